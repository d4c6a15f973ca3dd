//! Tenant quotas, counted once for the fleet in `kedge_quotas` (docs/ARCHITECTURE.md "Quotas").
//! This is the shell: every change is a compare-and-set of one key (read, decide with
//! [`kedge_core::quota`], write at the revision read, again on a conflict), so any number of
//! bridges, gateways, intakes and step services count together.
//!
//! - `runs.<tenant>` ([`Admissions`]): runs started in the current minute window, unfinished
//!   runs. Written by whoever admits a run (the bridge before it publishes the task, intake
//!   before `run.created`; the same run is admitted once), by the step service when a run ends
//!   or is revived, and by the reconciler's repair.
//! - `usage.<tenant>.<day>` ([`DayUsage`]): model tokens and cost of a day window, added by the
//!   step service after each model call from the call's reported usage.

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use bytes::Bytes;
use kedge_core::event::Usage;
use kedge_core::ids::{RunId, TenantId};
use kedge_core::quota::{Admissions, Admit, DayUsage, Exceeded, QuotaLimits, QuotaPolicy, Windows};
use kedge_core::settings::Price;
use kedge_core::subjects::{self, QUOTAS_BUCKET};

use crate::config::QuotasConfig;

/// Compare-and-set attempts before a change gives up (each conflict means another process
/// changed the key in between; a few in a row is heavy contention).
const CAS_TRIES: usize = 32;

/// Why the quotas could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    #[error("{QUOTAS_BUCKET} unavailable: {0}")]
    Unavailable(String),
    #[error("{QUOTAS_BUCKET} key {key} holds what is not a quota record: {reason}")]
    Corrupt { key: String, reason: String },
}

/// A tenant's use of its quotas, as `kedge tenants usage` and the bridge show it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TenantUsage {
    pub tenant: TenantId,
    pub limits: QuotaLimits,
    /// Runs started in the current minute window.
    pub runs_this_minute: usize,
    /// Unfinished runs counted (only when the tenant has `max_active_runs`).
    pub active_runs: usize,
    pub today: DayUsage,
    pub currency: String,
    /// Seconds until the day window rolls.
    pub day_ends_in_secs: u64,
}

/// The fleet's quota counts.
#[derive(Clone)]
pub struct Quotas {
    kv: kv::Store,
    config: QuotasConfig,
    policy: QuotaPolicy,
}

impl std::fmt::Debug for Quotas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quotas")
            .field("policy", &self.policy)
            .finish()
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn unavailable(e: impl std::fmt::Display) -> QuotaError {
    QuotaError::Unavailable(e.to_string())
}

impl Quotas {
    /// Opens the bucket (created by the layout).
    pub async fn open(js: jetstream::Context, config: QuotasConfig) -> Result<Quotas, QuotaError> {
        let kv = js.get_key_value(QUOTAS_BUCKET).await.map_err(unavailable)?;
        let policy = config.policy();
        Ok(Quotas { kv, config, policy })
    }

    /// Whether any tenant has a limit (else nothing is counted and every call is free).
    pub fn enabled(&self) -> bool {
        self.policy.any()
    }

    pub fn limits(&self, tenant: &TenantId) -> &QuotaLimits {
        self.policy.limits(tenant)
    }

    pub fn windows(&self) -> Windows {
        self.config.windows()
    }

    /// The record at `key` and its revision (0: none), a deleted or purged key read as none (an
    /// operator's reset).
    async fn read<T: serde::de::DeserializeOwned + Default>(
        &self,
        key: &str,
    ) -> Result<(T, u64), QuotaError> {
        match self.kv.entry(key).await.map_err(unavailable)? {
            Some(e) if e.operation == kv::Operation::Put => {
                let value =
                    serde_json::from_slice(&e.value).map_err(|err| QuotaError::Corrupt {
                        key: key.to_owned(),
                        reason: err.to_string(),
                    })?;
                Ok((value, e.revision))
            }
            Some(e) => Ok((T::default(), e.revision)),
            None => Ok((T::default(), 0)),
        }
    }

    /// Writes `value` at `key` if it is still at `revision`; `false` on a conflict.
    async fn write<T: serde::Serialize>(
        &self,
        key: &str,
        value: &T,
        revision: u64,
    ) -> Result<bool, QuotaError> {
        let body = Bytes::from(serde_json::to_vec(value).map_err(unavailable)?);
        let written = crate::cas::write(&self.kv, key, body, (revision != 0).then_some(revision))
            .await
            .map_err(unavailable)?;
        Ok(written.is_some())
    }

    /// Changes the record at `key` with `change` (`None`: nothing to write) by compare-and-set;
    /// returns what `change` last said.
    async fn change<T, R>(
        &self,
        key: &str,
        mut change: impl FnMut(&T) -> (Option<T>, R),
    ) -> Result<R, QuotaError>
    where
        T: serde::Serialize + serde::de::DeserializeOwned + Default,
    {
        for attempt in 0..CAS_TRIES {
            let (current, revision) = self.read::<T>(key).await?;
            let (next, said) = change(&current);
            let Some(next) = next else {
                return Ok(said);
            };
            if self.write(key, &next, revision).await? {
                return Ok(said);
            }
            // Another process wrote in between: read again, after a short pause that grows.
            tokio::time::sleep(Duration::from_millis(1 + attempt as u64 * 2)).await;
        }
        Err(QuotaError::Unavailable(format!(
            "{key}: {CAS_TRIES} compare-and-set conflicts in a row"
        )))
    }

    /// Admits `run` of `tenant` (idempotent: a run admitted before is admitted again without
    /// counting), or names the quota that refuses it.
    pub async fn admit(
        &self,
        tenant: &TenantId,
        run: &RunId,
    ) -> Result<Result<(), Exceeded>, QuotaError> {
        let limits = self.limits(tenant);
        if !(limits.runs_per_minute > 0 || limits.max_active_runs > 0) {
            return Ok(Ok(()));
        }
        let windows = self.windows();
        let now = now_ms();
        let key = subjects::quota_admissions_key(tenant);
        self.change(&key, |r: &Admissions| {
            match r.admit(tenant, limits, windows, run, now) {
                Admit::Already => (None, Ok(())),
                Admit::Admitted(next) => (Some(next), Ok(())),
                Admit::Refused(e) => (None, Err(e)),
            }
        })
        .await
    }

    /// Whether one more run of `tenant` would be admitted now (a read: the gateway's early
    /// answer; intake decides).
    pub async fn check(&self, tenant: &TenantId) -> Result<Result<(), Exceeded>, QuotaError> {
        let limits = self.limits(tenant);
        if !(limits.runs_per_minute > 0 || limits.max_active_runs > 0) {
            return Ok(Ok(()));
        }
        let (r, _) = self
            .read::<Admissions>(&subjects::quota_admissions_key(tenant))
            .await?;
        Ok(r.check(tenant, limits, self.windows(), now_ms()))
    }

    /// Counts `run` out of `tenant`'s unfinished runs (it ended; idempotent).
    pub async fn release(&self, tenant: &TenantId, run: &RunId) -> Result<(), QuotaError> {
        if self.limits(tenant).max_active_runs == 0 {
            return Ok(());
        }
        let key = subjects::quota_admissions_key(tenant);
        self.change(&key, |r: &Admissions| (r.release(run), ()))
            .await
    }

    /// Counts `run` among `tenant`'s unfinished runs again (revived by a new message; never
    /// refused: the run exists).
    pub async fn restore(&self, tenant: &TenantId, run: &RunId) -> Result<(), QuotaError> {
        let limits = self.limits(tenant);
        if limits.max_active_runs == 0 {
            return Ok(());
        }
        let key = subjects::quota_admissions_key(tenant);
        self.change(&key, |r: &Admissions| (r.restore(run, limits), ()))
            .await
    }

    /// Adds one model call's `usage` (priced at `price`) to `tenant`'s day.
    pub async fn record_usage(
        &self,
        tenant: &TenantId,
        usage: &Usage,
        price: Option<&Price>,
    ) -> Result<(), QuotaError> {
        let day = self.windows().day(now_ms());
        let key = subjects::quota_usage_key(tenant, day);
        let currency = self.config.currency.as_str();
        self.change(&key, |u: &DayUsage| {
            (Some(u.add(usage, price, currency)), ())
        })
        .await
    }

    /// Whether `tenant` may call a model now, or the day's quota that holds it.
    pub async fn day_check(&self, tenant: &TenantId) -> Result<Result<(), Exceeded>, QuotaError> {
        let limits = self.limits(tenant);
        if !limits.limits_usage() {
            return Ok(Ok(()));
        }
        let now = now_ms();
        let windows = self.windows();
        let key = subjects::quota_usage_key(tenant, windows.day(now));
        let (u, _) = self.read::<DayUsage>(&key).await?;
        Ok(u.check(tenant, limits, windows, now))
    }

    /// `tenant`'s use of its quotas now.
    pub async fn usage(&self, tenant: &TenantId) -> Result<TenantUsage, QuotaError> {
        let now = now_ms();
        let windows = self.windows();
        let (r, _) = self
            .read::<Admissions>(&subjects::quota_admissions_key(tenant))
            .await?;
        let (today, _) = self
            .read::<DayUsage>(&subjects::quota_usage_key(tenant, windows.day(now)))
            .await?;
        Ok(TenantUsage {
            tenant: tenant.clone(),
            limits: self.limits(tenant).clone(),
            runs_this_minute: r.started_now(windows, now),
            active_runs: r.active.len(),
            today,
            currency: self.config.currency.clone(),
            day_ends_in_secs: windows.day_left_ms(now).div_ceil(1000),
        })
    }

    /// The tenants with a record of admissions, and those the configuration lists.
    pub async fn tenants(&self) -> Result<Vec<TenantId>, QuotaError> {
        use futures::StreamExt;
        let mut found: std::collections::BTreeSet<TenantId> =
            self.config.tenants.keys().cloned().collect();
        let mut keys = self.kv.keys().await.map_err(unavailable)?;
        while let Some(k) = keys.next().await {
            let k = k.map_err(unavailable)?;
            if let Some(t) = subjects::parse_quota_admissions_key(&k) {
                found.insert(t);
            } else if let Some((t, _day)) = subjects::parse_quota_usage_key(&k) {
                found.insert(t);
            }
        }
        Ok(found.into_iter().collect())
    }

    /// The unfinished runs counted against `tenant`.
    pub async fn active(&self, tenant: &TenantId) -> Result<Vec<RunId>, QuotaError> {
        let (r, _) = self
            .read::<Admissions>(&subjects::quota_admissions_key(tenant))
            .await?;
        Ok(r.active)
    }
}
