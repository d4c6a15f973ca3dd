//! The streamed response: its events decoded and the message reassembled from them.

use std::collections::BTreeMap;

use kedge_core::agent::OUTPUT_TOOL;
use kedge_core::decide::ModelResponse;
use kedge_core::event::{AssistantMessage, FinishReason, ThinkingBlock, ToolCall, Usage};
use serde::Deserialize;
use serde_json::Value;

use crate::Delta;
use crate::context::parse_arguments;
use crate::error::{ErrorBody, ModelError, ModelErrorKind};
use crate::sse::SseEvent;

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
    use kedge_core::event::ErrorClass;
    use serde_json::json;

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
}
