//! The service: its loop (`tool.requested` deliveries, the liveness detector's verdicts, resolve
//! and inspect requests, kept work coming back), the handling of one delivery up to its
//! settling, keeping a request through a wait without spending a delivery ([`keep`]), and
//! adopting the operations of a runner found gone (docs/ARCHITECTURE.md "The tool service",
//! "Tool retries", "Takeover: the failure detector").

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::verify::CheckError;
use async_nats::jetstream::{AckKind, Message};
use futures::{FutureExt, StreamExt};
use kedge_core::event::ToolRequested;
use kedge_core::fairness::Pace;
use kedge_core::fold::handled_by_step;
use kedge_core::ids::{OperationId, RunId};
use kedge_core::subjects::Durable;
use kedge_core::subjects::{TOOL_INSPECT, TOOL_RESOLVE, TOOL_RESOLVE_QUEUE};
use kedge_runtime::consumer::{Backoff, Verdict as Settle};
use kedge_runtime::fair::{self, FairFeed, Tenancy};
use kedge_runtime::liveness::{Death, Liveness};
use kedge_runtime::responder::{Busy, Listen, Responder};
use kedge_runtime::tenants::RunTenants;
use kedge_runtime::{Runtime, RuntimeError, consumer, failpoint};
use tokio::sync::{mpsc, watch};
use tracing::Instrument;

use crate::answers::{answer_inspect, answer_resolve};
use crate::claim::{Look, look};
use crate::journaling::redeliver_held;
use crate::running::{Running, execute};
use crate::verify::{self, Stored};
use crate::{Handled, ToolError, builtin, held, sandbox, workspaces};

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

/// Everything a tool handler needs. Cheap to clone: one per connection of the process (the
/// light lane's, [`Ctx::on`]), sharing everything but the runtime.
#[derive(Clone)]
pub(crate) struct Ctx {
    pub(crate) rt: Runtime,
    pub(crate) env: builtin::Env,
    /// Connections to the configured MCP servers (opened on first use).
    pub(crate) mcp: kedge_mcp::Pool,
    pub(crate) running: Running,
    /// The failure detector: operations running here are announced in this process's
    /// heartbeats, and an operation held by a runner that is gone is taken over at once.
    pub(crate) liveness: Liveness,
    /// Operations adopted from a runner found gone, and when it was last heard: the takeover's
    /// latency ([`kedge_runtime::metrics::TAKEOVER_SECONDS`]) once the record is taken over.
    pub(crate) adopted: Arc<Mutex<HashMap<OperationId, std::time::Instant>>>,
    /// Where kept requests go back to be handled anew (the service's loop).
    again: mpsc::UnboundedSender<Again>,
    /// Turns true when the service stops: kept requests are handed back to the broker.
    pub(crate) stopping: watch::Receiver<bool>,
    /// The requests kept now (the service waits for them on shutdown), across both lanes.
    keeping: Keeping,
    /// Results not journaled yet, kept on this host's disk ([`held`]).
    pub(crate) held: held::HeldResults,
}

/// How many requests are kept ([`keep`]): each holds a [`Kept`] until it is handed back.
#[derive(Clone, Default)]
struct Keeping(Arc<std::sync::atomic::AtomicUsize>);

/// One kept request, counted in [`Keeping`] while it lives.
struct Kept(Arc<std::sync::atomic::AtomicUsize>);

impl Keeping {
    fn hold(&self) -> Kept {
        self.0.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Kept(self.0.clone())
    }

    fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Work kept for a while ([`keep`]) and handed back to the service's loop, with how many times
/// it was kept.
pub(crate) enum Again {
    /// A delivered request.
    Request(Box<Message>, u32),
    /// An operation adopted from a runner that is gone (there is no delivery to keep).
    Adopted(OperationId, u32),
}

impl Ctx {
    /// This context over another runtime of the process, its light lane (docs/ARCHITECTURE.md
    /// "Fairness across tenants"): the operations of a tenant without a backlog go out on that
    /// runtime's connection.
    pub(crate) fn on(&self, rt: Runtime) -> Ctx {
        Ctx { rt, ..self.clone() }
    }

    /// The context of a service on `rt`, with what [`run`] set up before its loop.
    pub(crate) fn new(
        rt: &Runtime,
        sandbox: Arc<dyn sandbox::Sandbox>,
        running: Running,
        liveness: Liveness,
        again: mpsc::UnboundedSender<Again>,
        stopping: watch::Receiver<bool>,
    ) -> Ctx {
        Ctx {
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
            adopted: Arc::default(),
            again,
            stopping,
            keeping: Keeping::default(),
            held: held::HeldResults::new(&rt.config.workspace_root),
            rt: rt.clone(),
        }
    }
}

/// Runs the tool service until `shutdown` resolves, then lets in-flight operations finish.
pub async fn run(rt: Runtime, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
    // No sandbox, no service (unless `unconfined` was chosen).
    let sandbox = configured_sandbox(&rt).await?;
    let liveness = rt.liveness().await?;
    let mut deaths = liveness.deaths();
    let running = Running::default();
    // The operations running here of a cancelled run are stopped at once (a missed notification
    // at most lets one that already started run to its timeout).
    let stopping = running.clone();
    let watching = rt
        .on_cancel_requests(move |run| stopping.stop_run(&run))
        .await?;
    let light_rt = rt.light_lane().await?;
    // Requests are taken in fair order across tenants (docs/ARCHITECTURE.md "Fairness across
    // tenants"): a run's tenant is read from its run.created.
    let feed = FairFeed::open(
        &rt,
        CONSUMER,
        rt.config.timeouts.tool_ack_wait(),
        fair::window(
            rt.config.tool_concurrency,
            consumer::max_ack_pending(CONSUMER),
        ),
        |feeder| Tenancy::Run(Box::new(RunTenants::new(feeder.journal.clone()))),
    )
    .await?;
    // Kept requests come back here; the service's stop hands them back to the broker.
    let (again, mut kept) = mpsc::unbounded_channel::<Again>();
    let (stop, stopping) = watch::channel(false);
    let ctx = Arc::new(Ctx::new(&rt, sandbox, running, liveness, again, stopping));
    // The light lane, for the operations of tenants without a backlog
    // (docs/ARCHITECTURE.md "Fairness across tenants").
    let light = light_rt.map(|light| Arc::new(ctx.on(light)));
    let light_workers = fair::light_workers(rt.config.tool_concurrency);
    if let Some(light) = &light
        && let Some(on) = light.rt.executor()
    {
        let (shared, light, workers) = (ctx.clone(), light.clone(), light_workers.clone());
        feed.take_light(on, light_workers.clone(), move |slot, msg| {
            let ctx = fair::lane(CONSUMER, Pace::Light, &shared, Some(&light)).clone();
            run_request(&workers, slot, ctx, msg);
            std::future::ready(())
        });
    }
    // Results an earlier process on this workspace root held and could not journal.
    tokio::spawn(redeliver_held(ctx.clone()));
    let workers = consumer::Workers::adaptive(
        rt.config.tool_concurrency,
        rt.admission_probe("tool", true),
        "tool",
    );
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
    // Precondition queries are answered beside the operations, and stop with the service.
    let answering = answer_inspects(&rt, &ctx).await?;
    tracing::info!(worker = %rt.config.worker_id, "tool service started");
    tokio::pin!(shutdown);
    loop {
        let (slot, msg, pace) = tokio::select! {
            _ = &mut shutdown => break,
            death = deaths.recv() => {
                // A runner that held operations is gone: take them over now (confirm query
                // first, through the claim), not when their requests are redelivered.
                if let Ok(death) = death {
                    adopt_all(&ctx, &workers, death).await;
                }
                continue;
            }
            // A resolve request runs the operation: it takes a slot of the operations' pool.
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
            next = feed.next(&workers) => match next {
                Some(next) => next,
                None => break,
            },
        };
        let ctx = fair::lane(CONSUMER, pace, &ctx, light.as_ref()).clone();
        run_request(&workers, slot, ctx, msg);
    }
    wind_down(&ctx, feed, &stop, [&workers, &light_workers], kept, sweeper).await;
    let _ = answering.await;
    watching.abort();
    tracing::info!("tool service stopped");
    Ok(())
}

/// The sandbox `rt`'s configuration asks for ([`sandbox::from_config`]); one that does not
/// work here is a configuration error.
pub(crate) async fn configured_sandbox(
    rt: &Runtime,
) -> Result<Arc<dyn sandbox::Sandbox>, RuntimeError> {
    sandbox::from_config(rt.config.sandbox).await.map_err(|e| {
        kedge_runtime::ConfigError::Invalid {
            field: "sandbox",
            reason: e.to_string(),
        }
        .into()
    })
}

/// Precondition queries answered at once by one tool process (more wait in the subscription).
const INSPECTS_IN_FLIGHT: usize = 64;

/// Answers precondition queries beside the operations until the service stops.
async fn answer_inspects(
    rt: &Runtime,
    ctx: &Arc<Ctx>,
) -> Result<tokio::task::JoinHandle<()>, RuntimeError> {
    let inspects = Responder::subscribe(
        &rt.client,
        Listen {
            what: "precondition queries",
            subject: TOOL_INSPECT.to_owned(),
            queue: TOOL_RESOLVE_QUEUE,
            bound: INSPECTS_IN_FLIGHT,
            busy: Busy::Wait,
        },
    )
    .await?;
    let (ctx, mut stopping) = (ctx.clone(), ctx.stopping.clone());
    Ok(tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopping.wait_for(|stopped| *stopped).await;
        };
        inspects
            .run(shutdown, |query| {
                let ctx = ctx.clone();
                async move { answer_inspect(&ctx, query).await }
            })
            .await;
    }))
}

/// Takes over the operations a runner found gone held (its last heartbeat named them), each
/// through [`adopt`]; when it was last heard is kept for the takeover's latency.
async fn adopt_all(ctx: &Arc<Ctx>, workers: &consumer::Workers, death: Death) {
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

/// The service's stop, once its loop has ended: pulled requests handed back, kept ones too
/// (with the rest of their wait), in-flight operations finished, the sweep and the MCP
/// connections closed.
async fn wind_down(
    ctx: &Ctx,
    feed: FairFeed,
    stop: &watch::Sender<bool>,
    workers: [&consumer::Workers; 2],
    mut kept: mpsc::UnboundedReceiver<Again>,
    sweeper: tokio::task::JoinHandle<()>,
) {
    feed.hand_back().await;
    // Kept requests go back to the broker with the rest of their wait (a handler that keeps one
    // from now on hands it back at once), as do those waiting to be handled anew.
    let _ = stop.send(true);
    for workers in workers {
        workers.drain().await;
    }
    kept.close();
    while let Some(again) = kept.recv().await {
        if let Again::Request(msg, _) = again {
            let _ = msg.ack_with(AckKind::Nak(None)).await;
        }
    }
    let waited = Instant::now();
    while ctx.keeping.count() > 0 && waited.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sweeper.abort();
    ctx.mcp.close().await;
}

/// A delivered request as the journal decided it: its run, operation and request, and its
/// place in the journal (`tool.started` is chained on it).
struct Checked {
    run_id: RunId,
    op: OperationId,
    req: ToolRequested,
    requested_at: Option<u64>,
}

/// Handles the delivered request `msg` on `slot` with `ctx` (over the process's runtime, or
/// its light lane's) on that runtime's threads.
fn run_request(workers: &consumer::Workers, slot: consumer::Slot, ctx: Arc<Ctx>, msg: Message) {
    let on = ctx.rt.executor().cloned();
    workers.run_on(on.as_ref(), slot, async move { handle(&ctx, msg, 0).await });
}

/// Handles a delivered request; `kept`: how many times this delivery was kept already.
async fn handle(ctx: &Ctx, msg: Message, kept: u32) {
    let Some(Checked {
        run_id,
        op,
        req,
        requested_at,
    }) = checked(ctx, &msg).await
    else {
        return;
    };
    if handled_by_step(&req.tool) {
        let _ = msg.ack().await;
        return;
    }
    let (span, looked) = span_of(ctx, &msg, &run_id, &op, &req).await;
    // A panic while handling it (a bug) is contained: it counts as a failed delivery (handed
    // back, and a dead letter at the last one); the service and its other operations go on.
    let result =
        AssertUnwindSafe(execute(ctx, &op, &req, looked, requested_at, None).instrument(span))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| {
                let reason = failpoint::panic_message(panic.as_ref());
                tracing::error!(op = %op, panic = %reason, "handling a tool operation panicked");
                Err(ToolError::Panicked(reason))
            });
    settle_delivery(ctx, msg, kept, &op, result).await;
}

/// A delivered request read whole and checked against the journal ([`verify::delivered`]);
/// `None` when it was settled here: data not readable yet (redelivered), not an envelope or
/// not a decision of the journal (terminated).
async fn checked(ctx: &Ctx, msg: &Message) -> Option<Checked> {
    let stored = msg.info().ok().map(|info| Stored {
        stream: info.stream,
        seq: info.stream_sequence,
    });
    // Verified below to be the request's place in the journal: `tool.started` is chained on it.
    let requested_at = stored.as_ref().map(|s| s.seq);
    let checked = verify::delivered(
        &ctx.rt.journal,
        msg.subject.as_str(),
        stored,
        msg.headers.as_ref(),
        &msg.payload,
    )
    .await;
    let (op, req) = match checked {
        Ok(checked) => checked,
        Err(CheckError::Refused(refusal)) => {
            // Never redelivered: it would be refused again, forever.
            tracing::warn!(
                subject = %msg.subject,
                reason = %refusal,
                "refused: not a decision of the journal; terminating"
            );
            let _ = msg.ack_with(AckKind::Term).await;
            return None;
        }
        Err(e) => {
            // A request whose data is held by reference (large arguments) is read back whole:
            // broker trouble reading it is retried.
            tracing::warn!(subject = %msg.subject, error = %e, "cannot read the request yet; redelivering");
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
            return None;
        }
    };
    let run_id = op.run().clone();
    Some(Checked {
        run_id,
        op,
        req,
        requested_at,
    })
}

/// The span a delivered request is handled in, and the journal's [`look`] when it was taken
/// here for the span's parent.
async fn span_of(
    ctx: &Ctx,
    msg: &Message,
    run_id: &RunId,
    op: &OperationId,
    req: &ToolRequested,
) -> (tracing::Span, Option<Look>) {
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
        let looked = look(ctx, op, req, true).await.ok();
        let traceparent = looked.as_ref().and_then(|l| l.traceparent.as_deref());
        kedge_runtime::trace::set_parent(&span, traceparent);
        looked
    } else {
        None
    };
    (span, looked)
}

/// Settles a delivery of `op` by what its handling came to: kept ([`keep`]) through a live
/// holder's work or a backoff, acknowledged, or handed back to be retried (a dead letter at
/// the last delivery).
async fn settle_delivery(
    ctx: &Ctx,
    msg: Message,
    kept: u32,
    op: &OperationId,
    result: Result<Handled, ToolError>,
) {
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
        if let Err(e) = keep(ctx, Again::Request(Box::new(msg), kept), op, wait).await {
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
    let keeping = ctx.keeping.hold();
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
        match execute(ctx, &op, &req, None, None, None).await {
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
