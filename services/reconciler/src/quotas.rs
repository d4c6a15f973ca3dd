//! The repair of the tenants' unfinished-run counts (docs/ARCHITECTURE.md "Quotas"). A run is
//! counted in at its admission and out by the step service when it ends; a crash between the
//! end and the count-out (or a task admitted that never became a run: rejected by intake for
//! another reason, or its message lost) would hold a slot of the tenant's `max_active_runs`
//! for ever. Every `quotas.repair_secs` the reconciler checks each run counted against each
//! tenant: one whose journal ends it (a terminal status) is counted out; one with no journal in
//! two checks in a row (admitted, never created) too.

use std::collections::BTreeSet;
use std::time::Duration;

use kedge_core::ids::{RunId, TenantId};
use kedge_runtime::Runtime;

/// Runs the repair every `quotas.repair_secs` until the task is aborted.
pub async fn repair_loop(rt: Runtime) {
    let every = Duration::from_secs(rt.config.quotas.repair_secs.max(1));
    let mut absent = BTreeSet::new();
    loop {
        tokio::time::sleep(every).await;
        match repair_once(&rt, &mut absent).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(counted_out = n, "tenant quotas repaired"),
            Err(e) => tracing::warn!(error = %e, "tenant quota repair failed"),
        }
    }
}

/// One pass: counts out the runs counted as unfinished that are not (`absent`: the runs found
/// without a journal by the previous pass). How many were counted out.
pub async fn repair_once(
    rt: &Runtime,
    absent: &mut BTreeSet<(TenantId, RunId)>,
) -> Result<usize, String> {
    let Some(quotas) = rt.quotas_if_any().await.map_err(|e| e.to_string())? else {
        return Ok(0);
    };
    let mut still_absent = BTreeSet::new();
    let mut counted_out = 0;
    for tenant in quotas.tenants().await.map_err(|e| e.to_string())? {
        for run in quotas.active(&tenant).await.map_err(|e| e.to_string())? {
            let over = match ended(rt, &run).await {
                Ok(Some(true)) => true,
                Ok(Some(false)) => false,
                Ok(None) => {
                    let key = (tenant.clone(), run.clone());
                    let twice = absent.contains(&key);
                    still_absent.insert(key);
                    twice
                }
                Err(e) => {
                    tracing::warn!(run_id = %run, error = %e, "cannot check a counted run");
                    false
                }
            };
            if over {
                quotas
                    .release(&tenant, &run)
                    .await
                    .map_err(|e| e.to_string())?;
                tracing::info!(run_id = %run, %tenant, "counted out of its tenant's unfinished runs");
                counted_out += 1;
            }
        }
    }
    *absent = still_absent;
    Ok(counted_out)
}

/// Whether `run` has ended by its journal; `None` when it has no `run.created`.
async fn ended(rt: &Runtime, run: &RunId) -> Result<Option<bool>, String> {
    let events = rt.journal.read(run, 0).await.map_err(|e| e.to_string())?;
    if !events
        .iter()
        .any(|r| r.envelope.event_type() == kedge_core::event::EventType::RunCreated)
    {
        return Ok(None);
    }
    let state =
        kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope))).map_err(|e| e.to_string())?;
    Ok(Some(state.status.is_terminal()))
}
