//! Adaptive admission applied to a service's [`Workers`](crate::consumer::Workers): a task
//! measures the process's scheduling lag and moves the handlers' limit by the rule of
//! [`kedge_core::admission`] (docs/ARCHITECTURE.md "Fairness across tenants").
//!
//! The limit is applied to the workers' semaphore itself: lowering it forgets free permits
//! (handlers in flight finish; their permits come back and are forgotten at the next
//! decision), raising it adds them back. The task holds the semaphore weakly and ends with it;
//! [`Admission::stop`] gives every permit back (a graceful stop waits for all of them).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use kedge_core::admission::Limit;
use tokio::sync::Semaphore;
use tokio::time::Instant;

/// How often the lag is sampled.
const TICK: Duration = Duration::from_millis(20);
/// Samples per decision (a decision every 100 ms).
const TICKS_PER_DECISION: u32 = 5;

/// The adaptive part of one service's workers.
#[derive(Debug)]
pub(crate) struct Admission {
    /// Permits taken out of the semaphore, and whether admission has stopped.
    held: Mutex<Held>,
    /// `held.count`, readable without the lock.
    held_count: AtomicUsize,
    /// The most handlers in use at once since the last decision.
    busiest: AtomicUsize,
    /// The limit now (for metrics and tests).
    limit: AtomicUsize,
}

#[derive(Debug, Default)]
struct Held {
    count: usize,
    stopped: bool,
}

impl Admission {
    /// Starts adapting the limit of `permits` (`max` of them), named `service` in logs.
    pub(crate) fn start(permits: &Arc<Semaphore>, max: usize, service: &'static str) -> Arc<Self> {
        let admission = Arc::new(Self {
            held: Mutex::new(Held::default()),
            held_count: AtomicUsize::new(0),
            busiest: AtomicUsize::new(0),
            limit: AtomicUsize::new(max),
        });
        tokio::spawn(control(
            Arc::downgrade(permits),
            Arc::downgrade(&admission),
            Limit::new(max),
            service,
        ));
        admission
    }

    /// Notes that a handler took a slot of `permits` (of `max`).
    pub(crate) fn taken(&self, permits: &Semaphore, max: usize) {
        self.busiest
            .fetch_max(self.in_use(permits, max), Ordering::Relaxed);
    }

    /// The handlers holding a slot of `permits` (of `max`).
    fn in_use(&self, permits: &Semaphore, max: usize) -> usize {
        max.saturating_sub(permits.available_permits())
            .saturating_sub(self.held_count.load(Ordering::Relaxed))
    }

    /// The limit now.
    pub(crate) fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Gives every held permit back and stops adapting.
    pub(crate) fn stop(&self, permits: &Semaphore) {
        if let Ok(mut held) = self.held.lock() {
            held.stopped = true;
            permits.add_permits(held.count);
            held.count = 0;
            self.held_count.store(0, Ordering::Relaxed);
        }
    }

    /// Holds `max - limit` permits out of `permits`, as far as free ones allow. False once
    /// stopped.
    fn apply(&self, permits: &Semaphore, max: usize, limit: usize) -> bool {
        let Ok(mut held) = self.held.lock() else {
            return false;
        };
        if held.stopped {
            return false;
        }
        let want = max.saturating_sub(limit);
        if held.count > want {
            permits.add_permits(held.count - want);
            held.count = want;
        } else if held.count < want {
            held.count += permits.forget_permits(want - held.count);
        }
        self.held_count.store(held.count, Ordering::Relaxed);
        self.limit.store(limit, Ordering::Relaxed);
        true
    }
}

/// Samples the lag every [`TICK`] and decides every [`TICKS_PER_DECISION`] samples, until the
/// workers are gone or admission is stopped.
async fn control(
    permits: Weak<Semaphore>,
    admission: Weak<Admission>,
    mut rule: Limit,
    service: &'static str,
) {
    let mut lag = Duration::ZERO;
    let mut ticks = 0;
    loop {
        let asked = Instant::now();
        tokio::time::sleep(TICK).await;
        lag += asked.elapsed().saturating_sub(TICK);
        ticks += 1;
        if ticks < TICKS_PER_DECISION {
            continue;
        }
        let (Some(permits), Some(admission)) = (permits.upgrade(), admission.upgrade()) else {
            return;
        };
        let mean = lag / ticks;
        (lag, ticks) = (Duration::ZERO, 0);
        let before = rule.current();
        // The handlers in use now count too: when none finished, none was started.
        let busiest = admission
            .busiest
            .swap(0, Ordering::Relaxed)
            .max(admission.in_use(&permits, rule.max()));
        let limit = rule.observe(mean, busiest);
        if !admission.apply(&permits, rule.max(), limit) {
            return;
        }
        if limit != before {
            tracing::debug!(
                service,
                limit,
                lag_us = mean.as_micros() as u64,
                busiest,
                "admission limit"
            );
        }
    }
}
