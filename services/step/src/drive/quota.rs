//! The tenant's quotas of the day (docs/ARCHITECTURE.md "Quotas"): before a model call the
//! tenant's tokens and cost of the day are checked, and a tenant over them has its run wait on
//! its provider's list until the day window rolls (or fail, `on_exceeded: fail`); after each
//! call its reported usage is added to the day; a run that ends is counted out of its tenant's
//! unfinished runs, a revived one back in. The quotas being unreadable never stops a run: it is
//! logged, and the run goes on.

use kedge_core::Decision;
use kedge_core::decide::StepPlan;
use kedge_core::event::{
    AttemptOutcome, Draft, FailureReason, ModelAttempt, ModelSpec, RunFailed, Timestamp, Trouble,
    Usage,
};
use kedge_core::fold::RunState;
use kedge_core::quota::{Exceeded, OnExceeded};
use kedge_runtime::metrics;

use super::commit::Writing;
use super::provider::{ProviderTrouble, WaitList};
use super::{DriveError, Driver};

impl Driver {
    /// The quota of the day that holds the run's tenant now, if one does.
    pub(super) async fn quota_holds(&self, state: &RunState) -> Option<Exceeded> {
        let quotas = match self.rt.quotas_if_any().await {
            Ok(Some(q)) => q,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "tenant quotas unavailable; the call goes on");
                return None;
            }
        };
        match quotas.day_check(&state.bundle.tenant).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(e) => {
                tracing::warn!(error = %e, "tenant quotas unavailable; the call goes on");
                None
            }
        }
    }

    /// Holds the plan's attempt for the tenant's quota `over`: the run waits on its provider's
    /// list, released when the day window rolls (`provider.waiting` names the quota), or fails
    /// with `quota_exceeded` when its tenant's quota says `on_exceeded: fail`.
    pub(super) async fn hold_for_quota(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        plan: &StepPlan,
        queue: &WaitList<'_>,
        over: Exceeded,
    ) -> Result<(), DriveError> {
        let reason = over.reason();
        tracing::info!(tenant = %over.tenant, quota = over.quota.as_str(), "tenant over its quota of the day; the model is not called");
        let on_exceeded = match self.rt.quotas().await {
            Ok(q) => q.limits(&over.tenant).on_exceeded,
            Err(_) => OnExceeded::Wait,
        };
        if on_exceeded == OnExceeded::Fail {
            let end = vec![
                Draft::new(Decision::ModelAttempt(ModelAttempt {
                    request_id: plan.request_id.clone(),
                    outcome: AttemptOutcome::Held {
                        endpoint: queue.endpoint.label.clone(),
                        reason: reason.clone(),
                    },
                }))
                .step(plan.step)
                .attempt(plan.attempt),
                Draft::new(Decision::RunFailed(RunFailed {
                    reason: FailureReason::QuotaExceeded,
                    message: reason,
                    effects: Vec::new(),
                })),
            ];
            self.commit_attempt_end(state, w, &plan.request_id, |_| end.clone())
                .await?;
            return Ok(());
        }
        let until =
            Timestamp::now().saturating_add(std::time::Duration::from_secs(over.retry_after_secs));
        let mut trouble = ProviderTrouble::held(
            queue.endpoint,
            reason,
            Trouble::RateLimited,
            metrics::ProviderWait::Queued,
        );
        trouble.not_before = Some(until);
        self.wait_on_provider(state, w, plan, queue, trouble).await
    }

    /// Adds a model call's reported `usage` to the run's tenant's day, in a task of its own:
    /// the paid answer is not held for the bucket's read and compare-and-set (it is committed
    /// to the journal meanwhile, so a crash or a slow broker here cannot cost a second call),
    /// and a count that cannot be written is logged, as before.
    pub(super) fn record_quota_usage(&self, state: &RunState, model: &ModelSpec, usage: &Usage) {
        // Every tenant's calls are counted once any tenant has a limit (`kedge tenants usage`
        // shows them); none without quotas.
        if !self.rt.config.quotas.any() {
            return;
        }
        let rt = self.rt.clone();
        let tenant = state.bundle.tenant.clone();
        let price = model.price.clone();
        let usage = *usage;
        tokio::spawn(async move {
            let Ok(quotas) = rt.quotas().await else {
                return;
            };
            if let Err(e) = quotas.record_usage(&tenant, &usage, price.as_ref()).await {
                tracing::warn!(error = %e, "could not count the model call against the tenant's quota");
            }
        });
    }

    /// A run that ended (its drive ends idle in a terminal status) is counted out of its
    /// tenant's unfinished runs; one just revived (`revived`: the commit held `run.revived`) back
    /// in. Each is idempotent; a crash before it is repaired by the reconciler
    /// (docs/ARCHITECTURE.md "Quotas").
    pub(super) async fn count_active(&self, state: &RunState, revived: bool) {
        let ended = !revived && state.status.is_terminal();
        if !revived && !ended {
            return;
        }
        let Ok(Some(quotas)) = self.rt.quotas_if_any().await else {
            return;
        };
        let (tenant, run) = (&state.bundle.tenant, &state.run_id);
        let counted = if ended {
            quotas.release(tenant, run).await
        } else {
            quotas.restore(tenant, run).await
        };
        if let Err(e) = counted {
            tracing::warn!(error = %e, "could not count the run in its tenant's quota (the reconciler will)");
        }
    }
}
