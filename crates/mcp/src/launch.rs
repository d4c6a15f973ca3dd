//! How a stdio server's process is made: the [`Launcher`] seam, and [`Direct`], the default.
//!
//! The pool knows nothing about sandboxes: a launcher turns what the configuration says into a
//! [`tokio::process::Command`], and the pool spawns it (stdin/stdout piped, stderr forwarded, as
//! the leader of a new process group). The tool service hands the pool a launcher backed by its
//! own sandbox; a pool built with [`Pool::new`](crate::Pool::new) uses [`Direct`], which refuses a
//! server whose configuration asks for a sandbox rather than start it unconfined.

use std::collections::BTreeMap;
use std::fmt;

use crate::StdioSandbox;

/// Everything the configuration says about starting one stdio server.
#[derive(Clone, Copy)]
pub struct Launch<'a> {
    /// The configured server name (letters, digits and `-` in a Kedge configuration; a launcher
    /// that uses it in a path must still check it).
    pub server: &'a str,
    /// The program: a name looked up on `PATH`, or a path.
    pub command: &'a str,
    /// Its arguments.
    pub args: &'a [String],
    /// The environment the configuration gives it (it gets nothing else but `PATH`).
    pub env: &'a BTreeMap<String, String>,
    /// How to confine it; `None`: not at all.
    pub sandbox: Option<&'a StdioSandbox>,
}

/// `env` values may hold secrets: only their names are printed.
impl fmt::Debug for Launch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Launch")
            .field("server", &self.server)
            .field("command", &self.command)
            .field("args", &self.args)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("sandbox", &self.sandbox)
            .finish()
    }
}

/// Makes the process of a stdio server. An `Err` (a sentence) becomes the pool's
/// [`McpError::Connect`](crate::McpError::Connect) for that server: nothing was started.
///
/// The pool sets the command's stdin, stdout and stderr and makes it a process-group leader;
/// the launcher sets everything else (program, arguments, environment, working directory).
pub trait Launcher: Send + Sync + fmt::Debug {
    /// The command that starts the server described by `launch`.
    fn command(&self, launch: &Launch<'_>) -> Result<tokio::process::Command, String>;
}

/// The default launcher: runs the command as this process's user, with a cleared environment
/// ([`direct_command`]). Refuses a server that asks for a sandbox: only a sandboxing launcher
/// (the tool service's) may start one.
#[derive(Debug, Clone, Copy, Default)]
pub struct Direct;

impl Launcher for Direct {
    fn command(&self, launch: &Launch<'_>) -> Result<tokio::process::Command, String> {
        if launch.sandbox.is_some() {
            return Err(format!(
                "its configuration asks for a sandbox (\"sandbox\"), and this process starts MCP \
                 servers unconfined (no sandboxing launcher was given to the pool; the tool \
                 service's confines them): refusing to start {:?} unconfined",
                launch.command
            ));
        }
        Ok(direct_command(launch))
    }
}

/// The server's command, unconfined: a cleared environment (the caller's own, with its API keys
/// and NATS credentials, is not the server's business) holding `PATH` (to find its interpreter)
/// and what its configuration names.
pub fn direct_command(launch: &Launch<'_>) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(launch.command);
    cmd.env_clear();
    if let Some(path) = std::env::var_os("PATH") {
        cmd.env("PATH", path);
    }
    cmd.args(launch.args).envs(launch.env);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{McpError, Pool, ServerConfig};

    #[test]
    fn direct_refuses_a_sandboxed_server() {
        let env = BTreeMap::new();
        let sandbox = StdioSandbox::default();
        let launch = Launch {
            server: "boxed",
            command: "/usr/bin/true",
            args: &[],
            env: &env,
            sandbox: Some(&sandbox),
        };
        let refused = Direct.command(&launch).expect_err("refused");
        assert!(refused.contains("asks for a sandbox"), "{refused}");
        let unboxed = Launch {
            sandbox: None,
            ..launch
        };
        assert!(Direct.command(&unboxed).is_ok());
    }

    /// `Pool::new` never starts a server that asks for a sandbox: a connect error naming it.
    #[tokio::test]
    async fn the_default_pool_refuses_a_sandboxed_server_by_name() {
        let marker = std::env::temp_dir().join(format!("kedge-mcp-refused-{}", std::process::id()));
        let _ = std::fs::remove_file(&marker);
        let config = ServerConfig::Stdio {
            command: "/usr/bin/touch".into(),
            args: vec![marker.display().to_string()],
            env: BTreeMap::new(),
            sandbox: Some(StdioSandbox::default()),
        };
        let pool = Pool::new(BTreeMap::from([("boxed".to_owned(), config)]));
        match pool.tools("boxed").await {
            Err(error @ McpError::Connect { .. }) => {
                let shown = error.to_string();
                assert!(
                    shown.contains("\"boxed\"") && shown.contains("asks for a sandbox"),
                    "{shown}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(!marker.exists(), "nothing was started");
    }
}
