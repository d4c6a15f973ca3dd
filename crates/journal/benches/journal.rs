//! Latency of the journal's operations against a real nats-server spawned for the run.
//!
//! ```text
//! cargo bench -p kedge-journal --bench journal                       # default fsync policy
//! cargo bench -p kedge-journal --bench journal -- --sync-always      # sync_interval: always
//! cargo bench -p kedge-journal --bench journal -- --iters 500
//! ```
//!
//! Prints p50/p99 per operation. One client, one request in flight: these are latencies, not
//! throughput.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use futures::StreamExt;
use kedge_core::event::{
    AssistantMessage, Digest, FinishReason, RunStarted, StepCompleted, Timestamp, ToolRequested,
    Usage, UserMessage,
};
use kedge_core::ids::ModelRequestId;
use kedge_core::{Attempt, Draft, Envelope, Event, OperationId, RunId, StepNo};
use kedge_journal::{Journal, LayoutOptions, Leases, ensure_layout};
use kedge_testkit::{NatsServer, ServerOptions};

struct Args {
    iters: usize,
    sync_always: bool,
}

fn args() -> Args {
    let mut out = Args {
        iters: 2000,
        sync_always: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--sync-always" => out.sync_always = true,
            "--iters" => {
                out.iters = it
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("--iters takes a number")
            }
            // `cargo bench` passes `--bench`; ignore it and anything else.
            _ => {}
        }
    }
    out
}

fn env(run: &RunId, draft: Draft) -> Envelope {
    Envelope::new(run.clone(), Timestamp::now(), draft)
}

fn decision(run: &RunId) -> Envelope {
    env(run, Draft::new(Event::RunStarted(RunStarted {})))
}

fn group(run: &RunId, step: u32) -> Vec<Envelope> {
    let mut g = vec![env(
        run,
        Draft::new(Event::StepCompleted(StepCompleted {
            request_id: ModelRequestId::new(run, StepNo(step), Attempt(1)),
            message: AssistantMessage {
                text: "I will look this up in three places.".into(),
                tool_calls: vec![],
            },
            usage: Usage {
                input_tokens: 1200,
                output_tokens: 80,
            },
            finish: FinishReason::ToolCalls,
            reused: false,
        }))
        .step(StepNo(step)),
    )];
    for i in 0..3 {
        let arguments = serde_json::json!({ "query": format!("query number {i}") });
        g.push(env(
            run,
            Draft::new(Event::ToolRequested(ToolRequested {
                call_id: format!("call_{i}"),
                tool: "search".into(),
                args_digest: Digest::of_json(&arguments),
                arguments,
                redispatch: 0,
                expect_version: None,
                timeout_secs: None,
                network: false,
            }))
            .step(StepNo(step))
            .op(OperationId::new(run, StepNo(step), i)),
        ));
    }
    g
}

fn input(run: &RunId, i: usize) -> Envelope {
    env(
        run,
        Draft::new(Event::UserMessage(UserMessage {
            text: format!("message {i}: please also check the other source"),
        })),
    )
}

#[derive(Default)]
struct Table(Vec<(String, Vec<Duration>)>);

impl Table {
    fn add(&mut self, name: &str, mut samples: Vec<Duration>) {
        samples.sort();
        eprintln!("  measured {name}");
        self.0.push((name.to_owned(), samples));
    }

    fn print(&self) {
        fn fmt(d: Duration) -> String {
            let us = d.as_secs_f64() * 1e6;
            if us < 1000.0 {
                format!("{us:.0} µs")
            } else {
                format!("{:.2} ms", us / 1000.0)
            }
        }
        let pct = |s: &[Duration], p: f64| s[((s.len() as f64 * p) as usize).min(s.len() - 1)];
        println!(
            "| {:<46} | {:>10} | {:>10} | {:>7} |",
            "operation", "p50", "p99", "n"
        );
        println!("|{:-<48}|{:->12}|{:->12}|{:->9}|", "", "", "", "");
        for (name, s) in &self.0 {
            println!(
                "| {:<46} | {:>10} | {:>10} | {:>7} |",
                name,
                fmt(pct(s, 0.50)),
                fmt(pct(s, 0.99)),
                s.len()
            );
        }
    }
}

async fn time<F, Fut>(iters: usize, mut f: F) -> Vec<Duration>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    // A few warm-up rounds, not measured.
    for i in 0..iters.min(20) {
        f(usize::MAX - i).await;
    }
    let mut out = Vec::with_capacity(iters);
    for i in 0..iters {
        let t = Instant::now();
        f(i).await;
        out.push(t.elapsed());
    }
    out
}

fn main() {
    let args = args();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(args));
}

async fn run(args: Args) {
    let server = NatsServer::start_with(ServerOptions {
        sync_always: args.sync_always,
        ..Default::default()
    })
    .await;
    let client = server.client().await;
    let report = ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    let journal = Journal::new(client.clone());
    let leases = Leases::new(client.clone());
    let n = args.iters;
    eprintln!(
        "nats-server {} (API level {}), file storage, R1, sync {}, {n} iterations",
        report.server_version,
        report.api_level,
        if args.sync_always {
            "always"
        } else {
            "default (every 2 min)"
        }
    );
    let mut table = Table::default();

    // Decision append: a chain of single decisions on one run.
    let run = RunId::generate();
    let mut last = 0;
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n + 20 {
        let e = [decision(&run)];
        let t = Instant::now();
        last = journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(&run, "bench"),
                last,
                &e,
            )
            .await
            .unwrap()
            .last_seq;
        samples.push(t.elapsed());
    }
    table.add("decision append (1 event)", samples.split_off(20));

    // Decision group: step.completed + 3 tool.requested as one atomic batch.
    let run = RunId::generate();
    let mut last = 0;
    let mut samples = Vec::with_capacity(n);
    for i in 0..n + 20 {
        let g = group(&run, i as u32 + 1);
        let t = Instant::now();
        last = journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(&run, "bench"),
                last,
                &g,
            )
            .await
            .unwrap()
            .last_seq;
        samples.push(t.elapsed());
    }
    table.add("decision group 1+3 (atomic batch)", samples.split_off(20));

    // Input append with a fresh Msg-Id each time.
    let run = RunId::generate();
    let s = time(n, |i| {
        let journal = journal.clone();
        let e = input(&run, i);
        async move {
            journal.append_input(&e, &format!("in-{i}")).await.unwrap();
        }
    })
    .await;
    table.add("input append", s);

    // A 50-event run (decisions, groups, inputs) among other runs' events.
    let run = RunId::generate();
    let noise = RunId::generate();
    let mut last = journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&run, "bench"),
            0,
            &[decision(&run)],
        )
        .await
        .unwrap()
        .last_seq;
    let mut count = 1;
    let mut step = 1;
    while count < 50 {
        if count + 4 <= 50 && step % 2 == 1 {
            last = journal
                .append_decisions(
                    &kedge_journal::DecisionWriter::unfenced(&run, "bench"),
                    last,
                    &group(&run, step),
                )
                .await
                .unwrap()
                .last_seq;
            count += 4;
        } else {
            journal
                .append_input(&input(&run, count), &format!("r50-{count}"))
                .await
                .unwrap();
            count += 1;
        }
        journal
            .append_input(&input(&noise, count), &format!("noise-{count}"))
            .await
            .unwrap();
        step += 1;
    }
    assert_eq!(journal.read(&run, 0).await.unwrap().len(), 50);
    let s = time(n, |_| {
        let journal = journal.clone();
        let run = run.clone();
        async move {
            let r = journal.read(&run, 0).await.unwrap();
            assert_eq!(r.len(), 50);
        }
    })
    .await;
    table.add("read 50-event run from 0 (journal.read)", s);

    // For comparison: the same read through an ordered consumer.
    let js = async_nats::jetstream::new(client.clone());
    let stream = js.get_stream_no_info("KEDGE_RUNS").await.unwrap();
    let s = time(n.min(1000), |_| {
        let stream = stream.clone();
        let filter = format!("agent.run.{run}.>");
        async move {
            let c = stream
                .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
                    filter_subject: filter,
                    deliver_policy:
                        async_nats::jetstream::consumer::DeliverPolicy::ByStartSequence {
                            start_sequence: 1,
                        },
                    ..Default::default()
                })
                .await
                .unwrap();
            let mut msgs = c.messages().await.unwrap();
            let mut got = 0;
            while let Some(m) = msgs.next().await {
                let m = m.unwrap();
                let _ = Envelope::from_json_bytes(&m.payload).unwrap();
                got += 1;
                if m.info().unwrap().pending == 0 {
                    break;
                }
            }
            assert_eq!(got, 50);
        }
    })
    .await;
    table.add("  (same read by ordered consumer, comparison)", s);

    let s = time(n, |_| {
        let journal = journal.clone();
        let run = run.clone();
        async move {
            assert!(journal.last_decision_seq(&run).await.unwrap() > 0);
        }
    })
    .await;
    table.add("last decision sequence (direct get, wildcard)", s);

    // Lease acquire over never-used keys, then renewals of one lease.
    let runs: Vec<RunId> = (0..n + 20).map(|_| RunId::generate()).collect();
    let s = time(n, |i| {
        let leases = leases.clone();
        let run = runs[if i >= n { n + (usize::MAX - i) } else { i }].clone();
        async move {
            leases
                .acquire(&run, "bench", Duration::from_secs(30))
                .await
                .unwrap();
        }
    })
    .await;
    table.add("lease acquire (KV, Nats-TTL + CAS)", s);

    let run = RunId::generate();
    let mut lease = leases
        .acquire(&run, "bench", Duration::from_secs(30))
        .await
        .unwrap();
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n + 20 {
        let t = Instant::now();
        lease = leases.renew(&lease).await.unwrap();
        samples.push(t.elapsed());
    }
    table.add("lease renew", samples.split_off(20));

    println!();
    println!(
        "kedge-journal bench: nats-server {}, R1 file storage, sync {}, loopback",
        report.server_version,
        if args.sync_always {
            "always"
        } else {
            "default"
        }
    );
    table.print();
    drop(server);
}
