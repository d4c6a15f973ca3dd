//! The tool service: executes `tool.requested` operations exactly once in effect.
//!
//! Consumes `agent.run.*.d.tool.requested` through the durable consumer `tool`. For each
//! operation it claims the operation id in `kedge_idempotency` (argument digest, runner):
//!
//! - a fresh claim runs the tool: `tool.started` is journaled, the tool runs under its timeout,
//!   the record is completed, then `tool.result` is journaled (deduplicated by `Nats-Msg-Id`);
//! - a record that is already done answers with the stored result without running again;
//! - the same id with different arguments is a conflict, reported as an error result;
//! - a record left `running` for longer than `tool_timeout + tool_grace` is abandoned (a live
//!   runner would have finished or killed its tool by then) and is resolved by the tool's confirm
//!   query: confirmed → `outcome.confirmed` with its result; not found (or an idempotent tool) →
//!   run again under the same id; ambiguous → `outcome.ambiguous` (the run waits in `unknown`
//!   for a person). A younger `running` record belongs to a live runner: the request is put back
//!   until the record is old enough.
//!
//! Retries (`policy.<tool>.retry`, carried by the request): an attempt that fails with an error
//! the policy retries (its class: `timeout`, `transient`, `rate_limited`; see
//! [`kedge_core::tools::RetryPolicy::after_failure`]) is journaled as `tool.attempt` under the
//! operation's id, the record is given back, and the request is kept by this runner until the
//! backoff has passed (a sleeping task that reports progress to the broker, so the request's ack
//! wait does not run out; see [`keep`]) and then handled anew: the next attempt, which the journal
//! numbers (one more than the failed attempts of the dispatch, as
//! [`kedge_core::tools::NextAttempt::after`] reads them) and which claims the record under that
//! number ([`kedge_core::tools::claim_dispatch`]), superseding the failed one without a confirm
//! query. A request held by a live runner, or whose attempt is not due yet, is kept the same way.
//! A kept request spends none of the consumer's deliveries (`max_deliver`): JetStream counts a
//! `Nak`, even a delayed one, as a delivery, so handing it back for each wait would bring a tool
//! retrying under its policy towards a dead letter. If this runner dies meanwhile, the broker
//! redelivers the request after its ack wait; on shutdown it is handed back with the rest of its
//! wait. Any other error, the last attempt's error, a stopped operation and an ambiguous outcome
//! of a tool not declared idempotent are not retried: the model, or a person, gets them as
//! before.
//!
//! A `running` record whose runner is gone (`kedge_runtime::liveness`: the broker has no
//! connection for it) is abandoned at once, whatever its age. The operations a runner is
//! running are announced in its heartbeats; when it is found gone, a standby adopts them right
//! away (their journaled requests, through the same claim), which is how a runner killed mid
//! tool call is replaced in about half a second instead of after `tool_ack_wait`.
//!
//! Abandoned operations also reach this code two other ways: the consumer redelivers the request after
//! `tool_ack_wait` (longer than `tool_timeout + tool_grace`), and the reconciler, finding an
//! operation started long ago with no outcome, sends the journaled `tool.requested` to
//! [`kedge_core::subjects::TOOL_RESOLVE`] (a queue group of the tool services). Both go through
//! the same claim, whose compare-and-set lets exactly one taker act.
//!
//! Cancellation: a request whose run already has `cancel.requested` is not run (its result says
//! so, marked `stopped`); an operation running when its run's cancel is requested is stopped
//! (the `shell` child is killed) and its result is marked `stopped`. The second path listens to
//! `cancel.requested` inputs on core NATS; the first reads the journal, so a missed notification
//! at most lets an operation that already started run to its timeout.
//!
//! Nothing runs that the journal did not decide ([`verify`]): a delivered request must be a
//! `tool.requested` decision of the run its subject, envelope and operation id all name, stored
//! by the run's writer; a resolve request is only a pointer to the journaled `tool.requested` of
//! the same operation and dispatch, which is what runs; a precondition query needs a run that
//! exists and a tool its agent declares. A refused delivery is terminated (never redelivered), a
//! refused resolve is answered `{"handled":"refused","reason":…}`; both are logged at warn.
//!
//! `ask_user` and `wait` are not executed here: the step service journals the question or the
//! timer, and the answer or the timer's firing is the operation's result.

pub mod builtin;
pub mod held;
pub mod sandbox;
pub mod target;
pub mod verify;
pub mod workspaces;

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{AckKind, Message};
use futures::{FutureExt, StreamExt};
use kedge_core::answers::{InspectReply, ResolveReply, TargetAnswer, TargetQuery};
use kedge_core::event::{
    Draft, Envelope, Event, EventType, Timestamp, ToolRequested, ToolResult, ToolStarted,
};
use kedge_core::fold::handled_by_step;
use kedge_core::ids::InputId;
use kedge_core::ids::{OperationId, RunId};
use kedge_core::subjects::Durable;
use kedge_core::subjects::{TOOL_INSPECT, TOOL_RESOLVE, TOOL_RESOLVE_QUEUE};
use kedge_core::tools::{NextAttempt, ToolErrorClass, Verdict, claim_dispatch};
use kedge_journal::{ErrorKind, JournalError};
use kedge_runtime::consumer::{Backoff, Verdict as Settle};
use kedge_runtime::idempotency::{Claim, Finished, IdempotencyError};
use kedge_runtime::liveness::Liveness;
use kedge_runtime::metrics::{self, ConfirmResult, Takeover, ToolOutcome};
use kedge_runtime::{Runtime, RuntimeError, consumer, failpoint};
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use crate::builtin::{Confirm, Output};
use crate::target::{Ran, Target};
use crate::verify::{CheckError, Stored};

pub use kedge_core::answers::Handled;

/// The durable consumer's name (and the dead letters' subject token).
const CONSUMER: Durable = Durable::Tool;
/// The longest redelivery delay after a failure (1 s, doubled per delivery up to it or the
/// configured `max_retry_delay`); the consumer's `max_deliver` bounds the tries, and the last
/// failing one is a dead letter on `agent.rejected.dead.tool`.
const RETRY_MAX: Duration = Duration::from_secs(30);
/// Most times one delivery of a request is kept and handled anew ([`keep`]); beyond, it is
/// handed back to the broker (a delivery spent) as before keeping existed. Every reason to keep
/// one ends (an attempt is due within the longest backoff, a live holder finishes or is found
/// gone, attempts are bounded), so this is only a backstop.
const MAX_KEPT: u32 = 1_000;

/// How long a runner keeps trying to journal a result it holds while the broker is unreachable
/// ([`keep_trying`]), and how often.
const HELD_RESULT_KEPT_FOR: Duration = Duration::from_secs(600);
const HELD_RESULT_RETRY: Duration = Duration::from_secs(1);

/// How often a confirm query that answered "still in flight" is asked again.
const IN_FLIGHT_POLL: Duration = Duration::from_millis(500);

/// The stop signal of one running operation.
type StopSignal = (OperationId, watch::Sender<bool>);

/// Stop signals of the operations running in this process, by run.
#[derive(Clone, Default)]
struct Running(Arc<Mutex<HashMap<RunId, Vec<StopSignal>>>>);

impl Running {
    fn register(&self, op: &OperationId) -> watch::Receiver<bool> {
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
    fn unregister(&self, op: &OperationId) {
        if let Ok(mut map) = self.0.lock()
            && let Some(ops) = map.get_mut(op.run())
        {
            ops.retain(|(o, tx)| o != op || !tx.is_closed());
            if ops.is_empty() {
                map.remove(op.run());
            }
        }
    }

    fn stop_run(&self, run: &RunId) {
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

/// Everything a tool handler needs.
struct Ctx {
    rt: Runtime,
    env: builtin::Env,
    /// Connections to the configured MCP servers (opened on first use).
    mcp: kedge_mcp::Pool,
    running: Running,
    /// The failure detector: operations running here are announced in this process's
    /// heartbeats, and an operation held by a runner that is gone is taken over at once.
    liveness: Liveness,
    /// Operations adopted from a runner found gone, and when it was last heard: the takeover's
    /// latency ([`metrics::TAKEOVER_SECONDS`]) once the record is taken over.
    adopted: Mutex<HashMap<OperationId, std::time::Instant>>,
    /// Where kept requests go back to be handled anew (the service's loop).
    again: mpsc::UnboundedSender<Again>,
    /// Turns true when the service stops: kept requests are handed back to the broker.
    stopping: watch::Receiver<bool>,
    /// One clone per kept request (the service waits for them on shutdown).
    keeping: Arc<()>,
    /// Results not journaled yet, kept on this host's disk ([`held`]).
    held: held::HeldResults,
}

/// Work kept for a while ([`keep`]) and handed back to the service's loop, with how many times
/// it was kept.
enum Again {
    /// A delivered request.
    Request(Box<Message>, u32),
    /// An operation adopted from a runner that is gone (there is no delivery to keep).
    Adopted(OperationId, u32),
}

/// What a runner's one look at the journal before an operation found ([`look`]).
#[derive(Debug, Default)]
struct Look {
    /// The run's `traceparent` (looked for only when spans are exported).
    traceparent: Option<String>,
    /// The run's cancellation was requested (best effort: no, when it could not be read).
    cancel_requested: bool,
    /// Under a retry policy: the attempt to make next.
    next: Option<NextAttempt>,
}

/// The runner's one read of the journal for an operation: one batched direct get of the last
/// `run.created` (only when spans are exported: its trace context), `cancel.requested` and,
/// under a retry policy, `tool.attempt` of the run. The last `tool.attempt` says where the
/// dispatch stands when it is this operation's, of this dispatch (attempts are journaled in
/// order: attempt n+1 is claimed only once n's failure is read); another operation's or
/// dispatch's sends the runner to read all of the run's `tool.attempt`s ([`next_attempt`]).
/// Without a policy a broker error is no error (the cancel check is best effort).
async fn look(
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

/// Runs the tool service until `shutdown` resolves, then lets in-flight operations finish.
pub async fn run(rt: Runtime, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
    // No sandbox, no service (unless `unconfined` was chosen).
    let sandbox = sandbox::from_config(rt.config.sandbox).await.map_err(|e| {
        kedge_runtime::ConfigError::Invalid {
            field: "sandbox",
            reason: e.to_string(),
        }
    })?;
    let consumer = consumer::durable(&rt.js, CONSUMER, rt.config.timeouts.tool_ack_wait()).await?;
    let liveness = rt.liveness().await?;
    let mut deaths = liveness.deaths();
    let running = Running::default();
    let mut cancels = rt
        .client
        .subscribe(kedge_core::subjects::event_all_runs(
            kedge_core::event::EventType::CancelRequested,
        ))
        .await
        .map_err(|e| RuntimeError::broker("subscribe to cancel requests", e))?;
    let stopper = running.clone();
    tokio::spawn(async move {
        while let Some(msg) = cancels.next().await {
            if let Some(parsed) = kedge_core::subjects::parse_event(&msg.subject) {
                stopper.stop_run(&parsed.run_id);
            }
        }
    });
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| RuntimeError::broker("tool consumer", e))?;
    // Kept requests come back here; the service's stop hands them back to the broker.
    let (again, mut kept) = mpsc::unbounded_channel::<Again>();
    let (stop, stopping) = watch::channel(false);
    let ctx = Arc::new(Ctx {
        env: builtin::Env {
            root: rt.config.workspace_root.clone(),
            shell_allowlist: rt.config.shell_allowlist.clone(),
            timeout: rt.config.timeouts.tool_timeout(),
            max_output: rt.config.max_tool_output_bytes,
            sandbox,
            ledger: rt.config.ledger_tool,
        },
        mcp: sandbox::mcp_pool(&rt.config),
        running,
        liveness,
        adopted: Mutex::default(),
        again,
        stopping,
        keeping: Arc::new(()),
        held: held::HeldResults::new(&rt.config.workspace_root),
        rt: rt.clone(),
    });
    // Results an earlier process on this workspace root held and could not journal.
    tokio::spawn(redeliver_held(ctx.clone()));
    let workers = consumer::Workers::new(rt.config.tool_concurrency);
    // Workspaces of purged runs (retention): this host's own sweep.
    let sweeper = tokio::spawn(workspaces::sweeper(
        rt.config.workspace_root.clone(),
        rt.journal.clone(),
        rt.config.retention.workspace_sweep,
    ));
    let mut resolves = rt
        .client
        .queue_subscribe(TOOL_RESOLVE, TOOL_RESOLVE_QUEUE.to_owned())
        .await
        .map_err(|e| RuntimeError::broker("subscribe to resolve requests", e))?;
    let mut inspects = rt
        .client
        .queue_subscribe(TOOL_INSPECT, TOOL_RESOLVE_QUEUE.to_owned())
        .await
        .map_err(|e| RuntimeError::broker("subscribe to precondition queries", e))?;
    tracing::info!(worker = %rt.config.worker_id, "tool service started");
    tokio::pin!(shutdown);
    loop {
        let (slot, msg) = tokio::select! {
            _ = &mut shutdown => break,
            death = deaths.recv() => {
                // A runner that held operations is gone: take them over now (confirm query
                // first, through the claim), not when their requests are redelivered.
                if let Ok(death) = death {
                    let last_heard = std::time::Instant::now()
                        .checked_sub(death.silent_for)
                        .unwrap_or_else(std::time::Instant::now);
                    if let Ok(mut adopted) = ctx.adopted.lock() {
                        if adopted.len() >= 10_000 {
                            adopted.clear();
                        }
                        for op in &death.held.ops {
                            adopted.insert(op.clone(), last_heard);
                        }
                    }
                    for op in death.held.ops {
                        let ctx = ctx.clone();
                        workers.spawn(async move { adopt(&ctx, op, 0).await }).await;
                    }
                }
                continue;
            }
            Some(query) = inspects.next() => {
                let ctx = ctx.clone();
                tokio::spawn(async move { answer_inspect(&ctx, query).await });
                continue;
            }
            Some(request) = resolves.next() => {
                let ctx = ctx.clone();
                workers.spawn(async move { answer_resolve(&ctx, request).await }).await;
                continue;
            }
            Some(again) = kept.recv() => {
                let ctx = ctx.clone();
                match again {
                    Again::Request(msg, times) => {
                        workers.spawn(async move { handle(&ctx, *msg, times).await }).await;
                    }
                    Again::Adopted(op, times) => {
                        workers.spawn(async move { adopt(&ctx, op, times).await }).await;
                    }
                }
                continue;
            }
            next = workers.next(&mut messages, CONSUMER) => match next {
                Some(next) => next,
                None => break,
            },
        };
        let ctx = ctx.clone();
        workers.run(slot, async move { handle(&ctx, msg, 0).await });
    }
    consumer::hand_back(messages, CONSUMER).await;
    // Kept requests go back to the broker with the rest of their wait (a handler that keeps one
    // from now on hands it back at once), as do those waiting to be handled anew.
    let _ = stop.send(true);
    workers.drain().await;
    kept.close();
    while let Some(again) = kept.recv().await {
        if let Again::Request(msg, _) = again {
            let _ = msg.ack_with(AckKind::Nak(None)).await;
        }
    }
    let waited = Instant::now();
    while Arc::strong_count(&ctx.keeping) > 1 && waited.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sweeper.abort();
    ctx.mcp.close().await;
    tracing::info!("tool service stopped");
    Ok(())
}

#[derive(Debug, thiserror::Error)]
enum ToolError {
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Idempotency(#[from] IdempotencyError),
    #[error("panicked: {0}")]
    Panicked(String),
}

impl ToolError {
    /// Broker trouble: the same write may succeed later.
    fn is_retryable(&self) -> bool {
        match self {
            ToolError::Journal(e) => e.is_retryable(),
            ToolError::Idempotency(e) => matches!(e, IdempotencyError::Unavailable(_)),
            ToolError::Panicked(_) => false,
        }
    }
}

/// Handles a delivered request; `kept`: how many times this delivery was kept already.
async fn handle(ctx: &Ctx, msg: Message, kept: u32) {
    // A request whose data is held by reference (large arguments) is read back whole.
    let envelope = match ctx.rt.journal.open(&msg.payload).await {
        Ok(envelope) => envelope,
        Err(e) if e.kind() == ErrorKind::Unavailable => {
            tracing::warn!(subject = %msg.subject, error = %e, "cannot read the request's data yet; redelivering");
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
            return;
        }
        Err(e) => {
            tracing::error!(subject = %msg.subject, error = %e, "not an envelope; terminating");
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        }
    };
    let (run_id, claimed_op) = (envelope.run_id.clone(), envelope.op.clone());
    let stored = msg.info().ok().map(|info| Stored {
        stream: info.stream,
        seq: info.stream_sequence,
    });
    // Verified below to be the request's place in the journal: `tool.started` is chained on it.
    let requested_at = stored.as_ref().map(|s| s.seq);
    let (op, req) =
        match verify::delivered(msg.subject.as_str(), stored, msg.headers.as_ref(), envelope) {
            Ok(checked) => checked,
            Err(refusal) => {
                // Never redelivered: it would be refused again, forever.
                tracing::warn!(
                    subject = %msg.subject,
                    run_id = %run_id,
                    op = claimed_op.as_ref().map(tracing::field::display),
                    reason = %refusal,
                    "refused: not a decision of the journal; terminating"
                );
                let _ = msg.ack_with(AckKind::Term).await;
                return;
            }
        };
    if handled_by_step(&req.tool) {
        let _ = msg.ack().await;
        return;
    }
    let span = tracing::info_span!(
        "tool",
        run_id = %run_id,
        op = %op,
        tool = %req.tool,
        attempt = tracing::field::Empty
    );
    // The step span that requested it (the `traceparent` header the journal put on this
    // tool.requested), so the tool's work nests under its step. A request without one (from an
    // older build) joins the run's trace (its run.created): then the one look at the journal is
    // taken here, before the span starts.
    let requested_by = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(kedge_runtime::trace::TRACEPARENT_HEADER))
        .map(|v| v.as_str());
    let looked = if requested_by.is_some() {
        kedge_runtime::trace::set_parent(&span, requested_by);
        None
    } else if kedge_runtime::trace::exporting() {
        let looked = look(ctx, &op, &req, true).await.ok();
        let traceparent = looked.as_ref().and_then(|l| l.traceparent.as_deref());
        kedge_runtime::trace::set_parent(&span, traceparent);
        looked
    } else {
        None
    };
    // A panic while handling it (a bug) is contained: it counts as a failed delivery (handed
    // back, and a dead letter at the last one); the service and its other operations go on.
    let result = AssertUnwindSafe(execute(ctx, &op, &req, looked, requested_at).instrument(span))
        .catch_unwind()
        .await
        .unwrap_or_else(|panic| {
            let reason = failpoint::panic_message(panic.as_ref());
            tracing::error!(op = %op, panic = %reason, "handling a tool operation panicked");
            Err(ToolError::Panicked(reason))
        });
    let delivered = consumer::deliveries(&msg);
    let last = consumer::is_last_delivery(CONSUMER, &msg);
    // Kept through a live holder's work or a backoff, spending no delivery; if this runner
    // goes away meanwhile, the broker redelivers it to another.
    let kept_for = match &result {
        Ok(Handled::Busy { retry_in_ms }) if !last => {
            tracing::info!(op = %op, retry_in_ms, "held by a live runner or not due; kept until then");
            Some(Duration::from_millis(*retry_in_ms))
        }
        Ok(Handled::Retrying {
            attempt,
            retry_in_ms,
        }) if !last => {
            tracing::info!(op = %op, attempt, retry_in_ms, "next attempt after the backoff");
            Some(Duration::from_millis((*retry_in_ms).max(1)))
        }
        _ => None,
    };
    if let Some(wait) = kept_for {
        if let Err(e) = keep(ctx, Again::Request(Box::new(msg), kept), &op, wait).await {
            tracing::warn!(op = %op, error = %e, "ack failed; the request will be redelivered");
        }
        return;
    }
    let verdict = match result {
        Ok(Handled::Busy { retry_in_ms }) => {
            // Not a failure: the live runner holding it records its outcome, and the reconciler
            // resolves it if that runner goes away.
            tracing::warn!(op = %op, retry_in_ms, delivered, "held by a live runner at the request's last delivery; dropping the request");
            Settle::Ack
        }
        Ok(Handled::Retrying { attempt, .. }) => {
            // The failure is journaled; the reconciler finds the operation overdue once its
            // next attempt has waited `tool_timeout + tool_grace` and asks a runner to go on.
            tracing::warn!(op = %op, attempt, delivered, "retry due at the request's last delivery; the reconciler will resume it");
            Settle::Ack
        }
        Ok(_) => Settle::Ack,
        Err(e) => Settle::Retry(
            format!("operation {op}: {e}"),
            Backoff::within(ctx.rt.config.timeouts.max_retry_delay().min(RETRY_MAX)),
        ),
    };
    consumer::settle(&ctx.rt.js, CONSUMER, &msg, verdict).await;
}

/// Keeps a delivered request of `op` (or an adopted operation) for `wait`, then hands it to
/// the service's loop to be handled anew, without giving it back to the broker: JetStream
/// counts every redelivery, a delayed `Nak` included, against the consumer's `max_deliver`, so a
/// request waiting for its next attempt or for a live holder would otherwise walk towards a
/// dead letter. Meanwhile the broker is told the request is in progress (`+WPI`, which resets
/// its ack wait and is not a delivery) every third of the ack wait, and the operation is
/// announced in this process's heartbeats: if this process dies, a standby adopts it at once
/// (and waits out what is left of the backoff itself). When the service stops, or the request
/// was kept [`MAX_KEPT`] times already, it is handed back with the rest of its wait
/// (`Nak(delay)`); an adopted operation is then left to its request's redelivery.
async fn keep(
    ctx: &Ctx,
    what: Again,
    op: &OperationId,
    wait: Duration,
) -> Result<(), async_nats::Error> {
    let mut stopping = ctx.stopping.clone();
    let stopped = *stopping.borrow();
    let times = match &what {
        Again::Request(_, n) | Again::Adopted(_, n) => *n,
    };
    if times >= MAX_KEPT || stopped {
        if let Again::Request(msg, _) = what {
            return msg.ack_with(AckKind::Nak(Some(wait))).await;
        }
        return Ok(());
    }
    // In progress from now: handling may already have used most of the ack wait, and the
    // first beat below is a third of it away.
    if let Again::Request(msg, _) = &what {
        msg.ack_with(AckKind::Progress).await?;
    }
    let again = ctx.again.clone();
    let keeping = ctx.keeping.clone();
    let hold = ctx.liveness.hold_op(op).await;
    let beat = (ctx.rt.config.timeouts.tool_ack_wait() / 3).max(Duration::from_millis(50));
    tokio::spawn(async move {
        let _keeping = (keeping, hold);
        let due = tokio::time::Instant::now() + wait;
        loop {
            let now = tokio::time::Instant::now();
            if now >= due {
                break;
            }
            let next = (now + beat).min(due);
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                _ = async { let _ = stopping.wait_for(|stop| *stop).await; } => {
                    if let Again::Request(msg, _) = what {
                        let rest = due.saturating_duration_since(tokio::time::Instant::now());
                        let _ = msg.ack_with(AckKind::Nak(Some(rest))).await;
                    }
                    return;
                }
            }
            if next < due
                && let Again::Request(msg, _) = &what
                && let Err(e) = msg.ack_with(AckKind::Progress).await
            {
                tracing::warn!(error = %e, "cannot report a kept request in progress");
            }
        }
        let what = match what {
            Again::Request(msg, n) => Again::Request(msg, n + 1),
            Again::Adopted(op, n) => Again::Adopted(op, n + 1),
        };
        if let Err(mpsc::error::SendError(Again::Request(msg, _))) = again.send(what) {
            // The service is stopping: back to the broker, due now.
            let _ = msg.ack_with(AckKind::Nak(None)).await;
        }
    });
    Ok(())
}

/// Answers the reconciler's request to resolve an operation stuck in `running`: the same
/// handling as a redelivered request, of the operation's journaled `tool.requested` (the
/// request only names it); the reply says what it came to ([`ResolveReply`]).
async fn answer_resolve(ctx: &Ctx, request: async_nats::Message) {
    let reply = match ctx.rt.journal.open(&request.payload).await {
        Ok(claimed) => {
            let span = tracing::info_span!(
                "resolve",
                run_id = %claimed.run_id,
                op = claimed.op.as_ref().map(tracing::field::display),
                tool = tracing::field::Empty,
            );
            resolve(ctx, claimed).instrument(span).await
        }
        Err(e) => ResolveReply::Failed {
            error: e.to_string(),
        },
    };
    if let (Some(to), Ok(body)) = (request.reply, serde_json::to_vec(&reply))
        && let Err(e) = ctx.rt.client.publish(to, body.into()).await
    {
        tracing::warn!(error = %e, "cannot answer a resolve request");
    }
}

async fn resolve(ctx: &Ctx, claimed: Envelope) -> ResolveReply {
    let failed = |error: String| ResolveReply::Failed { error };
    let (op, req) = match verify::journaled(&ctx.rt.journal, claimed).await {
        Ok(checked) => checked,
        Err(CheckError::Refused(refusal)) => {
            tracing::warn!(reason = %refusal, "resolve request refused: not what the journal decided");
            return ResolveReply::Handled(Handled::Refused {
                reason: refusal.to_string(),
            });
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot check a resolve request against the journal");
            return failed(e.to_string());
        }
    };
    if handled_by_step(&req.tool) {
        return failed("handled by the step service, not a tool runner".into());
    }
    tracing::Span::current().record("tool", req.tool.as_str());
    match execute(ctx, &op, &req, None, None).await {
        Ok(handled) => {
            tracing::info!(?handled, "resolved at the reconciler's request");
            ResolveReply::Handled(handled)
        }
        Err(e) => failed(e.to_string()),
    }
}

/// Takes over operation `op` of a runner that is gone: its journaled request is handled like
/// a redelivered one (the claim sees the gone runner's record and takes it over). An attempt
/// not due yet, or failed with its next one due after a backoff, is kept ([`keep`]) and
/// adopted again then; `kept`: how many times so far.
async fn adopt(ctx: &Ctx, op: OperationId, kept: u32) {
    let span = tracing::info_span!("adopt", run_id = %op.run(), op = %op);
    async {
        let req = match verify::latest(&ctx.rt.journal, &op).await {
            Ok(req) => req,
            Err(e) => {
                tracing::warn!(error = %e, "cannot adopt an operation of a gone runner; its request's redelivery will");
                return;
            }
        };
        if handled_by_step(&req.tool) {
            return;
        }
        match execute(ctx, &op, &req, None, None).await {
            Ok(Handled::Busy { retry_in_ms } | Handled::Retrying { retry_in_ms, .. }) => {
                tracing::info!(retry_in_ms, "adopted operation not due yet; kept until then");
                let wait = Duration::from_millis(retry_in_ms.max(1));
                let _ = keep(ctx, Again::Adopted(op.clone(), kept), &op, wait).await;
            }
            Ok(handled) => tracing::info!(?handled, "adopted an operation of a gone runner"),
            Err(e) => {
                tracing::warn!(error = %e, "adopted operation not finished; its request's redelivery will retry")
            }
        }
    }
    .instrument(span)
    .await
}

/// Handles one request of `op`; `looked`: the journal's [`look`], if the caller took it.
async fn execute(
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
    runner: &str,
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
    let ms = (due.0 - Timestamp::now().0).whole_milliseconds();
    (ms > 0).then(|| Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX)))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Journals a failed attempt that will be tried again after `delay` (`tool.attempt`, once per
/// dispatch and attempt).
async fn journal_attempt(
    rt: &Runtime,
    op: &OperationId,
    dispatch: u32,
    attempt: u32,
    class: ToolErrorClass,
    error: String,
    delay: Duration,
) -> Result<(), ToolError> {
    let data = kedge_core::event::ToolAttempt {
        attempt,
        dispatch,
        class,
        error,
        delay_ms: millis(delay),
        retry_at: Timestamp::now().saturating_add(delay),
    };
    let key = format!("tool.attempt:{op}:{dispatch}:{attempt}");
    let env = Envelope::new(
        op.run().clone(),
        Timestamp::now(),
        Draft::new(Event::ToolAttempt(data))
            .step(op.step())
            .op(op.clone()),
    );
    match rt.journal.append_input(&env, &key).await {
        Ok(_) | Err(JournalError::Duplicate { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Journals that an approved operation was not run because its target moved.
async fn journal_moved(
    rt: &Runtime,
    op: &OperationId,
    dispatch: u32,
    expected: &str,
    found: String,
) -> Result<(), ToolError> {
    let moved = kedge_core::event::TargetMoved {
        expected: expected.to_owned(),
        found,
    };
    journal_input(
        rt,
        op,
        Event::TargetMoved(moved),
        InputId::target_moved(op, dispatch),
        None,
    )
    .await
}

/// An operation's arguments with the run's sealed values opened ([`kedge_runtime::seal`]).
fn open_arguments<'a>(
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

/// Answers a precondition query (`kedge.tool.inspect`) with the target's current version, for a
/// run that exists and a tool its agent declares (else a refusal). When that cannot be checked
/// (broker trouble) there is no answer: the asker's timeout makes it ask again, where an error
/// answer could be taken for "no version".
async fn answer_inspect(ctx: &Ctx, request: async_nats::Message) {
    let reply = match serde_json::from_slice::<TargetQuery>(&request.payload) {
        Ok(q) => {
            let span = tracing::info_span!("inspect", run_id = %q.run_id, tool = %q.tool);
            match verify::inspectable(&ctx.rt.journal, &ctx.rt.agents, &q)
                .instrument(span.clone())
                .await
            {
                Ok(()) => {
                    let version = match open_arguments(&ctx.rt, &q.run_id, &q.arguments) {
                        Ok(arguments) => {
                            Target::of(&q.tool, &ctx.mcp)
                                .version(&ctx.env, &q.run_id, &arguments)
                                .await
                        }
                        Err(_) => None,
                    };
                    InspectReply::Version(TargetAnswer { version })
                }
                Err(CheckError::Refused(refusal)) => {
                    span.in_scope(|| {
                        tracing::warn!(reason = %refusal, "precondition query refused");
                    });
                    InspectReply::Refused {
                        refused: refusal.to_string(),
                    }
                }
                Err(e) => {
                    span.in_scope(|| {
                        tracing::warn!(error = %e, "cannot check a precondition query; not answering");
                    });
                    return;
                }
            }
        }
        Err(e) => InspectReply::Invalid {
            error: e.to_string(),
        },
    };
    if let (Some(to), Ok(body)) = (request.reply, serde_json::to_vec(&reply))
        && let Err(e) = ctx.rt.client.publish(to, body.into()).await
    {
        tracing::warn!(error = %e, "cannot answer a precondition query");
    }
}

/// Completes the record of an operation this runner holds (revision from its claim) with its
/// result and how it came about, before the result is journaled.
async fn record(
    rt: &Runtime,
    op: &OperationId,
    revision: u64,
    req: &ToolRequested,
    runner: &str,
    out: &Output,
    how: Finished,
) -> Result<(), ToolError> {
    rt.idempotency
        .finish(
            op,
            revision,
            &req.args_digest,
            runner,
            &out.content,
            out.is_error,
            how,
        )
        .await?;
    Ok(())
}

/// Runs `write` (journaling or recording something this runner holds and nobody else can have,
/// e.g. the result of a call it made) until it is not refused for broker trouble: every second
/// for up to [`HELD_RESULT_KEPT_FOR`], or until the service stops. A runner cut from the broker (a reset,
/// a partition) thus journals its result once it is back, however long its writes failed
/// meanwhile; an operation a standby took over meanwhile and left unresolved (waiting for the
/// call's deadline, or `ambiguous`) gets it as its outcome, and the run goes on with no person
/// (docs/ARCHITECTURE.md "Takeover"). A result (`hold`) is also kept on disk while it is not
/// written, from the start when the broker is out of reach already ([`held`]): a restarted
/// runner journals it.
async fn keep_trying<F, Fut>(
    ctx: &Ctx,
    what: &str,
    hold: Option<&held::HeldResult>,
    mut write: F,
) -> Result<(), ToolError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), ToolError>>,
{
    let until = tokio::time::Instant::now() + HELD_RESULT_KEPT_FOR;
    let mut failed = 0u32;
    let mut on_disk = false;
    let cut_off = ctx.rt.client.connection_state() != async_nats::connection::State::Connected;
    if let Some(hold) = hold.filter(|_| cut_off) {
        ctx.held.keep(hold).await;
        on_disk = true;
    }
    loop {
        let e = match write().await {
            Err(e) if e.is_retryable() => e,
            done => {
                if failed > 0 {
                    tracing::info!(tries = failed + 1, "wrote {what} once the broker was back");
                }
                if let Some(hold) = hold.filter(|_| on_disk && done.is_ok()) {
                    ctx.held.release(&hold.op).await;
                }
                return done;
            }
        };
        if let Some(hold) = hold.filter(|_| !on_disk) {
            ctx.held.keep(hold).await;
            on_disk = true;
        }
        failed += 1;
        if tokio::time::Instant::now() + HELD_RESULT_RETRY > until || *ctx.stopping.borrow() {
            tracing::error!(error = %e, tries = failed, "gave up writing {what}");
            return Err(e);
        }
        if failed == 1 {
            tracing::warn!(error = %e, "cannot write {what}; trying again every second while the broker is unreachable");
        }
        tokio::time::sleep(HELD_RESULT_RETRY).await;
    }
}

/// Journals the results an earlier process on this workspace root held and could not journal
/// (killed or stopped while cut from the broker), as their runner would have, then forgets them.
/// A result the fold no longer needs (the operation resolved meanwhile) is a no-op input.
async fn redeliver_held(ctx: Arc<Ctx>) {
    for held in ctx.held.all().await {
        let out = Output {
            content: held.content.clone(),
            is_error: held.is_error,
            class: None,
        };
        let rt = &ctx.rt;
        let op = &held.op;
        match keep_trying(&ctx, "a held result", None, || {
            journal_result(rt, op, out.clone(), held.stopped)
        })
        .await
        {
            Ok(()) => {
                tracing::info!(%op, "journaled a result an earlier process held");
                ctx.held.release(op).await;
            }
            Err(e) => {
                tracing::warn!(%op, error = %e, "cannot journal a held result; kept for the next start")
            }
        }
    }
}

/// Journals the result a confirm query found, as `outcome.confirmed` (the history says how it
/// was learned). Same msg id as [`journal_result`]: at most one of the two lands.
async fn journal_confirmed(rt: &Runtime, op: &OperationId, out: Output) -> Result<(), ToolError> {
    if out.is_error {
        return journal_result(rt, op, out, false).await;
    }
    let confirmed = kedge_core::event::OutcomeConfirmed {
        content: out.content,
    };
    journal_input(
        rt,
        op,
        Event::OutcomeConfirmed(confirmed),
        InputId::tool_result(op),
        None,
    )
    .await
}

/// Journals that an operation's outcome cannot be known.
async fn journal_ambiguous(
    rt: &Runtime,
    op: &OperationId,
    dispatch: u32,
    detail: String,
) -> Result<(), ToolError> {
    let ambiguous = kedge_core::event::OutcomeAmbiguous { detail };
    journal_input(
        rt,
        op,
        Event::OutcomeAmbiguous(ambiguous),
        InputId::outcome_ambiguous(op, dispatch),
        None,
    )
    .await
}

/// Journals an operation's result; its msg id makes a repeat a no-op.
async fn journal_result(
    rt: &Runtime,
    op: &OperationId,
    out: Output,
    stopped: bool,
) -> Result<(), ToolError> {
    journal_result_after(rt, op, out, stopped, None).await
}

/// [`journal_result`], checked run-wide on `after` (the operation's `tool.started`, when that
/// was chained on its `tool.requested`): the link the step reads the run by
/// ([`kedge_journal::Journal::read_chained`]).
async fn journal_result_after(
    rt: &Runtime,
    op: &OperationId,
    out: Output,
    stopped: bool,
    after: Option<u64>,
) -> Result<(), ToolError> {
    let result = ToolResult {
        content: out.content,
        is_error: out.is_error,
        stopped,
    };
    journal_input(
        rt,
        op,
        Event::ToolResult(result),
        InputId::tool_result(op),
        after,
    )
    .await
}

/// Journals an input about `op` under the msg id `key` (checked run-wide on `after` when
/// given, see [`kedge_journal::Journal::append_input_after`]); a repeat (same key) is a no-op.
async fn journal_input(
    rt: &Runtime,
    op: &OperationId,
    event: Event,
    key: InputId,
    after: Option<u64>,
) -> Result<(), ToolError> {
    let env = Envelope::new(
        op.run().clone(),
        Timestamp::now(),
        Draft::new(event).step(op.step()).op(op.clone()),
    );
    match rt
        .journal
        .append_input_after(&env, key.as_str(), after)
        .await
    {
        Ok(_) | Err(JournalError::Duplicate { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
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
