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
//! The pure parts (the breaker's transitions, the release order) are functions of their inputs
//! and tested below; [`Providers`] is the shell over the bucket.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, kv};
use futures::StreamExt;
use kedge_core::event::{Draft, Envelope, Event, ModelSpec, ProviderReleased, Timestamp, Trouble};
use kedge_core::ids::{InputId, RunId, TenantId};
use kedge_core::subjects::PROVIDERS_BUCKET;
use kedge_journal::{Journal, JournalError};
use serde::{Deserialize, Serialize};

use crate::config::ProviderConfig;
use crate::metrics;

pub mod pace;

pub use pace::{Limits, Pace};

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

/// A model endpoint: what the fleet shares a breaker and a wait list for. Two agents with the
/// same provider, base URL and key variable share it; the key itself never enters it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// 16 hex digits of the label's SHA-256 (a KV key token).
    pub id: String,
    /// `<provider> <base URL> (<key variable>)`, for people.
    pub label: String,
}

impl Endpoint {
    pub fn new(spec: &ModelSpec, key_var: &str) -> Endpoint {
        let provider = match spec.provider {
            kedge_core::event::Provider::Openai => "openai",
            kedge_core::event::Provider::Anthropic => "anthropic",
        };
        let base = spec.base_url.as_deref().unwrap_or("default");
        let label = format!("{provider} {base} ({key_var})");
        Endpoint {
            id: key_token(&label),
            label,
        }
    }

    /// The key token of the pace of `model`'s calls to this endpoint: providers count rate
    /// limits per model.
    pub fn pace_id(&self, model: &str) -> String {
        format!("{}.{}", self.id, key_token(model))
    }
}

/// 16 hex digits of `text`'s SHA-256: a KV key token for a name that may hold any character.
fn key_token(text: &str) -> String {
    let digest = kedge_core::event::Digest::of_bytes(text.as_bytes());
    digest
        .as_str()
        .trim_start_matches("sha256:")
        .chars()
        .take(16)
        .collect()
}

/// Where an endpoint's breaker stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    #[default]
    Closed,
    Open,
    Recovering,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::Recovering => "recovering",
        }
    }
}

/// An endpoint's breaker, as stored at `breaker.<endpoint>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Breaker {
    pub endpoint: String,
    pub state: BreakerState,
    /// Trouble reported in a row with no success between (while closed).
    #[serde(default)]
    pub failures: u32,
    /// When it last opened.
    #[serde(default)]
    pub opened_at: Option<Timestamp>,
    #[serde(default)]
    pub trouble: Option<Trouble>,
    #[serde(default)]
    pub last_error: String,
    /// When the fleet's next probe may go out (while open).
    #[serde(default)]
    pub next_probe_at: Option<Timestamp>,
    /// The wait before the next probe after this one fails.
    #[serde(default)]
    pub probe_interval_ms: u64,
    /// Probes sent since it last opened.
    #[serde(default)]
    pub probes: u64,
    pub updated_at: Timestamp,
}

impl Breaker {
    pub fn closed(endpoint: &Endpoint, now: Timestamp) -> Breaker {
        Breaker {
            endpoint: endpoint.label.clone(),
            state: BreakerState::Closed,
            failures: 0,
            opened_at: None,
            trouble: None,
            last_error: String::new(),
            next_probe_at: None,
            probe_interval_ms: 0,
            probes: 0,
            updated_at: now,
        }
    }

    /// Whether a call may go out: always unless open, and then only the fleet's probe.
    pub fn lets(&self, released: Option<bool>) -> bool {
        match self.state {
            BreakerState::Closed | BreakerState::Recovering => true,
            BreakerState::Open => released == Some(true),
        }
    }

    /// The breaker after a call met `trouble` (`probe`: the call was the fleet's probe);
    /// `None` when it does not change.
    pub fn on_trouble(
        &self,
        report: &TroubleReport,
        now: Timestamp,
        c: &ProviderConfig,
    ) -> Breaker {
        let mut b = self.clone();
        b.trouble = Some(report.trouble);
        b.last_error = report.message.chars().take(500).collect();
        b.updated_at = now;
        let wait_asked = report.retry_after.unwrap_or_default();
        match self.state {
            BreakerState::Closed => {
                b.failures = b.failures.saturating_add(1);
                if report.trouble == Trouble::RateLimited || b.failures >= c.open_after {
                    b.open(now, c.probe_interval.max(wait_asked), false);
                }
            }
            // A released call failed: the endpoint is not back after all.
            BreakerState::Recovering => b.open(now, c.probe_interval.max(wait_asked), false),
            BreakerState::Open if report.probe => {
                let doubled = Duration::from_millis(self.probe_interval_ms.saturating_mul(2))
                    .clamp(c.probe_interval, probe_ceiling(self.opened_at, now, c));
                b.open(now, doubled.max(wait_asked), true);
            }
            // A call that was in flight when it opened: only a longer wait asked counts.
            BreakerState::Open => {
                let asked = now.saturating_add(wait_asked);
                if self.next_probe_at.is_none_or(|at| asked > at) {
                    b.next_probe_at = Some(asked);
                }
            }
        }
        b
    }

    fn open(&mut self, now: Timestamp, wait: Duration, keep_since: bool) {
        if !keep_since || self.opened_at.is_none() {
            self.opened_at = Some(now);
            self.probes = 0;
        }
        self.state = BreakerState::Open;
        self.next_probe_at = Some(now.saturating_add(wait));
        self.probe_interval_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
    }

    /// The breaker after a call succeeded; `None` when it does not change.
    pub fn on_success(&self, now: Timestamp) -> Option<Breaker> {
        let mut b = self.clone();
        match self.state {
            BreakerState::Closed if self.failures == 0 => return None,
            BreakerState::Closed => b.failures = 0,
            BreakerState::Open => b.state = BreakerState::Recovering,
            BreakerState::Recovering => return None,
        }
        b.updated_at = now;
        Some(b)
    }
}

/// The longest wait between two probes of an endpoint open since `opened_at`:
/// `max_probe_interval`, or, in a long outage, 1/[`PROBE_SHARE`] of how long it has been open
/// (up to [`LONGEST_PROBE_WAIT`]). Recovery is noticed within a small share of the outage's
/// length, and a run that waits through a day-long outage alone is not probed (and its journal
/// not grown) every few seconds all day.
pub fn probe_ceiling(opened_at: Option<Timestamp>, now: Timestamp, c: &ProviderConfig) -> Duration {
    let open_for = opened_at
        .and_then(|at| Duration::try_from(now.0 - at.0).ok())
        .unwrap_or_default();
    c.max_probe_interval
        .max((open_for / PROBE_SHARE).min(LONGEST_PROBE_WAIT))
}

/// A long outage's probes come at most every 1/PROBE_SHARE of its length so far.
pub const PROBE_SHARE: u32 = 300;
/// The longest wait between two probes, however long the outage.
pub const LONGEST_PROBE_WAIT: Duration = Duration::from_secs(60);

/// What one call's trouble tells the breaker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TroubleReport {
    pub trouble: Trouble,
    pub message: String,
    /// How long the provider asked to be left alone (`retry-after`).
    pub retry_after: Option<Duration>,
    /// The call was the fleet's probe.
    pub probe: bool,
}

/// A run waiting on an endpoint, as stored at `wait.<endpoint>.<run_id>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiter {
    pub run_id: RunId,
    pub tenant: TenantId,
    /// When the run's step began to wait (the release order: oldest first).
    pub since: Timestamp,
    /// Not released before this (the run's own backoff, or the provider's `retry-after`).
    pub not_before: Timestamp,
    /// The pace the call keeps to ([`Endpoint::pace_id`]) when it waits its turn under rate
    /// limits: its release reserves the call's slot there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pace: Option<String>,
    /// The call's input tokens, as estimated (what its slot takes from the token limit).
    #[serde(default)]
    pub tokens: u64,
    /// The endpoints of the run's fallback models ([`Endpoint::id`]), in order: while this
    /// endpoint has been failing for `fallback_after_ms`, the run is released to the first of
    /// them that is not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fallbacks: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_after_ms: Option<u64>,
}

impl Waiter {
    /// Whether the run may be released to a fallback now: its endpoint (`primary`) has been
    /// failing for its `fallback_after`, and one of its fallbacks' breakers lets calls go.
    fn may_fall_back(
        &self,
        primary: &Breaker,
        breakers: &HashMap<String, (Breaker, u64)>,
        now: Timestamp,
    ) -> bool {
        let Some(after) = self.fallback_after_ms.map(Duration::from_millis) else {
            return false;
        };
        failing_long_enough(primary, after, now)
            && self
                .fallbacks
                .iter()
                .any(|id| breakers.get(id).is_none_or(|(b, _)| b.lets(None)))
    }
}

/// Whether `primary` has been failing (open) for at least `after`.
fn failing_long_enough(primary: &Breaker, after: Duration, now: Timestamp) -> bool {
    primary.state == BreakerState::Open
        && primary
            .opened_at
            .is_some_and(|at| now >= at.saturating_add(after))
}

/// Where a call goes ([`route`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// To the run's own model (`probe`: as the fleet's probe of its failing endpoint).
    Primary { probe: bool },
    /// To the run's fallback model of this index.
    Fallback(usize),
    /// Nowhere yet: the run's model's endpoint is failing and no fallback may answer.
    Hold { reason: String, trouble: Trouble },
}

/// Where a call goes, from the breakers: the run's own model unless its endpoint's breaker
/// holds the call (`released`: the run's release, `Some(true)` for the probe); then, once that
/// endpoint has been failing for `fallback_after`, the first fallback whose breaker lets calls
/// go (none known: closed); else nowhere.
pub fn route(
    primary: &Breaker,
    fallbacks: &[Breaker],
    fallback_after: Duration,
    released: Option<bool>,
    now: Timestamp,
) -> Route {
    if primary.lets(released) {
        return Route::Primary {
            probe: released == Some(true),
        };
    }
    if failing_long_enough(primary, fallback_after, now)
        && let Some(i) = fallbacks.iter().position(|b| b.lets(None))
    {
        return Route::Fallback(i);
    }
    let next = primary
        .next_probe_at
        .map_or_else(String::new, |at| format!("; next probe at {at}"));
    Route::Hold {
        reason: format!(
            "not sent: {} is failing since {}{next}; last error: {}",
            primary.endpoint,
            primary.opened_at.unwrap_or(primary.updated_at),
            primary.last_error
        ),
        trouble: primary.trouble.unwrap_or(Trouble::Unavailable),
    }
}

/// Who releases an endpoint's runs, as stored at `lead.<endpoint>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lead {
    pub worker: String,
    pub until: Timestamp,
}

/// The order runs are released in: oldest first within each tenant, the tenants taking turns
/// (each turn goes to the tenant whose next run waited longest), so one tenant's thousand
/// waiting runs do not starve another's one. Runs whose `not_before` is after `now` wait.
pub fn release_order<'a>(
    waiters: impl IntoIterator<Item = &'a Waiter>,
    now: Timestamp,
) -> Vec<&'a Waiter> {
    let mut by_tenant: BTreeMap<&TenantId, Vec<&Waiter>> = BTreeMap::new();
    for w in waiters.into_iter().filter(|w| w.not_before <= now) {
        by_tenant.entry(&w.tenant).or_default().push(w);
    }
    let mut queues: Vec<std::collections::VecDeque<&Waiter>> = by_tenant
        .into_values()
        .map(|mut q| {
            q.sort_by(|a, b| (a.since, &a.run_id).cmp(&(b.since, &b.run_id)));
            q.into()
        })
        .collect();
    let mut out = Vec::new();
    loop {
        // Each round: one run of every tenant with any left, in the order of their heads.
        let mut round: Vec<&Waiter> = queues.iter_mut().filter_map(|q| q.pop_front()).collect();
        if round.is_empty() {
            return out;
        }
        round.sort_by(|a, b| (a.since, &a.run_id).cmp(&(b.since, &b.run_id)));
        out.extend(round);
    }
}

/// What went wrong talking to `kedge_providers`.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error("{bucket} unavailable: {0}", bucket = kedge_core::subjects::PROVIDERS_BUCKET)]
    Unavailable(String),
}

fn unavailable(e: impl std::fmt::Display) -> ProviderError {
    ProviderError::Unavailable(e.to_string())
}

/// Where a call stands with its endpoint's rate limits ([`Providers::admit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    /// Its slot is this far away: wait, then call.
    After(Duration),
    /// No slot within [`IN_PLACE`], or runs already wait their turn: the run joins them.
    Queue { reason: String },
}

#[derive(Debug, Default)]
struct View {
    breakers: HashMap<String, (Breaker, u64)>,
    waiters: HashMap<String, BTreeMap<RunId, (Waiter, u64)>>,
    leads: HashMap<String, (Lead, u64)>,
    paces: HashMap<String, (pace::Pace, u64)>,
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
    worker: String,
    view: Mutex<View>,
}

impl std::fmt::Debug for Providers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Providers")
            .field("worker", &self.inner.worker)
            .finish_non_exhaustive()
    }
}

fn breaker_key(id: &str) -> String {
    format!("breaker.{id}")
}

fn wait_key(id: &str, run: &RunId) -> String {
    format!("wait.{id}.{run}")
}

fn lead_key(id: &str) -> String {
    format!("lead.{id}")
}

fn pace_key(id: &str) -> String {
    format!("pace.{id}")
}

impl Providers {
    /// Opens the bucket and starts watching it (the view is empty until the watch delivers).
    pub async fn open(
        js: jetstream::Context,
        config: ProviderConfig,
        worker: &str,
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
                worker: worker.to_owned(),
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

    /// Keeps the view up to date; a watch that ends (the broker restarted) is made again, and
    /// the view rebuilt from what it delivers.
    async fn watch(self, ready: tokio::sync::oneshot::Sender<()>) {
        let mut ready = Some(ready);
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.inner.kv.watch_with_history(">").await {
                Ok(mut entries) => {
                    backoff = Duration::from_millis(100);
                    let mut fresh = View::default();
                    let mut current = false;
                    loop {
                        let next = if current {
                            entries.next().await
                        } else {
                            // Nothing in the bucket: a watch delivers nothing until a write.
                            match tokio::time::timeout(Duration::from_millis(500), entries.next())
                                .await
                            {
                                Ok(next) => next,
                                Err(_) => {
                                    current = true;
                                    *self.lock() = std::mem::take(&mut fresh);
                                    if let Some(r) = ready.take() {
                                        let _ = r.send(());
                                    }
                                    continue;
                                }
                            }
                        };
                        let Some(Ok(entry)) = next else { break };
                        let seen_current = entry.seen_current || entry.delta == 0;
                        if current {
                            apply_entry(&mut self.lock(), entry);
                        } else {
                            apply_entry(&mut fresh, entry);
                            if seen_current {
                                current = true;
                                *self.lock() = std::mem::take(&mut fresh);
                                if let Some(r) = ready.take() {
                                    let _ = r.send(());
                                }
                            }
                        }
                    }
                    tracing::debug!(bucket = PROVIDERS_BUCKET, "watch ended; watching again");
                }
                Err(e) => {
                    tracing::warn!(bucket = PROVIDERS_BUCKET, error = %e, "cannot watch; trying again");
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// The endpoint's breaker as this process sees it (closed when it has none).
    pub fn breaker(&self, endpoint: &Endpoint) -> Breaker {
        self.lock()
            .breakers
            .get(&endpoint.id)
            .map(|(b, _)| b.clone())
            .unwrap_or_else(|| Breaker::closed(endpoint, Timestamp::now()))
    }

    /// Every breaker and how many runs wait on each, as this process sees them (for
    /// `kedge providers` and the metrics).
    pub fn snapshot(&self) -> Vec<(String, Breaker, usize)> {
        let view = self.lock();
        let mut out: Vec<(String, Breaker, usize)> = view
            .breakers
            .iter()
            .map(|(id, (b, _))| {
                let waiting = view.waiters.get(id).map_or(0, BTreeMap::len);
                (id.clone(), b.clone(), waiting)
            })
            .collect();
        out.sort_by(|a, b| a.1.endpoint.cmp(&b.1.endpoint));
        out
    }

    /// Where a call of a run whose model is at `primary` goes now ([`route`]; `released`: the
    /// run's release, `Some(true)` for the probe). A call that would go to a fallback while
    /// `primary`'s probe is due claims the probe and goes to `primary` instead: with every run
    /// on its fallback and none waiting, the calls themselves find out when it is back.
    pub async fn route(
        &self,
        primary: &Endpoint,
        fallbacks: &[Endpoint],
        fallback_after: Duration,
        released: Option<bool>,
    ) -> Route {
        let breakers: Vec<Breaker> = fallbacks.iter().map(|e| self.breaker(e)).collect();
        let now = Timestamp::now();
        let r = route(
            &self.breaker(primary),
            &breakers,
            fallback_after,
            released,
            now,
        );
        if matches!(r, Route::Fallback(_)) && self.claim_probe(&primary.id).await {
            return Route::Primary { probe: true };
        }
        r
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

    /// Reports a call that succeeded (a write only when the breaker was not closed and clean).
    pub async fn report_success(&self, endpoint: &Endpoint) {
        self.change(endpoint, |b, now| b.on_success(now)).await;
    }

    /// Reports a call that met provider trouble.
    pub async fn report_trouble(&self, endpoint: &Endpoint, report: &TroubleReport) {
        let config = self.inner.config.clone();
        self.change(endpoint, |b, now| Some(b.on_trouble(report, now, &config)))
            .await;
    }

    /// Applies `f` to the endpoint's breaker by compare-and-set (a few tries; a report lost
    /// to contention is made again by the next call). Best effort: never fails the caller.
    async fn change(
        &self,
        endpoint: &Endpoint,
        f: impl Fn(&Breaker, Timestamp) -> Option<Breaker>,
    ) {
        let key = breaker_key(&endpoint.id);
        // The view decides first: most successes change nothing and cost no round trip.
        let cached = self.lock().breakers.get(&endpoint.id).cloned();
        let now = Timestamp::now();
        match &cached {
            Some((b, _)) if f(b, now).is_none() => return,
            None if f(&Breaker::closed(endpoint, now), now).is_none() => return,
            _ => {}
        }
        for _ in 0..CAS_ATTEMPTS {
            let current = match self.inner.kv.entry(key.clone()).await {
                Ok(e) => e.filter(|e| e.operation == kv::Operation::Put),
                Err(e) => {
                    tracing::warn!(endpoint = %endpoint.label, error = %e, "cannot read the endpoint's breaker");
                    return;
                }
            };
            let now = Timestamp::now();
            let (breaker, revision) = match &current {
                Some(e) => match serde_json::from_slice::<Breaker>(&e.value) {
                    Ok(b) => (b, Some(e.revision)),
                    // A record that does not parse is replaced.
                    Err(_) => (Breaker::closed(endpoint, now), Some(e.revision)),
                },
                None => (Breaker::closed(endpoint, now), None),
            };
            let Some(next) = f(&breaker, now) else { return };
            match self.write(&key, &next, revision).await {
                Ok(rev) => {
                    if next.state != breaker.state {
                        tracing::info!(endpoint = %endpoint.label, from = breaker.state.as_str(), to = next.state.as_str(), error = %next.last_error, "model endpoint breaker");
                    }
                    self.lock()
                        .breakers
                        .insert(endpoint.id.clone(), (next, rev));
                    return;
                }
                Err(e) => {
                    tracing::debug!(endpoint = %endpoint.label, error = %e, "breaker changed concurrently; reading it again")
                }
            }
        }
    }

    /// Every pace (a model's rate limits at an endpoint, and the fleet's next slot), as this
    /// process sees them (for `kedge providers`).
    pub fn paces(&self) -> Vec<Pace> {
        let mut out: Vec<Pace> = self.lock().paces.values().map(|(p, _)| p.clone()).collect();
        out.sort_by(|a, b| (&a.endpoint, &a.model).cmp(&(&b.endpoint, &b.model)));
        out
    }

    /// The rate limits `model`'s calls to the endpoint keep to: `configured` (this process's
    /// `providers.limits`) and those the provider named, the lower of each.
    pub fn limits(&self, endpoint: &Endpoint, model: &str, configured: Limits) -> Limits {
        let learned = self
            .lock()
            .paces
            .get(&endpoint.pace_id(model))
            .map(|(p, _)| p.learned)
            .unwrap_or_default();
        configured.lower(learned)
    }

    /// Takes the call's slot under the rate limits of `model` at the endpoint: how long to
    /// wait for it, or that the run waits its turn in the queue (runs already wait there, or
    /// the slot is more than [`IN_PLACE`] away). A call with no limit goes at once, and costs
    /// no round trip.
    pub async fn admit(
        &self,
        endpoint: &Endpoint,
        model: &str,
        configured: Limits,
        tokens: u64,
    ) -> Admit {
        let limits = self.limits(endpoint, model, configured);
        if limits.is_none() {
            return Admit::After(Duration::ZERO);
        }
        let queued = self
            .lock()
            .waiters
            .get(&endpoint.id)
            .map_or(0, BTreeMap::len);
        if queued > 0 {
            return Admit::Queue {
                reason: format!(
                    "waiting its turn behind {queued} run(s) at {} (limit {limits})",
                    endpoint.label
                ),
            };
        }
        let reserved = self
            .change_pace(
                &endpoint.pace_id(model),
                (&endpoint.label, model),
                Some(configured),
                |p, now| match p.reserve(now, tokens, IN_PLACE) {
                    Ok((wait, next)) => (Ok(wait), Some(next)),
                    Err(far) => (Err(far), None),
                },
            )
            .await;
        match reserved {
            Some(Ok(wait)) => Admit::After(wait),
            Some(Err(far)) => Admit::Queue {
                reason: format!(
                    "waiting its turn at {}: the next slot under its limit ({limits}) is {} ms away",
                    endpoint.label,
                    far.as_millis()
                ),
            },
            None => Admit::Queue {
                reason: format!(
                    "waiting its turn at {}: its pace could not be read or changed",
                    endpoint.label
                ),
            },
        }
    }

    /// Records the limits the provider named in a response's headers (a write only when they
    /// changed).
    pub async fn learn(&self, endpoint: &Endpoint, model: &str, learned: Limits) {
        let id = endpoint.pace_id(model);
        let known = self.lock().paces.get(&id).map(|(p, _)| p.learned);
        if known == Some(learned) {
            return;
        }
        self.change_pace(&id, (&endpoint.label, model), None, |p, now| {
            if p.learned == learned {
                return ((), None);
            }
            let mut next = p.clone();
            next.learned = learned;
            next.updated_at = now;
            tracing::info!(endpoint = %endpoint.label, %learned, "the provider names its rate limits");
            ((), Some(next))
        })
        .await;
    }

    /// Applies `f` to a pace by compare-and-set: what `f` says, once its change is written (or
    /// it changes nothing); `None` when the bucket cannot be read or written, or other processes
    /// won every try. `configured`: this process's configured limits, written into the record
    /// (the releaser reads them there).
    async fn change_pace<T>(
        &self,
        id: &str,
        (label, model): (&str, &str),
        configured: Option<Limits>,
        mut f: impl FnMut(&Pace, Timestamp) -> (T, Option<Pace>),
    ) -> Option<T> {
        let key = pace_key(id);
        // The first try trusts the view; a conflict reads the record itself.
        let mut current = self.lock().paces.get(id).cloned().map(Some);
        for _ in 0..PACE_ATTEMPTS {
            let found = match current.take() {
                Some(found) => found,
                None => match self.inner.kv.entry(key.clone()).await {
                    Ok(e) => e.filter(|e| e.operation == kv::Operation::Put).map(|e| {
                        let p = serde_json::from_slice::<Pace>(&e.value)
                            .unwrap_or_else(|_| Pace::new(label, model, Timestamp::now()));
                        (p, e.revision)
                    }),
                    Err(e) => {
                        tracing::warn!(endpoint = %label, error = %e, "cannot read the endpoint's pace");
                        return None;
                    }
                },
            };
            let now = Timestamp::now();
            let (mut pace, revision) = match found {
                Some((p, rev)) => (p, Some(rev)),
                None => (Pace::new(label, model, now), None),
            };
            let reconfigured = configured.is_some_and(|c| c != pace.configured);
            if let Some(c) = configured {
                pace.configured = c;
            }
            let (verdict, next) = f(&pace, now);
            let next = match next {
                Some(next) => next,
                None if reconfigured => pace,
                None => return Some(verdict),
            };
            match self.write(&key, &next, revision).await {
                Ok(rev) => {
                    self.lock().paces.insert(id.to_owned(), (next, rev));
                    return Some(verdict);
                }
                Err(e) => {
                    tracing::debug!(endpoint = %label, error = %e, "pace changed concurrently; reading it again");
                }
            }
        }
        None
    }

    /// Records `waiter` as waiting on `endpoint` (before its `provider.waiting` is journaled):
    /// a new revision, so a release of an earlier wait cannot remove it.
    pub async fn wait(&self, endpoint: &Endpoint, waiter: &Waiter) -> Result<(), ProviderError> {
        let bytes = serde_json::to_vec(waiter).map_err(unavailable)?;
        let rev = self
            .inner
            .kv
            .put(wait_key(&endpoint.id, &waiter.run_id), bytes.into())
            .await
            .map_err(unavailable)?;
        self.lock()
            .waiters
            .entry(endpoint.id.clone())
            .or_default()
            .insert(waiter.run_id.clone(), (waiter.clone(), rev));
        Ok(())
    }

    /// Makes sure a run the journal says is waiting has its record (a drive of a waiting run:
    /// the record may have been lost with a broker's store, or never written before a crash).
    pub async fn ensure_waiting(
        &self,
        endpoint: &Endpoint,
        waiter: &Waiter,
    ) -> Result<(), ProviderError> {
        let known = self
            .lock()
            .waiters
            .get(&endpoint.id)
            .is_some_and(|w| w.contains_key(&waiter.run_id));
        if known {
            return Ok(());
        }
        let bytes = serde_json::to_vec(waiter).map_err(unavailable)?;
        match self
            .inner
            .kv
            .create(wait_key(&endpoint.id, &waiter.run_id), bytes.into())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(unavailable(e)),
        }
    }

    /// Removes a run's wait (it left the wait other than by a release: cancelled, failed).
    pub async fn forget(&self, endpoint: &Endpoint, run: &RunId) {
        if let Err(e) = self.remove(&endpoint.id, run, None).await {
            tracing::debug!(run_id = %run, error = %e, "could not remove the run's wait on its provider");
        }
    }

    /// A delete marker on the wait's key (checked on `revision` when given) that expires.
    async fn remove(
        &self,
        id: &str,
        run: &RunId,
        revision: Option<u64>,
    ) -> Result<(), ProviderError> {
        let mut headers = HeaderMap::new();
        headers.insert("KV-Operation", "DEL");
        headers.insert("Nats-TTL", format!("{MARKER_TTL_SECS}s").as_str());
        if let Some(r) = revision {
            headers.insert(
                "Nats-Expected-Last-Subject-Sequence",
                r.to_string().as_str(),
            );
        }
        let subject = kedge_core::subjects::kv_key(PROVIDERS_BUCKET, &wait_key(id, run));
        self.inner
            .js
            .publish_with_headers(subject, headers, bytes::Bytes::new())
            .await
            .map_err(unavailable)?
            .await
            .map_err(unavailable)?;
        if let Some(w) = self.lock().waiters.get_mut(id) {
            w.retain(|r, (_, rev)| r != run || revision.is_some_and(|mine| *rev > mine));
        }
        Ok(())
    }

    /// Whether this process releases the endpoint's runs now (taking or renewing its lead).
    async fn lead(&self, id: &str) -> bool {
        let now = Timestamp::now();
        let held = self.lock().leads.get(id).cloned();
        let renew_after = now.saturating_add(LEAD_FOR / 2);
        let revision = match &held {
            Some((l, _)) if l.worker == self.inner.worker && l.until > renew_after => return true,
            Some((l, _)) if l.worker != self.inner.worker && l.until > now => return false,
            Some((_, rev)) => Some(*rev),
            None => None,
        };
        let lead = Lead {
            worker: self.inner.worker.clone(),
            until: now.saturating_add(LEAD_FOR),
        };
        match self.write(&lead_key(id), &lead, revision).await {
            Ok(rev) => {
                self.lock().leads.insert(id.to_owned(), (lead, rev));
                true
            }
            Err(_) => false,
        }
    }

    /// Claims the endpoint's probe due now: moves `next_probe_at` on by the probe interval
    /// (compare-and-set, so two releasers never both send one). `false` when it is not due or
    /// another process claimed it.
    async fn claim_probe(&self, id: &str) -> bool {
        let Some((b, rev)) = self.lock().breakers.get(id).cloned() else {
            return false;
        };
        let now = Timestamp::now();
        if b.state != BreakerState::Open || b.next_probe_at.is_some_and(|at| at > now) {
            return false;
        }
        let mut next = b.clone();
        let interval =
            Duration::from_millis(b.probe_interval_ms).max(self.inner.config.probe_interval);
        next.next_probe_at = Some(now.saturating_add(interval));
        next.probes = next.probes.saturating_add(1);
        next.updated_at = now;
        match self.write(&breaker_key(id), &next, Some(rev)).await {
            Ok(rev) => {
                self.lock().breakers.insert(id.to_owned(), (next, rev));
                true
            }
            Err(_) => false,
        }
    }

    /// Closes a recovering breaker whose runs have all been released.
    async fn close_recovered(&self, id: &str) {
        let Some((b, rev)) = self.lock().breakers.get(id).cloned() else {
            return;
        };
        if b.state != BreakerState::Recovering {
            return;
        }
        let mut next = b;
        next.state = BreakerState::Closed;
        next.failures = 0;
        next.updated_at = Timestamp::now();
        if let Ok(rev) = self.write(&breaker_key(id), &next, Some(rev)).await {
            tracing::info!(endpoint = %next.endpoint, "model endpoint recovered; breaker closed");
            self.lock().breakers.insert(id.to_owned(), (next, rev));
        }
    }

    /// Journals `provider.released` for the wait (deduplicated by its revision), then removes
    /// the wait (checked on that revision: a newer wait of the run stays).
    async fn release(
        &self,
        journal: &Journal,
        id: &str,
        waiter: &Waiter,
        revision: u64,
        probe: bool,
    ) -> Result<(), ProviderError> {
        let env = Envelope::new(
            waiter.run_id.clone(),
            Timestamp::now(),
            Draft::new(Event::ProviderReleased(ProviderReleased { probe })),
        );
        let msg_id = InputId::provider_released(&waiter.run_id, revision);
        match journal.append_input(&env, msg_id.as_str()).await {
            Ok(_) | Err(JournalError::Duplicate { .. }) => {}
            Err(e) => return Err(unavailable(e)),
        }
        metrics::provider_released(probe);
        tracing::debug!(run_id = %waiter.run_id, probe, "released from its wait on the provider");
        self.remove(id, &waiter.run_id, Some(revision)).await
    }

    /// The first `most` of `order` whose calls have a slot within the next tick under their
    /// pace, which is reserved for them (one compare-and-set per pace; a pace that another
    /// process changed meanwhile lets none of its runs go this tick). Runs waiting with no pace
    /// (trouble, not a rate limit) need no slot.
    async fn reserve_turns<'w>(&self, order: Vec<&'w Waiter>, most: usize) -> Vec<&'w Waiter> {
        let now = Timestamp::now();
        let mut paces: HashMap<String, Option<(Pace, u64)>> = HashMap::new();
        let mut chosen: Vec<(&Waiter, Option<&str>)> = Vec::new();
        for w in order {
            if chosen.len() >= most {
                break;
            }
            let Some(pid) = w.pace.as_deref() else {
                chosen.push((w, None));
                continue;
            };
            let entry = paces
                .entry(pid.to_owned())
                .or_insert_with(|| self.lock().paces.get(pid).cloned());
            match entry {
                // No pace recorded: nothing to keep to.
                None => chosen.push((w, None)),
                Some((pace, _)) => {
                    if let Ok((_, next)) = pace.reserve(now, w.tokens, TICK) {
                        *pace = next;
                        chosen.push((w, Some(pid)));
                    }
                }
            }
        }
        let mut refused: Vec<String> = Vec::new();
        for (pid, found) in paces {
            let Some((pace, rev)) = found else { continue };
            let unchanged = self
                .lock()
                .paces
                .get(&pid)
                .is_some_and(|(p, r)| *r == rev && *p == pace);
            if unchanged {
                continue;
            }
            match self.write(&pace_key(&pid), &pace, Some(rev)).await {
                Ok(rev) => {
                    self.lock().paces.insert(pid, (pace, rev));
                }
                Err(_) => refused.push(pid),
            }
        }
        chosen
            .into_iter()
            .filter(|(_, pid)| pid.is_none_or(|p| !refused.iter().any(|r| r == p)))
            .map(|(w, _)| w)
            .collect()
    }

    /// Releases waiting runs, until its task is aborted: every [`TICK`], for each endpoint with runs
    /// waiting whose lead this process holds, the probe due (open) or the next runs at
    /// `release_per_second` (closed, recovering). Runs in every step process; the leads keep
    /// it to one releaser per endpoint.
    pub async fn run_releaser(self, journal: Journal) {
        let mut ticker = tokio::time::interval(TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Release credit per endpoint, refilled at `release_per_second` (burst: one tick's
        // worth, at least one run).
        let mut credit: HashMap<String, f64> = HashMap::new();
        let rate = f64::from(self.inner.config.release_per_second);
        let burst = (rate * TICK.as_secs_f64()).max(1.0);
        loop {
            ticker.tick().await;
            let (endpoints, recovering_idle, waiting, open) = {
                let view = self.lock();
                let endpoints: Vec<String> = view
                    .waiters
                    .iter()
                    .filter(|(_, w)| !w.is_empty())
                    .map(|(id, _)| id.clone())
                    .collect();
                let recovering_idle: Vec<String> = view
                    .breakers
                    .iter()
                    .filter(|(id, (b, _))| {
                        b.state == BreakerState::Recovering
                            && view.waiters.get(*id).is_none_or(BTreeMap::is_empty)
                    })
                    .map(|(id, _)| id.clone())
                    .collect();
                let waiting = view.waiters.values().map(BTreeMap::len).sum::<usize>();
                let open = view
                    .breakers
                    .values()
                    .filter(|(b, _)| b.state == BreakerState::Open)
                    .count();
                (endpoints, recovering_idle, waiting, open)
            };
            metrics::provider_view(waiting, open);
            for id in recovering_idle {
                if self.lead(&id).await {
                    self.close_recovered(&id).await;
                }
            }
            for id in endpoints {
                if !self.lead(&id).await {
                    continue;
                }
                let now = Timestamp::now();
                let (breaker, waiters, breakers) = {
                    let view = self.lock();
                    let breaker = view.breakers.get(&id).map(|(b, _)| b.clone());
                    let waiters: Vec<(Waiter, u64)> = view
                        .waiters
                        .get(&id)
                        .map(|w| w.values().cloned().collect())
                        .unwrap_or_default();
                    // The fallbacks' breakers, for the runs that may fall back.
                    let breakers = if breaker
                        .as_ref()
                        .is_some_and(|b| b.state == BreakerState::Open)
                        && waiters.iter().any(|(w, _)| !w.fallbacks.is_empty())
                    {
                        view.breakers.clone()
                    } else {
                        HashMap::new()
                    };
                    (breaker, waiters, breakers)
                };
                let revisions: HashMap<&RunId, u64> =
                    waiters.iter().map(|(w, rev)| (&w.run_id, *rev)).collect();
                let order = release_order(waiters.iter().map(|(w, _)| w), now);
                let c = credit.entry(id.clone()).or_insert(burst);
                *c = (*c + rate * TICK.as_secs_f64()).min(burst.max(1.0));
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let most = c.max(0.0).floor() as usize;
                let released: Vec<&Waiter> = match &breaker {
                    Some(b) if b.state == BreakerState::Open => {
                        // The probe goes to the run that has waited longest since it last
                        // began to wait (the lowest revision): a run probed in vain waits again
                        // under a new one, so the probes take turns among the waiting runs. A
                        // run that may fall back is not probed with: it goes to its fallback,
                        // and its call there probes the endpoint when the probe is due
                        // ([`Providers::route`]).
                        let probe = order
                            .iter()
                            .filter(|w| !w.may_fall_back(b, &breakers, now))
                            .min_by_key(|w| revisions.get(&w.run_id).copied().unwrap_or_default())
                            .copied();
                        if let Some(probe) = probe
                            && self.claim_probe(&id).await
                        {
                            let rev = revisions.get(&probe.run_id).copied().unwrap_or_default();
                            if let Err(e) = self.release(&journal, &id, probe, rev, true).await {
                                tracing::warn!(error = %e, "could not release the probe run");
                            }
                        }
                        // Runs that may fall back go, at the release rate, to their fallback.
                        order
                            .into_iter()
                            .filter(|w| {
                                probe.is_none_or(|p| p.run_id != w.run_id)
                                    && w.may_fall_back(b, &breakers, now)
                            })
                            .take(most)
                            .collect()
                    }
                    _ => self.reserve_turns(order, most).await,
                };
                for w in released {
                    if *c < 1.0 {
                        break;
                    }
                    let rev = revisions.get(&w.run_id).copied().unwrap_or_default();
                    match self.release(&journal, &id, w, rev, false).await {
                        Ok(()) => *c -= 1.0,
                        Err(e) => {
                            tracing::warn!(error = %e, "could not release a run waiting on its provider");
                            break;
                        }
                    }
                }
            }
        }
    }
}

/// Folds one watched entry into the view (entries that do not parse are skipped: the bucket is
/// written by Kedge's own services, but nothing read from the network is trusted to parse).
fn apply_entry(view: &mut View, entry: kv::Entry) {
    let put = entry.operation == kv::Operation::Put;
    let mut parts = entry.key.splitn(3, '.');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("breaker"), Some(id), None) => {
            match put
                .then(|| serde_json::from_slice::<Breaker>(&entry.value).ok())
                .flatten()
            {
                Some(b) => {
                    view.breakers.insert(id.to_owned(), (b, entry.revision));
                }
                None => {
                    view.breakers.remove(id);
                }
            }
        }
        (Some("pace"), Some(endpoint), Some(model)) => {
            let id = format!("{endpoint}.{model}");
            match put
                .then(|| serde_json::from_slice::<pace::Pace>(&entry.value).ok())
                .flatten()
            {
                Some(p) => {
                    view.paces.insert(id, (p, entry.revision));
                }
                None => {
                    view.paces.remove(&id);
                }
            }
        }
        (Some("lead"), Some(id), None) => {
            match put
                .then(|| serde_json::from_slice::<Lead>(&entry.value).ok())
                .flatten()
            {
                Some(l) => {
                    view.leads.insert(id.to_owned(), (l, entry.revision));
                }
                None => {
                    view.leads.remove(id);
                }
            }
        }
        (Some("wait"), Some(id), Some(run)) => {
            let Ok(run) = run.parse::<RunId>() else {
                return;
            };
            let waiters = view.waiters.entry(id.to_owned()).or_default();
            match put
                .then(|| serde_json::from_slice::<Waiter>(&entry.value).ok())
                .flatten()
            {
                Some(w) if w.run_id == run => {
                    waiters.insert(run, (w, entry.revision));
                }
                _ => {
                    waiters.remove(&run);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp(time::OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(1_800_000_000 + secs))
    }

    fn endpoint() -> Endpoint {
        Endpoint {
            id: "0123456789abcdef".into(),
            label: "openai http://127.0.0.1:1/v1 (K)".into(),
        }
    }

    fn report(trouble: Trouble, probe: bool, retry_after: Option<u64>) -> TroubleReport {
        TroubleReport {
            trouble,
            message: "HTTP 503".into(),
            retry_after: retry_after.map(Duration::from_secs),
            probe,
        }
    }

    #[test]
    fn an_endpoint_is_its_provider_base_url_and_key_variable_never_its_key() {
        let spec: ModelSpec = serde_json::from_value(serde_json::json!({
            "provider": "openai", "name": "m", "base_url": "http://127.0.0.1:9/v1"
        }))
        .expect("spec");
        let a = Endpoint::new(&spec, "KEY_A");
        assert_eq!(a.label, "openai http://127.0.0.1:9/v1 (KEY_A)");
        assert_eq!(a.id.len(), 16);
        assert_ne!(a.id, Endpoint::new(&spec, "KEY_B").id);
        let other: ModelSpec = serde_json::from_value(serde_json::json!({
            "provider": "openai", "name": "another-model", "base_url": "http://127.0.0.1:9/v1"
        }))
        .expect("spec");
        assert_eq!(
            a,
            Endpoint::new(&other, "KEY_A"),
            "models of one endpoint share it"
        );
    }

    #[test]
    fn a_closed_breaker_opens_after_open_after_failures_in_a_row_and_a_success_resets_them() {
        let c = ProviderConfig::default();
        let mut b = Breaker::closed(&endpoint(), at(0));
        for i in 1..c.open_after {
            b = b.on_trouble(&report(Trouble::Unavailable, false, None), at(i.into()), &c);
            assert_eq!((b.state, b.failures), (BreakerState::Closed, i));
            assert!(b.lets(None));
        }
        let reset = b.on_success(at(10)).expect("a success clears the failures");
        assert_eq!((reset.state, reset.failures), (BreakerState::Closed, 0));
        assert_eq!(
            reset.on_success(at(11)),
            None,
            "a clean closed breaker is not written"
        );
        b = reset;
        for i in 0..c.open_after {
            b = b.on_trouble(
                &report(Trouble::Unavailable, false, None),
                at(20 + i64::from(i)),
                &c,
            );
        }
        assert_eq!(b.state, BreakerState::Open);
        assert!(
            !b.lets(None) && !b.lets(Some(false)),
            "only the probe goes out"
        );
        assert!(b.lets(Some(true)));
        assert_eq!(
            b.next_probe_at,
            Some(at(22).saturating_add(c.probe_interval))
        );
    }

    #[test]
    fn a_rate_limit_opens_at_once_for_as_long_as_the_provider_asked() {
        let c = ProviderConfig::default();
        let b = Breaker::closed(&endpoint(), at(0)).on_trouble(
            &report(Trouble::RateLimited, false, Some(30)),
            at(0),
            &c,
        );
        assert_eq!(b.state, BreakerState::Open);
        assert_eq!(b.next_probe_at, Some(at(30)));
        let short = Breaker::closed(&endpoint(), at(0)).on_trouble(
            &report(Trouble::RateLimited, false, Some(1)),
            at(0),
            &c,
        );
        assert_eq!(
            short.next_probe_at,
            Some(at(0).saturating_add(c.probe_interval))
        );
    }

    #[test]
    fn failed_probes_double_the_wait_up_to_the_max_and_calls_in_flight_do_not_shorten_it() {
        let c = ProviderConfig::default();
        let mut b = Breaker::closed(&endpoint(), at(0));
        b.failures = c.open_after - 1;
        b = b.on_trouble(&report(Trouble::Unavailable, false, None), at(0), &c);
        let opened = b.opened_at;
        let mut waits = Vec::new();
        let mut now = 0;
        for _ in 0..6 {
            now += 100;
            b = b.on_trouble(&report(Trouble::Unavailable, true, None), at(now), &c);
            waits.push(b.probe_interval_ms / 1000);
        }
        // From 1 s, doubling up to 2 s; the outage is 600 s old by the last probe, so its
        // ceiling is still 2 s.
        assert_eq!(waits, vec![2, 2, 2, 2, 2, 2]);
        assert_eq!(b.opened_at, opened, "still the same outage");
        let before = b.next_probe_at;
        let in_flight = b.on_trouble(&report(Trouble::Unavailable, false, None), at(now), &c);
        assert_eq!(in_flight.next_probe_at, before);
        let asked = b.on_trouble(&report(Trouble::RateLimited, false, Some(600)), at(now), &c);
        assert_eq!(asked.next_probe_at, Some(at(now + 600)));
    }

    #[test]
    fn probes_slow_down_in_proportion_to_a_long_outage_up_to_a_minute() {
        let c = ProviderConfig::default();
        let opened = Some(at(0));
        assert_eq!(probe_ceiling(opened, at(10), &c), c.max_probe_interval);
        assert_eq!(probe_ceiling(opened, at(3000), &c), Duration::from_secs(10));
        assert_eq!(probe_ceiling(opened, at(86_400), &c), LONGEST_PROBE_WAIT);
        // A long outage's failed probes double the wait up to that ceiling.
        let mut b = Breaker::closed(&endpoint(), at(0)).on_trouble(
            &report(Trouble::RateLimited, false, None),
            at(0),
            &c,
        );
        for _ in 0..10 {
            b = b.on_trouble(&report(Trouble::Unavailable, true, None), at(6000), &c);
        }
        assert_eq!(b.probe_interval_ms, 20_000);
        // A probe the provider asked to put off longer waits as asked.
        let asked = b.on_trouble(&report(Trouble::RateLimited, true, Some(300)), at(6000), &c);
        assert_eq!(asked.probe_interval_ms, 300_000);
    }

    #[test]
    fn a_successful_probe_starts_the_recovery_and_a_failure_during_it_opens_again() {
        let c = ProviderConfig::default();
        let open = Breaker::closed(&endpoint(), at(0)).on_trouble(
            &report(Trouble::RateLimited, false, None),
            at(0),
            &c,
        );
        let recovering = open.on_success(at(5)).expect("changes");
        assert_eq!(recovering.state, BreakerState::Recovering);
        assert!(recovering.lets(None));
        assert_eq!(recovering.on_success(at(6)), None);
        let again = recovering.on_trouble(&report(Trouble::Unavailable, false, None), at(7), &c);
        assert_eq!(again.state, BreakerState::Open);
        assert_eq!(again.opened_at, Some(at(7)));
    }

    fn waiter(run: &str, tenant: &str, since: i64, not_before: i64) -> Waiter {
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

    #[test]
    fn runs_are_released_oldest_first_with_the_tenants_taking_turns() {
        let ws = [
            waiter("run_a1", "acme", 1, 0),
            waiter("run_a2", "acme", 2, 0),
            waiter("run_a3", "acme", 3, 0),
            waiter("run_a4", "acme", 4, 0),
            waiter("run_b1", "beta", 10, 0),
            waiter("run_c1", "core", 5, 0),
            waiter("run_c2", "core", 6, 0),
            waiter("run_late", "beta", 0, 100),
        ];
        let order: Vec<&str> = release_order(ws.iter(), at(50))
            .iter()
            .map(|w| w.run_id.as_str())
            .collect();
        assert_eq!(
            order,
            [
                "run_a1", "run_c1", "run_b1", "run_a2", "run_c2", "run_a3", "run_a4"
            ],
            "a run whose own wait is not over stays"
        );
        assert_eq!(release_order(ws.iter(), at(100)).len(), ws.len());
    }
    #[test]
    fn the_view_holds_every_kind_of_record_the_bucket_has() {
        let entry = |key: &str, value: Vec<u8>, put: bool| kv::Entry {
            bucket: PROVIDERS_BUCKET.into(),
            key: key.into(),
            value: value.into(),
            revision: 7,
            delta: 0,
            created: time::OffsetDateTime::UNIX_EPOCH,
            operation: if put {
                kv::Operation::Put
            } else {
                kv::Operation::Delete
            },
            seen_current: true,
        };
        let e = endpoint();
        let pid = e.pace_id("gpt-x");
        assert_eq!(pid.split('.').count(), 2, "endpoint, then model");
        let mut pace = Pace::new(&e.label, "gpt-x", at(0));
        pace.learned.requests_per_minute = Some(60);
        let mut view = View::default();
        apply_entry(
            &mut view,
            entry(
                &format!("pace.{pid}"),
                serde_json::to_vec(&pace).expect("json"),
                true,
            ),
        );
        apply_entry(
            &mut view,
            entry(
                &breaker_key(&e.id),
                serde_json::to_vec(&Breaker::closed(&e, at(0))).expect("json"),
                true,
            ),
        );
        let w = waiter("run_a", "t", 0, 0);
        apply_entry(
            &mut view,
            entry(
                &wait_key(&e.id, &w.run_id),
                serde_json::to_vec(&w).expect("json"),
                true,
            ),
        );
        assert_eq!(view.paces.get(&pid).map(|(p, r)| (p, *r)), Some((&pace, 7)));
        assert!(view.breakers.contains_key(&e.id));
        assert_eq!(view.waiters.get(&e.id).map(BTreeMap::len), Some(1));
        // A record that does not parse, or a delete, leaves nothing behind.
        apply_entry(
            &mut view,
            entry(&format!("pace.{pid}"), b"{".to_vec(), true),
        );
        apply_entry(
            &mut view,
            entry(&wait_key(&e.id, &w.run_id), Vec::new(), false),
        );
        assert!(view.paces.is_empty());
        assert_eq!(view.waiters.get(&e.id).map(BTreeMap::len), Some(0));
    }
    #[test]
    fn a_call_goes_to_the_runs_model_then_after_fallback_after_to_the_first_fallback_not_failing() {
        let c = ProviderConfig::default();
        let closed = Breaker::closed(&endpoint(), at(0));
        let mut open = closed.clone();
        for i in 0..c.open_after {
            open = open.on_trouble(&report(Trouble::Unavailable, false, None), at(i.into()), &c);
        }
        assert_eq!(open.state, BreakerState::Open);
        let opened = open.opened_at.expect("opened");
        let after = Duration::from_secs(30);
        let falls = [open.clone(), closed.clone()];
        // The run's own model, while it answers.
        assert_eq!(
            route(&closed, &falls, after, None, at(100)),
            Route::Primary { probe: false }
        );
        // Failing, but not for long enough: held.
        let soon = opened.saturating_add(Duration::from_secs(29));
        assert!(matches!(
            route(&open, &falls, after, None, soon),
            Route::Hold {
                trouble: Trouble::Unavailable,
                ..
            }
        ));
        // Long enough: the first fallback whose endpoint is not failing.
        let later = opened.saturating_add(after);
        assert_eq!(route(&open, &falls, after, None, later), Route::Fallback(1));
        // The fleet's probe goes to the run's own model, whatever the fallbacks.
        assert_eq!(
            route(&open, &falls, after, Some(true), later),
            Route::Primary { probe: true }
        );
        // Every fallback failing too, or none: held.
        assert!(matches!(
            route(&open, &[open.clone()], after, None, later),
            Route::Hold { .. }
        ));
        assert!(matches!(
            route(&open, &[], after, None, later),
            Route::Hold { .. }
        ));
        // Back (a probe succeeded): the run's own model again.
        let recovering = open.on_success(later).expect("recovering");
        assert_eq!(
            route(&recovering, &falls, after, None, later),
            Route::Primary { probe: false }
        );
        // A waiting run may be released to its fallback on the same terms.
        let mut w = waiter("run_a", "t", 0, 0);
        w.fallbacks = vec!["f1".into()];
        w.fallback_after_ms = Some(30_000);
        let mut breakers = HashMap::new();
        assert!(
            w.may_fall_back(&open, &breakers, later),
            "no breaker: closed"
        );
        assert!(!w.may_fall_back(&open, &breakers, soon));
        breakers.insert("f1".to_owned(), (open.clone(), 1));
        assert!(
            !w.may_fall_back(&open, &breakers, later),
            "its fallback is failing too"
        );
        assert!(!waiter("run_b", "t", 0, 0).may_fall_back(&open, &HashMap::new(), later));
    }
}
