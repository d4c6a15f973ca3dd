//! A large task input over HTTP: its `run.created` is journaled by
//! reference, `/history` and SSE show it whole, and `GET /v1/runs/{id}/blobs/{digest}` serves
//! the blob to the run's tenant only, and only a blob the run refers to.

use crate::bridge_support;
use crate::common;

use std::time::Duration;

use bridge_support::{ACME, Api, GLOBEX, Sse, SseStream, TestBridge, bridge_config};
use common::{Harness, Svc};
use kedge_core::event::Event;
use kedge_core::{EventType, RunStatus};
use reqwest::StatusCode;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_input_is_stored_by_reference_and_served_whole() {
    let script = json!({"models": {"blob": {"steps": [{"text": "read it all"}]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("qa", "blob").await;
    let mut config = bridge_config(&h.config, "127.0.0.1:0");
    config.bridge.max_body_bytes = 1024 * 1024;
    let bridge = TestBridge::start(config, "127.0.0.1:0").await;
    let acme = Api::new(&bridge.url(), Some(ACME));

    // 600 KiB of input: over the 64 KiB a journal message keeps, under the task limit.
    let input: String = (0..20_000)
        .map(|i| format!("line {i:06} of a long document\n"))
        .collect::<String>()[..600 * 1024]
        .to_owned();
    let (s, sub) = acme.submit("qa", &input, "blob-1").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{sub}");
    let run_id = sub["run_id"].as_str().expect("run id").to_owned();
    let run = run_id.parse().expect("run id");
    let state = h.wait_terminal(&run, Duration::from_secs(60)).await;
    assert_eq!(state.status, RunStatus::Succeeded);

    // The model was given the whole input.
    let asked = h.mock.requests("blob")[0].to_string();
    assert!(asked.contains("line 019000 of a long document"));

    // Stored by reference, named by the envelope's digest.
    let events = h.events(&run).await;
    let created = &events[0];
    let Event::RunCreated(c) = &created.envelope.event else {
        panic!("first event is {}", created.envelope.event_type());
    };
    assert_eq!(c.input, input);
    let references =
        h.rt.journal
            .blob_references(&run)
            .await
            .expect("references");
    assert_eq!(references.len(), 1, "{references:?}");
    assert_eq!(references[0].0, created.seq);
    let digest = created.envelope.digest.to_string();
    assert_eq!(references[0].1.digest.to_string(), digest);

    // /history shows it whole.
    let (s, history) = acme.get(&format!("/v1/runs/{run_id}/history")).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(history["events"][0]["type"], "run.created");
    assert_eq!(history["events"][0]["data"]["input"], json!(input));
    // So does SSE.
    let http = reqwest::Client::new();
    let mut sse = SseStream::open(
        &http,
        &format!("{}/v1/runs/{run_id}/events", bridge.url()),
        Some(ACME),
        None,
    )
    .await
    .expect("open");
    let first = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match sse.next().await {
                Some(Sse::Event { event, data, .. }) => return Some((event, data)),
                Some(_) => continue,
                None => return None,
            }
        }
    })
    .await
    .expect("an event in time")
    .expect("an event");
    assert_eq!(first.0, "run.created");
    assert_eq!(first.1["data"]["input"], json!(input));
    drop(sse);

    // The blob, to its tenant: the event's data, exactly as stored.
    let url = format!("{}/v1/runs/{run_id}/blobs/{digest}", bridge.url());
    let resp = http.get(&url).bearer_auth(ACME).send().await.expect("get");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "application/json");
    assert_eq!(resp.headers()["etag"], format!("\"{digest}\"").as_str());
    let body = resp.bytes().await.expect("body");
    assert_eq!(
        kedge_core::event::Digest::of_bytes(&body).to_string(),
        digest
    );
    let data: Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(data["input"], json!(input));

    // Not to another tenant, and not a blob the run does not refer to.
    let (s, p) = acme
        .with_token(Some(GLOBEX))
        .get(&format!("/v1/runs/{run_id}/blobs/{digest}"))
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{p}");
    let small = events
        .iter()
        .find(|r| r.envelope.event_type() == EventType::StepStarted)
        .expect("a step");
    let (s, p) = acme
        .get(&format!(
            "/v1/runs/{run_id}/blobs/{}",
            small.envelope.digest
        ))
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{p}");
    let (s, p) = acme
        .get(&format!("/v1/runs/{run_id}/blobs/sha256:nothex"))
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{p}");
    assert!(p["detail"].as_str().unwrap_or("").contains("digest"), "{p}");
    bridge.stop().await;
    h.shutdown().await;
}
