//! Per-tool policy ([`ToolPolicy`]): approval, risk, limits, retries, sensitive parameters and
//! reversibility.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::event::Risk;

/// When a tool's operations need a person's approval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalRule {
    #[default]
    Never,
    Always,
    /// When the operation's risk is at or above the policy's `approval_risk`.
    AtOrAboveRisk,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolPolicy {
    #[serde(default)]
    pub approval: ApprovalRule,
    #[serde(default)]
    pub risk: Risk,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_risk: Option<Risk>,
    /// A tighter time limit for this tool's operations: each dispatch carries it and the tool
    /// service applies the smaller of it and its `tool_timeout` (it cannot raise the limit,
    /// which the timeout relations are checked against).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// How long an approval request stays valid (default one day).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_ttl_secs: Option<u64>,
    /// The tool's commands may use the network (`shell`: the sandbox shares the host's network
    /// namespace instead of giving the command none). Default false: no network. Only for tools
    /// that run in the sandbox (`shell`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub network: bool,
    /// How failed operations of this tool are tried again (attempts, backoff with jitter, the
    /// error classes retried). Absent: one attempt, its error goes to the model. `timeout_secs`
    /// is the limit of each attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<crate::tools::RetryPolicy>,
    /// The longest output of this tool's operations kept for the model, in bytes (1 to
    /// [`MAX_TOOL_OUTPUT_BYTES`]); longer output is cut with a note. Absent: the tool service's
    /// `max_tool_output_bytes` (64 KiB by default). A result over 64 KiB is journaled by
    /// reference (`kedge_blobs`), so this is the model's limit, not the runtime's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_bytes: Option<u64>,
    /// Parameters of this tool whose values are sensitive (top-level argument names): sealed
    /// the moment the model's response arrives, so the journal and everything read from it hold
    /// them sealed; opened for the model's context and for the tool runner only. Kedge checks
    /// the rest of the arguments against the tool's schema; these the tool checks itself.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sensitive: Vec<String>,
    /// How far the tool's effect can be undone: `reversible` (nothing needs undoing: harmless
    /// to leave, or a read), `compensable` (undone by `compensate`), `irreversible`. Absent:
    /// undeclared, treated as irreversible (never compensated, always listed) and listed as
    /// `undeclared`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reversibility: Option<crate::event::Level>,
    /// With `reversibility: compensable` (and only then): the operation that undoes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensate: Option<CompensateDecl>,
}

impl ToolPolicy {
    /// The terms this tool's operations run under, as their requests carry them.
    pub fn limits(&self) -> crate::tools::RunLimits {
        crate::tools::RunLimits {
            timeout_secs: self.timeout_secs,
            network: self.network,
            retry: self.retry.clone(),
            max_output_bytes: self.max_output_bytes,
        }
    }
}

/// The most output a policy may keep for one tool operation (16 MiB).
pub const MAX_TOOL_OUTPUT_BYTES: u64 = 16 * 1024 * 1024;

fn is_false(b: &bool) -> bool {
    !*b
}

/// The tools whose operations run in the tool service's sandbox, where a network grant means
/// something.
pub const SANDBOXED_TOOLS: &[&str] = &["shell"];

/// Default validity of an approval request.
pub const DEFAULT_APPROVAL_TTL_SECS: u64 = 24 * 3600;

impl ToolPolicy {
    /// Why an operation of this tool needs a person's approval, if it does.
    pub fn approval_basis(&self, tool: &str) -> Option<String> {
        match self.approval {
            ApprovalRule::Never => None,
            ApprovalRule::Always => {
                Some(format!("policy: every `{tool}` operation needs approval"))
            }
            ApprovalRule::AtOrAboveRisk => {
                let threshold = self.approval_risk.unwrap_or(Risk::High);
                (self.risk >= threshold).then(|| {
                    format!(
                        "policy: `{tool}` is {:?} risk, approval needed at {:?} and above",
                        self.risk, threshold
                    )
                    .to_lowercase()
                })
            }
        }
    }
}

/// How a `compensable` tool's effect is undone (`policy.<tool>.compensate`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CompensateDecl {
    /// The compensating tool: a tool of this agent (not one the step handles itself, and not
    /// one that needs approval: compensations run without a person).
    pub tool: String,
    /// Its arguments, a JSON template: a string `${arguments}`, `${arguments.<field>…}`,
    /// `${result}` or `${op}` is the compensated operation's arguments (or a field of them),
    /// its result text, or its operation id; inside a longer string, their text. Absent: the
    /// compensated operation's own arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<serde_json::Value>,
}

#[cfg(test)]
mod tests {
    use crate::agent::{AgentDefinition, def};

    #[test]
    fn only_sandboxed_tools_are_granted_the_network_and_none_by_default() {
        let mut v = def();
        v["tools"] = serde_json::json!([{"name": "shell", "description": "Run a command"}]);
        v["policy"] = serde_json::json!({"shell": {}});
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        assert!(!d.tool_policy("shell").network, "no network unless granted");
        v["policy"] = serde_json::json!({"shell": {"network": true}});
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        assert!(d.tool_policy("shell").network);
    }
}
