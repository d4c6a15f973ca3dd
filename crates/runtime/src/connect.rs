//! The one way a Kedge process connects to NATS: [`connect_client`] (and [`Runtime::connect`],
//! which calls it). It applies the whole [`NatsConfig`]: a `.creds` file, an nkey seed file,
//! user + password, a token or the user info of the URLs (at most one, checked by
//! [`Config::check`]); the TLS CA and client certificate; the inbox prefix
//! ([`Config::inbox_prefix`]).
//!
//! Invariants:
//! - Secrets never leave through here: URLs are shown only through [`redact_url`] (errors, logs),
//!   user info is stripped from the URLs before the NATS client sees them (it is applied as user
//!   and password or token instead), and error texts are scrubbed of the configured password and
//!   token.
//! - The first connection retries an unreachable server for `nats.connect_wait_ms`; a refused
//!   authentication, a TLS failure or an unusable setting fails at once
//!   ([`ConnectFailure`] says which).
//!
//! [`Runtime::connect`]: crate::Runtime::connect
//! [`NatsConfig`]: crate::config::NatsConfig

use std::path::Path;
use std::time::{Duration, Instant};

use async_nats::{ConnectErrorKind, ConnectOptions, ServerAddr};

use crate::config::{REDACTED, Secret};
use crate::{Config, RuntimeError};

/// Why a connection failed, for callers that branch on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectFailure {
    /// No server answered within `nats.connect_wait_ms` (retried until then).
    Unreachable,
    /// The server refused the credentials (authorization violation, bad signature).
    Refused,
    /// The TLS handshake failed (untrusted server certificate, client certificate refused).
    Tls,
    /// A setting cannot be used: an unreadable file, a URL that does not parse.
    Setup,
}

/// The user info of a URL, applied as credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum UrlAuth {
    /// `nats://user:password@host`.
    UserPassword { user: String, password: Secret },
    /// `nats://token@host`.
    Token(Secret),
}

/// The byte range of a URL's user info: `(start, index of '@')`, if it has any.
fn userinfo_span(url: &str) -> Option<(usize, usize)> {
    let start = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[start..];
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let at = rest[..end].rfind('@')?;
    Some((start, start + at))
}

/// `url` with its user info (`user:password@`, `token@`) replaced by `<redacted>`; anything
/// else is kept. Every URL that is shown (errors, logs, `--dump-config`) goes through here.
pub fn redact_url(url: &str) -> String {
    match userinfo_span(url) {
        Some((start, at)) => format!("{}{REDACTED}{}", &url[..start], &url[at..]),
        None => url.to_owned(),
    }
}

/// The URLs, redacted, comma-separated.
pub fn redact_urls(urls: &[String]) -> String {
    urls.iter()
        .map(|u| redact_url(u))
        .collect::<Vec<_>>()
        .join(",")
}

/// `url` without its user info.
fn strip_userinfo(url: &str) -> String {
    match userinfo_span(url) {
        Some((start, at)) => format!("{}{}", &url[..start], &url[at + 1..]),
        None => url.to_owned(),
    }
}

/// `%XX` escapes decoded (user info in URLs is percent-encoded).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            // Two hex digits make at most 255.
            out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The credentials the URLs carry: `None` when none has user info; an error (without the
/// secrets) when two carry different user info: every server gets the same credentials.
pub(crate) fn url_auth(urls: &[String]) -> Result<Option<UrlAuth>, String> {
    let mut found: Option<&str> = None;
    for url in urls {
        let Some((start, at)) = userinfo_span(url) else {
            continue;
        };
        let info = &url[start..at];
        if info.is_empty() {
            continue;
        }
        match found {
            Some(other) if other != info => {
                return Err(
                    "the URLs carry different user info; every server is authenticated the \
                     same way"
                        .into(),
                );
            }
            _ => found = Some(info),
        }
    }
    Ok(found.map(|info| match info.split_once(':') {
        Some((user, password)) => UrlAuth::UserPassword {
            user: percent_decode(user),
            password: Secret::new(percent_decode(password)),
        },
        None => UrlAuth::Token(Secret::new(percent_decode(info))),
    }))
}

/// The configured secrets, to scrub them from error texts that might echo them.
fn secrets(config: &Config) -> Vec<String> {
    let n = &config.nats;
    let mut out: Vec<String> = [&n.password, &n.token]
        .into_iter()
        .flatten()
        .map(|s| s.expose().to_owned())
        .collect();
    match url_auth(&config.nats_urls) {
        Ok(Some(UrlAuth::UserPassword { password, .. })) => out.push(password.expose().into()),
        Ok(Some(UrlAuth::Token(t))) => out.push(t.expose().into()),
        Ok(None) | Err(_) => {}
    }
    out.retain(|s| !s.is_empty());
    out
}

fn scrub(text: &str, secrets: &[String]) -> String {
    secrets
        .iter()
        .fold(text.to_owned(), |t, s| t.replace(s.as_str(), REDACTED))
}

/// Reads a user nkey seed from `path`; the error never contains the file's content.
fn read_seed(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read nats.nkey_seed_file {}: {e}", path.display()))?;
    let seed = text.trim();
    if !seed.starts_with("SU") {
        return Err(format!(
            "nats.nkey_seed_file {} does not hold a user nkey seed (one line, `SU…`)",
            path.display()
        ));
    }
    Ok(seed.to_owned())
}

fn readable(field: &str, path: &Path) -> Result<(), String> {
    std::fs::File::open(path)
        .map(drop)
        .map_err(|e| format!("cannot read {field} {}: {e}", path.display()))
}

/// Options for connecting as `config` says: name `kedge-<worker_id>`, the authentication method,
/// TLS (CA, client certificate, required), the inbox prefix and a 5 s connection timeout (the
/// client logs connection events itself). Reads the creds and nkey seed files; checks that the
/// TLS files are readable. The URLs are not part of the options: [`connect_client`] passes them,
/// stripped of their user info (which this applies).
pub fn connect_options(config: &Config) -> Result<ConnectOptions, RuntimeError> {
    let n = &config.nats;
    n.check(&config.nats_urls)?;
    let setup = |reason: String| RuntimeError::Connect {
        urls: redact_urls(&config.nats_urls),
        kind: ConnectFailure::Setup,
        reason,
    };
    let mut options = ConnectOptions::new()
        .name(format!("kedge-{}", config.worker_id))
        .connection_timeout(Duration::from_secs(5))
        .custom_inbox_prefix(&n.inbox_prefix);
    if let Some(path) = &n.creds_file {
        let creds = std::fs::read_to_string(path).map_err(|e| {
            setup(format!(
                "cannot read nats.creds_file {}: {e}",
                path.display()
            ))
        })?;
        options = options
            .credentials(&creds)
            .map_err(|e| setup(format!("nats.creds_file {}: {e}", path.display())))?;
    }
    if let Some(path) = &n.nkey_seed_file {
        options = options.nkey(read_seed(path).map_err(setup)?);
    }
    if let (Some(user), Some(password)) = (&n.user, &n.password) {
        options = options.user_and_password(user.clone(), password.expose().to_owned());
    }
    if let Some(token) = &n.token {
        options = options.token(token.expose().to_owned());
    }
    match url_auth(&config.nats_urls).map_err(setup)? {
        Some(UrlAuth::UserPassword { user, password }) => {
            options = options.user_and_password(user, password.expose().to_owned());
        }
        Some(UrlAuth::Token(token)) => options = options.token(token.expose().to_owned()),
        None => {}
    }
    if let Some(ca) = &n.tls_ca {
        readable("nats.tls_ca", ca).map_err(setup)?;
        options = options.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&n.tls_cert, &n.tls_key) {
        readable("nats.tls_cert", cert).map_err(setup)?;
        readable("nats.tls_key", key).map_err(setup)?;
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    if n.requires_tls() {
        options = options.require_tls(true);
    }
    Ok(options)
}

/// Whether a TLS error (an untrusted certificate, a handshake alert) is behind `e`: the client
/// reports those as I/O errors.
fn is_tls_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    use async_nats::rustls;
    let mut next = Some(e);
    while let Some(err) = next {
        let inner_is_tls = err
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
            .is_some_and(|inner| inner.is::<rustls::Error>());
        if err.is::<rustls::Error>() || inner_is_tls {
            return true;
        }
        next = err.source();
    }
    false
}

fn classify(e: &async_nats::ConnectError) -> ConnectFailure {
    if is_tls_failure(e) {
        return ConnectFailure::Tls;
    }
    match e.kind() {
        ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
            ConnectFailure::Refused
        }
        ConnectErrorKind::Tls => ConnectFailure::Tls,
        ConnectErrorKind::ServerParse => ConnectFailure::Setup,
        ConnectErrorKind::Dns
        | ConnectErrorKind::TimedOut
        | ConnectErrorKind::Io
        | ConnectErrorKind::MaxReconnects => ConnectFailure::Unreachable,
    }
}

/// Connects to `config.nats_urls` with [`connect_options`]: what every Kedge process (services
/// through [`crate::Runtime::connect`], CLI commands that need no runtime) uses. An unreachable
/// server is retried (100 ms doubling to 2 s, each attempt logged) until `nats.connect_wait_ms`
/// has passed; a refusal, a TLS failure or a bad setting is returned at once. After the first
/// connection the client reconnects by itself.
pub async fn connect_client(config: &Config) -> Result<async_nats::Client, RuntimeError> {
    config.check()?;
    let urls = redact_urls(&config.nats_urls);
    let failed = |kind, reason: String| RuntimeError::Connect {
        urls: urls.clone(),
        kind,
        reason,
    };
    let addrs = config
        .nats_urls
        .iter()
        .map(|url| {
            strip_userinfo(url).parse::<ServerAddr>().map_err(|e| {
                failed(
                    ConnectFailure::Setup,
                    format!("`{}` is not a NATS URL: {e}", redact_url(url)),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let secrets = secrets(config);
    let deadline = Instant::now() + Duration::from_millis(config.nats.connect_wait_ms);
    let mut delay = Duration::from_millis(100);
    loop {
        match connect_options(config)?.connect(addrs.clone()).await {
            Ok(client) => {
                if !client.server_info().auth_required {
                    tracing::warn!(
                        urls = %urls,
                        "DEVELOPMENT MODE: this NATS server asks for no credentials, so anyone who \
                         can reach it can act as every Kedge service and every tenant (forge \
                         decisions, read and purge the journal). Run the secured configuration \
                         (`kedge nats-config`, docs/SECURITY.md) anywhere else"
                    );
                }
                tracing::debug!(
                    urls = %urls,
                    server = %client.server_info().server_name,
                    inbox_prefix = %config.inbox_prefix(),
                    "connected to NATS"
                );
                return Ok(client);
            }
            Err(e) => {
                let kind = classify(&e);
                let reason = scrub(&e.to_string(), &secrets);
                if kind != ConnectFailure::Unreachable || Instant::now() + delay > deadline {
                    return Err(failed(kind, reason));
                }
                tracing::warn!(
                    urls = %urls,
                    reason = %reason,
                    retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                    "cannot reach NATS yet; retrying"
                );
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Whether a secret sent over this connection (an approver token in a header) is safe from the
/// network: TLS is required, or every server is on this host (loopback).
pub fn protects_secrets(config: &Config) -> bool {
    let n = &config.nats;
    if n.tls_required || n.tls_ca.is_some() || n.tls_cert.is_some() {
        return true;
    }
    config.nats_urls.iter().all(|url| {
        let rest = strip_userinfo(url);
        if rest.starts_with("tls://") {
            return true;
        }
        let hostport = rest.split_once("://").map_or(rest.as_str(), |(_, r)| r);
        let hostport = hostport.split('/').next().unwrap_or_default();
        let host = match hostport.strip_prefix('[') {
            Some(v6) => v6.split(']').next().unwrap_or_default(),
            None => hostport.rsplit_once(':').map_or(hostport, |(h, _)| h),
        };
        host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_travel_only_over_tls_or_loopback() {
        let with = |urls: &[&str]| Config {
            nats_urls: urls.iter().map(|u| (*u).to_owned()).collect(),
            ..Config::default()
        };
        for ok in [
            &["nats://127.0.0.1:4222"][..],
            &["nats://localhost:4222", "nats://[::1]:4223"],
            &["tls://nats.example.com:4222"],
            &["nats://127.0.0.2"],
        ] {
            assert!(protects_secrets(&with(ok)), "{ok:?}");
        }
        for bad in [
            &["nats://nats.example.com:4222"][..],
            &["nats://127.0.0.1:4222", "nats://10.0.0.5:4222"],
            &["nats://u:p@192.0.2.1:4222"],
        ] {
            assert!(!protects_secrets(&with(bad)), "{bad:?}");
        }
        let mut c = with(&["nats://nats.example.com:4222"]);
        c.nats.tls_required = true;
        assert!(protects_secrets(&c));
    }

    #[test]
    fn user_info_is_redacted_and_everything_else_kept() {
        assert_eq!(
            redact_url("nats://alice:s3cret@nats.example:4222"),
            "nats://<redacted>@nats.example:4222"
        );
        assert_eq!(
            redact_url("tls://t0ken@10.0.0.1:4222/path?x=a@b"),
            "tls://<redacted>@10.0.0.1:4222/path?x=a@b"
        );
        assert_eq!(redact_url("bob:pw@host:4222"), "<redacted>@host:4222");
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        // The last `@` of the authority ends the user info: a password may contain `@`.
        assert_eq!(redact_url("nats://u:p@ss@h:1"), "nats://<redacted>@h:1");
        assert_eq!(
            redact_urls(&["nats://u:p@a:1".into(), "nats://b:2".into()]),
            "nats://<redacted>@a:1,nats://b:2"
        );
        assert_eq!(strip_userinfo("nats://u:p@a:1/x"), "nats://a:1/x");
        assert_eq!(strip_userinfo("a:1"), "a:1");
    }

    #[test]
    fn url_user_info_becomes_credentials() {
        let urls = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(url_auth(&urls(&["nats://a:1", "b:2"])), Ok(None));
        assert_eq!(
            url_auth(&urls(&["nats://al%40ce:p%3Aw%zz@a:1", "nats://b:2"])),
            Ok(Some(UrlAuth::UserPassword {
                user: "al@ce".into(),
                password: Secret::new("p:w%zz"),
            }))
        );
        assert_eq!(
            url_auth(&urls(&["nats://tok@a:1", "nats://tok@b:1"])),
            Ok(Some(UrlAuth::Token(Secret::new("tok"))))
        );
        let err = url_auth(&urls(&["nats://u:one@a:1", "nats://u:two@b:1"])).expect_err("differ");
        assert!(!err.contains("one") && !err.contains("two"), "{err}");
    }

    #[test]
    fn a_seed_file_is_read_trimmed_and_never_echoed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let good = dir.path().join("good.nk");
        let seed = "SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU";
        std::fs::write(&good, format!("{seed}\n")).expect("write");
        assert_eq!(read_seed(&good).as_deref(), Ok(seed));
        let bad = dir.path().join("bad.nk");
        std::fs::write(&bad, "not-a-seed-but-secret").expect("write");
        let err = read_seed(&bad).expect_err("not a seed");
        assert!(!err.contains("not-a-seed-but-secret"), "{err}");
        assert!(read_seed(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn options_refuse_unreadable_files_naming_the_field() {
        let mut config = Config::default();
        config.nats.tls_ca = Some("/nonexistent/ca.pem".into());
        let err = connect_options(&config).expect_err("unreadable CA");
        assert!(
            matches!(
                err,
                RuntimeError::Connect {
                    kind: ConnectFailure::Setup,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("nats.tls_ca"), "{err}");
        let mut config = Config::default();
        config.nats.creds_file = Some("/nonexistent/user.creds".into());
        let err = connect_options(&config).expect_err("unreadable creds");
        assert!(err.to_string().contains("nats.creds_file"), "{err}");
    }

    #[test]
    fn errors_are_scrubbed_of_secrets() {
        let mut config = Config {
            nats_urls: vec!["nats://u:url-pass@h:1".into()],
            ..Config::default()
        };
        let s = secrets(&config);
        assert_eq!(
            scrub("failed for u:url-pass at h", &s),
            "failed for u:<redacted> at h"
        );
        config.nats_urls = vec!["nats://h:1".into()];
        config.nats.token = Some(Secret::new("tok-123"));
        assert_eq!(scrub("bad tok-123", &secrets(&config)), "bad <redacted>");
    }
}
