//! The bridge's SSE path: latency from a journal append to its arrival at SSE clients, and the
//! bridge's memory per open SSE connection.
//!
//! ```text
//! cargo bench -p kedge --bench bridge                 # 1 and 200 clients, 1000 idle connections
//! cargo bench -p kedge --bench bridge -- --quick      # fewer events and connections
//! ```
//!
//! Setup: a nats-server of its own (kedge-testkit), intake in this process (to create the runs),
//! and the bridge as a separate `kedge serve bridge` process, so that its resident memory is its
//! own. The SSE clients run in this process (reqwest, parsing the wire format).
//!
//! - **Latency**: the bench appends `user.message` inputs to a run that has N clients watching
//!   (one every 10 ms, so the number is latency, not queueing); each message carries the
//!   append's start time; each client records `arrival − append start` for each. Reported per
//!   client count as p50 / p99 / max over every (client, event) pair.
//! - **Memory**: VmRSS of the bridge process (from /proc) with its feed warm, then with C more
//!   idle connections open on one run (each past its replay, on the live ring), then on C
//!   distinct runs (one feed, i.e. one ordered consumer and one delta subscription, per run).
//!   Reported as the RSS delta divided by C.
//!
//! Not a pass/fail test: it prints numbers (and checks every client got every event).

#![allow(clippy::unwrap_used)]

#[path = "../tests/bridge_support/mod.rs"]
mod bridge_support;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bridge_support::{ACME, Api, Sse, SseStream};
use kedge_core::event::{Draft, Timestamp, UserMessage};
use kedge_core::ids::RunId;
use kedge_runtime::{Config, Runtime};
use kedge_testkit::NatsServer;

struct Opts {
    events: usize,
    idle: usize,
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct Bridge {
    child: Child,
    base: String,
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_bridge(nats_url: &str) -> Bridge {
    let port = kedge_testkit::free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_kedge"))
        .args(["serve", "bridge"])
        .env("KEDGE_NATS_URL", nats_url)
        .env("KEDGE_BRIDGE_LISTEN", format!("127.0.0.1:{port}"))
        .env("KEDGE_BRIDGE_TOKENS", format!("{ACME}=acme"))
        .env("KEDGE_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn kedge serve bridge");
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let t0 = Instant::now();
    while http.get(format!("{base}/readyz")).send().await.is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "bridge did not start"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Bridge { child, base }
}

/// Opens an SSE stream on the run and returns once the replay (run.created) arrived.
async fn open_live(http: &reqwest::Client, base: &str, run: &RunId) -> SseStream {
    let url = format!("{base}/v1/runs/{run}/events");
    let mut s = SseStream::open(http, &url, Some(ACME), None)
        .await
        .expect("open");
    assert_eq!(s.status, reqwest::StatusCode::OK);
    loop {
        match s.next().await {
            Some(Sse::Event { id: Some(_), .. }) => return s,
            Some(_) => {}
            None => panic!("stream ended during replay"),
        }
    }
}

async fn latency(
    rt: &Runtime,
    base: &str,
    run: &RunId,
    clients: usize,
    events: usize,
    origin: Instant,
) -> Vec<f64> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut streams = Vec::new();
    for _ in 0..clients {
        streams.push(open_live(&http, base, run).await);
    }
    let ready = Arc::new(tokio::sync::Barrier::new(clients + 1));
    let mut tasks = Vec::new();
    for mut s in streams {
        let ready = ready.clone();
        tasks.push(tokio::spawn(async move {
            ready.wait().await;
            let mut lat = Vec::with_capacity(events);
            while lat.len() < events {
                match s.next().await {
                    Some(Sse::Event {
                        id: Some(_), data, ..
                    }) => {
                        let now = origin.elapsed().as_nanos() as f64;
                        let text = data["data"]["text"].as_str().unwrap_or("");
                        if let Some(sent) =
                            text.strip_prefix("t:").and_then(|t| t.parse::<f64>().ok())
                        {
                            lat.push((now - sent) / 1e6);
                        }
                    }
                    Some(_) => {}
                    None => panic!("stream ended"),
                }
            }
            lat
        }));
    }
    ready.wait().await;
    for i in 0..events {
        let sent = origin.elapsed().as_nanos();
        let input = kedge_core::InputEnvelope::new(
            run.clone(),
            Timestamp::now(),
            Draft::new(kedge_core::Input::UserMessage(UserMessage {
                text: format!("t:{sent}"),
            })),
        );
        let id = kedge_core::ids::InputId::arbitrary(format!("lat-{clients}-{i}"));
        rt.journal.append_input(&id, &input).await.expect("append");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    assert_eq!(all.len(), clients * events, "every client got every event");
    all.sort_by(|a, b| a.total_cmp(b));
    all
}

async fn submit(api: &Api, key: &str) -> RunId {
    let (s, v) = api.submit("bench", "hello", key).await;
    assert_eq!(s, reqwest::StatusCode::ACCEPTED, "{v}");
    v["run_id"].as_str().unwrap().parse().unwrap()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let opts = if quick {
        Opts {
            events: 50,
            idle: 200,
        }
    } else {
        Opts {
            events: 200,
            idle: 1000,
        }
    };
    let nats = NatsServer::start().await;
    let config = Config {
        nats_urls: vec![nats.url()],
        worker_id: "bench".parse().expect("worker id"),
        ..Config::default()
    };
    let rt = Runtime::connect(config.clone()).await.expect("runtime");
    let def = serde_json::json!({
        "name": "bench", "system_prompt": "bench",
        "model": {"provider": "openai", "name": "none", "base_url": "http://127.0.0.1:9/v1"},
        "tools": [], "budget": {"max_steps": 5, "max_tokens": 1000, "max_attempts_per_step": 1}
    });
    let def = kedge_core::agent::AgentDefinition::parse(def.to_string().as_bytes()).unwrap();
    rt.agents.put(&def).await.unwrap();
    // Intake as `kedge serve intake` runs it, until the bench ends.
    let mut services = kedge_serve::TransientKedge::new();
    let intake_rt = Runtime::connect(config.clone()).await.unwrap();
    services.start_on(intake_rt, &[kedge_serve::Service::Intake]);
    let bridge = start_bridge(&nats.url()).await;
    let api = Api::new(&bridge.base, Some(ACME));
    let origin = Instant::now();

    println!(
        "bridge SSE bench (nats-server {}, 2 cores, loopback; the bridge is a separate release-built process)",
        rt.client.server_info().version
    );
    println!();
    println!(
        "append → SSE arrival, {} events, one every 10 ms:",
        opts.events
    );
    for clients in [1usize, 200] {
        let run = submit(&api, &format!("lat-{clients}")).await;
        let l = latency(&rt, &bridge.base, &run, clients, opts.events, origin).await;
        println!(
            "  {clients:>4} client(s): p50 {:>6.2} ms   p99 {:>6.2} ms   max {:>6.2} ms   ({} samples)",
            percentile(&l, 0.50),
            percentile(&l, 0.99),
            l.last().copied().unwrap_or(f64::NAN),
            l.len()
        );
    }

    // Memory per idle connection, each scenario on a fresh bridge process (freed memory is kept
    // by the allocator, so a second scenario on the same process would look cheaper).
    println!();
    println!("bridge memory (VmRSS delta) per open SSE connection:");
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    drop(bridge);
    let bridge = start_bridge(&nats.url()).await;
    let api = Api::new(&bridge.base, Some(ACME));
    let pid = bridge.child.id();
    let run = submit(&api, "mem-one").await;
    // Warm: one feed, one connection, a few events through.
    let warm = open_live(&http, &bridge.base, &run).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = rss_kib(pid);
    let mut held = Vec::new();
    for _ in 0..opts.idle {
        held.push(open_live(&http, &bridge.base, &run).await);
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let after = rss_kib(pid);
    println!(
        "  {} connections on one run:  {before} KiB → {after} KiB = {:.1} KiB per connection",
        opts.idle,
        after.saturating_sub(before) as f64 / opts.idle as f64
    );
    drop(held);
    drop(warm);
    drop(bridge);

    let bridge = start_bridge(&nats.url()).await;
    let api = Api::new(&bridge.base, Some(ACME));
    let pid = bridge.child.id();
    let runs_n = opts.idle / 5;
    let mut runs = Vec::new();
    for i in 0..=runs_n {
        runs.push(submit(&api, &format!("mem-{i}")).await);
    }
    let warm = open_live(&http, &bridge.base, &runs[runs_n]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = rss_kib(pid);
    let mut held = Vec::new();
    for r in &runs[..runs_n] {
        held.push(open_live(&http, &bridge.base, r).await);
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let after = rss_kib(pid);
    println!(
        "  {runs_n} connections on {runs_n} runs: {before} KiB → {after} KiB = {:.1} KiB per connection with its own feed",
        after.saturating_sub(before) as f64 / runs_n as f64
    );
    drop(held);
    drop(warm);
}
