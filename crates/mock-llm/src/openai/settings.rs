//! The top-level parameters: no unknown ones, the sampling settings, the output caps,
//! `reasoning_effort`, `response_format`, and the tool settings.

use serde_json::Value;

use super::{field, missing, wrong_type};
use crate::error::ApiError;

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
pub(super) fn check_settings(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    if let Some(k) = obj.keys().find(|k| !PARAMS.contains(&k.as_str())) {
        return Err(ApiError::invalid(format!(
            "Unrecognized request argument supplied: {k}"
        )));
    }
    check_range(obj, "temperature", 0.0, 2.0)?;
    check_range(obj, "top_p", 0.0, 1.0)?;
    check_stop(obj)?;
    if let Some(seed) = field(obj, "seed")
        && !(seed.is_i64() || seed.is_u64())
    {
        return Err(wrong_type("seed", "an integer", seed));
    }
    check_output_caps(obj)?;
    check_reasoning_effort(obj)?;
    if let Some(format) = field(obj, "response_format") {
        check_response_format(format)?;
    }
    check_tool_settings(obj)
}

/// `stop`: a string, or an array of at most 4 strings.
fn check_stop(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
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
    Ok(())
}

/// `max_tokens` and `max_completion_tokens`: integers of at least 1.
fn check_output_caps(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
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
    Ok(())
}

/// `reasoning_effort`: `minimal`, `low`, `medium` or `high`.
fn check_reasoning_effort(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
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
    Ok(())
}

/// `parallel_tool_calls` (a boolean) and `tool_choice` (`none`, `auto`, `required`, or a
/// function offered in `tools`), each only with `tools`.
fn check_tool_settings(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
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
