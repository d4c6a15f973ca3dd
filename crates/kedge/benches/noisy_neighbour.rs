//! Noisy neighbour: one tenant's burst of runs against another tenant's steady trickle, as
//! deployed (docs/ARCHITECTURE.md "Fairness across tenants").
//!
//! ```text
//! cargo bench -p kedge --bench noisy_neighbour                    # N = 10000
//! cargo bench -p kedge --bench noisy_neighbour -- --quick         # N = 1000, shorter idle phase
//! cargo bench -p kedge --bench noisy_neighbour -- --runs 3000 --every-ms 100 --idle-secs 10
//! KEDGE_BENCH_NOISY_RUNS=500 cargo bench -p kedge --bench noisy_neighbour
//! KEDGE_BIN=/path/to/old/kedge cargo bench -p kedge --bench noisy_neighbour -- --quick
//! cargo bench -p kedge --bench noisy_neighbour -- --quick --concurrency 16
//! KEDGE_LIGHT_LANE=0 cargo bench -p kedge --bench noisy_neighbour -- --quick
//! KEDGE_SHARED_NICE=0 cargo bench -p kedge --bench noisy_neighbour   # shared threads at the light lane's priority
//! KEDGE_BENCH_SERVE_LOG=warn,kedge_runtime::admission=debug cargo bench -p kedge --bench noisy_neighbour
//! KEDGE_BENCH_NATS_CONFIG='prof_port: 18222' cargo bench -p kedge --bench noisy_neighbour   # with scripts/journal_stalls.py 18222 …
//! ```
//!
//! Setup (black-box, like the outage bench): one nats-server (kedge-testkit: free port,
//! temporary store); `kedge mock-llm` as its own process; one `kedge serve all` process on
//! default settings, configured by its environment alone. The bench is a client from outside:
//! it stores the agent, publishes tasks on `agent.task.<agent>.<tenant>` and follows the
//! journal's `run.created` and terminal decisions with an ordered consumer.
//!
//! Workload: each run is one model call asking for `list_files`, the tool call, and a final
//! answer (each model answer after 20 ms). Tenant `acme` (A) publishes N tasks at once (all
//! published, the broker's acks awaited, before anything else); tenant `globex` (B) submits one
//! task every `--every-ms` (100) and waits for intake's answer. B's latency is submit → its
//! terminal decision seen.
//!
//! Four phases in one sitting, on one `kedge serve all`:
//! 1. **B idle**: B alone for `--idle-secs` (10; 5 with `--quick`): B's p50/p99.
//! 2. **A alone**: A's burst: A's throughput = N / (burst → A's last run ended).
//! 3. **A + B**: A's burst again while B submits until A's last run ended: B's p50/p99 and A's
//!    throughput, printed as ratios to phases 1 and to the mean of 2 and 4.
//! 4. **A alone again**: a third burst. Each burst meets a fuller stream and fuller buckets
//!    than the one before, so A beside B is judged against the bursts on both sides of it;
//!    the fourth's ratio to the second is printed as the sitting's noise floor.
//!
//! For B's runs it prints each hop between consecutive events of the journal (their stamps),
//! the client's own two (submit → `run.created`, the terminal decision → seen), and how long
//! after its stamp the broker stored each event (where an append waited). After each burst it
//! prints how far the runs list (the projector's consumer) trails the journal: its backlog
//! carries into the next phase.
//!
//! Goals: B's p50 within 1.5× of idle, p99 within 3×, A's throughput within 10 % of A alone.
//! The machine's load average is printed beside them (a shared machine's noise). Not a
//! pass/fail test: it prints numbers (and checks every run succeeded).
//!
//! `KEDGE_BIN=<path>` runs another `kedge` binary as the service (a build from before the fair
//! feed: the same bench measures arrival order). The serve process gets
//! `KEDGE_ADAPTIVE_CONCURRENCY`, `KEDGE_LIGHT_LANE`, `KEDGE_SHARED_NICE` and `KEDGE_METRICS_ADDR`
//! from the bench's environment (no other `KEDGE_*` variable): `KEDGE_LIGHT_LANE=0` measures one
//! connection per process, `KEDGE_SHARED_NICE=0` the shared threads at the light lane's
//! priority, `KEDGE_ADAPTIVE_CONCURRENCY=1` adaptive admission. `KEDGE_BENCH_SERVICES="intake step
//! tool"` runs `kedge serve` with only those services instead of `all` (a diagnostic: what the
//! others cost the burst).

#![allow(clippy::unwrap_used)]

#[path = "support/mod.rs"]
mod support;
use support::deployed::{Children, Deployed, MODEL_KEY_VAR as KEY_VAR};
use support::{loadavg, read_proc, run_bench};

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use futures::StreamExt;
use kedge_app::tasks::{Answer, CALLER_HEADER, Submission};
use kedge_core::RunId;
use kedge_core::agent::AgentDefinition;
use kedge_core::event::{Event, EventType};
use kedge_core::subjects::{self, RUNS_STREAM};
use kedge_core::task::TaskSubmission;
use kedge_journal::Journal;
use serde_json::{Value, json};

const AGENT: &str = "noisy-bench";
const MODEL: &str = "noisy-bench";
const A: &str = "acme";
const B: &str = "globex";
/// Variables of the bench's environment passed on to `kedge serve all`.
const PASSED_ON: &[&str] = &[
    "KEDGE_ADAPTIVE_CONCURRENCY",
    "KEDGE_LIGHT_LANE",
    "KEDGE_METRICS_ADDR",
    "KEDGE_SHARED_NICE",
];
/// Tasks of A's burst whose broker acks are awaited at once.
const PUBLISH_IN_FLIGHT: usize = 512;

struct Opts {
    runs: usize,
    every: Duration,
    idle: Duration,
    cap: Duration,
    /// `step_concurrency` and `tool_concurrency` of the serve process (none: the defaults).
    concurrency: Option<usize>,
}

fn opts() -> Opts {
    let mut o = Opts {
        runs: std::env::var("KEDGE_BENCH_NOISY_RUNS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(10_000),
        every: Duration::from_millis(100),
        idle: Duration::from_secs(10),
        cap: Duration::from_secs(1800),
        concurrency: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} needs a number"))
        };
        match a.as_str() {
            "--quick" => {
                o.runs = o.runs.min(1000);
                o.idle = Duration::from_secs(5);
            }
            "--runs" => o.runs = num("--runs") as usize,
            "--every-ms" => o.every = Duration::from_millis(num("--every-ms").max(1)),
            "--idle-secs" => o.idle = Duration::from_secs(num("--idle-secs").max(1)),
            "--cap-secs" => o.cap = Duration::from_secs(num("--cap-secs")),
            "--concurrency" => o.concurrency = Some(num("--concurrency").max(1) as usize),
            // cargo bench passes --bench.
            "--bench" => {}
            other => panic!("unknown option {other}"),
        }
    }
    assert!(o.runs > 0, "--runs must be at least 1");
    o
}

// ---------------------------------------------------------------------------------------------
// The processes

fn script() -> Value {
    let step = json!({"tool_calls": [{"name": "list_files", "arguments": {}}], "delay_ms": 20});
    json!({"models": {MODEL: {"steps": [step, {"text": "done", "delay_ms": 20}]}}})
}

fn agent_definition(mock: &str) -> AgentDefinition {
    let def = json!({
        "name": AGENT,
        "system_prompt": "noisy neighbour bench",
        "model": {"provider": "openai", "name": MODEL, "base_url": format!("{mock}/v1")},
        "api_key_env": KEY_VAR,
        "tools": [{"name": "list_files", "description": "List the run's workspace",
                   "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}],
        "budget": {"max_steps": 10, "max_tokens": 1000000, "max_attempts_per_step": 3}
    });
    AgentDefinition::parse(def.to_string().as_bytes()).expect("a valid agent definition")
}

// ---------------------------------------------------------------------------------------------
// The journal, as a client sees it

#[derive(Default, Clone)]
struct Seen {
    tenant: Option<String>,
    ended: Option<(Instant, EventType)>,
}

#[derive(Default)]
struct View {
    runs: HashMap<RunId, Seen>,
    last_seq: u64,
}

type Shared = Arc<Mutex<View>>;

fn lock(view: &Shared) -> std::sync::MutexGuard<'_, View> {
    view.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The decisions the observer follows: `run.created` and the terminal ones among them.
const WATCHED: &str = "agent.run.*.d.run.*";

const ENDS: [EventType; 3] = [
    EventType::RunSucceeded,
    EventType::RunFailed,
    EventType::RunCancelled,
];

/// Follows every run's `run.created` and terminal decision into `view`.
async fn observe(js: async_nats::jetstream::Context, journal: Journal, view: Shared) {
    // One filter subject, not one per event type: on a stream holding fewer than a million
    // subjects, nats-server (2.14–2.15) walks the stream's whole subject index for a consumer
    // with several filters each time its next message lies past a filled block: with four, the
    // bench's own observer took about a quarter of the broker's CPU by the third burst
    // (docs/ARCHITECTURE.md "The broker's cost per run"). The run.* decisions it does not need
    // are passed over.
    loop {
        let start = lock(&view).last_seq + 1;
        let Ok(stream) = js.get_stream_no_info(RUNS_STREAM).await else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let config = OrderedConfig {
            filter_subject: WATCHED.to_owned(),
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
            ..Default::default()
        };
        let Ok(consumer) = stream.create_consumer(config).await else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        let Ok(mut messages) = consumer.messages().await else {
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        };
        while let Some(Ok(msg)) = messages.next().await {
            let at = Instant::now();
            let Ok(info) = msg.info() else { continue };
            let seq = info.stream_sequence;
            let Some(parsed) = subjects::parse_event(&msg.subject) else {
                continue;
            };
            if parsed.event_type != EventType::RunCreated && !ENDS.contains(&parsed.event_type) {
                let mut v = lock(&view);
                v.last_seq = v.last_seq.max(seq);
                continue;
            }
            let tenant = if parsed.event_type == EventType::RunCreated {
                match journal.open(&msg.payload).await {
                    Ok(env) => match env.event {
                        Event::RunCreated(c) => Some(c.tenant.to_string()),
                        _ => None,
                    },
                    Err(_) => None,
                }
            } else {
                None
            };
            let mut v = lock(&view);
            v.last_seq = v.last_seq.max(seq);
            let seen = v.runs.entry(parsed.run_id).or_default();
            if tenant.is_some() {
                seen.tenant = tenant;
            } else if seen.ended.is_none() {
                seen.ended = Some((at, parsed.event_type));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Tenants

fn task() -> TaskSubmission {
    TaskSubmission::new(AGENT.parse().expect("an agent name"), "go")
}

/// One of B's tasks, answered: its run.
async fn submit(client: &async_nats::Client, tenant: &str, key: &str) -> RunId {
    let task = task();
    let submission = Submission {
        task: &task,
        key,
        tenant,
        caller: Some("bench"),
    };
    match kedge_app::tasks::submit(client, &submission, Duration::from_secs(600)).await {
        Ok(Answer::Accepted { run_id }) => run_id,
        Ok(Answer::Rejected { error }) => panic!("rejected: {error:?}"),
        Err(e) => panic!("submit: {e}"),
    }
}

/// A's burst: `n` tasks published at once (no answer asked for); returns when the broker has
/// stored them all.
async fn burst(client: &async_nats::Client, n: usize, tag: &str) {
    let js = async_nats::jetstream::new(client.clone());
    let subject = subjects::task_for(&AGENT.parse().expect("agent"), &A.parse().expect("tenant"));
    let body: bytes::Bytes = serde_json::to_vec(&task()).unwrap().into();
    let pid = std::process::id();
    futures::stream::iter(0..n)
        .map(|i| {
            let (js, subject, body) = (js.clone(), subject.clone(), body.clone());
            async move {
                let mut headers = HeaderMap::new();
                headers.insert("Nats-Msg-Id", format!("noisy-{pid}-{tag}-{i}").as_str());
                headers.insert(CALLER_HEADER, "bench");
                let ack = js
                    .publish_with_headers(subject, headers, body)
                    .await
                    .expect("publish a task");
                ack.await.expect("the broker stores the task");
            }
        })
        .buffer_unordered(PUBLISH_IN_FLIGHT)
        .collect::<Vec<()>>()
        .await;
}

/// B's trickle: one task every `every` until `until` says stop; each run with its submit time.
async fn trickle(
    client: async_nats::Client,
    every: Duration,
    tag: &'static str,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<(Instant, RunId)> {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut pending = Vec::new();
    let pid = std::process::id();
    for i in 0.. {
        tick.tick().await;
        if *stop.borrow() {
            break;
        }
        let client = client.clone();
        pending.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let run = submit(&client, B, &format!("trickle-{pid}-{tag}-{i}")).await;
            (t0, run)
        }));
    }
    let mut out = Vec::new();
    for p in pending {
        out.push(p.await.expect("a submit task"));
    }
    out
}

/// Waits until every run of `runs` ended (panics past `cap`, or when a process died); the
/// time each took from its submit.
async fn latencies(
    view: &Shared,
    runs: &[(Instant, RunId)],
    cap: Duration,
    children: &mut Children,
) -> Vec<Duration> {
    let deadline = Instant::now() + cap;
    loop {
        let done: Option<Vec<Duration>> = {
            let v = lock(view);
            runs.iter()
                .map(|(t0, run)| {
                    let (at, ty) = v.runs.get(run)?.ended?;
                    assert_eq!(ty, EventType::RunSucceeded, "run {run} ended {ty}");
                    Some(at.duration_since(*t0))
                })
                .collect()
        };
        if let Some(d) = done {
            return d;
        }
        check_alive(children, deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn check_alive(children: &mut Children, deadline: Instant) {
    if let Some(dead) = children.dead() {
        panic!("{dead}\n{}", children.log_tail(30));
    }
    assert!(Instant::now() < deadline, "runs not ended within the cap");
}

/// A's runs ended so far (those created since `from_count` runs of A were known), and the time
/// of the last end.
fn a_ended(view: &Shared) -> (usize, Option<Instant>) {
    let v = lock(view);
    let mut n = 0;
    let mut last = None;
    for s in v.runs.values() {
        if s.tenant.as_deref() == Some(A)
            && let Some((at, ty)) = s.ended
        {
            assert_eq!(ty, EventType::RunSucceeded, "one of A's runs ended {ty}");
            n += 1;
            last = last.max(Some(at));
        }
    }
    (n, last)
}

/// A's burst of `n` runs on top of the `before` ended already; A's throughput (runs/s from the
/// burst's start to its last run's end).
async fn drain_a(
    client: &async_nats::Client,
    view: &Shared,
    n: usize,
    tag: &str,
    cap: Duration,
    children: &mut Children,
) -> f64 {
    let (before, _) = a_ended(view);
    let t0 = Instant::now();
    burst(client, n, tag).await;
    println!(
        "  A's {n} tasks published in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let deadline = Instant::now() + cap;
    loop {
        let (ended, last) = a_ended(view);
        if ended >= before + n {
            let secs = last
                .unwrap_or_else(Instant::now)
                .duration_since(t0)
                .as_secs_f64();
            return n as f64 / secs;
        }
        check_alive(children, deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A hop's gaps over B's runs, in ms: the median, the 90th and the 99th percentile (where a
/// tail comes from).
#[derive(Clone, Copy)]
struct Gaps {
    p50: f64,
    p90: f64,
    p99: f64,
}

/// The wall time of the bench's `at`: both clocks read once, the first time this is asked.
fn wall(at: Instant) -> time::OffsetDateTime {
    static ANCHOR: std::sync::OnceLock<(Instant, time::OffsetDateTime)> =
        std::sync::OnceLock::new();
    let (i0, w0) = *ANCHOR.get_or_init(|| (Instant::now(), time::OffsetDateTime::now_utc()));
    if at >= i0 {
        w0 + at.duration_since(i0)
    } else {
        w0 - i0.duration_since(at)
    }
}

/// Where B's runs spent their time: for each pair of consecutive events of a run's journal
/// (in the order first seen), the gaps between their times over `runs`.
///
/// Two hops are the client's: from its submit to the `run.created` intake stamped, and from the
/// terminal decision's stamp to the client seeing it (the bench's clock, turned into wall time
/// from one reading of both clocks; the events are stamped by the serve process on this host).
///
/// Then, per event type, how long after its stamp the broker stored it (the stream's own time
/// of the message): an append's wait in the broker's queues, apart from the services' time.
async fn hops(
    js: &async_nats::jetstream::Context,
    journal: &Journal,
    view: &Shared,
    runs: &[(Instant, RunId)],
) -> Vec<(String, Gaps)> {
    let mut order: Vec<String> = Vec::new();
    let mut gaps: HashMap<String, Vec<Duration>> = HashMap::new();
    let mut note = |hop: String, gap: Duration| {
        if !gaps.contains_key(&hop) {
            order.push(hop.clone());
        }
        gaps.entry(hop).or_default().push(gap);
    };
    for (t0, run) in runs {
        let Ok(events) = journal.read(run, 0).await else {
            continue;
        };
        if let Some(first) = events.first() {
            note(
                format!("submit → {}", first.envelope.event_type()),
                (first.envelope.at.0 - wall(*t0)).unsigned_abs(),
            );
        }
        for pair in events.windows(2) {
            let (a, b) = (&pair[0].envelope, &pair[1].envelope);
            let hop = format!("{} → {}", a.event_type(), b.event_type());
            note(hop, (b.at.0 - a.at.0).unsigned_abs());
        }
        if let Ok(stream) = js.get_stream_no_info(RUNS_STREAM).await {
            for r in &events {
                if let Ok(raw) = stream.get_raw_message(r.seq).await {
                    note(
                        format!("  {} stamped → stored", r.envelope.event_type()),
                        (raw.time - r.envelope.at.0).unsigned_abs(),
                    );
                }
            }
        }
        let seen = lock(view).runs.get(run).and_then(|s| s.ended);
        if let (Some(last), Some((at, _))) = (events.last(), seen) {
            note(
                format!("{} → seen by the client", last.envelope.event_type()),
                (wall(at) - last.envelope.at.0).unsigned_abs(),
            );
        }
    }
    order
        .into_iter()
        .map(|hop| {
            let mut g = gaps.remove(&hop).unwrap_or_default();
            g.sort();
            let gaps = Gaps {
                p50: pct(&g, 0.5),
                p90: pct(&g, 0.9),
                p99: pct(&g, 0.99),
            };
            (hop, gaps)
        })
        .collect()
}

/// The `n` slowest of `runs` (their latencies `took`, in the same order): when each was
/// submitted (since the first), how long it took, and its longest gap between two events (a
/// tail that clusters in time points at the broker or the host, one spread out at a hop).
async fn slowest(
    journal: &Journal,
    runs: &[(Instant, RunId)],
    took: &[Duration],
    n: usize,
) -> Vec<String> {
    let Some(first) = runs.iter().map(|(t0, _)| *t0).min() else {
        return Vec::new();
    };
    let mut order: Vec<usize> = (0..runs.len().min(took.len())).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(took[i]));
    let mut out = Vec::new();
    for &i in order.iter().take(n) {
        let (t0, run) = &runs[i];
        let longest = match journal.read(run, 0).await {
            Ok(events) => events
                .windows(2)
                .map(|w| {
                    let gap = (w[1].envelope.at.0 - w[0].envelope.at.0).unsigned_abs();
                    let hop = format!(
                        "{} → {}",
                        w[0].envelope.event_type(),
                        w[1].envelope.event_type()
                    );
                    (gap, hop)
                })
                .max_by_key(|(gap, _)| *gap)
                .map(|(gap, hop)| format!("{hop} {:.1} ms", gap.as_secs_f64() * 1e3))
                .unwrap_or_default(),
            Err(_) => String::new(),
        };
        out.push(format!(
            "+{:>6.2} s  {:>6.1} ms  {longest}",
            t0.duration_since(first).as_secs_f64(),
            took[i].as_secs_f64() * 1e3
        ));
    }
    out
}

/// B's hops idle and busy, side by side.
fn print_hops(idle: &[(String, Gaps)], busy: &[(String, Gaps)]) {
    println!(
        "  B's journal, median gap between consecutive events (idle → with A's backlog; its p90 / p99 then):"
    );
    for (hop, busy) in busy {
        let idle_ms = idle
            .iter()
            .find(|(h, _)| h == hop)
            .map_or(f64::NAN, |(_, g)| g.p50);
        println!(
            "    {hop:<44} {idle_ms:>8.1} ms → {:>8.1} ms  ({:.1} / {:.1})",
            busy.p50, busy.p90, busy.p99
        );
    }
}

/// The CPU ticks of the processes that do the work: nats-server, `kedge serve`, the mock model.
fn cpu_ticks(pids: &[(&'static str, u32)]) -> Vec<u64> {
    pids.iter()
        .map(|(_, pid)| read_proc(*pid).cpu_ticks)
        .collect()
}

/// CPU ms per run of A between two readings (`runs` ran in between), per process.
fn cpu_per_run(pids: &[(&'static str, u32)], before: &[u64], runs: usize) -> String {
    // Linux's USER_HZ: 100 ticks a second.
    const MS_PER_TICK: f64 = 10.0;
    cpu_ticks(pids)
        .iter()
        .zip(before)
        .zip(pids)
        .map(|((after, before), (name, _))| {
            let ms = after.saturating_sub(*before) as f64 * MS_PER_TICK / runs.max(1) as f64;
            format!("{name} {ms:.2}")
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1000.0
}

/// How far the runs list trails the journal as a phase ends: the projector's consumer's
/// messages left to deliver and held unacknowledged (nothing when `kedge serve` runs no
/// projector). Its backlog carries into the next phase.
async fn runs_list_lag(js: &async_nats::jetstream::Context) -> String {
    match support::deployed::journal_consumer(js, kedge_core::subjects::Durable::Projector).await {
        Some(info) => format!(
            "\n  runs list: the projector {} messages behind, {} unacknowledged, as the phase ended",
            info.num_pending, info.num_ack_pending
        ),
        None => String::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// The bench

fn main() {
    let o = opts();
    run_bench(async move {
        tokio::select! {
            () = bench(o) => {}
            _ = tokio::signal::ctrl_c() => eprintln!("interrupted: stopping the processes"),
        }
    });
}

async fn bench(o: Opts) {
    let mut deployed = Deployed::start(false, None).await;
    deployed.children.set_bin(std::env::var_os("KEDGE_BIN"));
    let rt = deployed.client_runtime().await;
    let view: Shared = Arc::default();
    let observer = tokio::spawn(observe(rt.js.clone(), rt.journal.clone(), view.clone()));

    let mock = deployed.start_mock(&script()).await;
    let mut env = deployed.serve_env("bench-serve");
    if let Ok(filter) = std::env::var("KEDGE_BENCH_SERVE_LOG") {
        env.push(("KEDGE_LOG".into(), filter));
    }
    // The settings an A/B of this bench turns, passed on to the serve process (which gets no
    // other `KEDGE_*` variable of the bench's environment).
    for var in PASSED_ON {
        if let Ok(v) = std::env::var(var) {
            env.push(((*var).to_owned(), v));
        }
    }
    if let Some(n) = o.concurrency {
        let file = deployed.dir.path().join("kedge.json");
        let config = json!({"step_concurrency": n, "tool_concurrency": n});
        std::fs::write(&file, config.to_string()).unwrap();
        env.push(("KEDGE_CONFIG".into(), file.to_string_lossy().into_owned()));
    }
    let serve = deployed.serve("serve", &support::deployed::services_from_env(), &env);
    let pids: Vec<(&'static str, u32)> = [
        ("nats-server", deployed.server_pid()),
        ("kedge serve", Some(serve)),
        ("mock-llm", deployed.children.pid("mock-llm")),
    ]
    .into_iter()
    .filter_map(|(name, pid)| Some((name, pid?)))
    .collect();
    let children = &mut deployed.children;
    rt.agents
        .put(&agent_definition(&mock))
        .await
        .expect("store the agent");
    println!(
        "noisy neighbour: A ({A}) bursts {} runs, B ({B}) one run every {:?}; one `kedge serve \
         all`{}{}{}; load average {}",
        o.runs,
        o.every,
        o.concurrency
            .map(|n| format!(", step and tool concurrency {n}"))
            .unwrap_or_default(),
        PASSED_ON
            .iter()
            .filter_map(|var| std::env::var(var).ok().map(|v| format!(", {var}={v}")))
            .collect::<String>(),
        std::env::var("KEDGE_BIN")
            .map(|b| format!(" ({b})"))
            .unwrap_or_default(),
        loadavg()
    );
    // Warm-up: a few runs of each tenant through every service.
    let warm: Vec<(Instant, RunId)> = futures::future::join_all((0..4).map(|i| {
        let client = rt.client.clone();
        async move {
            let tenant = if i % 2 == 0 { A } else { B };
            (
                Instant::now(),
                submit(&client, tenant, &format!("warm-{i}")).await,
            )
        }
    }))
    .await;
    latencies(&view, &warm, Duration::from_secs(120), children).await;

    // 1. B idle.
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let b = tokio::spawn(trickle(rt.client.clone(), o.every, "idle", stop));
    tokio::time::sleep(o.idle).await;
    let _ = stop_tx.send(true);
    let runs = b.await.expect("the trickle");
    let mut idle = latencies(&view, &runs, o.cap, children).await;
    idle.sort();
    let idle_hops = hops(&rt.js, &rt.journal, &view, &runs).await;
    println!(
        "1. B idle: {} runs, p50 {:.1} ms, p99 {:.1} ms (load {})",
        idle.len(),
        pct(&idle, 0.5),
        pct(&idle, 0.99),
        loadavg()
    );

    // 2. A alone.
    let before = cpu_ticks(&pids);
    let alone = drain_a(&rt.client, &view, o.runs, "alone", o.cap, children).await;
    println!(
        "2. A alone: {alone:.1} runs/s; CPU ms per run: {} (load {}){}",
        cpu_per_run(&pids, &before, o.runs),
        loadavg(),
        runs_list_lag(&rt.js).await
    );

    // 3. A + B.
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let b = tokio::spawn(trickle(rt.client.clone(), o.every, "mixed", stop));
    let before = cpu_ticks(&pids);
    let mixed = drain_a(&rt.client, &view, o.runs, "mixed", o.cap, children).await;
    let mixed_cpu = cpu_per_run(&pids, &before, o.runs);
    let mixed_lag = runs_list_lag(&rt.js).await;
    let _ = stop_tx.send(true);
    let runs = b.await.expect("the trickle");
    let mut busy = latencies(&view, &runs, o.cap, children).await;
    let slowest = slowest(&rt.journal, &runs, &busy, 5).await;
    busy.sort();
    println!(
        "3. A + B: A {mixed:.1} runs/s; B {} runs, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms \
         (load {})",
        busy.len(),
        pct(&busy, 0.5),
        pct(&busy, 0.99),
        pct(&busy, 1.0),
        loadavg()
    );
    println!("  CPU ms per run of A (B's few runs included): {mixed_cpu}{mixed_lag}");
    println!("  B's slowest runs (submitted at, since B's first; took; their longest hop):");
    for line in slowest {
        println!("    {line}");
    }
    print_hops(&idle_hops, &hops(&rt.js, &rt.journal, &view, &runs).await);

    // 4. A alone again: A's throughput beside B is judged against both bursts around it (a
    // later burst meets a fuller stream and buckets; their ratio is the noise floor).
    let before = cpu_ticks(&pids);
    let again = drain_a(&rt.client, &view, o.runs, "again", o.cap, children).await;
    println!(
        "4. A alone again: {again:.1} runs/s (×{:.2} of the first); CPU ms per run: {} (load {}){}",
        again / alone,
        cpu_per_run(&pids, &before, o.runs),
        loadavg(),
        runs_list_lag(&rt.js).await
    );
    let (p50, p99, thr) = (
        pct(&busy, 0.5) / pct(&idle, 0.5),
        pct(&busy, 0.99) / pct(&idle, 0.99),
        mixed / ((alone + again) / 2.0),
    );
    let mark = |ok: bool| if ok { "met" } else { "NOT met" };
    println!(
        "SUMMARY noisy_neighbour runs={} B_p50_ratio={p50:.2} ({}, goal <= 1.5) \
         B_p99_ratio={p99:.2} ({}, goal <= 3) A_throughput_ratio={thr:.2} ({}, goal >= 0.9) \
         A_alone_again_ratio={:.2} load={}",
        o.runs,
        mark(p50 <= 1.5),
        mark(p99 <= 3.0),
        mark(thr >= 0.9),
        again / alone,
        loadavg()
    );
    observer.abort();
    if std::env::var_os("KEDGE_BENCH_SERVE_LOG").is_some() {
        let kept = std::env::temp_dir().join("noisy_neighbour-serve.log");
        if std::fs::copy(children.log_dir.join("serve.log"), &kept).is_ok() {
            println!("  the serve process's log: {}", kept.display());
        }
    }
}
