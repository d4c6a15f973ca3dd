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
pub use envelope::{Draft, Envelope, EnvelopeError};
pub use run::{
    Budget, CancelRequested, FailureReason, Gate, Nudge, OpFate, OpSummary, OutputRejected,
    OutputValidation, RunCancelled, RunCancelling, RunCreated, RunFailed, RunGated, RunResumed,
    RunRevived, RunStarted, RunSucceeded, RunUnknown, RunWaiting, UserMessage, WaitReason,
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

fn is_false(b: &bool) -> bool {
    !*b
}

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
    ($($kind:ident $variant:ident($data:ty) = $name:literal;)*) => {
        /// A journal event: its type and data. Serialized as `{"type": …, "data": …}` inside the
        /// envelope.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
        #[serde(tag = "type", content = "data")]
        pub enum Event {
            $(#[serde(rename = $name)] $variant($data),)*
        }

        /// The type of an event, without its data.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum EventType {
            $($variant,)*
        }

        impl EventType {
            /// Every event type, in declaration order.
            pub const ALL: &'static [EventType] = &[$(EventType::$variant,)*];

            /// The wire name (`run.created`), also the last tokens of the event's subject.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(EventType::$variant => $name,)*
                }
            }

            pub fn kind(self) -> EventKind {
                match self {
                    $(EventType::$variant => EventKind::$kind,)*
                }
            }
        }

        impl FromStr for EventType {
            type Err = UnknownEventType;
            fn from_str(s: &str) -> Result<Self, UnknownEventType> {
                match s {
                    $($name => Ok(EventType::$variant),)*
                    other => Err(UnknownEventType(other.to_owned())),
                }
            }
        }

        impl Event {
            pub fn event_type(&self) -> EventType {
                match self {
                    $(Event::$variant(_) => EventType::$variant,)*
                }
            }

            /// JSON Schema of each event type's `data`, in declaration order.
            pub fn data_schemas() -> Vec<(EventType, Schema)> {
                vec![$((EventType::$variant, schemars::schema_for!($data)),)*]
            }

            /// The event of `event_type` whose `data` is `data` (an envelope's two fields).
            fn from_parts(
                event_type: EventType,
                data: &serde_json::value::RawValue,
            ) -> Result<Event, serde_json::Error> {
                Ok(match event_type {
                    $(EventType::$variant => Event::$variant(serde_json::from_str(data.get())?),)*
                })
            }

            /// The event's data as JSON (what the envelope's `data` holds and `digest` covers).
            pub fn data_json(&self) -> serde_json::Value {
                let value = match self {
                    $(Event::$variant(d) => serde_json::to_value(d),)*
                };
                value.unwrap_or(serde_json::Value::Null)
            }
        }
    };
}

events! {
    Decision RunCreated(Box<RunCreated>) = "run.created";
    Decision RunStarted(RunStarted) = "run.started";
    Decision StepStarted(StepStarted) = "step.started";
    Decision ModelAttempt(ModelAttempt) = "model.attempt";
    Decision StepCompleted(StepCompleted) = "step.completed";
    Decision ToolRequested(ToolRequested) = "tool.requested";
    Decision QuestionAsked(QuestionAsked) = "question.asked";
    Decision ChildStarted(ChildStarted) = "child.started";
    Decision ApprovalRequested(ApprovalRequested) = "approval.requested";
    Decision ApprovalInvalidated(ApprovalInvalidated) = "approval.invalidated";
    Decision ApprovalExpired(ApprovalExpired) = "approval.expired";
    Decision TimerScheduled(TimerScheduled) = "timer.scheduled";
    Decision CallbackExpected(CallbackExpected) = "callback.expected";
    Decision OutputRejected(OutputRejected) = "output.rejected";
    Decision RunWaiting(RunWaiting) = "run.waiting";
    Decision RunCancelling(RunCancelling) = "run.cancelling";
    Decision RunUnknown(RunUnknown) = "run.unknown";
    Decision RunResumed(RunResumed) = "run.resumed";
    Decision RunRevived(RunRevived) = "run.revived";
    Decision RunSucceeded(RunSucceeded) = "run.succeeded";
    Decision RunFailed(RunFailed) = "run.failed";
    Decision RunCancelled(RunCancelled) = "run.cancelled";
    Decision RunGated(RunGated) = "run.gated";
    Decision RunCompensating(RunCompensating) = "run.compensating";
    Decision ProviderWaiting(ProviderWaiting) = "provider.waiting";
    Decision ContextCompacted(ContextCompacted) = "context.compacted";
    Input UserMessage(UserMessage) = "user.message";
    Input ToolStarted(ToolStarted) = "tool.started";
    Input ToolResult(ToolResult) = "tool.result";
    Input ToolAttempt(ToolAttempt) = "tool.attempt";
    Input QuestionAnswered(QuestionAnswered) = "question.answered";
    Input ApprovalDecided(ApprovalDecided) = "approval.decided";
    Input TimerFired(TimerFired) = "timer.fired";
    Input CallbackReceived(CallbackReceived) = "callback.received";
    Input CancelRequested(CancelRequested) = "cancel.requested";
    Input OutcomeConfirmed(OutcomeConfirmed) = "outcome.confirmed";
    Input OutcomeNotFound(OutcomeNotFound) = "outcome.not_found";
    Input OutcomeAmbiguous(OutcomeAmbiguous) = "outcome.ambiguous";
    Input OutcomeResolved(OutcomeResolved) = "outcome.resolved";
    Input TargetMoved(TargetMoved) = "target.moved";
    Input Nudge(Nudge) = "nudge";
    Input ProviderReleased(ProviderReleased) = "provider.released";
}

impl Event {
    pub fn kind(&self) -> EventKind {
        self.event_type().kind()
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
