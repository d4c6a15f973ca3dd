//! A run's slot of its concurrency key (docs/ARCHITECTURE.md "Concurrency keys and
//! priorities"): asked for before the step that starts the run's work (`run.started`, or
//! `run.revived`), given back once the run ended. The record's transitions are the core's
//! (`kedge_core::concurrency`); the bucket is `kedge_runtime::slots`.

use kedge_core::concurrency::{Admission, claim_of, queued, starts_work};
use kedge_core::decide::StepPlan;
use kedge_core::fold::RunState;
use kedge_runtime::slots::{SlotError, Slots};

use super::commit::Writing;
use super::{DriveError, Driver};

/// What [`Driver::admit`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admit {
    /// The plan goes on (the run holds a slot, or needs none).
    Go,
    /// The key is at its limit: the run waits for `slot.granted`.
    Wait,
    /// The run moved on while its wait was being journaled: decide again.
    Again,
}

impl Driver {
    /// The bucket, opened on first use.
    async fn slots(&self) -> Result<Slots, DriveError> {
        let js = self.rt.js.clone();
        self.slots
            .get_or_try_init(|| async move { Slots::open(&js).await })
            .await
            .cloned()
            .map_err(DriveError::from)
    }

    /// Whether `plan` may go on: a plan that starts the run's work needs a slot of the run's key
    /// (a run without a key needs none). [`Admit::Wait`]: the key is at its limit, the run
    /// journaled (once) that it waits, and a `slot.granted` will wake it.
    pub(super) async fn admit(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        plan: &StepPlan,
    ) -> Result<Admit, DriveError> {
        let Some(conc) = state.bundle.concurrency.clone() else {
            return Ok(Admit::Go);
        };
        if !starts_work(&plan.start) {
            return Ok(Admit::Go);
        }
        let slots = self.slots().await?;
        let claim = claim_of(state, &conc);
        let admission = slots.take(&state.bundle.tenant, &conc, &claim).await?;
        tracing::debug!(run_id = %state.run_id, key = %conc.key, ?admission, "slot asked");
        match admission {
            Admission::Granted => Ok(Admit::Go),
            Admission::Queued { place } => {
                if let Some(draft) = queued(state, &conc, place) {
                    // A commit that does not land (an input came: maybe the grant) decides again.
                    if !self.commit(state, w, vec![draft]).await? {
                        return Ok(Admit::Again);
                    }
                }
                Ok(Admit::Wait)
            }
            Admission::Full => Err(DriveError::Slots(SlotError::Unavailable(format!(
                "concurrency key {} lists too many runs; trying again later",
                conc.key
            )))),
        }
    }

    /// Gives back the slot of a run that ended (idempotent: a run the record does not list
    /// changes nothing), waking the next waiting runs. A failure is logged: the reconciler frees
    /// the slot of a finished run later.
    pub(super) async fn release_slot(&self, state: &RunState) {
        let Some(conc) = &state.bundle.concurrency else {
            return;
        };
        let released = match self.slots().await {
            Ok(slots) => {
                slots
                    .release(
                        &self.rt.journal,
                        &state.bundle.tenant,
                        &conc.key,
                        &state.run_id,
                    )
                    .await
            }
            Err(DriveError::Slots(e)) => Err(e),
            Err(e) => Err(SlotError::Unavailable(e.to_string())),
        };
        match released {
            Ok(promoted) => {
                tracing::debug!(run_id = %state.run_id, key = %conc.key, ?promoted, "slot released");
            }
            Err(e) => {
                tracing::warn!(run_id = %state.run_id, key = %conc.key, error = %e, "could not release the run's slot; the reconciler will");
            }
        }
    }
}
