//! The messages: each one's own shape (pass 1, with the original indices), consecutive
//! same-role turns merged, then the tool use across the merged turns (pass 2); the `system`
//! prompt's blocks; and the thinking blocks passed back.

use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::reply::thinking_signature;

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
        "tool_use" => check_tool_use_block(&path, role, obj)?,
        "thinking" | "redacted_thinking" => check_thinking_block(&path, role, kind, obj)?,
        "tool_result" => check_tool_result_block(&path, role, obj)?,
        _ => {}
    }
    Ok(())
}

/// A `tool_use` block at `path`: in an assistant message, with an `id` matching the pattern, a
/// `name` and an object `input`.
fn check_tool_use_block(path: &str, role: &str, obj: &Map<String, Value>) -> Result<(), ApiError> {
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
    Ok(())
}

/// A `thinking` or `redacted_thinking` block at `path`: in an assistant message, with its
/// fields, and not marked for caching.
fn check_thinking_block(
    path: &str,
    role: &str,
    kind: &str,
    obj: &Map<String, Value>,
) -> Result<(), ApiError> {
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
    Ok(())
}

/// A `tool_result` block at `path`: in a user message, with a `tool_use_id` matching the
/// pattern, and `content` a string or a list of blocks (text blocks not empty).
fn check_tool_result_block(
    path: &str,
    role: &str,
    obj: &Map<String, Value>,
) -> Result<(), ApiError> {
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
    Ok(())
}

/// A message after validation of its own shape: role and content as blocks.
pub(super) struct Turn {
    pub(super) role: &'static str,
    pub(super) blocks: Vec<Value>,
}

/// Pass 1 for message `i`: its shape. Returns it as a [`Turn`].
pub(super) fn check_message(i: usize, is_last: bool, message: &Value) -> Result<Turn, ApiError> {
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
pub(super) fn merge(turns: Vec<Turn>) -> Vec<Turn> {
    let mut merged: Vec<Turn> = Vec::with_capacity(turns.len());
    for turn in turns {
        match merged.last_mut() {
            Some(last) if last.role == turn.role => last.blocks.extend(turn.blocks),
            _ => merged.push(turn),
        }
    }
    merged
}

pub(super) fn of_type<'a>(
    blocks: &'a [Value],
    kind: &'a str,
) -> impl Iterator<Item = &'a Value> + 'a {
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
pub(super) fn check_tool_use(turns: &[Turn]) -> Result<(), ApiError> {
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

pub(super) fn check_system(system: &Value) -> Result<(), ApiError> {
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

/// Every `thinking` block carries the signature the mock gave it: a block that was changed (or
/// made up) is refused, as the real API refuses a thinking block whose signature does not match.
pub(super) fn check_signatures(messages: &[Value]) -> Result<(), ApiError> {
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
pub(super) fn check_thinking_kept(turns: &[Turn]) -> Result<(), ApiError> {
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
