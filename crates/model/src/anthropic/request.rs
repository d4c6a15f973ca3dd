//! The request body of a Messages call: the normalized conversation as content blocks, the
//! system prompt, the tools with their `tool_choice`, and the settings (see the module's
//! documentation for the rules).

use std::borrow::Cow;

use kedge_core::agent::OUTPUT_TOOL;
use kedge_core::event::ThinkingBlock;
use kedge_core::fold::ChatMessage;
use kedge_core::settings::ToolChoice;
use serde::Serialize;
use serde_json::{Value, json};

use super::OUTPUT_INSTRUCTION;
use super::output::output_tool;
use crate::ModelCall;
use crate::context::{EMPTY_PLACEHOLDER, history_arguments, normalize};

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
pub(super) struct Ephemeral {
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
pub(super) struct Tool<'a> {
    pub(super) name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    pub(super) description: &'a str,
    pub(super) input_schema: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) cache_control: Option<Ephemeral>,
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
    let cache = call.spec.settings.cache;
    let messages = messages_of(turns_of(context), cache);
    let output_tool = output_tool(call);
    let system = system_of(call, output_tool.as_ref(), cache);
    let s = &call.spec.settings;
    let (tools, tool_choice) = tools_of(call, output_tool, cache);
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

/// The conversation as turns: consecutive same-role messages merged into one, each turn's
/// tool results kept apart from its other blocks.
fn turns_of<'a>(context: &'a [Cow<'_, ChatMessage>]) -> Vec<Turn<'a>> {
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
    turns
}

/// The turns as messages, tool results first; with `cache`, the last block marked as the end
/// of the cached prefix.
fn messages_of(turns: Vec<Turn<'_>>, cache: bool) -> Vec<Message<'_>> {
    let mut messages: Vec<Message<'_>> = turns
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
    messages
}

/// `system`: the prompt, ending with [`OUTPUT_INSTRUCTION`] when the call offers the `output`
/// tool; none when blank; with `cache`, one text block marked as cached.
fn system_of<'a>(
    call: &'a ModelCall<'_>,
    output_tool: Option<&Tool<'a>>,
    cache: bool,
) -> Option<System<'a>> {
    let system: Cow<'a, str> = match output_tool {
        Some(_) if call.system.trim().is_empty() => Cow::Borrowed(OUTPUT_INSTRUCTION),
        Some(_) => Cow::Owned(format!("{}\n\n{OUTPUT_INSTRUCTION}", call.system)),
        None => Cow::Borrowed(call.system),
    };
    if system.trim().is_empty() {
        None
    } else if cache {
        Some(System::Cached([SystemBlock {
            kind: "text",
            text: system,
            cache_control: EPHEMERAL,
        }]))
    } else {
        Some(System::Plain(system))
    }
}

/// The agent's tools, then the `output` tool when the call offers it, and the `tool_choice`
/// (only with tools).
fn tools_of<'a>(
    call: &'a ModelCall<'_>,
    output_tool: Option<Tool<'a>>,
    cache: bool,
) -> (Vec<Tool<'a>>, Option<Value>) {
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
    (tools, tool_choice)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{call_with, conversation};
    use kedge_core::event::{ModelSpec, Provider};

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
