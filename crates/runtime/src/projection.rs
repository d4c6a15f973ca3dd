//! The `kedge_runs` projection: one summary per run, a cache of its journal
//! (docs/ARCHITECTURE.md, "The bridge and the runs projection").
//!
//! Key `<tenant>.<run_id>` ([`key`]), value a JSON [`RunSummary`] carrying `seq`, the journal
//! sequence it was folded through. Two services write it, both through [`Store`] (a
//! compare-and-set that never lets a stale summary win): the step service, the runs' decision
//! writer, from the fold it holds after each drive; and the projector (`kedge_projector`,
//! `kedge serve projector`), from the runs' run-level decisions, as the net under it and the
//! list's rebuild (`kedge runs rebuild`). The bridge (`GET /v1/runs`, the `max_active_runs`
//! count) and `kedge runs list` read it through [`Projection`]. What the sides share lives here
//! because services never import each other (docs/ARCHITECTURE.md, "Map of the house").
//!
//! Nobody waits on it: a run that is a moment old may be missing from a list (the list is
//! eventually consistent), and everything about one run is answered from its journal.

use async_nats::jetstream::kv::{self, Operation};
use kedge_core::event::{OutputValidation, Timestamp, Usage, WaitReason};
use kedge_core::ids::{AgentName, RunId, TenantId};
use kedge_core::subjects::{self, RUNS_BUCKET, RUNS_BUCKET_STREAM};
use kedge_core::{FoldError, RunState, RunStatus};
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

impl RunSummary {
    /// The summary of a run folded through `state.last_seq`.
    pub fn of(state: &RunState) -> RunSummary {
        RunSummary {
            run_id: state.run_id.clone(),
            tenant: state.bundle.tenant.clone(),
            agent: state.bundle.agent.clone(),
            status: state.status,
            finished: kedge_core::decide::finished(state),
            turn: state.turn,
            step: state.step.get(),
            waiting_on: state.waiting_on(),
            queued: state.queued.clone(),
            usage: state.usage,
            // The validation of the run's last success (a revived run's is cleared).
            validation: match state.status {
                RunStatus::Succeeded => state.validation.clone(),
                _ => None,
            },
            created_at: state.created_at,
            updated_at: state.updated_at,
            seq: state.last_seq,
        }
    }
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
        Ok(Projection {
            kv,
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

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    Written,
    /// The stored summary was as new or newer; nothing written.
    Stale,
}

/// What is stored for a run, as far as one process knows: the sequence its summary was folded
/// through, the KV revision holding it, and the run's tenant (its key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known {
    pub seq: u64,
    pub revision: u64,
    pub tenant: TenantId,
}

/// What a write starts from (see [`Store::store`]).
#[derive(Debug, Clone)]
pub enum Hint {
    /// Read the key first.
    Unknown,
    /// Probably never written: create it.
    Absent,
    /// Probably this (this process stored or found it): compare-and-set on its revision.
    Stored(Known),
}

/// Compare-and-set attempts of one write before it gives up (each lost to a newer write).
const CAS_TRIES: usize = 16;

/// Write handle on the `kedge_runs` bucket: a summary is stored only over an older one.
#[derive(Debug, Clone)]
pub struct Store {
    kv: kv::Store,
    /// The read side, on the same bucket.
    read: Projection,
}

impl Store {
    pub async fn open(rt: &Runtime) -> Result<Store, RuntimeError> {
        let read = Projection::open(rt).await?;
        Ok(Store {
            kv: read.kv.clone(),
            read,
        })
    }

    /// Writes `summary` unless the stored one is newer (or, unless `overwrite_equal`, as new),
    /// starting from what the caller believes is stored (`hint`): with a right guess the write
    /// is one request (a compare-and-set on the believed revision, or a create), with a wrong
    /// one the compare-and-set fails and the write goes on as without a guess (read the key,
    /// compare, compare-and-set; a lost race reads again). Returns what is stored afterwards.
    pub async fn store(
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
                    // Stored by this process; a later write by anyone is newer still.
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
            match self.read.entry(&key).await? {
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

    /// What is stored for the run of `tenant` and `run`: `None` when nothing is (or the key was
    /// deleted).
    pub async fn known(
        &self,
        tenant: &TenantId,
        run: &RunId,
    ) -> Result<Option<Known>, ProjectionError> {
        Ok(self
            .read
            .entry(&key(tenant, run))
            .await?
            .map(|(revision, stored)| Known {
                seq: stored.map_or(0, |s| s.seq),
                revision,
                tenant: tenant.clone(),
            }))
    }

    /// Every key in the bucket (a rebuild's sweep).
    pub async fn keys(&self) -> Result<Vec<String>, ProjectionError> {
        use futures::TryStreamExt as _;
        self.kv
            .keys()
            .await
            .map_err(|e| ProjectionError::Kv(e.to_string()))?
            .try_collect()
            .await
            .map_err(|e| ProjectionError::Kv(e.to_string()))
    }

    /// Removes a run's summary (a rebuild, for runs no longer in the journal).
    pub async fn remove(&self, key: &str) -> Result<(), ProjectionError> {
        self.kv
            .delete(key)
            .await
            .map_err(|e| ProjectionError::Kv(e.to_string()))
    }
}
