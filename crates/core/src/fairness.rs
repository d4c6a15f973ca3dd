//! Fair order of work across tenants (docs/ARCHITECTURE.md "Fairness across tenants").
//!
//! A [`FairQueue`] holds the work a service has taken from a shared consumer and not started,
//! in one FIFO lane per tenant (and a [`Lane::Shared`] lane for work whose tenant is not known),
//! and hands it out by weighted round robin: each lane with work in turn gives up to its weight
//! of items (a deficit round robin where every item costs one), then goes to the back of the
//! ring. Within a lane, items leave in the order they came. The total is bounded: a full queue
//! refuses more (the caller stops taking from the broker until items leave).
//!
//! Pure: no clock, no I/O; the async shell (kedge-runtime's fair feed) decides when to push,
//! pop, and keep its deliveries alive.

use std::collections::{BTreeMap, HashMap, VecDeque};

use crate::ids::TenantId;

/// Which lane a piece of work waits in.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lane {
    /// Work of a tenant (its run's `run.created` names it, or the task's subject).
    Tenant(TenantId),
    /// Work whose tenant could not be resolved: one lane shared by all of it, with weight 1.
    Shared,
}

/// Which of its two lanes to the broker a service sends an item's work on (docs/ARCHITECTURE.md
/// "Fairness across tenants"), from what its tenant holds when the item is taken from its lane
/// ([`FairQueue::pop`], [`FairQueue::pop_light`]): its other items waiting behind it, or handed
/// out before it and not finished ([`InFlight`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// Fewer than [`BACKLOG_FROM`] other items of its own: a tenant keeping up, whose next
    /// operations must not queue behind anyone's backlog.
    Light,
    /// A backlog of its own: the lane every backlog shares.
    Shared,
}

/// Items held (waiting or in flight) from which a tenant has a backlog.
pub const BACKLOG_FROM: usize = 8;

impl Pace {
    /// The pace of an item whose tenant holds `own` other items.
    pub fn of(own: usize) -> Pace {
        if own < BACKLOG_FROM {
            Pace::Light
        } else {
            Pace::Shared
        }
    }
}

/// The items of each lane handed out and not finished yet (the shell says when one ends).
#[derive(Debug, Default)]
pub struct InFlight {
    by_lane: HashMap<Lane, usize>,
}

impl InFlight {
    /// An item of `lane` was handed out; returns how many of the lane were in flight before it.
    pub fn start(&mut self, lane: &Lane) -> usize {
        let n = self.by_lane.entry(lane.clone()).or_insert(0);
        *n += 1;
        *n - 1
    }

    /// An item of `lane` handed out has finished (a lane with none left is forgotten).
    pub fn end(&mut self, lane: &Lane) {
        if let Some(n) = self.by_lane.get_mut(lane) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.by_lane.remove(lane);
            }
        }
    }

    /// How many items of `lane` are in flight.
    pub fn of(&self, lane: &Lane) -> usize {
        self.by_lane.get(lane).copied().unwrap_or(0)
    }

    /// How many items of every lane are in flight.
    pub fn total(&self) -> usize {
        self.by_lane.values().sum()
    }

    /// Counts an item of `lane` just taken from a queue as in flight, and tells its pace:
    /// `behind` items of its lane are left in the queue.
    pub fn take(&mut self, lane: &Lane, behind: usize) -> Pace {
        let before = self.start(lane);
        Pace::of(behind + before)
    }
}

/// Per-tenant weights (`fairness.weights`): a tenant of weight `w` gets up to `w` items per
/// turn; a tenant not named has weight 1. The shared lane always has weight 1.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Weights {
    by_tenant: BTreeMap<TenantId, u32>,
}

/// The largest weight a tenant may be given: a weight is how many items one turn hands out in
/// a row, so a huge one would be the unfairness this prevents.
pub const MAX_WEIGHT: u32 = 1000;

impl Weights {
    /// The weights given; each must be in `1..=MAX_WEIGHT`.
    pub fn new(by_tenant: BTreeMap<TenantId, u32>) -> Result<Self, String> {
        if let Some((tenant, w)) = by_tenant.iter().find(|(_, w)| **w == 0 || **w > MAX_WEIGHT) {
            return Err(format!(
                "tenant `{tenant}` has weight {w}; a weight is 1 to {MAX_WEIGHT}"
            ));
        }
        Ok(Self { by_tenant })
    }

    /// The weight of `lane` (1 unless configured).
    pub fn of(&self, lane: &Lane) -> u32 {
        match lane {
            Lane::Tenant(t) => self.by_tenant.get(t).copied().unwrap_or(1),
            Lane::Shared => 1,
        }
    }
}

/// One lane's waiting items and what is left of its current turn.
#[derive(Debug)]
struct LaneQueue<T> {
    items: VecDeque<T>,
    /// Items the lane may still hand out in its current turn (0: its turn starts afresh).
    credit: u32,
}

/// Bounded per-lane FIFO queues handed out by weighted round robin (the module's docs).
#[derive(Debug)]
pub struct FairQueue<T> {
    lanes: HashMap<Lane, LaneQueue<T>>,
    /// The lanes with items, in turn order; the front one is handing out.
    ring: VecDeque<Lane>,
    weights: Weights,
    len: usize,
    capacity: usize,
}

impl<T> FairQueue<T> {
    /// An empty queue holding at most `capacity` items (at least 1).
    pub fn new(capacity: usize, weights: Weights) -> Self {
        Self {
            lanes: HashMap::new(),
            ring: VecDeque::new(),
            weights,
            len: 0,
            capacity: capacity.max(1),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether [`FairQueue::push`] would refuse.
    pub fn is_full(&self) -> bool {
        self.len >= self.capacity
    }

    /// How many items wait in `lane`.
    pub fn waiting(&self, lane: &Lane) -> usize {
        self.lanes.get(lane).map_or(0, |l| l.items.len())
    }

    /// Queues `item` at the back of `lane`; a lane that had nothing joins the back of the ring.
    /// A full queue hands the item back.
    pub fn push(&mut self, lane: Lane, item: T) -> Result<(), T> {
        if self.is_full() {
            return Err(item);
        }
        let queue = self.lanes.entry(lane.clone()).or_insert_with(|| LaneQueue {
            items: VecDeque::new(),
            credit: 0,
        });
        if queue.items.is_empty() {
            queue.credit = 0;
            self.ring.push_back(lane);
        }
        queue.items.push_back(item);
        self.len += 1;
        Ok(())
    }

    /// The next item in fair order, with its lane; `None` when empty.
    pub fn pop(&mut self) -> Option<(Lane, T)> {
        let (lane, item) = self.take_at(0)?;
        let weight = self.weights.of(&lane);
        // A lane still waiting spends one of its turn's credit; with none left it goes to the
        // back of the ring.
        if let Some(queue) = self.lanes.get_mut(&lane) {
            if queue.credit == 0 {
                queue.credit = weight;
            }
            queue.credit = queue.credit.saturating_sub(1);
            if queue.credit == 0 {
                self.ring.rotate_left(1);
            }
        }
        Some((lane, item))
    }

    /// The front item of the lane at position `at` of the ring; a lane it empties leaves the
    /// ring and forgets its turn (no credit is saved up).
    fn take_at(&mut self, at: usize) -> Option<(Lane, T)> {
        let lane = self.ring.get(at)?.clone();
        let queue = self.lanes.get_mut(&lane)?;
        let item = queue.items.pop_front()?;
        self.len -= 1;
        if queue.items.is_empty() {
            self.lanes.remove(&lane);
            self.ring.remove(at);
        }
        Some((lane, item))
    }

    /// The next item of the first lane, in turn order, whose item would be [`Pace::Light`] if
    /// taken now (its tenant holds fewer than [`BACKLOG_FROM`] others, waiting here or in
    /// `flying`), counted in `flying` as [`InFlight::take`] counts it: what a light lane's own
    /// taker takes ahead of the round robin. Taking it leaves every lane's turn as it was.
    /// `None` when no lane is light.
    pub fn pop_light(&mut self, flying: &mut InFlight) -> Option<(Lane, T)> {
        let light = self.ring.iter().position(|lane| {
            // Its tenant's others: those waiting behind it, and those in flight.
            let own = self.waiting(lane).saturating_sub(1) + flying.of(lane);
            Pace::of(own) == Pace::Light
        })?;
        let (lane, item) = self.take_at(light)?;
        flying.start(&lane);
        Some((lane, item))
    }

    /// Every waiting item, for the shell to look at (e.g. how long each has waited).
    pub fn items_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.lanes.values_mut().flat_map(|l| l.items.iter_mut())
    }

    /// Takes every waiting item out (a stop hands them back), in fair order.
    pub fn drain(&mut self) -> Vec<T> {
        let mut out = Vec::with_capacity(self.len);
        while let Some((_, item)) = self.pop() {
            out.push(item);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str) -> Lane {
        Lane::Tenant(name.parse().expect("tenant"))
    }

    fn weights(pairs: &[(&str, u32)]) -> Weights {
        Weights::new(
            pairs
                .iter()
                .map(|(n, w)| (n.parse().expect("tenant"), *w))
                .collect(),
        )
        .expect("valid weights")
    }

    fn order(q: &mut FairQueue<(char, u32)>) -> String {
        std::iter::from_fn(|| q.pop().map(|(_, (c, _))| c)).collect()
    }

    #[test]
    fn the_light_taker_takes_only_a_tenant_without_a_backlog_and_leaves_the_turns() {
        let (a, b, c) = (t("a"), t("b"), t("c"));
        let mut q = FairQueue::new(100, Weights::default());
        let mut flying = InFlight::default();
        // A backlog is never taken light.
        for i in 0..20 {
            q.push(a.clone(), ('a', i)).expect("room");
        }
        assert!(q.pop_light(&mut flying).is_none());
        // b's two behind a's backlog (turn order: a, then b) are taken ahead of a's.
        q.push(b.clone(), ('b', 0)).expect("room");
        q.push(b.clone(), ('b', 1)).expect("room");
        assert_eq!(q.pop_light(&mut flying), Some((b.clone(), ('b', 0))));
        assert_eq!(flying.of(&b), 1, "counted in flight");
        assert_eq!(q.pop_light(&mut flying), Some((b.clone(), ('b', 1))));
        assert_eq!(q.waiting(&b), 0);
        assert!(q.pop_light(&mut flying).is_none(), "a is not light");
        assert_eq!(q.len(), 20);
        // b's items in flight count as its own: with seven, an eighth held is a backlog.
        for _ in 0..5 {
            flying.start(&b);
        }
        q.push(b.clone(), ('b', 2)).expect("room");
        assert_eq!(q.pop_light(&mut flying), Some((b.clone(), ('b', 2))));
        q.push(b.clone(), ('b', 3)).expect("room");
        assert!(q.pop_light(&mut flying).is_none(), "b holds eight");
        // Another quiet tenant is found behind it; the round robin's turns are untouched.
        q.push(c.clone(), ('c', 0)).expect("room");
        assert_eq!(q.pop_light(&mut flying), Some((c.clone(), ('c', 0))));
        assert_eq!(order(&mut q), format!("ab{}", "a".repeat(19)));
    }

    #[test]
    fn a_tenant_is_light_while_it_holds_less_than_a_backlog() {
        assert_eq!(Pace::of(0), Pace::Light);
        assert_eq!(Pace::of(BACKLOG_FROM - 1), Pace::Light);
        assert_eq!(Pace::of(BACKLOG_FROM), Pace::Shared);
        assert_eq!(Pace::of(10_000), Pace::Shared);

        // What a service sees after each pop, as the fair feed counts: a burst's items go on
        // the shared lane, a trickle's beside it on the light one.
        let mut q = FairQueue::new(100, Weights::default());
        let mut flying = InFlight::default();
        let (a, b, c) = (t("a"), t("b"), t("c"));
        for i in 0..20 {
            q.push(a.clone(), i).expect("room");
        }
        q.push(b.clone(), 100).expect("room");
        let mut paces = Vec::new();
        while let Some((lane, _)) = q.pop() {
            let pace = flying.take(&lane, q.waiting(&lane));
            paces.push((lane.clone(), pace));
        }
        let of = |l: &Lane| {
            paces
                .iter()
                .filter(|(x, _)| x == l)
                .map(|(_, p)| *p)
                .collect::<Vec<_>>()
        };
        assert_eq!(of(&b), vec![Pace::Light], "b passes a's backlog");
        assert!(
            of(&a).iter().all(|p| *p == Pace::Shared),
            "a's burst shares"
        );
        // A tenant alone with a few items is light too (it stays beside whatever comes).
        for i in 0..3 {
            q.push(c.clone(), i).expect("room");
        }
        let mut flying = InFlight::default();
        while let Some((lane, _)) = q.pop() {
            assert_eq!(flying.take(&lane, q.waiting(&lane)), Pace::Light);
        }

        // Work in flight counts as much as work waiting, until it ends.
        let mut flying = InFlight::default();
        for _ in 0..BACKLOG_FROM {
            flying.start(&a);
        }
        assert_eq!(flying.total(), BACKLOG_FROM);
        assert_eq!(
            flying.take(&a, 0),
            Pace::Shared,
            "a's in flight are a backlog"
        );
        assert_eq!(flying.take(&b, 0), Pace::Light, "b's own are none");
        for _ in 0..3 {
            flying.end(&a);
        }
        assert_eq!(
            (flying.of(&a), flying.total()),
            (BACKLOG_FROM - 2, BACKLOG_FROM - 1)
        );
        assert_eq!(flying.take(&a, 0), Pace::Light, "a's backlog has gone");
        for _ in 0..100 {
            flying.end(&a);
        }
        assert_eq!(
            (flying.of(&a), flying.total()),
            (0, 1),
            "b's is still in flight"
        );
        assert_eq!(flying.start(&a), 0, "a lane with none left starts over");
    }

    #[test]
    fn one_tenant_is_first_in_first_out() {
        let mut q = FairQueue::new(100, Weights::default());
        for i in 0..10 {
            q.push(t("a"), i).expect("room");
        }
        let got: Vec<_> = std::iter::from_fn(|| q.pop().map(|(_, i)| i)).collect();
        assert_eq!(got, (0..10).collect::<Vec<_>>());
        assert!(q.is_empty());
        assert!(q.pop().is_none());
    }

    #[test]
    fn a_late_tenant_is_served_within_one_turn_of_a_backlog() {
        let mut q = FairQueue::new(10_000, Weights::default());
        for i in 0..1000 {
            q.push(t("a"), ('a', i)).expect("room");
        }
        // A's first item is out, then B arrives behind A's 999 others.
        assert_eq!(q.pop().map(|(_, (c, _))| c), Some('a'));
        q.push(t("b"), ('b', 0)).expect("room");
        // A's lane, alone in the ring, started its next turn; B joined behind it.
        assert_eq!(q.pop().map(|(_, (c, _))| c), Some('a'));
        assert_eq!(q.pop().map(|(_, (c, _))| c), Some('b'), "B's one run next");
        assert_eq!(q.len(), 998);
    }

    #[test]
    fn equal_tenants_alternate_and_keep_their_own_order() {
        let mut q = FairQueue::new(100, Weights::default());
        for i in 0..3 {
            q.push(t("a"), ('a', i)).expect("room");
        }
        for i in 0..3 {
            q.push(t("b"), ('b', i)).expect("room");
        }
        q.push(Lane::Shared, ('s', 0)).expect("room");
        let mut seen = Vec::new();
        while let Some((lane, item)) = q.pop() {
            seen.push((lane, item));
        }
        let letters: String = seen.iter().map(|(_, (c, _))| *c).collect();
        assert_eq!(letters, "absabab");
        for lane in [t("a"), t("b")] {
            let nums: Vec<u32> = seen
                .iter()
                .filter(|(l, _)| *l == lane)
                .map(|(_, (_, n))| *n)
                .collect();
            assert_eq!(nums, vec![0, 1, 2], "{lane:?} in arrival order");
        }
    }

    #[test]
    fn weights_give_that_many_items_per_turn() {
        let mut q = FairQueue::new(100, weights(&[("acme", 3)]));
        for i in 0..7 {
            q.push(t("acme"), ('A', i)).expect("room");
            q.push(t("b"), ('b', i)).expect("room");
        }
        assert_eq!(order(&mut q), "AAAbAAAbAbbbbb");
    }

    #[test]
    fn shares_over_a_long_backlog_follow_the_weights() {
        let mut q = FairQueue::new(10_000, weights(&[("x", 2), ("z", 5)]));
        for i in 0..2000 {
            for (c, lane) in [('x', t("x")), ('y', t("y")), ('z', t("z"))] {
                q.push(lane, (c, i)).expect("room");
            }
        }
        let first: Vec<char> = (0..800)
            .filter_map(|_| q.pop().map(|(_, (c, _))| c))
            .collect();
        let count = |c| first.iter().filter(|x| **x == c).count();
        assert_eq!((count('x'), count('y'), count('z')), (200, 100, 500));
    }

    #[test]
    fn an_emptied_lane_saves_no_credit() {
        let mut q = FairQueue::new(100, weights(&[("acme", 3)]));
        q.push(t("acme"), ('A', 0)).expect("room");
        q.push(t("b"), ('b', 0)).expect("room");
        q.push(t("b"), ('b', 1)).expect("room");
        assert_eq!(q.pop().map(|(_, (c, _))| c), Some('A'));
        // acme's lane emptied after one of its three: it rejoins at the back, with a new turn.
        for i in 1..5 {
            q.push(t("acme"), ('A', i)).expect("room");
        }
        assert_eq!(order(&mut q), "bAAAbA");
    }

    #[test]
    fn a_lane_that_refills_mid_turn_keeps_its_place() {
        let mut q = FairQueue::new(100, weights(&[("acme", 2)]));
        q.push(t("acme"), ('A', 0)).expect("room");
        q.push(t("acme"), ('A', 1)).expect("room");
        q.push(t("b"), ('b', 0)).expect("room");
        assert_eq!(q.pop().map(|(_, (c, _))| c), Some('A'));
        q.push(t("acme"), ('A', 2)).expect("room");
        assert_eq!(order(&mut q), "AbA");
    }

    #[test]
    fn the_total_is_bounded_and_a_refused_item_comes_back() {
        let mut q = FairQueue::new(3, Weights::default());
        for i in 0..3 {
            q.push(t("a"), i).expect("room");
        }
        assert!(q.is_full());
        assert_eq!(q.push(t("b"), 9), Err(9), "full, whatever the lane");
        assert_eq!(q.len(), 3);
        q.pop();
        assert!(!q.is_full());
        q.push(t("b"), 9).expect("room again");
        assert_eq!(q.waiting(&t("b")), 1);
        assert_eq!(q.waiting(&t("a")), 2);
        assert_eq!(FairQueue::<u8>::new(0, Weights::default()).capacity(), 1);
    }

    #[test]
    fn drain_takes_everything_and_nothing_is_lost_or_doubled() {
        let mut q = FairQueue::new(1000, weights(&[("a", 4)]));
        let mut pushed = Vec::new();
        for i in 0..300u32 {
            let lane = match i % 7 {
                0 => Lane::Shared,
                1 | 2 => t("b"),
                _ => t("a"),
            };
            q.push(lane, i).expect("room");
            pushed.push(i);
            if i % 5 == 0 {
                let (_, got) = q.pop().expect("an item");
                pushed.retain(|x| *x != got);
            }
        }
        for item in q.items_mut() {
            *item += 1000;
        }
        let mut rest = q.drain();
        rest.sort_unstable();
        let expected: Vec<u32> = pushed.iter().map(|x| x + 1000).collect();
        assert_eq!(rest, expected);
        assert!(q.is_empty());
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn weights_are_checked() {
        assert!(Weights::new([("a".parse().expect("t"), 0)].into()).is_err());
        assert!(Weights::new([("a".parse().expect("t"), MAX_WEIGHT + 1)].into()).is_err());
        let w = weights(&[("a", MAX_WEIGHT)]);
        assert_eq!(w.of(&t("a")), MAX_WEIGHT);
        assert_eq!(w.of(&t("other")), 1);
        assert_eq!(w.of(&Lane::Shared), 1);
    }
}
