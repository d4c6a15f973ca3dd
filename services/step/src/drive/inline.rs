//! Built-in tools run inside the drive (docs/ARCHITECTURE.md "Inline tools"): the requests
//! the drive marks inline as it commits them, and the operations it then runs itself before it
//! decides again.

use kedge_core::Decision;
use kedge_core::event::{Draft, ToolRequested};
use kedge_core::fold::{OpStatus, RunState};
use kedge_core::ids::OperationId;
use kedge_runtime::failpoint;
use kedge_tool::{Chained, Handled, Inline, InlineRun};
use tokio::sync::watch;

use super::cache::gap;
use super::commit::Writing;
use super::{DriveError, Driver};

/// Most inline operations one drive runs: past them its requests go to the tool service, and
/// the run's next drive is woken by their results like any other's. A run whose agent loop
/// takes every step inline would otherwise hold one of the service's slots for its whole life.
pub const INLINE_PER_DRIVE: u32 = 256;

/// An inline request this drive journaled: its operation, request and stream sequence.
pub(super) struct Requested {
    op: OperationId,
    req: ToolRequested,
    /// Where it landed (set once it has).
    pub(super) seq: u64,
    /// The span of the step that requested it (exported spans only): the tool's span nests
    /// under it, as under a tool worker (the `traceparent` header of its `tool.requested`).
    traceparent: Option<String>,
}

impl Driver {
    /// Marks `draft` inline when it requests a built-in tool and this drive may still run one
    /// (`w.inline_budget`, counted against it); the request to note in `w.inline` once it has
    /// landed (its `seq` set), for [`Driver::run_inline`].
    pub(super) fn mark_inline(
        &self,
        w: &mut Writing<'_>,
        draft: &mut Draft<Decision>,
    ) -> Option<Requested> {
        let inline = self.inline.as_ref()?;
        let (Decision::ToolRequested(req), Some(op)) = (&draft.event, &draft.op) else {
            return None;
        };
        if w.inline_budget == 0 || !inline.runs(&req.tool) {
            return None;
        }
        w.inline_budget -= 1;
        let requested = Requested {
            op: op.clone(),
            req: req.clone(),
            seq: 0,
            traceparent: kedge_runtime::trace::current(),
        };
        draft.inline = true;
        Some(requested)
    }

    /// Runs the run's unfinished inline operations: those this drive just requested, and any
    /// another drive left unfinished (its process died, or the broker failed it mid-way). All
    /// at once; then what they journaled is folded: as it landed for one operation whose start
    /// and result are chained ([`fold_chain`]), else by reading the run again. Whether anything
    /// was journaled (the caller decides again); `false` when nothing was to run, or every
    /// operation is held by another runner (which journals its result, waking the run).
    pub(super) async fn run_inline(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        lost: &watch::Receiver<bool>,
    ) -> Result<bool, DriveError> {
        let Some(inline) = &self.inline else {
            return Ok(false);
        };
        let requested = std::mem::take(&mut w.inline);
        let unfinished: Vec<&OperationId> = state
            .ops
            .values()
            .filter(|o| {
                o.inline
                    && o.result.is_none()
                    && matches!(o.status, OpStatus::Requested | OpStatus::Started { .. })
            })
            .map(|o| &o.op)
            .collect();
        if unfinished.is_empty() || *lost.borrow() {
            return Ok(false);
        }
        failpoint::hit("step.before_inline_run");
        let cancel = state.cancel_requested.is_some();
        let mut runs = Vec::with_capacity(unfinished.len());
        for op in unfinished {
            let known = requested.iter().find(|r| r.op == *op);
            // One this drive did not request counts against its budget too: nothing runs
            // inline without end in one drive.
            if known.is_none() {
                if w.inline_budget == 0 {
                    continue;
                }
                w.inline_budget -= 1;
            }
            runs.push(run_one(inline, op, known, cancel, lost));
        }
        let mut journaled = false;
        let mut ran = Vec::with_capacity(runs.len());
        for run in futures::future::join_all(runs).await {
            let run = run?;
            journaled |= run.journaled;
            ran.push(run);
        }
        if !journaled {
            return Ok(false);
        }
        // One operation that ran, its start and result each stored on the message before it
        // (the hot path): folded as they landed. Anything else: the run is read again.
        let folded = match ran.as_slice() {
            [one] if matches!(one.handled, Handled::Ran) && w.stale_through.is_none() => {
                fold_chain(state, w, &one.chained)?
            }
            _ => false,
        };
        if !folded {
            w.stale_through = None;
            self.refresh(state, &mut w.skipped, None, None).await?;
        }
        // The runs list follows the run step by step, as between drives (coalesced).
        self.listing.after_drive(&self.rt, state).await;
        Ok(true)
    }
}

/// Folds `chained` into `state` when it links up from the state's last message, each stored
/// checked on the one before it (nothing of the run lies between them); what the links
/// stepped over is noted for the next read to check, as for the drive's own appends. Whether
/// it was folded (`false`: nothing was).
fn fold_chain(
    state: &mut RunState,
    w: &mut Writing<'_>,
    chained: &[Chained],
) -> Result<bool, DriveError> {
    let mut at = state.last_seq;
    for c in chained {
        if c.after != at {
            return Ok(false);
        }
        at = c.seq;
    }
    if chained.is_empty() {
        return Ok(false);
    }
    for c in chained {
        w.skipped.extend(gap(state.last_seq, c.seq));
        state.apply(c.seq, &c.envelope)?;
    }
    Ok(true)
}

/// What running one inline operation came to.
struct Ran {
    handled: Handled,
    /// Its handling journaled something.
    journaled: bool,
    /// What it appended chained ([`Chained`]).
    chained: Vec<Chained>,
}

/// Runs one inline operation. A failed attempt its retry policy retries is waited for here
/// (the drive keeps the lease meanwhile) and then decided again; broker trouble fails the
/// drive, which is tried again (its wake redelivered).
async fn run_one(
    inline: &Inline,
    op: &OperationId,
    known: Option<&Requested>,
    cancel: bool,
    lost: &watch::Receiver<bool>,
) -> Result<Ran, DriveError> {
    let InlineRun { handled, chained } = inline
        .run(
            op,
            known.map(|r| (&r.req, r.seq)),
            cancel,
            known.and_then(|r| r.traceparent.as_deref()),
        )
        .await
        .map_err(DriveError::Inline)?;
    let journaled = match &handled {
        Handled::Ran
        | Handled::Stored
        | Handled::Conflict
        | Handled::Confirmed
        | Handled::Ambiguous
        | Handled::Cancelled
        | Handled::Moved => true,
        Handled::Retrying {
            attempt,
            retry_in_ms,
        } => {
            tracing::info!(op = %op, attempt, retry_in_ms, "inline operation's next attempt after its backoff");
            let mut lost = lost.clone();
            tokio::select! {
                _ = tokio::time::sleep(std::time::Duration::from_millis(*retry_in_ms)) => {}
                _ = lost.wait_for(|l| *l) => {}
            }
            true
        }
        // Another runner holds it (a tool worker that adopted it), or it was given back
        // earlier: its runner's result wakes the run.
        Handled::Busy { retry_in_ms } => {
            tracing::debug!(op = %op, retry_in_ms, "inline operation held by another runner");
            false
        }
        Handled::Released => false,
        Handled::Refused { reason } => {
            tracing::warn!(op = %op, %reason, "inline operation refused");
            false
        }
    };
    Ok(Ran {
        handled,
        journaled,
        chained,
    })
}
