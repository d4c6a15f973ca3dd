//! OpenAI Chat Completions (`POST /v1/chat/completions`): what it rejects, what it answers.
//!
//! Validation runs in two passes, as the real API appears to: first each message's own shape
//! (roles, required fields, types, function names), then the tool-call sequencing across
//! messages. The first problem found is reported, with the real API's wording and `param`.

use axum::http::HeaderMap;
use serde_json::{Value, json};

use crate::error::{ApiError, ErrorClass};
use crate::json_kind;
use crate::reply::{Output, Parsed, pieces, sse};
use crate::script::{Cue, valid_tool_name};

const ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// 401 unless `Authorization: Bearer <non-empty>`.
pub(crate) fn check_auth(headers: &HeaderMap) -> Result<(), ApiError> {
    let ok = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|key| !key.trim().is_empty());
    if ok {
        Ok(())
    } else {
        Err(ApiError::new(
            axum::http::StatusCode::UNAUTHORIZED,
            ErrorClass::Authentication,
            "You didn't provide an API key. You need to provide your API key in an Authorization \
             header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or as the password \
             field (with blank username) if you're accessing the API from your browser and are \
             prompted for a username. You can obtain an API key from \
             https://platform.openai.com/account/api-keys.",
        ))
    }
}

pub(crate) fn unparsable_body() -> ApiError {
    ApiError::invalid(
        "We could not parse the JSON body of your request. (HINT: This likely means you aren't \
         using your HTTP library correctly. The OpenAI API expects a JSON payload, but what was \
         sent was not valid JSON. If you have trouble figuring out how to fix this, please \
         contact us through our help center at help.openai.com.)",
    )
}

pub(crate) fn model_not_found(model: &str) -> ApiError {
    ApiError {
        status: axum::http::StatusCode::NOT_FOUND,
        code: Some("model_not_found"),
        ..ApiError::invalid(format!(
            "The model `{model}` does not exist or you do not have access to it."
        ))
    }
}

fn missing(param: &str) -> ApiError {
    ApiError::invalid_param(format!("Missing required parameter: '{param}'."), param)
}

fn wrong_type(path: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid_param(
        format!(
            "Invalid type for '{path}': expected {expected}, but got {} instead.",
            json_kind(got)
        ),
        path,
    )
}

fn empty_array(path: &str) -> ApiError {
    ApiError::invalid_param(
        format!(
            "Invalid '{path}': empty array. Expected an array with minimum length 1, but got an \
             empty array instead."
        ),
        path,
    )
}

/// Absent and `null` are the same thing to the API.
fn field<'a>(obj: &'a serde_json::Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn check_function_name(path: &str, name: Option<&Value>) -> Result<(), ApiError> {
    let name = match name {
        None | Some(Value::Null) => return Err(missing(path)),
        Some(Value::String(s)) => s,
        Some(other) => return Err(wrong_type(path, "a string", other)),
    };
    if valid_tool_name(name) {
        return Ok(());
    }
    let message = if name.is_empty() {
        format!(
            "Invalid '{path}': empty string. Expected a string with minimum length 1, but got an \
             empty string instead."
        )
    } else if name.len() > 64 {
        format!(
            "Invalid '{path}': string too long. Expected a string with maximum length 64, but got \
             a string with length {} instead.",
            name.len()
        )
    } else {
        format!(
            "Invalid '{path}': string does not match pattern. Expected a string that matches the \
             pattern '^[a-zA-Z0-9_-]+$'."
        )
    };
    Err(ApiError::invalid_param(message, path))
}

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
fn content_text(content: Option<&Value>) -> Option<String> {
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
fn check_message(i: usize, message: &Value) -> Result<&str, ApiError> {
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
fn check_sequence(messages: &[Value], roles: &[&str]) -> Result<(), ApiError> {
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

/// Validates a request body as the real API would, and summarises it for the script.
pub(crate) fn validate(body: &Value) -> Result<Parsed, ApiError> {
    let Some(obj) = body.as_object() else {
        return Err(unparsable_body());
    };
    let model = match field(obj, "model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        None | Some(Value::String(_)) => {
            return Err(ApiError::invalid("you must provide a model parameter"));
        }
        Some(other) => return Err(wrong_type("model", "a string", other)),
    };
    let messages = match field(obj, "messages") {
        None => return Err(missing("messages")),
        Some(Value::Array(m)) => m,
        Some(other) => return Err(wrong_type("messages", "an array", other)),
    };
    if messages.is_empty() {
        return Err(empty_array("messages"));
    }
    let stream = match field(obj, "stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(wrong_type("stream", "a boolean", other)),
    };
    let include_usage = match field(obj, "stream_options") {
        None => false,
        Some(_) if !stream => {
            return Err(ApiError::invalid_param(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                "stream_options",
            ));
        }
        Some(Value::Object(o)) => o.get("include_usage").and_then(Value::as_bool) == Some(true),
        Some(other) => return Err(wrong_type("stream_options", "an object", other)),
    };
    if let Some(tools) = field(obj, "tools") {
        check_tools(tools)?;
    }
    check_settings(obj)?;

    let roles = messages
        .iter()
        .enumerate()
        .map(|(i, m)| check_message(i, m))
        .collect::<Result<Vec<&str>, ApiError>>()?;
    check_sequence(messages, &roles)?;

    Ok(Parsed {
        model,
        stream,
        include_usage,
        thinking: false,
        cue: cue(messages, &roles),
        input_chars: crate::reply::json_chars(messages),
    })
}

/// Chat Completions request parameters; anything else is "Unrecognized request argument".
const PARAMS: [&str; 34] = [
    "model",
    "messages",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "max_tokens",
    "max_completion_tokens",
    "reasoning_effort",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "user",
    "response_format",
    "metadata",
    "store",
    "service_tier",
    "modalities",
    "audio",
    "prediction",
    "web_search_options",
    "functions",
    "function_call",
    "verbosity",
    "prompt_cache_key",
    "safety_identifier",
];

/// `response_format` as the real API checks it: `type` one of `text`, `json_object`,
/// `json_schema`; with `json_schema`, an object `json_schema` with a `name` matching
/// `^[a-zA-Z0-9_-]{1,64}$`, an optional object `schema` and an optional boolean `strict`.
fn check_response_format(format: &Value) -> Result<(), ApiError> {
    let Some(obj) = format.as_object() else {
        return Err(wrong_type("response_format", "an object", format));
    };
    match obj.get("type").and_then(Value::as_str) {
        None => return Err(missing("response_format.type")),
        Some("text" | "json_object") => return Ok(()),
        Some("json_schema") => {}
        Some(other) => {
            return Err(ApiError::invalid_param(
                format!(
                    "Invalid value: '{other}'. Supported values are: 'text', 'json_object', and \
                     'json_schema'."
                ),
                "response_format.type",
            ));
        }
    }
    let Some(spec) = obj.get("json_schema") else {
        return Err(missing("response_format.json_schema"));
    };
    let Some(spec) = spec.as_object() else {
        return Err(wrong_type("response_format.json_schema", "an object", spec));
    };
    match spec.get("name") {
        None => return Err(missing("response_format.json_schema.name")),
        Some(Value::String(name)) if crate::script::valid_tool_name(name) => {}
        Some(Value::String(name)) => {
            return Err(ApiError::invalid_param(
                format!(
                    "Invalid 'response_format.json_schema.name': string does not match pattern. \
                     Expected a string that matches the pattern '^[a-zA-Z0-9_-]{{1,64}}$', but got \
                     '{name}' instead."
                ),
                "response_format.json_schema.name",
            ));
        }
        Some(other) => {
            return Err(wrong_type(
                "response_format.json_schema.name",
                "a string",
                other,
            ));
        }
    }
    if let Some(schema) = spec.get("schema")
        && !schema.is_object()
    {
        return Err(wrong_type(
            "response_format.json_schema.schema",
            "an object",
            schema,
        ));
    }
    if let Some(strict) = spec.get("strict")
        && !(strict.is_boolean() || strict.is_null())
    {
        return Err(wrong_type(
            "response_format.json_schema.strict",
            "a boolean",
            strict,
        ));
    }
    Ok(())
}

/// `Invalid 'param': decimal above/below …` for a number outside `min..=max`.
fn check_range(
    obj: &serde_json::Map<String, Value>,
    param: &str,
    min: f64,
    max: f64,
) -> Result<(), ApiError> {
    let Some(v) = field(obj, param) else {
        return Ok(());
    };
    let Some(x) = v.as_f64() else {
        return Err(wrong_type(param, "a decimal", v));
    };
    let (side, bound, op) = if x > max {
        ("above maximum", max, "<=")
    } else if x < min {
        ("below minimum", min, ">=")
    } else {
        return Ok(());
    };
    Err(ApiError::invalid_param(
        format!(
            "Invalid '{param}': decimal {side} value. Expected a value {op} {bound}, but got {v} \
             instead."
        ),
        param,
    ))
}

/// The sampling and tool settings, as the real API checks them (wording from its answers; the rules
/// are the API's, those of the settings Kedge sends listed in docs/CONFIG.md "Model settings and
/// price": temperature 0–2, top_p 0–1, at most 4 stop sequences, an integer seed, a positive
/// integer output cap, `tool_choice` in one of its forms naming an offered tool, `tool_choice` and
/// `parallel_tool_calls` only with `tools`, `reasoning_effort` one of its values, and no unknown
/// parameter).
fn check_settings(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    if let Some(k) = obj.keys().find(|k| !PARAMS.contains(&k.as_str())) {
        return Err(ApiError::invalid(format!(
            "Unrecognized request argument supplied: {k}"
        )));
    }
    check_range(obj, "temperature", 0.0, 2.0)?;
    check_range(obj, "top_p", 0.0, 1.0)?;
    match field(obj, "stop") {
        None | Some(Value::String(_)) => {}
        Some(Value::Array(stops)) => {
            if stops.len() > 4 {
                return Err(ApiError::invalid_param(
                    format!(
                        "Invalid 'stop': array too long. Expected an array with maximum length 4, \
                         but got an array with length {} instead.",
                        stops.len()
                    ),
                    "stop",
                ));
            }
            for (i, s) in stops.iter().enumerate() {
                if !s.is_string() {
                    return Err(wrong_type(&format!("stop[{i}]"), "a string", s));
                }
            }
        }
        Some(other) => {
            return Err(wrong_type(
                "stop",
                "one of a string or array of strings",
                other,
            ));
        }
    }
    if let Some(seed) = field(obj, "seed")
        && !(seed.is_i64() || seed.is_u64())
    {
        return Err(wrong_type("seed", "an integer", seed));
    }
    for cap in ["max_tokens", "max_completion_tokens"] {
        match field(obj, cap) {
            None => {}
            Some(v) if v.as_u64().is_some_and(|n| n >= 1) => {}
            Some(v) if v.is_i64() => {
                return Err(ApiError::invalid_param(
                    format!(
                        "Invalid '{cap}': integer below minimum value. Expected a value >= 1, but \
                         got {v} instead."
                    ),
                    cap,
                ));
            }
            Some(v) => return Err(wrong_type(cap, "an integer", v)),
        }
    }
    if let Some(effort) = field(obj, "reasoning_effort") {
        let ok = effort
            .as_str()
            .is_some_and(|e| ["minimal", "low", "medium", "high"].contains(&e));
        if !ok {
            return Err(ApiError::invalid_param(
                format!(
                    "Invalid value: {effort}. Supported values are: 'minimal', 'low', 'medium', \
                     and 'high'."
                ),
                "reasoning_effort",
            ));
        }
    }
    if let Some(format) = field(obj, "response_format") {
        check_response_format(format)?;
    }
    let tool_names: Option<Vec<&str>> = field(obj, "tools").and_then(Value::as_array).map(|t| {
        t.iter()
            .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
            .collect()
    });
    if let Some(parallel) = field(obj, "parallel_tool_calls") {
        if !parallel.is_boolean() {
            return Err(wrong_type("parallel_tool_calls", "a boolean", parallel));
        }
        if tool_names.is_none() {
            return Err(ApiError::invalid_param(
                "Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only allowed \
                 when 'tools' are specified.",
                "parallel_tool_calls",
            ));
        }
    }
    if let Some(choice) = field(obj, "tool_choice") {
        let Some(names) = &tool_names else {
            return Err(ApiError::invalid_param(
                "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are \
                 specified.",
                "tool_choice",
            ));
        };
        match choice {
            Value::String(c) if ["none", "auto", "required"].contains(&c.as_str()) => {}
            Value::String(c) => {
                return Err(ApiError::invalid_param(
                    format!(
                        "Invalid value: '{c}'. Supported values are: 'none', 'auto', and \
                         'required'."
                    ),
                    "tool_choice",
                ));
            }
            Value::Object(o) => {
                if o.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(missing("tool_choice.type"));
                }
                let Some(name) = o.get("function").and_then(|f| f.get("name")) else {
                    return Err(missing("tool_choice.function.name"));
                };
                let name = name.as_str().unwrap_or_default();
                if !names.contains(&name) {
                    return Err(ApiError::invalid_param(
                        format!(
                            "Invalid value for 'tool_choice': function '{name}' is not one of the \
                             functions in 'tools'."
                        ),
                        "tool_choice",
                    ));
                }
            }
            other => {
                return Err(wrong_type(
                    "tool_choice",
                    "one of a string or object",
                    other,
                ));
            }
        }
    }
    Ok(())
}

fn check_tools(tools: &Value) -> Result<(), ApiError> {
    let Some(tools) = tools.as_array() else {
        return Err(wrong_type("tools", "an array", tools));
    };
    if tools.is_empty() {
        return Err(empty_array("tools"));
    }
    for (i, tool) in tools.iter().enumerate() {
        let Some(obj) = tool.as_object() else {
            return Err(wrong_type(&format!("tools[{i}]"), "an object", tool));
        };
        match field(obj, "type") {
            None => return Err(missing(&format!("tools[{i}].type"))),
            Some(Value::String(t)) if t == "function" => {}
            // Other tool kinds (custom grammars…) carry no `function` object.
            Some(Value::String(_)) => continue,
            Some(other) => return Err(wrong_type(&format!("tools[{i}].type"), "a string", other)),
        }
        let Some(function) = field(obj, "function") else {
            return Err(missing(&format!("tools[{i}].function")));
        };
        let Some(function) = function.as_object() else {
            return Err(wrong_type(
                &format!("tools[{i}].function"),
                "an object",
                function,
            ));
        };
        check_function_name(&format!("tools[{i}].function.name"), function.get("name"))?;
    }
    Ok(())
}

fn cue(messages: &[Value], roles: &[&str]) -> Cue {
    let assistant_turns = roles.iter().filter(|r| **r == "assistant").count();
    let last = roles.len() - 1;
    let last_user_text = (roles[last] == "user")
        .then(|| content_text(messages[last].get("content")))
        .flatten();
    let last_tool_results = roles
        .iter()
        .rposition(|r| *r != "tool")
        .map_or(0, |i| i + 1);
    let last_tool_results = messages[last_tool_results..]
        .iter()
        .filter_map(|m| content_text(m.get("content")))
        .collect();
    Cue {
        assistant_turns,
        last_user_text,
        last_tool_results,
    }
}

/// The non-streaming `chat.completion` body.
pub(crate) fn completion(out: &Output) -> Value {
    let mut message = json!({
        "role": "assistant",
        "content": out.text,
        "refusal": null,
        "annotations": [],
    });
    if !out.calls.is_empty() {
        message["tool_calls"] = out
            .calls
            .iter()
            .map(|c| {
                json!({
                    "id": c.id,
                    "type": "function",
                    "function": { "name": c.name, "arguments": c.arguments },
                })
            })
            .collect();
    }
    json!({
        "id": out.id,
        "object": "chat.completion",
        "created": out.created,
        "model": out.model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": finish_reason(out),
        }],
        "usage": usage(out),
        "system_fingerprint": "fp_mock",
    })
}

fn finish_reason(out: &Output) -> &'static str {
    if out.calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    }
}

fn usage(out: &Output) -> Value {
    json!({
        "prompt_tokens": out.input_tokens,
        "completion_tokens": out.output_tokens,
        "total_tokens": out.input_tokens + out.output_tokens,
    })
}

/// The `chat.completion.chunk` frames of a streamed answer, `data: [DONE]` included.
pub(crate) fn stream_frames(out: &Output, include_usage: bool) -> Vec<String> {
    let chunk = |delta: Value, finish: Option<&str>| {
        let mut c = json!({
            "id": out.id,
            "object": "chat.completion.chunk",
            "created": out.created,
            "model": out.model,
            "system_fingerprint": "fp_mock",
            "choices": [{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }],
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        sse(None, &c.to_string())
    };
    let mut frames = vec![chunk(
        json!({
            "role": "assistant",
            "content": if out.text.is_some() { json!("") } else { Value::Null },
            "refusal": null,
        }),
        None,
    )];
    if let Some(text) = &out.text {
        for piece in pieces(text) {
            frames.push(chunk(json!({ "content": piece }), None));
        }
    }
    for (index, call) in out.calls.iter().enumerate() {
        frames.push(chunk(
            json!({ "tool_calls": [{
                "index": index,
                "id": call.id,
                "type": "function",
                "function": { "name": call.name, "arguments": "" },
            }]}),
            None,
        ));
        for piece in pieces(&call.arguments) {
            frames.push(chunk(
                json!({ "tool_calls": [{ "index": index, "function": { "arguments": piece } }] }),
                None,
            ));
        }
    }
    frames.push(chunk(json!({}), Some(finish_reason(out))));
    if include_usage {
        let c = json!({
            "id": out.id,
            "object": "chat.completion.chunk",
            "created": out.created,
            "model": out.model,
            "system_fingerprint": "fp_mock",
            "choices": [],
            "usage": usage(out),
        });
        frames.push(sse(None, &c.to_string()));
    }
    frames.push(sse(None, "[DONE]"));
    frames
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(text: &str) -> Value {
        json!({"role": "user", "content": text})
    }
    fn assistant_calls(ids: &[&str]) -> Value {
        let calls: Vec<Value> = ids
            .iter()
            .map(|id| json!({"id": id, "type": "function", "function": {"name": "read_file", "arguments": "{}"}}))
            .collect();
        json!({"role": "assistant", "content": null, "tool_calls": calls})
    }
    fn tool(id: &str) -> Value {
        json!({"role": "tool", "tool_call_id": id, "content": "result"})
    }
    fn body(messages: Vec<Value>) -> Value {
        json!({"model": "m", "messages": messages})
    }
    fn rejected(body: &Value) -> ApiError {
        match validate(body) {
            Ok(p) => panic!("accepted: {p:?}"),
            Err(e) => {
                assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
                assert_eq!(e.class, ErrorClass::InvalidRequest);
                e
            }
        }
    }

    #[test]
    fn settings_are_checked_as_the_real_api_checks_them() {
        let tools =
            json!([{"type": "function", "function": {"name": "read_file", "parameters": {}}}]);
        let with = |extra: Value| {
            let mut b = body(vec![user("hi")]);
            for (k, v) in extra.as_object().expect("object") {
                b[k] = v.clone();
            }
            b
        };
        validate(&with(json!({
            "tools": tools, "tool_choice": {"type": "function", "function": {"name": "read_file"}},
            "parallel_tool_calls": false, "temperature": 2, "top_p": 0, "stop": ["a", "b", "c", "d"],
            "seed": -3, "max_completion_tokens": 10, "reasoning_effort": "minimal",
        })))
        .expect("valid settings");
        validate(&with(
            json!({"tools": tools, "tool_choice": "required", "stop": "END"}),
        ))
        .expect("required, and stop as one string");
        for (extra, param, words) in [
            (
                json!({"temperature": 2.5}),
                "temperature",
                "decimal above maximum value",
            ),
            (
                json!({"temperature": -0.1}),
                "temperature",
                "decimal below minimum value",
            ),
            (
                json!({"temperature": "hot"}),
                "temperature",
                "expected a decimal",
            ),
            (json!({"top_p": 1.1}), "top_p", "Expected a value <= 1"),
            (
                json!({"stop": ["a", "b", "c", "d", "e"]}),
                "stop",
                "maximum length 4",
            ),
            (json!({"seed": 1.5}), "seed", "expected an integer"),
            (
                json!({"max_completion_tokens": 0}),
                "max_completion_tokens",
                "Expected a value >= 1",
            ),
            (
                json!({"reasoning_effort": "extreme"}),
                "reasoning_effort",
                "Supported values",
            ),
            (
                json!({"tool_choice": "auto"}),
                "tool_choice",
                "only allowed when 'tools' are specified",
            ),
            (
                json!({"parallel_tool_calls": true}),
                "parallel_tool_calls",
                "only allowed when 'tools'",
            ),
            (
                json!({"tools": tools, "tool_choice": "any"}),
                "tool_choice",
                "'none', 'auto', and 'required'",
            ),
            (
                json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "shell"}}}),
                "tool_choice",
                "'shell' is not one of the functions",
            ),
        ] {
            let e = rejected(&with(extra.clone()));
            assert_eq!(e.param.as_deref(), Some(param), "{extra}: {}", e.message);
            assert!(e.message.contains(words), "{extra}: {}", e.message);
        }
        validate(&with(
            json!({"response_format": {"type": "json_schema", "json_schema":
            {"name": "output", "schema": {"type": "object"}, "strict": false}}}),
        ))
        .expect("a json_schema response format");
        validate(&with(json!({"response_format": {"type": "json_object"}}))).expect("json_object");
        for (format, param, words) in [
            (
                json!({"type": "yaml"}),
                "response_format.type",
                "Supported values",
            ),
            (
                json!({"type": "json_schema"}),
                "response_format.json_schema",
                "Missing required",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}}}),
                "response_format.json_schema.name",
                "Missing required",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "my output"}}),
                "response_format.json_schema.name",
                "does not match pattern",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "o", "schema": "x"}}),
                "response_format.json_schema.schema",
                "expected an object",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "o", "strict": "no"}}),
                "response_format.json_schema.strict",
                "expected a boolean",
            ),
        ] {
            let e = rejected(&with(json!({ "response_format": format.clone() })));
            assert_eq!(e.param.as_deref(), Some(param), "{format}: {}", e.message);
            assert!(e.message.contains(words), "{format}: {}", e.message);
        }
        let e = rejected(&with(
            json!({"thinking": {"type": "enabled", "budget_tokens": 2048}}),
        ));
        assert_eq!(
            e.message,
            "Unrecognized request argument supplied: thinking"
        );
    }

    #[test]
    fn accepts_a_multi_step_conversation_with_parallel_tool_calls() {
        let b = body(vec![
            json!({"role": "system", "content": "be brief"}),
            user("list and read"),
            assistant_calls(&["call_1", "call_2"]),
            tool("call_2"),
            tool("call_1"),
            json!({"role": "assistant", "content": "Let me ask.", "tool_calls": [
                {"id": "call_3", "type": "function", "function": {"name": "ask_user", "arguments": "{\"question\":\"Proceed?\"}"}}]}),
            json!({"role": "tool", "tool_call_id": "call_3", "content": [{"type": "text", "text": "yes"}]}),
            json!({"role": "assistant", "content": "All done."}),
            user("thanks"),
        ]);
        let p = validate(&b).expect("valid");
        assert_eq!(p.cue.assistant_turns, 3);
        assert_eq!(p.cue.last_user_text.as_deref(), Some("thanks"));
        assert!(!p.stream);
    }

    #[test]
    fn the_trailing_tool_results_are_the_cue() {
        let b = body(vec![
            user("go"),
            assistant_calls(&["a", "b"]),
            tool("a"),
            tool("b"),
        ]);
        let p = validate(&b).expect("valid");
        assert_eq!(p.cue.last_tool_results, ["result", "result"]);
        assert_eq!(p.cue.last_user_text, None);
        assert_eq!(p.cue.assistant_turns, 1);
    }

    #[test]
    fn rejects_tool_calls_not_answered_before_the_next_message() {
        let e = rejected(&body(vec![
            user("go"),
            assistant_calls(&["call_1", "call_2"]),
            tool("call_1"),
            user("well?"),
        ]));
        assert_eq!(
            e.message,
            "An assistant message with 'tool_calls' must be followed by tool messages responding \
             to each 'tool_call_id'. The following tool_call_ids did not have response messages: \
             call_2"
        );
        assert_eq!(e.param.as_deref(), Some("messages.[3].role"));
        assert_eq!(e.code, None);
    }

    #[test]
    fn rejects_tool_calls_left_unanswered_at_the_end() {
        let e = rejected(&body(vec![user("go"), assistant_calls(&["call_1"])]));
        assert!(
            e.message
                .ends_with("did not have response messages: call_1")
        );
        assert_eq!(e.param.as_deref(), Some("messages.[1].role"));
    }

    #[test]
    fn rejects_a_tool_message_without_preceding_tool_calls() {
        let e = rejected(&body(vec![user("go"), tool("call_1")]));
        assert_eq!(
            e.message,
            "Invalid parameter: messages with role 'tool' must be a response to a preceeding \
             message with 'tool_calls'."
        );
        assert_eq!(e.param.as_deref(), Some("messages.[1].role"));
        // A user message in between breaks the chain too.
        let e = rejected(&body(vec![
            user("go"),
            assistant_calls(&["call_1"]),
            user("interjection"),
            tool("call_1"),
        ]));
        assert!(
            e.message.contains("did not have response messages"),
            "{}",
            e.message
        );
    }

    #[test]
    fn rejects_a_tool_call_id_not_in_the_previous_tool_calls() {
        let e = rejected(&body(vec![
            user("go"),
            assistant_calls(&["call_1"]),
            tool("call_1"),
            tool("call_9"),
        ]));
        assert_eq!(
            e.message,
            "Invalid parameter: 'tool_call_id' of 'call_9' not found in 'tool_calls' of previous \
             message."
        );
        assert_eq!(e.param.as_deref(), Some("messages.[3].tool_call_id"));
    }

    #[test]
    fn rejects_a_tool_message_without_content() {
        let e = rejected(&body(vec![
            user("go"),
            assistant_calls(&["call_1"]),
            json!({"role": "tool", "tool_call_id": "call_1"}),
        ]));
        assert_eq!(
            e.message,
            "Missing required parameter: 'messages.[2].content'."
        );
        assert_eq!(e.param.as_deref(), Some("messages.[2].content"));
    }

    #[test]
    fn rejects_a_tool_message_without_tool_call_id() {
        let e = rejected(&body(vec![
            user("go"),
            assistant_calls(&["call_1"]),
            json!({"role": "tool", "content": "x"}),
        ]));
        assert_eq!(
            e.message,
            "Missing required parameter: 'messages.[2].tool_call_id'."
        );
    }

    #[test]
    fn rejects_an_assistant_without_content_or_tool_calls() {
        let e = rejected(&body(vec![user("go"), json!({"role": "assistant"})]));
        assert_eq!(
            e.message,
            "Missing required parameter: 'messages.[1].content'."
        );
        let e = rejected(&body(vec![
            user("go"),
            json!({"role": "assistant", "content": null}),
        ]));
        assert_eq!(
            e.message,
            "Invalid value for 'content': expected a string, got null."
        );
        assert_eq!(e.param.as_deref(), Some("messages.[1].content"));
        let e = rejected(&body(vec![
            user("go"),
            json!({"role": "assistant", "content": null, "tool_calls": []}),
        ]));
        assert!(e.message.contains("empty array"), "{}", e.message);
    }

    #[test]
    fn rejects_invalid_function_names_in_tools() {
        let tools = |name: &str| {
            json!({"model": "m", "messages": [user("go")],
                   "tools": [{"type": "function", "function": {"name": "ok_name"}},
                             {"type": "function", "function": {"name": name}}]})
        };
        let e = rejected(&tools("read file"));
        assert_eq!(e.param.as_deref(), Some("tools[1].function.name"));
        assert!(
            e.message.contains("does not match pattern"),
            "{}",
            e.message
        );
        let e = rejected(&tools(&"x".repeat(65)));
        assert!(e.message.contains("string too long"), "{}", e.message);
        let e = rejected(&tools(""));
        assert!(e.message.contains("empty string"), "{}", e.message);
        let e = rejected(&tools("mcp.fs/read"));
        assert!(
            e.message.contains("does not match pattern"),
            "{}",
            e.message
        );
    }

    #[test]
    fn rejects_invalid_function_names_in_tool_calls() {
        let e = rejected(&body(vec![
            user("go"),
            json!({"role": "assistant", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "fs.read", "arguments": "{}"}}]}),
            tool("call_1"),
        ]));
        assert_eq!(
            e.param.as_deref(),
            Some("messages[1].tool_calls[0].function.name")
        );
    }

    #[test]
    fn rejects_arguments_sent_as_an_object() {
        let e = rejected(&body(vec![
            user("go"),
            json!({"role": "assistant", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {}}}]}),
            tool("call_1"),
        ]));
        assert_eq!(
            e.message,
            "Invalid type for 'messages[1].tool_calls[0].function.arguments': expected a string, \
             but got an object instead."
        );
    }

    #[test]
    fn rejects_missing_model_and_messages() {
        let e = rejected(&json!({"messages": [user("go")]}));
        assert_eq!(e.message, "you must provide a model parameter");
        let e = rejected(&json!({"model": "m"}));
        assert_eq!(e.message, "Missing required parameter: 'messages'.");
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = rejected(&json!({"model": "m", "messages": []}));
        assert!(e.message.contains("empty array"), "{}", e.message);
    }

    #[test]
    fn rejects_unknown_roles_and_stream_options_without_stream() {
        let e = rejected(&body(vec![json!({"role": "bot", "content": "x"})]));
        assert_eq!(e.param.as_deref(), Some("messages.[0].role"));
        let e = rejected(&json!({"model": "m", "messages": [user("go")],
                                 "stream_options": {"include_usage": true}}));
        assert_eq!(e.param.as_deref(), Some("stream_options"));
    }

    #[test]
    fn stream_frames_fragment_tool_calls_like_the_real_api() {
        let out = Output {
            id: "chatcmpl-x".into(),
            created: 1,
            model: "m".into(),
            text: Some("Let me look.".into()),
            thinking: None,
            calls: vec![crate::reply::Call {
                id: "call_1".into(),
                name: "read_file".into(),
                arguments: "{\"path\":\"notes.txt\"}".into(),
                input: serde_json::Map::new(),
            }],
            input_tokens: 3,
            output_tokens: 4,
        };
        let frames = stream_frames(&out, true);
        assert_eq!(frames.last().map(String::as_str), Some("data: [DONE]\n\n"));
        let chunks: Vec<Value> = frames[..frames.len() - 1]
            .iter()
            .map(|f| serde_json::from_str(f.trim_start_matches("data: ").trim()).expect("json"))
            .collect();
        let usage_chunk = chunks.last().expect("usage");
        assert_eq!(usage_chunk["choices"], json!([]));
        assert_eq!(usage_chunk["usage"]["total_tokens"], 7);
        let finish = &chunks[chunks.len() - 2]["choices"][0];
        assert_eq!(finish["delta"], json!({}));
        assert_eq!(finish["finish_reason"], "tool_calls");
        let fragments: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
            .map(|t| &t[0])
            .collect();
        assert!(fragments.len() >= 3);
        assert_eq!(fragments[0]["id"], "call_1");
        for f in &fragments[1..] {
            assert_eq!(f["index"], 0);
            assert!(f.get("id").is_none() && f.get("type").is_none());
            assert!(f["function"].get("name").is_none());
        }
        let args: String = fragments
            .iter()
            .filter_map(|f| f["function"]["arguments"].as_str())
            .collect();
        assert_eq!(args, "{\"path\":\"notes.txt\"}");
    }
}
