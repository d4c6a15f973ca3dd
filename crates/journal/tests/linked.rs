//! Reads by the links of the broker's run-wide checks (`Journal::read_linked`), on a real
//! nats-server: exactly what a read returns, from the messages a consumer delivered, fetching
//! only what is missing by sequence; nothing when a link is missing.

#![allow(clippy::unwrap_used)]

mod common;

use async_nats::jetstream::message::StreamMessage;
use common::*;
use kedge_core::ids::InputId;
use kedge_core::{Envelope, RunId};
use kedge_journal::{DecisionWriter, Delivered, Journal, RunCreator};

async fn read(journal: &Journal, run: &RunId, after: u64) -> Vec<(u64, Envelope)> {
    let read = journal.read(run, after).await.unwrap();
    read.into_iter().map(|r| (r.seq, r.envelope)).collect()
}

async fn linked(
    journal: &Journal,
    run: &RunId,
    after: u64,
    known: &[StreamMessage],
) -> Option<Vec<(u64, Envelope)>> {
    let known: Vec<Delivered<'_>> = known.iter().map(delivered).collect();
    let page = journal.read_linked(run, after, &known).await.unwrap()?;
    Some(
        page.events
            .into_iter()
            .map(|r| (r.seq, r.envelope))
            .collect(),
    )
}

#[tokio::test]
async fn a_run_is_read_back_by_its_links_from_what_was_delivered() {
    let (server, journal) = setup().await;
    let js = async_nats::jetstream::new(server.client().await);
    let run = new_run();
    let other = new_run();
    let noise = |n: u32| {
        let journal = journal.clone();
        let other = other.clone();
        async move {
            journal
                .append_input(
                    &InputId::arbitrary(format!("o-{n}")),
                    &user_message(&other, "x"),
                )
                .await
                .unwrap();
        }
    };
    let created = journal
        .create_run(&RunCreator::intake(), &run_created(&run))
        .await
        .unwrap();
    noise(0).await;
    let writer = DecisionWriter::unfenced(&run, "step");
    let mut decisions = vec![created.last_seq];
    let mut last = created.last_decision();
    for step in 1..=3u32 {
        // The step's group: an atomic batch (its second decision has no check of its own).
        let group = journal
            .append_decisions(&writer, last, &step_group(&run, step))
            .await
            .unwrap();
        decisions.extend(group.first_seq..=group.last_seq);
        last = group.last_decision();
        noise(step * 10).await;
        let started = journal
            .append_input_after(
                &InputId::arbitrary(format!("s-{step}")),
                &tool_started(&run, step, 0),
                Some(group.last_seq),
            )
            .await
            .unwrap();
        assert!(started.chained);
        noise(step * 10 + 1).await;
        let result = journal
            .append_input_after(
                &InputId::arbitrary(format!("r-{step}")),
                &tool_result(&run, step, 0),
                Some(started.seq),
            )
            .await
            .unwrap();
        assert!(result.chained);
    }
    let all = read(&journal, &run, 0).await;
    assert_eq!(all.len(), 1 + 3 * 6);

    // What a consumer of the decisions was delivered: every decision, or only the newest.
    let mut known = Vec::new();
    for &seq in &decisions {
        known.push(stored(&js, seq).await);
    }
    let tip = *decisions.last().unwrap();
    assert_eq!(
        linked(&journal, &run, 0, &known).await,
        Some(
            read(&journal, &run, 0)
                .await
                .into_iter()
                .filter(|(s, _)| *s <= tip)
                .collect()
        ),
        "from nothing folded, every decision held: the inputs fetched by their links"
    );
    for after in [created.last_seq, decisions[3], decisions[5]] {
        let want: Vec<(u64, Envelope)> = all
            .iter()
            .filter(|(s, _)| *s > after && *s <= tip)
            .cloned()
            .collect();
        let newest = [stored(&js, tip).await];
        assert_eq!(
            linked(&journal, &run, after, &newest).await,
            Some(want.clone()),
            "after {after}, the newest held"
        );
        let held: Vec<StreamMessage> = known
            .iter()
            .filter(|m| m.sequence > after)
            .cloned()
            .collect();
        assert_eq!(
            linked(&journal, &run, after, &held).await,
            Some(want),
            "after {after}"
        );
    }
    // From nothing folded with only the newest held: back to run.created one link at a time
    // (16 steps here, as many as a read by links walks).
    assert_eq!(
        linked(&journal, &run, 0, &[stored(&js, tip).await]).await,
        Some(all.iter().filter(|(s, _)| *s <= tip).cloned().collect())
    );
    // Nothing held after `after`: nothing to read.
    assert_eq!(linked(&journal, &run, tip, &known).await, Some(Vec::new()));
    // An `after` that is not the run's message: the links pass it by.
    assert_eq!(
        linked(&journal, &run, created.last_seq + 1, &known).await,
        None
    );

    // A message from outside (no check) on the way: no read by links.
    journal
        .append_input(&InputId::arbitrary("u-1"), &user_message(&run, "meanwhile"))
        .await
        .unwrap();
    let group = journal
        .append_decisions(&writer, last, &step_group(&run, 4))
        .await
        .unwrap();
    let newest = [stored(&js, group.last_seq).await];
    assert_eq!(linked(&journal, &run, tip, &newest).await, None);
    // From past it, the links hold again.
    let want: Vec<(u64, Envelope)> = read(&journal, &run, group.first_seq - 1).await;
    assert_eq!(
        linked(&journal, &run, group.first_seq - 1, &newest).await,
        Some(want)
    );
}

#[tokio::test]
async fn a_short_run_is_read_back_from_its_newest_message_to_its_creation() {
    let (server, journal) = setup().await;
    let js = async_nats::jetstream::new(server.client().await);
    let run = new_run();
    let created = journal
        .create_run(&RunCreator::intake(), &run_created(&run))
        .await
        .unwrap();
    let writer = DecisionWriter::unfenced(&run, "step");
    let group = journal
        .append_decisions(&writer, created.last_decision(), &step_group(&run, 1))
        .await
        .unwrap();
    let started = journal
        .append_input_after(
            &InputId::arbitrary("s-1"),
            &tool_started(&run, 1, 0),
            Some(group.last_seq),
        )
        .await
        .unwrap();
    let result = journal
        .append_input_after(
            &InputId::arbitrary("r-1"),
            &tool_result(&run, 1, 0),
            Some(started.seq),
        )
        .await
        .unwrap();
    assert!(started.chained && result.chained);
    // A process that holds no state of the run, woken by its tool's result.
    let wake = [stored(&js, result.seq).await];
    assert_eq!(
        linked(&journal, &run, 0, &wake).await,
        Some(read(&journal, &run, 0).await)
    );
}
