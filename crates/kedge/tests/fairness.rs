//! Fairness across tenants (docs/ARCHITECTURE.md "Fairness across tenants"): one tenant's backlog
//! does not hold back another tenant's next run. Judged by order, never by time: which runs'
//! `run.succeeded` the journal holds first.

use crate::common;

use std::time::Duration;

use common::{Harness, Svc};
use kedge_core::event::EventType;
use kedge_core::ids::RunId;
use kedge_core::task::TaskSubmission;
use serde_json::json;

const AGENT: &str = "fair";
const MODEL: &str = "fair-model";
/// The backlog of the noisy tenant.
const BACKLOG: usize = 200;
const WAIT: Duration = Duration::from_secs(120);

async fn submit(h: &Harness, tenant: &str, key: &str) -> RunId {
    let task = TaskSubmission::new(AGENT.parse().expect("agent name"), "go");
    let submission = kedge_intake::Submission {
        task: &task,
        key,
        tenant,
        caller: Some("test"),
    };
    match kedge_intake::submit(&h.rt.client, &submission, Duration::from_secs(20))
        .await
        .expect("intake answered")
    {
        kedge_intake::Answer::Accepted { run_id } => run_id,
        kedge_intake::Answer::Rejected { error } => panic!("rejected: {error}"),
    }
}

/// The stream sequence of the run's `run.succeeded`, once it has one.
async fn succeeded_at(h: &Harness, run: &RunId) -> u64 {
    h.wait_for(run, WAIT, |s| s.status.is_terminal()).await;
    let found =
        h.rt.journal
            .last_of(run, &[EventType::RunSucceeded])
            .await
            .expect("journal read");
    found
        .first()
        .unwrap_or_else(|| panic!("run {run} did not succeed"))
        .seq
}

/// Tenant `acme` has 200 runs waiting for the one step worker (2 drives at once) when tenant
/// `globex` submits one: globex's run is driven within the first turns, not after acme's
/// backlog. The step service starts only once every run is created, so every wake waits in
/// the step consumer in arrival order (acme's 200, then globex's): in arrival order globex's
/// run would be the last to complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenants_backlog_does_not_hold_back_another_tenants_run() {
    let script = json!({"models": {MODEL: {"default": {"text": "done", "delay_ms": 10}}}});
    let mut h = Harness::start(script, &[Svc::Intake]).await;
    h.agent(AGENT, MODEL).await;
    let mut noisy = Vec::with_capacity(BACKLOG);
    for i in 0..BACKLOG {
        noisy.push(submit(&h, "acme", &format!("acme-{i}")).await);
    }
    let quiet = submit(&h, "globex", "globex-0").await;
    h.spawn_service_with(Svc::Step, "w-fair-step", |c| c.step_concurrency = 2);

    let quiet_at = succeeded_at(&h, &quiet).await;
    let mut before = 0;
    for run in &noisy {
        if succeeded_at(&h, run).await < quiet_at {
            before += 1;
        }
    }
    // Fair order: globex's one run comes within the first turns (the feed's reader takes the
    // consumer's first batch, then the rest; globex's lane is served on its next turn). In
    // arrival order it would come after all 200.
    assert!(
        before < BACKLOG / 4,
        "{before} of acme's {BACKLOG} runs completed before globex's one run"
    );
    // Nothing lost, nothing done twice: every run.succeeded exactly once.
    for run in noisy.iter().chain(std::iter::once(&quiet)) {
        let completed = h
            .events(run)
            .await
            .iter()
            .filter(|r| r.envelope.event_type() == EventType::RunSucceeded)
            .count();
        assert_eq!(completed, 1, "run {run}");
    }
    h.shutdown().await;
}
