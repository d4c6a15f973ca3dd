//! What a run waits on besides its tools: questions to the user, approvals, timers and external
//! callbacks.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Digest, Reversibility, Timestamp};
use crate::ids::{ApprovalId, CallbackKey, OperationId, QuestionId, StepNo, TimerId};
use crate::tools::RunLimits;

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

/// An approver's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Approve,
    Deny,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct QuestionAsked {
    pub question_id: QuestionId,
    pub prompt: String,
}

/// An operation held back until a person approves it (`approval.requested`): what the approver
/// is shown, and what is dispatched if approved.
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
    /// How the operation runs once approved (its tool's policy), carried to the dispatch.
    #[serde(flatten)]
    pub limits: RunLimits,
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
