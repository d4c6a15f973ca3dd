//! Model settings and prices: what an agent definition sets on every model call (`model.settings`)
//! and what its tokens cost (`model.price`).
//!
//! Both live in the [`ModelSpec`](crate::event::ModelSpec), which `run.created` freezes: a run
//! keeps the settings and the price it started with, whatever later revisions of the agent say.
//! The adapters (`kedge-model`) put the settings in each provider's wire form; [`check`] refuses,
//! when a definition is stored, what the provider would refuse (the providers' documentation;
//! the rules, setting by setting: docs/CONFIG.md "Model settings and price").

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::event::{Provider, Usage};

/// Settings sent with every model call of a run. Each one absent leaves the provider's default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSettings {
    /// Sampling temperature: 0–2 (OpenAI), 0–1 (Anthropic; not with `thinking`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 2))]
    pub temperature: Option<f64>,
    /// Nucleus sampling: 0–1 (with Anthropic `thinking`: 0.95–1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1))]
    pub top_p: Option<f64>,
    /// Stop sequences (non-empty strings; at most 4 for OpenAI). OpenAI `stop`, Anthropic
    /// `stop_sequences`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    /// OpenAI only: best-effort deterministic sampling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Whether and which tool the model must call: `"auto"`, `"none"`, `"required"` (Anthropic
    /// `any`) or `{"tool": "<name>"}` (a declared tool). Needs tools. A forcing choice
    /// (`required`, `tool`) applies to the first step after a user message only; steps that
    /// continue after tool results send `auto`, or the run could never finish.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// `false`: at most one tool call per step (OpenAI `parallel_tool_calls: false`, Anthropic
    /// `tool_choice.disable_parallel_tool_use: true`). Needs tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// OpenAI reasoning models only: `minimal`, `low`, `medium` or `high`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<ReasoningEffort>,
    /// Anthropic only: extended thinking with this token budget (at least 1024, less than
    /// `max_output_tokens`). The thinking blocks of each answer are kept in the run's transcript
    /// and sent back unchanged, as the API requires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<Thinking>,
    /// Anthropic only: prompt caching. `cache_control` marks the system prompt, the last tool
    /// and the conversation so far, so each step of a long run reads the prefix the previous
    /// one wrote. (OpenAI caches long prompts by itself.)
    #[serde(default, skip_serializing_if = "is_false")]
    pub cache: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl ModelSettings {
    pub fn is_empty(&self) -> bool {
        *self == ModelSettings::default()
    }
}

/// Which tool, if any, the model must call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model decides (the providers' default when tools are offered).
    Auto,
    /// The model calls no tool.
    None,
    /// The model calls some tool (Anthropic `any`).
    Required,
    /// The model calls this tool.
    Tool(String),
}

impl ToolChoice {
    /// `required` or a named tool: the model cannot answer without calling one.
    pub fn forces_a_call(&self) -> bool {
        matches!(self, ToolChoice::Required | ToolChoice::Tool(_))
    }
}

/// OpenAI `reasoning_effort`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningEffort {
    Minimal,
    Low,
    Medium,
    High,
}

impl ReasoningEffort {
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningEffort::Minimal => "minimal",
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
        }
    }
}

/// Anthropic extended thinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Thinking {
    /// Tokens the model may think with: at least 1024 and less than `max_output_tokens`.
    #[schemars(range(min = 1024))]
    pub budget_tokens: u32,
}

/// Anthropic's smallest thinking budget.
pub const MIN_THINKING_BUDGET: u32 = 1024;
/// OpenAI's limit on stop sequences.
pub const MAX_STOP_SEQUENCES_OPENAI: usize = 4;

/// What a model's tokens cost, per million.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Price of a million input tokens (Anthropic's cache reads and writes are counted as
    /// input at this price).
    #[schemars(range(min = 0))]
    pub input_per_mtok: f64,
    /// Price of a million output tokens (reasoning and thinking tokens included).
    #[schemars(range(min = 0))]
    pub output_per_mtok: f64,
    /// The currency of both prices and of `budget.max_cost` (default `USD`).
    #[serde(default = "default_currency")]
    pub currency: String,
}

fn default_currency() -> String {
    "USD".to_owned()
}

impl Price {
    /// What `usage` costs at this price.
    pub fn cost(&self, usage: &Usage) -> f64 {
        (usage.input_tokens as f64 * self.input_per_mtok
            + usage.output_tokens as f64 * self.output_per_mtok)
            / 1_000_000.0
    }
}

/// Checks `settings` and `price` for a model of `provider` that may write up to
/// `max_output_tokens` and is offered `tools`. `Err((field, reason))` names the first field at
/// fault, relative to `model.` (`settings.temperature`, `price.currency`, …).
pub fn check(
    provider: Provider,
    settings: &ModelSettings,
    price: Option<&Price>,
    max_output_tokens: u32,
    tools: &[&str],
) -> Result<(), (String, String)> {
    let anthropic = provider == Provider::Anthropic;
    check_sampling(settings, anthropic)?;
    check_provider_only(settings, anthropic)?;
    check_tool_choice(settings, tools)?;
    check_thinking(settings, max_output_tokens)?;
    check_price(price)
}

/// `Err` naming `settings.<field>` and why.
fn err(field: &str, reason: String) -> Result<(), (String, String)> {
    Err((format!("settings.{field}"), reason))
}

/// Temperature and `top_p` within the provider's ranges; stop sequences counted and not empty.
fn check_sampling(s: &ModelSettings, anthropic: bool) -> Result<(), (String, String)> {
    let (t_max, who) = if anthropic {
        (1.0, "Anthropic")
    } else {
        (2.0, "OpenAI")
    };
    if let Some(t) = s.temperature
        && !(t.is_finite() && (0.0..=t_max).contains(&t))
    {
        return err("temperature", format!("{t} is outside 0..={t_max} ({who})"));
    }
    if let Some(p) = s.top_p
        && !(p.is_finite() && (0.0..=1.0).contains(&p))
    {
        return err("top_p", format!("{p} is outside 0..=1"));
    }
    if !anthropic && s.stop.len() > MAX_STOP_SEQUENCES_OPENAI {
        return err(
            "stop",
            format!(
                "{} stop sequences; OpenAI takes at most {MAX_STOP_SEQUENCES_OPENAI}",
                s.stop.len()
            ),
        );
    }
    if let Some(i) = s.stop.iter().position(String::is_empty) {
        return err(&format!("stop[{i}]"), "must not be empty".into());
    }
    Ok(())
}

/// Settings only one of the providers has.
fn check_provider_only(s: &ModelSettings, anthropic: bool) -> Result<(), (String, String)> {
    let openai_only = [
        ("seed", s.seed.is_some()),
        ("reasoning_effort", s.reasoning_effort.is_some()),
    ];
    let anthropic_only = [("thinking", s.thinking.is_some()), ("cache", s.cache)];
    for (field, set) in openai_only {
        if set && anthropic {
            return err(
                field,
                "OpenAI only: Anthropic's API has no such setting".into(),
            );
        }
    }
    for (field, set) in anthropic_only {
        if set && !anthropic {
            return err(field, "Anthropic only".into());
        }
    }
    Ok(())
}

/// `tool_choice` and `parallel_tool_calls` need tools, and a chosen tool must be one of them.
fn check_tool_choice(s: &ModelSettings, tools: &[&str]) -> Result<(), (String, String)> {
    if tools.is_empty() {
        // OpenAI: "'tool_choice' is only allowed when 'tools' are specified" (and the same for
        // `parallel_tool_calls`); Anthropic's equivalents live in `tool_choice`.
        if s.tool_choice.is_some() {
            return err("tool_choice", "needs tools: the agent declares none".into());
        }
        if s.parallel_tool_calls.is_some() {
            return err(
                "parallel_tool_calls",
                "needs tools: the agent declares none".into(),
            );
        }
    }
    if let Some(ToolChoice::Tool(name)) = &s.tool_choice
        && !tools.contains(&name.as_str())
    {
        return err(
            "tool_choice",
            format!("`{name}` is not a tool of this agent"),
        );
    }
    Ok(())
}

/// Extended thinking (Anthropic): its budget and the settings it rules out.
fn check_thinking(s: &ModelSettings, max_output_tokens: u32) -> Result<(), (String, String)> {
    if let Some(thinking) = s.thinking {
        // Anthropic's documented limits for extended thinking: a budget of at
        // least 1024 and below `max_tokens`; no temperature, top_p only from 0.95, and no
        // tool choice that forces tool use.
        if thinking.budget_tokens < MIN_THINKING_BUDGET {
            return err(
                "thinking.budget_tokens",
                format!(
                    "{} is below Anthropic's minimum of {MIN_THINKING_BUDGET}",
                    thinking.budget_tokens
                ),
            );
        }
        if thinking.budget_tokens >= max_output_tokens {
            return err(
                "thinking.budget_tokens",
                format!(
                    "{} must be less than max_output_tokens ({max_output_tokens})",
                    thinking.budget_tokens
                ),
            );
        }
        if s.temperature.is_some() {
            return err(
                "temperature",
                "not allowed with thinking (Anthropic)".into(),
            );
        }
        if s.top_p.is_some_and(|p| p < 0.95) {
            return err(
                "top_p",
                "with thinking, must be 0.95..=1 (Anthropic)".into(),
            );
        }
        if s.tool_choice
            .as_ref()
            .is_some_and(ToolChoice::forces_a_call)
        {
            return err(
                "tool_choice",
                "thinking cannot be used with a tool choice that forces tool use (Anthropic)"
                    .into(),
            );
        }
    }
    Ok(())
}

/// A price per million tokens that is a number ≥ 0, in a currency code.
fn check_price(price: Option<&Price>) -> Result<(), (String, String)> {
    if let Some(p) = price {
        for (field, v) in [
            ("input_per_mtok", p.input_per_mtok),
            ("output_per_mtok", p.output_per_mtok),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err((
                    format!("price.{field}"),
                    format!("{v} must be a number ≥ 0"),
                ));
            }
        }
        let c = &p.currency;
        if c.is_empty() || c.len() > 16 || !c.chars().all(|ch| ch.is_ascii_alphanumeric()) {
            return Err((
                "price.currency".into(),
                "must be 1 to 16 letters or digits (an ISO 4217 code such as USD)".into(),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_is_per_million_tokens() {
        let p = Price {
            input_per_mtok: 2.0,
            output_per_mtok: 8.0,
            currency: "USD".into(),
        };
        let u = Usage {
            input_tokens: 1_000_000,
            output_tokens: 500_000,
            cost: None,
        };
        assert_eq!(p.cost(&u), 6.0);
    }

    #[test]
    fn settings_round_trip_and_tool_choice_forms() {
        let s: ModelSettings = serde_json::from_value(serde_json::json!({
            "temperature": 0.2, "tool_choice": {"tool": "read_file"}, "stop": ["END"]
        }))
        .expect("valid");
        assert_eq!(s.tool_choice, Some(ToolChoice::Tool("read_file".into())));
        let back = serde_json::to_value(&s).expect("json");
        assert_eq!(
            back["tool_choice"],
            serde_json::json!({"tool": "read_file"})
        );
        let s: ModelSettings =
            serde_json::from_value(serde_json::json!({"tool_choice": "required"})).expect("valid");
        assert!(s.tool_choice.expect("set").forces_a_call());
        assert!(serde_json::from_value::<ModelSettings>(serde_json::json!({"temp": 1})).is_err());
        assert!(ModelSettings::default().is_empty());
    }
}
