//! Adaptive admission: how many handlers a service runs at once while its process is short of
//! CPU (docs/ARCHITECTURE.md "Fairness across tenants"). The rule is here, pure; the runtime
//! measures the lag and applies the limit (`kedge_runtime::consumer::Workers::adaptive`).
//!
//! The signal is the process's scheduling lag: how late a timer due every tick actually runs.
//! A handler that waits on a model or a tool costs no CPU and adds no lag, so a service whose
//! work waits on the outside world keeps its whole configured concurrency. When the machine is
//! saturated, lag grows, the limit comes down, and work waits in the service's fair queue,
//! where tenants take turns, instead of inside the process, where everything in flight shares
//! the CPU and one tenant's next step runs as slowly as another tenant's backlog.
//!
//! Decrease is multiplicative (a quarter off per interval over the target, down to a quarter of
//! the configured concurrency), increase additive (an eighth more) and only when the limit was
//! what held work back (every slot was in use): the limit settles where the work is busy but
//! not queueing.

use std::time::Duration;

/// The lowest limit the rule sets: a quarter of the configured concurrency, at least this (or
/// the configured concurrency, when lower).
pub const MIN_LIMIT: usize = 8;
/// The delay above which the limit comes down.
pub const TARGET_LAG: Duration = Duration::from_millis(8);

/// The adaptive limit of one service's handlers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    max: usize,
    min: usize,
    target: Duration,
    limit: usize,
}

impl Limit {
    /// A limit at most `max` (the configured concurrency, at least 1), starting there.
    pub fn new(max: usize) -> Self {
        let max = max.max(1);
        Self {
            max,
            min: (max / 4).max(MIN_LIMIT).min(max),
            target: TARGET_LAG,
            limit: max,
        }
    }

    /// The limit now.
    pub fn current(&self) -> usize {
        self.limit
    }

    /// The most handlers the limit lets run at once.
    pub fn max(&self) -> usize {
        self.max
    }

    /// One decision, at the end of an interval: `lag` is the interval's mean scheduling lag,
    /// `busiest` the most handlers in use at once during it. Returns the new limit.
    pub fn observe(&mut self, lag: Duration, busiest: usize) -> usize {
        if lag > self.target {
            self.limit = (self.limit - self.limit / 4).max(self.min);
        } else if lag <= self.target / 2 && busiest >= self.limit {
            self.limit = (self.limit + (self.limit / 8).max(1)).min(self.max);
        }
        self.limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CALM: Duration = Duration::from_millis(1);
    const LATE: Duration = Duration::from_millis(20);

    #[test]
    fn a_calm_process_keeps_its_whole_concurrency() {
        let mut l = Limit::new(256);
        for busiest in [0, 10, 256] {
            assert_eq!(l.observe(CALM, busiest), 256);
        }
        assert_eq!(l.observe(TARGET_LAG, 256), 256, "at the target: no change");
    }

    #[test]
    fn lag_brings_the_limit_down_by_quarters_to_the_floor() {
        let mut l = Limit::new(256);
        let seen: Vec<usize> = (0..4).map(|_| l.observe(LATE, 256)).collect();
        assert_eq!(seen, vec![192, 144, 108, 81]);
        for _ in 0..40 {
            l.observe(LATE, 0);
        }
        assert_eq!(l.current(), 64, "a quarter of the configured concurrency");
        let mut small = Limit::new(20);
        for _ in 0..40 {
            small.observe(LATE, 20);
        }
        assert_eq!(small.current(), MIN_LIMIT, "at least MIN_LIMIT");
        // A configured concurrency below MIN_LIMIT is the floor.
        let mut tiny = Limit::new(3);
        assert_eq!(tiny.observe(LATE, 3), 3);
        assert_eq!(Limit::new(0).max(), 1);
    }

    #[test]
    fn the_limit_grows_back_only_when_calm_and_it_held_work_back() {
        let mut l = Limit::new(64);
        for _ in 0..20 {
            l.observe(LATE, 64);
        }
        let floor = l.current();
        assert_eq!(floor, 16);
        // Calm, but not every slot in use: the limit is not what holds work back.
        assert_eq!(l.observe(CALM, floor - 1), floor);
        // Between half the target and the target: held.
        assert_eq!(l.observe(TARGET_LAG * 3 / 4, floor), floor);
        // Calm and full: an eighth more (at least one), up to the configured concurrency.
        assert_eq!(l.observe(CALM, floor), floor + 2);
        let mut last = l.current();
        while last < 64 {
            let next = l.observe(CALM, last);
            assert!(next > last && next <= 64);
            last = next;
        }
        assert_eq!(l.observe(CALM, 64), 64);
    }
}
