//! How the fleet rides out a model provider's trouble (`providers.*`): the breaker per endpoint,
//! its probes, the rate waiting runs are released at, the rate limits kept to per endpoint; their
//! checks and `KEDGE_PROVIDER_*` variables. docs/CONFIG.md "Provider trouble (`providers.*`)".

use serde::{Deserialize, Serialize};

use super::ConfigError;
#[cfg(doc)]
use super::RetentionConfig; // linked from `ProviderConfig`'s documentation
use super::duration::{duration_text, parse_duration};
use super::env::num;

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
    pub(super) fn check(&self) -> Result<(), ConfigError> {
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

    /// Applies the `KEDGE_PROVIDER_*` variables.
    pub(super) fn apply_env(
        &mut self,
        get: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        if let Some(v) = get("KEDGE_PROVIDER_OPEN_AFTER") {
            self.open_after = num("KEDGE_PROVIDER_OPEN_AFTER", &v)?;
        }
        if let Some(v) = get("KEDGE_PROVIDER_LIMITS") {
            self.limits = serde_json::from_str(&v).map_err(|e| ConfigError::Env {
                var: "KEDGE_PROVIDER_LIMITS",
                reason: format!("not a JSON array of endpoint limits: {e}"),
            })?;
        }
        if let Some(v) = get("KEDGE_PROVIDER_RELEASE_PER_SECOND") {
            self.release_per_second = num("KEDGE_PROVIDER_RELEASE_PER_SECOND", &v)?;
        }
        for (var, field) in [
            ("KEDGE_PROVIDER_WAIT", &mut self.wait),
            ("KEDGE_PROVIDER_PROBE_INTERVAL", &mut self.probe_interval),
            (
                "KEDGE_PROVIDER_MAX_PROBE_INTERVAL",
                &mut self.max_probe_interval,
            ),
        ] {
            if let Some(v) = get(var) {
                *field = parse_duration(&v).map_err(|reason| ConfigError::Env { var, reason })?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

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
}
