//! The phases of a measurement: batches of runs submitted at once, the closed loop of runs
//! always in flight, and the checks every setting ends with (model calls per step, one ledger
//! line per operation).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kedge_core::ids::RunId;

use crate::env::{Env, RunTiming};
use crate::measure::{Cpu, ms};
use crate::readback::{Collected, collect};
use crate::support::deployed::journal_consumer;
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
    /// The journal's consumers sampled in the window ([`Backlog`]).
    pub backlog: Vec<Backlog>,
}

/// The most one durable consumer of the journal held unacknowledged and had left to deliver,
/// sampled every half second in the closed loop's window (consumer info, one request each). A
/// consumer held at its `max_ack_pending` falls behind the stream, and nats-server then finds
/// its next message the expensive way (see docs/PERFORMANCE.md, "The runs list in the agent
/// loop").
pub struct Backlog {
    pub consumer: &'static str,
    pub max_ack_pending: usize,
    pub max_unacked: usize,
    pub max_behind: u64,
    /// Left to deliver at the last sample, at the window's end.
    pub end_behind: u64,
}

impl std::fmt::Display for Backlog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} unacked (bound {}), {} behind ({} at the end)",
            self.consumer, self.max_unacked, self.max_ack_pending, self.max_behind, self.end_behind
        )
    }
}

/// Samples the journal's durable consumers every half second until `until` (see [`Backlog`]);
/// a consumer the deployment does not run is left out.
async fn sample_backlog(env: &Env, until: Instant) -> Vec<Backlog> {
    use kedge_core::subjects::{Durable, RUNS_STREAM};
    let mut out: Vec<Backlog> = Vec::new();
    let stream = env.rt.js.get_stream(RUNS_STREAM).await.ok();
    loop {
        let now = Instant::now();
        if now >= until {
            return out;
        }
        tokio::time::sleep((until - now).min(Duration::from_millis(500))).await;
        let Some(stream) = &stream else { continue };
        for d in Durable::ALL
            .into_iter()
            .filter(|d| d.stream() == RUNS_STREAM)
        {
            let Ok(info) = stream.consumer_info(d.name()).await else {
                continue;
            };
            let at = match out.iter().position(|b| b.consumer == d.name()) {
                Some(at) => at,
                None => {
                    out.push(Backlog {
                        consumer: d.name(),
                        max_ack_pending: usize::try_from(info.config.max_ack_pending).unwrap_or(0),
                        max_unacked: 0,
                        max_behind: 0,
                        end_behind: 0,
                    });
                    out.len() - 1
                }
            };
            let b = &mut out[at];
            b.max_unacked = b.max_unacked.max(info.num_ack_pending);
            b.max_behind = b.max_behind.max(info.num_pending);
            b.end_behind = info.num_pending;
        }
    }
}

/// How long after the closed loop's last run the runs list took to catch up: every run of
/// `runs` listed as finished (the step service writes a run's end as it journals it), and the
/// projector's consumer (when the deployment runs one) with nothing left to deliver or
/// unacknowledged; and the CPU spent meanwhile: work a list that trails defers past the
/// measured window. `None` when it did not catch up within two minutes.
pub async fn list_catch_up(env: &Env, runs: &[RunId]) -> Option<(f64, Cpu)> {
    use kedge_core::subjects::Durable;
    let list = kedge_runtime::projection::Projection::open(&env.rt)
        .await
        .ok()?;
    let tenant: kedge_core::ids::TenantId = "bench".parse().ok()?;
    let (cpu0, t0) = (env.cpu_mark(), Instant::now());
    while t0.elapsed() < Duration::from_secs(120) {
        let drained = match journal_consumer(&env.rt.js, Durable::Projector).await {
            Some(info) => info.num_pending == 0 && info.num_ack_pending == 0,
            None => true,
        };
        let listed = drained
            && list.list(&tenant).await.is_ok_and(|summaries| {
                let ended: std::collections::HashSet<&RunId> = summaries
                    .iter()
                    .filter(|s| s.finished)
                    .map(|s| &s.run_id)
                    .collect();
                runs.iter().all(|r| ended.contains(r))
            });
        if listed {
            return Some((t0.elapsed().as_secs_f64(), env.cpu_since(&cpu0)));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
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
        let backlog = sample_backlog(env_ref, t0 + window).await;
        let (lines1, cpu, secs) = (
            ledger_lines(env_ref),
            env_ref.cpu_since(&cpu0),
            t0.elapsed().as_secs_f64(),
        );
        stop_ref.store(true, std::sync::atomic::Ordering::Relaxed);
        (
            2 * lines1.saturating_sub(lines0),
            cpu,
            secs,
            Instant::now(),
            backlog,
        )
    };
    let (runs, (actions, cpu, secs, stopped, backlog)) = futures::join!(loops, measure);
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
        backlog,
    }
}
