//! The one rule for a process's bounded in-memory memories of runs (folded states, what it
//! stored, whose leases it released): when full, one entry makes room for a new one. Starting
//! over instead forgets every run at once, and a burst of more runs than the bound then pays
//! for all of them again on every step (docs/ARCHITECTURE.md "Fairness across tenants").

use std::collections::HashMap;
use std::hash::Hash;

/// Inserts `value` for `key` into `map`, which holds at most `cap` entries: a new key in a full
/// map first evicts another (whichever the map yields first). Returns what `key` held before.
pub fn insert<K: Eq + Hash + Clone, V>(
    map: &mut HashMap<K, V>,
    key: K,
    value: V,
    cap: usize,
) -> Option<V> {
    if map.len() >= cap
        && !map.contains_key(&key)
        && let Some(evicted) = map.keys().next().cloned()
    {
        map.remove(&evicted);
    }
    map.insert(key, value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_map_makes_room_for_one_new_key_and_keeps_the_rest() {
        let mut map = HashMap::new();
        for i in 0..4 {
            insert(&mut map, i, i, 4);
        }
        assert_eq!(map.len(), 4);
        // A key already there is replaced in place: nothing is evicted.
        assert_eq!(insert(&mut map, 2, 20, 4), Some(2));
        assert_eq!(map.len(), 4);
        // A new key evicts exactly one other.
        assert_eq!(insert(&mut map, 9, 9, 4), None);
        assert_eq!(map.len(), 4);
        assert_eq!(map.get(&9), Some(&9));
        assert_eq!((0..4).filter(|k| map.contains_key(k)).count(), 3);
        // Below the bound nothing is evicted.
        let mut small = HashMap::new();
        insert(&mut small, "a", 1, 4);
        insert(&mut small, "b", 2, 4);
        assert_eq!(small.len(), 2);
    }
}
