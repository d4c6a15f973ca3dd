//! The adapters against the strict mock LLM (`kedge-mock-llm`), for both providers: its
//! validation rejects what the real APIs reject, so a passing conversation means our requests
//! are well-formed; its faults exercise the error classification.

use std::time::{Duration, Instant};

use kedge_core::agent::ToolSpec;
use kedge_core::decide::ModelResponse;
use kedge_core::event::{ErrorClass, FinishReason, ModelSpec, Provider};
use kedge_core::fold::ChatMessage;
use kedge_core::ids::{Attempt, ModelRequestId, RunId, StepNo};
use kedge_mock_llm::{MockHandle, Scripts};
use kedge_model::{Delta, ModelCall, ModelClient, ModelError, ModelErrorKind};
use serde_json::json;

const PROVIDERS: [Provider; 2] = [Provider::Openai, Provider::Anthropic];

async fn mock(script: serde_json::Value) -> MockHandle {
    MockHandle::start(Scripts::from_value(script).expect("valid script")).await
}

fn spec(mock: &MockHandle, provider: Provider, model: &str) -> ModelSpec {
    ModelSpec {
        provider,
        name: model.into(),
        base_url: Some(format!("{}/v1", mock.base_url())),
        settings: Default::default(),
        price: None,
    }
}

fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "read_dir".into(),
            description: "List a directory".into(),
            parameters: json!({"type": "object", "properties": {"path": {"type": "string"}}}),
        },
        ToolSpec {
            name: "now".into(),
            description: String::new(),
            parameters: json!({"type": "object", "properties": {"tz": {"type": "string"}}}),
        },
    ]
}

fn request_id(step: u32, attempt: u32) -> ModelRequestId {
    let run: RunId = "run_model_tests".parse().expect("run id");
    ModelRequestId::new(&run, StepNo(step), Attempt(attempt))
}

struct Outcome {
    result: Result<ModelResponse, ModelError>,
    text_deltas: String,
    tool_deltas: Vec<String>,
    elapsed: Duration,
}

/// Makes one call with the default client.
async fn call(
    spec: &ModelSpec,
    context: &[ChatMessage],
    id: &ModelRequestId,
    timeout: Duration,
) -> Outcome {
    call_with(
        &ModelClient::new(),
        spec,
        Some("test-key"),
        context,
        id,
        timeout,
    )
    .await
}

async fn call_with(
    client: &ModelClient,
    spec: &ModelSpec,
    api_key: Option<&str>,
    context: &[ChatMessage],
    id: &ModelRequestId,
    timeout: Duration,
) -> Outcome {
    let tools = tools();
    let call = ModelCall {
        spec,
        api_key,
        system: "You are a terse test agent.",
        tools: &tools,
        context,
        request_id: id,
        max_output_tokens: 512,
        output_schema: None,
        timeout,
    };
    let mut text_deltas = String::new();
    let mut tool_deltas = Vec::new();
    let started = Instant::now();
    let result = client
        .complete(&call, &mut |d| match d {
            Delta::Text(t) => text_deltas.push_str(&t),
            Delta::ToolCall { name, .. } => tool_deltas.push(name),
            _ => {}
        })
        .await;
    Outcome {
        result,
        text_deltas,
        tool_deltas,
        elapsed: started.elapsed(),
    }
}

fn user(text: &str) -> Vec<ChatMessage> {
    vec![ChatMessage::User { text: text.into() }]
}

const SECS_5: Duration = Duration::from_secs(5);

#[tokio::test]
async fn a_three_step_conversation_with_parallel_tool_calls_passes_the_strict_mock() {
    for provider in PROVIDERS {
        let mock = mock(json!({"models": {"conv": {"steps": [
            {"text": "Looking.", "tool_calls": [
                {"name": "read_dir", "arguments": {"path": "/etc"}},
                {"name": "now", "arguments": {}}
            ]},
            {"tool_calls": [{"name": "now", "arguments": {"tz": "UTC"}}]},
            {"text": "Two files; it is noon UTC."}
        ]}}}))
        .await;
        let spec = spec(&mock, provider, "conv");
        let mut context = user("What is in /etc, and what time is it?");

        // Step 1: text and two parallel tool calls.
        let id1 = request_id(1, 1);
        let out = call(&spec, &context, &id1, SECS_5).await;
        let r = out
            .result
            .unwrap_or_else(|e| panic!("{provider:?} step 1: {e}"));
        assert_eq!(r.message.text, "Looking.", "{provider:?}");
        assert_eq!(out.text_deltas, "Looking.", "{provider:?}");
        assert_eq!(out.tool_deltas, ["read_dir", "now"], "{provider:?}");
        assert_eq!(r.finish, FinishReason::ToolCalls, "{provider:?}");
        assert_eq!(r.message.tool_calls.len(), 2);
        assert_eq!(r.message.tool_calls[0].name, "read_dir");
        assert_eq!(r.message.tool_calls[0].arguments, json!({"path": "/etc"}));
        assert_eq!(r.message.tool_calls[1].arguments, json!({}));
        assert!(
            r.usage.input_tokens > 0 && r.usage.output_tokens > 0,
            "{provider:?}: {:?}",
            r.usage
        );
        let ids: Vec<String> = r
            .message
            .tool_calls
            .iter()
            .map(|c| c.call_id.clone())
            .collect();
        context.push(ChatMessage::Assistant { message: r.message });
        context.push(ChatMessage::Tool {
            call_id: ids[0].clone(),
            content: "hosts\npasswd".into(),
            is_error: false,
        });
        context.push(ChatMessage::Tool {
            call_id: ids[1].clone(),
            content: "clock unavailable".into(),
            is_error: true,
        });
        // A user message that arrived after the tool results.
        context.push(ChatMessage::User {
            text: "Use UTC, please.".into(),
        });

        // Step 2: one more tool call, with no text.
        let id2 = request_id(2, 1);
        let out = call(&spec, &context, &id2, SECS_5).await;
        let r = out
            .result
            .unwrap_or_else(|e| panic!("{provider:?} step 2: {e}"));
        assert_eq!(r.message.text, "");
        assert_eq!(out.text_deltas, "");
        assert_eq!(r.message.tool_calls[0].arguments, json!({"tz": "UTC"}));
        let id = r.message.tool_calls[0].call_id.clone();
        context.push(ChatMessage::Assistant { message: r.message });
        context.push(ChatMessage::Tool {
            call_id: id,
            content: "12:00".into(),
            is_error: false,
        });

        // Step 3: the final answer.
        let id3 = request_id(3, 1);
        let out = call(&spec, &context, &id3, SECS_5).await;
        let r = out
            .result
            .unwrap_or_else(|e| panic!("{provider:?} step 3: {e}"));
        assert_eq!(r.message.text, "Two files; it is noon UTC.");
        assert_eq!(out.text_deltas, r.message.text);
        assert!(r.message.tool_calls.is_empty());
        assert_eq!(r.finish, FinishReason::Stop);

        for id in [&id1, &id2, &id3] {
            assert_eq!(mock.calls_for(&id.to_string()), 1, "{provider:?} {id}");
        }
        assert_eq!(mock.total_calls(), 3);

        // What was sent for step 2: results answered where the strict API wants them.
        let sent = &mock.requests("conv")[1];
        match provider {
            Provider::Openai => {
                let roles: Vec<&str> = sent["messages"]
                    .as_array()
                    .expect("messages")
                    .iter()
                    .map(|m| m["role"].as_str().unwrap_or(""))
                    .collect();
                assert_eq!(
                    roles,
                    ["system", "user", "assistant", "tool", "tool", "user"]
                );
                assert_eq!(sent["messages"][4]["content"], "ERROR: clock unavailable");
                assert_eq!(sent["stream_options"]["include_usage"], true);
            }
            Provider::Anthropic => {
                let last = &sent["messages"][2];
                assert_eq!(last["role"], "user");
                let types: Vec<&str> = last["content"]
                    .as_array()
                    .expect("blocks")
                    .iter()
                    .map(|b| b["type"].as_str().unwrap_or(""))
                    .collect();
                assert_eq!(types, ["tool_result", "tool_result", "text"]);
                assert_eq!(last["content"][1]["is_error"], true);
                assert_eq!(sent["system"], "You are a terse test agent.");
            }
        }

        // Control: the same request with the tool results taken out is refused, so the mock's
        // acceptance above means something.
        let mut broken = sent.clone();
        let (path, headers, expected) = match provider {
            Provider::Openai => {
                let messages = broken["messages"].as_array_mut().expect("messages");
                messages.retain(|m| m["role"] != "tool");
                (
                    "chat/completions",
                    vec![("authorization", "Bearer k")],
                    "did not have response messages",
                )
            }
            Provider::Anthropic => {
                let blocks = broken["messages"][2]["content"]
                    .as_array_mut()
                    .expect("blocks");
                blocks.retain(|b| b["type"] != "tool_result");
                (
                    "messages",
                    vec![("x-api-key", "k"), ("anthropic-version", "2023-06-01")],
                    "without `tool_result` blocks immediately after",
                )
            }
        };
        let mut request = reqwest::Client::new()
            .post(format!("{}/v1/{path}", mock.base_url()))
            .json(&broken);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let response = request.send().await.expect("mock answers");
        assert_eq!(response.status().as_u16(), 400, "{provider:?}");
        let body = response.text().await.expect("body");
        assert!(body.contains(expected), "{provider:?}: {body}");
    }
}

#[tokio::test]
async fn rate_limits_are_retryable_with_the_providers_delay() {
    for provider in PROVIDERS {
        let mock = mock(json!({"models": {"m": {"steps": [
            {"text": "fine now", "fault": {"status": 429, "retry_after_ms": 1500, "times": 1}}
        ]}}}))
        .await;
        let spec = spec(&mock, provider, "m");
        let first = request_id(1, 1);
        let e = call(&spec, &user("hi"), &first, SECS_5)
            .await
            .result
            .expect_err("429");
        assert_eq!(e.class, ErrorClass::Retryable, "{provider:?}");
        assert_eq!(e.kind, ModelErrorKind::Status);
        assert_eq!(e.status, Some(429));
        // `retry-after-ms: 1500` wins over `retry-after: 2`.
        assert_eq!(
            e.retry_after,
            Some(Duration::from_millis(1500)),
            "{provider:?}"
        );
        assert!(
            e.message.contains("Rate limit") || e.message.contains("rate limit"),
            "{}",
            e.message
        );

        // The caller's next attempt (a new request id) goes through.
        let second = request_id(1, 2);
        let r = call(&spec, &user("hi"), &second, SECS_5).await.result;
        assert_eq!(r.expect("second attempt").message.text, "fine now");
        assert_eq!(mock.calls_for(&first.to_string()), 1);
        assert_eq!(mock.calls_for(&second.to_string()), 1);
    }
}

#[tokio::test]
async fn an_answer_names_the_rate_limits_in_each_providers_headers_and_a_refusal_does_not() {
    for provider in PROVIDERS {
        let mock = mock(json!({"models": {"m": {
            "limits": {"requests_per_minute": 2, "tokens_per_minute": 40000},
            "steps": [{"text": "ok"}]
        }}}))
        .await;
        let spec = spec(&mock, provider, "m");
        let tools = tools();
        let learned = |id: ModelRequestId| {
            let spec = spec.clone();
            let tools = tools.clone();
            async move {
                let context = user("hi");
                let call = ModelCall {
                    spec: &spec,
                    api_key: Some("test-key"),
                    system: "s",
                    tools: &tools,
                    context: &context,
                    request_id: &id,
                    max_output_tokens: 64,
                    output_schema: None,
                    timeout: SECS_5,
                };
                let mut seen = None;
                let r = ModelClient::new()
                    .complete(&call, &mut |d| {
                        if let Delta::Limits(l) = d {
                            seen = Some(l);
                        }
                    })
                    .await;
                (r.is_ok(), seen)
            }
        };
        let (ok, seen) = learned(request_id(1, 1)).await;
        assert!(ok);
        let seen = seen.expect("limits named");
        assert_eq!(seen.requests_per_minute, Some(2), "{provider:?}");
        assert_eq!(seen.tokens_per_minute, Some(40000), "{provider:?}");
        let _ = learned(request_id(1, 2)).await;
        // Over the limit: a 429, whose headers teach nothing.
        let (ok, seen) = learned(request_id(1, 3)).await;
        assert!(!ok);
        assert_eq!(seen, None, "{provider:?}");
    }
}

#[tokio::test]
async fn overload_and_server_errors_are_retryable() {
    for (provider, status) in [
        (Provider::Anthropic, 529),
        (Provider::Openai, 503),
        (Provider::Openai, 500),
    ] {
        let mock = mock(json!({"models": {"m": {"steps": [
            {"text": "x", "fault": {"status": status}}
        ]}}}))
        .await;
        let e = call(
            &spec(&mock, provider, "m"),
            &user("hi"),
            &request_id(1, 1),
            SECS_5,
        )
        .await
        .result
        .expect_err("fault");
        assert_eq!(e.class, ErrorClass::Retryable, "{provider:?} {status}");
        assert_eq!(e.status, Some(status));
        assert_eq!(e.retry_after, None);
    }
}

#[tokio::test]
async fn bad_requests_are_fatal_with_the_providers_message() {
    for provider in PROVIDERS {
        let mock = mock(json!({"models": {"m": {"steps": [
            {"text": "x", "fault": {"status": 400}}
        ]}}}))
        .await;
        let e = call(
            &spec(&mock, provider, "m"),
            &user("hi"),
            &request_id(1, 1),
            SECS_5,
        )
        .await
        .result
        .expect_err("400");
        assert_eq!(e.class, ErrorClass::Fatal, "{provider:?}");
        assert_eq!(e.status, Some(400));
        assert_eq!(
            e.message, "HTTP 400 invalid_request_error: Invalid request (mock fault).",
            "{provider:?}"
        );

        // An unknown model: 404, fatal, and the provider says which model.
        let e = call(
            &spec(&mock, provider, "no-such-model"),
            &user("hi"),
            &request_id(1, 2),
            SECS_5,
        )
        .await
        .result
        .expect_err("404");
        assert_eq!(e.class, ErrorClass::Fatal);
        assert_eq!(e.status, Some(404));
        assert!(e.message.contains("no-such-model"), "{}", e.message);
    }
}

#[tokio::test]
async fn a_missing_api_key_is_fatal() {
    for provider in PROVIDERS {
        let mock = mock(json!({"models": {"m": {"default": {"text": "x"}}}})).await;
        let out = call_with(
            &ModelClient::new(),
            &spec(&mock, provider, "m"),
            None,
            &user("hi"),
            &request_id(1, 1),
            SECS_5,
        )
        .await;
        let e = out.result.expect_err("401");
        assert_eq!(e.class, ErrorClass::Fatal, "{provider:?}");
        assert_eq!(e.status, Some(401));
    }
}

#[tokio::test]
async fn a_hanging_provider_times_out_within_the_call_timeout() {
    for provider in PROVIDERS {
        let mock = mock(json!({"models": {"m": {"steps": [{"text": "x", "hang": true}]}}})).await;
        let timeout = Duration::from_millis(400);
        let id = request_id(1, 1);
        let out = call(&spec(&mock, provider, "m"), &user("hi"), &id, timeout).await;
        let e = out.result.expect_err("hang");
        assert_eq!(e.class, ErrorClass::Retryable, "{provider:?}");
        assert_eq!(e.kind, ModelErrorKind::Timeout);
        assert!(
            out.elapsed >= timeout && out.elapsed < timeout + Duration::from_millis(600),
            "{provider:?} took {:?}",
            out.elapsed
        );
        assert_eq!(mock.calls_for(&id.to_string()), 1);
    }
}

#[tokio::test]
async fn a_stalled_stream_hits_the_idle_timeout() {
    for provider in PROVIDERS {
        let mock = mock(json!({"models": {"m": {"steps": [
            {"text": "slow words here", "chunk_delay_ms": 1500}
        ]}}}))
        .await;
        let client = ModelClient::new().with_idle_timeout(Duration::from_millis(300));
        let out = call_with(
            &client,
            &spec(&mock, provider, "m"),
            Some("k"),
            &user("hi"),
            &request_id(1, 1),
            Duration::from_secs(20),
        )
        .await;
        let e = out.result.expect_err("stall");
        assert_eq!(e.kind, ModelErrorKind::Timeout, "{provider:?}: {e}");
        assert_eq!(e.class, ErrorClass::Retryable);
        assert!(out.elapsed < Duration::from_secs(3), "{:?}", out.elapsed);
    }
}

#[tokio::test]
async fn a_dropped_stream_is_retryable_not_a_truncated_success() {
    for provider in PROVIDERS {
        let mock = mock(json!({"models": {"m": {"steps": [
            {"text": "This answer will be cut off in the middle.",
             "tool_calls": [{"name": "now", "arguments": {"tz": "UTC"}}],
             "drop_after_chunks": 4}
        ]}}}))
        .await;
        let out = call(
            &spec(&mock, provider, "m"),
            &user("hi"),
            &request_id(1, 1),
            SECS_5,
        )
        .await;
        let e = out.result.expect_err("dropped");
        assert_eq!(e.class, ErrorClass::Retryable, "{provider:?}");
        assert_eq!(e.kind, ModelErrorKind::StreamEnded, "{provider:?}: {e}");
    }
}

#[tokio::test]
async fn an_error_inside_the_stream_is_retryable() {
    for provider in PROVIDERS {
        let mock = mock(json!({"models": {"m": {"steps": [
            {"text": "This answer breaks with an error event.", "stream_error": true}
        ]}}}))
        .await;
        let out = call(
            &spec(&mock, provider, "m"),
            &user("hi"),
            &request_id(1, 1),
            SECS_5,
        )
        .await;
        let e = out.result.expect_err("stream error");
        assert_eq!(e.class, ErrorClass::Retryable, "{provider:?}");
        assert_eq!(e.kind, ModelErrorKind::Provider, "{provider:?}: {e}");
    }
}

#[tokio::test]
async fn nothing_listening_is_a_retryable_connect_error() {
    // A port that was just free: bind, note it, close.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let spec = ModelSpec {
        provider: Provider::Openai,
        name: "m".into(),
        base_url: Some(format!("http://127.0.0.1:{port}/v1")),
        settings: Default::default(),
        price: None,
    };
    let e = call(&spec, &user("hi"), &request_id(1, 1), SECS_5)
        .await
        .result
        .expect_err("refused");
    assert_eq!(e.class, ErrorClass::Retryable);
    assert_eq!(e.kind, ModelErrorKind::Connect, "{e}");
}

#[tokio::test]
async fn awkward_contexts_are_repaired_into_requests_the_strict_mock_accepts() {
    use kedge_core::event::{AssistantMessage, ToolCall};
    let call = |id: &str, arguments: serde_json::Value| ToolCall {
        call_id: id.into(),
        name: "now".into(),
        arguments,
    };
    let assistant = |text: &str, tool_calls: Vec<ToolCall>| ChatMessage::Assistant {
        message: AssistantMessage {
            text: text.into(),
            tool_calls,
            thinking: Vec::new(),
        },
    };
    let result = |id: &str, content: &str| ChatMessage::Tool {
        call_id: id.into(),
        content: content.into(),
        is_error: false,
    };
    let user = |text: &str| ChatMessage::User { text: text.into() };
    let context = vec![
        user("hi"),
        // Arguments that were not JSON, an empty result, and a call that never got one.
        assistant(
            "",
            vec![call("call_1", "{oops".into()), call("call_2", json!({}))],
        ),
        result("call_1", ""),
        user("   "),
        // Neither text nor tool calls.
        assistant("", vec![]),
        user("next"),
        assistant("ok", vec![call("call_3", json!({"tz": "UTC"}))]),
        // A user message between a call and its result, then a stray result.
        user("interrupting"),
        result("call_3", "12:00"),
        result("call_9", "answers nothing"),
    ];
    for provider in PROVIDERS {
        let mock = mock(json!({"models": {"m": {"default": {"text": "accepted"}}}})).await;
        let out = call_with(
            &ModelClient::new(),
            &spec(&mock, provider, "m"),
            Some("k"),
            &context,
            &request_id(4, 1),
            SECS_5,
        )
        .await;
        let r = out
            .result
            .unwrap_or_else(|e| panic!("{provider:?}: the mock refused the request: {e}"));
        assert_eq!(r.message.text, "accepted");
    }
}

/// One call with `spec`'s settings and a 4096-token cap (thinking needs room).
async fn call_settings(spec: &ModelSpec, context: &[ChatMessage], step: u32) -> ModelResponse {
    try_call_settings(spec, context, step)
        .await
        .unwrap_or_else(|e| panic!("{:?} step {step}: {e}", spec.provider))
}

async fn try_call_settings(
    spec: &ModelSpec,
    context: &[ChatMessage],
    step: u32,
) -> Result<ModelResponse, ModelError> {
    let tools = tools();
    let id = request_id(step, 1);
    let call = ModelCall {
        spec,
        api_key: Some("test-key"),
        system: "You are a terse test agent.",
        tools: &tools,
        context,
        request_id: &id,
        max_output_tokens: 4096,
        output_schema: None,
        timeout: SECS_5,
    };
    ModelClient::new().complete(&call, &mut |_| {}).await
}

#[tokio::test]
async fn settings_reach_the_wire_in_each_providers_form_and_pass_the_strict_mock() {
    let script = json!({"models": {"tuned": {"steps": [
        {"tool_calls": [{"name": "now", "arguments": {}}]},
        {"text": "Noon."}
    ]}}});
    let settings = |provider| {
        serde_json::from_value::<kedge_core::settings::ModelSettings>(match provider {
            Provider::Openai => json!({
                "temperature": 0.3, "top_p": 0.9, "stop": ["END"], "seed": 42,
                "tool_choice": "required", "parallel_tool_calls": false, "reasoning_effort": "low"
            }),
            Provider::Anthropic => json!({
                "top_p": 0.95, "stop": ["END"], "tool_choice": "auto",
                "parallel_tool_calls": false, "thinking": {"budget_tokens": 1024}, "cache": true
            }),
        })
        .expect("settings")
    };
    for provider in PROVIDERS {
        let mock = mock(script.clone()).await;
        let mut spec = spec(&mock, provider, "tuned");
        spec.settings = settings(provider);
        let mut context = user("What time is it?");
        let r = call_settings(&spec, &context, 1).await;
        let call_id = r.message.tool_calls[0].call_id.clone();
        if provider == Provider::Anthropic {
            assert_eq!(r.message.thinking.len(), 1, "the thinking block is kept");
        }
        context.push(ChatMessage::Assistant { message: r.message });
        context.push(ChatMessage::Tool {
            call_id,
            content: "12:00".into(),
            is_error: false,
        });
        let r = call_settings(&spec, &context, 2).await;
        assert_eq!(r.message.text, "Noon.");

        let bodies = mock.requests("tuned");
        assert_eq!(bodies.len(), 2);
        let (first, second) = (&bodies[0], &bodies[1]);
        match provider {
            Provider::Openai => {
                assert_eq!(first["temperature"], 0.3);
                assert_eq!(first["top_p"], 0.9);
                assert_eq!(first["stop"], json!(["END"]));
                assert_eq!(first["seed"], 42);
                assert_eq!(first["reasoning_effort"], "low");
                assert_eq!(first["parallel_tool_calls"], false);
                assert_eq!(
                    first["tool_choice"], "required",
                    "forced after the user message"
                );
                assert_eq!(second["tool_choice"], "auto", "not after tool results");
            }
            Provider::Anthropic => {
                assert_eq!(
                    first["thinking"],
                    json!({"type": "enabled", "budget_tokens": 1024})
                );
                assert_eq!(first["top_p"], 0.95);
                assert_eq!(first["stop_sequences"], json!(["END"]));
                assert_eq!(
                    first["tool_choice"],
                    json!({"type": "auto", "disable_parallel_tool_use": true})
                );
                assert!(first.get("temperature").is_none() && first.get("seed").is_none());
                let ephemeral = json!({"type": "ephemeral"});
                assert_eq!(first["system"][0]["cache_control"], ephemeral);
                assert_eq!(
                    first["tools"][1]["cache_control"], ephemeral,
                    "the last tool"
                );
                assert!(first["tools"][0].get("cache_control").is_none());
                let last = |b: &serde_json::Value| {
                    b["messages"]
                        .as_array()
                        .and_then(|m| m.last())
                        .cloned()
                        .expect("message")
                };
                assert_eq!(last(first)["content"][0]["cache_control"], ephemeral);
                // The thinking block went back first in the assistant turn, unchanged.
                let turn = &second["messages"][1];
                assert_eq!(turn["role"], "assistant");
                assert_eq!(turn["content"][0]["type"], "thinking");
                assert!(
                    turn["content"][0]["signature"]
                        .as_str()
                        .is_some_and(|s| !s.is_empty())
                );
                assert_eq!(turn["content"][1]["type"], "tool_use");
                assert_eq!(last(second)["content"][0]["type"], "tool_result");
                assert_eq!(last(second)["content"][0]["cache_control"], ephemeral);
            }
        }
    }
}

#[tokio::test]
async fn a_thinking_block_not_passed_back_unchanged_is_refused() {
    let mock = mock(json!({"models": {"think": {"steps": [
        {"tool_calls": [{"name": "now", "arguments": {}}]},
        {"text": "Noon."}
    ]}}}))
    .await;
    let mut spec = spec(&mock, Provider::Anthropic, "think");
    spec.settings.thinking = Some(kedge_core::settings::Thinking {
        budget_tokens: 1024,
    });
    let context = user("What time is it?");
    let r = call_settings(&spec, &context, 1).await;
    let call_id = r.message.tool_calls[0].call_id.clone();
    for tamper in [true, false] {
        let mut message = r.message.clone();
        if tamper {
            if let kedge_core::event::ThinkingBlock::Thinking { thinking, .. } =
                &mut message.thinking[0]
            {
                thinking.push_str(" (edited)");
            }
        } else {
            message.thinking.clear();
        }
        let mut context = context.clone();
        context.push(ChatMessage::Assistant { message });
        context.push(ChatMessage::Tool {
            call_id: call_id.clone(),
            content: "12:00".into(),
            is_error: false,
        });
        let e = try_call_settings(&spec, &context, 2)
            .await
            .expect_err("refused");
        assert_eq!(e.class, ErrorClass::Fatal, "{e}");
        assert_eq!(e.status, Some(400));
        let words = if tamper {
            "Invalid `signature` in `thinking` block"
        } else {
            "must start with a thinking block"
        };
        assert!(e.message.contains(words), "{}", e.message);
    }
}
