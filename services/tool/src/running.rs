//! Handling one request of an operation ([`execute`]): its claim, the takeover of a gone
//! runner's record, then running the tool under its timeout and the run's cancel, the retry
//! policy's verdict on a failed attempt, and the record and result written together
//! (docs/ARCHITECTURE.md "The tool service", "Tool retries", "Waiting and stopping").

use kedge_core::Input;
use kedge_core::InputEnvelope;
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kedge_core::event::{Draft, Timestamp, ToolRequested, ToolStarted};
use kedge_core::ids::{InputId, OperationId, RunId, WorkerId};
use kedge_core::tools::{GiveUp, ToolErrorClass, Verdict, claim_dispatch};
use kedge_runtime::idempotency::{Finished, IdempotencyError};
use kedge_runtime::metrics::{self, ToolOutcome};
use kedge_runtime::{Runtime, failpoint};
use tokio::sync::watch;

use crate::builtin::Output;
use crate::claim::{self, Claimed, Look, millis};
use crate::journaling::{
    Landed, inline_if, journal_ambiguous, journal_attempt, journal_moved, journal_result,
    journal_result_after, keep_trying, note_chained, record,
};
use crate::service::Ctx;
use crate::target::{Ran, Target};
use crate::{Handled, ToolError, held, takeover};

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

/// One handling of a request of an operation: what each phase of [`execute`] reads.
pub(crate) struct Handling<'a> {
    pub(crate) ctx: &'a Ctx,
    pub(crate) op: &'a OperationId,
    pub(crate) req: &'a ToolRequested,
    /// This runner (the process's `worker_id`): who the record is claimed for.
    pub(crate) runner: &'a WorkerId,
    /// What the tool's name refers to.
    pub(crate) target: Target,
    /// How old a `running` record must be to be taken for abandoned (`op_abandoned_after`).
    pub(crate) abandoned_after: Duration,
    /// The request carries a retry policy: attempts are numbered, each claiming the record
    /// under its own number.
    pub(crate) retried: bool,
    /// Set for a handling inside a step's drive: where the inputs appended chained are noted
    /// (and its start and result go on the run's inline subjects).
    pub(crate) landed: Option<&'a Landed>,
}

/// Handles one request of `op`; `looked`: the journal's [`look`], if the caller took it.
///
/// Its phases: which attempt this is and its claim ([`claim::claim`]), the takeover of a
/// record whose runner is gone ([`takeover::take_over_gone`]), what the claim came to
/// ([`claim::outcome`]), then a cancelled run's or moved target's answer, the tool run beside
/// its `tool.started` ([`start_and_run`]), what it ran to ([`result_of`]), the retry policy's
/// verdict on a failure ([`after_failure`]) and the record and result written together
/// ([`finish`]).
///
/// [`look`]: crate::claim::look
///
/// `landed`: set for a handling inside a step's drive ([`crate::Inline`]): its `tool.started`
/// and `tool.result` go on the run's inline subjects, and what of them landed chained is noted
/// there (`Chained`).
pub(crate) async fn execute(
    ctx: &Ctx,
    op: &OperationId,
    req: &ToolRequested,
    looked: Option<Look>,
    requested_at: Option<u64>,
    landed: Option<&Landed>,
) -> Result<Handled, ToolError> {
    let runner = &ctx.rt.config.worker_id;
    let target = Target::of(&req.tool, &ctx.mcp);
    // Announced in this process's heartbeats from before the claim until the outcome is
    // recorded: if this process dies meanwhile, a standby takes the operation over at once.
    let _hold = ctx.liveness.hold_op(op).await;
    // A panic here (a bug; or the test failpoint) is contained by the handler.
    failpoint::panic_point("tool.execute", op.run().as_str());
    let h = Handling {
        ctx,
        op,
        req,
        runner,
        target,
        abandoned_after: ctx.rt.config.timeouts.op_abandoned_after(),
        retried: req.limits.retry.is_some(),
        landed,
    };
    let Claimed {
        claim,
        cancel_requested,
        attempt,
    } = match claim::claim(&h, looked).await? {
        ControlFlow::Continue(claimed) => claimed,
        ControlFlow::Break(handled) => return Ok(handled),
    };
    let code = claim_dispatch(req.redispatch, attempt, h.retried);
    tracing::Span::current().record("attempt", attempt);
    let mut claim = claim?;
    let early = takeover::take_over_gone(&h, &mut claim, code).await?;
    let revision = match claim::outcome(&h, claim, early).await? {
        ControlFlow::Continue(revision) => revision,
        ControlFlow::Break(handled) => return Ok(handled),
    };
    if cancel_requested {
        return not_run(&h, revision).await;
    }
    if let ControlFlow::Break(handled) = precondition(&h, revision, code).await? {
        return Ok(handled);
    }
    let (chained, ran) = start_and_run(&h, revision, attempt, requested_at).await;
    failpoint::hit("tool.after_effect");
    let (out, stopped) = match result_of(&h, ran).await? {
        ControlFlow::Continue(result) => result,
        ControlFlow::Break(handled) => return Ok(handled),
    };
    let out = match after_failure(&h, attempt, code, revision, out, stopped).await? {
        ControlFlow::Continue(out) => out,
        ControlFlow::Break(handled) => return Ok(handled),
    };
    finish(&h, revision, out, stopped, chained).await
}

/// A request whose run's cancellation was requested before it ran: not run, its result says
/// so, marked `stopped`.
async fn not_run(h: &Handling<'_>, revision: u64) -> Result<Handled, ToolError> {
    let (rt, op, req, runner) = (&h.ctx.rt, h.op, h.req, h.runner);
    let out = Output::error("not run: the run's cancellation was requested");
    record(rt, op, revision, req, runner, &out, Finished::Stopped).await?;
    journal_result(rt, op, out, true).await?;
    metrics::tool_operation(ToolOutcome::Cancelled);
    Ok(Handled::Cancelled)
}

/// An approved operation's precondition (`expect_version`), checked right before it runs: a
/// target that moved since the approval gives the record back and journals `target.moved`
/// (docs/ARCHITECTURE.md "Waiting and stopping").
async fn precondition(
    h: &Handling<'_>,
    revision: u64,
    code: u32,
) -> Result<ControlFlow<Handled>, ToolError> {
    let (rt, env, op, req, runner) = (&h.ctx.rt, &h.ctx.env, h.op, h.req, h.runner);
    if let Some(expected) = &req.expect_version {
        // The precondition: the target must still be where it was when the approval was asked.
        let found = h
            .target
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
            return Ok(ControlFlow::Break(Handled::Moved));
        }
    }
    Ok(ControlFlow::Continue(()))
}

/// Journals `tool.started` of attempt `attempt` and runs the tool under the run's cancel (a
/// compensation's excepted) beside it; then the run's stop signal is forgotten. Returns where
/// `tool.started` landed when it is chained (the link `tool.result` is chained on) and how the
/// run ended.
async fn start_and_run(
    h: &Handling<'_>,
    revision: u64,
    attempt: u32,
    requested_at: Option<u64>,
) -> (Option<u64>, Ran) {
    let (ctx, op, req, runner) = (h.ctx, h.op, h.req, h.runner);
    let (rt, env) = (&ctx.rt, &ctx.env);
    let started = InputEnvelope::new(
        op.run().clone(),
        Timestamp::now(),
        inline_if(
            h.landed.is_some(),
            Draft::new(Input::ToolStarted(ToolStarted {
                runner: runner.to_string(),
                attempt,
            }))
            .step(op.step())
            .op(op.clone()),
        ),
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
    let appended = rt.journal.append_input_after(&key, &started, chain_on);
    let (appended, ran) = futures::join!(appended, async {
        let began = std::time::Instant::now();
        let ran = match &arguments {
            Ok(arguments) => h.target.run(&limited, &ctx.mcp, op, arguments, stop).await,
            Err(e) => Ran::Done {
                out: Output::error(format!("not run: {e}")),
                stopped: false,
            },
        };
        metrics::tool_call(began.elapsed());
        ran
    });
    ctx.running.unregister(op);
    let chained = match appended {
        // A repeat (a redelivered request of the same claim) is not chained.
        Ok(appended) => {
            note_chained(h.landed, chain_on, &appended, &started);
            appended.chained.then_some(appended.seq)
        }
        Err(e) => {
            // The tool ran: its record and result still go in (and a failure there is retried;
            // the record then answers without running it again).
            tracing::warn!(error = %e, "tool.started not journaled");
            None
        }
    };
    (chained, ran)
}

/// What the run came to: its result for the model and whether the run's cancel stopped it;
/// or, for a remote call cut off mid-flight of a tool not safe to run again, the request's
/// answer (`outcome.ambiguous` journaled).
async fn result_of(
    h: &Handling<'_>,
    ran: Ran,
) -> Result<ControlFlow<Handled, (Output, bool)>, ToolError> {
    let (rt, op, req) = (&h.ctx.rt, h.op, h.req);
    let (out, stopped) = match ran {
        Ran::Done { out, stopped } => (out, stopped),
        // A tool its policy declares safe to run again: a lost connection is one more
        // transient failure, for the policy to retry.
        Ran::CutOff(detail)
            if req
                .limits
                .retry
                .as_ref()
                .is_some_and(|p| p.rerun_safe(&req.tool)) =>
        {
            (Output::failed(detail, ToolErrorClass::Transient), false)
        }
        Ran::CutOff(detail) => {
            // The record stays `running`: a person decides (`outcome.resolved`), and a retry
            // re-dispatches under the same id. Never retried automatically.
            journal_ambiguous(rt, op, req.redispatch, detail).await?;
            metrics::tool_operation(ToolOutcome::Ambiguous);
            return Ok(ControlFlow::Break(Handled::Ambiguous));
        }
    };
    let out = match h.target {
        Target::Unknown => Output::error(format!("unknown tool `{}`", req.tool)),
        _ => out,
    };
    Ok(ControlFlow::Continue((out, stopped)))
}

/// The retry policy's verdict on attempt `attempt`, when it failed and was not stopped: a
/// failure it retries is journaled (`tool.attempt`) and the record given back, and the request
/// is answered with the next attempt's wait; one it gives up on goes on to the model, told
/// which attempt it was and why ([`given_up`]) (docs/ARCHITECTURE.md "Tool retries").
async fn after_failure(
    h: &Handling<'_>,
    attempt: u32,
    code: u32,
    revision: u64,
    mut out: Output,
    stopped: bool,
) -> Result<ControlFlow<Handled, Output>, ToolError> {
    let (rt, op, req, runner) = (&h.ctx.rt, h.op, h.req, h.runner);
    if out.is_error
        && !stopped
        && let Some(policy) = &req.limits.retry
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
                return Ok(ControlFlow::Break(Handled::Retrying {
                    attempt: next,
                    retry_in_ms: millis(delay),
                }));
            }
            Verdict::GiveUp(why) => {
                if let Some(content) =
                    given_up(&out.content, attempt, out.class, policy.max_attempts(), why)
                {
                    tracing::info!(attempt, %why, "attempt failed; the model gets the error");
                    out.content = content;
                }
            }
        }
    }
    Ok(ControlFlow::Continue(out))
}

/// The error the model reads when the retry policy gives up on a failed attempt: told which
/// attempt of how many it was and why, when attempts were retried before or the failure had a
/// class a policy could retry; `None` for a tool's own error at the first attempt, which reads
/// as it is.
fn given_up(
    content: &str,
    attempt: u32,
    class: Option<ToolErrorClass>,
    max_attempts: u32,
    why: GiveUp,
) -> Option<String> {
    (attempt > 1 || class.is_some())
        .then(|| format!("{content}\n[attempt {attempt} of {max_attempts}: {why}]"))
}

/// How a run that came to a result is recorded, and counted: stopped by the run's cancel,
/// else ran, failed or succeeded by its result.
fn settled(stopped: bool, is_error: bool) -> (Finished, ToolOutcome) {
    let how = if stopped {
        Finished::Stopped
    } else {
        Finished::Ran
    };
    let outcome = match (stopped, is_error) {
        (true, _) => ToolOutcome::Stopped,
        (false, true) => ToolOutcome::Failed,
        (false, false) => ToolOutcome::Succeeded,
    };
    (how, outcome)
}

/// Finishes the record and journals the result (chained on `chained`, the `tool.started` it
/// follows), together, each kept trying while the broker is out of reach ([`keep_trying`]).
async fn finish(
    h: &Handling<'_>,
    revision: u64,
    out: Output,
    stopped: bool,
    chained: Option<u64>,
) -> Result<Handled, ToolError> {
    let (ctx, op, req, runner) = (h.ctx, h.op, h.req, h.runner);
    let rt = &ctx.rt;
    let (how, outcome) = settled(stopped, out.is_error);
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
                journal_result_after(rt, op, out.clone(), stopped, chained, h.landed)
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

    #[test]
    fn a_tools_own_error_at_its_first_attempt_reads_as_it_is() {
        assert_eq!(
            given_up("no such file", 1, None, 3, GiveUp::NotRetryable),
            None
        );
    }

    #[test]
    fn a_given_up_error_says_which_attempt_and_why() {
        let exhausted = given_up(
            "connection refused",
            3,
            Some(ToolErrorClass::Transient),
            3,
            GiveUp::Exhausted { attempts: 3 },
        );
        assert_eq!(
            exhausted.as_deref(),
            Some("connection refused\n[attempt 3 of 3: gave up after 3 attempts]")
        );
        // A failure with a class is annotated at its first attempt too: the policy could have
        // retried it and did not.
        let unsafe_timeout = given_up(
            "timed out",
            1,
            Some(ToolErrorClass::Timeout),
            5,
            GiveUp::NotSafeToRerun,
        );
        assert_eq!(
            unsafe_timeout.as_deref(),
            Some(
                "timed out\n[attempt 1 of 5: not retried: the tool is not known to be safe to \
                 run again after a timeout]"
            )
        );
        // A tool's own error after retried attempts says which attempt it was.
        let own = given_up("bad input", 2, None, 4, GiveUp::NotRetryable);
        assert_eq!(
            own.as_deref(),
            Some("bad input\n[attempt 2 of 4: not retried: the tool's own error]")
        );
    }

    #[test]
    fn a_run_is_recorded_stopped_whatever_its_result_else_by_its_result() {
        assert_eq!(
            settled(true, true),
            (Finished::Stopped, ToolOutcome::Stopped)
        );
        assert_eq!(
            settled(true, false),
            (Finished::Stopped, ToolOutcome::Stopped)
        );
        assert_eq!(settled(false, true), (Finished::Ran, ToolOutcome::Failed));
        assert_eq!(
            settled(false, false),
            (Finished::Ran, ToolOutcome::Succeeded)
        );
    }

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
