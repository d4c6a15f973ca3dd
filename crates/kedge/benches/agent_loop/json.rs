//! `--json FILE`: the key figures, for scripts/bench-vs-restate.sh.

use crate::measure::{Stats, loadavg, stats};
use crate::mode::ModeResult;
use crate::tap::per_action_op;
use crate::{ACTIONS, K, Opts};

fn stats_json(s: &Stats) -> serde_json::Value {
    serde_json::json!({"n": s.n, "p50_ms": s.p50, "p99_ms": s.p99, "mean_ms": s.mean, "max_ms": s.max})
}

/// The figures of the report that the comparison with the peers needs, one object per
/// durability setting. Times in ms, CPU in ms per action.
pub fn json_summary(results: &[ModeResult], o: &Opts, load_start: &str) -> serde_json::Value {
    let modes: Vec<serde_json::Value> = results
        .iter()
        .map(|r| {
            let conc: Vec<serde_json::Value> = r
                .conc
                .iter()
                .map(|(n, elapsed, rate, c, cpu)| {
                    serde_json::json!({
                        "runs": n,
                        "elapsed_ms": elapsed,
                        "actions_per_s": rate,
                        "action": stats_json(&stats(&c.actions())),
                        "run_journal": stats_json(&stats(&c.journal_wall)),
                        "cpu_ms_per_action": cpu.json(),
                        "cpu_ms_per_action_by_serve_process": cpu.json_by_process(),
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
                "topology": r.topology,
                "deployed": r.topology != "in process",
                "loadavg_before": r.load.0,
                "loadavg_after": r.load.1,
                "sequential": {
                    "runs": r.seq.runs,
                    "action": stats_json(&stats(&r.seq.actions())),
                    "model_action": stats_json(&stats(&r.seq.model)),
                    "tool_action": stats_json(&stats(&r.seq.tool)),
                    "run_client": stats_json(&stats(&r.seq.client_wall)),
                    "run_journal": stats_json(&stats(&r.seq.journal_wall)),
                    "cpu_ms_per_action": r.seq_cpu.json(),
                    "cpu_ms_per_action_by_serve_process": r.seq_cpu.json_by_process(),
                },
                "concurrency": conc,
                "sustained": r.sustained.as_ref().map(|s| serde_json::json!({
                    "in_flight": s.in_flight,
                    "window_s": s.window_s,
                    "actions": s.actions,
                    "actions_per_s": s.actions_per_s,
                    "cpu_ms_per_action": s.cpu.json(),
                    "cpu_ms_per_action_by_serve_process": s.cpu.json_by_process(),
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
        "topology": if o.in_process { "in process" } else if o.split { "deployed, split" } else { "deployed" },
        "k_iterations": K,
        "actions_per_run": ACTIONS,
        "sequential_runs": o.runs,
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "modes": modes,
    })
}
