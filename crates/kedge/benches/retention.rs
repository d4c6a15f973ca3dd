//! Retention keeps the broker and the reconciler flat: many runs flow through
//! the journal while the retention policy purges those past the horizon; the journal's bytes on
//! disk, the other buckets, the tool workspaces and the per-pass work of the reconciler and of
//! retention stay the same whatever the number of runs that went through.
//!
//! ```text
//! cargo bench -p kedge --bench retention                         # 20000 runs in rounds of 1000
//! cargo bench -p kedge --bench retention -- --runs 100000 --round 5000
//! cargo bench -p kedge --bench retention -- --runs 5000 --round 500 --archive
//! ```
//!
//! Each round:
//! 1. writes `--round` finished runs directly with the journal API, as the services would have
//!    (the pure core's `decide`/`complete_step`: `run.created`, `run.started`, `step.started`,
//!    `step.completed`, `run.succeeded`, one decision append each), the model response's record
//!    in `kedge_idempotency`, the run's summary in `kedge_runs`, and a workspace directory with a
//!    file (as a tool would have); plus one run in 100 that stays waiting on an hour's timer
//!    (never purged: the bench checks they all survive);
//! 2. waits past the horizon (`--horizon-ms`, default 500), runs one retention pass
//!    (`kedge_retention::apply_policy`) and one workspace sweep
//!    (`kedge_tool::workspaces::sweep`);
//! 3. runs one reconciler scan (a `kedge_reconciler::Reconciler` kept across rounds, as the
//!    service keeps it).
//!
//! It prints a row per round: runs written so far, the journal's messages and bytes (stream
//! state) and the broker's store directory on disk, the idempotency and projection buckets'
//! bytes, workspace directories left, what the retention pass read and purged and how long it
//! took, and how many runs the reconciler scan checked and how long it took. Flat columns are
//! the point; "written" grows. Not a pass/fail test, but it checks that every finished run was
//! purged and every waiting run is still whole.
//!
//! What to expect (2 shared cores, `--runs 100000 --round 2000`, about 6 minutes): the journal's
//! live bytes grow only with the runs left waiting (1 in 100: 5 MiB at 100k runs); every pass
//! reads exactly the 1980 terminal events that crossed the horizon and purges their runs (about
//! 3.5 s, ~550 runs/s, the same at 20k and 100k); the reconciler checks the 20 runs still alive
//! that the round touched, in a few ms. The journal's *disk* is a sawtooth: nats-server keeps the
//! space of removed messages in their block files until its periodic compaction (every 2 minutes,
//! the file store's sync interval), so it climbs by what was written meanwhile (~200 MiB at this
//! bench's rate) and falls back to ~20-30 MiB after each compaction (at ~27k, ~63k and ~97k runs);
//! without retention it would grow by ~4.75 KiB a run for good (~475 MiB at 100k runs).

#![allow(clippy::unwrap_used)]

#[path = "support/mod.rs"]
mod support;
use support::*;

use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kedge_core::decide::{ModelResponse, Next, complete_step, decide};
use kedge_core::event::{
    AssistantMessage, Draft, Envelope, FinishReason, RunCreated, Timestamp, ToolCall, Usage,
};
use kedge_core::ids::RunId;
use kedge_core::{RunStatus, fold};
use kedge_retention::{Policy, apply_policy};
use kedge_runtime::idempotency::IdempotencyStore;
use kedge_runtime::{Config, Runtime};
use kedge_testkit::NatsServer;

const WRITERS: usize = 32;

struct Opts {
    runs: usize,
    round: usize,
    horizon: Duration,
    archive: bool,
}

fn opts() -> Opts {
    let mut o = Opts {
        runs: 20_000,
        round: 1_000,
        horizon: Duration::from_millis(500),
        archive: false,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let next = |i: usize| args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--runs" => {
                o.runs = next(i).parse().unwrap();
                i += 1;
            }
            "--round" => {
                o.round = next(i).parse().unwrap();
                i += 1;
            }
            "--horizon-ms" => {
                o.horizon = Duration::from_millis(next(i).parse().unwrap());
                i += 1;
            }
            "--archive" => o.archive = true,
            // `cargo bench` passes `--bench`.
            _ => {}
        }
        i += 1;
    }
    o.round = o.round.clamp(1, o.runs.max(1));
    o
}

fn response(wait: bool) -> ModelResponse {
    let tool_calls = if wait {
        vec![ToolCall {
            call_id: "call_wait".into(),
            name: "wait".into(),
            arguments: serde_json::json!({"seconds": 3600}),
        }]
    } else {
        Vec::new()
    };
    ModelResponse {
        message: AssistantMessage {
            text: if wait {
                String::new()
            } else {
                "Revenue is up 4% on the quarter; costs are flat; the new region opened. ".repeat(8)
            },
            tool_calls,
            thinking: Vec::new(),
        },
        usage: Usage {
            input_tokens: 420,
            output_tokens: 180,
            cost: None,
        },
        finish: if wait {
            FinishReason::ToolCalls
        } else {
            FinishReason::Stop
        },
    }
}

async fn append(
    rt: &Runtime,
    run: &RunId,
    events: &mut Vec<(u64, Envelope)>,
    last_decision: &mut u64,
    drafts: Vec<Draft<kedge_core::Decision>>,
) {
    for d in drafts {
        let env = kedge_core::DecisionEnvelope::new(run.clone(), Timestamp::now(), d);
        let appended = rt
            .journal
            .append_decisions(
                &kedge_journal::DecisionWriter::unfenced(run, "bench"),
                kedge_core::ids::DecisionSeq::at(*last_decision),
                std::slice::from_ref(&env),
            )
            .await
            .unwrap();
        *last_decision = appended.last_seq;
        events.push((appended.last_seq, env.into_envelope()));
    }
}

/// Journals one run to its end (or, `wait`, to waiting on an hour's timer), with what the
/// services would have left for it: the model record, the projection entry, the workspace.
async fn write_run(rt: &Runtime, i: usize, wait: bool, workspaces: &Path) -> RunId {
    let run = RunId::generate();
    let idem = rt.js.get_key_value("kedge_idempotency").await.unwrap();
    let runs = rt.js.get_key_value("kedge_runs").await.unwrap();
    let mut events: Vec<(u64, Envelope)> = Vec::new();
    let mut last = 0;
    let created = Draft::new(kedge_core::Decision::RunCreated(Box::new(RunCreated {
        idempotency_key: Some(format!("flow-{i}")),
        ..created(
            "flow",
            "summarise the quarterly report and say what changed since the last one",
        )
    })));
    append(rt, &run, &mut events, &mut last, vec![created]).await;
    loop {
        let state = fold(events.iter().map(|(s, e)| (*s, e))).unwrap();
        match decide(&state) {
            Next::Commit(d) => append(rt, &run, &mut events, &mut last, d).await,
            Next::Step(plan) => {
                append(rt, &run, &mut events, &mut last, plan.start.clone()).await;
                let response = response(wait);
                idem.put(
                    IdempotencyStore::model_key(&plan.request_id),
                    serde_json::to_vec(&response.message).unwrap().into(),
                )
                .await
                .unwrap();
                let state = fold(events.iter().map(|(s, e)| (*s, e))).unwrap();
                let done = complete_step(
                    &state,
                    plan.step,
                    plan.attempt,
                    plan.request_id,
                    response,
                    false,
                    Timestamp::now(),
                    &Default::default(),
                );
                append(rt, &run, &mut events, &mut last, done).await;
            }
            Next::Finish(_) => unreachable!("the bench appends whole decision groups"),
            Next::Idle(_) => {
                if wait {
                    assert_eq!(state.status, RunStatus::WaitingExternal);
                } else {
                    assert_eq!(state.status, RunStatus::Succeeded);
                }
                let summary =
                    serde_json::json!({"run_id": run, "status": state.status, "last_seq": last});
                runs.put(
                    format!("acme.{run}"),
                    summary.to_string().into_bytes().into(),
                )
                .await
                .unwrap();
                let dir = workspaces.join(run.as_str());
                tokio::fs::create_dir_all(&dir).await.unwrap();
                tokio::fs::write(dir.join("notes.txt"), b"what the tools wrote")
                    .await
                    .unwrap();
                return run;
            }
        }
    }
}

async fn api(client: &async_nats::Client, subject: &str) -> serde_json::Value {
    let reply = client
        .request(format!("$JS.API.{subject}"), "{}".into())
        .await
        .unwrap();
    serde_json::from_slice(&reply.payload).unwrap()
}

/// (messages, bytes) of a stream's state.
async fn stream_state(client: &async_nats::Client, stream: &str) -> (u64, u64) {
    let info = api(client, &format!("STREAM.INFO.{stream}")).await;
    (
        info["state"]["messages"].as_u64().unwrap_or(0),
        info["state"]["bytes"].as_u64().unwrap_or(0),
    )
}

fn disk_bytes(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Bytes on disk of one stream's directory in the broker's store.
fn stream_disk(store: &Path, stream: &str) -> u64 {
    disk_bytes(
        &store
            .join("jetstream")
            .join("$G")
            .join("streams")
            .join(stream),
    )
}

fn dirs(path: &Path) -> usize {
    std::fs::read_dir(path).map_or(0, |d| d.flatten().count())
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn main() {
    let o = opts();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench(o));
}

async fn bench(o: Opts) {
    let server = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let workspaces = dir.path().join("ws");
    std::fs::create_dir_all(&workspaces).unwrap();
    let config = Config {
        nats_urls: vec![server.url()],
        workspace_root: workspaces.clone(),
        worker_id: "bench-retention".parse().expect("worker id"),
        ..Config::default()
    };
    let rt = Runtime::connect(config).await.unwrap();
    let policy = Policy {
        finished_after: o.horizon,
        archive: o.archive,
        batch: 256,
    };
    println!(
        "retention bench: {} runs in rounds of {} (1 in 100 left waiting), horizon {:?}, archive {}, {WRITERS} writers",
        o.runs, o.round, o.horizon, o.archive
    );
    println!(
        "{:>8} {:>8} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>6} | {:>6} {:>7} {:>8} {:>7} | {:>7} {:>8}",
        "written",
        "waiting",
        "jrnl msgs",
        "jrnl MiB",
        "jrnl disk",
        "store MiB",
        "idem MiB",
        "proj MiB",
        "ws",
        "read",
        "purged",
        "pass ms",
        "runs/s",
        "checked",
        "scan ms"
    );
    let mut reconciler = kedge_reconciler::Reconciler::new(rt.clone());
    let mut waiting: Vec<RunId> = Vec::new();
    let mut finished: Vec<RunId> = Vec::new();
    let mut written = 0;
    let t_all = Instant::now();
    let mut write_time = Duration::ZERO;
    while written < o.runs {
        let n = o.round.min(o.runs - written);
        let t0 = Instant::now();
        let new: Vec<(bool, RunId)> = futures::stream::iter(written..written + n)
            .map(|i| {
                let rt = &rt;
                let ws = &workspaces;
                async move {
                    let wait = i % 100 == 99;
                    (wait, write_run(rt, i, wait, ws).await)
                }
            })
            .buffer_unordered(WRITERS)
            .collect()
            .await;
        write_time += t0.elapsed();
        for (wait, run) in new {
            if wait {
                waiting.push(run);
            } else {
                finished.push(run);
            }
        }
        written += n;
        tokio::time::sleep(o.horizon + Duration::from_millis(50)).await;
        let t1 = Instant::now();
        let pass = apply_policy(&rt, policy).await.unwrap();
        let pass_time = t1.elapsed();
        assert_eq!(pass.failed, 0, "{pass:?}");
        kedge_tool::workspaces::sweep(&workspaces, &rt.journal, Duration::ZERO)
            .await
            .unwrap();
        let t2 = Instant::now();
        let scan = reconciler.scan().await.unwrap();
        let scan_time = t2.elapsed();
        let (msgs, bytes) = stream_state(&rt.client, "KEDGE_RUNS").await;
        let (_, idem) = stream_state(&rt.client, "KV_kedge_idempotency").await;
        let (_, proj) = stream_state(&rt.client, "KV_kedge_runs").await;
        println!(
            "{:>8} {:>8} {:>9} {:>9.2} {:>9.2} {:>9.2} {:>8.2} {:>8.2} {:>6} | {:>6} {:>7} {:>8.0} {:>7.0} | {:>7} {:>8.0}",
            written,
            waiting.len(),
            msgs,
            mib(bytes),
            mib(stream_disk(server.store_dir(), "KEDGE_RUNS")),
            mib(disk_bytes(server.store_dir())),
            mib(idem),
            mib(proj),
            dirs(&workspaces),
            pass.read,
            pass.purged,
            pass_time.as_secs_f64() * 1e3,
            pass.purged as f64 / pass_time.as_secs_f64().max(1e-9),
            scan.runs,
            scan_time.as_secs_f64() * 1e3
        );
    }
    // Every finished run is gone, every waiting one is whole.
    let step = (finished.len() / 200).max(1);
    for run in finished.iter().step_by(step) {
        assert!(
            rt.journal.last_seq(run).await.unwrap().is_none(),
            "{run} purged"
        );
    }
    for run in &waiting {
        let events = rt.journal.read(run, 0).await.unwrap();
        let state = fold(events.iter().map(|r| (r.seq, &r.envelope))).unwrap();
        assert_eq!(state.status, RunStatus::WaitingExternal, "{run} untouched");
        assert!(
            workspaces.join(run.as_str()).exists(),
            "{run}'s workspace kept"
        );
    }
    let store = server.store_dir();
    let mut by_stream: Vec<(String, u64)> =
        std::fs::read_dir(store.join("jetstream").join("$G").join("streams"))
            .map(|d| {
                d.flatten()
                    .map(|e| {
                        (
                            e.file_name().to_string_lossy().into_owned(),
                            disk_bytes(&e.path()),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
    by_stream.sort_by_key(|b| std::cmp::Reverse(b.1));
    println!(
        "store on disk by stream: {}",
        by_stream
            .iter()
            .map(|(n, b)| format!("{n} {:.2} MiB", mib(*b)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let last = rt.journal.stream_last_seq().await.unwrap();
    println!(
        "done: {written} runs ({} messages appended in all) in {:.1} s ({:.1} s writing); \
         {} finished runs purged, {} waiting runs untouched",
        last,
        t_all.elapsed().as_secs_f64(),
        write_time.as_secs_f64(),
        finished.len(),
        waiting.len()
    );
}
