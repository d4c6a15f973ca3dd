//! Layered configuration: defaults, then a JSON file, then a `nats` CLI context (connection
//! settings only), then `KEDGE_*` environment variables, then command-line flags ([`Flags`]); the
//! `nats` CLI's `NATS_URL`, `NATS_CREDS`, `NATS_NKEY`, `NATS_USER` and `NATS_PASSWORD` fill in
//! last, only what nothing else set. `kedge --dump-config` prints the result, secrets redacted.
//!
//! docs/CONFIG.md is the reference; every field here is listed there.
//!
//! # Connecting to NATS
//!
//! [`Config::nats`] ([`NatsConfig`]) holds how a process authenticates (at most one of a
//! `.creds` file, an nkey seed file, user + password, a token, or `user:password@` in the URLs;
//! [`Config::check`] refuses two), its TLS files and its inbox prefix. Every process connects
//! through [`crate::connect::connect_client`], which applies them all.
//!
//! Inboxes: replies to this process's requests arrive on `<prefix>.…` subjects, where the prefix
//! is [`Config::inbox_prefix`] (the field `config.nats.inbox_prefix`, default `_INBOX`). Code
//! that grants or checks permissions on inboxes uses `format!("{}.>", config.inbox_prefix())`.
//!
//! Secrets (passwords, tokens, approver and bridge tokens, API keys, user info in URLs) never
//! appear in `--dump-config` or in `Debug` output: they are [`Secret`]s or printed redacted.

use std::path::{Path, PathBuf};

use kedge_core::config::{RelationError, Timeouts};
use serde::{Deserialize, Serialize};

use crate::connect::{redact_url, url_auth};

/// The effective configuration of a Kedge process.
///
/// `Debug` and `Serialize` (`--dump-config`) redact secrets: user info in `nats_urls`, the
/// [`Secret`]s of [`NatsConfig`], approver and bridge tokens; `api_keys` are never serialized.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// NATS server URLs (`KEDGE_NATS_URL`, comma-separated; else a context's `url`; else
    /// `NATS_URL`). `nats://user:password@host` or `nats://token@host` authenticate like
    /// [`NatsConfig::user`]/[`NatsConfig::password`] or [`NatsConfig::token`] (printed redacted).
    #[serde(serialize_with = "redacted_urls")]
    pub nats_urls: Vec<String>,
    /// How to authenticate to NATS, TLS, the inbox prefix.
    pub nats: NatsConfig,
    /// Replicas of streams created at startup: 1 for a single node, 3 for a cluster.
    pub replicas: usize,
    /// This process's name in leases, operation records and `tool.started` (default: a random
    /// `w-…`).
    pub worker_id: String,
    /// Where the built-in file tools keep each run's workspace (`<root>/<run_id>/`).
    pub workspace_root: PathBuf,
    /// Commands the `shell` tool may run.
    pub shell_allowlist: Vec<String>,
    /// What confines the `shell` tool's commands (`KEDGE_SANDBOX`): `bwrap` (the default: each
    /// command in a bubblewrap sandbox that sees only the run's workspace, with no network and
    /// with resource limits; the tool service refuses to start without `bwrap`) or `unconfined`
    /// (development only: commands see the whole machine; logged as a warning).
    pub sandbox: SandboxKind,
    /// Offer the test-only `ledger_append` tool (`KEDGE_LEDGER_TOOL=1`): the side effect the
    /// tests, the demo and the benches count. Off in production.
    pub ledger_tool: bool,
    /// Keep a run's lease between two drives while the run waits on its tools
    /// (`KEDGE_PARK_LEASES`, default on): two lease writes fewer per agent-loop step. Off
    /// releases it after every drive, as builds before parking did; worth it while step workers
    /// of such a build (which do not ask a holder to yield) run beside this one.
    pub park_leases: bool,
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
    /// `--dump-config` prints each stdio server's `env` values redacted (they may be secrets).
    #[serde(serialize_with = "redacted_mcp_env")]
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
    /// Which API keys and endpoints agent definitions may use.
    pub models: ModelPolicy,
    /// Where `kedge serve` serves Prometheus metrics at `/metrics` (`KEDGE_METRICS_ADDR`,
    /// `host:port`); none (the default): no endpoint and nothing recorded. One address per
    /// process: two processes on one host need two ports. See [`crate::metrics`].
    pub metrics_addr: Option<String>,
    /// The OTLP/HTTP collector `kedge` exports its trace spans to (`KEDGE_OTLP_ENDPOINT`; the
    /// base URL, e.g. `http://otel-collector:4318`: spans go to `<endpoint>/v1/traces`, JSON
    /// encoded); none (the default): no export. See [`crate::trace`].
    pub otlp_endpoint: Option<String>,
    /// The operator's key for sensitive values (`KEDGE_SEAL_KEY`: 64 hex digits, 32 bytes), which
    /// intake, step and tool processes need when an agent marks task fields or tool parameters
    /// sensitive: such values are journaled sealed with it ([`crate::seal`]). None (the default):
    /// runs of such agents are refused. Never printed.
    pub seal_key: Option<Secret>,
    /// The retention policy (`kedge serve retention`) and the tool hosts' sweep of purged runs'
    /// workspaces. Off by default: see [`RetentionConfig`] and docs/CONFIG.md "Retention".
    pub retention: RetentionConfig,
    /// How the fleet rides out a model provider's outages and rate limits
    /// ([`crate::provider`], docs/CONFIG.md "Provider trouble").
    pub providers: ProviderConfig,
}

/// How the fleet rides out a model provider's trouble ([`crate::provider`]): the shared
/// breaker per endpoint, its probes, the rate the waiting runs are released at, and how long a
/// step waits before its run fails.
///
/// Durations are written with a unit, as in [`RetentionConfig`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProviderConfig {
    /// How long one step waits on its provider before the run fails naming the provider and
    /// its last error (`KEDGE_PROVIDER_WAIT`; default `24h`; the run's deadline, when sooner,
    /// ends the wait first).
    #[serde(with = "duration_text")]
    pub wait: std::time::Duration,
    /// Provider failures in a row (no success between them, from any process) that open an
    /// endpoint's breaker (`KEDGE_PROVIDER_OPEN_AFTER`; default 3). A 429 opens it at once.
    pub open_after: u32,
    /// How long an open breaker waits before the fleet's first probe, and after each failed
    /// probe the wait doubles up to `max_probe_interval` (`KEDGE_PROVIDER_PROBE_INTERVAL`;
    /// default `1s`). A `retry-after` longer than it is waited instead.
    #[serde(with = "duration_text")]
    pub probe_interval: std::time::Duration,
    /// The longest wait between two probes (`KEDGE_PROVIDER_MAX_PROBE_INTERVAL`; default `2s`):
    /// at most one request every 2 s reaches a failing endpoint from the whole fleet, and its
    /// recovery is noticed within 2 s. In a long outage the wait grows past it, to 1/300 of the
    /// outage's length so far (at most a minute: [`crate::provider::probe_ceiling`]).
    #[serde(with = "duration_text")]
    pub max_probe_interval: std::time::Duration,
    /// Runs released per second per endpoint once it is back (`KEDGE_PROVIDER_RELEASE_PER_SECOND`;
    /// default 20): the recovery is not a thundering herd.
    pub release_per_second: u32,
    /// Rate limits the fleet keeps to per endpoint, across every step process
    /// (`KEDGE_PROVIDER_LIMITS`, a JSON array; default none): the first entry that matches a
    /// call's endpoint applies. A limit a provider names in its rate-limit headers is kept to as
    /// well, and the lower of the two wins. See [`EndpointLimit`].
    pub limits: Vec<EndpointLimit>,
}

/// A rate limit the fleet keeps to on the endpoints it matches: every field given must equal
/// the endpoint's (`base_url` compared without a trailing `/`; a spec without a base URL has
/// the provider's default, matched by `"default"`); none given matches every endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointLimit {
    #[serde(default)]
    pub provider: Option<kedge_core::event::Provider>,
    #[serde(default)]
    pub base_url: Option<String>,
    #[serde(default)]
    pub key_var: Option<String>,
    /// Requests per minute, from the whole fleet.
    #[serde(default)]
    pub requests_per_minute: Option<u64>,
    /// Input tokens per minute (as estimated before the call), from the whole fleet.
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
}

impl EndpointLimit {
    /// Whether the limit applies to calls to `spec`'s endpoint with the key in `key_var`.
    pub fn matches(&self, spec: &kedge_core::event::ModelSpec, key_var: &str) -> bool {
        let trim = |u: &str| u.trim_end_matches('/').to_owned();
        self.provider.is_none_or(|p| p == spec.provider)
            && self.key_var.as_deref().is_none_or(|k| k == key_var)
            && self.base_url.as_deref().is_none_or(|want| {
                trim(want) == trim(spec.base_url.as_deref().unwrap_or("default"))
            })
    }
}

impl Default for ProviderConfig {
    fn default() -> Self {
        Self {
            wait: std::time::Duration::from_secs(24 * 3600),
            open_after: 3,
            probe_interval: std::time::Duration::from_secs(1),
            max_probe_interval: std::time::Duration::from_secs(2),
            release_per_second: 20,
            limits: Vec::new(),
        }
    }
}

impl ProviderConfig {
    fn check(&self) -> Result<(), ConfigError> {
        let invalid = |reason: String| {
            Err(ConfigError::Invalid {
                field: "providers",
                reason,
            })
        };
        if self.wait < std::time::Duration::from_secs(1) {
            return invalid("wait must be at least 1s".into());
        }
        if !(1..=1000).contains(&self.open_after) {
            return invalid(format!(
                "open_after {} is not between 1 and 1000",
                self.open_after
            ));
        }
        if self.probe_interval < std::time::Duration::from_millis(100) {
            return invalid("probe_interval must be at least 100ms".into());
        }
        if self.max_probe_interval < self.probe_interval {
            return invalid("max_probe_interval must be at least probe_interval".into());
        }
        if !(1..=10_000).contains(&self.release_per_second) {
            return invalid(format!(
                "release_per_second {} is not between 1 and 10000",
                self.release_per_second
            ));
        }
        for (i, l) in self.limits.iter().enumerate() {
            if l.requests_per_minute.is_none() && l.tokens_per_minute.is_none() {
                return invalid(format!(
                    "limits[{i}] names neither requests_per_minute nor tokens_per_minute"
                ));
            }
            if l.requests_per_minute == Some(0) || l.tokens_per_minute == Some(0) {
                return invalid(format!("limits[{i}]: a limit must be at least 1"));
            }
        }
        Ok(())
    }

    /// The configured limit of calls to `spec`'s endpoint with the key in `key_var`.
    pub fn limit_for(
        &self,
        spec: &kedge_core::event::ModelSpec,
        key_var: &str,
    ) -> Option<&EndpointLimit> {
        self.limits.iter().find(|l| l.matches(spec, key_var))
    }
}

/// The retention policy: what `kedge serve retention` purges, and how often ([`crate::retention`]).
///
/// Durations are written with a unit: `"30d"`, `"12h"`, `"15m"`, `"90s"`, `"500ms"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Whether the retention service purges anything (`KEDGE_RETENTION=1`). Off by default:
    /// a purge cannot be undone, and how long a journal must be kept (audit, disputes) is the
    /// operator's decision, not a default's.
    pub enabled: bool,
    /// A finished run is purged once it has been finished this long
    /// (`KEDGE_RETENTION_FINISHED_AFTER`; default `30d`, at least `1s`).
    #[serde(with = "duration_text")]
    pub finished_after: std::time::Duration,
    /// Archive each journal as JSON Lines to `kedge_blobs` before purging it
    /// (`KEDGE_RETENTION_ARCHIVE`; default on).
    pub archive: bool,
    /// How often the retention service looks for runs past the horizon
    /// (`KEDGE_RETENTION_INTERVAL`; default `10m`).
    #[serde(with = "duration_text")]
    pub interval: std::time::Duration,
    /// How often a tool service removes the workspaces of purged runs from its workspace root
    /// (`KEDGE_RETENTION_WORKSPACE_SWEEP`; default `10m`). Runs whether or not `enabled` is set
    /// here: `kedge runs purge` purges too.
    #[serde(with = "duration_text")]
    pub workspace_sweep: std::time::Duration,
    /// Runs purged between two saves of the retention cursor (default 256).
    pub batch: usize,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            finished_after: std::time::Duration::from_secs(30 * 24 * 3600),
            archive: true,
            interval: std::time::Duration::from_secs(600),
            workspace_sweep: std::time::Duration::from_secs(600),
            batch: 256,
        }
    }
}

impl RetentionConfig {
    fn check(&self) -> Result<(), ConfigError> {
        let invalid = |reason: String| {
            Err(ConfigError::Invalid {
                field: "retention",
                reason,
            })
        };
        if self.finished_after < std::time::Duration::from_secs(1) {
            return invalid("finished_after must be at least 1s".into());
        }
        if self.interval < std::time::Duration::from_millis(100)
            || self.workspace_sweep < std::time::Duration::from_millis(100)
        {
            return invalid("interval and workspace_sweep must be at least 100ms".into());
        }
        if !(1..=10_000).contains(&self.batch) {
            return invalid(format!("batch {} is not between 1 and 10000", self.batch));
        }
        Ok(())
    }
}

/// Parses a duration written with a unit: `500ms`, `90s`, `15m`, `12h`, `30d`.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("`{text}` has no unit (ms, s, m, h or d)"))?;
    let (n, unit) = t.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("`{text}` does not start with a number"))?;
    let ms = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1_000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        _ => return Err(format!("`{text}`: the unit is one of ms, s, m, h, d")),
    }
    .ok_or_else(|| format!("`{text}` is too long"))?;
    Ok(std::time::Duration::from_millis(ms))
}

/// Writes a duration in the largest unit that divides it.
pub fn format_duration(d: std::time::Duration) -> String {
    let ms = d.as_millis() as u64;
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms > 0 && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

mod duration_text {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &std::time::Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<std::time::Duration, D::Error> {
        let text = String::deserialize(d)?;
        super::parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

/// What an agent definition may name for its model: the operator's choice, not the author's.
/// An agent's `api_key_env` (or its provider's default variable) must be one of `keys` (or a key
/// the embedding program put in [`Config::api_keys`]); its `model.base_url` (when set) must start
/// with one of `base_urls`, each an `https://` prefix, or be on this host when `base_urls`
/// holds `loopback`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelPolicy {
    /// Environment variables agents may name as their API key (`KEDGE_MODEL_KEYS`,
    /// comma-separated).
    pub keys: Vec<String>,
    /// Allowed base URL prefixes, `https://…` or `loopback` (`KEDGE_MODEL_BASE_URLS`).
    pub base_urls: Vec<String>,
}

impl Default for ModelPolicy {
    fn default() -> Self {
        Self {
            keys: vec!["OPENAI_API_KEY".into(), "ANTHROPIC_API_KEY".into()],
            base_urls: vec![
                "https://api.openai.com/".into(),
                "https://api.anthropic.com/".into(),
                "loopback".into(),
            ],
        }
    }
}

/// Whether `url`'s host is this machine (127.0.0.0/8, ::1, localhost).
pub fn is_loopback_url(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return false;
    }
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl Config {
    /// The prefix of this process's inbox subjects (`<prefix>.…`): `nats.inbox_prefix`, default
    /// `_INBOX`. Replies to its requests arrive there, so a user's permissions must let it
    /// subscribe to `<prefix>.>`.
    pub fn inbox_prefix(&self) -> &str {
        &self.nats.inbox_prefix
    }

    /// The value of an API-key variable: the environment, else [`Config::api_keys`]. Only a
    /// variable the operator allows ([`ModelPolicy::keys`], or one in `api_keys`) is read: an
    /// agent definition cannot make the step send any other variable of its environment.
    pub fn api_key(&self, var: &str) -> Option<String> {
        if let Some(key) = self.api_keys.get(var) {
            return std::env::var(var)
                .ok()
                .filter(|v| !v.is_empty())
                .or_else(|| Some(key.clone()));
        }
        if !self.models.keys.iter().any(|k| k == var) {
            tracing::warn!(
                var,
                "an agent names an API-key variable the operator did not allow (models.keys); \
                 not read"
            );
            return None;
        }
        std::env::var(var).ok().filter(|v| !v.is_empty())
    }

    /// Whether an agent may use this key variable and base URL (see [`ModelPolicy`]); the
    /// reason when not.
    pub fn check_model(&self, key_var: &str, base_url: Option<&str>) -> Result<(), String> {
        if !self.api_keys.contains_key(key_var) && !self.models.keys.iter().any(|k| k == key_var) {
            return Err(format!(
                "api_key_env `{key_var}` is not among the keys the operator allows \
                 (models.keys / KEDGE_MODEL_KEYS: {})",
                self.models.keys.join(", ")
            ));
        }
        if let Some(url) = base_url {
            let allowed = self.models.base_urls.iter().any(|prefix| {
                if prefix == "loopback" {
                    is_loopback_url(url)
                } else {
                    // `https://api.anthropic.com` (as Anthropic's SDKs write it) is the
                    // allowed `https://api.anthropic.com/`; `…com.evil` is not.
                    url.starts_with(prefix.as_str())
                        || format!("{url}/").starts_with(prefix.as_str())
                }
            });
            if !allowed {
                return Err(format!(
                    "model.base_url `{url}` is not among the endpoints the operator allows \
                     (models.base_urls / KEDGE_MODEL_BASE_URLS: {})",
                    self.models.base_urls.join(", ")
                ));
            }
        }
        Ok(())
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            nats_urls: vec![DEFAULT_NATS_URL.into()],
            nats: NatsConfig::default(),
            replicas: 1,
            worker_id: format!("w-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
            workspace_root: PathBuf::from(".kedge/workspaces"),
            shell_allowlist: [
                "ls", "cat", "echo", "wc", "grep", "head", "tail", "sort", "date",
            ]
            .into_iter()
            .map(String::from)
            .collect(),
            sandbox: SandboxKind::Bwrap,
            ledger_tool: false,
            park_leases: true,
            step_concurrency: 256,
            tool_concurrency: 64,
            max_tool_output_bytes: 64 * 1024,
            timeouts: Timeouts::default(),
            mcp_servers: Default::default(),
            bridge: BridgeConfig::default(),
            api_keys: Default::default(),
            approvers: Default::default(),
            models: ModelPolicy::default(),
            metrics_addr: None,
            otlp_endpoint: None,
            seal_key: None,
            retention: RetentionConfig::default(),
            providers: ProviderConfig::default(),
        }
    }
}

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

/// The default server.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";
/// The default inbox prefix (the NATS clients' own).
pub const DEFAULT_INBOX_PREFIX: &str = "_INBOX";
/// What `Debug` and `--dump-config` print instead of a secret.
pub const REDACTED: &str = "<redacted>";

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Destructured so that a new field does not compile until it is decided here whether it
        // is a secret.
        let Config {
            nats_urls,
            nats,
            replicas,
            worker_id,
            workspace_root,
            shell_allowlist,
            sandbox,
            ledger_tool,
            park_leases,
            step_concurrency,
            tool_concurrency,
            max_tool_output_bytes,
            timeouts,
            mcp_servers,
            bridge,
            api_keys,
            approvers,
            models,
            metrics_addr,
            otlp_endpoint,
            seal_key,
            retention,
            providers,
        } = self;
        let urls: Vec<String> = nats_urls.iter().map(|u| redact_url(u)).collect();
        let api_keys: Vec<&String> = api_keys.keys().collect();
        let approvers: Vec<&String> = approvers.values().collect();
        f.debug_struct("Config")
            .field("nats_urls", &urls)
            .field("nats", nats)
            .field("replicas", replicas)
            .field("worker_id", worker_id)
            .field("workspace_root", workspace_root)
            .field("shell_allowlist", shell_allowlist)
            .field("sandbox", sandbox)
            .field("ledger_tool", ledger_tool)
            .field("park_leases", park_leases)
            .field("step_concurrency", step_concurrency)
            .field("tool_concurrency", tool_concurrency)
            .field("max_tool_output_bytes", max_tool_output_bytes)
            .field("timeouts", timeouts)
            .field("mcp_servers", mcp_servers)
            .field("bridge", bridge)
            .field("api_keys (names)", &api_keys)
            .field("approvers (names)", &approvers)
            .field("models", models)
            .field("metrics_addr", metrics_addr)
            .field("otlp_endpoint", &otlp_endpoint.as_deref().map(redact_url))
            .field("seal_key", seal_key)
            .field("retention", retention)
            .field("providers", providers)
            .finish()
    }
}

fn redacted_mcp_env<S: serde::Serializer>(
    servers: &std::collections::BTreeMap<String, kedge_mcp::ServerConfig>,
    s: S,
) -> Result<S::Ok, S::Error> {
    let shown: std::collections::BTreeMap<&String, kedge_mcp::ServerConfig> = servers
        .iter()
        .map(|(name, config)| {
            let config = match config {
                kedge_mcp::ServerConfig::Stdio {
                    command,
                    args,
                    env,
                    sandbox,
                } => kedge_mcp::ServerConfig::Stdio {
                    command: command.clone(),
                    args: args.clone(),
                    env: env
                        .keys()
                        .map(|k| (k.clone(), REDACTED.to_owned()))
                        .collect(),
                    sandbox: sandbox.clone(),
                },
                other => other.clone(),
            };
            (name, config)
        })
        .collect();
    serde::Serialize::serialize(&shown, s)
}

fn redacted_urls<S: serde::Serializer>(urls: &[String], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(urls.iter().map(|u| redact_url(u)))
}

/// A secret string (a password, a token). `Debug`, `Display` and `Serialize` print
/// `<redacted>`; [`Secret::expose`] gives the value to the one place that sends it. Deserializes
/// from a plain string.
#[derive(Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret itself: only for handing it to the NATS client.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Secret(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Secret(value.to_owned())
    }
}

/// For command-line parsers.
impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

/// How a process authenticates to NATS, its TLS files and its inbox prefix (the `nats` section of
/// the file). At most one authentication method: `creds_file`, `nkey_seed_file`,
/// `user` + `password`, `token` (or user info in `nats_urls`). File paths are not secrets and
/// are printed; passwords and tokens are [`Secret`]s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    /// A `.creds` file: user JWT and nkey seed (`KEDGE_NATS_CREDS`, `--creds`, `NATS_CREDS`).
    pub creds_file: Option<PathBuf>,
    /// A file holding a user nkey seed, `SU…` (`KEDGE_NATS_NKEY`, `--nkey`, `NATS_NKEY`).
    pub nkey_seed_file: Option<PathBuf>,
    /// User name, with `password` (`KEDGE_NATS_USER`, `--user`, `NATS_USER`).
    pub user: Option<String>,
    /// (`KEDGE_NATS_PASSWORD`, `--password`, `NATS_PASSWORD`).
    pub password: Option<Secret>,
    /// An authentication token (`KEDGE_NATS_TOKEN`, `--nats-token`).
    pub token: Option<Secret>,
    /// PEM file of the CA(s) that signed the servers' certificates (`KEDGE_NATS_TLS_CA`,
    /// `--tls-ca`). Setting any `tls_*` file requires TLS.
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate, with `tls_key` (`KEDGE_NATS_TLS_CERT`, `--tls-cert`).
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert` (`KEDGE_NATS_TLS_KEY`, `--tls-key`).
    pub tls_key: Option<PathBuf>,
    /// Refuse a connection without TLS (`KEDGE_NATS_TLS_REQUIRED=1`; also implied by `tls://`
    /// URLs and by any `tls_*` file).
    pub tls_required: bool,
    /// Prefix of this process's inbox subjects (`KEDGE_NATS_INBOX_PREFIX`); see
    /// [`Config::inbox_prefix`].
    pub inbox_prefix: String,
    /// How long the first connection keeps retrying an unreachable server before giving up
    /// (`KEDGE_NATS_CONNECT_WAIT_MS`). A refused authentication or a TLS failure is not retried.
    pub connect_wait_ms: u64,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            creds_file: None,
            nkey_seed_file: None,
            user: None,
            password: None,
            token: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_required: false,
            inbox_prefix: DEFAULT_INBOX_PREFIX.into(),
            connect_wait_ms: 10_000,
        }
    }
}

impl NatsConfig {
    /// The authentication methods set, by field name (more than one is refused by `check`).
    fn auth_methods(&self) -> Vec<&'static str> {
        let mut set = Vec::new();
        if self.creds_file.is_some() {
            set.push("nats.creds_file");
        }
        if self.nkey_seed_file.is_some() {
            set.push("nats.nkey_seed_file");
        }
        if self.user.is_some() || self.password.is_some() {
            set.push("nats.user/nats.password");
        }
        if self.token.is_some() {
            set.push("nats.token");
        }
        set
    }

    /// Whether TLS is required: `tls_required` or any TLS file.
    pub fn requires_tls(&self) -> bool {
        self.tls_required || self.tls_ca.is_some() || self.tls_cert.is_some()
    }

    /// The `nats` checks of [`Config::check`] (`urls`: [`Config::nats_urls`]).
    pub(crate) fn check(&self, urls: &[String]) -> Result<(), ConfigError> {
        let invalid = |field, reason: String| Err(ConfigError::Invalid { field, reason });
        let url_auth = url_auth(urls).map_err(|reason| ConfigError::Invalid {
            field: "nats_urls",
            reason,
        })?;
        let mut methods = self.auth_methods();
        if url_auth.is_some() {
            methods.push("nats_urls (user info)");
        }
        if methods.len() > 1 {
            return Err(ConfigError::AuthConflict { fields: methods });
        }
        match (&self.user, &self.password) {
            (Some(u), Some(p)) if !u.is_empty() && !p.expose().is_empty() => {}
            (Some(_), Some(_)) => {
                return invalid("nats.user", "user and password must not be empty".into());
            }
            (Some(_), None) => {
                return invalid(
                    "nats.password",
                    "nats.user is set without a password (for a token use nats.token)".into(),
                );
            }
            (None, Some(_)) => {
                return invalid("nats.user", "nats.password is set without a user".into());
            }
            (None, None) => {}
        }
        if self.token.as_ref().is_some_and(|t| t.expose().is_empty()) {
            return invalid("nats.token", "must not be empty".into());
        }
        if let Some(p) = &self.nkey_seed_file
            && looks_like_seed(&p.to_string_lossy())
        {
            // Not echoed: this is the secret itself.
            return invalid(
                "nats.nkey_seed_file",
                "this looks like an nkey seed, not a file path: put the seed in a file and give \
                 its path"
                    .into(),
            );
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return invalid(
                "nats.tls_cert/nats.tls_key",
                "a client certificate needs both the certificate and its key".into(),
            );
        }
        if !valid_inbox_prefix(&self.inbox_prefix) {
            return invalid(
                "nats.inbox_prefix",
                format!(
                    "`{}` is not a subject prefix (tokens of printable ASCII separated by `.`, \
                     no wildcards `*` `>`)",
                    self.inbox_prefix
                ),
            );
        }
        Ok(())
    }
}

/// An nkey seed is 58 base32 characters starting with `S`.
fn looks_like_seed(s: &str) -> bool {
    let s = s.trim();
    s.len() == 58
        && s.starts_with('S')
        && s.chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
}

fn valid_inbox_prefix(p: &str) -> bool {
    !p.is_empty()
        && p.split('.').all(|token| {
            !token.is_empty()
                && token
                    .chars()
                    .all(|c| c.is_ascii_graphic() && c != '*' && c != '>')
        })
}

/// The values of command-line flags: the highest layer of [`Config::load_layered`]. The binary
/// fills it from its global flags.
#[derive(Debug, Clone, Default)]
pub struct Flags {
    /// `--nats-url`, comma-separated.
    pub nats_url: Option<String>,
    /// `--context NAME`: a `nats` CLI context (else `NATS_CONTEXT`).
    pub context: Option<String>,
    pub creds: Option<PathBuf>,
    pub nkey: Option<PathBuf>,
    pub user: Option<String>,
    pub password: Option<Secret>,
    pub token: Option<Secret>,
    pub tls_ca: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

/// A `nats` CLI context (`<config dir>/nats/context/<name>.json`): the keys Kedge uses; the others
/// (`description`, `jetstream_domain`, …) are ignored. Empty strings mean unset, as the `nats` CLI
/// writes every key.
#[derive(Default, Deserialize)]
#[serde(default)]
struct NatsContext {
    url: Option<String>,
    user: Option<String>,
    password: Option<String>,
    token: Option<String>,
    creds: Option<String>,
    nkey: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    ca: Option<String>,
    inbox_prefix: Option<String>,
}

/// `$XDG_CONFIG_HOME/nats/context/<name>.json`, else `$HOME/.config/nats/context/<name>.json`.
pub fn context_path(
    name: &str,
    env: impl Fn(&'static str) -> Option<String>,
) -> Result<PathBuf, ConfigError> {
    let bad = |reason: &str| ConfigError::Context {
        name: name.to_owned(),
        path: PathBuf::new(),
        reason: reason.to_owned(),
    };
    if name.is_empty()
        || name.starts_with('.')
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@'))
    {
        return Err(bad(
            "a context name is letters, digits and `-_.@`, not starting with `.`",
        ));
    }
    let base = match non_empty(env("XDG_CONFIG_HOME")) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(
            non_empty(env("HOME")).ok_or_else(|| bad("neither XDG_CONFIG_HOME nor HOME is set"))?,
        )
        .join(".config"),
    };
    Ok(base
        .join("nats")
        .join("context")
        .join(format!("{name}.json")))
}

fn non_empty(v: Option<String>) -> Option<String> {
    v.filter(|s| !s.trim().is_empty())
}

fn split_urls(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// `~/x` → `$HOME/x` (the `nats` CLI writes paths so).
fn expand_home(path: String, home: Option<&str>) -> PathBuf {
    match (path.strip_prefix("~/"), home) {
        (Some(rest), Some(home)) => Path::new(home).join(rest),
        _ => PathBuf::from(path),
    }
}

impl Config {
    /// Reads the context `name` and sets the fields it gives; returns whether it gave a URL.
    fn apply_context(
        &mut self,
        name: &str,
        env: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<bool, ConfigError> {
        let path = context_path(name, env)?;
        let failed = |reason: String| ConfigError::Context {
            name: name.to_owned(),
            path: path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| failed(e.to_string()))?;
        let ctx: NatsContext = serde_json::from_str(&text).map_err(|e| failed(e.to_string()))?;
        let home = non_empty(env("HOME"));
        let file = |v: Option<String>| non_empty(v).map(|p| expand_home(p, home.as_deref()));
        let n = &mut self.nats;
        let url = non_empty(ctx.url).map(|u| split_urls(&u));
        let gave_url = url.is_some();
        if let Some(urls) = url {
            self.nats_urls = urls;
        }
        if let Some(v) = file(ctx.creds) {
            n.creds_file = Some(v);
        }
        if let Some(v) = file(ctx.nkey) {
            n.nkey_seed_file = Some(v);
        }
        match (non_empty(ctx.user), non_empty(ctx.password)) {
            (Some(user), Some(password)) => {
                n.user = Some(user);
                n.password = Some(Secret(password));
            }
            // The `nats` CLI's `user` is a token when it has no password.
            (Some(token), None) => n.token = Some(Secret(token)),
            (None, Some(_)) => {
                return Err(failed("`password` is set without `user`".into()));
            }
            (None, None) => {}
        }
        if let Some(v) = non_empty(ctx.token) {
            n.token = Some(Secret(v));
        }
        if let Some(v) = file(ctx.ca) {
            n.tls_ca = Some(v);
        }
        if let Some(v) = file(ctx.cert) {
            n.tls_cert = Some(v);
        }
        if let Some(v) = file(ctx.key) {
            n.tls_key = Some(v);
        }
        if let Some(v) = non_empty(ctx.inbox_prefix) {
            n.inbox_prefix = v;
        }
        Ok(gave_url)
    }

    /// Sets what the flags give.
    fn apply_flags(&mut self, flags: &Flags) {
        if let Some(urls) = &flags.nats_url {
            self.nats_urls = split_urls(urls);
        }
        let n = &mut self.nats;
        let set = |field: &mut Option<PathBuf>, v: &Option<PathBuf>| {
            if v.is_some() {
                field.clone_from(v);
            }
        };
        set(&mut n.creds_file, &flags.creds);
        set(&mut n.nkey_seed_file, &flags.nkey);
        set(&mut n.tls_ca, &flags.tls_ca);
        set(&mut n.tls_cert, &flags.tls_cert);
        set(&mut n.tls_key, &flags.tls_key);
        if flags.user.is_some() {
            n.user.clone_from(&flags.user);
        }
        if flags.password.is_some() {
            n.password.clone_from(&flags.password);
        }
        if flags.token.is_some() {
            n.token.clone_from(&flags.token);
        }
    }

    /// The `nats` CLI's variables, for what no other source set: `NATS_URL` when no URL was
    /// given; `NATS_CREDS`, `NATS_NKEY`, `NATS_USER` (+ `NATS_PASSWORD`; without one it is a
    /// token, as in the `nats` CLI) when no authentication method is set.
    fn apply_nats_fallbacks(
        &mut self,
        url_given: bool,
        env: &impl Fn(&'static str) -> Option<String>,
    ) {
        if !url_given && let Some(v) = non_empty(env("NATS_URL")) {
            self.nats_urls = split_urls(&v);
        }
        let url_auth = matches!(url_auth(&self.nats_urls), Ok(Some(_)) | Err(_));
        if !self.nats.auth_methods().is_empty() || url_auth {
            return;
        }
        let home = non_empty(env("HOME"));
        let n = &mut self.nats;
        n.creds_file = non_empty(env("NATS_CREDS")).map(|p| expand_home(p, home.as_deref()));
        n.nkey_seed_file = non_empty(env("NATS_NKEY")).map(|p| expand_home(p, home.as_deref()));
        match (non_empty(env("NATS_USER")), non_empty(env("NATS_PASSWORD"))) {
            (Some(user), Some(password)) => {
                n.user = Some(user);
                n.password = Some(Secret(password));
            }
            (Some(token), None) => n.token = Some(Secret(token)),
            // A stray NATS_PASSWORD alone is ignored, as by the `nats` CLI.
            (None, _) => {}
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
    /// The projector rewrites a run's entry in the runs list (`kedge_runs`) at most once per
    /// this interval while the run makes decisions (its first decision is projected at once):
    /// the list, and the `max_active_runs` count read from it, trail a run by up to this long.
    /// 0: every decision is projected as it is delivered (`KEDGE_BRIDGE_RUNS_LIST_INTERVAL_MS`).
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
}

/// The longest `bridge.runs_list_interval_ms`.
pub const MAX_RUNS_LIST_INTERVAL_MS: u64 = 10_000;

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
    #[error(
        "more than one way to authenticate to NATS is set: {}; set only one of nats.creds_file, \
         nats.nkey_seed_file, nats.user + nats.password, nats.token, user info in nats_urls",
        fields.join(", ")
    )]
    AuthConflict { fields: Vec<&'static str> },
    #[error("nats context `{name}` ({}): {reason}", path.display())]
    Context {
        name: String,
        path: PathBuf,
        reason: String,
    },
}

impl Config {
    /// Defaults, overlaid by `file` (if given), the context `NATS_CONTEXT` names and the
    /// process environment; checked. [`Config::load_layered`] with no flags.
    pub fn load(file: Option<&Path>) -> Result<Config, ConfigError> {
        Self::load_layered(file, &Flags::default(), |k| std::env::var(k).ok())
    }

    /// Every layer, later wins: defaults, `file`, the `nats` CLI context named by
    /// `flags.context` or `NATS_CONTEXT`, `KEDGE_*` variables, `flags`; then `NATS_URL`,
    /// `NATS_CREDS`, `NATS_NKEY`, `NATS_USER`/`NATS_PASSWORD` for what none of them set.
    /// Variables (and `XDG_CONFIG_HOME`/`HOME`, where contexts live) are read through `env`.
    /// Checked.
    pub fn load_layered(
        file: Option<&Path>,
        flags: &Flags,
        env: impl Fn(&'static str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let (mut config, mut url_given) = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
                    path: path.to_owned(),
                    reason: e.to_string(),
                })?;
                let parse = |e: serde_json::Error| ConfigError::Parse {
                    path: path.to_owned(),
                    reason: e.to_string(),
                };
                let value: serde_json::Value = serde_json::from_str(&text).map_err(parse)?;
                let url_given = value.get("nats_urls").is_some_and(|v| !v.is_null());
                (serde_json::from_value(value).map_err(parse)?, url_given)
            }
            None => (Config::default(), false),
        };
        let context = flags
            .context
            .clone()
            .or_else(|| non_empty(env("NATS_CONTEXT")));
        if let Some(name) = context {
            url_given |= config.apply_context(name.trim(), &env)?;
        }
        url_given |= env("KEDGE_NATS_URL").is_some();
        config.apply_env(&env)?;
        url_given |= flags.nats_url.is_some();
        config.apply_flags(flags);
        config.apply_nats_fallbacks(url_given, &env);
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
        fn flag(var: &'static str, v: &str) -> Result<bool, ConfigError> {
            match v.trim() {
                "1" | "true" | "yes" => Ok(true),
                "0" | "false" | "no" | "" => Ok(false),
                other => Err(ConfigError::Env {
                    var,
                    reason: format!("`{other}` is not 1/0/true/false"),
                }),
            }
        }
        if let Some(v) = get("KEDGE_NATS_URL") {
            self.nats_urls = split_urls(&v);
        }
        let n = &mut self.nats;
        for (var, field) in [
            ("KEDGE_NATS_CREDS", &mut n.creds_file),
            ("KEDGE_NATS_NKEY", &mut n.nkey_seed_file),
            ("KEDGE_NATS_TLS_CA", &mut n.tls_ca),
            ("KEDGE_NATS_TLS_CERT", &mut n.tls_cert),
            ("KEDGE_NATS_TLS_KEY", &mut n.tls_key),
        ] {
            if let Some(v) = non_empty(get(var)) {
                *field = Some(PathBuf::from(v.trim()));
            }
        }
        if let Some(v) = non_empty(get("KEDGE_NATS_USER")) {
            n.user = Some(v);
        }
        if let Some(v) = non_empty(get("KEDGE_NATS_PASSWORD")) {
            n.password = Some(Secret(v));
        }
        if let Some(v) = non_empty(get("KEDGE_NATS_TOKEN")) {
            n.token = Some(Secret(v));
        }
        if let Some(v) = get("KEDGE_NATS_TLS_REQUIRED") {
            n.tls_required = flag("KEDGE_NATS_TLS_REQUIRED", &v)?;
        }
        if let Some(v) = non_empty(get("KEDGE_NATS_INBOX_PREFIX")) {
            n.inbox_prefix = v.trim().to_owned();
        }
        if let Some(v) = get("KEDGE_NATS_CONNECT_WAIT_MS") {
            n.connect_wait_ms = num("KEDGE_NATS_CONNECT_WAIT_MS", &v)?;
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
        if let Some(v) = get("KEDGE_APPROVER_TOKENS") {
            for pair in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let (token, name) = pair.split_once(':').ok_or_else(|| ConfigError::Env {
                    var: "KEDGE_APPROVER_TOKENS",
                    reason: format!("`{pair}` is not token:name"),
                })?;
                self.approvers.insert(token.to_owned(), name.to_owned());
            }
        }
        let list = |v: &str| -> Vec<String> {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect()
        };
        if let Some(v) = get("KEDGE_MODEL_KEYS") {
            self.models.keys = list(&v);
        }
        if let Some(v) = get("KEDGE_MODEL_BASE_URLS") {
            self.models.base_urls = list(&v);
        }
        if let Some(v) = get("KEDGE_MCP_SERVERS") {
            self.mcp_servers = serde_json::from_str(&v).map_err(|e| ConfigError::Env {
                var: "KEDGE_MCP_SERVERS",
                reason: format!("not a JSON object of server configurations: {e}"),
            })?;
        }
        if let Some(v) = get("KEDGE_METRICS_ADDR") {
            self.metrics_addr = non_empty(Some(v)).map(|v| v.trim().to_owned());
        }
        if let Some(v) = get("KEDGE_SEAL_KEY") {
            self.seal_key = non_empty(Some(v)).map(|v| Secret::new(v.trim()));
        }
        if let Some(v) = get("KEDGE_OTLP_ENDPOINT") {
            self.otlp_endpoint = non_empty(Some(v)).map(|v| v.trim().to_owned());
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
            self.bridge.open = flag("KEDGE_BRIDGE_OPEN", &v)?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_MAX_SSE_PER_TENANT") {
            self.bridge.max_sse_per_tenant = num("KEDGE_BRIDGE_MAX_SSE_PER_TENANT", &v)?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_RUNS_PER_MINUTE") {
            self.bridge.runs_per_minute = num("KEDGE_BRIDGE_RUNS_PER_MINUTE", &v)?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_MAX_ACTIVE_RUNS") {
            self.bridge.max_active_runs = num("KEDGE_BRIDGE_MAX_ACTIVE_RUNS", &v)?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_REQUEST_TIMEOUT_MS") {
            self.bridge.request_timeout_ms = num("KEDGE_BRIDGE_REQUEST_TIMEOUT_MS", &v)?;
        }
        if let Some(v) = get("KEDGE_BRIDGE_RUNS_LIST_INTERVAL_MS") {
            self.bridge.runs_list_interval_ms = num("KEDGE_BRIDGE_RUNS_LIST_INTERVAL_MS", &v)?;
        }
        if let Some(v) = get("KEDGE_RETENTION") {
            self.retention.enabled = flag("KEDGE_RETENTION", &v)?;
        }
        if let Some(v) = get("KEDGE_RETENTION_ARCHIVE") {
            self.retention.archive = flag("KEDGE_RETENTION_ARCHIVE", &v)?;
        }
        for (var, field) in [
            (
                "KEDGE_RETENTION_FINISHED_AFTER",
                &mut self.retention.finished_after,
            ),
            ("KEDGE_RETENTION_INTERVAL", &mut self.retention.interval),
            (
                "KEDGE_RETENTION_WORKSPACE_SWEEP",
                &mut self.retention.workspace_sweep,
            ),
        ] {
            if let Some(v) = get(var) {
                *field = parse_duration(&v).map_err(|reason| ConfigError::Env { var, reason })?;
            }
        }
        if let Some(v) = get("KEDGE_PROVIDER_OPEN_AFTER") {
            self.providers.open_after = num("KEDGE_PROVIDER_OPEN_AFTER", &v)?;
        }
        if let Some(v) = get("KEDGE_PROVIDER_LIMITS") {
            self.providers.limits = serde_json::from_str(&v).map_err(|e| ConfigError::Env {
                var: "KEDGE_PROVIDER_LIMITS",
                reason: format!("not a JSON array of endpoint limits: {e}"),
            })?;
        }
        if let Some(v) = get("KEDGE_PROVIDER_RELEASE_PER_SECOND") {
            self.providers.release_per_second = num("KEDGE_PROVIDER_RELEASE_PER_SECOND", &v)?;
        }
        for (var, field) in [
            ("KEDGE_PROVIDER_WAIT", &mut self.providers.wait),
            (
                "KEDGE_PROVIDER_PROBE_INTERVAL",
                &mut self.providers.probe_interval,
            ),
            (
                "KEDGE_PROVIDER_MAX_PROBE_INTERVAL",
                &mut self.providers.max_probe_interval,
            ),
        ] {
            if let Some(v) = get(var) {
                *field = parse_duration(&v).map_err(|reason| ConfigError::Env { var, reason })?;
            }
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
            ("KEDGE_HEARTBEAT_MS", &mut t.heartbeat_ms),
            ("KEDGE_SUSPECT_AFTER_MS", &mut t.suspect_after_ms),
            ("KEDGE_DRAIN_MS", &mut t.drain_ms),
            ("KEDGE_RECONNECT_GRACE_MS", &mut t.reconnect_grace_ms),
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
        self.nats.check(&self.nats_urls)?;
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
        self.bridge.check()?;
        self.retention.check()?;
        self.providers.check()?;
        if let Some(addr) = &self.metrics_addr {
            let port = addr
                .rsplit_once(':')
                .filter(|(host, _)| !host.is_empty())
                .and_then(|(_, port)| port.parse::<u16>().ok());
            if port.is_none() {
                return Err(ConfigError::Invalid {
                    field: "metrics_addr",
                    reason: format!("`{addr}` is not host:port (e.g. 0.0.0.0:9464)"),
                });
            }
        }
        if let Some(key) = &self.seal_key {
            crate::seal::SealKey::from_hex(key.expose()).map_err(|e| ConfigError::Invalid {
                field: "seal_key",
                reason: e.to_string(),
            })?;
        }
        if let Some(url) = &self.otlp_endpoint {
            let rest = url
                .strip_prefix("http://")
                .or_else(|| url.strip_prefix("https://"));
            if rest.is_none_or(|r| r.is_empty() || r.starts_with('/')) {
                return Err(ConfigError::Invalid {
                    field: "otlp_endpoint",
                    reason: format!(
                        "`{}` is not an http(s) URL (e.g. http://127.0.0.1:4318)",
                        redact_url(url)
                    ),
                });
            }
        }
        if let Some(bad) = self.models.base_urls.iter().find(|u| {
            *u != "loopback" && !(u.starts_with("https://") && u.len() > "https://".len())
        }) {
            return Err(ConfigError::Invalid {
                field: "models.base_urls",
                reason: format!(
                    "`{bad}`: an entry is an https:// prefix or `loopback` (plain http only on \
                     this host)"
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_is_off_by_default_and_reads_durations_with_units() {
        let c = Config::default();
        assert!(!c.retention.enabled);
        assert_eq!(
            c.retention.finished_after,
            std::time::Duration::from_secs(30 * 86_400)
        );
        assert!(c.retention.archive);
        let v: serde_json::Value = serde_json::to_value(&c).expect("serializes");
        assert_eq!(v["retention"]["finished_after"], "30d");
        assert_eq!(v["retention"]["interval"], "10m");
        let parsed: Config = serde_json::from_value(serde_json::json!({
            "retention": {"enabled": true, "finished_after": "12h", "interval": "90s", "archive": false}
        }))
        .expect("parses");
        assert!(parsed.retention.enabled && !parsed.retention.archive);
        assert_eq!(
            parsed.retention.finished_after,
            std::time::Duration::from_secs(12 * 3600)
        );
        assert_eq!(
            parsed.retention.interval,
            std::time::Duration::from_secs(90)
        );
        let mut e = Config::default();
        e.apply_env(|k| match k {
            "KEDGE_RETENTION" => Some("1".into()),
            "KEDGE_RETENTION_FINISHED_AFTER" => Some("2s".into()),
            "KEDGE_RETENTION_WORKSPACE_SWEEP" => Some("500ms".into()),
            _ => None,
        })
        .expect("applies");
        assert!(e.retention.enabled);
        assert_eq!(
            e.retention.finished_after,
            std::time::Duration::from_secs(2)
        );
        assert_eq!(
            e.retention.workspace_sweep,
            std::time::Duration::from_millis(500)
        );
        for bad in ["30", "3w", "d", "-1s", ""] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert!(
            Config::default()
                .apply_env(|k| (k == "KEDGE_RETENTION_INTERVAL").then(|| "soon".into()))
                .is_err()
        );
        let mut short = Config::default();
        short.retention.finished_after = std::time::Duration::from_millis(10);
        assert!(
            short
                .check()
                .expect_err("too short")
                .to_string()
                .contains("retention")
        );
        assert_eq!(
            format_duration(std::time::Duration::from_millis(1500)),
            "1500ms"
        );
    }

    #[test]
    fn endpoint_limits_match_by_the_fields_they_name() {
        use kedge_core::event::{ModelSpec, Provider};
        let mut c = Config::default();
        c.apply_env(|k| {
            (k == "KEDGE_PROVIDER_LIMITS").then(|| {
                r#"[{"base_url": "http://mock:9/v1/", "requests_per_minute": 1500},
                    {"provider": "anthropic", "key_var": "TEAM_KEY", "tokens_per_minute": 40000}]"#
                    .into()
            })
        })
        .expect("applies");
        c.check().expect("valid");
        let spec = |provider, base_url: Option<&str>| ModelSpec {
            provider,
            name: "m".into(),
            base_url: base_url.map(str::to_owned),
            settings: Default::default(),
            price: None,
        };
        let p = &c.providers;
        let mock = spec(Provider::Openai, Some("http://mock:9/v1"));
        assert_eq!(
            p.limit_for(&mock, "ANY")
                .and_then(|l| l.requests_per_minute),
            Some(1500)
        );
        let team = spec(Provider::Anthropic, None);
        assert_eq!(
            p.limit_for(&team, "TEAM_KEY")
                .and_then(|l| l.tokens_per_minute),
            Some(40000)
        );
        assert!(p.limit_for(&team, "OTHER_KEY").is_none());
        assert!(
            p.limit_for(&spec(Provider::Openai, None), "TEAM_KEY")
                .is_none()
        );
        // A limit of nothing, or of zero, is refused; so is a body that is not a list.
        for bad in [r#"[{"base_url": "x"}]"#, r#"[{"requests_per_minute": 0}]"#] {
            let mut c = Config::default();
            c.apply_env(|k| (k == "KEDGE_PROVIDER_LIMITS").then(|| bad.into()))
                .expect("parses");
            assert!(c.check().is_err(), "{bad}");
        }
        assert!(
            Config::default()
                .apply_env(|k| (k == "KEDGE_PROVIDER_LIMITS").then(|| "{}".into()))
                .is_err()
        );
    }

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
    fn agents_use_only_the_keys_and_endpoints_the_operator_allows() {
        let mut c = Config::default();
        assert!(c.check_model("OPENAI_API_KEY", None).is_ok());
        assert!(
            c.check_model("OPENAI_API_KEY", Some("https://api.openai.com/v1"))
                .is_ok()
        );
        assert!(
            c.check_model("OPENAI_API_KEY", Some("http://127.0.0.1:8080/v1"))
                .is_ok()
        );
        assert!(
            c.check_model("OPENAI_API_KEY", Some("http://[::1]:8080/v1"))
                .is_ok()
        );
        assert!(
            c.check_model("ANTHROPIC_API_KEY", Some("https://api.anthropic.com"))
                .is_ok(),
            "as Anthropic's SDKs write it"
        );
        for (var, url) in [
            ("ANTHROPIC_API_KEY", Some("https://api.anthropic.com.evil")),
            ("HOME", None),
            ("NATS_PASSWORD", None),
            ("OPENAI_API_KEY", Some("https://evil.example/v1")),
            (
                "OPENAI_API_KEY",
                Some("https://api.openai.com.evil.example/v1"),
            ),
            ("OPENAI_API_KEY", Some("http://10.0.0.5/v1")),
            ("OPENAI_API_KEY", Some("http://127.0.0.1@evil.example/v1")),
        ] {
            assert!(c.check_model(var, url).is_err(), "{var} {url:?}");
        }
        assert_eq!(
            c.api_key("HOME"),
            None,
            "a variable nobody allowed is not read"
        );
        c.api_keys.insert("EMBEDDED_KEY".into(), "k".into());
        assert!(c.check_model("EMBEDDED_KEY", None).is_ok());
        assert_eq!(c.api_key("EMBEDDED_KEY").as_deref(), Some("k"));
        c.apply_env(|k| match k {
            "KEDGE_MODEL_KEYS" => Some("MY_KEY".into()),
            "KEDGE_MODEL_BASE_URLS" => Some("https://llm.internal/, loopback".into()),
            _ => None,
        })
        .expect("applies");
        assert!(
            c.check_model("MY_KEY", Some("https://llm.internal/v1"))
                .is_ok()
        );
        assert!(c.check_model("OPENAI_API_KEY", None).is_err());
        c.models.base_urls.push("http://llm.internal/".into());
        assert!(c.check().is_err(), "plain http beyond this host");
    }

    #[test]
    fn the_metrics_endpoint_is_off_unless_an_address_is_given() {
        let mut c = Config::default();
        assert_eq!(c.metrics_addr, None);
        c.apply_env(|k| (k == "KEDGE_METRICS_ADDR").then(|| " 0.0.0.0:9464 ".into()))
            .expect("applies");
        assert_eq!(c.metrics_addr.as_deref(), Some("0.0.0.0:9464"));
        c.check().expect("valid");
        let dumped = serde_json::to_value(&c).expect("json");
        assert_eq!(dumped["metrics_addr"], "0.0.0.0:9464");
        c.apply_env(|k| (k == "KEDGE_METRICS_ADDR").then(String::new))
            .expect("applies");
        assert_eq!(c.metrics_addr, None, "an empty variable turns it off");
        for bad in ["9464", ":9464", "localhost:port", "127.0.0.1:70000"] {
            c.metrics_addr = Some(bad.into());
            let err = c.check().expect_err(bad).to_string();
            assert!(err.contains("metrics_addr"), "{err}");
        }
        let from_file: Config =
            serde_json::from_str(r#"{"metrics_addr": "[::1]:9464"}"#).expect("parses");
        from_file.check().expect("valid");
    }

    #[test]
    fn trace_export_is_off_unless_an_endpoint_is_given() {
        let mut c = Config::default();
        assert_eq!(c.otlp_endpoint, None);
        c.apply_env(|k| (k == "KEDGE_OTLP_ENDPOINT").then(|| " http://127.0.0.1:4318 ".into()))
            .expect("applies");
        assert_eq!(c.otlp_endpoint.as_deref(), Some("http://127.0.0.1:4318"));
        c.check().expect("valid");
        assert_eq!(
            serde_json::to_value(&c).expect("json")["otlp_endpoint"],
            "http://127.0.0.1:4318"
        );
        c.apply_env(|k| (k == "KEDGE_OTLP_ENDPOINT").then(String::new))
            .expect("applies");
        assert_eq!(c.otlp_endpoint, None, "an empty variable turns it off");
        for bad in ["127.0.0.1:4318", "http://", "grpc://collector:4317"] {
            c.otlp_endpoint = Some(bad.into());
            let err = c.check().expect_err(bad).to_string();
            assert!(err.contains("otlp_endpoint"), "{err}");
        }
        let from_file: Config =
            serde_json::from_str(r#"{"otlp_endpoint": "https://otel.example:4318"}"#)
                .expect("parses");
        from_file.check().expect("valid");
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

    /// An environment of these variables only.
    fn env_of(pairs: &[(&'static str, String)]) -> impl Fn(&'static str) -> Option<String> + use<> {
        let pairs = pairs.to_vec();
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
    }

    fn write(path: &Path, text: &str) {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("mkdir");
        }
        std::fs::write(path, text).expect("write");
    }

    /// A temp dir with a config file, an XDG config dir holding the context `ctx`, and a HOME.
    struct Layers {
        dir: tempfile::TempDir,
    }

    impl Layers {
        fn new() -> Layers {
            let layers = Layers {
                dir: tempfile::tempdir().expect("tempdir"),
            };
            write(
                &layers.file(),
                r#"{"nats_urls": ["nats://file:4222"],
                    "nats": {"tls_ca": "/file/ca.pem", "tls_cert": "/file/c.pem",
                             "tls_key": "/file/k.pem", "inbox_prefix": "_FILE"}}"#,
            );
            write(
                &layers.xdg().join("nats/context/ctx.json"),
                r#"{"description": "unknown keys are ignored", "url": "nats://ctx:4222",
                    "user": "ctx-user", "password": "ctx-pass", "ca": "/ctx/ca.pem",
                    "inbox_prefix": "_CTX", "jetstream_domain": "", "token": "", "creds": ""}"#,
            );
            layers
        }
        fn file(&self) -> PathBuf {
            self.dir.path().join("kedge.json")
        }
        fn xdg(&self) -> PathBuf {
            self.dir.path().join("xdg")
        }
        fn xdg_env(&self) -> (&'static str, String) {
            ("XDG_CONFIG_HOME", self.xdg().display().to_string())
        }
    }

    #[test]
    fn nats_settings_layer_file_then_context_then_env_then_flags() {
        let l = Layers::new();
        let file = l.file();
        let ctx = Flags {
            context: Some("ctx".into()),
            ..Flags::default()
        };
        let env = [
            l.xdg_env(),
            ("KEDGE_NATS_URL", "nats://env:4222".into()),
            ("KEDGE_NATS_TLS_CA", "/env/ca.pem".into()),
            ("KEDGE_NATS_PASSWORD", "env-pass".into()),
        ];

        // File only.
        let c = Config::load_layered(Some(&file), &Flags::default(), env_of(&[])).expect("file");
        assert_eq!(c.nats_urls, vec!["nats://file:4222"]);
        assert_eq!(c.nats.tls_ca.as_deref(), Some(Path::new("/file/ca.pem")));
        assert_eq!(c.inbox_prefix(), "_FILE");
        assert!(c.nats.requires_tls());

        // The context (named by NATS_CONTEXT) over the file, field by field.
        let c = Config::load_layered(
            Some(&file),
            &Flags::default(),
            env_of(&[l.xdg_env(), ("NATS_CONTEXT", "ctx".into())]),
        )
        .expect("context");
        assert_eq!(c.nats_urls, vec!["nats://ctx:4222"]);
        assert_eq!(c.nats.tls_ca.as_deref(), Some(Path::new("/ctx/ca.pem")));
        assert_eq!(c.nats.tls_cert.as_deref(), Some(Path::new("/file/c.pem")));
        assert_eq!(c.nats.user.as_deref(), Some("ctx-user"));
        assert_eq!(c.nats.password, Some(Secret::new("ctx-pass")));
        assert_eq!(c.nats.token, None, "an empty key is unset");
        assert_eq!(c.inbox_prefix(), "_CTX");

        // KEDGE_* over the context (named by --context).
        let c = Config::load_layered(Some(&file), &ctx, env_of(&env)).expect("env");
        assert_eq!(c.nats_urls, vec!["nats://env:4222"]);
        assert_eq!(c.nats.tls_ca.as_deref(), Some(Path::new("/env/ca.pem")));
        assert_eq!(c.nats.user.as_deref(), Some("ctx-user"));
        assert_eq!(c.nats.password, Some(Secret::new("env-pass")));

        // Flags over everything.
        let flags = Flags {
            nats_url: Some("nats://flag-a:1, nats://flag-b:2".into()),
            tls_ca: Some("/flag/ca.pem".into()),
            password: Some(Secret::new("flag-pass")),
            ..ctx.clone()
        };
        let c = Config::load_layered(Some(&file), &flags, env_of(&env)).expect("flags");
        assert_eq!(c.nats_urls, vec!["nats://flag-a:1", "nats://flag-b:2"]);
        assert_eq!(c.nats.tls_ca.as_deref(), Some(Path::new("/flag/ca.pem")));
        assert_eq!(c.nats.password, Some(Secret::new("flag-pass")));
        assert_eq!(c.nats.tls_key.as_deref(), Some(Path::new("/file/k.pem")));
    }

    #[test]
    fn kedge_nats_url_beats_nats_url_which_fills_only_an_unset_url() {
        let l = Layers::new();
        let nats_url = ("NATS_URL", "nats://nats-cli:4222".to_owned());
        let load = |file: Option<&Path>, flags: &Flags, env: &[(&'static str, String)]| {
            Config::load_layered(file, flags, env_of(env))
                .expect("loads")
                .nats_urls
        };
        let none = Flags::default();
        assert_eq!(load(None, &none, &[]), vec![DEFAULT_NATS_URL]);
        assert_eq!(
            load(None, &none, std::slice::from_ref(&nats_url)),
            vec!["nats://nats-cli:4222"]
        );
        assert_eq!(
            load(
                None,
                &none,
                &[
                    nats_url.clone(),
                    ("KEDGE_NATS_URL", "nats://kedge:1".into())
                ]
            ),
            vec!["nats://kedge:1"]
        );
        // A file or a context that gives a URL wins over NATS_URL.
        assert_eq!(
            load(Some(&l.file()), &none, std::slice::from_ref(&nats_url)),
            vec!["nats://file:4222"]
        );
        let ctx = Flags {
            context: Some("ctx".into()),
            ..Flags::default()
        };
        assert_eq!(
            load(None, &ctx, &[nats_url.clone(), l.xdg_env()]),
            vec!["nats://ctx:4222"]
        );
        let flag = Flags {
            nats_url: Some("nats://flag:1".into()),
            ..Flags::default()
        };
        assert_eq!(load(None, &flag, &[nats_url]), vec!["nats://flag:1"]);
    }

    #[test]
    fn nats_cli_credentials_fill_in_only_when_no_method_is_set() {
        let load = |env: &[(&'static str, String)]| {
            Config::load_layered(None, &Flags::default(), env_of(env))
                .expect("loads")
                .nats
        };
        let user = ("NATS_USER", "nu".to_owned());
        let pass = ("NATS_PASSWORD", "np".to_owned());
        let n = load(&[user.clone(), pass.clone()]);
        assert_eq!(
            (n.user.as_deref(), n.password),
            (Some("nu"), Some(Secret::new("np")))
        );
        // As in the `nats` CLI, a user without a password is a token.
        let n = load(std::slice::from_ref(&user));
        assert_eq!((n.user, n.token), (None, Some(Secret::new("nu"))));
        let n = load(&[
            ("NATS_CREDS", "~/u.creds".into()),
            ("HOME", "/home/k".into()),
        ]);
        assert_eq!(n.creds_file.as_deref(), Some(Path::new("/home/k/u.creds")));
        let n = load(&[("NATS_NKEY", "/k/u.nk".into())]);
        assert_eq!(n.nkey_seed_file.as_deref(), Some(Path::new("/k/u.nk")));
        // A Kedge-level method wins: no conflict with the ambient NATS_* variables.
        let n = load(&[user, pass, ("KEDGE_NATS_TOKEN", "kt".into())]);
        assert_eq!((n.user, n.password), (None, None));
        assert_eq!(n.token, Some(Secret::new("kt")));
    }

    #[test]
    fn two_ways_to_authenticate_are_refused_naming_both() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("kedge.json");
        write(&file, r#"{"nats": {"token": "file-token"}}"#);
        let err = Config::load_layered(
            Some(&file),
            &Flags::default(),
            env_of(&[("KEDGE_NATS_CREDS", "/k/u.creds".into())]),
        )
        .expect_err("token and creds");
        let text = err.to_string();
        assert!(matches!(err, ConfigError::AuthConflict { .. }), "{text}");
        assert!(
            text.contains("nats.creds_file") && text.contains("nats.token"),
            "{text}"
        );
        assert!(!text.contains("file-token"), "{text}");

        let mut c = Config {
            nats_urls: vec!["nats://u:url-pass@h:4222".into()],
            ..Config::default()
        };
        c.nats.nkey_seed_file = Some("/k/u.nk".into());
        let text = c.check().expect_err("URL user info and nkey").to_string();
        assert!(
            text.contains("nats_urls") && text.contains("nats.nkey_seed_file"),
            "{text}"
        );
        assert!(!text.contains("url-pass"), "{text}");

        let mut c = Config::default();
        c.nats.user = Some("u".into());
        assert!(
            c.check()
                .expect_err("no password")
                .to_string()
                .contains("nats.password")
        );
        let mut c = Config::default();
        c.nats.tls_cert = Some("/c.pem".into());
        assert!(
            c.check()
                .expect_err("no key")
                .to_string()
                .contains("tls_key")
        );
        let mut c = Config::default();
        c.nats.inbox_prefix = "_INBOX.>".into();
        assert!(
            c.check()
                .expect_err("wildcard")
                .to_string()
                .contains("inbox_prefix")
        );
        let mut c = Config::default();
        let seed = "SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU";
        c.nats.nkey_seed_file = Some(seed.into());
        let text = c.check().expect_err("a seed, not a path").to_string();
        assert!(
            text.contains("nkey_seed_file") && !text.contains(seed),
            "{text}"
        );
    }

    #[test]
    fn a_context_is_read_from_xdg_config_home_or_home() {
        let dir = tempfile::tempdir().expect("tempdir");
        let home = dir.path().join("home");
        write(
            &home.join(".config/nats/context/prod.json"),
            r#"{"url": "tls://a:4222,tls://b:4222", "user": "tok-as-user", "creds": "~/p.creds",
                "nkey": "", "color_scheme": "dark", "tls_first": false}"#,
        );
        let env = [
            ("HOME", home.display().to_string()),
            ("NATS_CONTEXT", "prod".to_owned()),
        ];
        // HOME/.config without XDG_CONFIG_HOME; ~ expanded; `user` without password = token,
        // which with `creds` is two methods: refused.
        let err = Config::load_layered(None, &Flags::default(), env_of(&env))
            .expect_err("creds and token");
        assert!(err.to_string().contains("nats.creds_file"), "{err}");
        write(
            &home.join(".config/nats/context/prod.json"),
            r#"{"url": "tls://a:4222,tls://b:4222", "creds": "~/p.creds", "unknown": 1}"#,
        );
        let c = Config::load_layered(None, &Flags::default(), env_of(&env)).expect("loads");
        assert_eq!(c.nats_urls, vec!["tls://a:4222", "tls://b:4222"]);
        assert_eq!(c.nats.creds_file, Some(home.join("p.creds")));

        let flags = Flags {
            context: Some("missing".into()),
            ..Flags::default()
        };
        let err = Config::load_layered(None, &flags, env_of(&env)).expect_err("no such context");
        let text = err.to_string();
        assert!(
            text.contains("`missing`") && text.contains("missing.json"),
            "{text}"
        );
        let flags = Flags {
            context: Some("../prod".into()),
            ..Flags::default()
        };
        assert!(matches!(
            Config::load_layered(None, &flags, env_of(&env)),
            Err(ConfigError::Context { .. })
        ));
        assert_eq!(
            context_path("x", env_of(&[("XDG_CONFIG_HOME", "/xdg".into())])).expect("path"),
            Path::new("/xdg/nats/context/x.json")
        );
    }

    #[test]
    fn secrets_never_show_in_dump_or_debug() {
        let mut c = Config {
            nats_urls: vec![
                "nats://url-user:url-pass@h1:4222".into(),
                "nats://url-token@h2:4222".into(),
            ],
            ..Config::default()
        };
        c.nats.creds_file = Some("/etc/kedge/user.creds".into());
        c.nats.user = Some("alice".into());
        c.nats.password = Some(Secret::new("nats-pass"));
        c.nats.token = Some(Secret::new("nats-token"));
        c.approvers.insert("approver-token".into(), "ann".into());
        c.api_keys.insert("OPENAI_API_KEY".into(), "sk-key".into());
        c.bridge.tokens = BridgeConfig::parse_tokens("bridge-token-0123456789=acme").expect("ok");
        c.mcp_servers.insert(
            "search".into(),
            kedge_mcp::ServerConfig::Stdio {
                command: "search-server".into(),
                args: vec![],
                env: [("SEARCH_API_KEY".to_owned(), "mcp-secret".to_owned())].into(),
                sandbox: None,
            },
        );
        let dumped = serde_json::to_string_pretty(&c).expect("json");
        assert!(
            dumped.contains("SEARCH_API_KEY"),
            "the variable's name is shown"
        );
        let debug = format!("{c:?} {c:#?}");
        for text in [&dumped, &debug] {
            for secret in [
                "url-pass",
                "url-token",
                "nats-pass",
                "nats-token",
                "approver-token",
                "sk-key",
                "bridge-token",
                "mcp-secret",
            ] {
                assert!(!text.contains(secret), "{secret} in {text}");
            }
            assert!(text.contains("<redacted>@h1:4222"), "{text}");
            assert!(text.contains("/etc/kedge/user.creds"), "{text}");
        }
        // A secret in a file reads as itself.
        let n: NatsConfig = serde_json::from_str(r#"{"password": "p", "user": "u"}"#).expect("ok");
        assert_eq!(n.password.as_ref().map(Secret::expose), Some("p"));
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
