//! The bridge's endpoints for what runs wait on: approval decisions and external callbacks,
//! with their statuses and tenant isolation.

use crate::bridge_support;
use crate::common;

use std::time::Duration;

use bridge_support::{ACME, Api, GLOBEX, TestBridge, bridge_config};
use common::{Harness, Svc};
use kedge_core::RunStatus;
use reqwest::StatusCode;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approvals_and_callbacks_over_http() {
    let script = json!({"models": {
        "hw": {"steps": [
            {"text": "paying", "tool_calls": [{"name": "ledger_append", "arguments": {"text": "pay"}}]},
            {"text": "paid"}
        ]},
        "hc": {"steps": [
            {"text": "waiting", "tool_calls": [{"name": "await_callback", "arguments": {"timeout_seconds": 600}}]},
            {"text": "called back"}
        ]}
    }});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent_with_policy("hw", "hw", json!({"ledger_append": {"approval": "always"}}))
        .await;
    h.agent("hc", "hc").await;
    let bridge = TestBridge::start(bridge_config(&h.config, "127.0.0.1:0"), "127.0.0.1:0").await;
    let acme = Api::new(&bridge.url(), Some(ACME));
    let globex = Api::new(&bridge.url(), Some(GLOBEX));

    // Approval over HTTP.
    let (status, body) = acme.submit("hw", "pay", "http-approve-1").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let run: kedge_core::ids::RunId = body["run_id"]
        .as_str()
        .expect("run id")
        .parse()
        .expect("valid");
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingApproval)
        .await;
    let (id, a) = state.approvals.iter().next().expect("an approval");
    let path = format!("/v1/runs/{run}/approvals/{id}");
    let decision = json!({"verdict": "approve", "args_digest": a.request.args_digest});
    let (status, body) = globex.post(&path, &decision).await;
    assert_eq!(
        status,
        StatusCode::NOT_FOUND,
        "another tenant's run: {body}"
    );
    let (status, body) = acme
        .post(
            &path,
            &json!({"verdict": "maybe", "args_digest": a.request.args_digest}),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(body["field"], "verdict");
    let (status, body) = acme
        .post(
            &path,
            &json!({"verdict": "approve", "args_digest": "md5:1"}),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(body["field"], "args_digest");
    let writer = Api::new(&bridge.url(), Some(bridge_support::ACME_NO_APPROVE));
    let (status, body) = writer.post(&path, &decision).await;
    assert_eq!(
        status,
        StatusCode::FORBIDDEN,
        "a write token without the approve scope: {body}"
    );
    let (status, body) = acme.post(&path, &decision).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let (status, body) = acme.post(&path, &decision).await;
    assert_eq!(status, StatusCode::CONFLICT, "decided already: {body}");
    assert_eq!(
        h.wait_terminal(&run, WAIT).await.status,
        RunStatus::Succeeded
    );
    assert_eq!(h.ledger().len(), 1);

    // Callback over HTTP.
    let (status, body) = acme.submit("hc", "wait", "http-callback-1").await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let run: kedge_core::ids::RunId = body["run_id"]
        .as_str()
        .expect("run id")
        .parse()
        .expect("valid");
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingExternal)
        .await;
    let key = state.callbacks.keys().next().expect("key").clone();
    let path = format!("/v1/callbacks/{key}");
    let (status, _) = globex.post(&path, &json!({"x": 1})).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "another tenant's key");
    let (status, body) = acme.post(&path, &json!({"paid": true})).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(body["status"], "accepted");
    let (status, body) = acme.post(&path, &json!({"paid": true})).await;
    assert_eq!(status, StatusCode::OK, "a duplicate: {body}");
    assert_eq!(body["status"], "duplicate");
    assert_eq!(
        h.wait_terminal(&run, WAIT).await.status,
        RunStatus::Succeeded
    );
    let (status, body) = acme.post("/v1/callbacks/cbk_nobody_1_0", &json!({})).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert_eq!(body["field"], "key");
    bridge.stop().await;
    h.shutdown().await;
}
