//! Which API keys and endpoints agent definitions may use (`models`, [`ModelPolicy`]): the
//! policy, its check and `KEDGE_MODEL_KEYS`/`KEDGE_MODEL_BASE_URLS`, and how a step reads an API
//! key through it ([`Config::api_key`]). docs/CONFIG.md "Which keys and endpoints agents may use
//! (`models`)".

use serde::{Deserialize, Serialize};

use super::{Config, ConfigError};

/// What an agent definition may name for its model: the operator's choice, not the author's.
/// An agent's `api_key_env` (or its provider's default variable) must be one of `keys` (or a key
/// the embedding program put in [`Config::api_keys`]); its `model.base_url` (when set) must start
/// with one of `base_urls`, each an `https://` prefix, or be on this host when `base_urls`
/// holds `loopback`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelPolicy {
    /// Environment variables agents may name as their API key (`KEDGE_MODEL_KEYS`,
    /// comma-separated).
    pub keys: Vec<String>,
    /// Allowed base URL prefixes, `https://…` or `loopback` (`KEDGE_MODEL_BASE_URLS`).
    pub base_urls: Vec<String>,
}

impl Default for ModelPolicy {
    fn default() -> Self {
        Self {
            keys: vec!["OPENAI_API_KEY".into(), "ANTHROPIC_API_KEY".into()],
            base_urls: vec![
                "https://api.openai.com/".into(),
                "https://api.anthropic.com/".into(),
                "loopback".into(),
            ],
        }
    }
}

/// Whether `url`'s host is this machine (127.0.0.0/8, ::1, localhost).
pub fn is_loopback_url(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return false;
    }
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl ModelPolicy {
    /// Applies `KEDGE_MODEL_KEYS` and `KEDGE_MODEL_BASE_URLS`, comma-separated.
    pub(super) fn apply_env(&mut self, get: &impl Fn(&'static str) -> Option<String>) {
        let list = |v: &str| -> Vec<String> {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect()
        };
        if let Some(v) = get("KEDGE_MODEL_KEYS") {
            self.keys = list(&v);
        }
        if let Some(v) = get("KEDGE_MODEL_BASE_URLS") {
            self.base_urls = list(&v);
        }
    }

    /// Each allowed base URL is an `https://` prefix or `loopback`.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        if let Some(bad) = self.base_urls.iter().find(|u| {
            *u != "loopback" && !(u.starts_with("https://") && u.len() > "https://".len())
        }) {
            return Err(ConfigError::Invalid {
                field: "models.base_urls",
                reason: format!(
                    "`{bad}`: an entry is an https:// prefix or `loopback` (plain http only on \
                     this host)"
                ),
            });
        }
        Ok(())
    }
}

impl Config {
    /// The value of an API-key variable: the environment, else [`Config::api_keys`]. Only a
    /// variable the operator allows ([`ModelPolicy::keys`], or one in `api_keys`) is read: an
    /// agent definition cannot make the step send any other variable of its environment.
    pub fn api_key(&self, var: &str) -> Option<String> {
        if let Some(key) = self.api_keys.get(var) {
            return std::env::var(var)
                .ok()
                .filter(|v| !v.is_empty())
                .or_else(|| Some(key.clone()));
        }
        if !self.models.keys.iter().any(|k| k == var) {
            tracing::warn!(
                var,
                "an agent names an API-key variable the operator did not allow (models.keys); \
                 not read"
            );
            return None;
        }
        std::env::var(var).ok().filter(|v| !v.is_empty())
    }

    /// Whether an agent may use this key variable and base URL (see [`ModelPolicy`]); the
    /// reason when not.
    pub fn check_model(&self, key_var: &str, base_url: Option<&str>) -> Result<(), String> {
        if !self.api_keys.contains_key(key_var) && !self.models.keys.iter().any(|k| k == key_var) {
            return Err(format!(
                "api_key_env `{key_var}` is not among the keys the operator allows \
                 (models.keys / KEDGE_MODEL_KEYS: {})",
                self.models.keys.join(", ")
            ));
        }
        if let Some(url) = base_url {
            let allowed = self.models.base_urls.iter().any(|prefix| {
                if prefix == "loopback" {
                    is_loopback_url(url)
                } else {
                    // `https://api.anthropic.com` (as Anthropic's SDKs write it) is the
                    // allowed `https://api.anthropic.com/`; `…com.evil` is not.
                    url.starts_with(prefix.as_str())
                        || format!("{url}/").starts_with(prefix.as_str())
                }
            });
            if !allowed {
                return Err(format!(
                    "model.base_url `{url}` is not among the endpoints the operator allows \
                     (models.base_urls / KEDGE_MODEL_BASE_URLS: {})",
                    self.models.base_urls.join(", ")
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agents_use_only_the_keys_and_endpoints_the_operator_allows() {
        let mut c = Config::default();
        assert!(c.check_model("OPENAI_API_KEY", None).is_ok());
        assert!(
            c.check_model("OPENAI_API_KEY", Some("https://api.openai.com/v1"))
                .is_ok()
        );
        assert!(
            c.check_model("OPENAI_API_KEY", Some("http://127.0.0.1:8080/v1"))
                .is_ok()
        );
        assert!(
            c.check_model("OPENAI_API_KEY", Some("http://[::1]:8080/v1"))
                .is_ok()
        );
        assert!(
            c.check_model("ANTHROPIC_API_KEY", Some("https://api.anthropic.com"))
                .is_ok(),
            "as Anthropic's SDKs write it"
        );
        for (var, url) in [
            ("ANTHROPIC_API_KEY", Some("https://api.anthropic.com.evil")),
            ("HOME", None),
            ("NATS_PASSWORD", None),
            ("OPENAI_API_KEY", Some("https://evil.example/v1")),
            (
                "OPENAI_API_KEY",
                Some("https://api.openai.com.evil.example/v1"),
            ),
            ("OPENAI_API_KEY", Some("http://10.0.0.5/v1")),
            ("OPENAI_API_KEY", Some("http://127.0.0.1@evil.example/v1")),
        ] {
            assert!(c.check_model(var, url).is_err(), "{var} {url:?}");
        }
        assert_eq!(
            c.api_key("HOME"),
            None,
            "a variable nobody allowed is not read"
        );
        c.api_keys.insert("EMBEDDED_KEY".into(), "k".into());
        assert!(c.check_model("EMBEDDED_KEY", None).is_ok());
        assert_eq!(c.api_key("EMBEDDED_KEY").as_deref(), Some("k"));
        c.apply_env(|k| match k {
            "KEDGE_MODEL_KEYS" => Some("MY_KEY".into()),
            "KEDGE_MODEL_BASE_URLS" => Some("https://llm.internal/, loopback".into()),
            _ => None,
        })
        .expect("applies");
        assert!(
            c.check_model("MY_KEY", Some("https://llm.internal/v1"))
                .is_ok()
        );
        assert!(c.check_model("OPENAI_API_KEY", None).is_err());
        c.models.base_urls.push("http://llm.internal/".into());
        assert!(c.check().is_err(), "plain http beyond this host");
    }
}
