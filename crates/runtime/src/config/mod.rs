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
//!
//! # Sections
//!
//! Each group of settings is a module with its struct(s), defaults, checks and variables:
//! `nats` (connecting to NATS) and `layers` (the `nats` CLI context, flags and the `nats` CLI's
//! variables), `workers` (the process, its workers and tools), `secrets` ([`Secret`], approvers,
//! the seal key, the run-id key), `models`, `mcp`, `telemetry` (metrics and traces), `bridge`, `retention`,
//! `providers`, `quotas`, `fairness` and `timeouts`; `duration` and `env` read values. This module holds [`Config`]
//! itself and its loading: the file, the layers, the variables, the checks.

mod bridge;
mod duration;
mod env;
mod fairness;
mod layers;
mod mcp;
mod models;
mod nats;
mod providers;
mod quotas;
mod retention;
mod secrets;
mod telemetry;
mod timeouts;
mod workers;

pub use bridge::{BridgeConfig, BridgeToken, MAX_RUNS_LIST_INTERVAL_MS};
pub use duration::{format_duration, parse_duration};
pub use fairness::FairnessConfig;
pub use layers::{Flags, context_path};
pub use models::{ModelPolicy, is_loopback_url};
pub use nats::{DEFAULT_INBOX_PREFIX, DEFAULT_NATS_URL, NatsConfig};
pub use providers::{EndpointLimit, ProviderConfig};
pub use quotas::QuotasConfig;
pub use retention::RetentionConfig;
pub use secrets::{REDACTED, Secret};
pub use workers::SandboxKind;

use std::path::{Path, PathBuf};

use kedge_core::config::mcp::ServerConfig;
use kedge_core::config::{RelationError, Timeouts};
use kedge_core::ids::WorkerId;
use serde::{Deserialize, Serialize};

use crate::connect::redact_url;
use env::non_empty;
use mcp::redacted_mcp_env;

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
    pub worker_id: WorkerId,
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
    /// Run built-in tools inside the step's drive when the process runs the tool service too
    /// (`KEDGE_INLINE_TOOLS`, default on): the drive that requests such an operation runs it
    /// and goes on with its result, instead of a tool worker's delivery and a wake of the run
    /// (docs/ARCHITECTURE.md "Inline tools"). Off: every operation goes to the tool service.
    pub inline_tools: bool,
    /// Runs a step worker drives at once.
    pub step_concurrency: usize,
    /// Tool operations a tool worker runs at once.
    pub tool_concurrency: usize,
    /// Lower the intake, step and tool services' concurrency while their work queues in the
    /// broker or for the CPU (`KEDGE_ADAPTIVE_CONCURRENCY`, default off), so that it waits in
    /// the fair queue where tenants take turns: another tenant's latency under one tenant's
    /// backlog for that backlog's throughput (docs/ARCHITECTURE.md "Fairness across tenants").
    /// Off: the configured concurrency always.
    pub adaptive_concurrency: bool,
    /// Open a light lane (a second connection to the broker, and threads of its own) for the
    /// intake, step and tool consumers' deliveries and the work of a tenant without a backlog
    /// (`KEDGE_LIGHT_LANE`, default on), so that its operations do not wait behind another
    /// tenant's backlog in one connection's queue, one set of threads and one set of handler
    /// slots (docs/ARCHITECTURE.md "Fairness across tenants"). Off: one connection per process.
    pub light_lane: bool,
    /// The CPU priority (a nice value, 0 to 19) of the process's shared Tokio threads while
    /// its light lane is open (`KEDGE_SHARED_NICE`, default 10): the light lane's threads keep
    /// the process's own, so the work of a tenant without a backlog gets a core ahead of the
    /// backlog's (docs/ARCHITECTURE.md "Fairness across tenants"). 0: the same priority.
    /// Linux only, and only in the `kedge` binary (its shared runtime calls the hook).
    pub shared_nice: u8,
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
    pub mcp_servers: std::collections::BTreeMap<String, ServerConfig>,
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
    /// The key run ids are derived with (`KEDGE_RUN_ID_KEY`: 64 hex digits, 32 bytes;
    /// [`crate::run_ids`]). None (the default): the one held in the broker, created at random
    /// once. When set, the first process that ensures the layout stores it there, and every
    /// process that has it checks that the broker holds the same. Never printed.
    pub run_id_key: Option<Secret>,
    /// The retention policy (`kedge serve retention`) and the tool hosts' sweep of purged runs'
    /// workspaces. Off by default: see [`RetentionConfig`] and docs/CONFIG.md "Retention".
    pub retention: RetentionConfig,
    /// How the fleet rides out a model provider's outages and rate limits
    /// ([`crate::provider`], docs/CONFIG.md "Provider trouble").
    pub providers: ProviderConfig,
    /// Tenant quotas, counted once for the fleet ([`crate::quota`], docs/CONFIG.md "Quotas").
    pub quotas: QuotasConfig,
    /// How intake, step and tool share their work among tenants (docs/CONFIG.md "Fairness
    /// across tenants").
    pub fairness: FairnessConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            nats_urls: vec![DEFAULT_NATS_URL.into()],
            nats: NatsConfig::default(),
            replicas: 1,
            worker_id: WorkerId::generate(),
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
            inline_tools: true,
            step_concurrency: 256,
            tool_concurrency: 64,
            adaptive_concurrency: false,
            light_lane: true,
            shared_nice: 10,
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
            run_id_key: None,
            retention: RetentionConfig::default(),
            providers: ProviderConfig::default(),
            quotas: QuotasConfig::default(),
            fairness: FairnessConfig::default(),
        }
    }
}

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
            inline_tools,
            step_concurrency,
            tool_concurrency,
            adaptive_concurrency,
            light_lane,
            shared_nice,
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
            run_id_key,
            retention,
            providers,
            quotas,
            fairness,
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
            .field("inline_tools", inline_tools)
            .field("step_concurrency", step_concurrency)
            .field("tool_concurrency", tool_concurrency)
            .field("adaptive_concurrency", adaptive_concurrency)
            .field("light_lane", light_lane)
            .field("shared_nice", shared_nice)
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
            .field("run_id_key", run_id_key)
            .field("retention", retention)
            .field("providers", providers)
            .field("quotas", quotas)
            .field("fairness", fairness)
            .finish()
    }
}

fn redacted_urls<S: serde::Serializer>(urls: &[String], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(urls.iter().map(|u| redact_url(u)))
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
        // Section by section; the first bad variable in this order is the one reported.
        self.apply_nats_env(&get)?;
        self.apply_workers_env(&get)?;
        self.apply_approvers_env(&get)?;
        self.models.apply_env(&get);
        self.apply_mcp_env(&get)?;
        self.apply_metrics_env(&get);
        self.apply_seal_key_env(&get);
        self.apply_run_id_key_env(&get);
        self.apply_otlp_env(&get);
        self.bridge.apply_env(&get)?;
        self.retention.apply_env(&get)?;
        self.providers.apply_env(&get)?;
        self.quotas.apply_env(&get)?;
        self.fairness.apply_env(&get)?;
        self.apply_timeouts_env(&get)
    }

    /// Checks the timeout relations and the other fields.
    pub fn check(&self) -> Result<(), ConfigError> {
        // Section by section; the first failing check in this order is the one reported.
        self.timeouts.check()?;
        self.check_mcp_servers()?;
        self.check_nats()?;
        self.check_workers()?;
        self.bridge.check()?;
        self.retention.check()?;
        self.providers.check()?;
        self.quotas.check()?;
        self.fairness.check()?;
        self.check_metrics_addr()?;
        self.check_seal_key()?;
        self.check_run_id_key()?;
        self.check_otlp_endpoint()?;
        self.models.check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Helpers of the section modules' tests.

    /// An environment of these variables only.
    pub(super) fn env_of(
        pairs: &[(&'static str, String)],
    ) -> impl Fn(&'static str) -> Option<String> + use<> {
        let pairs = pairs.to_vec();
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
    }

    pub(super) fn write(path: &Path, text: &str) {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("mkdir");
        }
        std::fs::write(path, text).expect("write");
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
            ServerConfig::Stdio {
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
