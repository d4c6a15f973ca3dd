//! Results this runner holds and could not journal yet, kept on its disk until it can
//! (docs/ARCHITECTURE.md "Takeover", "A late result wins over a person").
//!
//! A runner cut from the broker keeps trying to journal the result of a call it made
//! (`keep_trying` in the service). The result is written here too — when the broker is out of
//! reach as the result arrives, or once a write of it has failed — so that a runner killed or
//! restarted meanwhile still delivers it: a tool service starting on the same workspace root
//! journals every result it finds here (`redeliver_held` in the service), under the operation's own
//! msg id (at most one outcome lands) and only as an input the fold accepts for an operation
//! with no result yet. The file goes once the result is in the journal.
//!
//! Files live in `<workspace_root>/.kedge-held/<operation id>.json` (not a run id, so the
//! workspace sweep leaves the directory alone). What is read back is checked like anything
//! else that enters: a file that does not parse, or whose name is not its operation's id, is
//! set aside as `<name>.bad` and logged, never journaled.

use std::path::{Path, PathBuf};

use kedge_core::ids::OperationId;
use serde::{Deserialize, Serialize};

/// The directory under the workspace root.
const DIR: &str = ".kedge-held";

/// One held result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldResult {
    pub op: OperationId,
    pub content: String,
    pub is_error: bool,
    pub stopped: bool,
}

/// The held results of a workspace root.
#[derive(Debug, Clone)]
pub struct HeldResults {
    dir: PathBuf,
}

impl HeldResults {
    pub fn new(workspace_root: &Path) -> Self {
        HeldResults {
            dir: workspace_root.join(DIR),
        }
    }

    fn path(&self, op: &OperationId) -> PathBuf {
        self.dir.join(format!("{op}.json"))
    }

    /// Writes `held` to disk (synced, then renamed into place: a crash leaves the old file or
    /// the new one, never half of one). A failure is logged: the result is still being written
    /// to the journal from memory.
    pub async fn keep(&self, held: &HeldResult) {
        let path = self.path(&held.op);
        let dir = self.dir.clone();
        let bytes = match serde_json::to_vec(held) {
            Ok(bytes) => bytes,
            Err(e) => {
                tracing::warn!(error = %e, "cannot encode a held result");
                return;
            }
        };
        let written = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            use std::io::Write as _;
            std::fs::create_dir_all(&dir)?;
            let tmp = path.with_extension("json.tmp");
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        })
        .await;
        match written {
            Ok(Ok(())) => {
                tracing::info!(op = %held.op, "result kept on disk until it is journaled")
            }
            Ok(Err(e)) => tracing::warn!(op = %held.op, error = %e, "cannot keep a result on disk"),
            Err(e) => tracing::warn!(op = %held.op, error = %e, "cannot keep a result on disk"),
        }
    }

    /// Forgets `op`'s held result (it is in the journal). Nothing held: nothing to do.
    pub async fn release(&self, op: &OperationId) {
        match tokio::fs::remove_file(self.path(op)).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(%op, error = %e, "cannot remove a held result"),
        }
    }

    /// Every held result on disk; files that are not one are set aside (`.bad`) and logged.
    pub async fn all(&self) -> Vec<HeldResult> {
        let mut found = Vec::new();
        let mut entries = match tokio::fs::read_dir(&self.dir).await {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return found,
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot read the held results");
                return found;
            }
        };
        while let Ok(Some(entry)) = entries.next_entry().await {
            let path = entry.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let Some(stem) = name.strip_suffix(".json") else {
                continue;
            };
            let parsed = tokio::fs::read(&path)
                .await
                .ok()
                .and_then(|bytes| serde_json::from_slice::<HeldResult>(&bytes).ok())
                .filter(|held| held.op.to_string() == stem);
            match parsed {
                Some(held) => found.push(held),
                None => {
                    tracing::warn!(file = %path.display(), "not a held result; set aside");
                    let _ = tokio::fs::rename(&path, path.with_extension("json.bad")).await;
                }
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kedge_core::StepNo;
    use kedge_core::ids::RunId;

    fn op(i: u32) -> OperationId {
        let run: RunId = "run_heldtest".parse().expect("valid");
        OperationId::new(&run, StepNo(1), i)
    }

    #[tokio::test]
    async fn held_results_round_trip_and_bad_files_are_set_aside() {
        let root = tempfile::tempdir().expect("dir");
        let held = HeldResults::new(root.path());
        assert!(held.all().await.is_empty(), "nothing held yet");
        let one = HeldResult {
            op: op(0),
            content: "paid".into(),
            is_error: false,
            stopped: false,
        };
        held.keep(&one).await;
        assert_eq!(held.all().await, vec![one.clone()]);
        // A file whose name is not its operation's id, and one that is not JSON.
        let dir = root.path().join(DIR);
        let moved = HeldResult {
            op: op(1),
            ..one.clone()
        };
        std::fs::write(
            dir.join(format!("{}.json", op(2))),
            serde_json::to_vec(&moved).expect("JSON"),
        )
        .expect("write");
        std::fs::write(dir.join("junk.json"), b"{not json").expect("write");
        assert_eq!(held.all().await, vec![one.clone()]);
        assert!(dir.join("junk.json.bad").exists(), "set aside");
        held.release(&one.op).await;
        held.release(&one.op).await;
        assert!(held.all().await.is_empty(), "released");
    }
}
