//! Which attempt a request is, and the claim of its record: the runner's one look at the
//! journal before an operation (its cancel, its trace context, where its retries stand), the
//! next attempt's number and when it is due, and the claim in `kedge_idempotency` under that
//! number (docs/ARCHITECTURE.md "The tool service", "Tool retries").

use std::time::Duration;

use kedge_core::event::{Event, EventType, Timestamp, ToolRequested};
use kedge_core::ids::OperationId;
use kedge_core::tools::NextAttempt;
use kedge_runtime::Runtime;

use crate::ToolError;
use crate::service::Ctx;

/// What a runner's one look at the journal before an operation found ([`look`]).
#[derive(Debug, Default)]
pub(crate) struct Look {
    /// The run's `traceparent` (looked for only when spans are exported).
    pub(crate) traceparent: Option<String>,
    /// The run's cancellation was requested (best effort: no, when it could not be read).
    pub(crate) cancel_requested: bool,
    /// Under a retry policy: the attempt to make next.
    pub(crate) next: Option<NextAttempt>,
}

/// The runner's one read of the journal for an operation: one batched direct get of the last
/// `run.created` (only when spans are exported: its trace context), `cancel.requested` and,
/// under a retry policy, `tool.attempt` of the run. The last `tool.attempt` says where the
/// dispatch stands when it is this operation's, of this dispatch (attempts are journaled in
/// order: attempt n+1 is claimed only once n's failure is read); another operation's or
/// dispatch's sends the runner to read all of the run's `tool.attempt`s ([`next_attempt`]).
/// Without a policy a broker error is no error (the cancel check is best effort).
pub(crate) async fn look(
    ctx: &Ctx,
    op: &OperationId,
    req: &ToolRequested,
    trace: bool,
) -> Result<Look, ToolError> {
    let mut types = Vec::with_capacity(3);
    if trace {
        types.push(EventType::RunCreated);
    }
    types.push(EventType::CancelRequested);
    if req.retry.is_some() {
        types.push(EventType::ToolAttempt);
    }
    let found = match ctx.rt.journal.last_of(op.run(), &types).await {
        Ok(found) => found,
        Err(e) if req.retry.is_some() => return Err(e.into()),
        Err(e) => {
            tracing::warn!(run_id = %op.run(), error = %e, "cannot check for a cancel request");
            return Ok(Look::default());
        }
    };
    let mut out = Look {
        next: req.retry.as_ref().map(|_| NextAttempt::FIRST),
        ..Look::default()
    };
    for r in found {
        match &r.envelope.event {
            Event::RunCreated(c) => out.traceparent = c.traceparent.clone(),
            Event::CancelRequested(_) => out.cancel_requested = true,
            Event::ToolAttempt(a) => {
                let mine = r.envelope.op.as_ref() == Some(op) && a.dispatch == req.redispatch;
                out.next = match NextAttempt::FIRST.after(a, r.envelope.at) {
                    Some(next) if mine => Some(next),
                    _ => Some(next_attempt(&ctx.rt, op, req.redispatch).await?),
                };
            }
            _ => {}
        }
    }
    Ok(out)
}

/// The next attempt of dispatch `dispatch` of `op`, from the run's journaled `tool.attempt`s
/// (a read of that one event type, checked against the leader like every journal read).
pub(crate) async fn next_attempt(
    rt: &Runtime,
    op: &OperationId,
    dispatch: u32,
) -> Result<NextAttempt, ToolError> {
    let recorded = rt
        .journal
        .read_type(op.run(), EventType::ToolAttempt)
        .await?;
    let attempts = recorded.iter().filter_map(|r| match &r.envelope.event {
        Event::ToolAttempt(a) if r.envelope.op.as_ref() == Some(op) => Some((a, r.envelope.at)),
        _ => None,
    });
    Ok(kedge_core::tools::next_attempt(attempts, dispatch))
}

/// How long until `due`, if it is still ahead.
pub(crate) fn until(due: Timestamp) -> Option<Duration> {
    let ms = (due.0 - Timestamp::now().0).whole_milliseconds();
    (ms > 0).then(|| Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX)))
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
