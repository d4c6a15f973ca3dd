//! Building a run's summary: the fold of its journal ([`summarize`]), and the fold the
//! projector keeps between a run's decisions ([`Folded`]).

use kedge_core::decide::finished;
use kedge_core::event::Timestamp;
use kedge_core::{FoldError, RunState, RunStatus};
use kedge_journal::Recorded;
use kedge_runtime::projection::RunSummary;

/// The summary of a run's whole journal; `None` for a run with no events.
pub fn summarize(events: &[Recorded]) -> Result<Option<RunSummary>, FoldError> {
    Ok(Folded::of(events)?.map(|folded| folded.summary()))
}

/// A run's fold as far as it was read, with the times its summary carries: what the projector
/// keeps of a run between two of its decisions, so that the next projection reads and folds
/// only the events after it instead of the whole journal again.
#[derive(Debug, Clone)]
pub(super) struct Folded {
    pub(super) state: RunState,
    created_at: Timestamp,
    updated_at: Timestamp,
}

impl Folded {
    /// The fold of a run's whole journal; `None` for a run with no events.
    pub(super) fn of(events: &[Recorded]) -> Result<Option<Folded>, FoldError> {
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
    pub(super) fn apply(&mut self, events: &[Recorded]) -> Result<(), FoldError> {
        for r in events {
            self.state.apply(r.seq, &r.envelope)?;
            self.updated_at = r.envelope.at;
        }
        Ok(())
    }

    pub(super) fn summary(&self) -> RunSummary {
        let state = &self.state;
        RunSummary {
            run_id: state.run_id.clone(),
            tenant: state.bundle.tenant.clone(),
            agent: state.bundle.agent.clone(),
            status: state.status,
            finished: finished(state),
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
            created_at: self.created_at,
            updated_at: self.updated_at,
            seq: state.last_seq,
        }
    }
}
