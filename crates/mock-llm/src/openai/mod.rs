//! OpenAI Chat Completions (`POST /v1/chat/completions`): what it rejects, what it answers.
//!
//! Validation runs in two passes, as the real API appears to: first each message's own shape
//! (roles, required fields, types, function names), then the tool-call sequencing across
//! messages. The first problem found is reported, with the real API's wording and `param`.
//!
//! The parts: each message's shape and the tool-call sequencing (`messages.rs`), the settings
//! (`settings.rs`), the tool definitions and function names (`tools.rs`), and the answer, whole
//! or streamed (`respond.rs`). The tests below validate whole requests.

use axum::http::HeaderMap;
use serde_json::Value;

use crate::error::{ApiError, ErrorClass};
use crate::json_kind;
use crate::reply::Parsed;
use crate::script::Cue;

mod messages;
mod respond;
mod settings;
mod tools;

pub(crate) use respond::{completion, stream_frames};

use messages::{check_message, check_sequence, content_text};
use settings::check_settings;
use tools::check_tools;

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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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

    /// A request with the settings in `extra`.
    fn with(extra: Value) -> Value {
        let mut b = body(vec![user("hi")]);
        for (k, v) in extra.as_object().expect("object") {
            b[k] = v.clone();
        }
        b
    }

    #[test]
    fn settings_are_checked_as_the_real_api_checks_them() {
        let tools =
            json!([{"type": "function", "function": {"name": "read_file", "parameters": {}}}]);
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
    }

    #[test]
    fn a_response_format_and_unknown_parameters_are_checked_as_the_real_api_checks_them() {
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
}
