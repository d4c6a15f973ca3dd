//! A step's model call: the model a run is frozen to, what it answers and what it costs, the
//! step's events (`step.started`, `model.attempt`, `step.completed`), the waits on the provider
//! (docs/ARCHITECTURE.md, "Provider trouble") and the compaction of the model's context
//! (docs/ARCHITECTURE.md, "The context window").

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

#[cfg(doc)]
use super::Gate;
use super::{Digest, ModelSettings, Price, Timestamp};
use crate::ids::ModelRequestId;

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
