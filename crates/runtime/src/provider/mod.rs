//! The fleet's view of each model endpoint, shared through the broker (docs/ARCHITECTURE.md,
//! "Provider trouble").
//!
//! A model provider's outage or rate limit is a wait, never a spent attempt; and it is the
//! fleet, not each run, that decides when to knock again. Everything here lives in the KV
//! bucket `kedge_providers`:
//!
//! - `breaker.<endpoint>`: the endpoint's breaker ([`Breaker`]): `closed` (calls go out),
//!   `open` (failing: calls are held, one probe goes out every `probe_interval`, doubling up to
//!   `max_probe_interval`), `recovering` (a probe succeeded: the waiting runs are released at
//!   `release_per_second`, oldest first and fair across tenants, and it closes once none wait).
//!   Every step process reports its calls' trouble and successes to it by compare-and-set.
//! - `wait.<endpoint>.<run_id>`: a run waiting on the endpoint ([`Waiter`]), written by the run's
//!   step before it journals `provider.waiting`; removed by the releaser after it journals the
//!   run's `provider.released`, with a delete marker that expires by itself.
//! - `pace.<endpoint>`: the endpoint's rate limits and the fleet's pace under them
//!   ([`pace::Pace`]): a call reserves its slot by compare-and-set before it goes, waiting in
//!   place for a slot within [`IN_PLACE`]; a call whose slot is further away, or that finds
//!   runs already waiting their turn, joins them (`wait.…`), and the releaser lets them go as
//!   the pace allows. The limits are the operator's (`providers.limits`) and those the provider
//!   names in its rate-limit headers, the lower of each.
//! - `lead.<endpoint>`: which step process releases the endpoint's runs ([`Lead`]), taken and
//!   renewed by compare-and-set, for [`LEAD_FOR`] at a time: a releaser that dies is replaced
//!   within that.
//!
//! Why it is safe under crashes: the journal says what each run does (`provider.waiting`, then
//! `provider.released` or the wait's bound firing as a durable timer); the bucket only says when
//! the fleet lets it. A lost or duplicated release is harmless: a release input is deduplicated
//! by its message id (the waiter's revision), counted once per wait by the fold, and a released
//! run whose endpoint is still failing is held again without a request. A wait whose record
//! is lost is written again by the run's next drive ([`Providers::ensure_waiting`]).
//!
//! The pure parts (the breaker's transitions, where a call goes, the release order) are
//! functions of their inputs, tested where they are (`breaker.rs`, `routing.rs`, `records.rs`);
//! [`Providers`] is the shell over the bucket: its live view (`watch.rs`), this process's calls
//! (`calls.rs`) and the waits and their release (`release.rs`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use kedge_core::ids::WorkerId;
use kedge_core::subjects::PROVIDERS_BUCKET;
use serde::Serialize;

use crate::config::ProviderConfig;

mod breaker;
mod calls;
pub mod pace;
mod records;
mod release;
mod routing;
mod watch;

pub use breaker::{
    Breaker, BreakerState, LONGEST_PROBE_WAIT, PROBE_SHARE, TroubleReport, probe_ceiling,
};
pub use calls::Admit;
pub use pace::{Limits, Pace};
pub use records::{Endpoint, Lead, Waiter};
pub use routing::{Route, release_order, route};

use records::{breaker_key, lead_key, pace_key, wait_key};
use watch::View;

/// How long a releaser holds an endpoint's lead before it must renew it.
pub const LEAD_FOR: Duration = Duration::from_secs(3);
/// How often the releaser looks at the endpoints with waiting runs.
const TICK: Duration = Duration::from_millis(100);
/// The longest a call waits in place (holding its run's lease) for its slot under the
/// endpoint's rate limits; a call whose slot is further away waits its turn in the queue.
pub const IN_PLACE: Duration = Duration::from_millis(500);
/// How long a released wait's delete marker stays (then the key is gone).
const MARKER_TTL_SECS: u64 = 60;
/// Compare-and-set attempts on a breaker before a report is given up (the next call reports
/// again).
const CAS_ATTEMPTS: usize = 4;
/// Compare-and-set attempts on a pace before a call waits its turn in the queue instead (every
/// call of a limited endpoint writes its pace, so several processes contend for it).
const PACE_ATTEMPTS: usize = 8;

/// What went wrong talking to `kedge_providers`.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error("{bucket} unavailable: {0}", bucket = kedge_core::subjects::PROVIDERS_BUCKET)]
    Unavailable(String),
}

fn unavailable(e: impl std::fmt::Display) -> ProviderError {
    ProviderError::Unavailable(e.to_string())
}

/// The shell over `kedge_providers`: a live view of the bucket (one KV watch per process), the
/// reports of this process's calls, and the release loop ([`Providers::run_releaser`]).
/// Cheap to clone.
#[derive(Clone)]
pub struct Providers {
    inner: Arc<Inner>,
}

struct Inner {
    kv: kv::Store,
    js: jetstream::Context,
    config: ProviderConfig,
    worker: WorkerId,
    view: Mutex<View>,
}

impl std::fmt::Debug for Providers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Providers")
            .field("worker", &self.inner.worker)
            .finish_non_exhaustive()
    }
}

impl Providers {
    /// Opens the bucket and starts watching it (the view is empty until the watch delivers).
    pub async fn open(
        js: jetstream::Context,
        config: ProviderConfig,
        worker: &WorkerId,
    ) -> Result<Providers, ProviderError> {
        let kv = js
            .get_key_value(PROVIDERS_BUCKET)
            .await
            .map_err(unavailable)?;
        let providers = Providers {
            inner: Arc::new(Inner {
                kv,
                js,
                config,
                worker: worker.clone(),
                view: Mutex::default(),
            }),
        };
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(providers.clone().watch(ready_tx));
        // The view is caught up before the first call is gated (bounded: a broker that does
        // not answer leaves the view empty, and calls go out as to a closed breaker).
        let _ = tokio::time::timeout(Duration::from_secs(5), ready_rx).await;
        Ok(providers)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, View> {
        self.inner
            .view
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Writes `value` at `key` by compare-and-set: over `revision`, or as a new key when there
    /// is none. The new revision, or why not (another process wrote it first, the broker).
    async fn write(
        &self,
        key: &str,
        value: &impl Serialize,
        revision: Option<u64>,
    ) -> Result<u64, String> {
        let bytes = bytes::Bytes::from(serde_json::to_vec(value).map_err(|e| e.to_string())?);
        match revision {
            Some(r) => self
                .inner
                .kv
                .update(key, bytes, r)
                .await
                .map_err(|e| e.to_string()),
            None => self
                .inner
                .kv
                .create(key, bytes)
                .await
                .map_err(|e| e.to_string()),
        }
    }
}

/// What the tests of the parts share.
#[cfg(test)]
mod fixtures {
    use std::time::Duration;

    use kedge_core::event::{Timestamp, Trouble};

    use super::{Endpoint, TroubleReport, Waiter};

    pub(super) fn at(secs: i64) -> Timestamp {
        Timestamp(time::OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(1_800_000_000 + secs))
    }

    pub(super) fn endpoint() -> Endpoint {
        Endpoint {
            id: "0123456789abcdef".into(),
            label: "openai http://127.0.0.1:1/v1 (K)".into(),
        }
    }

    pub(super) fn report(trouble: Trouble, probe: bool, retry_after: Option<u64>) -> TroubleReport {
        TroubleReport {
            trouble,
            message: "HTTP 503".into(),
            retry_after: retry_after.map(Duration::from_secs),
            probe,
        }
    }

    pub(super) fn waiter(run: &str, tenant: &str, since: i64, not_before: i64) -> Waiter {
        Waiter {
            run_id: run.parse().expect("run id"),
            tenant: tenant.parse().expect("tenant"),
            since: at(since),
            not_before: at(not_before),
            pace: None,
            tokens: 0,
            fallbacks: Vec::new(),
            fallback_after_ms: None,
        }
    }
}
