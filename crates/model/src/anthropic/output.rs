//! Structured output (an agent's `output_schema`): the `output` tool that carries the answer,
//! and the answer taken back out of its call (see the module's documentation).

use kedge_core::agent::OUTPUT_TOOL;
use kedge_core::decide::ModelResponse;
use kedge_core::event::{FinishReason, ToolCall};
use serde_json::Value;

use super::request::Tool;
use crate::ModelCall;

/// What the system prompt of an agent with an `output_schema` ends with.
pub const OUTPUT_INSTRUCTION: &str = "Give your final answer by calling the `output` tool: its \
     input is your answer, and it must match the tool's input schema. Do not write the answer \
     as text.";

/// The `output` tool of a call whose agent declares an `output_schema` (Anthropic has no
/// `response_format`): the schema as its input schema. `None` without a schema, or for one the
/// API would refuse as an input schema (not `"type": "object"`; `kedge agents put` refuses
/// those for Anthropic agents): the answer is then validated as text only.
pub(super) fn output_tool<'a>(call: &'a ModelCall<'_>) -> Option<Tool<'a>> {
    let schema = call.output_schema?;
    if schema.get("type").and_then(Value::as_str) != Some("object") {
        return None;
    }
    Some(Tool {
        name: OUTPUT_TOOL,
        description: OUTPUT_TOOL_DESCRIPTION,
        input_schema: schema,
        cache_control: None,
    })
}

/// The `output` tool's description.
const OUTPUT_TOOL_DESCRIPTION: &str = "Give your final answer: call this tool once, with your \
     whole answer as its input, when you have finished.";

/// The response with a call of the `output` tool made its answer: the call's input, as JSON,
/// becomes the turn's text (what Kedge validates and the run's output), and the call is removed
/// so that nothing dispatches it and no later request has to answer it. A turn that made
/// only that call ends as a final answer (`stop`); one that also called other tools goes on
/// with them. Input that was not valid JSON stays as the raw text it was (and fails validation
/// as such). Without an `output` call the response is unchanged.
pub fn answer_from_output_tool(mut response: ModelResponse) -> ModelResponse {
    let (outputs, calls): (Vec<ToolCall>, Vec<ToolCall>) = response
        .message
        .tool_calls
        .into_iter()
        .partition(|c| c.name == OUTPUT_TOOL);
    response.message.tool_calls = calls;
    if let Some(answer) = outputs.into_iter().next() {
        response.message.text = match answer.arguments {
            Value::String(raw) => raw,
            other => other.to_string(),
        };
        if response.message.tool_calls.is_empty() {
            response.finish = FinishReason::Stop;
        }
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Delta;
    use crate::anthropic::{Decoder, request_body};
    use crate::sse::SseParser;
    use crate::tests::call_with;
    use kedge_core::event::{AssistantMessage, ModelSpec, Provider, ThinkingBlock, Usage};
    use kedge_core::fold::ChatMessage;
    use serde_json::json;

    fn claude(settings: kedge_core::settings::ModelSettings) -> ModelSpec {
        ModelSpec {
            provider: Provider::Anthropic,
            name: "claude-test".into(),
            base_url: None,
            settings,
            price: None,
        }
    }

    #[test]
    fn an_output_schema_is_offered_as_the_output_tool_and_forced_only_when_alone() {
        let schema = json!({"type": "object", "required": ["answer"],
                            "properties": {"answer": {"type": "string"}}});
        let context = vec![ChatMessage::User {
            text: "Question?".into(),
        }];
        let spec = claude(Default::default());
        let mut call = call_with(&spec, &context);
        call.output_schema = Some(&schema);
        // Alone: offered last, forced, and the system prompt says to use it.
        call.tools = &[];
        let body = request_body(&call);
        assert_eq!(
            body["tools"],
            json!([{"name": "output", "input_schema": schema,
                    "description": OUTPUT_TOOL_DESCRIPTION}])
        );
        assert_eq!(
            body["tool_choice"],
            json!({"type": "tool", "name": "output"})
        );
        let system = body["system"].as_str().expect("system");
        assert!(system.starts_with("Be brief."), "{system}");
        assert!(system.ends_with(OUTPUT_INSTRUCTION), "{system}");
        // With the agent's own tools: offered after them, never forced.
        let call_tools = call_with(&spec, &context).tools;
        call.tools = call_tools;
        let body = request_body(&call);
        let names: Vec<&str> = body["tools"]
            .as_array()
            .expect("tools")
            .iter()
            .filter_map(|t| t["name"].as_str())
            .collect();
        assert_eq!(names, ["read_dir", "now", "output"]);
        assert!(body.get("tool_choice").is_none(), "{body}");
        // With extended thinking (which refuses a forcing choice): offered, not forced.
        let thinking = claude(kedge_core::settings::ModelSettings {
            thinking: Some(kedge_core::settings::Thinking {
                budget_tokens: 1024,
            }),
            cache: true,
            ..Default::default()
        });
        let mut call = call_with(&thinking, &context);
        call.tools = &[];
        call.output_schema = Some(&schema);
        call.system = "";
        let body = request_body(&call);
        assert_eq!(body["tools"][0]["name"], "output");
        assert_eq!(
            body["tools"][0]["cache_control"],
            json!({"type": "ephemeral"})
        );
        assert!(body.get("tool_choice").is_none(), "{body}");
        assert_eq!(body["system"][0]["text"], OUTPUT_INSTRUCTION);
        // No schema, or one that is not an object: no tool, the prompt as it was.
        call.output_schema = None;
        assert!(request_body(&call).get("tools").is_none());
        let array = json!({"type": "array"});
        call.output_schema = Some(&array);
        let body = request_body(&call);
        assert!(
            body.get("tools").is_none() && body.get("system").is_none(),
            "{body}"
        );
    }

    #[test]
    fn an_answer_through_the_output_tool_streams_as_text() {
        let stream = concat!(
            "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n",
            "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"output\",\"input\":{}}}\n\n",
            "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"answer\\\": \"}}\n\n",
            "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"\\\"42\\\"}\"}}\n\n",
            "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\"},\"usage\":{\"output_tokens\":5}}\n\n",
            "data: {\"type\":\"message_stop\"}\n\n",
        );
        for output_tool in [true, false] {
            let mut parser = SseParser::new();
            let mut decoder = if output_tool {
                Decoder::with_output_tool()
            } else {
                Decoder::default()
            };
            let mut text = String::new();
            let mut sink = |d: Delta| {
                if let Delta::Text(t) = d {
                    text.push_str(&t);
                }
            };
            for ev in parser.push(stream.as_bytes()).expect("lines") {
                decoder.on_event(&ev, &mut sink).expect("decodes");
            }
            let r = answer_from_output_tool(decoder.finish().expect("complete"));
            assert_eq!(r.message.text, r#"{"answer":"42"}"#);
            assert_eq!(r.finish, FinishReason::Stop);
            if output_tool {
                assert_eq!(text, r#"{"answer": "42"}"#, "streamed as it came");
            } else {
                assert!(text.is_empty(), "a tool's input is not text: {text}");
            }
        }
    }

    #[test]
    fn a_call_of_the_output_tool_is_the_answer_and_is_never_a_tool_call() {
        let call = |id: &str, name: &str, arguments: Value| ToolCall {
            call_id: id.into(),
            name: name.into(),
            arguments,
        };
        let response = |calls: Vec<ToolCall>| ModelResponse {
            message: AssistantMessage {
                text: "Here it is.".into(),
                tool_calls: calls,
                thinking: vec![ThinkingBlock::RedactedThinking { data: "x".into() }],
            },
            usage: Usage::default(),
            finish: FinishReason::ToolCalls,
        };
        // Alone: the input is the answer, the turn a final one; thinking kept.
        let r = answer_from_output_tool(response(vec![call(
            "toolu_1",
            "output",
            json!({"answer": "42"}),
        )]));
        assert_eq!(r.message.text, r#"{"answer":"42"}"#);
        assert!(r.message.tool_calls.is_empty());
        assert_eq!(r.finish, FinishReason::Stop);
        assert_eq!(r.message.thinking.len(), 1);
        // With other calls: those go on, the output call is not dispatched.
        let r = answer_from_output_tool(response(vec![
            call("toolu_1", "read_file", json!({"path": "a"})),
            call("toolu_2", "output", json!({"answer": "early"})),
        ]));
        assert_eq!(r.message.tool_calls.len(), 1);
        assert_eq!(r.message.tool_calls[0].name, "read_file");
        assert_eq!(r.finish, FinishReason::ToolCalls);
        // Input that was not JSON stays raw (validation then says so).
        let r = answer_from_output_tool(response(vec![call(
            "toolu_1",
            "output",
            Value::String("{oops".into()),
        )]));
        assert_eq!(r.message.text, "{oops");
        // No output call: unchanged.
        let plain = response(vec![call("toolu_1", "now", json!({}))]);
        assert_eq!(answer_from_output_tool(plain.clone()), plain);
    }
}
