//! Where a process serves its metrics (`metrics_addr`) and exports its trace spans
//! (`otlp_endpoint`): their variables and checks. docs/CONFIG.md "Metrics (`metrics_addr`)" and
//! "Traces (`otlp_endpoint`)".

use super::env::non_empty;
use super::{Config, ConfigError};
use crate::connect::redact_url;

impl Config {
    /// Applies `KEDGE_METRICS_ADDR` (blank: no endpoint).
    pub(super) fn apply_metrics_env(&mut self, get: &impl Fn(&'static str) -> Option<String>) {
        if let Some(v) = get("KEDGE_METRICS_ADDR") {
            self.metrics_addr = non_empty(Some(v)).map(|v| v.trim().to_owned());
        }
    }

    /// Applies `KEDGE_OTLP_ENDPOINT` (blank: no export).
    pub(super) fn apply_otlp_env(&mut self, get: &impl Fn(&'static str) -> Option<String>) {
        if let Some(v) = get("KEDGE_OTLP_ENDPOINT") {
            self.otlp_endpoint = non_empty(Some(v)).map(|v| v.trim().to_owned());
        }
    }

    /// A metrics address, when given, is `host:port`.
    pub(super) fn check_metrics_addr(&self) -> Result<(), ConfigError> {
        if let Some(addr) = &self.metrics_addr {
            let port = addr
                .rsplit_once(':')
                .filter(|(host, _)| !host.is_empty())
                .and_then(|(_, port)| port.parse::<u16>().ok());
            if port.is_none() {
                return Err(ConfigError::Invalid {
                    field: "metrics_addr",
                    reason: format!("`{addr}` is not host:port (e.g. 0.0.0.0:9464)"),
                });
            }
        }
        Ok(())
    }

    /// A collector, when given, is an `http(s)://` URL with a host.
    pub(super) fn check_otlp_endpoint(&self) -> Result<(), ConfigError> {
        if let Some(url) = &self.otlp_endpoint {
            let rest = url
                .strip_prefix("http://")
                .or_else(|| url.strip_prefix("https://"));
            if rest.is_none_or(|r| r.is_empty() || r.starts_with('/')) {
                return Err(ConfigError::Invalid {
                    field: "otlp_endpoint",
                    reason: format!(
                        "`{}` is not an http(s) URL (e.g. http://127.0.0.1:4318)",
                        redact_url(url)
                    ),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_endpoint_is_off_unless_an_address_is_given() {
        let mut c = Config::default();
        assert_eq!(c.metrics_addr, None);
        c.apply_env(|k| (k == "KEDGE_METRICS_ADDR").then(|| " 0.0.0.0:9464 ".into()))
            .expect("applies");
        assert_eq!(c.metrics_addr.as_deref(), Some("0.0.0.0:9464"));
        c.check().expect("valid");
        let dumped = serde_json::to_value(&c).expect("json");
        assert_eq!(dumped["metrics_addr"], "0.0.0.0:9464");
        c.apply_env(|k| (k == "KEDGE_METRICS_ADDR").then(String::new))
            .expect("applies");
        assert_eq!(c.metrics_addr, None, "an empty variable turns it off");
        for bad in ["9464", ":9464", "localhost:port", "127.0.0.1:70000"] {
            c.metrics_addr = Some(bad.into());
            let err = c.check().expect_err(bad).to_string();
            assert!(err.contains("metrics_addr"), "{err}");
        }
        let from_file: Config =
            serde_json::from_str(r#"{"metrics_addr": "[::1]:9464"}"#).expect("parses");
        from_file.check().expect("valid");
    }

    #[test]
    fn trace_export_is_off_unless_an_endpoint_is_given() {
        let mut c = Config::default();
        assert_eq!(c.otlp_endpoint, None);
        c.apply_env(|k| (k == "KEDGE_OTLP_ENDPOINT").then(|| " http://127.0.0.1:4318 ".into()))
            .expect("applies");
        assert_eq!(c.otlp_endpoint.as_deref(), Some("http://127.0.0.1:4318"));
        c.check().expect("valid");
        assert_eq!(
            serde_json::to_value(&c).expect("json")["otlp_endpoint"],
            "http://127.0.0.1:4318"
        );
        c.apply_env(|k| (k == "KEDGE_OTLP_ENDPOINT").then(String::new))
            .expect("applies");
        assert_eq!(c.otlp_endpoint, None, "an empty variable turns it off");
        for bad in ["127.0.0.1:4318", "http://", "grpc://collector:4317"] {
            c.otlp_endpoint = Some(bad.into());
            let err = c.check().expect_err(bad).to_string();
            assert!(err.contains("otlp_endpoint"), "{err}");
        }
        let from_file: Config =
            serde_json::from_str(r#"{"otlp_endpoint": "https://otel.example:4318"}"#)
                .expect("parses");
        from_file.check().expect("valid");
    }
}
