//! [`RunLimits`]: what an agent's tool policy says about running one operation, as it rides on
//! the operation's request.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::RetryPolicy;

fn is_false(b: &bool) -> bool {
    !*b
}

/// How one tool operation is run, from its tool's policy (`policy.<tool>`): carried on every
/// request that may dispatch it (`tool.requested`, `approval.requested`, a compensation's
/// spec) and kept with the operation, so each re-dispatch runs under the same terms. On the
/// wire its fields sit in the request's data itself (flattened), where they always were.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunLimits {
    /// The policy's time limit for the tool (`policy.<tool>.timeout_secs`); the runner
    /// applies the smaller of it and its own `tool_timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// The policy grants the tool the network (`policy.<tool>.network`): the runner's sandbox
    /// shares the host's network with the command. Absent: no network.
    #[serde(default, skip_serializing_if = "is_false")]
    pub network: bool,
    /// The policy's retry policy for the tool (`policy.<tool>.retry`), repeated on every
    /// dispatch. Absent: one attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryPolicy>,
    /// The policy's output limit for the tool (`policy.<tool>.max_output_bytes`): the runner
    /// keeps that much of the output instead of its own `max_tool_output_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<u64>,
}
