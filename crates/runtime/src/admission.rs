//! Adaptive admission applied to a service's [`Workers`](crate::consumer::Workers): a task
//! measures the delay work meets — the process's scheduling lag and, with a [`Probe::Broker`],
//! the queueing on a round trip through the broker — and moves the handlers' limit by the rule
//! of [`kedge_core::admission`] (docs/ARCHITECTURE.md "Fairness across tenants").
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
    pub(crate) fn start(
        permits: &Arc<Semaphore>,
        max: usize,
        probe: Probe,
        service: &'static str,
    ) -> Arc<Self> {
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
            probe,
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

/// What the delay that moves the limit is measured on.
#[derive(Debug, Clone)]
pub enum Probe {
    /// The process's scheduling lag alone: how late a timer runs.
    Scheduling,
    /// The scheduling lag and the queueing on a round trip through the broker: a message the
    /// service sends itself on `subject` (after everything the process sent before it, and
    /// through the server's own queues), less the fastest such trip of the last half minute.
    /// When the broker is what is saturated, every handler's broker operations wait there, and
    /// this is the delay that grows.
    Broker {
        client: async_nats::Client,
        subject: String,
    },
}

/// The longest a probe's round trip is waited for.
const PROBE_WAIT: Duration = Duration::from_secs(1);
/// How long the fastest round trip is remembered (two windows of this: between 15 and 30 s).
const BASE_WINDOW: Duration = Duration::from_secs(15);

/// The fastest round trip of the last one or two [`BASE_WINDOW`]s.
struct Base {
    current: Option<Duration>,
    previous: Option<Duration>,
    since: Instant,
}

impl Base {
    fn new() -> Self {
        Self {
            current: None,
            previous: None,
            since: Instant::now(),
        }
    }

    /// Notes a round trip; returns how much longer it took than the fastest remembered.
    fn queueing(&mut self, rtt: Duration) -> Duration {
        if self.since.elapsed() >= BASE_WINDOW {
            self.previous = self.current.take();
            self.since = Instant::now();
        }
        self.current = Some(self.current.map_or(rtt, |c| c.min(rtt)));
        let base = match (self.current, self.previous) {
            (Some(c), Some(p)) => c.min(p),
            (Some(c), None) => c,
            (None, _) => rtt,
        };
        rtt.saturating_sub(base)
    }
}

/// A probe's subscription and what it last sent.
struct Trip {
    client: async_nats::Client,
    subject: String,
    replies: async_nats::Subscriber,
    /// A random prefix of this probe's payloads, so that nobody else's message on the subject
    /// (another process under the same worker id, a forger) ends a wait.
    nonce: String,
    sent: u64,
    base: Base,
}

impl Trip {
    async fn open(probe: Probe) -> Option<Self> {
        let Probe::Broker { client, subject } = probe else {
            return None;
        };
        match client.subscribe(subject.clone()).await {
            Ok(replies) => Some(Self {
                client,
                subject,
                replies,
                nonce: uuid::Uuid::new_v4().simple().to_string(),
                sent: 0,
                base: Base::new(),
            }),
            Err(e) => {
                tracing::warn!(%subject, error = %e, "admission probe not subscribed; measuring the scheduling lag alone");
                None
            }
        }
    }

    /// The queueing on one round trip (the whole wait when none came back in time).
    async fn queueing(&mut self) -> Duration {
        use futures::StreamExt as _;
        self.sent += 1;
        let tag = format!("{}.{}", self.nonce, self.sent);
        let asked = Instant::now();
        if self
            .client
            .publish(self.subject.clone(), tag.clone().into())
            .await
            .is_err()
        {
            return PROBE_WAIT;
        }
        let back = tokio::time::timeout(PROBE_WAIT, async {
            // A late answer to an earlier probe is skipped.
            while let Some(msg) = self.replies.next().await {
                if msg.payload.as_ref() == tag.as_bytes() {
                    return true;
                }
            }
            false
        })
        .await;
        match back {
            Ok(true) => self.base.queueing(asked.elapsed()),
            _ => PROBE_WAIT,
        }
    }
}

/// Samples the delay every [`TICK`] and decides every [`TICKS_PER_DECISION`] samples, until
/// the workers are gone or admission is stopped.
async fn control(
    permits: Weak<Semaphore>,
    admission: Weak<Admission>,
    mut rule: Limit,
    probe: Probe,
    service: &'static str,
) {
    let mut trip = Trip::open(probe).await;
    crate::metrics::admission_limit(service, rule.current());
    let mut delay = Duration::ZERO;
    let mut ticks = 0;
    loop {
        let asked = Instant::now();
        tokio::time::sleep(TICK).await;
        delay += asked.elapsed().saturating_sub(TICK);
        if let Some(trip) = trip.as_mut() {
            delay += trip.queueing().await;
        }
        ticks += 1;
        if ticks < TICKS_PER_DECISION {
            continue;
        }
        let (Some(permits), Some(admission)) = (permits.upgrade(), admission.upgrade()) else {
            return;
        };
        let mean = delay / ticks;
        (delay, ticks) = (Duration::ZERO, 0);
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
            crate::metrics::admission_limit(service, limit);
            tracing::debug!(
                service,
                limit,
                delay_us = mean.as_micros() as u64,
                busiest,
                "admission limit"
            );
        }
    }
}
