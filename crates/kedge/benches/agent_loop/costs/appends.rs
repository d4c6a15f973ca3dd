//! The costs of appending: decisions one by one and as an atomic batch, inputs, the
//! alternatives to a batch, appends while another run commits batches back to back, and the
//! throughput of 16 concurrent writers.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kedge_core::StepNo;
use kedge_core::event::{Envelope, Event, Timestamp};
use kedge_core::ids::RunId;
use kedge_runtime::Runtime;

use super::{OpCost, Sample, time_op, uuid_like, with_run};
use crate::measure::{ms, stats};

/// A run of the bench's own that decisions are appended to, and its last sequence, carried
/// from append to append (the expected sequence of the next).
pub struct Chain {
    run: RunId,
    last: Arc<Mutex<u64>>,
}

/// Decision appends on a run of our own, one event and an atomic batch of three, the expected
/// sequence carried along; and an input append.
pub async fn decisions(rt: &Runtime, s: &Sample, iters: usize, out: &mut Vec<OpCost>) -> Chain {
    let drun = &RunId::generate();
    let last = Arc::new(Mutex::new(
        rt.journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(drun, "w-bench"),
                kedge_core::ids::DecisionSeq::at(0),
                &[
                    kedge_core::DecisionEnvelope::try_from(with_run(&s.created, drun))
                        .expect("a decision"),
                ],
            )
            .await
            .expect("run.created")
            .last_seq,
    ));
    out.push(OpCost {
        name: "append_decisions, 1 event (expected-seq)",
        stats: time_op(iters, |_| {
            let last = last.clone();
            let e = with_run(&s.step_started, drun);
            async move {
                let expected = *last.lock().unwrap();
                let a = rt
                    .journal
                    .append_decisions(
                        &kedge_journal::DecisionWriter::unfenced(drun, "w-bench"),
                        kedge_core::ids::DecisionSeq::at(expected),
                        &[kedge_core::DecisionEnvelope::try_from(e).expect("a decision")],
                    )
                    .await
                    .expect("append 1");
                *last.lock().unwrap() = a.last_seq;
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "append_decisions, 3 events (atomic batch)",
        stats: time_op(iters, |_| {
            let last = last.clone();
            let es: Vec<kedge_core::DecisionEnvelope> = s
                .group
                .iter()
                .map(|e| {
                    kedge_core::DecisionEnvelope::try_from(with_run(e, drun)).expect("a decision")
                })
                .collect();
            async move {
                let expected = *last.lock().unwrap();
                let a = rt
                    .journal
                    .append_decisions(
                        &kedge_journal::DecisionWriter::unfenced(drun, "w-bench"),
                        kedge_core::ids::DecisionSeq::at(expected),
                        &es,
                    )
                    .await
                    .expect("append 3");
                *last.lock().unwrap() = a.last_seq;
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "append_input (msg-id dedup)",
        stats: time_op(iters, |i| {
            let e = with_run(&s.tool_result, drun);
            async move {
                rt.journal
                    .append_input(
                        &kedge_core::ids::InputId::arbitrary(format!("bench:{i}:{}", uuid_like())),
                        &kedge_core::InputEnvelope::try_from(e).expect("an input"),
                    )
                    .await
                    .expect("input");
            }
        })
        .await,
    });
    Chain {
        run: drun.clone(),
        last,
    }
}

/// The same 3 decisions without an atomic batch: 3 chained single appends (expected-seq
/// carried from each ack), and one decision message carrying all three (3x the payload).
pub async fn alternatives(
    rt: &Runtime,
    s: &Sample,
    chain: &Chain,
    iters: usize,
    out: &mut Vec<OpCost>,
) {
    let (drun, last) = (&chain.run, &chain.last);
    out.push(OpCost {
        name: "alt: 3 decisions as 3 chained single appends",
        stats: time_op(iters, |_| {
            let last = last.clone();
            let es: Vec<kedge_core::DecisionEnvelope> = s
                .group
                .iter()
                .map(|e| {
                    kedge_core::DecisionEnvelope::try_from(with_run(e, drun)).expect("a decision")
                })
                .collect();
            async move {
                for e in es {
                    let expected = *last.lock().unwrap();
                    let a = rt
                        .journal
                        .append_decisions(
                            &kedge_journal::DecisionWriter::unfenced(drun, "w-bench"),
                            kedge_core::ids::DecisionSeq::at(expected),
                            &[e],
                        )
                        .await
                        .expect("append chained");
                    *last.lock().unwrap() = a.last_seq;
                }
            }
        })
        .await,
    });
    let big = {
        let Event::StepCompleted(sc) = &s.group[0].event else {
            unreachable!()
        };
        let mut sc = sc.clone();
        let extra: usize = s.group[1..].iter().map(|e| e.to_json_bytes().len()).sum();
        sc.message.text = format!("{}{}", sc.message.text, "x".repeat(extra));
        Envelope::new(
            drun.clone(),
            Timestamp::now(),
            kedge_core::Draft::new(Event::StepCompleted(sc)).step(StepNo(5)),
        )
    };
    out.push(OpCost {
        name: "alt: 3 decisions as 1 message (3x payload)",
        stats: time_op(iters, |_| {
            let last = last.clone();
            let e = with_run(&big, drun);
            async move {
                let expected = *last.lock().unwrap();
                let a = rt
                    .journal
                    .append_decisions(
                        &kedge_journal::DecisionWriter::unfenced(drun, "w-bench"),
                        kedge_core::ids::DecisionSeq::at(expected),
                        &[kedge_core::DecisionEnvelope::try_from(e).expect("a decision")],
                    )
                    .await
                    .expect("append big");
                *last.lock().unwrap() = a.last_seq;
            }
        })
        .await,
    });
}

/// Head-of-line blocking: a single append (and an input, and a lease) while another run commits
/// batches back to back.
pub async fn contended(
    rt: &Runtime,
    s: &Sample,
    chain: &Chain,
    runs: &[RunId],
    ttl: Duration,
    iters: usize,
    out: &mut Vec<OpCost>,
) {
    let (drun, last) = (&chain.run, &chain.last);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let brun = RunId::generate();
    let background = {
        let rt = rt.clone();
        let stop = stop.clone();
        let es: Vec<kedge_core::DecisionEnvelope> = s
            .group
            .iter()
            .map(|e| {
                kedge_core::DecisionEnvelope::try_from(with_run(e, &brun)).expect("a decision")
            })
            .collect();
        let first = with_run(&s.step_started, &brun);
        let brun = brun.clone();
        tokio::spawn(async move {
            let mut last = rt
                .journal
                .append_decisions(
                    &kedge_journal::DecisionWriter::unfenced(&brun, "w-bg"),
                    kedge_core::ids::DecisionSeq::at(0),
                    &[kedge_core::DecisionEnvelope::try_from(first).expect("a decision")],
                )
                .await
                .expect("bg first")
                .last_seq;
            let mut n = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let es: Vec<kedge_core::DecisionEnvelope> = es
                    .iter()
                    .map(|e| {
                        kedge_core::DecisionEnvelope::try_from(with_run(e, &brun))
                            .expect("a decision")
                    })
                    .collect();
                last = rt
                    .journal
                    .append_decisions(
                        &kedge_journal::DecisionWriter::unfenced(&brun, "w-bg"),
                        kedge_core::ids::DecisionSeq::at(last),
                        &es,
                    )
                    .await
                    .expect("bg batch")
                    .last_seq;
                n += 1;
            }
            n
        })
    };
    out.push(OpCost {
        name: "append 1 decision, batches committing meanwhile",
        stats: time_op(iters.min(200), |_| {
            let last = last.clone();
            let e = with_run(&s.step_started, drun);
            async move {
                let expected = *last.lock().unwrap();
                let a = rt
                    .journal
                    .append_decisions(
                        &kedge_journal::DecisionWriter::unfenced(drun, "w-bench"),
                        kedge_core::ids::DecisionSeq::at(expected),
                        &[kedge_core::DecisionEnvelope::try_from(e).expect("a decision")],
                    )
                    .await
                    .expect("append 1 (contended)");
                *last.lock().unwrap() = a.last_seq;
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "append_input, batches committing meanwhile",
        stats: time_op(iters.min(200), |i| {
            let e = with_run(&s.tool_result, drun);
            async move {
                rt.journal
                    .append_input(
                        &kedge_core::ids::InputId::arbitrary(format!(
                            "bench-hol:{i}:{}",
                            uuid_like()
                        )),
                        &kedge_core::InputEnvelope::try_from(e).expect("an input"),
                    )
                    .await
                    .expect("input (contended)");
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "lease acquire, batches committing meanwhile",
        stats: time_op(iters.min(200), |i| async move {
            let l = rt
                .leases
                .acquire(
                    &runs[i % runs.len()],
                    &"w-bench2".parse().expect("worker id"),
                    ttl,
                )
                .await;
            if let Ok(l) = l {
                let _ = rt.leases.release(l).await;
            }
        })
        .await,
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = background.await;
}

/// Throughput of 16 concurrent writers (one run each) for one second, with 3-event batches
/// and with 3 chained single appends.
pub async fn writers(rt: &Runtime, s: &Sample, out: &mut Vec<OpCost>) {
    for (name, batch) in [
        ("16 writers: 3-event batches", true),
        ("16 writers: 3 chained single appends", false),
    ] {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let lat: Arc<Mutex<Vec<f64>>> = Arc::default();
        let mut tasks = Vec::new();
        for w in 0..16 {
            let rt = rt.clone();
            let stop = stop.clone();
            let lat = lat.clone();
            let group = s.group.clone();
            let first = s.step_started.clone();
            tasks.push(tokio::spawn(async move {
                let run = RunId::generate();
                let writer = format!("w-tp{w}");
                let mut last = rt
                    .journal
                    .append_decisions(
                        &kedge_journal::DecisionWriter::unfenced(&run, &writer),
                        kedge_core::ids::DecisionSeq::at(0),
                        &[
                            kedge_core::DecisionEnvelope::try_from(with_run(&first, &run))
                                .expect("a decision"),
                        ],
                    )
                    .await
                    .expect("first")
                    .last_seq;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let t = Instant::now();
                    let es: Vec<kedge_core::DecisionEnvelope> = group
                        .iter()
                        .map(|e| {
                            kedge_core::DecisionEnvelope::try_from(with_run(e, &run))
                                .expect("a decision")
                        })
                        .collect();
                    if batch {
                        last = rt
                            .journal
                            .append_decisions(
                                &kedge_journal::DecisionWriter::unfenced(&run, &writer),
                                kedge_core::ids::DecisionSeq::at(last),
                                &es,
                            )
                            .await
                            .expect("batch")
                            .last_seq;
                    } else {
                        for e in es {
                            last = rt
                                .journal
                                .append_decisions(
                                    &kedge_journal::DecisionWriter::unfenced(&run, &writer),
                                    kedge_core::ids::DecisionSeq::at(last),
                                    &[e],
                                )
                                .await
                                .expect("single")
                                .last_seq;
                        }
                    }
                    lat.lock().unwrap().push(ms(t.elapsed()));
                }
            }));
        }
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in tasks {
            let _ = t.await;
        }
        let secs = t0.elapsed().as_secs_f64();
        let v = lat.lock().unwrap().clone();
        let st = stats(&v);
        let rate = v.len() as f64 / secs;
        let label: &'static str =
            Box::leak(format!("{name}: {rate:.0} groups/s, latency").into_boxed_str());
        out.push(OpCost {
            name: label,
            stats: st,
        });
    }
}
