//! A consumer's deliveries handed to the service's workers in fair order across tenants
//! (docs/ARCHITECTURE.md "Fairness across tenants").
//!
//! A [`FairFeed`] takes a window of deliveries ahead from the durable consumer (far more than
//! the service runs at once), queues each in its tenant's lane of a
//! [`kedge_core::fairness::FairQueue`] and hands them out by weighted round robin, so one
//! tenant's backlog does not hold back another tenant's next piece of work. What it does not
//! change: every delivery is still settled once, by its handler, exactly as before; the
//! consumer's redelivery, `max_deliver` and dead letters are untouched.
//!
//! - A delivery waiting in the window longer than a third of the consumer's ack wait is told
//!   to the server as in progress (`AckKind::Progress`), so it is not redelivered meanwhile.
//! - The window is bounded ([`FairFeed::start`]'s `window`); the consumer's `max_ack_pending`
//!   bounds it too (deliveries waiting here count as pending).
//! - On a stop, [`FairFeed::hand_back`] hands back (NAK, no delay) what the client pulled and
//!   what waits in the window: another process takes it at once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{AckKind, Message};
use kedge_core::fairness::{FairQueue, InFlight, Lane, Pace, Weights};
use kedge_core::subjects::{self, Durable};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::consumer::{Deliveries, Slot, Workers};
use crate::tenants::RunTenants;

/// How a delivery's tenant is found.
#[derive(Debug, Clone)]
pub enum Tenancy {
    /// A task: the tenant is its subject's (`agent.task.<agent>.<tenant>`; none: the default
    /// tenant). The server routes a tenant's tasks to its subject (docs/SECURITY.md).
    Task,
    /// A journal event: its run's tenant ([`RunTenants`]).
    Run(Box<RunTenants>),
}

impl Tenancy {
    async fn lane(&self, msg: &Message) -> Lane {
        match self {
            Tenancy::Task => match subjects::parse_task(&msg.subject) {
                Ok(task) => Lane::Tenant(task.tenant),
                // A subject intake will reject: still handled (and answered), in the shared
                // lane.
                Err(_) => Lane::Shared,
            },
            Tenancy::Run(tenants) => tenants.lane(msg).await,
        }
    }
}

/// What a delivery's work goes out on: `light` (the process's light lane, when it has one:
/// [`crate::Runtime::light_lane`]) for a [`Pace::Light`] delivery, else `shared` (the
/// connection and threads everyone else uses); counted in [`crate::metrics::LANE_WORK`]
/// (docs/ARCHITECTURE.md "Fairness across tenants").
pub fn lane<'a, T>(consumer: Durable, pace: Pace, shared: &'a T, light: Option<&'a T>) -> &'a T {
    let picked = match (pace, light) {
        (Pace::Light, Some(light)) => Some(light),
        (Pace::Light | Pace::Shared, _) => None,
    };
    crate::metrics::lane_work(consumer, picked.is_some());
    picked.unwrap_or(shared)
}

/// A delivery of `lane` handed to a handler, counted in flight until its slot is freed.
struct LaneHeld {
    shared: Arc<Shared>,
    lane: Lane,
}

impl std::fmt::Debug for LaneHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaneHeld")
            .field("lane", &self.lane)
            .finish_non_exhaustive()
    }
}

impl Drop for LaneHeld {
    fn drop(&mut self) {
        if let Ok(mut flying) = self.shared.in_flight.lock() {
            flying.end(&self.lane);
        }
    }
}

/// A delivery waiting in the window, and when the server last heard of it.
struct Waiting {
    msg: Message,
    since: Instant,
}

struct Shared {
    queue: Mutex<FairQueue<Waiting>>,
    /// Each lane's deliveries handed to handlers that have not ended ([`LaneHeld`]).
    in_flight: Mutex<InFlight>,
    /// Signalled when a delivery is queued or the consumer's stream ended.
    ready: Notify,
    /// Signalled when a delivery leaves the window.
    room: Notify,
    ended: std::sync::atomic::AtomicBool,
}

/// The fair feed of one consumer (the module's docs).
pub struct FairFeed {
    shared: Arc<Shared>,
    consumer: Durable,
    stop: watch::Sender<bool>,
    reader: tokio::task::JoinHandle<Deliveries>,
}

impl std::fmt::Debug for FairFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FairFeed")
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

/// The default window of a consumer: deliveries taken ahead of its handlers.
pub fn window(concurrency: usize, max_ack_pending: usize) -> usize {
    // Far more than the handlers run at once, and room left under max_ack_pending for those
    // the handlers hold.
    (concurrency.saturating_mul(64))
        .max(16_384)
        .min(max_ack_pending.saturating_sub(concurrency).max(1))
}

impl FairFeed {
    /// Starts taking `messages` (of a consumer whose ack wait is `ack_wait`) into a window of
    /// at most `window` deliveries, each in the lane `tenancy` finds for it.
    pub fn start(
        messages: Deliveries,
        window: usize,
        weights: Weights,
        tenancy: Tenancy,
        ack_wait: Duration,
    ) -> Self {
        let shared = Arc::new(Shared {
            queue: Mutex::new(FairQueue::new(window, weights)),
            in_flight: Mutex::default(),
            ready: Notify::new(),
            room: Notify::new(),
            ended: std::sync::atomic::AtomicBool::new(false),
        });
        let (stop, stopped) = watch::channel(false);
        let consumer = messages.name();
        let reader = tokio::spawn(read(messages, shared.clone(), tenancy, ack_wait, stopped));
        Self {
            shared,
            consumer,
            stop,
            reader,
        }
    }

    /// The next delivery in fair order, with a free slot of `workers` to handle it (taken first,
    /// like [`Workers::next`]) and its [`Pace`]: light when its tenant has no backlog here
    /// while others have one (deliveries waiting in the window or handled now, counted until
    /// their slots are freed), which tells the lane its work goes out on ([`lane`]). Cancel-safe (for
    /// `select!`). `None` once the consumer's stream has ended and the window is empty.
    pub async fn next(&self, workers: &Workers) -> Option<(Slot, Message, Pace)> {
        let slot = workers.slot().await;
        loop {
            let ready = self.shared.ready.notified();
            tokio::pin!(ready);
            ready.as_mut().enable();
            let popped = self.shared.queue.lock().ok().and_then(|mut q| {
                q.pop()
                    .map(|(lane, waiting)| (q.waiting(&lane), q.len(), lane, waiting))
            });
            if let Some((behind, left, lane, waiting)) = popped {
                self.shared.room.notify_one();
                let pace = match self.shared.in_flight.lock() {
                    Ok(mut flying) => flying.take(&lane, behind, left),
                    Err(_) => Pace::Shared,
                };
                let held = LaneHeld {
                    shared: self.shared.clone(),
                    lane,
                };
                return Some((slot.holding(held), waiting.msg, pace));
            }
            if self.shared.ended.load(std::sync::atomic::Ordering::Acquire) {
                return None;
            }
            ready.await;
        }
    }

    /// Stops taking deliveries and hands back (NAK, no delay) what the client pulled and what
    /// waits in the window, so another process takes it at once (bounded like
    /// [`Deliveries::hand_back`]). Returns how many were handed back.
    pub async fn hand_back(self) -> usize {
        let _ = self.stop.send(true);
        let mut handed = match self.reader.await {
            // The stream is dropped inside before any NAK (a handed-back delivery cannot come
            // back here).
            Ok(messages) => messages.hand_back().await,
            Err(_) => 0,
        };
        let waiting = match self.shared.queue.lock() {
            Ok(mut q) => q.drain(),
            Err(_) => Vec::new(),
        };
        let consumer = self.consumer;
        for w in waiting {
            match w.msg.ack_with(AckKind::Nak(None)).await {
                Ok(()) => handed += 1,
                Err(e) => {
                    tracing::debug!(%consumer, error = %e, "could not hand a queued delivery back; it is redelivered after the ack wait");
                }
            }
        }
        handed
    }
}

/// The feed's reader: takes deliveries into the window while it has room, keeps those waiting
/// long alive; returns the stream when told to stop.
async fn read(
    mut messages: Deliveries,
    shared: Arc<Shared>,
    tenancy: Tenancy,
    ack_wait: Duration,
    mut stopped: watch::Receiver<bool>,
) -> Deliveries {
    let consumer = messages.name();
    let keep_alive_after = ack_wait / 3;
    let mut tick = tokio::time::interval((ack_wait / 6).max(Duration::from_millis(100)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let room = async {
            loop {
                let room = shared.room.notified();
                tokio::pin!(room);
                room.as_mut().enable();
                if shared.queue.lock().is_ok_and(|q| !q.is_full()) {
                    return;
                }
                room.await;
            }
        };
        let next = async {
            room.await;
            messages.next().await
        };
        tokio::select! {
            _ = stopped.changed() => break,
            _ = tick.tick() => keep_alive(&shared, consumer, keep_alive_after).await,
            msg = next => match msg {
                Some(msg) => {
                    let lane = tenancy.lane(&msg).await;
                    let waiting = Waiting { msg, since: Instant::now() };
                    let refused = shared.queue.lock().ok().and_then(|mut q| q.push(lane, waiting).err());
                    if let Some(w) = refused {
                        // Not reached (room was checked and only this task pushes); handed
                        // back rather than held.
                        let _ = w.msg.ack_with(AckKind::Nak(None)).await;
                    }
                    shared.ready.notify_one();
                }
                None => {
                    shared.ended.store(true, std::sync::atomic::Ordering::Release);
                    shared.ready.notify_one();
                    // Nothing more comes; wait for the stop, keeping the window alive.
                    loop {
                        tokio::select! {
                            _ = stopped.changed() => break,
                            _ = tick.tick() => keep_alive(&shared, consumer, keep_alive_after).await,
                        }
                    }
                    break;
                }
            },
        }
    }
    messages
}

/// Tells the server that the deliveries waiting longer than `after` are in progress.
async fn keep_alive(shared: &Shared, consumer: Durable, after: Duration) {
    let now = Instant::now();
    let due: Vec<Message> = match shared.queue.lock() {
        Ok(mut q) => q
            .items_mut()
            .filter(|w| now.duration_since(w.since) >= after)
            .map(|w| {
                w.since = now;
                w.msg.clone()
            })
            .collect(),
        Err(_) => return,
    };
    if due.is_empty() {
        return;
    }
    tracing::debug!(%consumer, waiting = due.len(), "keeping queued deliveries in progress");
    for msg in due {
        if let Err(e) = msg.ack_with(AckKind::Progress).await {
            tracing::debug!(%consumer, error = %e, "in-progress ack failed; the delivery may be redelivered (absorbed like any redelivery)");
        }
    }
}
