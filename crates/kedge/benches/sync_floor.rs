//! The broker's own ceiling at equal durability: how many agent-loop iterations a second the
//! broker alone can store when every write is synced, for the write shape Kedge has today and
//! the shapes it could have. No Kedge service runs: 64 writers (one per "run") each publish an
//! iteration's writes one after the other, waiting for each acknowledgement, as a run's drive
//! does: `journal` messages on the run's subject of a journal stream, then `kv` writes on a key
//! of its own of an ops-like stream (history 1, as the ops bucket; plain writes, without the
//! compare-and-set check of the claim and the finish). What it shows is the
//! broker's share of the limit (its CPU and its serial fsyncs), with the whole machine for it;
//! the agent-loop bench measures Kedge with it.
//!
//! ```text
//! cargo bench -p kedge --bench sync_floor                  # one node, default sync and always
//! cargo bench -p kedge --bench sync_floor -- --cluster      # also three nodes on this machine, R3
//! cargo bench -p kedge --bench sync_floor -- --seconds 4 --concurrency 64
//! ```
//!
//! Shapes (see docs/ARCHITECTURE.md, "Durability setting"): today's iteration (five messages
//! of the run on the journal stream: `step.started`, `step.completed`, `tool.requested`,
//! `tool.started`, `tool.result`; two op-record writes: the claim and the finish), the step group
//! as one message (four), that and no `tool.started` (three), and the same spread over four
//! journal streams (the runs dealt out to them in turn). An iteration is two actions (a model step and a
//! tool step), so actions/s = 2 x iterations/s, the figure the agent-loop bench and Restate print.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use kedge_testkit::ServerOptions;

#[path = "support/mod.rs"]
mod support;

use support::deployed::Broker;

/// One iteration's writes.
#[derive(Clone, Copy)]
struct Shape {
    name: &'static str,
    /// Messages of the run on its journal stream, one after the other.
    journal: usize,
    /// Op-record writes (history 1), after them.
    kv: usize,
    /// Journal streams the runs are spread over.
    streams: usize,
}

const SHAPES: [Shape; 5] = [
    Shape {
        name: "today: 5 journal + 2 op record",
        journal: 5,
        kv: 2,
        streams: 1,
    },
    Shape {
        name: "step group as one message: 4 + 2",
        journal: 4,
        kv: 2,
        streams: 1,
    },
    Shape {
        name: "that, no tool.started: 3 + 2",
        journal: 3,
        kv: 2,
        streams: 1,
    },
    Shape {
        name: "today over 4 journal streams",
        journal: 5,
        kv: 2,
        streams: 4,
    },
    Shape {
        name: "3 + 2 over 4 journal streams",
        journal: 3,
        kv: 2,
        streams: 4,
    },
];

/// An event's size, about a journal message of the bench's workload.
const BODY: usize = 600;

struct Opts {
    seconds: f64,
    concurrency: usize,
    cluster: bool,
}

/// The positive number `flag` was given.
fn positive<T: std::str::FromStr + PartialOrd + Default>(value: Option<String>, flag: &str) -> T {
    value
        .and_then(|v| v.parse().ok())
        .filter(|v: &T| *v > T::default())
        .unwrap_or_else(|| panic!("{flag} takes a positive number"))
}

fn opts() -> Opts {
    let mut o = Opts {
        seconds: 5.0,
        concurrency: 64,
        cluster: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--seconds" => o.seconds = positive(it.next(), "--seconds"),
            "--concurrency" => o.concurrency = positive(it.next(), "--concurrency"),
            "--cluster" => o.cluster = true,
            // `cargo bench` passes `--bench`.
            "--bench" => {}
            other => panic!("sync_floor: unknown option {other}"),
        }
    }
    o
}

struct Measured {
    iterations_s: f64,
    /// Broker CPU per action (all nodes), ms.
    cpu_ms: f64,
    /// Broker CPU as a share of one core.
    core: f64,
}

async fn measure(broker: &Broker, shape: Shape, o: &Opts) -> Measured {
    let addrs: Vec<async_nats::ServerAddr> = broker
        .urls()
        .iter()
        .map(|u| u.parse().expect("a server URL"))
        .collect();
    let client = async_nats::connect(addrs).await.expect("connect");
    let js = jetstream::new(client);
    // Streams of their own per shape: deleted first, so each shape starts from empty files.
    for s in 0..shape.streams {
        let name = format!("FLOOR_J{s}");
        let _ = js.delete_stream(&name).await;
        js.create_stream(jetstream::stream::Config {
            name,
            subjects: vec![format!("floor.j{s}.>")],
            num_replicas: broker.replicas(),
            ..Default::default()
        })
        .await
        .expect("a journal stream");
    }
    let _ = js.delete_stream("FLOOR_OPS").await;
    js.create_stream(jetstream::stream::Config {
        name: "FLOOR_OPS".into(),
        subjects: vec!["floor.ops.>".into()],
        max_messages_per_subject: 1,
        num_replicas: broker.replicas(),
        ..Default::default()
    })
    .await
    .expect("the ops stream");

    let window = Duration::from_secs_f64(o.seconds);
    let cpu_before = support::cpu_ticks_of(&broker.pids());
    let started = Instant::now();
    let mut writers = Vec::new();
    for run in 0..o.concurrency {
        let js = js.clone();
        writers.push(tokio::spawn(async move {
            let body = bytes::Bytes::from(vec![b'x'; BODY]);
            let journal = format!("floor.j{}.run{run}", run % shape.streams);
            let mut iterations = 0u64;
            while started.elapsed() < window {
                for _ in 0..shape.journal {
                    publish(&js, journal.clone(), body.clone()).await;
                }
                let key = format!("floor.ops.run{run}.op{iterations}");
                for _ in 0..shape.kv {
                    publish(&js, key.clone(), body.clone()).await;
                }
                iterations += 1;
            }
            iterations
        }));
    }
    let mut iterations = 0u64;
    for w in writers {
        iterations += w.await.expect("a writer");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_ms = support::cpu_ticks_of(&broker.pids()).saturating_sub(cpu_before) as f64 * 1e3
        / kedge_testkit::clock_ticks();
    let actions = 2.0 * iterations as f64;
    Measured {
        iterations_s: iterations as f64 / elapsed,
        cpu_ms: cpu_ms / actions.max(1.0),
        core: cpu_ms / 1e3 / elapsed,
    }
}

async fn publish(js: &jetstream::Context, subject: String, body: bytes::Bytes) {
    js.publish(subject, body)
        .await
        .expect("publish")
        .await
        .expect("the write acknowledged");
}

async fn bench(o: Opts) {
    println!(
        "sync_floor: {} writers (runs), {:.0} s per shape, {BODY}-byte messages, nats-server {}; load average {}",
        o.concurrency,
        o.seconds,
        kedge_testkit::nats_server_binary().display(),
        support::loadavg()
    );
    let mut brokers = vec![(false, false), (true, false)];
    if o.cluster {
        brokers.push((false, true));
        brokers.push((true, true));
    }
    for (sync_always, cluster) in brokers {
        println!();
        println!(
            "{}, {}",
            if cluster {
                "three nodes on this machine, R3"
            } else {
                "one node"
            },
            if sync_always {
                "sync_interval: always (every write synced before its ack)"
            } else {
                "default sync"
            }
        );
        println!(
            "  {:<36} {:>12} {:>11} {:>15} {:>10}",
            "shape (writes per iteration)",
            "iterations/s",
            "actions/s",
            "CPU ms/action",
            "of a core"
        );
        let options = ServerOptions {
            sync_always,
            ..Default::default()
        };
        let broker = Broker::start(options, cluster).await;
        for shape in SHAPES {
            let m = measure(&broker, shape, &o).await;
            println!(
                "  {:<36} {:>12.0} {:>11.0} {:>15.3} {:>9.0}%",
                shape.name,
                m.iterations_s,
                2.0 * m.iterations_s,
                m.cpu_ms,
                m.core * 100.0
            );
        }
    }
}

fn main() {
    let o = opts();
    // Interrupted, the bench's future is dropped: the servers it started are killed by pid.
    support::run_bench(async move {
        tokio::select! {
            () = bench(o) => {}
            _ = tokio::signal::ctrl_c() => eprintln!("interrupted: stopping the servers"),
        }
    });
}
