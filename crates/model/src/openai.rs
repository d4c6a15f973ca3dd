//! OpenAI Chat Completions (`POST <base>/chat/completions`), streamed.
//!
//! Request: the system prompt first (omitted when empty), then the [normalized](crate::context)
//! conversation — `user`, `assistant` (`content` null when it has tool calls and no text;
//! [`EMPTY_PLACEHOLDER`] when it has neither), `tool` (`"ERROR: "` prefixed to the content of an
//! error result, since the API has no error flag). `tools` is omitted when there are none. The
//! output cap is `max_completion_tokens` on OpenAI's own endpoint (reasoning models reject
//! `max_tokens`) and `max_tokens` on any other base URL (compatible servers such as llama.cpp and
//! vLLM read that one).
//!
//! Settings (`model.settings`): `temperature`, `top_p`, `stop`, `seed`, `reasoning_effort` as
//! named; `tool_choice` (`"auto"`, `"none"`, `"required"`, `{"type": "function", "function":
//! {"name"}}`, see [`crate::effective_tool_choice`]) and `parallel_tool_calls` only with `tools`.
//!
//! Response: `data:` chunks until `data: [DONE]`; text from `delta.content`, tool calls
//! reassembled from `delta.tool_calls[]` by `index`, usage from the extra `choices: []` chunk
//! that `stream_options.include_usage` asks for.

use std::borrow::Cow;
use std::collections::BTreeMap;

use kedge_core::decide::ModelResponse;
use kedge_core::event::{AssistantMessage, FinishReason, ToolCall, Usage};
use kedge_core::fold::ChatMessage;
use kedge_core::settings::ToolChoice;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::context::{EMPTY_PLACEHOLDER, history_arguments, non_empty, normalize, parse_arguments};
use crate::error::{ErrorBody, ModelError, ModelErrorKind};
use crate::sse::SseEvent;
use crate::{Delta, ModelCall};

/// The public endpoint.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

/// Prefix of the content of a tool result that reports an error.
pub const ERROR_PREFIX: &str = "ERROR: ";

/// One message of the request, borrowed from the conversation: the conversation is serialized
/// straight into the body ([`request_json`]) instead of through a `Value` tree of it per step.
#[derive(Debug, Serialize)]
#[serde(tag = "role", rename_all = "lowercase")]
enum Message<'a> {
    System {
        content: &'a str,
    },
    User {
        content: &'a str,
    },
    Assistant {
        /// `null` when the turn has tool calls and no text.
        content: Option<&'a str>,
        #[serde(skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<Call<'a>>,
    },
    Tool {
        tool_call_id: &'a str,
        content: Cow<'a, str>,
    },
}

#[derive(Debug, Serialize)]
struct Call<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: Function<'a>,
}

#[derive(Debug, Serialize)]
struct Function<'a> {
    name: &'a str,
    /// The arguments as a JSON string, as the API has them.
    arguments: String,
}

/// The request body: the messages, then every other field, all borrowed from the call (no
/// `Value` tree, no copy of the tools' schemas per step).
#[derive(Debug, Serialize)]
struct Body<'a> {
    messages: Vec<Message<'a>>,
    model: &'a str,
    stream: bool,
    stream_options: StreamOptions,
    /// The output cap: this on OpenAI's own endpoint, `max_tokens` on any other.
    #[serde(skip_serializing_if = "Option::is_none")]
    max_completion_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Tool<'a>>,
    /// Both are refused without `tools`.
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f64>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    stop: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_effort: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    response_format: Option<ResponseFormat<'a>>,
}

#[derive(Debug, Serialize)]
struct StreamOptions {
    include_usage: bool,
}

#[derive(Debug, Serialize)]
struct Tool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: ToolFunction<'a>,
}

#[derive(Debug, Serialize)]
struct ToolFunction<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    description: &'a str,
    parameters: &'a Value,
}

/// Not strict: strict mode accepts only a subset of JSON Schema, and Kedge validates the answer
/// against the whole schema in any case.
#[derive(Debug, Serialize)]
struct ResponseFormat<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    json_schema: JsonSchemaFormat<'a>,
}

#[derive(Debug, Serialize)]
struct JsonSchemaFormat<'a> {
    name: &'static str,
    schema: &'a Value,
    strict: bool,
}

/// The request body for `call`, as JSON bytes.
pub fn request_json(call: &ModelCall<'_>) -> Result<Vec<u8>, serde_json::Error> {
    let context = normalize(call.context);
    serde_json::to_vec(&body(call, &context))
}

/// The request body for `call` (what [`request_json`] writes).
pub fn request_body(call: &ModelCall<'_>) -> Value {
    let context = normalize(call.context);
    serde_json::to_value(body(call, &context)).unwrap_or_default()
}

fn body<'a>(call: &'a ModelCall<'_>, context: &'a [Cow<'_, ChatMessage>]) -> Body<'a> {
    let mut messages = Vec::with_capacity(context.len() + 1);
    if !call.system.trim().is_empty() {
        messages.push(Message::System {
            content: call.system,
        });
    }
    for message in context {
        messages.push(match &**message {
            ChatMessage::User { text } => Message::User {
                content: non_empty(text),
            },
            ChatMessage::Assistant { message } if message.tool_calls.is_empty() => {
                Message::Assistant {
                    content: Some(non_empty(&message.text)),
                    tool_calls: Vec::new(),
                }
            }
            ChatMessage::Assistant { message } => Message::Assistant {
                content: Some(message.text.as_str()).filter(|t| !t.is_empty()),
                tool_calls: message
                    .tool_calls
                    .iter()
                    .map(|c| Call {
                        id: &c.call_id,
                        kind: "function",
                        function: Function {
                            name: &c.name,
                            arguments: history_arguments(&c.arguments).to_string(),
                        },
                    })
                    .collect(),
            },
            ChatMessage::Tool {
                call_id,
                content,
                is_error,
            } => Message::Tool {
                tool_call_id: call_id,
                content: match (is_error, content.is_empty()) {
                    (true, _) => Cow::Owned(format!("{ERROR_PREFIX}{content}")),
                    (false, true) => Cow::Borrowed(EMPTY_PLACEHOLDER),
                    (false, false) => Cow::Borrowed(content.as_str()),
                },
            },
        });
    }
    assemble(call, messages)
}

/// The body around `messages`: the model, the output cap, the tools and the settings, all
/// borrowed from `call`.
fn assemble<'a>(call: &'a ModelCall<'_>, messages: Vec<Message<'a>>) -> Body<'a> {
    let public = is_public_endpoint(call.spec.base_url.as_deref());
    let cap = Some(call.max_output_tokens);
    let s = &call.spec.settings;
    let tools: Vec<Tool<'a>> = call
        .tools
        .iter()
        .map(|t| Tool {
            kind: "function",
            function: ToolFunction {
                name: &t.name,
                description: &t.description,
                parameters: &t.parameters,
            },
        })
        .collect();
    let with_tools = !tools.is_empty();
    Body {
        messages,
        model: &call.spec.name,
        stream: true,
        stream_options: StreamOptions {
            include_usage: true,
        },
        max_completion_tokens: cap.filter(|_| public),
        max_tokens: cap.filter(|_| !public),
        tools,
        tool_choice: crate::effective_tool_choice(call)
            .filter(|_| with_tools)
            .map(|choice| match choice {
                ToolChoice::Auto => "auto".into(),
                ToolChoice::None => "none".into(),
                ToolChoice::Required => "required".into(),
                ToolChoice::Tool(name) => json!({"type": "function", "function": {"name": name}}),
            }),
        parallel_tool_calls: s.parallel_tool_calls.filter(|_| with_tools),
        temperature: s.temperature,
        top_p: s.top_p,
        stop: &s.stop,
        seed: s.seed,
        reasoning_effort: s.reasoning_effort.map(|e| e.as_str()),
        response_format: call.output_schema.map(|schema| ResponseFormat {
            kind: "json_schema",
            json_schema: JsonSchemaFormat {
                name: OUTPUT_SCHEMA_NAME,
                schema,
                strict: false,
            },
        }),
    }
}

/// `response_format.json_schema.name` of the agent's `output_schema`.
pub const OUTPUT_SCHEMA_NAME: &str = "output";

fn is_public_endpoint(base_url: Option<&str>) -> bool {
    base_url.is_none_or(|u| u.contains("://api.openai.com"))
}

#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Option<Vec<Choice>>,
    #[serde(default)]
    usage: Option<ChunkUsage>,
    #[serde(default)]
    error: Option<ErrorBody>,
}

#[derive(Debug, Deserialize)]
struct Choice {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default)]
    delta: Option<ChoiceDelta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ChoiceDelta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Deserialize)]
struct ToolCallDelta {
    #[serde(default)]
    index: Option<u64>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<FunctionDelta>,
}

#[derive(Debug, Deserialize)]
struct FunctionDelta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ChunkUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

#[derive(Debug, Default)]
struct PartialCall {
    id: Option<String>,
    name: Option<String>,
    arguments: String,
    announced: bool,
}

/// Reassembles one streamed completion.
#[derive(Debug, Default)]
pub(crate) struct Decoder {
    text: String,
    calls: BTreeMap<u64, PartialCall>,
    usage: Option<Usage>,
    finish: Option<String>,
    done: bool,
}

impl Decoder {
    pub fn is_done(&self) -> bool {
        self.done
    }

    pub fn on_event(
        &mut self,
        event: &SseEvent,
        on_delta: &mut dyn FnMut(Delta),
    ) -> Result<(), ModelError> {
        let data = event.data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        if self.done || data.is_empty() {
            return Ok(());
        }
        let chunk: Chunk = serde_json::from_str(data).map_err(|e| {
            ModelError::retryable(
                ModelErrorKind::Protocol,
                format!("undecodable stream chunk: {e}"),
            )
        })?;
        if let Some(error) = &chunk.error {
            return Err(ModelError::from_stream_error(error));
        }
        if let Some(u) = chunk.usage {
            self.usage = Some(Usage {
                input_tokens: u.prompt_tokens.unwrap_or(0),
                output_tokens: u.completion_tokens.unwrap_or(0),
                cost: None,
            });
        }
        // Only one choice is asked for (no `n`); ignore any other.
        for choice in chunk
            .choices
            .unwrap_or_default()
            .into_iter()
            .filter(|c| c.index.unwrap_or(0) == 0)
        {
            if let Some(reason) = choice.finish_reason {
                self.finish = Some(reason);
            }
            let Some(delta) = choice.delta else { continue };
            for piece in [delta.content, delta.refusal].into_iter().flatten() {
                if !piece.is_empty() {
                    self.text.push_str(&piece);
                    on_delta(Delta::Text(piece));
                }
            }
            for (position, fragment) in delta.tool_calls.into_iter().flatten().enumerate() {
                self.tool_fragment(position, fragment, on_delta);
            }
        }
        Ok(())
    }

    fn tool_fragment(
        &mut self,
        position: usize,
        fragment: ToolCallDelta,
        on_delta: &mut dyn FnMut(Delta),
    ) {
        // `index` is required by the API; a server that omits it gets a new slot for a fragment
        // with an id, and the last slot otherwise.
        let index = match fragment.index {
            Some(i) => i,
            None => match (&fragment.id, self.calls.keys().next_back()) {
                (None, Some(last)) => *last,
                (_, last) => last.map_or(position as u64, |l| l + 1),
            },
        };
        let call = self.calls.entry(index).or_default();
        if let Some(id) = fragment.id.filter(|id| !id.is_empty()) {
            call.id.get_or_insert(id);
        }
        if let Some(function) = fragment.function {
            if let Some(name) = function.name.filter(|n| !n.is_empty()) {
                call.name.get_or_insert(name);
            }
            if let Some(arguments) = function.arguments {
                call.arguments.push_str(&arguments);
            }
        }
        if !call.announced
            && let Some(name) = &call.name
        {
            call.announced = true;
            on_delta(Delta::ToolCall {
                call_id: call.id.clone().unwrap_or_default(),
                name: name.clone(),
            });
        }
    }

    pub fn finish(self) -> Result<ModelResponse, ModelError> {
        if !self.done {
            return Err(ModelError::retryable(
                ModelErrorKind::StreamEnded,
                "stream ended early (no [DONE])",
            ));
        }
        let mut tool_calls = Vec::with_capacity(self.calls.len());
        for (index, call) in self.calls {
            let Some(name) = call.name else {
                return Err(ModelError::retryable(
                    ModelErrorKind::Protocol,
                    format!("tool call {index} has no function name"),
                ));
            };
            tool_calls.push(ToolCall {
                call_id: call.id.unwrap_or_else(|| format!("call_{index}")),
                name,
                arguments: parse_arguments(&call.arguments),
            });
        }
        Ok(ModelResponse {
            message: AssistantMessage {
                text: self.text,
                tool_calls,
                thinking: Vec::new(),
            },
            usage: self.usage.unwrap_or_default(),
            finish: match self.finish.as_deref() {
                Some("stop") => FinishReason::Stop,
                Some("tool_calls" | "function_call") => FinishReason::ToolCalls,
                Some("length") => FinishReason::Length,
                _ => FinishReason::Other,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::SseParser;
    use crate::tests::{call_with, conversation};
    use kedge_core::event::{ErrorClass, ModelSpec, Provider};

    /// A captured stream: text, two parallel tool calls with arguments in pieces, the usage
    /// chunk, `[DONE]`.
    pub(crate) const STREAM: &str = concat!(
        "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Let me \"},\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"check \u{1f50d}\"},\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_A\",\"type\":\"function\",\"function\":{\"name\":\"read_file\",\"arguments\":\"\"}}]},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"pa\"}}]},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":1,\"id\":\"call_B\",\"type\":\"function\",\"function\":{\"name\":\"now\",\"arguments\":\"\"}}]},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"th\\\":\\\"/etc\\\"}\"}}]},\"finish_reason\":null}]}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}],\"usage\":null}\n\n",
        "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":42,\"completion_tokens\":17,\"total_tokens\":59}}\n\n",
        "data: [DONE]\n\n",
    );

    pub(crate) fn decode(
        stream: &[u8],
        piece: usize,
    ) -> (Result<ModelResponse, ModelError>, Vec<Delta>) {
        let mut parser = SseParser::new();
        let mut decoder = Decoder::default();
        let mut deltas = Vec::new();
        let mut sink = |d: Delta| deltas.push(d);
        for chunk in stream.chunks(piece) {
            for ev in parser.push(chunk).expect("line length") {
                if let Err(e) = decoder.on_event(&ev, &mut sink) {
                    return (Err(e), deltas);
                }
            }
        }
        if let Some(ev) = parser.finish()
            && let Err(e) = decoder.on_event(&ev, &mut sink)
        {
            return (Err(e), deltas);
        }
        (decoder.finish(), deltas)
    }

    #[test]
    fn a_stream_is_reassembled_whatever_the_chunking() {
        let expected = ModelResponse {
            message: AssistantMessage {
                text: "Let me check \u{1f50d}".into(),
                tool_calls: vec![
                    ToolCall {
                        call_id: "call_A".into(),
                        name: "read_file".into(),
                        arguments: json!({"path": "/etc"}),
                    },
                    ToolCall {
                        call_id: "call_B".into(),
                        name: "now".into(),
                        arguments: json!({}),
                    },
                ],
                thinking: Vec::new(),
            },
            usage: Usage {
                input_tokens: 42,
                output_tokens: 17,
                cost: None,
            },
            finish: FinishReason::ToolCalls,
        };
        for piece in [1, 2, 3, 7, 64, STREAM.len()] {
            let (result, deltas) = decode(STREAM.as_bytes(), piece);
            assert_eq!(result.expect("decodes"), expected, "piece {piece}");
            let text: String = deltas
                .iter()
                .filter_map(|d| match d {
                    Delta::Text(t) => Some(t.as_str()),
                    _ => None,
                })
                .collect();
            assert_eq!(text, "Let me check \u{1f50d}");
            assert!(deltas.contains(&Delta::ToolCall {
                call_id: "call_B".into(),
                name: "now".into()
            }));
        }
    }

    #[test]
    fn a_stream_without_done_is_an_error_not_a_truncated_success() {
        let cut = STREAM.replace("data: [DONE]\n\n", "");
        let (result, _) = decode(cut.as_bytes(), 5);
        let e = result.expect_err("no [DONE]");
        assert_eq!(e.class, ErrorClass::Retryable);
        assert_eq!(e.kind, ModelErrorKind::StreamEnded);
        let half = &STREAM.as_bytes()[..STREAM.len() / 2];
        let e = decode(half, 9).0.expect_err("cut in half");
        assert_eq!(e.kind, ModelErrorKind::StreamEnded);
    }

    #[test]
    fn an_error_chunk_mid_stream_is_classified() {
        let stream = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n",
            "data: {\"error\":{\"message\":\"The server had an error\",\"type\":\"server_error\",\"param\":null,\"code\":null}}\n\n",
        );
        let e = decode(stream.as_bytes(), 4).0.expect_err("error");
        assert_eq!(e.class, ErrorClass::Retryable);
        assert_eq!(e.kind, ModelErrorKind::Provider);
        assert!(
            e.message.contains("The server had an error"),
            "{}",
            e.message
        );
    }

    #[test]
    fn invalid_argument_json_is_kept_as_a_string() {
        let stream = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\": \"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n",
            "data: [DONE]\n\n",
        );
        let r = decode(stream.as_bytes(), 3).0.expect("decodes");
        assert_eq!(r.message.tool_calls[0].arguments, json!("{\"a\": "));
        assert_eq!(r.finish, FinishReason::Length);
        assert_eq!(r.usage, Usage::default());
    }

    #[test]
    fn the_request_is_built_for_the_strict_api() {
        let spec = ModelSpec {
            provider: Provider::Openai,
            name: "gpt-test".into(),
            base_url: Some("http://127.0.0.1:9/v1".into()),
            settings: Default::default(),
            price: None,
        };
        let context = conversation();
        let body = request_body(&call_with(&spec, &context));
        assert_eq!(
            body,
            json!({
                "model": "gpt-test",
                "stream": true,
                "stream_options": {"include_usage": true},
                "max_tokens": 256,
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "List /etc and tell me the time."},
                    {"role": "assistant", "content": null, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "read_dir", "arguments": "{\"path\":\"/etc\"}"}},
                        {"id": "call_2", "type": "function",
                         "function": {"name": "now", "arguments": "{}"}},
                    ]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "hosts\npasswd"},
                    {"role": "tool", "tool_call_id": "call_2", "content": "ERROR: clock unavailable"},
                    {"role": "user", "content": "Also, be quick."},
                    {"role": "assistant", "content": "Working on it.", "tool_calls": [
                        {"id": "call_3", "type": "function",
                         "function": {"name": "now", "arguments": "{\"raw_arguments\":\"{oops\"}"}},
                    ]},
                    {"role": "tool", "tool_call_id": "call_3", "content": "(empty)"},
                    {"role": "assistant", "content": "(empty)"},
                    {"role": "user", "content": "Thanks"},
                ],
                "tools": [
                    {"type": "function", "function": {"name": "read_dir", "description": "List a directory",
                     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
                    {"type": "function", "function": {"name": "now",
                     "parameters": {"type": "object", "properties": {}}}},
                ],
            })
        );
        // What goes on the wire (serialized from the borrowed conversation) is that body.
        let sent = request_json(&call_with(&spec, &context)).expect("serializes");
        let sent: Value = serde_json::from_slice(&sent).expect("JSON");
        assert_eq!(sent, body);
    }

    #[test]
    fn the_public_endpoint_gets_max_completion_tokens_and_no_empty_parts() {
        let spec = ModelSpec {
            provider: Provider::Openai,
            name: "gpt-test".into(),
            base_url: None,
            settings: Default::default(),
            price: None,
        };
        let context = vec![ChatMessage::User { text: "hi".into() }];
        let mut call = call_with(&spec, &context);
        call.system = "";
        call.tools = &[];
        let body = request_body(&call);
        assert_eq!(body["max_completion_tokens"], 256);
        assert!(body.get("max_tokens").is_none());
        assert!(body.get("tools").is_none());
        assert_eq!(body["messages"], json!([{"role": "user", "content": "hi"}]));
    }

    #[test]
    fn an_output_schema_is_requested_as_response_format_json_schema() {
        let spec = ModelSpec {
            provider: Provider::Openai,
            name: "gpt-test".into(),
            base_url: None,
            settings: Default::default(),
            price: None,
        };
        let context = vec![ChatMessage::User { text: "hi".into() }];
        let mut call = call_with(&spec, &context);
        assert!(request_body(&call).get("response_format").is_none());
        let schema = json!({"type": "object", "properties": {"answer": {"type": "string"}}});
        call.output_schema = Some(&schema);
        assert_eq!(
            request_body(&call)["response_format"],
            json!({"type": "json_schema",
                   "json_schema": {"name": "output", "schema": schema, "strict": false}})
        );
    }
}
