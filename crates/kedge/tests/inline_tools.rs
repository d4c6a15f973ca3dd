//! Built-in tools run inside the step's drive when the process runs the tool service too
//! (docs/ARCHITECTURE.md "Inline tools"): the whole agent loop of a run in one drive, no tool
//! worker's delivery and no wake of the run per operation; past one drive's budget the tool
//! service runs the rest; a process killed in the middle of an inline operation repeats no
//! effect; and a run cancelled meanwhile still ends.

use crate::common;

use std::time::Duration;

use common::{Harness, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::event::{Event, EventType};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

fn call(name: &str, args: serde_json::Value) -> serde_json::Value {
    json!({"name": name, "arguments": args})
}

/// Two steps with a ledger entry each (a built-in tool with a side effect), then the answer.
fn two_payments(model: &str) -> serde_json::Value {
    json!({"models": {model: {"steps": [
        {"text": "paying", "tool_calls": [call("ledger_append", json!({"text": "pay 5"}))]},
        {"text": "paying again", "tool_calls": [
            call("ledger_append", json!({"text": "pay 7"})),
            call("write_file", json!({"path": "receipt.txt", "content": "12"}))
        ]},
        {"text": "paid"}
    ]}}})
}

/// The run's (first) tool request was journaled, inline.
async fn assert_requested_inline(h: &Harness, run: &kedge_core::ids::RunId, case: &str) {
    let requested = h
        .events(run)
        .await
        .into_iter()
        .find(|r| r.envelope.event_type() == EventType::ToolRequested)
        .expect("the request was journaled");
    assert!(requested.envelope.inline, "{case}: requested inline");
}

/// How many messages a consumer of the journal was delivered so far.
async fn delivered(h: &Harness, consumer: &str) -> u64 {
    let mut c: async_nats::jetstream::consumer::PullConsumer =
        h.rt.js
            .get_consumer_from_stream(consumer, "KEDGE_RUNS")
            .await
            .expect("consumer");
    c.info()
        .await
        .expect("consumer info")
        .delivered
        .consumer_sequence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_beside_the_tool_service_runs_built_in_tools_in_its_drive() {
    let mut h = Harness::start(two_payments("mi"), &[Svc::Intake]).await;
    h.agent("payer", "mi").await;
    h.spawn_services(&[Svc::Step, Svc::Tool], "w-both");
    let run = h.submit("payer", "go", "task-inline").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded);
    let ledger = h.ledger();
    assert_eq!(ledger.len(), 2, "one entry per operation: {ledger:?}");
    let events = h.events(&run).await;
    let of = |t: EventType| -> Vec<bool> {
        events
            .iter()
            .filter(|r| r.envelope.event_type() == t)
            .map(|r| r.envelope.inline)
            .collect()
    };
    // Every request, start and result of the three operations is on its inline subject.
    for t in [
        EventType::ToolRequested,
        EventType::ToolStarted,
        EventType::ToolResult,
    ] {
        assert_eq!(of(t), [true, true, true], "{t}");
    }
    let receipt = events.iter().find_map(|r| match &r.envelope.event {
        Event::ToolResult(res) if res.content.contains("receipt.txt") => Some(res),
        _ => None,
    });
    assert!(receipt.is_some_and(|r| !r.is_error), "{receipt:?}");
    // No tool worker was asked, and no tool event woke the run: the only inputs the step
    // consumer saw are none (the run was started by its `run.created`, on the other consumer).
    assert_eq!(delivered(&h, "tool").await, 0, "the tool consumer");
    assert_eq!(delivered(&h, "step").await, 0, "the step's inputs consumer");
    assert_schema_valid(&events);
    h.check_replay(&run, "a-run-whose-tools-ran-inline").await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_a_drives_inline_budget_go_to_the_tool_service() {
    // One step asks for more built-in calls than one drive may run inline: the drive runs its
    // budget's worth, the rest are journaled as ordinary requests and the tool service (here in
    // the same process) runs them; every call has its one effect and one result.
    let budget = kedge_step::INLINE_PER_DRIVE as usize;
    let calls: Vec<serde_json::Value> = (0..budget + 4)
        .map(|i| call("ledger_append", json!({"text": format!("entry {i}")})))
        .collect();
    let script = json!({"models": {"mb": {"steps": [
        {"text": "many", "tool_calls": calls},
        {"text": "done"}
    ]}}});
    let mut h = Harness::start(script, &[Svc::Intake]).await;
    h.agent("many", "mb").await;
    h.spawn_services(&[Svc::Step, Svc::Tool], "w-both");
    let run = h.submit("many", "go", "task-inline-budget").await;
    let state = h.wait_terminal(&run, Duration::from_secs(180)).await;
    assert_eq!(state.status, RunStatus::Succeeded);
    let mut ledger = h.ledger();
    assert_eq!(ledger.len(), budget + 4, "one entry per call");
    ledger.sort();
    ledger.dedup();
    assert_eq!(ledger.len(), budget + 4, "no entry twice");
    let events = h.events(&run).await;
    let inline_of = |t: EventType| -> (usize, usize) {
        let flags: Vec<bool> = events
            .iter()
            .filter(|r| r.envelope.event_type() == t)
            .map(|r| r.envelope.inline)
            .collect();
        let inline = flags.iter().filter(|i| **i).count();
        (inline, flags.len() - inline)
    };
    // The budget's requests inline, with their starts and results; the rest on the tool
    // service's subjects.
    for t in [
        EventType::ToolRequested,
        EventType::ToolStarted,
        EventType::ToolResult,
    ] {
        assert_eq!(inline_of(t), (budget, 4), "{t}: (inline, not)");
    }
    assert_eq!(delivered(&h, "tool").await, 4, "the tool consumer");
    assert_schema_valid(&events);
    h.check_replay(&run, "a-run-past-its-inline-budget").await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_operations_run_at_most_tool_concurrency_at_once() {
    // A step asks for six calls at once; the process runs two operations at a time
    // (`tool_concurrency`), inline as on a tool worker: no two starts and results of more than
    // two operations overlap.
    let calls: Vec<serde_json::Value> = (0..6)
        .map(|_| call("shell", json!({"command": "sleep", "args": ["0.3"]})))
        .collect();
    let script = json!({"models": {"mt": {"steps": [
        {"text": "six", "tool_calls": calls},
        {"text": "done"}
    ]}}});
    let mut h = Harness::start_with(script, &[Svc::Intake], |c| c.tool_concurrency = 2).await;
    h.agent("six", "mt").await;
    h.spawn_services(&[Svc::Step, Svc::Tool], "w-both");
    let run = h.submit("six", "go", "task-inline-bound").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded);
    let events = h.events(&run).await;
    // +1 at each start, -1 at each result, in journal order (a start is journaled after its
    // slot is taken, a result before it is given back).
    let mut running = 0i32;
    let mut most = 0;
    for r in &events {
        match r.envelope.event_type() {
            EventType::ToolStarted => {
                assert!(r.envelope.inline, "started inline");
                running += 1;
                most = most.max(running);
            }
            EventType::ToolResult => running -= 1,
            _ => {}
        }
    }
    assert_eq!(most, 2, "operations running at once");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_in_an_inline_operation_repeats_no_effect() {
    // After the effect (the record still `running`: the next drive's claim takes it over and
    // the ledger's confirm query finds the entry); after the record and the result.
    for failpoint in ["tool.after_effect", "tool.after_record"] {
        let script = json!({"models": {"mk": {"steps": [
            {"text": "paying", "tool_calls": [call("ledger_append", json!({"text": "pay 5"}))]},
            {"text": "paid"}
        ]}}});
        let mut h = Harness::start(script, &[]).await;
        h.agent("ledger", "mk").await;
        let doomed = h.spawn_process("all", "w-all-doomed", failpoint);
        let run = h.submit("ledger", "go", "task-inline-kill").await;
        assert!(
            h.wait_exit(doomed, WAIT).await,
            "{failpoint}: the process should abort in the step's drive"
        );
        assert_eq!(h.ledger().len(), 1, "{failpoint}: the effect happened once");
        assert_requested_inline(&h, &run, failpoint).await;
        h.spawn_process("all", "w-all-fresh", "");
        let state = h.wait_terminal(&run, WAIT).await;
        assert_eq!(state.status, RunStatus::Succeeded, "{failpoint}");
        let ledger = h.ledger();
        assert_eq!(
            ledger.len(),
            1,
            "{failpoint}: the effect must not repeat: {ledger:?}"
        );
        assert_schema_valid(&h.events(&run).await);
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_run_left_with_an_unfinished_inline_operation_ends() {
    // The process dies with an inline operation unfinished, and the run's cancel comes
    // meanwhile; the next process's drive finds the run cancelling. An operation only
    // requested (`step.before_inline_run`) never started: the run ends without it, the effect
    // never runs. One whose effect ran (`tool.after_effect`, started and not recorded) must be
    // finished by that drive (taken over, confirmed, the outcome journaled) for the run to end:
    // not left waiting for the reconciler's nudge (`stall_after`, set longer than this test
    // waits).
    for (failpoint, effects, answered) in [
        ("step.before_inline_run", 0, vec![]),
        // Taken over from the gone runner and confirmed by the ledger's query.
        ("tool.after_effect", 1, vec![EventType::OutcomeConfirmed]),
    ] {
        let script = json!({"models": {"mx": {"steps": [
            {"text": "paying", "tool_calls": [call("ledger_append", json!({"text": "pay 5"}))]},
            {"text": "never"}
        ]}}});
        // The reconciler's nudge of a stalled run (which hands a stuck operation to the tool
        // service) out of this test's reach: the drive alone must finish it.
        let mut h = Harness::start_with(script, &[], |c| {
            c.timeouts.stall_after_ms = 300_000;
        })
        .await;
        h.agent("payer", "mx").await;
        let doomed = h.spawn_process("all", "w-all-doomed", failpoint);
        let run = h.submit("payer", "go", "task-inline-unfinished").await;
        assert!(
            h.wait_exit(doomed, WAIT).await,
            "{failpoint}: the process should abort in its drive"
        );
        assert_requested_inline(&h, &run, failpoint).await;
        h.cancel(&run).await;
        h.spawn_process("all", "w-all-fresh", "");
        let state = h.wait_terminal(&run, WAIT).await;
        assert_eq!(state.status, RunStatus::Cancelled, "{failpoint}");
        assert_eq!(h.ledger().len(), effects, "{failpoint}: effects");
        let events = h.events(&run).await;
        let answers: Vec<EventType> = events
            .iter()
            .map(|r| r.envelope.event_type())
            .filter(|t| {
                matches!(
                    t,
                    EventType::ToolResult
                        | EventType::OutcomeConfirmed
                        | EventType::OutcomeAmbiguous
                )
            })
            .collect();
        assert_eq!(answers, answered, "{failpoint}: the operation's answers");
        assert_schema_valid(&events);
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_stops_an_inline_tool_and_ends_the_run() {
    let script = json!({"models": {"mc": {"steps": [
        {"text": "sleeping", "tool_calls": [
            call("shell", json!({"command": "sleep", "args": ["20"]})),
            call("write_file", json!({"path": "x", "content": "y"}))]},
        {"text": "never"}
    ]}}});
    let mut h = Harness::start_with(script, &[Svc::Intake], |c| {
        c.timeouts.tool_timeout_ms = 30_000;
        c.timeouts.tool_ack_wait_ms = 45_000;
    })
    .await;
    h.agent("sleeper", "mc").await;
    h.spawn_services(&[Svc::Step, Svc::Tool], "w-both");
    let run = h.submit("sleeper", "go", "task-inline-cancel").await;
    h.wait_for(&run, WAIT, |s| {
        s.ops.values().any(|o| {
            o.call.name == "shell" && matches!(o.status, kedge_core::fold::OpStatus::Started { .. })
        })
    })
    .await;
    let asked = std::time::Instant::now();
    h.cancel(&run).await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Cancelled);
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "the sleep was stopped, not waited for"
    );
    let events = h.events(&run).await;
    let results: Vec<(bool, bool)> = events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::ToolResult(res) => Some((r.envelope.inline, res.stopped)),
            _ => None,
        })
        .collect();
    // Both ran inline; the shell was stopped by the cancel, the write was not.
    let mut stopped: Vec<bool> = results.iter().map(|(_, s)| *s).collect();
    stopped.sort();
    assert_eq!(stopped, [false, true], "{results:?}");
    assert!(results.iter().all(|(inline, _)| *inline), "{results:?}");
    h.shutdown().await;
}
