//! Built-in tools. Each run gets a workspace directory `<workspace_root>/<run_id>/`; paths are
//! relative to it and may not leave it. `shell` runs only allowlisted commands, without a shell,
//! inside the workspace, with a timeout after which the process is killed.
//!
//! `ledger_append` is the side-effect tool tests count: it appends `<operation id>\t<text>` to
//! `<workspace_root>/ledger.log` every time it runs (it does not deduplicate), and it answers a
//! confirm query (is the operation's line there?), so a runner that died mid-operation can be
//! resolved without repeating the effect.

use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use kedge_core::ids::{OperationId, RunId};
use serde_json::Value;
use tokio::io::AsyncWriteExt;

/// What a tool returned: content for the model, and whether it is an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub content: String,
    pub is_error: bool,
}

impl Output {
    fn ok(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            is_error: false,
        }
    }
    pub fn error(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            is_error: true,
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

    /// Cuts `s` to the largest output kept inline, with a note.
    pub fn truncate(&self, s: String) -> String {
        truncate(s, self.max_output)
    }

    /// Runs a built-in tool. Errors the model should see are `Output { is_error: true }`.
    pub async fn run(&self, tool: Builtin, op: &OperationId, args: &Value) -> Output {
        let work = self.workspace(op.run());
        if let Err(e) = tokio::fs::create_dir_all(&work).await {
            return Output::error(format!("cannot create the workspace: {e}"));
        }
        let result = match tool {
            Builtin::ReadFile => self.read_file(&work, args).await,
            Builtin::WriteFile => write_file(&work, args).await,
            Builtin::ListFiles => list_files(&work, args).await,
            Builtin::Shell => self.shell(&work, args).await,
            Builtin::LedgerAppend => self.ledger_append(op, args).await,
        };
        match result {
            Ok(out) => out,
            Err(msg) => Output::error(msg),
        }
    }

    /// The precondition check of a tool: the version of what the operation would change, or
    /// `None` for tools without one. `write_file`: the digest of the file (`sha256:…`) or
    /// `absent`. Arguments the tool would reject have no version (the run fails them anyway).
    pub async fn target_version(&self, tool: Builtin, run: &RunId, args: &Value) -> Option<String> {
        match tool {
            Builtin::WriteFile => {
                let path = resolve(&self.workspace(run), str_arg(args, "path").ok()?).ok()?;
                Some(match tokio::fs::read(&path).await {
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
        let path = resolve(work, str_arg(args, "path")?)?;
        let bytes = tokio::fs::read(&path)
            .await
            .map_err(|e| format!("cannot read {}: {e}", rel(work, &path)))?;
        Ok(Output::ok(truncate(
            String::from_utf8_lossy(&bytes).into_owned(),
            self.max_output,
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
        let child = tokio::process::Command::new(command)
            .args(&argv)
            .current_dir(work)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start `{command}`: {e}"))?;
        match tokio::time::timeout(self.timeout, child.wait_with_output()).await {
            Err(_) => Err(format!(
                "`{command}` timed out after {} ms and was killed",
                self.timeout.as_millis()
            )),
            Ok(Err(e)) => Err(format!("`{command}` failed: {e}")),
            Ok(Ok(out)) => {
                let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
                if !out.stderr.is_empty() {
                    text.push_str(&String::from_utf8_lossy(&out.stderr));
                }
                let text = truncate(text, self.max_output);
                if out.status.success() {
                    Ok(Output::ok(text))
                } else {
                    Ok(Output::error(format!("exit status {}: {text}", out.status)))
                }
            }
        }
    }

    async fn ledger_append(&self, op: &OperationId, args: &Value) -> Result<Output, String> {
        let text = str_arg(args, "text")?.replace(['\n', '\t'], " ");
        let mut f = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.ledger())
            .await
            .map_err(|e| format!("cannot open the ledger: {e}"))?;
        f.write_all(format!("{op}\t{text}\n").as_bytes())
            .await
            .map_err(|e| format!("cannot write the ledger: {e}"))?;
        f.sync_data()
            .await
            .map_err(|e| format!("cannot sync the ledger: {e}"))?;
        Ok(Output::ok(format!("recorded: {text}")))
    }
}

async fn write_file(work: &Path, args: &Value) -> Result<Output, String> {
    let path = resolve(work, str_arg(args, "path")?)?;
    let content = str_arg(args, "content")?;
    if let Some(parent) = path.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(|e| format!("cannot create {}: {e}", rel(work, parent)))?;
    }
    tokio::fs::write(&path, content)
        .await
        .map_err(|e| format!("cannot write {}: {e}", rel(work, &path)))?;
    Ok(Output::ok(format!(
        "wrote {} bytes to {}",
        content.len(),
        rel(work, &path)
    )))
}

async fn list_files(work: &Path, args: &Value) -> Result<Output, String> {
    let dir = match args.get("path").and_then(Value::as_str) {
        Some(p) if !p.is_empty() && p != "." => resolve(work, p)?,
        _ => work.to_owned(),
    };
    let mut entries = tokio::fs::read_dir(&dir)
        .await
        .map_err(|e| format!("cannot list {}: {e}", rel(work, &dir)))?;
    let mut names = Vec::new();
    while let Ok(Some(entry)) = entries.next_entry().await {
        let mut name = entry.file_name().to_string_lossy().into_owned();
        if entry.file_type().await.map(|t| t.is_dir()).unwrap_or(false) {
            name.push('/');
        }
        names.push(name);
    }
    names.sort();
    Ok(Output::ok(if names.is_empty() {
        "(empty)".to_owned()
    } else {
        names.join("\n")
    }))
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

fn rel(work: &Path, path: &Path) -> String {
    path.strip_prefix(work)
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| path.display().to_string())
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        let total = s.len();
        s.truncate(cut);
        s.push_str(&format!(
            "\n[truncated: {total} bytes, showing the first {cut}]"
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(dir: &Path) -> Env {
        Env {
            root: dir.to_owned(),
            shell_allowlist: vec!["echo".into(), "sleep".into(), "ls".into()],
            timeout: Duration::from_millis(500),
            max_output: 64,
        }
    }

    fn op(i: u32) -> OperationId {
        let run: RunId = "run_tooltest".parse().expect("valid");
        OperationId::new(&run, kedge_core::ids::StepNo(1), i)
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kedge-tool-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[tokio::test]
    async fn files_round_trip_inside_the_workspace_only() {
        let dir = tmp("files");
        let env = env(&dir);
        let w = env
            .run(
                Builtin::WriteFile,
                &op(0),
                &serde_json::json!({"path": "notes/a.txt", "content": "hello"}),
            )
            .await;
        assert!(!w.is_error, "{w:?}");
        let r = env
            .run(
                Builtin::ReadFile,
                &op(1),
                &serde_json::json!({"path": "notes/a.txt"}),
            )
            .await;
        assert_eq!(r, Output::ok("hello"));
        let l = env
            .run(Builtin::ListFiles, &op(2), &serde_json::json!({}))
            .await;
        assert_eq!(l.content, "notes/");
        for bad in ["../x", "/etc/passwd", "a/../../x"] {
            let r = env
                .run(Builtin::ReadFile, &op(3), &serde_json::json!({"path": bad}))
                .await;
            assert!(
                r.is_error && r.content.contains("leaves the workspace"),
                "{bad}: {r:?}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn shell_is_allowlisted_and_timed_out() {
        let dir = tmp("shell");
        let env = env(&dir);
        let ok = env
            .run(
                Builtin::Shell,
                &op(0),
                &serde_json::json!({"command": "echo", "args": ["hi"]}),
            )
            .await;
        assert_eq!(ok, Output::ok("hi\n"));
        let denied = env
            .run(
                Builtin::Shell,
                &op(1),
                &serde_json::json!({"command": "rm", "args": ["-rf", "x"]}),
            )
            .await;
        assert!(denied.is_error && denied.content.contains("not allowed"));
        let slow = env
            .run(
                Builtin::Shell,
                &op(2),
                &serde_json::json!({"command": "sleep", "args": ["5"]}),
            )
            .await;
        assert!(
            slow.is_error && slow.content.contains("timed out"),
            "{slow:?}"
        );
        let outside = env
            .run(
                Builtin::Shell,
                &op(3),
                &serde_json::json!({"command": "ls", "args": ["/"]}),
            )
            .await;
        assert!(outside.is_error);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn the_ledger_counts_every_run_and_confirms() {
        let dir = tmp("ledger");
        let env = env(&dir);
        assert_eq!(
            env.confirm(Builtin::LedgerAppend, &op(0)).await,
            Confirm::NotFound
        );
        let args = serde_json::json!({"text": "paid 5"});
        env.run(Builtin::LedgerAppend, &op(0), &args).await;
        env.run(Builtin::LedgerAppend, &op(0), &args).await;
        let text = std::fs::read_to_string(env.ledger()).expect("ledger");
        assert_eq!(
            text.lines().count(),
            2,
            "the tool itself does not deduplicate"
        );
        assert!(matches!(
            env.confirm(Builtin::LedgerAppend, &op(0)).await,
            Confirm::Confirmed(_)
        ));
        let long = env
            .run(
                Builtin::WriteFile,
                &op(5),
                &serde_json::json!({"path": "big", "content": "x".repeat(200)}),
            )
            .await;
        assert!(!long.is_error);
        let r = env
            .run(
                Builtin::ReadFile,
                &op(6),
                &serde_json::json!({"path": "big"}),
            )
            .await;
        assert!(r.content.contains("[truncated: 200 bytes"), "{r:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
