//! The read side of the `kedge_runs` projection: one summary per run, a cache of its journal
//! (docs/ARCHITECTURE.md, "The bridge and the runs projection").
//!
//! Key `<tenant>.<run_id>` ([`key`]), value a JSON [`RunSummary`] carrying `seq`, the journal
//! sequence it was folded through. The projector (`kedge_projector`, `kedge serve projector`)
//! writes it, and only it (and its rebuild, `kedge runs rebuild`); the bridge (`GET /v1/runs`,
//! the `max_active_runs` count) and `kedge runs list` read it through [`Projection`]. What both
//! sides need lives here because services never import each other (docs/ARCHITECTURE.md, "Map of
//! the house"): the bridge reads, the projector writes.
//!
//! Nobody waits on it: a run that is a moment old may be missing from a list (the list is
//! eventually consistent), and everything about one run is answered from its journal.

use async_nats::jetstream::kv::{self, Operation};
use kedge_core::event::{OutputValidation, Timestamp, Usage, WaitReason};
use kedge_core::ids::{AgentName, RunId, TenantId};
use kedge_core::subjects::{self, RUNS_BUCKET, RUNS_BUCKET_STREAM};
use kedge_core::{FoldError, RunStatus};
use kedge_journal::{Journal, JournalError};
use serde::{Deserialize, Serialize};

use crate::{Runtime, RuntimeError};

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
    /// While the run waits for a slot of its concurrency key: the key, its limit, its priority
    /// and its place when it began waiting (docs/ARCHITECTURE.md "Concurrency keys and
    /// priorities"). Absent in summaries written before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued: Option<kedge_core::event::RunQueued>,
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

/// The KV key of a run's summary.
pub fn key(tenant: &TenantId, run: &RunId) -> String {
    format!("{tenant}.{run}")
}

/// Read handle on the `kedge_runs` bucket: get one summary, list a tenant's.
#[derive(Debug, Clone)]
pub struct Projection {
    kv: kv::Store,
    journal: Journal,
}

impl Projection {
    pub async fn open(rt: &Runtime) -> Result<Projection, RuntimeError> {
        let kv = rt
            .js
            .get_key_value(RUNS_BUCKET)
            .await
            .map_err(|e| RuntimeError::broker(format!("open bucket {RUNS_BUCKET}"), e))?;
        Ok(Projection::on(kv, rt.journal.clone()))
    }

    /// A reader on the bucket `kv`, already opened (the projector's writer reads through one).
    pub fn on(kv: kv::Store, journal: Journal) -> Projection {
        Projection { kv, journal }
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
    /// (it is then overwritten by the next write). What a compare-and-set starts from.
    pub async fn entry(
        &self,
        key: &str,
    ) -> Result<Option<(u64, Option<RunSummary>)>, ProjectionError> {
        let entry = self
            .kv
            .entry(key)
            .await
            .map_err(|e| ProjectionError::Kv(e.to_string()))?;
        Ok(entry
            .filter(|e| e.operation == Operation::Put)
            .map(|e| (e.revision, serde_json::from_slice(&e.value).ok())))
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
}
