//! Reads, tails and input deduplication.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures::StreamExt;
use kedge_core::ids::{DecisionSeq, InputId};
use kedge_core::{DecisionEnvelope, Envelope, EventKind, RunId};
use kedge_journal::{DecisionWriter, InputAppended, Journal, JournalError, Recorded, RunCreator};

/// Writes a run of `n` decisions and inputs (groups included), interleaved with another run's
/// events; returns what was written with its sequences.
async fn write_run(journal: &Journal, run: &RunId, other: &RunId) -> Vec<(u64, Envelope)> {
    let mut written = Vec::new();
    let created = run_created(run);
    let a = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(run, "intake"),
            DecisionSeq::NONE,
            std::slice::from_ref(&created),
        )
        .await
        .unwrap();
    written.push((a.last_seq, created.into_envelope()));
    journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(other, "intake"),
            DecisionSeq::NONE,
            &[run_created(other)],
        )
        .await
        .unwrap();
    let mut last_decision = a.last_decision();
    for step in 1..=4 {
        let group = step_group(run, step);
        let g = journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(run, "step"),
                last_decision,
                &group,
            )
            .await
            .unwrap();
        last_decision = g.last_decision();
        written.extend(
            (g.first_seq..=g.last_seq).zip(group.into_iter().map(DecisionEnvelope::into_envelope)),
        );
        journal
            .append_input(
                &InputId::arbitrary(format!("o-{step}")),
                &user_message(other, "noise"),
            )
            .await
            .unwrap();
        for i in 0..2 {
            let input = tool_result(run, step, i);
            let seq = journal
                .append_input(&InputId::arbitrary(format!("r-{step}-{i}")), &input)
                .await
                .unwrap()
                .seq;
            written.push((seq, input.into_envelope()));
        }
    }
    written
}

fn check_reads_from_every_sequence(
    written: &[(u64, Envelope)],
    read: impl Fn(u64) -> Vec<Recorded>,
) {
    let last = written.last().unwrap().0;
    for after in 0..=last + 1 {
        let got: Vec<(u64, Envelope)> = read(after)
            .into_iter()
            .map(|r| (r.seq, r.envelope))
            .collect();
        let want: Vec<(u64, Envelope)> = written
            .iter()
            .filter(|(s, _)| *s > after)
            .cloned()
            .collect();
        assert_eq!(got, want, "read after {after}");
    }
}

async fn read_all_from_every_sequence(
    journal: &Journal,
    run: &RunId,
    last: u64,
) -> Vec<Vec<Recorded>> {
    let mut out = Vec::new();
    for after in 0..=last + 1 {
        out.push(journal.read(run, after).await.unwrap());
    }
    out
}

#[tokio::test]
async fn reads_from_every_sequence_return_exactly_what_follows_also_after_a_crash() {
    let (mut server, journal) = setup().await;
    let run = new_run();
    let other = new_run();
    let written = write_run(&journal, &run, &other).await;
    assert!(written.len() >= 20, "{}", written.len());
    let last = written.last().unwrap().0;

    let reads = read_all_from_every_sequence(&journal, &run, last).await;
    check_reads_from_every_sequence(&written, |after| reads[after as usize].clone());

    // Nothing after the end: an empty answer, promptly.
    let t = Instant::now();
    assert!(journal.read(&run, last).await.unwrap().is_empty());
    assert!(journal.read(&new_run(), 0).await.unwrap().is_empty());
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );

    server.kill9();
    server.restart().await;
    let journal = Journal::new(server.client().await);
    let reads = read_all_from_every_sequence(&journal, &run, last).await;
    check_reads_from_every_sequence(&written, |after| reads[after as usize].clone());
    assert_eq!(journal.last_seq(&run).await.unwrap(), Some(last));
}

#[tokio::test]
async fn an_input_published_twice_with_one_msg_id_is_stored_once() {
    let (_server, journal) = setup().await;
    let run = new_run();
    let input = user_message(&run, "hello");
    let first = journal
        .append_input(&InputId::arbitrary("client-key-1"), &input)
        .await
        .unwrap();
    assert!(!first.duplicate, "{first:?}");
    let seq = first.seq;
    // The repeat stores nothing and is answered with the first one's sequence.
    let again = journal
        .append_input(&InputId::arbitrary("client-key-1"), &input)
        .await;
    assert_eq!(
        again,
        Ok(InputAppended {
            seq,
            duplicate: true,
            chained: false
        })
    );
    let other = journal
        .append_input(&InputId::arbitrary("client-key-2"), &input)
        .await
        .unwrap();
    assert!(!other.duplicate, "{other:?}");
    let other = other.seq;
    let all = journal.read(&run, 0).await.unwrap();
    assert_eq!(all.iter().map(|r| r.seq).collect::<Vec<_>>(), [seq, other]);
    assert_eq!(all[0].msg_id.as_deref(), Some("client-key-1"));
}

#[tokio::test]
async fn messages_that_are_not_events_of_the_run_are_set_aside_and_reported_never_fatal() {
    let (server, journal) = setup().await;
    let (run, other) = (new_run(), new_run());
    let js = async_nats::jetstream::new(server.client().await);
    // Before the run exists, too.
    let early = publish_raw(
        &js,
        format!("agent.run.{run}.i.user.message"),
        b"early junk".to_vec(),
        None,
    )
    .await;
    let written = write_run(&journal, &run, &other).await;
    let input = |t: &str| format!("agent.run.{run}.i.{t}");
    let mut bad = vec![early];
    bad.push(publish_raw(&js, input("user.message"), b"not json".to_vec(), None).await);
    bad.push(
        publish_raw(
            &js,
            input("user.message"),
            b"{\"run_id\": 1}".to_vec(),
            None,
        )
        .await,
    );
    bad.push(
        publish_raw(
            &js,
            input("user.message"),
            user_message(&other, "another run's").to_json_bytes(),
            None,
        )
        .await,
    );
    bad.push(
        publish_raw(
            &js,
            input("tool.result"),
            user_message(&run, "another type's").to_json_bytes(),
            None,
        )
        .await,
    );
    // A well-formed decision without the writer's Nats-Msg-Id, and one with a client's id.
    bad.push(
        publish_raw(
            &js,
            format!("agent.run.{run}.d.run.started"),
            run_started(&run).to_json_bytes(),
            None,
        )
        .await,
    );
    bad.push(
        publish_raw(
            &js,
            format!("agent.run.{run}.d.run.started"),
            run_started(&run).to_json_bytes(),
            Some("client-key"),
        )
        .await,
    );
    // The run goes on after them: the writer appends after the set-aside decision.
    let last_decision = journal.last_decision_seq(&run).await.unwrap();
    assert_eq!(last_decision, *bad.last().unwrap(), "the broker counts it");
    let more = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "step"),
            DecisionSeq::at(last_decision),
            &step_group(&run, 5),
        )
        .await
        .unwrap();

    let want: Vec<u64> = written
        .iter()
        .map(|(s, _)| *s)
        .chain(more.first_seq..=more.last_seq)
        .collect();
    let got: Vec<u64> = journal
        .read(&run, 0)
        .await
        .unwrap()
        .iter()
        .map(|r| r.seq)
        .collect();
    assert_eq!(got, want, "read returns the events only");
    let page = journal.read_with_set_aside(&run, 0).await.unwrap();
    assert_eq!(page.events.len(), want.len());
    let aside: Vec<u64> = page.set_aside.iter().map(|a| a.seq).collect();
    assert_eq!(aside, bad);
    let kinds: Vec<EventKind> = page.set_aside.iter().map(|a| a.kind).collect();
    assert_eq!(kinds[..5], [EventKind::Input; 5]);
    assert_eq!(kinds[5..], [EventKind::Decision; 2]);
    for a in &page.set_aside {
        assert!(!a.reason.is_empty(), "{a:?}");
        assert!(a.subject.starts_with(&format!("agent.run.{run}.")), "{a:?}");
    }
    // From the middle: only what follows.
    let after = bad[2];
    let page = journal.read_with_set_aside(&run, after).await.unwrap();
    assert_eq!(
        page.set_aside.iter().map(|a| a.seq).collect::<Vec<_>>(),
        bad[3..]
    );
    assert!(page.events.iter().all(|r| r.seq > after));
    // Pages skip them too and stay gap-free in events.
    let mut after = 0;
    let mut paged = Vec::new();
    let mut paged_aside = Vec::new();
    loop {
        let page = journal.read_at_most(&run, after, 3).await.unwrap();
        paged.extend(page.events.iter().map(|r| r.seq));
        paged_aside.extend(page.set_aside.iter().map(|a| a.seq));
        if let Some(last) = page.events.last() {
            after = last.seq;
        }
        if !page.more {
            break;
        }
    }
    assert_eq!(paged, want);
    assert_eq!(paged_aside, bad);
    // A tail skips them as well.
    let mut tail = Box::pin(journal.tail(&run, 0));
    let mut tailed = Vec::new();
    while tailed.len() < want.len() {
        let r = tokio::time::timeout(Duration::from_secs(5), tail.next())
            .await
            .expect("in time")
            .expect("open")
            .unwrap();
        tailed.push(r.seq);
    }
    assert_eq!(tailed, want);
    // A run id that holds nothing but garbage reads as empty.
    let ghost = new_run();
    publish_raw(
        &js,
        format!("agent.run.{ghost}.d.run.created"),
        b"x".to_vec(),
        None,
    )
    .await;
    let page = journal.read_with_set_aside(&ghost, 0).await.unwrap();
    assert!(page.events.is_empty());
    assert_eq!(page.set_aside.len(), 1);
}

#[tokio::test]
async fn tail_replays_then_delivers_live_appends_without_gap_or_duplicate() {
    let (_server, journal) = setup().await;
    let run = new_run();
    let other = new_run();
    let written = write_run(&journal, &run, &other).await;
    let from = written[5].0;
    let mut tail = Box::pin(journal.tail(&run, from));

    let replay: Vec<u64> = written
        .iter()
        .map(|(s, _)| *s)
        .filter(|s| *s > from)
        .collect();
    let mut seen = Vec::new();
    while seen.len() < replay.len() {
        let r = tokio::time::timeout(Duration::from_secs(5), tail.next())
            .await
            .expect("replay in time")
            .expect("stream open")
            .unwrap();
        seen.push(r.seq);
    }
    assert_eq!(seen, replay);

    // Live: a decision group and an input, appended after the replay.
    let last_decision = journal.last_decision_seq(&run).await.unwrap();
    let live_group = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "step"),
            DecisionSeq::at(last_decision),
            &step_group(&run, 9),
        )
        .await
        .unwrap();
    let live_input = journal
        .append_input(&InputId::arbitrary("live-1"), &user_message(&run, "live"))
        .await
        .unwrap()
        .seq;
    let mut live = Vec::new();
    while live.len() < 5 {
        let r = tokio::time::timeout(Duration::from_secs(5), tail.next())
            .await
            .expect("live event in time")
            .expect("stream open")
            .unwrap();
        live.push(r.seq);
    }
    let mut want: Vec<u64> = (live_group.first_seq..=live_group.last_seq).collect();
    want.push(live_input);
    assert_eq!(live, want);
    // And nothing more (no duplicate redelivery).
    assert!(
        tokio::time::timeout(Duration::from_millis(300), tail.next())
            .await
            .is_err()
    );
}

#[tokio::test]
async fn tail_goes_on_after_a_broker_restart_without_replaying_old_events() {
    let (mut server, journal) = setup().await;
    let run = new_run();
    let created = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "intake"),
            DecisionSeq::NONE,
            &[run_created(&run)],
        )
        .await
        .unwrap();
    let input = journal
        .append_input(&InputId::arbitrary("a"), &user_message(&run, "a"))
        .await
        .unwrap()
        .seq;
    // Tail from the end: nothing delivered yet when the broker dies (async-nats 0.51 recreates
    // such an ordered consumer with DeliverPolicy::All; the journal must not replay).
    let mut tail = Box::pin(journal.tail(&run, input));
    assert!(
        tokio::time::timeout(Duration::from_millis(200), tail.next())
            .await
            .is_err()
    );
    server.kill9();
    server.restart().await;
    let started = Instant::now();
    let seq = loop {
        match journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(&run, "step"),
                created.last_decision(),
                &[run_started(&run)],
            )
            .await
        {
            Ok(a) => break a.last_seq,
            Err(JournalError::Duplicate { seq }) => break seq,
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(e) => panic!("{e:?}"),
        }
    };
    let next = loop {
        match tokio::time::timeout(Duration::from_secs(40), tail.next())
            .await
            .expect("the tail delivers again after the restart")
            .expect("stream open")
        {
            Ok(r) => break r,
            Err(e) => assert!(e.is_retryable(), "{e:?}"),
        }
    };
    eprintln!("tail resumed after {:?}", started.elapsed());
    assert_eq!(next.seq, seq);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), tail.next())
            .await
            .is_err()
    );
}

#[tokio::test]
async fn a_bounded_read_returns_a_gap_free_prefix_and_says_whether_more_follows() {
    let (_server, journal) = setup().await;
    let (run, other) = (new_run(), new_run());
    let written = write_run(&journal, &run, &other).await;
    let seqs: Vec<u64> = written.iter().map(|(s, _)| *s).collect();
    // Walk the run in pages of 3 from every starting point of the walk.
    for page_size in [1, 3, 7, seqs.len(), seqs.len() + 5] {
        let mut after = 0;
        let mut got = Vec::new();
        loop {
            let page = journal.read_at_most(&run, after, page_size).await.unwrap();
            assert!(page.events.len() <= page_size);
            got.extend(page.events.iter().map(|r| r.seq));
            if let Some(last) = page.events.last() {
                after = last.seq;
            }
            if !page.more {
                break;
            }
            assert_eq!(
                page.events.len(),
                page_size,
                "a page with more after it is full"
            );
        }
        assert_eq!(got, seqs, "pages of {page_size}");
    }
}

#[tokio::test]
async fn the_last_event_and_an_event_type_are_found_without_reading_the_journal() {
    let (_server, journal) = setup().await;
    let run = RunId::generate();
    let other = RunId::generate();
    assert_eq!(journal.last_event(&run).await.unwrap(), None);
    let before = time::OffsetDateTime::now_utc() - Duration::from_secs(5);
    let written = write_run(&journal, &run, &other).await;
    let last = journal.last_event(&run).await.unwrap().expect("an event");
    let (seq, env) = written.last().unwrap();
    assert_eq!(last.seq, *seq);
    assert_eq!(last.envelope.as_ref(), Some(env));
    assert_eq!(last.event_type, Some(env.event_type()));
    assert!(
        last.stored_at > before,
        "the server's time stamp: {:?}",
        last.stored_at
    );
    assert!(
        journal
            .has_event(&run, kedge_core::EventType::RunCreated)
            .await
            .unwrap()
    );
    assert!(
        !journal
            .has_event(&run, kedge_core::EventType::CancelRequested)
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn a_read_through_a_known_sequence_returns_the_run_up_to_it_and_after() {
    let (_server, journal) = setup().await;
    let run = new_run();
    let other = new_run();
    let created = journal
        .create_run(&RunCreator::intake(), &run_created(&run))
        .await
        .unwrap();
    journal
        .create_run(&RunCreator::intake(), &run_created(&other))
        .await
        .unwrap();
    let mut seqs = vec![created.last_seq];
    for i in 0..20u32 {
        // Interleaved with another run's inputs, as in a busy stream.
        seqs.push(
            journal
                .append_input(
                    &InputId::arbitrary(format!("r-{i}")),
                    &user_message(&run, &format!("m{i}")),
                )
                .await
                .unwrap()
                .seq,
        );
        journal
            .append_input(
                &InputId::arbitrary(format!("o-{i}")),
                &user_message(&other, "x"),
            )
            .await
            .unwrap();
    }
    // From the start, from the middle (a near read asks for a few at once), and from the end.
    for after in [0, seqs[3], seqs[18], seqs[20]] {
        let page = journal.read_through(&run, after, seqs[20]).await.unwrap();
        let got: Vec<u64> = page.events.iter().map(|r| r.seq).collect();
        let want: Vec<u64> = seqs.iter().copied().filter(|s| *s > after).collect();
        assert_eq!(got, want, "after {after}");
        assert!(!page.more);
        assert!(page.events.iter().all(|r| r.envelope.run_id == run));
    }
    // A `through` the run never reaches (a caller's mistake) still ends, from the leader.
    let page = journal
        .read_through(&run, seqs[10], seqs[20] + 1000)
        .await
        .unwrap();
    assert_eq!(page.events.len(), 10);
}

/// Whether `wake` is read by its chain from `after`.
async fn reads_by_chain(
    journal: &Journal,
    run: &RunId,
    after: u64,
    wake: &async_nats::jetstream::message::StreamMessage,
) -> bool {
    journal
        .read_chained(run, after, delivered(wake))
        .await
        .unwrap()
        .is_some()
}

#[tokio::test]
async fn a_chain_of_run_wide_checks_is_read_by_sequence_and_nothing_else_is() {
    let (server, journal) = setup().await;
    let js = async_nats::jetstream::new(server.client().await);
    let run = new_run();
    let other = new_run();
    let created = journal
        .create_run(&RunCreator::intake(), &run_created(&run))
        .await
        .unwrap();
    let writer = DecisionWriter::unfenced(&run, "step");
    let requested = journal
        .append_decisions(
            &writer,
            created.last_decision(),
            &[tool_requested(&run, 1, 0)],
        )
        .await
        .unwrap()
        .last_seq;
    // Other runs' messages between the links are stepped over.
    journal
        .append_input(&InputId::arbitrary("o-1"), &user_message(&other, "x"))
        .await
        .unwrap();
    let started = journal
        .append_input_after(
            &InputId::arbitrary("s-1"),
            &tool_started(&run, 1, 0),
            Some(requested),
        )
        .await
        .unwrap();
    assert!(started.chained, "the request is the run's last message");
    journal
        .append_input(&InputId::arbitrary("o-2"), &user_message(&other, "x"))
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
    assert!(result.chained);
    let wake = stored(&js, result.seq).await;
    let page = journal
        .read_chained(&run, requested, delivered(&wake))
        .await
        .unwrap()
        .expect("the two links hold");
    let got: Vec<(u64, Envelope)> = page
        .events
        .into_iter()
        .map(|r| (r.seq, r.envelope))
        .collect();
    let read = journal.read(&run, requested).await.unwrap();
    let want: Vec<(u64, Envelope)> = read.into_iter().map(|r| (r.seq, r.envelope)).collect();
    assert_eq!(got, want, "exactly what a batched read returns");
    // From anywhere but the chain's start, nothing is read by it.
    for after in [0, created.last_seq, started.seq, result.seq] {
        assert!(
            !reads_by_chain(&journal, &run, after, &wake).await,
            "after {after}"
        );
    }
    // A retry of a chained input that landed is recognised by its id.
    let again = journal
        .append_input_after(
            &InputId::arbitrary("s-1"),
            &tool_started(&run, 1, 0),
            Some(requested),
        )
        .await;
    assert_eq!(
        again,
        Ok(InputAppended {
            seq: started.seq,
            duplicate: true,
            chained: false
        })
    );

    // Something of the run lands after the next request: its tool.started goes out unchained,
    // and the result chained on that is not read by sequence.
    let requested = journal
        .append_decisions(
            &writer,
            DecisionSeq::at(requested),
            &[tool_requested(&run, 2, 0)],
        )
        .await
        .unwrap()
        .last_seq;
    journal
        .append_input(&InputId::arbitrary("u-1"), &user_message(&run, "meanwhile"))
        .await
        .unwrap();
    let started = journal
        .append_input_after(
            &InputId::arbitrary("s-2"),
            &tool_started(&run, 2, 0),
            Some(requested),
        )
        .await
        .unwrap();
    assert!(!started.chained);
    let result = journal
        .append_input_after(
            &InputId::arbitrary("r-2"),
            &tool_result(&run, 2, 0),
            Some(started.seq),
        )
        .await
        .unwrap();
    assert!(result.chained);
    let wake = stored(&js, result.seq).await;
    for after in [requested, requested + 1] {
        assert!(
            !reads_by_chain(&journal, &run, after, &wake).await,
            "after {after}"
        );
    }

    // A link checked on a narrower subject than the run's (the broker takes it: it is that
    // subject's last message) is no link.
    let forged = tool_result(&run, 2, 1);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        "Nats-Expected-Last-Subject-Sequence",
        result.seq.to_string().as_str(),
    );
    headers.insert(
        "Nats-Expected-Last-Subject-Sequence-Subject",
        forged.subject().as_str(),
    );
    let payload = journal.stored_form(&forged).await.unwrap();
    let seq = js
        .publish_with_headers(format!("agent.run.{run}.i.tool.result"), headers, payload)
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence;
    let wake = stored(&js, seq).await;
    assert!(!reads_by_chain(&journal, &run, started.seq, &wake).await);
}

#[tokio::test]
async fn a_purge_through_a_sequence_leaves_what_landed_after_it() {
    let (_server, journal) = setup().await;
    let run = new_run();
    let created = journal
        .create_run(&RunCreator::intake(), &run_created(&run))
        .await
        .unwrap();
    let first = journal
        .append_input(&InputId::arbitrary("p-1"), &user_message(&run, "seen"))
        .await
        .unwrap()
        .seq;
    // Landed after the purger's read, which went through `first`.
    let later = journal
        .append_input(
            &InputId::arbitrary("p-2"),
            &user_message(&run, "came later"),
        )
        .await
        .unwrap()
        .seq;
    assert_eq!(journal.purge_run(&run, first).await.unwrap(), 2);
    let left: Vec<u64> = journal
        .read(&run, 0)
        .await
        .unwrap()
        .iter()
        .map(|r| r.seq)
        .collect();
    assert_eq!(left, vec![later]);
    assert!(created.last_seq < first);
    // Through the end: nothing left; again: nothing to do.
    assert_eq!(journal.purge_run(&run, later).await.unwrap(), 1);
    assert!(journal.read(&run, 0).await.unwrap().is_empty());
    assert_eq!(journal.purge_run(&run, later).await.unwrap(), 0);
}

#[tokio::test]
async fn the_last_event_of_each_type_comes_back_in_one_read() {
    let (_server, journal) = setup().await;
    let run = new_run();
    let other = new_run();
    let created = journal
        .create_run(&RunCreator::intake(), &run_created(&run))
        .await
        .unwrap();
    journal
        .create_run(&RunCreator::intake(), &run_created(&other))
        .await
        .unwrap();
    let mut last = 0;
    for i in 0..3u32 {
        last = journal
            .append_input(
                &InputId::arbitrary(format!("lo-{i}")),
                &user_message(&run, &format!("m{i}")),
            )
            .await
            .unwrap()
            .seq;
        journal
            .append_input(
                &InputId::arbitrary(format!("lo-o-{i}")),
                &user_message(&other, "x"),
            )
            .await
            .unwrap();
    }
    use kedge_core::EventType::{CancelRequested, RunCreated, UserMessage};
    let found = journal
        .last_of(&run, &[UserMessage, CancelRequested, RunCreated])
        .await
        .unwrap();
    let seqs: Vec<u64> = found.iter().map(|r| r.seq).collect();
    assert_eq!(
        seqs,
        [created.last_seq, last],
        "in stream order, none for a missing type"
    );
    assert!(found.iter().all(|r| r.envelope.run_id == run));
    assert!(
        journal
            .last_of(&new_run(), &[RunCreated])
            .await
            .unwrap()
            .is_empty()
    );
    assert!(journal.last_of(&run, &[]).await.unwrap().is_empty());
}

/// `latest_per_subject` lists every key of a bucket under a prefix once, at its latest value,
/// across pages (more keys than one page), leaving out other prefixes and marking deleted keys;
/// and while keys are rewritten as fast as the broker takes them (each rewrite moves a key to
/// the end of the stream), no listing misses a key that was there all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_latest_per_subject_lists_every_key_once_even_while_keys_are_rewritten() {
    const KEYS: usize = 300;
    const STREAM: &str = "KV_kedge_runs";
    const FILTER: &str = "$KV.kedge_runs.a.>";
    let (_server, journal) = setup().await;
    let js = async_nats::jetstream::new(journal.client().clone());
    let kv = js.get_key_value("kedge_runs").await.unwrap();
    for i in 0..KEYS {
        kv.put(format!("a.k{i:03}"), format!("v{i}-0").into())
            .await
            .unwrap();
    }
    for i in 0..5 {
        kv.put(format!("b.k{i}"), "other".into()).await.unwrap();
    }
    kv.delete("a.k008").await.unwrap();
    kv.put("a.k010", "v10-1".into()).await.unwrap();

    let got = journal.latest_per_subject(STREAM, FILTER).await.unwrap();
    assert_eq!(got.len(), KEYS, "one per key of the prefix");
    assert!(
        got.windows(2).all(|w| w[0].seq < w[1].seq),
        "in stream order"
    );
    assert!(
        got.iter()
            .all(|l| l.subject.starts_with("$KV.kedge_runs.a."))
    );
    let deleted: Vec<&str> = got
        .iter()
        .filter(|l| l.deleted)
        .map(|l| l.subject.as_str())
        .collect();
    assert_eq!(deleted, ["$KV.kedge_runs.a.k008"]);
    let k010 = got
        .iter()
        .find(|l| l.subject == "$KV.kedge_runs.a.k010")
        .unwrap();
    assert_eq!(&k010.payload[..], b"v10-1", "the latest value");

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (kv, stop) = (kv.clone(), stop.clone());
        tokio::spawn(async move {
            let mut round = 1;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for i in (1..KEYS).step_by(2) {
                    kv.put(format!("a.k{i:03}"), format!("v{i}-{round}").into())
                        .await
                        .unwrap();
                }
                round += 1;
            }
            round
        })
    };
    for listing in 0..30 {
        let got = journal.latest_per_subject(STREAM, FILTER).await.unwrap();
        let live: std::collections::BTreeSet<&str> = got
            .iter()
            .filter(|l| !l.deleted)
            .map(|l| l.subject.as_str())
            .collect();
        assert_eq!(
            live.len(),
            KEYS - 1,
            "listing {listing}: every live key once, whatever was rewritten meanwhile"
        );
        assert_eq!(got.len(), KEYS, "listing {listing}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = writer.await.unwrap();
    assert!(rounds > 1, "keys were rewritten while the listings ran");
}

/// Two keys, both rewritten as fast as the broker takes them, listed over and over: each
/// listing has both. (An ephemeral last-per-subject consumer that stops at a pending count of
/// 0, the bridge's list before, returned one of the two in about one listing in five here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_latest_per_subject_of_hot_keys_misses_none() {
    let (_server, journal) = setup().await;
    let js = async_nats::jetstream::new(journal.client().clone());
    let kv = js.get_key_value("kedge_runs").await.unwrap();
    for key in ["t.run1", "t.run2"] {
        kv.put(key, "0".into()).await.unwrap();
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (kv, stop) = (kv.clone(), stop.clone());
        tokio::spawn(async move {
            let mut round = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                round += 1;
                for key in ["t.run1", "t.run2"] {
                    kv.put(key, round.to_string().into()).await.unwrap();
                }
            }
            round
        })
    };
    for listing in 0..1000 {
        let got = journal
            .latest_per_subject("KV_kedge_runs", "$KV.kedge_runs.t.>")
            .await
            .unwrap();
        let subjects: Vec<&str> = got.iter().map(|l| l.subject.as_str()).collect();
        assert_eq!(subjects.len(), 2, "listing {listing}: {subjects:?}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(
        writer.await.unwrap() > 1,
        "the keys were rewritten meanwhile"
    );
}

/// The runs touched after a sequence, listed while another run's messages are appended and
/// purged as fast as the broker takes them: every listing has the two runs touched before it
/// began. (The broker counts a new message into a consumer's pending count a moment after
/// storing it but takes a purged one out at once, so for that moment the count is one short;
/// a listing that took a pending count of 0 for "nothing more" stopped one message early and
/// missed the last run.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runs_touched_after_a_sequence_are_all_listed_while_another_run_is_purged() {
    let (_server, journal) = setup().await;
    let (b, c, churned) = (new_run(), new_run(), new_run());
    let first = journal
        .append_input(
            &InputId::arbitrary(format!("b-{b}")),
            &user_message(&b, "b"),
        )
        .await
        .unwrap()
        .seq;
    journal
        .append_input(
            &InputId::arbitrary(format!("c-{c}")),
            &user_message(&c, "c"),
        )
        .await
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let (journal, stop, run) = (journal.clone(), stop.clone(), churned.clone());
        tokio::spawn(async move {
            let mut round = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                round += 1;
                let seq = journal
                    .append_input(
                        &InputId::arbitrary(format!("a-{run}-{round}")),
                        &user_message(&run, "a"),
                    )
                    .await
                    .unwrap()
                    .seq;
                journal.purge_run(&run, seq).await.unwrap();
            }
            round
        })
    };
    for listing in 0..1000 {
        let (runs, through) = journal.runs_touched_after(first - 1).await.unwrap();
        assert!(
            runs.contains(&b) && runs.contains(&c),
            "listing {listing} (through {through}): {runs:?}"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(
        churn.await.unwrap() > 1,
        "the other run was purged meanwhile"
    );
}
