//! The reconciler nudges a run whose wake was acked but whose step never ran, once across
//! replicas, and leaves runs that legitimately wait alone.

use crate::common;

use std::time::Duration;

use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::event::Event;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_wake_was_acked_but_never_acted_on_is_nudged_and_completes() {
    let script = json!({"models": {"rn": {"steps": [
        {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "?"}}]},
        {"text": "done"}
    ]}}});
    let mut h = Harness::start_with(script, &[Svc::Intake], |c| {
        c.timeouts.stall_after_ms = 3_500;
    })
    .await;
    h.agent("rn", "rn").await;
    let run = h.submit("rn", "go", "rn-1").await;
    // Inject the failure: the step's wake (a new run's, on its own consumer) is taken and
    // acked, and nothing acts on it.
    let acked = common::swallow(
        &h.rt.js,
        kedge_core::subjects::Durable::StepCreated,
        Duration::from_secs(3),
        Duration::from_secs(1),
    )
    .await;
    assert_eq!(acked, 1, "the run.created wake");
    h.spawn_service(Svc::Step, "w-step");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(h.state(&run).await.status, RunStatus::Queued, "stalled");

    // Too early: the run's last event is younger than the stall threshold.
    let rec = h.runtime_as(kedge_runtime::secure::Kind::Reconciler).await;
    let early = kedge_reconciler::scan_once(&rec).await.expect("scan");
    assert!(early.nudged.is_empty());
    tokio::time::sleep(Duration::from_millis(3_600)).await;
    // Two replicas scan at once: one nudge.
    let (a, b) = tokio::join!(
        kedge_reconciler::scan_once(&rec),
        kedge_reconciler::scan_once(&rec)
    );
    let nudged = a.expect("scan").nudged.len() + b.expect("scan").nudged.len();
    assert_eq!(nudged, 1, "many replicas do not double-act");
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    let nudges = h
        .events(&run)
        .await
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::Nudge(_)))
        .count();
    assert_eq!(nudges, 1, "the nudge is journaled once");

    // A run waiting for a person is not stalled, however long it waits.
    tokio::time::sleep(Duration::from_millis(3_600)).await;
    let report = kedge_reconciler::scan_once(&rec).await.expect("scan");
    assert!(report.nudged.is_empty(), "{report:?}");
    assert_eq!(report.quiet, 1);
    let q = state.questions.keys().next().expect("a question").clone();
    h.input(
        &run,
        Event::QuestionAnswered(kedge_core::event::QuestionAnswered {
            question_id: q,
            answer: "yes".into(),
        }),
        "answer-rn",
    )
    .await;
    assert_eq!(
        h.wait_terminal(&run, WAIT).await.status,
        RunStatus::Succeeded
    );
    h.shutdown().await;
}

/// A tool worker killed mid-operation, and a tool consumer that would not redeliver for ten
/// minutes: the reconciler finds the operation stuck in `running` and has a tool runner resolve
/// it. With a confirm query (ledger_append) the run continues without repeating the effect; with
/// none (shell) the run sits in `unknown`. Two replicas scanning at once journal one nudge and
/// one outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_resolves_operations_stuck_in_running() {
    for (tool, args, confirmable) in [
        ("ledger_append", json!({"text": "pay 5"}), true),
        ("shell", json!({"command": "echo", "args": ["once"]}), false),
    ] {
        let script = json!({"models": {"rs": {"steps": [
            {"text": "acting", "tool_calls": [{"name": tool, "arguments": args}]},
            {"text": "done"}
        ]}}});
        let mut h = Harness::start_with(script, &[Svc::Intake, Svc::Step], |c| {
            // No redelivery within the test: only the reconciler can notice.
            c.timeouts.tool_ack_wait_ms = 600_000;
            c.timeouts.stall_after_ms = 3_500;
        })
        .await;
        h.agent("rs", "rs").await;
        let doomed = h.spawn_process("tool", "w-doomed", "tool.after_effect");
        let run = h.submit("rs", "go", &format!("rs-{tool}")).await;
        assert!(h.wait_exit(doomed, WAIT).await, "{tool}: the worker aborts");
        h.spawn_process("tool", "w-fresh", "");
        let state = h.state(&run).await;
        let (op, _) = state.ops.iter().next().expect("one op");
        assert!(
            matches!(
                state.ops[op].status,
                kedge_core::fold::OpStatus::Started { .. }
            ),
            "{tool}: started, never finished"
        );
        // Young: the runner might be alive. Nothing is asked.
        let rec = h.runtime_as(kedge_runtime::secure::Kind::Reconciler).await;
        let early = kedge_reconciler::scan_once(&rec).await.expect("scan");
        assert!(early.resolving.is_empty(), "{tool}: {early:?}");
        tokio::time::sleep(Duration::from_millis(3_600)).await;
        let (a, b) = tokio::join!(
            kedge_reconciler::scan_once(&rec),
            kedge_reconciler::scan_once(&rec)
        );
        let (a, b) = (a.expect("scan"), b.expect("scan"));
        // The first scan to reach the run asks; the other asks too, unless the first's nudge
        // already landed (the run is then not quiet: its last event is young).
        let mut asked: Vec<_> = a.resolving.iter().chain(&b.resolving).collect();
        assert!(!asked.is_empty(), "{tool}: {a:?} {b:?}");
        asked.dedup();
        assert_eq!(asked, vec![op], "{tool}");
        let done = if confirmable {
            h.wait_terminal(&run, WAIT).await
        } else {
            h.wait_for(&run, WAIT, |s| s.status == RunStatus::Unknown)
                .await
        };
        let events = h.events(&run).await;
        let count = |f: fn(&Event) -> bool| events.iter().filter(|r| f(&r.envelope.event)).count();
        assert_eq!(
            count(|e| matches!(e, Event::Nudge(n) if n.reason.contains("stuck"))),
            1,
            "{tool}: the reconciler's action is journaled once"
        );
        if confirmable {
            assert_eq!(done.status, RunStatus::Succeeded);
            assert_eq!(count(|e| matches!(e, Event::OutcomeConfirmed(_))), 1);
            assert_eq!(count(|e| matches!(e, Event::ToolResult(_))), 0);
            assert_eq!(h.ledger().len(), 1, "the effect did not repeat");
        } else {
            assert_eq!(count(|e| matches!(e, Event::OutcomeAmbiguous(_))), 1);
            // No automatic retry: it stays there.
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            assert_eq!(h.state(&run).await.status, RunStatus::Unknown);
            assert_eq!(h.mock.total_calls(), 1);
        }
        common::assert_schema_valid(&events);
        h.shutdown().await;
    }
}

/// A reconciler's scans look at the runs that are not settled (and those an event touched since
/// its last scan), not at every run ever created: runs that ended or wait on a person are
/// dropped once found so, and come back only when an event lands on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scans_look_at_unsettled_runs_only() {
    let script = json!({"models": {
        "done": {"steps": [{"text": "done"}]},
        "tool": {"steps": [
            {"text": "acting", "tool_calls": [{"name": "shell", "arguments": {"command": "echo", "args": ["x"]}}]},
            {"text": "done"}
        ]}
    }});
    // No tool service: the second agent's run waits on its tool, with an operation in flight.
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("done", "done").await;
    h.agent("tool", "tool").await;
    let mut done = Vec::new();
    for i in 0..4 {
        done.push(h.submit("done", "go", &format!("us-{i}")).await);
    }
    for run in &done {
        assert_eq!(
            h.wait_terminal(run, WAIT).await.status,
            RunStatus::Succeeded
        );
    }
    let waiting = h.submit("tool", "go", "us-tool").await;
    h.wait_for(&waiting, WAIT, |s| s.status == RunStatus::WaitingTool)
        .await;

    let rec = h.runtime_as(kedge_runtime::secure::Kind::Reconciler).await;
    let mut reconciler = kedge_reconciler::Reconciler::new(rec);
    // A fresh reconciler lists every run once.
    let first = reconciler.scan().await.expect("scan");
    assert_eq!(first.runs, 5, "{first:?}");
    assert_eq!(first.settled, 4, "{first:?}");
    assert_eq!(reconciler.unsettled(), 1);
    // Then only the run that is not settled.
    let second = reconciler.scan().await.expect("scan");
    assert_eq!(
        second.runs, 1,
        "settled runs are not visited again: {second:?}"
    );
    assert!(second.nudged.is_empty() && second.resolving.is_empty());

    // An event on an ended run brings it back for one look; found settled, it goes again.
    h.input(
        &done[0],
        Event::UserMessage(kedge_core::event::UserMessage {
            text: "one more thing".into(),
        }),
        "us-more",
    )
    .await;
    let third = reconciler.scan().await.expect("scan");
    assert_eq!(
        third.runs, 2,
        "the touched run and the waiting one: {third:?}"
    );
    // The revived turn may still be running: each of its events brings the run back for one
    // more look, until one finds it settled with nothing landed since. Then the waiting run
    // alone.
    let mut scans = 0;
    loop {
        let next = reconciler.scan().await.expect("scan");
        if next.runs == 1 {
            break;
        }
        assert_eq!(next.runs, 2, "only the touched run comes back: {next:?}");
        scans += 1;
        assert!(scans < 300, "the revived run never settled: {next:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(reconciler.unsettled(), 1);
    assert_eq!(reconciler.scan().await.expect("scan").runs, 1);
    h.shutdown().await;
}
