//! Parked leases (docs/ARCHITECTURE.md, "The step service"): a drive that leaves its run waiting
//! on its tools keeps the run's lease for the run's next drive instead of releasing it and
//! taking it again (two lease writes fewer per agent-loop step), and lets go of it when another
//! step worker woken for the run asks.

use crate::common;

use std::time::{Duration, Instant};

use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::decide::{Idle, Next, decide};
use kedge_core::ids::RunId;
use kedge_journal::LeaseHolder;
use kedge_model::ModelClient;
use kedge_runtime::Runtime;
use kedge_step::{Driver, Outcome};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

/// `n` steps of one `ledger_append` call each, then a final answer.
fn ledger_steps(model: &str, n: usize) -> serde_json::Value {
    let mut steps: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            json!({"text": format!("step {i}"), "tool_calls": [
                {"name": "ledger_append", "arguments": {"text": format!("entry {i}")}}]})
        })
        .collect();
    steps.push(json!({"text": "done"}));
    json!({"models": {model: {"steps": steps}}})
}

/// The default timeouts (leases renewed every 5 s): no renewal falls inside these short runs.
fn default_leases(c: &mut kedge_runtime::Config) {
    c.timeouts = kedge_core::config::Timeouts::default();
}

/// Writes on the lease bucket so far (each write is the next sequence of its stream).
async fn lease_writes(h: &Harness) -> u64 {
    let mut stream =
        h.rt.js
            .get_stream(format!("KV_{}", kedge_core::subjects::LEASES_BUCKET))
            .await
            .expect("lease bucket");
    stream
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence
}

/// Waits until `run`'s lease is held by `worker`.
async fn held_by(h: &Harness, run: &RunId, worker: &str) -> LeaseHolder {
    let deadline = Instant::now() + WAIT;
    loop {
        let holder = h.rt.leases.holder(run).await.expect("lease read");
        match holder {
            Some(l) if l.owner == worker => return l,
            other => assert!(
                Instant::now() < deadline,
                "{run}'s lease is not held by {worker}: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs an agent loop of `steps` ledger steps to its end with the default timeouts and
/// `park_leases` as given; returns the harness, the run and the lease writes it cost.
async fn a_loop(steps: usize, park: bool) -> (Harness, RunId, u64) {
    let h = Harness::start_with(
        ledger_steps("mloop", steps),
        &[Svc::Intake, Svc::Step, Svc::Tool],
        |c| {
            default_leases(c);
            c.park_leases = park;
        },
    )
    .await;
    h.agent("looper", "mloop").await;
    let before = lease_writes(&h).await;
    let run = h.submit("looper", "go", "task-loop").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(h.ledger().len(), steps);
    let writes = lease_writes(&h).await - before;
    (h, run, writes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_loop_keeps_its_lease_from_one_drive_to_the_next() {
    let (h, run, writes) = a_loop(6, true).await;
    // Seven drives (one per step, each woken by the last step's tool result). Released after
    // each and taken again by the next, that is 14 writes; parked in between, the first drive
    // acquires and the last releases (the slack: a wake that came before the drive parked).
    assert!(writes <= 4, "{writes} lease writes for seven drives");
    // An ended run's lease is released at once, not parked.
    assert_eq!(h.rt.leases.holder(&run).await.expect("lease read"), None);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_parking_off_every_drive_takes_and_releases_the_lease() {
    let (h, _, writes) = a_loop(3, false).await;
    // At least four drives (one per step; a wake that arrives during a drive makes one more),
    // each an acquire and a release.
    assert!(writes >= 8, "{writes} lease writes for four drives");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_lease_goes_to_another_step_worker_that_asks_for_it() {
    // No tool service yet: the run waits on its tool, and the step worker keeps its lease.
    let mut h = Harness::start_with(
        ledger_steps("mhand", 1),
        &[Svc::Intake, Svc::Step],
        default_leases,
    )
    .await;
    h.agent("handed", "mhand").await;
    let run = h.submit("handed", "go", "task-hand").await;
    h.wait_for(&run, WAIT, |s| {
        matches!(decide(s), Next::Idle(Idle::WaitingTools { .. }))
    })
    .await;
    let parked = held_by(&h, &run, "w-main-step").await;

    // Garbage on the yield subject is answered with nothing and lets nothing go.
    let yield_subject = kedge_core::subjects::live_yield(&common::worker("w-main-step"));
    for garbage in ["not a run id", "", "run_nobody_has"] {
        let answer =
            h.rt.client
                .request(yield_subject.clone(), garbage.to_owned().into())
                .await
                .expect("the step worker answers");
        assert!(
            answer.payload.is_empty(),
            "{garbage:?}: {:?}",
            answer.payload
        );
    }
    assert_eq!(held_by(&h, &run, "w-main-step").await, parked);

    // Another step worker, woken for the run, asks the holder (alive) for the lease and drives
    // the run (finding it waiting on its tool) instead of being turned away busy.
    let mut config = h.config.clone();
    config.worker_id = "w-other-step".parse().expect("worker id");
    let rt = Runtime::connect(config).await.expect("second runtime");
    let liveness = rt.liveness().await.expect("liveness");
    let (cancels, _) = tokio::sync::broadcast::channel(16);
    let other = Driver::new(rt, ModelClient::new(), cancels, liveness, None);
    let outcome = other.drive(&run, None, None, None).await.expect("drive");
    assert_eq!(outcome, Outcome::Idle);
    // It parked the lease in turn.
    let taken = held_by(&h, &run, "w-other-step").await;
    assert!(taken.revision > parked.revision);

    // It lets go when it stops; the tool's result then wakes the run at the first worker, which
    // finishes it.
    other.release_parked().await;
    h.spawn_service(Svc::Tool, "w-main-tool");
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(h.ledger().len(), 1);
    assert_eq!(h.mock.calls().total, 2, "one model call per step");
    h.shutdown().await;
}
