//! Agent definitions: what a run of an agent is made of (prompt, model, tools, policy, budget).
//!
//! Definitions live in the `kedge_agents` KV bucket under the agent's name; the bucket's revision
//! history is the version history. A run freezes the revision and the digests of each part in
//! `run.created`, so a later edit never changes a run in flight.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::event::{Budget, Digest, ModelSpec, Risk};
use crate::ids::{AgentName, TenantId};

/// A versioned agent definition (the value stored in `kedge_agents`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentDefinition {
    pub name: AgentName,
    pub system_prompt: String,
    pub model: ModelSpec,
    /// Environment variable holding the API key (default `OPENAI_API_KEY` or
    /// `ANTHROPIC_API_KEY`). The key itself never enters a definition or the journal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// Tools the model may call, with their JSON Schemas.
    #[serde(default)]
    pub tools: Vec<ToolSpec>,
    /// Per-tool policy, by tool name; tools without an entry get [`ToolPolicy::default`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub policy: BTreeMap<String, ToolPolicy>,
    #[serde(default)]
    pub budget: Budget,
    /// `max_tokens` sent with each model call.
    #[serde(default = "default_max_output_tokens")]
    pub max_output_tokens: u32,
    /// Tenants that may start runs of this agent. Absent: every tenant (an open agent, the
    /// right thing for a single-tenant deployment). To a tenant not listed, the agent does not
    /// exist: its task is rejected as naming no such agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<Vec<TenantId>>,
}

impl AgentDefinition {
    /// Whether `tenant` may start runs of this agent.
    pub fn allows_tenant(&self, tenant: &TenantId) -> bool {
        self.tenants
            .as_ref()
            .is_none_or(|allowed| allowed.contains(tenant))
    }
}

fn default_max_output_tokens() -> u32 {
    4096
}

/// A tool as the model sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments object.
    #[serde(default = "empty_object_schema")]
    pub parameters: serde_json::Value,
}

fn empty_object_schema() -> serde_json::Value {
    serde_json::json!({"type": "object", "properties": {}})
}

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
}

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

/// A definition that cannot be stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct DefinitionError {
    pub field: String,
    pub reason: String,
}

/// Provider function names: `[a-zA-Z0-9_-]{1,64}` (the stricter of the two APIs).
pub fn valid_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl AgentDefinition {
    pub fn parse(bytes: &[u8]) -> Result<AgentDefinition, DefinitionError> {
        let def: AgentDefinition = serde_json::from_slice(bytes).map_err(|e| DefinitionError {
            field: "definition".into(),
            reason: e.to_string(),
        })?;
        def.validate()?;
        Ok(def)
    }

    pub fn validate(&self) -> Result<(), DefinitionError> {
        let err = |field: String, reason: &str| {
            Err(DefinitionError {
                field,
                reason: reason.into(),
            })
        };
        let mut seen = std::collections::BTreeSet::new();
        for (i, t) in self.tools.iter().enumerate() {
            if !valid_tool_name(&t.name) {
                return err(format!("tools[{i}].name"), "must match [a-zA-Z0-9_-]{1,64}");
            }
            if !seen.insert(t.name.as_str()) {
                return err(format!("tools[{i}].name"), "duplicate tool name");
            }
            if t.parameters.get("type").and_then(|v| v.as_str()) != Some("object") {
                return err(
                    format!("tools[{i}].parameters"),
                    "must be a JSON Schema with \"type\": \"object\"",
                );
            }
        }
        for name in self.policy.keys() {
            if !seen.contains(name.as_str()) {
                return err(format!("policy.{name}"), "names no tool of this agent");
            }
        }
        if self.budget.max_steps == 0 || self.budget.max_attempts_per_step == 0 {
            return err(
                "budget".into(),
                "max_steps and max_attempts_per_step must be >= 1",
            );
        }
        Ok(())
    }

    pub fn tool_policy(&self, tool: &str) -> ToolPolicy {
        self.policy.get(tool).cloned().unwrap_or_default()
    }

    pub fn digest(&self) -> Digest {
        Digest::of(self)
    }
    pub fn prompt_digest(&self) -> Digest {
        Digest::of_bytes(self.system_prompt.as_bytes())
    }
    pub fn tools_digest(&self) -> Digest {
        Digest::of(&self.tools)
    }
    pub fn policy_digest(&self) -> Digest {
        Digest::of(&self.policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def() -> serde_json::Value {
        serde_json::json!({
            "name": "demo",
            "system_prompt": "You are helpful.",
            "model": {"provider": "openai", "name": "mock-demo", "base_url": "http://127.0.0.1:1/v1"},
            "tools": [{"name": "read_file", "description": "Read a file",
                       "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}],
            "policy": {"read_file": {"approval": "never"}}
        })
    }

    #[test]
    fn a_definition_parses_with_defaults() {
        let d = AgentDefinition::parse(def().to_string().as_bytes()).expect("valid");
        assert_eq!(d.budget, Budget::default());
        assert_eq!(d.max_output_tokens, 4096);
        assert_eq!(d.tool_policy("read_file").approval, ApprovalRule::Never);
        assert_ne!(d.prompt_digest(), d.tools_digest());
    }

    #[test]
    fn bad_definitions_name_the_field() {
        let mut v = def();
        v["tools"][0]["name"] = "read file".into();
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("bad name");
        assert_eq!(e.field, "tools[0].name");
        let mut v = def();
        v["policy"] = serde_json::json!({"shell": {}});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("unknown tool");
        assert_eq!(e.field, "policy.shell");
        let mut v = def();
        v["tools"][0]["parameters"] = serde_json::json!({"type": "string"});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("not object");
        assert_eq!(e.field, "tools[0].parameters");
    }
}
