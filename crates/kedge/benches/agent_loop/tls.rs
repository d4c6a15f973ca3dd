//! `--tls-compare`: plain TCP vs TLS on the same workload, in the same sitting. Two
//! environments side by side, the same sequential runs and concurrency rounds alternating
//! between them (plain/tls, then tls/plain), printed side by side with the ratio TLS / plain.

use std::collections::HashSet;
use std::time::Instant;

use kedge_core::ids::RunId;
use kedge_testkit::tls::Pki;

use crate::env::Env;
use crate::measure::{cpu_mark, cpu_since, loadavg, ms, stats};
use crate::phases::{ConcRound, check_ledger, conc_round, model_calls_per_step};
use crate::readback::{Collected, collect};
use crate::{ACTIONS, Opts};

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

pub async fn tls_compare(o: &Opts) {
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
        warm_up(v).await;
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
            sequential_rep(&mut variants[i], o, rep).await;
        }
        // Concurrency rounds, level by level, alternating at each level.
        for (round, &n) in o.concurrency.iter().enumerate() {
            for &i in &order {
                concurrency_rep(&mut variants[i], rep, round, n).await;
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

/// Warm-up (connections, HTTP pool, agent cache, consumers), then the check that the server
/// sees every Kedge connection speak TLS in the TLS variant and none in the plain one.
async fn warm_up(v: &mut Variant) {
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

/// Repetition `rep`'s sequential runs of one variant, printed as a row of the table.
async fn sequential_rep(v: &mut Variant, o: &Opts, rep: usize) {
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

/// Repetition `rep`'s round of `n` runs at once (level `round`) of one variant, printed as a
/// row of the table.
async fn concurrency_rep(v: &mut Variant, rep: usize, round: usize, n: usize) {
    let key = format!("{}-r{rep}-c{round}", v.label);
    let r = conc_round(&mut v.env, &key, n, &mut v.all_runs).await;
    let (n, elapsed, rate, c, cpu) = &r;
    let (cs, cm) = (cpu.server, cpu.kedge);
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

/// One row of the summary: the plain and TLS figures, their ratio and their difference.
fn row(name: &str, p: f64, t: f64, decimals: usize) {
    println!(
        "    {:<44} {:>11.decimals$} {:>11.decimals$} {:>10.3} {:>+11.decimals$}",
        name,
        p,
        t,
        t / p,
        t - p
    );
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
    print_tls_sequential(plain, tls, o);
    for (round, &n) in o.concurrency.iter().enumerate() {
        print_tls_level(plain, tls, round, n);
    }
    println!(
        "  (both environments live in this process and on these cores: the idle one's CPU is in the other's kedge figure; the load average is printed above)"
    );
}

/// The summary of the sequential runs, pooled over the repetitions.
fn print_tls_sequential(plain: &Variant, tls: &Variant, o: &Opts) {
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
}

/// The summary of the rounds of `n` runs at once (concurrency level `round`), pooled over the
/// repetitions.
fn print_tls_level(plain: &Variant, tls: &Variant, round: usize, n: usize) {
    let pooled = |v: &Variant| {
        let rounds = &v.conc[round];
        let mut c = Collected::default();
        for r in rounds {
            c.merge(&r.3);
        }
        let elapsed: f64 = rounds.iter().map(|r| r.1).sum();
        let na = (ACTIONS * n * rounds.len()) as f64;
        let cs = rounds.iter().map(|r| r.4.server).sum::<f64>() / rounds.len() as f64;
        let cm = rounds.iter().map(|r| r.4.kedge).sum::<f64>() / rounds.len() as f64;
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
