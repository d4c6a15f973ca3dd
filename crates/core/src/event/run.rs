//! A run's lifecycle: its frozen bundle (`run.created`) and budget, its waiting, ending and
//! reviving, the version gates it takes, and the inputs that drive it (a user's message, a
//! cancel request, a nudge).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{CompensationOutcome, Digest, Level, ModelSpec, ParentLink};
use crate::ids::{AgentName, OperationId, TenantId};

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

/// What a waiting run waits on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WaitReason {
    Tool,
    User,
    Approval,
    External,
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
    /// The run's tenant was over its model tokens or cost of the day and its quota says
    /// `on_exceeded: fail` (docs/ARCHITECTURE.md "Quotas"); the message names the quota.
    QuotaExceeded,
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
    /// The run's concurrency key, expanded, its limit and the run's priority
    /// (docs/ARCHITECTURE.md "Concurrency keys and priorities"). Absent: the run takes no slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<crate::concurrency::RunConcurrency>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub struct RunStarted {}

/// The run's concurrency key is at its limit: the run waits (its status stays `queued`, or
/// `succeeded`/`failed` for a message that would revive it) until a slot of the key is handed to
/// it (`slot.granted`). Journaled once per wait, with its place when it began waiting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunQueued {
    /// The expanded key (within the run's tenant).
    pub key: String,
    pub limit: u32,
    /// Its place among the key's waiting runs when it began waiting (1 = next).
    pub place: u32,
    #[serde(default)]
    pub priority: i32,
}

/// A slot of the run's concurrency key was handed to it (by the run that released it, or by
/// the reconciler): the run's writer is woken to start it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SlotGranted {
    pub key: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunWaiting {
    pub on: WaitReason,
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
pub struct CancelRequested {
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Nudge {
    pub reason: String,
}
