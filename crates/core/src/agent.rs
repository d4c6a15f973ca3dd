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

/// A tool as the model sees it.
///
/// In a definition a tool is an object (`name`, `description`, `parameters`) or, for a built-in
/// tool, just its name. A built-in listed without `parameters` (or with `null` or `{}`) gets
/// Kedge's schema and, if it has no description, Kedge's description (docs/CONFIG.md lists them);
/// any other tool without `parameters` accepts any object (`{"type": "object", "properties":
/// {}}`). What is stored is the resolved tool, so a run keeps the schema of its revision.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(with = "ToolEntry")]
pub struct ToolSpec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments object.
    #[serde(default = "empty_object_schema")]
    pub parameters: serde_json::Value,
}

/// A tool as a definition may write it.
#[derive(Deserialize, JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)] // only its schema is used; deserialization goes through `ToolSpecWire`
enum ToolEntry {
    /// A built-in tool by name (`read_file`, `shell`, …): Kedge supplies its schema.
    Name(String),
    Spec(ToolSpecWire),
}

/// A tool declared in full.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ToolSpecWire {
    /// `[a-zA-Z0-9_-]{1,64}`; an MCP tool is `<server>__<tool>`.
    name: String,
    #[serde(default)]
    description: String,
    /// JSON Schema of the arguments object (`"type": "object"`). Omitted for a built-in tool:
    /// Kedge's schema; for any other tool: any object.
    #[serde(default)]
    parameters: Option<serde_json::Value>,
    /// Only for the `run_agent` tool (and required there): the agents its model may start as
    /// child runs. Kedge writes the tool's parameters from it (the agent's name, one of these,
    /// and the child's input); it is not stored apart.
    #[serde(default)]
    agents: Option<Vec<AgentName>>,
}

impl TryFrom<ToolSpecWire> for ToolSpec {
    type Error = String;
    fn try_from(w: ToolSpecWire) -> Result<ToolSpec, String> {
        match (&w.agents, w.name == crate::child::RUN_AGENT_TOOL) {
            (Some(_), false) => {
                return Err(format!(
                    "`agents` is only for the `{}` tool, not `{}`",
                    crate::child::RUN_AGENT_TOOL,
                    w.name
                ));
            }
            (Some(agents), true) => {
                if agents.is_empty() {
                    return Err("`run_agent`'s `agents` must name at least one agent".into());
                }
                if w.parameters.is_some() {
                    return Err(
                        "`run_agent`'s parameters are Kedge's: name the agents in `agents`, \
                         not `parameters`"
                            .into(),
                    );
                }
                return Ok(ToolSpec {
                    description: if w.description.is_empty() {
                        crate::child::default_description(agents)
                    } else {
                        w.description
                    },
                    parameters: crate::child::parameters(agents),
                    name: w.name,
                });
            }
            (None, _) => {}
        }
        Ok(ToolSpec::from_wire(w))
    }
}

impl ToolSpec {
    fn from_wire(w: ToolSpecWire) -> ToolSpec {
        let unset = match &w.parameters {
            None | Some(serde_json::Value::Null) => true,
            Some(serde_json::Value::Object(o)) => o.is_empty(),
            Some(_) => false,
        };
        match crate::tools::builtin(&w.name) {
            Some(b) if unset => ToolSpec {
                description: if w.description.is_empty() {
                    b.description.to_owned()
                } else {
                    w.description
                },
                name: w.name,
                parameters: b.parameters(),
            },
            _ => ToolSpec {
                name: w.name,
                description: w.description,
                parameters: match w.parameters {
                    None | Some(serde_json::Value::Null) => empty_object_schema(),
                    Some(p) => p,
                },
            },
        }
    }
}

impl<'de> Deserialize<'de> for ToolSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ToolSpec, D::Error> {
        // A string is a built-in's name (any other name gets the permissive default, as an
        // entry without parameters does; `validate` checks the name).
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(name) => ToolSpec::try_from(ToolSpecWire {
                name,
                description: String::new(),
                parameters: None,
                agents: None,
            })
            .map_err(serde::de::Error::custom),
            other => serde_json::from_value::<ToolSpecWire>(other)
                .map_err(serde::de::Error::custom)
                .and_then(|w| ToolSpec::try_from(w).map_err(serde::de::Error::custom)),
        }
    }
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

/// A definition that cannot be stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct DefinitionError {
    pub field: String,
    pub reason: String,
}

/// Most steps a run may be given.
pub const MAX_STEPS: u32 = 100_000;
/// Most attempts per step.
pub const MAX_ATTEMPTS_PER_STEP: u32 = 100;
/// Longest run deadline (a year): the timer service holds the deadline timer that long.
pub const MAX_DEADLINE_SECS: u64 = 366 * 24 * 3600;
/// Longest approval validity (the approval's expiry is a durable timer).
pub const MAX_APPROVAL_TTL_SECS: u64 = 366 * 24 * 3600;
/// Longest per-tool time limit (it can only tighten the tool service's own `tool_timeout`).
pub const MAX_TOOL_TIMEOUT_SECS: u64 = 24 * 3600;
/// Largest `max_output_tokens`.
pub const MAX_OUTPUT_TOKENS: u64 = 1 << 20;

fn in_range(field: &str, value: u64, min: u64, max: u64) -> Result<(), DefinitionError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(DefinitionError {
            field: field.to_owned(),
            reason: format!("{value} is outside {min}..={max}"),
        })
    }
}

/// Range checks of a budget, shared by agent definitions and (for the limits a task sets)
/// tasks: `Err((field, reason))` names the first field out of range, prefixed with `prefix`.
pub fn check_budget(b: &Budget, prefix: &str) -> Result<(), (String, String)> {
    let limits = [
        (
            "max_steps",
            Some(u64::from(b.max_steps)),
            u64::from(MAX_STEPS),
        ),
        ("max_tokens", Some(b.max_tokens), u64::MAX),
        (
            "max_attempts_per_step",
            Some(u64::from(b.max_attempts_per_step)),
            u64::from(MAX_ATTEMPTS_PER_STEP),
        ),
        ("deadline_secs", b.deadline_secs, MAX_DEADLINE_SECS),
    ];
    for (field, value, max) in limits {
        if let Some(v) = value
            && !(1..=max).contains(&v)
        {
            return Err((
                format!("{prefix}{field}"),
                format!("{v} is outside 1..={max}"),
            ));
        }
    }
    if let Some(c) = b.max_cost
        && !(c.is_finite() && c > 0.0)
    {
        return Err((
            format!("{prefix}max_cost"),
            format!("{c} must be a number > 0"),
        ));
    }
    Ok(())
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
            if let Err(reason) = crate::tools::check_schema(&t.parameters) {
                return err(format!("tools[{i}].parameters"), &reason);
            }
            if t.name == crate::child::RUN_AGENT_TOOL && crate::child::allowed(t).is_none() {
                return err(
                    format!("tools[{i}].agents"),
                    "run_agent must name the agents it may start (`\"agents\": [..]`); its \
                     parameters are Kedge's",
                );
            }
        }
        if let Some(schema) = &self.output_schema
            && let Err(reason) = crate::tools::check_schema(schema)
        {
            return err("output_schema".into(), &reason);
        }
        if let Err((field, reason)) = self.context.check() {
            return err(field.into(), &reason);
        }
        if let Some(n) = self.output_retries {
            if self.on_invalid_output != OnInvalidOutput::Retry {
                return err(
                    "output_retries".into(),
                    "only with \"on_invalid_output\": \"retry\"",
                );
            }
            in_range(
                "output_retries",
                u64::from(n),
                1,
                u64::from(MAX_OUTPUT_RETRIES),
            )?;
        }
        if self.on_invalid_output == OnInvalidOutput::Retry && self.output_schema.is_none() {
            return err(
                "on_invalid_output".into(),
                "retry needs an output_schema to check the answer against",
            );
        }
        if let Some(schema) = &self.output_schema
            && self.model.provider == crate::event::Provider::Anthropic
            && schema.get("type").and_then(|t| t.as_str()) != Some("object")
        {
            return err(
                "output_schema".into(),
                "an Anthropic agent's output_schema must have \"type\": \"object\" (it is the \
                 input schema of the `output` tool the answer is given through)",
            );
        }
        if self.output_schema.is_some()
            && self.model.provider == crate::event::Provider::Anthropic
            && let Some(i) = self.tools.iter().position(|t| t.name == OUTPUT_TOOL)
        {
            return err(
                format!("tools[{i}].name"),
                "`output` is the tool an Anthropic agent with an output_schema answers through",
            );
        }
        for (name, p) in &self.policy {
            if !seen.contains(name.as_str()) {
                return err(format!("policy.{name}"), "names no tool of this agent");
            }
            if p.network && !SANDBOXED_TOOLS.contains(&name.as_str()) {
                return err(
                    format!("policy.{name}.network"),
                    "only tools that run in the sandbox (shell) can be granted the network",
                );
            }
            if let Some(retry) = &p.retry
                && let Err((field, reason)) = retry.check(name)
            {
                return err(format!("policy.{name}.retry.{field}"), &reason);
            }
            let properties = self
                .tools
                .iter()
                .find(|t| t.name == *name)
                .and_then(|t| t.parameters.get("properties"))
                .and_then(|p| p.as_object());
            for (i, param) in p.sensitive.iter().enumerate() {
                if param.is_empty() || properties.is_some_and(|props| !props.contains_key(param)) {
                    return err(
                        format!("policy.{name}.sensitive[{i}]"),
                        "must name a parameter of the tool (a property of its schema)",
                    );
                }
            }
            for (field, value, max) in [
                ("timeout_secs", p.timeout_secs, MAX_TOOL_TIMEOUT_SECS),
                (
                    "max_output_bytes",
                    p.max_output_bytes,
                    MAX_TOOL_OUTPUT_BYTES,
                ),
                (
                    "approval_ttl_secs",
                    p.approval_ttl_secs,
                    MAX_APPROVAL_TTL_SECS,
                ),
            ] {
                if let Some(v) = value {
                    in_range(&format!("policy.{name}.{field}"), v, 1, max)?;
                }
            }
        }
        for (i, field) in self.sensitive_task_fields.iter().enumerate() {
            let known = field == "input"
                || field
                    .strip_prefix("metadata.")
                    .is_some_and(|key| !key.is_empty());
            if !known {
                return err(
                    format!("sensitive_task_fields[{i}]"),
                    "must be `input` or `metadata.<key>`",
                );
            }
        }
        self.check_compensation()?;
        check_budget(&self.budget, "budget.")
            .map_err(|(field, reason)| DefinitionError { field, reason })?;
        in_range(
            "max_output_tokens",
            u64::from(self.max_output_tokens),
            1,
            MAX_OUTPUT_TOKENS,
        )?;
        let tool_names: Vec<&str> = self.tools.iter().map(|t| t.name.as_str()).collect();
        crate::settings::check(
            self.model.provider,
            &self.model.settings,
            self.model.price.as_ref(),
            self.max_output_tokens,
            &tool_names,
        )
        .map_err(|(field, reason)| DefinitionError {
            field: format!("model.{field}"),
            reason,
        })?;
        if self.budget.max_cost.is_some() && self.model.price.is_none() {
            return err(
                "budget.max_cost".into(),
                "needs model.price to count what the run costs",
            );
        }
        self.check_fallbacks(&tool_names)
    }

    /// The fallback models: each checked as `model` is, and priced like it when the run's cost
    /// is counted.
    fn check_fallbacks(&self, tool_names: &[&str]) -> Result<(), DefinitionError> {
        let err = |field: String, reason: String| Err(DefinitionError { field, reason });
        if self.fallbacks.len() > MAX_FALLBACKS {
            return err(
                "fallbacks".into(),
                format!("at most {MAX_FALLBACKS} fallback models"),
            );
        }
        if self.fallbacks.is_empty() && self.fallback_after_secs.is_some() {
            return err("fallback_after_secs".into(), "only with fallbacks".into());
        }
        in_range(
            "fallback_after_secs",
            self.fallback_after_secs.unwrap_or_default(),
            0,
            86_400,
        )?;
        for (i, f) in self.fallbacks.iter().enumerate() {
            let m = &f.model;
            if m.name.trim().is_empty() {
                return err(format!("fallbacks[{i}].name"), "must not be empty".into());
            }
            crate::settings::check(
                m.provider,
                &m.settings,
                m.price.as_ref(),
                self.max_output_tokens,
                tool_names,
            )
            .map_err(|(field, reason)| DefinitionError {
                field: format!("fallbacks[{i}].{field}"),
                reason,
            })?;
            if self.budget.max_cost.is_some() && m.currency() != self.model.currency() {
                return err(
                    format!("fallbacks[{i}].price"),
                    "with budget.max_cost every fallback needs a price in model.price's currency"
                        .into(),
                );
            }
            if let Some(schema) = &self.output_schema
                && m.provider == crate::event::Provider::Anthropic
                && (schema.get("type").and_then(|t| t.as_str()) != Some("object")
                    || tool_names.contains(&OUTPUT_TOOL))
            {
                return err(
                    format!("fallbacks[{i}].provider"),
                    "an Anthropic model answers an output_schema through its `output` tool: the \
                     schema must have \"type\": \"object\" and no tool may be named `output`"
                        .into(),
                );
            }
            if f.api_key_env.as_deref().is_some_and(|k| {
                k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            }) {
                return err(
                    format!("fallbacks[{i}].api_key_env"),
                    "must be an environment variable name ([A-Za-z0-9_]+)".into(),
                );
            }
        }
        Ok(())
    }

    /// The reversibility declarations (`policy.<tool>.reversibility`, `compensate`).
    fn check_compensation(&self) -> Result<(), DefinitionError> {
        use crate::event::Level;
        let err = |field: String, reason: String| Err(DefinitionError { field, reason });
        for (name, p) in &self.policy {
            match (p.reversibility, &p.compensate) {
                (Some(Level::Undeclared), _) => {
                    return err(
                        format!("policy.{name}.reversibility"),
                        "must be reversible, compensable or irreversible (leave it out for \
                         undeclared)"
                            .into(),
                    );
                }
                (Some(Level::Compensable), None) => {
                    return err(
                        format!("policy.{name}.compensate"),
                        "a compensable tool must name its compensation \
                         (`{\"tool\": …, \"arguments\": …}`)"
                            .into(),
                    );
                }
                (Some(Level::Compensable), Some(c)) => {
                    let field = format!("policy.{name}.compensate.tool");
                    if !self.tools.iter().any(|t| t.name == c.tool) {
                        return err(field, format!("`{}` is not a tool of this agent", c.tool));
                    }
                    if crate::fold::handled_by_step(&c.tool) {
                        return err(
                            field,
                            format!(
                                "`{}` is handled by the step and has no effect to run",
                                c.tool
                            ),
                        );
                    }
                    if self.tool_policy(&c.tool).approval != ApprovalRule::Never {
                        return err(
                            field,
                            format!(
                                "`{}` needs approval, and compensations run without a person",
                                c.tool
                            ),
                        );
                    }
                    if let Some(args) = &c.arguments
                        && let Err(reason) = crate::compensation::check_template(args)
                    {
                        return err(format!("policy.{name}.compensate.arguments"), reason);
                    }
                }
                (_, Some(_)) => {
                    return err(
                        format!("policy.{name}.compensate"),
                        "only with \"reversibility\": \"compensable\"".into(),
                    );
                }
                (Some(Level::Reversible | Level::Irreversible) | None, None) => {}
            }
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
    fn builtins_by_name_get_kedges_schema_and_explicit_schemas_are_kept() {
        let mut v = def();
        v["tools"] = serde_json::json!([
            "shell",
            {"name": "read_file"},
            {"name": "write_file", "description": "mine", "parameters": {}},
            {"name": "list_files", "parameters": {"type": "object", "properties": {}}},
            {"name": "time__now"}
        ]);
        v["policy"] = serde_json::json!({});
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        let shell = crate::tools::builtin("shell").expect("built-in");
        assert_eq!(d.tools[0], shell.spec());
        assert_eq!(
            d.tools[1].parameters["required"],
            serde_json::json!(["path"])
        );
        assert_eq!(d.tools[2].description, "mine");
        assert_eq!(
            d.tools[2].parameters["required"],
            serde_json::json!(["path", "content"])
        );
        assert_eq!(
            d.tools[3].parameters,
            empty_object_schema(),
            "an explicit schema stays"
        );
        assert_eq!(d.tools[4].parameters, empty_object_schema());
        // What is stored reads back the same (the schema is part of the revision).
        let stored = serde_json::to_vec(&d).expect("json");
        assert_eq!(AgentDefinition::parse(&stored).expect("valid"), d);
    }

    #[test]
    fn an_output_schema_is_checked_when_stored_and_fail_is_the_default() {
        let d = AgentDefinition::parse(def().to_string().as_bytes()).expect("valid");
        assert_eq!(d.output_schema, None);
        assert_eq!(d.on_invalid_output, OnInvalidOutput::Fail);
        let mut v = def();
        v["output_schema"] = serde_json::json!({"type": "object", "required": ["answer"],
            "properties": {"answer": {"type": "string"}}});
        v["on_invalid_output"] = serde_json::json!("accept");
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        assert_eq!(d.on_invalid_output, OnInvalidOutput::Accept);
        let stored = serde_json::to_vec(&d).expect("json");
        assert_eq!(AgentDefinition::parse(&stored).expect("valid"), d);
        for bad in [
            serde_json::json!({"type": "strin"}),
            serde_json::json!({"type": "string", "pattern": "("}),
            serde_json::json!({"$ref": "#/definitions/missing"}),
        ] {
            v["output_schema"] = bad.clone();
            let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("bad schema");
            assert_eq!(e.field, "output_schema", "{bad}: {e}");
        }
        v["output_schema"] = serde_json::json!({"type": "string"});
        v["on_invalid_output"] = serde_json::json!("retry_forever");
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("unknown choice");
        assert!(
            e.reason.contains("on_invalid_output") || e.reason.contains("retry_forever"),
            "{e}"
        );
    }

    #[test]
    fn retrying_an_invalid_output_is_bounded_and_checked_naming_the_field() {
        let mut v = def();
        v["output_schema"] = serde_json::json!({"type": "object", "required": ["answer"]});
        v["on_invalid_output"] = serde_json::json!("retry");
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        assert_eq!(d.on_invalid_output, OnInvalidOutput::Retry);
        assert_eq!(d.output_retries(), DEFAULT_OUTPUT_RETRIES);
        v["output_retries"] = serde_json::json!(5);
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        assert_eq!(d.output_retries(), 5);
        let stored = serde_json::to_vec(&d).expect("json");
        assert_eq!(AgentDefinition::parse(&stored).expect("valid"), d);
        assert_eq!(
            crate::tools::Contract::of(&d).output_retries(),
            5,
            "the contract carries it"
        );
        for (patch, field) in [
            (serde_json::json!({"output_retries": 0}), "output_retries"),
            (serde_json::json!({"output_retries": 6}), "output_retries"),
            (
                serde_json::json!({"on_invalid_output": "fail", "output_retries": 2}),
                "output_retries",
            ),
            (
                serde_json::json!({"on_invalid_output": "accept", "output_retries": 1}),
                "output_retries",
            ),
            (
                serde_json::json!({"output_schema": null, "output_retries": null}),
                "on_invalid_output",
            ),
        ] {
            let mut v = v.clone();
            for (k, x) in patch.as_object().expect("object") {
                v[k] = x.clone();
            }
            if v["output_schema"].is_null() {
                v.as_object_mut().expect("object").remove("output_schema");
            }
            if v["output_retries"].is_null() {
                v.as_object_mut().expect("object").remove("output_retries");
            }
            let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err(field);
            assert_eq!(e.field, field, "{patch}: {e}");
        }
        let e = AgentDefinition::parse(
            serde_json::json!({"name": "x", "system_prompt": "", "model": {"provider": "openai", "name": "m"},
                "output_schema": {"type": "object"}, "output_retries": -1})
            .to_string()
            .as_bytes(),
        )
        .expect_err("negative");
        assert!(
            e.reason.contains("output_retries") || e.reason.contains("-1"),
            "{e}"
        );
        // Fail and accept retry nothing.
        let d = AgentDefinition::parse(def().to_string().as_bytes()).expect("valid");
        assert_eq!(d.output_retries(), 0);
    }

    #[test]
    fn an_anthropic_agent_with_an_output_schema_keeps_the_output_tool_name_free() {
        let mut v = def();
        v["tools"] = serde_json::json!(["read_file", {"name": "output"}]);
        v["policy"] = serde_json::json!({});
        // Without a schema, or on OpenAI, `output` is a name like any other.
        AgentDefinition::parse(v.to_string().as_bytes()).expect("no schema");
        v["output_schema"] = serde_json::json!({"type": "object"});
        AgentDefinition::parse(v.to_string().as_bytes()).expect("openai");
        v["model"] = serde_json::json!({"provider": "anthropic", "name": "claude"});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("taken");
        assert_eq!(e.field, "tools[1].name");
        assert!(e.reason.contains("output"), "{e}");
        // The schema is the tool's input schema: Anthropic takes objects only.
        v["tools"] = serde_json::json!(["read_file"]);
        AgentDefinition::parse(v.to_string().as_bytes()).expect("an object schema");
        v["output_schema"] = serde_json::json!({"type": "array"});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("not an object");
        assert_eq!(e.field, "output_schema");
    }

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

    #[test]
    fn schemas_and_numbers_are_checked_when_stored() {
        let mut v = def();
        v["tools"][0]["parameters"] =
            serde_json::json!({"type": "object", "properties": {"path": {"type": "strin"}}});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("bad schema");
        assert_eq!(e.field, "tools[0].parameters");
        for (field, value, name) in [
            (
                "budget",
                serde_json::json!({"max_steps": 1, "max_tokens": 1, "max_attempts_per_step": 1, "deadline_secs": u64::MAX}),
                "budget.deadline_secs",
            ),
            (
                "budget",
                serde_json::json!({"max_steps": 0, "max_tokens": 1, "max_attempts_per_step": 1}),
                "budget.max_steps",
            ),
            (
                "budget",
                serde_json::json!({"max_steps": 1, "max_tokens": 1, "max_attempts_per_step": 1000}),
                "budget.max_attempts_per_step",
            ),
            (
                "max_output_tokens",
                serde_json::json!(0),
                "max_output_tokens",
            ),
            (
                "policy",
                serde_json::json!({"read_file": {"approval_ttl_secs": u64::MAX}}),
                "policy.read_file.approval_ttl_secs",
            ),
            (
                "policy",
                serde_json::json!({"read_file": {"max_output_bytes": 0}}),
                "policy.read_file.max_output_bytes",
            ),
            (
                "policy",
                serde_json::json!({"read_file": {"sensitive": ["path", "nope"]}}),
                "policy.read_file.sensitive[1]",
            ),
            (
                "sensitive_task_fields",
                serde_json::json!(["input", "metadata."]),
                "sensitive_task_fields[1]",
            ),
            (
                "sensitive_task_fields",
                serde_json::json!(["output"]),
                "sensitive_task_fields[0]",
            ),
            (
                "policy",
                serde_json::json!({"read_file": {"max_output_bytes": 16 * 1024 * 1024 + 1}}),
                "policy.read_file.max_output_bytes",
            ),
            (
                "policy",
                serde_json::json!({"read_file": {"timeout_secs": 0}}),
                "policy.read_file.timeout_secs",
            ),
            (
                "policy",
                serde_json::json!({"read_file": {"network": true}}),
                "policy.read_file.network",
            ),
        ] {
            let mut v = def();
            v[field] = value;
            let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err(name);
            assert_eq!(e.field, name);
        }
    }

    #[test]
    fn fallback_models_are_checked_like_the_model_and_name_the_field_at_fault() {
        let with = |extra: serde_json::Value| {
            let mut v = def();
            for (k, x) in extra.as_object().expect("object") {
                v[k] = x.clone();
            }
            AgentDefinition::parse(v.to_string().as_bytes())
        };
        let claude = serde_json::json!({"provider": "anthropic", "name": "claude", "api_key_env": "TEAM_KEY"});
        let d = with(serde_json::json!({"fallbacks": [claude], "fallback_after_secs": 5}))
            .expect("a fallback");
        assert_eq!(d.fallbacks[0].model.name, "claude");
        assert_eq!(d.fallbacks[0].api_key_env.as_deref(), Some("TEAM_KEY"));
        assert_eq!(d.fallback_after(), std::time::Duration::from_secs(5));
        let d = with(serde_json::json!({"fallbacks": [claude]})).expect("the default wait");
        assert_eq!(
            d.fallback_after(),
            std::time::Duration::from_secs(DEFAULT_FALLBACK_AFTER_SECS)
        );
        let priced = serde_json::json!({"provider": "openai", "name": "m", "price": {"input_per_mtok": 1, "output_per_mtok": 1}});
        for (extra, field) in [
            (
                serde_json::json!({"fallback_after_secs": 5}),
                "fallback_after_secs",
            ),
            (
                serde_json::json!({"fallbacks": [claude, claude, claude, claude]}),
                "fallbacks",
            ),
            (
                serde_json::json!({"fallbacks": [claude], "fallback_after_secs": 100000}),
                "fallback_after_secs",
            ),
            (
                serde_json::json!({"fallbacks": [{"provider": "anthropic", "name": " "}]}),
                "fallbacks[0].name",
            ),
            (
                serde_json::json!({"fallbacks": [{"provider": "anthropic", "name": "c", "settings": {"seed": 1}}]}),
                "fallbacks[0].settings.seed",
            ),
            (
                serde_json::json!({"fallbacks": [{"provider": "openai", "name": "c", "api_key_env": "a-b"}]}),
                "fallbacks[0].api_key_env",
            ),
            // Counting the cost needs every model priced in one currency.
            (
                serde_json::json!({"model": priced, "budget": {"max_steps": 5, "max_tokens": 1000, "max_attempts_per_step": 3, "max_cost": 1.0}, "fallbacks": [claude]}),
                "fallbacks[0].price",
            ),
            (
                serde_json::json!({"fallbacks": [claude], "output_schema": {"type": "array"}}),
                "fallbacks[0].provider",
            ),
        ] {
            let e = with(extra.clone()).expect_err("refused");
            assert_eq!(e.field, field, "{extra}: {}", e.reason);
        }
    }

    #[test]
    fn model_settings_and_prices_are_checked_against_the_providers_rules() {
        let with = |model: serde_json::Value, extra: serde_json::Value| {
            let mut v = def();
            v["model"] = model;
            for (k, x) in extra.as_object().expect("object") {
                v[k] = x.clone();
            }
            AgentDefinition::parse(v.to_string().as_bytes())
        };
        let openai = |settings: serde_json::Value| serde_json::json!({"provider": "openai", "name": "m", "settings": settings});
        let anthropic = |settings: serde_json::Value| serde_json::json!({"provider": "anthropic", "name": "m", "settings": settings});
        let none = serde_json::json!({});
        let d = with(
            openai(serde_json::json!({
                "temperature": 1.5, "top_p": 0.9, "stop": ["END"], "seed": 7,
                "tool_choice": {"tool": "read_file"}, "parallel_tool_calls": false,
                "reasoning_effort": "low"
            })),
            none.clone(),
        )
        .expect("valid OpenAI settings");
        assert_eq!(d.model.settings.seed, Some(7));
        with(
            anthropic(serde_json::json!({
                "thinking": {"budget_tokens": 1024}, "top_p": 0.95, "cache": true,
                "tool_choice": "auto", "stop": ["a", "b", "c", "d", "e"]
            })),
            none.clone(),
        )
        .expect("valid Anthropic settings");
        for (model, extra, field) in [
            (
                openai(serde_json::json!({"temperature": 2.5})),
                none.clone(),
                "model.settings.temperature",
            ),
            (
                anthropic(serde_json::json!({"temperature": 1.5})),
                none.clone(),
                "model.settings.temperature",
            ),
            (
                openai(serde_json::json!({"top_p": -0.1})),
                none.clone(),
                "model.settings.top_p",
            ),
            (
                openai(serde_json::json!({"stop": ["a", "b", "c", "d", "e"]})),
                none.clone(),
                "model.settings.stop",
            ),
            (
                openai(serde_json::json!({"stop": [""]})),
                none.clone(),
                "model.settings.stop[0]",
            ),
            (
                anthropic(serde_json::json!({"seed": 1})),
                none.clone(),
                "model.settings.seed",
            ),
            (
                anthropic(serde_json::json!({"reasoning_effort": "high"})),
                none.clone(),
                "model.settings.reasoning_effort",
            ),
            (
                openai(serde_json::json!({"thinking": {"budget_tokens": 2048}})),
                none.clone(),
                "model.settings.thinking",
            ),
            (
                openai(serde_json::json!({"cache": true})),
                none.clone(),
                "model.settings.cache",
            ),
            (
                openai(serde_json::json!({"tool_choice": {"tool": "shell"}})),
                none.clone(),
                "model.settings.tool_choice",
            ),
            (
                openai(serde_json::json!({"tool_choice": "required"})),
                serde_json::json!({"tools": [], "policy": {}}),
                "model.settings.tool_choice",
            ),
            (
                openai(serde_json::json!({"parallel_tool_calls": true})),
                serde_json::json!({"tools": [], "policy": {}}),
                "model.settings.parallel_tool_calls",
            ),
            (
                anthropic(serde_json::json!({"thinking": {"budget_tokens": 1000}})),
                none.clone(),
                "model.settings.thinking.budget_tokens",
            ),
            (
                anthropic(serde_json::json!({"thinking": {"budget_tokens": 4096}})),
                none.clone(),
                "model.settings.thinking.budget_tokens",
            ),
            (
                anthropic(
                    serde_json::json!({"thinking": {"budget_tokens": 2048}, "temperature": 1}),
                ),
                none.clone(),
                "model.settings.temperature",
            ),
            (
                anthropic(serde_json::json!({"thinking": {"budget_tokens": 2048}, "top_p": 0.5})),
                none.clone(),
                "model.settings.top_p",
            ),
            (
                anthropic(
                    serde_json::json!({"thinking": {"budget_tokens": 2048}, "tool_choice": "required"}),
                ),
                none.clone(),
                "model.settings.tool_choice",
            ),
            (
                serde_json::json!({"provider": "openai", "name": "m", "price": {"input_per_mtok": -1, "output_per_mtok": 1}}),
                none.clone(),
                "model.price.input_per_mtok",
            ),
            (
                serde_json::json!({"provider": "openai", "name": "m", "price": {"input_per_mtok": 1, "output_per_mtok": 1, "currency": "US$"}}),
                none.clone(),
                "model.price.currency",
            ),
            (
                serde_json::json!({"provider": "openai", "name": "m"}),
                serde_json::json!({"budget": {"max_steps": 5, "max_tokens": 100, "max_attempts_per_step": 1, "max_cost": 1.0}}),
                "budget.max_cost",
            ),
            (
                serde_json::json!({"provider": "openai", "name": "m", "price": {"input_per_mtok": 1, "output_per_mtok": 1}}),
                serde_json::json!({"budget": {"max_steps": 5, "max_tokens": 100, "max_attempts_per_step": 1, "max_cost": 0}}),
                "budget.max_cost",
            ),
        ] {
            let e = with(model.clone(), extra).expect_err(field);
            assert_eq!(e.field, field, "{model}: {e}");
        }
        let d = with(
            serde_json::json!({"provider": "openai", "name": "m", "price": {"input_per_mtok": 2, "output_per_mtok": 8}}),
            serde_json::json!({"budget": {"max_steps": 5, "max_tokens": 100, "max_attempts_per_step": 1, "max_cost": 0.5}}),
        )
        .expect("a priced model with a cost budget");
        assert_eq!(d.model.price.as_ref().expect("price").currency, "USD");
        assert_eq!(
            AgentDefinition::parse(&serde_json::to_vec(&d).expect("json"))
                .expect("reads back")
                .budget
                .max_cost,
            Some(0.5)
        );
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

    #[test]
    fn a_tool_retry_policy_is_checked_when_stored_naming_the_field() {
        let mut v = def();
        v["tools"] = serde_json::json!(["read_file", "shell", {"name": "srv__search"}]);
        v["policy"] = serde_json::json!({
            "srv__search": {"timeout_secs": 5, "retry": {"attempts": 4, "initial_backoff_ms": 200,
                "max_backoff_ms": 5000, "multiplier": 3, "jitter": 0.2,
                "on": ["timeout", "transient", "rate_limited"], "idempotent": true}},
            "read_file": {"retry": {"on": ["timeout"]}},
            "shell": {"retry": {}}
        });
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        let r = d.tool_policy("srv__search").retry.expect("a policy");
        assert_eq!((r.max_attempts(), r.idempotent), (4, true));
        assert_eq!(
            d.tool_policy("shell").retry,
            Some(crate::tools::RetryPolicy::default())
        );
        assert_eq!(
            d.tool_policy("list_files").retry,
            None,
            "none declared: one attempt"
        );
        let stored = serde_json::to_vec(&d).expect("json");
        assert_eq!(AgentDefinition::parse(&stored).expect("valid"), d);
        for (tool, retry, field) in [
            (
                "srv__search",
                serde_json::json!({"attempts": 0}),
                "policy.srv__search.retry.attempts",
            ),
            (
                "srv__search",
                serde_json::json!({"attempts": 1000}),
                "policy.srv__search.retry.attempts",
            ),
            (
                "srv__search",
                serde_json::json!({"attempts": -2}),
                "policy.srv__search.retry.attempts",
            ),
            (
                "srv__search",
                serde_json::json!({"initial_backoff_ms": -100}),
                "policy.srv__search.retry.initial_backoff_ms",
            ),
            (
                "srv__search",
                serde_json::json!({"max_backoff_ms": 86_400_000}),
                "policy.srv__search.retry.max_backoff_ms",
            ),
            (
                "srv__search",
                serde_json::json!({"multiplier": 0}),
                "policy.srv__search.retry.multiplier",
            ),
            (
                "srv__search",
                serde_json::json!({"jitter": 2}),
                "policy.srv__search.retry.jitter",
            ),
            (
                "srv__search",
                serde_json::json!({"on": ["timeout"]}),
                "policy.srv__search.retry.on",
            ),
            (
                "shell",
                serde_json::json!({"on": ["timeout"]}),
                "policy.shell.retry.on",
            ),
            (
                "shell",
                serde_json::json!({"idempotent": true}),
                "policy.shell.retry.idempotent",
            ),
        ] {
            let mut v = v.clone();
            v["policy"] = serde_json::json!({ tool: {"retry": retry} });
            let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err(field);
            assert_eq!(e.field, field, "{e}");
        }
        // Misspelled fields and classes are refused too.
        v["policy"] = serde_json::json!({"shell": {"retry": {"retries": 3}}});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("unknown field");
        assert!(e.reason.contains("retries"), "{e}");
        v["policy"] = serde_json::json!({"shell": {"retry": {"on": ["flaky"]}}});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("unknown class");
        assert!(e.reason.contains("flaky"), "{e}");
    }
}
