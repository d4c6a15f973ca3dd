//! Built-in tools. Each run gets a workspace directory `<workspace_root>/<run_id>/`; paths are
//! relative to it and may not leave it. `shell` runs only allowlisted commands, without a shell,
//! through the configured [`Sandbox`] (which confines it to the workspace), with a timeout and an
//! output cap past which its process group is killed (see [`crate::sandbox`]).
//!
//! The file tools open every path relative to a descriptor of the workspace with `openat2` and
//! `RESOLVE_BENEATH` (kernel 5.6+): a `..` or a symlink (however deep, whatever created it) that
//! would lead out of the workspace fails the open instead of being followed, and there is no
//! window between a check and the open. `rustix` is the crate for it: safe wrappers of the raw
//! system calls, already in the dependency tree (through tokio's and tempfile's users), where
//! `cap-std` would add a family of crates for the same `openat2` call.
//!
//! `ledger_append` is the side-effect tool tests count: it appends `<operation id>\t<text>` to
//! `<workspace_root>/ledger.log` every time it runs (it does not deduplicate), and it answers a
//! confirm query (is the operation's line there?), so a runner that died mid-operation can be
//! resolved without repeating the effect.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kedge_core::agent::MAX_TOOL_OUTPUT_BYTES;
use kedge_core::ids::{OperationId, RunId};
use kedge_core::tools::ToolErrorClass;
use rustix::fs::{Mode, OFlags, ResolveFlags};
use serde_json::Value;

use crate::sandbox::{Ended, Sandbox};

/// What a tool returned: content for the model, and whether it is an error; for an error, its
/// class when a retry policy could try it again (a timeout, a call that never reached the tool).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub content: String,
    pub is_error: bool,
    pub class: Option<ToolErrorClass>,
}

impl Output {
    pub fn ok(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            is_error: false,
            class: None,
        }
    }
    /// An error the model reads; trying the same call again would not help.
    pub fn error(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            is_error: true,
            class: None,
        }
    }
    /// An error of class `class` (see [`ToolErrorClass`]).
    pub fn failed(content: impl Into<String>, class: ToolErrorClass) -> Self {
        Self {
            content: content.into(),
            is_error: true,
            class: Some(class),
        }
    }
}

/// The answer of a confirm query about an operation whose runner disappeared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Confirm {
    /// It happened; this is its result.
    Confirmed(Output),
    /// It did not happen: running it again is safe.
    NotFound,
    /// It is still running where it runs (a status query that sees calls in flight said so):
    /// ask again later; running it again now could double it.
    InFlight,
    /// Cannot tell.
    Ambiguous(String),
}

/// The built-in tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    ReadFile,
    WriteFile,
    ListFiles,
    Shell,
    LedgerAppend,
}

impl Builtin {
    pub const ALL: &'static [Builtin] = &[
        Builtin::ReadFile,
        Builtin::WriteFile,
        Builtin::ListFiles,
        Builtin::Shell,
        Builtin::LedgerAppend,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Builtin::ReadFile => "read_file",
            Builtin::WriteFile => "write_file",
            Builtin::ListFiles => "list_files",
            Builtin::Shell => "shell",
            Builtin::LedgerAppend => "ledger_append",
        }
    }

    pub fn by_name(name: &str) -> Option<Builtin> {
        Self::ALL.iter().copied().find(|b| b.name() == name)
    }

    /// Running it twice has the same effect as once.
    pub fn idempotent(self) -> bool {
        match self {
            Builtin::ReadFile | Builtin::WriteFile | Builtin::ListFiles => true,
            Builtin::Shell | Builtin::LedgerAppend => false,
        }
    }
}

/// Where the tools work and what they may do.
#[derive(Debug, Clone)]
pub struct Env {
    pub root: PathBuf,
    pub shell_allowlist: Vec<String>,
    pub timeout: Duration,
    pub max_output: usize,
    /// What confines `shell` commands.
    pub sandbox: Arc<dyn Sandbox>,
    /// Whether the test-only `ledger_append` is offered (configuration `ledger_tool`).
    pub ledger: bool,
}

impl Env {
    pub fn workspace(&self, run: &RunId) -> PathBuf {
        self.root.join(run.as_str())
    }

    pub fn ledger(&self) -> PathBuf {
        self.root.join("ledger.log")
    }

    /// This environment with the time limit lowered to `secs` (the agent policy's
    /// `timeout_secs`); a limit above the configured one does not raise it.
    pub fn limited_to(&self, secs: Option<u64>) -> std::borrow::Cow<'_, Env> {
        match secs.map(Duration::from_secs) {
            Some(limit) if limit < self.timeout => std::borrow::Cow::Owned(Env {
                timeout: limit,
                ..self.clone()
            }),
            _ => std::borrow::Cow::Borrowed(self),
        }
    }

    /// This environment as a request's policy leaves it: the time limit lowered to its
    /// `timeout_secs` ([`Env::limited_to`]), the output kept set to its `max_output_bytes`
    /// (the agent's choice, up to [`MAX_TOOL_OUTPUT_BYTES`]: longer results are journaled by
    /// reference) and, when the policy grants the tool the network (`network`), a sandbox that
    /// shares it ([`crate::sandbox::WithNetwork`]).
    pub fn for_request(&self, req: &kedge_core::event::ToolRequested) -> std::borrow::Cow<'_, Env> {
        let mut env = self.limited_to(req.limits.timeout_secs);
        if let Some(max) = req.limits.max_output_bytes {
            let max = usize::try_from(max.clamp(1, MAX_TOOL_OUTPUT_BYTES)).unwrap_or(usize::MAX);
            if max != env.max_output {
                env.to_mut().max_output = max;
            }
        }
        if req.limits.network {
            let env = env.to_mut();
            env.sandbox = Arc::new(crate::sandbox::WithNetwork(env.sandbox.clone()));
        }
        env
    }

    /// Cuts `s` to the largest output kept inline, with a note.
    pub fn truncate(&self, s: String) -> String {
        truncate(s, self.max_output)
    }

    /// Runs a built-in tool. Errors the model should see are `Output { is_error: true }`.
    pub async fn run(&self, tool: Builtin, op: &OperationId, args: &Value) -> Output {
        match self.dispatch(tool, op, args).await {
            Ok(out) => out,
            Err(msg) => Output::error(msg),
        }
    }

    async fn dispatch(
        &self,
        tool: Builtin,
        op: &OperationId,
        args: &Value,
    ) -> Result<Output, String> {
        let run = op.run();
        match tool {
            Builtin::ReadFile => self.read_file(&self.open_workspace(run).await?, args).await,
            Builtin::WriteFile => write_file(&self.open_workspace(run).await?, args).await,
            Builtin::ListFiles => list_files(&self.open_workspace(run).await?, args).await,
            Builtin::Shell => self.shell(&self.open_workspace(run).await?, args).await,
            Builtin::LedgerAppend if !self.ledger => Err(
                "tool `ledger_append` is not offered here (a test-only tool; the operator \
                 enables it with ledger_tool / KEDGE_LEDGER_TOOL=1)"
                    .to_owned(),
            ),
            // Writes beside the workspaces: the run's is not needed.
            Builtin::LedgerAppend => self.ledger_append(op, args).await,
        }
    }

    /// The run's workspace, created if missing, as an absolute path (the sandbox mounts it at
    /// its own path): one trip to the blocking pool.
    async fn open_workspace(&self, run: &RunId) -> Result<PathBuf, String> {
        let work = self.workspace(run);
        blocking(move || {
            std::fs::create_dir_all(&work).map_err(doing("cannot create the workspace"))?;
            std::fs::canonicalize(&work).map_err(doing("cannot find the workspace"))
        })
        .await
        .map_err(|e| e.to_string())
    }

    /// The precondition check of a tool: the version of what the operation would change, or
    /// `None` for tools without one. `write_file`: the digest of the file (`sha256:…`) or
    /// `absent`. Arguments the tool would reject have no version (the run fails them anyway).
    pub async fn target_version(&self, tool: Builtin, run: &RunId, args: &Value) -> Option<String> {
        match tool {
            Builtin::WriteFile => {
                let work = self.workspace(run);
                let path = str_arg(args, "path").ok()?;
                resolve(&work, path).ok()?;
                let path = path.to_owned();
                let read = blocking(move || {
                    let file = beneath::open_file(&work, &path, OFlags::RDONLY, Mode::empty())?;
                    let mut bytes = Vec::new();
                    std::fs::File::from(file).read_to_end(&mut bytes)?;
                    Ok(bytes)
                })
                .await;
                Some(match read {
                    Ok(bytes) => kedge_core::event::Digest::of_bytes(&bytes)
                        .as_str()
                        .to_owned(),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => "absent".to_owned(),
                    Err(e) => format!("unreadable: {}", e.kind()),
                })
            }
            Builtin::ReadFile | Builtin::ListFiles | Builtin::Shell | Builtin::LedgerAppend => None,
        }
    }

    /// The confirm query of a tool, for an operation whose runner disappeared mid-way.
    pub async fn confirm(&self, tool: Builtin, op: &OperationId) -> Confirm {
        match tool {
            Builtin::ReadFile | Builtin::WriteFile | Builtin::ListFiles => Confirm::NotFound,
            Builtin::LedgerAppend => match tokio::fs::read_to_string(self.ledger()).await {
                Ok(text) => {
                    let prefix = format!("{op}\t");
                    match text.lines().find(|l| l.starts_with(&prefix)) {
                        Some(line) => Confirm::Confirmed(Output::ok(format!(
                            "recorded: {}",
                            &line[prefix.len()..]
                        ))),
                        None => Confirm::NotFound,
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Confirm::NotFound,
                Err(e) => Confirm::Ambiguous(format!("cannot read the ledger: {e}")),
            },
            Builtin::Shell => Confirm::Ambiguous(
                "a shell command was interrupted; whether it ran cannot be known".into(),
            ),
        }
    }

    async fn read_file(&self, work: &Path, args: &Value) -> Result<Output, String> {
        let path = str_arg(args, "path")?;
        resolve(work, path)?;
        let (owned_work, owned_path, max) = (work.to_owned(), path.to_owned(), self.max_output);
        // Read at most the cap (plus a few bytes to cut on a character boundary).
        let (bytes, total) = blocking(move || {
            let file = beneath::open_file(&owned_work, &owned_path, OFlags::RDONLY, Mode::empty())?;
            let file = std::fs::File::from(file);
            let total = file.metadata()?.len();
            let mut bytes = Vec::new();
            (&file).take(max as u64 + 4).read_to_end(&mut bytes)?;
            Ok((bytes, total))
        })
        .await
        .map_err(|e| format!("cannot read {path}: {}", beneath::explain(&e)))?;
        let total = usize::try_from(total)
            .unwrap_or(usize::MAX)
            .max(bytes.len());
        Ok(Output::ok(truncate_of(
            String::from_utf8_lossy(&bytes).into_owned(),
            self.max_output,
            total,
        )))
    }

    async fn shell(&self, work: &Path, args: &Value) -> Result<Output, String> {
        let command = str_arg(args, "command")?;
        if !self.shell_allowlist.iter().any(|c| c == command) {
            return Err(format!(
                "`{command}` is not allowed; allowed commands: {}",
                self.shell_allowlist.join(", ")
            ));
        }
        let argv: Vec<String> = match args.get("args") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(format!("args must be strings, got {other}")),
                })
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(format!("args must be an array of strings, got {other}")),
        };
        if argv
            .iter()
            .any(|a| a.starts_with('/') || a.split('/').any(|p| p == ".."))
        {
            return Err("arguments may not name paths outside the workspace".into());
        }
        if !self.sandbox.confines() {
            tracing::warn!(command, "running unconfined (sandbox \"unconfined\")");
        }
        let done = crate::sandbox::execute(
            self.sandbox.as_ref(),
            command,
            &argv,
            work,
            self.timeout,
            self.max_output,
        )
        .await
        .map_err(|e| format!("cannot run `{command}`: {e}"))?;
        let mut text = String::from_utf8_lossy(&done.stdout).into_owned();
        if !done.stderr.is_empty() {
            text.push_str(&String::from_utf8_lossy(&done.stderr));
        }
        match done.ended {
            Ended::TimedOut => Ok(Output::failed(
                format!(
                    "`{command}` timed out after {} ms and was killed; output so far: {}",
                    self.timeout.as_millis(),
                    truncate(text, self.max_output)
                ),
                ToolErrorClass::Timeout,
            )),
            Ended::OverCap => {
                let mut cut = self.max_output.min(text.len());
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                text.truncate(cut);
                Err(format!(
                    "{text}\n[`{command}` printed more than {} bytes and was killed]",
                    self.max_output
                ))
            }
            Ended::Exited(status) => {
                let text = truncate(text, self.max_output);
                if status.success() {
                    Ok(Output::ok(text))
                } else {
                    Ok(Output::error(format!("exit status {status}: {text}")))
                }
            }
        }
    }

    async fn ledger_append(&self, op: &OperationId, args: &Value) -> Result<Output, String> {
        let text = str_arg(args, "text")?.replace(['\n', '\t'], " ");
        let (root, ledger, line) = (self.root.clone(), self.ledger(), format!("{op}\t{text}\n"));
        // One trip to the blocking pool for the open and the write. Not synced to disk: the
        // line is the file's once written (a process killed after it leaves it there for the
        // confirm query), and a test tool's line need not outlive the machine. The Restate
        // peer's tool, the bench's yardstick, appends its line the same way.
        blocking(move || {
            std::fs::create_dir_all(root).map_err(doing("cannot create the ledger's directory"))?;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(ledger)
                .map_err(doing("cannot open the ledger"))?;
            std::io::Write::write_all(&mut f, line.as_bytes())
                .map_err(doing("cannot write the ledger"))
        })
        .await
        .map_err(|e| e.to_string())?;
        Ok(Output::ok(format!("recorded: {text}")))
    }
}

async fn write_file(work: &Path, args: &Value) -> Result<Output, String> {
    let path = str_arg(args, "path")?;
    resolve(work, path)?;
    let content = str_arg(args, "content")?;
    let (owned_work, owned_path, bytes) = (work.to_owned(), path.to_owned(), content.to_owned());
    blocking(move || {
        let rel = Path::new(&owned_path);
        let dir = match rel.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => {
                beneath::create_dirs(&owned_work, parent)?
            }
            _ => beneath::root(&owned_work)?,
        };
        let name = rel
            .file_name()
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        let file = beneath::open_at(
            &dir,
            Path::new(name),
            OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC,
            Mode::from_raw_mode(0o644),
        )?;
        let mut file = std::fs::File::from(file);
        std::io::Write::write_all(&mut file, bytes.as_bytes())
    })
    .await
    .map_err(|e| format!("cannot write {path}: {}", beneath::explain(&e)))?;
    Ok(Output::ok(format!(
        "wrote {} bytes to {}",
        content.len(),
        Path::new(path).display()
    )))
}

async fn list_files(work: &Path, args: &Value) -> Result<Output, String> {
    let path = match args.get("path").and_then(Value::as_str) {
        Some(p) if !p.is_empty() && p != "." => {
            resolve(work, p)?;
            p.to_owned()
        }
        _ => ".".to_owned(),
    };
    let owned_work = work.to_owned();
    let shown = path.clone();
    let mut names = blocking(move || {
        let dir = beneath::open_at(
            &beneath::root(&owned_work)?,
            Path::new(&path),
            OFlags::RDONLY | OFlags::DIRECTORY,
            Mode::empty(),
        )?;
        let mut names = Vec::new();
        for entry in rustix::fs::Dir::read_from(&dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == "." || name == ".." {
                continue;
            }
            let is_dir = match entry.file_type() {
                rustix::fs::FileType::Directory => true,
                rustix::fs::FileType::Unknown => rustix::fs::statat(
                    &dir,
                    entry.file_name(),
                    rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
                )
                .map(|st| {
                    rustix::fs::FileType::from_raw_mode(st.st_mode)
                        == rustix::fs::FileType::Directory
                })
                .unwrap_or(false),
                _ => false,
            };
            names.push(if is_dir { format!("{name}/") } else { name });
        }
        Ok(names)
    })
    .await
    .map_err(|e| format!("cannot list {shown}: {}", beneath::explain(&e)))?;
    names.sort();
    Ok(Output::ok(if names.is_empty() {
        "(empty)".to_owned()
    } else {
        names.join("\n")
    }))
}

/// What was being done, in front of an I/O error.
fn doing(what: &'static str) -> impl FnOnce(std::io::Error) -> std::io::Error {
    move |e| std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Runs blocking file work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(std::io::Error::other)?
}

/// Opens beneath the workspace: every path is resolved relative to a descriptor of it with
/// `RESOLVE_BENEATH`, so nothing (`..`, an absolute symlink, a symlink to `..`) leads out.
mod beneath {
    use super::*;

    fn resolve_flags() -> ResolveFlags {
        ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS
    }

    /// The workspace directory itself.
    pub(super) fn root(work: &Path) -> std::io::Result<OwnedFd> {
        Ok(rustix::fs::open(
            work,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )?)
    }

    /// `path` beneath `dir`.
    pub(super) fn open_at(
        dir: &OwnedFd,
        path: &Path,
        flags: OFlags,
        mode: Mode,
    ) -> std::io::Result<OwnedFd> {
        Ok(rustix::fs::openat2(
            dir,
            path,
            flags | OFlags::CLOEXEC,
            mode,
            resolve_flags(),
        )?)
    }

    /// A regular file beneath the workspace (a FIFO or device is refused, without blocking).
    pub(super) fn open_file(
        work: &Path,
        path: &str,
        flags: OFlags,
        mode: Mode,
    ) -> std::io::Result<OwnedFd> {
        let fd = open_at(
            &root(work)?,
            Path::new(path),
            flags | OFlags::NONBLOCK,
            mode,
        )?;
        let st = rustix::fs::fstat(&fd)?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        Ok(fd)
    }

    /// Creates the directories of `rel` beneath the workspace one at a time (each opened
    /// beneath the last), and returns the last.
    pub(super) fn create_dirs(work: &Path, rel: &Path) -> std::io::Result<OwnedFd> {
        let mut dir = root(work)?;
        for part in rel.components() {
            let Component::Normal(name) = part else {
                continue;
            };
            let name = Path::new(name);
            let flags = OFlags::RDONLY | OFlags::DIRECTORY;
            dir = match open_at(&dir, name, flags, Mode::empty()) {
                Ok(next) => next,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    match rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o755)) {
                        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                        Err(e) => return Err(e.into()),
                    }
                    open_at(&dir, name, flags, Mode::empty())?
                }
                Err(e) => return Err(e),
            };
        }
        Ok(dir)
    }

    /// An error for the model; `EXDEV` is what `RESOLVE_BENEATH` answers for a way out.
    pub(super) fn explain(e: &std::io::Error) -> String {
        if e.raw_os_error() == Some(rustix::io::Errno::XDEV.raw_os_error()) {
            "it leads out of the workspace (through a symlink); not followed".to_owned()
        } else {
            e.to_string()
        }
    }
}

fn str_arg<'a>(args: &'a Value, name: &str) -> Result<&'a str, String> {
    args.get(name)
        .and_then(Value::as_str)
        .ok_or_else(|| format!("missing string argument `{name}`"))
}

/// A path inside the workspace, or an error naming why not.
fn resolve(work: &Path, path: &str) -> Result<PathBuf, String> {
    let p = Path::new(path);
    if path.is_empty() {
        return Err("path is empty".into());
    }
    for c in p.components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                return Err(format!("path `{path}` leaves the workspace"));
            }
        }
    }
    Ok(work.join(p))
}

fn truncate(s: String, max: usize) -> String {
    let total = s.len();
    truncate_of(s, max, total)
}

/// Cuts `s` (the start of something `total` bytes long) to `max` bytes, with a note.
fn truncate_of(mut s: String, max: usize, total: usize) -> String {
    if total > max || s.len() > max {
        let mut cut = max.min(s.len());
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str(&format!(
            "\n[truncated: {total} bytes, showing the first {cut}]"
        ));
    }
    s
}

#[cfg(test)]
mod tests;
