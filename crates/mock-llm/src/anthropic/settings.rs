//! The top-level parameters: no unknown ones, the sampling settings, `tool_choice`, `thinking`,
//! and `cache_control` wherever it marks a block.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// Messages API request parameters; anything else is "Extra inputs are not permitted".
const PARAMS: [&str; 17] = [
    "model",
    "messages",
    "max_tokens",
    "system",
    "stream",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "metadata",
    "thinking",
    "service_tier",
    "container",
    "mcp_servers",
    "context_management",
];

fn check_unit_range(obj: &Map<String, Value>, param: &str) -> Result<Option<f64>, ApiError> {
    match obj.get(param) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            if x > 1.0 {
                Err(ApiError::invalid(format!(
                    "{param}: Input should be less than or equal to 1"
                )))
            } else if x < 0.0 || x.is_nan() {
                Err(ApiError::invalid(format!(
                    "{param}: Input should be greater than or equal to 0"
                )))
            } else {
                Ok(Some(x))
            }
        }
        Some(_) => Err(ApiError::invalid(format!(
            "{param}: Input should be a valid number"
        ))),
    }
}

/// The sampling, tool-choice and thinking parameters. Returns whether thinking is enabled.
///
/// The API's rules (the settings' ones are listed in docs/CONFIG.md "Model settings and price"): no
/// unknown parameter (`seed`, `reasoning_effort`, `parallel_tool_calls` are OpenAI's), temperature
/// and top_p 0–1, `stop_sequences` a list of strings, `tool_choice` one of `auto` / `any` / `tool`
/// (+ `name`, an offered tool) / `none`, `thinking: {type: enabled, budget_tokens ≥ 1024 and <
/// max_tokens}`, no temperature other than 1 with thinking. From Anthropic's extended-thinking
/// documentation: with thinking, top_p ≥ 0.95 and no tool choice that forces tool use; and a
/// `tool_choice` needs `tools`.
pub(super) fn check_settings(obj: &Map<String, Value>) -> Result<bool, ApiError> {
    if let Some(k) = obj.keys().find(|k| !PARAMS.contains(&k.as_str())) {
        return Err(ApiError::invalid(format!(
            "{k}: Extra inputs are not permitted"
        )));
    }
    let temperature = check_unit_range(obj, "temperature")?;
    let top_p = check_unit_range(obj, "top_p")?;
    check_stop_sequences(obj)?;
    let forced = check_tool_choice(obj)?;
    let thinking = check_thinking(obj)?;
    if thinking {
        check_thinking_compatible(temperature, top_p, forced)?;
    }
    Ok(thinking)
}

/// `stop_sequences`: a list of strings.
fn check_stop_sequences(obj: &Map<String, Value>) -> Result<(), ApiError> {
    match obj.get("stop_sequences") {
        None | Some(Value::Null) => {}
        Some(Value::Array(stops)) => {
            for (i, s) in stops.iter().enumerate() {
                if !s.is_string() {
                    return Err(ApiError::invalid(format!(
                        "stop_sequences.{i}: Input should be a valid string"
                    )));
                }
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stop_sequences: Input should be a valid list",
            ));
        }
    }
    Ok(())
}

/// `tool_choice`: one of `auto` / `any` / `tool` (+ `name`, an offered tool) / `none`, with only
/// its own fields, and only with `tools`. Returns whether it forces tool use (`any`, `tool`).
fn check_tool_choice(obj: &Map<String, Value>) -> Result<bool, ApiError> {
    let tool_names: Option<Vec<&str>> = obj.get("tools").and_then(Value::as_array).map(|t| {
        t.iter()
            .filter_map(|t| t.get("name").and_then(Value::as_str))
            .collect()
    });
    let mut forced = false;
    if let Some(choice) = obj.get("tool_choice").filter(|c| !c.is_null()) {
        let Some(c) = choice.as_object() else {
            return Err(ApiError::invalid(
                "tool_choice: Input should be a valid dictionary",
            ));
        };
        let kind = c.get("type").and_then(Value::as_str).unwrap_or_default();
        let allowed: &[&str] = match kind {
            "auto" | "any" => &["type", "disable_parallel_tool_use"],
            "tool" => &["type", "name", "disable_parallel_tool_use"],
            "none" => &["type"],
            _ => {
                return Err(ApiError::invalid(format!(
                    "tool_choice: Input tag '{kind}' found using 'type' does not match any of the \
                     expected tags: 'auto', 'any', 'tool', 'none'"
                )));
            }
        };
        if let Some(k) = c.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(ApiError::invalid(format!(
                "tool_choice.{kind}.{k}: Extra inputs are not permitted"
            )));
        }
        if c.get("disable_parallel_tool_use")
            .is_some_and(|d| !d.is_boolean())
        {
            return Err(ApiError::invalid(format!(
                "tool_choice.{kind}.disable_parallel_tool_use: Input should be a valid boolean"
            )));
        }
        let Some(names) = &tool_names else {
            return Err(ApiError::invalid(
                "tool_choice may only be specified while providing tools",
            ));
        };
        if kind == "tool" {
            let Some(name) = c.get("name").and_then(Value::as_str) else {
                return Err(ApiError::invalid("tool_choice.tool.name: Field required"));
            };
            if !names.contains(&name) {
                return Err(ApiError::invalid(format!(
                    "tool_choice.tool.name: Tool '{name}' not found in provided tools"
                )));
            }
        }
        forced = matches!(kind, "any" | "tool");
    }
    Ok(forced)
}

/// `thinking`: `disabled`, or `enabled` with `budget_tokens` ≥ 1024 and < `max_tokens`. Returns
/// whether thinking is enabled.
fn check_thinking(obj: &Map<String, Value>) -> Result<bool, ApiError> {
    let thinking = match obj.get("thinking") {
        None | Some(Value::Null) => false,
        Some(Value::Object(t)) => match t.get("type").and_then(Value::as_str) {
            Some("disabled") => false,
            Some("enabled") => {
                let budget = match t.get("budget_tokens") {
                    Some(Value::Number(n)) if n.is_u64() || n.is_i64() => {
                        n.as_i64().unwrap_or(i64::MAX)
                    }
                    None | Some(Value::Null) => {
                        return Err(ApiError::invalid(
                            "thinking.enabled.budget_tokens: Field required",
                        ));
                    }
                    Some(_) => {
                        return Err(ApiError::invalid(
                            "thinking.enabled.budget_tokens: Input should be a valid integer",
                        ));
                    }
                };
                if budget < 1024 {
                    return Err(ApiError::invalid(
                        "thinking.enabled.budget_tokens: Input should be greater than or equal to \
                         1024",
                    ));
                }
                let max_tokens = obj.get("max_tokens").and_then(Value::as_i64).unwrap_or(0);
                if max_tokens <= budget {
                    return Err(ApiError::invalid(
                        "`max_tokens` must be greater than `thinking.budget_tokens`. Please \
                         consult our documentation at \
                         https://docs.claude.com/en/docs/build-with-claude/extended-thinking#max-tokens-and-context-window-size",
                    ));
                }
                true
            }
            _ => {
                return Err(ApiError::invalid(
                    "thinking: Input tag found using 'type' does not match any of the expected \
                     tags: 'enabled', 'disabled'",
                ));
            }
        },
        Some(_) => {
            return Err(ApiError::invalid(
                "thinking: Input should be a valid dictionary",
            ));
        }
    };
    Ok(thinking)
}

/// What thinking allows of the other settings (Anthropic's extended-thinking documentation): a
/// temperature of 1, `top_p` ≥ 0.95, and no `tool_choice` that forces tool use.
fn check_thinking_compatible(
    temperature: Option<f64>,
    top_p: Option<f64>,
    forced: bool,
) -> Result<(), ApiError> {
    if temperature.is_some_and(|t| t != 1.0) {
        return Err(ApiError::invalid(
            "`temperature` may only be set to 1 when thinking is enabled. Please consult our \
             documentation at \
             https://docs.claude.com/en/docs/build-with-claude/extended-thinking#feature-compatibility",
        ));
    }
    if top_p.is_some_and(|p| p < 0.95) {
        return Err(ApiError::invalid(
            "`top_p` must be greater than or equal to 0.95 or unset when thinking is enabled. \
             Please consult our documentation at \
             https://docs.claude.com/en/docs/build-with-claude/extended-thinking#feature-compatibility",
        ));
    }
    if forced {
        return Err(ApiError::invalid(
            "Thinking may not be enabled when tool_choice forces tool use.",
        ));
    }
    Ok(())
}

/// `cache_control` is `{"type": "ephemeral"}` (with an optional `ttl` of `5m` or `1h`), on at most
/// 4 blocks in all of `tools`, `system` and `messages` (the API's limit; docs/CONFIG.md "Model
/// settings and price" says which three Kedge marks).
pub(super) fn check_cache_control(obj: &Map<String, Value>) -> Result<(), ApiError> {
    fn mark<'a>(marked: &mut Vec<(String, &'a Value)>, path: String, block: &'a Value) {
        if let Some(c) = block.get("cache_control").filter(|c| !c.is_null()) {
            marked.push((path, c));
        }
    }
    let mut marked: Vec<(String, &Value)> = Vec::new();
    for (i, tool) in obj
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        mark(&mut marked, format!("tools.{i}.custom"), tool);
    }
    for (j, block) in obj
        .get("system")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        mark(&mut marked, format!("system.{j}"), block);
    }
    for (i, message) in obj
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        for (j, block) in message
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let kind = block
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or_default();
            mark(
                &mut marked,
                format!("messages.{i}.content.{j}.{kind}"),
                block,
            );
            for (k, inner) in block
                .get("content")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .enumerate()
            {
                mark(
                    &mut marked,
                    format!("messages.{i}.content.{j}.{kind}.content.{k}"),
                    inner,
                );
            }
        }
    }
    for (path, c) in &marked {
        let Some(c) = c.as_object() else {
            return Err(ApiError::invalid(format!(
                "{path}.cache_control: Input should be a valid dictionary"
            )));
        };
        if c.get("type").and_then(Value::as_str) != Some("ephemeral") {
            return Err(ApiError::invalid(format!(
                "{path}.cache_control.ephemeral.type: Input should be 'ephemeral'"
            )));
        }
        if let Some(k) = c.keys().find(|k| !["type", "ttl"].contains(&k.as_str())) {
            return Err(ApiError::invalid(format!(
                "{path}.cache_control.ephemeral.{k}: Extra inputs are not permitted"
            )));
        }
        if c.get("ttl")
            .is_some_and(|t| !matches!(t.as_str(), Some("5m" | "1h")))
        {
            return Err(ApiError::invalid(format!(
                "{path}.cache_control.ephemeral.ttl: Input should be '5m' or '1h'"
            )));
        }
    }
    if marked.len() > 4 {
        return Err(ApiError::invalid(format!(
            "A maximum of 4 blocks with cache_control may be provided. Found {}.",
            marked.len()
        )));
    }
    Ok(())
}
