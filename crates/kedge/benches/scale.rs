//! Scale with history: what one run, one reconciler scan and one fresh
//! `kedge serve all` cost as the journal fills up with runs.
//!
//! ```text
//! cargo bench -p kedge --bench scale                                  # N = 1000, 10000
//! cargo bench -p kedge --bench scale -- --levels 1000,10000,100000
//! cargo bench -p kedge --bench scale -- --levels 1000 --reads 100 --window 5
//! ```
//!
//! For each level N (cumulative: the runs of the previous levels stay), the bench:
//!
//! 1. publishes the new runs' journals straight into `KEDGE_RUNS`, pipelined (no ack awaited per
//!    message), so that 100k runs take seconds, not minutes. The events are what the services
//!    would have journaled, made by the pure core (`decide`, `complete_step`): N waiting runs of
//!    7 events each (`run.created` … a `wait` of an hour, `timer.scheduled`, `run.waiting`),
//!    written 64 runs side by side; then 20 finished 10-turn chats of 50 events each, written
//!    one after another ("compact"), and 4 more whose turns were spread over the level's
//!    waiting runs ("spread": a run that lived while the others came). Each decision carries a
//!    writer's `Nats-Msg-Id` (`d:<run>:<expected>:0:bench`), as the journal's readers require.
//! 2. times reading one whole run (`Journal::read(run, 0)`, one at a time): a compact 50-event
//!    chat of this level, one of the first level ("old"), a spread one, and a 7-event waiting run;
//! 3. times the reconciler: a fresh `Reconciler`'s first scan (it lists every run once), the
//!    next scan of a reconciler that has followed the journal since the previous level (it
//!    looks only at runs not settled and at runs touched since), and its scan after that, with
//!    nothing new (what a quiet deployment pays every `stall_after / 2`);
//! 4. starts `kedge serve all` (intake, step, tool, timer, reconciler, projector) on default
//!    settings as a separate process and waits until it has caught up on the new runs: every
//!    consumer drained and acknowledged, `KEDGE_TIMERS` holding a schedule per waiting run.
//!    Runs per second = new runs / that time; beside it the CPU both processes spent per run
//!    (and the rate two free cores would give: wall time on a shared machine is noisy), when
//!    each consumer drained, and the process's peak RSS;
//! 5. kills it, starts a fresh one and measures it holding every run: RSS and CPU over an idle
//!    window (`--window`, 10 s) from 2 s after its start.
//!
//! `KEDGE_BIN=<path>` runs another `kedge` binary as the service (a build from before a change).
//! `--serve projector` runs the projector alone in step 4 (and 5): what catching up costs it by
//! itself, its drain time and CPU per run not mixed with the other services' (the timer schedules
//! are then not waited for).
//!
//! Not a pass/fail test: it prints a table (and checks that every read is complete).

#![allow(clippy::unwrap_used)]

/// The allocator the `kedge` binary runs with (its main.rs): the reads timed here run in this
/// process and cost what they cost in the product.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "support/mod.rs"]
mod support;
use support::*;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use futures::StreamExt;
use kedge_core::decide::{ModelResponse, Next, complete_step, decide};
use kedge_core::event::{
    AssistantMessage, Draft, Envelope, Event, EventKind, FinishReason, Timestamp, ToolCall, Usage,
    UserMessage,
};
use kedge_core::ids::RunId;
use kedge_core::{RunStatus, fold};
use kedge_runtime::Runtime;
use kedge_testkit::NatsServer;

/// Runs written side by side when filling a level.
const SIDE_BY_SIDE: usize = 64;
/// Compact 50-event chats written after each level's waiting runs.
const COMPACT: usize = 20;
/// 50-event chats whose turns are spread over each level's waiting runs.
const SPREAD: usize = 4;
/// Turns of a chat: `run.created`, `run.started`, then per turn a model step and its end, and
/// a user message before each next turn: 50 events.
const TURNS: usize = 10;
/// Publishes in flight (acks not yet received) while filling.
const IN_FLIGHT: usize = 1024;
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
    reads: usize,
    window: Duration,
    /// What the service process runs: `all`, or `projector` alone (`--serve projector`).
    serve: Serve,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Serve {
    All,
    Projector,
}

impl Serve {
    fn arg(self) -> &'static str {
        match self {
            Serve::All => "all",
            Serve::Projector => "projector",
        }
    }

    /// The consumers the process runs and must drain (stream, name).
    fn consumers(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Serve::All => CONSUMERS,
            Serve::Projector => &[("KEDGE_RUNS", "projector")],
        }
    }
}

fn opts() -> Opts {
    let mut o = Opts {
        levels: vec![1_000, 10_000],
        reads: 200,
        window: Duration::from_secs(10),
        serve: Serve::All,
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
            "--reads" => {
                i += 1;
                o.reads = args[i].parse().unwrap();
            }
            "--window" => {
                i += 1;
                o.window = Duration::from_secs(args[i].parse().unwrap());
            }
            "--serve" => {
                i += 1;
                o.serve = match args[i].as_str() {
                    "all" => Serve::All,
                    "projector" => Serve::Projector,
                    other => panic!("--serve all|projector, not {other}"),
                };
            }
            // cargo bench passes --bench; ignore what we do not know.
            _ => {}
        }
        i += 1;
    }
    o
}

// ---------------------------------------------------------------------------------------------
// Journals made by the core

fn response(tool_calls: Vec<ToolCall>, text: &str) -> ModelResponse {
    let finish = if tool_calls.is_empty() {
        FinishReason::Stop
    } else {
        FinishReason::ToolCalls
    };
    ModelResponse {
        message: AssistantMessage {
            text: text.into(),
            tool_calls,
            thinking: Vec::new(),
        },
        usage: Usage {
            input_tokens: 20,
            output_tokens: 5,
            cost: None,
        },
        finish,
    }
}

/// One message to publish: subject, `Nats-Msg-Id`, payload.
type Msg = (String, String, bytes::Bytes);

/// A run's journal as the services would write it, with sequences local to the run (its
/// readers need only that each decision names an earlier place than its own).
struct Sim {
    run: RunId,
    events: Vec<(u64, Envelope)>,
    last_decision: u64,
    out: Vec<Msg>,
}

impl Sim {
    fn new(agent: &str, input: &str) -> Sim {
        let mut sim = Sim {
            run: RunId::generate(),
            events: Vec::new(),
            last_decision: 0,
            out: Vec::new(),
        };
        let c = Draft::new(Event::RunCreated(Box::new(created(agent, input))));
        sim.push(c);
        sim
    }

    fn push(&mut self, draft: Draft<impl Into<Event>>) {
        let seq = self.events.len() as u64 + 1;
        self.push_at(draft, seq);
    }

    /// Adds an event stored at `seq` (a live run's real sequence, see [`Live`]).
    fn push_at(&mut self, draft: Draft<impl Into<Event>>, seq: u64) {
        let env = Envelope::new(self.run.clone(), Timestamp::now(), draft);
        let id = if env.kind() == EventKind::Decision {
            let expected = kedge_core::ids::DecisionSeq::at(self.last_decision);
            let id = kedge_journal::decision_msg_id(&self.run, expected, 0, "bench");
            self.last_decision = seq;
            id
        } else {
            format!("bench:{}:{seq}", self.run)
        };
        self.out
            .push((env.subject(), id, bytes::Bytes::from(env.to_json_bytes())));
        self.events.push((seq, env));
    }

    fn state(&self) -> kedge_core::RunState {
        fold(self.events.iter().map(|(s, e)| (*s, e))).unwrap()
    }

    /// Decides until idle, answering each model step with `answer`.
    fn settle(&mut self, answer: &dyn Fn() -> ModelResponse) -> kedge_core::RunState {
        loop {
            let state = self.state();
            match decide(&state) {
                Next::Commit(d) => d.into_iter().for_each(|d| self.push(d)),
                Next::Step(plan) => {
                    plan.start.clone().into_iter().for_each(|d| self.push(d));
                    let state = self.state();
                    let done = complete_step(
                        &state,
                        plan.step,
                        plan.attempt,
                        plan.request_id,
                        answer(),
                        false,
                        Timestamp::now(),
                        &Default::default(),
                    );
                    done.into_iter().for_each(|d| self.push(d));
                }
                Next::Finish(_) => unreachable!("whole groups are written"),
                Next::Idle(_) => return state,
            }
        }
    }
}

/// A run waiting an hour on a durable timer: 7 events.
fn waiting_run() -> Sim {
    let mut sim = Sim::new("waiter", "wait for an hour");
    let state = sim.settle(&|| {
        response(
            vec![ToolCall {
                call_id: "call_wait".into(),
                name: "wait".into(),
                arguments: serde_json::json!({"seconds": 3600}),
            }],
            "",
        )
    });
    assert_eq!(state.status, RunStatus::WaitingExternal);
    sim
}

/// A chat written live, one event at a time with its real stream sequence (its inputs'
/// sequences shape the step's `inputs_through`): `TURNS` turns, 50 events, finished.
struct Live {
    sim: Sim,
    turn: usize,
}

impl Live {
    fn new() -> Live {
        Live {
            sim: Sim {
                run: RunId::generate(),
                events: Vec::new(),
                last_decision: 0,
                out: Vec::new(),
            },
            turn: 0,
        }
    }

    async fn publish(&mut self, p: &mut Publisher, draft: Draft<impl Into<Event>>) {
        let draft = draft.widen();
        let seq = p.send_now(&self.sim, &draft).await;
        self.sim.push_at(draft, seq);
    }

    /// Writes the chat's next turn (the first one with its `run.created`).
    async fn next_turn(&mut self, p: &mut Publisher) {
        if self.turn == 0 {
            let c = Draft::new(Event::RunCreated(Box::new(created("chat", "hello"))));
            self.publish(p, c).await;
        } else {
            let text = format!("and then {}?", self.turn);
            self.publish(p, Draft::new(Event::UserMessage(UserMessage { text })))
                .await;
        }
        self.turn += 1;
        loop {
            let state = self.sim.state();
            match decide(&state) {
                Next::Commit(d) => {
                    for d in d {
                        self.publish(p, d).await;
                    }
                }
                Next::Step(plan) => {
                    for d in plan.start.clone() {
                        self.publish(p, d).await;
                    }
                    let state = self.sim.state();
                    let done = complete_step(
                        &state,
                        plan.step,
                        plan.attempt,
                        plan.request_id,
                        response(Vec::new(), "an answer"),
                        false,
                        Timestamp::now(),
                        &Default::default(),
                    );
                    for d in done {
                        self.publish(p, d).await;
                    }
                }
                Next::Finish(_) => unreachable!("whole groups are written"),
                Next::Idle(_) => {
                    assert_eq!(state.status, RunStatus::Succeeded);
                    return;
                }
            }
        }
    }

    async fn write_all(mut self, p: &mut Publisher) -> RunId {
        while self.turn < TURNS {
            self.next_turn(p).await;
        }
        assert_eq!(self.sim.events.len(), 50, "a chat is 50 events");
        self.sim.run
    }
}

/// Publishes messages in order (one connection keeps them in order), `IN_FLIGHT` acks at most
/// outstanding.
struct Publisher {
    js: async_nats::jetstream::Context,
    acks: futures::stream::FuturesUnordered<
        <async_nats::jetstream::context::PublishAckFuture as std::future::IntoFuture>::IntoFuture,
    >,
}

impl Publisher {
    async fn send(&mut self, (subject, id, payload): Msg) {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", id.as_str());
        while self.acks.len() >= IN_FLIGHT {
            self.acks.next().await.unwrap().unwrap();
        }
        let ack = self
            .js
            .publish_with_headers(subject, headers, payload)
            .await
            .unwrap();
        self.acks.push(std::future::IntoFuture::into_future(ack));
    }

    /// Publishes one event of `sim`'s run after everything sent before it is stored, and
    /// returns its stream sequence.
    async fn send_now(&mut self, sim: &Sim, draft: &Draft) -> u64 {
        self.flush().await;
        let env = Envelope::new(sim.run.clone(), Timestamp::now(), draft.clone());
        let mut headers = HeaderMap::new();
        let id = if env.kind() == EventKind::Decision {
            let expected = kedge_core::ids::DecisionSeq::at(sim.last_decision);
            kedge_journal::decision_msg_id(&sim.run, expected, 0, "bench")
        } else {
            format!("bench:{}:{}", sim.run, sim.events.len() + 1)
        };
        headers.insert("Nats-Msg-Id", id.as_str());
        self.js
            .publish_with_headers(env.subject(), headers, env.to_json_bytes().into())
            .await
            .unwrap()
            .await
            .unwrap()
            .sequence
    }

    async fn flush(&mut self) {
        while let Some(ack) = self.acks.next().await {
            ack.unwrap();
        }
    }
}

/// The runs of one level.
struct Level {
    waiting: Vec<RunId>,
    compact: Vec<RunId>,
    spread: Vec<RunId>,
}

/// Writes `n` waiting runs, `SIDE_BY_SIDE` at a time (their events interleaved), with the
/// spread chats' turns among them, then the compact chats.
async fn fill(rt: &Runtime, n: usize) -> Level {
    let mut p = Publisher {
        // A loaded machine (these share two cores) can be slow to ack a full pipeline.
        js: async_nats::jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(60))
            .build(rt.client.clone()),
        acks: Default::default(),
    };
    let mut level = Level {
        waiting: Vec::with_capacity(n),
        compact: Vec::new(),
        spread: Vec::new(),
    };
    let mut spread: Vec<Live> = (0..SPREAD).map(|_| Live::new()).collect();
    let chunks = n.div_ceil(SIDE_BY_SIDE).max(1);
    let turn_every = (chunks / TURNS).max(1);
    for chunk in 0..chunks {
        if chunk % turn_every == 0 {
            for chat in &mut spread {
                if chat.turn < TURNS {
                    chat.next_turn(&mut p).await;
                }
            }
        }
        let count = SIDE_BY_SIDE.min(n - (chunk * SIDE_BY_SIDE).min(n));
        let sims: Vec<Sim> = (0..count).map(|_| waiting_run()).collect();
        let mut iters: Vec<_> = sims
            .into_iter()
            .map(|s| {
                level.waiting.push(s.run.clone());
                s.out.into_iter()
            })
            .collect();
        // One event of each run in turn, as side-by-side writers would.
        let mut any = true;
        while any {
            any = false;
            for it in &mut iters {
                if let Some(m) = it.next() {
                    p.send(m).await;
                    any = true;
                }
            }
        }
    }
    for chat in spread {
        level.spread.push(chat.write_all(&mut p).await);
    }
    for _ in 0..COMPACT {
        level.compact.push(Live::new().write_all(&mut p).await);
    }
    p.flush().await;
    level
}

// ---------------------------------------------------------------------------------------------
// Measures

fn pct(mut ms: Vec<f64>) -> (f64, f64) {
    ms.sort_by(f64::total_cmp);
    (
        ms[ms.len() / 2],
        ms[(ms.len() * 99 / 100).min(ms.len() - 1)],
    )
}

/// p50 / p99 (ms) of reading a whole run, one read at a time, cycling over `runs`.
async fn reads(rt: &Runtime, runs: &[RunId], events: usize, count: usize) -> (f64, f64) {
    for run in runs {
        assert_eq!(rt.journal.read(run, 0).await.unwrap().len(), events);
    }
    let mut ms = Vec::with_capacity(count);
    for i in 0..count {
        let run = &runs[i % runs.len()];
        let t0 = Instant::now();
        let got = rt.journal.read(run, 0).await.unwrap();
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
        assert_eq!(got.len(), events);
    }
    pct(ms)
}

/// The consumers of `kedge serve all` that have nothing pending or unacknowledged.
async fn drained(client: &async_nats::Client, serve: Serve) -> Vec<&'static str> {
    let mut out = Vec::new();
    for (stream, name) in serve.consumers() {
        let info = api(
            client,
            &format!("CONSUMER.INFO.{stream}.{name}"),
            serde_json::json!({}),
        )
        .await;
        if info.get("error").is_some() {
            continue;
        }
        let pending = info["num_pending"].as_u64().unwrap_or(u64::MAX);
        let unacked = info["num_ack_pending"].as_u64().unwrap_or(u64::MAX);
        if pending == 0 && unacked == 0 {
            out.push(*name);
        }
    }
    out
}

/// Waits until `kedge serve all` (pid) has caught up; the time it took, its peak RSS (KiB),
/// and when each consumer (and the timers' schedules) got there.
async fn wait_caught_up(
    client: &async_nats::Client,
    pid: u32,
    schedules: u64,
    serve: Serve,
) -> (Duration, u64, Vec<(&'static str, Duration)>) {
    let t0 = Instant::now();
    let mut peak = 0;
    let mut done: Vec<(&'static str, Duration)> = Vec::new();
    loop {
        peak = peak.max(read_proc(pid).rss_kb);
        for name in drained(client, serve).await {
            if !done.iter().any(|(n, _)| *n == name) {
                done.push((name, t0.elapsed()));
            }
        }
        // The projector alone schedules nothing.
        let scheduled = serve == Serve::Projector || pending_schedules(client).await == schedules;
        if scheduled && !done.iter().any(|(n, _)| *n == "schedules") {
            done.push(("schedules", t0.elapsed()));
        }
        if scheduled && done.len() == serve.consumers().len() + 1 {
            return (t0.elapsed(), peak, done);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(1800),
            "kedge serve all did not catch up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn serve_all(nats_url: &str, dir: &std::path::Path, log: &std::path::Path, serve: Serve) -> Child {
    let log = std::fs::File::create(log).unwrap();
    // `KEDGE_BIN`: another build to compare (e.g. a copy of the binary before a change).
    let bin = std::env::var("KEDGE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kedge").to_owned());
    Command::new(bin)
        .args(["serve", serve.arg()])
        .env("KEDGE_NATS_URL", nats_url)
        .env("KEDGE_WORKER_ID", "w-bench")
        .env("KEDGE_WORKSPACE_ROOT", dir.join("ws"))
        .env("KEDGE_LOG", "warn,kedge_reconciler=info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn kedge serve all")
}

struct Row {
    runs: usize,
    fill: Duration,
    compact: (f64, f64),
    old: (f64, f64),
    spread: (f64, f64),
    waiting: (f64, f64),
    first_scan: (Duration, usize),
    next_scan: (Duration, usize),
    idle_scan: (Duration, usize),
    catch_up: (usize, Duration, u64),
    held_rss_kb: u64,
    held_cpu: f64,
}

fn main() {
    run_bench(bench(opts()));
}

async fn bench(o: Opts) {
    let server = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let rt = writer_runtime(&server, dir.path()).await;
    let nats_pid = server.pid().unwrap();
    let ticks = kedge_testkit::clock_ticks();
    println!(
        "scale bench: levels {:?}, {} reads per line, idle window {:?}, kedge serve {}",
        o.levels,
        o.reads,
        o.window,
        o.serve.arg()
    );
    let mut follower = kedge_reconciler::Reconciler::new(rt.clone());
    follower.scan().await.unwrap();
    let mut rows = Vec::new();
    let mut total = 0;
    let mut old: Vec<RunId> = Vec::new();
    for &level in &o.levels {
        assert!(level >= total, "levels must grow");
        let t0 = Instant::now();
        let new = level - total;
        let l = fill(&rt, new).await;
        let fill_time = t0.elapsed();
        total = level;
        if old.is_empty() {
            old = l.compact.clone();
        }
        println!("N={total}: wrote {new} waiting runs and 24 chats in {fill_time:.1?}");
        let compact = reads(&rt, &l.compact, 50, o.reads).await;
        let old_reads = reads(&rt, &old, 50, o.reads).await;
        let spread = reads(&rt, &l.spread, 50, o.reads).await;
        let waiting = reads(&rt, &l.waiting[..l.waiting.len().min(200)], 7, o.reads).await;

        let t0 = Instant::now();
        let report = kedge_reconciler::Reconciler::new(rt.clone())
            .scan()
            .await
            .unwrap();
        let fresh_scan = (t0.elapsed(), report.runs);
        let t0 = Instant::now();
        let report = follower.scan().await.unwrap();
        let next_scan = (t0.elapsed(), report.runs);
        // Nothing new since: the scan a quiet deployment makes every `stall_after / 2`.
        let t0 = Instant::now();
        let report = follower.scan().await.unwrap();
        let idle_scan = (t0.elapsed(), report.runs);
        println!(
            "N={total}: reads done; reconciler first scan {:.1?} ({} runs), following scan {:.1?} ({} runs), then with nothing new {:.1?} ({} runs)",
            fresh_scan.0, fresh_scan.1, next_scan.0, next_scan.1, idle_scan.0, idle_scan.1
        );

        let log = dir.path().join("kedge.log");
        let child = serve_all(&server.url(), dir.path(), &log, o.serve);
        let pid = child.id();
        let (k0, n0) = (read_proc(pid).cpu_ticks, read_proc(nats_pid).cpu_ticks);
        let (took, peak, done) = wait_caught_up(&rt.client, pid, total as u64, o.serve).await;
        let (k1, n1) = (read_proc(pid).cpu_ticks, read_proc(nats_pid).cpu_ticks);
        let caught = new + COMPACT + SPREAD;
        let cpu_ms = |a: u64, b: u64| b.saturating_sub(a) as f64 / ticks * 1e3 / caught as f64;
        println!(
            "N={total}: catch-up CPU per run: kedge {:.3} ms, nats-server {:.3} ms (runs/s at 2 cores: {:.0})",
            cpu_ms(k0, k1),
            cpu_ms(n0, n1),
            2e3 / (cpu_ms(k0, k1) + cpu_ms(n0, n1))
        );
        let done: Vec<String> = done
            .iter()
            .map(|(name, at)| format!("{name} {at:.1?}"))
            .collect();
        println!("N={total}: drained: {}", done.join(", "));
        println!(
            "N={total}: kedge serve {} caught up on {} new runs in {took:.1?} ({:.0} runs/s), peak RSS {:.1} MB",
            o.serve.arg(),
            new + COMPACT + SPREAD,
            (new + COMPACT + SPREAD) as f64 / took.as_secs_f64(),
            peak as f64 / 1024.0
        );
        stop(child);

        // A fresh process holding every run.
        let log = dir.path().join("kedge-fresh.log");
        let child = serve_all(&server.url(), dir.path(), &log, o.serve);
        let pid = child.id();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let c0 = read_proc(pid).cpu_ticks;
        let t0 = Instant::now();
        tokio::time::sleep(o.window).await;
        let Proc {
            rss_kb: rss,
            cpu_ticks: c1,
            ..
        } = read_proc(pid);
        let cpu = c1.saturating_sub(c0) as f64 / ticks / t0.elapsed().as_secs_f64() * 100.0;
        stop(child);
        let nats_rss = read_proc(nats_pid).rss_kb;
        println!(
            "N={total}: fresh process RSS {:.1} MB, CPU {cpu:.2} % over {:?}; nats-server RSS {:.1} MB",
            rss as f64 / 1024.0,
            o.window,
            nats_rss as f64 / 1024.0
        );
        rows.push(Row {
            runs: total,
            fill: fill_time,
            compact,
            old: old_reads,
            spread,
            waiting,
            first_scan: fresh_scan,
            next_scan,
            idle_scan,
            catch_up: (new + COMPACT + SPREAD, took, peak),
            held_rss_kb: rss,
            held_cpu: cpu,
        });
    }
    println!();
    println!(
        "| runs | fill | read 50-event p50/p99 ms: compact | old | spread | 7-event waiting | reconciler: fresh scan | following scan | idle scan | catch-up runs/s (peak RSS MB) | fresh process RSS MB, CPU % |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let pp = |(a, b): (f64, f64)| format!("{a:.2} / {b:.2}");
    for r in &rows {
        println!(
            "| {} | {:.1?} | {} | {} | {} | {} | {:.2?} ({} runs) | {:.2?} ({} runs) | {:.2?} ({} runs) | {:.0} ({:.1}) | {:.1}, {:.2} |",
            r.runs,
            r.fill,
            pp(r.compact),
            pp(r.old),
            pp(r.spread),
            pp(r.waiting),
            r.first_scan.0,
            r.first_scan.1,
            r.next_scan.0,
            r.next_scan.1,
            r.idle_scan.0,
            r.idle_scan.1,
            r.catch_up.0 as f64 / r.catch_up.1.as_secs_f64(),
            r.catch_up.2 as f64 / 1024.0,
            r.held_rss_kb as f64 / 1024.0,
            r.held_cpu,
        );
    }
    drop(server);
}
