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
    /// `KEDGE_PARK_LEASES`, `KEDGE_INLINE_TOOLS`, `KEDGE_ADAPTIVE_CONCURRENCY` and `KEDGE_SANDBOX`.
    pub(super) fn apply_workers_env(
        &mut self,
        get: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        if let Some(v) = get("KEDGE_REPLICAS") {
            self.replicas = num("KEDGE_REPLICAS", &v)?;
        }
        if let Some(v) = get("KEDGE_WORKER_ID") {
            self.worker_id = v
                .parse()
                .map_err(|e: kedge_core::ids::IdError| ConfigError::Env {
                    var: "KEDGE_WORKER_ID",
                    reason: format!(
                        "{e} (it names the worker's liveness subjects: 1 to 128 of A-Z a-z 0-9 _ -)"
                    ),
                })?;
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
        if let Some(v) = get("KEDGE_INLINE_TOOLS") {
            self.inline_tools = flag("KEDGE_INLINE_TOOLS", &v)?;
        }
        if let Some(v) = get("KEDGE_ADAPTIVE_CONCURRENCY") {
            self.adaptive_concurrency = flag("KEDGE_ADAPTIVE_CONCURRENCY", &v)?;
        }
        if let Some(v) = get("KEDGE_LIGHT_LANE") {
            self.light_lane = flag("KEDGE_LIGHT_LANE", &v)?;
        }
        if let Some(v) = get("KEDGE_SHARED_NICE") {
            self.shared_nice = num("KEDGE_SHARED_NICE", &v)?;
        }
        if let Some(v) = get("KEDGE_SANDBOX") {
            self.sandbox = v.parse().map_err(|reason| ConfigError::Env {
                var: "KEDGE_SANDBOX",
                reason,
            })?;
        }
        Ok(())
    }

    /// The replicas and the concurrency limits (a worker id is valid by its type).
    pub(super) fn check_workers(&self) -> Result<(), ConfigError> {
        if !matches!(self.replicas, 1..=5) {
            return Err(ConfigError::Invalid {
                field: "replicas",
                reason: format!("{} is not between 1 and 5", self.replicas),
            });
        }
        if self.shared_nice > 19 {
            return Err(ConfigError::Invalid {
                field: "shared_nice",
                reason: format!("{} is not a nice value between 0 and 19", self.shared_nice),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::env_of;

    #[test]
    fn the_shared_threads_nice_value_is_between_0_and_19() {
        let mut c = Config::default();
        assert_eq!(c.shared_nice, 10, "lowered by default");
        c.apply_workers_env(&env_of(&[("KEDGE_SHARED_NICE", "0".into())]))
            .expect("a nice value");
        assert_eq!(c.shared_nice, 0);
        c.check_workers().expect("0 is valid");
        c.apply_workers_env(&env_of(&[("KEDGE_SHARED_NICE", "20".into())]))
            .expect("a number");
        let err = c.check_workers().expect_err("20 is not a nice value");
        assert!(err.to_string().contains("shared_nice"), "{err}");
        let err = c
            .apply_workers_env(&env_of(&[("KEDGE_SHARED_NICE", "-5".into())]))
            .expect_err("not a u8");
        assert!(err.to_string().contains("KEDGE_SHARED_NICE"), "{err}");
    }

    #[test]
    fn a_worker_id_is_a_subject_token_from_the_environment_and_from_a_file() {
        let mut c = Config::default();
        assert!(
            c.worker_id.as_str().starts_with("w-"),
            "a fresh id by default"
        );
        c.apply_workers_env(&env_of(&[("KEDGE_WORKER_ID", "step-a-1".into())]))
            .expect("a token");
        assert_eq!(c.worker_id.as_str(), "step-a-1");
        for bad in ["", "a.b", "a b", "w>", "é", &"w".repeat(129)] {
            let err = c
                .apply_workers_env(&env_of(&[("KEDGE_WORKER_ID", bad.to_owned())]))
                .expect_err(bad);
            assert!(err.to_string().contains("KEDGE_WORKER_ID"), "{err}");
        }
        let from_file: Result<Config, _> = serde_json::from_str(r#"{"worker_id": "a.b"}"#);
        assert!(
            from_file.is_err(),
            "a file's worker id is checked as it is read"
        );
    }
}
