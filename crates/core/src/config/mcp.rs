//! How to reach one MCP server ([`ServerConfig`]), and its JSON form: plain data, read by the
//! configuration (`mcp_servers`, docs/CONFIG.md "MCP servers (`mcp_servers`)") and used by the MCP
//! client, `kedge_mcp`, which re-exports it.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

/// How to reach one MCP server.
///
/// A server is either a child process that speaks MCP on its stdin/stdout, or a Streamable HTTP
/// endpoint. The JSON form is a flat object, told apart by which key is present:
///
/// ```json
/// {"command": "mcp-server-time", "args": ["--local-timezone", "UTC"], "env": {"TZ": "UTC"}}
/// {"url": "http://127.0.0.1:3001/mcp"}
/// ```
///
/// `args`, `env` and `sandbox` are optional (default: none). Unknown keys are rejected, and so is
/// an object with both `command` and `url`, or with `args`/`env`/`sandbox` next to `url`, so a typo
/// in a configuration
/// file is an error at startup rather than a silently ignored setting. A configuration file
/// typically holds a map of them, `{"time": {"command": …}, "search": {"url": …}}`, which
/// deserializes straight into the `BTreeMap` that `kedge_mcp::Pool::new` takes.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawServerConfig", into = "RawServerConfig")]
pub enum ServerConfig {
    /// A child process speaking newline-delimited JSON-RPC on stdin/stdout.
    ///
    /// The child gets a cleared environment: `PATH` (to find its interpreter) and `env`, nothing
    /// else of this process's (API keys, NATS credentials stay here). Its stderr is
    /// forwarded to `tracing` (target `kedge_mcp::stderr`, level debug). It runs in a process
    /// group of its own, so that ending it also ends whatever it started (`npx`, `uvx`, shell
    /// wrappers).
    ///
    /// With `sandbox` ([`StdioSandbox`]) the child is confined: it is started by the pool's
    /// `Launcher` (`kedge_mcp::Launcher`), which must be a sandboxing one (the tool service's);
    /// `kedge_mcp::Pool::new` refuses to start such a server.
    Stdio {
        /// Program to run; looked up on `PATH` when it has no slash.
        command: String,
        /// Arguments, not interpreted by a shell.
        args: Vec<String>,
        /// Extra environment variables for the child.
        env: BTreeMap<String, String>,
        /// Confine the child (`"sandbox": {…}`); `None`: it runs as the pool's own user and sees
        /// the whole machine.
        sandbox: Option<StdioSandbox>,
    },
    /// A Streamable HTTP endpoint, e.g. `http://127.0.0.1:3001/mcp`.
    Http {
        /// The endpoint URL (`http://` or `https://`).
        url: String,
    },
}

impl ServerConfig {
    /// A stdio server with no extra environment.
    pub fn stdio(
        command: impl Into<String>,
        args: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Self::Stdio {
            command: command.into(),
            args: args.into_iter().map(Into::into).collect(),
            env: BTreeMap::new(),
            sandbox: None,
        }
    }

    /// A Streamable HTTP server.
    pub fn http(url: impl Into<String>) -> Self {
        Self::Http { url: url.into() }
    }
}

/// `env` values may hold secrets: Debug prints only their names.
impl fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Stdio {
                command,
                args,
                env,
                sandbox,
            } => f
                .debug_struct("Stdio")
                .field("command", command)
                .field("args", args)
                .field("env", &env.keys().collect::<Vec<_>>())
                .field("sandbox", sandbox)
                .finish(),
            Self::Http { url } => f.debug_struct("Http").field("url", url).finish(),
        }
    }
}

/// How a stdio server is confined (`"sandbox"` in its configuration):
///
/// ```json
/// {"command": "/usr/bin/node", "args": ["/srv/mcp/server.js"],
///  "sandbox": {"network": false, "read_only": ["/srv/mcp/server.js"]}}
/// ```
///
/// What confining means is the pool's `Launcher`'s (`kedge_mcp::Launcher`) business; the tool service's
/// (bubblewrap) gives the server a private, writable directory of its own as its whole writable
/// file system, read-only `/usr` and the system libraries, the `read_only` paths (read-only, at
/// the same place), no network unless `network`, and resource limits.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StdioSandbox {
    /// The server shares the host's network (default: none at all).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub network: bool,
    /// Host files and directories the server may read (and run): absolute, without `..`, not
    /// `/`. Its program must be under `/usr` or one of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub read_only: Vec<PathBuf>,
}

impl StdioSandbox {
    /// Checks the paths; the error names the field.
    pub fn check(&self) -> Result<(), String> {
        for (i, path) in self.read_only.iter().enumerate() {
            let bad = |why: &str| Err(format!("\"sandbox.read_only[{i}]\" {path:?}: {why}"));
            if !path.is_absolute() {
                return bad("must be an absolute path");
            }
            if path.components().any(|c| c == Component::ParentDir) {
                return bad("must not contain `..`");
            }
            if path.as_os_str().as_encoded_bytes().contains(&0) {
                return bad("must not contain a NUL byte");
            }
            if path.components().all(|c| c == Component::RootDir) {
                return bad("`/` would expose the whole file system");
            }
        }
        Ok(())
    }
}

/// The flat JSON object, before it is checked to be exactly one of the two forms.
#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServerConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    command: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    args: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    env: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sandbox: Option<StdioSandbox>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    url: Option<String>,
}

impl TryFrom<RawServerConfig> for ServerConfig {
    type Error = String;

    fn try_from(raw: RawServerConfig) -> Result<Self, Self::Error> {
        match (raw.command, raw.url) {
            (Some(_), Some(_)) => {
                Err("an MCP server has either \"command\" or \"url\", not both".into())
            }
            (None, None) => {
                Err("an MCP server needs \"command\" (stdio) or \"url\" (Streamable HTTP)".into())
            }
            (Some(command), None) => {
                if command.trim().is_empty() {
                    return Err("\"command\" is empty".into());
                }
                if let Some(sandbox) = &raw.sandbox {
                    sandbox.check()?;
                    if command.contains('/') && !Path::new(&command).is_absolute() {
                        return Err(format!(
                            "\"command\" of a sandboxed server must be an absolute path or a \
                             program name (looked up on PATH), got {command:?}"
                        ));
                    }
                }
                Ok(Self::Stdio {
                    command,
                    args: raw.args.unwrap_or_default(),
                    env: raw.env.unwrap_or_default(),
                    sandbox: raw.sandbox,
                })
            }
            (None, Some(url)) => {
                if raw.args.is_some() || raw.env.is_some() || raw.sandbox.is_some() {
                    return Err("\"args\", \"env\" and \"sandbox\" apply only to a \"command\" server, not to a \"url\" one".into());
                }
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(format!(
                        "\"url\" must start with http:// or https://, got {url:?}"
                    ));
                }
                Ok(Self::Http { url })
            }
        }
    }
}

impl From<ServerConfig> for RawServerConfig {
    fn from(config: ServerConfig) -> Self {
        match config {
            ServerConfig::Stdio {
                command,
                args,
                env,
                sandbox,
            } => Self {
                command: Some(command),
                args: (!args.is_empty()).then_some(args),
                env: (!env.is_empty()).then_some(env),
                sandbox,
                url: None,
            },
            ServerConfig::Http { url } => Self {
                url: Some(url),
                ..Self::default()
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(value: serde_json::Value) -> Result<ServerConfig, String> {
        serde_json::from_value(value).map_err(|e| e.to_string())
    }

    #[test]
    fn stdio_form_with_defaults() {
        assert_eq!(
            parse(json!({"command": "mcp-server-time"})),
            Ok(ServerConfig::stdio("mcp-server-time", Vec::<String>::new()))
        );
        let full = parse(json!({"command": "x", "args": ["a", "b"], "env": {"K": "V"}}));
        assert_eq!(
            full,
            Ok(ServerConfig::Stdio {
                command: "x".into(),
                args: vec!["a".into(), "b".into()],
                env: BTreeMap::from([("K".to_string(), "V".to_string())]),
                sandbox: None,
            })
        );
    }

    #[test]
    fn sandbox_option() {
        let parsed = parse(json!({"command": "/usr/bin/node", "args": ["/srv/s.js"],
            "sandbox": {"network": true, "read_only": ["/srv/s.js", "/opt/node/"]}}));
        let Ok(ServerConfig::Stdio { sandbox, .. }) = parsed else {
            panic!("{parsed:?}")
        };
        assert_eq!(
            sandbox,
            Some(StdioSandbox {
                network: true,
                read_only: vec!["/srv/s.js".into(), "/opt/node/".into()],
            })
        );
        // An empty object: confined, no network, nothing more to read.
        let parsed = parse(json!({"command": "node", "sandbox": {}}));
        assert!(
            matches!(&parsed, Ok(ServerConfig::Stdio { sandbox: Some(s), .. }) if *s == StdioSandbox::default()),
            "{parsed:?}"
        );
        // Absent: not sandboxed, as before.
        let parsed = parse(json!({"command": "node"}));
        assert!(
            matches!(&parsed, Ok(ServerConfig::Stdio { sandbox: None, .. })),
            "{parsed:?}"
        );
    }

    #[test]
    fn sandbox_paths_are_checked_where_parsed() {
        for (value, needle) in [
            (
                json!({"command": "x", "sandbox": {"read_only": ["/ok", "rel/path"]}}),
                "\"sandbox.read_only[1]\" \"rel/path\": must be an absolute path",
            ),
            (
                json!({"command": "x", "sandbox": {"read_only": ["/srv/../etc"]}}),
                "\"sandbox.read_only[0]\" \"/srv/../etc\": must not contain `..`",
            ),
            (
                json!({"command": "x", "sandbox": {"read_only": ["/"]}}),
                "\"sandbox.read_only[0]\" \"/\": `/` would expose",
            ),
            (
                json!({"command": "x", "sandbox": {"read_only": [""]}}),
                "must be an absolute path",
            ),
            (
                json!({"command": "x", "sandbox": {"net": true}}),
                "unknown field `net`",
            ),
            (
                json!({"command": "./bin/server", "sandbox": {}}),
                "absolute path or a program name",
            ),
            (
                json!({"url": "http://a", "sandbox": {}}),
                "only to a \"command\"",
            ),
        ] {
            let err = parse(value.clone()).expect_err(&value.to_string());
            assert!(err.contains(needle), "{value}: {err}");
        }
        // Unsandboxed, a relative command is still fine (run from the service's directory).
        assert!(parse(json!({"command": "./bin/server"})).is_ok());
    }

    #[test]
    fn http_form() {
        assert_eq!(
            parse(json!({"url": "http://127.0.0.1:1/mcp"})),
            Ok(ServerConfig::http("http://127.0.0.1:1/mcp"))
        );
    }

    #[test]
    fn rejects_ambiguous_and_unknown() {
        for (value, needle) in [
            (json!({"command": "x", "url": "http://a"}), "not both"),
            (json!({}), "needs"),
            (json!({"command": "x", "arg": []}), "unknown field `arg`"),
            (
                json!({"url": "http://a", "env": {}}),
                "only to a \"command\"",
            ),
            (json!({"url": "ftp://a"}), "must start with"),
            (json!({"command": " "}), "empty"),
        ] {
            let err = parse(value.clone()).expect_err(&value.to_string());
            assert!(err.contains(needle), "{value}: {err}");
        }
    }

    #[test]
    fn round_trips_in_the_flat_form() {
        let stdio = ServerConfig::stdio("x", ["--y"]);
        assert_eq!(
            serde_json::to_value(&stdio).ok(),
            Some(json!({"command": "x", "args": ["--y"]}))
        );
        let boxed = json!({"command": "x", "sandbox": {"read_only": ["/srv"]}});
        assert_eq!(
            parse(boxed.clone())
                .ok()
                .and_then(|c| serde_json::to_value(c).ok()),
            Some(boxed)
        );
        let networked = json!({"command": "x", "sandbox": {"network": true}});
        assert_eq!(
            parse(networked.clone())
                .ok()
                .and_then(|c| serde_json::to_value(c).ok()),
            Some(networked)
        );
        let http = ServerConfig::http("https://h/mcp");
        assert_eq!(
            serde_json::to_value(&http).ok(),
            Some(json!({"url": "https://h/mcp"}))
        );
    }

    #[test]
    fn debug_hides_env_values() {
        let config = ServerConfig::Stdio {
            command: "x".into(),
            args: vec![],
            env: BTreeMap::from([("TOKEN".to_string(), "secret".to_string())]),
            sandbox: None,
        };
        let shown = format!("{config:?}");
        assert!(
            shown.contains("TOKEN") && !shown.contains("secret"),
            "{shown}"
        );
    }
}
