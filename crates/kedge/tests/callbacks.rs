//! External callbacks over NATS: a duplicate has one effect, an early one is matched when the
//! run starts waiting, an expired one is refused, one for an unknown key is recorded.

use crate::common;

use std::time::Duration;

use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::event::Event;
use kedge_core::ids::{CallbackKey, OperationId, StepNo};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);

async fn deliver(h: &Harness, key: &str, payload: Value) -> Value {
    let reply =
        h.rt.client
            .request(format!("agent.callback.{key}"), payload.to_string().into())
            .await
            .expect("callback answered");
    serde_json::from_slice(&reply.payload).expect("json answer")
}

fn script(model: &str, delay_ms: u64, timeout: f64) -> Value {
    json!({"models": {model: {"steps": [
        {"text": "waiting for the bank", "delay_ms": delay_ms,
         "tool_calls": [{"name": "await_callback", "arguments": {"timeout_seconds": timeout}}]},
        {"text": "done"}
    ]}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_callback_has_one_effect() {
    let h = Harness::start(script("cbd", 0, 600.0), &[Svc::Intake, Svc::Step]).await;
    h.agent("cbd", "cbd").await;
    let run = h.submit("cbd", "go", "cbd-1").await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingExternal)
        .await;
    let key = state.callbacks.keys().next().expect("a key").clone();
    assert_eq!(
        key,
        CallbackKey::for_operation(&OperationId::new(&run, StepNo(1), 0))
    );
    let first = deliver(&h, key.as_str(), json!({"paid": 5})).await;
    assert_eq!(first["status"], "accepted", "{first}");
    let again = deliver(&h, key.as_str(), json!({"paid": 5})).await;
    assert_eq!(again["status"], "duplicate", "{again}");
    let other = deliver(&h, key.as_str(), json!({"paid": 6})).await;
    assert!(
        other["status"] == "duplicate" || other["status"] == "closed",
        "{other}"
    );
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    let received = h
        .events(&run)
        .await
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::CallbackReceived(_)))
        .count();
    assert_eq!(received, 1, "one effect");
    let request = h
        .mock
        .requests("cbd")
        .pop()
        .expect("second request")
        .to_string();
    assert!(request.contains("paid"), "the model saw the payload");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_callback_is_matched_when_the_run_starts_waiting() {
    let h = Harness::start(script("cbe", 1500, 600.0), &[Svc::Intake, Svc::Step]).await;
    h.agent("cbe", "cbe").await;
    let run = h.submit("cbe", "go", "cbe-1").await;
    h.wait_for(&run, WAIT, |s| s.open_step.is_some()).await;
    let key = CallbackKey::for_operation(&OperationId::new(&run, StepNo(1), 0));
    let early = deliver(&h, key.as_str(), json!("early bird")).await;
    assert_eq!(early["status"], "early", "{early}");
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    let op = done.ops.keys().next().expect("op");
    assert_eq!(
        done.ops[op].result.as_ref().map(|r| r.content.as_str()),
        Some("early bird")
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_and_unknown_callbacks_are_refused_and_recorded() {
    let h = Harness::start(script("cbx", 0, 1.0), &[Svc::Intake, Svc::Step]).await;
    h.agent("cbx", "cbx").await;
    let run = h.submit("cbx", "go", "cbx-1").await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingExternal)
        .await;
    let key = state.callbacks.keys().next().expect("a key").clone();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = deliver(&h, key.as_str(), json!({"late": true})).await;
    assert_eq!(late["status"], "expired", "{late}");
    assert!(late["expires_at"].is_string());
    let received = h
        .events(&run)
        .await
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::CallbackReceived(_)))
        .count();
    assert_eq!(received, 0, "refused, not journaled");

    for unknown in ["cbk_nosuchrun_1_0", "not-even-a-key"] {
        let answer = deliver(&h, unknown, json!({"who": "knows"})).await;
        assert_eq!(answer["status"], "unknown_key", "{answer}");
        assert_eq!(answer["recorded"], true);
    }
    let js = async_nats::jetstream::new(h.rt.client.clone());
    let mut stream = js.get_stream("KEDGE_REJECTIONS").await.expect("stream");
    let info = stream.info().await.expect("info");
    assert_eq!(
        info.state.messages, 2,
        "unknown callbacks are recorded, not lost"
    );
    h.shutdown().await;
}
