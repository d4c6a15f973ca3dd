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

use kedge_core::event::{OutputValidation, Timestamp, Usage, WaitReason};
use kedge_core::ids::{AgentName, RunId, TenantId};
use kedge_core::{FoldError, RunStatus};
use kedge_journal::JournalError;
use serde::{Deserialize, Serialize};

mod projector;
mod rebuild;
mod store;
mod summary;
#[cfg(test)]
mod tests;

pub use projector::{PROJECTOR, run_projector};
pub use rebuild::{RebuildReport, rebuild};
pub use store::Projection;
pub use summary::summarize;

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

/// The KV key of a run's summary.
pub fn key(tenant: &TenantId, run: &RunId) -> String {
    format!("{tenant}.{run}")
}
