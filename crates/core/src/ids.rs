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

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

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

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                s.parse()
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.0)
            }
        }

        impl JsonSchema for $name {
            fn schema_name() -> Cow<'static, str> {
                stringify!($name).into()
            }
            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                json_schema!({
                    "type": "string",
                    "pattern": concat!("^", $prefix, "[A-Za-z0-9_-]{1,", $max_lit, "}$"),
                })
            }
        }
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

/// Splits `prefix<run body>_<a>_<b>` into the run id and the two trailing numbers.
fn split_derived(
    kind: &'static str,
    prefix: &'static str,
    s: &str,
) -> Result<(RunId, u32, u32), IdError> {
    let rest = strip(prefix, s)?;
    let malformed = |why| IdError::Malformed {
        kind,
        got: s.chars().take(140).collect(),
        why,
    };
    let mut parts = rest.rsplitn(3, '_');
    let b = parts.next().ok_or_else(|| malformed("missing fields"))?;
    let a = parts.next().ok_or_else(|| malformed("missing fields"))?;
    let run = parts.next().ok_or_else(|| malformed("missing run id"))?;
    let a: u32 = a.parse().map_err(|_| malformed("step is not a number"))?;
    let b: u32 = b
        .parse()
        .map_err(|_| malformed("last field is not a number"))?;
    let run: RunId = format!("{}{run}", RunId::PREFIX).parse()?;
    Ok((run, a, b))
}

/// The identity of one tool operation: `(run, step, call index)`, string form
/// `op_<run body>_<step>_<index>`. Stable across retries, crashes and takeovers; passed to tools and
/// MCP servers as their idempotency key.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct OperationId {
    run: RunId,
    step: StepNo,
    index: u32,
}

impl OperationId {
    pub const PREFIX: &'static str = "op_";

    pub fn new(run: &RunId, step: StepNo, index: u32) -> Self {
        Self {
            run: run.clone(),
            step,
            index,
        }
    }
    pub fn run(&self) -> &RunId {
        &self.run
    }
    pub fn step(&self) -> StepNo {
        self.step
    }
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Where compensation ids start in a step's index space (a step's calls never get near).
    pub const COMPENSATION_BASE: u32 = 1_000_000_000;

    /// The operation that compensates `self` (docs/ARCHITECTURE.md "Compensation"): same run
    /// and step, index [`OperationId::COMPENSATION_BASE`] + `self`'s. Derived from the operation
    /// alone, so whoever decides it names the same one, and an ordinary operation id
    /// everywhere else (the tool runners' records, the confirm queries). `None` for a
    /// compensation (compensations are not compensated) or an index that does not fit.
    pub fn compensation_of(&self) -> Option<OperationId> {
        if self.is_compensation() {
            return None;
        }
        Some(OperationId {
            run: self.run.clone(),
            step: self.step,
            index: Self::COMPENSATION_BASE.checked_add(self.index)?,
        })
    }

    /// Whether this is a compensation's id.
    pub fn is_compensation(&self) -> bool {
        self.index >= Self::COMPENSATION_BASE
    }

    /// The operation a compensation's id compensates.
    pub fn compensated(&self) -> Option<OperationId> {
        self.is_compensation().then(|| OperationId {
            run: self.run.clone(),
            step: self.step,
            index: self.index - Self::COMPENSATION_BASE,
        })
    }
}

impl fmt::Display for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}_{}_{}",
            Self::PREFIX,
            self.run.body(),
            self.step,
            self.index
        )
    }
}

impl fmt::Debug for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OperationId({self})")
    }
}

impl FromStr for OperationId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        let (run, step, index) = split_derived("OperationId", Self::PREFIX, s)?;
        Ok(Self {
            run,
            step: StepNo(step),
            index,
        })
    }
}

impl TryFrom<String> for OperationId {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        s.parse()
    }
}

impl From<OperationId> for String {
    fn from(id: OperationId) -> String {
        id.to_string()
    }
}

impl JsonSchema for OperationId {
    fn schema_name() -> Cow<'static, str> {
        "OperationId".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "type": "string", "pattern": "^op_[A-Za-z0-9_-]+_[0-9]+_[0-9]+$" })
    }
}

impl RunId {
    /// The child run an operation of `run_agent` starts (docs/ARCHITECTURE.md "Child runs"):
    /// `run_ch` + 32 hex digits of the SHA-256 of the operation id. Derived from the operation
    /// alone, so a writer that takes over after a crash finds the same child (one child per
    /// operation); of fixed length whatever the parent's id.
    pub fn for_child(op: &OperationId) -> RunId {
        use sha2::Digest as _;
        let hash = sha2::Sha256::digest(format!("child:{op}").as_bytes());
        let mut body = String::with_capacity(2 + 32);
        body.push_str("ch");
        for b in hash.iter().take(16) {
            body.push_str(&format!("{b:02x}"));
        }
        RunId(format!("{}{body}", RunId::PREFIX))
    }
}

impl QuestionId {
    /// The question an `ask_user` operation asks: derived from the operation, so a retried commit
    /// asks the same question. Always valid: a run id body has at most 64 characters.
    pub fn for_operation(op: &OperationId) -> Self {
        Self(format!(
            "{}{}_{}_{}",
            Self::PREFIX,
            op.run.body(),
            op.step,
            op.index
        ))
    }
}

impl CallbackKey {
    /// The correlation key of an `await_callback` operation: derived from the operation, so the
    /// run it belongs to can be found from the key alone.
    pub fn for_operation(op: &OperationId) -> Self {
        Self(format!(
            "{}{}_{}_{}",
            Self::PREFIX,
            op.run.body(),
            op.step,
            op.index
        ))
    }

    /// The operation a derived key belongs to (`None` for a key not made by
    /// [`CallbackKey::for_operation`]).
    pub fn operation(&self) -> Option<OperationId> {
        format!("{}{}", OperationId::PREFIX, self.body())
            .parse()
            .ok()
    }
}

impl ApprovalId {
    /// The `version`-th approval request of an operation: derived, so a retried commit asks the
    /// same one, and a fresh request after an invalidation gets a new id.
    pub fn for_operation(op: &OperationId, version: u32) -> Self {
        Self(format!(
            "{}{}_{}_{}_v{version}",
            Self::PREFIX,
            op.run.body(),
            op.step,
            op.index
        ))
    }
}

impl TimerId {
    /// The deadline timer of a run.
    pub fn for_deadline(run: &RunId) -> Self {
        Self(format!("{}deadline_{}", Self::PREFIX, run.body()))
    }

    /// The bound on step `step`'s wait for its model provider: derived, so every wait of the
    /// step (and a retried commit) names the same timer.
    pub fn for_provider_wait(run: &RunId, step: StepNo) -> Self {
        Self(format!("{}provider_{}_{step}", Self::PREFIX, run.body()))
    }

    /// The expiry timer of an approval request.
    pub fn for_approval(approval: &ApprovalId) -> Self {
        Self(format!("{}{}", Self::PREFIX, approval.body()))
    }

    /// The timer of a `wait` operation: derived from the operation, so a retried commit schedules
    /// the same timer.
    pub fn for_operation(op: &OperationId) -> Self {
        Self(format!(
            "{}{}_{}_{}",
            Self::PREFIX,
            op.run.body(),
            op.step,
            op.index
        ))
    }
}

/// The identity of one model call attempt: `(run, step, attempt)`, string form
/// `req_<run body>_<step>_<attempt>`. The key of the stored model response in `kedge_idempotency`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ModelRequestId {
    run: RunId,
    step: StepNo,
    attempt: Attempt,
}

impl ModelRequestId {
    pub const PREFIX: &'static str = "req_";

    pub fn new(run: &RunId, step: StepNo, attempt: Attempt) -> Self {
        Self {
            run: run.clone(),
            step,
            attempt,
        }
    }
    pub fn run(&self) -> &RunId {
        &self.run
    }
    pub fn step(&self) -> StepNo {
        self.step
    }
    pub fn attempt(&self) -> Attempt {
        self.attempt
    }
}

impl fmt::Display for ModelRequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}_{}_{}",
            Self::PREFIX,
            self.run.body(),
            self.step,
            self.attempt
        )
    }
}

impl fmt::Debug for ModelRequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelRequestId({self})")
    }
}

impl FromStr for ModelRequestId {
    type Err = IdError;
    fn from_str(s: &str) -> Result<Self, IdError> {
        let (run, step, attempt) = split_derived("ModelRequestId", Self::PREFIX, s)?;
        Ok(Self {
            run,
            step: StepNo(step),
            attempt: Attempt(attempt),
        })
    }
}

impl TryFrom<String> for ModelRequestId {
    type Error = IdError;
    fn try_from(s: String) -> Result<Self, IdError> {
        s.parse()
    }
}

impl From<ModelRequestId> for String {
    fn from(id: ModelRequestId) -> String {
        id.to_string()
    }
}

impl JsonSchema for ModelRequestId {
    fn schema_name() -> Cow<'static, str> {
        "ModelRequestId".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "type": "string", "pattern": "^req_[A-Za-z0-9_-]+_[0-9]+_[0-9]+$" })
    }
}

/// Declares an unprefixed name that is used as a subject token (agent names, tenants).
macro_rules! token_name {
    ($(#[$meta:meta])* $name:ident, $max:literal) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                let kind = stringify!($name);
                if s.is_empty() {
                    return Err(IdError::Empty { kind });
                }
                if s.len() > $max {
                    return Err(IdError::TooLong { kind, max: $max });
                }
                match s.chars().find(|c| !is_token_char(*c)) {
                    Some(ch) => Err(IdError::InvalidChar { kind, ch }),
                    None => Ok(Self(s.to_owned())),
                }
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                s.parse()
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.0)
            }
        }

        impl JsonSchema for $name {
            fn schema_name() -> Cow<'static, str> {
                stringify!($name).into()
            }
            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                json_schema!({
                    "type": "string",
                    "pattern": concat!("^[A-Za-z0-9_-]{1,", stringify!($max), "}$"),
                })
            }
        }
    };
}

token_name!(
    /// An agent's name: the last token of `agent.task.<agent>` and the key in `kedge_agents`.
    AgentName,
    64
);
token_name!(
    /// The tenant a run belongs to; runs of one tenant are invisible to another.
    TenantId,
    64
);

/// The deduplication id (`Nats-Msg-Id`) of a journal input: what makes a repeat of the same input
/// land once. Every id Kedge gives an input is built by one of these constructors, so the scheme
/// is stated once (and two kinds of input can never share an id by accident).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InputId(String);

impl InputId {
    /// A user message; `key` is the caller's idempotency key (a fresh id when it has none).
    pub fn message(run: &RunId, key: Option<&str>) -> InputId {
        let key = key
            .map(str::to_owned)
            .unwrap_or_else(|| uuid::Uuid::now_v7().simple().to_string());
        InputId(format!("msg:{run}:{key}"))
    }
    /// The one answer a question gets.
    pub fn answer(question: &QuestionId) -> InputId {
        InputId(format!("answer:{question}"))
    }
    /// The one cancel request a run records.
    pub fn cancel(run: &RunId) -> InputId {
        InputId(format!("cancel:{run}"))
    }
    /// The one decision an approval gets.
    pub fn approval_decided(approval: &ApprovalId) -> InputId {
        InputId(format!("approval.decided:{approval}"))
    }
    /// One delivery of a callback (`delivery` is the sender's id, or the payload's digest).
    pub fn callback(key: &CallbackKey, delivery: &str) -> InputId {
        InputId(format!("callback:{key}:{delivery}"))
    }
    /// The one result an operation gets (a confirmed outcome uses the same id, so at most one
    /// of the two lands).
    pub fn tool_result(op: &OperationId) -> InputId {
        InputId(format!("tool.result:{op}"))
    }
    /// A person's resolution of the ambiguity of an operation's `dispatch` (its count of
    /// dispatches when found ambiguous): one per ambiguity, a repeat is a duplicate.
    pub fn outcome_resolved(op: &OperationId, dispatch: u32) -> InputId {
        InputId(format!("outcome.resolved:{op}:{dispatch}"))
    }
    /// `tool.started` of one claim of an operation (`revision`: the claim's record revision).
    pub fn tool_started(op: &OperationId, revision: u64) -> InputId {
        InputId(format!("tool.started:{op}:{revision}"))
    }
    /// `outcome.ambiguous` of one dispatch of an operation.
    pub fn outcome_ambiguous(op: &OperationId, dispatch: u32) -> InputId {
        InputId(format!("outcome.ambiguous:{op}:{dispatch}"))
    }
    /// `target.moved` of one dispatch of an operation.
    pub fn target_moved(op: &OperationId, dispatch: u32) -> InputId {
        InputId(format!("target.moved:{op}:{dispatch}"))
    }
    /// The firing of a durable timer.
    pub fn timer_fired(timer: &TimerId) -> InputId {
        InputId(format!("timer.fired:{timer}"))
    }
    /// The reconciler's nudge of a stalled run, once per last event it saw.
    pub fn nudge(run: &RunId, last_seq: u64) -> InputId {
        InputId(format!("nudge:{run}:{last_seq}"))
    }
    /// The fleet's release of a run from its wait on the provider: once per wait (`since`:
    /// the wait's registration, a revision of the fleet's wait list), so a releaser that
    /// repeats itself after a crash releases nothing twice.
    pub fn provider_released(run: &RunId, since: u64) -> InputId {
        InputId(format!("provider.released:{run}:{since}"))
    }
    /// An operator's retry of a run whose wake became dead letter `dead_seq`
    /// (`kedge dead retry`).
    pub fn dead_retry(run: &RunId, dead_seq: u64) -> InputId {
        InputId(format!("retry:{run}:{dead_seq}"))
    }
    /// The reconciler's nudge naming an operation stuck in one dispatch.
    pub fn resolve_nudge(op: &OperationId, dispatch: u32) -> InputId {
        InputId(format!("resolve:{op}:{dispatch}"))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for InputId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_ids_name_what_they_deduplicate() {
        let run: RunId = "run_abc".parse().expect("valid");
        let q: QuestionId = "q_1".parse().expect("valid");
        assert_eq!(InputId::answer(&q).as_str(), "answer:q_1");
        assert_eq!(InputId::cancel(&run).as_str(), "cancel:run_abc");
        assert_eq!(InputId::message(&run, Some("k")).as_str(), "msg:run_abc:k");
        assert_ne!(InputId::message(&run, None), InputId::message(&run, None));
        assert_eq!(InputId::nudge(&run, 7).as_str(), "nudge:run_abc:7");
    }

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
    fn operation_ids_are_derived_and_parse_back() {
        let run: RunId = "run_my_client-run_7".parse().expect("valid");
        let op = OperationId::new(&run, StepNo(3), 2);
        assert_eq!(op.to_string(), "op_my_client-run_7_3_2");
        let back: OperationId = op.to_string().parse().expect("parses");
        assert_eq!(back, op);
        assert_eq!(back.run(), &run);
        assert_eq!(back.step(), StepNo(3));
        assert_eq!(back.index(), 2);
        assert!("op_x_1".parse::<OperationId>().is_err());
        assert!("op_x_a_1".parse::<OperationId>().is_err());
        assert!(matches!(
            "run_x_1_1".parse::<OperationId>(),
            Err(IdError::TypeMismatch { .. })
        ));
    }

    #[test]
    fn request_ids_are_derived_and_parse_back() {
        let run = RunId::generate();
        let req = ModelRequestId::new(&run, StepNo(1), Attempt(2));
        let back: ModelRequestId = req.to_string().parse().expect("parses");
        assert_eq!(back, req);
        assert_eq!(back.attempt(), Attempt(2));
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
}
