//! The one bounded map for a process's in-memory memories of runs (folded states, what it
//! stored, whose leases it released, a run's tenant): two generations of half the bound each.
//! New and looked-up entries live in the young one; when it fills, it becomes the old one and
//! the previous old one is forgotten, and an entry found in the old one moves back to the young
//! one. So what a process uses is kept and what it stopped using goes, at O(1) per call, and a
//! burst of more runs than the bound forgets only the runs it stopped touching, never all of
//! them at once (docs/ARCHITECTURE.md "Fairness across tenants").

use std::collections::HashMap;
use std::hash::Hash;

/// A map of at most about `bound` entries, recently used ones kept (the module's docs).
#[derive(Debug)]
pub struct Bounded<K, V> {
    young: HashMap<K, V>,
    old: HashMap<K, V>,
    half: usize,
}

impl<K: Eq + Hash + Clone, V> Bounded<K, V> {
    /// An empty map keeping at most `bound` entries (at least 2).
    pub fn new(bound: usize) -> Self {
        Self {
            young: HashMap::new(),
            old: HashMap::new(),
            half: (bound / 2).max(1),
        }
    }

    /// Keeps `value` for `key`; returns what `key` held before.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let before = self.old.remove(&key);
        if self.young.len() >= self.half && !self.young.contains_key(&key) {
            self.old = std::mem::take(&mut self.young);
        }
        self.young.insert(key, value).or(before)
    }

    /// The value for `key`, now counted as used.
    pub fn get(&mut self, key: &K) -> Option<&V> {
        self.get_mut(key).map(|v| &*v)
    }

    /// The value for `key`, to change, now counted as used.
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        if !self.young.contains_key(key) {
            let value = self.old.remove(key)?;
            self.insert(key.clone(), value);
        }
        self.young.get_mut(key)
    }

    /// Takes the value for `key` out.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        self.young.remove(key).or_else(|| self.old.remove(key))
    }

    pub fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }

    pub fn is_empty(&self) -> bool {
        self.young.is_empty() && self.old.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_map_keeps_what_was_used_last_and_forgets_what_was_not() {
        let mut map = Bounded::new(4);
        for i in 0..4 {
            map.insert(i, i);
        }
        assert_eq!(map.len(), 4);
        // A key already there is replaced in place.
        assert_eq!(map.insert(2, 20), Some(2));
        assert_eq!(map.len(), 4);
        // 0 is used: it outlives 1, which is not.
        assert_eq!(map.get(&0), Some(&0));
        map.insert(8, 8);
        map.insert(9, 9);
        assert_eq!(map.get(&1), None);
        assert_eq!(map.get(&0), Some(&0));
        assert!(map.len() <= 4);
        assert_eq!(map.remove(&9), Some(9));
        assert_eq!(map.remove(&9), None);
    }

    #[test]
    fn a_long_burst_keeps_the_newest_entries() {
        // One entry evicted per insert, whichever the map yields first, kept the oldest and
        // evicted the newest at once (a cache of nothing the process was using).
        let mut map = Bounded::new(1_000);
        for k in 0..100_000u64 {
            map.insert(k, k);
        }
        assert!(map.len() <= 1_000);
        let newest = (99_500..100_000).filter(|k| map.get(k).is_some()).count();
        assert_eq!(newest, 500, "the last 500 inserted are all there");
        assert_eq!((0..90_000).filter(|k| map.get(k).is_some()).count(), 0);
    }
}
