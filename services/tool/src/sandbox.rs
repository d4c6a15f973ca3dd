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
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use kedge_runtime::config::SandboxKind;
use tokio::io::{AsyncRead, AsyncReadExt};

/// The `PATH` commands see.
const PATH: &str = "/usr/local/bin:/usr/bin:/bin";
/// Where `prlimit` must be, inside the sandbox (its `/usr` is the host's).
const PRLIMIT: &str = "/usr/bin/prlimit";
/// What a command granted the network sees of `/etc` besides the usual few files.
const NETWORK_FILES: &[&str] = &[
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/ssl",
    "/etc/ca-certificates",
];

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

/// A bubblewrap sandbox (see the module doc).
#[derive(Debug, Clone)]
pub struct Bubblewrap {
    bwrap: PathBuf,
    /// How the host's `/bin`, `/sbin`, `/lib*` appear inside: a symlink (merged `/usr`) or a
    /// read-only bind.
    system: Vec<SystemDir>,
}

#[derive(Debug, Clone)]
enum SystemDir {
    Link { path: &'static str, target: PathBuf },
    Bind(&'static str),
}

impl Bubblewrap {
    /// Finds `bwrap` on `PATH` (or in `/usr/bin`), checks that `prlimit` is where the sandbox
    /// expects it, and runs `true` in a sandbox once, so a host where namespaces are denied fails
    /// at startup and not at the first command.
    pub async fn probe() -> Result<Bubblewrap, SandboxError> {
        let sandbox = Bubblewrap::locate()?;
        sandbox.trial().await
    }

    /// Finds `bwrap` and `prlimit` and reads how the host lays out its system directories,
    /// without a trial run ([`Bubblewrap::probe`] does one).
    pub fn locate() -> Result<Bubblewrap, SandboxError> {
        let bwrap = find_program("bwrap")
            .ok_or_else(|| SandboxError::Unavailable("`bwrap` not found on PATH".into()))?;
        if !Path::new(PRLIMIT).is_file() {
            return Err(SandboxError::Unavailable(format!(
                "{PRLIMIT} (util-linux) not found"
            )));
        }
        let mut system = Vec::new();
        for path in ["/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"] {
            match std::fs::symlink_metadata(path) {
                Ok(m) if m.file_type().is_symlink() => {
                    if let Ok(target) = std::fs::read_link(path) {
                        system.push(SystemDir::Link { path, target });
                    }
                }
                Ok(m) if m.is_dir() => system.push(SystemDir::Bind(path)),
                _ => {}
            }
        }
        Ok(Bubblewrap { bwrap, system })
    }

    /// Runs `true` in a sandbox once.
    async fn trial(self) -> Result<Bubblewrap, SandboxError> {
        let sandbox = self;
        let probe_dir = std::env::temp_dir();
        let out = sandbox
            .command(
                "true",
                &[],
                &probe_dir,
                &Limits::for_timeout(Duration::from_secs(5)),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .output();
        match tokio::time::timeout(Duration::from_secs(10), out).await {
            Ok(Ok(out)) if out.status.success() => {
                tracing::info!(bwrap = %sandbox.bwrap.display(), "sandbox: bubblewrap");
                Ok(sandbox)
            }
            Ok(Ok(out)) => Err(SandboxError::Unavailable(format!(
                "`{}` does not work here ({}): {}",
                sandbox.bwrap.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))),
            Ok(Err(e)) => Err(SandboxError::Unavailable(format!(
                "cannot run `{}`: {e}",
                sandbox.bwrap.display()
            ))),
            Err(_) => Err(SandboxError::Unavailable(format!(
                "`{}` did not finish a trial run in 10 s",
                sandbox.bwrap.display()
            ))),
        }
    }
}

impl Sandbox for Bubblewrap {
    fn name(&self) -> &'static str {
        "bwrap"
    }

    fn confines(&self) -> bool {
        true
    }

    fn command_with(
        &self,
        program: &str,
        args: &[String],
        workspace: &Path,
        limits: &Limits,
        extra: &Extra<'_>,
    ) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.bwrap);
        cmd.env_clear()
            .args(["--unshare-all", "--unshare-user"])
            .args(["--uid", "65534", "--gid", "65534"])
            .args(["--cap-drop", "ALL"])
            .args(["--die-with-parent", "--new-session", "--clearenv"])
            .args(["--setenv", "PATH", PATH])
            .arg("--setenv")
            .arg("HOME")
            .arg(workspace)
            .args(["--setenv", "TMPDIR", "/tmp"]);
        for (name, value) in extra.env {
            cmd.arg("--setenv").arg(name).arg(value);
        }
        cmd.args(["--ro-bind", "/usr", "/usr"]);
        for dir in &self.system {
            match dir {
                SystemDir::Link { path, target } => {
                    cmd.arg("--symlink").arg(target).arg(path);
                }
                SystemDir::Bind(path) => {
                    cmd.args(["--ro-bind", path, path]);
                }
            }
        }
        for file in ["/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"] {
            cmd.args(["--ro-bind-try", file, file]);
        }
        if limits.network {
            // Granted by the tool's policy: the host's network, and what resolving names and
            // checking certificates read.
            cmd.arg("--share-net");
            for file in NETWORK_FILES {
                cmd.args(["--ro-bind-try", file, file]);
            }
        }
        cmd.args(["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]);
        // After the tmpfs, so a path under /tmp is not hidden by it.
        for path in extra.read_only {
            cmd.arg("--ro-bind").arg(path).arg(path);
        }
        cmd.arg("--bind")
            .arg(workspace)
            .arg(workspace)
            .arg("--chdir")
            .arg(workspace)
            .arg("--")
            .arg(PRLIMIT);
        if let Some(cpu) = limits.cpu_secs {
            cmd.arg(format!("--cpu={cpu}"));
        }
        cmd.arg(format!("--as={}", limits.address_space_bytes))
            .arg(format!("--fsize={}", limits.file_size_bytes))
            .arg(format!("--nproc={}", limits.processes))
            .arg("--core=0")
            .arg("--")
            .arg(program)
            .args(args);
        cmd
    }
}

/// The tool service's pool of MCP servers (`mcp_servers`): a stdio server whose configuration
/// has `"sandbox"` is started by an [`McpLauncher`] in the sandbox `config.sandbox` names; the
/// others are started unconfined, as the tool service's user, and each of those is logged once
/// here as a warning when the sandbox is `bwrap` (they are trusted code the operator chose; the
/// option confines one when it is not).
///
/// The sandbox is located again here without a trial run: the tool service's
/// [`from_config`] has already checked that it works (or refused to start).
pub fn mcp_pool(config: &kedge_runtime::Config) -> kedge_mcp::Pool {
    let sandbox: Arc<dyn Sandbox> = match config.sandbox {
        SandboxKind::Bwrap => match Bubblewrap::locate() {
            Ok(bwrap) => Arc::new(bwrap),
            Err(error) => {
                tracing::error!(%error, "MCP servers that ask for a sandbox will be refused");
                return kedge_mcp::Pool::new(config.mcp_servers.clone());
            }
        },
        SandboxKind::Unconfined => Arc::new(Unconfined),
    };
    mcp_pool_in(config.mcp_servers.clone(), sandbox, &config.workspace_root)
}

/// [`mcp_pool`] with a sandbox and workspace root of the caller's choosing.
pub fn mcp_pool_in(
    servers: BTreeMap<String, kedge_mcp::ServerConfig>,
    sandbox: Arc<dyn Sandbox>,
    workspace_root: &Path,
) -> kedge_mcp::Pool {
    for (name, server) in &servers {
        if let kedge_mcp::ServerConfig::Stdio {
            command,
            sandbox: None,
            ..
        } = server
            && sandbox.confines()
        {
            tracing::warn!(
                server = %name,
                %command,
                "MCP stdio server `{name}` is not sandboxed (no \"sandbox\" in its \
                 configuration): it runs as the tool service's user and sees the whole machine \
                 and network"
            );
        }
    }
    let launcher = McpLauncher::new(sandbox, workspace_root);
    kedge_mcp::Pool::with_launcher(servers, Arc::new(launcher))
}

/// Starts MCP stdio servers for the pool ([`kedge_mcp::Launcher`]): one whose configuration
/// has `"sandbox"` ([`kedge_mcp::StdioSandbox`]) runs through the [`Sandbox`]:
///
/// - its whole writable file system is a directory of its own, `<workspace_root>/.mcp/<server>/`
///   (created, mode 0700; also its `HOME` and working directory), plus an empty `/tmp`;
/// - it reads `/usr` and the system libraries, as a shell command does, and the configured
///   `read_only` paths (which must exist and must not overlap the workspace root: the runs'
///   workspaces stay out of its sight);
/// - its program is resolved to an absolute path (on the configured `env`'s `PATH`, else the
///   sandbox's) that must lie under `/usr` or a `read_only` path: nothing from elsewhere runs;
/// - it gets the configured `env` (set inside: the sandbox clears everything) and no network
///   unless the option grants it;
/// - [`Limits::for_server`]: address space, file size and processes as for a shell command, no
///   CPU-time limit (it lives across many calls).
///
/// A server without `"sandbox"` runs as before ([`kedge_mcp::direct_command`]). With the
/// [`Unconfined`] sandbox a sandboxed server runs unconfined in its directory, with a warning.
#[derive(Debug)]
pub struct McpLauncher {
    sandbox: Arc<dyn Sandbox>,
    workspace_root: PathBuf,
}

impl McpLauncher {
    /// A launcher confining servers in `sandbox`, with their directories under
    /// `workspace_root/.mcp/`.
    pub fn new(sandbox: Arc<dyn Sandbox>, workspace_root: &Path) -> McpLauncher {
        McpLauncher {
            sandbox,
            workspace_root: workspace_root.to_owned(),
        }
    }

    /// `<workspace_root>/.mcp/<server>/`, created with mode 0700; and the workspace root,
    /// canonical.
    fn server_dir(&self, server: &str) -> Result<(PathBuf, PathBuf), String> {
        use std::os::unix::fs::PermissionsExt as _;

        if server.is_empty()
            || server.starts_with('.')
            || !server
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        {
            return Err(format!(
                "server name {server:?} cannot name its sandbox directory"
            ));
        }
        let root = std::fs::create_dir_all(&self.workspace_root)
            .and_then(|()| self.workspace_root.canonicalize())
            .map_err(|e| format!("workspace root {}: {e}", self.workspace_root.display()))?;
        let mcp = root.join(".mcp");
        let dir = mcp.join(server);
        for d in [&mcp, &dir] {
            std::fs::create_dir_all(d)
                .and_then(|()| std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)))
                .map_err(|e| format!("sandbox directory {}: {e}", d.display()))?;
        }
        Ok((dir, root))
    }
}

impl kedge_mcp::Launcher for McpLauncher {
    fn command(&self, launch: &kedge_mcp::Launch<'_>) -> Result<tokio::process::Command, String> {
        let Some(options) = launch.sandbox else {
            return Ok(kedge_mcp::direct_command(launch));
        };
        let (dir, root) = self.server_dir(launch.server)?;
        // The read-only paths: they must exist (bubblewrap would fail less clearly), and may
        // neither hold nor lie inside the workspace root.
        let mut visible = vec![PathBuf::from("/usr")];
        let mut real_allowed = vec![PathBuf::from("/usr")];
        for (i, path) in options.read_only.iter().enumerate() {
            let real = path
                .canonicalize()
                .map_err(|e| format!("\"sandbox.read_only[{i}]\" {}: {e}", path.display()))?;
            if real.starts_with(&root) || root.starts_with(&real) {
                return Err(format!(
                    "\"sandbox.read_only[{i}]\" {} overlaps the workspace root {}: the server \
                     would see the runs' workspaces",
                    path.display(),
                    root.display()
                ));
            }
            visible.push(path.clone());
            real_allowed.push(real);
        }
        let program = resolve_program(launch.command, launch.env.get("PATH").map(String::as_str))?;
        let real = program
            .canonicalize()
            .map_err(|e| format!("command {}: {e}", program.display()))?;
        if !real_allowed.iter().any(|a| real.starts_with(a)) {
            return Err(format!(
                "command {} ({}) is neither under /usr nor under a \"sandbox.read_only\" path: \
                 a sandboxed server runs only programs it can read",
                launch.command,
                real.display()
            ));
        }
        // Run it by the path it was found at when that is visible inside (argv[0] unchanged),
        // else by its real path.
        let program = if visible.iter().any(|a| program.starts_with(a)) {
            program
        } else {
            real
        };
        if !self.sandbox.confines() {
            tracing::warn!(
                server = launch.server,
                "sandbox \"{}\": MCP server `{}` asks for a sandbox but runs unconfined (development only)",
                self.sandbox.name(),
                launch.server
            );
        }
        let read_only: Vec<PathBuf> = options.read_only.clone();
        tracing::info!(
            server = launch.server,
            sandbox = self.sandbox.name(),
            dir = %dir.display(),
            network = options.network,
            "starting a sandboxed MCP server"
        );
        Ok(self.sandbox.command_with(
            &program.to_string_lossy(),
            launch.args,
            &dir,
            &Limits::for_server(options.network),
            &Extra {
                read_only: &read_only,
                env: launch.env,
            },
        ))
    }
}

/// `command` as an absolute path: itself when it has a slash (a sandboxed server's must be
/// absolute), else the first executable file of that name on `path` (the sandbox's `PATH` when
/// the configuration sets none).
fn resolve_program(command: &str, path: Option<&str>) -> Result<PathBuf, String> {
    use std::os::unix::fs::PermissionsExt as _;

    if command.contains('/') {
        let program = PathBuf::from(command);
        if !program.is_absolute() {
            return Err(format!(
                "command {command:?}: a sandboxed server's command is an absolute path or a name"
            ));
        }
        return Ok(program);
    }
    let path = path.unwrap_or(PATH);
    std::env::split_paths(path)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(command))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| format!("command {command:?} not found on PATH {path:?}"))
}

fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// It exited (or was killed by a signal of its own making, e.g. `SIGXCPU`).
    Exited(ExitStatus),
    /// Still running at the timeout: its process group was killed.
    TimedOut,
    /// Its output went past the cap: its process group was killed.
    OverCap,
}

/// What a command printed (stdout, then stderr; at most the cap plus one read's worth) and how it
/// ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub ended: Ended,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Runs `program args` through `sandbox` in `workspace`, reading its output as it comes and
/// killing its process group past `max_output` bytes (stdout and stderr together) or at
/// `timeout`. Dropping the future kills the group too (the run's cancel).
pub async fn execute(
    sandbox: &dyn Sandbox,
    program: &str,
    args: &[String],
    workspace: &Path,
    timeout: Duration,
    max_output: usize,
) -> std::io::Result<Finished> {
    let limits = Limits::for_timeout(timeout);
    let mut cmd = sandbox.command(program, args, workspace, &limits);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd.spawn()?;
    // Declared after `child`, so dropped before it: the group is killed while its leader is
    // not yet reaped.
    let mut group = Group(child.id().and_then(|id| i32::try_from(id).ok()));
    let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let ran = tokio::time::timeout(timeout, async {
        if read_capped(stdout, stderr, max_output, &mut out, &mut err).await? {
            return Ok(Ended::OverCap);
        }
        child.wait().await.map(Ended::Exited)
    })
    .await;
    let ended = match ran {
        Ok(Ok(Ended::Exited(status))) => {
            // Reaped: its group id may belong to someone else now.
            group.disarm();
            return Ok(Finished {
                ended: Ended::Exited(status),
                stdout: out,
                stderr: err,
            });
        }
        Ok(Ok(ended)) => ended,
        Ok(Err(e)) => {
            group.kill();
            let _ = child.kill().await;
            return Err(e);
        }
        Err(_) => Ended::TimedOut,
    };
    group.kill();
    let _ = child.kill().await;
    Ok(Finished {
        ended,
        stdout: out,
        stderr: err,
    })
}

/// Reads both pipes to their ends into `out` and `err`; true (and stops reading) once together
/// they hold more than `max` bytes.
async fn read_capped(
    mut stdout: Option<impl AsyncRead + Unpin>,
    mut stderr: Option<impl AsyncRead + Unpin>,
    max: usize,
    out: &mut Vec<u8>,
    err: &mut Vec<u8>,
) -> std::io::Result<bool> {
    let (mut a, mut b) = ([0u8; 8192], [0u8; 8192]);
    while stdout.is_some() || stderr.is_some() {
        tokio::select! {
            n = read_some(&mut stdout, &mut a) => match n? {
                0 => stdout = None,
                n => out.extend_from_slice(&a[..n]),
            },
            n = read_some(&mut stderr, &mut b) => match n? {
                0 => stderr = None,
                n => err.extend_from_slice(&b[..n]),
            },
        }
        if out.len() + err.len() > max {
            return Ok(true);
        }
    }
    Ok(false)
}

/// One read from `r`; never ready once `r` is gone.
async fn read_some(
    r: &mut Option<impl AsyncRead + Unpin>,
    buf: &mut [u8],
) -> std::io::Result<usize> {
    match r {
        Some(r) => r.read(buf).await,
        None => std::future::pending().await,
    }
}

/// A command's process group, killed on drop unless disarmed.
struct Group(Option<i32>);

impl Group {
    fn kill(&mut self) {
        if let Some(pid) = self.0.take().and_then(rustix::process::Pid::from_raw) {
            let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
        }
    }

    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kedge-sbx-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    /// The sandbox under test; these tests need bubblewrap (scripts/setup.sh installs it).
    async fn bwrap() -> Bubblewrap {
        Bubblewrap::probe()
            .await
            .expect("bubblewrap works here (scripts/setup.sh installs it)")
    }

    #[tokio::test]
    async fn no_network_inside() {
        let sb = bwrap().await;
        let ws = tmp("net");
        // `cat` of bash's /dev/tcp is the only socket a shell can open without a client program.
        let done = execute(
            &sb,
            "bash",
            &args(&[
                "-c",
                "echo > /dev/tcp/1.1.1.1/53 && echo CONNECTED; cat /proc/net/dev",
            ]),
            &ws,
            Duration::from_secs(5),
            4096,
        )
        .await
        .expect("ran");
        let out = String::from_utf8_lossy(&done.stdout);
        assert!(!out.contains("CONNECTED"), "{out}");
        // Only a loopback interface exists.
        let ifaces: Vec<&str> = out
            .lines()
            .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim()))
            .filter(|n| !n.contains('|'))
            .collect();
        assert_eq!(ifaces, vec!["lo"], "{out}");
        // Unconfined, the same host does have other interfaces (or the check above proves nothing).
        let host = std::fs::read_to_string("/proc/net/dev").expect("host interfaces");
        assert!(host.lines().count() > 3, "{host}");
        let _ = std::fs::remove_dir_all(&ws);
    }

    #[tokio::test]
    async fn the_file_system_is_the_workspace_and_usr() {
        let sb = bwrap().await;
        let ws = tmp("fs");
        std::fs::write(ws.join("mine"), "inside").expect("write");
        let done = execute(
            &sb,
            "ls",
            &args(&["/", "/etc"]),
            &ws,
            Duration::from_secs(5),
            4096,
        )
        .await
        .expect("ran");
        let out = String::from_utf8_lossy(&done.stdout);
        for absent in ["home", "root", "work", "passwd", "shadow", "hostname"] {
            assert!(!out.lines().any(|l| l == absent), "{absent} visible: {out}");
        }
        let done = execute(
            &sb,
            "cat",
            &args(&["mine"]),
            &ws,
            Duration::from_secs(5),
            4096,
        )
        .await
        .expect("ran");
        assert_eq!(done.stdout, b"inside");
        let _ = std::fs::remove_dir_all(&ws);
    }

    #[tokio::test]
    async fn limits_apply_inside() {
        let sb = bwrap().await;
        let ws = tmp("limits");
        let done = execute(
            &sb,
            "cat",
            &args(&["/proc/self/limits"]),
            &ws,
            Duration::from_secs(3),
            8192,
        )
        .await
        .expect("ran");
        let out = String::from_utf8_lossy(&done.stdout);
        let limit = |name: &str| {
            out.lines()
                .find(|l| l.starts_with(name))
                .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
                .unwrap_or_default()
        };
        assert!(limit("Max cpu time").contains(" 4 4 "), "{out}");
        assert!(
            limit("Max file size").contains(&format!(" {} ", 64 << 20)),
            "{out}"
        );
        assert!(
            limit("Max address space").contains(&format!(" {} ", 1u64 << 30)),
            "{out}"
        );
        assert!(limit("Max processes").contains(" 64 64 "), "{out}");
        // A file cannot grow past the size limit (SIGXFSZ).
        let done = execute(
            &sb,
            "bash",
            &args(&["-c", "head -c 70000000 /dev/zero > big"]),
            &ws,
            Duration::from_secs(5),
            4096,
        )
        .await
        .expect("ran");
        assert!(
            matches!(done.ended, Ended::Exited(s) if !s.success()),
            "{done:?}"
        );
        let size = std::fs::metadata(ws.join("big")).expect("big").len();
        assert_eq!(size, 64 << 20);
        let _ = std::fs::remove_dir_all(&ws);
    }

    #[tokio::test]
    async fn output_is_capped_while_read_and_the_group_is_killed() {
        for sb in [&bwrap().await as &dyn Sandbox, &Unconfined] {
            let ws = tmp("cap");
            let started = std::time::Instant::now();
            let done = execute(sb, "yes", &[], &ws, Duration::from_secs(20), 10_000)
                .await
                .expect("ran");
            assert_eq!(done.ended, Ended::OverCap, "{}", sb.name());
            assert!(done.stdout.len() <= 10_000 + 8192, "{}", done.stdout.len());
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{:?}",
                started.elapsed()
            );
            let _ = std::fs::remove_dir_all(&ws);
        }
    }

    #[tokio::test]
    async fn the_whole_group_dies_at_the_timeout_even_unconfined() {
        let marker = format!("4{}.75", std::process::id() % 1000);
        for sb in [&bwrap().await as &dyn Sandbox, &Unconfined] {
            let ws = tmp("group");
            let script = format!("sleep {marker} & sleep {marker}");
            let done = execute(
                sb,
                "sh",
                &args(&["-c", &script]),
                &ws,
                Duration::from_millis(300),
                4096,
            )
            .await
            .expect("ran");
            assert_eq!(done.ended, Ended::TimedOut, "{}", sb.name());
            let deadline = std::time::Instant::now() + Duration::from_secs(3);
            while sleeping(&marker) {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{}: a sleep outlived its command",
                    sb.name()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = std::fs::remove_dir_all(&ws);
        }
    }

    #[tokio::test]
    async fn a_server_gets_its_env_its_read_only_paths_and_no_cpu_limit() {
        let sb = bwrap().await;
        let ws = tmp("server");
        let shown = tmp("server-ro");
        std::fs::write(shown.join("data"), "readable\n").expect("write");
        let env = BTreeMap::from([("GIVEN".to_owned(), "yes".to_owned())]);
        let read_only = [shown.clone()];
        let script = format!(
            "echo \"$GIVEN\"; cat {0}/data; echo x > {0}/data || echo RO; grep 'Max cpu time' /proc/self/limits",
            shown.display()
        );
        let mut cmd = sb.command_with(
            "bash",
            &args(&["-c", &script]),
            &ws,
            &Limits::for_server(false),
            &Extra {
                read_only: &read_only,
                env: &env,
            },
        );
        let out = cmd.output().await.expect("ran");
        let out = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[..3], ["yes", "readable", "RO"], "{out}");
        // Not the shell's `--cpu`: inherited from this process (unlimited in a test).
        let host = std::fs::read_to_string("/proc/self/limits").expect("limits");
        let host_cpu = host
            .lines()
            .find(|l| l.starts_with("Max cpu time"))
            .unwrap_or("");
        assert_eq!(
            lines[3].split_whitespace().collect::<Vec<_>>(),
            host_cpu.split_whitespace().collect::<Vec<_>>(),
            "{out}"
        );
        assert_eq!(
            std::fs::read_to_string(shown.join("data")).expect("data"),
            "readable\n"
        );
        let _ = std::fs::remove_dir_all(&ws);
        let _ = std::fs::remove_dir_all(&shown);
    }

    /// Whether a process running `sleep <marker>` is alive.
    fn sleeping(marker: &str) -> bool {
        let wanted = format!("sleep\0{marker}");
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .any(|e| {
                std::fs::read(e.path().join("cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).contains(&wanted))
                    .unwrap_or(false)
            })
    }
}
