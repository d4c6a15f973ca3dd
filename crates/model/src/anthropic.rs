//! Anthropic Messages (`POST <base>/messages`), streamed.
//!
//! Request: `system` at the top level (omitted when empty), `max_tokens` (required), and the
//! [normalized](crate::context) conversation as content blocks, with consecutive same-role turns
//! merged into one message:
//! - assistant: a `text` block when the text is not blank, then one `tool_use` block per call
//!   (`input` is always an object);
//! - tool results: `tool_result` blocks (`is_error` when set; no `content` when empty) in the
//!   *next* user message, always before that message's other blocks, so a user message that
//!   arrived after the results is merged in behind them;
//! - user: a `text` block when the text is not blank; a message left with no block at all gets
//!   [`crate::EMPTY_PLACEHOLDER`] (text blocks must be non-empty).
//!
//! Tool ids are sent as they came from the provider; one that does not match `^[a-zA-Z0-9_-]+$`
//! (never the case for Anthropic's own ids) has its other characters replaced by `_`, on the
//! `tool_use` and its `tool_result` alike.
//!
//! Settings (`model.settings`): `temperature`, `top_p`, `stop_sequences`, `thinking: {type:
//! enabled, budget_tokens}`, `tool_choice` (`auto`, `none`, `any`, `tool` + `name`, see
//! [`crate::effective_tool_choice`]; `disable_parallel_tool_use` for `parallel_tool_calls:
//! false`) only with `tools`. With `cache`, `cache_control: {type: ephemeral}` marks the system
//! prompt (then sent as one text block), the last tool and the last block of the last message:
//! three breakpoints of the four allowed, so each step of a long run reads the prefix the previous
//! step wrote. Thinking blocks of an assistant turn come first in its content, exactly as
//! received (thinking text and signature, or redacted data).
//!
//! Structured output (an agent's `output_schema`; Anthropic has no `response_format`): the
//! schema is offered as the input schema of one more tool, `output`, after the agent's own, and
//! the system prompt ends with [`OUTPUT_INSTRUCTION`]. The call is forced (`tool_choice: {type:
//! tool, name: output}`) only when it is the only tool and thinking is off (the API refuses a
//! forcing choice with thinking); otherwise it is offered. A call to it is the answer
//! ([`answer_from_output_tool`]): its input becomes the turn's text and the call is removed, so
//! it is never dispatched and never needs a `tool_result`.
//!
//! Response: `message_start`, per block `content_block_start` / `content_block_delta`
//! (`text_delta`, `input_json_delta`, `thinking_delta`, `signature_delta`) / `content_block_stop`, `message_delta` (stop reason,
//! output tokens), `message_stop`; `ping` ignored; `error` → [`ModelError`]. Input tokens count
//! cache reads and writes too (`input_tokens + cache_creation_input_tokens +
//! cache_read_input_tokens`), since all of them are billed input.

use std::borrow::Cow;
use std::collections::BTreeMap;

use kedge_core::agent::OUTPUT_TOOL;
use kedge_core::decide::ModelResponse;
use kedge_core::event::{AssistantMessage, FinishReason, ThinkingBlock, ToolCall, Usage};
use kedge_core::fold::ChatMessage;
use kedge_core::settings::ToolChoice;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::context::{EMPTY_PLACEHOLDER, history_arguments, normalize, parse_arguments};
use crate::error::{ErrorBody, ModelError, ModelErrorKind};
use crate::sse::SseEvent;
use crate::{Delta, ModelCall};

/// The public endpoint.
pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";

/// The `anthropic-version` header sent with every request.
pub const API_VERSION: &str = "2023-06-01";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    User,
    Assistant,
}

/// One message under construction: `tool_result` blocks are kept apart so they always come
/// first.
#[derive(Debug)]
struct Turn<'a> {
    role: Role,
    results: Vec<Content<'a>>,
    blocks: Vec<Content<'a>>,
}

/// `cache_control: {type: ephemeral}`.
#[derive(Debug, Clone, Copy, Serialize)]
struct Ephemeral {
    #[serde(rename = "type")]
    kind: &'static str,
}

const EPHEMERAL: Ephemeral = Ephemeral { kind: "ephemeral" };

/// A content block, borrowed from the conversation: the body is serialized straight from
/// the run's messages ([`request_json`]), not through a `Value` tree of them per step.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Content<'a> {
    Text {
        text: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_control: Option<Ephemeral>,
    },
    Thinking {
        thinking: &'a str,
        signature: &'a str,
    },
    RedactedThinking {
        data: &'a str,
    },
    ToolUse {
        id: String,
        name: &'a str,
        input: Cow<'a, Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_control: Option<Ephemeral>,
    },
    ToolResult {
        tool_use_id: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        content: Option<&'a str>,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        is_error: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_control: Option<Ephemeral>,
    },
}

impl Content<'_> {
    /// Marks the block as the end of the cached prefix; a thinking block cannot be marked.
    fn cache(&mut self) {
        match self {
            Content::Text { cache_control, .. }
            | Content::ToolUse { cache_control, .. }
            | Content::ToolResult { cache_control, .. } => *cache_control = Some(EPHEMERAL),
            Content::Thinking { .. } | Content::RedactedThinking { .. } => {}
        }
    }
}

#[derive(Debug, Serialize)]
struct Message<'a> {
    role: &'static str,
    content: Vec<Content<'a>>,
}

/// `system`: the prompt, or with `cache` one text block marked as cached.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum System<'a> {
    Plain(Cow<'a, str>),
    Cached([SystemBlock<'a>; 1]),
}

#[derive(Debug, Serialize)]
struct SystemBlock<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: Cow<'a, str>,
    cache_control: Ephemeral,
}

/// A tool definition, its schema borrowed from the agent (or the `output_schema`).
#[derive(Debug, Serialize)]
struct Tool<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    description: &'a str,
    input_schema: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_control: Option<Ephemeral>,
}

#[derive(Debug, Serialize)]
struct Thinking {
    #[serde(rename = "type")]
    kind: &'static str,
    budget_tokens: u32,
}

/// The request body.
#[derive(Debug, Serialize)]
struct Body<'a> {
    model: &'a str,
    max_tokens: u32,
    stream: bool,
    messages: Vec<Message<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<System<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<Tool<'a>>,
    /// Only with `tools`.
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f64>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    stop_sequences: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    thinking: Option<Thinking>,
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
    let mut turns: Vec<Turn<'a>> = Vec::with_capacity(context.len());
    for message in context {
        match &**message {
            ChatMessage::User { text } => {
                let t = turn(&mut turns, Role::User);
                if !text.trim().is_empty() {
                    t.blocks.push(Content::Text {
                        text,
                        cache_control: None,
                    });
                }
            }
            ChatMessage::Assistant { message } => {
                let t = turn(&mut turns, Role::Assistant);
                // Thinking blocks first, exactly as received (the API checks the signature).
                for block in &message.thinking {
                    t.blocks.push(match block {
                        ThinkingBlock::Thinking {
                            thinking,
                            signature,
                        } => Content::Thinking {
                            thinking,
                            signature,
                        },
                        ThinkingBlock::RedactedThinking { data } => {
                            Content::RedactedThinking { data }
                        }
                    });
                }
                if !message.text.trim().is_empty() {
                    t.blocks.push(Content::Text {
                        text: &message.text,
                        cache_control: None,
                    });
                }
                for c in &message.tool_calls {
                    t.blocks.push(Content::ToolUse {
                        id: tool_id(&c.call_id),
                        name: &c.name,
                        input: history_arguments(&c.arguments),
                        cache_control: None,
                    });
                }
            }
            ChatMessage::Tool {
                call_id,
                content,
                is_error,
            } => {
                turn(&mut turns, Role::User)
                    .results
                    .push(Content::ToolResult {
                        tool_use_id: tool_id(call_id),
                        content: Some(content.as_str()).filter(|c| !c.is_empty()),
                        is_error: *is_error,
                        cache_control: None,
                    });
            }
        }
    }
    let cache = call.spec.settings.cache;
    let mut messages: Vec<Message<'a>> = turns
        .into_iter()
        .map(|t| {
            let mut content = t.results;
            content.extend(t.blocks);
            if content.is_empty() {
                content.push(Content::Text {
                    text: EMPTY_PLACEHOLDER,
                    cache_control: None,
                });
            }
            let role = match t.role {
                Role::User => "user",
                Role::Assistant => "assistant",
            };
            Message { role, content }
        })
        .collect();
    if cache
        // The conversation so far: the next step reads it from the cache.
        && let Some(block) = messages.last_mut().and_then(|m| m.content.last_mut())
    {
        block.cache();
    }
    let output_tool = output_tool(call);
    let system: Cow<'a, str> = match output_tool {
        Some(_) if call.system.trim().is_empty() => Cow::Borrowed(OUTPUT_INSTRUCTION),
        Some(_) => Cow::Owned(format!("{}\n\n{OUTPUT_INSTRUCTION}", call.system)),
        None => Cow::Borrowed(call.system),
    };
    let system = if system.trim().is_empty() {
        None
    } else if cache {
        Some(System::Cached([SystemBlock {
            kind: "text",
            text: system,
            cache_control: EPHEMERAL,
        }]))
    } else {
        Some(System::Plain(system))
    };
    let s = &call.spec.settings;
    let mut tools: Vec<Tool<'a>> = call
        .tools
        .iter()
        .map(|t| Tool {
            name: &t.name,
            description: &t.description,
            input_schema: &t.parameters,
            cache_control: None,
        })
        .collect();
    tools.extend(output_tool);
    let mut tool_choice = None;
    if !tools.is_empty() {
        if cache && let Some(last) = tools.last_mut() {
            // Caches every tool definition (they precede the system prompt in the prefix).
            last.cache_control = Some(EPHEMERAL);
        }
        let serial = s.parallel_tool_calls == Some(false);
        let choice = if call.tools.is_empty() {
            // Only the `output` tool: the answer is forced through it, except with extended
            // thinking, which the API refuses with a forcing tool choice (the model is told
            // to use it instead, and a plain-text answer is validated all the same).
            (s.thinking.is_none()).then(|| ToolChoice::Tool(OUTPUT_TOOL.to_owned()))
        } else {
            // The agent's own tools come first: the `output` tool is offered, never forced.
            crate::effective_tool_choice(call)
        };
        tool_choice = match choice {
            None if serial => Some(json!({"type": "auto"})),
            None => None,
            Some(ToolChoice::Auto) => Some(json!({"type": "auto"})),
            Some(ToolChoice::None) => Some(json!({"type": "none"})),
            Some(ToolChoice::Required) => Some(json!({"type": "any"})),
            Some(ToolChoice::Tool(name)) => Some(json!({"type": "tool", "name": name})),
        };
        if let Some(tc) = &mut tool_choice
            && serial
            && tc["type"] != "none"
        {
            tc["disable_parallel_tool_use"] = true.into();
        }
    }
    Body {
        model: &call.spec.name,
        max_tokens: call.max_output_tokens,
        stream: true,
        messages,
        system,
        tools,
        tool_choice,
        temperature: s.temperature,
        top_p: s.top_p,
        stop_sequences: &s.stop,
        thinking: s.thinking.map(|t| Thinking {
            kind: "enabled",
            budget_tokens: t.budget_tokens,
        }),
    }
}

/// What the system prompt of an agent with an `output_schema` ends with.
pub const OUTPUT_INSTRUCTION: &str = "Give your final answer by calling the `output` tool: its \
     input is your answer, and it must match the tool's input schema. Do not write the answer \
     as text.";

/// The `output` tool of a call whose agent declares an `output_schema` (Anthropic has no
/// `response_format`): the schema as its input schema. `None` without a schema, or for one the
/// API would refuse as an input schema (not `"type": "object"`; `kedge agents put` refuses
/// those for Anthropic agents): the answer is then validated as text only.
fn output_tool<'a>(call: &'a ModelCall<'_>) -> Option<Tool<'a>> {
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

/// The message `role` continues: the last one when it has that role, else a new one.
fn turn<'t, 'a>(turns: &'t mut Vec<Turn<'a>>, role: Role) -> &'t mut Turn<'a> {
    if turns.last().is_none_or(|t| t.role != role) {
        turns.push(Turn {
            role,
            results: Vec::new(),
            blocks: Vec::new(),
        });
    }
    let last = turns.len() - 1;
    &mut turns[last]
}

/// A tool id as the API accepts it (`^[a-zA-Z0-9_-]+$`).
fn tool_id(id: &str) -> String {
    if id.is_empty() {
        return "_".to_owned();
    }
    id.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum StreamEvent {
    MessageStart {
        message: StartMessage,
    },
    ContentBlockStart {
        index: u64,
        content_block: BlockStart,
    },
    ContentBlockDelta {
        index: u64,
        delta: BlockDelta,
    },
    ContentBlockStop {},
    MessageDelta {
        #[serde(default)]
        delta: Option<MessageDelta>,
        #[serde(default)]
        usage: Option<StreamUsage>,
    },
    MessageStop {},
    Ping {},
    Error {
        error: ErrorBody,
    },
    #[serde(other)]
    Unknown,
}

#[derive(Debug, Deserialize)]
struct StartMessage {
    #[serde(default)]
    usage: Option<StreamUsage>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum BlockStart {
    Text {
        #[serde(default)]
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        #[serde(default)]
        input: Option<Value>,
    },
    Thinking {
        #[serde(default)]
        thinking: String,
        #[serde(default)]
        signature: String,
    },
    RedactedThinking {
        #[serde(default)]
        data: String,
    },
    /// `server_tool_use`, …: not part of the provider-neutral response.
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum BlockDelta {
    TextDelta {
        text: String,
    },
    InputJsonDelta {
        partial_json: String,
    },
    ThinkingDelta {
        thinking: String,
    },
    SignatureDelta {
        signature: String,
    },
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
struct MessageDelta {
    #[serde(default)]
    stop_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

#[derive(Debug)]
enum Block {
    Text(String),
    ToolUse {
        id: String,
        name: String,
        start_input: Option<Value>,
        json: String,
    },
    Thinking {
        thinking: String,
        signature: String,
    },
    RedactedThinking(String),
    Other,
}

/// Reassembles one streamed message.
#[derive(Debug, Default)]
pub(crate) struct Decoder {
    blocks: BTreeMap<u64, Block>,
    /// The latest value of each usage field (`message_delta` counts are cumulative).
    input: u64,
    cache_creation: u64,
    cache_read: u64,
    output: u64,
    stop_reason: Option<String>,
    done: bool,
    /// The call offered the `output` tool: its input is the answer, streamed as text deltas.
    output_tool: bool,
}

impl Decoder {
    /// A decoder for a call that offered the `output` tool (an `output_schema`): the answer
    /// given through it streams as [`Delta::Text`], as a text answer would.
    pub fn with_output_tool() -> Decoder {
        Decoder {
            output_tool: true,
            ..Decoder::default()
        }
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    pub fn on_event(
        &mut self,
        event: &SseEvent,
        on_delta: &mut dyn FnMut(Delta),
    ) -> Result<(), ModelError> {
        if self.done || event.data.trim().is_empty() {
            return Ok(());
        }
        let parsed: StreamEvent = serde_json::from_str(&event.data).map_err(|e| {
            ModelError::retryable(
                ModelErrorKind::Protocol,
                format!(
                    "undecodable `{}` event: {e}",
                    event.event.as_deref().unwrap_or("message")
                ),
            )
        })?;
        match parsed {
            StreamEvent::MessageStart { message } => {
                if let Some(u) = message.usage {
                    self.usage(&u);
                }
            }
            StreamEvent::ContentBlockStart {
                index,
                content_block,
            } => {
                let block = match content_block {
                    BlockStart::Text { text } => {
                        if !text.is_empty() {
                            on_delta(Delta::Text(text.clone()));
                        }
                        Block::Text(text)
                    }
                    BlockStart::ToolUse { id, name, input } => {
                        on_delta(Delta::ToolCall {
                            call_id: id.clone(),
                            name: name.clone(),
                        });
                        Block::ToolUse {
                            id,
                            name,
                            start_input: input,
                            json: String::new(),
                        }
                    }
                    BlockStart::Thinking {
                        thinking,
                        signature,
                    } => Block::Thinking {
                        thinking,
                        signature,
                    },
                    BlockStart::RedactedThinking { data } => Block::RedactedThinking(data),
                    BlockStart::Other => Block::Other,
                };
                self.blocks.insert(index, block);
            }
            StreamEvent::ContentBlockDelta { index, delta } => {
                match (self.blocks.get_mut(&index), delta) {
                    (Some(Block::Text(text)), BlockDelta::TextDelta { text: piece }) => {
                        if !piece.is_empty() {
                            text.push_str(&piece);
                            on_delta(Delta::Text(piece));
                        }
                    }
                    (
                        Some(Block::ToolUse { json, name, .. }),
                        BlockDelta::InputJsonDelta { partial_json },
                    ) => {
                        if self.output_tool && name == OUTPUT_TOOL && !partial_json.is_empty() {
                            on_delta(Delta::Text(partial_json.clone()));
                        }
                        json.push_str(&partial_json);
                    }
                    (
                        Some(Block::Thinking { thinking, .. }),
                        BlockDelta::ThinkingDelta { thinking: piece },
                    ) => {
                        thinking.push_str(&piece);
                    }
                    (
                        Some(Block::Thinking { signature, .. }),
                        BlockDelta::SignatureDelta { signature: piece },
                    ) => {
                        signature.push_str(&piece);
                    }
                    (Some(Block::Other), _) | (_, BlockDelta::Other) => {}
                    (_, _) => {
                        return Err(ModelError::retryable(
                            ModelErrorKind::Protocol,
                            format!("delta for content block {index} does not match its type"),
                        ));
                    }
                }
            }
            StreamEvent::MessageDelta { delta, usage } => {
                if let Some(reason) = delta.and_then(|d| d.stop_reason) {
                    self.stop_reason = Some(reason);
                }
                if let Some(u) = usage {
                    self.usage(&u);
                }
            }
            StreamEvent::MessageStop {} => self.done = true,
            StreamEvent::Error { error } => return Err(ModelError::from_stream_error(&error)),
            StreamEvent::ContentBlockStop {} | StreamEvent::Ping {} | StreamEvent::Unknown => {}
        }
        Ok(())
    }

    fn usage(&mut self, u: &StreamUsage) {
        if let Some(v) = u.input_tokens {
            self.input = v;
        }
        if let Some(v) = u.cache_creation_input_tokens {
            self.cache_creation = v;
        }
        if let Some(v) = u.cache_read_input_tokens {
            self.cache_read = v;
        }
        if let Some(v) = u.output_tokens {
            self.output = v;
        }
    }

    pub fn finish(self) -> Result<ModelResponse, ModelError> {
        if !self.done {
            return Err(ModelError::retryable(
                ModelErrorKind::StreamEnded,
                "stream ended early (no message_stop)",
            ));
        }
        let mut text = String::new();
        let mut tool_calls = Vec::new();
        let mut thinking_blocks = Vec::new();
        for block in self.blocks.into_values() {
            match block {
                Block::Text(t) => text.push_str(&t),
                Block::ToolUse {
                    id,
                    name,
                    start_input,
                    json,
                } => {
                    let arguments = match start_input {
                        Some(input) if json.trim().is_empty() && input.is_object() => input,
                        _ => parse_arguments(&json),
                    };
                    tool_calls.push(ToolCall {
                        call_id: id,
                        name,
                        arguments,
                    });
                }
                Block::Thinking {
                    thinking,
                    signature,
                } => thinking_blocks.push(ThinkingBlock::Thinking {
                    thinking,
                    signature,
                }),
                Block::RedactedThinking(data) => {
                    thinking_blocks.push(ThinkingBlock::RedactedThinking { data })
                }
                Block::Other => {}
            }
        }
        Ok(ModelResponse {
            message: AssistantMessage {
                text,
                tool_calls,
                thinking: thinking_blocks,
            },
            usage: Usage {
                input_tokens: self
                    .input
                    .saturating_add(self.cache_creation)
                    .saturating_add(self.cache_read),
                output_tokens: self.output,
                cost: None,
            },
            finish: match self.stop_reason.as_deref() {
                Some("end_turn" | "stop_sequence") => FinishReason::Stop,
                Some("tool_use") => FinishReason::ToolCalls,
                Some("max_tokens") => FinishReason::Length,
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

    const STREAM: &str = concat!(
        "event: message_start\n",
        "data: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-test\",\"stop_reason\":null,\"usage\":{\"input_tokens\":40,\"cache_read_input_tokens\":2,\"output_tokens\":1}}}\n\n",
        "event: content_block_start\n",
        "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
        "event: ping\n",
        "data: {\"type\":\"ping\"}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Let me \"}}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"check \u{1f50d}\"}}\n\n",
        "event: content_block_stop\n",
        "data: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
        "event: content_block_start\n",
        "data: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_A\",\"name\":\"read_file\",\"input\":{}}}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"\"}}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\\\"pa\"}}\n\n",
        "event: content_block_delta\n",
        "data: {\"type\":\"content_block_delta\",\"index\":1,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"th\\\":\\\"/etc\\\"}\"}}\n\n",
        "event: content_block_stop\n",
        "data: {\"type\":\"content_block_stop\",\"index\":1}\n\n",
        "event: content_block_start\n",
        "data: {\"type\":\"content_block_start\",\"index\":2,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_B\",\"name\":\"now\",\"input\":{}}}\n\n",
        "event: content_block_stop\n",
        "data: {\"type\":\"content_block_stop\",\"index\":2}\n\n",
        "event: message_delta\n",
        "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"tool_use\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":17}}\n\n",
        "event: message_stop\n",
        "data: {\"type\":\"message_stop\"}\n\n",
    );

    fn decode(stream: &[u8], piece: usize) -> (Result<ModelResponse, ModelError>, Vec<Delta>) {
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
                        call_id: "toolu_A".into(),
                        name: "read_file".into(),
                        arguments: json!({"path": "/etc"}),
                    },
                    ToolCall {
                        call_id: "toolu_B".into(),
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
                call_id: "toolu_A".into(),
                name: "read_file".into()
            }));
        }
    }

    #[test]
    fn a_stream_without_message_stop_is_an_error() {
        let cut = STREAM.replace(
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
            "",
        );
        let e = decode(cut.as_bytes(), 11).0.expect_err("no message_stop");
        assert_eq!(e.class, ErrorClass::Retryable);
        assert_eq!(e.kind, ModelErrorKind::StreamEnded);
    }

    #[test]
    fn an_error_event_is_classified() {
        let stream = concat!(
            "event: message_start\n",
            "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n",
            "event: error\n",
            "data: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n",
        );
        let e = decode(stream.as_bytes(), 6).0.expect_err("error event");
        assert_eq!(e.class, ErrorClass::Retryable);
        assert_eq!(e.kind, ModelErrorKind::Provider);
        assert_eq!(e.message, "error in stream: overloaded_error: Overloaded");
    }

    #[test]
    fn unknown_blocks_and_events_are_skipped() {
        let stream = concat!(
            "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":1}}}\n\n",
            "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\",\"signature\":\"\"}}\n\n",
            "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"hmm\"}}\n\n",
            "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"signature_delta\",\"signature\":\"x\"}}\n\n",
            "data: {\"type\":\"brand_new_event\",\"x\":1}\n\n",
            "data: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"text\",\"text\":\"ok\"}}\n\n",
            "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"output_tokens\":5}}\n\n",
            "data: {\"type\":\"message_stop\"}\n\n",
        );
        let r = decode(stream.as_bytes(), 13).0.expect("decodes");
        assert_eq!(r.message.text, "ok");
        assert_eq!(
            r.message.thinking,
            vec![ThinkingBlock::Thinking {
                thinking: "hmm".into(),
                signature: "x".into()
            }],
            "thinking blocks are kept, signature included"
        );
        assert_eq!(r.finish, FinishReason::Length);
        assert_eq!(
            r.usage,
            Usage {
                input_tokens: 3,
                output_tokens: 5,
                cost: None,
            }
        );
    }

    #[test]
    fn the_request_is_built_for_the_strict_api() {
        let spec = ModelSpec {
            provider: Provider::Anthropic,
            name: "claude-test".into(),
            base_url: None,
            settings: Default::default(),
            price: None,
        };
        let mut context = conversation();
        if let ChatMessage::Assistant { message } = &mut context[1] {
            message.tool_calls[1].call_id = "call.2".into();
        }
        if let ChatMessage::Tool { call_id, .. } = &mut context[3] {
            *call_id = "call.2".into();
        }
        let body = request_body(&call_with(&spec, &context));
        assert_eq!(
            body,
            json!({
                "model": "claude-test",
                "max_tokens": 256,
                "stream": true,
                "system": "Be brief.",
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "List /etc and tell me the time."}]},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "call_1", "name": "read_dir", "input": {"path": "/etc"}},
                        {"type": "tool_use", "id": "call_2", "name": "now", "input": {}},
                    ]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "call_1", "content": "hosts\npasswd"},
                        {"type": "tool_result", "tool_use_id": "call_2", "content": "clock unavailable", "is_error": true},
                        {"type": "text", "text": "Also, be quick."},
                    ]},
                    {"role": "assistant", "content": [
                        {"type": "text", "text": "Working on it."},
                        {"type": "tool_use", "id": "call_3", "name": "now", "input": {"raw_arguments": "{oops"}},
                    ]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "call_3"},
                    ]},
                    {"role": "assistant", "content": [{"type": "text", "text": "(empty)"}]},
                    {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
                ],
                "tools": [
                    {"name": "read_dir", "description": "List a directory",
                     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}},
                    {"name": "now", "input_schema": {"type": "object", "properties": {}}},
                ],
            })
        );
        // What goes on the wire (serialized from the borrowed conversation) is that body.
        let sent = request_json(&call_with(&spec, &context)).expect("serializes");
        let sent: Value = serde_json::from_slice(&sent).expect("JSON");
        assert_eq!(sent, body);
    }

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

    #[test]
    fn blank_user_text_next_to_results_is_left_out_and_ids_are_sanitized() {
        assert_eq!(tool_id("toolu_01-AbC"), "toolu_01-AbC");
        assert_eq!(tool_id("call.2/x"), "call_2_x");
        assert_eq!(tool_id(""), "_");
        let spec = ModelSpec {
            provider: Provider::Anthropic,
            name: "claude-test".into(),
            base_url: None,
            settings: Default::default(),
            price: None,
        };
        let context = vec![
            ChatMessage::User { text: " ".into() },
            ChatMessage::User { text: "".into() },
        ];
        let mut call = call_with(&spec, &context);
        call.system = "";
        let body = request_body(&call);
        assert!(body.get("system").is_none());
        assert_eq!(
            body["messages"],
            json!([{"role": "user", "content": [{"type": "text", "text": "(empty)"}]}])
        );
    }
}
