//! The agent loop end to end: per-action overhead, run latency, throughput, and where a step's
//! time goes — by default measured on Kedge as deployed: `kedge serve all` a process of its own,
//! driven by this process as a client.
//!
//! ```text
//! cargo bench -p kedge --bench agent_loop                          # both durability settings, deployed
//! cargo bench -p kedge --bench agent_loop -- --split               # one `kedge serve <service>` process per service
//! cargo bench -p kedge --bench agent_loop -- --in-process          # the services in this process (diagnostic: op costs)
//! KEDGE_BENCH_SERVICES="intake step tool" cargo bench -p kedge --bench agent_loop -- --quick   # `serve` with only those (diagnostic)
//! KEDGE_LIGHT_LANE=0 cargo bench -p kedge --bench agent_loop -- --quick   # one connection per serve process (A/B)
//! KEDGE_SHARED_NICE=0 cargo bench -p kedge --bench agent_loop -- --quick  # shared threads at the light lane's priority (A/B)
//! KEDGE_BRIDGE_RUNS_LIST_INTERVAL_MS=1000 cargo bench -p kedge --bench agent_loop -- --quick   # the runs list written less often (A/B)
//! KEDGE_BIN=/tmp/kedge-before cargo bench -p kedge --bench agent_loop -- --quick   # another build as the `kedge` processes (A/B)
//! cargo bench -p kedge --bench agent_loop -- --quick               # fewer runs and iterations
//! cargo bench -p kedge --bench agent_loop -- --runs 20 --default-only
//! cargo bench -p kedge --bench agent_loop -- --sync-always-only --no-trace
//! cargo bench -p kedge --bench agent_loop -- --tls-compare         # plain TCP vs TLS, same run (in process)
//! cargo bench -p kedge --bench agent_loop -- --tls-compare --tls-reps 6 --runs 20
//! cargo bench -p kedge --bench agent_loop -- --json FILE         # also write the key figures as JSON
//! cargo bench -p kedge --bench agent_loop -- --sustain 15        # closed-loop window, s (0: none)
//! cargo bench -p kedge --bench agent_loop -- --cluster           # a 3-node cluster on this machine, R3 streams
//! cargo bench -p kedge --bench agent_loop -- --no-park           # leases released after every drive
//! cargo bench -p kedge --bench agent_loop -- --with-projector    # in process, the projector too
//! scripts/bench-vs-restate.sh [--quick]         # Restate first, then this bench: one table, ratios
//! ```
//!
//! **Two topologies.** *Deployed* (the default) measures what users run: a nats-server of its
//! own (kedge-testkit: free port, temporary store; `sync_interval: always` in that setting),
//! `kedge mock-llm` as its own process (the same script as in process), and `kedge serve all`
//! as its own process on default settings but for what the workload needs
//! (`KEDGE_LEDGER_TOOL=1`, the model's key, the workspace root, a worker id; `--no-park` adds
//! `KEDGE_PARK_LEASES=0`), started from the binary built with the bench (`../support`,
//! `Deployed`). This process is only a client: it stores the agent, submits each task to
//! `agent.task.<agent>.<tenant>` (waiting for intake's answer, choosing the run id), follows
//! the runs' terminal decisions with an ordered consumer, and reads the journal back after each
//! measured phase for the journal-stamp figures. `serve all` runs every service of `all`,
//! the projector (the runs list) among them, as users run it. CPU per action is split by
//! process from /proc/<pid>/stat (utime + stime) over each measured phase: nats-server, `kedge
//! serve`, `kedge mock-llm` and the client (this process). `--split` runs one `kedge serve
//! <service>` process per service of `all` (intake, step, tool, projector, reconciler, timer,
//! approval, gateway), each with its own worker id, so that the `kedge serve` CPU splits by
//! service too (eight connections and processes instead of one: a diagnostic, not what a
//! single-host deployment runs). Every process is killed by its pid when the bench ends, panics
//! or is interrupted. What cannot apply as deployed is skipped and says so: the op costs (they
//! call the services' APIs from inside this process). The wiretap and the readback are a
//! client's and run in both.
//!
//! *In process* (`--in-process`, the diagnostic and the figures recorded before the deployed
//! mode): intake + step + tool run as tasks of this process, the mock model on a thread. The
//! throughput figures are not comparable between the two: in process, the services and the
//! client share one process and one allocator, and the projector does not run (unless
//! `--with-projector`). `--tls-compare` and `--with-projector` run in process. `--cluster`
//! (three nodes on this machine, every stream and bucket with three replicas: `KEDGE_REPLICAS=3`
//! for `kedge serve`) runs in either topology.
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
//! answer. In process, everything runs here: a nats-server of its own (kedge-testkit), the strict
//! mock model, and intake + step + tool in this process (as the end-to-end tests run them), each
//! service on its own connection. The projector (the runs list's cache, `kedge_runs`) does not
//! run in process unless `--with-projector` is given: the Restate peer keeps no such list.
//!
//! Throughput two ways: batches of 1, 16 and 64 runs submitted at once, timed until the last one
//! ends (latency under load; a batch's ramp-up and tail run with fewer runs in flight), and a
//! **closed loop** of 64 runs always in flight (each loop submits its next run when its last one
//! ends), counted over a window after a ramp (`--sustain`, default 10 s, 6 s with `--quick`):
//! what the Restate peer's throughput mode measures, and the "actions/s at 64 runs" of the
//! comparison. Its actions are counted by the ledger (two per line: the model call that asked for
//! the tool and the tool call). In the window the journal's durable consumers are sampled every
//! half second (consumer info: the most each held unacknowledged and had left to deliver), and
//! after the loop the bench waits for the projector to catch up and prints how long that took
//! and its CPU: work a projector that trails the stream defers past the window.
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
//! - **op costs** (in process only): the same public APIs the services call (leases, journal,
//!   idempotency KV), timed in a loop on the same server, one request in flight.
//! - **CPU**: utime+stime per phase, from /proc. Deployed: of each process (nats-server, every
//!   `kedge serve`, `kedge mock-llm`, this client). In process: of nats-server and of this
//!   process; the mock model serves on a thread of its own, whose CPU is printed apart and left
//!   out of the process's (a model's work: the Restate peer's `llm` step is a canned answer).
//!
//! `--tls-compare` measures the cost of TLS instead: two environments side by side, one
//! over plain TCP and one where every Kedge connection (runtime, services, watcher) speaks TLS
//! with a client certificate to a server that verifies it (a CA and both certificates generated
//! here with rcgen, as kedge-runtime's connect tests do). The same sequential runs and
//! concurrency rounds alternate between the two, plain/tls then tls/plain (ABBA, so a drifting
//! machine load falls on both alike), and the figures are printed side by side with the ratio
//! TLS / plain. One durability setting: default sync unless `--sync-always-only`; no wiretap,
//! no op costs; in process. Measured once (2 cores, load average ~3, default sync,
//! `--tls-reps 12 --runs 30`):
//! TLS 1.3 adds ~0.11 ms to an action's p50 (1.43 -> 1.54 ms, x1.08), ~4 ms to a 40-action run
//! (x1.07), ~9% CPU per action on both sides, and takes 5-8% off throughput (paired medians
//! 0.92 sequential, 0.93 / 0.95 / 0.94 at 1 / 16 / 64 runs at once).
//!
//! Not a pass/fail test: it prints numbers. It does check that every run succeeded, that the
//! model was called exactly once per step, and that the ledger has one line per operation.
//!
//! The modules, by role: [`workload`] (the agent, its script and the services' configuration),
//! [`env`] (the topology of one environment, deployed or in process: broker, mock model,
//! services, the terminal watcher), [`phases`] (sequential runs, batches, the closed loop, the checks),
//! [`mode`] (one durability setting end to end), [`readback`] (a run read back into figures),
//! [`tap`] (the wiretap), [`costs`] (the op costs), [`measure`] (statistics and CPU
//! accounting), [`report`] and [`json`] (what is printed and written), [`tls`]
//! (`--tls-compare`).

#![allow(clippy::unwrap_used)]

/// The allocator the `kedge` binary runs with (its main.rs): in process (`--in-process`) the
/// services run in this process.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "../support/mod.rs"]
mod support;

mod costs;
mod env;
mod json;
mod measure;
mod mode;
mod phases;
mod readback;
mod report;
mod tap;
mod tls;
mod workload;

use std::time::{Duration, Instant};

use measure::loadavg;

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
    /// not kept, as the Restate peer keeps none. In process only: `kedge serve all` runs it.
    projector: bool,
    /// `--in-process`: the services run in this process (the diagnostic: op costs); by
    /// default Kedge runs as deployed, `kedge serve all` a process of its own.
    in_process: bool,
    /// `--split`: deployed, one `kedge serve <service>` process per service of `all`, so that
    /// the CPU per action splits by service.
    split: bool,
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
        in_process: false,
        split: false,
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
            "--in-process" => o.in_process = true,
            "--split" => o.split = true,
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
    // What only the in-process topology has: TLS, the projector left out.
    let needs_in_process = [
        (o.tls_compare, "--tls-compare"),
        (o.projector, "--with-projector"),
    ];
    for (given, flag) in needs_in_process {
        if given && !o.in_process {
            println!("{flag} runs in process (as --in-process)");
            o.in_process = true;
        }
    }
    if o.split && o.in_process {
        println!("--split is for the deployed topology: ignored in process");
        o.split = false;
    }
    o
}

fn main() {
    let o = opts();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    // Interrupted (SIGINT, SIGTERM), the bench's future is dropped: the processes it started
    // are killed by pid.
    runtime.block_on(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("a SIGTERM handler");
        tokio::select! {
            () = bench(o) => {}
            _ = tokio::signal::ctrl_c() => eprintln!("interrupted: stopping the processes"),
            _ = term.recv() => eprintln!("terminated: stopping the processes"),
        }
    });
}

async fn bench(o: Opts) {
    let started = Instant::now();
    println!(
        "agent_loop bench: K = {K} (model + ledger_append) per run = {ACTIONS} actions + final answer; Kedge {}; {} sequential runs; concurrency {:?}; op-cost iterations {}; {} cores",
        if o.in_process {
            "in this process (--in-process)"
        } else if o.split {
            "as deployed, one `kedge serve <service>` process per service (--split)"
        } else {
            "as deployed: `kedge serve all` a process of its own, this process a client"
        },
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
        tls::tls_compare(&o).await;
        println!();
        println!("total bench time {:.1} s", started.elapsed().as_secs_f64());
        return;
    }
    let mut results = Vec::new();
    if o.default_mode {
        results.push(mode::run_mode("default sync", false, &o).await);
    }
    if o.always_mode {
        results.push(mode::run_mode("sync always", true, &o).await);
    }
    report::print_summary(&results);
    println!();
    println!("total bench time {:.1} s", started.elapsed().as_secs_f64());
    if let Some(path) = &o.json {
        let summary = json::json_summary(&results, &o, &load_start);
        let text = serde_json::to_string_pretty(&summary).expect("JSON summary");
        std::fs::write(path, text + "\n")
            .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        println!("key figures written to {}", path.display());
    }
}
