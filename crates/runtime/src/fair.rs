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
//! - Opened with [`FairFeed::open`], the deliveries come over the process's light lane
//!   ([`crate::Runtime::light_lane`]) and are read on its threads, and a light taker
//!   ([`FairFeed::take_light`]) hands the deliveries of a tenant without a backlog to slots of
//!   its own, ahead of the round robin: none of a quiet tenant's steps waits in the connection,
//!   the threads or the slots another tenant's backlog fills.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{AckKind, Message};
use kedge_core::fairness::{BACKLOG_FROM, FairQueue, InFlight, Lane, Pace, Weights};
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
        let held = match self.shared.in_flight.lock() {
            Ok(mut flying) => {
                flying.end(&self.lane);
                flying.of(&self.lane)
            }
            Err(_) => return,
        };
        if held < BACKLOG_FROM {
            // Its lane's next delivery may be light now.
            self.shared.light_ready.notify_one();
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
    /// Signalled when a delivery the light taker may take is queued, or a lane's work in
    /// flight ends ([`FairFeed::take_light`]).
    light_ready: Notify,
    ended: std::sync::atomic::AtomicBool,
}

/// The fair feed of one consumer (the module's docs).
pub struct FairFeed {
    shared: Arc<Shared>,
    consumer: Durable,
    stop: watch::Sender<bool>,
    reader: tokio::task::JoinHandle<Sources>,
    /// The light takers' loops ([`FairFeed::take_light`]), ended by the stop.
    light: Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for FairFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FairFeed")
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

/// Messages a fair feed asks for per pull request (at most its window). The client asks again
/// once half a batch is taken, one request at a time, so a backlog is read at about half a
/// batch per round trip, and another tenant's task stored behind a burst waits until the feed
/// has read through it to be queued in its own lane: with the client's default (200), such a
/// task's p99 from submit to `run.created` was 44–76 ms behind 10,000 tasks, with 1,000 16–22
/// ms (docs/ARCHITECTURE.md "Fairness across tenants").
pub const PULL_BATCH: usize = 1_000;

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
        Self::start_many(
            vec![messages],
            |_| false,
            window,
            weights,
            tenancy,
            ack_wait,
        )
    }

    /// [`FairFeed::start`] over several consumers' deliveries, passing over (acknowledging as
    /// they are read) those `passed_over` says ([`FairFeed::open_many`]).
    pub fn start_many(
        sources: Vec<Deliveries>,
        passed_over: fn(&Message) -> bool,
        window: usize,
        weights: Weights,
        tenancy: Tenancy,
        ack_wait: Duration,
    ) -> Self {
        let reading = Reading {
            tenancy,
            passed_over,
            settle: None,
            ack_wait,
        };
        Self::start_on(None, sources, window, weights, reading)
    }

    /// Opens the deliveries of `consumer` and starts their feed ([`FairFeed::start`]), each in
    /// the lane `tenancy` finds (given the runtime the feed reads with). With a light lane
    /// ([`crate::Runtime::light_lane`]) the deliveries come over its connection and are read on
    /// its threads: they do not wait behind the replies to a backlog's operations on the first
    /// connection, nor their reader behind the backlog's tasks (docs/ARCHITECTURE.md "Fairness
    /// across tenants"). They are still settled over `rt`'s connection, where the acks of a
    /// backlog's work go out together with its other writes (from the light lane's idle
    /// connection each would be a write of its own to the broker).
    pub async fn open(
        rt: &crate::Runtime,
        consumer: Durable,
        ack_wait: Duration,
        window: usize,
        tenancy: impl FnOnce(&crate::Runtime) -> Tenancy,
    ) -> Result<Self, crate::RuntimeError> {
        Self::open_many(rt, &[consumer], |_| false, ack_wait, window, tenancy).await
    }

    /// [`FairFeed::open`] over the deliveries of several `consumers` (of one service, with the
    /// same ack wait) taken into one window, each delivery in the lane of its tenant whichever
    /// consumer it came from. A delivery `passed_over` says the service has no work in is
    /// acknowledged as it is read, and neither queued nor handed out: the step's consumer of
    /// inputs has one wildcard filter subject and so also delivers inputs that do not wake a
    /// run (docs/ARCHITECTURE.md "The broker's cost per run").
    pub async fn open_many(
        rt: &crate::Runtime,
        consumers: &[Durable],
        passed_over: fn(&Message) -> bool,
        ack_wait: Duration,
        window: usize,
        tenancy: impl FnOnce(&crate::Runtime) -> Tenancy,
    ) -> Result<Self, crate::RuntimeError> {
        let feeder = rt.light_lane().await?.unwrap_or_else(|| rt.clone());
        let batch = PULL_BATCH.min(window);
        let mut sources = Vec::with_capacity(consumers.len());
        for &consumer in consumers {
            let js = feeder.js.clone();
            let open =
                async move { Deliveries::open_batched(&js, consumer, ack_wait, batch).await };
            let messages = match feeder.executor() {
                Some(on) => on.spawn(open).await.map_err(|e| {
                    crate::RuntimeError::broker(format!("consumer {consumer}"), e)
                })??,
                None => open.await?,
            };
            sources.push(messages);
        }
        let reading = Reading {
            tenancy: tenancy(&feeder),
            passed_over,
            settle: Some(rt.js.clone()),
            ack_wait,
        };
        Ok(Self::start_on(
            feeder.executor(),
            sources,
            window,
            rt.config.fairness.weights(),
            reading,
        ))
    }

    /// [`FairFeed::start`], reading on `on`'s threads (else the caller's runtime) as `reading`
    /// says.
    fn start_on(
        on: Option<&tokio::runtime::Handle>,
        sources: Vec<Deliveries>,
        window: usize,
        weights: Weights,
        reading: Reading,
    ) -> Self {
        let shared = Arc::new(Shared {
            queue: Mutex::new(FairQueue::new(window, weights)),
            in_flight: Mutex::default(),
            ready: Notify::new(),
            room: Notify::new(),
            light_ready: Notify::new(),
            ended: std::sync::atomic::AtomicBool::new(false),
        });
        let (stop, stopped) = watch::channel(false);
        let consumer = sources.first().map_or(Durable::Intake, Deliveries::name);
        let reading = read(
            Sources::of(sources),
            consumer,
            shared.clone(),
            reading,
            stopped,
        );
        let reader = match on {
            Some(on) => on.spawn(reading),
            None => tokio::spawn(reading),
        };
        Self {
            shared,
            consumer,
            stop,
            reader,
            light: Mutex::default(),
        }
    }

    /// Starts the feed's light taker on `on` (the light lane's threads,
    /// [`crate::Runtime::executor`]): it takes, ahead of the round robin, each delivery whose
    /// pace is light ([`FairQueue::pop_light`]) as soon as one of `workers` (the light lane's
    /// own slots, [`light_workers`]) is free, and gives it to `take` with its slot (which picks
    /// the light lane with [`lane`], as for any [`Pace::Light`] delivery). What it
    /// does not take (its slots all busy) the round robin of [`FairFeed::next`] hands out, with
    /// the same pace. Stops with [`FairFeed::hand_back`]; the caller drains `workers` after it.
    pub fn take_light<F, Fut>(&self, on: &tokio::runtime::Handle, workers: Workers, mut take: F)
    where
        F: FnMut(Slot, Message) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let mut taker = LightTaker {
            shared: self.shared.clone(),
            stopped: self.stop.subscribe(),
        };
        let taking = on.spawn(async move {
            while let Some((slot, msg)) = taker.next(&workers).await {
                take(slot, msg).await;
            }
        });
        if let Ok(mut light) = self.light.lock() {
            light.push(taking);
        }
    }

    /// How many deliveries wait in the window now (read, not yet handed out).
    pub fn waiting(&self) -> usize {
        self.shared.queue.lock().map_or(0, |q| q.len())
    }

    /// The next delivery in fair order, with a free slot of `workers` to handle it (taken first,
    /// like [`Workers::next`]) and its [`Pace`]: light when its tenant has no backlog here
    /// (fewer than [`BACKLOG_FROM`] other deliveries waiting in the window or handled now,
    /// counted until their slots are freed), which tells the lane its work goes out on
    /// ([`lane`]). Cancel-safe (for `select!`). `None` once the consumer's stream has ended and
    /// the window is empty.
    pub async fn next(&self, workers: &Workers) -> Option<(Slot, Message, Pace)> {
        let slot = workers.slot().await;
        loop {
            let ready = self.shared.ready.notified();
            tokio::pin!(ready);
            ready.as_mut().enable();
            let popped = self.shared.queue.lock().ok().and_then(|mut q| {
                q.pop()
                    .map(|(lane, waiting)| (q.waiting(&lane), lane, waiting))
            });
            if let Some((behind, lane, waiting)) = popped {
                self.shared.room.notify_one();
                let pace = match self.shared.in_flight.lock() {
                    Ok(mut flying) => flying.take(&lane, behind),
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

    /// Stops taking deliveries (the light takers end first) and hands back (NAK, no delay) what
    /// the client pulled and what waits in the window, so another process takes it at once
    /// (bounded like [`Deliveries::hand_back`]). Returns how many were handed back.
    pub async fn hand_back(self) -> usize {
        let _ = self.stop.send(true);
        let takers = match self.light.lock() {
            Ok(mut light) => std::mem::take(&mut *light),
            Err(_) => Vec::new(),
        };
        for taker in takers {
            let _ = taker.await;
        }
        let mut handed = match self.reader.await {
            // The stream is dropped inside before any NAK (a handed-back delivery cannot come
            // back here).
            Ok(sources) => {
                let mut handed = 0;
                for messages in sources.all {
                    handed += messages.hand_back().await;
                }
                handed
            }
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

/// The light lane's own slots for a service of `concurrency` handlers
/// ([`FairFeed::take_light`]): a quarter as many, at least [`BACKLOG_FROM`].
pub fn light_workers(concurrency: usize) -> Workers {
    Workers::new((concurrency / 4).max(BACKLOG_FROM))
}

/// The light taker of a feed ([`FairFeed::take_light`]).
struct LightTaker {
    shared: Arc<Shared>,
    stopped: watch::Receiver<bool>,
}

impl LightTaker {
    /// The next light delivery, with a free slot of `workers`; `None` once the feed stops or
    /// its consumer's stream has ended.
    async fn next(&mut self, workers: &Workers) -> Option<(Slot, Message)> {
        let slot = tokio::select! {
            slot = workers.slot() => slot,
            _ = self.stopped.wait_for(|stop| *stop) => return None,
        };
        loop {
            let ready = self.shared.light_ready.notified();
            tokio::pin!(ready);
            ready.as_mut().enable();
            if *self.stopped.borrow()
                || self.shared.ended.load(std::sync::atomic::Ordering::Acquire)
            {
                return None;
            }
            let popped = self.shared.queue.lock().ok().and_then(|mut q| {
                let mut flying = self.shared.in_flight.lock().ok()?;
                q.pop_light(&mut flying)
            });
            if let Some((lane, waiting)) = popped {
                self.shared.room.notify_one();
                let held = LaneHeld {
                    shared: self.shared.clone(),
                    lane,
                };
                return Some((slot.holding(held), waiting.msg));
            }
            tokio::select! {
                _ = ready => {}
                _ = self.stopped.wait_for(|stop| *stop) => return None,
            }
        }
    }
}

/// The consumers a feed reads, and which of them is asked first next time.
struct Sources {
    all: Vec<Deliveries>,
    /// Index in `all` of the one asked first next time (always below its length).
    first: usize,
}

impl Sources {
    fn of(all: Vec<Deliveries>) -> Self {
        Self { all, first: 0 }
    }

    /// The next delivery of any of them: whichever has one first, the first asked taking turns
    /// (so a consumer with a backlog does not keep the other's deliveries waiting: the step's
    /// inputs do not hold back new runs). Cancel-safe like [`Deliveries::next`]. `None` once
    /// one of their streams has ended (its consumer was deleted), as for a feed of one.
    async fn next(&mut self) -> Option<Message> {
        let first = self.first;
        match self.all.as_mut_slice() {
            [] => None,
            [one] => one.next().await,
            many => {
                self.first = (first + 1) % many.len();
                let mut nexts: Vec<_> = many.iter_mut().map(|d| Box::pin(d.next())).collect();
                nexts.rotate_left(first);
                futures::future::select_all(nexts).await.0
            }
        }
    }
}

/// What the reader of a feed does with a delivery: finds its lane, passes it over, settles it
/// over `settle` (else the connection it came on), keeps it alive by the ack wait.
struct Reading {
    tenancy: Tenancy,
    passed_over: fn(&Message) -> bool,
    settle: Option<async_nats::jetstream::Context>,
    ack_wait: Duration,
}

/// The feed's reader: takes deliveries into the window while it has room, keeps those waiting
/// long alive; returns the sources when told to stop. `consumer` names the feed in its logs
/// (its first consumer's name).
async fn read(
    mut messages: Sources,
    consumer: Durable,
    shared: Arc<Shared>,
    reading: Reading,
    mut stopped: watch::Receiver<bool>,
) -> Sources {
    let Reading {
        tenancy,
        passed_over,
        settle,
        ack_wait,
    } = reading;
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
                Some(mut msg) => {
                    if let Some(js) = &settle {
                        msg.context = js.clone();
                    }
                    if passed_over(&msg) {
                        // Nothing to do: a lost ack only brings it back to be passed over.
                        if let Err(e) = msg.ack().await {
                            tracing::debug!(%consumer, error = %e, "could not acknowledge a delivery passed over; it is redelivered after the ack wait");
                        }
                        continue;
                    }
                    let lane = tenancy.lane(&msg).await;
                    let waiting = Waiting { msg, since: Instant::now() };
                    match push(&shared, lane, waiting) {
                        Ok(light) => {
                            shared.ready.notify_one();
                            if light {
                                shared.light_ready.notify_one();
                            }
                        }
                        // Not reached (room was checked and only this task pushes); handed
                        // back rather than held.
                        Err(w) => {
                            let _ = w.msg.ack_with(AckKind::Nak(None)).await;
                        }
                    }
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

/// Queues `waiting` in `lane`; returns whether the light taker may want it (its tenant held
/// fewer than [`BACKLOG_FROM`] deliveries here), or hands it back when the window is full.
fn push(shared: &Shared, lane: Lane, waiting: Waiting) -> Result<bool, Box<Waiting>> {
    let Ok(mut queue) = shared.queue.lock() else {
        return Err(Box::new(waiting));
    };
    let flying = shared.in_flight.lock().map_or(0, |f| f.of(&lane));
    let own = queue.waiting(&lane) + flying;
    queue.push(lane, waiting).map_err(Box::new)?;
    Ok(own < BACKLOG_FROM)
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
