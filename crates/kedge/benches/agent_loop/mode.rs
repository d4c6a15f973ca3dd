//! One durability setting, end to end: an environment of its own (deployed, or in process),
//! warm-up, sequential runs, batches, the closed loop, the traced run, the op costs (in process
//! only), and the checks.

use std::time::{Duration, Instant};

use kedge_core::ids::RunId;

use crate::costs::op_costs;
use crate::env::{Env, RunTiming};
use crate::measure::{Cpu, loadavg, ms, stats};
use crate::phases::{
    ConcRound, Sustained, check_ledger, conc_round, list_catch_up, model_calls_per_step, sustained,
};
use crate::readback::{Collected, collect};
use crate::report::{
    print_conc_segments, print_costs, print_segments, print_sequential, print_tap,
};
use crate::tap::{TapReport, analyze_tap, start_tap};
use crate::{ACTIONS, Opts};

pub struct ModeResult {
    pub label: &'static str,
    pub sync_always: bool,
    pub seq: Collected,
    pub conc: Vec<ConcRound>,
    /// The closed-loop phase (`--sustain 0`: none).
    pub sustained: Option<Sustained>,
    pub calls_per_step: f64,
    /// CPU ms per action during the sequential runs, by process.
    pub seq_cpu: Cpu,
    /// Whether Kedge ran as deployed (its own processes), and how ("deployed", "deployed,
    /// split", "in process").
    pub topology: &'static str,
    /// The wiretap of the traced run (`--no-trace`: none).
    pub tap: Option<TapReport>,
    /// Load average before and after this setting's measurements.
    pub load: (String, String),
}

/// The sequential runs of one setting: their timings, what was collected from them, and the
/// CPU ms per action by process.
struct Sequential {
    timings: Vec<RunTiming>,
    seq: Collected,
    cpu: Cpu,
}

pub async fn run_mode(label: &'static str, sync_always: bool, o: &Opts) -> ModeResult {
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
    let (mut env, topology) = if o.in_process {
        let env = Env::start(sync_always, None, "", o.cluster, !o.no_park, o.projector).await;
        (env, "in process")
    } else if o.split {
        (
            Env::start_deployed(sync_always, !o.no_park, true, o.cluster).await,
            "deployed, split",
        )
    } else {
        (
            Env::start_deployed(sync_always, !o.no_park, false, o.cluster).await,
            "deployed",
        )
    };
    println!("  {}", env.describe());

    // Warm-up: connections, HTTP pool, agent cache, consumers.
    let mut all_runs: Vec<RunId> = Vec::new();
    for i in 0..2 {
        let t = env.run_one(format!("{label}-warm-{i}")).await;
        all_runs.push(t.run.clone());
        env.submitted += 1;
    }

    // 1 + 2: sequential runs.
    let sequential = sequential(&mut env, label, o, &mut all_runs).await;

    // 5 (live): segments of the steady-state loop.
    print_segments(&sequential.seq);

    // 3: concurrency.
    let conc = concurrency(&mut env, label, o, &mut all_runs).await;

    // 3b: the closed loop, 64 runs always in flight, as the peer's throughput mode.
    let sustained = closed_loop(&mut env, label, o, &mut all_runs).await;

    // 4: model calls per step, before anything else calls the mock.
    let calls_per_step = model_calls_per_step(&env, &all_runs, "").await;

    // Traced run: the wiretap.
    let mut tap = None;
    if o.trace {
        tap = Some(traced(&mut env, label, &mut all_runs).await);
    }

    // 5: op costs, on an idle server (the services would drive the runs the bench writes).
    env.stop_services().await;
    if env.deployed() {
        println!();
        println!(
            "  Op costs: not measured as deployed (they time the services' own APIs from inside this process; --in-process measures them)"
        );
    } else {
        let sample = sequential
            .timings
            .last()
            .map(|t| t.run.clone())
            .expect("a sequential run");
        let (costs, _) = op_costs(&env, &sample, o.micro_iters).await;
        print_costs(&costs, &sequential.seq);
    }

    // The ledger: exactly one line per operation.
    check_ledger(&env, &all_runs, "");

    let load_after = loadavg();
    println!("  load average after: {load_after}");
    env.shutdown().await;
    ModeResult {
        label,
        sync_always,
        seq: sequential.seq,
        conc,
        sustained,
        calls_per_step,
        seq_cpu: sequential.cpu,
        topology,
        tap,
        load: (load_before, load_after),
    }
}

/// `o.runs` runs one at a time, read back and printed with the CPU they took.
async fn sequential(env: &mut Env, label: &str, o: &Opts, all_runs: &mut Vec<RunId>) -> Sequential {
    let mut seq_timings = Vec::new();
    let cpu0 = env.cpu_mark();
    let seq_t0 = Instant::now();
    for i in 0..o.runs {
        let t = env.run_one(format!("{label}-seq-{i}")).await;
        seq_timings.push(t);
        env.submitted += 1;
    }
    let seq_elapsed = ms(seq_t0.elapsed());
    let cpu = env.cpu_since(&cpu0);
    let mut seq = Collected::default();
    collect(env, &seq_timings, &mut seq).await;
    all_runs.extend(seq_timings.iter().map(|t| t.run.clone()));

    print_sequential(&seq, o.runs);
    let n_actions = (o.runs * ACTIONS) as f64;
    println!(
        "  CPU ms/action during the sequential runs: {}; {:.0}% of one core busy in total",
        cpu.per(n_actions).describe(),
        cpu.total() / seq_elapsed * 100.0
    );
    Sequential {
        timings: seq_timings,
        seq,
        cpu: cpu.per(n_actions),
    }
}

/// One batch per level of `o.concurrency`, printed as a table, then their loop segments.
async fn concurrency(
    env: &mut Env,
    label: &str,
    o: &Opts,
    all_runs: &mut Vec<RunId>,
) -> Vec<ConcRound> {
    println!();
    println!("  Throughput (submit all, wait for all terminal; actions/s = 40 x N / elapsed)");
    println!(
        "  {:>5} {:>10} {:>12} {:>14} {:>14} {:>12} {:>12}  CPU ms/action ({})",
        "runs",
        "elapsed ms",
        "actions/s",
        "action p50 ms",
        "action p99 ms",
        "run p50 ms",
        "run max ms",
        if env.deployed() {
            "server / kedge serve / client"
        } else {
            "server / kedge"
        },
    );
    let mut conc = Vec::new();
    for (round, &n) in o.concurrency.iter().enumerate() {
        let r = conc_round(env, &format!("{label}-c{round}"), n, all_runs).await;
        let (n, elapsed, rate, c, cpu) = &r;
        let a = stats(&c.actions());
        let w = stats(&c.journal_wall);
        println!(
            "  {:>5} {:>10.1} {:>12.0} {:>14.3} {:>14.3} {:>12.1} {:>12.1}  {}",
            n,
            elapsed,
            rate,
            a.p50,
            a.p99,
            w.p50,
            w.max,
            cpu.cell()
        );
        conc.push(r);
    }
    print_conc_segments(&conc);
    conc
}

/// The closed loop (`--sustain`, 0: none) at the highest concurrency level, printed.
async fn closed_loop(
    env: &mut Env,
    label: &str,
    o: &Opts,
    all_runs: &mut Vec<RunId>,
) -> Option<Sustained> {
    if o.sustain_s <= 0.0 {
        return None;
    }
    let n = o.concurrency.iter().copied().max().unwrap_or(64);
    let ramp = Duration::from_secs_f64((o.sustain_s / 4.0).clamp(1.0, 5.0));
    let s = sustained(
        env,
        &format!("{label}-loop"),
        n,
        ramp,
        Duration::from_secs_f64(o.sustain_s),
        all_runs,
    )
    .await;
    println!();
    println!(
        "  Closed loop, {} runs always in flight ({:.1} s ramp, then {:.1} s measured): {:.0} actions/s ({} actions); CPU ms/action: {}; {} runs in all, drained {:.1} s after the window",
        s.in_flight,
        ramp.as_secs_f64(),
        s.window_s,
        s.actions_per_s,
        s.actions,
        s.cpu.describe(),
        s.runs,
        s.drain_s
    );
    if !s.backlog.is_empty() {
        let parts: Vec<String> = s.backlog.iter().map(ToString::to_string).collect();
        println!(
            "  Journal consumers in the window, at most: {}",
            parts.join("; ")
        );
    }
    match list_catch_up(env, all_runs).await {
        Some((secs, cpu)) => println!(
            "  Runs list: every run listed as ended {secs:.1} s after the last one ended; CPU ms meanwhile: {} (per action of the window: {:.3} in all)",
            cpu.describe(),
            cpu.total() / s.actions.max(1) as f64
        ),
        None => println!(
            "  Runs list: some runs not listed as ended two minutes after the last one ended"
        ),
    }
    Some(s)
}

/// One more run under the wiretap, analysed and printed.
async fn traced(env: &mut Env, label: &str, all_runs: &mut Vec<RunId>) -> TapReport {
    let (tap_client, store, task) = start_tap(&env.urls()[0]).await;
    let t = env.run_one(format!("{label}-traced")).await;
    env.submitted += 1;
    all_runs.push(t.run.clone());
    tokio::time::sleep(Duration::from_millis(100)).await;
    task.abort();
    drop(tap_client);
    let recs = std::mem::take(&mut *store.lock().unwrap());
    let rep = analyze_tap(&recs, &t.run);
    print_tap(&rep, t.wall);
    rep
}
