//! The answer: the `chat.completion` body, or its stream of `chat.completion.chunk` frames.

use serde_json::{Value, json};

use crate::reply::{Output, pieces, sse};

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
