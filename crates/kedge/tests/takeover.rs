//! Takeover by the failure detector, with the DEFAULT timeouts (lease 15 s,
//! step ack wait 30 s, tool ack wait 90 s, abandonment 70 s): a standby takes over a run whose
//! worker was killed -9 mid model call, or an operation whose runner was killed mid tool call,
//! as soon as the broker says the process is gone — long before any of those timeouts could
//! have let it. A worker that is only paused keeps its run.
//!
//! Each bound below is far above what takeover takes (about half a second, see the `takeover`
//! bench) and far below the timeout that would otherwise have recovered the run, so they prove
//! which mechanism acted, not how fast this machine is.

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{Harness, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::config::Timeouts;
use kedge_core::event::Event;
use kedge_core::fold::OpStatus;
use kedge_core::ids::RunId;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);
/// Less than the default lease TTL (15 s), step ack wait (30 s) and abandonment age (70 s).
const TAKEN_OVER_WITHIN: Duration = Duration::from_secs(12);

fn call(name: &str, args: serde_json::Value) -> serde_json::Value {
    json!({"name": name, "arguments": args})
}

/// Waits until the run's first step has started and returns the worker holding its lease.
async fn driver_of(h: &Harness, run: &RunId) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let started = h
            .events(run)
            .await
            .iter()
            .any(|r| matches!(r.envelope.event, Event::StepStarted(_)));
        if started && let Some(l) = h.rt.leases.holder(run).await.expect("lease read") {
            return l.owner;
        }
        assert!(Instant::now() < deadline, "nobody drove {run}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until the run's lease is held by `worker` and its first step has started.
async fn driven_by(h: &Harness, run: &RunId, worker: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let holder = h.rt.leases.holder(run).await.expect("lease read");
        let started = h
            .events(run)
            .await
            .iter()
            .any(|r| matches!(r.envelope.event, Event::StepStarted(_)));
        if started && holder.is_some_and(|l| l.owner == worker) {
            return;
        }
        assert!(Instant::now() < deadline, "{worker} never drove {run}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {sig} {pid}");
}

/// A harness whose `kedge serve` processes run with the default timeouts.
async fn harness(script: serde_json::Value, in_process: &[Svc]) -> Harness {
    let mut h = Harness::start(script, in_process).await;
    h.config.timeouts = Timeouts::default();
    h
}

/// The reconnect grace the standby gives a holder killed mid model call (its answer might
/// still come, had it only lost its connection): short here, so the test does not wait 15 s.
const GRACE_MS: &str = "2000";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_model_call_is_replaced_by_the_standby_after_the_reconnect_grace() {
    let script = json!({"models": {"slow": {"steps": [
        {"text": "thinking", "delay_ms": 3000},
    ]}}});
    let mut h = harness(script, &[Svc::Intake]).await;
    h.agent("slow", "slow").await;
    // Two workers, both up and hearing each other; whichever takes the run is killed the
    // moment its `step.started` is journaled (the worst moment: nothing but the lease and the
    // heartbeat announce that it holds the run).
    let grace = [("KEDGE_RECONNECT_GRACE_MS", GRACE_MS.to_owned())];
    let workers = [
        ("w-a", h.spawn_process_with_env("all", "w-a", "", &grace)),
        ("w-b", h.spawn_process_with_env("all", "w-b", "", &grace)),
    ];
    for (w, _) in workers {
        h.heartbeat_of(w).await;
    }
    let run = h.submit("slow", "go", "task-kill-model").await;
    let holder = driver_of(&h, &run).await;
    let (_, doomed) = workers
        .into_iter()
        .find(|(w, _)| *w == holder)
        .expect("one of ours drives it");
    let killed = Instant::now();
    h.kill9(doomed);
    let state = h.wait_terminal(&run, WAIT).await;
    let took = killed.elapsed();
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert!(
        took < TAKEN_OVER_WITHIN,
        "the standby finished the run {took:?} after the kill: it waited for a timeout"
    );
    // The killed call was never answered; the standby's attempt was the only answered one.
    let calls = h.mock.calls();
    assert!(calls.by_request_id.values().all(|n| *n == 1), "{calls:?}");
    let attempts: Vec<u32> = h
        .events(&run)
        .await
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::StepStarted(s) => Some(s.request_id.attempt().get()),
            _ => None,
        })
        .collect();
    assert_eq!(attempts, vec![1, 2], "the standby started attempt 2");
    assert_schema_valid(&h.events(&run).await);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_run_whose_drive_fails_is_driven_again_without_waiting_for_a_redelivery() {
    let script = json!({"models": {"slow": {"steps": [
        {"text": "thinking", "delay_ms": 3000},
    ]}}});
    let mut h = harness(script, &[Svc::Intake]).await;
    h.agent("slow", "slow").await;
    let grace = [("KEDGE_RECONNECT_GRACE_MS", GRACE_MS.to_owned())];
    let a = h.spawn_process_with_env("step", "w-a", "", &grace);
    h.heartbeat_of("w-a").await;
    let run = h.submit("slow", "go", "task-adopt-fails").await;
    driven_by(&h, &run, "w-a").await;
    // The standby runs in this process, and its first two drives of the run fail (as they do
    // while the broker cannot answer yet; here a contained panic). The run's wake is held by
    // the killed worker: it comes back only after the step's ack wait (30 s).
    kedge_runtime::failpoint::arm_panic("step.drive", run.as_str(), 2);
    h.spawn_service_with(Svc::Step, "w-b", |c| {
        c.timeouts = Timeouts::default();
        c.timeouts.reconnect_grace_ms = GRACE_MS.parse().expect("grace");
    });
    h.heartbeat_of("w-b").await;
    let killed = Instant::now();
    h.kill9(a);
    let state = h.wait_terminal(&run, WAIT).await;
    let took = killed.elapsed();
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert!(
        took < TAKEN_OVER_WITHIN,
        "the standby finished the run {took:?} after the kill: it waited for the wake's redelivery"
    );
    // The killed call was never answered; no attempt was called twice.
    let calls = h.mock.calls();
    assert!(calls.by_request_id.values().all(|n| *n == 1), "{calls:?}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_worker_keeps_its_run_and_its_paid_call() {
    let script = json!({"models": {"slow": {"steps": [
        {"text": "thinking", "delay_ms": 3000},
    ]}}});
    let mut h = harness(script, &[Svc::Intake]).await;
    h.agent("slow", "slow").await;
    let a = h.spawn_process("step", "w-a", "");
    h.heartbeat_of("w-a").await;
    let run = h.submit("slow", "go", "task-pause").await;
    driven_by(&h, &run, "w-a").await;
    h.spawn_process("step", "w-b", "");
    h.heartbeat_of("w-b").await;

    // Silent for 2 s (several times the suspicion threshold), connection open: alive.
    let pid = h.pid(a);
    signal(pid, "-STOP");
    tokio::time::sleep(Duration::from_secs(2)).await;
    signal(pid, "-CONT");
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(
        h.mock.total_calls(),
        1,
        "one call, not a second one by the standby"
    );
    let started = h
        .events(&run)
        .await
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::StepStarted(_)))
        .count();
    assert_eq!(started, 1, "no false takeover");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_killed_mid_tool_call_is_replaced_by_the_standby_at_once() {
    let script = json!({"models": {"m": {"steps": [
        {"text": "sleeping", "tool_calls": [call("shell", json!({"command": "sleep", "args": ["3"]}))]},
        {"text": "done"}
    ]}}});
    let mut h = harness(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("sleeper", "m").await;
    let config = h.dir.path().join("tool-config.json");
    std::fs::write(&config, r#"{"shell_allowlist": ["sleep"]}"#).expect("config file");
    let env = [("KEDGE_CONFIG", config.display().to_string())];
    let runners = [
        ("w-ta", h.spawn_process_with_env("tool", "w-ta", "", &env)),
        ("w-tb", h.spawn_process_with_env("tool", "w-tb", "", &env)),
    ];
    for (w, _) in runners {
        h.heartbeat_of(w).await;
    }
    let run = h.submit("sleeper", "go", "task-kill-tool").await;
    // Killed the moment its `tool.started` is journaled.
    let state = h
        .wait_for(&run, WAIT, |s| {
            s.ops
                .values()
                .any(|op| matches!(op.status, OpStatus::Started { .. }))
        })
        .await;
    let runner = state
        .ops
        .values()
        .find_map(|op| match &op.status {
            OpStatus::Started { runner } => Some(runner.clone()),
            _ => None,
        })
        .expect("started");
    let (_, a) = runners
        .into_iter()
        .find(|(w, _)| *w == runner)
        .expect("one of ours runs it");
    let killed = Instant::now();
    h.kill9(a);
    // An interrupted shell command may or may not have had its effect, and `shell` has no
    // confirm query: the standby says so at once (the run waits for a person), instead of the
    // request sitting unacknowledged for the tool ack wait.
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::Unknown)
        .await;
    let took = killed.elapsed();
    assert!(
        took < TAKEN_OVER_WITHIN,
        "the standby took {took:?} after the kill: it waited for a timeout"
    );
    assert!(
        state
            .ops
            .values()
            .all(|op| matches!(op.status, OpStatus::Ambiguous { .. })),
        "{:?}",
        state.ops
    );
    assert_schema_valid(&h.events(&run).await);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_mid_model_call_keeps_the_paid_answer_for_the_next_holder() {
    let script = json!({"models": {"slow": {"steps": [
        {"text": "thinking", "delay_ms": 2000},
    ]}}});
    // Fast timeouts (renewal every 500 ms): the worker notices the loss during the call.
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("slow", "slow").await;
    let run = h.submit("slow", "go", "task-lease-lost").await;
    // Wait for the call to be in flight, then take the lease as a worker that no longer
    // exists would have (a false takeover, e.g. across a reconnect).
    let holder = loop {
        let started = h
            .events(&run)
            .await
            .iter()
            .any(|r| matches!(r.envelope.event, Event::StepStarted(_)));
        if let Some(holder) = h.rt.leases.holder(&run).await.expect("lease read")
            && started
        {
            break holder;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    h.rt.leases
        .take_over(
            &run,
            &common::worker("w-vanished"),
            holder.ttl,
            holder.revision,
        )
        .await
        .expect("taken");
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(
        h.mock.total_calls(),
        1,
        "the answer received after the loss was stored and reused, not paid again"
    );
    let reused = h
        .events(&run)
        .await
        .iter()
        .any(|r| matches!(&r.envelope.event, Event::StepCompleted(c) if c.reused));
    assert!(
        reused,
        "the next holder completed the step from the stored response"
    );
    h.shutdown().await;
}
