//! Anthropic Messages (`POST /v1/messages`): what it rejects, what it answers.
//!
//! Validation follows the real API's order: first each message's own shape (the schema, with
//! the original message indices), then consecutive same-role turns are merged (the current API
//! merges rather than rejects them), then tool use is checked across the merged turns: every
//! `tool_use` answered by a `tool_result` at the start of the next (user) message, and every
//! `tool_result` answering a `tool_use` of the message right before it. A final assistant
//! message is a prefill: it is allowed to be empty, and it is not an assistant turn of its own.

use axum::http::{HeaderMap, StatusCode};
use serde_json::{Map, Value, json};

use crate::error::{ApiError, ErrorClass};
use crate::reply::{Output, Parsed, pieces, sse, thinking_signature};
use crate::script::{Cue, valid_tool_name};

const BLOCK_TYPES: [&str; 11] = [
    "text",
    "image",
    "document",
    "search_result",
    "thinking",
    "redacted_thinking",
    "tool_use",
    "tool_result",
    "server_tool_use",
    "web_search_tool_result",
    "container_upload",
];

/// 401 without `x-api-key`.
pub(crate) fn check_auth(headers: &HeaderMap) -> Result<(), ApiError> {
    let ok = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|key| !key.trim().is_empty());
    if ok {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            ErrorClass::Authentication,
            "x-api-key header is required",
        ))
    }
}

/// 400 without `anthropic-version`.
pub(crate) fn check_version(headers: &HeaderMap) -> Result<(), ApiError> {
    let ok = headers
        .get("anthropic-version")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| !v.trim().is_empty());
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid("anthropic-version: header is required"))
    }
}

pub(crate) fn unparsable_body() -> ApiError {
    ApiError::invalid("There was an error parsing the body of your request: invalid JSON")
}

pub(crate) fn model_not_found(model: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        ErrorClass::NotFound,
        format!("model: {model}"),
    )
}

fn invalid_id(id: &Value) -> bool {
    !id.as_str().is_some_and(|s| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    })
}

fn id_pattern(path: &str) -> ApiError {
    ApiError::invalid(format!(
        "{path}: String should match pattern '^[a-zA-Z0-9_-]+$'"
    ))
}

/// A text block's `text`: present, a string, not empty, not only whitespace.
fn check_text_block(where_: &str, path: &str, block: &Map<String, Value>) -> Result<(), ApiError> {
    match block.get("text") {
        None | Some(Value::Null) => Err(ApiError::invalid(format!("{path}.text: Field required"))),
        Some(Value::String(s)) if s.is_empty() => Err(ApiError::invalid(format!(
            "{where_}: text content blocks must be non-empty"
        ))),
        Some(Value::String(s)) if s.trim().is_empty() => Err(ApiError::invalid(format!(
            "{where_}: text content blocks must contain non-whitespace text"
        ))),
        Some(Value::String(_)) => Ok(()),
        Some(_) => Err(ApiError::invalid(format!(
            "{path}.text: Input should be a valid string"
        ))),
    }
}

fn block_type<'a>(
    path: &str,
    block: &'a Value,
) -> Result<(&'a Map<String, Value>, &'a str), ApiError> {
    let Some(obj) = block.as_object() else {
        return Err(ApiError::invalid(format!(
            "{path}: Input should be a valid dictionary or object to extract fields from"
        )));
    };
    match obj.get("type").and_then(Value::as_str) {
        Some(t) => Ok((obj, t)),
        None => Err(ApiError::invalid(format!(
            "{path}: Unable to extract tag using discriminator 'type'"
        ))),
    }
}

/// One content block of message `i` (original index), in a message of `role`.
fn check_block(i: usize, j: usize, role: &str, block: &Value) -> Result<(), ApiError> {
    let path = format!("messages.{i}.content.{j}");
    let (obj, kind) = block_type(&path, block)?;
    if !BLOCK_TYPES.contains(&kind) {
        let expected = BLOCK_TYPES
            .iter()
            .map(|t| format!("'{t}'"))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(ApiError::invalid(format!(
            "{path}: Input tag '{kind}' found using 'type' does not match any of the expected \
             tags: {expected}"
        )));
    }
    match kind {
        "text" => check_text_block("messages", &format!("{path}.text"), obj)?,
        "tool_use" => {
            if role != "assistant" {
                return Err(ApiError::invalid(format!(
                    "{path}: `tool_use` blocks can only be in `assistant` messages"
                )));
            }
            match obj.get("id") {
                None | Some(Value::Null) => {
                    return Err(ApiError::invalid(format!(
                        "{path}.tool_use.id: Field required"
                    )));
                }
                Some(id) if invalid_id(id) => {
                    return Err(id_pattern(&format!("{path}.tool_use.id")));
                }
                Some(_) => {}
            }
            if !obj.get("name").is_some_and(Value::is_string) {
                return Err(ApiError::invalid(format!(
                    "{path}.tool_use.name: Field required"
                )));
            }
            if !obj.get("input").is_some_and(Value::is_object) {
                return Err(ApiError::invalid(format!(
                    "{path}.tool_use.input: Input should be a valid dictionary"
                )));
            }
        }
        "thinking" | "redacted_thinking" => {
            if role != "assistant" {
                return Err(ApiError::invalid(format!(
                    "{path}: `{kind}` blocks can only be in `assistant` messages"
                )));
            }
            let fields: &[&str] = if kind == "thinking" {
                &["thinking", "signature"]
            } else {
                &["data"]
            };
            for f in fields {
                if !obj.get(*f).is_some_and(Value::is_string) {
                    return Err(ApiError::invalid(format!(
                        "{path}.{kind}.{f}: Field required"
                    )));
                }
            }
            if obj.contains_key("cache_control") {
                // Thinking blocks cannot be marked for caching (Anthropic's documentation).
                return Err(ApiError::invalid(format!(
                    "{path}.{kind}.cache_control: Extra inputs are not permitted"
                )));
            }
        }
        "tool_result" => {
            if role != "user" {
                return Err(ApiError::invalid(format!(
                    "{path}: `tool_result` blocks can only be in `user` messages"
                )));
            }
            match obj.get("tool_use_id") {
                None | Some(Value::Null) => {
                    return Err(ApiError::invalid(format!(
                        "{path}.tool_result.tool_use_id: Field required"
                    )));
                }
                Some(id) if invalid_id(id) => {
                    return Err(id_pattern(&format!("{path}.tool_result.tool_use_id")));
                }
                Some(_) => {}
            }
            match obj.get("content") {
                None | Some(Value::Null) | Some(Value::String(_)) => {}
                Some(Value::Array(inner)) => {
                    for (k, b) in inner.iter().enumerate() {
                        let inner_path = format!("{path}.tool_result.content.{k}");
                        let (inner_obj, inner_kind) = block_type(&inner_path, b)?;
                        if inner_kind == "text" {
                            check_text_block("messages", &format!("{inner_path}.text"), inner_obj)?;
                        }
                    }
                }
                Some(_) => {
                    return Err(ApiError::invalid(format!(
                        "{path}.tool_result.content: Input should be a valid list"
                    )));
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// A message after validation of its own shape: role and content as blocks.
struct Turn {
    role: &'static str,
    blocks: Vec<Value>,
}

/// Pass 1 for message `i`: its shape. Returns it as a [`Turn`].
fn check_message(i: usize, is_last: bool, message: &Value) -> Result<Turn, ApiError> {
    let Some(obj) = message.as_object() else {
        return Err(ApiError::invalid(format!(
            "messages.{i}: Input should be a valid dictionary"
        )));
    };
    let role = match obj.get("role").and_then(Value::as_str) {
        Some("user") => "user",
        Some("assistant") => "assistant",
        Some("system") => {
            return Err(ApiError::invalid(
                "messages: Unexpected role \"system\". The Messages API accepts a top-level \
                 `system` parameter, not \"system\" as an input message role.",
            ));
        }
        None if obj.get("role").is_none_or(Value::is_null) => {
            return Err(ApiError::invalid(format!(
                "messages.{i}.role: Field required"
            )));
        }
        _ => {
            return Err(ApiError::invalid(format!(
                "messages.{i}.role: Input should be 'user' or 'assistant'"
            )));
        }
    };
    let blocks = match obj.get("content") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(format!(
                "messages.{i}.content: Field required"
            )));
        }
        Some(Value::String(s)) => {
            if s.is_empty() {
                Vec::new()
            } else {
                vec![json!({"type": "text", "text": s})]
            }
        }
        Some(Value::Array(blocks)) => {
            for (j, block) in blocks.iter().enumerate() {
                check_block(i, j, role, block)?;
            }
            blocks.clone()
        }
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "messages.{i}.content: Input should be a valid list"
            )));
        }
    };
    let prefill = is_last && role == "assistant";
    if blocks.is_empty() && !prefill {
        return Err(ApiError::invalid(format!(
            "messages.{i}: all messages must have non-empty content except for the optional \
             final assistant message"
        )));
    }
    if prefill {
        let ends_in_whitespace = blocks
            .last()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
            .and_then(|b| b.get("text").and_then(Value::as_str))
            .is_some_and(|t| t.ends_with(char::is_whitespace));
        if ends_in_whitespace {
            return Err(ApiError::invalid(
                "messages: final assistant content cannot end with trailing whitespace",
            ));
        }
    }
    Ok(Turn { role, blocks })
}

/// Consecutive same-role messages become one turn.
fn merge(turns: Vec<Turn>) -> Vec<Turn> {
    let mut merged: Vec<Turn> = Vec::with_capacity(turns.len());
    for turn in turns {
        match merged.last_mut() {
            Some(last) if last.role == turn.role => last.blocks.extend(turn.blocks),
            _ => merged.push(turn),
        }
    }
    merged
}

fn of_type<'a>(blocks: &'a [Value], kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    blocks
        .iter()
        .filter(move |b| b.get("type").and_then(Value::as_str) == Some(kind))
}

fn tool_use_ids(turn: &Turn) -> Vec<&str> {
    of_type(&turn.blocks, "tool_use")
        .filter_map(|b| b.get("id").and_then(Value::as_str))
        .collect()
}

/// Pass 2, over merged turns (indices are the merged ones).
fn check_tool_use(turns: &[Turn]) -> Result<(), ApiError> {
    for (k, turn) in turns.iter().enumerate() {
        if turn.role == "assistant" {
            let ids = tool_use_ids(turn);
            if ids.is_empty() {
                continue;
            }
            // Only the tool_result blocks at the start of the next user message count.
            let answered: Vec<&str> = turns
                .get(k + 1)
                .filter(|next| next.role == "user")
                .map(|next| {
                    next.blocks
                        .iter()
                        .take_while(|b| {
                            b.get("type").and_then(Value::as_str) == Some("tool_result")
                        })
                        .filter_map(|b| b.get("tool_use_id").and_then(Value::as_str))
                        .collect()
                })
                .unwrap_or_default();
            let missing: Vec<&str> = ids
                .into_iter()
                .filter(|id| !answered.contains(id))
                .collect();
            if !missing.is_empty() {
                return Err(ApiError::invalid(format!(
                    "messages.{}: `tool_use` ids were found without `tool_result` blocks \
                     immediately after: {}. Each `tool_use` block must have a corresponding \
                     `tool_result` block in the next message.",
                    k + 1,
                    missing.join(", ")
                )));
            }
        } else {
            let previous: Vec<&str> = k
                .checked_sub(1)
                .map(|p| tool_use_ids(&turns[p]))
                .unwrap_or_default();
            for (j, block) in turn.blocks.iter().enumerate() {
                if block.get("type").and_then(Value::as_str) != Some("tool_result") {
                    continue;
                }
                let id = block
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                if !previous.contains(&id) {
                    return Err(ApiError::invalid(format!(
                        "messages.{k}.content.{j}: unexpected `tool_use_id` found in \
                         `tool_result` blocks: {id}. Each `tool_result` block must have a \
                         corresponding `tool_use` block in the previous message."
                    )));
                }
            }
        }
    }
    Ok(())
}

fn check_system(system: &Value) -> Result<(), ApiError> {
    match system {
        Value::String(_) => Ok(()),
        Value::Array(blocks) => {
            for (j, block) in blocks.iter().enumerate() {
                let path = format!("system.{j}");
                let (obj, kind) = block_type(&path, block)?;
                if kind != "text" {
                    return Err(ApiError::invalid(format!(
                        "{path}: Input tag '{kind}' found using 'type' does not match any of the \
                         expected tags: 'text'"
                    )));
                }
                check_text_block("system", &format!("{path}.text"), obj)?;
            }
            Ok(())
        }
        _ => Err(ApiError::invalid("system: Input should be a valid list")),
    }
}

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
fn check_settings(obj: &Map<String, Value>) -> Result<bool, ApiError> {
    if let Some(k) = obj.keys().find(|k| !PARAMS.contains(&k.as_str())) {
        return Err(ApiError::invalid(format!(
            "{k}: Extra inputs are not permitted"
        )));
    }
    let temperature = check_unit_range(obj, "temperature")?;
    let top_p = check_unit_range(obj, "top_p")?;
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
    if thinking {
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
    }
    Ok(thinking)
}

/// `cache_control` is `{"type": "ephemeral"}` (with an optional `ttl` of `5m` or `1h`), on at most
/// 4 blocks in all of `tools`, `system` and `messages` (the API's limit; docs/CONFIG.md "Model
/// settings and price" says which three Kedge marks).
fn check_cache_control(obj: &Map<String, Value>) -> Result<(), ApiError> {
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

/// Every `thinking` block carries the signature the mock gave it: a block that was changed (or
/// made up) is refused, as the real API refuses a thinking block whose signature does not match.
fn check_signatures(messages: &[Value]) -> Result<(), ApiError> {
    for (i, message) in messages.iter().enumerate() {
        for (j, block) in message
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            if block.get("type").and_then(Value::as_str) != Some("thinking") {
                continue;
            }
            let text = block
                .get("thinking")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let signature = block
                .get("signature")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if signature != thinking_signature(text) {
                return Err(ApiError::invalid(format!(
                    "messages.{i}.content.{j}: Invalid `signature` in `thinking` block"
                )));
            }
        }
    }
    Ok(())
}

/// With thinking on, the assistant turn whose tool use the conversation is continuing (the last
/// assistant turn, when the last user turn starts with `tool_result` blocks) must start with its
/// thinking block, passed back unchanged (Anthropic's documentation; docs/CONFIG.md "Model settings
/// and price", "Extended thinking").
fn check_thinking_kept(turns: &[Turn]) -> Result<(), ApiError> {
    let Some(last_user) = turns.iter().rposition(|t| t.role == "user") else {
        return Ok(());
    };
    let continues_tool_use = turns[last_user]
        .blocks
        .first()
        .and_then(|b| b.get("type"))
        .and_then(Value::as_str)
        == Some("tool_result");
    let Some(k) = last_user.checked_sub(1) else {
        return Ok(());
    };
    if !continues_tool_use || turns[k].role != "assistant" {
        return Ok(());
    }
    let first = turns[k]
        .blocks
        .first()
        .and_then(|b| b.get("type"))
        .and_then(Value::as_str)
        .unwrap_or_default();
    if matches!(first, "thinking" | "redacted_thinking") {
        return Ok(());
    }
    Err(ApiError::invalid(format!(
        "messages.{k}.content.0.type: Expected `thinking` or `redacted_thinking`, but found \
         `{first}`. When `thinking` is enabled, a final `assistant` message must start with a \
         thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks). We \
         recommend you include thinking blocks from previous turns. To avoid this requirement, \
         disable `thinking`. Please consult our documentation at \
         https://docs.claude.com/en/docs/build-with-claude/extended-thinking"
    )))
}

fn check_tools(tools: &Value) -> Result<(), ApiError> {
    let Some(tools) = tools.as_array() else {
        return Err(ApiError::invalid("tools: Input should be a valid list"));
    };
    for (i, tool) in tools.iter().enumerate() {
        let Some(obj) = tool.as_object() else {
            return Err(ApiError::invalid(format!(
                "tools.{i}: Input should be a valid dictionary"
            )));
        };
        // Server tools (`"type": "web_search_20250305"`, …) have their own shapes.
        if obj
            .get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| t != "custom")
        {
            continue;
        }
        match obj.get("name") {
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.name: Field required"
                )));
            }
            Some(Value::String(name)) if valid_tool_name(name) => {}
            Some(_) => {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.name: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'"
                )));
            }
        }
        for key in obj.keys() {
            if !matches!(
                key.as_str(),
                "type" | "name" | "description" | "input_schema" | "cache_control"
            ) {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.{key}: Extra inputs are not permitted"
                )));
            }
        }
        if obj
            .get("description")
            .is_some_and(|d| !d.is_string() && !d.is_null())
        {
            return Err(ApiError::invalid(format!(
                "tools.{i}.custom.description: Input should be a valid string"
            )));
        }
        let schema = match obj.get("input_schema") {
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.input_schema: Field required"
                )));
            }
            Some(Value::Object(schema)) => schema,
            Some(_) => {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.input_schema: Input should be a valid dictionary"
                )));
            }
        };
        match schema.get("type") {
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.input_schema.type: Field required"
                )));
            }
            Some(Value::String(t)) if t == "object" => {}
            Some(_) => {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.input_schema.type: Input should be 'object'"
                )));
            }
        }
        if jsonschema::meta::validate(&Value::Object(schema.clone())).is_err() {
            return Err(ApiError::invalid(format!(
                "tools.{i}.custom.input_schema: JSON schema is invalid. It must match JSON Schema \
                 draft 2020-12 (https://json-schema.org/draft/2020-12). Learn more about tool use \
                 at https://docs.claude.com/en/docs/tool-use."
            )));
        }
    }
    let mut names: Vec<&str> = tools
        .iter()
        .filter_map(|t| t.get("name").and_then(Value::as_str))
        .collect();
    names.sort_unstable();
    if names.windows(2).any(|w| w[0] == w[1]) {
        return Err(ApiError::invalid("tools: Tool names must be unique."));
    }
    Ok(())
}

/// Validates a request body as the real API would, and summarises it for the script.
pub(crate) fn validate(body: &Value) -> Result<Parsed, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(ApiError::invalid(
            "body: Input should be a valid dictionary",
        ));
    };
    let model = match obj.get("model") {
        None | Some(Value::Null) => return Err(ApiError::invalid("model: Field required")),
        Some(Value::String(m)) => m.clone(),
        Some(_) => return Err(ApiError::invalid("model: Input should be a valid string")),
    };
    let messages = match obj.get("messages") {
        None | Some(Value::Null) => return Err(ApiError::invalid("messages: Field required")),
        Some(Value::Array(m)) => m,
        Some(_) => return Err(ApiError::invalid("messages: Input should be a valid list")),
    };
    match obj.get("max_tokens") {
        None | Some(Value::Null) => return Err(ApiError::invalid("max_tokens: Field required")),
        Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n >= 1) => {}
        Some(Value::Number(n)) if n.as_i64().is_some() => {
            return Err(ApiError::invalid(
                "max_tokens: Input should be greater than or equal to 1",
            ));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "max_tokens: Input should be a valid integer",
            ));
        }
    }
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::invalid("stream: Input should be a valid boolean")),
    };
    let system = obj.get("system").filter(|s| !s.is_null());
    if let Some(system) = system {
        check_system(system)?;
    }
    if let Some(tools) = obj.get("tools").filter(|t| !t.is_null()) {
        check_tools(tools)?;
    }
    let thinking = check_settings(obj)?;
    check_cache_control(obj)?;
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages: at least one message is required",
        ));
    }
    let last = messages.len() - 1;
    let turns = messages
        .iter()
        .enumerate()
        .map(|(i, m)| check_message(i, i == last, m))
        .collect::<Result<Vec<Turn>, ApiError>>()?;
    let turns = merge(turns);
    check_tool_use(&turns)?;
    check_signatures(messages)?;
    if thinking {
        check_thinking_kept(&turns)?;
    }

    let input_chars =
        crate::reply::json_chars(messages) + system.map_or(0, crate::reply::json_chars);
    Ok(Parsed {
        model,
        stream,
        include_usage: false,
        thinking,
        cue: cue(&turns),
        input_chars,
    })
}

fn cue(turns: &[Turn]) -> Cue {
    let prefill = turns.last().is_some_and(|t| t.role == "assistant");
    let assistant_turns =
        turns.iter().filter(|t| t.role == "assistant").count() - usize::from(prefill);
    let Some(last_user) = turns.iter().rev().find(|t| t.role == "user") else {
        return Cue {
            assistant_turns,
            ..Cue::default()
        };
    };
    let texts: Vec<&str> = of_type(&last_user.blocks, "text")
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .collect();
    let last_tool_results = of_type(&last_user.blocks, "tool_result")
        .map(|b| match b.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(inner)) => of_type(inner, "text")
                .filter_map(|t| t.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        })
        .collect();
    Cue {
        assistant_turns,
        last_user_text: (!texts.is_empty()).then(|| texts.join("\n")),
        last_tool_results,
    }
}

fn stop_reason(out: &Output) -> &'static str {
    if out.calls.is_empty() {
        "end_turn"
    } else {
        "tool_use"
    }
}

fn content(out: &Output) -> Vec<Value> {
    let mut blocks = Vec::with_capacity(out.calls.len() + 2);
    if let Some(thinking) = &out.thinking {
        blocks.push(json!({"type": "thinking", "thinking": thinking,
                           "signature": thinking_signature(thinking)}));
    }
    if let Some(text) = &out.text {
        blocks.push(json!({"type": "text", "text": text}));
    }
    for call in &out.calls {
        blocks.push(
            json!({"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}),
        );
    }
    blocks
}

/// The non-streaming `message` body.
pub(crate) fn message(out: &Output) -> Value {
    json!({
        "id": out.id,
        "type": "message",
        "role": "assistant",
        "model": out.model,
        "content": content(out),
        "stop_reason": stop_reason(out),
        "stop_sequence": null,
        "usage": { "input_tokens": out.input_tokens, "output_tokens": out.output_tokens },
    })
}

/// The SSE events of a streamed answer, `message_stop` included.
pub(crate) fn stream_frames(out: &Output) -> Vec<String> {
    let event = |name: &str, data: Value| sse(Some(name), &data.to_string());
    let mut frames = vec![
        event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": out.id, "type": "message", "role": "assistant", "model": out.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": { "input_tokens": out.input_tokens, "output_tokens": 1 },
            }}),
        ),
        event("ping", json!({"type": "ping"})),
    ];
    let mut index = 0;
    if let Some(thinking) = &out.thinking {
        frames.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        ));
        for piece in pieces(thinking) {
            frames.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "thinking_delta", "thinking": piece}}),
            ));
        }
        frames.push(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
                   "delta": {"type": "signature_delta", "signature": thinking_signature(thinking)}}),
        ));
        frames.push(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
        index += 1;
    }
    if let Some(text) = &out.text {
        frames.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "text", "text": ""}}),
        ));
        for piece in pieces(text) {
            frames.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "text_delta", "text": piece}}),
            ));
        }
        frames.push(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
        index += 1;
    }
    for call in &out.calls {
        frames.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}}),
        ));
        for piece in pieces(&call.arguments) {
            frames.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": piece}}),
            ));
        }
        frames.push(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
        index += 1;
    }
    frames.push(event(
        "message_delta",
        json!({"type": "message_delta",
               "delta": {"stop_reason": stop_reason(out), "stop_sequence": null},
               "usage": {"output_tokens": out.output_tokens}}),
    ));
    frames.push(event("message_stop", json!({"type": "message_stop"})));
    frames
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(messages: Value) -> Value {
        json!({"model": "m", "max_tokens": 100, "messages": messages})
    }
    fn rejected(body: &Value) -> String {
        match validate(body) {
            Ok(p) => panic!("accepted: {p:?}"),
            Err(e) => {
                assert_eq!(e.status, StatusCode::BAD_REQUEST);
                assert_eq!(e.class, ErrorClass::InvalidRequest);
                e.message
            }
        }
    }
    fn tool_use(id: &str) -> Value {
        json!({"type": "tool_use", "id": id, "name": "read_file", "input": {"path": "a"}})
    }
    fn tool_result(id: &str) -> Value {
        json!({"type": "tool_result", "tool_use_id": id, "content": "contents"})
    }

    #[test]
    fn settings_are_checked_as_the_real_api_checks_them() {
        let tools = json!([{"name": "read_file", "input_schema": {"type": "object"}}]);
        let with = |extra: Value| {
            let mut b = body(json!([{"role": "user", "content": "go"}]));
            for (k, v) in extra.as_object().expect("object") {
                b[k] = v.clone();
            }
            b
        };
        validate(&with(json!({
            "tools": tools, "tool_choice": {"type": "tool", "name": "read_file", "disable_parallel_tool_use": true},
            "temperature": 1, "top_p": 0.5, "stop_sequences": ["END"],
        })))
        .expect("valid settings");
        let p = validate(&with(json!({
            "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "temperature": 1, "top_p": 0.95, "tools": tools, "tool_choice": {"type": "auto"},
        })))
        .expect("thinking with what it allows");
        assert!(p.thinking);
        for (extra, words) in [
            (json!({"seed": 1}), "seed: Extra inputs are not permitted"),
            (
                json!({"reasoning_effort": "low"}),
                "reasoning_effort: Extra inputs",
            ),
            (
                json!({"temperature": 1.5}),
                "temperature: Input should be less than or equal to 1",
            ),
            (
                json!({"top_p": -1}),
                "top_p: Input should be greater than or equal to 0",
            ),
            (
                json!({"stop_sequences": "END"}),
                "stop_sequences: Input should be a valid list",
            ),
            (
                json!({"tool_choice": {"type": "auto"}}),
                "tool_choice may only be specified while providing tools",
            ),
            (
                json!({"tools": tools, "tool_choice": {"type": "required"}}),
                "does not match any of the expected tags",
            ),
            (
                json!({"tools": tools, "tool_choice": {"type": "tool", "name": "shell"}}),
                "Tool 'shell' not found",
            ),
            (
                json!({"tools": tools, "tool_choice": {"type": "none", "disable_parallel_tool_use": true}}),
                "Extra inputs",
            ),
            (
                json!({"thinking": {"type": "enabled", "budget_tokens": 1000}}),
                "greater than or equal to 1024",
            ),
            (
                json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}),
                "`max_tokens` must be greater than `thinking.budget_tokens`",
            ),
            (
                json!({"max_tokens": 2000, "temperature": 0.5, "thinking": {"type": "enabled", "budget_tokens": 1024}}),
                "`temperature` may only be set to 1",
            ),
            (
                json!({"max_tokens": 2000, "top_p": 0.5, "thinking": {"type": "enabled", "budget_tokens": 1024}}),
                "`top_p` must be greater than or equal to 0.95",
            ),
            (
                json!({"max_tokens": 2000, "tools": tools, "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 1024}}),
                "Thinking may not be enabled when tool_choice forces tool use",
            ),
        ] {
            let m = rejected(&with(extra.clone()));
            assert!(m.contains(words), "{extra}: {m}");
        }
    }

    #[test]
    fn cache_control_is_ephemeral_on_at_most_four_blocks() {
        let cc = json!({"type": "ephemeral"});
        let b = json!({"model": "m", "max_tokens": 100,
            "system": [{"type": "text", "text": "be brief", "cache_control": cc}],
            "tools": [{"name": "a", "input_schema": {"type": "object"}, "cache_control": cc}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "one", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                {"type": "text", "text": "two", "cache_control": cc}]}]});
        validate(&b).expect("four breakpoints");
        let mut five = b.clone();
        five["messages"][0]["content"]
            .as_array_mut()
            .expect("blocks")
            .push(json!({"type": "text", "text": "three", "cache_control": cc}));
        assert_eq!(
            rejected(&five),
            "A maximum of 4 blocks with cache_control may be provided. Found 5."
        );
        let mut wrong = b.clone();
        wrong["system"][0]["cache_control"] = json!({"type": "persistent"});
        assert!(rejected(&wrong).contains("Input should be 'ephemeral'"));
    }

    #[test]
    fn thinking_blocks_must_come_back_signed_and_first_in_a_tool_use_turn() {
        let thought = "Step 1: deciding how to answer.";
        let thinking = json!({"type": "thinking", "thinking": thought, "signature": thinking_signature(thought)});
        let request = |assistant: Vec<Value>| {
            json!({"model": "m", "max_tokens": 2000,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "tools": [{"name": "read_file", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": assistant},
                {"role": "user", "content": [tool_result("toolu_1")]},
            ]})
        };
        validate(&request(vec![thinking.clone(), tool_use("toolu_1")])).expect("kept");
        let m = rejected(&request(vec![tool_use("toolu_1")]));
        assert!(
            m.starts_with("messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found `tool_use`"),
            "{m}"
        );
        let mut changed = thinking.clone();
        changed["thinking"] = "Something else.".into();
        assert_eq!(
            rejected(&request(vec![changed, tool_use("toolu_1")])),
            "messages.1.content.0: Invalid `signature` in `thinking` block"
        );
        // Without thinking enabled, an earlier turn's blocks may still be sent (signed).
        let mut off = request(vec![thinking, tool_use("toolu_1")]);
        off.as_object_mut().expect("object").remove("thinking");
        validate(&off).expect("thinking blocks without thinking enabled");
        // The answer to a thinking request starts with a signed thinking block.
        let p = validate(&request(vec![
            json!({"type": "thinking", "thinking": thought, "signature": thinking_signature(thought)}),
            tool_use("toolu_1"),
        ]))
        .expect("valid");
        let out = Output::generate(
            crate::error::Provider::Anthropic,
            &p,
            &crate::script::Response::plain_ok(),
        );
        let content = message(&out)["content"].clone();
        assert_eq!(content[0]["type"], "thinking");
        assert_eq!(
            content[0]["signature"],
            thinking_signature(content[0]["thinking"].as_str().expect("text")).as_str()
        );
        let frames = stream_frames(&out).concat();
        assert!(frames.contains("thinking_delta") && frames.contains("signature_delta"));
    }

    #[test]
    fn accepts_a_multi_step_conversation_with_parallel_tool_calls() {
        let b = json!({"model": "m", "max_tokens": 100, "system": "be brief", "messages": [
            {"role": "user", "content": "list and read"},
            {"role": "assistant", "content": [tool_use("toolu_1"), tool_use("toolu_2")]},
            {"role": "user", "content": [tool_result("toolu_2"), tool_result("toolu_1"),
                                         {"type": "text", "text": "both done"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me ask."},
                {"type": "tool_use", "id": "toolu_3", "name": "ask_user", "input": {"question": "Proceed?"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3",
                                          "content": [{"type": "text", "text": "yes"}]}]},
            {"role": "assistant", "content": "All done."},
            {"role": "user", "content": "thanks"},
        ]});
        let p = validate(&b).expect("valid");
        assert_eq!(p.cue.assistant_turns, 3);
        assert_eq!(p.cue.last_user_text.as_deref(), Some("thanks"));
    }

    #[test]
    fn merges_consecutive_same_role_turns_instead_of_rejecting_them() {
        // Results split over two user messages, then a user text: all one turn after merging.
        let b = body(json!([
            {"role": "user", "content": "go"},
            {"role": "user", "content": "really"},
            {"role": "assistant", "content": [tool_use("toolu_1")]},
            {"role": "assistant", "content": [tool_use("toolu_2")]},
            {"role": "user", "content": [tool_result("toolu_1")]},
            {"role": "user", "content": [tool_result("toolu_2")]},
            {"role": "user", "content": "and now?"},
        ]));
        let p = validate(&b).expect("valid");
        assert_eq!(p.cue.assistant_turns, 1);
        assert_eq!(p.cue.last_tool_results, ["contents", "contents"]);
        assert_eq!(p.cue.last_user_text.as_deref(), Some("and now?"));
    }

    #[test]
    fn a_final_assistant_message_is_a_prefill() {
        let b = body(json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "Sure,"},
        ]));
        let p = validate(&b).expect("valid");
        assert_eq!(p.cue.assistant_turns, 0);
        assert_eq!(p.cue.last_user_text.as_deref(), Some("go"));
        let b =
            body(json!([{"role": "user", "content": "go"}, {"role": "assistant", "content": ""}]));
        validate(&b).expect("an empty prefill is allowed");
        let m = rejected(&body(json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "Sure, "},
        ])));
        assert!(m.contains("trailing whitespace"), "{m}");
    }

    #[test]
    fn rejects_tool_use_without_tool_result_in_the_next_message() {
        let m = rejected(&body(json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [tool_use("toolu_1"), tool_use("toolu_2")]},
            {"role": "user", "content": [tool_result("toolu_1")]},
        ])));
        assert_eq!(
            m,
            "messages.2: `tool_use` ids were found without `tool_result` blocks immediately \
             after: toolu_2. Each `tool_use` block must have a corresponding `tool_result` block \
             in the next message."
        );
        let m = rejected(&body(json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [tool_use("toolu_1")]},
        ])));
        assert!(
            m.starts_with("messages.2: `tool_use` ids were found"),
            "{m}"
        );
    }

    #[test]
    fn rejects_tool_result_not_first_in_the_next_message() {
        let m = rejected(&body(json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [tool_use("toolu_1")]},
            {"role": "user", "content": [{"type": "text", "text": "here:"}, tool_result("toolu_1")]},
        ])));
        assert!(
            m.starts_with("messages.2: `tool_use` ids were found"),
            "{m}"
        );
        assert!(m.contains("toolu_1"), "{m}");
    }

    #[test]
    fn rejects_a_tool_result_for_a_tool_use_not_in_the_previous_message() {
        let m = rejected(&body(json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [tool_use("toolu_1")]},
            {"role": "user", "content": [tool_result("toolu_1"), tool_result("toolu_9")]},
        ])));
        assert_eq!(
            m,
            "messages.2.content.1: unexpected `tool_use_id` found in `tool_result` blocks: \
             toolu_9. Each `tool_result` block must have a corresponding `tool_use` block in the \
             previous message."
        );
        let m = rejected(&body(
            json!([{"role": "user", "content": [tool_result("toolu_1")]}]),
        ));
        assert!(
            m.starts_with("messages.0.content.0: unexpected `tool_use_id`"),
            "{m}"
        );
    }

    #[test]
    fn rejects_ids_outside_the_pattern() {
        let m = rejected(&body(json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [tool_use("call.1")]},
            {"role": "user", "content": [tool_result("call.1")]},
        ])));
        assert_eq!(
            m,
            "messages.1.content.0.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'"
        );
        let m = rejected(&body(json!([
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a b", "content": "x"}]},
        ])));
        assert!(m.starts_with("messages.0.content.0.tool_result.tool_use_id: String should match"));
    }

    #[test]
    fn rejects_empty_text_blocks() {
        let m = rejected(&body(json!([
            {"role": "user", "content": [{"type": "text", "text": ""}]},
        ])));
        assert_eq!(m, "messages: text content blocks must be non-empty");
        let m = rejected(&body(json!([
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "text", "text": " \n"}, tool_use("toolu_1")]},
            {"role": "user", "content": [tool_result("toolu_1")]},
        ])));
        assert_eq!(
            m,
            "messages: text content blocks must contain non-whitespace text"
        );
        let m = rejected(&body(json!([{"role": "user", "content": ""}])));
        assert!(m.contains("must have non-empty content"), "{m}");
        let m = rejected(
            &json!({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": ""}],
                                 "messages": [{"role": "user", "content": "go"}]}),
        );
        assert_eq!(m, "system: text content blocks must be non-empty");
    }

    #[test]
    fn rejects_missing_max_tokens_model_and_messages() {
        let m = rejected(&json!({"model": "m", "messages": [{"role": "user", "content": "go"}]}));
        assert_eq!(m, "max_tokens: Field required");
        let m =
            rejected(&json!({"max_tokens": 5, "messages": [{"role": "user", "content": "go"}]}));
        assert_eq!(m, "model: Field required");
        let m = rejected(&json!({"model": "m", "max_tokens": 5}));
        assert_eq!(m, "messages: Field required");
    }

    #[test]
    fn rejects_a_system_role_message() {
        let m = rejected(&body(json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "go"},
        ])));
        assert!(m.contains("top-level `system` parameter"), "{m}");
    }

    #[test]
    fn rejects_invalid_tool_names() {
        let m = rejected(&json!({"model": "m", "max_tokens": 5,
            "tools": [{"name": "fs.read", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": "go"}]}));
        assert!(
            m.starts_with("tools.0.custom.name: String should match pattern"),
            "{m}"
        );
    }

    #[test]
    fn a_tools_shape_is_checked_as_the_real_api_checks_it() {
        let with = |tools: Value| {
            json!({"model": "m", "max_tokens": 5, "tools": tools,
                   "messages": [{"role": "user", "content": "go"}]})
        };
        // Kedge's `output` tool: an object schema, a description, the cache marker.
        validate(&with(json!([
            {"name": "read_file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}},
            {"name": "output", "description": "Give your final answer.", "cache_control": {"type": "ephemeral"},
             "input_schema": {"type": "object", "required": ["answer"], "properties": {"answer": {"type": "string"}}}}
        ])))
        .expect("accepted");
        for (tools, expected) in [
            (
                json!([{"name": "a"}]),
                "tools.0.custom.input_schema: Field required",
            ),
            (
                json!([{"name": "a", "input_schema": []}]),
                "tools.0.custom.input_schema: Input should be a valid dictionary",
            ),
            (
                json!([{"name": "a", "input_schema": {"properties": {}}}]),
                "tools.0.custom.input_schema.type: Field required",
            ),
            (
                json!([{"name": "a", "input_schema": {"type": "array"}}]),
                "tools.0.custom.input_schema.type: Input should be 'object'",
            ),
            (
                json!([{"name": "a", "input_schema": {"type": "object", "required": "answer"}}]),
                "tools.0.custom.input_schema: JSON schema is invalid",
            ),
            (
                json!([{"name": "a", "input_schema": {"type": "object"}, "strict": true}]),
                "tools.0.custom.strict: Extra inputs are not permitted",
            ),
            (
                json!([{"name": "a", "input_schema": {"type": "object"}, "description": 7}]),
                "tools.0.custom.description: Input should be a valid string",
            ),
            (
                json!([{"name": "output", "input_schema": {"type": "object"}},
                       {"name": "output", "input_schema": {"type": "object"}}]),
                "tools: Tool names must be unique.",
            ),
        ] {
            let m = rejected(&with(tools.clone()));
            assert!(m.starts_with(expected), "{tools}: {m}");
        }
    }

    #[test]
    fn stream_frames_split_tool_input_and_end_with_message_stop() {
        let out = Output {
            id: "msg_x".into(),
            created: 1,
            model: "m".into(),
            text: Some("Reading.".into()),
            thinking: None,
            calls: vec![crate::reply::Call {
                id: "toolu_1".into(),
                name: "read_file".into(),
                arguments: "{\"path\":\"a\"}".into(),
                input: serde_json::Map::new(),
            }],
            input_tokens: 3,
            output_tokens: 4,
        };
        let frames = stream_frames(&out);
        let names: Vec<&str> = frames
            .iter()
            .map(|f| {
                f.lines()
                    .next()
                    .unwrap_or_default()
                    .trim_start_matches("event: ")
            })
            .collect();
        assert_eq!(names.first(), Some(&"message_start"));
        assert!(names.contains(&"ping"));
        assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
        let partial: Vec<Value> = frames
            .iter()
            .filter(|f| f.contains("input_json_delta"))
            .map(|f| {
                let data = f
                    .lines()
                    .nth(1)
                    .unwrap_or_default()
                    .trim_start_matches("data: ");
                serde_json::from_str::<Value>(data).expect("json")
            })
            .collect();
        assert!(partial.len() >= 2);
        let joined: String = partial
            .iter()
            .filter_map(|d| d["delta"]["partial_json"].as_str())
            .collect();
        assert_eq!(joined, "{\"path\":\"a\"}");
    }
}
