//! The agent loop end to end: per-action overhead, run latency, throughput, and where a step's
//! time goes.
//!
//! ```text
//! cargo bench -p kedge --bench agent_loop                          # both durability settings
//! cargo bench -p kedge --bench agent_loop -- --quick               # fewer runs and iterations
//! cargo bench -p kedge --bench agent_loop -- --runs 20 --default-only
//! cargo bench -p kedge --bench agent_loop -- --sync-always-only --no-trace
//! cargo bench -p kedge --bench agent_loop -- --tls-compare         # plain TCP vs TLS, same run
//! cargo bench -p kedge --bench agent_loop -- --tls-compare --tls-reps 6 --runs 20
//! cargo bench -p kedge --bench agent_loop -- --json FILE         # also write the key figures as JSON
//! cargo bench -p kedge --bench agent_loop -- --sustain 15        # closed-loop window, s (0: none)
//! cargo bench -p kedge --bench agent_loop -- --cluster           # a 3-node cluster, R3 streams
//! cargo bench -p kedge --bench agent_loop -- --no-park           # leases released after every drive
//! cargo bench -p kedge --bench agent_loop -- --with-projector    # the projector runs too (serve all)
//! scripts/bench-vs-restate.sh [--quick]         # Restate first, then this bench: one table, ratios
//! ```
//!
//! **Side by side with Restate**: `scripts/bench-vs-restate.sh` runs the Restate peer (not part of
//! this repository: the directory `RESTATE_PEER_SRC` names, which the script requires unless
//! `--kedge-only`; installed once from the npm registry into `.tools/restate-peer/`; see
//! docs/PERFORMANCE.md, "Kedge next to Restate") right before this bench, in the same sitting, then
//! prints one table — Restate, Kedge with default sync, Kedge with `sync_interval: always` — of
//! action p50/p99, run p50, actions/s at 64 runs and CPU ms per action, with the ratios Kedge /
//! Restate and the goals marked met or not, and beside it the per-action bill (broker operations by
//! kind from the wiretap, CPU split by process). It reads this bench's `--json` file. Without node,
//! npm or root (the peer runs in a private network namespace) it prints Kedge alone and says why.
//!
//! Workload (the one the peers were measured on): K = 20 iterations of one model call (mock, zero
//! latency) then one `ledger_append` tool call — 40 journaled actions per run — then a final text
//! answer. Everything runs here: a nats-server of its own (kedge-testkit), the strict mock model,
//! and intake + step + tool in this process (as the end-to-end tests run them), each service on
//! its own connection. The projector (the runs list's cache, `kedge_runs`) does not run unless
//! `--with-projector` is given: the Restate peer keeps no such list.
//!
//! Throughput two ways: batches of 1, 16 and 64 runs submitted at once, timed until the last one
//! ends (latency under load; a batch's ramp-up and tail run with fewer runs in flight), and a
//! **closed loop** of 64 runs always in flight (each loop submits its next run when its last one
//! ends), counted over a window after a ramp (`--sustain`, default 10 s, 6 s with `--quick`):
//! what the Restate peer's throughput mode measures, and the "actions/s at 64 runs" of the
//! comparison. Its actions are counted by the ledger (two per line: the model call that asked for
//! the tool and the tool call).
//!
//! Timing sources:
//! - **journal stamps** (`envelope.at`, set by the writer just before it appends) define the
//!   actions: a model action runs from the event that woke the step (`run.created` / the previous
//!   `tool.result`) to its `step.completed`; a tool action from the end of the step's decision
//!   group (its `run.waiting` in a run from before gate `wait_from_step_group`, else its last
//!   decision: the group journals no `run.waiting`) to its `tool.result`.
//! - **stored stamps** (the server's `Nats-Time-Stamp` of each message, read back by direct get)
//!   split each loop iteration into segments: append latencies (stamp → stored) and the gaps
//!   between them (consumer wake, lease, reads, model call, KV records).
//! - **client clock**: submit → terminal event seen by an ordered consumer (what a watcher sees).
//! - **a wiretap** (one core subscription on `>`, only during one extra traced run) counts the
//!   broker operations per action and times each request → reply as the server answered it.
//! - **op costs**: the same public APIs the services call (leases, journal, idempotency KV),
//!   timed in a loop on the same server, one request in flight.
//! - **CPU**: utime+stime of nats-server and of this process per phase, from /proc; the mock
//!   model serves on a thread of its own, whose CPU is printed apart and left out of the
//!   process's (a model's work: the Restate peer's `llm` step is a canned answer).
//!
//! `--tls-compare` measures the cost of TLS instead: two environments side by side, one
//! over plain TCP and one where every Kedge connection (runtime, services, watcher) speaks TLS
//! with a client certificate to a server that verifies it (a CA and both certificates generated
//! here with rcgen, as kedge-runtime's connect tests do). The same sequential runs and
//! concurrency rounds alternate between the two, plain/tls then tls/plain (ABBA, so a drifting
//! machine load falls on both alike), and the figures are printed side by side with the ratio
//! TLS / plain. One durability setting: default sync unless `--sync-always-only`; no wiretap,
//! no op costs. Measured once (2 cores, load average ~3, default sync, `--tls-reps 12 --runs 30`):
//! TLS 1.3 adds ~0.11 ms to an action's p50 (1.43 -> 1.54 ms, x1.08), ~4 ms to a 40-action run
//! (x1.07), ~9% CPU per action on both sides, and takes 5-8% off throughput (paired medians
//! 0.92 sequential, 0.93 / 0.95 / 0.94 at 1 / 16 / 64 runs at once).
//!
//! Not a pass/fail test: it prints numbers. It does check that every run succeeded, that the
//! model was called exactly once per step, and that the ledger has one line per operation.

#![allow(clippy::unwrap_used)]

/// The allocator the `kedge` binary runs with (its main.rs): the services run in this process.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::DeliverPolicy;
use futures::StreamExt;
use kedge_core::agent::AgentDefinition;
use kedge_core::decide::{Next, decide};
use kedge_core::event::{Digest, Envelope, Event, EventType, Timestamp};
use kedge_core::ids::{ModelRequestId, OperationId, RunId};
use kedge_core::task::TaskSubmission;
use kedge_core::{Attempt, RunStatus, StepNo};
use kedge_journal::Recorded;
use kedge_mock_llm::{MockHandle, Scripts};
use kedge_runtime::idempotency::{Claim, StoredResponse};
use kedge_runtime::{Config, Runtime};
use kedge_testkit::{NatsCluster, NatsServer, ServerOptions};
use time::OffsetDateTime;

const K: usize = 20;
const ACTIONS: usize = 2 * K;
const AGENT: &str = "bench";
const MODEL: &str = "bench";
const API_KEY_VAR: &str = "KEDGE_BENCH_API_KEY";
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------------------------
// Options

#[derive(Debug, Clone)]
struct Opts {
    runs: usize,
    micro_iters: usize,
    concurrency: Vec<usize>,
    default_mode: bool,
    always_mode: bool,
    trace: bool,
    /// `--tls-compare`: plain vs TLS instead of the full report.
    tls_compare: bool,
    /// `--tls-reps`: repetitions of each variant's measurements in the TLS comparison.
    tls_reps: usize,
    /// `--json FILE`: also write the report's key figures to FILE as JSON (for
    /// `scripts/bench-vs-restate.sh`); not with `--tls-compare`.
    json: Option<std::path::PathBuf>,
    /// `--sustain SECS`: the measured window of the closed-loop phase (64 runs always in
    /// flight, as the Restate peer's throughput mode); 0 skips it.
    sustain_s: f64,
    /// `--cluster`: a three-node cluster on this machine, streams and buckets with three
    /// replicas (every write a RAFT proposal), instead of one server; "server" CPU is the
    /// three nodes'.
    cluster: bool,
    /// `--no-park`: the step releases a run's lease after every drive (`park_leases: false`),
    /// for an A/B of parking in one build.
    no_park: bool,
    /// `--with-projector`: the projector runs beside intake, step and tool (as in `kedge serve
    /// all`), keeping `kedge_runs` in step with every decision; without it the runs list is
    /// not kept, as the Restate peer keeps none.
    projector: bool,
}

fn opts() -> Opts {
    let mut o = Opts {
        runs: 10,
        micro_iters: 400,
        concurrency: vec![1, 16, 64],
        default_mode: true,
        always_mode: true,
        trace: true,
        tls_compare: false,
        tls_reps: 4,
        json: None,
        sustain_s: 10.0,
        cluster: false,
        no_park: false,
        projector: false,
    };
    let mut runs: Option<usize> = None;
    let mut sustain: Option<f64> = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--runs" => runs = it.next().and_then(|n| n.parse().ok()),
            "--quick" => {
                o.runs = 4;
                o.micro_iters = 150;
                sustain.get_or_insert(6.0);
            }
            "--sustain" => {
                sustain = Some(
                    it.next()
                        .and_then(|n| n.parse::<f64>().ok())
                        .filter(|s| s.is_finite() && *s >= 0.0)
                        .expect("--sustain takes a number of seconds"),
                )
            }
            "--micro-iters" => {
                o.micro_iters = it
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("--micro-iters takes a number")
            }
            "--sync-always-only" => o.default_mode = false,
            "--default-only" => o.always_mode = false,
            "--no-trace" => o.trace = false,
            "--tls-compare" => o.tls_compare = true,
            "--tls-reps" => {
                o.tls_reps = it
                    .next()
                    .and_then(|n| n.parse::<usize>().ok())
                    .expect("--tls-reps takes a number")
                    .max(1)
            }
            "--json" => o.json = Some(it.next().expect("--json takes a file name").into()),
            "--cluster" => o.cluster = true,
            "--no-park" => o.no_park = true,
            "--with-projector" => o.projector = true,
            // `cargo bench` passes `--bench`; ignore it and anything else.
            _ => {}
        }
    }
    if let Some(r) = runs {
        o.runs = r.max(1);
    }
    if let Some(s) = sustain {
        o.sustain_s = s;
    }
    o
}

// ---------------------------------------------------------------------------------------------
// Statistics

#[derive(Debug, Clone, Copy, Default)]
struct Stats {
    n: usize,
    p50: f64,
    p99: f64,
    mean: f64,
    max: f64,
}

fn stats(values: &[f64]) -> Stats {
    if values.is_empty() {
        return Stats::default();
    }
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let pick = |p: f64| {
        let idx = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[idx]
    };
    Stats {
        n: v.len(),
        p50: pick(0.50),
        p99: pick(0.99),
        mean: v.iter().sum::<f64>() / v.len() as f64,
        max: v[v.len() - 1],
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn dt_ms(later: OffsetDateTime, earlier: OffsetDateTime) -> f64 {
    (later - earlier).as_seconds_f64() * 1e3
}

// ---------------------------------------------------------------------------------------------
// CPU accounting (/proc/<pid>/stat, utime + stime, in clock ticks)

/// Milliseconds per clock tick.
fn tick_ms() -> f64 {
    1e3 / kedge_testkit::clock_ticks()
}

fn cpu_ticks(pid: u32) -> Option<u64> {
    kedge_testkit::cpu_ticks(&format!("/proc/{pid}/stat"))
}

/// The threads serving the mock model ([`start_mock`]): their CPU is the model's, counted
/// apart from the runtime's (the Restate peer's `llm` step is a canned answer in its own process).
static MOCK_THREADS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn thread_ticks(tid: u32) -> Option<u64> {
    kedge_testkit::cpu_ticks(&format!("/proc/self/task/{tid}/stat"))
}

fn mock_ticks() -> u64 {
    MOCK_THREADS
        .lock()
        .unwrap()
        .iter()
        .filter_map(|&tid| thread_ticks(tid))
        .sum()
}

/// Serves the mock model on a thread of its own (a single-threaded runtime that lives as long
/// as the process), so that [`cpu_since`] leaves its CPU out of the runtime's.
fn start_mock(scripts: Scripts) -> MockHandle {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("mock-model".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("mock runtime");
            rt.block_on(async move {
                let handle = MockHandle::start(scripts).await;
                let tid = std::fs::read_link("/proc/thread-self")
                    .ok()
                    .and_then(|p| p.file_name()?.to_str()?.parse::<u32>().ok());
                let _ = tx.send((handle, tid));
                std::future::pending::<()>().await
            })
        })
        .expect("mock thread");
    let (handle, tid) = rx.recv().expect("mock model started");
    if let Some(tid) = tid {
        MOCK_THREADS.lock().unwrap().push(tid);
    }
    handle
}

#[derive(Clone, Copy)]
struct CpuMark {
    server: u64,
    me: u64,
    mock: u64,
}

fn cpu_mark(server_pids: &[u32]) -> CpuMark {
    CpuMark {
        server: server_pids.iter().filter_map(|p| cpu_ticks(*p)).sum(),
        me: cpu_ticks(std::process::id()).unwrap_or(0),
        mock: mock_ticks(),
    }
}

/// CPU milliseconds (server, this process without the mock model's thread) since `from`.
fn cpu_since(from: CpuMark, server_pids: &[u32]) -> (f64, f64) {
    let now = cpu_mark(server_pids);
    let me = now.me.saturating_sub(from.me);
    let mock = now.mock.saturating_sub(from.mock);
    (
        (now.server.saturating_sub(from.server)) as f64 * tick_ms(),
        me.saturating_sub(mock) as f64 * tick_ms(),
    )
}

/// CPU milliseconds of the mock model's thread since `from`.
fn mock_cpu_since(from: CpuMark) -> f64 {
    mock_ticks().saturating_sub(from.mock) as f64 * tick_ms()
}

// ---------------------------------------------------------------------------------------------
// The environment of one durability setting

fn agent_definition(base_url: &str) -> AgentDefinition {
    let tool = |n: &str| {
        serde_json::json!({"name": n, "description": n,
                           "parameters": {"type": "object", "properties": {}}})
    };
    let tools: Vec<serde_json::Value> = [
        "read_file",
        "write_file",
        "list_files",
        "shell",
        "ask_user",
        "ledger_append",
    ]
    .iter()
    .map(|n| tool(n))
    .collect();
    let v = serde_json::json!({
        "name": AGENT,
        "system_prompt": "bench agent",
        "model": {"provider": "openai", "name": MODEL, "base_url": format!("{base_url}/v1")},
        "api_key_env": API_KEY_VAR,
        "tools": tools,
        "budget": {"max_steps": 25, "max_tokens": 10000000, "max_attempts_per_step": 3}
    });
    AgentDefinition::parse(v.to_string().as_bytes()).expect("valid bench agent")
}

fn script() -> serde_json::Value {
    let mut steps: Vec<serde_json::Value> = (1..=K)
        .map(|i| {
            serde_json::json!({"text": format!("step {i}"), "tool_calls": [
                {"name": "ledger_append", "arguments": {"text": format!("{i}")}}]})
        })
        .collect();
    steps.push(serde_json::json!({"text": "done"}));
    serde_json::json!({"models": {MODEL: {"steps": steps}}})
}

/// One concurrency round: (runs, elapsed ms, actions/s, what was collected, CPU ms/action of
/// the server and of this process).
type ConcRound = (usize, f64, f64, Collected, (f64, f64));

/// Like the test harness's `fast_config` (short timeouts), concurrency at the defaults.
fn bench_config(nats_url: &str, workspace: &Path, worker: &str) -> Config {
    let mut config = Config {
        nats_urls: vec![nats_url.to_owned()],
        workspace_root: workspace.to_owned(),
        worker_id: worker.to_owned(),
        ..Config::default()
    };
    config
        .api_keys
        .insert(API_KEY_VAR.into(), "bench-key".into());
    config.ledger_tool = true;
    let t = &mut config.timeouts;
    t.lease_ttl_ms = 2_000;
    t.lease_renew_ms = 500;
    t.step_ack_wait_ms = 3_000;
    t.model_timeout_ms = 10_000;
    t.tool_timeout_ms = 1_000;
    t.tool_grace_ms = 500;
    t.tool_ack_wait_ms = 2_000;
    t.stall_after_ms = 10_000;
    t.max_retry_delay_ms = 500;
    config.check().expect("valid bench config");
    config
}

/// Terminal events as a watching client sees them: one ordered consumer over every run's
/// terminal decision subjects.
#[derive(Default)]
struct Terminals {
    slots: Mutex<HashMap<String, Slot>>,
}

enum Slot {
    Waiting(tokio::sync::oneshot::Sender<(Instant, String)>),
    Done(Instant, String),
}

impl Terminals {
    fn register(&self, run: &RunId) -> tokio::sync::oneshot::Receiver<(Instant, String)> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut slots = self.slots.lock().unwrap();
        match slots.remove(run.as_str()) {
            Some(Slot::Done(at, ty)) => {
                let _ = tx.send((at, ty));
            }
            _ => {
                slots.insert(run.as_str().to_owned(), Slot::Waiting(tx));
            }
        }
        rx
    }

    fn seen(&self, run: &str, ty: &str, at: Instant) {
        let mut slots = self.slots.lock().unwrap();
        match slots.remove(run) {
            Some(Slot::Waiting(tx)) => {
                let _ = tx.send((at, ty.to_owned()));
            }
            _ => {
                slots.insert(run.to_owned(), Slot::Done(at, ty.to_owned()));
            }
        }
    }
}

/// The broker of one environment: one server, or a three-node cluster (`--cluster`).
enum Broker {
    Single(Box<NatsServer>),
    Cluster(NatsCluster),
}

impl Broker {
    fn urls(&self) -> Vec<String> {
        match self {
            Broker::Single(s) => vec![s.url()],
            Broker::Cluster(c) => c.urls(),
        }
    }

    fn pids(&self) -> Vec<u32> {
        match self {
            Broker::Single(s) => s.pid().into_iter().collect(),
            Broker::Cluster(c) => (0..NatsCluster::SIZE).filter_map(|n| c.pid(n)).collect(),
        }
    }
}

struct Env {
    nats: Broker,
    mock: MockHandle,
    _dir: tempfile::TempDir,
    config: Config,
    rt: Runtime,
    terminals: Arc<Terminals>,
    stop: tokio::sync::broadcast::Sender<()>,
    services: Vec<tokio::task::JoinHandle<()>>,
    watcher: tokio::task::JoinHandle<()>,
    submitted: usize,
}

impl Env {
    /// With `tls`, the server offers TLS and verifies client certificates, and every Kedge
    /// connection requires TLS (CA + client certificate); `extra_config` is appended to the
    /// server's configuration.
    async fn start(
        sync_always: bool,
        tls: Option<&Pki>,
        extra_config: &str,
        cluster: bool,
        park: bool,
        projector: bool,
    ) -> Env {
        let mut server_config = extra_config.to_owned();
        if let Some(pki) = tls {
            server_config.push_str(&pki.server_config());
        }
        let options = ServerOptions {
            sync_always,
            extra_config: server_config,
            ..Default::default()
        };
        let nats = if cluster {
            Broker::Cluster(NatsCluster::start_with(options).await)
        } else {
            Broker::Single(Box::new(NatsServer::start_with(options).await))
        };
        let mock = start_mock(Scripts::from_value(script()).expect("valid script"));
        let dir = tempfile::tempdir().expect("temp dir");
        let urls = nats.urls();
        let mut config = bench_config(&urls[0], &dir.path().join("ws"), "w-bench");
        if cluster {
            config.nats_urls = urls;
            config.replicas = 3;
            config.check().expect("valid cluster bench config");
        }
        config.park_leases = park;
        if let Some(pki) = tls {
            config.nats.tls_ca = Some(pki.ca.clone());
            config.nats.tls_cert = Some(pki.client_cert.clone());
            config.nats.tls_key = Some(pki.client_key.clone());
            config.check().expect("valid TLS bench config");
        }
        let rt = Runtime::connect(config.clone()).await.expect("runtime");
        rt.agents
            .put(&agent_definition(&mock.base_url()))
            .await
            .expect("agent stored");
        let (stop, _) = tokio::sync::broadcast::channel(1);
        let mut services = Vec::new();
        let services_run = [
            ("intake", "w-intake"),
            ("step", "w-step"),
            ("tool", "w-tool"),
            ("projector", "w-projector"),
        ];
        for (svc, worker) in services_run
            .into_iter()
            .filter(|(svc, _)| projector || *svc != "projector")
        {
            let mut c = config.clone();
            c.worker_id = worker.to_owned();
            let mut rx = stop.subscribe();
            services.push(tokio::spawn(async move {
                let rt = Runtime::connect(c).await.expect("service runtime");
                let stop = async move {
                    let _ = rx.recv().await;
                };
                let result = match svc {
                    "intake" => kedge_intake::run(rt, stop).await,
                    "step" => kedge_step::run(rt, stop).await,
                    "projector" => kedge_bridge::projection::run_projector(rt, stop).await,
                    _ => kedge_tool::run(rt, stop).await,
                };
                if let Err(e) = result {
                    panic!("{svc} service failed: {e}");
                }
            }));
        }
        let terminals = Arc::new(Terminals::default());
        let stream = rt.js.get_stream("KEDGE_RUNS").await.expect("KEDGE_RUNS");
        let consumer = stream
            .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
                filter_subjects: vec![
                    "agent.run.*.d.run.succeeded".into(),
                    "agent.run.*.d.run.failed".into(),
                    "agent.run.*.d.run.cancelled".into(),
                ],
                deliver_policy: DeliverPolicy::New,
                ..Default::default()
            })
            .await
            .expect("terminal watcher");
        let mut messages = consumer.messages().await.expect("terminal watcher stream");
        let t = terminals.clone();
        let watcher = tokio::spawn(async move {
            while let Some(m) = messages.next().await {
                let Ok(m) = m else { continue };
                let at = Instant::now();
                if let Some(p) = kedge_core::subjects::parse_event(&m.subject) {
                    t.seen(p.run_id.as_str(), p.event_type.as_str(), at);
                }
            }
        });
        Env {
            nats,
            mock,
            _dir: dir,
            config,
            rt,
            terminals,
            stop,
            services,
            watcher,
            submitted: 0,
        }
    }

    fn server_pids(&self) -> Vec<u32> {
        self.nats.pids()
    }

    /// Submits one run (the client picks its id) and waits for its terminal event.
    async fn run_one(&self, key: String) -> RunTiming {
        let run = RunId::generate();
        let rx = self.terminals.register(&run);
        let t0 = Instant::now();
        self.submit(&run, &key).await;
        let answered = Instant::now();
        let (at, ty) = tokio::time::timeout(RUN_TIMEOUT, rx)
            .await
            .unwrap_or_else(|_| panic!("run {run} not terminal after {RUN_TIMEOUT:?}"))
            .expect("terminal watcher alive");
        assert_eq!(ty, "run.succeeded", "run {run} ended {ty}");
        RunTiming {
            run,
            submit: ms(answered - t0),
            wall: ms(at - t0),
        }
    }

    async fn submit(&self, run: &RunId, key: &str) {
        let task = TaskSubmission {
            agent: AGENT.parse().expect("agent name"),
            input: "go".into(),
            run_id: Some(run.clone()),
            budget: None,
            metadata: Default::default(),
        };
        let submission = kedge_intake::Submission {
            task: &task,
            key,
            tenant: "bench",
            caller: Some("bench"),
        };
        match kedge_intake::submit(&self.rt.client, &submission, Duration::from_secs(30))
            .await
            .expect("intake answered")
        {
            kedge_intake::Answer::Accepted { run_id } => assert_eq!(&run_id, run),
            kedge_intake::Answer::Rejected { error } => panic!("rejected: {error:?}"),
        }
    }

    async fn stop_services(&mut self) {
        let _ = self.stop.send(());
        for s in self.services.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(10), s).await;
        }
    }

    async fn shutdown(mut self) {
        self.stop_services().await;
        self.watcher.abort();
        drop(self.mock);
        drop(self.nats);
    }
}

struct RunTiming {
    run: RunId,
    /// Submit → intake's answer, ms.
    submit: f64,
    /// Submit → terminal event seen, ms.
    wall: f64,
}

// ---------------------------------------------------------------------------------------------
// Reading a run back: events with their writer stamps and the server's stored stamps

struct Ev {
    ty: EventType,
    step: u32,
    at: OffsetDateTime,
    stored: OffsetDateTime,
}

/// The server's store time of every message of the run (batched direct get).
async fn stored_times(client: &async_nats::Client, run: &RunId) -> HashMap<u64, OffsetDateTime> {
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await.expect("subscribe");
    let body = serde_json::json!({"seq": 1, "next_by_subj": kedge_core::subjects::run_all(run),
                                  "batch": 1000});
    client
        .publish_with_reply(
            "$JS.API.DIRECT.GET.KEDGE_RUNS",
            inbox,
            body.to_string().into(),
        )
        .await
        .expect("direct get");
    let mut out = HashMap::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), sub.next())
            .await
            .expect("direct get answer")
            .expect("subscription open");
        if m.status.is_some() {
            break; // 204 end of batch (or 404)
        }
        let h = m.headers.as_ref().expect("direct get headers");
        let seq: u64 = h
            .get("Nats-Sequence")
            .and_then(|v| v.as_str().parse().ok())
            .expect("Nats-Sequence");
        let ts = h
            .get("Nats-Time-Stamp")
            .and_then(|v| {
                OffsetDateTime::parse(v.as_str(), &time::format_description::well_known::Rfc3339)
                    .ok()
            })
            .expect("Nats-Time-Stamp");
        out.insert(seq, ts);
    }
    out
}

async fn load_run(rt: &Runtime, run: &RunId) -> (Vec<Recorded>, Vec<Ev>) {
    let recorded = rt.journal.read(run, 0).await.expect("journal read");
    let stored = stored_times(&rt.client, run).await;
    let evs = recorded
        .iter()
        .map(|r| Ev {
            ty: r.envelope.event_type(),
            step: r.envelope.step.map_or(0, |s| s.get()),
            at: r.envelope.at.0,
            stored: *stored.get(&r.seq).expect("stored time of every event"),
        })
        .collect();
    (recorded, evs)
}

/// Per-run figures derived from the journal.
#[derive(Default)]
struct RunFigures {
    model_actions: Vec<f64>,
    tool_actions: Vec<f64>,
    /// run.created → run.succeeded (stamps), ms.
    journal_wall: f64,
    steps: u64,
    /// Segments of the steady-state loop iterations (steps 2..=K), by name.
    segments: BTreeMap<&'static str, Vec<f64>>,
}

const SEGMENTS: &[(&str, &str)] = &[
    (
        "1 wake->intent",
        "tool.result stored -> step.started stamped (step consumer wake, lease acquire, journal load, decide)",
    ),
    (
        "2 step.started append",
        "step.started stamp -> stored (1 decision)",
    ),
    (
        "3 model span",
        "step.started stored -> step.completed stamped (refresh read, model HTTP, KV put of the response)",
    ),
    (
        "4 group batch arrival",
        "step.completed stamp -> the group's last decision stored (step.completed + tool.requested, chained single appends)",
    ),
    (
        "5 commit+tool wake+claim",
        "group end stored -> tool.started stamped (tool consumer wake, op claim: KV create, cancel check)",
    ),
    ("6 tool.started append", "stamp -> stored (input)"),
    (
        "7 tool run+finish",
        "tool.started stored -> tool.result stamped (ledger append, KV update of the op record)",
    ),
    ("8 tool.result append", "stamp -> stored (input)"),
    ("= loop", "tool.result(k-1) stored -> tool.result(k) stored"),
];

fn figures(run: &RunId, recorded: &[Recorded], evs: &[Ev]) -> RunFigures {
    let state = kedge_core::fold(recorded.iter().map(|r| (r.seq, &r.envelope))).expect("folds");
    assert_eq!(
        state.status,
        RunStatus::Succeeded,
        "run {run}: {:?}",
        state.failure
    );
    let mut f = RunFigures {
        steps: u64::from(state.step.get()),
        ..Default::default()
    };
    let find = |ty: EventType, step: u32| evs.iter().find(|e| e.ty == ty && e.step == step);
    // Where a step's decision group ends: its `run.waiting`, or without one (gate
    // `wait_from_step_group`) its last decision before the step's first tool result.
    let group_end = |step: u32| {
        find(EventType::RunWaiting, step).or_else(|| {
            evs.iter()
                .filter(|e| e.step == step)
                .take_while(|e| e.ty != EventType::ToolStarted && e.ty != EventType::ToolResult)
                .filter(|e| e.ty.kind() == kedge_core::event::EventKind::Decision)
                .last()
        })
    };
    let created = evs
        .iter()
        .find(|e| e.ty == EventType::RunCreated)
        .expect("run.created");
    let succeeded = evs
        .iter()
        .find(|e| e.ty == EventType::RunSucceeded)
        .expect("run.succeeded");
    f.journal_wall = dt_ms(succeeded.at, created.at);
    let mut wake = created.at;
    for e in evs {
        match e.ty {
            EventType::StepCompleted => f.model_actions.push(dt_ms(e.at, wake)),
            EventType::ToolResult => {
                wake = e.at;
                let waiting = group_end(e.step).expect("the step's decision group");
                f.tool_actions.push(dt_ms(e.at, waiting.at));
            }
            _ => {}
        }
    }
    for k in 2..=K as u32 {
        let (Some(prev), Some(ss), Some(sc), Some(rw), Some(ts), Some(tr)) = (
            find(EventType::ToolResult, k - 1),
            find(EventType::StepStarted, k),
            find(EventType::StepCompleted, k),
            group_end(k),
            find(EventType::ToolStarted, k),
            find(EventType::ToolResult, k),
        ) else {
            continue;
        };
        let mut put = |name: &'static str, v: f64| f.segments.entry(name).or_default().push(v);
        put("1 wake->intent", dt_ms(ss.at, prev.stored));
        put("2 step.started append", dt_ms(ss.stored, ss.at));
        put("3 model span", dt_ms(sc.at, ss.stored));
        put("4 group batch arrival", dt_ms(rw.stored, sc.at));
        put("5 commit+tool wake+claim", dt_ms(ts.at, rw.stored));
        put("6 tool.started append", dt_ms(ts.stored, ts.at));
        put("7 tool run+finish", dt_ms(tr.at, ts.stored));
        put("8 tool.result append", dt_ms(tr.stored, tr.at));
        put("= loop", dt_ms(tr.stored, prev.stored));
    }
    f
}

#[derive(Default)]
struct Collected {
    model: Vec<f64>,
    tool: Vec<f64>,
    journal_wall: Vec<f64>,
    client_wall: Vec<f64>,
    submit: Vec<f64>,
    segments: BTreeMap<&'static str, Vec<f64>>,
    steps: u64,
    runs: usize,
}

impl Collected {
    fn add(&mut self, t: &RunTiming, f: RunFigures) {
        self.model.extend(&f.model_actions);
        self.tool.extend(&f.tool_actions);
        self.journal_wall.push(f.journal_wall);
        self.client_wall.push(t.wall);
        self.submit.push(t.submit);
        for (k, v) in f.segments {
            self.segments.entry(k).or_default().extend(v);
        }
        self.steps += f.steps;
        self.runs += 1;
    }

    fn actions(&self) -> Vec<f64> {
        let mut all = self.model.clone();
        all.extend(&self.tool);
        all
    }
}

async fn collect(env: &Env, timings: &[RunTiming], into: &mut Collected) {
    for t in timings {
        let (recorded, evs) = load_run(&env.rt, &t.run).await;
        let f = figures(&t.run, &recorded, &evs);
        into.add(t, f);
    }
}

// ---------------------------------------------------------------------------------------------
// The wiretap: every message through the server during one run

struct Tapped {
    t: Instant,
    subject: String,
    reply: Option<String>,
    batch_id: bool,
    batch_commit: bool,
    kv_op: Option<String>,
    expected_last: Option<String>,
    body: String,
}

async fn start_tap(
    url: &str,
) -> (
    async_nats::Client,
    Arc<Mutex<Vec<Tapped>>>,
    tokio::task::JoinHandle<()>,
) {
    let client = async_nats::ConnectOptions::new()
        .subscription_capacity(1 << 20)
        .connect(url)
        .await
        .expect("tap connects");
    let mut sub = client.subscribe(">").await.expect("tap subscribes");
    client.flush().await.expect("flush");
    let store: Arc<Mutex<Vec<Tapped>>> = Arc::default();
    let s = store.clone();
    let task = tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            let t = Instant::now();
            let h = m.headers.as_ref();
            let get = |k: &str| h.and_then(|h| h.get(k)).map(|v| v.as_str().to_owned());
            let rec = Tapped {
                t,
                subject: m.subject.to_string(),
                reply: m.reply.as_ref().map(|r| r.to_string()),
                batch_id: get("Nats-Batch-Id").is_some(),
                batch_commit: get("Nats-Batch-Commit").is_some(),
                kv_op: get("KV-Operation"),
                expected_last: get("Nats-Expected-Last-Subject-Sequence"),
                body: String::from_utf8_lossy(&m.payload[..m.payload.len().min(160)]).into_owned(),
            };
            s.lock().unwrap().push(rec);
        }
    });
    (client, store, task)
}

/// What a tapped message is, by subject and headers.
fn classify(m: &Tapped) -> String {
    let s = m.subject.as_str();
    if let Some(r) = &m.reply
        && let Some(rest) = r.strip_prefix("$JS.ACK.")
    {
        let mut parts = rest.split('.');
        let stream = parts.next().unwrap_or("?");
        let consumer = parts.next().unwrap_or("?");
        return format!("deliver {stream}/{consumer}");
    }
    if let Some(rest) = s.strip_prefix("$JS.ACK.") {
        let mut parts = rest.split('.');
        let stream = parts.next().unwrap_or("?");
        let consumer = parts.next().unwrap_or("?");
        return format!("ack {stream}/{consumer}");
    }
    if let Some(rest) = s.strip_prefix("$JS.API.CONSUMER.MSG.NEXT.") {
        let mut p = rest.split('.');
        let stream = p.next().unwrap_or("?");
        let consumer = p.next().unwrap_or("?");
        let consumer = if consumer.len() > 12 {
            "ordered"
        } else {
            consumer
        };
        return format!("pull request {stream}/{consumer}");
    }
    if let Some(rest) = s.strip_prefix("$JS.API.DIRECT.GET.") {
        let stream = rest.split('.').next().unwrap_or("?");
        let what = if m.body.contains("\"batch\"") {
            "batch"
        } else if m.body.contains("last_by_subj") || rest.contains('.') {
            "last"
        } else {
            "seq"
        };
        return format!("direct get {stream} ({what})");
    }
    if let Some(rest) = s.strip_prefix("$JS.API.STREAM.MSG.GET.") {
        return format!("leader get {rest}");
    }
    if s.starts_with("$JS.API.") {
        let t: Vec<&str> = s.split('.').take(4).collect();
        return format!("api {}", t.join("."));
    }
    if let Some(rest) = s.strip_prefix("$KV.kedge_leases.") {
        let _ = rest;
        return if m.kv_op.as_deref() == Some("DEL") {
            "lease release (KV CAS write)".into()
        } else if m.expected_last.is_some() {
            "lease acquire/renew (KV CAS write)".into()
        } else {
            "lease write".into()
        };
    }
    if let Some(rest) = s.strip_prefix("$KV.kedge_idempotency.") {
        return if rest.starts_with("model.") {
            "KV put model response".into()
        } else if m.expected_last.as_deref() == Some("0") {
            "KV create op record (claim)".into()
        } else if m.expected_last.is_some() {
            "KV update op record (finish)".into()
        } else {
            "KV put op record".into()
        };
    }
    if let Some(p) = kedge_core::subjects::parse_event(s) {
        let kind = match p.kind {
            kedge_core::EventKind::Decision => {
                if m.batch_commit {
                    "decision batch commit"
                } else if m.batch_id {
                    "decision batch part"
                } else {
                    "decision publish"
                }
            }
            kedge_core::EventKind::Input => "input publish",
        };
        return format!("{kind} {}", p.event_type);
    }
    if s.starts_with("agent.delta.") {
        return "delta (core)".into();
    }
    if s.starts_with("agent.task.") {
        return "task publish".into();
    }
    if s.starts_with("_INBOX.") {
        return "reply".into();
    }
    let t: Vec<&str> = s.split('.').take(2).collect();
    format!("other {}", t.join("."))
}

struct TapReport {
    /// category → (count, reply latencies in ms)
    ops: BTreeMap<String, (usize, Vec<f64>)>,
    timeline: Vec<String>,
}

fn analyze_tap(recs: &[Tapped], run: &RunId) -> TapReport {
    // Replies by inbox subject: first and last arrival.
    let mut replies: HashMap<&str, (Instant, Instant)> = HashMap::new();
    for m in recs {
        if m.subject.starts_with("_INBOX.") && m.reply.is_none() {
            let e = replies.entry(m.subject.as_str()).or_insert((m.t, m.t));
            e.1 = m.t;
        }
    }
    let run_prefix = format!("agent.run.{run}.");
    let mut ops: BTreeMap<String, (usize, Vec<f64>)> = BTreeMap::new();
    let mut lines: Vec<(Instant, String)> = Vec::new();
    for m in recs {
        let cat = classify(m);
        if cat == "reply" {
            continue;
        }
        // Only count what concerns the traced run or is run-agnostic (API, KV, consumers).
        if m.subject.starts_with("agent.run.") && !m.subject.starts_with(&run_prefix) {
            continue;
        }
        let lat = m
            .reply
            .as_deref()
            .filter(|r| r.starts_with("_INBOX."))
            .and_then(|r| replies.get(r))
            .map(|(first, last)| (ms(*first - m.t), ms(*last - m.t)));
        let e = ops.entry(cat.clone()).or_insert((0, Vec::new()));
        e.0 += 1;
        if let Some((_, last)) = lat {
            e.1.push(last);
        }
        let lat_s = match lat {
            Some((_, last)) => format!("  → reply after {last:6.3} ms"),
            None => String::new(),
        };
        lines.push((m.t, format!("{cat}{lat_s}")));
    }
    // Timeline of one steady-state loop: from the publish of tool.result of step 9 to that of
    // step 10 (the n-th tool.result input publish of the run).
    let tr_publishes: Vec<Instant> = recs
        .iter()
        .filter(|m| {
            m.subject.starts_with(&run_prefix)
                && m.subject.ends_with(".i.tool.result")
                && m.reply.as_deref().is_some_and(|r| r.starts_with("_INBOX."))
        })
        .map(|m| m.t)
        .collect();
    let mut timeline = Vec::new();
    if tr_publishes.len() >= 10 {
        let (from, to) = (tr_publishes[8], tr_publishes[9]);
        for (t, line) in lines.iter().filter(|(t, _)| *t >= from && *t <= to) {
            if line.starts_with("pull request") || line.contains("KEDGE_RUNS/ordered") {
                continue;
            }
            timeline.push(format!("+{:7.3} ms  {line}", ms(*t - from)));
        }
    }
    TapReport { ops, timeline }
}

// ---------------------------------------------------------------------------------------------
// Op costs: the public APIs the services call, one request in flight

async fn time_op<F, Fut>(n: usize, mut f: F) -> Stats
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    // A few warm-up calls.
    for i in 0..5.min(n) {
        f(n + i).await;
    }
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        f(i).await;
        v.push(ms(t.elapsed()));
    }
    stats(&v)
}

fn with_run(e: &Envelope, run: &RunId) -> Envelope {
    let mut e = e.clone();
    e.run_id = run.clone();
    e.at = Timestamp::now();
    e
}

/// A copy of the first `n` events of `src` under a new run id (raw publishes, for reading).
/// Decisions carry a writer's `Nats-Msg-Id` (readers set aside a decision without one).
async fn copy_run(rt: &Runtime, src: &[Recorded], n: usize) -> RunId {
    let run = RunId::generate();
    for (i, r) in src.iter().take(n).enumerate() {
        let e = with_run(&r.envelope, &run);
        let mut headers = async_nats::HeaderMap::new();
        if e.event_type().kind() == kedge_core::EventKind::Decision {
            headers.insert(
                "Nats-Msg-Id",
                kedge_journal::journal::decision_msg_id(&run, 0, i, "bench-copy").as_str(),
            );
        }
        rt.js
            .publish_with_headers(e.subject(), headers, e.to_json_bytes().into())
            .await
            .expect("publish")
            .await
            .expect("ack");
    }
    run
}

struct OpCost {
    name: &'static str,
    stats: Stats,
}

async fn op_costs(env: &Env, sample: &RunId, iters: usize) -> (Vec<OpCost>, usize) {
    let rt = &env.rt;
    let src = rt.journal.read(sample, 0).await.expect("sample run");
    let full_len = src.len();
    let by_type = |ty: EventType, step: u32| {
        src.iter()
            .find(|r| {
                r.envelope.event_type() == ty && r.envelope.step.map_or(0, |s| s.get()) == step
            })
            .map(|r| r.envelope.clone())
            .expect("sample event")
    };
    let created = src[0].envelope.clone();
    let step_started = by_type(EventType::StepStarted, 5);
    // The step group of a run from before gate `wait_from_step_group` (three decisions; a run
    // of this build journals two, no `run.waiting`): the appends below are timed on it.
    let step_completed = by_type(EventType::StepCompleted, 5);
    let waiting = src
        .iter()
        .find(|r| r.envelope.event_type() == EventType::RunWaiting)
        .map(|r| r.envelope.clone())
        .unwrap_or_else(|| {
            kedge_core::event::Envelope::new(
                step_completed.run_id.clone(),
                step_completed.at,
                kedge_core::event::Draft::new(Event::RunWaiting(kedge_core::event::RunWaiting {
                    on: kedge_core::event::WaitReason::Tool,
                }))
                .step(StepNo(5)),
            )
        });
    let group = [
        step_completed,
        by_type(EventType::ToolRequested, 5),
        waiting,
    ];
    let tool_result = by_type(EventType::ToolResult, 5);
    let mut out = Vec::new();
    let ttl = Duration::from_secs(2);

    // Baselines.
    out.push(OpCost {
        name: "core round trip (flush/PING)",
        stats: time_op(iters, |_| async {
            rt.client.flush().await.expect("flush");
        })
        .await,
    });
    out.push(OpCost {
        name: "js publish+ack 256 B (no headers)",
        stats: time_op(iters, |_| async {
            rt.js
                .publish("agent.run.run_benchraw.x.y", vec![b'x'; 256].into())
                .await
                .expect("publish")
                .await
                .expect("ack");
        })
        .await,
    });

    // Leases.
    let runs: Vec<RunId> = (0..iters + 10).map(|_| RunId::generate()).collect();
    let held: Arc<Mutex<HashMap<usize, kedge_journal::Lease>>> = Arc::default();
    out.push(OpCost {
        name: "lease acquire (direct get + CAS)",
        stats: time_op(iters, |i| {
            let runs = &runs;
            let held = held.clone();
            async move {
                let l = rt
                    .leases
                    .acquire(&runs[i % runs.len()], "w-bench", ttl)
                    .await
                    .expect("acquire");
                held.lock().unwrap().insert(i, l);
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "lease renew (CAS)",
        stats: time_op(iters, |i| {
            let held = held.clone();
            async move {
                let l = held.lock().unwrap().remove(&i);
                if let Some(l) = l {
                    let l = rt.leases.renew(&l).await.expect("renew");
                    held.lock().unwrap().insert(i, l);
                }
            }
        })
        .await,
    });
    let markers: Arc<Mutex<HashMap<usize, kedge_journal::Released>>> = Arc::default();
    out.push(OpCost {
        name: "lease release (CAS delete)",
        stats: time_op(iters, |i| {
            let held = held.clone();
            let markers = markers.clone();
            async move {
                let l = held.lock().unwrap().remove(&i);
                if let Some(l) = l {
                    let m = rt.leases.release(l).await.expect("release");
                    markers.lock().unwrap().insert(i, m);
                }
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "lease acquire_after (own release marker)",
        stats: time_op(iters, |i| {
            let runs = &runs;
            let markers = markers.clone();
            async move {
                let hint = markers.lock().unwrap().remove(&i);
                rt.leases
                    .acquire_after(&runs[i % runs.len()], "w-bench", ttl, hint)
                    .await
                    .expect("acquire");
            }
        })
        .await,
    });

    // Reads.
    let run60 = copy_run(rt, &src, 60).await;
    let run_full = copy_run(rt, &src, full_len).await;
    let last_full = rt
        .journal
        .last_seq(&run_full)
        .await
        .expect("last")
        .unwrap_or(0);
    let tail3_after = {
        let all = rt.journal.read(&run_full, 0).await.expect("read");
        all[all.len().saturating_sub(4)].seq
    };
    out.push(OpCost {
        name: "journal.read(run, 0), 60 events",
        stats: time_op(iters, |_| async {
            let r = rt.journal.read(&run60, 0).await.expect("read");
            assert_eq!(r.len(), 60);
        })
        .await,
    });
    let full_name: &'static str =
        Box::leak(format!("journal.read(run, 0), {full_len} events").into_boxed_str());
    out.push(OpCost {
        name: full_name,
        stats: time_op(iters, |_| async {
            let r = rt.journal.read(&run_full, 0).await.expect("read");
            assert_eq!(r.len(), full_len);
        })
        .await,
    });
    out.push(OpCost {
        name: "journal.read(run, after), 3 new (refresh)",
        stats: time_op(iters, |_| async {
            let r = rt.journal.read(&run_full, tail3_after).await.expect("read");
            assert_eq!(r.len(), 3);
        })
        .await,
    });
    out.push(OpCost {
        name: "journal.read(run, last), 0 new",
        stats: time_op(iters, |_| async {
            let r = rt.journal.read(&run_full, last_full).await.expect("read");
            assert!(r.is_empty());
        })
        .await,
    });

    out.push(OpCost {
        name: "direct get last of a run (cancel check)",
        stats: {
            // As the tool service checks: the last `cancel.requested` of the run (none here).
            let stream = rt.js.get_stream("KEDGE_RUNS").await.expect("stream");
            let subject = kedge_core::subjects::event(&run_full, EventType::CancelRequested);
            time_op(iters, |_| {
                let (stream, subject) = (&stream, &subject);
                async move {
                    let _ = stream.direct_get_last_for_subject(subject.as_str()).await;
                }
            })
            .await
        },
    });

    // Decision appends: a run of our own, the expected sequence carried along.
    let drun = RunId::generate();
    let last = Arc::new(Mutex::new(
        rt.journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(&drun, "w-bench"),
                0,
                &[with_run(&created, &drun)],
            )
            .await
            .expect("run.created")
            .last_seq,
    ));
    out.push(OpCost {
        name: "append_decisions, 1 event (expected-seq)",
        stats: time_op(iters, |_| {
            let last = last.clone();
            let e = with_run(&step_started, &drun);
            let drun = &drun;
            async move {
                let expected = *last.lock().unwrap();
                let a = rt
                    .journal
                    .append_decisions(
                        &kedge_journal::DecisionWriter::unfenced(drun, "w-bench"),
                        expected,
                        &[e],
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
            let es: Vec<Envelope> = group.iter().map(|e| with_run(e, &drun)).collect();
            let drun = &drun;
            async move {
                let expected = *last.lock().unwrap();
                let a = rt
                    .journal
                    .append_decisions(
                        &kedge_journal::DecisionWriter::unfenced(drun, "w-bench"),
                        expected,
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
            let e = with_run(&tool_result, &drun);
            async move {
                rt.journal
                    .append_input(&e, &format!("bench:{i}:{}", uuid_like()))
                    .await
                    .expect("input");
            }
        })
        .await,
    });

    // The same 3 decisions without an atomic batch: 3 chained single appends (expected-seq
    // carried from each ack), and one decision message carrying all three (3x the payload).
    out.push(OpCost {
        name: "alt: 3 decisions as 3 chained single appends",
        stats: time_op(iters, |_| {
            let last = last.clone();
            let es: Vec<Envelope> = group.iter().map(|e| with_run(e, &drun)).collect();
            let drun = &drun;
            async move {
                for e in es {
                    let expected = *last.lock().unwrap();
                    let a = rt
                        .journal
                        .append_decisions(
                            &kedge_journal::DecisionWriter::unfenced(drun, "w-bench"),
                            expected,
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
        let Event::StepCompleted(sc) = &group[0].event else {
            unreachable!()
        };
        let mut sc = sc.clone();
        let extra: usize = group[1..].iter().map(|e| e.to_json_bytes().len()).sum();
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
            let e = with_run(&big, &drun);
            let drun = &drun;
            async move {
                let expected = *last.lock().unwrap();
                let a = rt
                    .journal
                    .append_decisions(
                        &kedge_journal::DecisionWriter::unfenced(drun, "w-bench"),
                        expected,
                        &[e],
                    )
                    .await
                    .expect("append big");
                *last.lock().unwrap() = a.last_seq;
            }
        })
        .await,
    });

    // Head-of-line blocking: a single append while another run commits batches back to back.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let brun = RunId::generate();
    let background = {
        let rt = rt.clone();
        let stop = stop.clone();
        let es: Vec<Envelope> = group.iter().map(|e| with_run(e, &brun)).collect();
        let first = with_run(&step_started, &brun);
        let brun = brun.clone();
        tokio::spawn(async move {
            let mut last = rt
                .journal
                .append_decisions(
                    &kedge_journal::DecisionWriter::unfenced(&brun, "w-bg"),
                    0,
                    &[first],
                )
                .await
                .expect("bg first")
                .last_seq;
            let mut n = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let es: Vec<Envelope> = es.iter().map(|e| with_run(e, &brun)).collect();
                last = rt
                    .journal
                    .append_decisions(
                        &kedge_journal::DecisionWriter::unfenced(&brun, "w-bg"),
                        last,
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
            let e = with_run(&step_started, &drun);
            let drun = &drun;
            async move {
                let expected = *last.lock().unwrap();
                let a = rt
                    .journal
                    .append_decisions(
                        &kedge_journal::DecisionWriter::unfenced(drun, "w-bench"),
                        expected,
                        &[e],
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
            let e = with_run(&tool_result, &drun);
            async move {
                rt.journal
                    .append_input(&e, &format!("bench-hol:{i}:{}", uuid_like()))
                    .await
                    .expect("input (contended)");
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "lease acquire, batches committing meanwhile",
        stats: time_op(iters.min(200), |i| {
            let runs = &runs;
            async move {
                let l = rt
                    .leases
                    .acquire(&runs[i % runs.len()], "w-bench2", ttl)
                    .await;
                if let Ok(l) = l {
                    let _ = rt.leases.release(l).await;
                }
            }
        })
        .await,
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = background.await;

    // Throughput of 16 concurrent writers (one run each) for one second.
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
            let group = group.clone();
            let first = step_started.clone();
            tasks.push(tokio::spawn(async move {
                let run = RunId::generate();
                let writer = format!("w-tp{w}");
                let mut last = rt
                    .journal
                    .append_decisions(
                        &kedge_journal::DecisionWriter::unfenced(&run, &writer),
                        0,
                        &[with_run(&first, &run)],
                    )
                    .await
                    .expect("first")
                    .last_seq;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let t = Instant::now();
                    let es: Vec<Envelope> = group.iter().map(|e| with_run(e, &run)).collect();
                    if batch {
                        last = rt
                            .journal
                            .append_decisions(
                                &kedge_journal::DecisionWriter::unfenced(&run, &writer),
                                last,
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
                                    last,
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

    // The ledger_append tool itself (open, append: one blocking-pool hop), as the tool runs it.
    let tool_env = kedge_tool::builtin::Env {
        root: env.config.workspace_root.join("bench-tool"),
        shell_allowlist: vec![],
        timeout: Duration::from_secs(1),
        max_output: 64 * 1024,
        sandbox: std::sync::Arc::new(kedge_tool::sandbox::Unconfined),
        ledger: true,
    };
    let trun = RunId::generate();
    out.push(OpCost {
        name: "ledger_append tool run (open+append)",
        stats: time_op(iters, |i| {
            let tool_env = &tool_env;
            let trun = &trun;
            async move {
                let op = OperationId::new(trun, StepNo(i as u32 + 1), 0);
                let out = tool_env
                    .run(
                        kedge_tool::builtin::Builtin::LedgerAppend,
                        &op,
                        &serde_json::json!({"text": "x"}),
                    )
                    .await;
                assert!(!out.is_error, "{}", out.content);
            }
        })
        .await,
    });

    // Idempotency KV.
    let Event::StepCompleted(sc) = &group[0].event else {
        unreachable!()
    };
    let stored = StoredResponse {
        context_digest: Digest::of_bytes(b"bench"),
        response: kedge_core::decide::ModelResponse {
            message: sc.message.clone(),
            usage: sc.usage,
            finish: sc.finish,
        },
    };
    let krun = RunId::generate();
    out.push(OpCost {
        name: "KV put model response (store_response)",
        stats: time_op(iters, |i| {
            let stored = &stored;
            let krun = &krun;
            async move {
                let req = ModelRequestId::new(krun, StepNo(i as u32 + 1), Attempt(1));
                rt.idempotency
                    .store_response(&req, stored)
                    .await
                    .expect("put");
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "KV get model response (stored_response)",
        stats: time_op(iters, |i| {
            let krun = &krun;
            async move {
                let req = ModelRequestId::new(krun, StepNo((i % iters) as u32 + 1), Attempt(1));
                let _ = rt.idempotency.stored_response(&req).await.expect("get");
            }
        })
        .await,
    });
    let revs: Arc<Mutex<HashMap<usize, u64>>> = Arc::default();
    let digest = Digest::of_bytes(b"args");
    out.push(OpCost {
        name: "op claim (KV create)",
        stats: time_op(iters, |i| {
            let revs = revs.clone();
            let krun = &krun;
            let digest = &digest;
            async move {
                let op = OperationId::new(krun, StepNo(i as u32 + 1), 0);
                match rt
                    .idempotency
                    .claim(&op, digest, "w-bench", 0, Duration::from_secs(70))
                    .await
                    .expect("claim")
                {
                    Claim::Fresh { revision } => {
                        revs.lock().unwrap().insert(i, revision);
                    }
                    other => panic!("claim: {other:?}"),
                }
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "op finish (KV update, CAS)",
        stats: time_op(iters, |i| {
            let revs = revs.clone();
            let krun = &krun;
            let digest = &digest;
            async move {
                let rev = revs.lock().unwrap().get(&i).copied();
                if let Some(rev) = rev {
                    let op = OperationId::new(krun, StepNo(i as u32 + 1), 0);
                    rt.idempotency
                        .finish(
                            &op,
                            rev,
                            digest,
                            "w-bench",
                            "recorded: 5",
                            false,
                            kedge_runtime::idempotency::Finished::Ran,
                        )
                        .await
                        .expect("finish");
                }
            }
        })
        .await,
    });

    // Consumer wake: an input appended → delivered to a durable pull consumer (messages()).
    let wrun = RunId::generate();
    let stream = rt.js.get_stream("KEDGE_RUNS").await.expect("stream");
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("bench_wake".into()),
            filter_subject: format!("agent.run.{wrun}.i.>"),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .expect("bench consumer");
    let mut msgs = consumer.messages().await.expect("messages");
    let msgs_ref = Arc::new(tokio::sync::Mutex::new(&mut msgs));
    out.push(OpCost {
        name: "wake: input append -> pull delivery",
        stats: time_op(iters, |i| {
            let e = with_run(&tool_result, &wrun);
            let msgs_ref = msgs_ref.clone();
            async move {
                rt.journal
                    .append_input(&e, &format!("wake:{i}:{}", uuid_like()))
                    .await
                    .expect("input");
                let mut g = msgs_ref.lock().await;
                let m = tokio::time::timeout(Duration::from_secs(5), g.next())
                    .await
                    .expect("delivered")
                    .expect("open")
                    .expect("message");
                m.ack().await.expect("ack");
            }
        })
        .await,
    });
    drop(msgs_ref);
    drop(msgs);
    let _ = stream.delete_consumer("bench_wake").await;

    // The model call: the HTTP round trip to the mock with a step-10 context.
    let upto = src
        .iter()
        .position(|r| {
            r.envelope.event_type() == EventType::ToolResult
                && r.envelope.step.map_or(0, |s| s.get()) == 9
        })
        .expect("tool.result of step 9");
    let state = kedge_core::fold(src[..=upto].iter().map(|r| (r.seq, &r.envelope))).expect("fold");
    let def = rt
        .agents
        .at_revision(&state.bundle.agent, state.bundle.agent_revision)
        .await
        .expect("agent");
    let Next::Step(plan) = decide(&state) else {
        panic!("expected a step")
    };
    let client = kedge_model::ModelClient::new();
    let other = RunId::generate();
    let request_id = ModelRequestId::new(&other, plan.step, plan.attempt);
    let model_calls_before = env.mock.total_calls();
    out.push(OpCost {
        name: "model call, step-10 context (HTTP, mock)",
        stats: time_op(iters.min(200), |_| {
            let (state, def, plan, client, request_id) =
                (&state, &def, &plan, &client, &request_id);
            async move {
                let call = kedge_model::ModelCall {
                    spec: &state.bundle.model,
                    api_key: Some("bench-key"),
                    system: &def.system_prompt,
                    tools: &def.tools,
                    context: &plan.context,
                    request_id,
                    max_output_tokens: def.max_output_tokens,
                    output_schema: def.output_schema.as_ref(),
                    timeout: Duration::from_secs(10),
                };
                let mut sink = |_d: kedge_model::Delta| {};
                client.complete(&call, &mut sink).await.expect("model call");
            }
        })
        .await,
    });
    let micro_model_calls = (env.mock.total_calls() - model_calls_before) as usize;

    // Pure CPU: fold + decide over a 60-event prefix (what every drive does after its read).
    let cpu = {
        let prefix: Vec<Recorded> = src.iter().take(60).cloned().collect();
        let mut v = Vec::new();
        for _ in 0..iters {
            let t = Instant::now();
            let s = kedge_core::fold(prefix.iter().map(|r| (r.seq, &r.envelope))).expect("fold");
            let n = decide(&s);
            std::hint::black_box(n);
            v.push(ms(t.elapsed()));
        }
        stats(&v)
    };
    out.push(OpCost {
        name: "CPU: fold(60 events) + decide",
        stats: cpu,
    });
    let decode = {
        let bytes: Vec<Vec<u8>> = src
            .iter()
            .take(60)
            .map(|r| r.envelope.to_json_bytes())
            .collect();
        let mut v = Vec::new();
        for _ in 0..iters {
            let t = Instant::now();
            for b in &bytes {
                std::hint::black_box(Envelope::from_json_bytes(b).expect("decode"));
            }
            v.push(ms(t.elapsed()));
        }
        stats(&v)
    };
    out.push(OpCost {
        name: "CPU: decode 60 envelopes (JSON + digest)",
        stats: decode,
    });
    (out, micro_model_calls)
}

/// The machine's load (other processes share these cores: read the numbers with it).
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn uuid_like() -> String {
    RunId::generate()
        .as_str()
        .trim_start_matches("run_")
        .to_owned()
}

/// Model calls per step over `all_runs` (printed, prefixed with `who`); run before anything else
/// calls the mock.
async fn model_calls_per_step(env: &Env, all_runs: &[RunId], who: &str) -> f64 {
    let calls = env.mock.calls();
    let mut total_steps = 0u64;
    for r in all_runs {
        let evs = env.rt.journal.read(r, 0).await.expect("read");
        let s = kedge_core::fold(evs.iter().map(|x| (x.seq, &x.envelope))).expect("fold");
        total_steps += u64::from(s.step.get());
    }
    let repeated = calls.by_request_id.values().filter(|&&n| n != 1).count();
    let calls_per_step = calls.total as f64 / total_steps as f64;
    println!();
    println!(
        "  {who}Model calls per step: {} calls / {} steps over {} runs = {:.3}  (request ids called more than once: {repeated})",
        calls.total,
        total_steps,
        all_runs.len(),
        calls_per_step
    );
    calls_per_step
}

/// The ledger has exactly one line per operation of `all_runs` (printed, prefixed with `who`;
/// asserted), and every submitted run is counted.
fn check_ledger(env: &Env, all_runs: &[RunId], who: &str) {
    let ledger =
        std::fs::read_to_string(env.config.workspace_root.join("ledger.log")).unwrap_or_default();
    let lines: Vec<&str> = ledger.lines().collect();
    let ops: HashSet<&str> = lines.iter().filter_map(|l| l.split('\t').next()).collect();
    let expected = all_runs.len() * K;
    println!();
    println!(
        "  {who}Ledger: {} lines, {} distinct operation ids, expected {} ({} runs x {K}) -> {}",
        lines.len(),
        ops.len(),
        expected,
        all_runs.len(),
        if lines.len() == expected && ops.len() == expected {
            "OK, exactly one line per operation"
        } else {
            "MISMATCH"
        }
    );
    assert_eq!(lines.len(), expected, "ledger lines");
    assert_eq!(ops.len(), expected, "distinct operations in the ledger");
    assert_eq!(env.submitted, all_runs.len());
}

/// One concurrency round: submits `n` runs at once (idempotency keys `<key>-<n>-<i>`), waits
/// for every terminal event and reads the runs back; adds them to `all_runs`.
async fn conc_round(env: &mut Env, key: &str, n: usize, all_runs: &mut Vec<RunId>) -> ConcRound {
    let pid = env.server_pids();
    let runs: Vec<RunId> = (0..n).map(|_| RunId::generate()).collect();
    let rxs: Vec<_> = runs.iter().map(|r| env.terminals.register(r)).collect();
    let cpu0 = cpu_mark(&pid);
    let t0 = Instant::now();
    let env_ref = &*env;
    let submits = runs.iter().enumerate().map(|(i, r)| async move {
        let s = Instant::now();
        env_ref.submit(r, &format!("{key}-{n}-{i}")).await;
        ms(s.elapsed())
    });
    let submit_ms = futures::future::join_all(submits).await;
    let mut timings = Vec::new();
    for ((r, rx), sub) in runs.iter().zip(rxs).zip(submit_ms) {
        let (at, ty) = tokio::time::timeout(RUN_TIMEOUT, rx)
            .await
            .unwrap_or_else(|_| panic!("run {r} not terminal"))
            .expect("watcher");
        assert_eq!(ty, "run.succeeded", "run {r} ended {ty}");
        timings.push(RunTiming {
            run: r.clone(),
            submit: sub,
            wall: ms(at - t0),
        });
    }
    let elapsed = timings.iter().map(|t| t.wall).fold(0.0, f64::max);
    let (cs, cm) = cpu_since(cpu0, &pid);
    env.submitted += n;
    let mut c = Collected::default();
    collect(env, &timings, &mut c).await;
    all_runs.extend(runs.iter().cloned());
    let rate = (ACTIONS * n) as f64 / (elapsed / 1e3);
    let na = (ACTIONS * n) as f64;
    (n, elapsed, rate, c, (cs / na, cm / na))
}

/// The closed-loop phase: `n` runs always in flight (each of `n` loops submits its next run as
/// soon as its last one ends), as the Restate peer's throughput mode measures; a single batch
/// (`conc_round`) also times its ramp-up and its tail, where fewer than `n` runs are left.
struct Sustained {
    in_flight: usize,
    /// The measured window (after the ramp), s.
    window_s: f64,
    /// Actions completed in the window: two per ledger line (one model call asking for the
    /// tool, one tool call), as the peer counts its `llm` and `tool` steps.
    actions: u64,
    actions_per_s: f64,
    /// CPU ms per action in the window: (nats-server, kedge process without the mock model).
    cpu: (f64, f64),
    /// CPU ms per action of the mock model's thread in the window.
    mock_cpu: f64,
    /// Runs completed over the whole phase (ramp, window and drain).
    runs: usize,
    /// From the end of the window until every loop's last run ended, s.
    drain_s: f64,
}

/// Lines of the ledger file so far: one per tool call of the `ledger_append` built-in.
fn ledger_lines(env: &Env) -> u64 {
    std::fs::read(env.config.workspace_root.join("ledger.log"))
        .map(|b| b.iter().filter(|&&c| c == b'\n').count() as u64)
        .unwrap_or(0)
}

async fn sustained(
    env: &mut Env,
    key: &str,
    n: usize,
    ramp: Duration,
    window: Duration,
    all_runs: &mut Vec<RunId>,
) -> Sustained {
    let pid = env.server_pids();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let env_ref = &*env;
    let stop_ref = &stop;
    let loops = futures::future::join_all((0..n).map(|w| async move {
        let mut done = Vec::new();
        while !stop_ref.load(std::sync::atomic::Ordering::Relaxed) {
            let t = env_ref.run_one(format!("{key}-{w}-{}", done.len())).await;
            done.push(t.run);
        }
        done
    }));
    let measure = async {
        tokio::time::sleep(ramp).await;
        let (lines0, cpu0, t0) = (ledger_lines(env_ref), cpu_mark(&pid), Instant::now());
        tokio::time::sleep(window).await;
        let (lines1, cpu, mock, secs) = (
            ledger_lines(env_ref),
            cpu_since(cpu0, &pid),
            mock_cpu_since(cpu0),
            t0.elapsed().as_secs_f64(),
        );
        stop_ref.store(true, std::sync::atomic::Ordering::Relaxed);
        (
            2 * lines1.saturating_sub(lines0),
            cpu,
            mock,
            secs,
            Instant::now(),
        )
    };
    let (runs, (actions, (cs, cm), mock, secs, stopped)) = futures::join!(loops, measure);
    let drain_s = stopped.elapsed().as_secs_f64();
    let runs: Vec<RunId> = runs.into_iter().flatten().collect();
    env.submitted += runs.len();
    let count = runs.len();
    all_runs.extend(runs);
    let per = actions.max(1) as f64;
    Sustained {
        in_flight: n,
        window_s: secs,
        actions,
        actions_per_s: actions as f64 / secs,
        cpu: (cs / per, cm / per),
        mock_cpu: mock / per,
        runs: count,
        drain_s,
    }
}

// ---------------------------------------------------------------------------------------------
// One durability setting, end to end

struct ModeResult {
    label: &'static str,
    sync_always: bool,
    seq: Collected,
    conc: Vec<ConcRound>,
    /// The closed-loop phase (`--sustain 0`: none).
    sustained: Option<Sustained>,
    calls_per_step: f64,
    /// CPU ms per action during the sequential runs: (nats-server, kedge process).
    seq_cpu: (f64, f64),
    /// CPU ms per action of the mock model's thread during the sequential runs.
    seq_mock_cpu: f64,
    /// The wiretap of the traced run (`--no-trace`: none).
    tap: Option<TapReport>,
    /// Load average before and after this setting's measurements.
    load: (String, String),
}

async fn run_mode(label: &'static str, sync_always: bool, o: &Opts) -> ModeResult {
    println!();
    println!("================================================================================");
    println!(
        "  {label}: nats-server {}",
        if sync_always {
            "jetstream { sync_interval: always } (fsync before every ack)"
        } else {
            "default sync (fsync every 2 min)"
        }
    );
    println!("================================================================================");
    let load_before = loadavg();
    println!("  load average before: {load_before}");
    let mut env = Env::start(sync_always, None, "", o.cluster, !o.no_park, o.projector).await;
    let pid = env.server_pids();

    // Warm-up: connections, HTTP pool, agent cache, consumers.
    let mut all_runs: Vec<RunId> = Vec::new();
    for i in 0..2 {
        let t = env.run_one(format!("{label}-warm-{i}")).await;
        all_runs.push(t.run.clone());
        env.submitted += 1;
    }

    // 1 + 2: sequential runs.
    let mut seq_timings = Vec::new();
    let cpu0 = cpu_mark(&pid);
    let seq_t0 = Instant::now();
    for i in 0..o.runs {
        let t = env.run_one(format!("{label}-seq-{i}")).await;
        seq_timings.push(t);
        env.submitted += 1;
    }
    let seq_elapsed = ms(seq_t0.elapsed());
    let (cpu_srv, cpu_me) = cpu_since(cpu0, &pid);
    let cpu_mock = mock_cpu_since(cpu0);
    let mut seq = Collected::default();
    collect(&env, &seq_timings, &mut seq).await;
    all_runs.extend(seq_timings.iter().map(|t| t.run.clone()));

    print_sequential(&seq, o.runs);
    let n_actions = (o.runs * ACTIONS) as f64;
    let seq_cpu = (cpu_srv / n_actions, cpu_me / n_actions);
    println!(
        "  CPU during the sequential runs: nats-server {:.3} ms/action, kedge process (services + client) {:.3} ms/action, mock model (its own thread) {:.3} ms/action; {:.0}% of one core busy in total",
        cpu_srv / n_actions,
        cpu_me / n_actions,
        cpu_mock / n_actions,
        (cpu_srv + cpu_me + cpu_mock) / seq_elapsed * 100.0
    );

    // 5 (live): segments of the steady-state loop.
    print_segments(&seq);

    // 3: concurrency.
    println!();
    println!("  Throughput (submit all, wait for all terminal; actions/s = 40 x N / elapsed)");
    println!(
        "  {:>5} {:>10} {:>12} {:>14} {:>14} {:>12} {:>12}  CPU ms/action (server / kedge)",
        "runs",
        "elapsed ms",
        "actions/s",
        "action p50 ms",
        "action p99 ms",
        "run p50 ms",
        "run max ms",
    );
    let mut conc = Vec::new();
    for (round, &n) in o.concurrency.iter().enumerate() {
        let r = conc_round(&mut env, &format!("{label}-c{round}"), n, &mut all_runs).await;
        let (n, elapsed, rate, c, (cs, cm)) = &r;
        let a = stats(&c.actions());
        let w = stats(&c.journal_wall);
        println!(
            "  {:>5} {:>10.1} {:>12.0} {:>14.3} {:>14.3} {:>12.1} {:>12.1}  {:.3} / {:.3}",
            n, elapsed, rate, a.p50, a.p99, w.p50, w.max, cs, cm
        );
        conc.push(r);
    }
    print_conc_segments(&conc);

    // 3b: the closed loop, 64 runs always in flight, as the peer's throughput mode.
    let sustained = if o.sustain_s > 0.0 {
        let n = o.concurrency.iter().copied().max().unwrap_or(64);
        let ramp = Duration::from_secs_f64((o.sustain_s / 4.0).clamp(1.0, 5.0));
        let s = sustained(
            &mut env,
            &format!("{label}-loop"),
            n,
            ramp,
            Duration::from_secs_f64(o.sustain_s),
            &mut all_runs,
        )
        .await;
        println!();
        println!(
            "  Closed loop, {} runs always in flight ({:.1} s ramp, then {:.1} s measured): {:.0} actions/s ({} actions); CPU {:.3} ms/action server + {:.3} kedge + {:.3} mock model; {} runs in all, drained {:.1} s after the window",
            s.in_flight,
            ramp.as_secs_f64(),
            s.window_s,
            s.actions_per_s,
            s.actions,
            s.cpu.0,
            s.cpu.1,
            s.mock_cpu,
            s.runs,
            s.drain_s
        );
        Some(s)
    } else {
        None
    };

    // 4: model calls per step, before anything else calls the mock.
    let calls_per_step = model_calls_per_step(&env, &all_runs, "").await;

    // Traced run: the wiretap.
    let mut tap = None;
    if o.trace {
        let (tap_client, store, task) = start_tap(&env.nats.urls()[0]).await;
        let t = env.run_one(format!("{label}-traced")).await;
        env.submitted += 1;
        all_runs.push(t.run.clone());
        tokio::time::sleep(Duration::from_millis(100)).await;
        task.abort();
        drop(tap_client);
        let recs = std::mem::take(&mut *store.lock().unwrap());
        let rep = analyze_tap(&recs, &t.run);
        print_tap(&rep, t.wall);
        tap = Some(rep);
    }

    // 5: op costs, on an idle server (the services would drive the runs the bench writes).
    env.stop_services().await;
    let sample = seq_timings
        .last()
        .map(|t| t.run.clone())
        .expect("a sequential run");
    let (costs, _) = op_costs(&env, &sample, o.micro_iters).await;
    print_costs(&costs, &seq);

    // The ledger: exactly one line per operation.
    check_ledger(&env, &all_runs, "");

    let load_after = loadavg();
    println!("  load average after: {load_after}");
    env.shutdown().await;
    ModeResult {
        label,
        sync_always,
        seq,
        conc,
        sustained,
        calls_per_step,
        seq_cpu,
        seq_mock_cpu: cpu_mock / n_actions,
        tap,
        load: (load_before, load_after),
    }
}

// ---------------------------------------------------------------------------------------------
// Printing

fn print_sequential(c: &Collected, runs: usize) {
    let m = stats(&c.model);
    let t = stats(&c.tool);
    let a = stats(&c.actions());
    let jw = stats(&c.journal_wall);
    let cw = stats(&c.client_wall);
    let sub = stats(&c.submit);
    let per_action_wall: Vec<f64> = c.client_wall.iter().map(|w| w / ACTIONS as f64).collect();
    let per_action_jwall: Vec<f64> = c.journal_wall.iter().map(|w| w / ACTIONS as f64).collect();
    println!();
    println!("  Sequential runs: {runs} (after 2 warm-up runs), one at a time");
    println!("  per-action overhead (journal stamps)   p50 ms    p99 ms   mean ms      n");
    println!(
        "    model action (wake -> step.completed) {:8.3} {:9.3} {:9.3} {:6}",
        m.p50, m.p99, m.mean, m.n
    );
    println!(
        "    tool action (group end -> tool.result)    {:5.3} {:9.3} {:9.3} {:6}",
        t.p50, t.p99, t.mean, t.n
    );
    println!(
        "    all actions                          {:8.3} {:9.3} {:9.3} {:6}",
        a.p50, a.p99, a.mean, a.n
    );
    println!(
        "    mean(run wall / 40): client {:.3} ms, journal {:.3} ms",
        stats(&per_action_wall).mean,
        stats(&per_action_jwall).mean
    );
    println!("  one run end to end                     p50 ms    p99 ms   mean ms");
    println!(
        "    client: submit -> terminal seen      {:8.1} {:9.1} {:9.1}",
        cw.p50, cw.p99, cw.mean
    );
    println!(
        "    journal: run.created -> run.succeeded {:7.1} {:9.1} {:9.1}",
        jw.p50, jw.p99, jw.mean
    );
    println!(
        "    (of which submit -> intake's answer  {:8.2} {:9.2} {:9.2})",
        sub.p50, sub.p99, sub.mean
    );
}

fn print_segments(c: &Collected) {
    println!();
    println!(
        "  Where a loop iteration (1 model + 1 tool action, steps 2..{K}) goes — writer stamps vs server store times:"
    );
    println!(
        "    {:<24} {:>8} {:>8} {:>8} {:>8}   what it contains",
        "segment", "p50 ms", "mean ms", "p99 ms", "max ms"
    );
    for (name, what) in SEGMENTS {
        if let Some(v) = c.segments.get(name) {
            let s = stats(v);
            println!(
                "    {:<24} {:8.3} {:8.3} {:8.3} {:8.3}   {what}",
                name, s.p50, s.mean, s.p99, s.max
            );
        }
    }
}

fn print_conc_segments(conc: &[ConcRound]) {
    println!();
    println!("  Loop segments under concurrency (p50 / mean / p99 ms):");
    let mut head = format!("    {:<24}", "segment");
    for (n, ..) in conc {
        head.push_str(&format!(" {:>26}", format!("{n} runs")));
    }
    println!("{head}");
    for (name, _) in SEGMENTS {
        let mut line = format!("    {:<24}", name);
        for (_, _, _, c, _) in conc {
            let s = stats(c.segments.get(name).map_or(&[][..], |v| &v[..]));
            line.push_str(&format!(
                " {:>26}",
                format!("{:.2} / {:.2} / {:.1}", s.p50, s.mean, s.p99)
            ));
        }
        println!("{line}");
    }
}

fn print_tap(rep: &TapReport, wall: f64) {
    println!();
    println!(
        "  Wiretap of one traced run ({wall:.1} ms under the tap): messages per action (/40) and server reply latency"
    );
    println!(
        "    {:<52} {:>6} {:>9} {:>12} {:>12}",
        "operation", "count", "per act.", "reply p50 ms", "reply p99 ms"
    );
    for (cat, (n, lat)) in &rep.ops {
        if !per_action_op(cat) {
            // intake's own queue and the bench's terminal watcher: not per-action work.
            continue;
        }
        let s = stats(lat);
        let (p50, p99) = if lat.is_empty() {
            ("-".to_owned(), "-".to_owned())
        } else {
            (format!("{:.3}", s.p50), format!("{:.3}", s.p99))
        };
        println!(
            "    {:<52} {:>6} {:>9.2} {:>12} {:>12}",
            cat,
            n,
            *n as f64 / ACTIONS as f64,
            p50,
            p99
        );
    }
    let (mut requests, mut all) = (0usize, 0usize);
    for (cat, (n, lat)) in &rep.ops {
        if !per_action_op(cat) {
            continue;
        }
        all += n;
        requests += lat.len();
    }
    println!(
        "    {:<52} {:>6} {:>9.2}   (all messages listed: {all}, {:.2} per action)",
        "= request/reply round trips",
        requests,
        requests as f64 / ACTIONS as f64,
        all as f64 / ACTIONS as f64
    );
    if !rep.timeline.is_empty() {
        println!();
        println!(
            "  Timeline of one loop iteration under the tap (tool.result of step 9 published -> tool.result of step 10 published):"
        );
        for l in &rep.timeline {
            println!("    {l}");
        }
    }
}

fn print_costs(costs: &[OpCost], seq: &Collected) {
    println!();
    println!("  Op costs (the services' own APIs, one in flight, same server):");
    println!(
        "    {:<46} {:>8} {:>8} {:>8}",
        "operation", "p50 ms", "p99 ms", "mean ms"
    );
    let mut by: HashMap<&str, Stats> = HashMap::new();
    for c in costs {
        println!(
            "    {:<46} {:8.3} {:8.3} {:8.3}",
            c.name, c.stats.p50, c.stats.p99, c.stats.mean
        );
        by.insert(c.name, c.stats);
    }
    let g = |name: &str| by.get(name).map_or(f64::NAN, |s| s.p50);
    // The per-loop bill on the critical path (one model action + one tool action, steady
    // state), op by op as the services do them (the wiretap above shows the same sequence; the
    // model response's KV put is made only when the step's commit does not land, so it is not
    // on it):
    let rows: Vec<(&str, f64, f64)> = vec![
        (
            "step wake: pull delivery",
            1.0,
            g("wake: input append -> pull delivery"),
        ),
        (
            "lease acquire (own release marker)",
            1.0,
            g("lease acquire_after (own release marker)"),
        ),
        (
            "drive start: read after the cached state",
            1.0,
            g("journal.read(run, after), 3 new (refresh)"),
        ),
        (
            "fold + decide (CPU)",
            1.0,
            g("CPU: fold(60 events) + decide"),
        ),
        (
            "step.started append (1 decision)",
            1.0,
            g("append_decisions, 1 event (expected-seq)"),
        ),
        (
            "model HTTP call",
            1.0,
            g("model call, step-10 context (HTTP, mock)"),
        ),
        (
            "group: 2 chained decision appends (checked on the run's last message)",
            2.0,
            g("append_decisions, 1 event (expected-seq)"),
        ),
        (
            "tool wake: pull delivery",
            1.0,
            g("wake: input append -> pull delivery"),
        ),
        ("op claim (KV create)", 1.0, g("op claim (KV create)")),
        (
            "cancel check (direct get, last of run)",
            1.0,
            g("direct get last of a run (cancel check)"),
        ),
        (
            "ledger_append || tool.started input",
            1.0,
            g("ledger_append tool run (open+append)").max(g("append_input (msg-id dedup)")),
        ),
        (
            "op finish (KV update)",
            1.0,
            g("op finish (KV update, CAS)"),
        ),
        ("tool.result input", 1.0, g("append_input (msg-id dedup)")),
    ];
    let total: f64 = rows.iter().map(|(_, n, c)| n * c).sum();
    let loop_p50 = seq.segments.get("= loop").map_or(0.0, |v| stats(v).p50);
    println!();
    println!(
        "  The per-loop bill on the critical path (1 model + 1 tool action), op count x p50 cost:"
    );
    for (name, n, c) in &rows {
        println!(
            "    {:<44} {:>3} x {:7.3} = {:7.3} ms  ({:4.1}%)",
            name,
            n,
            c,
            n * c,
            n * c / total * 100.0
        );
    }
    println!(
        "    {:<44}                 {:7.3} ms  -> {:.3} ms per action; measured loop p50 {:.3} ms ({:.3} per action)",
        "sum",
        total,
        total / 2.0,
        loop_p50,
        loop_p50 / 2.0
    );
    println!(
        "    off the critical path but sharing the stream and the CPU: the lease release (while the tool starts);"
    );
    println!(
        "    `a || b` runs both at once (the longer counts). For comparison, the group as one atomic batch: {:.3} ms instead of {:.3} ms",
        g("append_decisions, 3 events (atomic batch)"),
        3.0 * g("append_decisions, 1 event (expected-seq)")
    );
}

fn print_summary(results: &[ModeResult]) {
    println!();
    println!("================================================================================");
    println!("  Summary (ours, this run) vs peers and goal");
    println!("================================================================================");
    println!(
        "  {:<26} {:>18} {:>16} {:>18} {:>16}",
        "", "action p50 ms", "run p50 ms", "actions/s @64", "calls/step"
    );
    for r in results {
        let a = stats(&r.seq.actions());
        let w = stats(&r.seq.client_wall);
        let jw = stats(&r.seq.journal_wall);
        // The closed loop when it ran (what the peer measures), else the batch of 64.
        let at64 = r
            .sustained
            .as_ref()
            .map(|s| format!("{:.0} (loop {})", s.actions_per_s, s.in_flight))
            .or_else(|| {
                r.conc
                    .iter()
                    .find(|c| c.0 == 64)
                    .or(r.conc.last())
                    .map(|c| format!("{:.0} (@{})", c.2, c.0))
            });
        println!(
            "  {:<26} {:>18} {:>16} {:>18} {:>16}",
            format!("Kedge ({})", r.label),
            format!("{:.3} (p99 {:.2})", a.p50, a.p99),
            format!("{:.1} ({:.1} jrnl)", w.p50, jw.p50),
            at64.unwrap_or_else(|| "-".into()),
            format!("{:.3}", r.calls_per_step)
        );
    }
    println!(
        "  {:<26} {:>18} {:>16} {:>18} {:>16}",
        "Restate 1.7", "1.2-1.5", "57-73", "2,600-3,300", "-"
    );
    println!(
        "  {:<26} {:>18} {:>16} {:>18} {:>16}",
        "DBOS 3.4", "5-6", "210-260", "~165", "-"
    );
    println!(
        "  {:<26} {:>18} {:>16} {:>18} {:>16}",
        "goal", "<= 0.8", "<= 35", ">= 6,000", "1.000"
    );
    for r in results {
        println!();
        println!("  {} throughput by concurrency:", r.label);
        for (n, elapsed, rate, c, (cs, cm)) in &r.conc {
            let a = stats(&c.actions());
            println!(
                "    {n:>3} runs: {rate:7.0} actions/s ({elapsed:.0} ms), action p50 {:.3} ms, CPU {:.3} ms/action server + {:.3} kedge",
                a.p50, cs, cm
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// `--json FILE`: the key figures, for scripts/bench-vs-restate.sh

/// Whether a tapped category is per-action work (not intake's queue, the bench's terminal
/// watcher or JetStream API calls): the same filter `print_tap` applies.
fn per_action_op(cat: &str) -> bool {
    !(cat.contains("KEDGE_TASKS") || cat.contains("/ordered") || cat.starts_with("api "))
}

fn stats_json(s: &Stats) -> serde_json::Value {
    serde_json::json!({"n": s.n, "p50_ms": s.p50, "p99_ms": s.p99, "mean_ms": s.mean, "max_ms": s.max})
}

/// The figures of the report that the comparison with the peers needs, one object per
/// durability setting. Times in ms, CPU in ms per action.
fn json_summary(results: &[ModeResult], o: &Opts, load_start: &str) -> serde_json::Value {
    let modes: Vec<serde_json::Value> = results
        .iter()
        .map(|r| {
            let conc: Vec<serde_json::Value> = r
                .conc
                .iter()
                .map(|(n, elapsed, rate, c, (cs, cm))| {
                    serde_json::json!({
                        "runs": n,
                        "elapsed_ms": elapsed,
                        "actions_per_s": rate,
                        "action": stats_json(&stats(&c.actions())),
                        "run_journal": stats_json(&stats(&c.journal_wall)),
                        "cpu_ms_per_action": {"nats_server": cs, "kedge": cm},
                    })
                })
                .collect();
            let tap = r.tap.as_ref().map(|t| {
                let ops: Vec<serde_json::Value> = t
                    .ops
                    .iter()
                    .filter(|(cat, _)| per_action_op(cat))
                    .map(|(cat, (n, lat))| {
                        serde_json::json!({
                            "op": cat,
                            "count": n,
                            "per_action": *n as f64 / ACTIONS as f64,
                            "request_reply": !lat.is_empty(),
                        })
                    })
                    .collect();
                let (all, requests) = t
                    .ops
                    .iter()
                    .filter(|(cat, _)| per_action_op(cat))
                    .fold((0, 0), |(a, q), (_, (n, lat))| (a + n, q + lat.len()));
                serde_json::json!({
                    "ops": ops,
                    "messages_per_action": all as f64 / ACTIONS as f64,
                    "round_trips_per_action": requests as f64 / ACTIONS as f64,
                })
            });
            serde_json::json!({
                "label": r.label,
                "sync_always": r.sync_always,
                "loadavg_before": r.load.0,
                "loadavg_after": r.load.1,
                "sequential": {
                    "runs": r.seq.runs,
                    "action": stats_json(&stats(&r.seq.actions())),
                    "model_action": stats_json(&stats(&r.seq.model)),
                    "tool_action": stats_json(&stats(&r.seq.tool)),
                    "run_client": stats_json(&stats(&r.seq.client_wall)),
                    "run_journal": stats_json(&stats(&r.seq.journal_wall)),
                    "cpu_ms_per_action": {"nats_server": r.seq_cpu.0, "kedge": r.seq_cpu.1, "mock_model": r.seq_mock_cpu},
                },
                "concurrency": conc,
                "sustained": r.sustained.as_ref().map(|s| serde_json::json!({
                    "in_flight": s.in_flight,
                    "window_s": s.window_s,
                    "actions": s.actions,
                    "actions_per_s": s.actions_per_s,
                    "cpu_ms_per_action": {"nats_server": s.cpu.0, "kedge": s.cpu.1, "mock_model": s.mock_cpu},
                    "runs": s.runs,
                    "drain_s": s.drain_s,
                })),
                "model_calls_per_step": r.calls_per_step,
                "wiretap": tap,
            })
        })
        .collect();
    serde_json::json!({
        "bench": "kedge-agent_loop",
        "k_iterations": K,
        "actions_per_run": ACTIONS,
        "sequential_runs": o.runs,
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "modes": modes,
    })
}

// ---------------------------------------------------------------------------------------------
// TLS comparison (`--tls-compare`): plain TCP vs TLS on the same workload, same sitting

use kedge_testkit::tls::Pki;

/// One side of the comparison and everything measured on it, over all repetitions.
struct Variant {
    label: &'static str,
    env: Env,
    /// The server's monitoring port (connz: which connections speak TLS).
    http_port: u16,
    all_runs: Vec<RunId>,
    /// The sequential runs of every repetition.
    seq: Collected,
    /// Per repetition: elapsed ms of its sequential runs and CPU ms (server, kedge process).
    seq_reps: Vec<(f64, (f64, f64))>,
    /// Per concurrency level (as `Opts::concurrency`), one round per repetition.
    conc: Vec<Vec<ConcRound>>,
}

impl Collected {
    fn merge(&mut self, other: &Collected) {
        self.model.extend(&other.model);
        self.tool.extend(&other.tool);
        self.journal_wall.extend(&other.journal_wall);
        self.client_wall.extend(&other.client_wall);
        self.submit.extend(&other.submit);
        for (k, v) in &other.segments {
            self.segments.entry(k).or_default().extend(v);
        }
        self.steps += other.steps;
        self.runs += other.runs;
    }
}

/// The Kedge connections the server sees (`kedge-*` names) and which TLS they speak.
async fn kedge_connections(http_port: u16) -> (usize, usize, HashSet<String>) {
    let body = reqwest::get(format!("http://127.0.0.1:{http_port}/connz?limit=1024"))
        .await
        .expect("connz")
        .text()
        .await
        .expect("connz body");
    let v: serde_json::Value = serde_json::from_str(&body).expect("connz JSON");
    let mut kedge = 0;
    let mut tls = 0;
    let mut kinds = HashSet::new();
    for c in v["connections"].as_array().into_iter().flatten() {
        if !c["name"].as_str().is_some_and(|n| n.starts_with("kedge-")) {
            continue;
        }
        kedge += 1;
        if let Some(version) = c["tls_version"].as_str() {
            tls += 1;
            kinds.insert(format!(
                "TLS {version} {}",
                c["tls_cipher_suite"].as_str().unwrap_or("?")
            ));
        }
    }
    (kedge, tls, kinds)
}

async fn tls_compare(o: &Opts) {
    let sync_always = !o.default_mode;
    let reps = o.tls_reps;
    println!();
    println!("================================================================================");
    println!(
        "  TLS cost: plain TCP vs TLS (client certificate verified), nats-server {}",
        if sync_always {
            "jetstream { sync_interval: always }"
        } else {
            "default sync"
        }
    );
    println!(
        "  {reps} repetitions of ({} sequential runs, then {:?} runs at once) per variant, alternated plain/tls, tls/plain, ...",
        o.runs, o.concurrency
    );
    println!("================================================================================");
    println!("  load average before: {}", loadavg());
    let pki_dir = tempfile::tempdir().expect("temp dir");
    let pki = Pki::generate(pki_dir.path());
    let mut variants = Vec::new();
    for (label, tls) in [("plain", None), ("tls", Some(&pki))] {
        let http_port = kedge_testkit::free_port();
        let env = Env::start(
            sync_always,
            tls,
            &format!("http: \"127.0.0.1:{http_port}\"\n"),
            false,
            !o.no_park,
            false,
        )
        .await;
        variants.push(Variant {
            label,
            env,
            http_port,
            all_runs: Vec::new(),
            seq: Collected::default(),
            seq_reps: Vec::new(),
            conc: o.concurrency.iter().map(|_| Vec::new()).collect(),
        });
    }
    for v in &mut variants {
        // Warm-up: connections, HTTP pool, agent cache, consumers.
        for i in 0..2 {
            let t = v.env.run_one(format!("{}-warm-{i}", v.label)).await;
            v.all_runs.push(t.run);
            v.env.submitted += 1;
        }
        let (kedge, tls, kinds) = kedge_connections(v.http_port).await;
        let mut kinds: Vec<String> = kinds.into_iter().collect();
        kinds.sort();
        println!(
            "  {:<5}: the server sees {kedge} Kedge connections, {tls} of them over TLS{}",
            v.label,
            if kinds.is_empty() {
                String::new()
            } else {
                format!(" ({})", kinds.join(", "))
            }
        );
        assert!(
            kedge > 0,
            "no Kedge connection seen by the {} server",
            v.label
        );
        let expect_tls = if v.label == "tls" { kedge } else { 0 };
        assert_eq!(
            tls, expect_tls,
            "{} server: Kedge connections over TLS",
            v.label
        );
    }

    println!();
    println!(
        "  {:>4} {:<5} {:>6} {:>10} {:>10} {:>14} {:>14} {:>12}  CPU ms/action (server / kedge)",
        "rep",
        "",
        "runs",
        "elapsed ms",
        "actions/s",
        "action p50 ms",
        "action p99 ms",
        "run p50 ms",
    );
    for rep in 0..reps {
        let order: [usize; 2] = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        // Sequential runs, one at a time.
        for &i in &order {
            let v = &mut variants[i];
            let pid = v.env.server_pids();
            let mut timings = Vec::new();
            let cpu0 = cpu_mark(&pid);
            let t0 = Instant::now();
            for j in 0..o.runs {
                let t = v.env.run_one(format!("{}-r{rep}-seq-{j}", v.label)).await;
                timings.push(t);
                v.env.submitted += 1;
            }
            let elapsed = ms(t0.elapsed());
            let (cs, cm) = cpu_since(cpu0, &pid);
            let mut c = Collected::default();
            collect(&v.env, &timings, &mut c).await;
            v.all_runs.extend(timings.iter().map(|t| t.run.clone()));
            let a = stats(&c.actions());
            let w = stats(&c.journal_wall);
            let na = (o.runs * ACTIONS) as f64;
            println!(
                "  {:>4} {:<5} {:>6} {:>10.1} {:>10.0} {:>14.3} {:>14.3} {:>12.1}  {:.3} / {:.3}",
                rep + 1,
                v.label,
                format!("{}seq", o.runs),
                elapsed,
                na / (elapsed / 1e3),
                a.p50,
                a.p99,
                w.p50,
                cs / na,
                cm / na
            );
            v.seq.merge(&c);
            v.seq_reps.push((elapsed, (cs, cm)));
        }
        // Concurrency rounds, level by level, alternating at each level.
        for (round, &n) in o.concurrency.iter().enumerate() {
            for &i in &order {
                let v = &mut variants[i];
                let key = format!("{}-r{rep}-c{round}", v.label);
                let r = conc_round(&mut v.env, &key, n, &mut v.all_runs).await;
                let (n, elapsed, rate, c, (cs, cm)) = &r;
                let a = stats(&c.actions());
                let w = stats(&c.journal_wall);
                println!(
                    "  {:>4} {:<5} {:>6} {:>10.1} {:>10.0} {:>14.3} {:>14.3} {:>12.1}  {:.3} / {:.3}",
                    rep + 1,
                    v.label,
                    n,
                    elapsed,
                    rate,
                    a.p50,
                    a.p99,
                    w.p50,
                    cs,
                    cm
                );
                v.conc[round].push(r);
            }
        }
        println!("  load average after repetition {}: {}", rep + 1, loadavg());
    }

    for v in &variants {
        model_calls_per_step(&v.env, &v.all_runs, &format!("{}: ", v.label)).await;
        check_ledger(&v.env, &v.all_runs, &format!("{}: ", v.label));
    }
    print_tls_summary(&variants, o);
    println!("  load average after: {}", loadavg());
    for v in variants {
        v.env.shutdown().await;
    }
}

/// `tls / plain` of each repetition's pair (measured next to each other): "median m (lo..hi)".
fn paired_ratios(plain: &[f64], tls: &[f64]) -> String {
    let mut r: Vec<f64> = plain.iter().zip(tls).map(|(p, t)| t / p).collect();
    r.sort_by(|a, b| a.total_cmp(b));
    let s = stats(&r);
    format!(
        "median {:.3} ({:.3}..{:.3})",
        s.p50,
        r.first().copied().unwrap_or(0.0),
        s.max
    )
}

fn print_tls_summary(variants: &[Variant], o: &Opts) {
    let (plain, tls) = (&variants[0], &variants[1]);
    println!();
    println!("================================================================================");
    println!("  Summary: the cost of TLS (same run; pooled over the repetitions)");
    println!("================================================================================");
    println!(
        "  {:<46} {:>11} {:>11} {:>10} {:>11}",
        "", "plain", "tls", "tls/plain", "tls-plain"
    );
    let row = |name: &str, p: f64, t: f64, decimals: usize| {
        println!(
            "    {:<44} {:>11.decimals$} {:>11.decimals$} {:>10.3} {:>+11.decimals$}",
            name,
            p,
            t,
            t / p,
            t - p
        );
    };
    let seq_figures = |v: &Variant| {
        let elapsed: f64 = v.seq_reps.iter().map(|r| r.0).sum();
        let cs: f64 = v.seq_reps.iter().map(|r| r.1.0).sum();
        let cm: f64 = v.seq_reps.iter().map(|r| r.1.1).sum();
        let na = (v.seq.runs * ACTIONS) as f64;
        (na / (elapsed / 1e3), cs / na, cm / na)
    };
    let (pr, pcs, pcm) = seq_figures(plain);
    let (tr, tcs, tcm) = seq_figures(tls);
    println!(
        "  sequential: one run at a time ({} runs x {ACTIONS} actions per variant)",
        plain.seq.runs
    );
    let (pa, ta) = (stats(&plain.seq.actions()), stats(&tls.seq.actions()));
    row("action p50 ms", pa.p50, ta.p50, 3);
    row("action p99 ms", pa.p99, ta.p99, 3);
    row("action mean ms", pa.mean, ta.mean, 3);
    row(
        "model action p50 ms",
        stats(&plain.seq.model).p50,
        stats(&tls.seq.model).p50,
        3,
    );
    row(
        "tool action p50 ms",
        stats(&plain.seq.tool).p50,
        stats(&tls.seq.tool).p50,
        3,
    );
    row(
        "run p50 ms (40 actions; client: submit->seen)",
        stats(&plain.seq.client_wall).p50,
        stats(&tls.seq.client_wall).p50,
        1,
    );
    row(
        "run p50 ms (journal: created->succeeded)",
        stats(&plain.seq.journal_wall).p50,
        stats(&tls.seq.journal_wall).p50,
        1,
    );
    row(
        "submit -> intake's answer p50 ms",
        stats(&plain.seq.submit).p50,
        stats(&tls.seq.submit).p50,
        2,
    );
    row("actions/s", pr, tr, 0);
    let seq_rates = |v: &Variant| -> Vec<f64> {
        v.seq_reps
            .iter()
            .map(|r| (o.runs * ACTIONS) as f64 / (r.0 / 1e3))
            .collect()
    };
    println!(
        "      actions/s tls/plain per repetition (paired): {}",
        paired_ratios(&seq_rates(plain), &seq_rates(tls))
    );
    row("CPU ms/action nats-server", pcs, tcs, 3);
    row("CPU ms/action kedge process", pcm, tcm, 3);
    for (round, &n) in o.concurrency.iter().enumerate() {
        let pooled = |v: &Variant| {
            let rounds = &v.conc[round];
            let mut c = Collected::default();
            for r in rounds {
                c.merge(&r.3);
            }
            let elapsed: f64 = rounds.iter().map(|r| r.1).sum();
            let na = (ACTIONS * n * rounds.len()) as f64;
            let cs = rounds.iter().map(|r| r.4.0).sum::<f64>() / rounds.len() as f64;
            let cm = rounds.iter().map(|r| r.4.1).sum::<f64>() / rounds.len() as f64;
            let rates: Vec<String> = rounds.iter().map(|r| format!("{:.0}", r.2)).collect();
            (c, na / (elapsed / 1e3), cs, cm, rates)
        };
        let (pc, pr, pcs, pcm, prates) = pooled(plain);
        let (tc, tr, tcs, tcm, trates) = pooled(tls);
        println!(
            "  {n} runs at once ({} rounds per variant)",
            plain.conc[round].len()
        );
        row("actions/s (all actions / all elapsed)", pr, tr, 0);
        let rates = |v: &Variant| -> Vec<f64> { v.conc[round].iter().map(|r| r.2).collect() };
        println!(
            "      actions/s tls/plain per round (paired): {}",
            paired_ratios(&rates(plain), &rates(tls))
        );
        let (pa, ta) = (stats(&pc.actions()), stats(&tc.actions()));
        row("action p50 ms", pa.p50, ta.p50, 3);
        row("action p99 ms", pa.p99, ta.p99, 3);
        row(
            "run p50 ms (journal)",
            stats(&pc.journal_wall).p50,
            stats(&tc.journal_wall).p50,
            1,
        );
        row("CPU ms/action nats-server", pcs, tcs, 3);
        row("CPU ms/action kedge process", pcm, tcm, 3);
        println!(
            "    actions/s per round: plain {}; tls {}",
            prates.join(", "),
            trates.join(", ")
        );
    }
    println!(
        "  (both environments live in this process and on these cores: the idle one's CPU is in the other's kedge figure; the load average is printed above)"
    );
}

fn main() {
    let o = opts();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        let started = Instant::now();
        println!(
            "agent_loop bench: K = {K} (model + ledger_append) per run = {ACTIONS} actions + final answer; {} sequential runs; concurrency {:?}; op-cost iterations {}; {} cores",
            o.runs,
            o.concurrency,
            o.micro_iters,
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        let load_start = loadavg();
        println!(
            "nats-server: {}{}; load average {} (other processes on these cores inflate every figure: compare ratios within one run)",
            kedge_testkit::nats_server_binary().display(),
            if o.cluster {
                " (three nodes on this machine, three replicas)"
            } else {
                ""
            },
            load_start
        );
        if o.tls_compare {
            tls_compare(&o).await;
            println!();
            println!("total bench time {:.1} s", started.elapsed().as_secs_f64());
            return;
        }
        let mut results = Vec::new();
        if o.default_mode {
            results.push(run_mode("default sync", false, &o).await);
        }
        if o.always_mode {
            results.push(run_mode("sync always", true, &o).await);
        }
        print_summary(&results);
        println!();
        println!("total bench time {:.1} s", started.elapsed().as_secs_f64());
        if let Some(path) = &o.json {
            let summary = json_summary(&results, &o, &load_start);
            let text = serde_json::to_string_pretty(&summary).expect("JSON summary");
            std::fs::write(path, text + "\n")
                .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            println!("key figures written to {}", path.display());
        }
    });
}
