//! The answer: the `message` body, or its stream of SSE events.

use serde_json::{Value, json};

use crate::reply::{Output, pieces, sse, thinking_signature};

fn stop_reason(out: &Output) -> &'static str {
    if out.calls.is_empty() {
        "end_turn"
    } else {
        "tool_use"
    }
}

fn content(out: &Output) -> Vec<Value> {
    let mut blocks = Vec::with_capacity(out.calls.len() + 2);
    if let Some(thinking) = &out.thinking {
        blocks.push(json!({"type": "thinking", "thinking": thinking,
                           "signature": thinking_signature(thinking)}));
    }
    if let Some(text) = &out.text {
        blocks.push(json!({"type": "text", "text": text}));
    }
    for call in &out.calls {
        blocks.push(
            json!({"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}),
        );
    }
    blocks
}

/// The non-streaming `message` body.
pub(crate) fn message(out: &Output) -> Value {
    json!({
        "id": out.id,
        "type": "message",
        "role": "assistant",
        "model": out.model,
        "content": content(out),
        "stop_reason": stop_reason(out),
        "stop_sequence": null,
        "usage": { "input_tokens": out.input_tokens, "output_tokens": out.output_tokens },
    })
}

/// The SSE events of a streamed answer, `message_stop` included.
pub(crate) fn stream_frames(out: &Output) -> Vec<String> {
    let event = |name: &str, data: Value| sse(Some(name), &data.to_string());
    let mut frames = vec![
        event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": out.id, "type": "message", "role": "assistant", "model": out.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": { "input_tokens": out.input_tokens, "output_tokens": 1 },
            }}),
        ),
        event("ping", json!({"type": "ping"})),
    ];
    let mut index = 0;
    if let Some(thinking) = &out.thinking {
        frames.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        ));
        for piece in pieces(thinking) {
            frames.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "thinking_delta", "thinking": piece}}),
            ));
        }
        frames.push(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
                   "delta": {"type": "signature_delta", "signature": thinking_signature(thinking)}}),
        ));
        frames.push(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
        index += 1;
    }
    if let Some(text) = &out.text {
        frames.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "text", "text": ""}}),
        ));
        for piece in pieces(text) {
            frames.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "text_delta", "text": piece}}),
            ));
        }
        frames.push(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
        index += 1;
    }
    for call in &out.calls {
        frames.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index,
                   "content_block": {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}}),
        ));
        for piece in pieces(&call.arguments) {
            frames.push(event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": piece}}),
            ));
        }
        frames.push(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
        index += 1;
    }
    frames.push(event(
        "message_delta",
        json!({"type": "message_delta",
               "delta": {"stop_reason": stop_reason(out), "stop_sequence": null},
               "usage": {"output_tokens": out.output_tokens}}),
    ));
    frames.push(event("message_stop", json!({"type": "message_stop"})));
    frames
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_frames_split_tool_input_and_end_with_message_stop() {
        let out = Output {
            id: "msg_x".into(),
            created: 1,
            model: "m".into(),
            text: Some("Reading.".into()),
            thinking: None,
            calls: vec![crate::reply::Call {
                id: "toolu_1".into(),
                name: "read_file".into(),
                arguments: "{\"path\":\"a\"}".into(),
                input: serde_json::Map::new(),
            }],
            input_tokens: 3,
            output_tokens: 4,
        };
        let frames = stream_frames(&out);
        let names: Vec<&str> = frames
            .iter()
            .map(|f| {
                f.lines()
                    .next()
                    .unwrap_or_default()
                    .trim_start_matches("event: ")
            })
            .collect();
        assert_eq!(names.first(), Some(&"message_start"));
        assert!(names.contains(&"ping"));
        assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
        let partial: Vec<Value> = frames
            .iter()
            .filter(|f| f.contains("input_json_delta"))
            .map(|f| {
                let data = f
                    .lines()
                    .nth(1)
                    .unwrap_or_default()
                    .trim_start_matches("data: ");
                serde_json::from_str::<Value>(data).expect("json")
            })
            .collect();
        assert!(partial.len() >= 2);
        let joined: String = partial
            .iter()
            .filter_map(|d| d["delta"]["partial_json"].as_str())
            .collect();
        assert_eq!(joined, "{\"path\":\"a\"}");
    }
}
