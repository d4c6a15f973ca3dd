//! The HTTP bridge's settings (`bridge.*`, `kedge serve bridge`): its listener, its bearer tokens
//! ([`BridgeToken`]), the per-tenant limits and SSE tuning; their checks and `KEDGE_BRIDGE_*`
//! variables. docs/CONFIG.md "The bridge (`bridge.*`)".

use serde::{Deserialize, Serialize};

use super::env::{flag, num};
use super::{ConfigError, REDACTED};

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
    /// Open SSE connections one tenant may hold on one bridge; more are answered 429
    /// (`KEDGE_BRIDGE_MAX_SSE_PER_TENANT`).
    pub max_sse_per_tenant: usize,
    /// Runs one tenant may start per minute through one bridge, 0 for no limit; more are answered
    /// 429 with `Retry-After` (`KEDGE_BRIDGE_RUNS_PER_MINUTE`).
    pub runs_per_minute: u32,
    /// Unfinished runs one tenant may have at once, 0 for no limit (counted from the runs
    /// projection at each submit); more are answered 429 (`KEDGE_BRIDGE_MAX_ACTIVE_RUNS`).
    pub max_active_runs: usize,
    /// How long a request other than an SSE stream may take; slower ones are answered 503
    /// (`KEDGE_BRIDGE_REQUEST_TIMEOUT_MS`).
    pub request_timeout_ms: u64,
    /// The step service rewrites a busy run's entry in the runs list (`kedge_runs`: running,
    /// waiting on its tools) at most once per this interval, and the projector a run's from
    /// its run-level decisions (its first decision at once): the list, and the
    /// `max_active_runs` count read from it, trail a run by up to this long. 0: every drive's
    /// summary, every decision delivered, written at once (`KEDGE_BRIDGE_RUNS_LIST_INTERVAL_MS`).
    pub runs_list_interval_ms: u64,
}

/// One bearer token of the bridge. `Debug` and `Serialize` print the token redacted.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BridgeToken {
    #[serde(serialize_with = "redacted")]
    pub token: String,
    pub tenant: String,
    /// `write` (default: submit, message, answer, cancel, read) or `read` (read only).
    #[serde(default = "write_scope")]
    pub scope: String,
}

impl std::fmt::Debug for BridgeToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BridgeToken")
            .field("token", &REDACTED)
            .field("tenant", &self.tenant)
            .field("scope", &self.scope)
            .finish()
    }
}

fn write_scope() -> String {
    "write".into()
}

fn redacted<S: serde::Serializer>(_: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(REDACTED)
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
            max_sse_per_tenant: 1_000,
            runs_per_minute: 600,
            max_active_runs: 0,
            request_timeout_ms: 30_000,
            runs_list_interval_ms: 250,
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
                let (token, grant) = item.split_once('=').ok_or_else(|| {
                    "expected `token=tenant[:read|write|approve|write+approve]`".to_owned()
                })?;
                let (tenant, scope) = grant.split_once(':').unwrap_or((grant, "write"));
                Ok(BridgeToken {
                    token: token.trim().to_owned(),
                    tenant: tenant.trim().to_owned(),
                    scope: scope.trim().to_owned(),
                })
            })
            .collect()
    }

    pub(super) fn check(&self) -> Result<(), ConfigError> {
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
            if !matches!(
                t.scope.as_str(),
                "read" | "write" | "approve" | "write+approve" | "approve+write"
            ) {
                return invalid(
                    "bridge.tokens",
                    format!(
                        "scope `{}` is not `read`, `write`, `approve` or `write+approve`",
                        t.scope
                    ),
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
            || self.max_sse_per_tenant == 0
            || self.request_timeout_ms == 0
        {
            return invalid(
                "bridge",
                "max_body_bytes >= 1024; heartbeat_ms, max_sse_connections, sse_ring, \
                 max_sse_per_tenant and request_timeout_ms >= 1"
                    .into(),
            );
        }
        if self.runs_list_interval_ms > MAX_RUNS_LIST_INTERVAL_MS {
            // The projector holds a run's deliveries unacknowledged for the interval: well
            // under the consumer's 30 s ack wait.
            return invalid(
                "bridge.runs_list_interval_ms",
                format!(
                    "{} is more than {MAX_RUNS_LIST_INTERVAL_MS}",
                    self.runs_list_interval_ms
                ),
            );
        }
        Ok(())
    }

    /// Applies the `KEDGE_BRIDGE_*` variables.
    pub(super) fn apply_env(
        &mut self,
        get: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        if let Some(v) = get("KEDGE_BRIDGE_LISTEN") {
            self.listen = v.trim().to_owned();
        }
        if let Some(v) = get("KEDGE_BRIDGE_TOKENS") {
            self.tokens = Self::parse_tokens(&v).map_err(|reason| ConfigError::Env {
                var: "KEDGE_BRIDGE_TOKENS",
                reason,
            })?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_OPEN") {
            self.open = flag("KEDGE_BRIDGE_OPEN", &v)?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_MAX_SSE_PER_TENANT") {
            self.max_sse_per_tenant = num("KEDGE_BRIDGE_MAX_SSE_PER_TENANT", &v)?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_RUNS_PER_MINUTE") {
            self.runs_per_minute = num("KEDGE_BRIDGE_RUNS_PER_MINUTE", &v)?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_MAX_ACTIVE_RUNS") {
            self.max_active_runs = num("KEDGE_BRIDGE_MAX_ACTIVE_RUNS", &v)?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_REQUEST_TIMEOUT_MS") {
            self.request_timeout_ms = num("KEDGE_BRIDGE_REQUEST_TIMEOUT_MS", &v)?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_RUNS_LIST_INTERVAL_MS") {
            self.runs_list_interval_ms = num("KEDGE_BRIDGE_RUNS_LIST_INTERVAL_MS", &v)?;
        }
        Ok(())
    }
}

/// The longest `bridge.runs_list_interval_ms`.
pub const MAX_RUNS_LIST_INTERVAL_MS: u64 = 10_000;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

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
    fn the_runs_list_interval_is_set_by_its_variable_and_bounded_by_the_ack_wait() {
        let mut c = Config::default();
        assert_eq!(c.bridge.runs_list_interval_ms, 250);
        c.apply_env(|k| (k == "KEDGE_BRIDGE_RUNS_LIST_INTERVAL_MS").then(|| "0".into()))
            .expect("applies");
        c.check().expect("0: every decision");
        assert_eq!(c.bridge.runs_list_interval_ms, 0);
        c.bridge.runs_list_interval_ms = MAX_RUNS_LIST_INTERVAL_MS + 1;
        let e = c.check().expect_err("past the bound").to_string();
        assert!(e.contains("bridge.runs_list_interval_ms"), "{e}");
    }
}
