//! Tool operations: where each stands ([`ToolOp`]) and how each operation event moves one
//! (docs/ARCHITECTURE.md "The tool service", "Tool retries"). What every event does to an
//! operation in every phase is declared in [`super::lifecycle`], and tested against this code
//! there.

use crate::event::{
    ApprovalRequested, Envelope, OpFate, OpSummary, Resolution, TargetMoved, Timestamp,
    ToolAttempt, ToolCall, ToolRequested,
};
use crate::ids::{OperationId, StepNo};

use super::FoldError;
use super::run::RunState;

/// The name of the built-in tool that asks the user a question; the run waits for the answer.
pub const ASK_USER_TOOL: &str = "ask_user";
/// The name of the built-in tool that waits: `{"seconds": N}` schedules a durable timer and the
/// run waits (holding nothing) until it fires.
pub const WAIT_TOOL: &str = "wait";

/// The name of the built-in tool that waits for an external callback:
/// `{"timeout_seconds": N}`; its result is the first payload delivered for the operation's
/// correlation key (`CallbackKey::for_operation`).
pub const AWAIT_CALLBACK_TOOL: &str = "await_callback";

/// Tools the step service handles itself (no tool worker executes them).
pub fn handled_by_step(tool: &str) -> bool {
    tool == ASK_USER_TOOL
        || tool == WAIT_TOOL
        || tool == AWAIT_CALLBACK_TOOL
        || tool == crate::child::RUN_AGENT_TOOL
}

/// Where one tool operation stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpStatus {
    /// Held back until a person approves it (`approval.requested`); not dispatched.
    AwaitingApproval,
    /// Requested; no runner has reported starting it.
    Requested,
    Started {
        runner: String,
    },
    /// Found not to have happened (`outcome.not_found`, or a person chose `retry`): to be
    /// dispatched again under the same operation id.
    ToRetry,
    Done,
    /// A runner died mid-operation and its confirm query could not tell whether it happened.
    Ambiguous {
        detail: String,
    },
}

/// The result the model will see for an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpResult {
    pub content: String,
    pub is_error: bool,
    pub stopped: bool,
    /// Journal sequence of the input that carried it.
    pub seq: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolOp {
    pub op: OperationId,
    pub call: ToolCall,
    pub args_digest: crate::event::Digest,
    pub status: OpStatus,
    pub result: Option<OpResult>,
    /// How many times the operation was dispatched (`tool.requested`), the first included.
    pub dispatches: u32,
    /// When it entered its current status (requested, dispatched, started): how long a
    /// `Started` operation has been running.
    pub since: Timestamp,
    /// The runner found the target moved since the approval was given (`target.moved`); cleared
    /// by the fresh `approval.requested`.
    pub target_moved: Option<crate::event::TargetMoved>,
    /// The terms it runs under (from its request), repeated on every dispatch.
    pub limits: crate::tools::RunLimits,
    /// Attempts of its current dispatch that failed and were retried (`tool.attempt`).
    pub failed_attempts: u32,
    /// Its tool's declared reversibility (from its request), and a compensable tool's
    /// compensation.
    pub reversibility: Option<crate::event::Reversibility>,
    /// For a compensation: the operation it compensates.
    pub compensates: Option<OperationId>,
    /// Its current dispatch was requested inline: the run's drive runs it itself, no tool
    /// service is asked (docs/ARCHITECTURE.md "Inline tools").
    pub inline: bool,
}

impl ToolOp {
    /// A first dispatch (`tool.requested`): requested, no runner has started it.
    fn requested(op: OperationId, req: &ToolRequested, at: Timestamp, inline: bool) -> ToolOp {
        ToolOp {
            op,
            call: ToolCall {
                call_id: req.call_id.clone(),
                name: req.tool.clone(),
                arguments: req.arguments.clone(),
            },
            args_digest: req.args_digest.clone(),
            status: OpStatus::Requested,
            result: None,
            dispatches: 1,
            since: at,
            target_moved: None,
            limits: req.limits.clone(),
            failed_attempts: 0,
            reversibility: req.reversibility.clone(),
            compensates: req.compensates.clone(),
            inline,
        }
    }

    /// An operation held back until a person approves it (`approval.requested`): not
    /// dispatched.
    fn awaiting_approval(op: OperationId, req: &ApprovalRequested, at: Timestamp) -> ToolOp {
        ToolOp {
            op,
            call: ToolCall {
                call_id: req.call_id.clone(),
                name: req.tool.clone(),
                arguments: req.arguments.clone(),
            },
            args_digest: req.args_digest.clone(),
            status: OpStatus::AwaitingApproval,
            result: None,
            dispatches: 0,
            since: at,
            target_moved: None,
            limits: req.limits.clone(),
            failed_attempts: 0,
            reversibility: req.reversibility.clone(),
            compensates: None,
            inline: false,
        }
    }

    /// A re-dispatch under the same operation id (`tool.requested` after `outcome.not_found`
    /// or a person's `retry`).
    fn redispatch(&mut self, at: Timestamp, inline: bool) {
        self.status = OpStatus::Requested;
        self.inline = inline;
        self.dispatches = self.dispatches.saturating_add(1);
        self.since = at;
        self.failed_attempts = 0;
    }

    /// `tool.started`: a runner took the dispatched operation. `false` (ignored) for an
    /// operation in any other status.
    pub(super) fn start(&mut self, runner: &str, at: Timestamp) -> bool {
        match self.status {
            OpStatus::Requested => {
                self.status = OpStatus::Started {
                    runner: runner.to_owned(),
                };
                self.since = at;
                true
            }
            OpStatus::AwaitingApproval
            | OpStatus::Started { .. }
            | OpStatus::ToRetry
            | OpStatus::Done
            | OpStatus::Ambiguous { .. } => false,
        }
    }

    /// A failed attempt that will be tried again (`tool.attempt`): not a result. The operation
    /// waits for its next attempt as a dispatched one does, from when that attempt is due (so a
    /// long backoff is not taken for a stuck operation). What a `tool.attempt` means is
    /// `NextAttempt::after`'s to say (the runners read it the same way): a later attempt of the
    /// current dispatch, its due time at most the longest backoff away. `false` (ignored) for
    /// any other.
    pub(super) fn fail_attempt(&mut self, a: &ToolAttempt, at: Timestamp) -> bool {
        let dispatched = match self.status {
            OpStatus::Requested | OpStatus::Started { .. } => true,
            OpStatus::AwaitingApproval
            | OpStatus::ToRetry
            | OpStatus::Done
            | OpStatus::Ambiguous { .. } => false,
        };
        if !dispatched || a.dispatch.saturating_add(1) != self.dispatches {
            return false;
        }
        let known = crate::tools::NextAttempt {
            number: self.failed_attempts.saturating_add(1),
            due: None,
        };
        match known.after(a, at) {
            Some(next) => {
                self.status = OpStatus::Requested;
                self.failed_attempts = a.attempt;
                self.since = next.due.unwrap_or(at);
                true
            }
            None => false,
        }
    }

    /// The operation's result (`tool.result`, an outcome, or one given on its behalf): done.
    fn settle(&mut self, seq: u64, content: String, is_error: bool, stopped: bool) {
        self.status = OpStatus::Done;
        self.result = Some(OpResult {
            content,
            is_error,
            stopped,
            seq,
        });
    }

    /// `outcome.not_found`: it did not happen; to be dispatched again under the same id.
    pub(super) fn not_found(&mut self) {
        self.status = OpStatus::ToRetry;
    }

    /// `outcome.ambiguous`: nobody can tell whether it happened; a person decides.
    pub(super) fn ambiguous(&mut self, detail: &str) {
        self.status = OpStatus::Ambiguous {
            detail: detail.to_owned(),
        };
    }

    /// `outcome.resolved`: a person's word on an ambiguous operation. `false` (ignored) for an
    /// operation that is not ambiguous.
    pub(super) fn resolve(&mut self, resolution: &Resolution, seq: u64) -> bool {
        match self.status {
            OpStatus::Ambiguous { .. } => {}
            OpStatus::AwaitingApproval
            | OpStatus::Requested
            | OpStatus::Started { .. }
            | OpStatus::ToRetry
            | OpStatus::Done => return false,
        }
        match resolution {
            Resolution::Retry => self.status = OpStatus::ToRetry,
            Resolution::Completed { content } => self.settle(seq, content.clone(), false, false),
            Resolution::Failed { reason } => self.settle(seq, reason.clone(), true, false),
        }
        true
    }

    /// `target.moved`: back to waiting for a person, the approval it ran under no longer holds.
    /// `false` (ignored) for an operation that is not dispatched.
    pub(super) fn move_target(&mut self, moved: &TargetMoved, at: Timestamp) -> bool {
        match self.status {
            OpStatus::Requested | OpStatus::Started { .. } => {
                self.status = OpStatus::AwaitingApproval;
                self.target_moved = Some(moved.clone());
                self.since = at;
                true
            }
            OpStatus::AwaitingApproval
            | OpStatus::ToRetry
            | OpStatus::Done
            | OpStatus::Ambiguous { .. } => false,
        }
    }
}

impl RunState {
    /// `tool.requested` (checked by the caller against the run's compensation): a first
    /// dispatch creates the operation, a later one dispatches it again; an operation that has
    /// its result is never dispatched again.
    pub(super) fn request_op(
        &mut self,
        seq: u64,
        env: &Envelope,
        op: OperationId,
        req: &ToolRequested,
    ) -> Result<(), FoldError> {
        match self.ops.get_mut(&op) {
            // A re-dispatch under the same operation id (after `outcome.not_found` or a
            // person's `retry`).
            Some(existing) if existing.result.is_none() => existing.redispatch(env.at, env.inline),
            Some(_) => {
                return Err(Self::inconsistent(
                    seq,
                    env,
                    "operation already has a result",
                ));
            }
            None => {
                let tool = ToolOp::requested(op.clone(), req, env.at, env.inline);
                self.ops.insert(op, tool);
            }
        }
        Ok(())
    }

    /// `approval.requested`: the operation exists from now on, held back until approved.
    pub(super) fn hold_op(&mut self, op: &OperationId, req: &ApprovalRequested, at: Timestamp) {
        let tool = self
            .ops
            .entry(op.clone())
            .or_insert_with(|| ToolOp::awaiting_approval(op.clone(), req, at));
        // A fresh request (after an invalidation) is made for where the target is now.
        tool.target_moved = None;
    }

    /// Sets the result of an operation that has none yet.
    pub(super) fn set_op_result(
        &mut self,
        op: &OperationId,
        seq: u64,
        content: String,
        is_error: bool,
    ) {
        if let Some(tool) = self.ops.get_mut(op)
            && tool.result.is_none()
        {
            tool.settle(seq, content, is_error, false);
        }
    }

    /// The operation named by the envelope's `op`, if it exists and has no result yet.
    pub(super) fn open_op(&mut self, env: &Envelope) -> Option<&mut ToolOp> {
        let op = env.op.as_ref()?;
        self.ops.get_mut(op).filter(|o| o.result.is_none())
    }

    /// Sets the result of the envelope's operation, if it has none yet; `false` if it has one
    /// or does not exist.
    pub(super) fn set_result(
        &mut self,
        env: &Envelope,
        seq: u64,
        content: String,
        is_error: bool,
        stopped: bool,
    ) -> bool {
        match self.open_op(env) {
            Some(op) => {
                op.settle(seq, content, is_error, stopped);
                true
            }
            None => false,
        }
    }

    /// Operations a tool runner should be working on (dispatched or started, no outcome yet)
    /// that entered that status before `cutoff`: with `cutoff = now - (tool_timeout +
    /// tool_grace)`, the ones whose runner is gone or never got the request. Tools the step
    /// service handles (questions, waits, callbacks) legitimately wait and are never listed.
    pub fn ops_stuck_since(&self, cutoff: Timestamp) -> Vec<&ToolOp> {
        self.ops
            .values()
            .filter(|o| {
                matches!(o.status, OpStatus::Requested | OpStatus::Started { .. })
                    && o.result.is_none()
                    && !handled_by_step(&o.call.name)
                    && o.since.0 < cutoff.0
            })
            .collect()
    }

    /// The operations of the last completed step, in call order.
    pub fn last_step_ops(&self) -> Vec<&ToolOp> {
        let last = match &self.open_step {
            Some(open) => StepNo(open.step.get().saturating_sub(1)),
            None => self.step,
        };
        self.ops
            .values()
            .filter(|o| o.op.step() == last && o.compensates.is_none())
            .collect()
    }

    /// Operations that have no result yet (of any step).
    pub fn unresolved_ops(&self) -> impl Iterator<Item = &ToolOp> {
        self.ops.values().filter(|o| o.result.is_none())
    }

    /// How every operation of the run ended, for `run.cancelled` (and `run.failed`'s
    /// `effects`): a compensation is listed under the operation it compensates, not apart; each
    /// with its level when the run's agent declares any ([`RunState::declares_levels`]).
    pub fn op_summaries(&self) -> Vec<OpSummary> {
        let levels = self.declares_levels();
        self.ops
            .values()
            .filter(|o| o.compensates.is_none())
            .map(|o| OpSummary {
                level: levels.then(|| crate::compensation::level_of(o)),
                compensation: crate::compensation::outcome_of(self, &o.op),
                op: o.op.clone(),
                fate: match (&o.result, &o.status) {
                    (Some(r), _) if r.stopped => OpFate::Stopped,
                    (Some(r), _) if r.is_error => OpFate::Failed,
                    (Some(_), _) => OpFate::Completed,
                    // Waiting for its next attempt (a retry policy): its attempts failed, and
                    // no more will run.
                    (None, OpStatus::Requested) if o.failed_attempts > 0 => OpFate::Failed,
                    (
                        None,
                        OpStatus::Requested | OpStatus::ToRetry | OpStatus::AwaitingApproval,
                    ) => OpFate::NeverStarted,
                    (None, _) => OpFate::Stopped,
                },
            })
            .collect()
    }

    /// Whether any operation's request carries a declared reversibility: then the run's
    /// terminal event lists each operation's level. Never for runs of agents that declare
    /// none, so their terminal events are what they always were.
    pub fn declares_levels(&self) -> bool {
        self.ops.values().any(|o| o.reversibility.is_some())
    }
}
