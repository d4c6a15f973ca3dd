//! The projector: the durable consumer that keeps `kedge_runs` up to date ([`run`]), one run
//! at a time, resting runs between passes (see the crate's doc).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::Message;
use kedge_core::EventType;
use kedge_core::bounded::Bounded;
use kedge_core::ids::RunId;
use kedge_core::subjects::{self, Durable};
use kedge_journal::Delivered;
use kedge_runtime::consumer::{Backoff, Verdict};
use kedge_runtime::{Runtime, RuntimeError, consumer, failpoint};
use tokio::sync::{mpsc, watch};

use super::Writer;
use super::summary::Folded;
use kedge_runtime::metrics::{self, ProjectorRead};
use kedge_runtime::projection::{Hint, Known};

/// The projector's durable consumer (`nats/consumers/KEDGE_RUNS/projector.json`).
pub const PROJECTOR: Durable = Durable::Projector;
/// Runs projected at once. Each is a journal read and a write, a few round trips mostly spent
/// waiting on the broker, and the loop takes a slot before it takes the next delivery (even one
/// that only joins a run being projected), so this bounds how fast the projector reads: at 64,
/// in a 10,000-run burst under load it fell 40,000 messages behind in the first burst and
/// 120,000 by the third (the list tens of seconds stale); at 256 it stays within a few
/// thousand, at no cost to the burst (docs/ARCHITECTURE.md "Scale with history"). The
/// consumer's `max_ack_pending` (20,000) bounds the deliveries held, those of resting runs
/// included. A resting run holds the decisions of one
/// `runs_list_interval_ms`, so the bound caps what the projector can follow at about
/// `max_ack_pending / runs_list_interval_ms` decisions a second: at 1,000 that was 4,000, less
/// than one busy node stores, and the list fell behind without end. The bound is also the
/// memory the held deliveries' payloads may take (docs/ARCHITECTURE.md "The bridge and the runs
/// projection").
const PROJECTING: usize = 256;

/// Runs the projector until `shutdown` resolves.
///
/// Deliveries are handled per run, `PROJECTING` runs at once: a delivery of a run already
/// being projected joins it (`Inbox`), and one read, fold and store covers every decision of
/// the run that arrived meanwhile (a backlog of a run's decisions, a burst of a live run). A
/// delivery is acknowledged only once a summary folded through it is stored (or found stored),
/// so a process killed midway leaves the rest to redelivery. At most one projection of a run is
/// in flight in a process; across processes, the compare-and-set decides.
///
/// A decision it cannot project (broker trouble, or a panic, which is contained) is handed back
/// with a growing delay; at the consumer's last delivery (`max_deliver` 20), and at once for a
/// run whose journal does not fold or a subject that is not a run's event, it is given up on
/// as a dead letter (`agent.rejected.dead.projector`, `kedge dead list`): the projection is a
/// cache, a later decision of the run or `kedge runs rebuild` brings the summary up to date.
pub async fn run(rt: Runtime, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
    let workers = consumer::Workers::new(PROJECTING);
    let (stop, stopping) = watch::channel(false);
    let projector = Arc::new(Projector {
        projection: Writer::open(&rt).await?,
        projected: Projected::default(),
        folds: Folds::default(),
        inbox: Inbox::default(),
        cap: rt.config.timeouts.max_retry_delay(),
        interval: Duration::from_millis(rt.config.bridge.runs_list_interval_ms),
        workers: workers.clone(),
        stopping,
    });
    let mut messages =
        consumer::Deliveries::open(&rt.js, PROJECTOR, Duration::from_secs(30)).await?;
    // Every handler and resting run holds a clone; all are gone once every delivery taken is
    // settled.
    let (held, mut all_settled) = mpsc::channel::<()>(1);
    tracing::info!(worker = %rt.config.worker_id, "projector started");
    tokio::pin!(shutdown);
    loop {
        let (slot, msg) = tokio::select! {
            _ = &mut shutdown => break,
            next = workers.next(&mut messages) => match next {
                Some(next) => next,
                None => break,
            },
        };
        let parsed = match (subjects::parse_event(&msg.subject), msg.info()) {
            (Some(parsed), Ok(info)) => Some((parsed.run_id, info.stream_sequence)),
            _ => None,
        };
        let Some((run, seq)) = parsed else {
            let projector = projector.clone();
            workers.run(slot, async move {
                let verdict = Verdict::Poison("not a journal event subject".into());
                projector.settle(&msg, &verdict).await;
            });
            continue;
        };
        if projector.projected.covers(&run, seq) {
            // Folded into a summary this process stored (or found stored) already.
            projector.settle(&msg, &Verdict::Ack).await;
            continue;
        }
        let created = is_run_created(&msg);
        if !projector.inbox.add(&run, msg) {
            // Joins the projection of the run in flight or resting; the slot is not needed.
            continue;
        }
        let projector = projector.clone();
        let held = held.clone();
        if created || projector.interval.is_zero() {
            // A new run is listed at once.
            workers.run(slot, async move { projector.project_run(run, held).await });
        } else {
            // A later decision rests first: the step service that journaled it writes the
            // run's summary itself, at once for a decision that leaves the run not busy, so
            // the pass after the rest usually finds it stored and reads nothing (projected at
            // once, it would race that write and often read the run's journal for nothing).
            drop(slot);
            tokio::spawn(projector.rest(run, held));
        }
    }
    messages.hand_back().await;
    // Resting runs are projected at once, with what they hold.
    let _ = stop.send(true);
    drop(held);
    let _ = all_settled.recv().await;
    workers.drain().await;
    // The last acknowledgements are on their way out only once flushed: dropped with the
    // connection, their deliveries would wait out the ack wait.
    if let Err(e) = rt.client.flush().await {
        tracing::warn!(error = %e, "could not flush the last acknowledgements");
    }
    tracing::info!("projector stopped");
    Ok(())
}

/// What the projector's handlers share.
#[derive(Debug)]
struct Projector {
    projection: Writer,
    projected: Projected,
    folds: Folds,
    inbox: Inbox,
    /// The longest delay before a redelivery.
    cap: Duration,
    /// How long a run rests after a projection before the next (`bridge.runs_list_interval_ms`).
    interval: Duration,
    workers: consumer::Workers,
    /// Set when the projector stops: resting runs are projected at once.
    stopping: watch::Receiver<bool>,
}

impl Projector {
    /// Projects `run` until no delivery of it is waiting: each pass takes every delivery that
    /// arrived since the last one and settles them all on one projection. After a pass the run
    /// rests for the interval ([`Projector::rest`]) holding no slot, still in the inbox, so the
    /// deliveries of a busy run gather there and the next pass covers them all: a run's summary
    /// is written at most once per interval, not once per decision. `held` is the run's share of
    /// the stop's wait (see [`run`]).
    async fn project_run(self: Arc<Self>, run: RunId, held: mpsc::Sender<()>) {
        use futures::FutureExt as _;
        while let Some(batch) = self.inbox.take(&run) {
            let handled = std::panic::AssertUnwindSafe(self.project(&run, &batch))
                .catch_unwind()
                .await;
            let verdict = handled.unwrap_or_else(|panic| {
                let reason = kedge_runtime::failpoint::panic_message(panic.as_ref());
                tracing::error!(run_id = %run, panic = %reason, "projecting panicked");
                Verdict::Retry(format!("panicked: {reason}"), self.backoff())
            });
            for msg in &batch {
                self.settle(msg, &verdict).await;
            }
            if !self.interval.is_zero() && !*self.stopping.borrow() {
                tokio::spawn(self.rest(run, held));
                return;
            }
        }
    }

    /// Lets `run` rest for the interval (cut short when the projector stops), then projects what
    /// its deliveries gathered meanwhile, if any, on a free slot.
    /// (Boxed: it and [`Projector::project_run`] start each other.)
    fn rest(
        self: Arc<Self>,
        run: RunId,
        held: mpsc::Sender<()>,
    ) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut stopping = self.stopping.clone();
            tokio::select! {
                _ = tokio::time::sleep(self.interval) => {}
                _ = stopping.wait_for(|stopping| *stopping) => {}
            }
            if self.inbox.release_if_empty(&run) {
                return; // nothing came: no slot needed
            }
            let slot = self.workers.slot().await;
            let workers = self.workers.clone();
            workers.run(slot, self.project_run(run, held));
        })
    }

    /// Projects `run` through the latest of `batch`, its decisions' deliveries.
    async fn project(&self, run: &RunId, batch: &[Message]) -> Verdict {
        failpoint::panic_point("projector.project", run.as_str());
        // Every delivery in the inbox has its metadata (see `run`).
        let through = batch
            .iter()
            .filter_map(|msg| msg.info().ok().map(|i| i.stream_sequence))
            .max()
            .unwrap_or(0);
        let known = self.projected.get(run);
        if known.as_ref().is_some_and(|k| k.seq >= through) {
            return Verdict::Ack;
        }
        // What is stored: nothing when the run's first decision is among these (a run is
        // projected first when its `run.created` is delivered); else read, since the step
        // service writes a run's summary from its own fold after each drive: a summary it
        // stored through these decisions already needs no journal read, fold or write here
        // (docs/ARCHITECTURE.md "The bridge and the runs projection").
        let hint = if known.is_none() && batch.iter().any(is_run_created) {
            Hint::Absent
        } else {
            let Some(tenant) = known.map(|k| k.tenant).or_else(|| self.tenant_of(run)) else {
                return self.project_read(run, through, batch, Hint::Unknown).await;
            };
            match self.projection.store.known(&tenant, run).await {
                Ok(Some(stored)) if stored.seq >= through => {
                    metrics::projector_read(ProjectorRead::Covered);
                    self.projected.note(run, stored);
                    // A fold kept of the run is behind what is stored: a later pass that
                    // reads starts over rather than keep it.
                    drop(self.folds.take(run));
                    return Verdict::Ack;
                }
                Ok(Some(stored)) => Hint::Stored(stored),
                Ok(None) => Hint::Absent,
                Err(e) => return Verdict::Retry(format!("run {run}: {e}"), self.backoff()),
            }
        };
        self.project_read(run, through, batch, hint).await
    }

    /// The tenant of `run`, when this process holds its fold.
    fn tenant_of(&self, run: &RunId) -> Option<kedge_core::ids::TenantId> {
        self.folds.tenant(run)
    }

    /// Projects `run` through `through` from its journal: the events after the fold this
    /// process keeps of it (or all), folded and stored starting from `hint`.
    async fn project_read(
        &self,
        run: &RunId,
        through: u64,
        batch: &[Message],
        hint: Hint,
    ) -> Verdict {
        // Taken out while the run is projected (one handler at a time projects a run), put back
        // once its summary is stored.
        let folded = self.folds.take(run);
        let delivered: Vec<Delivered<'_>> = batch
            .iter()
            .filter_map(|msg| {
                Some(Delivered {
                    seq: msg.info().ok()?.stream_sequence,
                    subject: msg.subject.as_str(),
                    headers: msg.headers.as_ref(),
                    payload: &msg.payload,
                })
            })
            .collect();
        match self
            .projection
            .project_through(run, through, &delivered, hint, folded)
            .await
        {
            Ok(Some((summary, _, known, folded))) => {
                self.projected.note(run, known);
                if !summary.finished {
                    self.folds.keep(run, folded);
                }
                Verdict::Ack
            }
            Ok(None) => Verdict::Ack,
            Err(e) if e.is_retryable() => Verdict::Retry(format!("run {run}: {e}"), self.backoff()),
            Err(e) => {
                tracing::error!(run_id = %run, error = %e, "run cannot be projected");
                Verdict::Poison(format!("run {run} cannot be projected: {e}"))
            }
        }
    }

    async fn settle(&self, msg: &Message, verdict: &Verdict) {
        consumer::settle(&self.projection.js, PROJECTOR, msg, verdict.clone()).await;
    }

    /// Redelivery delays after a failure (doubled per delivery up to the configured cap).
    fn backoff(&self) -> Backoff {
        Backoff::within(self.cap)
    }
}

fn is_run_created(msg: &Message) -> bool {
    subjects::parse_event(&msg.subject).is_some_and(|s| s.event_type == EventType::RunCreated)
}

/// The deliveries of the runs being projected, per run. A run is in the inbox exactly while a
/// handler projects it: [`Inbox::add`] says whether the delivery started the run's entry (the
/// caller starts the handler) or joined one (the handler takes it on its next pass), and
/// [`Inbox::take`] removes the entry, under the same lock, when nothing is left. So every
/// delivery is taken by exactly one pass of exactly one handler, and a run never has two.
#[derive(Debug, Clone)]
pub(super) struct Inbox<M = Message>(Arc<Mutex<HashMap<RunId, Vec<M>>>>);

impl<M> Default for Inbox<M> {
    fn default() -> Self {
        Inbox(Arc::default())
    }
}

impl<M> Inbox<M> {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RunId, Vec<M>>> {
        // Nothing panics holding it; a poisoned map is still whole.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds a delivery of `run`; `true` when no handler has the run (the caller starts one).
    pub(super) fn add(&self, run: &RunId, msg: M) -> bool {
        let mut map = self.lock();
        match map.get_mut(run) {
            Some(waiting) => {
                waiting.push(msg);
                false
            }
            None => {
                map.insert(run.clone(), vec![msg]);
                true
            }
        }
    }

    /// The deliveries of `run` waiting for its handler; `None`, and the run is no longer
    /// handled, when there are none.
    pub(super) fn take(&self, run: &RunId) -> Option<Vec<M>> {
        let mut map = self.lock();
        let waiting = map.get_mut(run).map(std::mem::take).unwrap_or_default();
        if waiting.is_empty() {
            map.remove(run);
            None
        } else {
            Some(waiting)
        }
    }

    /// Removes `run`, as [`Inbox::take`] would, when no delivery of it is waiting; `true` when
    /// it did (the run is no longer handled).
    pub(super) fn release_if_empty(&self, run: &RunId) -> bool {
        let mut map = self.lock();
        match map.get(run) {
            Some(waiting) if !waiting.is_empty() => false,
            _ => {
                map.remove(run);
                true
            }
        }
    }
}

/// Runs this projector stored (or found stored) a summary of: a decision at or before its
/// sequence needs no broker request at all (a journal read folds every decision there is, so
/// a backlog of a run's decisions, a fresh projector over a journal that grew without one,
/// costs one read, not one per decision), and the next write of the run is a compare-and-set
/// on the revision it left, with no read of the key. Bounded like the step's cache of states
/// ([`Bounded`]: the runs it stopped using make room).
#[derive(Debug, Clone)]
pub(super) struct Projected(Arc<Mutex<Bounded<RunId, Known>>>);

/// Runs [`Projected`] remembers at most.
const PROJECTED_RUNS: usize = 10_000;

impl Default for Projected {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Bounded::new(PROJECTED_RUNS))))
    }
}

impl Projected {
    pub(super) fn covers(&self, run: &RunId, seq: u64) -> bool {
        self.0
            .lock()
            .is_ok_and(|mut m| m.get(run).is_some_and(|k| k.seq >= seq))
    }

    pub(super) fn get(&self, run: &RunId) -> Option<Known> {
        self.0.lock().ok().and_then(|mut m| m.get(run).cloned())
    }

    pub(super) fn note(&self, run: &RunId, known: Known) {
        if let Ok(mut m) = self.0.lock() {
            match m.get_mut(run) {
                Some(k) if (k.seq, k.revision) >= (known.seq, known.revision) => {}
                Some(k) => *k = known,
                None => {
                    m.insert(run.clone(), known);
                }
            }
        }
    }
}

/// The folds of the runs this projector is following (see [`Folded`]), so that a run's next
/// decision costs a read of what is new, not of its whole journal (which made every loop of a
/// run cost a read of everything before it). A run is kept only while it is not finished: a
/// finished run's journal may be purged by retention, and a run revived later is folded anew
/// from its journal. Bounded ([`Bounded`]: the folds it stopped using make room).
#[derive(Debug)]
struct Folds(Mutex<Bounded<RunId, Folded>>);

impl Default for Folds {
    fn default() -> Self {
        Self(Mutex::new(Bounded::new(FOLDED_RUNS)))
    }
}

/// Runs [`Folds`] keeps (each with its transcript so far).
const FOLDED_RUNS: usize = 4_096;

impl Folds {
    fn take(&self, run: &RunId) -> Option<Folded> {
        self.0.lock().ok().and_then(|mut m| m.remove(run))
    }

    fn keep(&self, run: &RunId, folded: Folded) {
        if let Ok(mut m) = self.0.lock() {
            m.insert(run.clone(), folded);
        }
    }

    fn tenant(&self, run: &RunId) -> Option<kedge_core::ids::TenantId> {
        let mut m = self.0.lock().ok()?;
        m.get(run).map(|f| f.state.bundle.tenant.clone())
    }
}
