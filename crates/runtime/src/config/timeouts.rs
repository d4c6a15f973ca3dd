//! The variables of [`kedge_core::config::Timeouts`] (`KEDGE_*_MS`, each a number of
//! milliseconds); the struct, its defaults and its relations are `kedge_core`'s. docs/CONFIG.md
//! "Timeouts and their relations".

use super::env::num;
use super::{Config, ConfigError};

impl Config {
    /// Applies the timeouts' variables.
    pub(super) fn apply_timeouts_env(
        &mut self,
        get: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_bad_number_names_the_variable() {
        let mut c = Config::default();
        let err = c
            .apply_env(|k| (k == "KEDGE_LEASE_TTL_MS").then(|| "soon".into()))
            .expect_err("not a number");
        assert!(err.to_string().contains("KEDGE_LEASE_TTL_MS"));
    }
}
