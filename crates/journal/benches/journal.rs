//! Latency of the journal's operations against a real nats-server spawned for the run.
//!
//! ```text
//! cargo bench -p kedge-journal --bench journal                       # default fsync policy
//! cargo bench -p kedge-journal --bench journal -- --sync-always      # sync_interval: always
//! cargo bench -p kedge-journal --bench journal -- --iters 500
//! cargo bench -p kedge-journal --bench journal -- --history 1000,10000,100000   # reads vs history
//! ```
//!
//! Prints p50/p99 per operation. One client, one request in flight: these are latencies, not
//! throughput.
//!
//! `--history LEVELS` measures instead what reading one run costs as the stream fills up with
//! other runs; see [`history`]. Its table adds the CPU each read
//! cost this process and the nats-server (from /proc, per read over the line's reads): on a
//! shared host the latency moves with other work, the CPU much less.

#![allow(clippy::unwrap_used)]

/// The allocator the `kedge` binary runs with (its main.rs): a read costs here what it costs there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::{Duration, Instant};

use futures::StreamExt;
use kedge_core::event::{
    AssistantMessage, Digest, FinishReason, RunStarted, StepCompleted, Timestamp, ToolRequested,
    Usage, UserMessage,
};
use kedge_core::ids::{DecisionSeq, InputId, ModelRequestId};
use kedge_core::{
    Attempt, Decision, DecisionEnvelope, Draft, Envelope, Input, InputEnvelope, OperationId, RunId,
    StepNo,
};
use kedge_journal::{Journal, LayoutOptions, Leases, RunCreator, ensure_layout};
use kedge_testkit::{NatsServer, ServerOptions};

struct Args {
    iters: usize,
    sync_always: bool,
    /// `--history`: cumulative numbers of runs in the stream to measure reads at.
    history: Vec<usize>,
    /// `--filler-events`: events per filler run in `--history` mode.
    filler_events: usize,
    /// `--reads`: reads measured per kind and level in `--history` mode.
    reads: usize,
}

fn args() -> Args {
    let mut out = Args {
        iters: 2000,
        sync_always: false,
        history: Vec::new(),
        filler_events: 5,
        reads: 400,
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
            "--history" => {
                out.history = it
                    .next()
                    .map(|l| l.split(',').map(|n| n.trim().parse().unwrap()).collect())
                    .expect("--history takes levels, e.g. 1000,10000,100000")
            }
            "--filler-events" => {
                out.filler_events = it
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("--filler-events takes a number")
            }
            "--reads" => {
                out.reads = it
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("--reads takes a number")
            }
            // `cargo bench` passes `--bench`; ignore it and anything else.
            _ => {}
        }
    }
    out
}

fn decision_env(run: &RunId, draft: Draft<Decision>) -> DecisionEnvelope {
    DecisionEnvelope::new(run.clone(), Timestamp::now(), draft)
}

fn input_env(run: &RunId, draft: Draft<Input>) -> InputEnvelope {
    InputEnvelope::new(run.clone(), Timestamp::now(), draft)
}

fn decision(run: &RunId) -> DecisionEnvelope {
    decision_env(run, Draft::new(Decision::RunStarted(RunStarted {})))
}

fn group(run: &RunId, step: u32) -> Vec<DecisionEnvelope> {
    let mut g = vec![decision_env(
        run,
        Draft::new(Decision::StepCompleted(StepCompleted {
            request_id: ModelRequestId::new(run, StepNo(step), Attempt(1)),
            message: AssistantMessage {
                text: "I will look this up in three places.".into(),
                tool_calls: vec![],
                thinking: Vec::new(),
            },
            usage: Usage {
                input_tokens: 1200,
                output_tokens: 80,
                cost: None,
            },
            finish: FinishReason::ToolCalls,
            reused: false,
            follows: None,
            model: None,
        }))
        .step(StepNo(step)),
    )];
    for i in 0..3 {
        let arguments = serde_json::json!({ "query": format!("query number {i}") });
        g.push(decision_env(
            run,
            Draft::new(Decision::ToolRequested(ToolRequested {
                call_id: format!("call_{i}"),
                tool: "search".into(),
                args_digest: Digest::of_json(&arguments),
                arguments,
                redispatch: 0,
                expect_version: None,
                limits: Default::default(),
                reversibility: None,
                compensates: None,
            }))
            .step(StepNo(step))
            .op(OperationId::new(run, StepNo(step), i)),
        ));
    }
    g
}

fn input(run: &RunId, i: usize) -> InputEnvelope {
    input_env(
        run,
        Draft::new(Input::UserMessage(UserMessage {
            text: format!("message {i}: please also check the other source"),
        })),
    )
}

#[derive(Default)]
struct Table(Vec<(String, Timed)>);

/// Latency samples, with the CPU each operation cost when it was measured.
struct Timed {
    samples: Vec<Duration>,
    /// Milliseconds of CPU per operation: this process, the nats-server.
    cpu: Option<(f64, f64)>,
}

impl From<Vec<Duration>> for Timed {
    fn from(samples: Vec<Duration>) -> Self {
        Self { samples, cpu: None }
    }
}

/// CPU time a process has spent so far, in ms: `None` off Linux.
fn cpu_ms(pid: &str) -> Option<f64> {
    kedge_testkit::cpu_ms(&format!("/proc/{pid}/stat"))
}

/// This process's and the nats-server's CPU so far.
fn cpu_now(server: Option<u32>) -> Option<(f64, f64)> {
    Some((cpu_ms("self")?, cpu_ms(&server?.to_string())?))
}

impl Table {
    fn add(&mut self, name: &str, timed: impl Into<Timed>) {
        let mut timed = timed.into();
        timed.samples.sort();
        eprintln!("  measured {name}");
        self.0.push((name.to_owned(), timed));
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
            "| {:<46} | {:>10} | {:>10} | {:>7} | {:>21} |",
            "operation", "p50", "p99", "n", "CPU ms/op: bench + server"
        );
        println!(
            "|{:-<48}|{:->12}|{:->12}|{:->9}|{:->23}|",
            "", "", "", "", ""
        );
        for (name, t) in &self.0 {
            let cpu = t
                .cpu
                .map(|(client, server)| format!("{client:.3} + {server:.3}"))
                .unwrap_or_default();
            println!(
                "| {:<46} | {:>10} | {:>10} | {:>7} | {:>21} |",
                name,
                fmt(pct(&t.samples, 0.50)),
                fmt(pct(&t.samples, 0.99)),
                t.samples.len(),
                cpu
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
    if args.history.is_empty() {
        rt.block_on(run(args));
    } else {
        rt.block_on(history(args));
    }
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
    let mut last = DecisionSeq::NONE;
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
            .last_decision();
        samples.push(t.elapsed());
    }
    table.add("decision append (1 event)", samples.split_off(20));

    // Decision group: step.completed + 3 tool.requested as one atomic batch.
    let run = RunId::generate();
    let mut last = DecisionSeq::NONE;
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
            .last_decision();
        samples.push(t.elapsed());
    }
    table.add("decision group 1+3 (atomic batch)", samples.split_off(20));

    // Input append with a fresh Msg-Id each time.
    let run = RunId::generate();
    let s = time(n, |i| {
        let journal = journal.clone();
        let e = input(&run, i);
        async move {
            journal
                .append_input(&InputId::arbitrary(format!("in-{i}")), &e)
                .await
                .unwrap();
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
            DecisionSeq::NONE,
            &[decision(&run)],
        )
        .await
        .unwrap()
        .last_decision();
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
                .last_decision();
            count += 4;
        } else {
            journal
                .append_input(
                    &InputId::arbitrary(format!("r50-{count}")),
                    &input(&run, count),
                )
                .await
                .unwrap();
            count += 1;
        }
        journal
            .append_input(
                &InputId::arbitrary(format!("noise-{count}")),
                &input(&noise, count),
            )
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
                .acquire(
                    &run,
                    &"bench".parse().expect("worker id"),
                    Duration::from_secs(30),
                )
                .await
                .unwrap();
        }
    })
    .await;
    table.add("lease acquire (KV, Nats-TTL + CAS)", s);

    let run = RunId::generate();
    let mut lease = leases
        .acquire(
            &run,
            &"bench".parse().expect("worker id"),
            Duration::from_secs(30),
        )
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

// ---------------------------------------------------------------------------------------------
// --history: what reading one run costs as the stream fills up with other runs.

/// Compact 50-event runs written at each level (after its filler runs, 10 at a time).
const COMPACT: usize = 20;
/// 50-event runs whose events are spread over each level's filler runs (a run that lived while
/// the level's runs came and went).
const SPREAD: usize = 4;
/// Filler runs written concurrently.
const FILL_WRITERS: usize = 64;

fn created(run: &RunId) -> DecisionEnvelope {
    decision_env(
        run,
        Draft::new(Decision::RunCreated(Box::new(
            kedge_core::event::RunCreated {
                caller: Some("bench".into()),
                runtime_version: "bench".into(),
                ..kedge_testkit::fixtures::run_created("bench", "look this up")
            },
        ))),
    )
}

/// Writes a run one event at a time, as the services would: `run.created`, then decisions and
/// inputs in a fixed rotation (each decision checked against the one before).
struct Writer {
    run: RunId,
    last_decision: DecisionSeq,
    written: usize,
}

impl Writer {
    fn new() -> Self {
        Self {
            run: RunId::generate(),
            last_decision: DecisionSeq::NONE,
            written: 0,
        }
    }

    async fn next(&mut self, journal: &Journal) {
        let run = &self.run;
        let w = kedge_journal::DecisionWriter::unfenced(run, "bench");
        let step = (self.written / 5) as u32 + 1;
        let decision = match self.written {
            0 => {
                self.last_decision = journal
                    .create_run(&RunCreator::intake(), &created(run))
                    .await
                    .unwrap()
                    .last_decision();
                self.written += 1;
                return;
            }
            1 => Some(decision(run)),
            // From the third event on: user.message (input), step.completed, tool.requested
            // ×2, user.message, … (a 5-event run has 5 subjects, like a short real one).
            n => match n % 5 {
                3 => Some(group(run, step).swap_remove(0)),
                4 => Some(group(run, step).swap_remove(1)),
                0 => Some(group(run, step).swap_remove(2)),
                _ => None,
            },
        };
        match decision {
            Some(d) => {
                self.last_decision = journal
                    .append_decisions(&w, self.last_decision, &[d])
                    .await
                    .unwrap()
                    .last_decision();
            }
            None => {
                journal
                    .append_input(
                        &InputId::arbitrary(format!("h-{run}-{}", self.written)),
                        &input(run, self.written),
                    )
                    .await
                    .unwrap();
            }
        }
        self.written += 1;
    }
}

/// Writes `count` filler runs of `events` events each, `FILL_WRITERS` at a time.
async fn fill(journal: &Journal, count: usize, events: usize) {
    futures::stream::iter(0..count)
        .map(|_| {
            let journal = journal.clone();
            async move {
                let mut w = Writer::new();
                for _ in 0..events {
                    w.next(&journal).await;
                }
            }
        })
        .buffer_unordered(FILL_WRITERS)
        .collect::<Vec<()>>()
        .await;
}

/// The read path of the previous commit (kept here as the baseline, spoken on the wire): every
/// read by the wildcard `agent.run.<id>.>`. A leader `last_by_subj` beside a probe of one
/// message (its end of batch says how many follow), then exactly that many from sequence 1, 256
/// per page. Returns the number of messages read.
async fn wildcard_read(raw: &RawReader, run: &RunId) -> usize {
    let filter = format!("agent.run.{run}.>");
    let leader = raw.client.request(
        "$JS.API.STREAM.MSG.GET.KEDGE_RUNS",
        serde_json::json!({ "last_by_subj": filter })
            .to_string()
            .into(),
    );
    let (leader, probe) = futures::join!(leader, raw.batch(&filter, 1, 1));
    let leader: serde_json::Value = serde_json::from_slice(&leader.unwrap().payload).unwrap();
    let last = leader["message"]["seq"].as_u64().unwrap();
    let (mut page, mut pending) = probe;
    if pending > 0 && pending < 256 {
        // From sequence 1 again: what is pending from there comes from the subject index.
        (page, pending) = raw.batch(&filter, 1, 1 + pending as usize).await;
    }
    let mut got = 0;
    let mut reached = 0;
    loop {
        for (seq, payload) in &page {
            if *seq <= reached {
                continue;
            }
            let _ = Envelope::from_json_bytes(payload).unwrap();
            reached = *seq;
            got += 1;
        }
        if pending == 0 {
            assert!(reached >= last, "R1: the one server answers");
            return got;
        }
        (page, pending) = raw
            .batch(&filter, reached + 1, (pending as usize).min(256))
            .await;
    }
}

/// Batched direct gets over one reply subscription (as the journal does), one at a time.
struct RawReader {
    client: async_nats::Client,
    prefix: String,
    sub: tokio::sync::Mutex<(async_nats::Subscriber, u64)>,
}

impl RawReader {
    async fn new(client: &async_nats::Client) -> Self {
        let prefix = client.new_inbox();
        let sub = client.subscribe(format!("{prefix}.*")).await.unwrap();
        Self {
            client: client.clone(),
            prefix,
            sub: tokio::sync::Mutex::new((sub, 0)),
        }
    }

    /// A batched direct get: (sequence, payload) of each message, and the pending count at
    /// the end.
    async fn batch(
        &self,
        filter: &str,
        from: u64,
        batch: usize,
    ) -> (Vec<(u64, bytes::Bytes)>, u64) {
        let mut guard = self.sub.lock().await;
        let (sub, token) = &mut *guard;
        *token += 1;
        let reply = format!("{}.{token}", self.prefix);
        self.client
            .publish_with_reply(
                "$JS.API.DIRECT.GET.KEDGE_RUNS",
                reply.clone(),
                serde_json::json!({ "seq": from, "next_by_subj": filter, "batch": batch })
                    .to_string()
                    .into(),
            )
            .await
            .unwrap();
        let mut out = Vec::new();
        loop {
            let m = tokio::time::timeout(Duration::from_secs(10), sub.next())
                .await
                .unwrap()
                .unwrap();
            if m.subject.as_str() != reply {
                continue;
            }
            let header = |name: &str| {
                m.headers
                    .as_ref()
                    .and_then(|h| h.get(name))
                    .and_then(|v| v.as_str().parse::<u64>().ok())
            };
            match m.status.map(|s| s.as_u16()) {
                Some(204) => return (out, header("Nats-Num-Pending").unwrap_or(0)),
                Some(404) => return (out, 0),
                Some(other) => panic!("direct get status {other}"),
                None => out.push((header("Nats-Sequence").unwrap(), m.payload.clone())),
            }
        }
    }
}

/// Reads the run in pages of `page` events (as `/history` does, by sequence) and checks they
/// make up the whole read.
async fn check_pages(journal: &Journal, run: &RunId, page: usize) {
    let whole = journal.read(run, 0).await.unwrap();
    let mut paged = Vec::new();
    let mut after = 0;
    loop {
        let p = journal.read_at_most(run, after, page).await.unwrap();
        if let Some(last) = p.events.last() {
            after = last.seq;
        }
        paged.extend(p.events);
        if !p.more {
            break;
        }
    }
    assert_eq!(paged, whole);
}

/// Times `reads` calls of `f`, one at a time, cycling over `runs` (each called once first, not
/// timed), and the CPU they cost this process and the nats-server (`server`'s pid).
async fn time_reads<F, Fut>(server: Option<u32>, runs: &[RunId], reads: usize, mut f: F) -> Timed
where
    F: FnMut(RunId) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for run in runs {
        f(run.clone()).await;
    }
    let mut samples = Vec::with_capacity(reads);
    let before = cpu_now(server);
    for i in 0..reads {
        let run = runs[i % runs.len()].clone();
        let t = Instant::now();
        f(run).await;
        samples.push(t.elapsed());
    }
    let per = |a: f64, b: f64| (b - a) / reads.max(1) as f64;
    let cpu = before
        .zip(cpu_now(server))
        .map(|((c0, s0), (c1, s1))| (per(c0, c1), per(s0, s1)));
    Timed { samples, cpu }
}

/// `--history`: for each level N (cumulative), fills the stream with filler runs up to N runs
/// (`--filler-events` each, 5 by default), with `SPREAD` 50-event runs whose events are spread
/// over that fill and `COMPACT` 50-event runs written right after it; then times, one read at
/// a time and cycling over runs, reading a whole 50-event run: the ones just written ("recent"),
/// the first level's ("old"), the previous level's, and the spread ones — with `Journal::read` and with the read path
/// of the previous commit (`wildcard_read`: by the wildcard only), back to back on the same
/// runs; a spread run is also read in pages of 20 (`read_at_most`, as `/history` pages). Also
/// the cost of
/// `last_event` and of `run_ids` (every run: the reconciler's old scan).
async fn history(args: Args) {
    let server = NatsServer::start().await;
    let pid = server.pid();
    let client = server.client().await;
    let report = ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    let journal = Journal::new(client.clone());
    let raw = RawReader::new(&client).await;
    eprintln!(
        "nats-server {}, R1 file storage; levels {:?}, filler runs of {} events, {} reads per line",
        report.server_version, args.history, args.filler_events, args.reads
    );
    let mut table = Table::default();
    let mut total = 0;
    let mut old: Vec<RunId> = Vec::new();
    let mut previous: Vec<RunId> = Vec::new();
    let mut sleepers: Vec<RunId> = Vec::new();
    for &level in &args.history {
        assert!(level >= total, "levels must grow");
        let new_fillers = level - total - COMPACT - SPREAD;
        let t0 = Instant::now();
        // Spread runs: one event each after every 49th of the fill.
        let mut spread: Vec<Writer> = (0..SPREAD).map(|_| Writer::new()).collect();
        for chunk in 0..50 {
            for w in &mut spread {
                w.next(&journal).await;
            }
            if chunk < 49 {
                let n = new_fillers / 49 + usize::from(chunk < new_fillers % 49);
                fill(&journal, n, args.filler_events).await;
            }
        }
        // Compact runs: 50 events each, 10 runs written side by side.
        let compact: Vec<RunId> = futures::stream::iter(0..COMPACT)
            .map(|_| {
                let journal = journal.clone();
                async move {
                    let mut w = Writer::new();
                    for _ in 0..50 {
                        w.next(&journal).await;
                    }
                    w.run
                }
            })
            .buffer_unordered(10)
            .collect()
            .await;
        total = level;
        eprintln!("N={level}: wrote the level in {:.1?}", t0.elapsed());
        if old.is_empty() {
            old = compact.clone();
        }
        let mid = std::mem::replace(&mut previous, compact.clone());
        let spread: Vec<RunId> = spread.into_iter().map(|w| w.run).collect();
        for run in compact.iter().chain(&spread) {
            assert_eq!(journal.read(run, 0).await.unwrap().len(), 50);
            assert_eq!(wildcard_read(&raw, run).await, 50);
            check_pages(&journal, run, 7).await;
        }
        let mut kinds = vec![("recent", &compact), ("old", &old)];
        if !mid.is_empty() && mid != old {
            kinds.push(("previous level's", &mid));
        }
        kinds.push(("spread", &spread));
        for (kind, runs) in kinds {
            let s = time_reads(pid, runs, args.reads, |run| {
                let journal = journal.clone();
                async move {
                    assert_eq!(journal.read(&run, 0).await.unwrap().len(), 50);
                }
            })
            .await;
            table.add(&format!("N={level} read {kind} 50-event run"), s);
            let raw = &raw;
            let s = time_reads(pid, runs, args.reads, |run| async move {
                assert_eq!(wildcard_read(raw, &run).await, 50);
            })
            .await;
            table.add(&format!("N={level}   same, before (wildcard_read)"), s);
        }
        let s = time_reads(pid, &spread, args.reads / 4, |run| {
            let journal = journal.clone();
            async move {
                let mut after = 0;
                let mut n = 0;
                loop {
                    let p = journal.read_at_most(&run, after, 20).await.unwrap();
                    n += p.events.len();
                    after = p.events.last().map_or(after, |e| e.seq);
                    if !p.more {
                        break;
                    }
                }
                assert_eq!(n, 50);
            }
        })
        .await;
        table.add(&format!("N={level} read spread run in pages of 20"), s);
        let s = time_reads(pid, &compact, args.reads, |run| {
            let journal = journal.clone();
            async move {
                assert!(journal.last_event(&run).await.unwrap().is_some());
            }
        })
        .await;
        table.add(&format!("N={level} last_event (recent run)"), s);
        let s = time_reads(pid, &old, args.reads, |run| {
            let journal = journal.clone();
            async move {
                assert!(journal.last_event(&run).await.unwrap().is_some());
            }
        })
        .await;
        table.add(&format!("N={level} last_event (old run)"), s);
        let s = time_reads(pid, &old[..1], 3, |_| {
            let journal = journal.clone();
            async move {
                assert_eq!(journal.run_ids().await.unwrap().len(), level);
            }
        })
        .await;
        table.add(&format!("N={level} run_ids (every run)"), s);
        // A run woken long after its last event (a timer, an answer): the step service reads
        // from its cached fold (the run's last event) through the wake. The first level's
        // spread runs (read no more as 50-event runs), each woken once per level.
        if sleepers.is_empty() {
            sleepers = spread.clone();
        }
        let mut woken = std::collections::HashMap::new();
        for run in &sleepers {
            let last = journal.last_seq(run).await.unwrap().unwrap_or(0);
            let wake = journal
                .append_input(
                    &InputId::arbitrary(format!("wake-{level}-{run}")),
                    &input(run, level),
                )
                .await
                .unwrap()
                .seq;
            woken.insert(run.clone(), (last, wake));
        }
        let woken = &woken;
        let s = time_reads(pid, &sleepers, args.reads, |run| {
            let journal = journal.clone();
            async move {
                let (after, wake) = woken[&run];
                let page = journal.read_through(&run, after, wake).await.unwrap();
                assert_eq!(page.events.len(), 1);
            }
        })
        .await;
        table.add(
            &format!("N={level} wake of an old run: read_through its fold"),
            s,
        );
        let s = time_reads(pid, &sleepers, args.reads, |run| {
            let journal = journal.clone();
            async move {
                let (after, _) = woken[&run];
                let page = journal.read_with_set_aside(&run, after).await.unwrap();
                assert_eq!(page.events.len(), 1);
            }
        })
        .await;
        table.add(&format!("N={level}   same, by the probe (read after)"), s);
    }
    println!();
    println!(
        "kedge-journal history bench: nats-server {}, R1 file storage, filler runs of {} events",
        report.server_version, args.filler_events
    );
    table.print();
    drop(server);
}
