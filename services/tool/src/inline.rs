//! Built-in tools run inside a step's drive (docs/ARCHITECTURE.md "Inline tools").
//!
//! A step service whose process also runs the tool service journals the request of a built-in
//! tool on the run's inline subject, which no tool service takes, and its drive runs the
//! operation itself through [`Inline::run`]: the same [`execute`] a tool worker runs for a
//! delivered request (claim, takeover of a gone runner's record, cancel and precondition
//! checks, `tool.started` and the tool, the retry verdict, the record and `tool.result`), with
//! the operation's start and result on the run's inline subjects, which wake no step: the
//! drive folds them itself and goes on. What else an operation may journal (a failed attempt
//! to retry, a confirmed or ambiguous outcome, a moved target) goes where a tool worker puts
//! it, and wakes the run as usual.
//!
//! The operation is announced in the process's heartbeats while it runs, as a tool worker's
//! is: if the process dies, the tool services adopt it (and the step services the run) at
//! once; the drive's own wake, not yet acknowledged, is redelivered otherwise.

use std::sync::Arc;

use kedge_core::event::ToolRequested;
use kedge_core::fold::handled_by_step;
use kedge_core::ids::OperationId;
use kedge_runtime::{Runtime, RuntimeError};
use tokio::sync::{Semaphore, mpsc, watch};
use tracing::Instrument;

use crate::builtin::Builtin;
use crate::claim::Look;
use crate::journaling::{Chained, Landed};
use crate::running::{Running, execute};
use crate::service::{Ctx, configured_sandbox};
use crate::{Handled, verify};

/// Runs built-in tools for a step's drives. Cheap to clone.
#[derive(Clone)]
pub struct Inline {
    ctx: Arc<Ctx>,
    /// At most `tool_concurrency` operations of this process's drives run at once (shared by
    /// every clone): the bound the tool service keeps on its deliveries, which one step asking
    /// for hundreds of calls would otherwise pass, one drive running them all at once.
    slots: Arc<Semaphore>,
    /// Held for as long as any clone lives: the stop signal [`Ctx`] reads (never sent), and
    /// the subscription that stops the operations of a cancelled run.
    _kept: Arc<Kept>,
}

impl std::fmt::Debug for Inline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inline").finish_non_exhaustive()
    }
}

/// What an [`Inline`] keeps alive.
struct Kept {
    _stop: watch::Sender<bool>,
    watching: tokio::task::JoinHandle<()>,
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.watching.abort();
    }
}

/// What running an inline operation came to: its handling, and the inputs it appended
/// chained, in the order they landed (its `tool.started` and `tool.result` on the hot path).
#[derive(Debug)]
pub struct InlineRun {
    pub handled: Handled,
    pub chained: Vec<Chained>,
}

/// Why an inline operation did not come to an answer: broker trouble (the drive is tried
/// again), or a request the journal does not hold as the run's.
#[derive(Debug, thiserror::Error)]
#[error("inline operation {op}: {reason}")]
pub struct InlineError {
    pub op: OperationId,
    /// Trying again later may succeed.
    pub retryable: bool,
    reason: String,
}

impl Inline {
    /// The tools of this process's step drives: the configured sandbox and workspace root, the
    /// process's failure detector, and the run's cancel listened to (an operation running when
    /// its run's cancel is requested is stopped, as in the tool service).
    pub async fn open(rt: &Runtime) -> Result<Inline, RuntimeError> {
        let sandbox = configured_sandbox(rt).await?;
        let liveness = rt.liveness().await?;
        let running = Running::default();
        let stopping = running.clone();
        let watching = rt
            .on_cancel_requests(move |run| stopping.stop_run(&run))
            .await?;
        // Nothing is kept for later here ([`crate::service`]'s `keep`): a retry's wait is the
        // drive's.
        let (again, _) = mpsc::unbounded_channel();
        let (stop, stopped) = watch::channel(false);
        let ctx = Ctx::new(rt, sandbox, running, liveness, again, stopped);
        Ok(Inline {
            ctx: Arc::new(ctx),
            slots: Arc::new(Semaphore::new(rt.config.tool_concurrency.max(1))),
            _kept: Arc::new(Kept {
                _stop: stop,
                watching,
            }),
        })
    }

    /// The same tools over another runtime of the process (a step driver's light lane).
    pub fn on(&self, rt: Runtime) -> Inline {
        Inline {
            ctx: Arc::new(self.ctx.on(rt)),
            slots: self.slots.clone(),
            _kept: self._kept.clone(),
        }
    }

    /// Whether `tool` is one a drive runs inline: a built-in tool the tool service would run
    /// (not one the step handles itself, such as `ask_user`).
    pub fn runs(&self, tool: &str) -> bool {
        !handled_by_step(tool) && Builtin::by_name(tool).is_some()
    }

    /// Runs operation `op` as a tool worker would its delivered request, and says what it
    /// appended chained. `requested`: its
    /// `tool.requested` as the drive just journaled it, and where (its `tool.started` is
    /// chained on it); `None` reads the operation's latest request from the journal (a drive
    /// that finds an inline operation unfinished). `cancel_requested`: what the drive's state
    /// says of the run's cancel, standing in for the runner's look at the journal (only for a
    /// request without a retry policy, whose look has nothing else to read). `traceparent`:
    /// the span of the step that requested it, which the tool's span nests under.
    pub async fn run(
        &self,
        op: &OperationId,
        requested: Option<(&ToolRequested, u64)>,
        cancel_requested: bool,
        traceparent: Option<&str>,
    ) -> Result<InlineRun, InlineError> {
        let failed = |retryable: bool, reason: String| InlineError {
            op: op.clone(),
            retryable,
            reason,
        };
        let read;
        let (req, requested_at) = match requested {
            Some((req, at)) => (req, Some(at)),
            None => {
                read = verify::latest(&self.ctx.rt.journal, op)
                    .await
                    .map_err(|e| {
                        let retryable =
                            matches!(&e, verify::CheckError::Journal(j) if j.is_retryable());
                        failed(retryable, e.to_string())
                    })?;
                (&read, None)
            }
        };
        let looked = req.limits.retry.is_none().then(|| Look {
            cancel_requested,
            ..Look::default()
        });
        let span = tracing::info_span!(
            "tool",
            run_id = %op.run(),
            op = %op,
            tool = %req.tool,
            attempt = tracing::field::Empty
        );
        if traceparent.is_some() {
            kedge_runtime::trace::set_parent(&span, traceparent);
        }
        // Held from the claim to the result; a retry's backoff, waited for by the drive, holds
        // none.
        let _slot = self
            .slots
            .acquire()
            .await
            .map_err(|e| failed(true, e.to_string()))?;
        let landed = Landed::default();
        let handled = execute(&self.ctx, op, req, looked, requested_at, Some(&landed))
            .instrument(span)
            .await
            .map_err(|e| failed(e.is_retryable(), e.to_string()))?;
        let chained = landed.into_inner().unwrap_or_default();
        Ok(InlineRun { handled, chained })
    }
}
