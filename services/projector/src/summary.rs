//! Building a run's summary: the fold of its journal ([`summarize`]), and the fold the
//! projector keeps between a run's decisions ([`Folded`]).

use kedge_core::{FoldError, RunState};
use kedge_journal::Recorded;
use kedge_runtime::projection::RunSummary;

/// The summary of a run's whole journal; `None` for a run with no events.
pub fn summarize(events: &[Recorded]) -> Result<Option<RunSummary>, FoldError> {
    Ok(Folded::of(events)?.map(|folded| folded.summary()))
}

/// A run's fold as far as it was read: what the projector keeps of a run between two of its
/// decisions, so that the next projection reads and folds only the events after it instead of
/// the whole journal again.
#[derive(Debug, Clone)]
pub(super) struct Folded {
    pub(super) state: RunState,
}

impl Folded {
    /// The fold of a run's whole journal; `None` for a run with no events.
    pub(super) fn of(events: &[Recorded]) -> Result<Option<Folded>, FoldError> {
        if events.is_empty() {
            return Ok(None);
        }
        let state = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope)))?;
        Ok(Some(Folded { state }))
    }

    /// Folds in the events that follow the ones folded (in order, as the whole journal's
    /// fold would).
    pub(super) fn apply(&mut self, events: &[Recorded]) -> Result<(), FoldError> {
        for r in events {
            self.state.apply(r.seq, &r.envelope)?;
        }
        Ok(())
    }

    pub(super) fn summary(&self) -> RunSummary {
        RunSummary::of(&self.state)
    }
}
