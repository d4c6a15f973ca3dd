//! Approvals: an operation the agent's policy holds back runs only under a valid, unexpired
//! approval whose digest matches what executes; a denial tells the model; a stale approval is
//! invalidated and asked again; an expired one never runs.

use crate::common;

use std::time::Duration;

use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::event::Event;
use kedge_core::fold::{ApprovalStatus, OpStatus};
use kedge_core::ids::RunId;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);

fn script(model: &str) -> Value {
    json!({"models": {model: {"steps": [
        {"text": "paying", "tool_calls": [{"name": "ledger_append", "arguments": {"text": "pay 100"}}]},
        {"text": "finished"}
    ]}}})
}

async fn start(model: &str, ttl_secs: u64) -> (Harness, RunId) {
    let h = Harness::start_with(
        script(model),
        &[Svc::Intake, Svc::Step, Svc::Tool, Svc::Approval],
        |c| {
            c.approvers.insert("tok-alice".into(), "alice".into());
        },
    )
    .await;
    h.agent_with_policy(
        model,
        model,
        json!({"ledger_append": {"approval": "always", "risk": "high", "approval_ttl_secs": ttl_secs}}),
    )
    .await;
    let run = h
        .submit(model, "pay the invoice", &format!("{model}-1"))
        .await;
    (h, run)
}

async fn decide(h: &Harness, run: &RunId, token: &str, body: Value) -> Value {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Authorization", format!("Bearer {token}").as_str());
    let reply =
        h.rt.client
            .request_with_headers(
                format!("agent.approval.{run}"),
                headers,
                body.to_string().into(),
            )
            .await
            .expect("approval service answered");
    serde_json::from_slice(&reply.payload).expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approved_operation_runs_once_and_nothing_runs_before() {
    let (h, run) = start("ap1", 3600).await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingApproval)
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(h.ledger().is_empty(), "nothing runs before the approval");
    let (id, a) = state.approvals.iter().next().expect("an approval");
    assert_eq!(
        a.request.arguments,
        json!({"text": "pay 100"}),
        "the approver sees the call"
    );
    let unauth = decide(
        &h,
        &run,
        "tok-mallory",
        json!({"approval_id": id, "verdict": "approve", "args_digest": a.request.args_digest}),
    )
    .await;
    assert_eq!(unauth["code"], 401, "{unauth}");
    let ok = decide(
        &h,
        &run,
        "tok-alice",
        json!({"approval_id": id, "verdict": "approve", "args_digest": a.request.args_digest}),
    )
    .await;
    assert_eq!(ok["status"], "journaled", "{ok}");
    let again = decide(
        &h,
        &run,
        "tok-alice",
        json!({"approval_id": id, "verdict": "deny", "args_digest": a.request.args_digest}),
    )
    .await;
    assert_eq!(
        again["code"], 409,
        "a decided approval is not open: {again}"
    );
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    assert_eq!(h.ledger().len(), 1);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_tells_the_model_and_the_operation_never_runs() {
    let (h, run) = start("ap2", 3600).await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingApproval)
        .await;
    let (id, a) = state.approvals.iter().next().expect("an approval");
    let no = decide(&h, &run, "tok-alice", json!({"approval_id": id, "verdict": "deny", "args_digest": a.request.args_digest, "comment": "too much"})).await;
    assert_eq!(no["status"], "journaled", "{no}");
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "the model continues");
    assert!(h.ledger().is_empty());
    let last = h.mock.requests("ap2").pop().expect("request").to_string();
    assert!(last.contains("denied by alice: too much"), "{last}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_for_other_arguments_is_invalidated_and_asked_again() {
    let (h, run) = start("ap3", 3600).await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingApproval)
        .await;
    let (id, _) = state.approvals.iter().next().expect("an approval");
    // The approver was shown digest D' (other arguments): it cannot authorise these.
    let shown = kedge_core::event::Digest::of_json(&json!({"text": "pay 1"}));
    let stale = decide(
        &h,
        &run,
        "tok-alice",
        json!({"approval_id": id, "verdict": "approve", "args_digest": shown}),
    )
    .await;
    assert_eq!(stale["status"], "journaled");
    let state = h.wait_for(&run, WAIT, |s| s.approvals.len() == 2).await;
    assert_eq!(state.status, RunStatus::WaitingApproval);
    assert!(matches!(
        state.approvals[id].status,
        ApprovalStatus::Invalidated { .. }
    ));
    let (fresh_id, fresh) = state
        .approvals
        .iter()
        .find(|(_, a)| a.status == ApprovalStatus::Open)
        .expect("a fresh request");
    assert_eq!(fresh.request.plan_version, 2);
    assert!(
        h.ledger().is_empty(),
        "the stale approval authorised nothing"
    );
    let op = state.ops.keys().next().expect("op").clone();
    assert_eq!(state.ops[&op].status, OpStatus::AwaitingApproval);
    let ok = decide(&h, &run, "tok-alice", json!({"approval_id": fresh_id, "verdict": "approve", "args_digest": fresh.request.args_digest})).await;
    assert_eq!(ok["status"], "journaled");
    assert_eq!(
        h.wait_terminal(&run, WAIT).await.status,
        RunStatus::Succeeded
    );
    assert_eq!(h.ledger().len(), 1);
    let invalidated = h
        .events(&run)
        .await
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::ApprovalInvalidated(_)))
        .count();
    assert_eq!(invalidated, 1);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_given_after_it_expired_does_not_run_the_operation() {
    let (h, run) = start("ap4", 1).await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingApproval)
        .await;
    let (id, a) = state.approvals.iter().next().expect("an approval");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = decide(
        &h,
        &run,
        "tok-alice",
        json!({"approval_id": id, "verdict": "approve", "args_digest": a.request.args_digest}),
    )
    .await;
    assert_eq!(late["status"], "journaled", "{late}");
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    assert_eq!(done.approvals[id].status, ApprovalStatus::Expired);
    assert!(h.ledger().is_empty(), "an expired approval runs nothing");
    let last = h.mock.requests("ap4").pop().expect("request").to_string();
    assert!(last.contains("expired"), "the model is told: {last}");
    h.shutdown().await;
}

/// The tool's precondition check: `write_file` approved for the file as it was shown; the file
/// changes before the runner gets to it → not written, the approval invalidated, a fresh one
/// asked showing where the file is now; approved again, it is written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_whose_target_moved_is_invalidated_and_asked_again() {
    let script = json!({"models": {"ap5": {"steps": [
        {"text": "writing", "tool_calls": [{"name": "write_file", "arguments": {"path": "notes.txt", "content": "from the agent"}}]},
        {"text": "finished"}
    ]}}});
    let h = Harness::start_with(
        script,
        &[Svc::Intake, Svc::Step, Svc::Tool, Svc::Approval],
        |c| {
            c.approvers.insert("tok-alice".into(), "alice".into());
        },
    )
    .await;
    h.agent_with_policy("ap5", "ap5", json!({"write_file": {"approval": "always"}}))
        .await;
    let run = h.submit("ap5", "write the notes", "ap5-1").await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingApproval)
        .await;
    let (id, a) = state.approvals.iter().next().expect("an approval");
    assert_eq!(
        a.request.target_version.as_deref(),
        Some("absent"),
        "the approver is shown where the target is"
    );
    // Someone else creates the file after it was shown, before the approval.
    let file = h.config.workspace_root.join(run.as_str()).join("notes.txt");
    std::fs::create_dir_all(file.parent().expect("dir")).expect("workspace");
    std::fs::write(&file, "written by someone else").expect("write");
    let ok = decide(
        &h,
        &run,
        "tok-alice",
        json!({"approval_id": id, "verdict": "approve", "args_digest": a.request.args_digest}),
    )
    .await;
    assert_eq!(ok["status"], "journaled", "{ok}");
    let state = h
        .wait_for(&run, WAIT, |s| {
            s.status == RunStatus::WaitingApproval && s.approvals.len() == 2
        })
        .await;
    assert_eq!(
        std::fs::read_to_string(&file).expect("file"),
        "written by someone else",
        "the old approval authorised nothing"
    );
    assert!(matches!(
        state.approvals[id].status,
        ApprovalStatus::Invalidated { .. }
    ));
    let (id2, a2) = state
        .approvals
        .iter()
        .find(|(k, _)| *k != id)
        .expect("a fresh approval");
    assert_eq!(a2.request.plan_version, 2);
    let now = kedge_core::event::Digest::of_bytes(b"written by someone else");
    assert_eq!(
        a2.request.target_version.as_deref(),
        Some(now.as_str()),
        "the fresh request shows the target as it is now"
    );
    let events = h.events(&run).await;
    let moved = events
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::TargetMoved(_)))
        .count();
    assert_eq!(moved, 1);
    assert!(events.iter().any(|r| matches!(&r.envelope.event,
        Event::ApprovalInvalidated(i) if i.reason.contains("target moved"))));
    let ok = decide(
        &h,
        &run,
        "tok-alice",
        json!({"approval_id": id2, "verdict": "approve", "args_digest": a2.request.args_digest}),
    )
    .await;
    assert_eq!(ok["status"], "journaled", "{ok}");
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    assert_eq!(
        std::fs::read_to_string(&file).expect("file"),
        "from the agent"
    );
    let op = done.ops.values().next().expect("op");
    assert_eq!(op.dispatches, 2, "dispatched, given back, dispatched again");
    common::assert_schema_valid(&h.events(&run).await);
    h.shutdown().await;
}

/// Under a retry policy too, a dispatch given back because its target moved is done with: a
/// later request for it (a redelivery, the reconciler's resolve) is answered `released`, not
/// put back to be tried again (it used to come back every 200 ms until its deliveries ran out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatch_given_back_under_a_retry_policy_is_not_asked_for_again() {
    let script = json!({"models": {"ap9": {"steps": [
        {"text": "writing", "tool_calls": [{"name": "write_file", "arguments": {"path": "n.txt", "content": "agent"}}]},
        {"text": "finished"}
    ]}}});
    let h = Harness::start_with(
        script,
        &[Svc::Intake, Svc::Step, Svc::Tool, Svc::Approval],
        |c| {
            c.approvers.insert("tok-alice".into(), "alice".into());
        },
    )
    .await;
    h.agent_with_policy(
        "ap9",
        "ap9",
        json!({"write_file": {"approval": "always", "retry": {"attempts": 3}}}),
    )
    .await;
    let run = h.submit("ap9", "write", "ap9-1").await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingApproval)
        .await;
    let (id, a) = state.approvals.iter().next().expect("an approval");
    let file = h.config.workspace_root.join(run.as_str()).join("n.txt");
    std::fs::create_dir_all(file.parent().expect("dir")).expect("workspace");
    std::fs::write(&file, "someone else").expect("write");
    let ok = decide(
        &h,
        &run,
        "tok-alice",
        json!({"approval_id": id, "verdict": "approve", "args_digest": a.request.args_digest}),
    )
    .await;
    assert_eq!(ok["status"], "journaled", "{ok}");
    h.wait_for(&run, WAIT, |s| {
        s.status == RunStatus::WaitingApproval && s.approvals.len() == 2
    })
    .await;
    let events = h.events(&run).await;
    let first = events
        .iter()
        .find(|r| matches!(&r.envelope.event, Event::ToolRequested(t) if t.redispatch == 0))
        .expect("the first dispatch");
    assert!(matches!(&first.envelope.event, Event::ToolRequested(t) if t.limits.retry.is_some()));
    let answer =
        h.rt.client
            .request(
                kedge_core::subjects::TOOL_RESOLVE,
                first.envelope.to_json_bytes().into(),
            )
            .await
            .expect("answered");
    let answer: Value = serde_json::from_slice(&answer.payload).expect("JSON");
    assert_eq!(answer, json!({"handled": "released"}));
    assert_eq!(
        std::fs::read_to_string(&file).expect("file"),
        "someone else"
    );
    h.shutdown().await;
}
