//! Running a shell command through a [`Sandbox`]: [`execute`], with its output capped while it
//! is read and its process group killed at the timeout, over the cap, or on drop.

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

use super::{Limits, Sandbox};

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
