//! Removing the workspaces of purged runs (retention).
//!
//! A run's workspace (`<workspace_root>/<run_id>/`) is on the host of the tool service that ran
//! its tools, which may not be the host that purges the run. So each tool service sweeps its own
//! workspace root every `retention.workspace_sweep` ([`sweeper`]) and removes the directory of
//! every run whose journal is gone: a run is purged only once finished (the journal is its last
//! part to go), and a workspace is made only for a tool the journal decided, so a run directory
//! with no journal behind it belongs to a purged run. Whoever purged it (the retention service or
//! `kedge runs purge`) needs no way to reach the tool hosts, a tool host that was down during the
//! purge catches up on its next sweep, and nothing but the journal is trusted to say a run is
//! gone (a message claiming so could be forged). The cost of a sweep is one lookup per directory
//! in the root, which retention keeps to the runs not yet purged.
//!
//! A directory changed in the last minute is left for the next sweep (a lagging replica could
//! answer for a run whose first tool call just made it), as are names that are not run ids.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kedge_core::ids::RunId;
use kedge_journal::Journal;

/// A directory younger than this is not removed.
const SETTLE: Duration = Duration::from_secs(60);

/// What one [`sweep`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Swept {
    /// Run directories looked at.
    pub looked_at: usize,
    /// Removed: their run's journal is gone.
    pub removed: Vec<RunId>,
}

/// Removes from `root` the workspace of every run with no journal left (see the module docs).
/// `settle`: directories modified more recently than this are left for a later sweep.
pub async fn sweep(root: &Path, journal: &Journal, settle: Duration) -> std::io::Result<Swept> {
    let mut swept = Swept::default();
    let mut entries = match tokio::fs::read_dir(root).await {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(swept),
        Err(e) => return Err(e),
    };
    while let Some(entry) = entries.next_entry().await? {
        let Some(run) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<RunId>().ok())
        else {
            continue;
        };
        let Ok(meta) = tokio::fs::symlink_metadata(entry.path()).await else {
            continue;
        };
        if !meta.is_dir() {
            continue;
        }
        swept.looked_at += 1;
        let recent = meta
            .modified()
            .ok()
            .and_then(|m| m.elapsed().ok())
            .is_none_or(|age| age < settle);
        if recent {
            continue;
        }
        // A direct get (any replica may answer) finds most runs cheaply; that a run is gone is
        // asked of the stream leader too (a replica may trail a run created a moment ago)
        // before anything is removed.
        let gone = match journal.last_seq(&run).await {
            Ok(None) => journal
                .read_at_most(&run, 0, 1)
                .await
                .map(|p| p.events.is_empty()),
            Ok(Some(_)) => Ok(false),
            Err(e) => Err(e),
        };
        match gone {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                tracing::warn!(run_id = %run, error = %e, "workspace sweep: cannot look the run up; kept");
                continue;
            }
        }
        let path: PathBuf = entry.path();
        match tokio::fs::remove_dir_all(&path).await {
            Ok(()) => {
                tracing::info!(run_id = %run, path = %path.display(), "workspace of a purged run removed");
                swept.removed.push(run);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(run_id = %run, error = %e, "workspace of a purged run not removed")
            }
        }
    }
    Ok(swept)
}

/// Sweeps `root` every `every` for as long as the process lives.
pub async fn sweeper(root: PathBuf, journal: Journal, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        match sweep(&root, &journal, SETTLE.min(every)).await {
            Ok(swept) if !swept.removed.is_empty() => tracing::info!(
                looked_at = swept.looked_at,
                removed = swept.removed.len(),
                "workspace sweep"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(root = %root.display(), error = %e, "workspace sweep failed"),
        }
    }
}
