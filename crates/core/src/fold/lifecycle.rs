//! The lifecycle of a tool operation, declared as one table: what each operation event does to
//! an operation in each phase.
//!
//! An operation is requested (`tool.requested`), or held back for a person's approval first
//! (`approval.requested`); a runner starts it (`tool.started`) and may fail attempts that are
//! tried again (`tool.attempt`, docs/ARCHITECTURE.md "Tool retries"); its result ends it: the
//! runner's `tool.result`, or one given on its behalf by what it waits on (its question's answer
//! or timeout, its approval's denial or expiry, its timer, its callback or the callback's
//! expiry). An operation whose runner died is settled by the tool's confirm query
//! (`outcome.confirmed`, `outcome.not_found`, `outcome.ambiguous`), an ambiguous one by a person
//! (`outcome.resolved`) (docs/ARCHITECTURE.md "The tool service").
//!
//! [`TRANSITIONS`] has one row per [`OpEvent`], naming for each [`OpPhase`] the phase the
//! operation moves to (or stays in), or why the event leaves it alone ([`OpTarget::Ignored`]:
//! anyone may append inputs, and an input that no longer matters is counted and skipped) or
//! makes the fold fail ([`OpTarget::Rejected`]: the single writer never journals it). The fold
//! moves operations per event (`fold/operation.rs`); the tests below apply every event to an
//! operation in every phase and fail wherever the fold and the table disagree.
//!
//! Checks that do not depend on the operation's phase are not in the table: a decision without
//! the operation it names, a compensation requested outside its run's plan (the fold fails),
//! a `tool.attempt` of another dispatch or not later than the last one counted
//! (`NextAttempt::after`: ignored), and any input but `tool.result` to a cancelled run
//! (ignored).

use super::operation::{OpStatus, ToolOp};
use crate::event::EventType;

/// Where an operation stands, without the details its status carries ([`OpStatus`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpPhase {
    /// The run has no operation by that id.
    Absent,
    AwaitingApproval,
    Requested,
    Started,
    ToRetry,
    Ambiguous,
    /// It has its result.
    Done,
}

impl OpPhase {
    pub const ALL: &'static [OpPhase] = &[
        OpPhase::Absent,
        OpPhase::AwaitingApproval,
        OpPhase::Requested,
        OpPhase::Started,
        OpPhase::ToRetry,
        OpPhase::Ambiguous,
        OpPhase::Done,
    ];

    /// The phase of an operation, or [`OpPhase::Absent`] for none.
    pub fn of(op: Option<&ToolOp>) -> OpPhase {
        op.map_or(OpPhase::Absent, ToolOp::phase)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OpPhase::Absent => "absent",
            OpPhase::AwaitingApproval => "awaiting_approval",
            OpPhase::Requested => "requested",
            OpPhase::Started => "started",
            OpPhase::ToRetry => "to_retry",
            OpPhase::Ambiguous => "ambiguous",
            OpPhase::Done => "done",
        }
    }
}

impl std::fmt::Display for OpPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl ToolOp {
    /// The operation's phase: [`OpPhase::Done`] once it has its result, else its status's.
    pub fn phase(&self) -> OpPhase {
        if self.result.is_some() {
            return OpPhase::Done;
        }
        match self.status {
            OpStatus::AwaitingApproval => OpPhase::AwaitingApproval,
            OpStatus::Requested => OpPhase::Requested,
            OpStatus::Started { .. } => OpPhase::Started,
            OpStatus::ToRetry => OpPhase::ToRetry,
            OpStatus::Ambiguous { .. } => OpPhase::Ambiguous,
            OpStatus::Done => OpPhase::Done,
        }
    }
}

/// An event as it acts on one operation: a journaled event that names the operation (its `op`),
/// or one that gives the operation its result through what it waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpEvent {
    /// `tool.requested` (a decision): a dispatch, the first or a later one under the same id.
    ToolRequested,
    /// `approval.requested` (a decision).
    ApprovalRequested,
    /// `tool.started`.
    ToolStarted,
    /// `tool.attempt`: a failed attempt of the current dispatch, to be tried again.
    ToolAttempt,
    /// `tool.result`.
    ToolResult,
    /// `outcome.confirmed`.
    OutcomeConfirmed,
    /// `outcome.not_found`.
    OutcomeNotFound,
    /// `outcome.ambiguous`.
    OutcomeAmbiguous,
    /// `outcome.resolved` with `retry`.
    ResolvedRetry,
    /// `outcome.resolved` with `completed`.
    ResolvedCompleted,
    /// `outcome.resolved` with `failed`.
    ResolvedFailed,
    /// `target.moved`.
    TargetMoved,
    /// `question.answered` of the question the operation asks (`ask_user`).
    QuestionAnswered,
    /// `timer.fired` of that question's timeout.
    QuestionTimedOut,
    /// `approval.decided` with `deny`, on the operation's approval.
    ApprovalDenied,
    /// `approval.expired` (a decision), of the operation's approval.
    ApprovalExpired,
    /// `timer.fired` of a `wait` operation's timer.
    WaitFired,
    /// `callback.received` for the key the operation expects (`await_callback`).
    CallbackReceived,
    /// `callback.expected` (a decision) for a key whose callback came first.
    CallbackMatched,
    /// `timer.fired` of the callback's expiry.
    CallbackExpired,
}

impl OpEvent {
    pub const ALL: &'static [OpEvent] = &[
        OpEvent::ToolRequested,
        OpEvent::ApprovalRequested,
        OpEvent::ToolStarted,
        OpEvent::ToolAttempt,
        OpEvent::ToolResult,
        OpEvent::OutcomeConfirmed,
        OpEvent::OutcomeNotFound,
        OpEvent::OutcomeAmbiguous,
        OpEvent::ResolvedRetry,
        OpEvent::ResolvedCompleted,
        OpEvent::ResolvedFailed,
        OpEvent::TargetMoved,
        OpEvent::QuestionAnswered,
        OpEvent::QuestionTimedOut,
        OpEvent::ApprovalDenied,
        OpEvent::ApprovalExpired,
        OpEvent::WaitFired,
        OpEvent::CallbackReceived,
        OpEvent::CallbackMatched,
        OpEvent::CallbackExpired,
    ];

    /// The journaled event's type.
    pub fn event_type(self) -> EventType {
        match self {
            OpEvent::ToolRequested => EventType::ToolRequested,
            OpEvent::ApprovalRequested => EventType::ApprovalRequested,
            OpEvent::ToolStarted => EventType::ToolStarted,
            OpEvent::ToolAttempt => EventType::ToolAttempt,
            OpEvent::ToolResult => EventType::ToolResult,
            OpEvent::OutcomeConfirmed => EventType::OutcomeConfirmed,
            OpEvent::OutcomeNotFound => EventType::OutcomeNotFound,
            OpEvent::OutcomeAmbiguous => EventType::OutcomeAmbiguous,
            OpEvent::ResolvedRetry | OpEvent::ResolvedCompleted | OpEvent::ResolvedFailed => {
                EventType::OutcomeResolved
            }
            OpEvent::TargetMoved => EventType::TargetMoved,
            OpEvent::QuestionAnswered => EventType::QuestionAnswered,
            OpEvent::QuestionTimedOut | OpEvent::WaitFired | OpEvent::CallbackExpired => {
                EventType::TimerFired
            }
            OpEvent::ApprovalDenied => EventType::ApprovalDecided,
            OpEvent::ApprovalExpired => EventType::ApprovalExpired,
            OpEvent::CallbackReceived => EventType::CallbackReceived,
            OpEvent::CallbackMatched => EventType::CallbackExpected,
        }
    }
}

/// What an event does to an operation in one phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpTarget {
    /// The event applies: the operation is in this phase after it (maybe the one it was in).
    To(OpPhase),
    /// The operation is left as it is, for this reason; an input that acts on nothing else is
    /// counted in `RunState::ignored_inputs`.
    Ignored(&'static str),
    /// The fold fails with this reason: the single writer never journals it.
    Rejected(&'static str),
}

/// One row of the table: what `event` does to an operation in each phase.
#[derive(Debug, Clone, Copy)]
pub struct OpTransition {
    pub event: OpEvent,
    pub absent: OpTarget,
    pub awaiting_approval: OpTarget,
    pub requested: OpTarget,
    pub started: OpTarget,
    pub to_retry: OpTarget,
    pub ambiguous: OpTarget,
    pub done: OpTarget,
}

impl OpTransition {
    /// What the row's event does to an operation in `phase`.
    pub fn from(&self, phase: OpPhase) -> OpTarget {
        match phase {
            OpPhase::Absent => self.absent,
            OpPhase::AwaitingApproval => self.awaiting_approval,
            OpPhase::Requested => self.requested,
            OpPhase::Started => self.started,
            OpPhase::ToRetry => self.to_retry,
            OpPhase::Ambiguous => self.ambiguous,
            OpPhase::Done => self.done,
        }
    }

    /// The row of an event that gives an operation its result: any operation still without
    /// one is done; a result it already has stands.
    const fn settles(event: OpEvent) -> OpTransition {
        OpTransition {
            event,
            absent: Ignored(NO_SUCH_OPERATION),
            awaiting_approval: To(Done),
            requested: To(Done),
            started: To(Done),
            to_retry: To(Done),
            ambiguous: To(Done),
            done: Ignored(HAS_ITS_RESULT),
        }
    }

    /// The row of a person's word on an ambiguous operation (`outcome.resolved`).
    const fn resolves(event: OpEvent, to: OpPhase) -> OpTransition {
        OpTransition {
            event,
            absent: Ignored(NO_SUCH_OPERATION),
            awaiting_approval: Ignored(NOT_AMBIGUOUS),
            requested: Ignored(NOT_AMBIGUOUS),
            started: Ignored(NOT_AMBIGUOUS),
            to_retry: Ignored(NOT_AMBIGUOUS),
            ambiguous: To(to),
            done: Ignored(HAS_ITS_RESULT),
        }
    }
}

use OpPhase::{
    Ambiguous as Am, AwaitingApproval as AA, Done, Requested as Rq, Started as St, ToRetry as TR,
};
use OpTarget::{Ignored, Rejected, To};

const NO_SUCH_OPERATION: &str = "the run has no such operation";
const HAS_ITS_RESULT: &str = "the operation has its result: the first one stands";
const NOT_DISPATCHED: &str = "the operation is not dispatched";
const NOT_AMBIGUOUS: &str = "only an ambiguous operation waits for a person";

/// The operation lifecycle: one row per [`OpEvent`].
pub const TRANSITIONS: &[OpTransition] = &[
    // A first dispatch creates the operation, or dispatches the one a person approved; a later
    // one (after `outcome.not_found` or a person's `retry`) dispatches it again under the same
    // id, counting its dispatches.
    OpTransition {
        event: OpEvent::ToolRequested,
        absent: To(Rq),
        awaiting_approval: To(Rq),
        requested: To(Rq),
        started: To(Rq),
        to_retry: To(Rq),
        ambiguous: To(Rq),
        done: Rejected("operation already has a result"),
    },
    // The operation exists from now on, held back until approved. An operation that exists
    // stays where it is: a fresh request (after an invalidation) is made for where the target
    // is now, and forgets that it moved.
    OpTransition {
        event: OpEvent::ApprovalRequested,
        absent: To(AA),
        awaiting_approval: To(AA),
        requested: To(Rq),
        started: To(St),
        to_retry: To(TR),
        ambiguous: To(Am),
        done: To(Done),
    },
    OpTransition {
        event: OpEvent::ToolStarted,
        absent: Ignored(NO_SUCH_OPERATION),
        awaiting_approval: Ignored(NOT_DISPATCHED),
        requested: To(St),
        started: Ignored("the operation was started already"),
        to_retry: Ignored(NOT_DISPATCHED),
        ambiguous: Ignored(NOT_DISPATCHED),
        done: Ignored(HAS_ITS_RESULT),
    },
    // The operation waits for its next attempt as a dispatched one does.
    OpTransition {
        event: OpEvent::ToolAttempt,
        absent: Ignored(NO_SUCH_OPERATION),
        awaiting_approval: Ignored(NOT_DISPATCHED),
        requested: To(Rq),
        started: To(Rq),
        to_retry: Ignored(NOT_DISPATCHED),
        ambiguous: Ignored(NOT_DISPATCHED),
        done: Ignored(HAS_ITS_RESULT),
    },
    // A result counts whatever the operation's status: a runner's late result wins over a
    // person asked meanwhile (docs/ARCHITECTURE.md "The tool service").
    OpTransition::settles(OpEvent::ToolResult),
    OpTransition::settles(OpEvent::OutcomeConfirmed),
    OpTransition {
        event: OpEvent::OutcomeNotFound,
        absent: Ignored(NO_SUCH_OPERATION),
        awaiting_approval: To(TR),
        requested: To(TR),
        started: To(TR),
        to_retry: To(TR),
        ambiguous: To(TR),
        done: Ignored(HAS_ITS_RESULT),
    },
    OpTransition {
        event: OpEvent::OutcomeAmbiguous,
        absent: Ignored(NO_SUCH_OPERATION),
        awaiting_approval: To(Am),
        requested: To(Am),
        started: To(Am),
        to_retry: To(Am),
        ambiguous: To(Am),
        done: Ignored(HAS_ITS_RESULT),
    },
    OpTransition::resolves(OpEvent::ResolvedRetry, TR),
    OpTransition::resolves(OpEvent::ResolvedCompleted, Done),
    OpTransition::resolves(OpEvent::ResolvedFailed, Done),
    // Back to waiting for a person: the approval it ran under no longer holds.
    OpTransition {
        event: OpEvent::TargetMoved,
        absent: Ignored(NO_SUCH_OPERATION),
        awaiting_approval: Ignored(NOT_DISPATCHED),
        requested: To(AA),
        started: To(AA),
        to_retry: Ignored(NOT_DISPATCHED),
        ambiguous: Ignored(NOT_DISPATCHED),
        done: Ignored(HAS_ITS_RESULT),
    },
    // Results given on the operation's behalf by what it waits on.
    OpTransition::settles(OpEvent::QuestionAnswered),
    OpTransition::settles(OpEvent::QuestionTimedOut),
    OpTransition::settles(OpEvent::ApprovalDenied),
    OpTransition::settles(OpEvent::ApprovalExpired),
    OpTransition::settles(OpEvent::WaitFired),
    OpTransition::settles(OpEvent::CallbackReceived),
    OpTransition::settles(OpEvent::CallbackMatched),
    OpTransition::settles(OpEvent::CallbackExpired),
];

/// The row of an event.
pub fn transition(event: OpEvent) -> Option<&'static OpTransition> {
    TRANSITIONS.iter().find(|t| t.event == event)
}

/// What `event` does to an operation in `phase`.
pub fn target(phase: OpPhase, event: OpEvent) -> Option<OpTarget> {
    transition(event).map(|t| t.from(phase))
}

#[cfg(test)]
mod tests;
