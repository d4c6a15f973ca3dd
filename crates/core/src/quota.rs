//! Tenant quotas, the pure part (docs/ARCHITECTURE.md "Quotas"): the limits an operator sets per
//! tenant, the windows they are counted in, the admission of a run, the day's model usage and
//! its cost. The shell (`kedge_runtime::quota`) keeps the counts in the broker, by
//! compare-and-set, once for the whole fleet; every decision about them is made here.
//!
//! Windows are numbered from the Unix epoch (`window = now / length`), so a count keyed by its
//! window rolls by itself: the next window starts at zero without anyone resetting it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::event::Usage;
use crate::ids::{RunId, TenantId};
use crate::settings::Price;

/// What happens to a run whose tenant is over its tokens or cost of the day.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnExceeded {
    /// The run waits, holding nothing, until the day's window rolls (the default).
    #[default]
    Wait,
    /// The run fails (`quota_exceeded`).
    Fail,
}

/// One tenant's limits; 0 means no limit.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuotaLimits {
    /// Runs started per minute, fleet-wide.
    pub runs_per_minute: u32,
    /// Unfinished runs at once, fleet-wide.
    pub max_active_runs: u32,
    /// Model tokens (input and output) per day.
    pub tokens_per_day: u64,
    /// Cost of model calls per day, in `quotas.currency`, at the models' prices.
    pub cost_per_day: f64,
    /// What a run over its tokens or cost of the day does.
    pub on_exceeded: OnExceeded,
}

// `cost_per_day` is never NaN: the configuration's check refuses it, so equality is total.
impl Eq for QuotaLimits {}

impl QuotaLimits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.runs_per_minute > 0 || self.max_active_runs > 0 || self.limits_usage()
    }

    /// Whether a limit on the day's usage (tokens or cost) is set.
    pub fn limits_usage(&self) -> bool {
        self.tokens_per_day > 0 || self.cost_per_day > 0.0
    }
}

/// The operator's quotas: a default for every tenant, and tenants with limits of their own (a
/// listed tenant's limits replace the default wholly).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuotaPolicy {
    pub default: QuotaLimits,
    pub tenants: BTreeMap<TenantId, QuotaLimits>,
}

impl QuotaPolicy {
    /// The limits of `tenant`.
    pub fn limits(&self, tenant: &TenantId) -> &QuotaLimits {
        self.tenants.get(tenant).unwrap_or(&self.default)
    }

    /// Whether any tenant has any limit (else nothing is counted).
    pub fn any(&self) -> bool {
        self.default.any() || self.tenants.values().any(QuotaLimits::any)
    }
}

/// A quota, as rejections and waits name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuotaKind {
    RunsPerMinute,
    MaxActiveRuns,
    TokensPerDay,
    CostPerDay,
}

impl QuotaKind {
    pub fn as_str(self) -> &'static str {
        match self {
            QuotaKind::RunsPerMinute => "runs_per_minute",
            QuotaKind::MaxActiveRuns => "max_active_runs",
            QuotaKind::TokensPerDay => "tokens_per_day",
            QuotaKind::CostPerDay => "cost_per_day",
        }
    }
}

/// The lengths of the windows quotas are counted in: a minute and a day (60 s and 86,400 s;
/// shorter only in tests, `quotas.minute_secs` / `quotas.day_secs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    pub minute_secs: u64,
    pub day_secs: u64,
}

impl Default for Windows {
    fn default() -> Self {
        Windows {
            minute_secs: 60,
            day_secs: 86_400,
        }
    }
}

impl Windows {
    /// The minute window holding `now_ms` (Unix milliseconds).
    pub fn minute(&self, now_ms: u64) -> u64 {
        now_ms / (self.minute_secs.max(1) * 1000)
    }

    /// The day window holding `now_ms`.
    pub fn day(&self, now_ms: u64) -> u64 {
        now_ms / (self.day_secs.max(1) * 1000)
    }

    /// Milliseconds from `now_ms` to the end of its minute window.
    pub fn minute_left_ms(&self, now_ms: u64) -> u64 {
        let len = self.minute_secs.max(1) * 1000;
        (self.minute(now_ms) + 1) * len - now_ms
    }

    /// Milliseconds from `now_ms` to the end of its day window.
    pub fn day_left_ms(&self, now_ms: u64) -> u64 {
        let len = self.day_secs.max(1) * 1000;
        (self.day(now_ms) + 1) * len - now_ms
    }
}

/// Whole seconds to wait for `ms` (at least 1: `Retry-After` of 0 means "now").
fn secs_for(ms: u64) -> u64 {
    ms.div_ceil(1000).max(1)
}

/// How long a refused run start is told to wait for a slot of its unfinished runs.
pub const ACTIVE_RETRY_SECS: u64 = 10;

/// A quota that refused (or holds) a tenant: which, how much is used of how much, and when to
/// try again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Exceeded {
    pub quota: QuotaKind,
    pub tenant: TenantId,
    pub used: f64,
    pub limit: f64,
    /// Seconds until trying again may succeed (the window's end; a guess for active runs).
    pub retry_after_secs: u64,
}

impl Exceeded {
    /// What a rejection or a wait says.
    pub fn reason(&self) -> String {
        let what = match self.quota {
            QuotaKind::RunsPerMinute => "runs started this minute",
            QuotaKind::MaxActiveRuns => "unfinished runs",
            QuotaKind::TokensPerDay => "model tokens used today",
            QuotaKind::CostPerDay => "model cost today",
        };
        format!(
            "quota {} exceeded: tenant {} has {} {what}, its limit is {}; retry after {} s",
            self.quota.as_str(),
            self.tenant,
            self.used,
            self.limit,
            self.retry_after_secs
        )
    }
}

/// A tenant's run admissions, one record per tenant: the runs started in the current minute
/// window (and in the one before, so that a task admitted just before the window rolled is
/// recognised after it), and its unfinished runs. Run ids make every change idempotent: a task
/// delivered twice is admitted once, a run ended twice is released once.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admissions {
    pub minute: u64,
    #[serde(default)]
    pub started: Vec<RunId>,
    #[serde(default)]
    pub previous: Vec<RunId>,
    #[serde(default)]
    pub active: Vec<RunId>,
}

/// What [`Admissions::admit`] decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Admit {
    /// The run was admitted before: nothing to write.
    Already,
    /// Admitted: the record to write.
    Admitted(Admissions),
    Refused(Exceeded),
}

impl Admissions {
    /// The record as of minute window `minute`: an older one's `started` moves to `previous`
    /// (or is dropped when more than one window old).
    fn rolled(&self, minute: u64) -> Admissions {
        let mut r = self.clone();
        if r.minute != minute {
            r.previous = if r.minute + 1 == minute {
                std::mem::take(&mut r.started)
            } else {
                Vec::new()
            };
            r.started.clear();
            r.minute = minute;
        }
        r
    }

    /// Whether `run` was admitted (it is unfinished, or started within the last two windows).
    pub fn holds(&self, run: &RunId) -> bool {
        self.active.contains(run) || self.started.contains(run) || self.previous.contains(run)
    }

    /// Admits `run` of `tenant` under `limits` at `now_ms`, or refuses it naming the quota.
    /// Only the limits that are set are counted (a tenant without an active-runs limit keeps
    /// no list of its runs).
    pub fn admit(
        &self,
        tenant: &TenantId,
        limits: &QuotaLimits,
        windows: Windows,
        run: &RunId,
        now_ms: u64,
    ) -> Admit {
        let minute = windows.minute(now_ms);
        let r = self.rolled(minute);
        if r.holds(run) {
            return Admit::Already;
        }
        if let Err(e) = r.check(tenant, limits, windows, now_ms) {
            return Admit::Refused(e);
        }
        let mut r = r;
        if limits.runs_per_minute > 0 {
            r.started.push(run.clone());
        }
        if limits.max_active_runs > 0 {
            r.active.push(run.clone());
        }
        Admit::Admitted(r)
    }

    /// Whether one more run of `tenant` would be admitted now (without a run id: the tenant
    /// gateway's early answer; intake still decides).
    pub fn check(
        &self,
        tenant: &TenantId,
        limits: &QuotaLimits,
        windows: Windows,
        now_ms: u64,
    ) -> Result<(), Exceeded> {
        let r = self.rolled(windows.minute(now_ms));
        let started = r.started.len();
        if limits.runs_per_minute > 0 && started >= limits.runs_per_minute as usize {
            return Err(Exceeded {
                quota: QuotaKind::RunsPerMinute,
                tenant: tenant.clone(),
                used: started as f64,
                limit: f64::from(limits.runs_per_minute),
                retry_after_secs: secs_for(windows.minute_left_ms(now_ms)),
            });
        }
        let active = r.active.len();
        if limits.max_active_runs > 0 && active >= limits.max_active_runs as usize {
            return Err(Exceeded {
                quota: QuotaKind::MaxActiveRuns,
                tenant: tenant.clone(),
                used: active as f64,
                limit: f64::from(limits.max_active_runs),
                retry_after_secs: ACTIVE_RETRY_SECS,
            });
        }
        Ok(())
    }

    /// The record without `run` among the unfinished runs (it ended), or `None` when it was
    /// not there.
    pub fn release(&self, run: &RunId) -> Option<Admissions> {
        let mut r = self.clone();
        let before = r.active.len();
        r.active.retain(|a| a != run);
        (r.active.len() != before).then_some(r)
    }

    /// The record with `run` among the unfinished runs again (revived), or `None` when it was
    /// there already or the tenant keeps no list.
    pub fn restore(&self, run: &RunId, limits: &QuotaLimits) -> Option<Admissions> {
        if limits.max_active_runs == 0 || self.active.contains(run) {
            return None;
        }
        let mut r = self.clone();
        r.active.push(run.clone());
        Some(r)
    }

    /// Runs started in the minute window of `now_ms`.
    pub fn started_now(&self, windows: Windows, now_ms: u64) -> usize {
        self.rolled(windows.minute(now_ms)).started.len()
    }
}

/// A tenant's model usage in one day window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DayUsage {
    pub tokens: u64,
    /// In `quotas.currency`; calls priced in another currency are not counted here.
    pub cost: f64,
    /// Model calls counted.
    #[serde(default)]
    pub calls: u64,
}

impl DayUsage {
    /// The usage with one model call's `usage` added, priced at `price` when its currency is
    /// `currency` (the cost of a call priced in another currency is not added).
    pub fn add(&self, usage: &Usage, price: Option<&Price>, currency: &str) -> DayUsage {
        let mut u = self.clone();
        u.tokens = u.tokens.saturating_add(usage.total());
        u.calls = u.calls.saturating_add(1);
        if let Some(p) = price.filter(|p| p.currency == currency) {
            let c = p.cost(usage);
            if c.is_finite() && c > 0.0 {
                u.cost += c;
            }
        }
        u
    }

    /// Whether `tenant` may call a model now under `limits`, or which quota of the day holds
    /// it and until when.
    pub fn check(
        &self,
        tenant: &TenantId,
        limits: &QuotaLimits,
        windows: Windows,
        now_ms: u64,
    ) -> Result<(), Exceeded> {
        let retry_after_secs = secs_for(windows.day_left_ms(now_ms));
        if limits.tokens_per_day > 0 && self.tokens >= limits.tokens_per_day {
            return Err(Exceeded {
                quota: QuotaKind::TokensPerDay,
                tenant: tenant.clone(),
                used: self.tokens as f64,
                limit: limits.tokens_per_day as f64,
                retry_after_secs,
            });
        }
        if limits.cost_per_day > 0.0 && self.cost >= limits.cost_per_day {
            return Err(Exceeded {
                quota: QuotaKind::CostPerDay,
                tenant: tenant.clone(),
                used: self.cost,
                limit: limits.cost_per_day,
                retry_after_secs,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant() -> TenantId {
        "acme".parse().expect("tenant")
    }

    fn run(n: u32) -> RunId {
        format!("run_{n:032x}").parse().expect("run id")
    }

    fn limits(rpm: u32, active: u32) -> QuotaLimits {
        QuotaLimits {
            runs_per_minute: rpm,
            max_active_runs: active,
            ..QuotaLimits::default()
        }
    }

    fn admitted(a: Admit) -> Admissions {
        match a {
            Admit::Admitted(r) => r,
            other => panic!("not admitted: {other:?}"),
        }
    }

    #[test]
    fn windows_are_numbered_from_the_epoch_and_say_when_they_end() {
        let w = Windows::default();
        assert_eq!(w.minute(59_999), 0);
        assert_eq!(w.minute(60_000), 1);
        assert_eq!(w.minute_left_ms(59_000), 1_000);
        assert_eq!(w.day(86_400_000 * 3 + 5), 3);
        assert_eq!(w.day_left_ms(86_400_000 * 3 + 400), 86_400_000 - 400);
        let short = Windows {
            minute_secs: 2,
            day_secs: 5,
        };
        assert_eq!(short.day(4_999), 0);
        assert_eq!(short.day(5_000), 1);
        assert_eq!(secs_for(1), 1);
        assert_eq!(secs_for(1_001), 2);
        assert_eq!(secs_for(0), 1);
    }

    #[test]
    fn runs_per_minute_admits_the_limit_then_refuses_until_the_window_rolls() {
        let w = Windows::default();
        let l = limits(2, 0);
        let t0 = 600_000 + 15_000;
        let r = admitted(Admissions::default().admit(&tenant(), &l, w, &run(1), t0));
        let r = admitted(r.admit(&tenant(), &l, w, &run(2), t0));
        assert!(r.active.is_empty(), "no list without an active limit");
        let Admit::Refused(e) = r.admit(&tenant(), &l, w, &run(3), t0) else {
            panic!("third run admitted");
        };
        assert_eq!(e.quota, QuotaKind::RunsPerMinute);
        assert_eq!(e.retry_after_secs, 45);
        assert!(e.reason().contains("runs_per_minute") && e.reason().contains("acme"));
        assert_eq!(
            r.check(&tenant(), &l, w, t0).map_err(|e| e.quota),
            Err(QuotaKind::RunsPerMinute)
        );
        // Idempotent: the same run again is no new start, in this window and the next.
        assert_eq!(r.admit(&tenant(), &l, w, &run(2), t0), Admit::Already);
        assert_eq!(
            r.admit(&tenant(), &l, w, &run(2), t0 + 60_000),
            Admit::Already
        );
        // The next window starts at zero.
        let next = admitted(r.admit(&tenant(), &l, w, &run(3), t0 + 60_000));
        assert_eq!(next.started, vec![run(3)]);
        assert_eq!(next.previous, vec![run(1), run(2)]);
        // Two windows later the old ones are forgotten.
        let later = admitted(next.admit(&tenant(), &l, w, &run(4), t0 + 180_000));
        assert!(later.previous.is_empty());
        assert_eq!(later.started_now(w, t0 + 180_000), 1);
    }

    #[test]
    fn unfinished_runs_are_counted_by_id_and_released_once() {
        let w = Windows::default();
        let l = limits(0, 2);
        let r = admitted(Admissions::default().admit(&tenant(), &l, w, &run(1), 0));
        let r = admitted(r.admit(&tenant(), &l, w, &run(2), 0));
        let Admit::Refused(e) = r.admit(&tenant(), &l, w, &run(3), 0) else {
            panic!("third unfinished run admitted");
        };
        assert_eq!(
            (e.quota, e.retry_after_secs),
            (QuotaKind::MaxActiveRuns, ACTIVE_RETRY_SECS)
        );
        let r = r.release(&run(1)).expect("released");
        assert!(r.release(&run(1)).is_none(), "a second end changes nothing");
        let r = admitted(r.admit(&tenant(), &l, w, &run(3), 0));
        assert!(r.restore(&run(3), &l).is_none(), "already there");
        let r = r.release(&run(2)).expect("released");
        assert_eq!(r.restore(&run(2), &l).expect("revived").active.len(), 2);
        assert!(r.restore(&run(2), &limits(0, 0)).is_none(), "no list kept");
    }

    #[test]
    fn no_limits_admit_everything_and_keep_nothing() {
        let r = admitted(Admissions::default().admit(
            &tenant(),
            &QuotaLimits::default(),
            Windows::default(),
            &run(1),
            0,
        ));
        assert_eq!(r, Admissions::default());
        assert!(!QuotaLimits::default().any());
    }

    #[test]
    fn the_day_counts_tokens_and_cost_in_the_quota_currency() {
        let usd = Price {
            input_per_mtok: 3.0,
            output_per_mtok: 15.0,
            currency: "USD".into(),
        };
        let eur = Price {
            currency: "EUR".into(),
            ..usd.clone()
        };
        let call = Usage {
            input_tokens: 1_000_000,
            output_tokens: 100_000,
            cost: None,
        };
        let u = DayUsage::default().add(&call, Some(&usd), "USD");
        assert_eq!(u.tokens, 1_100_000);
        assert!((u.cost - 4.5).abs() < 1e-9, "{}", u.cost);
        let u = u.add(&call, Some(&eur), "USD").add(&call, None, "USD");
        assert!(
            (u.cost - 4.5).abs() < 1e-9,
            "other currencies and no price add nothing"
        );
        assert_eq!((u.tokens, u.calls), (3_300_000, 3));

        let w = Windows::default();
        let mut l = QuotaLimits {
            tokens_per_day: 3_300_000,
            ..QuotaLimits::default()
        };
        let e = u
            .check(&tenant(), &l, w, 86_400_000 - 2_500)
            .expect_err("at the limit");
        assert_eq!((e.quota, e.retry_after_secs), (QuotaKind::TokensPerDay, 3));
        l.tokens_per_day = 3_300_001;
        assert!(u.check(&tenant(), &l, w, 0).is_ok());
        l.cost_per_day = 4.5;
        assert_eq!(
            u.check(&tenant(), &l, w, 0).map_err(|e| e.quota),
            Err(QuotaKind::CostPerDay)
        );
        assert!(l.limits_usage() && l.any());
    }

    #[test]
    fn a_listed_tenant_has_its_own_limits_and_the_rest_the_default() {
        let mut p = QuotaPolicy::default();
        assert!(!p.any());
        p.default.runs_per_minute = 5;
        p.tenants.insert("globex".parse().expect("t"), limits(0, 1));
        assert_eq!(p.limits(&tenant()).runs_per_minute, 5);
        let g = p.limits(&"globex".parse().expect("t"));
        assert_eq!((g.runs_per_minute, g.max_active_runs), (0, 1));
        assert!(p.any());
        let parsed: QuotaPolicy = serde_json::from_str(
            r#"{"default": {"tokens_per_day": 10, "on_exceeded": "fail"}, "tenants": {"acme": {}}}"#,
        )
        .expect("parses");
        assert_eq!(parsed.default.on_exceeded, OnExceeded::Fail);
        assert!(!parsed.limits(&tenant()).any());
        assert!(serde_json::from_str::<QuotaPolicy>(r#"{"default": {"nope": 1}}"#).is_err());
    }
}
