//! Helpers for the integration tests: the real reference MCP servers, installed by
//! `scripts/mcp-servers.sh` into `.tools/`, launched through small shell wrappers that record what
//! the client sends and the pid of each server started. Every process a test starts is killed by
//! pid when its guard drops, pass or fail.

#![allow(
    dead_code,
    clippy::unwrap_used,
    reason = "test helpers: a failed expectation is a panic"
)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kedge_mcp::ServerConfig;
use serde_json::{Map, Value, json};

/// The repository root (this crate is `crates/mcp`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The launcher `.tools/bin/<name>`; panics with the fix when it is missing.
pub fn launcher(name: &str) -> PathBuf {
    let path = repo_root().join(".tools/bin").join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `bash scripts/mcp-servers.sh` (from the repo root) to install the reference MCP servers",
        path.display()
    );
    path.canonicalize().unwrap()
}

/// `{"message": text}`.
pub fn echo_args(text: &str) -> Map<String, Value> {
    obj(json!({ "message": text }))
}

pub fn obj(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
}

/// A `stop` that never fires.
pub fn never() -> std::future::Pending<()> {
    std::future::pending()
}

pub const PATIENT: Duration = Duration::from_secs(30);

/// A temp dir holding the transcript of what the client sent and the pids of the servers
/// started; kills those pids on drop. Declare it before the pool, so it drops after it.
///
/// The dir is kept (and its path printed) when the test fails, or always with
/// `KEDGE_MCP_TEST_KEEP=1`.
pub struct Recorder {
    dir: Option<tempfile::TempDir>,
}

impl Recorder {
    pub fn new() -> Self {
        Self {
            dir: Some(tempfile::tempdir().unwrap()),
        }
    }

    fn path(&self) -> &Path {
        self.dir.as_ref().map(tempfile::TempDir::path).unwrap()
    }

    pub fn log_path(&self) -> PathBuf {
        self.path().join("client-to-server.jsonl")
    }

    pub fn pids_path(&self) -> PathBuf {
        self.path().join("pids")
    }

    fn env(&self, launcher: &Path) -> BTreeMap<String, String> {
        BTreeMap::from([
            (
                "KEDGE_TEST_LOG".into(),
                self.log_path().display().to_string(),
            ),
            (
                "KEDGE_TEST_PIDS".into(),
                self.pids_path().display().to_string(),
            ),
            ("KEDGE_TEST_LAUNCHER".into(), launcher.display().to_string()),
        ])
    }

    /// server-everything over stdio, with every byte the client sends appended to
    /// [`Self::log_path`] (`tee`) and the server's pid to [`Self::pids_path`].
    pub fn everything_teed(&self) -> ServerConfig {
        let script = r#"tee -a "$KEDGE_TEST_LOG" | sh -c 'echo $$ >> "$KEDGE_TEST_PIDS"; exec "$0" stdio' "$KEDGE_TEST_LAUNCHER""#;
        ServerConfig::Stdio {
            command: "sh".into(),
            args: vec!["-c".into(), script.into()],
            env: self.env(&launcher("mcp-server-everything")),
            sandbox: None,
        }
    }

    /// server-everything over stdio as the pool's direct child (`exec`), pid recorded.
    pub fn everything_direct(&self) -> ServerConfig {
        let script = r#"echo $$ >> "$KEDGE_TEST_PIDS"; exec "$KEDGE_TEST_LAUNCHER" stdio"#;
        ServerConfig::Stdio {
            command: "sh".into(),
            args: vec!["-c".into(), script.into()],
            env: self.env(&launcher("mcp-server-everything")),
            sandbox: None,
        }
    }

    /// The JSON-RPC messages the client sent so far.
    pub fn messages(&self) -> Vec<Value> {
        std::fs::read_to_string(self.log_path())
            .unwrap_or_default()
            .lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| {
                serde_json::from_str(line).unwrap_or_else(|e| panic!("bad JSON line {line:?}: {e}"))
            })
            .collect()
    }

    /// Messages with this `method`.
    pub fn with_method(&self, method: &str) -> Vec<Value> {
        self.messages()
            .into_iter()
            .filter(|m| m["method"] == method)
            .collect()
    }

    /// Pids of the servers started so far, in order.
    pub fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.pids_path())
            .unwrap_or_default()
            .lines()
            .map(|line| line.trim().parse().unwrap())
            .collect()
    }

    /// The id of the `tools/call` request that carried `_meta."kedge/operation_id" == op`.
    pub fn call_request_id(&self, operation_id: &str) -> Option<Value> {
        self.with_method("tools/call")
            .into_iter()
            .find(|m| m["params"]["_meta"]["kedge/operation_id"] == operation_id)
            .map(|m| m["id"].clone())
    }

    /// Waits (≤ 3 s) until the transcript has a `notifications/cancelled` for the request that
    /// carried `operation_id`, and returns that notification's params.
    pub async fn wait_for_cancel_of(&self, operation_id: &str) -> Value {
        let give_up = Instant::now() + Duration::from_secs(3);
        loop {
            if let Some(id) = self.call_request_id(operation_id) {
                let cancel = self
                    .with_method("notifications/cancelled")
                    .into_iter()
                    .find(|m| m["params"]["requestId"] == id);
                if let Some(cancel) = cancel {
                    return cancel["params"].clone();
                }
            }
            assert!(
                Instant::now() < give_up,
                "no notifications/cancelled for the tools/call of {operation_id}; transcript:\n{}",
                std::fs::read_to_string(self.log_path()).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        for pid in self.pids() {
            kill(pid);
        }
        keep_if_wanted(self.dir.take());
    }
}

/// Keeps a test's temp dir when the test is failing (or `KEDGE_MCP_TEST_KEEP` is set).
pub fn keep_if_wanted(dir: Option<tempfile::TempDir>) {
    if let Some(dir) = dir
        && (std::thread::panicking() || std::env::var_os("KEDGE_MCP_TEST_KEEP").is_some())
    {
        eprintln!("kept test files in {}", dir.keep().display());
    }
}

/// SIGKILL one process by pid (no-op if it is gone).
pub fn kill(pid: u32) {
    let _ = std::process::Command::new("kill")
        .arg("-KILL")
        .arg(pid.to_string())
        .stderr(std::process::Stdio::null())
        .status();
}
