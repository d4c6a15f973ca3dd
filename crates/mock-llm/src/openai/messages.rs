//! The messages: each one's own shape (pass 1: roles, required fields, types, function
//! names), then the tool-call sequencing across them (pass 2).

use serde_json::Value;

use super::tools::check_function_name;
use super::{empty_array, field, missing, wrong_type};
use crate::error::ApiError;

const ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// `content` as a string or an array of content parts.
fn check_content(i: usize, role: &str, content: &Value) -> Result<(), ApiError> {
    let path = format!("messages[{i}].content");
    let parts = match content {
        Value::String(_) => return Ok(()),
        Value::Array(parts) => parts,
        other => {
            return Err(wrong_type(
                &path,
                "one of a string or array of objects",
                other,
            ));
        }
    };
    let allowed: &[&str] = match role {
        "user" => &["text", "image_url", "input_audio", "file"],
        "assistant" => &["text", "refusal"],
        _ => &["text"],
    };
    for (j, part) in parts.iter().enumerate() {
        let part_path = format!("{path}[{j}]");
        let Some(obj) = part.as_object() else {
            return Err(wrong_type(&part_path, "an object", part));
        };
        let kind = match field(obj, "type") {
            None => return Err(missing(&format!("messages.[{i}].content.[{j}].type"))),
            Some(Value::String(s)) => s.as_str(),
            Some(other) => return Err(wrong_type(&format!("{part_path}.type"), "a string", other)),
        };
        if !allowed.contains(&kind) {
            let list = allowed
                .iter()
                .map(|a| format!("'{a}'"))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(ApiError::invalid_param(
                format!("Invalid value: '{kind}'. Supported values are: {list}."),
                format!("messages.[{i}].content.[{j}].type"),
            ));
        }
        if kind == "text" {
            match field(obj, "text") {
                None => return Err(missing(&format!("messages.[{i}].content.[{j}].text"))),
                Some(Value::String(_)) => {}
                Some(other) => {
                    return Err(wrong_type(&format!("{part_path}.text"), "a string", other));
                }
            }
        }
    }
    Ok(())
}

/// The text of a string or text-parts content.
pub(super) fn content_text(content: Option<&Value>) -> Option<String> {
    match content? {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect();
            (!texts.is_empty()).then(|| texts.join("\n"))
        }
        _ => None,
    }
}

/// Pass 1: one message's own shape. Returns its role.
pub(super) fn check_message(i: usize, message: &Value) -> Result<&str, ApiError> {
    let Some(obj) = message.as_object() else {
        return Err(wrong_type(&format!("messages[{i}]"), "an object", message));
    };
    let role = match field(obj, "role") {
        None => return Err(missing(&format!("messages.[{i}].role"))),
        Some(Value::String(r)) => r.as_str(),
        Some(other) => {
            return Err(wrong_type(
                &format!("messages[{i}].role"),
                "a string",
                other,
            ));
        }
    };
    if !ROLES.contains(&role) {
        return Err(ApiError::invalid_param(
            format!(
                "Invalid value: '{role}'. Supported values are: 'system', 'assistant', 'user', \
                 'function', 'tool', and 'developer'."
            ),
            format!("messages.[{i}].role"),
        ));
    }
    let content = field(obj, "content");
    match role {
        "assistant" => {
            let tool_calls = field(obj, "tool_calls");
            let function_call = field(obj, "function_call");
            if content.is_none() && tool_calls.is_none() && function_call.is_none() {
                return Err(if obj.contains_key("content") {
                    ApiError::invalid_param(
                        "Invalid value for 'content': expected a string, got null.",
                        format!("messages.[{i}].content"),
                    )
                } else {
                    missing(&format!("messages.[{i}].content"))
                });
            }
            if let Some(tool_calls) = tool_calls {
                check_tool_calls(i, tool_calls)?;
            }
        }
        "tool" => {
            if content.is_none() {
                return Err(missing(&format!("messages.[{i}].content")));
            }
            match field(obj, "tool_call_id") {
                None => return Err(missing(&format!("messages.[{i}].tool_call_id"))),
                Some(Value::String(_)) => {}
                Some(other) => {
                    return Err(wrong_type(
                        &format!("messages[{i}].tool_call_id"),
                        "a string",
                        other,
                    ));
                }
            }
        }
        _ => {
            if content.is_none() {
                return Err(missing(&format!("messages.[{i}].content")));
            }
        }
    }
    if let Some(content) = content {
        check_content(i, role, content)?;
    }
    Ok(role)
}

fn check_tool_calls(i: usize, tool_calls: &Value) -> Result<(), ApiError> {
    let path = format!("messages[{i}].tool_calls");
    let Some(calls) = tool_calls.as_array() else {
        return Err(wrong_type(&path, "an array", tool_calls));
    };
    if calls.is_empty() {
        return Err(empty_array(&path));
    }
    for (j, call) in calls.iter().enumerate() {
        let Some(obj) = call.as_object() else {
            return Err(wrong_type(&format!("{path}[{j}]"), "an object", call));
        };
        match field(obj, "id") {
            None => return Err(missing(&format!("messages.[{i}].tool_calls.[{j}].id"))),
            Some(Value::String(_)) => {}
            Some(other) => return Err(wrong_type(&format!("{path}[{j}].id"), "a string", other)),
        }
        match field(obj, "type") {
            None => return Err(missing(&format!("messages.[{i}].tool_calls.[{j}].type"))),
            Some(Value::String(t)) if t == "function" => {}
            Some(other) => {
                return Err(ApiError::invalid_param(
                    format!("Invalid value: {other}. Supported values are: 'function'.",),
                    format!("messages.[{i}].tool_calls.[{j}].type"),
                ));
            }
        }
        let Some(function) = field(obj, "function") else {
            return Err(missing(&format!(
                "messages.[{i}].tool_calls.[{j}].function"
            )));
        };
        let Some(function) = function.as_object() else {
            return Err(wrong_type(
                &format!("{path}[{j}].function"),
                "an object",
                function,
            ));
        };
        check_function_name(&format!("{path}[{j}].function.name"), function.get("name"))?;
        match field(function, "arguments") {
            None => {
                return Err(missing(&format!(
                    "messages.[{i}].tool_calls.[{j}].function.arguments"
                )));
            }
            Some(Value::String(_)) => {}
            Some(other) => {
                return Err(wrong_type(
                    &format!("{path}[{j}].function.arguments"),
                    "a string",
                    other,
                ));
            }
        }
    }
    Ok(())
}

fn tool_call_ids(message: &Value) -> Vec<&str> {
    message
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .filter_map(|c| c.get("id").and_then(Value::as_str))
                .collect()
        })
        .unwrap_or_default()
}

/// Pass 2: every `tool_calls` answered by the tool messages right after it, and every tool
/// message answering the `tool_calls` right before it.
pub(super) fn check_sequence(messages: &[Value], roles: &[&str]) -> Result<(), ApiError> {
    struct Pending<'a> {
        assistant: usize,
        ids: Vec<&'a str>,
        answered: Vec<&'a str>,
    }
    fn unanswered(pending: &Pending<'_>, at: usize) -> Result<(), ApiError> {
        let missing: Vec<&str> = pending
            .ids
            .iter()
            .copied()
            .filter(|id| !pending.answered.contains(id))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        Err(ApiError::invalid_param(
            format!(
                "An assistant message with 'tool_calls' must be followed by tool messages \
                 responding to each 'tool_call_id'. The following tool_call_ids did not have \
                 response messages: {}",
                missing.join(", ")
            ),
            format!("messages.[{at}].role"),
        ))
    }

    let mut pending: Option<Pending<'_>> = None;
    for (i, (message, role)) in messages.iter().zip(roles).enumerate() {
        if *role == "tool" {
            let Some(p) = pending.as_mut() else {
                return Err(ApiError::invalid_param(
                    "Invalid parameter: messages with role 'tool' must be a response to a \
                     preceeding message with 'tool_calls'.",
                    format!("messages.[{i}].role"),
                ));
            };
            let id = message
                .get("tool_call_id")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if !p.ids.contains(&id) {
                return Err(ApiError::invalid_param(
                    format!(
                        "Invalid parameter: 'tool_call_id' of '{id}' not found in 'tool_calls' of \
                         previous message."
                    ),
                    format!("messages.[{i}].tool_call_id"),
                ));
            }
            p.answered.push(id);
            continue;
        }
        if let Some(p) = pending.take() {
            unanswered(&p, i)?;
        }
        if *role == "assistant" {
            let ids = tool_call_ids(message);
            if !ids.is_empty() {
                pending = Some(Pending {
                    assistant: i,
                    ids,
                    answered: Vec::new(),
                });
            }
        }
    }
    if let Some(p) = pending {
        unanswered(&p, p.assistant)?;
    }
    Ok(())
}
