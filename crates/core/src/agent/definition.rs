//! The agent definition ([`AgentDefinition`]) as stored in `kedge_agents`, the choices it makes
//! about a run's end and its answer, and what a run reads of it.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{ToolPolicy, ToolSpec};
use crate::event::{Budget, Digest, ModelSpec};
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
    /// The most tokens each model call may write (OpenAI `max_completion_tokens`, or
    /// `max_tokens` on other OpenAI-compatible servers; Anthropic `max_tokens`; thinking
    /// included).
    #[serde(default = "default_max_output_tokens")]
    pub max_output_tokens: u32,
    /// Tenants that may start runs of this agent. Absent: every tenant (an open agent, the
    /// right thing for a single-tenant deployment). To a tenant not listed, the agent does not
    /// exist: its task is rejected as naming no such agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<Vec<TenantId>>,
    /// JSON Schema the final answer (the model's text when it calls no tools) must match, as
    /// JSON. Requested in the provider's structured-output form (OpenAI `response_format`;
    /// Anthropic an `output` tool whose input is the answer, so for Anthropic it must have
    /// `"type": "object"`) and validated by Kedge in any case: `result.validation` is `valid` or
    /// `invalid {errors}`. Absent: the answer is free text, `not_checked`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<serde_json::Value>,
    /// What an answer that does not match `output_schema` means: `fail` (default) fails the run
    /// naming the errors, `accept` succeeds with `invalid {errors}`, `retry` sends the answer
    /// back to the model with the errors (`output_retries` times at most, then as `fail`).
    #[serde(default, skip_serializing_if = "OnInvalidOutput::is_fail")]
    pub on_invalid_output: OnInvalidOutput,
    /// With `on_invalid_output: retry`: how many times per turn an invalid answer is sent back
    /// for a corrected one before the run fails (default 2, 1 to 5). Each retry is one more
    /// step (the budget counts it). Only with `retry`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 5))]
    pub output_retries: Option<u32>,
    /// Task fields whose values are sensitive: `input`, `metadata.<key>`. Intake seals them
    /// with the operator's key before the run is journaled; the model still reads them
    /// (docs/SECURITY.md, "Sensitive values"). A deployment without a seal key refuses runs of
    /// an agent that marks anything sensitive.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sensitive_task_fields: Vec<String>,
    /// What a cancelled run does with its effects: `none` (default) ends it at once, listing
    /// them; `compensate` first runs the compensation of each completed operation of a
    /// `compensable` tool (`policy.<tool>.reversibility`), newest first, one at a time
    /// (docs/ARCHITECTURE.md "Compensation").
    #[serde(default, skip_serializing_if = "OnEnd::is_none")]
    pub on_cancel: OnEnd,
    /// The same for a run that fails (its budget, deadline, the model's refusal, an invalid
    /// answer): `none` (default) or `compensate`.
    #[serde(default, skip_serializing_if = "OnEnd::is_none")]
    pub on_failure: OnEnd,
    /// How the conversation is kept within the model's context window (docs/CONFIG.md "The
    /// context window"): `window_tokens`, `strategy` (`trim`, default, `summarize` or `fail`),
    /// `keep_last_turns`.
    #[serde(
        default,
        skip_serializing_if = "crate::context::ContextSettings::is_default"
    )]
    pub context: crate::context::ContextSettings,
    /// Other models the run's steps call while `model`'s endpoint has been failing for longer
    /// than `fallback_after_secs`, in order (docs/ARCHITECTURE.md "Provider trouble"): the first
    /// whose endpoint is not failing answers; `model` is called again once it is back. Each is
    /// checked by the operator's model policy like `model`; with `budget.max_cost` each needs a
    /// price in the same currency. At most [`MAX_FALLBACKS`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fallbacks: Vec<FallbackModel>,
    /// How long `model`'s endpoint must have been failing before a step falls back (default
    /// 30; 0 falls back at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 86400))]
    pub fallback_after_secs: Option<u64>,
    /// The concurrency key of this agent's runs when a task names none (docs/CONFIG.md "Agent
    /// definitions"): at most `limit` runs of one expanded `key` run at once per tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<crate::concurrency::ConcurrencySpec>,
    /// The priority of this agent's runs when a task names none (-1000..=1000, default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
}

/// Most fallback models an agent may list.
pub const MAX_FALLBACKS: usize = 3;
/// `fallback_after_secs` when an agent with fallbacks leaves it out.
pub const DEFAULT_FALLBACK_AFTER_SECS: u64 = 30;

/// A model a step falls back to while the agent's own model is unavailable: a model spec (its
/// provider, name, base URL, settings and price) and the variable holding its key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FallbackModel {
    #[serde(flatten)]
    pub model: ModelSpec,
    /// Environment variable holding its API key (default `OPENAI_API_KEY` or
    /// `ANTHROPIC_API_KEY` by provider).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
}

impl AgentDefinition {
    /// How long the model's endpoint must have been failing before a step falls back.
    pub fn fallback_after(&self) -> std::time::Duration {
        std::time::Duration::from_secs(
            self.fallback_after_secs
                .unwrap_or(DEFAULT_FALLBACK_AFTER_SECS),
        )
    }
}

/// What a run that ends early (cancelled, failed) does with the effects of its turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnEnd {
    /// Nothing: the run ends at once, its terminal event listing its operations.
    #[default]
    None,
    /// Compensate what can be compensated, newest first, then end; what cannot is listed.
    Compensate,
}

impl OnEnd {
    fn is_none(&self) -> bool {
        *self == OnEnd::None
    }
}

/// Retries of an invalid answer when `output_retries` is not given.
pub const DEFAULT_OUTPUT_RETRIES: u32 = 2;
/// Most `output_retries`.
pub const MAX_OUTPUT_RETRIES: u32 = 5;

/// The tool an Anthropic agent with an `output_schema` is offered to give its final answer
/// through (Anthropic has no `response_format`): its input schema is the output schema, and a
/// call to it is the answer, never dispatched. No declared tool of such an agent may have this
/// name.
pub const OUTPUT_TOOL: &str = "output";

/// What an answer that does not match the agent's `output_schema` means for the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnInvalidOutput {
    /// The run fails (`invalid_output`), its message naming the errors.
    #[default]
    Fail,
    /// The run succeeds; its result's validation is `invalid {errors}`.
    Accept,
    /// The answer goes back to the model with the errors (journaled as `output.rejected`) and
    /// the run continues, up to `output_retries` times per turn; then the run fails as with
    /// `fail`.
    Retry,
}

impl OnInvalidOutput {
    fn is_fail(&self) -> bool {
        *self == OnInvalidOutput::Fail
    }
}

impl AgentDefinition {
    /// How many times per turn an invalid answer is sent back for a corrected one: `0` unless
    /// `on_invalid_output` is `retry`.
    pub fn output_retries(&self) -> u32 {
        match self.on_invalid_output {
            OnInvalidOutput::Retry => self.output_retries.unwrap_or(DEFAULT_OUTPUT_RETRIES),
            OnInvalidOutput::Fail | OnInvalidOutput::Accept => 0,
        }
    }

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

impl AgentDefinition {
    /// The sensitive parameters of `tool` (`policy.<tool>.sensitive`).
    pub fn sensitive_params(&self, tool: &str) -> &[String] {
        self.policy
            .get(tool)
            .map_or(&[], |p| p.sensitive.as_slice())
    }

    /// Whether anything of this agent's runs is sensitive: its runs need the seal key.
    pub fn marks_sensitive(&self) -> bool {
        !self.sensitive_task_fields.is_empty()
            || self.policy.values().any(|p| !p.sensitive.is_empty())
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
    use crate::agent::{ApprovalRule, def};
    use crate::event::Budget;

    #[test]
    fn a_definition_parses_with_defaults() {
        let d = AgentDefinition::parse(def().to_string().as_bytes()).expect("valid");
        assert_eq!(d.budget, Budget::default());
        assert_eq!(d.max_output_tokens, 4096);
        assert_eq!(d.tool_policy("read_file").approval, ApprovalRule::Never);
        assert_ne!(d.prompt_digest(), d.tools_digest());
    }
}
