//! Typed identifiers.
//!
//! Every id has a prefixed string form (`run_…`, `op_…`, `apr_…`) so that an id pasted into a log,
//! a subject or a URL says what it is, and parsing one kind as another fails with
//! [`IdError::TypeMismatch`]. Ids that appear in NATS subjects (run ids, agent names) are restricted
//! to characters that are safe in a subject token: ASCII letters, digits, `_` and `-`.
//!
//! Derived ids are pure functions of their parts: an operation id is `(run, step, call index)` and a
//! model request id is `(run, step, attempt)`, so a worker that takes over after a crash computes the
//! same ids as the one that died.
//!
//! The module is split by kind: here the prefixed ids (`run_…`, `apr_…`, …) and the counters
//! (steps, attempts); `derived` the ids computed from their parts; `name` the unprefixed names
//! (agents, tenants); `input` the deduplication ids of journal inputs; `seq` a decision's stream
//! sequence.

/// The impls every id with a string form shares: parsed from a `String` through its `FromStr`
/// (so serde validates what it decodes), turned back into one by `$into`, written
/// `Name(value)` by `Debug`, and a string matching `$pattern` in the JSON Schemas (`schemas/`).
macro_rules! string_form {
    ($name:ident, $pattern:expr, |$id:ident| $into:expr) => {
        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                s.parse()
            }
        }

        impl From<$name> for String {
            fn from($id: $name) -> String {
                $into
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({})"), self)
            }
        }

        impl JsonSchema for $name {
            fn schema_name() -> Cow<'static, str> {
                stringify!($name).into()
            }
            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                json_schema!({ "type": "string", "pattern": $pattern })
            }
        }
    };
}

mod derived;
mod input;
mod name;
mod seq;

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

pub use derived::{ModelRequestId, OperationId};
pub use input::InputId;
pub use name::{AgentName, TenantId, WorkerId};
pub use seq::DecisionSeq;

/// Longest body (after the prefix) accepted for a run id. Derived ids (operations, questions)
/// embed it, so other ids accept up to [`MAX_ID_BODY`].
pub const MAX_RUN_ID_BODY: usize = 64;
/// Longest body (after the prefix) accepted for any other prefixed id.
pub const MAX_ID_BODY: usize = 128;

/// Why a string is not a valid id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("expected an id starting with `{expected}`, got `{got}`")]
    TypeMismatch { expected: &'static str, got: String },
    #[error("`{kind}` id has an empty body")]
    Empty { kind: &'static str },
    #[error("`{kind}` id is longer than {max} characters")]
    TooLong { kind: &'static str, max: usize },
    #[error("`{kind}` id contains `{ch}`; only ASCII letters, digits, `_` and `-` are allowed")]
    InvalidChar { kind: &'static str, ch: char },
    #[error("`{got}` is not a valid {kind} id: {why}")]
    Malformed {
        kind: &'static str,
        got: String,
        why: &'static str,
    },
}

fn is_token_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-'
}

/// Validates an id body: non-empty, bounded, subject-safe characters only.
fn check_body(kind: &'static str, body: &str, max: usize) -> Result<(), IdError> {
    if body.is_empty() {
        return Err(IdError::Empty { kind });
    }
    if body.len() > max {
        return Err(IdError::TooLong { kind, max });
    }
    match body.chars().find(|c| !is_token_char(*c)) {
        Some(ch) => Err(IdError::InvalidChar { kind, ch }),
        None => Ok(()),
    }
}

fn strip<'a>(prefix: &'static str, s: &'a str) -> Result<&'a str, IdError> {
    s.strip_prefix(prefix).ok_or_else(|| IdError::TypeMismatch {
        expected: prefix,
        got: s.chars().take(40).collect(),
    })
}

/// Declares a prefixed, opaque id: `prefix + token`, new ones from a UUIDv7 (time-ordered).
macro_rules! prefixed_id {
    ($(#[$meta:meta])* $name:ident, $prefix:literal, $max:expr, $max_lit:literal) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub const PREFIX: &'static str = $prefix;

            /// A fresh id (UUIDv7 body, so ids sort by creation time).
            pub fn generate() -> Self {
                Self(format!("{}{}", $prefix, uuid::Uuid::now_v7().simple()))
            }

            /// The part after the prefix.
            pub fn body(&self) -> &str {
                &self.0[$prefix.len()..]
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                let body = strip($prefix, s)?;
                check_body(stringify!($name), body, $max)?;
                Ok(Self(s.to_owned()))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        string_form!(
            $name,
            concat!("^", $prefix, "[A-Za-z0-9_-]{1,", $max_lit, "}$"),
            |id| id.0
        );
    };
}

prefixed_id!(
    /// A run: one agent conversation, from `run.created` to its terminal event (and beyond, when
    /// revived). Clients may choose their own (`run_` + up to 100 subject-safe characters).
    RunId,
    "run_",
    MAX_RUN_ID_BODY,
    "64"
);
prefixed_id!(
    /// An approval request shown to a person.
    ApprovalId,
    "apr_",
    MAX_ID_BODY,
    "128"
);
prefixed_id!(
    /// A question asked to the user (`ask_user`).
    QuestionId,
    "q_",
    MAX_ID_BODY,
    "128"
);
prefixed_id!(
    /// A durable timer.
    TimerId,
    "tmr_",
    MAX_ID_BODY,
    "128"
);
prefixed_id!(
    /// The correlation key an external callback is matched by.
    CallbackKey,
    "cbk_",
    MAX_ID_BODY,
    "128"
);

/// Declares a plain, counted number (step, attempt) that serializes as an integer.
macro_rules! counter {
    ($(#[$meta:meta])* $name:ident, $label:literal) => {
        $(#[$meta])*
        #[derive(
            Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize, JsonSchema,
        )]
        #[serde(transparent)]
        pub struct $name(pub u32);

        impl $name {
            pub fn get(self) -> u32 {
                self.0
            }
            pub fn next(self) -> Self {
                Self(self.0.saturating_add(1))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($label, "{}"), self.0)
            }
        }
    };
}

counter!(
    /// A step number within a run: step 1 is the first model call. Steps never reuse numbers,
    /// also across revivals.
    StepNo,
    "step#"
);
counter!(
    /// An attempt at a step's model call: 1 for the first call; each retry (after a crash or a
    /// retryable error) journals a new `step.started` with the next attempt.
    Attempt,
    "attempt#"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_round_trip_and_carry_their_prefix() {
        let run = RunId::generate();
        assert!(run.as_str().starts_with("run_"));
        assert_eq!(run.as_str().parse::<RunId>(), Ok(run.clone()));
        let apr = ApprovalId::generate();
        assert_eq!(apr.to_string().parse::<ApprovalId>(), Ok(apr));
    }

    #[test]
    fn wrong_prefix_is_a_type_mismatch() {
        let err = "apr_123".parse::<RunId>().expect_err("wrong prefix");
        assert!(matches!(
            err,
            IdError::TypeMismatch {
                expected: "run_",
                ..
            }
        ));
    }

    #[test]
    fn subject_unsafe_characters_are_refused() {
        for bad in ["run_a.b", "run_a*", "run_>", "run_a b", "run_ä"] {
            assert!(
                matches!(bad.parse::<RunId>(), Err(IdError::InvalidChar { .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            "run_".parse::<RunId>(),
            Err(IdError::Empty { .. })
        ));
        let long = format!("run_{}", "x".repeat(MAX_RUN_ID_BODY + 1));
        assert!(matches!(
            long.parse::<RunId>(),
            Err(IdError::TooLong { .. })
        ));
    }

    #[test]
    fn ids_serialize_as_strings_and_validate_on_deserialize() {
        let run: RunId = "run_abc".parse().expect("valid");
        assert_eq!(serde_json::to_string(&run).expect("ser"), "\"run_abc\"");
        assert!(serde_json::from_str::<RunId>("\"run_a.b\"").is_err());
        assert_eq!(
            serde_json::to_string(&StepNo(4)).expect("ser"),
            "4",
            "counters are plain numbers"
        );
        let agent: AgentName = "research-bot".parse().expect("valid");
        assert_eq!(agent.as_str(), "research-bot");
        assert!("a.b".parse::<AgentName>().is_err());
    }

    #[test]
    fn worker_ids_are_subject_tokens() {
        let fresh = WorkerId::generate();
        assert!(fresh.as_str().starts_with("w-") && fresh.as_str().len() == 14);
        assert_eq!(fresh.as_str().parse::<WorkerId>(), Ok(fresh.clone()));
        assert_eq!(
            serde_json::to_string(&"step-7".parse::<WorkerId>().expect("valid")).expect("ser"),
            "\"step-7\""
        );
        for bad in ["", "step-7@host", "a b", "a.b", "a*", "w>"] {
            assert!(bad.parse::<WorkerId>().is_err(), "{bad}");
        }
        assert!("w".repeat(129).parse::<WorkerId>().is_err());
        assert!(serde_json::from_str::<WorkerId>("\"a.b\"").is_err());
    }
}
