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
//! wait does not run out; see `service::keep`) and then handled anew: the next attempt, which
//! the journal numbers (one more than the failed attempts of the dispatch, as
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
//! In a process that runs the step service too, built-in tools are run inside the step's drives
//! instead ([`Inline`], docs/ARCHITECTURE.md "Inline tools"): the same handling, their requests
//! on the runs' inline subject, which this consumer does not take.
//!
//! `ask_user` and `wait` are not executed here: the step service journals the question or the
//! timer, and the answer or the timer's firing is the operation's result.
//!
//! The code, by role: `service` (the loop, one delivery up to its settling, keeping a request
//! through a wait, adopting a gone runner's operations), `running` (one request of an
//! operation, from its claim to its recorded outcome: `running::execute`), `claim` (which
//! attempt, and the claim of the record), `takeover` (a gone runner's or abandoned record: when
//! to take it over, the confirm query), `journaling` (the journal's inputs, the record, writes
//! kept trying while the broker is out of reach), `answers` (resolve and inspect requests); and
//! the tools themselves: [`target`], [`builtin`], [`sandbox`], with [`verify`], [`held`] and
//! [`workspaces`].

pub mod builtin;
pub mod held;
pub mod sandbox;
pub mod target;
pub mod verify;
pub mod workspaces;

mod answers;
mod claim;
mod inline;
mod journaling;
mod running;
mod service;
mod takeover;

use kedge_journal::JournalError;
use kedge_runtime::idempotency::IdempotencyError;

pub use inline::{Inline, InlineError, InlineRun};
pub use journaling::Chained;
pub use kedge_core::answers::Handled;
pub use service::run;

/// Why handling a request did not come to an answer: a write or read the broker refused, or a
/// panic (a bug) contained by the handler.
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
