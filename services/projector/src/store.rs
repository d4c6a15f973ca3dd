//! The projector's writes to the `kedge_runs` bucket: [`Writer`] (project a run: read, fold,
//! store through [`Store`], the compare-and-set that never lets a stale summary win). The
//! read side (get, list) is [`kedge_runtime::projection::Projection`].

use async_nats::jetstream::Context;
use kedge_core::ids::RunId;
use kedge_journal::{Delivered, Journal, Recorded};
use kedge_runtime::metrics::{self, ProjectorRead};
use kedge_runtime::projection::{Hint, Known, ProjectionError, RunSummary, Store, Stored};
use kedge_runtime::{Runtime, RuntimeError};

use super::summarize;
use super::summary::Folded;

/// Write handle on the `kedge_runs` bucket.
#[derive(Debug, Clone)]
pub struct Writer {
    pub(super) store: Store,
    pub(super) js: Context,
    journal: Journal,
}

impl Writer {
    pub async fn open(rt: &Runtime) -> Result<Writer, RuntimeError> {
        Ok(Writer {
            store: Store::open(rt).await?,
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
            .store
            .store(summary, overwrite_equal, Hint::Unknown)
            .await?
            .0)
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
        let (stored, known) = self.store.store(&summary, false, hint).await?;
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
        let (stored, known) = self.store.store(&summary, overwrite_equal, hint).await?;
        Ok(Some((summary, stored, known)))
    }

    /// Removes a run's summary (rebuild, for runs no longer in the journal).
    pub(super) async fn remove(&self, key: &str) -> Result<(), ProjectionError> {
        self.store.remove(key).await
    }
}
