//! A provider's bad day over real HTTP: every trouble kind in both wire formats, the control
//! endpoint's rules, scripted rate limits and context windows.

use std::time::{Duration, Instant};

use kedge_mock_llm::{MockHandle, Scripts, Trouble, TroubleKind};
use reqwest::header::HeaderMap;
use serde_json::{Value, json};

use super::{an_user, anthropic, client, json_of, oa_user, openai, read_body, sse_events};

const SCRIPT: &str = r#"{ "models": {
  "mock-a": {"default": {"text": "fine"}},
  "mock-b": {"default": {"text": "fine too"}},
  "mock-rpm": {"default": {"text": "ok"}, "limits": {"requests_per_minute": 2}},
  "mock-tpm": {"default": {"text": "ok"}, "limits": {"tokens_per_minute": 100}},
  "mock-small": {"default": {"text": "ok"}, "context_window": 20}
} }"#;

async fn start() -> MockHandle {
    MockHandle::start(Scripts::from_json(SCRIPT).expect("script")).await
}

fn oa(model: &str) -> Value {
    json!({"model": model, "messages": [oa_user("go")]})
}

fn an(model: &str) -> Value {
    json!({"model": model, "max_tokens": 16, "messages": [an_user(json!("go"))]})
}

fn url(mock: &MockHandle, path: &str) -> String {
    format!("{}{path}", mock.base_url())
}

/// `PUT /_mock/trouble`: the status and the body (`null` when empty).
async fn put_trouble(mock: &MockHandle, body: impl Into<reqwest::Body>) -> (u16, Value) {
    let resp = client()
        .put(url(mock, "/_mock/trouble"))
        .body(body)
        .send()
        .await
        .expect("send");
    let status = resp.status().as_u16();
    let text = resp.text().await.expect("body");
    let body = if text.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).expect("json")
    };
    (status, body)
}

async fn trouble(mock: &MockHandle, body: Value) {
    let (status, err) = put_trouble(mock, body.to_string()).await;
    assert_eq!(status, 204, "{body}: {err}");
}

async fn get_json(mock: &MockHandle, path: &str) -> Value {
    let resp = client().get(url(mock, path)).send().await.expect("send");
    assert_eq!(resp.status().as_u16(), 200);
    resp.json().await.expect("json")
}

fn header<'h>(headers: &'h HeaderMap, name: &str) -> &'h str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("no {name} header in {headers:?}"))
}

/// `YYYY-MM-DDTHH:MM:SSZ`.
fn is_rfc3339(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 20
        && b[4] == b'-'
        && b[7] == b'-'
        && b[10] == b'T'
        && b[13] == b':'
        && b[16] == b':'
        && b[19] == b'Z'
        && s.chars().filter(char::is_ascii_digit).count() == 14
}

/// Whether an I/O error with kind `ConnectionReset` (a TCP RST) caused `err`.
fn reset_by_peer(err: &reqwest::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionReset)
        {
            return true;
        }
        source = e.source();
    }
    false
}

/// `retry-after-ms` a little under a minute (the first call of the window leaves it then) and
/// `retry-after` the same in seconds, rounded up.
fn retry_in_under_a_minute(h: &HeaderMap) {
    let ms: u64 = header(h, "retry-after-ms").parse().expect("ms");
    assert!((50_000..=60_000).contains(&ms), "{ms}");
    assert_eq!(header(h, "retry-after"), ms.div_ceil(1000).to_string());
}

// ---------------------------------------------------------------- each kind, both formats

#[tokio::test]
async fn unavailable_is_a_5xx_with_each_providers_body() {
    let mock = start().await;
    trouble(&mock, json!({"kind": "unavailable"})).await;

    let resp = openai(&mock, None, &oa("mock-a")).await;
    assert_eq!(resp.status().as_u16(), 503);
    assert!(resp.headers().contains_key("x-request-id"));
    assert!(!resp.headers().contains_key("retry-after"));
    assert!(!resp.headers().contains_key("retry-after-ms"));
    assert_eq!(
        json_of(resp).await.1,
        json!({"error": {"message": "The server is overloaded or not ready yet.",
                         "type": "server_error", "param": null, "code": null}})
    );

    let resp = anthropic(&mock, None, &an("mock-a")).await;
    assert_eq!(resp.status().as_u16(), 500);
    let request_id = header(resp.headers(), "request-id").to_owned();
    let (_, body) = json_of(resp).await;
    assert_eq!(
        body,
        json!({"type": "error", "error": {"type": "api_error", "message": "Internal server error"},
               "request_id": request_id})
    );
    assert!(request_id.starts_with("req_"));

    // The provider is down whatever is asked: even an invalid request or an unknown model.
    let resp = openai(&mock, None, &json!({"model": "mock-a"})).await;
    assert_eq!(resp.status().as_u16(), 503);
    let resp = anthropic(&mock, None, &an("no-such-model")).await;
    assert_eq!(resp.status().as_u16(), 500);

    // Another status, and retry headers.
    trouble(
        &mock,
        json!({"kind": "unavailable", "status": 502, "retry_after_ms": 2500}),
    )
    .await;
    for resp in [
        openai(&mock, None, &oa("mock-a")).await,
        anthropic(&mock, None, &an("mock-a")).await,
    ] {
        assert_eq!(resp.status().as_u16(), 502);
        assert_eq!(header(resp.headers(), "retry-after"), "3");
        assert_eq!(header(resp.headers(), "retry-after-ms"), "2500");
    }
    assert_eq!(mock.troubled_calls(), 6);
}

#[tokio::test]
async fn overloaded_is_anthropics_529_and_openais_503() {
    let mock = start().await;
    trouble(&mock, json!({"kind": "overloaded"})).await;
    let resp = anthropic(&mock, None, &an("mock-a")).await;
    assert_eq!(resp.status().as_u16(), 529);
    assert!(!resp.headers().contains_key("retry-after"));
    let (_, body) = json_of(resp).await;
    assert_eq!(
        body["error"],
        json!({"type": "overloaded_error", "message": "Overloaded"})
    );
    assert_eq!(body["type"], "error");
    assert!(
        body["request_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("req_"))
    );

    let (status, body) = json_of(openai(&mock, None, &oa("mock-a")).await).await;
    assert_eq!(status, 503);
    assert_eq!(
        body,
        json!({"error": {"message": "The server is overloaded or not ready yet.",
                         "type": "server_error", "param": null, "code": null}})
    );
}

#[tokio::test]
async fn rate_limited_is_a_429_with_each_providers_body_and_headers() {
    let mock = start().await;
    trouble(&mock, json!({"kind": "rate_limited"})).await;

    let resp = openai(&mock, None, &oa("mock-a")).await;
    assert_eq!(resp.status().as_u16(), 429);
    let h = resp.headers().clone();
    assert_eq!(header(&h, "x-ratelimit-limit-requests"), "50");
    assert_eq!(header(&h, "x-ratelimit-remaining-requests"), "0");
    assert_eq!(header(&h, "x-ratelimit-reset-requests"), "1m0s");
    assert_eq!(header(&h, "x-ratelimit-limit-tokens"), "30000");
    assert_eq!(header(&h, "x-ratelimit-remaining-tokens"), "0");
    assert_eq!(header(&h, "x-ratelimit-reset-tokens"), "1m0s");
    assert!(!h.contains_key("retry-after") && !h.contains_key("retry-after-ms"));
    let (_, body) = json_of(resp).await;
    let error = &body["error"];
    assert_eq!(
        (&error["type"], &error["code"], &error["param"]),
        (
            &json!("requests"),
            &json!("rate_limit_exceeded"),
            &Value::Null
        )
    );
    assert!(
        error["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("Rate limit reached for mock-a in organization")),
        "{body}"
    );

    let resp = anthropic(&mock, None, &an("mock-a")).await;
    assert_eq!(resp.status().as_u16(), 429);
    let h = resp.headers().clone();
    for name in ["requests", "tokens", "input-tokens"] {
        assert_eq!(
            header(&h, &format!("anthropic-ratelimit-{name}-remaining")),
            "0"
        );
        let reset = header(&h, &format!("anthropic-ratelimit-{name}-reset"));
        assert!(is_rfc3339(reset), "{name}: {reset}");
    }
    assert_eq!(header(&h, "anthropic-ratelimit-requests-limit"), "50");
    assert_eq!(header(&h, "anthropic-ratelimit-tokens-limit"), "30000");
    assert!(!h.contains_key("retry-after") && !h.contains_key("retry-after-ms"));
    let (_, body) = json_of(resp).await;
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m
                .starts_with("Number of request tokens has exceeded your per-minute rate limit")),
        "{body}"
    );
    assert!(body["request_id"].is_string());

    // With retry_after_ms: retry-after (seconds, rounded up) and retry-after-ms, and the resets
    // say the same; a model with scripted limits reports those.
    trouble(
        &mock,
        json!({"kind": "rate_limited", "retry_after_ms": 1500}),
    )
    .await;
    let resp = openai(&mock, None, &oa("mock-rpm")).await;
    assert_eq!(resp.status().as_u16(), 429);
    let h = resp.headers();
    assert_eq!(header(h, "retry-after"), "2");
    assert_eq!(header(h, "retry-after-ms"), "1500");
    assert_eq!(header(h, "x-ratelimit-reset-requests"), "1.5s");
    assert_eq!(header(h, "x-ratelimit-limit-requests"), "2");
    let resp = anthropic(&mock, None, &an("mock-a")).await;
    assert_eq!(header(resp.headers(), "retry-after"), "2");
    assert_eq!(header(resp.headers(), "retry-after-ms"), "1500");
}

#[tokio::test]
async fn reset_closes_the_connection_without_a_response() {
    let mock = start().await;
    trouble(&mock, json!({"kind": "reset"})).await;
    let started = Instant::now();
    let stream_oa = json!({"model": "mock-a", "stream": true, "messages": [oa_user("go")]});
    let stream_an = json!({"model": "mock-a", "max_tokens": 16, "stream": true,
                           "messages": [an_user(json!("go"))]});
    for (name, url, body) in [
        ("openai", "/v1/chat/completions", oa("mock-a")),
        ("openai stream", "/v1/chat/completions", stream_oa),
        ("anthropic", "/v1/messages", an("mock-a")),
        ("anthropic stream", "/v1/messages", stream_an),
    ] {
        let err = client()
            .post(format!("{}{url}", mock.base_url()))
            .bearer_auth("sk-test")
            .header("x-api-key", "sk-ant-test")
            .header("anthropic-version", "2023-06-01")
            .json(&body)
            .send()
            .await
            .expect_err("no response at all");
        assert!(err.status().is_none(), "{name}: {err:?}");
        assert!(!err.is_timeout() && !err.is_status(), "{name}: {err:?}");
        assert!(err.is_request() || err.is_connect(), "{name}: {err:?}");
        assert!(reset_by_peer(&err), "{name}: {err:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!((mock.total_calls(), mock.troubled_calls()), (4, 4));

    // The server itself is fine: once the trouble ends, calls are answered.
    mock.set_trouble(None);
    assert_eq!(
        json_of(openai(&mock, None, &oa("mock-a")).await).await.0,
        200
    );
}

#[tokio::test]
async fn reset_works_on_a_router_mounted_elsewhere_too() {
    let mock = kedge_mock_llm::MockLlm::new(Scripts::from_json(SCRIPT).expect("script"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(axum::serve(listener, mock.router()).into_future());
    mock.set_trouble(Some(Trouble::new(TroubleKind::Reset)));
    let err = client()
        .post(format!("http://{addr}/v1/chat/completions"))
        .bearer_auth("sk-test")
        .json(&oa("mock-a"))
        .send()
        .await
        .expect_err("no response at all");
    assert!(err.status().is_none() && !err.is_timeout(), "{err:?}");
    assert_eq!(mock.troubled_calls(), 1);
    server.abort();
}

#[tokio::test]
async fn stream_cut_sends_200_and_headers_then_closes() {
    let mock = start().await;
    trouble(&mock, json!({"kind": "stream_cut"})).await;

    let body = json!({"model": "mock-a", "stream": true, "messages": [oa_user("go")]});
    let resp = openai(&mock, None, &body).await;
    assert_eq!(resp.status().as_u16(), 200);
    assert!(header(resp.headers(), "content-type").starts_with("text/event-stream"));
    let got = read_body(resp).await.expect_err("the stream is cut");
    let events = sse_events(&got);
    // At most the opening chunk (role, empty content): no content, no final chunk, no [DONE].
    assert!(events.len() <= 1, "{got}");
    for (_, data) in &events {
        let chunk: Value = serde_json::from_str(data).expect("json");
        let delta = &chunk["choices"][0]["delta"];
        assert!(delta["content"].as_str().is_none_or(str::is_empty), "{got}");
        assert!(chunk["choices"][0]["finish_reason"].is_null(), "{got}");
    }
    assert!(!got.contains("[DONE]") && !got.contains("fine"));

    let body = json!({"model": "mock-a", "max_tokens": 16, "stream": true,
                      "messages": [an_user(json!("go"))]});
    let resp = anthropic(&mock, None, &body).await;
    assert_eq!(resp.status().as_u16(), 200);
    let got = read_body(resp).await.expect_err("the stream is cut");
    let events = sse_events(&got);
    assert!(events.len() <= 1, "{got}");
    assert!(
        events
            .iter()
            .all(|(name, _)| name.as_deref() == Some("message_start")),
        "{got}"
    );

    // Non-streaming: half a JSON body, then the close.
    for resp in [
        openai(&mock, None, &oa("mock-a")).await,
        anthropic(&mock, None, &an("mock-a")).await,
    ] {
        assert_eq!(resp.status().as_u16(), 200);
        let got = read_body(resp).await.expect_err("the body is cut");
        assert!(
            got.starts_with('{') && serde_json::from_str::<Value>(&got).is_err(),
            "{got}"
        );
    }
    assert_eq!(mock.troubled_calls(), 4);

    // The stream starts only for an accepted request: an invalid one still gets its 400.
    let (status, _) = json_of(openai(&mock, None, &json!({"model": "mock-a"})).await).await;
    assert_eq!(status, 400);
    assert_eq!(mock.troubled_calls(), 4);
}

// ---------------------------------------------------------------- the control endpoint

#[tokio::test]
async fn models_filter_for_ms_counter_reset_and_delete() {
    let mock = start().await;
    assert_eq!(get_json(&mock, "/_mock/trouble").await, Value::Null);
    let set = Instant::now();
    trouble(
        &mock,
        json!({"kind": "unavailable", "models": ["mock-a"], "for_ms": 1500}),
    )
    .await;
    assert_eq!(
        get_json(&mock, "/_mock/trouble").await,
        json!({"kind": "unavailable", "models": ["mock-a"], "for_ms": 1500})
    );
    assert_eq!(
        openai(&mock, Some("req_1"), &oa("mock-a"))
            .await
            .status()
            .as_u16(),
        503
    );
    assert_eq!(
        openai(&mock, Some("req_1"), &oa("mock-b"))
            .await
            .status()
            .as_u16(),
        200
    );
    assert_eq!(
        anthropic(&mock, None, &an("mock-b"))
            .await
            .status()
            .as_u16(),
        200
    );
    let calls = get_json(&mock, "/_mock/calls").await;
    assert_eq!(
        calls,
        json!({"total": 3, "by_request_id": {"": 1, "req_1": 2},
               "by_model": {"mock-a": 1, "mock-b": 2}, "troubled": 1, "limited": 0})
    );
    // Troubled calls are recorded like the others.
    assert_eq!(mock.requests("mock-a"), vec![oa("mock-a")]);

    // Reset zeroes the counter, not the trouble.
    let resp = client()
        .post(url(&mock, "/_mock/reset"))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 204);
    assert_eq!(get_json(&mock, "/_mock/calls").await["troubled"], 0);
    assert_eq!(
        anthropic(&mock, None, &an("mock-a"))
            .await
            .status()
            .as_u16(),
        500
    );
    assert_eq!(get_json(&mock, "/_mock/calls").await["troubled"], 1);

    // for_ms: over by itself, counted from the PUT.
    tokio::time::sleep(Duration::from_millis(1600).saturating_sub(set.elapsed())).await;
    assert_eq!(get_json(&mock, "/_mock/trouble").await, Value::Null);
    assert_eq!(
        openai(&mock, None, &oa("mock-a")).await.status().as_u16(),
        200
    );
    assert_eq!(mock.troubled_calls(), 1);

    // DELETE ends it (and is fine when there is none).
    trouble(&mock, json!({"kind": "overloaded"})).await;
    assert_eq!(
        get_json(&mock, "/_mock/trouble").await,
        json!({"kind": "overloaded"})
    );
    assert_eq!(
        openai(&mock, None, &oa("mock-b")).await.status().as_u16(),
        503
    );
    for _ in 0..2 {
        let resp = client()
            .delete(url(&mock, "/_mock/trouble"))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status().as_u16(), 204);
    }
    assert_eq!(get_json(&mock, "/_mock/trouble").await, Value::Null);
    assert_eq!(
        openai(&mock, None, &oa("mock-b")).await.status().as_u16(),
        200
    );
    assert_eq!(mock.troubled_calls(), 2);
}

#[tokio::test]
async fn authentication_comes_before_trouble() {
    let mock = start().await;
    for kind in ["reset", "unavailable", "stream_cut"] {
        trouble(&mock, json!({"kind": kind})).await;
        let resp = client()
            .post(url(&mock, "/v1/chat/completions"))
            .json(&oa("mock-a"))
            .send()
            .await
            .expect("a 401, not a reset");
        assert_eq!(resp.status().as_u16(), 401, "{kind}");
        let resp = client()
            .post(url(&mock, "/v1/messages"))
            .header("anthropic-version", "2023-06-01")
            .json(&an("mock-a"))
            .send()
            .await
            .expect("a 401, not a reset");
        let (status, body) = json_of(resp).await;
        assert_eq!(status, 401, "{kind}");
        assert_eq!(body["error"]["type"], "authentication_error");
    }
    assert_eq!((mock.total_calls(), mock.troubled_calls()), (0, 0));
}

#[tokio::test]
async fn hostile_control_input_gets_a_400_with_a_reason() {
    let mock = start().await;
    let cases: Vec<(&str, Vec<u8>, &str, &str)> = vec![
        (
            "unknown field",
            br#"{"kind":"reset","forms":1}"#.to_vec(),
            "forms",
            "unknown field `forms`",
        ),
        (
            "unknown kind",
            br#"{"kind":"meltdown"}"#.to_vec(),
            "kind",
            "unknown variant `meltdown`",
        ),
        (
            "no kind",
            br#"{"status":503}"#.to_vec(),
            "",
            "missing field `kind`",
        ),
        (
            "status on overloaded",
            br#"{"kind":"overloaded","status":503}"#.to_vec(),
            "status",
            "only applies to kind `unavailable`",
        ),
        (
            "status not 5xx",
            br#"{"kind":"unavailable","status":200}"#.to_vec(),
            "status",
            "not one of",
        ),
        (
            "status not a number",
            br#"{"kind":"unavailable","status":"503"}"#.to_vec(),
            "status",
            "invalid type",
        ),
        (
            "no models",
            br#"{"kind":"reset","models":[]}"#.to_vec(),
            "models",
            "at least one model",
        ),
        (
            "models not a list",
            br#"{"kind":"reset","models":"mock-a"}"#.to_vec(),
            "models",
            "invalid type",
        ),
        (
            "for_ms 0",
            br#"{"kind":"reset","for_ms":0}"#.to_vec(),
            "for_ms",
            "at least 1",
        ),
        (
            "for_ms negative",
            br#"{"kind":"reset","for_ms":-5}"#.to_vec(),
            "for_ms",
            "invalid value",
        ),
        (
            "retry on a reset",
            br#"{"kind":"reset","retry_after_ms":10}"#.to_vec(),
            "retry_after_ms",
            "only applies",
        ),
        (
            "retry too long",
            br#"{"kind":"rate_limited","retry_after_ms":99999999999}"#.to_vec(),
            "retry_after_ms",
            "at most",
        ),
        ("not json", b"{".to_vec(), "", "EOF"),
        ("not utf-8", vec![0xff, 0xfe, b'{'], "", "expected value"),
        ("null", b"null".to_vec(), "", "a JSON object, not null"),
        (
            "a list",
            br#"["reset"]"#.to_vec(),
            "",
            "a JSON object, not an array",
        ),
        (
            "trailing",
            br#"{"kind":"reset"} {}"#.to_vec(),
            "",
            "trailing characters",
        ),
        ("empty", Vec::new(), "", "EOF"),
    ];
    for (name, body, path, message) in cases {
        let (status, err) = put_trouble(&mock, body).await;
        assert_eq!(status, 400, "{name}: {err}");
        assert_eq!(err["error"]["path"], path, "{name}: {err}");
        assert_eq!(err.as_object().map(|o| o.len()), Some(1), "{name}: {err}");
        assert!(
            err["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains(message)),
            "{name}: {err}"
        );
    }
    // Nothing was set, and calls go through.
    assert_eq!(get_json(&mock, "/_mock/trouble").await, Value::Null);
    assert_eq!(
        openai(&mock, None, &oa("mock-a")).await.status().as_u16(),
        200
    );
    let resp = client()
        .post(url(&mock, "/_mock/trouble"))
        .body("{}")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status().as_u16(), 405);
}

#[tokio::test]
async fn the_rust_api_sets_reads_and_ends_trouble() {
    let mock = start().await;
    let t = Trouble::new(TroubleKind::Unavailable)
        .with_status(504)
        .and_then(|t| t.for_models(["mock-b"]))
        .expect("valid");
    mock.set_trouble(Some(t.clone()));
    assert_eq!(mock.trouble(), Some(t));
    assert_eq!(
        get_json(&mock, "/_mock/trouble").await,
        json!({"kind": "unavailable", "status": 504, "models": ["mock-b"]})
    );
    assert_eq!(
        openai(&mock, None, &oa("mock-b")).await.status().as_u16(),
        504
    );
    assert_eq!(
        anthropic(&mock, None, &an("mock-b"))
            .await
            .status()
            .as_u16(),
        504
    );
    assert_eq!(
        openai(&mock, None, &oa("mock-a")).await.status().as_u16(),
        200
    );
    assert_eq!(mock.troubled_calls(), 2);
    assert_eq!(mock.calls().troubled, 2);
    mock.set_trouble(None);
    assert_eq!(mock.trouble(), None);

    let brief = Trouble::new(TroubleKind::Overloaded)
        .lasting(Duration::from_millis(500))
        .expect("valid");
    mock.set_trouble(Some(brief));
    assert_eq!(
        anthropic(&mock, None, &an("mock-a"))
            .await
            .status()
            .as_u16(),
        529
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(mock.trouble(), None);
    assert_eq!(
        anthropic(&mock, None, &an("mock-a"))
            .await
            .status()
            .as_u16(),
        200
    );
}

// ---------------------------------------------------------------- scripted limits

#[tokio::test]
async fn requests_per_minute_refuses_the_call_over_the_limit() {
    let mock = start().await;
    for remaining in ["1", "0"] {
        let resp = openai(&mock, None, &oa("mock-rpm")).await;
        assert_eq!(resp.status().as_u16(), 200);
        let h = resp.headers();
        assert_eq!(header(h, "x-ratelimit-limit-requests"), "2");
        assert_eq!(header(h, "x-ratelimit-remaining-requests"), remaining);
        assert_eq!(header(h, "x-ratelimit-reset-requests"), "1m0s");
        assert!(!h.contains_key("x-ratelimit-limit-tokens"));
        assert!(!h.contains_key("retry-after"));
    }
    let resp = openai(&mock, None, &oa("mock-rpm")).await;
    assert_eq!(resp.status().as_u16(), 429);
    let h = resp.headers().clone();
    assert_eq!(header(&h, "x-ratelimit-remaining-requests"), "0");
    retry_in_under_a_minute(&h);
    let (_, body) = json_of(resp).await;
    assert_eq!(body["error"]["type"], "requests");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("Rate limit reached for mock-rpm in organization")
            && message.contains("Limit 2, Used 2, Requested 1"),
        "{message}"
    );

    // The window is the model's, whichever format calls it.
    let resp = anthropic(&mock, None, &an("mock-rpm")).await;
    assert_eq!(resp.status().as_u16(), 429);
    let h = resp.headers().clone();
    assert_eq!(header(&h, "anthropic-ratelimit-requests-limit"), "2");
    assert_eq!(header(&h, "anthropic-ratelimit-requests-remaining"), "0");
    assert!(is_rfc3339(header(&h, "anthropic-ratelimit-requests-reset")));
    retry_in_under_a_minute(&h);
    let (_, body) = json_of(resp).await;
    assert_eq!(body["error"]["type"], "rate_limit_error");

    // Refused calls are calls (counted), but not troubled ones (`limited` counts them); another
    // model is unaffected.
    assert_eq!((mock.total_calls(), mock.troubled_calls()), (4, 0));
    assert_eq!(mock.mock().calls().limited, 2);
    assert_eq!(
        openai(&mock, None, &oa("mock-a")).await.status().as_u16(),
        200
    );
    // A reset forgets the window.
    mock.reset();
    let resp = anthropic(&mock, None, &an("mock-rpm")).await;
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(
        header(resp.headers(), "anthropic-ratelimit-requests-remaining"),
        "1"
    );
}

#[tokio::test]
async fn tokens_per_minute_counts_input_tokens() {
    let mock = start().await;
    let long =
        |chars: usize| json!({"model": "mock-tpm", "messages": [oa_user(&"x".repeat(chars))]});
    // ~300 characters: about 83 tokens of the 100.
    let resp = openai(&mock, None, &long(300)).await;
    assert_eq!(resp.status().as_u16(), 200);
    let h = resp.headers().clone();
    let (_, body) = json_of(resp).await;
    let used = body["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert!(used > 50 && used < 100, "{used}");
    assert_eq!(header(&h, "x-ratelimit-limit-tokens"), "100");
    assert_eq!(
        header(&h, "x-ratelimit-remaining-tokens"),
        (100 - used).to_string()
    );
    assert!(!h.contains_key("x-ratelimit-limit-requests"));

    // The same again does not fit until the first leaves the window.
    let resp = openai(&mock, None, &long(300)).await;
    assert_eq!(resp.status().as_u16(), 429);
    retry_in_under_a_minute(resp.headers());
    let (_, body) = json_of(resp).await;
    assert_eq!(body["error"]["type"], "tokens");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");

    // One larger than the whole limit never fits: no retry-after.
    let resp = anthropic(
        &mock,
        None,
        &json!({"model": "mock-tpm", "max_tokens": 16, "messages": [an_user(json!("x".repeat(500)))]}),
    )
    .await;
    assert_eq!(resp.status().as_u16(), 429);
    let h = resp.headers().clone();
    assert!(!h.contains_key("retry-after"));
    assert_eq!(header(&h, "anthropic-ratelimit-input-tokens-limit"), "100");
    assert_eq!(
        header(&h, "anthropic-ratelimit-tokens-remaining"),
        (100 - used).to_string()
    );
    assert_eq!(json_of(resp).await.1["error"]["type"], "rate_limit_error");

    // A small one still fits.
    let resp = openai(&mock, None, &oa("mock-tpm")).await;
    assert_eq!(resp.status().as_u16(), 200);
}

#[tokio::test]
async fn context_window_refuses_a_prompt_too_long() {
    let mock = start().await;
    assert_eq!(
        openai(&mock, None, &oa("mock-small"))
            .await
            .status()
            .as_u16(),
        200
    );
    assert_eq!(
        anthropic(&mock, None, &an("mock-small"))
            .await
            .status()
            .as_u16(),
        200
    );

    let text = "a long question ".repeat(10);
    // The same messages to an unlimited model say how many tokens they are.
    let oa_long = |model: &str| json!({"model": model, "messages": [oa_user(&text)]});
    let (_, ok) = json_of(openai(&mock, None, &oa_long("mock-a")).await).await;
    let tokens = ok["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert!(tokens > 20);
    let (status, body) = json_of(openai(&mock, None, &oa_long("mock-small")).await).await;
    assert_eq!(status, 400);
    assert_eq!(
        body,
        json!({"error": {
            "message": format!("This model's maximum context length is 20 tokens. However, your \
                                messages resulted in {tokens} tokens. Please reduce the length of \
                                the messages."),
            "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}})
    );

    let an_long =
        |model: &str| json!({"model": model, "max_tokens": 16, "messages": [an_user(json!(text))]});
    let (_, ok) = json_of(anthropic(&mock, None, &an_long("mock-a")).await).await;
    let tokens = ok["usage"]["input_tokens"].as_u64().expect("usage");
    let (status, body) = json_of(anthropic(&mock, None, &an_long("mock-small")).await).await;
    assert_eq!(status, 400);
    assert_eq!(body["type"], "error");
    assert_eq!(
        body["error"],
        json!({"type": "invalid_request_error",
               "message": format!("prompt is too long: {tokens} tokens > 20 maximum")})
    );
    assert!(body["request_id"].is_string());
}
