//! Which attempt a request is, and the claim of its record: the runner's one look at the
//! journal before an operation (its cancel, its trace context, where its retries stand), the
//! next attempt's number and when it is due, the claim in `kedge_idempotency` under that
//! number, and what the claim came to (docs/ARCHITECTURE.md "The tool service", "Tool
//! retries").

use std::ops::ControlFlow;
use std::time::Duration;

use kedge_core::event::{Event, EventType, Timestamp, ToolRequested};
use kedge_core::ids::OperationId;
use kedge_core::tools::{NextAttempt, claim_dispatch};
use kedge_runtime::Runtime;
use kedge_runtime::idempotency::{Claim, Finished, IdempotencyError};
use kedge_runtime::metrics::{self, ToolOutcome};

use crate::builtin::{Confirm, Output};
use crate::journaling::{journal_confirmed, journal_result};
use crate::running::Handling;
use crate::service::Ctx;
use crate::{Handled, ToolError, takeover};

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
    if req.limits.retry.is_some() {
        types.push(EventType::ToolAttempt);
    }
    let found = match ctx.rt.journal.last_of(op.run(), &types).await {
        Ok(found) => found,
        Err(e) if req.limits.retry.is_some() => return Err(e.into()),
        Err(e) => {
            tracing::warn!(run_id = %op.run(), error = %e, "cannot check for a cancel request");
            return Ok(Look::default());
        }
    };
    let mut out = Look {
        next: req.limits.retry.as_ref().map(|_| NextAttempt::FIRST),
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

/// The claim of the attempt a request makes, and what was learned on the way.
pub(crate) struct Claimed {
    /// The claim's answer (an error is the caller's to return, once the attempt's number is on
    /// its span).
    pub(crate) claim: Result<Claim, IdempotencyError>,
    /// The run's cancellation was requested and stops this attempt (never a compensation's).
    pub(crate) cancel_requested: bool,
    /// The attempt's number: always 1 without a retry policy.
    pub(crate) attempt: u32,
}

/// Which attempt this request makes, and its claim; or, under a retry policy, the answer that
/// the attempt is not due yet.
pub(crate) async fn claim(
    h: &Handling<'_>,
    looked: Option<Look>,
) -> Result<ControlFlow<Handled, Claimed>, ToolError> {
    // Which attempt this is: always the first without a retry policy; under one, the journal's
    // to say (one more than the failed attempts of this dispatch it records), and not before
    // the last one's `retry_at` (unless the run is being cancelled: then the attempt is not
    // run, at once). Each attempt claims the record under its own number, greater than the
    // last one's (`claim_dispatch`), so it supersedes an attempt whose failure is journaled
    // without a confirm query, and one attempt of one dispatch runs at a time.
    if h.retried {
        claim_attempt(h, looked).await
    } else {
        Ok(ControlFlow::Continue(claim_once(h, looked).await))
    }
}

/// Under a retry policy: the attempt the journal numbers next, claimed under its number once
/// it is due.
async fn claim_attempt(
    h: &Handling<'_>,
    looked: Option<Look>,
) -> Result<ControlFlow<Handled, Claimed>, ToolError> {
    let (ctx, op, req) = (h.ctx, h.op, h.req);
    let rt = &ctx.rt;
    let looked = match looked {
        Some(looked) => looked,
        None => look(ctx, op, req, false).await?,
    };
    // A compensation runs because the run is cancelled (or failed): its cancel does not
    // stop it.
    let cancel_requested = looked.cancel_requested && req.compensates.is_none();
    let mut next = looked.next.unwrap_or(NextAttempt::FIRST);
    loop {
        if !cancel_requested
            && let Some(due) = next.due
            && let Some(wait) = until(due)
        {
            tracing::info!(
                attempt = next.number,
                wait_ms = wait.as_millis(),
                "next attempt not due yet"
            );
            return Ok(ControlFlow::Break(Handled::Busy {
                retry_in_ms: millis(wait),
            }));
        }
        let claim = rt
            .idempotency
            .claim_attempt(
                op,
                &req.args_digest,
                h.runner,
                claim_dispatch(req.redispatch, next.number, true),
                claim_dispatch(req.redispatch, 1, true),
                h.abandoned_after,
            )
            .await;
        // A record given back at this number: either that attempt's failure landed since
        // the journal was read (read again: the next number is free), or the dispatch was
        // given back without running (its target moved): nothing to do. Numbers only go
        // up, so this ends.
        if let Ok(Claim::Released) = claim {
            let again = next_attempt(rt, op, req.redispatch).await?;
            if again.number > next.number {
                tracing::info!(
                    attempt = again.number,
                    "the previous attempt was given back since the journal was read"
                );
                next = again;
                continue;
            }
        }
        break Ok(ControlFlow::Continue(Claimed {
            claim,
            cancel_requested,
            attempt: next.number,
        }));
    }
}

/// Without a retry policy: the one attempt's claim, with the journal's look beside it.
async fn claim_once(h: &Handling<'_>, looked: Option<Look>) -> Claimed {
    let (ctx, op, req) = (h.ctx, h.op, h.req);
    // The journal's look (the cancel check) goes out with the claim.
    let (claim, looked) = futures::join!(
        ctx.rt.idempotency.claim(
            op,
            &req.args_digest,
            h.runner,
            req.redispatch,
            h.abandoned_after
        ),
        async {
            match looked {
                Some(looked) => looked,
                // A compensation's cancel check would be ignored (below): not made.
                None if req.compensates.is_some() => Look::default(),
                None => look(ctx, op, req, false).await.unwrap_or_default(),
            }
        }
    );
    Claimed {
        claim,
        cancel_requested: looked.cancel_requested && req.compensates.is_none(),
        attempt: 1,
    }
}

/// What the claim came to: the record's revision when this runner is to run the operation,
/// or the request's answer: a stored result journaled as its finisher journals it, a dispatch
/// given back, a conflict, a live holder's, or a taken-over operation the confirm query
/// settled ([`takeover::taken_over`]; `early`: the status query asked before the takeover).
pub(crate) async fn outcome(
    h: &Handling<'_>,
    claim: Claim,
    early: Option<Confirm>,
) -> Result<ControlFlow<Handled, u64>, ToolError> {
    let (rt, op, req) = (&h.ctx.rt, h.op, h.req);
    let revision = match claim {
        Claim::Fresh { revision } => revision,
        Claim::Done {
            content,
            is_error,
            how,
        } => {
            tracing::info!("operation already done; journaling its stored result");
            let out = Output {
                content,
                is_error,
                class: None,
            };
            // As its finisher journals it (which may still be on its way: the same msg id).
            match how {
                Finished::Ran => journal_result(rt, op, out, false).await?,
                Finished::Stopped => journal_result(rt, op, out, true).await?,
                Finished::Confirmed => journal_confirmed(rt, op, out).await?,
            }
            metrics::tool_operation(ToolOutcome::Stored);
            return Ok(ControlFlow::Break(Handled::Stored));
        }
        Claim::Released => {
            tracing::info!(
                "this dispatch was given back earlier (its target moved); nothing to do"
            );
            return Ok(ControlFlow::Break(Handled::Released));
        }
        Claim::Conflict { stored } => {
            let out = Output::error(format!(
                "operation {op} was already requested with different arguments \
                 (digest {stored}, now {}); not executed",
                req.args_digest
            ));
            journal_result(rt, op, out, false).await?;
            metrics::tool_operation(ToolOutcome::Conflict);
            return Ok(ControlFlow::Break(Handled::Conflict));
        }
        Claim::Held {
            runner, retry_in, ..
        } => {
            tracing::info!(%runner, "held by a live runner");
            return Ok(ControlFlow::Break(Handled::Busy {
                retry_in_ms: busy_ms(retry_in),
            }));
        }
        // The journal says the earlier dispatch did not happen (not found, or a person chose to
        // retry): run it again under the same id.
        Claim::TakenOver {
            revision,
            redispatched: true,
            ..
        } => revision,
        Claim::TakenOver {
            revision, previous, ..
        } => return takeover::taken_over(h, revision, previous, early).await,
    };
    Ok(ControlFlow::Continue(revision))
}

/// The wait a live holder's claim answers with (`retry_in`), in whole milliseconds and at
/// least one: a request kept for it is handled anew no sooner.
fn busy_ms(retry_in: Duration) -> u64 {
    u64::try_from(retry_in.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The next attempt of dispatch `dispatch` of `op`, from the run's journaled `tool.attempt`s
/// (a read of that one event type, checked against the leader like every journal read).
async fn next_attempt(
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
fn until(due: Timestamp) -> Option<Duration> {
    wait_until(due, Timestamp::now())
}

/// How long from `now` until `due`, in whole milliseconds, if that is at least one.
fn wait_until(due: Timestamp, now: Timestamp) -> Option<Duration> {
    let ms = (due.0 - now.0).whole_milliseconds();
    (ms > 0).then(|| Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX)))
}

/// A duration in whole milliseconds, `u64::MAX` past it.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_due_ahead_is_waited_for_in_whole_milliseconds() {
        let now = Timestamp::now();
        let due = now.saturating_add(Duration::from_millis(1_500));
        assert_eq!(wait_until(due, now), Some(Duration::from_millis(1_500)));
        let due = now.saturating_add(Duration::from_micros(2_700));
        assert_eq!(wait_until(due, now), Some(Duration::from_millis(2)));
    }

    #[test]
    fn an_attempt_due_now_or_past_or_within_a_millisecond_is_not_waited_for() {
        let earlier = Timestamp::now();
        let now = earlier.saturating_add(Duration::from_secs(1));
        assert_eq!(wait_until(now, now), None);
        assert_eq!(wait_until(earlier, now), None);
        let within = now.saturating_add(Duration::from_micros(400));
        assert_eq!(wait_until(within, now), None);
    }

    #[test]
    fn millis_saturate() {
        assert_eq!(millis(Duration::ZERO), 0);
        assert_eq!(millis(Duration::from_micros(1_999)), 1);
        assert_eq!(millis(Duration::from_secs(90)), 90_000);
        assert_eq!(millis(Duration::MAX), u64::MAX);
    }

    #[test]
    fn a_live_holders_wait_is_at_least_a_millisecond() {
        // A request kept for no time at all would be handled anew at once, over and over.
        assert_eq!(busy_ms(Duration::ZERO), 1);
        assert_eq!(busy_ms(Duration::from_micros(300)), 1);
        assert_eq!(busy_ms(Duration::from_millis(2_500)), 2_500);
        assert_eq!(busy_ms(Duration::MAX), u64::MAX);
    }
}
