//! The journal on a three-node cluster with R3 streams: reads see every acknowledged event, and
//! a stream-leader crash shows up as retryable errors, then appends land again with nothing lost
//! or stored twice.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kedge_journal::{ErrorKind, Journal, JournalError, LayoutOptions, ensure_layout};
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
            0,
            &[run_created(&run)],
        )
        .await
        .unwrap()
        .last_seq;
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
        last_decision = g.last_seq;
        count += 4;
        assert_eq!(journal.read(&run, 0).await.unwrap().len(), count);
        let seq = journal
            .append_input(&tool_result(&run, step, 0), &format!("r{step}"))
            .await
            .unwrap();
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
                    last_decision = a.last_seq;
                    break;
                }
                // An attempt that landed but whose ack was lost.
                Err(JournalError::Duplicate { seq }) => {
                    last_decision = seq;
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
