//! The streams and key-value buckets of the layout, and the keys Kedge keeps in them (part of
//! the registry: see the module above).

use crate::ids::TenantId;

use super::{ANY_TAIL, ONE_TOKEN};

/// Task intake stream (work-queue retention), subjects `agent.task.>`.
pub const TASKS_STREAM: &str = "KEDGE_TASKS";
/// The journal stream (limits retention, file storage), subjects `agent.run.>`.
pub const RUNS_STREAM: &str = "KEDGE_RUNS";
/// Durable timers (limits retention, message schedules): `kedge.timer.sched.<run>.<timer>` and
/// `kedge.timer.fired.<run>.<timer>` (see [`super::timer_scheduled`]).
pub const TIMERS_STREAM: &str = "KEDGE_TIMERS";
/// What was set aside (30 days): refused tasks `agent.rejected.<agent>`, journal messages that
/// failed their checks `agent.rejected.journal.<run>.<seq>`, dead letters
/// `agent.rejected.dead.<consumer>`.
pub const REJECTIONS_STREAM: &str = "KEDGE_REJECTIONS";
/// A key-value bucket's name and the name of the stream behind it (`KV_<bucket>`), each
/// spelled once.
macro_rules! bucket {
    ($(#[$doc:meta])* $bucket:ident, $stream:ident, $name:literal, $prefix:literal) => {
        $(#[$doc])*
        pub const $bucket: &str = $name;
        #[doc = concat!("The stream behind `", $name, "`.")]
        pub const $stream: &str = concat!($prefix, $name);
    };
}

bucket!(LEASES_BUCKET, LEASES_STREAM, "kedge_leases", "KV_");
bucket!(
    IDEMPOTENCY_BUCKET,
    IDEMPOTENCY_STREAM,
    "kedge_idempotency",
    "KV_"
);
bucket!(RUNS_BUCKET, RUNS_BUCKET_STREAM, "kedge_runs", "KV_");
bucket!(AGENTS_BUCKET, AGENTS_STREAM, "kedge_agents", "KV_");
bucket!(
    /// The fleet's view of each model endpoint: breakers, waiting runs, releasers.
    PROVIDERS_BUCKET,
    PROVIDERS_STREAM,
    "kedge_providers",
    "KV_"
);
bucket!(
    /// Tenant quotas, counted once for the fleet (docs/ARCHITECTURE.md "Quotas"): each
    /// tenant's run admissions ([`quota_admissions_key`]) and model usage per day window
    /// ([`quota_usage_key`]).
    QUOTAS_BUCKET,
    QUOTAS_STREAM,
    "kedge_quotas",
    "KV_"
);
/// The key of [`QUOTAS_BUCKET`] holding `tenant`'s run admissions (runs started in the current
/// minute window, unfinished runs): `runs.<tenant>`.
pub fn quota_admissions_key(tenant: &TenantId) -> String {
    format!("runs.{tenant}")
}
/// The key of [`QUOTAS_BUCKET`] holding `tenant`'s model usage in day window `day`:
/// `usage.<tenant>.<day>`.
pub fn quota_usage_key(tenant: &TenantId, day: u64) -> String {
    format!("usage.{tenant}.{day}")
}
/// The filter of every tenant's run admissions in [`QUOTAS_BUCKET`] (`runs.*`).
pub const QUOTA_ADMISSIONS_ALL: &str = "runs.*";
/// The tenant and day window of a [`quota_usage_key`], if `key` is one.
pub fn parse_quota_usage_key(key: &str) -> Option<(TenantId, u64)> {
    let (tenant, day) = key.strip_prefix("usage.")?.rsplit_once('.')?;
    Some((tenant.parse().ok()?, day.parse().ok()?))
}
/// The tenant of a [`quota_admissions_key`], if `key` is one.
pub fn parse_quota_admissions_key(key: &str) -> Option<TenantId> {
    key.strip_prefix("runs.")?.parse().ok()
}
bucket!(
    /// Server-held secrets (no direct gets: read only by the kinds whose permissions allow it).
    SECRETS_BUCKET,
    SECRETS_STREAM,
    "kedge_secrets",
    "KV_"
);
bucket!(
    /// The slots of concurrency keys: one record per key of a tenant, `<tenant>.<key digest>`
    /// ([`slot_key`]), listing the runs holding its slots and the runs waiting
    /// (docs/ARCHITECTURE.md "Concurrency keys and priorities").
    SLOTS_BUCKET,
    SLOTS_STREAM,
    "kedge_slots",
    "KV_"
);

/// The key of concurrency key `key` of `tenant` in [`SLOTS_BUCKET`]: `<tenant>.<32 hex digits
/// of SHA-256 of the key>` (tenant-scoped: another tenant's same key is another record).
pub fn slot_key(tenant: &TenantId, key: &str) -> String {
    format!("{tenant}.{}", crate::concurrency::key_digest(key))
}

bucket!(
    /// Schedules (docs/ARCHITECTURE.md, "Schedules"): key `<tenant>.<name>`, value the
    /// schedule's spec and its state (`kedge_core::schedule::ScheduleRecord`).
    SCHEDULES_BUCKET,
    SCHEDULES_STREAM,
    "kedge_schedules",
    "KV_"
);
/// The key filter of every schedule of `tenant` in [`SCHEDULES_BUCKET`] (`<tenant>.*`).
pub fn schedules_of(tenant: &TenantId) -> String {
    format!("{tenant}.{ONE_TOKEN}")
}
/// The key of [`SECRETS_BUCKET`] holding the key run ids are derived with (docs/SECURITY.md,
/// "Run ids").
pub const RUN_ID_KEY_ENTRY: &str = "run-ids";
bucket!(
    /// The object store of what journal messages and records hold by reference.
    BLOBS_BUCKET,
    BLOBS_STREAM,
    "kedge_blobs",
    "OBJ_"
);

/// The streams a finished run has data in, which retention purges it from (named one by one:
/// never the tasks or the agents): the journal, the operation and model-answer records, its
/// lease, its summary in the runs projection, its timers, what was set aside of it, and its
/// blobs. The retention user's permissions are built from this list, and retention's tests check
/// that every purge it makes is of one of these streams.
pub const PURGED_STREAMS: [&str; 7] = [
    RUNS_STREAM,
    IDEMPOTENCY_STREAM,
    LEASES_STREAM,
    RUNS_BUCKET_STREAM,
    TIMERS_STREAM,
    REJECTIONS_STREAM,
    BLOBS_STREAM,
];

/// The key of the retention service's cursor in [`LEASES_BUCKET`] (the journal sequence through
/// which it handled terminal events): the one key of that bucket the retention user may write.
pub const RETENTION_CURSOR_KEY: &str = "retention.cursor";

/// The subject of key `key` of key-value bucket `bucket` (`$KV.<bucket>.<key>`; a key with
/// wildcards makes a filter).
pub fn kv_key(bucket: &str, key: &str) -> String {
    format!("$KV.{bucket}.{key}")
}

/// The subject of an object's meta record in object store `bucket` (`$O.<bucket>.M.<encoded name>`).
pub fn object_meta(bucket: &str, encoded_name: &str) -> String {
    format!("$O.{bucket}.M.{encoded_name}")
}

/// The subject of an object's chunks in object store `bucket` (`$O.<bucket>.C.<nuid>`).
pub fn object_chunks(bucket: &str, nuid: &str) -> String {
    format!("$O.{bucket}.C.{nuid}")
}

/// Every subject of key-value bucket `bucket` (`$KV.<bucket>.>`): its keys, to write or watch.
pub fn kv_all(bucket: &str) -> String {
    kv_key(bucket, ANY_TAIL)
}

/// Every subject of object store `bucket` a writer publishes: its chunks (`$O.<bucket>.C.>`)
/// and its meta records (`$O.<bucket>.M.>`).
pub fn object_writes(bucket: &str) -> [String; 2] {
    [
        object_chunks(bucket, ANY_TAIL),
        object_meta(bucket, ANY_TAIL),
    ]
}

/// Every subject of every object store (`$O.>`).
pub const OBJECTS_ALL: &str = "$O.>";
