//! Tool operations: the request (`tool.requested`), the runner's reports (`tool.started`,
//! `tool.attempt`, `tool.result`) and the settling of an outcome in doubt (`outcome.*`,
//! `target.moved`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Digest, Reversibility, Timestamp, ToolErrorClass};
use crate::ids::OperationId;
use crate::tools::RunLimits;

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

/// A tool operation dispatched by the run's writer (`tool.requested`): a runner runs it once in
/// effect and journals its result.
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
    /// How the operation runs (its tool's policy: time limit, network, retries, output limit).
    #[serde(flatten)]
    pub limits: RunLimits,
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

fn is_zero(n: &u32) -> bool {
    *n == 0
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
