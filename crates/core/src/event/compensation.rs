//! Compensation (docs/ARCHITECTURE.md "Compensation"): how far an operation's effect can be
//! undone, how it is undone, and what undoing it came to.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::RunFailed;
use crate::ids::OperationId;
use crate::tools::RunLimits;

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
    /// How the compensating tool runs (its own policy), carried to its dispatch.
    #[serde(flatten)]
    pub limits: RunLimits,
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
