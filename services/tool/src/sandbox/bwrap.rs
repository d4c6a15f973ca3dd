//! The [`Bubblewrap`] sandbox: locating `bwrap` and `prlimit`, the trial run, and the command
//! line that builds the sandbox (see the module doc of [`super`]).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use super::{Extra, Limits, PATH, Sandbox, SandboxError};

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

fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}
