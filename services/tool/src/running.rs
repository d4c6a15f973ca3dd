//! Handling one request of an operation ([`execute`]): its claim, the takeover of a gone
//! runner's record, then running the tool under its timeout and the run's cancel, the retry
//! policy's verdict on a failed attempt, and the record and result written together
//! (docs/ARCHITECTURE.md "The tool service", "Tool retries", "Waiting and stopping").

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kedge_core::event::{Draft, Envelope, Event, Timestamp, ToolRequested, ToolStarted};
use kedge_core::ids::{InputId, OperationId, RunId};
use kedge_core::tools::{NextAttempt, ToolErrorClass, Verdict, claim_dispatch};
use kedge_journal::JournalError;
use kedge_runtime::idempotency::{Claim, Finished, IdempotencyError};
use kedge_runtime::metrics::{self, Takeover, ToolOutcome};
use kedge_runtime::{Runtime, failpoint};
use tokio::sync::watch;

use crate::builtin::{Confirm, Output};
use crate::claim::{Look, look, millis, next_attempt, until};
use crate::journaling::{
    journal_ambiguous, journal_attempt, journal_confirmed, journal_moved, journal_result,
    journal_result_after, keep_trying, record,
};
use crate::service::Ctx;
use crate::takeover::{IN_FLIGHT_POLL, already_journaled, count_confirm, settled_confirm};
use crate::target::{Ran, Target};
use crate::{Handled, ToolError, held};

/// The stop signal of one running operation.
type StopSignal = (OperationId, watch::Sender<bool>);

/// Stop signals of the operations running in this process, by run.
#[derive(Clone, Default)]
pub(crate) struct Running(Arc<Mutex<HashMap<RunId, Vec<StopSignal>>>>);

impl Running {
    pub(crate) fn register(&self, op: &OperationId) -> watch::Receiver<bool> {
        let (tx, rx) = watch::channel(false);
        if let Ok(mut map) = self.0.lock() {
            map.entry(op.run().clone())
                .or_default()
                .push((op.clone(), tx));
        }
        rx
    }

    /// Forgets `op`'s stop signals whose handling ended (its receiver is gone): another
    /// delivery of the same operation handled at the same time keeps its own.
    pub(crate) fn unregister(&self, op: &OperationId) {
        if let Ok(mut map) = self.0.lock()
            && let Some(ops) = map.get_mut(op.run())
        {
            ops.retain(|(o, tx)| o != op || !tx.is_closed());
            if ops.is_empty() {
                map.remove(op.run());
            }
        }
    }

    pub(crate) fn stop_run(&self, run: &RunId) {
        if let Ok(map) = self.0.lock()
            && let Some(ops) = map.get(run)
        {
            for (op, tx) in ops {
                tracing::info!(op = %op, "stopping: the run's cancellation was requested");
                let _ = tx.send(true);
            }
        }
    }
}

/// Handles one request of `op`; `looked`: the journal's [`look`], if the caller took it.
pub(crate) async fn execute(
    ctx: &Ctx,
    op: &OperationId,
    req: &ToolRequested,
    looked: Option<Look>,
    requested_at: Option<u64>,
) -> Result<Handled, ToolError> {
    let (rt, env) = (&ctx.rt, &ctx.env);
    let runner = &rt.config.worker_id;
    let target = Target::of(&req.tool, &ctx.mcp);
    // Announced in this process's heartbeats from before the claim until the outcome is
    // recorded: if this process dies meanwhile, a standby takes the operation over at once.
    let _hold = ctx.liveness.hold_op(op).await;
    // A panic here (a bug; or the test failpoint) is contained by the handler.
    failpoint::panic_point("tool.execute", op.run().as_str());
    let abandoned_after = rt.config.timeouts.op_abandoned_after();
    // Which attempt this is: always the first without a retry policy; under one, the journal's
    // to say (one more than the failed attempts of this dispatch it records), and not before
    // the last one's `retry_at` (unless the run is being cancelled: then the attempt is not
    // run, at once). Each attempt claims the record under its own number, greater than the
    // last one's (`claim_dispatch`), so it supersedes an attempt whose failure is journaled
    // without a confirm query, and one attempt of one dispatch runs at a time.
    let retried = req.retry.is_some();
    let (claim, cancel_requested, attempt) = if retried {
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
                return Ok(Handled::Busy {
                    retry_in_ms: millis(wait),
                });
            }
            let claim = rt
                .idempotency
                .claim_attempt(
                    op,
                    &req.args_digest,
                    runner,
                    claim_dispatch(req.redispatch, next.number, true),
                    claim_dispatch(req.redispatch, 1, true),
                    abandoned_after,
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
            break (claim, cancel_requested, next.number);
        }
    } else {
        // The journal's look (the cancel check) goes out with the claim.
        let (claim, looked) = futures::join!(
            rt.idempotency.claim(
                op,
                &req.args_digest,
                runner,
                req.redispatch,
                abandoned_after
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
        (
            claim,
            looked.cancel_requested && req.compensates.is_none(),
            1,
        )
    };
    let code = claim_dispatch(req.redispatch, attempt, retried);
    tracing::Span::current().record("attempt", attempt);
    let mut claim = claim?;
    // Held by a runner that is gone (the broker has no connection for it): abandoned now,
    // whatever the record's age; unless the runner's call went to an MCP server, where it may
    // still take effect (a dropped connection, or a dead runner's call the server goes on
    // with): such an operation is taken over only once its first attempt's deadline
    // (`tool_timeout + tool_grace` from its claim) has passed, and then the confirm query
    // decides (docs/ARCHITECTURE.md "Takeover"). A tool that honours the operation id may be
    // run again at once.
    // A server whose status query sees calls in flight is asked at once instead, without
    // taking the operation over: `confirmed` is taken over and used; `in_flight` is asked again
    // shortly; anything else waits for the deadline like any remote call (a `not_found` may be
    // a call still on its way to the server).
    // Under a retry policy, a gone runner's record of an earlier attempt whose failure the
    // journal already holds (the runner died between journaling it and giving its record
    // back) is finished: the attempt due now supersedes it, with nothing to ask.
    let gone_holder = match &claim {
        Claim::Held {
            runner: holder,
            dispatch,
            ..
        } if ctx.liveness.is_gone(holder).await => {
            Some((holder.clone(), retried && *dispatch < code))
        }
        _ => None,
    };
    let may_still_land = matches!(target, Target::Mcp { .. })
        && !req.retry.as_ref().is_some_and(|p| p.rerun_safe(&req.tool));
    let mut early = None;
    if let Some((holder, attempt_finished)) = gone_holder {
        let take_over = attempt_finished
            || !may_still_land
            || {
                early = target.early_confirm(env, &ctx.mcp, op).await;
                early.as_ref().inspect(|c| count_confirm(c));
                match (&early, &mut claim) {
                    (Some(Confirm::Confirmed(_)), _) => true,
                    (Some(Confirm::InFlight), Claim::Held { retry_in, .. }) => {
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
            claim = rt
                .idempotency
                .claim_from(
                    op,
                    &req.args_digest,
                    runner,
                    code,
                    claim_dispatch(req.redispatch, 1, retried),
                    abandoned_after,
                    Some(holder.as_str()),
                )
                .await?;
        }
    }
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
            return Ok(Handled::Stored);
        }
        Claim::Released => {
            tracing::info!(
                "this dispatch was given back earlier (its target moved); nothing to do"
            );
            return Ok(Handled::Released);
        }
        Claim::Conflict { stored } => {
            let out = Output::error(format!(
                "operation {op} was already requested with different arguments \
                 (digest {stored}, now {}); not executed",
                req.args_digest
            ));
            journal_result(rt, op, out, false).await?;
            metrics::tool_operation(ToolOutcome::Conflict);
            return Ok(Handled::Conflict);
        }
        Claim::Held {
            runner, retry_in, ..
        } => {
            tracing::info!(%runner, "held by a live runner");
            return Ok(Handled::Busy {
                retry_in_ms: u64::try_from(retry_in.as_millis())
                    .unwrap_or(u64::MAX)
                    .max(1),
            });
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
        } => {
            tracing::warn!(previous_runner = %previous, "operation left running by a runner that is gone");
            let heard = ctx.adopted.lock().ok().and_then(|mut a| a.remove(op));
            metrics::takeover(Takeover::Operation, heard.map(|at| at.elapsed()));
            if already_journaled(rt, op, revision, req, runner).await? {
                tracing::info!("its result is journaled; the record is finished from it");
                metrics::tool_operation(ToolOutcome::Stored);
                return Ok(Handled::Stored);
            }
            // A tool its retry policy declares idempotent honours the operation id: running it
            // again is the answer, with no need to ask whether it happened.
            let rerun_safe = req.retry.as_ref().is_some_and(|p| p.rerun_safe(&req.tool));
            let confirm = match early {
                _ if rerun_safe => None,
                // Asked just before the takeover.
                Some(confirmed @ Confirm::Confirmed(_)) => Some(confirmed),
                _ => settled_confirm(ctx, &target, op, abandoned_after).await,
            };
            match confirm {
                None | Some(Confirm::NotFound) => revision,
                Some(Confirm::Confirmed(out)) => {
                    record(rt, op, revision, req, runner, &out, Finished::Confirmed).await?;
                    failpoint::hit("tool.after_confirmed_record");
                    journal_confirmed(rt, op, out).await?;
                    metrics::tool_operation(ToolOutcome::Confirmed);
                    return Ok(Handled::Confirmed);
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
                    return Ok(Handled::Ambiguous);
                }
            }
        }
    };
    if cancel_requested {
        let out = Output::error("not run: the run's cancellation was requested");
        record(rt, op, revision, req, runner, &out, Finished::Stopped).await?;
        journal_result(rt, op, out, true).await?;
        metrics::tool_operation(ToolOutcome::Cancelled);
        return Ok(Handled::Cancelled);
    }
    if let Some(expected) = &req.expect_version {
        // The precondition: the target must still be where it was when the approval was asked.
        let found = target
            .version(env, op.run(), &req.arguments)
            .await
            .unwrap_or_else(|| "none".to_owned());
        if found != *expected {
            tracing::warn!(%expected, %found, "the approved target moved; not running");
            rt.idempotency
                .release(op, revision, &req.args_digest, runner, code)
                .await?;
            journal_moved(rt, op, req.redispatch, expected, found).await?;
            metrics::tool_operation(ToolOutcome::Moved);
            return Ok(Handled::Moved);
        }
    }
    let started = Envelope::new(
        op.run().clone(),
        Timestamp::now(),
        Draft::new(Event::ToolStarted(ToolStarted {
            runner: runner.clone(),
            attempt,
        }))
        .step(op.step())
        .op(op.clone()),
    );
    // A compensation is not stopped by the run's cancel (it is what the cancel asked for).
    let (_unstopped, never) = watch::channel(false);
    let stop = if req.compensates.is_some() {
        never
    } else {
        ctx.running.register(op)
    };
    // `tool.started` goes out first and its acknowledgement is awaited alongside the tool, not
    // before it; `tool.result` is appended only after both, so the journal keeps the order.
    let key = InputId::tool_started(op, revision);
    let limited = env.for_request(req);
    // Sensitive arguments are journaled sealed; the tool gets them in clear.
    let arguments = open_arguments(rt, op.run(), &req.arguments);
    // Chained (checked run-wide) on the request when this is its first attempt: the run's last
    // message then, unless something landed since (another tool of the step, an input), in
    // which case it goes out unchained at once. `tool.result` is chained on it in turn, and the
    // step reads the run by those links ([`kedge_journal::Journal::read_chained`]).
    let chain_on = requested_at.filter(|_| attempt == 1);
    let appended = rt
        .journal
        .append_input_after(&started, key.as_str(), chain_on);
    let (started, ran) = futures::join!(appended, async {
        let began = std::time::Instant::now();
        let ran = match &arguments {
            Ok(arguments) => target.run(&limited, &ctx.mcp, op, arguments, stop).await,
            Err(e) => Ran::Done {
                out: Output::error(format!("not run: {e}")),
                stopped: false,
            },
        };
        metrics::tool_call(began.elapsed());
        ran
    });
    ctx.running.unregister(op);
    let chained = match started {
        Ok(started) => started.chained.then_some(started.seq),
        Err(JournalError::Duplicate { .. }) => None,
        Err(e) => {
            // The tool ran: its record and result still go in (and a failure there is retried;
            // the record then answers without running it again).
            tracing::warn!(error = %e, "tool.started not journaled");
            None
        }
    };
    failpoint::hit("tool.after_effect");
    let (out, stopped) = match ran {
        Ran::Done { out, stopped } => (out, stopped),
        // A tool its policy declares safe to run again: a lost connection is one more
        // transient failure, for the policy to retry.
        Ran::CutOff(detail) if req.retry.as_ref().is_some_and(|p| p.rerun_safe(&req.tool)) => {
            (Output::failed(detail, ToolErrorClass::Transient), false)
        }
        Ran::CutOff(detail) => {
            // The record stays `running`: a person decides (`outcome.resolved`), and a retry
            // re-dispatches under the same id. Never retried automatically.
            journal_ambiguous(rt, op, req.redispatch, detail).await?;
            metrics::tool_operation(ToolOutcome::Ambiguous);
            return Ok(Handled::Ambiguous);
        }
    };
    let mut out = match target {
        Target::Unknown => Output::error(format!("unknown tool `{}`", req.tool)),
        _ => out,
    };
    if out.is_error
        && !stopped
        && let Some(policy) = &req.retry
    {
        match policy.after_failure(&req.tool, attempt, out.class, kedge_runtime::jitter_draw()) {
            Verdict::Retry { next, delay } => {
                let class = out.class.unwrap_or(ToolErrorClass::Transient);
                tracing::info!(attempt, %class, delay_ms = delay.as_millis(), "attempt failed; retrying");
                metrics::tool_retried(class);
                // The failure first, then the record given back: a runner that finds the
                // record still held at this attempt's number after a crash in between reads
                // the failure and claims the next number over it.
                journal_attempt(rt, op, req.redispatch, attempt, class, out.content, delay).await?;
                rt.idempotency
                    .release(op, revision, &req.args_digest, runner, code)
                    .await?;
                return Ok(Handled::Retrying {
                    attempt: next,
                    retry_in_ms: millis(delay),
                });
            }
            Verdict::GiveUp(why) => {
                if attempt > 1 || out.class.is_some() {
                    tracing::info!(attempt, %why, "attempt failed; the model gets the error");
                    out.content = format!(
                        "{}\n[attempt {attempt} of {}: {why}]",
                        out.content,
                        policy.max_attempts()
                    );
                }
            }
        }
    }
    let how = if stopped {
        Finished::Stopped
    } else {
        Finished::Ran
    };
    let outcome = match (stopped, out.is_error) {
        (true, _) => ToolOutcome::Stopped,
        (false, true) => ToolOutcome::Failed,
        (false, false) => ToolOutcome::Succeeded,
    };
    // The record and the result go out together (one round trip, not two, before the run
    // moves on). A result journaled before its record is finished (a crash in between, or a
    // record write that failed) leaves the record `running`; whoever takes it over reads the
    // result from the journal before anything else ([`already_journaled`]) and never runs the
    // operation again.
    let (recorded, journaled) = futures::join!(
        async {
            if failpoint::fires("tool.record_lost", op.run().as_str()) {
                return Ok(());
            }
            keep_trying(ctx, "its record", None, || {
                record(rt, op, revision, req, runner, &out, how)
            })
            .await
        },
        async {
            if failpoint::fires("tool.result_lost", op.run().as_str()) {
                return Ok(());
            }
            let held = held::HeldResult {
                op: op.clone(),
                content: out.content.clone(),
                is_error: out.is_error,
                stopped,
            };
            keep_trying(ctx, "its result", Some(&held), || {
                journal_result_after(rt, op, out.clone(), stopped, chained)
            })
            .await
        }
    );
    failpoint::hit("tool.after_record");
    journaled?;
    match recorded {
        Ok(()) => {}
        // Taken over while this runner was away (a dropped connection outlasted the call's
        // deadline): the result is journaled all the same (the same msg id as anything the
        // taker journals: at most one lands), and the taker's record stands.
        Err(ToolError::Idempotency(IdempotencyError::Raced { .. })) => {
            tracing::warn!(
                "the operation was taken over while its call ran; its record is the taker's (the result is journaled)"
            );
            metrics::fenced_write(metrics::Fenced::OpRecord);
        }
        // The run has its result; the record is finished by the next claim of the operation.
        Err(e) => tracing::warn!(error = %e, "tool.result journaled but its record not finished"),
    }
    metrics::tool_operation(outcome);
    Ok(Handled::Ran)
}

/// An operation's arguments with the run's sealed values opened ([`kedge_runtime::seal`]).
pub(crate) fn open_arguments<'a>(
    rt: &Runtime,
    run: &RunId,
    arguments: &'a serde_json::Value,
) -> Result<std::borrow::Cow<'a, serde_json::Value>, kedge_runtime::seal::SealError> {
    if !kedge_runtime::seal::holds_sealed(arguments) {
        return Ok(std::borrow::Cow::Borrowed(arguments));
    }
    let mut opened = arguments.clone();
    kedge_runtime::seal::open_all(rt.seal.as_ref(), run, &mut opened)?;
    Ok(std::borrow::Cow::Owned(opened))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kedge_core::StepNo;

    #[tokio::test]
    async fn a_finished_handling_leaves_the_stop_signal_of_another_of_the_same_operation() {
        let run: RunId = "run_x".parse().expect("run id");
        let op = OperationId::new(&run, StepNo(1), 0);
        let running = Running::default();
        let first = running.register(&op);
        let mut second = running.register(&op);
        // The first handling ends (its receiver goes) and forgets its signal only.
        drop(first);
        running.unregister(&op);
        running.stop_run(&run);
        assert!(
            second.wait_for(|s| *s).await.is_ok(),
            "the other is still stopped by a cancel"
        );
        drop(second);
        running.unregister(&op);
        assert!(running.0.lock().expect("lock").is_empty());
    }
}
