//! Cooperative cancel from every kind of state: the run ends `cancelled` exactly once, nothing is
//! dispatched after the request, and `run.cancelled` names every operation's outcome.

use crate::common;

use std::time::{Duration, Instant};

use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::event::{Event, OpFate};
use kedge_journal::Recorded;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

fn call(name: &str, args: serde_json::Value) -> serde_json::Value {
    json!({"name": name, "arguments": args})
}

/// The invariants every cancelled run must show.
fn assert_cancelled_once(events: &[Recorded], cancel_seq: u64) -> Vec<OpFate> {
    let cancelled: Vec<_> = events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::RunCancelled(c) => Some(c.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(cancelled.len(), 1, "exactly one run.cancelled");
    let dispatched_after = events
        .iter()
        .filter(|r| r.seq > cancel_seq && matches!(r.envelope.event, Event::ToolRequested(_)))
        .count();
    assert_eq!(
        dispatched_after, 0,
        "no tool dispatched after the cancel request"
    );
    let ops = events
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::ToolRequested(_)))
        .count();
    assert_eq!(
        cancelled[0].operations.len(),
        ops,
        "every operation's outcome is named"
    );
    cancelled[0].operations.iter().map(|o| o.fate).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_while_queued() {
    let script = json!({"models": {"cq": {"steps": [{"text": "never"}]}}});
    let mut h = Harness::start(script, &[Svc::Intake]).await;
    h.agent("cq", "cq").await;
    let run = h.submit("cq", "go", "cq-1").await;
    assert_eq!(h.state(&run).await.status, RunStatus::Queued);
    let seq = h.cancel(&run).await;
    h.spawn_service(Svc::Step, "w-late");
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Cancelled);
    assert_cancelled_once(&h.events(&run).await, seq);
    assert_eq!(h.mock.total_calls(), 0, "the model was never called");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_model_call_aborts_the_call_and_dispatches_nothing() {
    let script = json!({"models": {"cm": {"steps": [
        {"text": "slow", "delay_ms": 8000, "tool_calls": [call("ledger_append", json!({"text": "no"}))]},
        {"text": "never"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("cm", "cm").await;
    let run = h.submit("cm", "go", "cm-1").await;
    h.wait_for(&run, WAIT, |s| s.open_step.is_some()).await;
    let asked = Instant::now();
    let seq = h.cancel(&run).await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Cancelled);
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "the model call was aborted, not waited for ({:?})",
        asked.elapsed()
    );
    let events = h.events(&run).await;
    assert!(events.iter().any(|r| matches!(
        &r.envelope.event,
        Event::ModelAttempt(a) if a.outcome == kedge_core::event::AttemptOutcome::Cancelled
    )));
    assert_cancelled_once(&events, seq);
    assert!(h.ledger().is_empty(), "no side effect");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_tool_call_stops_the_running_tool() {
    let script = json!({"models": {"ct": {"steps": [
        {"text": "sleeping", "tool_calls": [
            call("shell", json!({"command": "sleep", "args": ["20"]})),
            call("write_file", json!({"path": "x", "content": "y"}))]},
        {"text": "never"}
    ]}}});
    let h = Harness::start_with(script, &[Svc::Intake, Svc::Step, Svc::Tool], |c| {
        c.timeouts.tool_timeout_ms = 30_000;
        c.timeouts.tool_ack_wait_ms = 45_000;
    })
    .await;
    h.agent("ct", "ct").await;
    let run = h.submit("ct", "go", "ct-1").await;
    h.wait_for(&run, WAIT, |s| {
        s.ops.values().any(|o| {
            o.call.name == "shell" && matches!(o.status, kedge_core::fold::OpStatus::Started { .. })
        })
    })
    .await;
    let asked = Instant::now();
    let seq = h.cancel(&run).await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Cancelled);
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "the sleep was killed"
    );
    let mut fates = assert_cancelled_once(&h.events(&run).await, seq);
    fates.sort_by_key(|f| format!("{f:?}"));
    assert_eq!(fates, vec![OpFate::Completed, OpFate::Stopped], "{fates:?}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_while_waiting_for_the_user_or_a_timer() {
    for (model, tool, args, waiting) in [
        (
            "cu",
            "ask_user",
            json!({"question": "?"}),
            RunStatus::WaitingUser,
        ),
        (
            "cw",
            "wait",
            json!({"seconds": 3600}),
            RunStatus::WaitingExternal,
        ),
    ] {
        let script = json!({"models": {model: {"steps": [
            {"text": "waiting", "tool_calls": [call(tool, args)]},
            {"text": "never"}
        ]}}});
        let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
        h.agent(model, model).await;
        let run = h.submit(model, "go", &format!("{model}-1")).await;
        h.wait_for(&run, WAIT, |s| s.status == waiting).await;
        let seq = h.cancel(&run).await;
        let state = h.wait_terminal(&run, WAIT).await;
        assert_eq!(state.status, RunStatus::Cancelled, "{tool}");
        let fates = assert_cancelled_once(&h.events(&run).await, seq);
        assert_eq!(fates, vec![OpFate::NeverStarted], "{tool}");
        assert_eq!(h.mock.total_calls(), 1, "{tool}");
        h.shutdown().await;
    }
}
