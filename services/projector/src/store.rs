//! The write side of the `kedge_runs` bucket: [`Writer`] (a compare-and-set store that never
//! lets a stale summary win, project a run). The read side (get, list) is
//! [`kedge_runtime::projection::Projection`], which the writer reads through.

use async_nats::jetstream::Context;
use async_nats::jetstream::kv;
use kedge_core::ids::{RunId, TenantId};
use kedge_core::subjects::RUNS_BUCKET;
use kedge_journal::{Delivered, Journal, Recorded};
use kedge_runtime::metrics::{self, ProjectorRead};
use kedge_runtime::projection::{Projection, ProjectionError, RunSummary, key};
use kedge_runtime::{Runtime, RuntimeError};

use super::summary::Folded;
use super::{Stored, summarize};

/// Write handle on the `kedge_runs` bucket.
#[derive(Debug, Clone)]
pub struct Writer {
    pub(super) kv: kv::Store,
    pub(super) js: Context,
    journal: Journal,
    /// The read side, on the same bucket.
    read: Projection,
}

const CAS_TRIES: usize = 16;

impl Writer {
    pub async fn open(rt: &Runtime) -> Result<Writer, RuntimeError> {
        let kv = rt
            .js
            .get_key_value(RUNS_BUCKET)
            .await
            .map_err(|e| RuntimeError::broker(format!("open bucket {RUNS_BUCKET}"), e))?;
        Ok(Writer {
            read: Projection::on(kv.clone(), rt.journal.clone()),
            kv,
            js: rt.js.clone(),
            journal: rt.journal.clone(),
        })
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

    /// [`Writer::store`], starting from what the caller believes is stored: with a right
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

    /// [`Writer::project`] of a run through at least `through`, an event of the run the
    /// broker acknowledged (the decision a projector handles), `delivered` the decisions of the
    /// run the projector holds: read by their links back to the fold
    /// ([`Journal::read_linked`]: the run's other messages fetched by sequence, no walk of the
    /// stream), else without asking the stream leader where the run ends
    /// ([`Journal::read_through`]); a later event the read did not reach is projected on its
    /// own delivery. `hint`: what the caller believes is stored. `folded`: the run's fold as
    /// this process last left it; only the events after it are read (a fold that no longer
    /// applies is started over from the whole journal). Returns the fold through the read
    /// besides.
    pub(super) async fn project_through(
        &self,
        run: &RunId,
        through: u64,
        delivered: &[Delivered<'_>],
        hint: Hint,
        folded: Option<Folded>,
    ) -> Result<Option<(RunSummary, Stored, Known, Folded)>, ProjectionError> {
        let folded = match folded {
            Some(mut known) if known.state.last_seq < through => {
                let after = known.state.last_seq;
                let events = self.events_after(run, after, through, delivered).await?;
                match known.apply(&events) {
                    Ok(()) => Some(known),
                    Err(e) => {
                        tracing::warn!(run_id = %run, error = %e, "the kept fold does not take the run's new events; folding the whole journal");
                        self.fold(
                            run,
                            &self.journal.read_through(run, 0, through).await?.events,
                        )?
                    }
                }
            }
            Some(known) => Some(known),
            None => {
                let events = self.events_after(run, 0, through, delivered).await?;
                self.fold(run, &events)?
            }
        };
        let Some(folded) = folded else {
            return Ok(None);
        };
        let summary = folded.summary();
        let (stored, known) = self.store_hinted(&summary, false, hint).await?;
        Ok(Some((summary, stored, known, folded)))
    }

    /// The run's events after `after` through at least `through`: by the links of the
    /// `delivered` decisions when they reach `after`, else read.
    async fn events_after(
        &self,
        run: &RunId,
        after: u64,
        through: u64,
        delivered: &[Delivered<'_>],
    ) -> Result<Vec<Recorded>, ProjectionError> {
        if let Some(page) = self.journal.read_linked(run, after, delivered).await?
            && page.events.last().is_some_and(|r| r.seq >= through)
        {
            metrics::projector_read(ProjectorRead::Linked);
            return Ok(page.events);
        }
        metrics::projector_read(ProjectorRead::Batched);
        Ok(self.journal.read_through(run, after, through).await?.events)
    }

    /// The fold of `events`, a run's whole journal through some sequence; `None` for none.
    fn fold(&self, run: &RunId, events: &[Recorded]) -> Result<Option<Folded>, ProjectionError> {
        Folded::of(events).map_err(|source| ProjectionError::Fold {
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

    /// Removes a run's summary (rebuild, for runs no longer in the journal).
    pub(super) async fn remove(&self, key: &str) -> Result<(), ProjectionError> {
        self.kv
            .delete(key)
            .await
            .map_err(|e| ProjectionError::Kv(e.to_string()))
    }
}

/// What is stored for a run, as far as one process knows: the sequence its summary was folded
/// through, the KV revision holding it, and the run's tenant (its key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Known {
    pub(super) seq: u64,
    pub(super) revision: u64,
    pub(super) tenant: TenantId,
}

/// What a store starts from (see [`Writer::store_hinted`]).
#[derive(Debug, Clone)]
pub(super) enum Hint {
    /// Read the key first.
    Unknown,
    /// Probably never written: create it.
    Absent,
    /// Probably this (this process stored or found it): compare-and-set on its revision.
    Stored(Known),
}
