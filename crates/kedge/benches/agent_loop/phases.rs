//! The phases of a measurement: batches of runs submitted at once, the closed loop of runs
//! always in flight, and the checks every setting ends with (model calls per step, one ledger
//! line per operation).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kedge_core::ids::RunId;

use crate::env::{Env, RunTiming};
use crate::measure::{Cpu, ms};
use crate::readback::{Collected, collect};
use crate::{ACTIONS, K};

/// One concurrency round: (runs, elapsed ms, actions/s, what was collected, CPU ms per action
/// by process).
pub type ConcRound = (usize, f64, f64, Collected, Cpu);

/// Model calls per step over `all_runs` (printed, prefixed with `who`); run before anything else
/// calls the mock.
pub async fn model_calls_per_step(env: &Env, all_runs: &[RunId], who: &str) -> f64 {
    let (total_calls, repeated) = env.model_calls().await;
    let mut total_steps = 0u64;
    for r in all_runs {
        let evs = env.rt.journal.read(r, 0).await.expect("read");
        let s = kedge_core::fold(evs.iter().map(|x| (x.seq, &x.envelope))).expect("fold");
        total_steps += u64::from(s.step.get());
    }
    let calls_per_step = total_calls as f64 / total_steps as f64;
    println!();
    println!(
        "  {who}Model calls per step: {} calls / {} steps over {} runs = {:.3}  (request ids called more than once: {repeated})",
        total_calls,
        total_steps,
        all_runs.len(),
        calls_per_step
    );
    calls_per_step
}

/// The ledger has exactly one line per operation of `all_runs` (printed, prefixed with `who`;
/// asserted), and every submitted run is counted.
pub fn check_ledger(env: &Env, all_runs: &[RunId], who: &str) {
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
pub async fn conc_round(
    env: &mut Env,
    key: &str,
    n: usize,
    all_runs: &mut Vec<RunId>,
) -> ConcRound {
    let chosen: Vec<RunId> = (0..n).map(|_| RunId::generate()).collect();
    let tenant = "bench".parse().expect("tenant");
    let runs: Vec<RunId> = chosen
        .iter()
        .map(|c| kedge_runtime::run_ids::chosen(&tenant, c))
        .collect();
    let rxs: Vec<_> = runs.iter().map(|r| env.terminals.register(r)).collect();
    let cpu0 = env.cpu_mark();
    let t0 = Instant::now();
    let env_ref = &*env;
    let submits = chosen
        .iter()
        .zip(&runs)
        .enumerate()
        .map(|(i, (c, r))| async move {
            let s = Instant::now();
            env_ref.submit(c, r, &format!("{key}-{n}-{i}")).await;
            ms(s.elapsed())
        });
    let submit_ms = futures::future::join_all(submits).await;
    let mut timings = Vec::new();
    for ((r, rx), sub) in runs.iter().zip(rxs).zip(submit_ms) {
        let (at, _) = env.terminal(r, rx).await;
        timings.push(RunTiming {
            run: r.clone(),
            submit: sub,
            wall: ms(at - t0),
        });
    }
    let elapsed = timings.iter().map(|t| t.wall).fold(0.0, f64::max);
    let cpu = env.cpu_since(&cpu0);
    env.submitted += n;
    let mut c = Collected::default();
    collect(env, &timings, &mut c).await;
    all_runs.extend(runs.iter().cloned());
    let rate = (ACTIONS * n) as f64 / (elapsed / 1e3);
    let na = (ACTIONS * n) as f64;
    (n, elapsed, rate, c, cpu.per(na))
}

/// The closed-loop phase: `n` runs always in flight (each of `n` loops submits its next run as
/// soon as its last one ends), as the Restate peer's throughput mode measures; a single batch
/// (`conc_round`) also times its ramp-up and its tail, where fewer than `n` runs are left.
pub struct Sustained {
    pub in_flight: usize,
    /// The measured window (after the ramp), s.
    pub window_s: f64,
    /// Actions completed in the window: two per ledger line (one model call asking for the
    /// tool, one tool call), as the peer counts its `llm` and `tool` steps.
    pub actions: u64,
    pub actions_per_s: f64,
    /// CPU ms per action in the window, by process.
    pub cpu: Cpu,
    /// Runs completed over the whole phase (ramp, window and drain).
    pub runs: usize,
    /// From the end of the window until every loop's last run ended, s.
    pub drain_s: f64,
}

/// Lines of the ledger file so far: one per tool call of the `ledger_append` built-in.
fn ledger_lines(env: &Env) -> u64 {
    std::fs::read(env.config.workspace_root.join("ledger.log"))
        .map(|b| b.iter().filter(|&&c| c == b'\n').count() as u64)
        .unwrap_or(0)
}

pub async fn sustained(
    env: &mut Env,
    key: &str,
    n: usize,
    ramp: Duration,
    window: Duration,
    all_runs: &mut Vec<RunId>,
) -> Sustained {
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
        let (lines0, cpu0, t0) = (ledger_lines(env_ref), env_ref.cpu_mark(), Instant::now());
        tokio::time::sleep(window).await;
        let (lines1, cpu, secs) = (
            ledger_lines(env_ref),
            env_ref.cpu_since(&cpu0),
            t0.elapsed().as_secs_f64(),
        );
        stop_ref.store(true, std::sync::atomic::Ordering::Relaxed);
        (2 * lines1.saturating_sub(lines0), cpu, secs, Instant::now())
    };
    let (runs, (actions, cpu, secs, stopped)) = futures::join!(loops, measure);
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
        cpu: cpu.per(per),
        runs: count,
        drain_s,
    }
}
