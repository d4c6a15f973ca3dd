//! Compensation through the real services (docs/ARCHITECTURE.md "Compensation"): a cancelled
//! run whose agent compensates undoes its compensable effects newest first, each compensation
//! an operation with its own id that the tool service runs exactly once, even when the tool
//! worker is killed -9 right after the compensation's effect; irreversible effects are listed.

use crate::common;

use std::time::Duration;

use common::{Harness, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::agent::OnEnd;
use kedge_core::event::{CancelRequested, CompensationStatus, Event, Level, OpFate};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(40);

fn call(name: &str, args: serde_json::Value) -> serde_json::Value {
    json!({"name": name, "arguments": args})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_compensates_ledger_once_across_a_tool_kill() {
    let script = json!({"models": {"mcomp": {"steps": [
        {"text": "paying", "tool_calls": [call("ledger_append", json!({"text": "pay 5"}))]},
        {"text": "paying more", "tool_calls": [
            call("ledger_append", json!({"text": "pay 7"})),
            call("write_file", json!({"path": "receipt.txt", "content": "paid 12"}))]},
        {"text": "asking", "tool_calls": [call("ask_user", json!({"question": "which colour?"}))]}
    ]}}});
    let mut h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent_edited("shop", "mcomp", |def| {
        def.policy = serde_json::from_value(json!({
            "ledger_append": {"reversibility": "compensable", "compensate": {
                "tool": "ledger_append",
                "arguments": {"text": "reversal of ${arguments.text} (${op})"}}},
            "write_file": {"reversibility": "irreversible"}
        }))
        .expect("valid policy");
        def.on_cancel = OnEnd::Compensate;
    })
    .await;
    let first = h.spawn_process("tool", "w-tool-first", "");
    let run = h.submit("shop", "buy a boat", "task-comp").await;
    h.wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    assert_eq!(h.ledger().len(), 2, "two payments");
    // The compensation's runner dies right after its effect, before any record of it.
    h.kill9(first);
    let doomed = h.spawn_process("tool", "w-tool-doomed", "tool.after_effect");
    h.input(
        &run,
        Event::CancelRequested(CancelRequested {
            reason: "changed my mind".into(),
            by: Some("tester".into()),
        }),
        &format!("cancel:{run}"),
    )
    .await;
    assert!(
        h.wait_exit(doomed, WAIT).await,
        "the doomed tool worker should abort at its failpoint"
    );
    assert_eq!(h.ledger().len(), 3, "the newest payment's reversal ran");
    h.spawn_process("tool", "w-tool-fresh", "");
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Cancelled);

    let (pay5, pay7, receipt) = {
        let ops: Vec<_> = state
            .ops
            .keys()
            .filter(|o| !o.is_compensation())
            .cloned()
            .collect();
        (ops[0].clone(), ops[1].clone(), ops[2].clone())
    };
    let (c7, c5) = (
        pay7.compensation_of().expect("an id"),
        pay5.compensation_of().expect("an id"),
    );
    // Each effect once, each reversal once, newest first, keyed by its own operation id.
    let ledger = h.ledger();
    assert_eq!(ledger.len(), 4, "{ledger:?}");
    assert_eq!(ledger[0], format!("{pay5}\tpay 5"));
    assert_eq!(ledger[1], format!("{pay7}\tpay 7"));
    assert_eq!(ledger[2], format!("{c7}\treversal of pay 7 ({pay7})"));
    assert_eq!(ledger[3], format!("{c5}\treversal of pay 5 ({pay5})"));

    let events = h.events(&run).await;
    assert_schema_valid(&events);
    let requested: Vec<_> = events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::ToolRequested(t) if t.compensates.is_some() => r.envelope.op.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(
        requested,
        [c7.clone(), c5.clone()],
        "one request each, newest first"
    );
    assert!(
        events
            .iter()
            .any(|r| matches!(r.envelope.event, Event::OutcomeConfirmed(_))
                && r.envelope.op.as_ref() == Some(&c7)),
        "the killed compensation was confirmed by the ledger's query, not run again"
    );
    let ended: Vec<_> = events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::RunCancelled(c) => Some(c.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(ended.len(), 1, "one terminal event");
    let ops = &ended[0].operations;
    assert_eq!(ops.len(), 4, "{ops:?}");
    for (op, c) in [(&pay5, &c5), (&pay7, &c7)] {
        let s = ops.iter().find(|s| s.op == *op).expect("listed");
        assert_eq!(
            (s.fate, s.level),
            (OpFate::Completed, Some(Level::Compensable))
        );
        let comp = s.compensation.as_ref().expect("compensated");
        assert_eq!(
            (comp.status, comp.op.as_ref()),
            (CompensationStatus::Compensated, Some(c))
        );
    }
    let s = ops.iter().find(|s| s.op == receipt).expect("listed");
    assert_eq!(
        (s.fate, s.level, &s.compensation),
        (OpFate::Completed, Some(Level::Irreversible), &None),
        "the irreversible effect is listed, not undone"
    );
    // `kedge runs show`'s view lists them too.
    let view = kedge_app::view::run_view(&state, &events);
    assert_eq!(view.effects, ended[0].operations);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_run_compensates_then_fails_with_its_reason() {
    let script = json!({"models": {"mfail": {"steps": [
        {"text": "paying", "tool_calls": [call("ledger_append", json!({"text": "pay 1"}))]},
        {"text": "paying", "tool_calls": [call("ledger_append", json!({"text": "pay 2"}))]},
        {"text": "never reached"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent_edited("budgeted", "mfail", |def| {
        def.policy = serde_json::from_value(json!({
            "ledger_append": {"reversibility": "compensable", "compensate": {
                "tool": "ledger_append", "arguments": {"text": "undo ${result}"}}}
        }))
        .expect("valid policy");
        def.on_failure = OnEnd::Compensate;
        def.budget.max_steps = 2;
    })
    .await;
    let run = h.submit("budgeted", "go", "task-comp-fail").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Failed);
    let failure = state.failure.clone().expect("a failure");
    assert_eq!(
        failure.reason,
        kedge_core::event::FailureReason::MaxSteps,
        "{failure:?}"
    );
    let ledger = h.ledger();
    assert_eq!(ledger.len(), 4, "{ledger:?}");
    assert!(ledger[2].ends_with("\tundo recorded: pay 2"), "{ledger:?}");
    assert!(ledger[3].ends_with("\tundo recorded: pay 1"), "{ledger:?}");
    assert_eq!(failure.effects.len(), 2);
    assert!(failure.effects.iter().all(|e| {
        e.compensation
            .as_ref()
            .is_some_and(|c| c.status == CompensationStatus::Compensated)
    }));
    assert_schema_valid(&h.events(&run).await);
    h.shutdown().await;
}
