//! Decision appends: one writer per run, optimistic concurrency, atomic groups, retries.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use kedge_core::EventType;
use kedge_core::ids::{DecisionSeq, InputId};
use kedge_journal::{Appended, ErrorKind, JournalError, RunCreator};

#[tokio::test]
async fn concurrent_appends_from_the_same_sequence_exactly_one_lands() {
    let (_server, journal) = setup().await;
    let run = new_run();
    let created = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "intake"),
            DecisionSeq::NONE,
            &[run_created(&run)],
        )
        .await
        .unwrap();
    assert_eq!(created.first_seq, created.last_seq);

    // Eight writers race from the same expected sequence, half with single events, half with
    // groups.
    let attempts = (0..8).map(|i| {
        let journal = journal.clone();
        let run = run.clone();
        async move {
            let events = if i % 2 == 0 {
                vec![run_started(&run)]
            } else {
                step_group(&run, 1)
            };
            journal
                .append_decisions(
                    &kedge_journal::DecisionWriter::unfenced(&run, &format!("w{i}")),
                    created.last_decision(),
                    &events,
                )
                .await
        }
    });
    let results = futures::future::join_all(attempts).await;
    let winners: Vec<&Appended> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    let winner = winners[0];
    for r in &results {
        match r {
            Ok(_) => {}
            Err(JournalError::Conflict { expected, actual }) => {
                assert_eq!(*expected, created.last_seq);
                assert_eq!(*actual, winner.last_seq);
            }
            Err(e) => panic!("unexpected error {e:?}"),
        }
    }
    assert_eq!(
        journal.last_decision_seq(&run).await.unwrap(),
        winner.last_seq
    );
    let all = journal.read(&run, 0).await.unwrap();
    assert_eq!(
        all.len() as u64,
        1 + winner.last_seq - winner.first_seq + 1,
        "only the winner's events are stored"
    );
}

#[tokio::test]
async fn an_input_in_between_does_not_fail_a_decision_append() {
    let (_server, journal) = setup().await;
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
        .append_input(&InputId::arbitrary("in-1"), &user_message(&run, "more"))
        .await
        .unwrap()
        .seq;
    assert!(input > created.last_seq);
    assert_eq!(journal.last_seq(&run).await.unwrap(), Some(input));
    assert_eq!(
        journal.last_decision_seq(&run).await.unwrap(),
        created.last_seq
    );

    let next = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "step-a"),
            created.last_decision(),
            &[run_started(&run)],
        )
        .await
        .unwrap();
    assert!(next.last_seq > input);
    // Also a group after more inputs.
    journal
        .append_input(&InputId::arbitrary("in-2"), &tool_result(&run, 1, 0))
        .await
        .unwrap();
    let group = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "step-a"),
            next.last_decision(),
            &step_group(&run, 1),
        )
        .await
        .unwrap();
    assert_eq!(group.last_seq - group.first_seq, 3);
}

/// A decision append lands while the run's inputs keep landing (a step's parallel tools
/// starting and answering while it appends the rest of its group): inputs never conflict, so
/// however many land between its look at the run and its append, it looks again and lands
/// once they pause, checked on the run's last message.
#[tokio::test]
async fn a_decision_append_lands_through_a_burst_of_inputs() {
    let (_server, journal) = setup().await;
    let run = new_run();
    let created = journal
        .create_run(&RunCreator::intake(), &run_created(&run))
        .await
        .unwrap();
    let burst = {
        let journal = journal.clone();
        let run = run.clone();
        tokio::spawn(async move {
            let until = std::time::Instant::now() + std::time::Duration::from_millis(300);
            let mut n = 0u32;
            while std::time::Instant::now() < until {
                journal
                    .append_input(
                        &InputId::arbitrary(format!("burst-{n}")),
                        &tool_result(&run, 1, n),
                    )
                    .await
                    .unwrap();
                n += 1;
            }
            n
        })
    };
    // Appended while the burst goes on (it started first).
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let landed = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "step-a"),
            created.last_decision(),
            &[run_started(&run)],
        )
        .await
        .expect("lands through the burst");
    let inputs = burst.await.unwrap();
    assert!(inputs > 10, "a burst ({inputs} inputs)");
    assert_eq!(
        journal.last_decision_seq(&run).await.unwrap(),
        landed.last_seq
    );
}

#[tokio::test]
async fn an_append_checked_against_the_run_lands_only_on_its_last_message() {
    let (_server, journal) = setup().await;
    let run = new_run();
    let other = new_run();
    let writer = kedge_journal::DecisionWriter::unfenced(&run, "step-a");
    let created = journal
        .create_run(&RunCreator::intake(), &run_created(&run))
        .await
        .unwrap();
    // Another run's messages in between do not matter: only this run's last message does.
    journal
        .create_run(&RunCreator::intake(), &run_created(&other))
        .await
        .unwrap();
    journal
        .append_input(
            &InputId::arbitrary("other-1"),
            &user_message(&other, "elsewhere"),
        )
        .await
        .unwrap();
    let started = journal
        .append_decision_current(
            &writer,
            created.last_decision(),
            created.last_seq,
            &run_started(&run),
        )
        .await
        .unwrap();
    assert!(started.first_seq > created.last_seq + 1, "{started:?}");

    // An input of this run lands: the writer is behind, nothing is stored.
    let input = journal
        .append_input(&InputId::arbitrary("in-1"), &user_message(&run, "stop"))
        .await
        .unwrap()
        .seq;
    let completed = step_completed(&run, 1);
    let behind = journal
        .append_decision_current(
            &writer,
            started.last_decision(),
            started.last_seq,
            &completed,
        )
        .await
        .unwrap_err();
    assert_eq!(
        behind,
        JournalError::Behind {
            expected: started.last_seq
        }
    );
    assert_eq!(behind.kind(), ErrorKind::Conflict);
    assert_eq!(journal.last_seq(&run).await.unwrap(), Some(input));
    // Having read it, the writer's append lands.
    let landed = journal
        .append_decision_current(&writer, started.last_decision(), input, &completed)
        .await
        .unwrap();
    // The same append again is a duplicate, checked either way.
    assert_eq!(
        journal
            .append_decision_current(&writer, started.last_decision(), input, &completed)
            .await,
        Err(JournalError::Duplicate {
            seq: landed.last_seq
        })
    );
    assert_eq!(
        journal
            .append_decisions(
                &writer,
                started.last_decision(),
                std::slice::from_ref(&completed)
            )
            .await,
        Err(JournalError::Duplicate {
            seq: landed.last_seq
        })
    );
    // Another writer's decision since: a conflict, not "behind".
    let rival = kedge_journal::DecisionWriter::unfenced(&run, "step-b");
    let theirs = journal
        .append_decisions(
            &rival,
            landed.last_decision(),
            &[tool_requested(&run, 1, 0)],
        )
        .await
        .unwrap();
    assert_eq!(
        journal
            .append_decision_current(
                &writer,
                landed.last_decision(),
                landed.last_seq,
                &tool_requested(&run, 1, 1)
            )
            .await,
        Err(JournalError::Conflict {
            expected: landed.last_seq,
            actual: theirs.last_seq
        })
    );
    let all = journal.read(&run, 0).await.unwrap();
    assert_eq!(
        all.len(),
        5,
        "created, started, the input, completed, theirs"
    );
}

#[tokio::test]
async fn after_a_takeover_the_old_writer_conflicts_and_a_late_append_without_takeover_lands() {
    let (_server, journal) = setup().await;
    let run = new_run();
    let created = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "intake"),
            DecisionSeq::NONE,
            &[run_created(&run)],
        )
        .await
        .unwrap();
    // Worker A reads the run and is about to decide; meanwhile worker B takes over and decides.
    let seen_by_a = journal.last_decision_seq(&run).await.unwrap();
    assert_eq!(seen_by_a, created.last_seq);
    let seen_by_b = journal.last_decision_seq(&run).await.unwrap();
    let b = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "worker-b"),
            DecisionSeq::at(seen_by_b),
            &[run_started(&run)],
        )
        .await
        .unwrap();

    // The zombie's commit fails, with both sequences.
    let err = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "worker-a"),
            DecisionSeq::at(seen_by_a),
            &step_group(&run, 1),
        )
        .await
        .unwrap_err();
    assert_eq!(
        err,
        JournalError::Conflict {
            expected: seen_by_a,
            actual: b.last_seq
        }
    );
    assert_eq!(err.kind(), ErrorKind::Conflict);

    // B is slow but nobody took over: its late commit lands.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let late = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "worker-b"),
            b.last_decision(),
            &step_group(&run, 1),
        )
        .await
        .unwrap();
    assert_eq!(late.first_seq, b.last_seq + 1);
}

#[tokio::test]
async fn a_retried_append_whose_first_attempt_landed_is_a_duplicate_not_a_conflict() {
    let (_server, journal) = setup().await;
    let run = new_run();
    let first = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "intake"),
            DecisionSeq::NONE,
            &[run_created(&run)],
        )
        .await
        .unwrap();
    // `run.created` retried (intake's ack was lost).
    let again = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "intake"),
            DecisionSeq::NONE,
            &[run_created(&run)],
        )
        .await
        .unwrap_err();
    assert_eq!(
        again,
        JournalError::Duplicate {
            seq: first.last_seq
        }
    );
    assert_eq!(again.kind(), ErrorKind::Duplicate);

    // A single decision retried.
    let events = [run_started(&run)];
    let one = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "step-a"),
            first.last_decision(),
            &events,
        )
        .await
        .unwrap();
    assert_eq!(
        journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(&run, "step-a"),
                first.last_decision(),
                &events
            )
            .await,
        Err(JournalError::Duplicate { seq: one.last_seq })
    );
    // Another writer from the same sequence is a conflict, not a duplicate.
    assert_eq!(
        journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(&run, "step-b"),
                first.last_decision(),
                &events
            )
            .await,
        Err(JournalError::Conflict {
            expected: first.last_seq,
            actual: one.last_seq
        })
    );

    // A group retried.
    let group = step_group(&run, 1);
    let landed = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "step-a"),
            one.last_decision(),
            &group,
        )
        .await
        .unwrap();
    assert_eq!(
        journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(&run, "step-a"),
                one.last_decision(),
                &group
            )
            .await,
        Err(JournalError::Duplicate {
            seq: landed.last_seq
        })
    );
    // Nothing was stored twice.
    let all = journal.read(&run, 0).await.unwrap();
    assert_eq!(all.len(), 6);
    assert_eq!(
        all.last().unwrap().msg_id.as_deref(),
        Some(kedge_journal::decision_msg_id(&run, one.last_decision(), 3, "step-a").as_str())
    );
}

#[tokio::test]
async fn a_stale_group_stores_nothing_and_a_fresh_one_stores_all_contiguously() {
    let (_server, journal) = setup().await;
    let run = new_run();
    let created = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "intake"),
            DecisionSeq::NONE,
            &[run_created(&run)],
        )
        .await
        .unwrap();
    let started = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "step-b"),
            created.last_decision(),
            &[run_started(&run)],
        )
        .await
        .unwrap();
    // Inputs land meanwhile; they do not count for the check.
    journal
        .append_input(&InputId::arbitrary("u-1"), &user_message(&run, "x"))
        .await
        .unwrap();

    let group = step_group(&run, 1);
    let stale = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "step-a"),
            created.last_decision(),
            &group,
        )
        .await;
    assert_eq!(
        stale,
        Err(JournalError::Conflict {
            expected: created.last_seq,
            actual: started.last_seq
        })
    );
    let after_stale = journal.read(&run, 0).await.unwrap();
    assert_eq!(after_stale.len(), 3, "nothing of the stale group is stored");
    assert!(after_stale.iter().all(|r| !matches!(
        r.envelope.event_type(),
        EventType::StepCompleted | EventType::ToolRequested
    )));

    // Another input, then the fresh group: four contiguous sequences.
    let input = journal
        .append_input(&InputId::arbitrary("u-2"), &user_message(&run, "y"))
        .await
        .unwrap()
        .seq;
    let fresh = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "step-a"),
            started.last_decision(),
            &group,
        )
        .await
        .unwrap();
    assert_eq!(fresh.first_seq, input + 1);
    assert_eq!(fresh.last_seq, fresh.first_seq + 3);
    let stored = journal.read(&run, input).await.unwrap();
    assert_eq!(
        stored.iter().map(|r| r.seq).collect::<Vec<_>>(),
        (fresh.first_seq..=fresh.last_seq).collect::<Vec<_>>()
    );
    assert_eq!(
        stored
            .iter()
            .map(|r| r.envelope.clone())
            .collect::<Vec<_>>(),
        group
            .iter()
            .map(|e| e.envelope().clone())
            .collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn a_group_of_another_run_is_refused() {
    let (_server, journal) = setup().await;
    let run = new_run();
    // An input on the decision path (or the reverse) does not compile: the kind is in the type
    // (`DecisionEnvelope`, `InputEnvelope`).
    let other = new_run();
    let err = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "w"),
            DecisionSeq::NONE,
            &[run_created(&other)],
        )
        .await
        .unwrap_err();
    assert!(matches!(err, JournalError::BadRequest(_)), "{err:?}");
    assert_eq!(journal.last_seq(&run).await.unwrap(), None);
    assert_eq!(journal.last_decision_seq(&run).await.unwrap(), 0);
}

#[tokio::test]
async fn a_run_is_created_only_with_run_created_and_only_once() {
    let (_server, journal) = setup().await;
    let run = new_run();
    let not_created = run_started(&run);
    assert!(matches!(
        journal
            .create_run(&RunCreator::intake(), &not_created)
            .await,
        Err(JournalError::BadRequest(_))
    ));
    let created = run_created(&run);
    let first = journal
        .create_run(&RunCreator::intake(), &created)
        .await
        .unwrap();
    assert_eq!(first.first_seq, first.last_seq);
    // The same append again is recognised as ours; another run.created for the run conflicts.
    assert!(matches!(
        journal.create_run(&RunCreator::intake(), &created).await,
        Err(JournalError::Duplicate { .. })
    ));
    // Stamped later than `created`.
    let other = run_created(&run);
    assert!(matches!(
        journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(&run, "someone"),
                DecisionSeq::NONE,
                &[other]
            )
            .await,
        Err(JournalError::Conflict { .. })
    ));
}

/// What `append_decision_current` relies on, checked at scale: the broker refuses an append
/// checked against the run's last message once any message of the run (an input on another
/// subject, old or new, in another message block) landed after it. Many runs side by side,
/// their inputs and decisions interleaved with other runs' messages across blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_run_wide_check_holds_across_subjects_and_blocks() {
    let (_server, journal) = setup().await;
    let runs: Vec<_> = (0..200).map(|_| new_run()).collect();
    let mut last = std::collections::HashMap::new();
    let mut decided = std::collections::HashMap::new();
    for run in &runs {
        let created = journal
            .create_run(&RunCreator::intake(), &run_created(run))
            .await
            .unwrap();
        last.insert(run.clone(), created.last_seq);
        decided.insert(run.clone(), created.last_decision());
    }
    let client = journal.client().clone();
    let js = async_nats::jetstream::new(client);
    let filler = new_run();
    for round in 0..6 {
        // Other runs' messages, 8 MiB and more per round: the runs' messages end up spread
        // over message blocks.
        let mut acks = Vec::new();
        for n in 0..2_500 {
            let subject = format!("agent.run.{filler}.i.user.message");
            acks.push(
                js.publish(subject, vec![b'x'; 4096].into())
                    .await
                    .unwrap_or_else(|e| panic!("filler {n}: {e}")),
            );
        }
        for ack in acks {
            ack.await.unwrap();
        }
        for (i, run) in runs.iter().enumerate() {
            let writer = kedge_journal::DecisionWriter::unfenced(run, "step-a");
            // Every other run gets an input (alternating subjects) after its last message.
            if (i + round) % 2 == 0 {
                let input = if round % 3 == 0 {
                    user_message(run, &format!("m{round}"))
                } else {
                    tool_result(run, round as u32, 0)
                };
                let seq = journal
                    .append_input(&InputId::arbitrary(format!("in-{run}-{round}")), &input)
                    .await
                    .unwrap()
                    .seq;
                let stale = journal
                    .append_decision_current(&writer, decided[run], last[run], &run_started(run))
                    .await;
                assert_eq!(
                    stale,
                    Err(JournalError::Behind {
                        expected: last[run]
                    }),
                    "round {round}: an input at {seq} after {}",
                    last[run]
                );
                last.insert(run.clone(), seq);
            }
            let landed = journal
                .append_decision_current(&writer, decided[run], last[run], &run_started(run))
                .await
                .unwrap();
            last.insert(run.clone(), landed.last_seq);
            decided.insert(run.clone(), landed.last_decision());
        }
    }
}
