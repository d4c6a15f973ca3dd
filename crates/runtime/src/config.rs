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
    /// MCP servers the tool service calls, by name (`KEDGE_MCP_SERVERS`, a JSON object): each
    /// `{"command": …, "args": [...], "env": {...}}` (a child speaking stdio) or `{"url": …}`
    /// (Streamable HTTP). An agent's tool named `<server>__<tool>` is the MCP tool `<tool>` of
    /// server `<server>`; names are letters, digits and `-` (no `_`, so the split is unambiguous).
    pub mcp_servers: std::collections::BTreeMap<String, kedge_mcp::ServerConfig>,
    /// The HTTP bridge (`kedge serve bridge`).
    pub bridge: BridgeConfig,
    /// API keys by environment-variable name, for programs that embed Kedge (the demo, tests).
    /// The environment wins. Never read from a file and never printed.
    #[serde(skip)]
    pub api_keys: std::collections::BTreeMap<String, String>,
    /// Approvers by bearer token (`KEDGE_APPROVER_TOKENS=token:name,…`): who may decide
    /// approvals over NATS. Never printed.
    #[serde(default, skip_serializing)]
    pub approvers: std::collections::BTreeMap<String, String>,
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
            mcp_servers: Default::default(),
            bridge: BridgeConfig::default(),
            api_keys: Default::default(),
            approvers: Default::default(),
        }
    }
}

/// The HTTP bridge's settings. Tokens are secrets: `--dump-config` prints them redacted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BridgeConfig {
    /// Address the bridge listens on (`KEDGE_BRIDGE_LISTEN`).
    pub listen: String,
    /// Bearer tokens and the tenant each acts for (`KEDGE_BRIDGE_TOKENS`:
    /// `token=tenant[:read],…`).
    pub tokens: Vec<BridgeToken>,
    /// Development mode (`KEDGE_BRIDGE_OPEN=1`): requests without a token act for `open_tenant`.
    /// The bridge warns at startup. Without it, a bridge with no tokens refuses to start.
    pub open: bool,
    /// The tenant of token-less requests in open mode.
    pub open_tenant: String,
    /// Largest request body, in bytes (a larger one is answered 413).
    pub max_body_bytes: usize,
    /// How long `POST /v1/runs` waits for intake's answer.
    pub intake_wait_ms: u64,
    /// Interval of SSE heartbeat comments.
    pub heartbeat_ms: u64,
    /// The `retry:` hint sent to SSE clients (their reconnection delay).
    pub sse_retry_ms: u64,
    /// Open SSE connections one bridge serves at once; more are answered 503.
    pub max_sse_connections: usize,
    /// Frames a watched run's fan-out ring keeps; a connection further behind catches up from
    /// the journal.
    pub sse_ring: usize,
}

/// One bearer token of the bridge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeToken {
    #[serde(serialize_with = "redacted")]
    pub token: String,
    pub tenant: String,
    /// `write` (default: submit, message, answer, cancel, read) or `read` (read only).
    #[serde(default = "write_scope")]
    pub scope: String,
}

fn write_scope() -> String {
    "write".into()
}

fn redacted<S: serde::Serializer>(_: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str("<redacted>")
}

impl Default for BridgeConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            tokens: Vec::new(),
            open: false,
            open_tenant: "default".into(),
            max_body_bytes: 1024 * 1024,
            intake_wait_ms: 10_000,
            heartbeat_ms: 15_000,
            sse_retry_ms: 1_000,
            max_sse_connections: 10_000,
            sse_ring: 1024,
        }
    }
}

impl BridgeConfig {
    /// Parses `KEDGE_BRIDGE_TOKENS`: `token=tenant[:scope]`, comma-separated.
    pub fn parse_tokens(v: &str) -> Result<Vec<BridgeToken>, String> {
        v.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|item| {
                let (token, grant) = item
                    .split_once('=')
                    .ok_or_else(|| "expected `token=tenant[:read|write]`".to_owned())?;
                let (tenant, scope) = grant.split_once(':').unwrap_or((grant, "write"));
                Ok(BridgeToken {
                    token: token.trim().to_owned(),
                    tenant: tenant.trim().to_owned(),
                    scope: scope.trim().to_owned(),
                })
            })
            .collect()
    }

    fn check(&self) -> Result<(), ConfigError> {
        let invalid = |field, reason: String| Err(ConfigError::Invalid { field, reason });
        if self.listen.parse::<std::net::SocketAddr>().is_err() {
            return invalid(
                "bridge.listen",
                format!("`{}` is not an address like 127.0.0.1:8080", self.listen),
            );
        }
        let tenant_ok = |t: &str| {
            (1..=64).contains(&t.len())
                && t.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        for t in &self.tokens {
            if t.token.len() < 16 || !t.token.chars().all(|c| c.is_ascii_graphic()) {
                return invalid(
                    "bridge.tokens",
                    "a token needs at least 16 printable ASCII characters, no spaces".into(),
                );
            }
            if !tenant_ok(&t.tenant) {
                return invalid(
                    "bridge.tokens",
                    format!("tenant `{}` is not 1-64 of [A-Za-z0-9_-]", t.tenant),
                );
            }
            if !matches!(t.scope.as_str(), "read" | "write") {
                return invalid(
                    "bridge.tokens",
                    format!("scope `{}` is not `read` or `write`", t.scope),
                );
            }
        }
        if !tenant_ok(&self.open_tenant) {
            return invalid(
                "bridge.open_tenant",
                format!("`{}` is not 1-64 of [A-Za-z0-9_-]", self.open_tenant),
            );
        }
        if self.max_body_bytes < 1024
            || self.heartbeat_ms == 0
            || self.max_sse_connections == 0
            || self.sse_ring == 0
        {
            return invalid(
                "bridge",
                "max_body_bytes >= 1024; heartbeat_ms, max_sse_connections and sse_ring >= 1"
                    .into(),
            );
        }
        Ok(())
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
        if let Some(v) = get("KEDGE_APPROVER_TOKENS") {
            for pair in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let (token, name) = pair.split_once(':').ok_or_else(|| ConfigError::Env {
                    var: "KEDGE_APPROVER_TOKENS",
                    reason: format!("`{pair}` is not token:name"),
                })?;
                self.approvers.insert(token.to_owned(), name.to_owned());
            }
        }
        if let Some(v) = get("KEDGE_MCP_SERVERS") {
            self.mcp_servers = serde_json::from_str(&v).map_err(|e| ConfigError::Env {
                var: "KEDGE_MCP_SERVERS",
                reason: format!("not a JSON object of server configurations: {e}"),
            })?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_LISTEN") {
            self.bridge.listen = v.trim().to_owned();
        }
        if let Some(v) = get("KEDGE_BRIDGE_TOKENS") {
            self.bridge.tokens =
                BridgeConfig::parse_tokens(&v).map_err(|reason| ConfigError::Env {
                    var: "KEDGE_BRIDGE_TOKENS",
                    reason,
                })?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_OPEN") {
            self.bridge.open = match v.trim() {
                "1" | "true" | "yes" => true,
                "0" | "false" | "no" | "" => false,
                other => {
                    return Err(ConfigError::Env {
                        var: "KEDGE_BRIDGE_OPEN",
                        reason: format!("`{other}` is not 1/0/true/false"),
                    });
                }
            };
        }
        let t = &mut self.timeouts;
        for (var, field) in [
            ("KEDGE_LEASE_TTL_MS", &mut t.lease_ttl_ms),
            ("KEDGE_LEASE_RENEW_MS", &mut t.lease_renew_ms),
            ("KEDGE_MODEL_TIMEOUT_MS", &mut t.model_timeout_ms),
            ("KEDGE_STEP_ACK_WAIT_MS", &mut t.step_ack_wait_ms),
            ("KEDGE_TOOL_TIMEOUT_MS", &mut t.tool_timeout_ms),
            ("KEDGE_TOOL_GRACE_MS", &mut t.tool_grace_ms),
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
        if let Some(bad) = self.mcp_servers.keys().find(|name| {
            name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        }) {
            return Err(ConfigError::Invalid {
                field: "mcp_servers",
                reason: format!(
                    "server name `{bad}`: use letters, digits and `-` (tools are named `<server>__<tool>`)"
                ),
            });
        }
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
        self.bridge.check()?;
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
            err.to_string()
                .contains("tool_ack_wait > tool_timeout + tool_grace"),
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
    fn bridge_tokens_parse_check_and_never_print() {
        let mut c = Config::default();
        c.apply_env(|k| match k {
            "KEDGE_BRIDGE_TOKENS" => {
                Some("tok-aaaaaaaaaaaaaaaa=acme, tok-bbbbbbbbbbbbbbbb=globex:read".into())
            }
            "KEDGE_BRIDGE_LISTEN" => Some("127.0.0.1:0".into()),
            _ => None,
        })
        .expect("applies");
        c.check().expect("valid");
        assert_eq!(c.bridge.tokens.len(), 2);
        assert_eq!(c.bridge.tokens[1].tenant, "globex");
        assert_eq!(c.bridge.tokens[1].scope, "read");
        let dumped = serde_json::to_string(&c).expect("json");
        assert!(!dumped.contains("tok-aaaa"), "{dumped}");
        c.bridge.tokens[0].token = "short".into();
        assert!(c.check().is_err());
        let mut c = Config::default();
        assert!(
            c.apply_env(|k| (k == "KEDGE_BRIDGE_TOKENS").then(|| "no-tenant".into()))
                .is_err()
        );
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
