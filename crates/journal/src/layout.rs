//! The broker layout as data, and the startup check that the broker matches it.
//!
//! The streams, KV buckets and object store Kedge relies on are JSON files under `nats/`
//! (`nats/streams/`, `nats/kv/`, `nats/objects/`), in the JetStream `StreamConfig` form that
//! `nats stream add --config FILE` takes (KV buckets and the object store as their underlying
//! `KV_<bucket>` / `OBJ_<bucket>` streams, configured as `nats kv add` / `nats object add` and
//! async-nats would create them). They are embedded in the binary ([`LAYOUT`]), so a service
//! needs no files at runtime; operators can create the same things by hand from the same files.
//!
//! [`ensure_layout`] runs at every service's startup and fails fast:
//! 1. the server must be nats-server ≥ [`MIN_SERVER_VERSION`] with a JetStream API level ≥
//!    [`MIN_API_LEVEL`] (older servers *silently ignore* the stream flags and headers the journal
//!    depends on: atomic batches, wildcard expected-subject-sequence, per-message TTL, schedules);
//! 2. each stream is created if missing; an existing one is verified, never changed;
//! 3. after creating, the stream's info is read back and verified too, so that a flag the server
//!    dropped is noticed.
//!
//! Verification ([`diff_config`]) compares what Kedge relies on: subjects, retention, storage,
//! discard policy, per-subject history, every feature flag the file sets (`allow_atomic`,
//! `allow_msg_schedules`, `allow_msg_ttl`, `allow_direct`, `allow_rollup_hdrs`, `deny_delete`),
//! that `allow_rollup_hdrs` is off where the file sets it `false` (a stream that accepts
//! `Nats-Rollup` can be purged by any publisher), the delete-marker TTL, a consumer limit at
//! least the file's, and for the journal (`KEDGE_RUNS`) and the timers (`KEDGE_TIMERS`, whose
//! pending schedules may be days old) that they are never trimmed (no age, size or count limit).
//! Replicas, duplicate windows and descriptions are the operator's to tune.
//!
//! `KEDGE_RUNS` sets `max_consumers` explicitly: nats-server 2.15 caps every stream at 1000
//! consumers unless the stream sets a positive limit (a `-1` is silently replaced by that default),
//! and every live [`crate::Journal::tail`] is an ephemeral ordered consumer that lingers 30 s after
//! it is dropped.
//!
//! Note: nats-server 2.15 turns `allow_rollup_hdrs` on by itself for a stream with
//! `allow_msg_schedules` (schedules are stored as rollups). That is why the durable timers'
//! schedules live in their own stream, `KEDGE_TIMERS` (whose file states the forced `true`), and
//! not in the journal: `KEDGE_RUNS` must refuse `Nats-Rollup`, or anyone allowed to publish under
//! `agent.run.>` could purge a run's journal.

use std::time::Duration;

use async_nats::Client;
use bytes::Bytes;
use kedge_core::subjects::{
    AGENTS_STREAM, BLOBS_STREAM, IDEMPOTENCY_STREAM, LEASES_STREAM, PROVIDERS_STREAM,
    QUOTAS_STREAM, REJECTIONS_STREAM, RUNS_BUCKET_STREAM, RUNS_STREAM, SCHEDULES_STREAM,
    SECRETS_STREAM, SLOTS_STREAM, TASKS_STREAM, TIMERS_STREAM,
};
use serde_json::Value;

use crate::wire::{self, WireError, codes};

/// Oldest nats-server Kedge runs on (atomic batch + `Nats-Msg-Id` dedup inside batches).
pub const MIN_SERVER_VERSION: &str = "2.14.0";
/// Lowest JetStream API level (`$JS.API.INFO` → `api.level`) Kedge runs on.
pub const MIN_API_LEVEL: usize = 4;

const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Every stream of the layout: (stream name, its configuration as JSON), in creation order.
pub const LAYOUT: &[(&str, &str)] = &[
    (
        TASKS_STREAM,
        include_str!("../../../nats/streams/KEDGE_TASKS.json"),
    ),
    (
        RUNS_STREAM,
        include_str!("../../../nats/streams/KEDGE_RUNS.json"),
    ),
    (
        TIMERS_STREAM,
        include_str!("../../../nats/streams/KEDGE_TIMERS.json"),
    ),
    (
        REJECTIONS_STREAM,
        include_str!("../../../nats/streams/KEDGE_REJECTIONS.json"),
    ),
    (
        LEASES_STREAM,
        include_str!("../../../nats/kv/kedge_leases.json"),
    ),
    (
        IDEMPOTENCY_STREAM,
        include_str!("../../../nats/kv/kedge_idempotency.json"),
    ),
    (
        RUNS_BUCKET_STREAM,
        include_str!("../../../nats/kv/kedge_runs.json"),
    ),
    (
        PROVIDERS_STREAM,
        include_str!("../../../nats/kv/kedge_providers.json"),
    ),
    (
        SLOTS_STREAM,
        include_str!("../../../nats/kv/kedge_slots.json"),
    ),
    (
        QUOTAS_STREAM,
        include_str!("../../../nats/kv/kedge_quotas.json"),
    ),
    (
        AGENTS_STREAM,
        include_str!("../../../nats/kv/kedge_agents.json"),
    ),
    (
        SECRETS_STREAM,
        include_str!("../../../nats/kv/kedge_secrets.json"),
    ),
    (
        BLOBS_STREAM,
        include_str!("../../../nats/objects/kedge_blobs.json"),
    ),
    (
        SCHEDULES_STREAM,
        include_str!("../../../nats/kv/kedge_schedules.json"),
    ),
];

/// Streams that must never lose messages to limits: the journal is the only truth, and a
/// pending timer's schedule may wait for days.
const NEVER_TRIMMED: &[&str] = &[RUNS_STREAM, TIMERS_STREAM];

/// Options of [`ensure_layout`].
#[derive(Debug, Clone)]
pub struct LayoutOptions {
    /// Replicas of each stream created (1 for a single node, 3 for a cluster). Existing streams
    /// keep theirs.
    pub replicas: usize,
}

impl Default for LayoutOptions {
    fn default() -> Self {
        Self { replicas: 1 }
    }
}

/// What [`ensure_layout`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutReport {
    pub server_version: String,
    pub api_level: usize,
    /// Streams created by this call.
    pub created: Vec<String>,
    /// Streams that existed and matched.
    pub verified: Vec<String>,
}

/// Why the broker cannot run Kedge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error(
        "nats-server {found} is too old: Kedge needs nats-server >= {required} \
         (JetStream API level >= {MIN_API_LEVEL}); older servers silently ignore the stream \
         flags and headers the journal relies on"
    )]
    ServerTooOld {
        found: String,
        required: &'static str,
    },
    #[error(
        "stream {stream} does not match Kedge's layout: {field} is {found}, expected {expected} \
         (Kedge never changes an existing stream; fix or recreate it, e.g. from nats/ JSON files)"
    )]
    Mismatch {
        stream: String,
        field: String,
        expected: String,
        found: String,
    },
    #[error(
        "stream {stream} is missing: this server has no Kedge deployment (or not all of it); \
         run `kedge layout` (as admin) to create it"
    )]
    Missing { stream: String },
    #[error("JetStream is not available on this server/account: {0}")]
    NoJetStream(String),
    #[error("broker unavailable while checking the layout ({op}): {reason}")]
    Unavailable { op: String, reason: String },
    #[error("broker refused {op}: {reason}")]
    Rejected { op: String, reason: String },
    #[error("embedded layout file for {stream} is invalid: {reason}")]
    BadFile { stream: String, reason: String },
}

impl LayoutError {
    fn wire(op: String, e: WireError) -> Self {
        if e.is_transient() {
            LayoutError::Unavailable {
                op,
                reason: e.to_string(),
            }
        } else {
            LayoutError::Rejected {
                op,
                reason: e.to_string(),
            }
        }
    }
}

/// A `major.minor.patch` server version; a pre-release (`2.14.0-RC.1`) sorts before its release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServerVersion {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
    /// `true` for a release, `false` for a pre-release (so that releases compare greater).
    pub release: bool,
}

/// Parses `2.15.1`, `v2.15.1`, `2.14.0-RC.1`, `2.12.0+build`; `None` if it is not a version.
pub fn parse_version(s: &str) -> Option<ServerVersion> {
    let s = s.trim();
    let s = s.strip_prefix('v').unwrap_or(s);
    let (core, pre) = match s.find(['-', '+']) {
        Some(i) => (&s[..i], s[i..].starts_with('-')),
        None => (s, false),
    };
    let mut parts = core.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    let patch = parts.next().map_or(Some(0), |p| p.parse().ok())?;
    if parts.next().is_some() {
        return None;
    }
    Some(ServerVersion {
        major,
        minor,
        patch,
        release: !pre,
    })
}

/// Whether `found` is at least `required` (both as [`parse_version`] reads them; an unreadable
/// `found` is not).
pub fn version_at_least(found: &str, required: &str) -> bool {
    match (parse_version(found), parse_version(required)) {
        (Some(f), Some(r)) => f >= r,
        _ => false,
    }
}

/// Checks the server version and JetStream API level.
pub fn check_server(version: &str, api_level: usize) -> Result<(), LayoutError> {
    if !version_at_least(version, MIN_SERVER_VERSION) {
        return Err(LayoutError::ServerTooOld {
            found: if version.is_empty() {
                "(unknown version)".to_owned()
            } else {
                version.to_owned()
            },
            required: MIN_SERVER_VERSION,
        });
    }
    if api_level < MIN_API_LEVEL {
        return Err(LayoutError::ServerTooOld {
            found: format!("{version} (JetStream API level {api_level})"),
            required: MIN_SERVER_VERSION,
        });
    }
    Ok(())
}

/// One field where an existing stream differs from the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldMismatch {
    pub field: String,
    pub expected: String,
    pub found: String,
}

/// Fields whose value must equal the file's.
const EXACT_FIELDS: &[&str] = &["retention", "storage", "discard", "max_msgs_per_subject"];
/// Flags that must be on when the file turns them on (off in the file means "not relied on").
const FLAGS: &[&str] = &[
    "allow_atomic",
    "allow_msg_schedules",
    "allow_msg_ttl",
    "allow_direct",
    "allow_rollup_hdrs",
    "deny_delete",
];
/// Flags that must be off when the file turns them off explicitly (`false`, not just absent).
const OFF_FLAGS: &[&str] = &["allow_rollup_hdrs"];
/// Limits that must be unlimited on a never-trimmed stream, with their "unlimited" value.
const NO_LIMITS: &[(&str, i64)] = &[("max_age", 0), ("max_bytes", -1), ("max_msgs", -1)];

fn show(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "unset".to_owned(),
        Some(v) => v.to_string(),
    }
}

fn flag(v: Option<&Value>) -> bool {
    v.and_then(Value::as_bool).unwrap_or(false)
}

fn subject_set(v: Option<&Value>) -> Vec<String> {
    let mut s: Vec<String> = v
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    s.sort();
    s
}

/// Compares a stream's configuration as the server reports it (`found`) with the layout's
/// (`desired`), both JetStream `StreamConfig` JSON. Empty when `found` has everything Kedge relies
/// on. `never_trimmed` also requires no age, size or count limit.
pub fn diff_config(desired: &Value, found: &Value, never_trimmed: bool) -> Vec<FieldMismatch> {
    let mut out = Vec::new();
    let mut push = |field: &str, expected: String, found: String| {
        out.push(FieldMismatch {
            field: field.to_owned(),
            expected,
            found,
        })
    };
    let (want, got) = (
        subject_set(desired.get("subjects")),
        subject_set(found.get("subjects")),
    );
    if want != got {
        push("subjects", format!("{want:?}"), format!("{got:?}"));
    }
    for field in EXACT_FIELDS {
        if let Some(want) = desired.get(*field)
            && found.get(*field) != Some(want)
        {
            push(field, want.to_string(), show(found.get(*field)));
        }
    }
    for field in FLAGS {
        if flag(desired.get(*field)) && !flag(found.get(*field)) {
            push(field, "true".to_owned(), show(found.get(*field)));
        }
    }
    for field in OFF_FLAGS {
        if desired.get(*field) == Some(&Value::Bool(false)) && flag(found.get(*field)) {
            push(field, "false".to_owned(), show(found.get(*field)));
        }
    }
    // nats-server 2.15 replaces a `max_consumers` <= 0 by its default (1000 per stream), so a
    // limit the file sets must really be there.
    if let Some(want) = desired.get("max_consumers").and_then(Value::as_i64)
        && want > 0
    {
        let got = found
            .get("max_consumers")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        if got < want {
            push(
                "max_consumers",
                format!(">= {want}"),
                show(found.get("max_consumers")),
            );
        }
    }
    let marker = |v: &Value| {
        v.get("subject_delete_marker_ttl")
            .and_then(Value::as_u64)
            .unwrap_or(0)
    };
    if marker(desired) > 0 && marker(found) == 0 {
        push(
            "subject_delete_marker_ttl",
            marker(desired).to_string(),
            show(found.get("subject_delete_marker_ttl")),
        );
    }
    if never_trimmed {
        for (field, unlimited) in NO_LIMITS {
            let v = found
                .get(*field)
                .and_then(Value::as_i64)
                .unwrap_or(*unlimited);
            // The server reports "no limit" as -1 or 0 depending on the field.
            if v > 0 {
                push(field, unlimited.to_string(), v.to_string());
            }
        }
    }
    out
}

/// The layout file for `name`, with `num_replicas` set.
fn desired_config(name: &str, json: &str, replicas: usize) -> Result<Value, LayoutError> {
    let mut v: Value = serde_json::from_str(json).map_err(|e| LayoutError::BadFile {
        stream: name.to_owned(),
        reason: e.to_string(),
    })?;
    match v.as_object_mut() {
        Some(obj) if obj.get("name").and_then(Value::as_str) == Some(name) => {
            obj.insert("num_replicas".to_owned(), replicas.max(1).into());
            Ok(v)
        }
        _ => Err(LayoutError::BadFile {
            stream: name.to_owned(),
            reason: "not an object whose name is the stream's".into(),
        }),
    }
}

fn first_mismatch(stream: &str, diffs: Vec<FieldMismatch>) -> Result<(), LayoutError> {
    match diffs.into_iter().next() {
        None => Ok(()),
        Some(d) => Err(LayoutError::Mismatch {
            stream: stream.to_owned(),
            field: d.field,
            expected: d.expected,
            found: d.found,
        }),
    }
}

/// The stream's configuration as the server has it, `None` if there is no such stream.
async fn stream_config(client: &Client, name: &str) -> Result<Option<Value>, LayoutError> {
    match wire::api(
        client,
        &format!("STREAM.INFO.{name}"),
        Bytes::new(),
        REQUEST_TIMEOUT,
    )
    .await
    {
        Ok(info) => Ok(Some(info.get("config").cloned().unwrap_or(Value::Null))),
        Err(e) if e.api_code() == Some(codes::STREAM_NOT_FOUND) => Ok(None),
        Err(e) => Err(LayoutError::wire(format!("stream info {name}"), e)),
    }
}

/// Checks the server, then creates every missing stream of [`LAYOUT`] and verifies every stream
/// (existing ones and, read back, the ones just created). See the module docs.
pub async fn ensure_layout(
    client: &Client,
    opts: &LayoutOptions,
) -> Result<LayoutReport, LayoutError> {
    check_layout(client, opts, true).await
}

/// [`ensure_layout`] without creating anything: what a command that only reads or sends to an
/// existing deployment runs, so that pointing it at the wrong server changes nothing there. A
/// missing stream is [`LayoutError::Missing`].
pub async fn verify_layout(
    client: &Client,
    opts: &LayoutOptions,
) -> Result<LayoutReport, LayoutError> {
    check_layout(client, opts, false).await
}

async fn check_layout(
    client: &Client,
    opts: &LayoutOptions,
    create: bool,
) -> Result<LayoutReport, LayoutError> {
    // `server_info` is filled in by the server's INFO on connect.
    client.flush().await.map_err(|e| LayoutError::Unavailable {
        op: "connect".into(),
        reason: e.to_string(),
    })?;
    let version = client.server_info().version;
    // The version alone first: an old server's answers below may not even parse.
    check_server(&version, MIN_API_LEVEL)?;
    let info = match wire::api(client, "INFO", Bytes::new(), REQUEST_TIMEOUT).await {
        Ok(info) => info,
        Err(WireError::NoResponders) => {
            return Err(LayoutError::NoJetStream(format!(
                "no responders on {} (JetStream disabled?)",
                kedge_core::subjects::JS_API_INFO
            )));
        }
        Err(WireError::Api(e)) if e.code != 503 => {
            return Err(LayoutError::NoJetStream(e.to_string()));
        }
        Err(e) => return Err(LayoutError::wire("account info".into(), e)),
    };
    let api_level = info
        .get("api")
        .and_then(|a| a.get("level"))
        .and_then(Value::as_u64)
        .unwrap_or(0) as usize;
    check_server(&version, api_level)?;

    let mut report = LayoutReport {
        server_version: version,
        api_level,
        created: Vec::new(),
        verified: Vec::new(),
    };
    for (name, json) in LAYOUT {
        let desired = desired_config(name, json, opts.replicas)?;
        let never_trimmed = NEVER_TRIMMED.contains(name);
        if let Some(found) = stream_config(client, name).await? {
            first_mismatch(name, diff_config(&desired, &found, never_trimmed))?;
            report.verified.push((*name).to_owned());
            continue;
        }
        if !create {
            return Err(LayoutError::Missing {
                stream: (*name).to_owned(),
            });
        }
        let body = Bytes::from(desired.to_string());
        match wire::api(
            client,
            &format!("STREAM.CREATE.{name}"),
            body,
            REQUEST_TIMEOUT,
        )
        .await
        {
            Ok(_) => report.created.push((*name).to_owned()),
            // Someone else created it meanwhile, differently: verify theirs below.
            Err(e) if e.api_code() == Some(codes::STREAM_NAME_IN_USE) => {
                report.verified.push((*name).to_owned())
            }
            Err(e) => {
                // In a secured deployment only admin may create streams: the server drops the
                // request (a permission violation), which looks like a time-out from here.
                let op = format!(
                    "create stream {name}, which is missing (in a secured deployment only admin \
                     may create it: run `kedge layout` as admin first)"
                );
                return Err(LayoutError::wire(op, e));
            }
        }
        let found = stream_config(client, name)
            .await?
            .ok_or_else(|| LayoutError::Rejected {
                op: format!("create stream {name}"),
                reason: "the stream is missing right after it was created".into(),
            })?;
        first_mismatch(name, diff_config(&desired, &found, never_trimmed))?;
    }
    tracing::info!(
        server_version = %report.server_version,
        api_level = report.api_level,
        created = ?report.created,
        verified = ?report.verified,
        "broker layout {}",
        if create { "ensured" } else { "verified" }
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn versions_parse_and_compare() {
        assert_eq!(
            parse_version("2.15.1"),
            Some(ServerVersion {
                major: 2,
                minor: 15,
                patch: 1,
                release: true
            })
        );
        assert_eq!(parse_version("v2.14").map(|v| v.patch), Some(0));
        assert!(parse_version("nope").is_none());
        assert!(parse_version("2.x.1").is_none());
        assert!(parse_version("2.1.1.1").is_none());
        assert!(version_at_least("2.14.0", "2.14.0"));
        assert!(version_at_least("2.15.1", "2.14.0"));
        assert!(version_at_least("3.0.0", "2.14.0"));
        assert!(version_at_least("2.14.0+build.7", "2.14.0"));
        assert!(!version_at_least("2.14.0-RC.1", "2.14.0"));
        assert!(!version_at_least("2.12.9", "2.14.0"));
        assert!(!version_at_least("2.9.20", "2.14.0"));
        assert!(!version_at_least("", "2.14.0"));
    }

    #[test]
    fn server_check_names_the_needed_version() {
        assert!(check_server("2.15.1", 5).is_ok());
        let old = check_server("2.11.3", 1).expect_err("too old");
        assert_eq!(
            old,
            LayoutError::ServerTooOld {
                found: "2.11.3".into(),
                required: "2.14.0"
            }
        );
        assert!(old.to_string().contains("needs nats-server >= 2.14.0"));
        let level = check_server("2.14.0", 3).expect_err("low api level");
        assert!(level.to_string().contains("API level 3"), "{level}");
    }

    #[test]
    fn every_layout_file_is_a_stream_config_async_nats_reads() {
        for (name, json) in LAYOUT {
            let cfg: async_nats::jetstream::stream::Config =
                serde_json::from_str(json).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(&cfg.name, name);
            assert!(!cfg.subjects.is_empty(), "{name}");
            // Direct gets everywhere but the secrets, which only the kinds allowed may read
            // (docs/SECURITY.md, "Run ids").
            assert_eq!(cfg.allow_direct, *name != SECRETS_STREAM, "{name}");
            let desired = desired_config(name, json, 3).expect("valid");
            assert_eq!(desired["num_replicas"], 3);
            // A stream equal to its own file has no mismatch.
            assert!(diff_config(&desired, &desired, NEVER_TRIMMED.contains(name)).is_empty());
        }
        let runs = LAYOUT
            .iter()
            .find(|(n, _)| *n == "KEDGE_RUNS")
            .map(|(_, j)| serde_json::from_str::<async_nats::jetstream::stream::Config>(j))
            .expect("KEDGE_RUNS is in the layout")
            .expect("parses");
        assert!(runs.allow_atomic_publish && runs.deny_delete);
        // Schedules would force rollups on: they live in KEDGE_TIMERS instead.
        assert!(!runs.allow_message_schedules && !runs.allow_rollup);
        assert_eq!(runs.duplicate_window, Duration::from_secs(3600));
        assert_eq!(runs.max_age, Duration::ZERO);
        let timers = LAYOUT
            .iter()
            .find(|(n, _)| *n == "KEDGE_TIMERS")
            .map(|(_, j)| serde_json::from_str::<async_nats::jetstream::stream::Config>(j))
            .expect("KEDGE_TIMERS is in the layout")
            .expect("parses");
        assert!(timers.allow_message_schedules && timers.allow_message_ttl);
        assert_eq!(
            timers.max_age,
            Duration::ZERO,
            "pending timers are never aged out"
        );
        assert_eq!(
            timers.retention,
            async_nats::jetstream::stream::RetentionPolicy::Limits
        );
        assert_eq!(
            timers.storage,
            async_nats::jetstream::stream::StorageType::File
        );
        let leases = LAYOUT
            .iter()
            .find(|(n, _)| *n == "KV_kedge_leases")
            .map(|(_, j)| serde_json::from_str::<async_nats::jetstream::stream::Config>(j))
            .expect("leases are in the layout")
            .expect("parses");
        assert!(leases.allow_message_ttl && leases.subject_delete_marker_ttl.is_some());
        assert_eq!(leases.max_messages_per_subject, 1);
    }

    #[test]
    fn diff_names_missing_flags_and_changed_fields() {
        let desired = json!({
            "subjects": ["agent.run.>"], "retention": "limits", "storage": "file",
            "discard": "old", "allow_atomic": true, "allow_msg_schedules": true,
            "allow_direct": true, "deny_delete": true, "allow_msg_ttl": false,
        });
        let mut found = desired.clone();
        found["allow_rollup_hdrs"] = true.into();
        found["allow_msg_ttl"] = true.into();
        found["max_age"] = 0.into();
        found["max_bytes"] = (-1).into();
        assert!(
            diff_config(&desired, &found, true).is_empty(),
            "extra flags are fine"
        );

        let mut old_server = desired.clone();
        old_server.as_object_mut().map(|o| o.remove("allow_atomic"));
        let d = diff_config(&desired, &old_server, true);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].field, "allow_atomic");
        assert_eq!(d[0].found, "unset");

        let mut changed = desired.clone();
        changed["storage"] = "memory".into();
        changed["subjects"] = json!(["agent.run.*.>"]);
        changed["allow_msg_schedules"] = false.into();
        changed["max_age"] = 86_400_000_000_000i64.into();
        let fields: Vec<String> = diff_config(&desired, &changed, true)
            .into_iter()
            .map(|d| d.field)
            .collect();
        assert_eq!(
            fields,
            ["subjects", "storage", "allow_msg_schedules", "max_age"]
        );
        // Limits only matter on never-trimmed streams.
        assert_eq!(diff_config(&desired, &changed, false).len(), 3);
    }

    #[test]
    fn rollups_must_be_off_where_the_file_turns_them_off() {
        let desired = json!({"subjects": ["agent.run.>"], "allow_rollup_hdrs": false});
        let mut found = desired.clone();
        assert!(diff_config(&desired, &found, false).is_empty());
        found["allow_rollup_hdrs"] = true.into();
        let d = diff_config(&desired, &found, false);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].field, "allow_rollup_hdrs");
        assert_eq!(d[0].expected, "false");
        // A file that does not mention the flag does not care.
        let silent = json!({"subjects": ["agent.run.>"]});
        assert!(diff_config(&silent, &found, false).is_empty());
    }

    #[test]
    fn a_consumer_limit_the_file_sets_must_be_at_least_as_high() {
        let desired = json!({"subjects": ["a.>"], "max_consumers": 10_000});
        let unlimited_but_defaulted = json!({"subjects": ["a.>"], "max_consumers": -1});
        let d = diff_config(&desired, &unlimited_but_defaulted, false);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].field, "max_consumers");
        let higher = json!({"subjects": ["a.>"], "max_consumers": 50_000});
        assert!(diff_config(&desired, &higher, false).is_empty());
    }

    #[test]
    fn marker_ttl_must_be_set_when_the_file_sets_it() {
        let desired = json!({"subjects": ["$KV.l.>"], "allow_msg_ttl": true,
                             "subject_delete_marker_ttl": 60_000_000_000u64});
        let found = json!({"subjects": ["$KV.l.>"], "allow_msg_ttl": true});
        let d = diff_config(&desired, &found, false);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].field, "subject_delete_marker_ttl");
    }
}
