//! Layered configuration: defaults, then a JSON file, then `KEDGE_*` environment variables, then
//! command-line flags (applied by the binary). `kedge --dump-config` prints the result.
//!
//! docs/CONFIG.md is the reference; every field here is listed there.

use std::path::PathBuf;

use kedge_core::config::{RelationError, Timeouts};
use serde::{Deserialize, Serialize};

/// The effective configuration of a Kedge process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// NATS server URLs (`KEDGE_NATS_URL`, comma-separated).
    pub nats_urls: Vec<String>,
    /// Replicas of streams created at startup: 1 for a single node, 3 for a cluster.
    pub replicas: usize,
    /// This process's name in leases, operation records and `tool.started` (default: a random
    /// `w-…`).
    pub worker_id: String,
    /// Where the built-in file tools keep each run's workspace (`<root>/<run_id>/`).
    pub workspace_root: PathBuf,
    /// Commands the `shell` tool may run.
    pub shell_allowlist: Vec<String>,
    /// Runs a step worker drives at once.
    pub step_concurrency: usize,
    /// Tool operations a tool worker runs at once.
    pub tool_concurrency: usize,
    /// Largest tool result kept inline in the journal, in bytes; longer output is truncated with
    /// a note.
    pub max_tool_output_bytes: usize,
    pub timeouts: Timeouts,
    /// API keys by environment-variable name, for programs that embed Kedge (the demo, tests).
    /// The environment wins. Never read from a file and never printed.
    #[serde(skip)]
    pub api_keys: std::collections::BTreeMap<String, String>,
}

impl Config {
    /// The value of an API-key variable: the environment, else [`Config::api_keys`].
    pub fn api_key(&self, var: &str) -> Option<String> {
        std::env::var(var)
            .ok()
            .filter(|v| !v.is_empty())
            .or_else(|| self.api_keys.get(var).cloned())
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            nats_urls: vec!["nats://127.0.0.1:4222".into()],
            replicas: 1,
            worker_id: format!("w-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
            workspace_root: PathBuf::from(".kedge/workspaces"),
            shell_allowlist: [
                "ls", "cat", "echo", "wc", "grep", "head", "tail", "sort", "date",
            ]
            .into_iter()
            .map(String::from)
            .collect(),
            step_concurrency: 256,
            tool_concurrency: 64,
            max_tool_output_bytes: 64 * 1024,
            timeouts: Timeouts::default(),
            api_keys: Default::default(),
        }
    }
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("config file {path}: {reason}")]
    Parse { path: PathBuf, reason: String },
    #[error("environment variable {var}: {reason}")]
    Env { var: &'static str, reason: String },
    #[error(transparent)]
    Relation(#[from] RelationError),
    #[error("{field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}

impl Config {
    /// Defaults, overlaid by `file` (if given) and the environment; checked.
    pub fn load(file: Option<&std::path::Path>) -> Result<Config, ConfigError> {
        let mut config = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
                    path: path.to_owned(),
                    reason: e.to_string(),
                })?;
                serde_json::from_str(&text).map_err(|e| ConfigError::Parse {
                    path: path.to_owned(),
                    reason: e.to_string(),
                })?
            }
            None => Config::default(),
        };
        config.apply_env(|k| std::env::var(k).ok())?;
        config.check()?;
        Ok(config)
    }

    /// Applies `KEDGE_*` variables read through `get`.
    pub fn apply_env(
        &mut self,
        get: impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        fn num<T: std::str::FromStr>(var: &'static str, v: &str) -> Result<T, ConfigError> {
            v.trim().parse().map_err(|_| ConfigError::Env {
                var,
                reason: format!("`{v}` is not a number"),
            })
        }
        if let Some(v) = get("KEDGE_NATS_URL") {
            self.nats_urls = v
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect();
        }
        if let Some(v) = get("KEDGE_REPLICAS") {
            self.replicas = num("KEDGE_REPLICAS", &v)?;
        }
        if let Some(v) = get("KEDGE_WORKER_ID") {
            self.worker_id = v;
        }
        if let Some(v) = get("KEDGE_WORKSPACE_ROOT") {
            self.workspace_root = PathBuf::from(v);
        }
        let t = &mut self.timeouts;
        for (var, field) in [
            ("KEDGE_LEASE_TTL_MS", &mut t.lease_ttl_ms),
            ("KEDGE_LEASE_RENEW_MS", &mut t.lease_renew_ms),
            ("KEDGE_MODEL_TIMEOUT_MS", &mut t.model_timeout_ms),
            ("KEDGE_STEP_ACK_WAIT_MS", &mut t.step_ack_wait_ms),
            ("KEDGE_TOOL_TIMEOUT_MS", &mut t.tool_timeout_ms),
            ("KEDGE_TOOL_ACK_WAIT_MS", &mut t.tool_ack_wait_ms),
            ("KEDGE_STALL_AFTER_MS", &mut t.stall_after_ms),
            ("KEDGE_MAX_RETRY_DELAY_MS", &mut t.max_retry_delay_ms),
        ] {
            if let Some(v) = get(var) {
                *field = num(var, &v)?;
            }
        }
        Ok(())
    }

    /// Checks the timeout relations and the other fields.
    pub fn check(&self) -> Result<(), ConfigError> {
        self.timeouts.check()?;
        if self.nats_urls.is_empty() {
            return Err(ConfigError::Invalid {
                field: "nats_urls",
                reason: "at least one URL is needed".into(),
            });
        }
        if !matches!(self.replicas, 1..=5) {
            return Err(ConfigError::Invalid {
                field: "replicas",
                reason: format!("{} is not between 1 and 5", self.replicas),
            });
        }
        if self.worker_id.is_empty() || !self.worker_id.chars().all(|c| c.is_ascii_graphic()) {
            return Err(ConfigError::Invalid {
                field: "worker_id",
                reason: "must be non-empty printable ASCII without spaces".into(),
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

    #[test]
    fn env_overrides_defaults_and_relations_are_checked() {
        let mut c = Config::default();
        c.apply_env(|k| match k {
            "KEDGE_NATS_URL" => Some("nats://a:1, nats://b:2".into()),
            "KEDGE_TOOL_TIMEOUT_MS" => Some("120000".into()),
            _ => None,
        })
        .expect("applies");
        assert_eq!(c.nats_urls, vec!["nats://a:1", "nats://b:2"]);
        let err = c.check().expect_err("tool ack wait now too short");
        assert!(
            err.to_string().contains("tool_ack_wait > tool_timeout"),
            "{err}"
        );
    }

    #[test]
    fn a_bad_number_names_the_variable() {
        let mut c = Config::default();
        let err = c
            .apply_env(|k| (k == "KEDGE_LEASE_TTL_MS").then(|| "soon".into()))
            .expect_err("not a number");
        assert!(err.to_string().contains("KEDGE_LEASE_TTL_MS"));
    }

    #[test]
    fn a_config_file_with_an_unknown_field_is_refused() {
        let dir = std::env::temp_dir().join(format!("kedge-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let path = dir.join("bad.json");
        std::fs::write(&path, r#"{"replicas": 1, "lease_ttl": 3}"#).expect("write");
        let err = Config::load(Some(&path)).expect_err("unknown field");
        assert!(err.to_string().contains("lease_ttl"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
