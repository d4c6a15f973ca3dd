//! The journal envelope: an event stamped with its run, time and position, and its JSON form.

use std::borrow::Cow;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Decision, Digest, Event, EventKind, EventType, Input, Timestamp};
use crate::ids::{Attempt, OperationId, RunId, StepNo};

/// An event before it is stamped with its run and time: what `decide` produces (a
/// `Draft<Decision>`) and the shells append. `E` is the event: a [`Decision`], an [`Input`], or
/// either ([`Event`], the default, for readers and tests that build histories).
#[derive(Debug, Clone, PartialEq)]
pub struct Draft<E = Event> {
    pub event: E,
    pub step: Option<StepNo>,
    pub attempt: Option<Attempt>,
    pub op: Option<OperationId>,
    /// Journaled on the operation's inline subject ([`Envelope::inline`]).
    pub inline: bool,
}

impl<E> Draft<E> {
    pub fn new(event: E) -> Self {
        Self {
            event,
            step: None,
            attempt: None,
            op: None,
            inline: false,
        }
    }
    pub fn step(mut self, step: StepNo) -> Self {
        self.step = Some(step);
        self
    }
    pub fn attempt(mut self, attempt: Attempt) -> Self {
        self.attempt = Some(attempt);
        self
    }
    pub fn op(mut self, op: OperationId) -> Self {
        self.op = Some(op);
        self
    }
    /// Marks the draft as an event of an operation its run's drive runs itself
    /// ([`Envelope::inline`]).
    pub fn inline(mut self) -> Self {
        self.inline = true;
        self
    }
}

impl<E: Into<Event>> Draft<E> {
    /// The same draft, its event as an [`Event`] of either kind.
    pub fn widen(self) -> Draft<Event> {
        Draft {
            event: self.event.into(),
            step: self.step,
            attempt: self.attempt,
            op: self.op,
            inline: self.inline,
        }
    }
}

macro_rules! kinded_envelope {
    ($(#[$doc:meta])* $name:ident, $kind:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq)]
        pub struct $name(Envelope);

        impl $name {
            /// Stamps a draft with its run and time (see [`Envelope::new`]).
            pub fn new(run_id: RunId, at: Timestamp, draft: Draft<$kind>) -> Self {
                Self(Envelope::new(run_id, at, draft))
            }

            pub fn envelope(&self) -> &Envelope {
                &self.0
            }

            pub fn into_envelope(self) -> Envelope {
                self.0
            }
        }

        impl std::ops::Deref for $name {
            type Target = Envelope;
            fn deref(&self) -> &Envelope {
                &self.0
            }
        }

        impl From<$name> for Envelope {
            fn from(e: $name) -> Envelope {
                e.0
            }
        }

        impl TryFrom<Envelope> for $name {
            type Error = Envelope;
            /// The envelope, if its event is of this kind; otherwise the envelope back.
            fn try_from(e: Envelope) -> Result<Self, Envelope> {
                if e.kind() == EventKind::$kind {
                    Ok(Self(e))
                } else {
                    Err(e)
                }
            }
        }
    };
}

kinded_envelope!(
    /// An envelope whose event is a decision: what the journal's decision appends take, so an
    /// input cannot be appended on a decision path (the kind is in the type).
    DecisionEnvelope,
    Decision
);

kinded_envelope!(
    /// An envelope whose event is an input: what the journal's input appends take.
    InputEnvelope,
    Input
);

/// The journal envelope: what one message on `agent.run.<run_id>.{d,i}.<type>` carries (or, for
/// an operation run inline, on its inline subject: [`Envelope::inline`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Envelope {
    pub run_id: RunId,
    pub at: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<StepNo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<Attempt>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<OperationId>,
    /// An event of an operation the run's drive runs itself, inline (docs/ARCHITECTURE.md
    /// "Inline tools"): its `tool.requested` is journaled on `agent.run.<run_id>.d.inline.<type>`
    /// (a decision no tool service takes) and its `tool.started` and `tool.result` on
    /// `agent.run.<run_id>.inline.<type>` (inputs that wake no step). Only those three types
    /// may be inline ([`EventType::may_be_inline`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inline: bool,
    #[serde(flatten)]
    pub event: Event,
    /// SHA-256 of `data` in canonical JSON.
    pub digest: Digest,
}

/// A message that is not a valid envelope.
#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    #[error("not a valid journal envelope: {0}")]
    Json(#[from] serde_json::Error),
    #[error("digest mismatch for {event_type}: envelope says {claimed}, data hashes to {actual}")]
    DigestMismatch {
        event_type: EventType,
        claimed: Digest,
        actual: Digest,
    },
}

impl Envelope {
    /// Stamps a draft with its run and time and computes the data digest.
    pub fn new(run_id: RunId, at: Timestamp, draft: Draft<impl Into<Event>>) -> Self {
        let draft = draft.widen();
        let digest = Digest::of_json(&draft.event.data_json());
        Self {
            run_id,
            at,
            step: draft.step,
            attempt: draft.attempt,
            op: draft.op,
            inline: draft.inline,
            event: draft.event,
            digest,
        }
    }

    pub fn event_type(&self) -> EventType {
        self.event.event_type()
    }

    pub fn kind(&self) -> EventKind {
        self.event.kind()
    }

    /// The subject this event is journaled on: `agent.run.<run_id>.<d|i>.<type>`, or its inline
    /// subject ([`Envelope::inline`]).
    pub fn subject(&self) -> String {
        if self.inline {
            crate::subjects::inline_event(&self.run_id, self.event_type())
        } else {
            crate::subjects::event(&self.run_id, self.event_type())
        }
    }

    pub fn to_json_bytes(&self) -> Vec<u8> {
        // An envelope is plain data with string keys: serialization cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parses an envelope and checks its digest.
    ///
    /// The same as deserializing an [`Envelope`], without serde's `flatten`, which buffers
    /// every field it does not know (here `type` and the whole `data`) into a tree first: the
    /// data is decoded by its type straight from its bytes.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        /// An envelope on the wire, its data still raw.
        #[derive(Deserialize)]
        struct Wire<'a> {
            run_id: RunId,
            at: Timestamp,
            #[serde(default)]
            step: Option<StepNo>,
            #[serde(default)]
            attempt: Option<Attempt>,
            #[serde(default)]
            op: Option<OperationId>,
            #[serde(default)]
            inline: bool,
            #[serde(rename = "type", borrow)]
            event_type: Cow<'a, str>,
            #[serde(borrow)]
            data: &'a serde_json::value::RawValue,
            digest: Digest,
        }
        let wire: Wire<'_> = serde_json::from_slice(bytes)?;
        let event_type = wire
            .event_type
            .parse::<EventType>()
            .map_err(|e| EnvelopeError::Json(<serde_json::Error as serde::de::Error>::custom(e)))?;
        let env = Envelope {
            run_id: wire.run_id,
            at: wire.at,
            step: wire.step,
            attempt: wire.attempt,
            op: wire.op,
            inline: wire.inline,
            event: Event::from_parts(event_type, wire.data)?,
            digest: wire.digest,
        };
        env.verify_digest()?;
        Ok(env)
    }

    pub fn verify_digest(&self) -> Result<(), EnvelopeError> {
        let actual = Digest::of_json(&self.event.data_json());
        if actual == self.digest {
            Ok(())
        } else {
            Err(EnvelopeError::DigestMismatch {
                event_type: self.event_type(),
                claimed: self.digest.clone(),
                actual,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{ToolResult, UserMessage};

    fn run() -> RunId {
        "run_t1".parse().expect("valid")
    }

    #[test]
    fn envelope_round_trips_with_digest() {
        let op = OperationId::new(&run(), StepNo(1), 0);
        let env = Envelope::new(
            run(),
            Timestamp::now(),
            Draft::new(Event::ToolResult(ToolResult {
                content: "ok".into(),
                is_error: false,
                stopped: false,
            }))
            .step(StepNo(1))
            .op(op.clone()),
        );
        let bytes = env.to_json_bytes();
        let value: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
        assert_eq!(value["type"], "tool.result");
        assert_eq!(value["op"], op.to_string());
        assert_eq!(value["data"]["content"], "ok");
        assert_eq!(env.subject(), "agent.run.run_t1.i.tool.result");
        let back = Envelope::from_json_bytes(&bytes).expect("parses");
        assert_eq!(back, env);
    }

    #[test]
    fn tampered_data_fails_the_digest_check() {
        let env = Envelope::new(
            run(),
            Timestamp::now(),
            Draft::new(Event::UserMessage(UserMessage { text: "hi".into() })),
        );
        let mut value: serde_json::Value =
            serde_json::from_slice(&env.to_json_bytes()).expect("json");
        value["data"]["text"] = "bye".into();
        let bytes = serde_json::to_vec(&value).expect("json");
        assert!(matches!(
            Envelope::from_json_bytes(&bytes),
            Err(EnvelopeError::DigestMismatch { .. })
        ));
    }
}
