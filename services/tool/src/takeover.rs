//! Operations of runners that are gone, or records past their abandonment age: whether the
//! record may be taken over now, the confirm (status) query that decides what the earlier
//! attempt did, and the result a taker finds already journaled (docs/ARCHITECTURE.md
//! "Takeover: the failure detector", "The tool service").

use std::time::Duration;

use kedge_core::event::{Event, EventType, ToolRequested};
use kedge_core::ids::OperationId;
use kedge_runtime::Runtime;
use kedge_runtime::idempotency::Finished;
use kedge_runtime::metrics::{self, ConfirmResult};

use crate::ToolError;
use crate::builtin::{Confirm, Output};
use crate::journaling::record;
use crate::service::Ctx;
use crate::target::Target;

/// How often a confirm query that answered "still in flight" is asked again.
pub(crate) const IN_FLIGHT_POLL: Duration = Duration::from_millis(500);

/// Counts a confirm query's answer in `kedge_confirm_queries_total`.
pub(crate) fn count_confirm(confirm: &Confirm) {
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
pub(crate) async fn settled_confirm(
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
pub(crate) async fn already_journaled(
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
