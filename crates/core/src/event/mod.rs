//! Journal events: the envelope and every event type's data.
//!
//! An event is either a **decision** (appended only by the holder of the run's lease, on
//! `agent.run.<id>.d.<type>`, with an optimistic-concurrency check) or an **input** (appended by
//! anyone, on `agent.run.<id>.i.<type>`, deduplicated by `Nats-Msg-Id`). [`EventKind`] says which;
//! the split is part of the type, not a convention.
//!
//! On the wire an event is one JSON envelope: `run_id, type, at, step, attempt, op, data, digest`,
//! where `digest` is the SHA-256 of `data` in canonical JSON (keys sorted, no whitespace).
//!
//! The module is split by area:
//! - `envelope`: the envelope ([`Envelope`]) and its JSON form, and the [`Draft`] it is made from;
//! - `digest` and `timestamp`: the [`Digest`] of an event's data and the instants events carry;
//! - `run`: the run's lifecycle (`run.*`), its budget, and the inputs that drive it;
//! - `step`: a step's model call, its usage, the waits on the provider and context compaction;
//! - `tool`: tool operations and the settling of their outcomes;
//! - `wait`: questions, approvals, timers and callbacks;
//! - `compensation` and `child`: undoing effects, and child runs;
//! - here: the `events!` table, which declares every event type with its wire name and kind.

mod child;
mod compensation;
mod digest;
mod envelope;
mod run;
mod step;
mod timestamp;
mod tool;
mod wait;

use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema};
use serde::{Deserialize, Serialize};

pub use crate::settings::{ModelSettings, Price};
pub use crate::tools::{RetryPolicy, ToolErrorClass};

pub use child::{ChildStarted, ParentLink};
pub use compensation::{
    CompensateSpec, CompensationOutcome, CompensationStatus, Level, PlannedCompensation,
    Reversibility, RunCompensating, StopCause,
};
pub use digest::{Digest, DigestError, SeqDigest};
pub use envelope::{DecisionEnvelope, Draft, Envelope, EnvelopeError, InputEnvelope};
pub use run::{
    Budget, CancelRequested, FailureReason, Gate, Nudge, OpFate, OpSummary, OutputRejected,
    OutputValidation, RunCancelled, RunCancelling, RunCreated, RunFailed, RunGated, RunQueued,
    RunResumed, RunRevived, RunStarted, RunSucceeded, RunUnknown, RunWaiting, SlotGranted,
    UserMessage, WaitReason,
};
pub use step::{
    AssistantMessage, AttemptOutcome, CompactionCause, CompactionSummary, ContextCompacted,
    ErrorClass, FinishReason, ModelAttempt, ModelSpec, Provider, ProviderReleased, ProviderWaiting,
    StepCompleted, StepStarted, ThinkingBlock, ToolCall, Trouble, Usage,
};
pub use timestamp::Timestamp;
pub use tool::{
    OutcomeAmbiguous, OutcomeConfirmed, OutcomeNotFound, OutcomeResolved, Resolution, TargetMoved,
    ToolAttempt, ToolRequested, ToolResult, ToolStarted,
};
pub use wait::{
    ApprovalDecided, ApprovalExpired, ApprovalInvalidated, ApprovalRequested, CallbackExpected,
    CallbackReceived, QuestionAnswered, QuestionAsked, Risk, TimerFired, TimerPurpose,
    TimerScheduled, Verdict,
};

/// Whether an event is written by the run's single decision writer or by anyone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Decision,
    Input,
}

impl EventKind {
    /// The subject token between the run id and the event type: `d` or `i`.
    pub fn token(self) -> &'static str {
        match self {
            EventKind::Decision => "d",
            EventKind::Input => "i",
        }
    }
}

/// An unknown event type name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown event type `{0}`")]
pub struct UnknownEventType(pub String);

macro_rules! events {
    (
        decisions { $($dv:ident($dt:ty) = $dn:literal;)* }
        inputs { $($iv:ident($it:ty) = $in:literal;)* }
    ) => {
        /// A journal event: its type and data. Serialized as `{"type": …, "data": …}` inside the
        /// envelope.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
        #[serde(tag = "type", content = "data")]
        pub enum Event {
            $(#[serde(rename = $dn)] $dv($dt),)*
            $(#[serde(rename = $in)] $iv($it),)*
        }

        /// A decision: an event only the run's single writer appends
        /// ([`crate::event::EventKind::Decision`]). Made into an [`Event`] by `From`.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Decision {
            $($dv($dt),)*
        }

        /// An input: an event anyone may append, deduplicated by its id
        /// ([`crate::event::EventKind::Input`]). Made into an [`Event`] by `From`.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Input {
            $($iv($it),)*
        }

        /// A decision's data, borrowed from its [`Event`] ([`Event::by_kind`]).
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub enum DecisionRef<'a> {
            $($dv(&'a $dt),)*
        }

        /// An input's data, borrowed from its [`Event`] ([`Event::by_kind`]).
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub enum InputRef<'a> {
            $($iv(&'a $it),)*
        }

        /// The type of an event, without its data.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum EventType {
            $($dv,)*
            $($iv,)*
        }

        impl EventType {
            /// Every event type, in declaration order (the decisions, then the inputs).
            pub const ALL: &'static [EventType] = &[$(EventType::$dv,)* $(EventType::$iv,)*];

            /// The wire name (`run.created`), also the last tokens of the event's subject.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(EventType::$dv => $dn,)*
                    $(EventType::$iv => $in,)*
                }
            }

            pub fn kind(self) -> EventKind {
                match self {
                    $(EventType::$dv => EventKind::Decision,)*
                    $(EventType::$iv => EventKind::Input,)*
                }
            }
        }

        impl FromStr for EventType {
            type Err = UnknownEventType;
            fn from_str(s: &str) -> Result<Self, UnknownEventType> {
                match s {
                    $($dn => Ok(EventType::$dv),)*
                    $($in => Ok(EventType::$iv),)*
                    other => Err(UnknownEventType(other.to_owned())),
                }
            }
        }

        impl Event {
            pub fn event_type(&self) -> EventType {
                match self {
                    $(Event::$dv(_) => EventType::$dv,)*
                    $(Event::$iv(_) => EventType::$iv,)*
                }
            }

            /// The event's data as a decision's or an input's, borrowed: what a reader that
            /// treats the two apart (the fold) matches on, each side exhaustively.
            pub fn by_kind(&self) -> ByKind<'_> {
                match self {
                    $(Event::$dv(d) => ByKind::Decision(DecisionRef::$dv(d)),)*
                    $(Event::$iv(d) => ByKind::Input(InputRef::$iv(d)),)*
                }
            }

            /// JSON Schema of each event type's `data`, in declaration order.
            pub fn data_schemas() -> Vec<(EventType, Schema)> {
                vec![
                    $((EventType::$dv, schemars::schema_for!($dt)),)*
                    $((EventType::$iv, schemars::schema_for!($it)),)*
                ]
            }

            /// The event of `event_type` whose `data` is `data` (an envelope's two fields).
            fn from_parts(
                event_type: EventType,
                data: &serde_json::value::RawValue,
            ) -> Result<Event, serde_json::Error> {
                Ok(match event_type {
                    $(EventType::$dv => Event::$dv(serde_json::from_str(data.get())?),)*
                    $(EventType::$iv => Event::$iv(serde_json::from_str(data.get())?),)*
                })
            }

            /// The event's data as JSON (what the envelope's `data` holds and `digest` covers).
            pub fn data_json(&self) -> serde_json::Value {
                let value = match self {
                    $(Event::$dv(d) => serde_json::to_value(d),)*
                    $(Event::$iv(d) => serde_json::to_value(d),)*
                };
                value.unwrap_or(serde_json::Value::Null)
            }
        }

        impl From<Decision> for Event {
            fn from(d: Decision) -> Event {
                match d {
                    $(Decision::$dv(d) => Event::$dv(d),)*
                }
            }
        }

        impl From<Input> for Event {
            fn from(i: Input) -> Event {
                match i {
                    $(Input::$iv(d) => Event::$iv(d),)*
                }
            }
        }

        impl TryFrom<Event> for Decision {
            type Error = Input;
            /// The decision an event is, or the input it is instead.
            fn try_from(e: Event) -> Result<Decision, Input> {
                match e {
                    $(Event::$dv(d) => Ok(Decision::$dv(d)),)*
                    $(Event::$iv(d) => Err(Input::$iv(d)),)*
                }
            }
        }

        impl Decision {
            pub fn event_type(&self) -> EventType {
                match self {
                    $(Decision::$dv(_) => EventType::$dv,)*
                }
            }

            /// The decision's data, borrowed.
            pub fn borrowed(&self) -> DecisionRef<'_> {
                match self {
                    $(Decision::$dv(d) => DecisionRef::$dv(d),)*
                }
            }
        }

        impl Input {
            pub fn event_type(&self) -> EventType {
                match self {
                    $(Input::$iv(_) => EventType::$iv,)*
                }
            }

            /// The input's data, borrowed.
            pub fn borrowed(&self) -> InputRef<'_> {
                match self {
                    $(Input::$iv(d) => InputRef::$iv(d),)*
                }
            }
        }
    };
}

events! {
    decisions {
        RunCreated(Box<RunCreated>) = "run.created";
        RunStarted(RunStarted) = "run.started";
        StepStarted(StepStarted) = "step.started";
        ModelAttempt(ModelAttempt) = "model.attempt";
        StepCompleted(StepCompleted) = "step.completed";
        ToolRequested(ToolRequested) = "tool.requested";
        QuestionAsked(QuestionAsked) = "question.asked";
        ChildStarted(ChildStarted) = "child.started";
        ApprovalRequested(ApprovalRequested) = "approval.requested";
        ApprovalInvalidated(ApprovalInvalidated) = "approval.invalidated";
        ApprovalExpired(ApprovalExpired) = "approval.expired";
        TimerScheduled(TimerScheduled) = "timer.scheduled";
        CallbackExpected(CallbackExpected) = "callback.expected";
        OutputRejected(OutputRejected) = "output.rejected";
        RunWaiting(RunWaiting) = "run.waiting";
        RunCancelling(RunCancelling) = "run.cancelling";
        RunUnknown(RunUnknown) = "run.unknown";
        RunResumed(RunResumed) = "run.resumed";
        RunRevived(RunRevived) = "run.revived";
        RunSucceeded(RunSucceeded) = "run.succeeded";
        RunFailed(RunFailed) = "run.failed";
        RunCancelled(RunCancelled) = "run.cancelled";
        RunGated(RunGated) = "run.gated";
        RunCompensating(RunCompensating) = "run.compensating";
        ProviderWaiting(ProviderWaiting) = "provider.waiting";
        ContextCompacted(ContextCompacted) = "context.compacted";
        RunQueued(RunQueued) = "run.queued";
    }
    inputs {
        UserMessage(UserMessage) = "user.message";
        ToolStarted(ToolStarted) = "tool.started";
        ToolResult(ToolResult) = "tool.result";
        ToolAttempt(ToolAttempt) = "tool.attempt";
        QuestionAnswered(QuestionAnswered) = "question.answered";
        ApprovalDecided(ApprovalDecided) = "approval.decided";
        TimerFired(TimerFired) = "timer.fired";
        CallbackReceived(CallbackReceived) = "callback.received";
        CancelRequested(CancelRequested) = "cancel.requested";
        OutcomeConfirmed(OutcomeConfirmed) = "outcome.confirmed";
        OutcomeNotFound(OutcomeNotFound) = "outcome.not_found";
        OutcomeAmbiguous(OutcomeAmbiguous) = "outcome.ambiguous";
        OutcomeResolved(OutcomeResolved) = "outcome.resolved";
        TargetMoved(TargetMoved) = "target.moved";
        Nudge(Nudge) = "nudge";
        ProviderReleased(ProviderReleased) = "provider.released";
        SlotGranted(SlotGranted) = "slot.granted";
    }
}

/// An event's data by its kind ([`Event::by_kind`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ByKind<'a> {
    Decision(DecisionRef<'a>),
    Input(InputRef<'a>),
}

impl Event {
    pub fn kind(&self) -> EventKind {
        self.event_type().kind()
    }
}

impl EventType {
    /// Whether the step service drives a run when this event of it is stored: its creation
    /// and every input that can change what the run does next. Not the start of a tool
    /// attempt (`tool.started`) nor a failed attempt that will be retried (`tool.attempt`):
    /// the step's consumer delivers them too (one wildcard over the inputs,
    /// docs/ARCHITECTURE.md "The broker's cost per run") and the step acknowledges them
    /// unread.
    pub fn wakes_step(self) -> bool {
        match self {
            EventType::RunCreated => true,
            EventType::ToolStarted | EventType::ToolAttempt => false,
            other => other.kind() == EventKind::Input,
        }
    }

    /// Whether an event of this type may be journaled on its operation's inline subject
    /// ([`Envelope::inline`]): the request of an operation its run's drive runs itself, the
    /// start of an attempt and the result. Every other event of such an operation (a retried
    /// attempt, a confirmed or ambiguous outcome, a moved target) is journaled as any other,
    /// and wakes the step as any other.
    pub fn may_be_inline(self) -> bool {
        matches!(
            self,
            EventType::ToolRequested | EventType::ToolStarted | EventType::ToolResult
        )
    }
}

impl fmt::Display for EventType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_event_type_name_round_trips_and_is_subject_safe() {
        for t in EventType::ALL {
            assert_eq!(t.as_str().parse::<EventType>(), Ok(*t));
            assert!(
                t.as_str()
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c == '.' || c == '_'),
                "{t}"
            );
        }
        assert!("run.exploded".parse::<EventType>().is_err());
    }

    #[test]
    fn decisions_and_inputs_are_split() {
        use EventType as T;
        for t in [
            T::RunCreated,
            T::StepStarted,
            T::ToolRequested,
            T::RunSucceeded,
        ] {
            assert_eq!(t.kind(), EventKind::Decision, "{t}");
        }
        for t in [T::UserMessage, T::ToolResult, T::CancelRequested, T::Nudge] {
            assert_eq!(t.kind(), EventKind::Input, "{t}");
        }
    }
}
