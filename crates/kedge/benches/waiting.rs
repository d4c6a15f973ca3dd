//! Waiting holds nothing (principle 7): what N runs waiting on a durable timer cost a
//! `kedge serve all` process and nats-server, as N grows.
//!
//! ```text
//! cargo bench -p kedge --bench waiting                              # N = 0, 1000, 5000, 10000
//! cargo bench -p kedge --bench waiting -- --levels 0,100,1000 --window 5
//! cargo bench -p kedge --bench waiting -- --levels 10000 --timeline 130   # + CPU over time
//! cargo bench -p kedge --bench waiting -- --levels 10000 --timeline 130 \
//!     --timeline-services intake,step,tool,timer,projector                 # without the reconciler
//! ```
//!
//! For each level N (cumulative: the runs of the previous level stay), the bench:
//! 1. writes the new runs' journals directly with the journal API, as the step service would
//!    have: `run.created`, `run.started`, `step.started`, `step.completed` (a `wait` call of one
//!    hour), `tool.requested`, `timer.scheduled`, `run.waiting{external}` — produced by the pure
//!    core (`decide`, `complete_step`), one decision append each;
//! 2. starts `kedge serve all` (intake, step, tool, timer, reconciler, projector) as a separate
//!    process, on default settings, and waits until it has caught up: every consumer has nothing
//!    pending or unacknowledged, and `KEDGE_TIMERS` holds N pending schedules (the timer service
//!    scheduled them). Then it measures an idle window ("after catch-up": the process that just
//!    processed the new runs' backlog);
//! 3. kills it, starts a fresh `kedge serve all`, and measures another idle window ("fresh": a
//!    process that only *holds* N waiting runs).
//!
//! Per window, from /proc: VmRSS and thread count at the end, and CPU% = Δ(utime+stime) over the
//! window, for the Kedge process and for nats-server. Plus the streams' bytes on disk.
//!
//! `--timeline S` then follows a fresh `kedge serve all` holding the last level's runs for S
//! seconds, printing CPU% per 5 s of both processes and the reconciler's scans from the log: the
//! one periodic activity whose cost grows with the number of runs (it scans every run every
//! `stall_after / 2`, 60 s by default), which a 10 s window may or may not catch.
//!
//! Not a pass/fail test; it prints a table, and checks that every run is waiting and every timer
//! is scheduled.

#![allow(clippy::unwrap_used)]

#[path = "support/mod.rs"]
mod support;
use support::*;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kedge_core::decide::{ModelResponse, Next, complete_step, decide};
use kedge_core::event::{
    AssistantMessage, Draft, Envelope, FinishReason, RunCreated, Timestamp, ToolCall, Usage,
};
use kedge_core::ids::RunId;
use kedge_core::{RunStatus, fold};
use kedge_runtime::Runtime;
use kedge_testkit::NatsServer;

const WRITERS: usize = 32;
/// The consumers `kedge serve all` runs (stream, name).
const CONSUMERS: &[(&str, &str)] = &[
    ("KEDGE_RUNS", "step"),
    ("KEDGE_RUNS", "step-created"),
    ("KEDGE_RUNS", "tool"),
    ("KEDGE_RUNS", "timer"),
    ("KEDGE_RUNS", "projector"),
    ("KEDGE_TIMERS", "timer-fired"),
];

struct Opts {
    levels: Vec<usize>,
    window: Duration,
    timeline: Duration,
    timeline_services: Vec<String>,
}

fn opts() -> Opts {
    let mut o = Opts {
        levels: vec![0, 1_000, 5_000, 10_000],
        window: Duration::from_secs(10),
        timeline: Duration::ZERO,
        timeline_services: vec!["all".into()],
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--levels" => {
                i += 1;
                o.levels = args[i]
                    .split(',')
                    .map(|s| s.trim().parse().unwrap())
                    .collect();
            }
            "--window" => {
                i += 1;
                o.window = Duration::from_secs(args[i].parse().unwrap());
            }
            "--timeline" => {
                i += 1;
                o.timeline = Duration::from_secs(args[i].parse().unwrap());
            }
            "--timeline-services" => {
                i += 1;
                o.timeline_services = args[i].split(',').map(|s| s.trim().to_owned()).collect();
            }
            // cargo bench passes --bench; ignore what we do not know.
            _ => {}
        }
        i += 1;
    }
    o
}

// ---------------------------------------------------------------------------------------------
// /proc

#[derive(Debug, Clone, Copy)]
struct Sample {
    rss_kb: u64,
    threads: u64,
    cpu_pct: f64,
}

/// An idle window of `window` over both processes.
async fn measure(kedge: u32, nats: u32, window: Duration) -> (Sample, Sample) {
    let ticks = kedge_testkit::clock_ticks();
    let (k0, n0) = (read_proc(kedge), read_proc(nats));
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let (k1, n1) = (read_proc(kedge), read_proc(nats));
    let secs = t0.elapsed().as_secs_f64();
    let sample = |a: Proc, b: Proc| Sample {
        rss_kb: b.rss_kb,
        threads: b.threads,
        cpu_pct: (b.cpu_ticks.saturating_sub(a.cpu_ticks)) as f64 / ticks / secs * 100.0,
    };
    (sample(k0, k1), sample(n0, n1))
}

// ---------------------------------------------------------------------------------------------
// Journals written directly

fn wait_an_hour() -> ModelResponse {
    ModelResponse {
        message: AssistantMessage {
            text: String::new(),
            tool_calls: vec![ToolCall {
                call_id: "call_wait".into(),
                name: "wait".into(),
                arguments: serde_json::json!({"seconds": 3600}),
            }],
            thinking: Vec::new(),
        },
        usage: Usage {
            input_tokens: 20,
            output_tokens: 5,
            cost: None,
        },
        finish: FinishReason::ToolCalls,
    }
}

/// Appends decisions one at a time (as a single writer with the concurrency check) and records
/// them for the fold.
async fn append(
    rt: &Runtime,
    run: &RunId,
    events: &mut Vec<(u64, Envelope)>,
    last_decision: &mut u64,
    drafts: Vec<Draft<kedge_core::Decision>>,
) {
    for d in drafts {
        let env = kedge_core::DecisionEnvelope::new(run.clone(), Timestamp::now(), d);
        let appended = rt
            .journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(run, "bench"),
                kedge_core::ids::DecisionSeq::at(*last_decision),
                std::slice::from_ref(&env),
            )
            .await
            .unwrap();
        *last_decision = appended.last_seq;
        events.push((appended.last_seq, env.into_envelope()));
    }
}

/// Journals one run up to `run.waiting{external}` with its timer scheduled.
async fn write_run(rt: &Runtime, i: usize) -> RunId {
    let run = RunId::generate();
    let mut events: Vec<(u64, Envelope)> = Vec::new();
    let mut last = 0;
    let created = Draft::new(kedge_core::Decision::RunCreated(Box::new(RunCreated {
        idempotency_key: Some(format!("wait-{i}")),
        ..created("waiter", "wait for an hour")
    })));
    append(rt, &run, &mut events, &mut last, vec![created]).await;
    loop {
        let state = fold(events.iter().map(|(s, e)| (*s, e))).unwrap();
        match decide(&state) {
            Next::Commit(d) => append(rt, &run, &mut events, &mut last, d).await,
            Next::Step(plan) => {
                append(rt, &run, &mut events, &mut last, plan.start.clone()).await;
                let state = fold(events.iter().map(|(s, e)| (*s, e))).unwrap();
                let done = complete_step(
                    &state,
                    plan.step,
                    plan.attempt,
                    plan.request_id,
                    wait_an_hour(),
                    false,
                    Timestamp::now(),
                    &Default::default(),
                );
                append(rt, &run, &mut events, &mut last, done).await;
            }
            Next::Finish(_) => unreachable!("the bench appends whole decision groups"),
            Next::Idle(_) => {
                assert_eq!(state.status, RunStatus::WaitingExternal);
                assert_eq!(state.timers.len(), 1);
                return run;
            }
        }
    }
}

async fn write_runs(rt: &Runtime, from: usize, to: usize, all: &mut Vec<RunId>) -> Duration {
    let t0 = Instant::now();
    let written: Vec<RunId> = futures::stream::iter(from..to)
        .map(|i| write_run(rt, i))
        .buffer_unordered(WRITERS)
        .collect()
        .await;
    assert_eq!(written.len(), to - from);
    all.extend(written);
    t0.elapsed()
}

/// p50 and p99 (ms) of reading a whole run's journal (what the step service, the reconciler and
/// the bridge do per run), one read at a time, over up to 200 runs.
async fn read_latency(rt: &Runtime, runs: &[RunId]) -> Option<(f64, f64)> {
    if runs.is_empty() {
        return None;
    }
    let step = (runs.len() / 200).max(1);
    let mut ms = Vec::new();
    for run in runs.iter().step_by(step) {
        let t0 = Instant::now();
        let events = rt.journal.read(run, 0).await.unwrap();
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
        assert_eq!(events.len(), 7);
    }
    ms.sort_by(f64::total_cmp);
    Some((
        ms[ms.len() / 2],
        ms[(ms.len() * 99 / 100).min(ms.len() - 1)],
    ))
}

// ---------------------------------------------------------------------------------------------
// The broker's view

async fn stream_bytes(client: &async_nats::Client, stream: &str) -> u64 {
    let info = api(
        client,
        &format!("STREAM.INFO.{stream}"),
        serde_json::json!({}),
    )
    .await;
    info["state"]["bytes"].as_u64().unwrap_or(0)
}

/// Whether every consumer of `kedge serve all` exists and has nothing pending or unacked.
async fn caught_up(client: &async_nats::Client) -> bool {
    for (stream, name) in CONSUMERS {
        let info = api(
            client,
            &format!("CONSUMER.INFO.{stream}.{name}"),
            serde_json::json!({}),
        )
        .await;
        if info.get("error").is_some() {
            return false;
        }
        let pending = info["num_pending"].as_u64().unwrap_or(u64::MAX);
        let unacked = info["num_ack_pending"].as_u64().unwrap_or(u64::MAX);
        if pending > 0 || unacked > 0 {
            return false;
        }
    }
    true
}

async fn wait_caught_up(client: &async_nats::Client, schedules: u64) -> Duration {
    let t0 = Instant::now();
    loop {
        if caught_up(client).await && pending_schedules(client).await == schedules {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(600),
            "kedge serve all did not catch up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// The Kedge process

fn serve_all(
    nats_url: &str,
    workspace: &std::path::Path,
    log: &std::path::Path,
    filter: &str,
) -> Child {
    serve(&["all".to_owned()], nats_url, workspace, log, filter)
}

fn serve(
    services: &[String],
    nats_url: &str,
    workspace: &std::path::Path,
    log: &std::path::Path,
    filter: &str,
) -> Child {
    let log = std::fs::File::create(log).unwrap();
    Command::new(env!("CARGO_BIN_EXE_kedge"))
        .arg("serve")
        .args(services)
        .env("KEDGE_NATS_URL", nats_url)
        .env("KEDGE_WORKER_ID", "w-bench")
        .env("KEDGE_WORKSPACE_ROOT", workspace)
        .env("KEDGE_LOG", filter)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn kedge serve all")
}

struct Row {
    runs: usize,
    phase: &'static str,
    kedge: Sample,
    nats: Sample,
    runs_mb: f64,
    timers_mb: f64,
    read: Option<(f64, f64)>,
}

fn main() {
    run_bench(bench(opts()));
}

async fn bench(o: Opts) {
    let server = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let rt = writer_runtime(&server, dir.path()).await;
    let nats_pid = server.pid().unwrap();
    println!(
        "waiting bench: levels {:?}, idle window {:?}, nats-server pid {nats_pid}, {WRITERS} concurrent writers",
        o.levels, o.window
    );
    let mut rows = Vec::new();
    let mut total = 0;
    let mut written = Vec::new();
    for &level in &o.levels {
        assert!(level >= total, "levels must grow");
        let wrote = write_runs(&rt, total, level, &mut written).await;
        let read = read_latency(&rt, &written).await;
        total = level;

        let child = serve_all(
            &server.url(),
            &dir.path().join("ws"),
            &dir.path().join("kedge.log"),
            "warn",
        );
        let pid = child.id();
        let catchup = wait_caught_up(&rt.client, total as u64).await;
        // Let the last acks and timers settle before the window opens.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (kedge, nats) = measure(pid, nats_pid, o.window).await;
        let runs_mb = stream_bytes(&rt.client, "KEDGE_RUNS").await as f64 / 1e6;
        let timers_mb = stream_bytes(&rt.client, "KEDGE_TIMERS").await as f64 / 1e6;
        println!(
            "N={total}: wrote the new runs in {wrote:.1?}; kedge serve all caught up in {catchup:.1?}"
        );
        rows.push(Row {
            runs: total,
            phase: "after catch-up",
            kedge,
            nats,
            runs_mb,
            timers_mb,
            read,
        });
        stop(child);

        let child = serve_all(
            &server.url(),
            &dir.path().join("ws"),
            &dir.path().join("kedge.log"),
            "warn",
        );
        let pid = child.id();
        tokio::time::sleep(Duration::from_secs(2)).await;
        wait_caught_up(&rt.client, total as u64).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (kedge, nats) = measure(pid, nats_pid, o.window).await;
        rows.push(Row {
            runs: total,
            phase: "fresh",
            kedge,
            nats,
            runs_mb,
            timers_mb,
            read,
        });
        stop(child);
    }
    println!();
    println!(
        "| waiting runs | kedge serve all | kedge RSS MB | threads | CPU % | nats-server RSS MB | threads | CPU % | KEDGE_RUNS MB | KEDGE_TIMERS MB | journal read p50 / p99 ms |"
    );
    println!("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &rows {
        println!(
            "| {} | {} | {:.1} | {} | {:.2} | {:.1} | {} | {:.2} | {:.1} | {:.2} | {} |",
            r.runs,
            r.phase,
            r.kedge.rss_kb as f64 / 1024.0,
            r.kedge.threads,
            r.kedge.cpu_pct,
            r.nats.rss_kb as f64 / 1024.0,
            r.nats.threads,
            r.nats.cpu_pct,
            r.runs_mb,
            r.timers_mb,
            r.read
                .map_or("-".to_owned(), |(p50, p99)| format!("{p50:.2} / {p99:.2}")),
        );
    }
    println!(
        "\n(CPU % of one core over an idle {:?} window; RSS and threads at its end.)",
        o.window
    );
    if !o.timeline.is_zero() {
        timeline(
            &o.timeline_services,
            &server.url(),
            dir.path(),
            nats_pid,
            total,
            o.timeline,
        )
        .await;
    }
}

/// CPU% per 5 s of a fresh `kedge serve all` and of nats-server, and the reconciler's scans.
async fn timeline(
    services: &[String],
    url: &str,
    dir: &std::path::Path,
    nats_pid: u32,
    runs: usize,
    span: Duration,
) {
    let log = dir.join("timeline.log");
    let child = serve(
        services,
        url,
        &dir.join("ws"),
        &log,
        "warn,kedge_reconciler=info",
    );
    let pid = child.id();
    println!(
        "\ntimeline: a fresh kedge serve {} holding {runs} waiting runs, CPU % per 5 s",
        services.join(" ")
    );
    println!("| t (s) | kedge CPU % | kedge RSS MB | nats-server CPU % | nats-server RSS MB |");
    println!("| ---: | ---: | ---: | ---: | ---: |");
    let t0 = Instant::now();
    while t0.elapsed() < span {
        let (k, n) = measure(pid, nats_pid, Duration::from_secs(5)).await;
        println!(
            "| {:.0} | {:.1} | {:.1} | {:.1} | {:.1} |",
            t0.elapsed().as_secs_f64(),
            k.cpu_pct,
            k.rss_kb as f64 / 1024.0,
            n.cpu_pct,
            n.rss_kb as f64 / 1024.0
        );
    }
    stop(child);
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    for line in text.lines().filter(|l| l.contains("reconciler scan")) {
        println!("log: {line}");
    }
}
