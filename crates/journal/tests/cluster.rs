//! The journal on a three-node cluster with R3 streams: reads see every acknowledged event, and
//! a stream-leader crash shows up as retryable errors, then appends land again with nothing lost
//! or stored twice.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kedge_core::ids::{DecisionSeq, InputId};
use kedge_journal::{ErrorKind, Journal, JournalError, LayoutOptions, RunCreator, ensure_layout};
use kedge_testkit::NatsCluster;

async fn setup_cluster() -> (NatsCluster, Journal) {
    let cluster = NatsCluster::start().await;
    let client = cluster.client().await;
    ensure_layout(&client, &LayoutOptions { replicas: 3 })
        .await
        .unwrap();
    (cluster, Journal::new(client))
}

async fn runs_leader(journal: &Journal) -> String {
    let info = journal
        .client()
        .request("$JS.API.STREAM.INFO.KEDGE_RUNS", "".into())
        .await
        .unwrap();
    let info: serde_json::Value = serde_json::from_slice(&info.payload).unwrap();
    info["cluster"]["leader"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn cluster_reads_see_every_acknowledged_event_and_failover_is_retryable() {
    let (mut cluster, journal) = setup_cluster().await;
    let run = new_run();

    // Read-your-writes after every append, whichever replica answers the direct gets.
    let mut last_decision = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "intake"),
            DecisionSeq::NONE,
            &[run_created(&run)],
        )
        .await
        .unwrap()
        .last_decision();
    let mut count = 1;
    for step in 1..=6 {
        let g = journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(&run, "step"),
                last_decision,
                &step_group(&run, step),
            )
            .await
            .unwrap();
        last_decision = g.last_decision();
        count += 4;
        assert_eq!(journal.read(&run, 0).await.unwrap().len(), count);
        let seq = journal
            .append_input(
                &InputId::arbitrary(format!("r{step}")),
                &tool_result(&run, step, 0),
            )
            .await
            .unwrap()
            .seq;
        count += 1;
        let all = journal.read(&run, 0).await.unwrap();
        assert_eq!(all.len(), count);
        assert_eq!(all.last().unwrap().seq, seq);
    }

    // Kill the journal stream's leader while appending decisions, retrying each append as a
    // step worker would.
    let leader = runs_leader(&journal).await;
    let node = cluster.node_index(&leader).unwrap();
    cluster.kill9(node);
    let started = Instant::now();
    let mut kinds = Vec::new();
    for i in 0..5 {
        let events = [run_started(&run)];
        loop {
            match journal
                .append_decisions(
                    &kedge_journal::DecisionWriter::unfenced(&run, "step"),
                    last_decision,
                    &events,
                )
                .await
            {
                Ok(a) => {
                    last_decision = a.last_decision();
                    break;
                }
                // An attempt that landed but whose ack was lost.
                Err(JournalError::Duplicate { seq }) => {
                    last_decision = DecisionSeq::at(seq);
                    break;
                }
                Err(e) => {
                    kinds.push(e.kind());
                    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e:?} (append {i})");
                    assert!(started.elapsed() < Duration::from_secs(30), "no recovery");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        count += 1;
    }
    let all = journal.read(&run, 0).await.unwrap();
    assert_eq!(all.len(), count, "nothing lost or duplicated");
    assert!(all.windows(2).all(|w| w[0].seq < w[1].seq));
    eprintln!(
        "failover: {} retryable errors, recovered in {:?}",
        kinds.len(),
        started.elapsed()
    );
    cluster.restart(node).await;
}

/// Two writers append a run's next decision at the same moment on an R3 stream, one with the
/// run-wide check (the step with its state current), one with the plain append (a writer whose
/// state is behind, a zombie that lost its lease): exactly one lands, every time, and the loser
/// is told. The leader refuses a check while a publish checked on the same subject string is
/// in flight, not one checked on another: with the plain append checked on the run's decisions
/// only (before), both landed in 30 to 38 of these 400 races, and in 299 of 300 sent at once
/// without the plain append's look. With its two lookups asked at once (a first version of the
/// fix), in 0 to 5 of 400: the answers could straddle the other writer's decision.
#[tokio::test]
async fn two_writers_racing_for_a_runs_next_decision_never_both_land() {
    const TRIES: usize = 400;
    let (_cluster, journal) = setup_cluster().await;
    let mut landed = Vec::new();
    for i in 0..TRIES {
        let run = new_run();
        let created = journal
            .create_run(&RunCreator::intake(), &run_created(&run))
            .await
            .unwrap();
        let current = kedge_journal::DecisionWriter::unfenced(&run, "current");
        let plain = kedge_journal::DecisionWriter::unfenced(&run, "plain");
        let (a, b) = (run_started(&run), run_started(&run));
        let current = journal.append_decision_current(
            &current,
            created.last_decision(),
            created.last_seq,
            &a,
        );
        let plain =
            journal.append_decisions(&plain, created.last_decision(), std::slice::from_ref(&b));
        // Both orders of sending.
        let (current, plain) = if i % 2 == 0 {
            futures::join!(current, plain)
        } else {
            let (plain, current) = futures::join!(plain, current);
            (current, plain)
        };
        for r in [&current, &plain] {
            if let Err(e) = r {
                assert!(
                    matches!(
                        e,
                        JournalError::Conflict { .. } | JournalError::Behind { .. }
                    ),
                    "try {i}: the loser is told it lost: {e:?}"
                );
            }
        }
        let n = usize::from(current.is_ok()) + usize::from(plain.is_ok());
        let decisions = journal
            .read(&run, 0)
            .await
            .unwrap()
            .iter()
            .filter(|r| r.envelope.kind() == kedge_core::EventKind::Decision)
            .count();
        assert_eq!(
            decisions,
            1 + n,
            "try {i}: what landed is what was answered"
        );
        landed.push(n);
    }
    let both = landed.iter().filter(|n| **n == 2).count();
    let none = landed.iter().filter(|n| **n == 0).count();
    assert_eq!(
        (both, none),
        (0, 0),
        "of {TRIES} races: both landed, none landed"
    );
}
