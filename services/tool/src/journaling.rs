//! Writing what this runner holds: the journal's inputs about an operation (`tool.result`,
//! `outcome.confirmed`, `outcome.ambiguous`, `tool.attempt`, `target.moved`, each under its own
//! msg id so a repeat is a no-op), the operation's record in `kedge_idempotency`, and the
//! writes kept trying while the broker is out of reach, with the results held on disk meanwhile
//! and journaled by the next start (docs/ARCHITECTURE.md "The tool service", "A late result
//! wins over a person").

use kedge_core::Input;
use kedge_core::InputEnvelope;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kedge_core::event::{Draft, Timestamp, ToolRequested, ToolResult};
use kedge_core::ids::{InputId, OperationId, WorkerId};
use kedge_core::tools::ToolErrorClass;
use kedge_runtime::Runtime;
use kedge_runtime::idempotency::Finished;

use crate::builtin::Output;
use crate::claim::millis;
use crate::service::Ctx;
use crate::{ToolError, held};

/// An input an inline handling appended checked on the run's message before it: nothing of
/// the run lies between `after` and `seq` (docs/ARCHITECTURE.md "Inline tools"). The step's
/// drive folds such a chain as it landed instead of reading the run again.
#[derive(Debug, Clone)]
pub struct Chained {
    pub after: u64,
    pub seq: u64,
    pub envelope: InputEnvelope,
}

/// Where a handling notes the inputs it appended chained ([`Chained`]), when its caller wants
/// them.
pub(crate) type Landed = std::sync::Mutex<Vec<Chained>>;

/// Notes `envelope`, appended as `appended` checked on `after`, in `landed` when it landed
/// chained (not a repeat of an earlier append).
pub(crate) fn note_chained(
    landed: Option<&Landed>,
    after: Option<u64>,
    appended: &kedge_journal::InputAppended,
    envelope: &InputEnvelope,
) {
    if let (Some(landed), Some(after), true, false) =
        (landed, after, appended.chained, appended.duplicate)
        && let Ok(mut landed) = landed.lock()
    {
        landed.push(Chained {
            after,
            seq: appended.seq,
            envelope: envelope.clone(),
        });
    }
}

/// Journals an operation's result; its msg id makes a repeat a no-op.
pub(crate) async fn journal_result(
    rt: &Runtime,
    op: &OperationId,
    out: Output,
    stopped: bool,
) -> Result<(), ToolError> {
    journal_result_after(rt, op, out, stopped, None, None).await
}

/// [`journal_result`], checked run-wide on `after` (the operation's `tool.started`, when that
/// was chained on its `tool.requested`): the link the step reads the run by
/// ([`kedge_journal::Journal::read_chained`]). `inline`: on the run's inline subject, for the
/// step's drive that runs the operation, noted there when chained (docs/ARCHITECTURE.md
/// "Inline tools").
pub(crate) async fn journal_result_after(
    rt: &Runtime,
    op: &OperationId,
    out: Output,
    stopped: bool,
    after: Option<u64>,
    inline: Option<&Landed>,
) -> Result<(), ToolError> {
    let result = ToolResult {
        content: out.content,
        is_error: out.is_error,
        stopped,
    };
    let draft = inline_if(inline.is_some(), Draft::new(Input::ToolResult(result)));
    let (appended, input) = append(rt, op, draft, InputId::tool_result(op), after).await?;
    note_chained(inline, after, &appended, &input);
    Ok(())
}

/// `draft` marked inline when `inline` (docs/ARCHITECTURE.md "Inline tools").
pub(crate) fn inline_if(inline: bool, draft: Draft<Input>) -> Draft<Input> {
    if inline { draft.inline() } else { draft }
}

/// Journals the result a confirm query found, as `outcome.confirmed` (the history says how it
/// was learned). Same msg id as [`journal_result`]: at most one of the two lands.
pub(crate) async fn journal_confirmed(
    rt: &Runtime,
    op: &OperationId,
    out: Output,
) -> Result<(), ToolError> {
    if out.is_error {
        return journal_result(rt, op, out, false).await;
    }
    let confirmed = kedge_core::event::OutcomeConfirmed {
        content: out.content,
    };
    journal_input(
        rt,
        op,
        Draft::new(Input::OutcomeConfirmed(confirmed)),
        InputId::tool_result(op),
        None,
    )
    .await
}

/// Journals that an operation's outcome cannot be known.
pub(crate) async fn journal_ambiguous(
    rt: &Runtime,
    op: &OperationId,
    dispatch: u32,
    detail: String,
) -> Result<(), ToolError> {
    let ambiguous = kedge_core::event::OutcomeAmbiguous { detail };
    journal_input(
        rt,
        op,
        Draft::new(Input::OutcomeAmbiguous(ambiguous)),
        InputId::outcome_ambiguous(op, dispatch),
        None,
    )
    .await
}

/// Journals a failed attempt that will be tried again after `delay` (`tool.attempt`, once per
/// dispatch and attempt).
pub(crate) async fn journal_attempt(
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
    journal_input(
        rt,
        op,
        Draft::new(Input::ToolAttempt(data)),
        InputId::tool_attempt(op, dispatch, attempt),
        None,
    )
    .await
}

/// Journals that an approved operation was not run because its target moved.
pub(crate) async fn journal_moved(
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
        Draft::new(Input::TargetMoved(moved)),
        InputId::target_moved(op, dispatch),
        None,
    )
    .await
}

/// Journals an input about `op` under the msg id `key` (checked run-wide on `after` when
/// given, see [`kedge_journal::Journal::append_input_after`]); a repeat (same key) is a no-op.
async fn journal_input(
    rt: &Runtime,
    op: &OperationId,
    input: Draft<Input>,
    key: InputId,
    after: Option<u64>,
) -> Result<(), ToolError> {
    append(rt, op, input, key, after).await.map(|_| ())
}

/// [`journal_input`], with where it landed and what.
async fn append(
    rt: &Runtime,
    op: &OperationId,
    input: Draft<Input>,
    key: InputId,
    after: Option<u64>,
) -> Result<(kedge_journal::InputAppended, InputEnvelope), ToolError> {
    let input = InputEnvelope::new(
        op.run().clone(),
        Timestamp::now(),
        input.step(op.step()).op(op.clone()),
    );
    let appended = rt.journal.append_input_after(&key, &input, after).await?;
    Ok((appended, input))
}

/// Completes the record of an operation this runner holds (revision from its claim) with its
/// result and how it came about, before the result is journaled.
pub(crate) async fn record(
    rt: &Runtime,
    op: &OperationId,
    revision: u64,
    req: &ToolRequested,
    runner: &WorkerId,
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

/// How long a runner keeps trying to journal a result it holds while the broker is unreachable
/// ([`keep_trying`]), and how often.
const HELD_RESULT_KEPT_FOR: Duration = Duration::from_secs(600);
const HELD_RESULT_RETRY: Duration = Duration::from_secs(1);

/// Runs `write` (journaling or recording something this runner holds and nobody else can have,
/// e.g. the result of a call it made) until it is not refused for broker trouble: every second
/// for up to [`HELD_RESULT_KEPT_FOR`], or until the service stops. A runner cut from the broker (a reset,
/// a partition) thus journals its result once it is back, however long its writes failed
/// meanwhile; an operation a standby took over meanwhile and left unresolved (waiting for the
/// call's deadline, or `ambiguous`) gets it as its outcome, and the run goes on with no person
/// (docs/ARCHITECTURE.md "Takeover"). A result (`hold`) is also kept on disk while it is not
/// written, from the start when the broker is out of reach already ([`held`]): a restarted
/// runner journals it.
pub(crate) async fn keep_trying<F, Fut>(
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
pub(crate) async fn redeliver_held(ctx: Arc<Ctx>) {
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
