//! Journal events: the envelope and every event type's data.
//!
//! An event is either a **decision** (appended only by the holder of the run's lease, on
//! `agent.run.<id>.d.<type>`, with an optimistic-concurrency check) or an **input** (appended by
//! anyone, on `agent.run.<id>.i.<type>`, deduplicated by `Nats-Msg-Id`). [`EventKind`] says which;
//! the split is part of the type, not a convention.
//!
//! On the wire an event is one JSON envelope: `run_id, type, at, step, attempt, op, data, digest`,
//! where `digest` is the SHA-256 of `data` in canonical JSON (keys sorted, no whitespace).

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

pub use crate::settings::{ModelSettings, Price};
pub use crate::tools::{RetryPolicy, ToolErrorClass};

use crate::ids::{
    AgentName, ApprovalId, Attempt, CallbackKey, ModelRequestId, OperationId, QuestionId, RunId,
    StepNo, TenantId, TimerId,
};

/// A UTC instant, RFC 3339 on the wire.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Timestamp(#[serde(with = "time::serde::rfc3339")] pub OffsetDateTime);

impl Timestamp {
    /// The latest instant a timestamp holds (9999-12-31T23:59:59.999999999Z).
    pub const MAX: Timestamp = Timestamp(time::PrimitiveDateTime::MAX.assume_utc());
    /// The earliest instant a timestamp holds (-9999-01-01T00:00:00Z).
    pub const MIN: Timestamp = Timestamp(time::PrimitiveDateTime::MIN.assume_utc());

    pub fn now() -> Self {
        Self(OffsetDateTime::now_utc())
    }

    /// `self + d`, or [`Timestamp::MAX`] when that is past the last representable instant.
    /// Time arithmetic in the core goes through these helpers: `OffsetDateTime + Duration`
    /// panics on overflow, and the amounts come from tasks, definitions and model output.
    pub fn saturating_add(self, d: std::time::Duration) -> Timestamp {
        time::Duration::try_from(d)
            .ok()
            .and_then(|d| self.0.checked_add(d))
            .map_or(Timestamp::MAX, Timestamp)
    }

    /// `self + d` for a signed duration, clamped to [`Timestamp::MIN`]..=[`Timestamp::MAX`].
    pub fn saturating_add_signed(self, d: time::Duration) -> Timestamp {
        match self.0.checked_add(d) {
            Some(t) => Timestamp(t),
            None if d.is_negative() => Timestamp::MIN,
            None => Timestamp::MAX,
        }
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.format(&Rfc3339) {
            Ok(s) => f.write_str(&s),
            Err(_) => write!(f, "{:?}", self.0),
        }
    }
}

impl JsonSchema for Timestamp {
    fn schema_name() -> Cow<'static, str> {
        "Timestamp".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "type": "string", "format": "date-time" })
    }
}

/// `sha256:<64 hex digits>`: the digest of a canonical JSON value (or of raw bytes).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

/// A string that is not `sha256:<64 lowercase hex>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a digest of the form sha256:<64 lowercase hex digits>")]
pub struct DigestError(String);

impl Digest {
    /// Digest of raw bytes.
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self::of_hash(Sha256::digest(bytes).as_slice())
    }

    /// `sha256:` and the lowercase hex of `hash`, with no allocation but the string's.
    fn of_hash(hash: &[u8]) -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(7 + 2 * hash.len());
        s.push_str("sha256:");
        for &b in hash {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
        Self(s)
    }

    /// Digest of a JSON value in canonical form. `serde_json::Map` keeps keys sorted (the crate's
    /// `preserve_order` feature is off in this workspace), so equal values give equal digests.
    /// The serialization is hashed as it is written (the same bytes, not collected first).
    pub fn of_json(value: &serde_json::Value) -> Self {
        let mut hashing = Hashing(Sha256::new());
        hashing.canonical(value);
        Self::of_hash(hashing.0.finalize().as_slice())
    }

    /// Digest of any serializable value, through its canonical JSON form.
    pub fn of<T: Serialize>(value: &T) -> Self {
        Self::of_json(&serde_json::to_value(value).unwrap_or(serde_json::Value::Null))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Feeds what serde_json writes into the hash.
#[derive(Clone)]
struct Hashing(Sha256);

impl Hashing {
    /// Hashes `value`'s canonical JSON form.
    fn canonical(&mut self, value: &serde_json::Value) {
        // Serializing a `Value` into a writer that never fails cannot fail.
        let _ = serde_json::to_writer(self, value);
    }
}

impl std::io::Write for Hashing {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// [`Digest::of`] a sequence, item by item: after items `a, b`, [`SeqDigest::digest`] is
/// `Digest::of(&[a, b])` (the same bytes are hashed: `[`, each item's canonical form, `,`
/// between them, `]`), and a clone goes on from there. So a sequence that only grows (a run's
/// transcript) is hashed once over its life instead of whole at every step.
#[derive(Clone)]
pub struct SeqDigest {
    hashing: Hashing,
    items: usize,
}

impl Default for SeqDigest {
    fn default() -> Self {
        let mut hashing = Hashing(Sha256::new());
        hashing.0.update(b"[");
        Self { hashing, items: 0 }
    }
}

impl SeqDigest {
    /// How many items were pushed.
    pub fn items(&self) -> usize {
        self.items
    }

    pub fn push<T: Serialize>(&mut self, item: &T) {
        if self.items > 0 {
            self.hashing.0.update(b",");
        }
        self.hashing
            .canonical(&serde_json::to_value(item).unwrap_or(serde_json::Value::Null));
        self.items += 1;
    }

    /// The digest of the items pushed so far.
    pub fn digest(&self) -> Digest {
        let mut hash = self.hashing.0.clone();
        hash.update(b"]");
        Digest::of_hash(hash.finalize().as_slice())
    }
}

impl fmt::Debug for SeqDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SeqDigest")
            .field("items", &self.items)
            .finish_non_exhaustive()
    }
}

impl FromStr for Digest {
    type Err = DigestError;
    fn from_str(s: &str) -> Result<Self, DigestError> {
        let hex = s
            .strip_prefix("sha256:")
            .ok_or_else(|| DigestError(s.to_owned()))?;
        if hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            Ok(Self(s.to_owned()))
        } else {
            Err(DigestError(s.to_owned()))
        }
    }
}

impl TryFrom<String> for Digest {
    type Error = DigestError;
    fn try_from(s: String) -> Result<Self, DigestError> {
        s.parse()
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", &self.0[..self.0.len().min(19)])
    }
}

impl JsonSchema for Digest {
    fn schema_name() -> Cow<'static, str> {
        "Digest".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "type": "string", "pattern": "^sha256:[0-9a-f]{64}$" })
    }
}

// ---------------------------------------------------------------------------------------------
// Data shared by several events.
// ---------------------------------------------------------------------------------------------

/// Which wire format a model speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Provider {
    Openai,
    Anthropic,
}

/// The model a run is frozen to, with the settings sent on every call and its price.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ModelSpec {
    pub provider: Provider,
    pub name: String,
    /// Base URL of the API; `None` means the provider's public endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Sampling, tool choice, reasoning / thinking and caching settings (docs/CONFIG.md).
    #[serde(default, skip_serializing_if = "ModelSettings::is_empty")]
    pub settings: ModelSettings,
    /// What the model's tokens cost: with it, usage is reported in currency and
    /// `budget.max_cost` can be enforced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price: Option<Price>,
}

impl ModelSpec {
    /// The currency of the model's price (and of the run's cost and `budget.max_cost`), if it
    /// has one.
    pub fn currency(&self) -> Option<&str> {
        self.price.as_ref().map(|p| p.currency.as_str())
    }
}

/// Limits a run is held to. Frozen into `run.created`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Budget {
    /// Model calls (steps) the run may make in all its turns.
    pub max_steps: u32,
    /// Input + output tokens the run may spend.
    pub max_tokens: u64,
    /// Attempts per step (crash retries and retryable model errors) before the run fails.
    pub max_attempts_per_step: u32,
    /// Wall-clock limit of the run in seconds, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_secs: Option<u64>,
    /// What the run may spend, in the currency of `model.price` (which it needs), counted
    /// like `max_tokens`: no new step once the run's cost reached it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost: Option<f64>,
}

impl Default for Budget {
    fn default() -> Self {
        Self {
            max_steps: 50,
            max_tokens: 1_000_000,
            max_attempts_per_step: 3,
            deadline_secs: None,
            max_cost: None,
        }
    }
}

/// Tokens spent, and what they cost when the run's model has a price.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// In the currency of the run's `model.price`; absent without a price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
}

impl Usage {
    pub fn total(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }
    pub fn add(&mut self, other: Usage) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.cost = match (self.cost, other.cost) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
    }
    /// This usage with its cost at `price` (none without a price).
    pub fn priced(self, price: Option<&Price>) -> Usage {
        Usage {
            cost: price.map(|p| p.cost(&self)),
            ..self
        }
    }
}

/// One tool call the model asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ToolCall {
    /// The provider's id for the call (`call_…`, `toolu_…`); answered by the matching result.
    pub call_id: String,
    pub name: String,
    pub arguments: serde_json::Value,
}

/// The assistant's turn as the model returned it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AssistantMessage {
    #[serde(default)]
    pub text: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// Anthropic extended thinking: the turn's thinking blocks, in order, exactly as received
    /// (signature included). Sent back unchanged with the turn, as the API requires.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub thinking: Vec<ThinkingBlock>,
}

/// One block of a model's extended thinking (Anthropic).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ThinkingBlock {
    Thinking {
        thinking: String,
        signature: String,
    },
    /// Thinking the provider encrypted; passed back as received.
    RedactedThinking {
        data: String,
    },
}

/// Why the model stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    ToolCalls,
    Length,
    Other,
}

/// How a model error should be treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// 429, 5xx, 529, timeouts, dropped connections: try again (a new attempt).
    Retryable,
    /// 4xx other than 429: the same request will fail again.
    Fatal,
}

/// Trouble on the provider's side: not the request's fault, and not the answer's. A call that
/// meets it spends none of the step's `max_attempts_per_step`; the run waits on the provider
/// (`provider.waiting`) until the fleet releases it (docs/ARCHITECTURE.md, "Provider
/// trouble").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Trouble {
    /// 5xx, 529, a connection refused or reset, a timeout before the first byte, a stream cut
    /// before any content.
    Unavailable,
    /// 429 (other than a quota that waiting does not restore).
    RateLimited,
}

impl Trouble {
    pub fn as_str(self) -> &'static str {
        match self {
            Trouble::Unavailable => "unavailable",
            Trouble::RateLimited => "rate_limited",
        }
    }
}

impl fmt::Display for Trouble {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outcome of one model call attempt that did not produce a committed step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum AttemptOutcome {
    Error {
        class: ErrorClass,
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        status: Option<u16>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after_ms: Option<u64>,
        /// Set when the error is the provider's trouble: the attempt is not spent. Absent in
        /// journals written before it existed, where every error attempt counts.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        trouble: Option<Trouble>,
    },
    /// The request was not sent: the fleet's breaker for the model endpoint was open (it is
    /// failing, and only its probes go out). Not spent.
    Held { endpoint: String, reason: String },
    /// The worker lost its lease while the model ran; the call was aborted.
    LeaseLost,
    /// The run's cancellation was requested while the model ran; the call was aborted.
    Cancelled,
}

impl AttemptOutcome {
    /// Whether the attempt spends nothing of `max_attempts_per_step`: it met provider trouble
    /// or was never sent.
    pub fn is_free(&self) -> bool {
        match self {
            AttemptOutcome::Error { trouble, .. } => trouble.is_some(),
            AttemptOutcome::Held { .. } => true,
            AttemptOutcome::LeaseLost | AttemptOutcome::Cancelled => false,
        }
    }
}

/// What a waiting run waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WaitReason {
    Tool,
    User,
    Approval,
    External,
}

/// Risk level of a tool operation, for approval policy.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Risk {
    #[default]
    Low,
    Medium,
    High,
}

/// What a timer is for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TimerPurpose {
    /// The `wait` tool: the operation's result is the timer firing.
    Wait {
        op: OperationId,
    },
    RunDeadline,
    ApprovalExpiry {
        approval_id: ApprovalId,
    },
    QuestionTimeout {
        question_id: QuestionId,
    },
    /// No callback arrived for this key in time: its operation fails.
    CallbackExpiry {
        key: CallbackKey,
    },
    /// The bound on a step's wait for its model provider (`provider_wait`): the run fails if it
    /// is still waiting on the provider for this step when it fires.
    ProviderWait {
        step: StepNo,
    },
}

/// Whether a run's output passed its validation. Reported apart from the run's status
/// (docs/ARCHITECTURE.md, principle 9).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum OutputValidation {
    #[default]
    NotChecked,
    Valid,
    Invalid {
        errors: Vec<String>,
    },
}

/// Why a run failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FailureReason {
    AttemptsExhausted,
    MaxSteps,
    MaxTokens,
    /// The run's cost reached `budget.max_cost`.
    MaxCost,
    Deadline,
    ModelRejected,
    Operator,
    Internal,
    /// The final answer did not match the agent's `output_schema` (with `on_invalid_output:
    /// fail`, or `retry` once its retries are used up); the message names the errors by JSON
    /// path.
    InvalidOutput,
    /// The model provider stayed unavailable (or over its rate limit) for the step's whole
    /// `provider_wait`; the message names the endpoint and its last error.
    ProviderUnavailable,
}

/// An approver's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Approve,
    Deny,
}

/// A person's resolution of an operation whose outcome was ambiguous.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "resolution", rename_all = "snake_case")]
pub enum Resolution {
    /// It did not happen: run it again under the same operation id.
    Retry,
    /// It happened; this is its result.
    Completed { content: String },
    /// Give the model an error result for it.
    Failed { reason: String },
}

/// How an operation ended, as listed by `run.cancelled`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OpFate {
    Completed,
    Failed,
    Stopped,
    NeverStarted,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct OpSummary {
    pub op: OperationId,
    pub fate: OpFate,
    /// The effect's reversibility, listed when the run's agent declares reversibility for any
    /// of its tools (docs/ARCHITECTURE.md "Compensation"); absent in runs that declare none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub level: Option<Level>,
    /// What compensating it did (a completed operation of a `compensable` tool, under an
    /// agent that compensates on this run's end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensation: Option<CompensationOutcome>,
}

// ---------------------------------------------------------------------------------------------
// Compensation (docs/ARCHITECTURE.md "Compensation").
// ---------------------------------------------------------------------------------------------

/// How far an operation's effect can be undone, as its tool's policy declares it
/// (`policy.<tool>.reversibility`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// Nothing needs undoing: the effect is harmless to leave (a read, an idempotent re-do).
    Reversible,
    /// Undone by another operation, the tool's `compensate`.
    Compensable,
    /// Cannot be undone: listed, never compensated.
    Irreversible,
    /// The policy declares nothing: treated as irreversible (never compensated, always listed),
    /// but named apart so that a listing never claims what nobody declared.
    Undeclared,
}

/// Why a run ends, for the agent's compensation choice (`on_cancel`, `on_failure`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StopCause {
    Cancel,
    Failure,
}

/// The operation that undoes a `compensable` tool's effect, as carried on each of its
/// operations' requests (the policy rides on the request, like `retry`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CompensateSpec {
    /// The compensating tool (a tool of the agent).
    pub tool: String,
    /// Its arguments: a JSON template in which a string `${arguments}`, `${arguments.<field>…}`,
    /// `${result}` or `${op}` stands for the compensated operation's arguments (or a field of
    /// them), its result text, or its operation id. A string that is one placeholder takes the
    /// value as is; placeholders inside a longer string are replaced by their text.
    pub arguments: serde_json::Value,
    /// The compensating tool's own policy, carried to its dispatch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub network: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryPolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<u64>,
}

/// An operation's reversibility as its request journals it: the level its tool's policy
/// declares, the compensation of a `compensable` tool, and when the agent compensates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Reversibility {
    pub level: Level,
    /// With `compensable`: how the effect is undone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensate: Option<CompensateSpec>,
    /// The run ends that the agent compensates (`on_cancel`, `on_failure`: `compensate`);
    /// empty: never.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub compensate_on: Vec<StopCause>,
}

/// What compensating one operation came to, as the run's terminal event lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CompensationOutcome {
    /// The compensating operation (`OperationId::compensation_of`); absent when none could be
    /// built.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<OperationId>,
    pub status: CompensationStatus,
    /// Its result text (or why it could not be made).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CompensationStatus {
    /// The compensating operation completed.
    Compensated,
    /// It ended with an error, or could not be built: the effect stands.
    Failed,
    /// Its outcome is ambiguous (its runner died and the confirm query could not tell).
    Ambiguous,
}

/// One entry of a compensation plan: an operation to compensate and the operation that does it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PlannedCompensation {
    pub op: OperationId,
    pub tool: String,
    /// The compensating operation, or none when its arguments could not be built (`error`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensation: Option<OperationId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The run is ending (cancelled, or failed) and its agent compensates: the compensations it
/// will run, newest effect first, one at a time; the run ends with `run.cancelled` or
/// `run.failed` (the failure recorded here) once each is settled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunCompensating {
    pub cause: StopCause,
    /// With cause `failure`: the failure the run ends with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<RunFailed>,
    pub plan: Vec<PlannedCompensation>,
}

// ---------------------------------------------------------------------------------------------
// Event data, one struct per event type.
// ---------------------------------------------------------------------------------------------

/// The frozen run bundle: everything a run's behaviour depends on, fixed at creation so that
/// replaying the journal through newer code takes the same path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct RunCreated {
    pub agent: AgentName,
    /// Revision of the agent definition in `kedge_agents`.
    pub agent_revision: u64,
    pub agent_digest: Digest,
    pub model: ModelSpec,
    pub prompt_digest: Digest,
    pub tools_digest: Digest,
    pub policy_digest: Digest,
    pub budget: Budget,
    pub tenant: TenantId,
    /// Who submitted the task (token subject, NATS user, …), if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caller: Option<String>,
    /// The client's idempotency key (the task's `Nats-Msg-Id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// The user's first message.
    pub input: String,
    /// Kedge version that created the run.
    pub runtime_version: String,
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// The W3C `traceparent` the task came with (the bridge's HTTP header or the task's NATS
    /// header), so every service's spans for this run join the submitter's trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// Set on a child run (started by its parent's `run_agent` operation): the parent and the
    /// operation whose result this run's final answer becomes. Absent on a run from a task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentLink>,
}

/// Where a child run comes from: its parent run and the `run_agent` operation in it. The
/// child's run id is derived from `op` ([`RunId::for_child`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ParentLink {
    pub run_id: RunId,
    pub op: OperationId,
    /// The agents of the runs above this one, the root first and the parent last: its length
    /// is the child's depth (at most [`crate::child::MAX_DEPTH`]), and an agent in it may not
    /// be started again below (no recursion).
    pub ancestors: Vec<AgentName>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub struct RunStarted {}

/// Intent before effect: journaled before the model is called.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StepStarted {
    pub request_id: ModelRequestId,
    /// Digest of the exact context sent to the model.
    pub context_digest: Digest,
    /// The journal sequence of the last input the context includes. Inputs after it (even if they
    /// land before this event) belong to the next step.
    pub inputs_through: u64,
    /// The model this attempt calls when it is not the run's own: one of the agent's
    /// `fallbacks`, while the run's model is unavailable. Its price counts the step's cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelSpec>,
}

/// A model attempt that did not complete the step (error or lost lease).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ModelAttempt {
    pub request_id: ModelRequestId,
    #[serde(flatten)]
    pub outcome: AttemptOutcome,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StepCompleted {
    pub request_id: ModelRequestId,
    pub message: AssistantMessage,
    pub usage: Usage,
    pub finish: FinishReason,
    /// True when the response was taken from `kedge_idempotency` (stored by a worker that died
    /// before committing) instead of calling the model again.
    #[serde(default)]
    pub reused: bool,
    /// How many decisions of its group follow it, when the group settles the run's waiting
    /// status by itself (gate [`Gate::WaitFromStepGroup`]): the fold derives the status from
    /// the group once that many landed, and no `run.waiting` is journaled. Absent in a group
    /// that ends with its own settling decision (`run.waiting`, `run.succeeded`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follows: Option<u32>,
    /// The model that answered, when it was not the run's own (a fallback, named by its
    /// attempt's `step.started`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ToolRequested {
    pub call_id: String,
    pub tool: String,
    pub arguments: serde_json::Value,
    pub args_digest: Digest,
    /// 0 for the first dispatch; n for the n-th re-dispatch of the same operation after its
    /// outcome was found not to have happened (`outcome.not_found`, a person's `retry`, or its
    /// target moved before it could run).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub redispatch: u32,
    /// The target version the approval was given for (`approval.requested`'s
    /// `target_version`): the runner checks it right before running and does not run the
    /// operation if the target moved (`target.moved`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect_version: Option<String>,
    /// The agent policy's time limit for this tool (`policy.<tool>.timeout_secs`); the runner
    /// applies the smaller of it and its own `tool_timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// The agent policy grants this tool the network (`policy.<tool>.network`): the runner's
    /// sandbox shares the host's network with the command. Absent: no network.
    #[serde(default, skip_serializing_if = "is_false")]
    pub network: bool,
    /// The agent policy's retry policy for this tool (`policy.<tool>.retry`), repeated on every
    /// dispatch. Absent: one attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryPolicy>,
    /// The agent policy's output limit for this tool (`policy.<tool>.max_output_bytes`): the
    /// runner keeps that much of the output instead of its own `max_tool_output_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<u64>,
    /// The tool's declared reversibility (`policy.<tool>.reversibility`), and for a
    /// `compensable` tool how its effect is undone. Absent: undeclared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reversibility: Option<Reversibility>,
    /// Set on a compensation's request: the operation whose effect it undoes (its own id is
    /// `OperationId::compensation_of` that one). Runners run it even though the run's cancel
    /// was requested: undoing is what the cancel asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensates: Option<OperationId>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The `run_agent` operation (the envelope's `op`) starts child run `child` of `agent`: the
/// parent's half of the link (the child's `run.created` carries the other). Journaled with the
/// operation's `tool.requested`, before the child exists (intent before effect).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ChildStarted {
    pub child: RunId,
    pub agent: AgentName,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct QuestionAsked {
    pub question_id: QuestionId,
    pub prompt: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalRequested {
    pub approval_id: ApprovalId,
    pub tool: String,
    /// The call as the model made it: what the approver is shown, and what runs if approved.
    pub call_id: String,
    pub arguments: serde_json::Value,
    pub args_digest: Digest,
    pub risk: Risk,
    /// Why this needs approval (the policy rule that matched).
    pub basis: String,
    pub expires_at: Timestamp,
    pub plan_version: u32,
    /// The version of what the operation would change, as the tool's precondition check saw it
    /// when the request was made (e.g. `write_file`: the digest of the file, or `absent`); none
    /// for tools without a precondition check. What the approver is shown; the operation runs
    /// only while the target is still at this version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_version: Option<String>,
    /// The policy's time limit for the tool, carried to the dispatch once approved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// The policy's network grant for the tool, carried to the dispatch once approved.
    #[serde(default, skip_serializing_if = "is_false")]
    pub network: bool,
    /// The policy's retry policy for the tool, carried to the dispatch once approved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryPolicy>,
    /// The policy's output limit for the tool, carried to the dispatch once approved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<u64>,
    /// The tool's declared reversibility, carried to the dispatch once approved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reversibility: Option<Reversibility>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalInvalidated {
    pub approval_id: ApprovalId,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalExpired {
    pub approval_id: ApprovalId,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TimerScheduled {
    pub timer_id: TimerId,
    pub fire_at: Timestamp,
    pub purpose: TimerPurpose,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CallbackExpected {
    pub key: CallbackKey,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Timestamp>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunWaiting {
    pub on: WaitReason,
}

/// The step's model call met provider trouble, or was held because the fleet knows its
/// endpoint is failing: the run waits on the provider, holding nothing, until the fleet
/// releases it (`provider.released`) or the wait's bound passes. Journaled once per wait, not
/// per request: the fleet's probes, not each run, find out when the endpoint is back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ProviderWaiting {
    /// The endpoint, as operators know it: provider, base URL and key variable (never a key).
    pub endpoint: String,
    pub trouble: Trouble,
    /// The last error (or why the call was held).
    pub message: String,
    /// When this step first waited on the provider (kept across the waits of one step).
    pub since: Timestamp,
    /// When the step gives up waiting: `since` + `provider_wait`, or the run's deadline if
    /// sooner (its own timer).
    pub give_up_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunCancelling {
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunUnknown {
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub struct RunResumed {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunRevived {
    /// The turn that starts (turn 1 is the one `run.created` began).
    pub turn: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunSucceeded {
    pub output: String,
    #[serde(default)]
    pub validation: OutputValidation,
}

/// The final answer did not match the agent's `output_schema` and `on_invalid_output: retry`
/// has retries left: the run does not end. The next step's context carries the rejected answer
/// and a message listing `errors` that asks for a corrected answer
/// ([`crate::fold::output_feedback`]). Journaled under the step whose answer it rejects; it
/// ends that step's decision group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct OutputRejected {
    /// Where and how the answer failed the schema (at most five, each naming a JSON Pointer).
    pub errors: Vec<String>,
    /// Which retry this rejection starts (1 for the first) in the run's current turn.
    pub retry: u32,
    /// The agent's `output_retries`: retries allowed per turn before the run fails.
    pub max_retries: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunFailed {
    pub reason: FailureReason,
    pub message: String,
    /// How every operation ended, with its level and compensation: listed when the run's agent
    /// declares reversibility for any of its tools (absent otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub effects: Vec<OpSummary>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunCancelled {
    pub operations: Vec<OpSummary>,
}

/// A version gate: a change to the decision code (`decide`, `complete_step`) that decides
/// differently from the code before it for the same journal. A run takes the new branch only
/// from the decision group that journals the gate's marker (`run.gated`) on; a journal without
/// the marker keeps the old branch, in replay and when a new build continues it. See
/// docs/ARCHITECTURE.md, "Upgrades: decision replay".
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Gate {
    /// A step that requested tools and waits on them alone (no person, timer or callback)
    /// journals no `run.waiting`: its `step.completed` counts the decisions of its group
    /// (`follows`), and the fold derives the waiting status from them.
    WaitFromStepGroup,
}

impl Gate {
    /// Every gate this build knows, oldest first.
    pub const ALL: &'static [Gate] = &[Gate::WaitFromStepGroup];
}

/// The marker of a version gate: from this decision group on, the run takes `gate`'s new
/// branch. Journaled once per run and gate, right after the first decision of the group that
/// first takes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunGated {
    pub gate: Gate,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct UserMessage {
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ToolStarted {
    /// Which worker took the operation.
    pub runner: String,
    /// Which attempt of the operation's dispatch this is (1 for the first; more only under a
    /// retry policy, after a `tool.attempt`).
    #[serde(default = "first_attempt", skip_serializing_if = "is_first_attempt")]
    pub attempt: u32,
}

fn first_attempt() -> u32 {
    1
}

fn is_first_attempt(n: &u32) -> bool {
    *n == 1
}

/// An attempt of a tool operation that failed with an error its retry policy retries
/// (`policy.<tool>.retry`); attempt `attempt + 1` follows at `retry_at`. Journaled by the
/// runner under the operation's id (`Nats-Msg-Id` `tool.attempt:<op>:<dispatch>:<attempt>`)
/// before the operation's record is given back for the next attempt. Not a result: the model
/// sees only the operation's one `tool.result`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ToolAttempt {
    /// The attempt that failed (1 for the first).
    pub attempt: u32,
    /// The dispatch it belongs to (`tool.requested`'s `redispatch`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dispatch: u32,
    pub class: ToolErrorClass,
    /// The error, as the model would have read it.
    pub error: String,
    /// The wait the runner drew (backoff with jitter).
    pub delay_ms: u64,
    /// When the next attempt is due: no runner starts it earlier.
    pub retry_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ToolResult {
    pub content: String,
    #[serde(default)]
    pub is_error: bool,
    /// True when the tool reported it was stopped by a cancel.
    #[serde(default)]
    pub stopped: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct QuestionAnswered {
    pub question_id: QuestionId,
    pub answer: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalDecided {
    pub approval_id: ApprovalId,
    pub verdict: Verdict,
    /// The argument digest the approver was shown.
    pub args_digest: Digest,
    pub approver: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TimerFired {
    pub timer_id: TimerId,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CallbackReceived {
    pub key: CallbackKey,
    pub payload: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CancelRequested {
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct OutcomeConfirmed {
    pub content: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub struct OutcomeNotFound {}

/// The runner did not run an approved operation: its target is no longer at the version the
/// approval was given for. The approval is invalidated and a fresh one requested.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TargetMoved {
    /// The version the approval was given for.
    pub expected: String,
    /// The version found right before running (`absent`, a digest, …).
    pub found: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct OutcomeAmbiguous {
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct OutcomeResolved {
    #[serde(flatten)]
    pub resolution: Resolution,
    pub by: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Nudge {
    pub reason: String,
}

/// The model's context is compacted from the next step on (docs/ARCHITECTURE.md "The context
/// window"): tool results elided and turns left out, as [`crate::context::apply`] reads them.
/// The journal keeps the whole conversation; only what the model reads changes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ContextCompacted {
    /// The transcript is kept verbatim from this message on (1: no turn left out).
    pub keep_from: u32,
    /// Transcript indexes of tool results elided, ascending.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub elided: Vec<u32>,
    /// The estimated tokens of the context before, and the budget it had to fit.
    pub estimated_tokens: u64,
    pub budget_tokens: u64,
    pub cause: CompactionCause,
    /// With `context.strategy: summarize`: the model's summary of everything the compaction
    /// leaves out (an earlier summary included), which the model reads in their place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<CompactionSummary>,
    /// Tool results longer than this many characters reach the model cut to it, with a note
    /// (results too big for the window on their own); at least 256, and never raised by a
    /// later compaction. Absent: the cut in force, if any, stays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_result_chars: Option<u32>,
}

/// A summary of the turns a compaction leaves out, written by the run's model in a call of
/// its own ([`crate::context::summary_request_id`]: stored and reused after a crash like any
/// answer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CompactionSummary {
    pub text: String,
    pub request_id: ModelRequestId,
    /// What the call cost: counted in the run's usage and budget like a step's.
    pub usage: Usage,
}

/// Why a context was compacted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CompactionCause {
    /// The estimate of the next request did not fit the model's window.
    Estimate,
    /// The provider refused the last request as too long (`context_length_exceeded`).
    TooLong,
}

/// The fleet lets a run waiting on its provider call again: the endpoint is back (the runs are
/// released at a bounded rate, oldest first), or this run is the one probe the fleet sends to a
/// failing endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ProviderReleased {
    /// This run's call is the fleet's probe of an endpoint that is still failing.
    #[serde(default)]
    pub probe: bool,
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

/// An event before it is stamped with its run and time: what `decide` produces and the shells
/// append.
#[derive(Debug, Clone, PartialEq)]
pub struct Draft {
    pub event: Event,
    pub step: Option<StepNo>,
    pub attempt: Option<Attempt>,
    pub op: Option<OperationId>,
}

impl Draft {
    pub fn new(event: Event) -> Self {
        Self {
            event,
            step: None,
            attempt: None,
            op: None,
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
}

/// The journal envelope: what one message on `agent.run.<run_id>.{d,i}.<type>` carries.
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
    pub fn new(run_id: RunId, at: Timestamp, draft: Draft) -> Self {
        let digest = Digest::of_json(&draft.event.data_json());
        Self {
            run_id,
            at,
            step: draft.step,
            attempt: draft.attempt,
            op: draft.op,
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

    /// The subject this event is journaled on: `agent.run.<run_id>.<d|i>.<type>`.
    pub fn subject(&self) -> String {
        crate::subjects::event(&self.run_id, self.event_type())
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

    fn run() -> RunId {
        "run_t1".parse().expect("valid")
    }

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

    #[test]
    fn a_sequence_digested_item_by_item_is_the_digest_of_the_whole() {
        let items = [
            serde_json::json!({"b": 1, "a": [1, 2]}),
            serde_json::json!("text"),
            serde_json::json!(null),
        ];
        let mut seq = SeqDigest::default();
        assert_eq!(seq.digest(), Digest::of(&Vec::<serde_json::Value>::new()));
        for (n, item) in items.iter().enumerate() {
            seq.push(item);
            assert_eq!(seq.items(), n + 1);
            assert_eq!(seq.digest(), Digest::of(&items[..=n].to_vec()), "{n}");
        }
        // Taking the digest does not end the sequence.
        let before = seq.digest();
        seq.push(&items[0]);
        assert_ne!(seq.digest(), before);
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

    #[test]
    fn digest_ignores_key_order() {
        let a: serde_json::Value = serde_json::from_str(r#"{"a":1,"b":[1,2]}"#).expect("json");
        let b: serde_json::Value = serde_json::from_str(r#"{"b":[1,2],"a":1}"#).expect("json");
        assert_eq!(Digest::of_json(&a), Digest::of_json(&b));
        assert!(Digest::of_json(&a).as_str().parse::<Digest>().is_ok());
    }

    /// Digests are stored in journals: their bytes never change. SHA-256 of "abc" (FIPS 180-2),
    /// and a JSON value's digest is that of its compact serialization.
    #[test]
    fn digests_are_the_sha256_of_the_bytes_in_lowercase_hex() {
        assert_eq!(
            Digest::of_bytes(b"abc").as_str(),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            Digest::of_bytes(b"").as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        let value = serde_json::json!({
            "z": [1, 2.5, -3, null, true, "é\n\"q\u{1}"],
            "a": {"nested": {"k": "v"}, "empty": {}},
            "big": "x".repeat(100_000),
        });
        let bytes = serde_json::to_vec(&value).expect("serializes");
        assert_eq!(Digest::of_json(&value), Digest::of_bytes(&bytes));
    }
}
