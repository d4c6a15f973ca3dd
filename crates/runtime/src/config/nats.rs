//! How a process connects to NATS (`nats_urls`, `nats.*`, [`NatsConfig`]): at most one way to
//! authenticate, the TLS files, the inbox prefix; their checks and `KEDGE_NATS_*` variables. The
//! other layers that set them (a `nats` CLI context, flags, the `nats` CLI's own variables) are
//! in `layers.rs`. docs/CONFIG.md "Connecting to NATS".

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::env::{flag, non_empty, num, split_urls};
use super::{Config, ConfigError, Secret};
use crate::connect::url_auth;

/// The default server.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";
/// The default inbox prefix (the NATS clients' own).
pub const DEFAULT_INBOX_PREFIX: &str = "_INBOX";

/// How a process authenticates to NATS, its TLS files and its inbox prefix (the `nats` section of
/// the file). At most one authentication method: `creds_file`, `nkey_seed_file`,
/// `user` + `password`, `token` (or user info in `nats_urls`). File paths are not secrets and
/// are printed; passwords and tokens are [`Secret`]s.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    /// A `.creds` file: user JWT and nkey seed (`KEDGE_NATS_CREDS`, `--creds`, `NATS_CREDS`).
    pub creds_file: Option<PathBuf>,
    /// A file holding a user nkey seed, `SU…` (`KEDGE_NATS_NKEY`, `--nkey`, `NATS_NKEY`).
    pub nkey_seed_file: Option<PathBuf>,
    /// User name, with `password` (`KEDGE_NATS_USER`, `--user`, `NATS_USER`).
    pub user: Option<String>,
    /// (`KEDGE_NATS_PASSWORD`, `--password`, `NATS_PASSWORD`).
    pub password: Option<Secret>,
    /// An authentication token (`KEDGE_NATS_TOKEN`, `--nats-token`).
    pub token: Option<Secret>,
    /// PEM file of the CA(s) that signed the servers' certificates (`KEDGE_NATS_TLS_CA`,
    /// `--tls-ca`). Setting any `tls_*` file requires TLS.
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate, with `tls_key` (`KEDGE_NATS_TLS_CERT`, `--tls-cert`).
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert` (`KEDGE_NATS_TLS_KEY`, `--tls-key`).
    pub tls_key: Option<PathBuf>,
    /// Refuse a connection without TLS (`KEDGE_NATS_TLS_REQUIRED=1`; also implied by `tls://`
    /// URLs and by any `tls_*` file).
    pub tls_required: bool,
    /// Prefix of this process's inbox subjects (`KEDGE_NATS_INBOX_PREFIX`); see
    /// [`Config::inbox_prefix`].
    pub inbox_prefix: String,
    /// How long the first connection keeps retrying an unreachable server before giving up
    /// (`KEDGE_NATS_CONNECT_WAIT_MS`). A refused authentication or a TLS failure is not retried.
    pub connect_wait_ms: u64,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            creds_file: None,
            nkey_seed_file: None,
            user: None,
            password: None,
            token: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_required: false,
            inbox_prefix: DEFAULT_INBOX_PREFIX.into(),
            connect_wait_ms: 10_000,
        }
    }
}

impl NatsConfig {
    /// The authentication methods set, by field name (more than one is refused by `check`).
    pub(super) fn auth_methods(&self) -> Vec<&'static str> {
        let mut set = Vec::new();
        if self.creds_file.is_some() {
            set.push("nats.creds_file");
        }
        if self.nkey_seed_file.is_some() {
            set.push("nats.nkey_seed_file");
        }
        if self.user.is_some() || self.password.is_some() {
            set.push("nats.user/nats.password");
        }
        if self.token.is_some() {
            set.push("nats.token");
        }
        set
    }

    /// Whether TLS is required: `tls_required` or any TLS file.
    pub fn requires_tls(&self) -> bool {
        self.tls_required || self.tls_ca.is_some() || self.tls_cert.is_some()
    }

    /// The `nats` checks of [`Config::check`] (`urls`: [`Config::nats_urls`]).
    pub(crate) fn check(&self, urls: &[String]) -> Result<(), ConfigError> {
        let invalid = |field, reason: String| Err(ConfigError::Invalid { field, reason });
        let url_auth = url_auth(urls).map_err(|reason| ConfigError::Invalid {
            field: "nats_urls",
            reason,
        })?;
        let mut methods = self.auth_methods();
        if url_auth.is_some() {
            methods.push("nats_urls (user info)");
        }
        if methods.len() > 1 {
            return Err(ConfigError::AuthConflict { fields: methods });
        }
        match (&self.user, &self.password) {
            (Some(u), Some(p)) if !u.is_empty() && !p.expose().is_empty() => {}
            (Some(_), Some(_)) => {
                return invalid("nats.user", "user and password must not be empty".into());
            }
            (Some(_), None) => {
                return invalid(
                    "nats.password",
                    "nats.user is set without a password (for a token use nats.token)".into(),
                );
            }
            (None, Some(_)) => {
                return invalid("nats.user", "nats.password is set without a user".into());
            }
            (None, None) => {}
        }
        if self.token.as_ref().is_some_and(|t| t.expose().is_empty()) {
            return invalid("nats.token", "must not be empty".into());
        }
        if let Some(p) = &self.nkey_seed_file
            && looks_like_seed(&p.to_string_lossy())
        {
            // Not echoed: this is the secret itself.
            return invalid(
                "nats.nkey_seed_file",
                "this looks like an nkey seed, not a file path: put the seed in a file and give \
                 its path"
                    .into(),
            );
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return invalid(
                "nats.tls_cert/nats.tls_key",
                "a client certificate needs both the certificate and its key".into(),
            );
        }
        if !valid_inbox_prefix(&self.inbox_prefix) {
            return invalid(
                "nats.inbox_prefix",
                format!(
                    "`{}` is not a subject prefix (tokens of printable ASCII separated by `.`, \
                     no wildcards `*` `>`)",
                    self.inbox_prefix
                ),
            );
        }
        Ok(())
    }
}

/// An nkey seed is 58 base32 characters starting with `S`.
fn looks_like_seed(s: &str) -> bool {
    let s = s.trim();
    s.len() == 58
        && s.starts_with('S')
        && s.chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
}

fn valid_inbox_prefix(p: &str) -> bool {
    !p.is_empty()
        && p.split('.').all(|token| {
            !token.is_empty()
                && token
                    .chars()
                    .all(|c| c.is_ascii_graphic() && c != '*' && c != '>')
        })
}

impl Config {
    /// The prefix of this process's inbox subjects (`<prefix>.…`): `nats.inbox_prefix`, default
    /// `_INBOX`. Replies to its requests arrive there, so a user's permissions must let it
    /// subscribe to `<prefix>.>`.
    pub fn inbox_prefix(&self) -> &str {
        &self.nats.inbox_prefix
    }

    /// Applies `KEDGE_NATS_URL` and the `KEDGE_NATS_*` variables.
    pub(super) fn apply_nats_env(
        &mut self,
        get: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        if let Some(v) = get("KEDGE_NATS_URL") {
            self.nats_urls = split_urls(&v);
        }
        let n = &mut self.nats;
        for (var, field) in [
            ("KEDGE_NATS_CREDS", &mut n.creds_file),
            ("KEDGE_NATS_NKEY", &mut n.nkey_seed_file),
            ("KEDGE_NATS_TLS_CA", &mut n.tls_ca),
            ("KEDGE_NATS_TLS_CERT", &mut n.tls_cert),
            ("KEDGE_NATS_TLS_KEY", &mut n.tls_key),
        ] {
            if let Some(v) = non_empty(get(var)) {
                *field = Some(PathBuf::from(v.trim()));
            }
        }
        if let Some(v) = non_empty(get("KEDGE_NATS_USER")) {
            n.user = Some(v);
        }
        if let Some(v) = non_empty(get("KEDGE_NATS_PASSWORD")) {
            n.password = Some(Secret(v));
        }
        if let Some(v) = non_empty(get("KEDGE_NATS_TOKEN")) {
            n.token = Some(Secret(v));
        }
        if let Some(v) = get("KEDGE_NATS_TLS_REQUIRED") {
            n.tls_required = flag("KEDGE_NATS_TLS_REQUIRED", &v)?;
        }
        if let Some(v) = non_empty(get("KEDGE_NATS_INBOX_PREFIX")) {
            n.inbox_prefix = v.trim().to_owned();
        }
        if let Some(v) = get("KEDGE_NATS_CONNECT_WAIT_MS") {
            n.connect_wait_ms = num("KEDGE_NATS_CONNECT_WAIT_MS", &v)?;
        }
        Ok(())
    }

    /// At least one URL, and the `nats` checks ([`NatsConfig::check`]).
    pub(super) fn check_nats(&self) -> Result<(), ConfigError> {
        if self.nats_urls.is_empty() {
            return Err(ConfigError::Invalid {
                field: "nats_urls",
                reason: "at least one URL is needed".into(),
            });
        }
        self.nats.check(&self.nats_urls)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Flags;
    use crate::config::tests::{env_of, write};

    #[test]
    fn two_ways_to_authenticate_are_refused_naming_both() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("kedge.json");
        write(&file, r#"{"nats": {"token": "file-token"}}"#);
        let err = Config::load_layered(
            Some(&file),
            &Flags::default(),
            env_of(&[("KEDGE_NATS_CREDS", "/k/u.creds".into())]),
        )
        .expect_err("token and creds");
        let text = err.to_string();
        assert!(matches!(err, ConfigError::AuthConflict { .. }), "{text}");
        assert!(
            text.contains("nats.creds_file") && text.contains("nats.token"),
            "{text}"
        );
        assert!(!text.contains("file-token"), "{text}");

        let mut c = Config {
            nats_urls: vec!["nats://u:url-pass@h:4222".into()],
            ..Config::default()
        };
        c.nats.nkey_seed_file = Some("/k/u.nk".into());
        let text = c.check().expect_err("URL user info and nkey").to_string();
        assert!(
            text.contains("nats_urls") && text.contains("nats.nkey_seed_file"),
            "{text}"
        );
        assert!(!text.contains("url-pass"), "{text}");

        let mut c = Config::default();
        c.nats.user = Some("u".into());
        assert!(
            c.check()
                .expect_err("no password")
                .to_string()
                .contains("nats.password")
        );
        let mut c = Config::default();
        c.nats.tls_cert = Some("/c.pem".into());
        assert!(
            c.check()
                .expect_err("no key")
                .to_string()
                .contains("tls_key")
        );
        let mut c = Config::default();
        c.nats.inbox_prefix = "_INBOX.>".into();
        assert!(
            c.check()
                .expect_err("wildcard")
                .to_string()
                .contains("inbox_prefix")
        );
        let mut c = Config::default();
        let seed = "SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU";
        c.nats.nkey_seed_file = Some(seed.into());
        let text = c.check().expect_err("a seed, not a path").to_string();
        assert!(
            text.contains("nkey_seed_file") && !text.contains(seed),
            "{text}"
        );
    }
}
