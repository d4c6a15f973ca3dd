//! The layers that set connection settings besides the file and the `KEDGE_*` variables: a `nats`
//! CLI context (`--context`, `NATS_CONTEXT`), command-line flags ([`Flags`]), and the `nats` CLI's
//! own variables (`NATS_URL`, `NATS_CREDS`, …), which fill in only what nothing else set.
//! docs/CONFIG.md "Connecting to NATS".

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::env::{non_empty, split_urls};
use super::{Config, ConfigError, Secret};
use crate::connect::url_auth;

/// The values of command-line flags: the highest layer of [`Config::load_layered`]. The binary
/// fills it from its global flags.
#[derive(Debug, Clone, Default)]
pub struct Flags {
    /// `--nats-url`, comma-separated.
    pub nats_url: Option<String>,
    /// `--context NAME`: a `nats` CLI context (else `NATS_CONTEXT`).
    pub context: Option<String>,
    pub creds: Option<PathBuf>,
    pub nkey: Option<PathBuf>,
    pub user: Option<String>,
    pub password: Option<Secret>,
    pub token: Option<Secret>,
    pub tls_ca: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
}

/// A `nats` CLI context (`<config dir>/nats/context/<name>.json`): the keys Kedge uses; the others
/// (`description`, `jetstream_domain`, …) are ignored. Empty strings mean unset, as the `nats` CLI
/// writes every key.
#[derive(Default, Deserialize)]
#[serde(default)]
struct NatsContext {
    url: Option<String>,
    user: Option<String>,
    password: Option<String>,
    token: Option<String>,
    creds: Option<String>,
    nkey: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    ca: Option<String>,
    inbox_prefix: Option<String>,
}

/// `$XDG_CONFIG_HOME/nats/context/<name>.json`, else `$HOME/.config/nats/context/<name>.json`.
pub fn context_path(
    name: &str,
    env: impl Fn(&'static str) -> Option<String>,
) -> Result<PathBuf, ConfigError> {
    let bad = |reason: &str| ConfigError::Context {
        name: name.to_owned(),
        path: PathBuf::new(),
        reason: reason.to_owned(),
    };
    if name.is_empty()
        || name.starts_with('.')
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@'))
    {
        return Err(bad(
            "a context name is letters, digits and `-_.@`, not starting with `.`",
        ));
    }
    let base = match non_empty(env("XDG_CONFIG_HOME")) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(
            non_empty(env("HOME")).ok_or_else(|| bad("neither XDG_CONFIG_HOME nor HOME is set"))?,
        )
        .join(".config"),
    };
    Ok(base
        .join("nats")
        .join("context")
        .join(format!("{name}.json")))
}

/// `~/x` → `$HOME/x` (the `nats` CLI writes paths so).
fn expand_home(path: String, home: Option<&str>) -> PathBuf {
    match (path.strip_prefix("~/"), home) {
        (Some(rest), Some(home)) => Path::new(home).join(rest),
        _ => PathBuf::from(path),
    }
}

impl Config {
    /// Reads the context `name` and sets the fields it gives; returns whether it gave a URL.
    pub(super) fn apply_context(
        &mut self,
        name: &str,
        env: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<bool, ConfigError> {
        let path = context_path(name, env)?;
        let failed = |reason: String| ConfigError::Context {
            name: name.to_owned(),
            path: path.clone(),
            reason,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| failed(e.to_string()))?;
        let ctx: NatsContext = serde_json::from_str(&text).map_err(|e| failed(e.to_string()))?;
        let home = non_empty(env("HOME"));
        let file = |v: Option<String>| non_empty(v).map(|p| expand_home(p, home.as_deref()));
        let n = &mut self.nats;
        let url = non_empty(ctx.url).map(|u| split_urls(&u));
        let gave_url = url.is_some();
        if let Some(urls) = url {
            self.nats_urls = urls;
        }
        if let Some(v) = file(ctx.creds) {
            n.creds_file = Some(v);
        }
        if let Some(v) = file(ctx.nkey) {
            n.nkey_seed_file = Some(v);
        }
        match (non_empty(ctx.user), non_empty(ctx.password)) {
            (Some(user), Some(password)) => {
                n.user = Some(user);
                n.password = Some(Secret(password));
            }
            // The `nats` CLI's `user` is a token when it has no password.
            (Some(token), None) => n.token = Some(Secret(token)),
            (None, Some(_)) => {
                return Err(failed("`password` is set without `user`".into()));
            }
            (None, None) => {}
        }
        if let Some(v) = non_empty(ctx.token) {
            n.token = Some(Secret(v));
        }
        if let Some(v) = file(ctx.ca) {
            n.tls_ca = Some(v);
        }
        if let Some(v) = file(ctx.cert) {
            n.tls_cert = Some(v);
        }
        if let Some(v) = file(ctx.key) {
            n.tls_key = Some(v);
        }
        if let Some(v) = non_empty(ctx.inbox_prefix) {
            n.inbox_prefix = v;
        }
        Ok(gave_url)
    }

    /// Sets what the flags give.
    pub(super) fn apply_flags(&mut self, flags: &Flags) {
        if let Some(urls) = &flags.nats_url {
            self.nats_urls = split_urls(urls);
        }
        let n = &mut self.nats;
        let set = |field: &mut Option<PathBuf>, v: &Option<PathBuf>| {
            if v.is_some() {
                field.clone_from(v);
            }
        };
        set(&mut n.creds_file, &flags.creds);
        set(&mut n.nkey_seed_file, &flags.nkey);
        set(&mut n.tls_ca, &flags.tls_ca);
        set(&mut n.tls_cert, &flags.tls_cert);
        set(&mut n.tls_key, &flags.tls_key);
        if flags.user.is_some() {
            n.user.clone_from(&flags.user);
        }
        if flags.password.is_some() {
            n.password.clone_from(&flags.password);
        }
        if flags.token.is_some() {
            n.token.clone_from(&flags.token);
        }
    }

    /// The `nats` CLI's variables, for what no other source set: `NATS_URL` when no URL was
    /// given; `NATS_CREDS`, `NATS_NKEY`, `NATS_USER` (+ `NATS_PASSWORD`; without one it is a
    /// token, as in the `nats` CLI) when no authentication method is set.
    pub(super) fn apply_nats_fallbacks(
        &mut self,
        url_given: bool,
        env: &impl Fn(&'static str) -> Option<String>,
    ) {
        if !url_given && let Some(v) = non_empty(env("NATS_URL")) {
            self.nats_urls = split_urls(&v);
        }
        let url_auth = matches!(url_auth(&self.nats_urls), Ok(Some(_)) | Err(_));
        if !self.nats.auth_methods().is_empty() || url_auth {
            return;
        }
        let home = non_empty(env("HOME"));
        let n = &mut self.nats;
        n.creds_file = non_empty(env("NATS_CREDS")).map(|p| expand_home(p, home.as_deref()));
        n.nkey_seed_file = non_empty(env("NATS_NKEY")).map(|p| expand_home(p, home.as_deref()));
        match (non_empty(env("NATS_USER")), non_empty(env("NATS_PASSWORD"))) {
            (Some(user), Some(password)) => {
                n.user = Some(user);
                n.password = Some(Secret(password));
            }
            (Some(token), None) => n.token = Some(Secret(token)),
            // A stray NATS_PASSWORD alone is ignored, as by the `nats` CLI.
            (None, _) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DEFAULT_NATS_URL;
    use crate::config::tests::{env_of, write};

    /// A temp dir with a config file, an XDG config dir holding the context `ctx`, and a HOME.
    struct Layers {
        dir: tempfile::TempDir,
    }

    impl Layers {
        fn new() -> Layers {
            let layers = Layers {
                dir: tempfile::tempdir().expect("tempdir"),
            };
            write(
                &layers.file(),
                r#"{"nats_urls": ["nats://file:4222"],
                    "nats": {"tls_ca": "/file/ca.pem", "tls_cert": "/file/c.pem",
                             "tls_key": "/file/k.pem", "inbox_prefix": "_FILE"}}"#,
            );
            write(
                &layers.xdg().join("nats/context/ctx.json"),
                r#"{"description": "unknown keys are ignored", "url": "nats://ctx:4222",
                    "user": "ctx-user", "password": "ctx-pass", "ca": "/ctx/ca.pem",
                    "inbox_prefix": "_CTX", "jetstream_domain": "", "token": "", "creds": ""}"#,
            );
            layers
        }
        fn file(&self) -> PathBuf {
            self.dir.path().join("kedge.json")
        }
        fn xdg(&self) -> PathBuf {
            self.dir.path().join("xdg")
        }
        fn xdg_env(&self) -> (&'static str, String) {
            ("XDG_CONFIG_HOME", self.xdg().display().to_string())
        }
    }

    #[test]
    fn nats_settings_layer_file_then_context_then_env_then_flags() {
        let l = Layers::new();
        let file = l.file();
        let ctx = Flags {
            context: Some("ctx".into()),
            ..Flags::default()
        };
        let env = [
            l.xdg_env(),
            ("KEDGE_NATS_URL", "nats://env:4222".into()),
            ("KEDGE_NATS_TLS_CA", "/env/ca.pem".into()),
            ("KEDGE_NATS_PASSWORD", "env-pass".into()),
        ];

        // File only.
        let c = Config::load_layered(Some(&file), &Flags::default(), env_of(&[])).expect("file");
        assert_eq!(c.nats_urls, vec!["nats://file:4222"]);
        assert_eq!(c.nats.tls_ca.as_deref(), Some(Path::new("/file/ca.pem")));
        assert_eq!(c.inbox_prefix(), "_FILE");
        assert!(c.nats.requires_tls());

        // The context (named by NATS_CONTEXT) over the file, field by field.
        let c = Config::load_layered(
            Some(&file),
            &Flags::default(),
            env_of(&[l.xdg_env(), ("NATS_CONTEXT", "ctx".into())]),
        )
        .expect("context");
        assert_eq!(c.nats_urls, vec!["nats://ctx:4222"]);
        assert_eq!(c.nats.tls_ca.as_deref(), Some(Path::new("/ctx/ca.pem")));
        assert_eq!(c.nats.tls_cert.as_deref(), Some(Path::new("/file/c.pem")));
        assert_eq!(c.nats.user.as_deref(), Some("ctx-user"));
        assert_eq!(c.nats.password, Some(Secret::new("ctx-pass")));
        assert_eq!(c.nats.token, None, "an empty key is unset");
        assert_eq!(c.inbox_prefix(), "_CTX");

        // KEDGE_* over the context (named by --context).
        let c = Config::load_layered(Some(&file), &ctx, env_of(&env)).expect("env");
        assert_eq!(c.nats_urls, vec!["nats://env:4222"]);
        assert_eq!(c.nats.tls_ca.as_deref(), Some(Path::new("/env/ca.pem")));
        assert_eq!(c.nats.user.as_deref(), Some("ctx-user"));
        assert_eq!(c.nats.password, Some(Secret::new("env-pass")));

        // Flags over everything.
        let flags = Flags {
            nats_url: Some("nats://flag-a:1, nats://flag-b:2".into()),
            tls_ca: Some("/flag/ca.pem".into()),
            password: Some(Secret::new("flag-pass")),
            ..ctx.clone()
        };
        let c = Config::load_layered(Some(&file), &flags, env_of(&env)).expect("flags");
        assert_eq!(c.nats_urls, vec!["nats://flag-a:1", "nats://flag-b:2"]);
        assert_eq!(c.nats.tls_ca.as_deref(), Some(Path::new("/flag/ca.pem")));
        assert_eq!(c.nats.password, Some(Secret::new("flag-pass")));
        assert_eq!(c.nats.tls_key.as_deref(), Some(Path::new("/file/k.pem")));
    }

    #[test]
    fn kedge_nats_url_beats_nats_url_which_fills_only_an_unset_url() {
        let l = Layers::new();
        let nats_url = ("NATS_URL", "nats://nats-cli:4222".to_owned());
        let load = |file: Option<&Path>, flags: &Flags, env: &[(&'static str, String)]| {
            Config::load_layered(file, flags, env_of(env))
                .expect("loads")
                .nats_urls
        };
        let none = Flags::default();
        assert_eq!(load(None, &none, &[]), vec![DEFAULT_NATS_URL]);
        assert_eq!(
            load(None, &none, std::slice::from_ref(&nats_url)),
            vec!["nats://nats-cli:4222"]
        );
        assert_eq!(
            load(
                None,
                &none,
                &[
                    nats_url.clone(),
                    ("KEDGE_NATS_URL", "nats://kedge:1".into())
                ]
            ),
            vec!["nats://kedge:1"]
        );
        // A file or a context that gives a URL wins over NATS_URL.
        assert_eq!(
            load(Some(&l.file()), &none, std::slice::from_ref(&nats_url)),
            vec!["nats://file:4222"]
        );
        let ctx = Flags {
            context: Some("ctx".into()),
            ..Flags::default()
        };
        assert_eq!(
            load(None, &ctx, &[nats_url.clone(), l.xdg_env()]),
            vec!["nats://ctx:4222"]
        );
        let flag = Flags {
            nats_url: Some("nats://flag:1".into()),
            ..Flags::default()
        };
        assert_eq!(load(None, &flag, &[nats_url]), vec!["nats://flag:1"]);
    }

    #[test]
    fn nats_cli_credentials_fill_in_only_when_no_method_is_set() {
        let load = |env: &[(&'static str, String)]| {
            Config::load_layered(None, &Flags::default(), env_of(env))
                .expect("loads")
                .nats
        };
        let user = ("NATS_USER", "nu".to_owned());
        let pass = ("NATS_PASSWORD", "np".to_owned());
        let n = load(&[user.clone(), pass.clone()]);
        assert_eq!(
            (n.user.as_deref(), n.password),
            (Some("nu"), Some(Secret::new("np")))
        );
        // As in the `nats` CLI, a user without a password is a token.
        let n = load(std::slice::from_ref(&user));
        assert_eq!((n.user, n.token), (None, Some(Secret::new("nu"))));
        let n = load(&[
            ("NATS_CREDS", "~/u.creds".into()),
            ("HOME", "/home/k".into()),
        ]);
        assert_eq!(n.creds_file.as_deref(), Some(Path::new("/home/k/u.creds")));
        let n = load(&[("NATS_NKEY", "/k/u.nk".into())]);
        assert_eq!(n.nkey_seed_file.as_deref(), Some(Path::new("/k/u.nk")));
        // A Kedge-level method wins: no conflict with the ambient NATS_* variables.
        let n = load(&[user, pass, ("KEDGE_NATS_TOKEN", "kt".into())]);
        assert_eq!((n.user, n.password), (None, None));
        assert_eq!(n.token, Some(Secret::new("kt")));
    }

    #[test]
    fn a_context_is_read_from_xdg_config_home_or_home() {
        let dir = tempfile::tempdir().expect("tempdir");
        let home = dir.path().join("home");
        write(
            &home.join(".config/nats/context/prod.json"),
            r#"{"url": "tls://a:4222,tls://b:4222", "user": "tok-as-user", "creds": "~/p.creds",
                "nkey": "", "color_scheme": "dark", "tls_first": false}"#,
        );
        let env = [
            ("HOME", home.display().to_string()),
            ("NATS_CONTEXT", "prod".to_owned()),
        ];
        // HOME/.config without XDG_CONFIG_HOME; ~ expanded; `user` without password = token,
        // which with `creds` is two methods: refused.
        let err = Config::load_layered(None, &Flags::default(), env_of(&env))
            .expect_err("creds and token");
        assert!(err.to_string().contains("nats.creds_file"), "{err}");
        write(
            &home.join(".config/nats/context/prod.json"),
            r#"{"url": "tls://a:4222,tls://b:4222", "creds": "~/p.creds", "unknown": 1}"#,
        );
        let c = Config::load_layered(None, &Flags::default(), env_of(&env)).expect("loads");
        assert_eq!(c.nats_urls, vec!["tls://a:4222", "tls://b:4222"]);
        assert_eq!(c.nats.creds_file, Some(home.join("p.creds")));

        let flags = Flags {
            context: Some("missing".into()),
            ..Flags::default()
        };
        let err = Config::load_layered(None, &flags, env_of(&env)).expect_err("no such context");
        let text = err.to_string();
        assert!(
            text.contains("`missing`") && text.contains("missing.json"),
            "{text}"
        );
        let flags = Flags {
            context: Some("../prod".into()),
            ..Flags::default()
        };
        assert!(matches!(
            Config::load_layered(None, &flags, env_of(&env)),
            Err(ConfigError::Context { .. })
        ));
        assert_eq!(
            context_path("x", env_of(&[("XDG_CONFIG_HOME", "/xdg".into())])).expect("path"),
            Path::new("/xdg/nats/context/x.json")
        );
    }
}
