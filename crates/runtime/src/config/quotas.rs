//! Tenant quotas (`quotas.*`): runs started per minute, unfinished runs, model tokens and cost
//! per day, for every tenant (`default`) and for listed tenants; the windows' lengths; the
//! `KEDGE_QUOTAS` variable. docs/CONFIG.md "Quotas (`quotas.*`)"; what is counted where:
//! docs/ARCHITECTURE.md "Quotas".

use kedge_core::quota::{QuotaLimits, QuotaPolicy, Windows};
use serde::{Deserialize, Serialize};

use super::ConfigError;

/// The operator's quotas. Nothing is counted while no tenant has a limit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct QuotasConfig {
    /// The limits of every tenant not listed in `tenants` (all 0: none).
    pub default: QuotaLimits,
    /// Tenants with limits of their own (they replace `default` wholly).
    pub tenants: std::collections::BTreeMap<kedge_core::ids::TenantId, QuotaLimits>,
    /// The currency `cost_per_day` is counted in (default `USD`); calls of models priced in
    /// another currency add tokens but no cost.
    pub currency: String,
    /// The length of the window `runs_per_minute` counts in, in seconds (default 60; tests).
    pub minute_secs: u64,
    /// The length of the window `tokens_per_day` and `cost_per_day` count in, in seconds
    /// (default 86,400: days of UTC; tests).
    pub day_secs: u64,
    /// How often the reconciler checks the unfinished runs counted against each tenant and
    /// removes those that ended without being counted out (a crash between the end and the
    /// count), in seconds (default 30).
    pub repair_secs: u64,
}

impl Default for QuotasConfig {
    fn default() -> Self {
        QuotasConfig {
            default: QuotaLimits::default(),
            tenants: Default::default(),
            currency: "USD".to_owned(),
            minute_secs: 60,
            day_secs: 86_400,
            repair_secs: 30,
        }
    }
}

/// The highest `runs_per_minute` a tenant may be given.
pub const MAX_RUNS_PER_MINUTE: u32 = 5_000;
/// The highest `max_active_runs` a tenant may be given.
pub const MAX_ACTIVE_RUNS: u32 = 10_000;

impl QuotasConfig {
    /// The limits as a policy (what the core decides with).
    pub fn policy(&self) -> QuotaPolicy {
        QuotaPolicy {
            default: self.default.clone(),
            tenants: self.tenants.clone(),
        }
    }

    /// Whether any tenant has any limit (without a limit, no door and no step touches the
    /// quotas bucket).
    pub fn any(&self) -> bool {
        self.default.any() || self.tenants.values().any(QuotaLimits::any)
    }

    /// The windows' lengths.
    pub fn windows(&self) -> Windows {
        Windows {
            minute_secs: self.minute_secs,
            day_secs: self.day_secs,
        }
    }

    pub(super) fn check(&self) -> Result<(), ConfigError> {
        let invalid = |reason: String| {
            Err(ConfigError::Invalid {
                field: "quotas",
                reason,
            })
        };
        if self.minute_secs == 0 || self.day_secs == 0 || self.repair_secs == 0 {
            return invalid("minute_secs, day_secs and repair_secs must be at least 1".into());
        }
        if self.currency.trim().is_empty() {
            return invalid("currency must not be empty".into());
        }
        let all = std::iter::once(("default".to_owned(), &self.default))
            .chain(self.tenants.iter().map(|(t, l)| (t.to_string(), l)));
        for (who, l) in all {
            if !l.cost_per_day.is_finite() || l.cost_per_day < 0.0 {
                return invalid(format!(
                    "{who}: cost_per_day must be a finite amount of at least 0"
                ));
            }
            // A tenant's admissions record lists the run ids these allow (one write of the whole
            // record per admission, under the broker's 1 MB message limit).
            if l.runs_per_minute > MAX_RUNS_PER_MINUTE || l.max_active_runs > MAX_ACTIVE_RUNS {
                return invalid(format!(
                    "{who}: runs_per_minute is at most {MAX_RUNS_PER_MINUTE} and max_active_runs at most {MAX_ACTIVE_RUNS}"
                ));
            }
        }
        Ok(())
    }

    /// `KEDGE_QUOTAS`: the whole section as a JSON object.
    pub(super) fn apply_env(
        &mut self,
        get: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        if let Some(v) = get("KEDGE_QUOTAS").filter(|v| !v.trim().is_empty()) {
            *self = serde_json::from_str(&v).map_err(|e| ConfigError::Env {
                var: "KEDGE_QUOTAS",
                reason: e.to_string(),
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::env_of;

    #[test]
    fn quotas_read_from_the_variable_and_are_checked() {
        let mut q = QuotasConfig::default();
        assert!(q.check().is_ok() && !q.policy().any());
        let env = env_of(&[(
            "KEDGE_QUOTAS",
            r#"{"default": {"runs_per_minute": 5}, "tenants": {"acme": {"cost_per_day": 2.5}}, "day_secs": 10}"#.into(),
        )]);
        q.apply_env(&env).expect("applies");
        assert_eq!(q.default.runs_per_minute, 5);
        assert_eq!(q.windows().day_secs, 10);
        assert_eq!(
            q.policy().limits(&"acme".parse().expect("t")).cost_per_day,
            2.5
        );
        assert!(q.check().is_ok());
        q.default.cost_per_day = -1.0;
        assert!(q.check().is_err());
        q.default.cost_per_day = 0.0;
        q.default.max_active_runs = MAX_ACTIVE_RUNS + 1;
        assert!(q.check().is_err());
        q.default.max_active_runs = 0;
        q.minute_secs = 0;
        assert!(q.check().is_err());
        let bad = env_of(&[("KEDGE_QUOTAS", r#"{"default": {"runs": 1}}"#.into())]);
        assert!(QuotasConfig::default().apply_env(&bad).is_err());
    }
}
