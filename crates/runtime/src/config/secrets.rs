//! Values never printed: [`Secret`] (passwords, tokens, the seal and run-id keys) and [`REDACTED`], what
//! `Debug` and `--dump-config` print instead; and the operator's secrets that are settings of
//! their own, listed in docs/CONFIG.md's table: the approvers by token (`KEDGE_APPROVER_TOKENS`)
//! the seal key (`KEDGE_SEAL_KEY`) and the run-id key (`KEDGE_RUN_ID_KEY`).

use serde::{Deserialize, Serialize};

use super::env::non_empty;
use super::{Config, ConfigError};

/// What `Debug` and `--dump-config` print instead of a secret.
pub const REDACTED: &str = "<redacted>";

/// A secret string (a password, a token). `Debug`, `Display` and `Serialize` print
/// `<redacted>`; [`Secret::expose`] gives the value to the one place that sends it. Deserializes
/// from a plain string.
#[derive(Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub(super) String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The secret itself: only for handing it to the NATS client.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Secret(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Secret(value.to_owned())
    }
}

/// For command-line parsers.
impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

impl Config {
    /// Applies `KEDGE_APPROVER_TOKENS` (`token:name`, comma-separated).
    pub(super) fn apply_approvers_env(
        &mut self,
        get: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        if let Some(v) = get("KEDGE_APPROVER_TOKENS") {
            for pair in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                let (token, name) = pair.split_once(':').ok_or_else(|| ConfigError::Env {
                    var: "KEDGE_APPROVER_TOKENS",
                    reason: format!("`{pair}` is not token:name"),
                })?;
                self.approvers.insert(token.to_owned(), name.to_owned());
            }
        }
        Ok(())
    }

    /// Applies `KEDGE_SEAL_KEY` (blank: none).
    pub(super) fn apply_seal_key_env(&mut self, get: &impl Fn(&'static str) -> Option<String>) {
        if let Some(v) = get("KEDGE_SEAL_KEY") {
            self.seal_key = non_empty(Some(v)).map(|v| Secret::new(v.trim()));
        }
    }

    /// Applies `KEDGE_RUN_ID_KEY` (blank: none).
    pub(super) fn apply_run_id_key_env(&mut self, get: &impl Fn(&'static str) -> Option<String>) {
        if let Some(v) = get("KEDGE_RUN_ID_KEY") {
            self.run_id_key = non_empty(Some(v)).map(|v| Secret::new(v.trim()));
        }
    }

    /// A run-id key, when given, is one [`crate::run_ids::RunIdKey::from_hex`] reads.
    pub(super) fn check_run_id_key(&self) -> Result<(), ConfigError> {
        if let Some(key) = &self.run_id_key {
            crate::run_ids::RunIdKey::from_hex(key.expose()).map_err(|e| ConfigError::Invalid {
                field: "run_id_key",
                reason: e.to_string(),
            })?;
        }
        Ok(())
    }

    /// A seal key, when given, is one [`crate::seal::SealKey::from_hex`] reads.
    pub(super) fn check_seal_key(&self) -> Result<(), ConfigError> {
        if let Some(key) = &self.seal_key {
            crate::seal::SealKey::from_hex(key.expose()).map_err(|e| ConfigError::Invalid {
                field: "seal_key",
                reason: e.to_string(),
            })?;
        }
        Ok(())
    }
}
