//! The MCP stdio servers' launcher: [`mcp_pool`] and [`McpLauncher`], which starts a server
//! whose configuration asks for it in the [`Sandbox`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kedge_runtime::config::SandboxKind;

use super::{Bubblewrap, Extra, Limits, PATH, Sandbox, Unconfined};

/// The tool service's pool of MCP servers (`mcp_servers`): a stdio server whose configuration
/// has `"sandbox"` is started by an [`McpLauncher`] in the sandbox `config.sandbox` names; the
/// others are started unconfined, as the tool service's user, and each of those is logged once
/// here as a warning when the sandbox is `bwrap` (they are trusted code the operator chose; the
/// option confines one when it is not).
///
/// The sandbox is located again here without a trial run: the tool service's
/// [`from_config`](super::from_config) has already checked that it works (or refused to start).
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
