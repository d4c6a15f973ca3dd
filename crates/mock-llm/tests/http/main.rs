//! The mock over real HTTP (reqwest against an in-process `MockHandle`): strictness in both
//! formats, scripted conversations streamed and not, faults, counters and control endpoints;
//! `trouble` puts outages, rate limits and context windows in front of it.

use std::time::{Duration, Instant};

use kedge_mock_llm::{MockHandle, Scripts};
use serde_json::{Value, json};

/// A provider's bad day: the trouble endpoint, rate limits and context windows.
mod trouble;

const DEMO: &str = r#"{ "models": {
  "mock-demo": {
    "steps": [
      {"tool_calls": [{"name": "list_files", "arguments": {}},
                      {"name": "read_file", "arguments": {"path": "notes.txt"}}]},
      {"text": "Let me ask.", "tool_calls": [{"name": "ask_user", "arguments": {"question": "Proceed?"}}]},
      {"text": "All done."}
    ],
    "rules": [
      {"when_last_user_contains": "tides", "respond": {"text": "High tide at noon."}},
      {"when_last_tool_result_contains": "PERMISSION DENIED", "respond": {"text": "I cannot read it."}}
    ],
    "default": {"text": "Nothing more to do."}
  },
  "mock-faults": {
    "steps": [
      {"text": "after a 429", "fault": {"status": 429, "retry_after_ms": 1500, "times": 1}},
      {"text": "after a 529", "fault": {"status": 529, "times": 2}}
    ]
  },
  "mock-hang": {"default": {"text": "never", "hang": true}},
  "mock-slow": {"default": {"text": "late", "delay_ms": 200}},
  "mock-drop": {"default": {"text": "This answer will be cut off before it ends.",
                            "tool_calls": [{"name": "read_file", "arguments": {"path": "a-rather-long-file-name.txt"}}],
                            "drop_after_chunks": 3, "fail_times": 1}},
  "mock-stream-error": {"default": {"text": "This answer breaks in the middle of the stream.", "stream_error": true}}
} }"#;

async fn start() -> MockHandle {
    MockHandle::start(Scripts::from_json(DEMO).expect("demo script")).await
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client")
}

async fn openai(mock: &MockHandle, request_id: Option<&str>, body: &Value) -> reqwest::Response {
    let mut req = client()
        .post(format!("{}/v1/chat/completions", mock.base_url()))
        .bearer_auth("sk-test")
        .json(body);
    if let Some(id) = request_id {
        req = req.header("X-Kedge-Request-Id", id);
    }
    req.send().await.expect("send")
}

async fn anthropic(mock: &MockHandle, request_id: Option<&str>, body: &Value) -> reqwest::Response {
    let mut req = client()
        .post(format!("{}/v1/messages", mock.base_url()))
        .header("x-api-key", "sk-ant-test")
        .header("anthropic-version", "2023-06-01")
        .json(body);
    if let Some(id) = request_id {
        req = req.header("X-Kedge-Request-Id", id);
    }
    req.send().await.expect("send")
}

async fn json_of(resp: reqwest::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    (status, resp.json().await.expect("json body"))
}

/// (event name, data) of each SSE event.
fn sse_events(text: &str) -> Vec<(Option<String>, String)> {
    text.split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .map(|block| {
            let mut event = None;
            let mut data = String::new();
            for line in block.lines() {
                if let Some(e) = line.strip_prefix("event: ") {
                    event = Some(e.to_owned());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data.push_str(d);
                }
            }
            (event, data)
        })
        .collect()
}

/// Reads a body chunk by chunk until it ends (`Ok`) or the connection breaks (`Err`, with
/// what arrived before).
async fn read_body(mut resp: reqwest::Response) -> Result<String, String> {
    let mut got = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => got.extend_from_slice(&chunk),
            Ok(None) => return Ok(String::from_utf8(got).expect("utf-8")),
            Err(_) => return Err(String::from_utf8_lossy(&got).into_owned()),
        }
    }
}

// ---------------------------------------------------------------- strictness, OpenAI

fn oa_user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}
fn oa_calls(ids: &[&str]) -> Value {
    let calls: Vec<Value> = ids
        .iter()
        .map(|id| json!({"id": id, "type": "function", "function": {"name": "read_file", "arguments": "{}"}}))
        .collect();
    json!({"role": "assistant", "content": null, "tool_calls": calls})
}
fn oa_tool(id: &str) -> Value {
    json!({"role": "tool", "tool_call_id": id, "content": "ok"})
}

#[tokio::test]
async fn openai_rejects_what_the_real_api_rejects() {
    let mock = start().await;
    let m = |messages: Value| json!({"model": "mock-demo", "messages": messages});
    let cases: Vec<(&str, Value, &str, Option<&str>)> = vec![
        (
            "unanswered tool_calls",
            m(json!([
                oa_user("go"),
                oa_calls(&["call_1", "call_2"]),
                oa_tool("call_1"),
                oa_user("?")
            ])),
            "The following tool_call_ids did not have response messages: call_2",
            Some("messages.[3].role"),
        ),
        (
            "tool without preceding tool_calls",
            m(json!([oa_user("go"), oa_tool("call_1")])),
            "messages with role 'tool' must be a response to a preceeding message with 'tool_calls'.",
            Some("messages.[1].role"),
        ),
        (
            "tool_call_id not in previous tool_calls",
            m(json!([
                oa_user("go"),
                oa_calls(&["call_1"]),
                oa_tool("call_1"),
                oa_tool("call_7")
            ])),
            "'tool_call_id' of 'call_7' not found in 'tool_calls' of previous message.",
            Some("messages.[3].tool_call_id"),
        ),
        (
            "tool message without content",
            m(
                json!([oa_user("go"), oa_calls(&["call_1"]), {"role": "tool", "tool_call_id": "call_1"}]),
            ),
            "Missing required parameter: 'messages.[2].content'.",
            Some("messages.[2].content"),
        ),
        (
            "tool message without tool_call_id",
            m(json!([oa_user("go"), oa_calls(&["call_1"]), {"role": "tool", "content": "x"}])),
            "Missing required parameter: 'messages.[2].tool_call_id'.",
            Some("messages.[2].tool_call_id"),
        ),
        (
            "assistant without content or tool_calls",
            m(json!([oa_user("go"), {"role": "assistant", "content": null}, oa_user("again")])),
            "Invalid value for 'content': expected a string, got null.",
            Some("messages.[1].content"),
        ),
        (
            "invalid function name in tools",
            json!({"model": "mock-demo", "messages": [oa_user("go")],
                   "tools": [{"type": "function", "function": {"name": "fs.read", "parameters": {}}}]}),
            "string does not match pattern",
            Some("tools[0].function.name"),
        ),
        (
            "invalid function name in tool_calls",
            m(json!([oa_user("go"),
                     {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "x".repeat(65), "arguments": "{}"}}]},
                     oa_tool("call_1")])),
            "string too long",
            Some("messages[1].tool_calls[0].function.name"),
        ),
        (
            "missing model",
            json!({"messages": [oa_user("go")]}),
            "you must provide a model parameter",
            None,
        ),
        (
            "missing messages",
            json!({"model": "mock-demo"}),
            "Missing required parameter: 'messages'.",
            Some("messages"),
        ),
    ];
    for (name, body, message, param) in &cases {
        let (status, body) = json_of(openai(&mock, Some("req_bad"), body).await).await;
        assert_eq!(status, 400, "{name}: {body}");
        let error = &body["error"];
        assert_eq!(error["type"], "invalid_request_error", "{name}");
        assert!(
            error["message"]
                .as_str()
                .is_some_and(|m| m.contains(message)),
            "{name}: {body}"
        );
        assert_eq!(error["param"].as_str(), *param, "{name}: {body}");
        assert!(
            error.get("code").is_some_and(Value::is_null),
            "{name}: {body}"
        );
    }
    // Rejected calls are calls: all counted.
    assert_eq!(mock.calls_for("req_bad"), cases.len() as u64);

    // Unknown model: 404 model_not_found.
    let (status, body) = json_of(
        openai(
            &mock,
            None,
            &json!({"model": "gpt-nope", "messages": [oa_user("go")]}),
        )
        .await,
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "model_not_found");

    // No key: 401, not counted.
    let before = mock.total_calls();
    let resp = client()
        .post(format!("{}/v1/chat/completions", mock.base_url()))
        .json(&json!({"model": "mock-demo", "messages": [oa_user("go")]}))
        .send()
        .await
        .expect("send");
    let (status, body) = json_of(resp).await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("API key"))
    );
    assert_eq!(mock.total_calls(), before);

    // Not JSON: 400, counted under model "".
    let resp = client()
        .post(format!("{}/v1/chat/completions", mock.base_url()))
        .bearer_auth("k")
        .body("{not json")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 400);
    assert_eq!(mock.calls().by_model.get(""), Some(&2)); // the missing-model case and this one
}

// ---------------------------------------------------------------- strictness, Anthropic

fn an_user(content: Value) -> Value {
    json!({"role": "user", "content": content})
}
fn an_uses(ids: &[&str]) -> Value {
    let blocks: Vec<Value> = ids
        .iter()
        .map(|id| json!({"type": "tool_use", "id": id, "name": "read_file", "input": {}}))
        .collect();
    json!({"role": "assistant", "content": blocks})
}
fn an_result(id: &str) -> Value {
    json!({"type": "tool_result", "tool_use_id": id, "content": "ok"})
}

#[tokio::test]
async fn anthropic_rejects_what_the_real_api_rejects() {
    let mock = start().await;
    let m = |messages: Value| json!({"model": "mock-demo", "max_tokens": 64, "messages": messages});
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "tool_use without tool_result in the next message",
            m(json!([
                an_user(json!("go")),
                an_uses(&["toolu_1", "toolu_2"]),
                an_user(json!([an_result("toolu_1")]))
            ])),
            "messages.2: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_2.",
        ),
        (
            "tool_result after text",
            m(json!([
                an_user(json!("go")),
                an_uses(&["toolu_1"]),
                an_user(json!([{"type": "text", "text": "here"}, an_result("toolu_1")]))
            ])),
            "messages.2: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1.",
        ),
        (
            "tool_result for an unknown tool_use",
            m(json!([
                an_user(json!("go")),
                an_uses(&["toolu_1"]),
                an_user(json!([an_result("toolu_1"), an_result("toolu_8")]))
            ])),
            "messages.2.content.1: unexpected `tool_use_id` found in `tool_result` blocks: toolu_8.",
        ),
        (
            "id outside the pattern",
            m(json!([
                an_user(json!("go")),
                an_uses(&["toolu:1"]),
                an_user(json!([an_result("toolu:1")]))
            ])),
            "messages.1.content.0.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'",
        ),
        (
            "empty text block",
            m(json!([an_user(json!([{"type": "text", "text": ""}]))])),
            "messages: text content blocks must be non-empty",
        ),
        (
            "missing max_tokens",
            json!({"model": "mock-demo", "messages": [an_user(json!("go"))]}),
            "max_tokens: Field required",
        ),
    ];
    for (name, body, message) in &cases {
        let (status, body) = json_of(anthropic(&mock, Some("req_bad"), body).await).await;
        assert_eq!(status, 400, "{name}: {body}");
        assert_eq!(body["type"], "error", "{name}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{name}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(message)),
            "{name}: {body}"
        );
        assert!(
            body["request_id"]
                .as_str()
                .is_some_and(|r| r.starts_with("req_")),
            "{name}"
        );
    }
    assert_eq!(mock.calls_for("req_bad"), cases.len() as u64);

    // Same-role turns are merged, not rejected: results split over two user messages pass.
    let merged = m(json!([
        an_user(json!("go")),
        an_uses(&["toolu_1"]),
        an_uses(&["toolu_2"]),
        an_user(json!([an_result("toolu_1")])),
        an_user(json!([an_result("toolu_2")])),
    ]));
    let (status, body) = json_of(anthropic(&mock, None, &merged).await).await;
    assert_eq!(status, 200, "{body}");

    // Unknown model: 404 not_found_error.
    let (status, body) = json_of(
        anthropic(
            &mock,
            None,
            &json!({"model": "claude-nope", "max_tokens": 5, "messages": [an_user(json!("go"))]}),
        )
        .await,
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["type"], "not_found_error");

    // Missing key: 401 authentication_error; missing version: 400.
    let send = |key: bool, version: bool| {
        let mut req = client()
            .post(format!("{}/v1/messages", mock.base_url()))
            .json(&m(json!([an_user(json!("go"))])));
        if key {
            req = req.header("x-api-key", "k");
        }
        if version {
            req = req.header("anthropic-version", "2023-06-01");
        }
        req.send()
    };
    let (status, body) = json_of(send(false, true).await.expect("send")).await;
    assert_eq!(
        (status, body["error"]["type"].as_str()),
        (401, Some("authentication_error"))
    );
    let (status, body) = json_of(send(true, false).await.expect("send")).await;
    assert_eq!(status, 400);
    assert_eq!(
        body["error"]["message"],
        "anthropic-version: header is required"
    );
}

// ---------------------------------------------------------------- scripted conversations

/// Plays the demo script over OpenAI, answering each tool call, and returns the final text.
async fn openai_conversation(mock: &MockHandle, stream: bool) {
    let mut messages = vec![
        json!({"role": "system", "content": "Be brief."}),
        oa_user("Tidy my notes"),
    ];
    let mut seen_ids = Vec::new();
    for step in 0..3 {
        let mut body = json!({"model": "mock-demo", "messages": messages,
            "tools": [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]});
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let resp = openai(mock, Some(&format!("req_oa_{stream}_{step}")), &body).await;
        assert_eq!(resp.status().as_u16(), 200);
        let message = if stream {
            assert!(
                resp.headers()["content-type"]
                    .to_str()
                    .is_ok_and(|c| c.starts_with("text/event-stream"))
            );
            reassemble_openai(&read_body(resp).await.expect("complete stream"))
        } else {
            let (_, body) = json_of(resp).await;
            assert_eq!(body["object"], "chat.completion");
            assert!(
                body["id"]
                    .as_str()
                    .is_some_and(|id| id.starts_with("chatcmpl-"))
            );
            let usage = &body["usage"];
            assert_eq!(
                usage["total_tokens"].as_u64(),
                Some(
                    usage["prompt_tokens"].as_u64().unwrap_or(0)
                        + usage["completion_tokens"].as_u64().unwrap_or(0)
                )
            );
            let finish = body["choices"][0]["finish_reason"].clone();
            let mut message = body["choices"][0]["message"].clone();
            message["finish_reason"] = finish;
            message
        };
        let calls = message["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        match step {
            0 => {
                assert_eq!(calls.len(), 2, "{message}");
                assert_eq!(message["finish_reason"], "tool_calls");
                assert_eq!(calls[1]["function"]["name"], "read_file");
                let args: Value = serde_json::from_str(
                    calls[1]["function"]["arguments"].as_str().expect("string"),
                )
                .expect("arguments are JSON");
                assert_eq!(args, json!({"path": "notes.txt"}));
            }
            1 => {
                assert_eq!(message["content"], "Let me ask.");
                assert_eq!(calls.len(), 1);
                assert_eq!(calls[0]["function"]["name"], "ask_user");
            }
            _ => {
                assert_eq!(message["content"], "All done.");
                assert_eq!(message["finish_reason"], "stop");
                assert!(calls.is_empty());
            }
        }
        for call in &calls {
            let id = call["id"].as_str().expect("id").to_owned();
            assert!(id.starts_with("call_") && !seen_ids.contains(&id), "{id}");
            seen_ids.push(id);
        }
        let mut assistant = json!({"role": "assistant", "content": message["content"].clone()});
        if !calls.is_empty() {
            assistant["tool_calls"] = json!(calls);
        }
        messages.push(assistant);
        // Answer in reverse order: any order is fine as long as every id is answered.
        for call in calls.iter().rev() {
            messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "done"}));
        }
    }
    // Past the last step: the default.
    messages.push(oa_user("anything else?"));
    let (_, body) = json_of(
        openai(
            mock,
            None,
            &json!({"model": "mock-demo", "messages": messages}),
        )
        .await,
    )
    .await;
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "Nothing more to do."
    );
}

/// Rebuilds an OpenAI assistant message from stream chunks, checking the fragment rules.
fn reassemble_openai(text: &str) -> Value {
    let events = sse_events(text);
    assert_eq!(events.last().map(|(_, d)| d.as_str()), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str(d).expect("chunk json"))
        .collect();
    let usage = chunks.last().expect("usage chunk");
    assert_eq!(usage["choices"], json!([]));
    assert!(
        usage["usage"]["prompt_tokens"]
            .as_u64()
            .is_some_and(|t| t > 0)
    );
    let mut content = String::new();
    let mut calls: Vec<Value> = Vec::new();
    let mut fragments = Vec::new();
    let mut finish = Value::Null;
    for chunk in &chunks[..chunks.len() - 1] {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        let choice = &chunk["choices"][0];
        if !choice["finish_reason"].is_null() {
            assert_eq!(
                choice["delta"],
                json!({}),
                "the finishing chunk has an empty delta"
            );
            finish = choice["finish_reason"].clone();
        }
        if let Some(c) = choice["delta"]["content"].as_str() {
            content.push_str(c);
        }
        for frag in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let index = frag["index"].as_u64().expect("index is required") as usize;
            if let Some(id) = frag.get("id") {
                assert_eq!(index, calls.len());
                calls.push(json!({"id": id, "type": frag["type"],
                    "function": {"name": frag["function"]["name"], "arguments": ""}}));
            } else {
                assert!(
                    frag["function"].get("name").is_none(),
                    "name only in the first fragment"
                );
                let args = calls[index]["function"]["arguments"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
                    + frag["function"]["arguments"]
                        .as_str()
                        .expect("arguments piece");
                calls[index]["function"]["arguments"] = json!(args);
                fragments.push(index);
            }
        }
    }
    for (index, call) in calls.iter().enumerate() {
        assert!(
            fragments.iter().filter(|i| **i == index).count() >= 2,
            "arguments split in ≥2 pieces"
        );
        let args = call["function"]["arguments"].as_str().expect("arguments");
        serde_json::from_str::<Value>(args).expect("reassembled arguments are valid JSON");
    }
    let mut message = json!({"role": "assistant",
        "content": if content.is_empty() { Value::Null } else { json!(content) },
        "finish_reason": finish});
    if !calls.is_empty() {
        message["tool_calls"] = json!(calls);
    }
    message
}

#[tokio::test]
async fn openai_scripted_conversation_non_streaming_and_streaming() {
    let mock = start().await;
    openai_conversation(&mock, false).await;
    openai_conversation(&mock, true).await;
    assert_eq!(mock.calls_for("req_oa_true_1"), 1);
    assert_eq!(mock.requests("mock-demo").len(), 8);
}

#[tokio::test]
async fn the_same_conversation_gets_the_same_answer_when_retried() {
    let mock = start().await;
    let body = json!({"model": "mock-demo", "messages": [
        oa_user("go"), oa_calls(&["call_a", "call_b"]), oa_tool("call_a"), oa_tool("call_b")]});
    for _ in 0..3 {
        let (_, body) = json_of(openai(&mock, Some("req_retry"), &body).await).await;
        assert_eq!(body["choices"][0]["message"]["content"], "Let me ask.");
    }
    assert_eq!(mock.calls_for("req_retry"), 3);
}

async fn anthropic_conversation(mock: &MockHandle, stream: bool) {
    let mut messages = vec![an_user(json!("Tidy my notes"))];
    for step in 0..3 {
        let body = json!({"model": "mock-demo", "max_tokens": 256, "system": "Be brief.",
            "stream": stream, "messages": messages,
            "tools": [{"name": "read_file", "input_schema": {"type": "object"}}]});
        let resp = anthropic(mock, Some(&format!("req_an_{stream}_{step}")), &body).await;
        assert_eq!(resp.status().as_u16(), 200);
        let message = if stream {
            reassemble_anthropic(&read_body(resp).await.expect("complete stream"))
        } else {
            let (_, body) = json_of(resp).await;
            assert_eq!(body["type"], "message");
            assert!(body["id"].as_str().is_some_and(|id| id.starts_with("msg_")));
            assert!(
                body["usage"]["input_tokens"]
                    .as_u64()
                    .is_some_and(|t| t > 0)
            );
            body
        };
        let content = message["content"].as_array().cloned().expect("content");
        let uses: Vec<&Value> = content.iter().filter(|b| b["type"] == "tool_use").collect();
        match step {
            0 => {
                assert_eq!(uses.len(), 2, "{message}");
                assert_eq!(message["stop_reason"], "tool_use");
                assert_eq!(uses[1]["input"], json!({"path": "notes.txt"}));
            }
            1 => {
                assert_eq!(content[0], json!({"type": "text", "text": "Let me ask."}));
                assert_eq!(uses.len(), 1);
            }
            _ => {
                assert_eq!(content, [json!({"type": "text", "text": "All done."})]);
                assert_eq!(message["stop_reason"], "end_turn");
            }
        }
        for u in &uses {
            assert!(u["id"].as_str().is_some_and(|id| id.starts_with("toolu_")));
        }
        messages.push(json!({"role": "assistant", "content": content}));
        if !uses.is_empty() {
            let results: Vec<Value> = uses
                .iter()
                .map(|u| json!({"type": "tool_result", "tool_use_id": u["id"], "content": "done"}))
                .collect();
            messages.push(an_user(json!(results)));
        }
    }
}

/// Rebuilds an Anthropic message from its events, checking the event grammar.
fn reassemble_anthropic(text: &str) -> Value {
    let events = sse_events(text);
    let names: Vec<&str> = events
        .iter()
        .map(|(e, _)| e.as_deref().expect("event name"))
        .collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert!(names.contains(&"ping"));
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"]);
    let mut message = Value::Null;
    let mut partial: Vec<(String, usize)> = Vec::new();
    for (name, data) in &events {
        let data: Value = serde_json::from_str(data).expect("event json");
        assert_eq!(data["type"].as_str(), name.as_deref());
        match data["type"].as_str().unwrap_or_default() {
            "message_start" => message = data["message"].clone(),
            "content_block_start" => {
                let index = data["index"].as_u64().expect("index") as usize;
                let content = message["content"].as_array_mut().expect("content");
                assert_eq!(index, content.len());
                content.push(data["content_block"].clone());
                partial.push((String::new(), 0));
            }
            "content_block_delta" => {
                let index = data["index"].as_u64().expect("index") as usize;
                let delta = &data["delta"];
                match delta["type"].as_str() {
                    Some("text_delta") => {
                        let block = &mut message["content"][index];
                        let text = block["text"].as_str().unwrap_or_default().to_owned()
                            + delta["text"].as_str().expect("text");
                        block["text"] = json!(text);
                    }
                    Some("input_json_delta") => {
                        partial[index]
                            .0
                            .push_str(delta["partial_json"].as_str().expect("partial"));
                        partial[index].1 += 1;
                    }
                    other => panic!("unexpected delta {other:?}"),
                }
            }
            "content_block_stop" => {
                let index = data["index"].as_u64().expect("index") as usize;
                if message["content"][index]["type"] == "tool_use" {
                    assert!(partial[index].1 >= 2, "input_json_delta in ≥2 pieces");
                    message["content"][index]["input"] =
                        serde_json::from_str(&partial[index].0).expect("reassembled input is JSON");
                }
            }
            "message_delta" => {
                message["stop_reason"] = data["delta"]["stop_reason"].clone();
                message["usage"]["output_tokens"] = data["usage"]["output_tokens"].clone();
            }
            "ping" | "message_stop" => {}
            other => panic!("unexpected event {other}"),
        }
    }
    message
}

#[tokio::test]
async fn anthropic_scripted_conversation_non_streaming_and_streaming() {
    let mock = start().await;
    anthropic_conversation(&mock, false).await;
    anthropic_conversation(&mock, true).await;
    assert_eq!(mock.requests("mock-demo").len(), 6);
}

#[tokio::test]
async fn rules_answer_before_steps() {
    let mock = start().await;
    let (_, body) = json_of(
        openai(
            &mock,
            None,
            &json!({"model": "mock-demo", "messages": [oa_user("When are the tides?")]}),
        )
        .await,
    )
    .await;
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "High tide at noon."
    );
    let denied = json!({"model": "mock-demo", "messages": [
        oa_user("go"), oa_calls(&["call_1", "call_2"]), oa_tool("call_1"),
        {"role": "tool", "tool_call_id": "call_2", "content": "PERMISSION DENIED: notes.txt"}]});
    let (_, body) = json_of(openai(&mock, None, &denied).await).await;
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "I cannot read it."
    );

    let (_, body) = json_of(
        anthropic(
            &mock,
            None,
            &json!({"model": "mock-demo", "max_tokens": 9,
            "messages": [an_user(json!([{"type": "text", "text": "tides today?"}]))]}),
        )
        .await,
    )
    .await;
    assert_eq!(body["content"][0]["text"], "High tide at noon.");
    let denied = json!({"model": "mock-demo", "max_tokens": 9, "messages": [
        an_user(json!("go")), an_uses(&["toolu_1"]),
        an_user(json!([{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": true,
                        "content": [{"type": "text", "text": "PERMISSION DENIED"}]}]))]});
    let (_, body) = json_of(anthropic(&mock, None, &denied).await).await;
    assert_eq!(body["content"][0]["text"], "I cannot read it.");
}

// ---------------------------------------------------------------- faults

#[tokio::test]
async fn fault_429_with_retry_after_then_success() {
    let mock = start().await;
    let body = json!({"model": "mock-faults", "messages": [oa_user("go")]});
    let resp = openai(&mock, Some("req_f"), &body).await;
    assert_eq!(resp.status().as_u16(), 429);
    assert_eq!(resp.headers()["retry-after"], "2");
    assert_eq!(resp.headers()["retry-after-ms"], "1500");
    let (_, err) = json_of(resp).await;
    assert_eq!(err["error"]["code"], "rate_limit_exceeded");
    let (status, ok) = json_of(openai(&mock, Some("req_f"), &body).await).await;
    assert_eq!(status, 200);
    assert_eq!(ok["choices"][0]["message"]["content"], "after a 429");
    assert_eq!(mock.calls_for("req_f"), 2);

    // Anthropic shape; the fault count is per (model, step), shared across formats.
    mock.reset();
    let body = json!({"model": "mock-faults", "max_tokens": 9, "messages": [an_user(json!("go"))]});
    let resp = anthropic(&mock, None, &body).await;
    assert_eq!(resp.status().as_u16(), 429);
    assert!(resp.headers().contains_key("request-id"));
    let (_, err) = json_of(resp).await;
    assert_eq!(err["error"]["type"], "rate_limit_error");
    assert_eq!(json_of(anthropic(&mock, None, &body).await).await.0, 200);

    // Step 1 fails twice with 529 overloaded_error (no retry headers without retry_after_ms).
    let body = json!({"model": "mock-faults", "max_tokens": 9, "messages": [
        an_user(json!("go")), {"role": "assistant", "content": "after a 429"}, an_user(json!("more"))]});
    for _ in 0..2 {
        let resp = anthropic(&mock, None, &body).await;
        assert_eq!(resp.status().as_u16(), 529);
        assert!(!resp.headers().contains_key("retry-after"));
        assert_eq!(json_of(resp).await.1["error"]["type"], "overloaded_error");
    }
    let (status, ok) = json_of(anthropic(&mock, None, &body).await).await;
    assert_eq!(
        (status, &ok["content"][0]["text"]),
        (200, &json!("after a 529"))
    );
}

#[tokio::test]
async fn hang_makes_the_client_time_out_and_delay_delays() {
    let mock = start().await;
    let started = Instant::now();
    let err = client()
        .post(format!("{}/v1/chat/completions", mock.base_url()))
        .bearer_auth("k")
        .timeout(Duration::from_millis(300))
        .json(&json!({"model": "mock-hang", "messages": [oa_user("go")]}))
        .send()
        .await
        .expect_err("a hanging call never answers");
    assert!(err.is_timeout(), "{err}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(mock.total_calls(), 1);

    let started = Instant::now();
    let (status, _) = json_of(
        openai(
            &mock,
            None,
            &json!({"model": "mock-slow", "messages": [oa_user("go")]}),
        )
        .await,
    )
    .await;
    assert_eq!(status, 200);
    assert!(started.elapsed() >= Duration::from_millis(200));

    // Dropping the handle stops the server even with a call still hanging.
    let url = mock.base_url();
    let hanging = tokio::spawn(async move {
        client()
            .post(format!("{url}/v1/chat/completions"))
            .bearer_auth("k")
            .json(&json!({"model": "mock-hang", "messages": [oa_user("go")]}))
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(mock);
    let released = tokio::time::timeout(Duration::from_secs(5), hanging)
        .await
        .expect("released at shutdown")
        .expect("task");
    assert_eq!(released.ok(), Some(503));
}

#[tokio::test]
async fn drop_after_chunks_cuts_the_stream() {
    let mock = start().await;
    let body = json!({"model": "mock-drop", "stream": true, "messages": [oa_user("go")]});
    let got = read_body(openai(&mock, None, &body).await)
        .await
        .expect_err("the stream is cut");
    let events = sse_events(&got);
    assert_eq!(events.len(), 3, "{got}");
    assert!(!got.contains("[DONE]"));
    // fail_times: 1, so the next call streams to the end.
    let full = read_body(openai(&mock, None, &body).await)
        .await
        .expect("complete");
    assert!(full.ends_with("data: [DONE]\n\n"));

    mock.reset();
    let body = json!({"model": "mock-drop", "max_tokens": 9, "stream": true, "messages": [an_user(json!("go"))]});
    let got = read_body(anthropic(&mock, None, &body).await)
        .await
        .expect_err("the stream is cut");
    assert_eq!(sse_events(&got).len(), 3, "{got}");
    assert!(!got.contains("message_stop"));

    // Non-streaming: half a body, then the connection closes.
    mock.reset();
    let resp = openai(
        &mock,
        None,
        &json!({"model": "mock-drop", "messages": [oa_user("go")]}),
    )
    .await;
    assert_eq!(resp.status().as_u16(), 200);
    assert!(resp.json::<Value>().await.is_err());
}

#[tokio::test]
async fn stream_error_sends_an_error_event_mid_stream() {
    let mock = start().await;
    let body = json!({"model": "mock-stream-error", "stream": true, "messages": [oa_user("go")]});
    let got = read_body(openai(&mock, None, &body).await)
        .await
        .expect("ends");
    let events = sse_events(&got);
    let (_, last) = events.last().expect("events");
    let last: Value = serde_json::from_str(last).expect("json");
    assert_eq!(last["error"]["type"], "server_error");
    assert!(events.len() > 2 && !got.contains("[DONE]"));

    let body = json!({"model": "mock-stream-error", "max_tokens": 9, "stream": true,
                      "messages": [an_user(json!("go"))]});
    let got = read_body(anthropic(&mock, None, &body).await)
        .await
        .expect("ends");
    let events = sse_events(&got);
    let (name, data) = events.last().expect("events");
    assert_eq!(name.as_deref(), Some("error"));
    assert_eq!(
        serde_json::from_str::<Value>(data).expect("json")["error"]["type"],
        "overloaded_error"
    );
    assert_eq!(events[0].0.as_deref(), Some("message_start"));
}

// ---------------------------------------------------------------- counters and control

#[tokio::test]
async fn counts_per_request_id_and_control_endpoints() {
    let mock = start().await;
    let ok = json!({"model": "mock-demo", "messages": [oa_user("go")]});
    let rejected = json!({"model": "mock-demo", "messages": [oa_user("go"), oa_tool("call_x")]});
    openai(&mock, Some("req_a"), &ok).await;
    openai(&mock, Some("req_a"), &rejected).await;
    openai(&mock, Some("req_b"), &ok).await;
    openai(&mock, None, &ok).await;
    anthropic(
        &mock,
        Some("req_a"),
        &json!({"model": "mock-demo", "max_tokens": 5,
        "messages": [an_user(json!("go"))]}),
    )
    .await;
    assert_eq!(mock.calls_for("req_a"), 3);
    assert_eq!(mock.calls_for("req_b"), 1);
    assert_eq!(mock.calls_for(""), 1);
    assert_eq!(mock.calls_for("req_zzz"), 0);
    assert_eq!(mock.total_calls(), 5);

    let http = client();
    let calls: Value = http
        .get(format!("{}/_mock/calls", mock.base_url()))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(
        calls,
        json!({"total": 5, "by_request_id": {"": 1, "req_a": 3, "req_b": 1}, "by_model": {"mock-demo": 5},
               "troubled": 0, "limited": 0})
    );
    let requests: Value = http
        .get(format!(
            "{}/_mock/requests?model=mock-demo",
            mock.base_url()
        ))
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(requests.as_array().map(Vec::len), Some(5));
    assert_eq!(requests[1], rejected);
    assert_eq!(mock.requests("mock-demo")[0], ok);

    // Replace the script over HTTP; a bad one is refused with its path.
    let resp = http
        .put(format!("{}/_mock/scripts", mock.base_url()))
        .body(r#"{"models": {"mock-demo": {"steps": [{"text": "fresh", "hang": "yes"}]}}}"#)
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 400);
    let err: Value = resp.json().await.expect("json");
    assert_eq!(err["error"]["path"], "models.mock-demo.steps[0].hang");
    let resp = http
        .put(format!("{}/_mock/scripts", mock.base_url()))
        .body(r#"{"models": {"mock-demo": {"steps": [{"text": "fresh"}]}}}"#)
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 204);
    let (_, body) = json_of(openai(&mock, None, &ok).await).await;
    assert_eq!(body["choices"][0]["message"]["content"], "fresh");

    let resp = http
        .post(format!("{}/_mock/reset", mock.base_url()))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 204);
    assert_eq!(mock.total_calls(), 0);
    assert!(mock.requests("mock-demo").is_empty());

    // set_scripts from the library.
    mock.set_scripts(
        Scripts::from_json(r#"{"models": {"other": {"default": {"text": "x"}}}}"#).expect("script"),
    );
    assert_eq!(json_of(openai(&mock, None, &ok).await).await.0, 404);
}
