//! Operations of runners that are gone, or records past their abandonment age: whether the
//! record may be taken over now, the confirm (status) query that decides what the earlier
//! attempt did, and the result a taker finds already journaled (docs/ARCHITECTURE.md
//! "Takeover: the failure detector", "The tool service").

use std::ops::ControlFlow;
use std::time::Duration;

use kedge_core::event::{Event, EventType, ToolRequested};
use kedge_core::ids::{OperationId, WorkerId};
use kedge_core::tools::{claim_dispatch, supersedes};
use kedge_runtime::idempotency::{Claim, Finished};
use kedge_runtime::metrics::{self, ConfirmResult, Takeover, ToolOutcome};
use kedge_runtime::{Runtime, failpoint};

use crate::builtin::{Confirm, Output};
use crate::journaling::{journal_ambiguous, journal_confirmed, record};
use crate::running::Handling;
use crate::service::Ctx;
use crate::target::Target;
use crate::{Handled, ToolError};

/// How often a confirm query that answered "still in flight" is asked again.
const IN_FLIGHT_POLL: Duration = Duration::from_millis(500);

/// A record held by a runner that is gone, taken over when it may be now; returns the answer of
/// the status query asked before the takeover, if one was.
///
/// Held by a runner that is gone (the broker has no connection for it): abandoned now,
/// whatever the record's age; unless the runner's call went to an MCP server, where it may
/// still take effect (a dropped connection, or a dead runner's call the server goes on
/// with): such an operation is taken over only once its first attempt's deadline
/// (`tool_timeout + tool_grace` from its claim) has passed, and then the confirm query
/// decides (docs/ARCHITECTURE.md "Takeover"). A tool that honours the operation id may be
/// run again at once.
/// A server whose status query sees calls in flight is asked at once instead, without
/// taking the operation over: `confirmed` is taken over and used; `in_flight` is asked again
/// shortly; anything else waits for the deadline like any remote call (a `not_found` may be
/// a call still on its way to the server).
/// Under a retry policy, a gone runner's record of an earlier attempt whose failure the
/// journal already holds (the runner died between journaling it and giving its record
/// back) is finished: the attempt due now supersedes it, with nothing to ask.
pub(crate) async fn take_over_gone(
    h: &Handling<'_>,
    claim: &mut Claim,
    code: u32,
) -> Result<Option<Confirm>, ToolError> {
    let (ctx, op, req, target) = (h.ctx, h.op, h.req, &h.target);
    let gone_holder = match &*claim {
        Claim::Held {
            runner: holder,
            dispatch,
            ..
        } if holder_is_gone(ctx, holder).await => Some((holder.clone(), *dispatch)),
        _ => None,
    };
    let may_still_land = matches!(target, Target::Mcp { .. })
        && !req
            .limits
            .retry
            .as_ref()
            .is_some_and(|p| p.rerun_safe(&req.tool));
    let mut early = None;
    if let Some((holder, dispatch)) = gone_holder {
        // The gone runner's record is taken over at once, before any status query, when the
        // journal superseded it (an earlier attempt whose failure it holds) or its call cannot
        // still land (not a remote call, or one of a tool safe to run again).
        let first = claim_dispatch(req.redispatch, 1, h.retried);
        let take_over = supersedes(dispatch, code, first, true)
            || !may_still_land
            || {
                early = target.early_confirm(&ctx.env, &ctx.mcp, op).await;
                early.as_ref().inspect(|c| count_confirm(c));
                match (after_early(early.as_ref()), &mut *claim) {
                    (Early::TakeOver, _) => true,
                    (Early::AskAgain, Claim::Held { retry_in, .. }) => {
                        tracing::info!(runner = %holder, "the runner of this remote call is gone, and its server is still running the call: asking again shortly");
                        metrics::remote_call_waited();
                        *retry_in = IN_FLIGHT_POLL;
                        false
                    }
                    (_, claim) => {
                        let retry_in = match claim {
                            Claim::Held { retry_in, .. } => retry_in.as_millis() as u64,
                            _ => 0,
                        };
                        tracing::info!(runner = %holder, retry_in_ms = retry_in, "the runner of this remote call is gone, but the call may still take effect: waiting for its deadline");
                        metrics::remote_call_waited();
                        false
                    }
                }
            };
        if take_over {
            *claim = ctx
                .rt
                .idempotency
                .claim_from(
                    op,
                    &req.args_digest,
                    h.runner,
                    code,
                    first,
                    h.abandoned_after,
                    Some(holder.as_str()),
                )
                .await?;
        }
    }
    Ok(early)
}

/// Whether the runner a record names is gone: a name that is no worker id is no Kedge
/// process's (nobody heartbeats or answers for it).
async fn holder_is_gone(ctx: &Ctx, holder: &str) -> bool {
    match holder.parse::<WorkerId>() {
        Ok(worker) => ctx.liveness.is_gone(&worker).await,
        Err(_) => true,
    }
}

/// What the status query asked before a takeover ([`Target::early_confirm`]) says of a remote
/// call whose runner is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Early {
    /// It took effect: take the record over and use its result.
    TakeOver,
    /// Its server is still running it: ask again after [`IN_FLIGHT_POLL`].
    AskAgain,
    /// No early answer, or one that proves nothing yet (`not_found` may be a call still on its
    /// way): wait for the call's deadline.
    AwaitDeadline,
}

/// What `early`, the answer of [`Target::early_confirm`] if it gave one, means ([`Early`]).
fn after_early(early: Option<&Confirm>) -> Early {
    match early {
        Some(Confirm::Confirmed(_)) => Early::TakeOver,
        Some(Confirm::InFlight) => Early::AskAgain,
        _ => Early::AwaitDeadline,
    }
}

/// A record this runner took over from one that is gone (`previous`), not redispatched: the
/// takeover is counted, then a result already journaled finishes it ([`already_journaled`]);
/// else the confirm query (`early`, if asked before the takeover, or [`settled_confirm`])
/// decides: the revision to run it again under, or the request's answer (`outcome.confirmed`
/// or `outcome.ambiguous` journaled).
pub(crate) async fn taken_over(
    h: &Handling<'_>,
    revision: u64,
    previous: String,
    early: Option<Confirm>,
) -> Result<ControlFlow<Handled, u64>, ToolError> {
    let (ctx, op, req, runner) = (h.ctx, h.op, h.req, h.runner);
    let rt = &ctx.rt;
    tracing::warn!(previous_runner = %previous, "operation left running by a runner that is gone");
    let heard = ctx.adopted.lock().ok().and_then(|mut a| a.remove(op));
    metrics::takeover(Takeover::Operation, heard.map(|at| at.elapsed()));
    if already_journaled(rt, op, revision, req, runner).await? {
        tracing::info!("its result is journaled; the record is finished from it");
        metrics::tool_operation(ToolOutcome::Stored);
        return Ok(ControlFlow::Break(Handled::Stored));
    }
    // A tool its retry policy declares idempotent honours the operation id: running it
    // again is the answer, with no need to ask whether it happened.
    let rerun_safe = req
        .limits
        .retry
        .as_ref()
        .is_some_and(|p| p.rerun_safe(&req.tool));
    let confirm = match early {
        _ if rerun_safe => None,
        // Asked just before the takeover.
        Some(confirmed @ Confirm::Confirmed(_)) => Some(confirmed),
        _ => settled_confirm(ctx, &h.target, op, h.abandoned_after).await,
    };
    match confirm {
        None | Some(Confirm::NotFound) => Ok(ControlFlow::Continue(revision)),
        Some(Confirm::Confirmed(out)) => {
            record(rt, op, revision, req, runner, &out, Finished::Confirmed).await?;
            failpoint::hit("tool.after_confirmed_record");
            journal_confirmed(rt, op, out).await?;
            metrics::tool_operation(ToolOutcome::Confirmed);
            Ok(ControlFlow::Break(Handled::Confirmed))
        }
        Some(unsettled @ (Confirm::Ambiguous(_) | Confirm::InFlight)) => {
            // Never retried automatically: the run waits in `unknown` for a person
            // (`outcome.resolved`). (`settled_confirm` has waited an in-flight call out
            // already, up to its bound.)
            let detail = match unsettled {
                Confirm::Ambiguous(detail) => detail,
                _ => "its server still reports the call in flight".to_owned(),
            };
            journal_ambiguous(rt, op, req.redispatch, detail).await?;
            metrics::tool_operation(ToolOutcome::Ambiguous);
            Ok(ControlFlow::Break(Handled::Ambiguous))
        }
    }
}

/// Counts a confirm query's answer in `kedge_confirm_queries_total`.
fn count_confirm(confirm: &Confirm) {
    metrics::confirm_query(match confirm {
        Confirm::Confirmed(_) => ConfirmResult::Confirmed,
        Confirm::NotFound => ConfirmResult::NotFound,
        Confirm::InFlight => ConfirmResult::InFlight,
        Confirm::Ambiguous(_) => ConfirmResult::Ambiguous,
    });
}

/// The confirm query of an operation taken over from a gone runner, asked again while the
/// target answers that the call is still in flight (every [`IN_FLIGHT_POLL`], up to `bound`:
/// the first attempt's deadline and grace, counted again from now). Still in flight after
/// that, it is a question for a person, as a call whose server cannot tell. Each answer is
/// counted in `kedge_confirm_queries_total`.
async fn settled_confirm(
    ctx: &Ctx,
    target: &Target,
    op: &OperationId,
    bound: Duration,
) -> Option<Confirm> {
    let until = tokio::time::Instant::now() + bound;
    loop {
        let confirm = target.confirm(&ctx.env, &ctx.mcp, op).await;
        confirm.as_ref().inspect(|c| count_confirm(c));
        if !matches!(confirm, Some(Confirm::InFlight)) {
            return confirm;
        }
        if tokio::time::Instant::now() + IN_FLIGHT_POLL > until {
            return Some(Confirm::Ambiguous(ctx.env.truncate(format!(
                "its server still reports the call in flight {} s after it was taken over",
                bound.as_secs()
            ))));
        }
        tracing::info!(
            "the call is still in flight where it runs; asking again in {} ms",
            IN_FLIGHT_POLL.as_millis()
        );
        tokio::time::sleep(IN_FLIGHT_POLL).await;
    }
}

/// After a claim took an abandoned record over: the operation's result, when the journal has
/// one. The record of an operation that ran is finished and its result journaled at once
/// (`execute`), so a runner that died in between can leave a `running` record behind a result
/// the run already has: the record is finished from the journal and nothing runs again.
async fn already_journaled(
    rt: &Runtime,
    op: &OperationId,
    revision: u64,
    req: &ToolRequested,
    runner: &WorkerId,
) -> Result<bool, ToolError> {
    let results = rt
        .journal
        .read_type(op.run(), EventType::ToolResult)
        .await?;
    let Some(result) = results.iter().find_map(|r| match &r.envelope.event {
        Event::ToolResult(result) if r.envelope.op.as_ref() == Some(op) => Some(result),
        _ => None,
    }) else {
        return Ok(false);
    };
    let how = if result.stopped {
        Finished::Stopped
    } else {
        Finished::Ran
    };
    let out = Output {
        content: result.content.clone(),
        is_error: result.is_error,
        class: None,
    };
    record(rt, op, revision, req, runner, &out, how).await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_confirmed_early_answer_takes_over_and_only_in_flight_asks_again() {
        let confirmed = Confirm::Confirmed(Output::ok("done"));
        assert_eq!(after_early(Some(&confirmed)), Early::TakeOver);
        assert_eq!(after_early(Some(&Confirm::InFlight)), Early::AskAgain);
        // Before the deadline a `not_found` may be a call still on its way to the server.
        assert_eq!(after_early(Some(&Confirm::NotFound)), Early::AwaitDeadline);
        let ambiguous = Confirm::Ambiguous("cannot tell".into());
        assert_eq!(after_early(Some(&ambiguous)), Early::AwaitDeadline);
        // A server that does not see calls in flight is not asked before the deadline.
        assert_eq!(after_early(None), Early::AwaitDeadline);
    }
}
