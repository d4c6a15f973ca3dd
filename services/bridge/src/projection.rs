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
//! on the runs' decisions (`agent.run.*.d.>`; only decisions change a summary). For each one it
//! skips the work when the stored summary already covers that sequence (so a burst of decisions
//! costs one journal read), else reads and folds the run and writes the summary.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::kv::{self, Operation};
use async_nats::jetstream::{AckKind, Context, Message};
use futures::StreamExt;
use kedge_core::event::{OutputValidation, Timestamp, Usage, WaitReason};
use kedge_core::ids::{AgentName, RunId, TenantId};
use kedge_core::subjects::{self, RUNS_BUCKET};
use kedge_core::{FoldError, RunStatus};
use kedge_journal::{Journal, JournalError, Recorded};
use kedge_runtime::{Runtime, RuntimeError, consumer, failpoint};
use serde::{Deserialize, Serialize};

use crate::tenants::TenantCache;
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
    #[error("kedge_runs: {0}")]
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
    let Some(first) = events.first() else {
        return Ok(None);
    };
    let state = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope)))?;
    let validation = match state.status {
        RunStatus::Succeeded => view::result_validation(events),
        _ => None,
    };
    Ok(Some(RunSummary {
        run_id: state.run_id.clone(),
        tenant: state.bundle.tenant.clone(),
        agent: state.bundle.agent.clone(),
        status: state.status,
        finished: view::finished(&state),
        turn: state.turn,
        step: state.step.get(),
        waiting_on: state.waiting_on(),
        usage: state.usage,
        validation,
        created_at: first.envelope.at,
        updated_at: events.last().map_or(first.envelope.at, |r| r.envelope.at),
        seq: state.last_seq,
    }))
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
    tenants: TenantCache,
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
            tenants: TenantCache::new(rt),
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
        let key = key(&summary.tenant, &summary.run_id);
        let value: bytes::Bytes = serde_json::to_vec(summary)
            .map_err(|e| ProjectionError::Kv(e.to_string()))?
            .into();
        for _ in 0..CAS_TRIES {
            match self.entry(&key).await? {
                None => match self.kv.create(&key, value.clone()).await {
                    Ok(_) => return Ok(Stored::Written),
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => continue,
                    Err(e) => return Err(ProjectionError::Kv(e.to_string())),
                },
                Some((revision, stored)) => {
                    let stored_seq = stored.map_or(0, |s| s.seq);
                    if stored_seq > summary.seq || (stored_seq == summary.seq && !overwrite_equal) {
                        return Ok(Stored::Stale);
                    }
                    match self.kv.update(&key, value.clone(), revision).await {
                        Ok(_) => return Ok(Stored::Written),
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
        self.fold_and_store(run, &events, overwrite_equal).await
    }

    /// [`Projection::project`] of a run through at least `through`, an event of the run the
    /// broker acknowledged (the decision a projector handles): read without asking the stream
    /// leader where the run ends ([`Journal::read_through`]); a later event the read did not
    /// reach is projected on its own delivery.
    async fn project_through(
        &self,
        run: &RunId,
        through: u64,
    ) -> Result<Option<(RunSummary, Stored)>, ProjectionError> {
        let events = self.journal.read_through(run, 0, through).await?.events;
        self.fold_and_store(run, &events, false).await
    }

    /// Folds a run's events into its summary and stores it. `Ok(None)` for no events.
    async fn fold_and_store(
        &self,
        run: &RunId,
        events: &[Recorded],
        overwrite_equal: bool,
    ) -> Result<Option<(RunSummary, Stored)>, ProjectionError> {
        let Some(summary) = summarize(events).map_err(|source| ProjectionError::Fold {
            run: run.clone(),
            source,
        })?
        else {
            return Ok(None);
        };
        let stored = self.store(&summary, overwrite_equal).await?;
        Ok(Some((summary, stored)))
    }

    /// Every summary of a tenant (one pass over the bucket's keys `<tenant>.>`).
    pub async fn list(&self, tenant: &TenantId) -> Result<Vec<RunSummary>, ProjectionError> {
        let filter = format!("$KV.{RUNS_BUCKET}.{tenant}.>");
        let kv_err = |e: &dyn std::fmt::Display| ProjectionError::Kv(e.to_string());
        let stream = self
            .js
            .get_stream_no_info(format!("KV_{RUNS_BUCKET}"))
            .await
            .map_err(|e| kv_err(&e))?;
        let consumer: PullConsumer = stream
            .create_consumer(pull::Config {
                deliver_policy: DeliverPolicy::LastPerSubject,
                filter_subject: filter,
                ack_policy: AckPolicy::None,
                inactive_threshold: Duration::from_secs(10),
                memory_storage: true,
                ..Default::default()
            })
            .await
            .map_err(|e| kv_err(&e))?;
        let name = consumer.cached_info().name.clone();
        let result = async {
            let mut out = Vec::new();
            if consumer.cached_info().num_pending == 0 {
                return Ok(out);
            }
            let mut messages = consumer.messages().await.map_err(|e| kv_err(&e))?;
            loop {
                let next = tokio::time::timeout(Duration::from_secs(5), messages.next())
                    .await
                    .map_err(|_| ProjectionError::Kv("listing timed out".into()))?;
                let Some(msg) = next else { break };
                let msg = msg.map_err(|e| kv_err(&e))?;
                let pending = msg.info().map(|i| i.pending).unwrap_or(0);
                let deleted = msg
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("KV-Operation"))
                    .is_some();
                if !deleted && let Ok(s) = serde_json::from_slice::<RunSummary>(&msg.payload) {
                    out.push(s);
                }
                if pending == 0 {
                    break;
                }
            }
            Ok(out)
        }
        .await;
        let _ = stream.delete_consumer(&name).await;
        result
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
pub const PROJECTOR: &str = "projector";
/// First redelivery delay after a failure; it doubles per delivery up to the configured
/// `max_retry_delay`, and the consumer's `max_deliver` bounds the tries.
const RETRY_DELAY: Duration = Duration::from_secs(1);

/// Runs the projector until `shutdown` resolves.
///
/// A decision it cannot project (broker trouble, or a panic, which is contained) is handed back
/// with a growing delay; at the consumer's last delivery (`max_deliver` 20), and at once for a
/// run whose journal does not fold, it is given up on as a dead letter
/// (`agent.rejected.dead.projector`, `kedge dead list`): the projection is a cache, a later
/// decision of the run or `kedge runs rebuild` brings the summary up to date.
pub async fn run_projector(
    rt: Runtime,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RuntimeError> {
    let projection = Projection::open(&rt).await?;
    let consumer = consumer::durable(&rt.js, PROJECTOR, Duration::from_secs(30)).await?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| RuntimeError::broker("projector consumer", e))?;
    let workers = consumer::Workers::new(16);
    let projected = Projected::default();
    let cap = rt.config.timeouts.max_retry_delay();
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
        let projection = projection.clone();
        let projected = projected.clone();
        workers.run(slot, async move {
            use futures::FutureExt as _;
            let handled = std::panic::AssertUnwindSafe(handle(&projection, &projected, &msg))
                .catch_unwind()
                .await;
            let verdict = handled.unwrap_or_else(|panic| {
                let reason = kedge_runtime::failpoint::panic_message(panic.as_ref());
                tracing::error!(subject = %msg.subject, panic = %reason, "projecting panicked");
                Verdict::Retry(format!("panicked: {reason}"))
            });
            settle(&projection.js, &msg, verdict, cap).await;
        });
    }
    consumer::hand_back(messages, PROJECTOR).await;
    workers.drain().await;
    tracing::info!("projector stopped");
    Ok(())
}

/// What the projector tells the broker about a decision.
#[derive(Debug)]
enum Verdict {
    Ack,
    /// Failed for the reason: handed back, given up on at the last delivery.
    Retry(String),
    /// Never worth another delivery: given up on at once.
    Poison(String),
}

async fn settle(js: &Context, msg: &Message, verdict: Verdict, cap: Duration) {
    let delivered = consumer::deliveries(msg);
    let ack = match verdict {
        Verdict::Ack => msg.ack().await,
        Verdict::Poison(reason) => return consumer::dead_letter(js, PROJECTOR, msg, &reason).await,
        Verdict::Retry(reason) if consumer::is_last_delivery(PROJECTOR, msg) => {
            return consumer::dead_letter(js, PROJECTOR, msg, &reason).await;
        }
        Verdict::Retry(reason) => {
            let delay = consumer::retry_delay(delivered, RETRY_DELAY.min(cap), cap);
            tracing::warn!(subject = %msg.subject, delivered, %reason, "projection deferred");
            msg.ack_with(AckKind::Nak(Some(delay))).await
        }
    };
    if let Err(e) = ack {
        tracing::warn!(subject = %msg.subject, error = %e, "ack failed; the decision will be redelivered");
    }
}

/// Runs this projector stored (or found stored) a summary of, and the sequence that summary was
/// folded through: a decision at or before it needs no broker request at all. A journal read
/// folds every decision there is, so a backlog of a run's decisions (a fresh projector over a
/// journal that grew without one) costs one read, not one per decision. Bounded like the
/// step's cache of states: started over when full.
#[derive(Debug, Clone, Default)]
struct Projected(std::sync::Arc<std::sync::Mutex<std::collections::HashMap<RunId, u64>>>);

/// Runs [`Projected`] remembers before it starts over.
const PROJECTED_RUNS: usize = 10_000;

impl Projected {
    fn covers(&self, run: &RunId, seq: u64) -> bool {
        self.0
            .lock()
            .is_ok_and(|m| m.get(run).is_some_and(|through| *through >= seq))
    }

    fn note(&self, run: &RunId, through: u64) {
        if let Ok(mut m) = self.0.lock() {
            if m.len() >= PROJECTED_RUNS && !m.contains_key(run) {
                m.clear();
            }
            let at = m.entry(run.clone()).or_default();
            *at = (*at).max(through);
        }
    }
}

/// A decision stored longer ago than this is handled as a backlog (see `handle`): a projector
/// catching up on a journal that grew without one, or a redelivery.
const BACKLOG_AGE: Duration = Duration::from_secs(2);

fn is_backlog(msg: &Message) -> bool {
    msg.info().is_ok_and(|info| {
        time::OffsetDateTime::now_utc() - info.published
            > time::Duration::try_from(BACKLOG_AGE).unwrap_or(time::Duration::MAX)
    })
}

async fn handle(projection: &Projection, projected: &Projected, msg: &Message) -> Verdict {
    let Some(parsed) = subjects::parse_event(&msg.subject) else {
        return Verdict::Poison("not a journal event subject".into());
    };
    let run = parsed.run_id;
    failpoint::panic_point("projector.project", run.as_str());
    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or(u64::MAX);
    if projected.covers(&run, seq) {
        return Verdict::Ack;
    }
    // A summary folded through this decision or later is already there (a burst of decisions of
    // one run costs one journal read). Not looked for in a backlog: the look costs what reading
    // the run does, and the write after the read finds it just the same.
    if !is_backlog(msg)
        && let Ok(Some(tenant)) = projection.tenants.get(&run).await
        && let Ok(Some(stored)) = projection.get(&tenant, &run).await
        && stored.seq >= seq
    {
        projected.note(&run, stored.seq);
        return Verdict::Ack;
    }
    match projection.project_through(&run, seq).await {
        Ok(Some((summary, _))) => {
            projected.note(&run, summary.seq);
            Verdict::Ack
        }
        Ok(None) => Verdict::Ack,
        Err(e) if e.is_retryable() => Verdict::Retry(format!("run {run}: {e}")),
        Err(e) => {
            tracing::error!(run_id = %run, error = %e, "run cannot be projected");
            Verdict::Poison(format!("run {run} cannot be projected: {e}"))
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
