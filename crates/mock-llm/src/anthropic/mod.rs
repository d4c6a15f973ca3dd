//! Anthropic Messages (`POST /v1/messages`): what it rejects, what it answers.
//!
//! Validation follows the real API's order: first each message's own shape (the schema, with
//! the original message indices), then consecutive same-role turns are merged (the current API
//! merges rather than rejects them), then tool use is checked across the merged turns: every
//! `tool_use` answered by a `tool_result` at the start of the next (user) message, and every
//! `tool_result` answering a `tool_use` of the message right before it. A final assistant
//! message is a prefill: it is allowed to be empty, and it is not an assistant turn of its own.
//!
//! The parts: each message's shape and the tool use across them (`messages.rs`), the top-level
//! settings and `cache_control` (`settings.rs`), the tool definitions (`tools.rs`), and the
//! answer, whole or streamed (`respond.rs`). The tests below validate whole requests.

use axum::http::{HeaderMap, StatusCode};
use serde_json::Value;

use crate::error::{ApiError, ErrorClass};
use crate::reply::Parsed;
use crate::script::Cue;

mod messages;
mod respond;
mod settings;
mod tools;

pub(crate) use respond::{message, stream_frames};

use messages::{
    Turn, check_message, check_signatures, check_system, check_thinking_kept, check_tool_use,
    merge, of_type,
};
use settings::{check_cache_control, check_settings};
use tools::check_tools;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reply::{Output, thinking_signature};
    use serde_json::json;

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
}
