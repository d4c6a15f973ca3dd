//! The `kedge_runs` projection: one summary per run, a cache of its journal.
//!
//! Key `<tenant>.<run_id>`, value a JSON [`RunSummary`]. The summary is always the fold of the
//! run's whole journal as read at one moment, and carries `seq`, the journal sequence it was folded
//! through. Invariants:
//!
//! - **Rebuildable.** Nothing is in the projection that is not in the journal: [`rebuild`] (the
//!   `kedge runs rebuild` command) recomputes every entry from the journal.
//! - **Stale never wins.** A write is a compare-and-set on the key's KV revision, and is made only
//!   when the summary's `seq` is newer than the stored one; a lost race re-reads and compares
//!   again. So two projectors, a slow one and a fast one, or a projector and a rebuild, converge
//!   on the newest fold whatever the order their writes arrive in.
//! - **Nobody waits on it.** The step service never reads it; the bridge uses it only to list runs
//!   (`GET /v1/runs`), and answers everything about one run from the journal itself. A run that is
//!   a moment old may be missing from the list: the list is eventually consistent.
//!
//! The projector is a durable consumer (`projector`, `nats/consumers/KEDGE_RUNS/projector.json`)
//! on the runs' decisions (`agent.run.*.d.>`; only decisions change a summary). It projects many
//! runs at once and one run at a time: the decisions of a run delivered while it is being
//! projected are covered by one more read, fold and store, and a decision at or before a summary
//! it already stored costs no request at all (so a burst or a backlog of a run's decisions
//! costs one journal read). A write starts from what the process last stored for the run (a
//! compare-and-set on that revision, or a create for a run first seen by its `run.created`), so
//! it is usually one request; a wrong guess falls back to reading the key. It keeps the fold of
//! each unfinished run it follows (bounded), so a decision costs a read of the events after the
//! last one folded, not of the whole journal again: that made every loop of a run cost a read
//! and fold of everything before it (agent_loop `--with-projector`: 400 → 1,450 actions/s).
//! And it writes a run at most once per `bridge.runs_list_interval_ms` (250 ms): after a
//! projection the run rests, holding no slot, and the decisions delivered meanwhile gather in
//! its inbox entry for the next pass, so a busy agent loop costs a read and a write per
//! interval instead of per decision (its first decision is projected at once; a stop projects
//! what resting runs gathered before it returns).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::kv::{self, Operation};
use async_nats::jetstream::{Context, Message};
use futures::StreamExt;
use kedge_core::event::{OutputValidation, Timestamp, Usage, WaitReason};
use kedge_core::ids::{AgentName, RunId, TenantId};
use kedge_core::subjects::{self, Durable, RUNS_BUCKET, RUNS_BUCKET_STREAM};
use kedge_core::{EventType, FoldError, RunState, RunStatus};
use kedge_journal::{Journal, JournalError, Recorded};
use kedge_runtime::consumer::{Backoff, Verdict};
use kedge_runtime::{Runtime, RuntimeError, consumer, failpoint};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use crate::view;

/// One run in `kedge_runs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSummary {
    pub run_id: RunId,
    pub tenant: TenantId,
    pub agent: AgentName,
    pub status: RunStatus,
    /// Ended, and nothing is about to revive it.
    pub finished: bool,
    pub turn: u32,
    /// The last step started (0 before the first).
    pub step: u32,
    pub waiting_on: Option<WaitReason>,
    pub usage: Usage,
    /// Validation of the current turn's output, when the run succeeded.
    pub validation: Option<OutputValidation>,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    /// The journal sequence this summary was folded through: its version.
    pub seq: u64,
}

/// Why a projection operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ProjectionError {
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error("run {run} does not fold: {source}")]
    Fold { run: RunId, source: FoldError },
    #[error("{bucket}: {0}", bucket = kedge_core::subjects::RUNS_BUCKET)]
    Kv(String),
}

impl ProjectionError {
    /// Worth trying again later (broker trouble), as opposed to a journal that cannot be folded.
    pub fn is_retryable(&self) -> bool {
        match self {
            ProjectionError::Journal(e) => e.is_retryable(),
            ProjectionError::Fold { .. } => false,
            ProjectionError::Kv(_) => true,
        }
    }
}

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    Written,
    /// The stored summary was as new or newer; nothing written.
    Stale,
}

/// The summary of a run's whole journal; `None` for a run with no events.
pub fn summarize(events: &[Recorded]) -> Result<Option<RunSummary>, FoldError> {
    Ok(Folded::of(events)?.map(|folded| folded.summary()))
}

/// A run's fold as far as it was read, with the times its summary carries: what the projector
/// keeps of a run between two of its decisions, so that the next projection reads and folds
/// only the events after it instead of the whole journal again.
#[derive(Debug, Clone)]
struct Folded {
    state: RunState,
    created_at: Timestamp,
    updated_at: Timestamp,
}

impl Folded {
    /// The fold of a run's whole journal; `None` for a run with no events.
    fn of(events: &[Recorded]) -> Result<Option<Folded>, FoldError> {
        let Some(first) = events.first() else {
            return Ok(None);
        };
        let state = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope)))?;
        Ok(Some(Folded {
            state,
            created_at: first.envelope.at,
            updated_at: events.last().map_or(first.envelope.at, |r| r.envelope.at),
        }))
    }

    /// Folds in the events that follow the ones folded (in order, as the whole journal's
    /// fold would).
    fn apply(&mut self, events: &[Recorded]) -> Result<(), FoldError> {
        for r in events {
            self.state.apply(r.seq, &r.envelope)?;
            self.updated_at = r.envelope.at;
        }
        Ok(())
    }

    fn summary(&self) -> RunSummary {
        let state = &self.state;
        RunSummary {
            run_id: state.run_id.clone(),
            tenant: state.bundle.tenant.clone(),
            agent: state.bundle.agent.clone(),
            status: state.status,
            finished: view::finished(state),
            turn: state.turn,
            step: state.step.get(),
            waiting_on: state.waiting_on(),
            usage: state.usage,
            // The validation of the run's last success (a revived run's is cleared).
            validation: match state.status {
                RunStatus::Succeeded => state.validation.clone(),
                _ => None,
            },
            created_at: self.created_at,
            updated_at: self.updated_at,
            seq: state.last_seq,
        }
    }
}

/// The KV key of a run's summary.
pub fn key(tenant: &TenantId, run: &RunId) -> String {
    format!("{tenant}.{run}")
}

/// Handle on the `kedge_runs` bucket.
#[derive(Debug, Clone)]
pub struct Projection {
    kv: kv::Store,
    js: Context,
    journal: Journal,
}

const CAS_TRIES: usize = 16;

impl Projection {
    pub async fn open(rt: &Runtime) -> Result<Projection, RuntimeError> {
        let kv = rt
            .js
            .get_key_value(RUNS_BUCKET)
            .await
            .map_err(|e| RuntimeError::broker(format!("open bucket {RUNS_BUCKET}"), e))?;
        Ok(Projection {
            kv,
            js: rt.js.clone(),
            journal: rt.journal.clone(),
        })
    }

    /// The stored summary of a run.
    pub async fn get(
        &self,
        tenant: &TenantId,
        run: &RunId,
    ) -> Result<Option<RunSummary>, ProjectionError> {
        Ok(self.entry(&key(tenant, run)).await?.and_then(|(_, s)| s))
    }

    /// `(revision, summary)` of a live key; the summary is `None` when the value does not parse
    /// (it is then overwritten by the next write).
    async fn entry(&self, key: &str) -> Result<Option<(u64, Option<RunSummary>)>, ProjectionError> {
        let entry = self
            .kv
            .entry(key)
            .await
            .map_err(|e| ProjectionError::Kv(e.to_string()))?;
        Ok(entry
            .filter(|e| e.operation == Operation::Put)
            .map(|e| (e.revision, serde_json::from_slice(&e.value).ok())))
    }

    /// Writes `summary` unless the stored one is newer (or, unless `overwrite_equal`, as new).
    pub async fn store(
        &self,
        summary: &RunSummary,
        overwrite_equal: bool,
    ) -> Result<Stored, ProjectionError> {
        Ok(self
            .store_hinted(summary, overwrite_equal, Hint::Unknown)
            .await?
            .0)
    }

    /// [`Projection::store`], starting from what the caller believes is stored: with a right
    /// guess the write is one request (a compare-and-set on the believed revision, or a create),
    /// with a wrong one the compare-and-set fails and the write goes on as without a guess (read
    /// the key, compare, compare-and-set). Returns what is stored afterwards.
    async fn store_hinted(
        &self,
        summary: &RunSummary,
        overwrite_equal: bool,
        hint: Hint,
    ) -> Result<(Stored, Known), ProjectionError> {
        let key = key(&summary.tenant, &summary.run_id);
        let value: bytes::Bytes = serde_json::to_vec(summary)
            .map_err(|e| ProjectionError::Kv(e.to_string()))?
            .into();
        let known = |seq: u64, revision: u64| Known {
            seq,
            revision,
            tenant: summary.tenant.clone(),
        };
        let guess = match hint {
            Hint::Unknown => None,
            Hint::Absent => Some(0),
            Hint::Stored(k) if k.tenant == summary.tenant => {
                if k.seq > summary.seq || (k.seq == summary.seq && !overwrite_equal) {
                    // Stored by this projector; a later write by anyone is newer still.
                    return Ok((Stored::Stale, k));
                }
                Some(k.revision)
            }
            Hint::Stored(_) => None,
        };
        if let Some(revision) = guess {
            // Revision 0: only if the key has never been written (a `create` without the
            // client's follow-up read on failure: the loop below reads anyway).
            match self.kv.update(&key, value.clone(), revision).await {
                Ok(revision) => return Ok((Stored::Written, known(summary.seq, revision))),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {}
                Err(e) => return Err(ProjectionError::Kv(e.to_string())),
            }
        }
        for _ in 0..CAS_TRIES {
            match self.entry(&key).await? {
                None => match self.kv.create(&key, value.clone()).await {
                    Ok(revision) => return Ok((Stored::Written, known(summary.seq, revision))),
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => continue,
                    Err(e) => return Err(ProjectionError::Kv(e.to_string())),
                },
                Some((revision, stored)) => {
                    let stored_seq = stored.map_or(0, |s| s.seq);
                    if stored_seq > summary.seq || (stored_seq == summary.seq && !overwrite_equal) {
                        return Ok((Stored::Stale, known(stored_seq, revision)));
                    }
                    match self.kv.update(&key, value.clone(), revision).await {
                        Ok(revision) => return Ok((Stored::Written, known(summary.seq, revision))),
                        Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                        Err(e) => return Err(ProjectionError::Kv(e.to_string())),
                    }
                }
            }
        }
        Err(ProjectionError::Kv(format!(
            "{key}: lost {CAS_TRIES} compare-and-set races in a row"
        )))
    }

    /// Reads and folds a run and stores its summary. `Ok(None)` for a run with no events.
    pub async fn project(
        &self,
        run: &RunId,
        overwrite_equal: bool,
    ) -> Result<Option<(RunSummary, Stored)>, ProjectionError> {
        let events = self.journal.read(run, 0).await?;
        Ok(self
            .fold_and_store(run, &events, overwrite_equal, Hint::Unknown)
            .await?
            .map(|(summary, stored, _)| (summary, stored)))
    }

    /// [`Projection::project`] of a run through at least `through`, an event of the run the
    /// broker acknowledged (the decision a projector handles): read without asking the stream
    /// leader where the run ends ([`Journal::read_through`]); a later event the read did not
    /// reach is projected on its own delivery. `hint`: what the caller believes is stored.
    /// `folded`: the run's fold as this process last left it; only the events after it are
    /// read (a fold that no longer applies is started over from the whole journal). Returns
    /// the fold through the read besides.
    async fn project_through(
        &self,
        run: &RunId,
        through: u64,
        hint: Hint,
        folded: Option<Folded>,
    ) -> Result<Option<(RunSummary, Stored, Known, Folded)>, ProjectionError> {
        let folded = match folded {
            Some(mut known) if known.state.last_seq < through => {
                let after = known.state.last_seq;
                let events = self.journal.read_through(run, after, through).await?.events;
                match known.apply(&events) {
                    Ok(()) => Some(known),
                    Err(e) => {
                        tracing::warn!(run_id = %run, error = %e, "the kept fold does not take the run's new events; folding the whole journal");
                        self.fold_through(run, through).await?
                    }
                }
            }
            Some(known) => Some(known),
            None => self.fold_through(run, through).await?,
        };
        let Some(folded) = folded else {
            return Ok(None);
        };
        let summary = folded.summary();
        let (stored, known) = self.store_hinted(&summary, false, hint).await?;
        Ok(Some((summary, stored, known, folded)))
    }

    /// The fold of the run's whole journal through at least `through`; `None` for no events.
    async fn fold_through(
        &self,
        run: &RunId,
        through: u64,
    ) -> Result<Option<Folded>, ProjectionError> {
        let events = self.journal.read_through(run, 0, through).await?.events;
        Folded::of(&events).map_err(|source| ProjectionError::Fold {
            run: run.clone(),
            source,
        })
    }

    /// Folds a run's events into its summary and stores it. `Ok(None)` for no events.
    async fn fold_and_store(
        &self,
        run: &RunId,
        events: &[Recorded],
        overwrite_equal: bool,
        hint: Hint,
    ) -> Result<Option<(RunSummary, Stored, Known)>, ProjectionError> {
        let Some(summary) = summarize(events).map_err(|source| ProjectionError::Fold {
            run: run.clone(),
            source,
        })?
        else {
            return Ok(None);
        };
        let (stored, known) = self.store_hinted(&summary, overwrite_equal, hint).await?;
        Ok(Some((summary, stored, known)))
    }

    /// Every summary of a tenant (one pass over the bucket's keys `<tenant>.>`, by batched
    /// direct gets: [`Journal::latest_per_subject`]). A summary rewritten meanwhile is listed
    /// once, at its newer version; an entry that does not parse is left out.
    pub async fn list(&self, tenant: &TenantId) -> Result<Vec<RunSummary>, ProjectionError> {
        let filter = subjects::kv_key(RUNS_BUCKET, &format!("{tenant}.>"));
        let entries = self
            .journal
            .latest_per_subject(RUNS_BUCKET_STREAM, &filter)
            .await?;
        Ok(entries
            .iter()
            .filter(|e| !e.deleted)
            .filter_map(|e| serde_json::from_slice::<RunSummary>(&e.payload).ok())
            .collect())
    }

    /// Removes a run's summary (rebuild, for runs no longer in the journal).
    async fn remove(&self, key: &str) -> Result<(), ProjectionError> {
        self.kv
            .delete(key)
            .await
            .map_err(|e| ProjectionError::Kv(e.to_string()))
    }
}

/// The projector's durable consumer (`nats/consumers/KEDGE_RUNS/projector.json`).
pub const PROJECTOR: Durable = Durable::Projector;
/// Runs projected at once. Each is a journal read and a write, a few round trips mostly spent
/// waiting on the broker; the consumer's `max_ack_pending` (1,000) bounds the deliveries held.
const PROJECTING: usize = 64;

/// Runs the projector until `shutdown` resolves.
///
/// Deliveries are handled per run, [`PROJECTING`] runs at once: a delivery of a run already
/// being projected joins it ([`Inbox`]), and one read, fold and store covers every decision of
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
pub async fn run_projector(
    rt: Runtime,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RuntimeError> {
    let workers = consumer::Workers::new(PROJECTING);
    let (stop, stopping) = watch::channel(false);
    let projector = Arc::new(Projector {
        projection: Projection::open(&rt).await?,
        projected: Projected::default(),
        folds: Folds::default(),
        inbox: Inbox::default(),
        cap: rt.config.timeouts.max_retry_delay(),
        interval: Duration::from_millis(rt.config.bridge.runs_list_interval_ms),
        workers: workers.clone(),
        stopping,
    });
    let consumer = consumer::durable(&rt.js, PROJECTOR, Duration::from_secs(30)).await?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| RuntimeError::broker("projector consumer", e))?;
    // Every handler and resting run holds a clone; all are gone once every delivery taken is
    // settled.
    let (held, mut all_settled) = mpsc::channel::<()>(1);
    tracing::info!(worker = %rt.config.worker_id, "projector started");
    tokio::pin!(shutdown);
    loop {
        let (slot, msg) = tokio::select! {
            _ = &mut shutdown => break,
            next = workers.next(&mut messages, PROJECTOR) => match next {
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
        if !projector.inbox.add(&run, msg) {
            // Joins the projection of the run in flight or resting; the slot is not needed.
            continue;
        }
        let projector = projector.clone();
        let held = held.clone();
        workers.run(slot, async move { projector.project_run(run, held).await });
    }
    consumer::hand_back(messages, PROJECTOR).await;
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
    projection: Projection,
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
    /// the stop's wait (see [`run_projector`]).
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
        // Every delivery in the inbox has its metadata (see `run_projector`).
        let through = batch
            .iter()
            .filter_map(|msg| msg.info().ok().map(|i| i.stream_sequence))
            .max()
            .unwrap_or(0);
        let known = self.projected.get(run);
        if known.as_ref().is_some_and(|k| k.seq >= through) {
            return Verdict::Ack;
        }
        // What is stored, as far as this process knows: its own last write of the run, else
        // nothing when the run's first decision is among these (a run is projected first when
        // its `run.created` is delivered), else unknown (the store reads the key).
        let hint = match known {
            Some(k) => Hint::Stored(k),
            None if batch.iter().any(is_run_created) => Hint::Absent,
            None => Hint::Unknown,
        };
        // Taken out while the run is projected (one handler at a time projects a run), put back
        // once its summary is stored.
        let folded = self.folds.take(run);
        match self
            .projection
            .project_through(run, through, hint, folded)
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
struct Inbox<M = Message>(Arc<Mutex<HashMap<RunId, Vec<M>>>>);

impl<M> Default for Inbox<M> {
    fn default() -> Self {
        Inbox(Arc::default())
    }
}

impl<M> Inbox<M> {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RunId, Vec<M>>> {
        // Nothing panics holding it; a poisoned map is still whole.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds a delivery of `run`; `true` when no handler has the run (the caller starts one).
    fn add(&self, run: &RunId, msg: M) -> bool {
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
    fn take(&self, run: &RunId) -> Option<Vec<M>> {
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
    fn release_if_empty(&self, run: &RunId) -> bool {
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

/// What is stored for a run, as far as one process knows: the sequence its summary was folded
/// through, the KV revision holding it, and the run's tenant (its key).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Known {
    seq: u64,
    revision: u64,
    tenant: TenantId,
}

/// What a store starts from (see [`Projection::store_hinted`]).
#[derive(Debug, Clone)]
enum Hint {
    /// Read the key first.
    Unknown,
    /// Probably never written: create it.
    Absent,
    /// Probably this (this process stored or found it): compare-and-set on its revision.
    Stored(Known),
}

/// Runs this projector stored (or found stored) a summary of: a decision at or before its
/// sequence needs no broker request at all (a journal read folds every decision there is, so
/// a backlog of a run's decisions, a fresh projector over a journal that grew without one,
/// costs one read, not one per decision), and the next write of the run is a compare-and-set
/// on the revision it left, with no read of the key. Bounded like the step's cache of states:
/// started over when full.
#[derive(Debug, Clone, Default)]
struct Projected(Arc<Mutex<HashMap<RunId, Known>>>);

/// Runs [`Projected`] remembers before it starts over.
const PROJECTED_RUNS: usize = 10_000;

impl Projected {
    fn covers(&self, run: &RunId, seq: u64) -> bool {
        self.0
            .lock()
            .is_ok_and(|m| m.get(run).is_some_and(|k| k.seq >= seq))
    }

    fn get(&self, run: &RunId) -> Option<Known> {
        self.0.lock().ok().and_then(|m| m.get(run).cloned())
    }

    fn note(&self, run: &RunId, known: Known) {
        if let Ok(mut m) = self.0.lock() {
            if m.len() >= PROJECTED_RUNS && !m.contains_key(run) {
                m.clear();
            }
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
/// from its journal. Bounded like [`Projected`]: started over when full.
#[derive(Debug, Default)]
struct Folds(Mutex<HashMap<RunId, Folded>>);

/// Runs [`Folds`] keeps before it starts over (each with its transcript so far).
const FOLDED_RUNS: usize = 1_024;

impl Folds {
    fn take(&self, run: &RunId) -> Option<Folded> {
        self.0.lock().ok().and_then(|mut m| m.remove(run))
    }

    fn keep(&self, run: &RunId, folded: Folded) {
        if let Ok(mut m) = self.0.lock() {
            if m.len() >= FOLDED_RUNS {
                m.clear();
            }
            m.insert(run.clone(), folded);
        }
    }
}

/// What [`rebuild`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RebuildReport {
    /// Runs found in the journal.
    pub runs: usize,
    /// Summaries written (new, or newer than the stored one).
    pub written: usize,
    /// Summaries already up to date.
    pub unchanged: usize,
    /// Runs whose journal does not fold (left out, logged).
    pub failed: usize,
    /// Entries removed because their run is not in the journal.
    pub removed: usize,
}

/// Recomputes `kedge_runs` from the journal: every run with a `run.created` gets the summary of
/// its whole journal (written when at least as new as the stored one, so a concurrent projector
/// is never overtaken by an older fold), and entries of runs not in the journal are removed.
pub async fn rebuild(rt: &Runtime) -> Result<RebuildReport, ProjectionError> {
    let projection = Projection::open(rt)
        .await
        .map_err(|e| ProjectionError::Kv(e.to_string()))?;
    let runs = rt
        .journal
        .run_ids()
        .await
        .map_err(|e| ProjectionError::Kv(e.to_string()))?;
    let mut report = RebuildReport {
        runs: runs.len(),
        ..Default::default()
    };
    let mut keys = std::collections::HashSet::new();
    for run in &runs {
        match projection.project(run, true).await {
            Ok(Some((summary, stored))) => {
                keys.insert(key(&summary.tenant, run));
                match stored {
                    Stored::Written => report.written += 1,
                    Stored::Stale => report.unchanged += 1,
                }
            }
            Ok(None) => {}
            Err(e @ ProjectionError::Fold { .. }) => {
                tracing::error!(run_id = %run, error = %e, "run left out of the projection");
                report.failed += 1;
            }
            Err(e) => return Err(e),
        }
    }
    let mut existing = projection
        .kv
        .keys()
        .await
        .map_err(|e| ProjectionError::Kv(e.to_string()))?;
    let mut stale_keys = Vec::new();
    while let Some(k) = existing.next().await {
        let k = k.map_err(|e| ProjectionError::Kv(e.to_string()))?;
        if !keys.contains(&k) {
            stale_keys.push(k);
        }
    }
    for k in stale_keys {
        projection.remove(&k).await?;
        report.removed += 1;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> RunId {
        RunId::generate()
    }

    /// The recorded journals every build replays (crates/core/tests/fixtures): a fold kept
    /// after any prefix of one and then given the rest gives the summary of the whole journal,
    /// as a fold of the whole journal does (what the projector relies on to read only what is
    /// new).
    #[test]
    fn a_fold_kept_and_given_the_rest_summarizes_the_whole_journal() {
        let mut journals = 0;
        for (path, journal) in kedge_core::fixtures::recorded_journals() {
            let events: Vec<Recorded> = journal
                .into_iter()
                .map(|(seq, envelope)| Recorded {
                    seq,
                    envelope,
                    msg_id: None,
                })
                .collect();
            let whole = summarize(&events).expect("folds").expect("has events");
            let validated = match whole.status {
                RunStatus::Succeeded => view::result_validation(&events),
                _ => None,
            };
            assert_eq!(
                whole.validation,
                validated,
                "{}: the last success's validation",
                path.display()
            );
            let whole = serde_json::to_value(&whole).expect("serializes");
            for k in 1..events.len() {
                let Ok(Some(mut kept)) = Folded::of(&events[..k]) else {
                    continue; // no decision yet: nothing the projector would keep
                };
                kept.apply(&events[k..]).expect("the rest folds in");
                assert_eq!(
                    serde_json::to_value(kept.summary()).expect("serializes"),
                    whole,
                    "{} kept after {k} of {} events",
                    path.display(),
                    events.len()
                );
            }
            journals += 1;
        }
        assert!(journals >= 10, "the fixtures were read ({journals})");
    }

    #[test]
    fn a_run_has_one_handler_that_takes_every_delivery_once() {
        let inbox: Inbox<u64> = Inbox::default();
        let (a, b) = (run(), run());
        assert!(inbox.add(&a, 1), "the first delivery starts a handler");
        assert!(!inbox.add(&a, 2), "a second one joins it");
        assert!(inbox.add(&b, 3), "another run has its own");
        assert_eq!(inbox.take(&a), Some(vec![1, 2]), "one pass takes both");
        assert!(!inbox.add(&a, 4), "the handler is still on the run");
        assert_eq!(inbox.take(&a), Some(vec![4]));
        assert_eq!(inbox.take(&a), None, "nothing left: the handler ends");
        assert!(inbox.add(&a, 5), "so the next delivery starts a new one");
        assert_eq!(inbox.take(&b), Some(vec![3]));
        assert_eq!(inbox.take(&b), None);
        assert_eq!(inbox.take(&a), Some(vec![5]));
        assert!(!inbox.add(&a, 6), "a resting run still has its handler");
        assert!(
            !inbox.release_if_empty(&a),
            "which is not released with a delivery"
        );
        assert_eq!(inbox.take(&a), Some(vec![6]));
        assert!(inbox.release_if_empty(&a), "but is released without one");
        assert!(inbox.add(&a, 7), "so the next delivery starts a new one");
        assert_eq!(inbox.take(&a), Some(vec![7]));
        assert_eq!(inbox.take(&a), None);
        assert!(inbox.lock().is_empty());
    }

    #[test]
    fn what_is_known_of_a_run_only_moves_forward() {
        let projected = Projected::default();
        let a = run();
        let tenant: TenantId = "acme".parse().expect("tenant");
        let known = |seq, revision| Known {
            seq,
            revision,
            tenant: tenant.clone(),
        };
        assert!(!projected.covers(&a, 1));
        projected.note(&a, known(10, 3));
        assert!(projected.covers(&a, 10) && !projected.covers(&a, 11));
        projected.note(&a, known(7, 2));
        assert_eq!(
            projected.get(&a),
            Some(known(10, 3)),
            "an older fold is ignored"
        );
        projected.note(&a, known(12, 5));
        assert_eq!(projected.get(&a), Some(known(12, 5)));
    }
}
