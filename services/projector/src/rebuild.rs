//! Recomputing `kedge_runs` from the journal ([`rebuild`], `kedge runs rebuild`).

use kedge_runtime::Runtime;
use kedge_runtime::projection::{ProjectionError, key};
use serde::Serialize;

use super::{Stored, Writer};

/// What [`rebuild`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RebuildReport {
    /// Runs found in the journal.
    pub runs: usize,
    /// Summaries written (new, or newer than the stored one).
    pub written: usize,
    /// Summaries already up to date.
    pub unchanged: usize,
    /// Runs whose journal does not fold (left out, logged).
    pub failed: usize,
    /// Entries removed because their run is not in the journal.
    pub removed: usize,
}

/// Recomputes `kedge_runs` from the journal: every run with a `run.created` gets the summary of
/// its whole journal (written when at least as new as the stored one, so a concurrent projector
/// is never overtaken by an older fold), and entries of runs not in the journal are removed.
pub async fn rebuild(rt: &Runtime) -> Result<RebuildReport, ProjectionError> {
    let projection = Writer::open(rt)
        .await
        .map_err(|e| ProjectionError::Kv(e.to_string()))?;
    let runs = rt
        .journal
        .run_ids()
        .await
        .map_err(|e| ProjectionError::Kv(e.to_string()))?;
    let mut report = RebuildReport {
        runs: runs.len(),
        ..Default::default()
    };
    let mut keys = std::collections::HashSet::new();
    for run in &runs {
        match projection.project(run, true).await {
            Ok(Some((summary, stored))) => {
                keys.insert(key(&summary.tenant, run));
                match stored {
                    Stored::Written => report.written += 1,
                    Stored::Stale => report.unchanged += 1,
                }
            }
            Ok(None) => {}
            Err(e @ ProjectionError::Fold { .. }) => {
                tracing::error!(run_id = %run, error = %e, "run left out of the projection");
                report.failed += 1;
            }
            Err(e) => return Err(e),
        }
    }
    let stale_keys: Vec<String> = projection
        .store
        .keys()
        .await?
        .into_iter()
        .filter(|k| !keys.contains(k))
        .collect();
    for k in stale_keys {
        projection.remove(&k).await?;
        report.removed += 1;
    }
    Ok(report)
}
