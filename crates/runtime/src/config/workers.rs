//! The process and its workers: its id (`worker_id`), the replicas of the streams it creates, how
//! many runs and tool operations it drives at once, whether it parks leases, and what its tools
//! may do: the workspace root, the shell allowlist, the sandbox ([`SandboxKind`]), the test-only
//! ledger tool. Their variables and checks are in docs/CONFIG.md's table.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::env::{flag, num};
use super::{Config, ConfigError};

/// What confines the `shell` tool's commands ([`Config::sandbox`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxKind {
    /// bubblewrap: the run's workspace only, no network, resource limits.
    Bwrap,
    /// No confinement (development only).
    Unconfined,
}

impl std::str::FromStr for SandboxKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "bwrap" => Ok(SandboxKind::Bwrap),
            "unconfined" => Ok(SandboxKind::Unconfined),
            other => Err(format!("`{other}` is not `bwrap` or `unconfined`")),
        }
    }
}

impl Config {
    /// Applies `KEDGE_REPLICAS`, `KEDGE_WORKER_ID`, `KEDGE_WORKSPACE_ROOT`, `KEDGE_LEDGER_TOOL`,
    /// `KEDGE_PARK_LEASES` and `KEDGE_SANDBOX`.
    pub(super) fn apply_workers_env(
        &mut self,
        get: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        if let Some(v) = get("KEDGE_REPLICAS") {
            self.replicas = num("KEDGE_REPLICAS", &v)?;
        }
        if let Some(v) = get("KEDGE_WORKER_ID") {
            self.worker_id = v;
        }
        if let Some(v) = get("KEDGE_WORKSPACE_ROOT") {
            self.workspace_root = PathBuf::from(v);
        }
        if let Some(v) = get("KEDGE_LEDGER_TOOL") {
            self.ledger_tool = flag("KEDGE_LEDGER_TOOL", &v)?;
        }
        if let Some(v) = get("KEDGE_PARK_LEASES") {
            self.park_leases = flag("KEDGE_PARK_LEASES", &v)?;
        }
        if let Some(v) = get("KEDGE_SANDBOX") {
            self.sandbox = v.parse().map_err(|reason| ConfigError::Env {
                var: "KEDGE_SANDBOX",
                reason,
            })?;
        }
        Ok(())
    }

    /// The replicas, the worker id and the concurrency limits.
    pub(super) fn check_workers(&self) -> Result<(), ConfigError> {
        if !matches!(self.replicas, 1..=5) {
            return Err(ConfigError::Invalid {
                field: "replicas",
                reason: format!("{} is not between 1 and 5", self.replicas),
            });
        }
        if !kedge_core::subjects::is_token(&self.worker_id) {
            return Err(ConfigError::Invalid {
                field: "worker_id",
                reason: format!(
                    "`{}` must be 1 to 128 of A-Z a-z 0-9 _ - (it names the worker's liveness subjects)",
                    self.worker_id.escape_debug()
                ),
            });
        }
        if self.step_concurrency == 0 || self.tool_concurrency == 0 {
            return Err(ConfigError::Invalid {
                field: "step_concurrency/tool_concurrency",
                reason: "must be at least 1".into(),
            });
        }
        Ok(())
    }
}
