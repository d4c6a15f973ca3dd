//! The bridge's per-tenant quotas: runs started per minute, unfinished runs, open event
//! streams. Past a limit the answer is 429 with `Retry-After`; another tenant is not affected.

use crate::bridge_support;
use crate::common;

use std::time::Duration;

use bridge_support::{ACME, Api, GLOBEX, TestBridge, bridge_config};
use common::{Harness, Svc};
use kedge_core::RunStatus;
use reqwest::StatusCode;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

/// `Retry-After` and detail of a request that must be refused with 429.
async fn refused_with_retry_after(r: reqwest::RequestBuilder) -> (u64, String) {
    let resp = r.send().await.expect("sent");
    assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
    let retry = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .expect("Retry-After");
    let body: serde_json::Value = resp.json().await.expect("problem details");
    assert_eq!(body["status"], 429, "{body}");
    let detail = body["detail"].as_str().unwrap_or_default().to_owned();
    assert!(detail.contains("acme"), "{body}");
    (retry, detail)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_held_to_their_quotas_and_only_theirs() {
    let script = json!({"models": {"ask": {"steps": [
        {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "?"}}]},
        {"text": "done"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("ask", "ask").await;
    let mut config = bridge_config(&h.config, "127.0.0.1:0");
    config.bridge.runs_per_minute = 3;
    config.bridge.max_active_runs = 2;
    config.bridge.max_sse_per_tenant = 1;
    let bridge = TestBridge::start(config, "127.0.0.1:0").await;
    let _projector = bridge_support::spawn_projector(&h.config);
    let acme = Api::new(&bridge.url(), Some(ACME));
    let globex = Api::new(&bridge.url(), Some(GLOBEX));

    // Two unfinished runs (they wait for an answer): the third is refused until one ends.
    let mut runs = Vec::new();
    for key in ["q-1", "q-2"] {
        let (status, body) = acme.submit("ask", "go", key).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{body}");
        let run: kedge_core::ids::RunId = body["run_id"].as_str().expect("id").parse().expect("id");
        h.wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingUser)
            .await;
        runs.push(run);
    }
    // The limit counts the runs projection, which catches up asynchronously.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (status, list) = acme.get("/v1/runs").await;
        assert_eq!(status, StatusCode::OK, "{list}");
        if list["runs"].as_array().is_some_and(|r| r.len() == 2) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{list}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let submit = |key: &str| {
        acme.http
            .post(format!("{}/v1/runs", bridge.url()))
            .bearer_auth(ACME)
            .header("Idempotency-Key", key)
            .json(&json!({"agent": "ask", "input": "go"}))
    };
    let (retry, detail) = refused_with_retry_after(submit("q-3")).await;
    assert!(detail.contains("unfinished runs"), "{detail}");
    assert!(retry >= 1);
    // Runs per minute: 3 a minute, and the third attempt above took the third token.
    let (retry, detail) = refused_with_retry_after(submit("q-4")).await;
    assert!(detail.contains("a minute"), "{detail}");
    assert!((1..=60).contains(&retry), "{retry}");
    // Another tenant is not affected.
    let (status, body) = globex.submit("ask", "go", "g-1").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");

    // One event stream per tenant: a second one is refused while the first is open.
    let stream = |token: &str| {
        acme.http
            .get(format!("{}/v1/runs/{}/events", bridge.url(), runs[0]))
            .bearer_auth(token.to_owned())
    };
    let first = stream(ACME).send().await.expect("first stream");
    assert_eq!(first.status(), StatusCode::OK);
    refused_with_retry_after(stream(ACME)).await;
    drop(first);
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let again = stream(ACME).send().await.expect("sent");
        if again.status() == StatusCode::OK {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the closed stream's slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
