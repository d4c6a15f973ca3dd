//! Reads of a run spread over history: a run whose events lie far apart among other runs'
//! messages is read by its literal subjects (one batched direct get per event type, merged by
//! sequence). These tests fail if that read lost, duplicated or misordered an event, mishandled
//! a message set aside or skipped, or a page boundary: whole, from anywhere, paged and through
//! a known sequence, it must equal the run's events in order.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use futures::StreamExt;
use kedge_core::ids::{DecisionSeq, InputId};
use kedge_core::{DecisionEnvelope, Envelope, InputEnvelope, RunId};
use kedge_journal::blob::INLINE_MAX;
use kedge_journal::{DecisionWriter, Journal, ReadPage, RunCreator};

/// Other runs' messages stored between two of the run's: `n` of them, on 97 subjects.
async fn filler(js: &async_nats::jetstream::Context, n: usize, salt: usize) {
    let mut acks = Vec::with_capacity(n);
    for i in 0..n {
        let subject = format!("agent.run.run_fill{}.i.user.message", (i + salt) % 97);
        let ack = js
            .publish(subject, format!("filler {salt} {i}").into_bytes().into())
            .await
            .unwrap();
        acks.push(ack);
        if acks.len() == 512 {
            for ack in acks.drain(..) {
                ack.await.unwrap();
            }
        }
    }
    for ack in acks {
        ack.await.unwrap();
    }
}

/// A tool result too large to hold inline: stored by reference.
fn big_result(run: &RunId, step: u32) -> InputEnvelope {
    long_tool_result(run, step, 9, INLINE_MAX + 1000)
}

/// What a spread run holds: its events with their sequences, and the sequences of the messages
/// set aside, in order.
struct Spread {
    run: RunId,
    events: Vec<(u64, Envelope)>,
    aside: Vec<u64>,
}

/// A run of 8 steps (decision groups, tool results, user messages, one result by reference),
/// with garbage on its subjects and a message on a non-event subject, every one of its messages
/// `gap` other messages after the one before.
async fn write_spread_run(journal: &Journal, gap: usize) -> Spread {
    let js = async_nats::jetstream::new(journal.client().clone());
    let run = new_run();
    let mut events = Vec::new();
    let mut aside = Vec::new();
    filler(&js, gap, 0).await;
    let created = run_created(&run);
    let a = journal
        .create_run(&RunCreator::intake(), &created)
        .await
        .unwrap();
    events.push((a.last_seq, created.into_envelope()));
    let mut last_decision = a.last_decision();
    let mut salt = 1;
    for step in 1..=8 {
        filler(&js, gap, salt).await;
        salt += 1;
        let group = step_group(&run, step);
        let g = journal
            .append_decisions(
                &DecisionWriter::unfenced(&run, "step"),
                last_decision,
                &group,
            )
            .await
            .unwrap();
        last_decision = g.last_decision();
        events.extend(
            (g.first_seq..=g.last_seq).zip(group.into_iter().map(DecisionEnvelope::into_envelope)),
        );
        for i in 0..2 {
            filler(&js, gap, salt).await;
            salt += 1;
            let input = if step == 4 && i == 1 {
                big_result(&run, step)
            } else {
                tool_result(&run, step, i)
            };
            let seq = journal
                .append_input(&InputId::arbitrary(format!("r-{run}-{step}-{i}")), &input)
                .await
                .unwrap()
                .seq;
            events.push((seq, input.into_envelope()));
        }
        filler(&js, gap, salt).await;
        salt += 1;
        match step {
            2 => aside.push(
                publish_raw(
                    &js,
                    format!("agent.run.{run}.i.user.message"),
                    b"not json".to_vec(),
                    None,
                )
                .await,
            ),
            3 => aside.push(
                publish_raw(
                    &js,
                    format!("agent.run.{run}.i.tool.result"),
                    user_message(&new_run(), "another run's").to_json_bytes(),
                    None,
                )
                .await,
            ),
            5 => {
                // Neither an event nor set aside: skipped.
                publish_raw(
                    &js,
                    format!("agent.run.{run}.x.note"),
                    b"a reserved subtree".to_vec(),
                    None,
                )
                .await;
            }
            6 => {
                // A decision without the writer's id: set aside, and it moves the run's last
                // decision.
                let seq = publish_raw(
                    &js,
                    format!("agent.run.{run}.d.run.started"),
                    run_started(&run).to_json_bytes(),
                    None,
                )
                .await;
                aside.push(seq);
                last_decision = DecisionSeq::at(seq);
            }
            _ => {
                let m = user_message(&run, &format!("message {step}"));
                let seq = journal
                    .append_input(&InputId::arbitrary(format!("u-{run}-{step}")), &m)
                    .await
                    .unwrap()
                    .seq;
                events.push((seq, m.into_envelope()));
            }
        }
    }
    // Other runs' messages after it, too.
    filler(&js, gap, salt).await;
    Spread { run, events, aside }
}

fn seqs(page: &ReadPage) -> Vec<u64> {
    page.events.iter().map(|r| r.seq).collect()
}

/// `page` holds exactly the events of `want` and the set-aside sequences of `aside` after
/// `after` (`how` names the read in the messages).
fn assert_all_after(
    page: &ReadPage,
    want: &[(u64, Envelope)],
    aside: &[u64],
    after: u64,
    how: &str,
) {
    let expected: Vec<(u64, Envelope)> = want.iter().filter(|(s, _)| *s > after).cloned().collect();
    assert_eq!(pairs(page), expected, "{how}after {after}");
    let aside: Vec<u64> = aside.iter().copied().filter(|s| *s > after).collect();
    assert_eq!(
        page.set_aside.iter().map(|a| a.seq).collect::<Vec<_>>(),
        aside,
        "set aside {how}after {after}"
    );
}

fn pairs(page: &ReadPage) -> Vec<(u64, Envelope)> {
    page.events
        .iter()
        .map(|r| (r.seq, r.envelope.clone()))
        .collect()
}

/// Reads the run in pages of `size` events from `after`: the events and the set-aside
/// sequences, concatenated.
async fn paged(journal: &Journal, run: &RunId, size: usize) -> (Vec<(u64, Envelope)>, Vec<u64>) {
    let (mut events, mut aside) = (Vec::new(), Vec::new());
    let mut after = 0;
    loop {
        let page = journal.read_at_most(run, after, size).await.unwrap();
        assert!(page.events.len() <= size);
        assert!(
            page.events.first().is_none_or(|e| e.seq > after),
            "a page starts after its cursor"
        );
        events.extend(pairs(&page));
        aside.extend(page.set_aside.iter().map(|a| a.seq));
        match page.events.last() {
            Some(last) => after = last.seq,
            None => assert!(!page.more, "an empty page is the last"),
        }
        if !page.more {
            return (events, aside);
        }
    }
}

#[tokio::test]
async fn a_run_spread_over_history_reads_whole_in_order_from_anywhere_and_in_pages() {
    let (_server, journal) = setup().await;
    // ~60 messages of the run over ~140k of the stream: far enough apart for the read by
    // literal subjects (more than 2048 other messages per message of the run).
    let s = write_spread_run(&journal, 4200).await;
    let (run, want) = (&s.run, &s.events);
    assert!(want.windows(2).all(|w| w[0].0 < w[1].0));
    // run.created, 8 × (a group of 4 and 2 results), 4 user messages.
    assert_eq!(want.len(), 1 + 8 * 6 + 4);

    let whole = journal.read_with_set_aside(run, 0).await.unwrap();
    assert_eq!(
        pairs(&whole),
        *want,
        "whole, in order, by reference resolved"
    );
    assert_eq!(
        whole.set_aside.iter().map(|a| a.seq).collect::<Vec<_>>(),
        s.aside
    );
    assert!(!whole.more);
    assert_eq!(journal.read(run, 0).await.unwrap().len(), want.len());

    // From anywhere: every event's sequence, the one before it and every set-aside one.
    let mut cursors: Vec<u64> = want
        .iter()
        .flat_map(|(seq, _)| [*seq - 1, *seq])
        .chain(s.aside.iter().copied())
        .collect();
    cursors.sort_unstable();
    cursors.dedup();
    for after in cursors {
        let page = journal.read_with_set_aside(run, after).await.unwrap();
        assert_all_after(&page, want, &s.aside, after, "");
    }

    // In pages: every boundary, the set-aside messages reported once each.
    for size in [1, 3, 4, 7, 25, 1000] {
        let (events, aside) = paged(&journal, run, size).await;
        assert_eq!(events, *want, "pages of {size}");
        assert_eq!(aside, s.aside, "set aside in pages of {size}");
    }

    // Through a known sequence (the step service's read), from the start and from the middle.
    let last = want.last().unwrap().0;
    let page = journal.read_through(run, 0, last).await.unwrap();
    assert_eq!(pairs(&page), *want);
    let mid = want[want.len() / 2].0;
    let page = journal.read_through(run, mid, last).await.unwrap();
    assert_eq!(
        seqs(&page),
        want.iter()
            .map(|(s, _)| *s)
            .filter(|s| *s > mid)
            .collect::<Vec<_>>()
    );
    // From every event and every set-aside message: near the end by the probe, far from it
    // (16k sequences and more) by the literal subjects at once.
    for after in want.iter().map(|(s, _)| *s).chain(s.aside.iter().copied()) {
        let page = journal.read_through(run, after, last).await.unwrap();
        assert_all_after(&page, want, &s.aside, after, &format!("through {last} "));
    }

    // The same as a tail (an ordered consumer) delivers.
    let mut tail = Box::pin(journal.tail(run, 0));
    let mut tailed = Vec::new();
    while tailed.len() < want.len() {
        let r = tokio::time::timeout(Duration::from_secs(10), tail.next())
            .await
            .expect("in time")
            .expect("open")
            .unwrap();
        tailed.push((r.seq, r.envelope));
    }
    assert_eq!(tailed, *want);

    // What lands after the read is read next, and a decision goes on after the set-aside one.
    let last_decision = journal.last_decision_seq(run).await.unwrap();
    let more = journal
        .append_decisions(
            &DecisionWriter::unfenced(run, "step"),
            DecisionSeq::at(last_decision),
            &step_group(run, 9),
        )
        .await
        .unwrap();
    let page = journal.read_with_set_aside(run, 0).await.unwrap();
    assert_eq!(page.events.len(), want.len() + 4);
    assert_eq!(
        seqs(&page)[want.len()..],
        (more.first_seq..=more.last_seq).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn spread_runs_side_by_side_each_read_only_their_own_events() {
    let (_server, journal) = setup().await;
    // Two spread runs written into the same stretch of history: each one's filler holds the
    // other's messages too.
    let (a, b) = futures::join!(
        write_spread_run(&journal, 2300),
        write_spread_run(&journal, 2300)
    );
    for s in [&a, &b] {
        let page = journal.read_with_set_aside(&s.run, 0).await.unwrap();
        assert_eq!(pairs(&page), s.events);
        assert_eq!(
            page.set_aside.iter().map(|a| a.seq).collect::<Vec<_>>(),
            s.aside
        );
        let (events, aside) = paged(&journal, &s.run, 5).await;
        assert_eq!(events, s.events);
        assert_eq!(aside, s.aside);
    }
}

#[tokio::test]
async fn a_spread_run_with_garbage_on_many_subjects_reads_the_same() {
    let (_server, journal) = setup().await;
    let js = async_nats::jetstream::new(journal.client().clone());
    // Garbage on more subjects than the read by literal subjects takes on (it leaves the run
    // to the wildcard), spread too, among a few events.
    let run = new_run();
    let created = run_created(&run);
    let a = journal
        .create_run(&RunCreator::intake(), &created)
        .await
        .unwrap();
    let mut events = vec![(a.last_seq, created.into_envelope())];
    let mut aside = Vec::new();
    for i in 0..70 {
        filler(&js, 2500, i).await;
        if i % 10 == 5 {
            let m = user_message(&run, &format!("message {i}"));
            let seq = journal
                .append_input(&InputId::arbitrary(format!("u-{i}")), &m)
                .await
                .unwrap()
                .seq;
            events.push((seq, m.into_envelope()));
        }
        aside.push(
            publish_raw(
                &js,
                format!("agent.run.{run}.i.junk{i}"),
                b"junk".to_vec(),
                None,
            )
            .await,
        );
    }
    let m = user_message(&run, "the last word");
    let seq = journal
        .append_input(&InputId::arbitrary("u-last"), &m)
        .await
        .unwrap()
        .seq;
    events.push((seq, m.into_envelope()));
    filler(&js, 2300, 99).await;
    let page = journal.read_with_set_aside(&run, 0).await.unwrap();
    assert_eq!(pairs(&page), events);
    assert_eq!(
        page.set_aside.iter().map(|a| a.seq).collect::<Vec<_>>(),
        aside
    );
    let (paged_events, paged_aside) = paged(&journal, &run, 3).await;
    assert_eq!(paged_events, events);
    assert_eq!(paged_aside, aside);
}
