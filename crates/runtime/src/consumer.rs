//! Durable pull consumers, configured from `nats/consumers/<STREAM>/<name>.json` (the form
//! `nats consumer add --config` takes), embedded in the binary. The ack wait comes from the
//! checked [`kedge_core::config::Timeouts`], so the file and the timeout relations cannot
//! disagree.
//!
//! Redelivery is bounded: a consumer whose file sets `max_deliver` hands a message back with a
//! growing delay ([`retry_delay`]) and, on its last delivery ([`is_last_delivery`]), gives up on
//! it with [`crate::rejections::dead_letter`]: a record on `agent.rejected.dead.<consumer>` (stream
//! `KEDGE_REJECTIONS`, 30 days; `nats stream view KEDGE_REJECTIONS --subject
//! 'agent.rejected.dead.>'`), an error log line, and a `Term`. Never a silent loop.

use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::{PullConsumer, pull};

use kedge_core::subjects::Durable;

use crate::RuntimeError;
pub use crate::admission::Probe;

/// The configuration file of each of the layout's durable consumers (their names and streams
/// are in the registry, [`Durable`]).
const FILES: &[(Durable, &str)] = &[
    (
        Durable::Intake,
        include_str!("../../../nats/consumers/KEDGE_TASKS/intake.json"),
    ),
    (
        Durable::Step,
        include_str!("../../../nats/consumers/KEDGE_RUNS/step.json"),
    ),
    (
        Durable::StepCreated,
        include_str!("../../../nats/consumers/KEDGE_RUNS/step-created.json"),
    ),
    (
        Durable::Tool,
        include_str!("../../../nats/consumers/KEDGE_RUNS/tool.json"),
    ),
    (
        Durable::Projector,
        include_str!("../../../nats/consumers/KEDGE_RUNS/projector.json"),
    ),
    (
        Durable::Timer,
        include_str!("../../../nats/consumers/KEDGE_RUNS/timer.json"),
    ),
    (
        Durable::TimerFired,
        include_str!("../../../nats/consumers/KEDGE_TIMERS/timer-fired.json"),
    ),
];

/// The parsed configuration of a named consumer, with `ack_wait` set.
pub fn config(durable: Durable, ack_wait: Duration) -> Result<pull::Config, RuntimeError> {
    let (stream, name) = (durable.stream(), durable.name());
    let (_, text) = FILES
        .iter()
        .find(|(d, _)| *d == durable)
        .ok_or_else(|| RuntimeError::broker(format!("consumer {name}"), "no such consumer file"))?;
    let mut config: pull::Config = serde_json::from_str(text)
        .map_err(|e| RuntimeError::broker(format!("nats/consumers/{stream}/{name}.json"), e))?;
    config.ack_wait = ack_wait;
    Ok(config)
}

/// Gets or creates the durable consumer `name`; an existing one is updated to the file's
/// configuration (consumers hold no data, so updating is safe).
pub async fn durable(
    js: &Context,
    name: Durable,
    ack_wait: Duration,
) -> Result<PullConsumer, RuntimeError> {
    let config = config(name, ack_wait)?;
    let stream = name.stream();
    let stream_handle = js
        .get_stream(stream)
        .await
        .map_err(|e| RuntimeError::broker(format!("stream {stream}"), e))?;
    let consumer = stream_handle
        .create_consumer(config)
        .await
        .map_err(|e| RuntimeError::broker(format!("consumer {stream}/{name}"), e))?;
    crate::metrics::watch_consumer(name, &consumer);
    crate::health::consumer_bound(name.name());
    Ok(consumer)
}

/// How long a pull request of a service's consumer waits at the server; an idle consumer asks
/// again this often, and a request the server lost without a word is asked again after this
/// and 5 s more (the client's own rule).
const PULL_EXPIRES: Duration = Duration::from_secs(10);
/// Messages a service's consumer asks for per pull request (the client's default).
pub const PULL_BATCH: usize = 200;
/// The server's sign of life on an idle pull request (below half of `PULL_EXPIRES`, as the
/// server requires).
const PULL_HEARTBEAT: Duration = Duration::from_secs(3);
/// The first wait before a pull stream is opened again after a request was not served; doubled
/// per failure in a row, at most `REOPEN_CAP`.
const REOPEN_FIRST: Duration = Duration::from_millis(100);
const REOPEN_CAP: Duration = Duration::from_secs(2);
/// The most messages taken from a closing stream's buffer.
const DRAIN_AT_MOST: usize = 10_000;

/// A durable consumer's deliveries, as a service takes them.
///
/// The client's pull stream keeps one pull request open at the server. When a request is not
/// served — no server answers for the consumer yet (a new cluster still electing its leader,
/// a node coming back), the server falls silent on it (no idle heartbeat for twice its
/// interval: the request was lost in a consumer leader change or a partition), or answers it
/// with a status the client does not know — the client does not ask again until the request's
/// expiry passes plus 5 s, however many deliveries wait: a service would take nothing for
/// that long.
/// So such a stream is closed (what the client already holds is kept and handed out first)
/// and opened again after a short, growing delay (docs/ARCHITECTURE.md "Conventions every
/// service keeps").
pub struct Deliveries {
    consumer: PullConsumer,
    name: Durable,
    /// Messages asked for per pull request ([`PULL_BATCH`] unless [`Deliveries::batched`]).
    batch: usize,
    stream: Option<pull::Stream>,
    /// Taken from a stream closed to be opened again; handed out before anything new.
    buffered: std::collections::VecDeque<async_nats::jetstream::Message>,
    /// When the stream may be opened again.
    reopen_at: Option<tokio::time::Instant>,
    /// Requests not served since the last delivery.
    failures: u32,
}

impl std::fmt::Debug for Deliveries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deliveries")
            .field("consumer", &self.name)
            .field("open", &self.stream.is_some())
            .field("buffered", &self.buffered.len())
            .field("failures", &self.failures)
            .finish_non_exhaustive()
    }
}

impl Deliveries {
    /// Gets or creates the durable consumer `name` ([`durable`]) and opens its deliveries.
    pub async fn open(
        js: &Context,
        name: Durable,
        ack_wait: Duration,
    ) -> Result<Self, RuntimeError> {
        Self::open_batched(js, name, ack_wait, PULL_BATCH).await
    }

    /// [`Deliveries::open`] with `batch` messages per pull request ([`Deliveries::batched`]).
    pub async fn open_batched(
        js: &Context,
        name: Durable,
        ack_wait: Duration,
        batch: usize,
    ) -> Result<Self, RuntimeError> {
        let consumer = durable(js, name, ack_wait).await?;
        Self::batched(consumer, name, batch).await
    }

    /// The deliveries of `consumer`, reported as `name`'s.
    pub async fn of(consumer: PullConsumer, name: Durable) -> Result<Self, RuntimeError> {
        Self::batched(consumer, name, PULL_BATCH).await
    }

    /// [`Deliveries::of`], asking for `batch` messages per pull request (at least 1). The
    /// client asks again once half of a batch is taken, one request at a time, so a backlog is
    /// read at about half a batch per round trip: a fair feed reads far ahead with a larger
    /// one ([`crate::fair::PULL_BATCH`]).
    pub async fn batched(
        consumer: PullConsumer,
        name: Durable,
        batch: usize,
    ) -> Result<Self, RuntimeError> {
        let batch = batch.max(1);
        let stream = pull_stream(&consumer, batch)
            .await
            .map_err(|e| RuntimeError::broker(format!("consumer {name}"), e))?;
        Ok(Self {
            consumer,
            name,
            batch,
            stream: Some(stream),
            buffered: std::collections::VecDeque::new(),
            reopen_at: None,
            failures: 0,
        })
    }

    /// The consumer's name.
    pub fn name(&self) -> Durable {
        self.name
    }

    /// The next delivery. Hiccups (a missed heartbeat, a reconnect) are logged and skipped; a
    /// request the server could not serve opens the stream again (the type's docs). `None`
    /// once the stream has ended (the consumer was deleted). Cancel-safe (for `select!`).
    pub async fn next(&mut self) -> Option<async_nats::jetstream::Message> {
        use async_nats::jetstream::consumer::pull::MessagesErrorKind;
        use futures::StreamExt as _;
        let consumer = self.name;
        loop {
            if let Some(msg) = self.buffered.pop_front() {
                return Some(self.delivered(msg));
            }
            let Some(stream) = self.stream.as_mut() else {
                if let Some(at) = self.reopen_at {
                    tokio::time::sleep_until(at).await;
                }
                match pull_stream(&self.consumer, self.batch).await {
                    Ok(stream) => {
                        self.stream = Some(stream);
                        self.reopen_at = None;
                    }
                    Err(e) => {
                        tracing::warn!(%consumer, error = %e, "could not open the consumer's deliveries; trying again");
                        self.failed();
                    }
                }
                continue;
            };
            match stream.next().await {
                Some(Ok(msg)) => return Some(self.delivered(msg)),
                Some(Err(e)) => match e.kind() {
                    MessagesErrorKind::NoResponders
                    | MessagesErrorKind::MissingHeartbeat
                    | MessagesErrorKind::Other => {
                        tracing::warn!(%consumer, error = %e, "a pull request was not served; asking again");
                        self.close_for_reopen();
                    }
                    // A request not sent (the connection is down: the client asks again once
                    // it is back), or the end of the stream (the consumer is gone; `None`
                    // follows).
                    _ => tracing::warn!(%consumer, error = %e, "consumer hiccup"),
                },
                None => return None,
            }
        }
    }

    fn delivered(&mut self, msg: async_nats::jetstream::Message) -> async_nats::jetstream::Message {
        self.failures = 0;
        crate::metrics::delivered(self.name, deliveries(&msg));
        msg
    }

    /// Closes the stream, keeping what its client holds, and sets when to open it again.
    fn close_for_reopen(&mut self) {
        use futures::{FutureExt as _, StreamExt as _};
        if let Some(mut stream) = self.stream.take() {
            for _ in 0..DRAIN_AT_MOST {
                match stream.next().now_or_never() {
                    Some(Some(Ok(msg))) => self.buffered.push_back(msg),
                    Some(Some(Err(_))) => {}
                    Some(None) | None => break,
                }
            }
        }
        self.failed();
    }

    fn failed(&mut self) {
        self.failures = self.failures.saturating_add(1);
        let delay = retry_delay(i64::from(self.failures), REOPEN_FIRST, REOPEN_CAP);
        self.reopen_at = Some(tokio::time::Instant::now() + delay);
    }

    /// On a graceful stop, hands back at once what was pulled and not handed out: the client
    /// pulls in batches ([`PULL_BATCH`] messages per request, or the feed's), so a stopping
    /// process may hold wakes or operation requests no handler took. Each is NAKed without
    /// delay, so another process gets it now instead of after the ack wait (30 s for the step,
    /// 90 s for the tool).
    ///
    /// The buffered messages are taken first and the stream (with its subscription, so its
    /// open pull request finds no interest) is dropped before any NAK: a handed-back message
    /// cannot be delivered to this process again and bounce here, burning the consumer's
    /// `max_deliver`. Bounded by `HAND_BACK_FOR`. Returns how many messages were handed back.
    pub async fn hand_back(self) -> usize {
        use futures::StreamExt as _;
        let consumer = self.name;
        let mut pulled: Vec<_> = self.buffered.into_iter().collect();
        if let Some(mut messages) = self.stream {
            let until = tokio::time::Instant::now() + HAND_BACK_FOR;
            loop {
                let quiet = HAND_BACK_QUIET
                    .min(until.saturating_duration_since(tokio::time::Instant::now()));
                match tokio::time::timeout(quiet, messages.next()).await {
                    Ok(Some(Ok(msg))) => pulled.push(msg),
                    Ok(Some(Err(_))) => {}
                    Ok(None) | Err(_) => break,
                }
            }
        }
        let mut handed = 0;
        for msg in pulled {
            match msg
                .ack_with(async_nats::jetstream::AckKind::Nak(None))
                .await
            {
                Ok(()) => handed += 1,
                Err(e) => {
                    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or_default();
                    tracing::debug!(%consumer, seq, error = %e, "could not hand a message back; it is redelivered after the ack wait");
                }
            }
        }
        if handed > 0 {
            tracing::info!(
                %consumer,
                handed,
                "handed back the messages pulled and not started"
            );
        }
        handed
    }
}

/// A pull stream of a service's consumer: `batch` messages per request, `PULL_EXPIRES`,
/// `PULL_HEARTBEAT`.
async fn pull_stream(
    consumer: &PullConsumer,
    batch: usize,
) -> Result<pull::Stream, async_nats::jetstream::consumer::StreamError> {
    consumer
        .stream()
        .max_messages_per_batch(batch)
        .expires(PULL_EXPIRES)
        .heartbeat(PULL_HEARTBEAT)
        .messages()
        .await
}

/// The `max_deliver` of consumer `name`'s file; `None` when unbounded (or unknown). The files
/// are parsed once (this is asked on every delivery).
pub fn max_deliver(name: Durable) -> Option<i64> {
    static MAX_DELIVER: std::sync::OnceLock<Vec<(Durable, Option<i64>)>> =
        std::sync::OnceLock::new();
    let all = MAX_DELIVER.get_or_init(|| {
        Durable::ALL
            .into_iter()
            .map(|name| {
                let max = config(name, Duration::from_secs(1))
                    .ok()
                    .and_then(|c| (c.max_deliver > 0).then_some(c.max_deliver));
                (name, max)
            })
            .collect()
    });
    all.iter()
        .find(|(n, _)| *n == name)
        .and_then(|(_, max)| *max)
}

/// The `max_ack_pending` of consumer `name`'s file (deliveries the server lets it hold
/// unacknowledged: what bounds a fair feed's window, [`crate::fair`]); 1000 when the file does
/// not say.
pub fn max_ack_pending(name: Durable) -> usize {
    config(name, Duration::from_secs(1))
        .ok()
        .and_then(|c| usize::try_from(c.max_ack_pending).ok())
        .filter(|n| *n > 0)
        .unwrap_or(1000)
}

/// How many times the server delivered `msg` (1 the first time; 1 if it does not say).
pub fn deliveries(msg: &async_nats::jetstream::Message) -> i64 {
    msg.info().map(|i| i.delivered).unwrap_or(1).max(1)
}

/// Whether this is the last delivery consumer `name` makes of `msg` (its `max_deliver`).
pub fn is_last_delivery(name: Durable, msg: &async_nats::jetstream::Message) -> bool {
    max_deliver(name).is_some_and(|max| deliveries(msg) >= max)
}

/// The delay before the next delivery after the `delivered`-th: `base` doubled per delivery,
/// at most `cap`.
pub fn retry_delay(delivered: i64, base: Duration, cap: Duration) -> Duration {
    let doublings = u32::try_from(delivered.saturating_sub(1).clamp(0, 20)).unwrap_or(20);
    base.saturating_mul(1u32 << doublings).min(cap)
}

/// The redelivery delays of a failure: `base` after the first delivery, doubled per delivery up
/// to `cap` ([`retry_delay`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
}

impl Backoff {
    /// 1 s doubling up to `max` (the configured longest redelivery delay,
    /// `timeouts.max_retry_delay`, or less).
    pub fn within(max: Duration) -> Self {
        Self {
            base: Duration::from_secs(1).min(max),
            cap: max,
        }
    }
}

/// What a consumer's handler decided about one delivery: the one vocabulary every consumer
/// settles its messages with ([`settle`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Done with it.
    Ack,
    /// Not a failure (not due yet, driven elsewhere): handed back, due again after the delay.
    /// At the consumer's last delivery it is acked and dropped, with a warning: only a handler
    /// whose message another path covers (the reconciler, the journal) may answer this.
    Later(Duration),
    /// Failed for the reason: handed back after a delay growing per delivery; at the
    /// consumer's last delivery, given up on as a dead letter.
    Retry(String, Backoff),
    /// Never worth another delivery: a dead letter now.
    Poison(String),
}

/// Acks, hands back or gives up on `msg` as `verdict` says: never a silent loop (every
/// consumer's `max_deliver` is bounded, and what it gives up on is a dead letter).
pub async fn settle(
    js: &Context,
    consumer: Durable,
    msg: &async_nats::jetstream::Message,
    verdict: Verdict,
) {
    let delivered = deliveries(msg);
    let last = is_last_delivery(consumer, msg);
    let kind = match verdict {
        Verdict::Ack => async_nats::jetstream::AckKind::Ack,
        Verdict::Later(_) if last => {
            tracing::warn!(%consumer, subject = %msg.subject, delivered, "not done at its last delivery; dropped (another path covers it)");
            async_nats::jetstream::AckKind::Ack
        }
        Verdict::Later(delay) => async_nats::jetstream::AckKind::Nak(Some(delay)),
        Verdict::Retry(reason, _) if last => {
            return crate::rejections::dead_letter(js, consumer, msg, &reason).await;
        }
        Verdict::Retry(reason, backoff) => {
            let delay = retry_delay(delivered, backoff.base, backoff.cap);
            tracing::warn!(%consumer, subject = %msg.subject, delivered, %reason, retry_in_ms = delay.as_millis() as u64, "will retry");
            async_nats::jetstream::AckKind::Nak(Some(delay))
        }
        Verdict::Poison(reason) => {
            return crate::rejections::dead_letter(js, consumer, msg, &reason).await;
        }
    };
    match kind {
        // Confirmed beside the handler: its slot is free at once, also while the broker does
        // not answer.
        async_nats::jetstream::AckKind::Nak(_) => {
            tokio::spawn(hand_back_confirmed(consumer, msg.clone(), kind));
        }
        _ => {
            // A lost ack costs a redelivery after the ack wait, which every handler takes as
            // done (the journal says so): not worth a round trip on every delivery.
            if let Err(e) = msg.ack_with(kind).await {
                tracing::warn!(%consumer, subject = %msg.subject, error = %e, "ack failed; the message will be redelivered");
            }
        }
    }
}

/// How long the server's confirmation of a hand-back is waited for, per try.
const CONFIRM_WAIT: Duration = Duration::from_secs(2);
/// Tries of a hand-back before it is left to the ack wait.
const CONFIRM_TRIES: u32 = 3;

/// Hands `msg` back (`kind`, a NAK) and waits for the server to confirm it, trying again
/// when it does not. An unconfirmed NAK may have been lost on its way (a consumer leader
/// change, a route not yet back after a partition): the message would wait for the whole ack
/// wait (30 s for a step's wake, 90 s for an operation) instead of its delay, and with it the
/// run. A NAK of a delivery that is no longer pending changes nothing at the server, so a
/// repeated one is harmless.
async fn hand_back_confirmed(
    consumer: Durable,
    msg: async_nats::jetstream::Message,
    kind: async_nats::jetstream::AckKind,
) {
    for attempt in 1..=CONFIRM_TRIES {
        let error = match tokio::time::timeout(CONFIRM_WAIT, msg.double_ack_with(kind)).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no confirmation".to_owned(),
        };
        if attempt == CONFIRM_TRIES {
            tracing::warn!(%consumer, subject = %msg.subject, %error, "hand-back not confirmed; the message comes back after the ack wait");
        } else {
            tracing::debug!(%consumer, subject = %msg.subject, %error, attempt, "hand-back not confirmed; sending it again");
            tokio::time::sleep(Duration::from_millis(200) * attempt).await;
        }
    }
}

/// How long [`Deliveries::hand_back`] waits for one more message before it deems the
/// consumer's buffer empty.
const HAND_BACK_QUIET: Duration = Duration::from_millis(50);
/// The most time [`Deliveries::hand_back`] spends.
const HAND_BACK_FOR: Duration = Duration::from_secs(2);

/// Runs handlers with at most `n` at once (fewer while the process is short of CPU, when
/// [`Workers::adaptive`]); [`Workers::drain`] waits for those in flight (a service's graceful
/// stop).
#[derive(Debug, Clone)]
pub struct Workers {
    permits: std::sync::Arc<tokio::sync::Semaphore>,
    n: u32,
    admission: Option<std::sync::Arc<crate::admission::Admission>>,
}

/// A reserved handler slot of [`Workers`] (freed when the handler it is given to ends).
#[derive(Debug)]
pub struct Slot {
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// What else lives as long as the handler (the fair feed's count of its tenant's work in
    /// flight, [`crate::fair::FairFeed::next`]).
    _held: Option<Box<dyn std::fmt::Debug + Send + Sync>>,
}

impl Slot {
    /// The slot, keeping `held` until the handler it is given to ends.
    pub(crate) fn holding(self, held: impl std::fmt::Debug + Send + Sync + 'static) -> Slot {
        Slot {
            _held: Some(Box::new(held)),
            ..self
        }
    }
}

impl Workers {
    /// At most `n` handlers at once, always.
    pub fn new(n: usize) -> Self {
        let n = u32::try_from(n.max(1)).unwrap_or(u32::MAX);
        Self {
            permits: std::sync::Arc::new(tokio::sync::Semaphore::new(n as usize)),
            n,
            admission: None,
        }
    }

    /// At most `n` handlers at once, fewer while the work meets delays of its own making
    /// (adaptive admission, docs/ARCHITECTURE.md "Fairness across tenants") measured by
    /// `probe`; none: `n` always. `service` names them in logs. Must be called inside a Tokio
    /// runtime.
    pub fn adaptive(n: usize, probe: Option<Probe>, service: &'static str) -> Self {
        let mut workers = Self::new(n);
        if let Some(probe) = probe {
            workers.admission = Some(crate::admission::Admission::start(
                &workers.permits,
                workers.n as usize,
                probe,
                service,
            ));
        }
        workers
    }

    /// How many handlers may run at once now.
    pub fn limit(&self) -> usize {
        self.admission
            .as_ref()
            .map_or(self.n as usize, |a| a.limit())
    }

    /// Waits for a free slot and runs `task` on it.
    pub async fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let slot = self.slot().await;
        self.run(slot, task);
    }

    /// Waits for a free slot. Cancel-safe.
    pub async fn slot(&self) -> Slot {
        let permit = self.permits.clone().acquire_owned().await.ok();
        if let Some(admission) = &self.admission {
            admission.taken(&self.permits, self.n as usize);
        }
        Slot {
            _permit: permit,
            _held: None,
        }
    }

    /// Runs `task` on `slot`, which it frees when it ends.
    ///
    /// The task is boxed before it is spawned: a service's handler is a large future (a tool
    /// operation's ~27 KB, a step drive's ~17 KB in a release build), and a future is moved by
    /// copying all of it, so wrapping it unboxed (then moving the wrapper into the runtime's
    /// task) copied it twice per message; boxed, it is copied once and the wrapper holds a
    /// pointer.
    pub fn run(&self, slot: Slot, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.run_on(None, slot, task);
    }

    /// [`Workers::run`] on `executor`'s threads (a light lane's, [`crate::Runtime::executor`]),
    /// or the caller's Tokio runtime when `None`.
    pub fn run_on(
        &self,
        executor: Option<&tokio::runtime::Handle>,
        slot: Slot,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let task = Box::pin(async move {
            task.await;
            drop(slot);
        });
        match executor {
            Some(executor) => drop(executor.spawn(task)),
            None => drop(tokio::spawn(task)),
        }
    }

    /// The consumer's next message together with a free slot to handle it. The slot is taken
    /// first, so no message is ever held waiting for one: on a graceful stop, what was pulled
    /// and not started is with `deliveries`, for [`Deliveries::hand_back`]. Cancel-safe (for
    /// `select!`). `None` once the stream has ended.
    pub async fn next(
        &self,
        deliveries: &mut Deliveries,
    ) -> Option<(Slot, async_nats::jetstream::Message)> {
        let slot = self.slot().await;
        let msg = deliveries.next().await?;
        Some((slot, msg))
    }

    /// Waits until every running handler has finished.
    pub async fn drain(&self) {
        if let Some(admission) = &self.admission {
            admission.stop(&self.permits);
        }
        let _ = self.permits.acquire_many(self.n).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_consumers_deliver_every_wake() {
        use kedge_core::event::{EventKind, EventType};
        let step = config(Durable::Step, Duration::from_secs(30)).expect("parses");
        let created = config(Durable::StepCreated, Duration::from_secs(30)).expect("parses");
        assert_eq!(step.filter_subjects, vec!["agent.run.*.i.>".to_owned()]);
        assert_eq!(
            created.filter_subjects,
            vec![kedge_core::subjects::event_all_runs(EventType::RunCreated)]
        );
        // Every type that wakes the step is on one of the two; of the inputs, only the start
        // of a tool attempt and a failed attempt to be retried do not wake it.
        for t in EventType::ALL {
            let delivered = *t == EventType::RunCreated || t.kind() == EventKind::Input;
            assert!(
                delivered || !t.wakes_step(),
                "{t} wakes the step: deliver it"
            );
        }
        let passed_over: Vec<_> = EventType::ALL
            .iter()
            .filter(|t| t.kind() == EventKind::Input && !t.wakes_step())
            .collect();
        assert_eq!(
            passed_over,
            [&EventType::ToolStarted, &EventType::ToolAttempt],
            "a new input type must wake the step (or be passed over here)"
        );
    }

    #[test]
    fn every_journal_consumer_has_one_filter_subject() {
        // nats-server (2.14–2.15) walks the journal's whole subject index under the stream's
        // lock each time a consumer with several filter subjects passes a filled block with
        // nothing left for it: with ~300,000 subjects (30,000 runs) the stream stopped storing
        // for ~170 ms about once a second (docs/ARCHITECTURE.md "The broker's cost per run").
        // (A consumer of a whole stream has none, which takes the same path.)
        for name in Durable::ALL {
            let c = config(name, Duration::from_secs(30)).expect("parses");
            let filters = c.filter_subjects.len() + usize::from(!c.filter_subject.is_empty());
            assert!(filters <= 1, "{name}: {filters} filter subjects");
        }
    }

    #[test]
    fn redelivery_backs_off_and_is_bounded_where_it_must_be() {
        let base = Duration::from_secs(1);
        let cap = Duration::from_secs(30);
        assert_eq!(retry_delay(1, base, cap), base);
        assert_eq!(retry_delay(3, base, cap), Duration::from_secs(4));
        assert_eq!(retry_delay(60, base, cap), cap);
        assert_eq!(retry_delay(-5, base, cap), base);
        // Every consumer's handler gives up on the last delivery: every one has a bound.
        for name in Durable::ALL {
            assert!(max_deliver(name).is_some_and(|m| m > 1), "{name}");
            let c = config(name, Duration::from_secs(1)).expect("parses");
            assert_eq!(max_deliver(name), Some(c.max_deliver), "{name}: the file's");
        }
    }

    #[test]
    fn the_projector_can_hold_what_its_resting_runs_gather() {
        // A resting run holds its decisions unacknowledged for the interval, so the bound caps
        // what the projector follows at about `max_ack_pending / interval` decisions a second.
        // At 1,000 that was 4,000 a second, below what one busy node stores (an agent loop of
        // 64 runs makes ~5,800), and the list fell behind without end.
        let c = config(Durable::Projector, Duration::from_secs(30)).expect("parses");
        let interval_s = crate::config::Config::default()
            .bridge
            .runs_list_interval_ms as f64
            / 1e3;
        let followed = c.max_ack_pending as f64 / interval_s;
        assert!(
            followed >= 40_000.0,
            "the projector follows at most {followed:.0} decisions/s"
        );
    }

    #[test]
    fn every_consumer_file_parses() {
        assert_eq!(FILES.len(), Durable::ALL.len(), "one file per durable");
        for name in Durable::ALL {
            let c = config(name, Duration::from_secs(7)).expect("parses");
            assert_eq!(c.durable_name.as_deref(), Some(name.name()));
            assert_eq!(c.ack_wait, Duration::from_secs(7));
        }
    }
}
