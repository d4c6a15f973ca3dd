//! The report: every table and line the bench prints for one durability setting, and the
//! summary of all of them.

use std::collections::HashMap;

use crate::costs::OpCost;
use crate::measure::{Stats, stats};
use crate::mode::ModeResult;
use crate::phases::ConcRound;
use crate::readback::{Collected, SEGMENTS};
use crate::tap::{TapReport, per_action_op};
use crate::{ACTIONS, K};

pub fn print_sequential(c: &Collected, runs: usize) {
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

pub fn print_segments(c: &Collected) {
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

pub fn print_conc_segments(conc: &[ConcRound]) {
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

pub fn print_tap(rep: &TapReport, wall: f64) {
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

pub fn print_costs(costs: &[OpCost], seq: &Collected) {
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

/// The summary's short name of a topology.
fn short_topology(t: &str) -> &str {
    match t {
        "deployed" => "deployed",
        "deployed, split" => "split",
        _ => "in-proc",
    }
}

pub fn print_summary(results: &[ModeResult]) {
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
            format!("Kedge ({}, {})", r.label, short_topology(r.topology)),
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
        for (n, elapsed, rate, c, cpu) in &r.conc {
            let a = stats(&c.actions());
            println!(
                "    {n:>3} runs: {rate:7.0} actions/s ({elapsed:.0} ms), action p50 {:.3} ms, CPU ms/action: {}",
                a.p50,
                cpu.describe()
            );
        }
        if let Some(s) = &r.sustained {
            println!(
                "    closed loop of {}: {:.0} actions/s, CPU ms/action: {}",
                s.in_flight,
                s.actions_per_s,
                s.cpu.describe()
            );
        }
    }
}
