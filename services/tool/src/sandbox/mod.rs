//! What confines the `shell` tool's commands: the [`Sandbox`] seam, its two implementations, and
//! [`execute`], which runs a command through one with its output capped while it is read.
//!
//! The allowlist of commands is policy; the sandbox is the boundary. Allowlisted programs take
//! options that name files (`grep --file=…`, `sort --files0-from=… -o …`), so no check of the
//! arguments can keep a command inside the workspace; what the command can *see* must.
//!
//! - [`Bubblewrap`] (the default, `sandbox: "bwrap"`): each command runs in a fresh bubblewrap
//!   sandbox: new user, mount, pid, network, ipc, uts and cgroup namespaces (`--unshare-all`), all
//!   capabilities dropped, a new session, a clean environment, killed with its parent. Its file
//!   system holds read-only `/usr` (and the `/bin`, `/lib*` links or binds of the host), the few
//!   harmless files of `/etc` programs load (`ld.so.cache`, `alternatives`, `localtime`), a fresh
//!   `/proc`, a minimal `/dev`, an empty `/tmp`, and the run's workspace read-write at its own
//!   path (so relative paths keep working). Nothing else exists in there: not `/etc/passwd`, not
//!   `/home`, `/root`, the repository or the other runs' workspaces; a symlink pointing out of the
//!   workspace points at nothing. No network interface but a down loopback, unless the agent's
//!   policy grants the tool the network (`policy.shell.network: true`, carried on each
//!   `tool.requested`): then the command shares the host's network namespace (`--share-net`) and
//!   sees `/etc/resolv.conf`, `/etc/hosts` and the CA certificates; nothing else changes. Inside, `prlimit`
//!   (util-linux, in `/usr/bin`) sets the resource limits ([`Limits`]) before the command starts.
//! - [`Unconfined`] (`sandbox: "unconfined"`, development only): the command runs as the tool
//!   service's user in the workspace with a clean environment, and sees the whole machine. It is
//!   chosen explicitly, and logged as a warning at startup and for every command.
//!
//! Why bubblewrap rather than Landlock or seccomp: Landlock restricts file access (and, from ABI
//! 4, TCP) of an unprivileged process, but applying it needs code between `fork` and `exec`
//! (`pre_exec`, which is `unsafe`, which the workspace forbids) or a helper binary, and it neither
//! hides the file system nor isolates pids, ipc or sockets other than TCP. seccomp filters system
//! calls, not paths: it cannot say "only this directory". bubblewrap is a small, audited,
//! packaged (`apt-get install bubblewrap`) setuid-free program that builds exactly the view we
//! want from namespaces, is what Flatpak runs every application in, and costs a few ms per
//! command. Its pid namespace also makes the kill complete: when the command's process group is
//! killed, bubblewrap's init dies and the kernel kills every process left in the namespace,
//! including ones that escaped into a session of their own.
//!
//! Resource limits: CPU seconds, address space, file size and processes (`RLIMIT_NPROC`), set by
//! `prlimit` inside the sandbox (no `pre_exec`, so no `unsafe` in our code). The kernel does not
//! apply `RLIMIT_NPROC` to processes of the real root user, so when the tool service runs as root
//! the process count is bounded only by the pid namespace's lifetime (the timeout, the output
//! cap and cancel kill it all); running the tool service as an ordinary user makes the limit
//! count the processes of that one sandbox (its user namespace has its own count).
//!
//! Killing: every command starts as the leader of a new process group; on timeout, on output
//! over the cap, and when its future is dropped (the run's cancel), the whole group is sent
//! `SIGKILL` before the leader is reaped (so the group id cannot have been reused).
//! Unconfined, descendants that left the group survive; in the sandbox they die with it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kedge_runtime::config::SandboxKind;

mod bwrap;
mod execute;
mod mcp;
#[cfg(test)]
mod tests;

pub use bwrap::Bubblewrap;
pub use execute::{Ended, Finished, execute};
pub use mcp::{McpLauncher, mcp_pool, mcp_pool_in};

/// The `PATH` commands see.
const PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Resource limits of one command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// CPU time, in seconds (`RLIMIT_CPU`); `None`: not limited (a long-lived MCP server,
    /// whose CPU time adds up over many calls).
    pub cpu_secs: Option<u64>,
    /// Address space, in bytes (`RLIMIT_AS`).
    pub address_space_bytes: u64,
    /// Largest file it may write, in bytes (`RLIMIT_FSIZE`).
    pub file_size_bytes: u64,
    /// Processes (`RLIMIT_NPROC`; see the module doc for root).
    pub processes: u64,
    /// The host's network is shared with the command (the tool's policy grants it); otherwise
    /// it has none.
    pub network: bool,
}

impl Limits {
    /// The limits of a command that may run for `timeout`: CPU time just above it (the wall
    /// clock kills it first), 1 GiB of address space, 64 MiB files, 64 processes.
    pub fn for_timeout(timeout: Duration) -> Limits {
        Limits {
            cpu_secs: Some(timeout.as_secs().saturating_add(1)),
            address_space_bytes: 1 << 30,
            file_size_bytes: 64 << 20,
            processes: 64,
            network: false,
        }
    }

    /// The limits of a long-lived MCP server: those of a command, without a CPU-time limit,
    /// with the network only if `network`.
    pub fn for_server(network: bool) -> Limits {
        Limits {
            cpu_secs: None,
            network,
            ..Limits::for_timeout(Duration::ZERO)
        }
    }
}

/// What a long-lived program (an MCP server) needs beyond a shell command: more of the host to
/// read, and an environment.
#[derive(Debug, Clone, Copy)]
pub struct Extra<'a> {
    /// Host paths (absolute, existing) shown read-only at the same place.
    pub read_only: &'a [PathBuf],
    /// Environment variables set inside (after, so over, the sandbox's own `PATH`, `HOME`,
    /// `TMPDIR`).
    pub env: &'a BTreeMap<String, String>,
}

static NO_ENV: BTreeMap<String, String> = BTreeMap::new();

impl Extra<'_> {
    /// Nothing extra: a shell command.
    pub const NONE: Extra<'static> = Extra {
        read_only: &[],
        env: &NO_ENV,
    };
}

/// `inner`, with the network shared with every command: the sandbox of a tool whose policy
/// grants it the network ([`Limits::network`]).
#[derive(Debug, Clone)]
pub struct WithNetwork(pub Arc<dyn Sandbox>);

impl Sandbox for WithNetwork {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn confines(&self) -> bool {
        self.0.confines()
    }

    fn command_with(
        &self,
        program: &str,
        args: &[String],
        workspace: &Path,
        limits: &Limits,
        extra: &Extra<'_>,
    ) -> tokio::process::Command {
        let limits = Limits {
            network: true,
            ..*limits
        };
        self.0
            .command_with(program, args, workspace, &limits, extra)
    }
}

/// Why a sandbox cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(
        "sandbox `bwrap`: {0}; install bubblewrap (scripts/setup.sh, or `apt-get install \
         bubblewrap`) or set sandbox \"unconfined\" (KEDGE_SANDBOX=unconfined) for development"
    )]
    Unavailable(String),
}

/// A way to confine a command to a run's workspace.
pub trait Sandbox: Send + Sync + std::fmt::Debug {
    /// `bwrap`, `unconfined`.
    fn name(&self) -> &'static str;
    /// Whether commands are confined (false: development only).
    fn confines(&self) -> bool;
    /// The command that runs `program` with `args` in `workspace` (an absolute path that exists)
    /// under `limits`, with `extra` paths to read and environment. The caller sets its stdio
    /// and process group ([`execute`] for a shell command, the MCP pool for a server).
    fn command_with(
        &self,
        program: &str,
        args: &[String],
        workspace: &Path,
        limits: &Limits,
        extra: &Extra<'_>,
    ) -> tokio::process::Command;

    /// [`Sandbox::command_with`] with nothing extra: a shell command. [`execute`] sets its
    /// stdio, process group and kill-on-drop.
    fn command(
        &self,
        program: &str,
        args: &[String],
        workspace: &Path,
        limits: &Limits,
    ) -> tokio::process::Command {
        self.command_with(program, args, workspace, limits, &Extra::NONE)
    }
}

/// The sandbox a configuration asks for: bubblewrap after checking that it works here (an error
/// when it does not: the tool service then refuses to start), or the unconfined one, with a
/// warning.
pub async fn from_config(kind: SandboxKind) -> Result<Arc<dyn Sandbox>, SandboxError> {
    match kind {
        SandboxKind::Bwrap => Ok(Arc::new(Bubblewrap::probe().await?)),
        SandboxKind::Unconfined => {
            tracing::warn!(
                "sandbox \"unconfined\": shell commands run with the tool service's user and see \
                 the whole machine and network; use it for development only"
            );
            Ok(Arc::new(Unconfined))
        }
    }
}

/// No confinement: development only.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unconfined;

impl Sandbox for Unconfined {
    fn name(&self) -> &'static str {
        "unconfined"
    }

    fn confines(&self) -> bool {
        false
    }

    fn command_with(
        &self,
        program: &str,
        args: &[String],
        workspace: &Path,
        _limits: &Limits,
        extra: &Extra<'_>,
    ) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args)
            .current_dir(workspace)
            .env_clear()
            .env("PATH", PATH)
            .envs(extra.env);
        cmd
    }
}
