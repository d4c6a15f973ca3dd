//! Outage: N runs in flight through a model provider's outage, as deployed. Black-box: real
//! processes configured by their environment alone, observed only through the journal, the
//! `kedge_providers` bucket and the mock model's counters (docs/ARCHITECTURE.md "Provider
//! trouble"; the settings are docs/CONFIG.md "Provider trouble (`providers.*`)").
//!
//! ```text
//! cargo bench -p kedge --bench outage                                   # 500 runs, 60 s outage
//! cargo bench -p kedge --bench outage -- --runs 50 --outage-secs 20
//! cargo bench -p kedge --bench outage -- --runs 200 --outage-secs 30 --release-per-second 20 --rpm 1500
//! cargo bench -p kedge --bench outage -- --outage-secs 600 --steps 2     # the 10-minute goal
//! ```
//!
//! Options: `--runs N` (500), `--outage-secs T` (60), `--kind K` (`unavailable`; also
//! `overloaded`, `rate_limited`, `reset`, `stream_cut`: the mock's trouble kinds), `--rpm RPM`
//! (none: the model's `requests_per_minute` from the recovery on, and the fleet's
//! `KEDGE_PROVIDER_LIMITS`), `--learn` (with `--rpm`: the fleet is not told the limit and keeps
//! to the one the mock's rate-limit headers name), `--cap-secs S` (T + 300: the
//! longest wait for the runs to end after the recovery), `--steps N` (1: `kedge serve all`
//! processes), `--probe-interval D` (`1s`), `--max-probe-interval D` (`2s`),
//! `--release-per-second N` (20) — the last three passed as `KEDGE_PROVIDER_PROBE_INTERVAL`,
//! `KEDGE_PROVIDER_MAX_PROBE_INTERVAL`, `KEDGE_PROVIDER_RELEASE_PER_SECOND` to every serve
//! process —, `--logs DIR` (keep the processes' logs there), `--log FILTER` (their `KEDGE_LOG`,
//! `warn`).
//!
//! Setup: one nats-server (kedge-testkit: free port, temporary store); `kedge mock-llm` as its own
//! process (a free port, a script file; driven over its `/_mock/*` endpoints); `--steps`
//! `kedge serve all` processes. Every `KEDGE_*` variable of the bench's own environment is
//! removed from theirs; their whole configuration is environment variables (NATS URL, worker
//! id, workspace root, the model key variable, the `KEDGE_PROVIDER_*` above). The bench is a
//! client from outside: it stores the agent, submits tasks on `agent.task.<agent>` (as
//! `kedge submit` does) and reads the journal with an ordered consumer over `agent.run.>`.
//!
//! Workload: `--runs` runs of an agent whose model answers three `list_files` tool steps, then
//! a text answer, each after 50 ms. The runs are submitted (32 at a time); once about half of
//! them have journaled their first `step.started`, the mock is put in trouble (`PUT
//! /_mock/trouble`) for T seconds while the rest are still submitted and the others come to
//! their next step. The mock's `troubled` counter (calls answered with the trouble) is sampled
//! every second. At the end the mock's script gets `limits.requests_per_minute` (with `--rpm`;
//! replacing the script also empties its rate window) and the trouble is deleted: that instant
//! is the recovery **R**. Then the bench waits for every run to end (at most `--cap-secs`).
//!
//! Printed, one line per figure, then one `SUMMARY outage …` line:
//!
//! - runs succeeded / failed / not finished, and the failure reasons;
//! - requests to the failing endpoint during the outage: all troubled calls, and the rate over
//!   its steady part (from 5 s after it began to its end) from the whole fleet, with the
//!   breaker's probe settings;
//! - for each run `waiting_provider` at R (the fold of its journal up to the stream's last
//!   sequence at R): R → its next model call (the envelope time `at` of its first
//!   `step.started` after R whose call was not held by the breaker): p50, p99, max, against
//!   what the release rate (and the RPM) allow for that many runs, `runs / min(rate, RPM/60)`,
//!   and the ratio max / allowed. The same from the first release after R (the breaker's probe
//!   succeeding first: R → that probe is at most `max_probe_interval`), and when the probe and
//!   the first release came;
//! - with `--rpm`: the 429s after R (`model.attempt` with `status` 429 or `rate_limited` in the
//!   journal), and how many of them met a waiting run's released call (the release's own; the
//!   others are the released runs' next steps); and the mock's calls after R that did not
//!   complete a step;
//! - model calls per completed step: (mock calls − troubled) / `step.completed` (~1.0).
//!
//! Goals: 500 runs through a 10-minute outage with 0 failed; ≤ 1 request/s to the failing
//! endpoint from the whole fleet; every run's next call after recovery within 10 % of what the
//! release rate / RPM allows; no 429 caused by the release.
//!
//! Read R → next call with the probe in mind: after R the breaker is still open until its next
//! probe, which comes up to the probe interval reached by then after R (doubling from
//! `probe_interval` to `max_probe_interval`, and past it in a long outage to 1/300 of its length
//! so far, docs/CONFIG.md); the release rate cannot account for that wait, hence the second set
//! of figures, from the first release after R.
//!
//! Every wait is capped; the child processes are killed by pid when the bench ends, panics or is
//! interrupted (a guard), and the temporary directory (store, workspaces, script, logs unless
//! `--logs`) is removed.

#[path = "support/mod.rs"]
mod support;
use support::deployed::{Children, Deployed, MODEL_KEY_VAR as KEY_VAR};
use support::run_bench;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use futures::StreamExt;
use kedge_app::tasks::{Answer, Submission};
use kedge_core::agent::AgentDefinition;
use kedge_core::event::{AttemptOutcome, Trouble};
use kedge_core::subjects::{PROVIDERS_BUCKET, RUNS_STREAM};
use kedge_core::task::TaskSubmission;
use kedge_core::{Envelope, Event, RunId, RunStatus};
use kedge_journal::Journal;
use serde_json::{Value, json};
use time::OffsetDateTime;

const AGENT: &str = "outage-bench";
const MODEL: &str = "outage-bench";
const WARM_AGENT: &str = "outage-warm";
const WARM_MODEL: &str = "outage-warm";
/// Tasks submitted at once.
const SUBMIT_CONCURRENCY: usize = 32;
/// The steady part of the outage starts this long after it began (the calls in flight then,
/// and the ones that open the breaker, are not the fleet's steady rate).
const STEADY_FROM: Duration = Duration::from_secs(5);
const KINDS: &[&str] = &[
    "unavailable",
    "overloaded",
    "rate_limited",
    "reset",
    "stream_cut",
];

struct Opts {
    runs: usize,
    outage: Duration,
    kind: String,
    rpm: Option<u32>,
    learn: bool,
    cap: Duration,
    steps: usize,
    probe_interval: String,
    max_probe_interval: String,
    release_per_second: u32,
    logs: Option<PathBuf>,
    log_filter: String,
}

fn opts() -> Opts {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |i: usize| -> &str {
        args.get(i)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("{} needs a value", args[i - 1]))
    };
    let mut o = Opts {
        runs: 500,
        outage: Duration::from_secs(60),
        kind: "unavailable".into(),
        rpm: None,
        learn: false,
        cap: Duration::ZERO,
        steps: 1,
        probe_interval: "1s".into(),
        max_probe_interval: "2s".into(),
        release_per_second: 20,
        logs: None,
        log_filter: "warn".into(),
    };
    let mut cap: Option<Duration> = None;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--runs" => {
                i += 1;
                o.runs = value(i).parse().expect("--runs N");
            }
            "--outage-secs" => {
                i += 1;
                o.outage = Duration::from_secs_f64(value(i).parse().expect("--outage-secs T"));
            }
            "--kind" => {
                i += 1;
                o.kind = value(i).to_owned();
                assert!(KINDS.contains(&o.kind.as_str()), "--kind: one of {KINDS:?}");
            }
            "--rpm" => {
                i += 1;
                o.rpm = Some(value(i).parse().expect("--rpm RPM"));
            }
            "--learn" => o.learn = true,
            "--cap-secs" => {
                i += 1;
                cap = Some(Duration::from_secs_f64(
                    value(i).parse().expect("--cap-secs S"),
                ));
            }
            "--steps" => {
                i += 1;
                o.steps = value(i).parse().expect("--steps N");
            }
            "--probe-interval" => {
                i += 1;
                o.probe_interval = value(i).to_owned();
            }
            "--max-probe-interval" => {
                i += 1;
                o.max_probe_interval = value(i).to_owned();
            }
            "--release-per-second" => {
                i += 1;
                o.release_per_second = value(i).parse().expect("--release-per-second N");
            }
            "--logs" => {
                i += 1;
                o.logs = Some(PathBuf::from(value(i)));
            }
            "--log" => {
                i += 1;
                o.log_filter = value(i).to_owned();
            }
            // cargo bench passes --bench; ignore what we do not know.
            _ => {}
        }
        i += 1;
    }
    assert!(o.runs > 0, "--runs must be at least 1");
    assert!(o.steps > 0, "--steps must be at least 1");
    assert!(
        o.release_per_second > 0,
        "--release-per-second must be at least 1"
    );
    o.cap = cap.unwrap_or(o.outage + Duration::from_secs(300));
    o
}

// ---------------------------------------------------------------------------------------------
// The processes

/// The mock model's script: the bench's model (three `list_files` steps, then the answer, each
/// after 50 ms; with `rpm`, its `requests_per_minute`) and the warm-up's.
fn script(rpm: Option<u32>) -> Value {
    let step = json!({"tool_calls": [{"name": "list_files", "arguments": {}}], "delay_ms": 50});
    let mut model = json!({"steps": [step, step, step, {"text": "done", "delay_ms": 50}]});
    if let Some(rpm) = rpm {
        model["limits"] = json!({"requests_per_minute": rpm});
    }
    json!({"models": {MODEL: model, WARM_MODEL: {"default": {"text": "ok"}}}})
}

/// The mock model's control endpoints (`/_mock/*`).
struct Mock {
    http: reqwest::Client,
    base: String,
}

/// `GET /_mock/calls`, the figures the bench uses.
#[derive(Debug, Clone, Copy, Default)]
struct Calls {
    total: u64,
    troubled: u64,
}

impl Mock {
    async fn calls(&self) -> Option<Calls> {
        let v: Value = self
            .http
            .get(format!("{}/_mock/calls", self.base))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        Some(Calls {
            total: v["total"].as_u64()?,
            troubled: v["troubled"].as_u64()?,
        })
    }

    /// A control request that must answer 204.
    async fn control(&self, method: reqwest::Method, path: &str, body: Option<Value>) {
        let mut req = self
            .http
            .request(method.clone(), format!("{}{path}", self.base));
        if let Some(body) = body {
            req = req.json(&body);
        }
        let resp = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        assert!(
            status == reqwest::StatusCode::NO_CONTENT,
            "{method} {path}: {status} {text}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The journal, as a client sees it

/// Every run's events, from an ordered consumer over `agent.run.>`.
#[derive(Default)]
struct View {
    runs: HashMap<RunId, Vec<(u64, Envelope)>>,
    /// The last stream sequence seen.
    last_seq: u64,
    /// Messages that did not open as events, and consumer errors.
    errors: u64,
}

type Shared = Arc<Mutex<View>>;

fn lock(view: &Shared) -> std::sync::MutexGuard<'_, View> {
    view.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Follows KEDGE_RUNS from its first message into `view`, for as long as the bench runs;
/// recreates its consumer from the last sequence seen after an error.
async fn observe(js: async_nats::jetstream::Context, journal: Journal, view: Shared) {
    loop {
        let start = lock(&view).last_seq + 1;
        let consumer = match js.get_stream_no_info(RUNS_STREAM).await {
            Ok(stream) => {
                stream
                    .create_consumer(OrderedConfig {
                        filter_subject: "agent.run.>".into(),
                        deliver_policy: DeliverPolicy::ByStartSequence {
                            start_sequence: start,
                        },
                        ..Default::default()
                    })
                    .await
            }
            Err(e) => {
                eprintln!("observer: {RUNS_STREAM}: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let mut messages = match consumer {
            Ok(c) => match c.messages().await {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("observer: messages: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            },
            Err(e) => {
                eprintln!("observer: consumer: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        while let Some(item) = messages.next().await {
            let msg = match item {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("observer: {e}");
                    lock(&view).errors += 1;
                    break;
                }
            };
            let Ok(info) = msg.info() else {
                lock(&view).errors += 1;
                continue;
            };
            let seq = info.stream_sequence;
            if seq <= lock(&view).last_seq {
                continue;
            }
            let opened = journal.open(&msg.payload).await;
            let mut v = lock(&view);
            v.last_seq = seq;
            match opened {
                Ok(env) => v
                    .runs
                    .entry(env.run_id.clone())
                    .or_default()
                    .push((seq, env)),
                Err(_) => v.errors += 1,
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits (at most `cap`) until the view has seen the stream through `seq`.
async fn catch_up(view: &Shared, seq: u64, cap: Duration) -> bool {
    let deadline = Instant::now() + cap;
    while lock(view).last_seq < seq {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// The run's state from its events through `through`.
fn fold_through(events: &[(u64, Envelope)], through: u64) -> Option<kedge_core::RunState> {
    kedge_core::fold(
        events
            .iter()
            .filter(|(s, _)| *s <= through)
            .map(|(s, e)| (*s, e)),
    )
    .ok()
}

/// Seconds from `from` to `to` (negative when before).
fn secs_between(from: OffsetDateTime, to: OffsetDateTime) -> f64 {
    (to - from).as_seconds_f64()
}

/// The envelope time and request id of the run's first model call after `after`: its first
/// `step.started` whose request the breaker did not hold.
fn next_call_after(events: &[(u64, Envelope)], after: u64) -> Option<(OffsetDateTime, String)> {
    let held: HashSet<String> = events
        .iter()
        .filter(|(s, _)| *s > after)
        .filter_map(|(_, e)| match &e.event {
            Event::ModelAttempt(a) if matches!(a.outcome, AttemptOutcome::Held { .. }) => {
                Some(a.request_id.to_string())
            }
            _ => None,
        })
        .collect();
    events
        .iter()
        .filter(|(s, _)| *s > after)
        .find_map(|(_, e)| match &e.event {
            Event::StepStarted(s) if !held.contains(&s.request_id.to_string()) => {
                Some((e.at.0, s.request_id.to_string()))
            }
            _ => None,
        })
}

/// p50, p99 and max (nearest rank) of `v`, sorted in place.
fn percentiles(v: &mut [f64]) -> Option<(f64, f64, f64)> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Some((rank(0.5), rank(0.99), v[v.len() - 1]))
}

/// The `kedge_providers` keys: breakers (key → value) and the number of waits.
async fn providers(js: &async_nats::jetstream::Context) -> (Vec<(String, String)>, usize) {
    let Ok(kv) = js.get_key_value(PROVIDERS_BUCKET).await else {
        return (Vec::new(), 0);
    };
    let Ok(mut keys) = kv.keys().await else {
        return (Vec::new(), 0);
    };
    let mut breakers = Vec::new();
    let mut waits = 0;
    while let Some(Ok(k)) = keys.next().await {
        if k.starts_with("wait.") {
            waits += 1;
        } else if k.starts_with("breaker.")
            && let Ok(Some(v)) = kv.get(&k).await
        {
            breakers.push((k, String::from_utf8_lossy(&v).into_owned()));
        }
    }
    (breakers, waits)
}

// ---------------------------------------------------------------------------------------------
// Submitting

async fn submit(client: &async_nats::Client, agent: &str, key: String) -> Result<RunId, String> {
    let task = TaskSubmission::new(agent.parse().expect("an agent name"), "go");
    let submission = Submission {
        task: &task,
        key: &key,
        tenant: "acme",
        caller: Some("bench"),
    };
    match kedge_app::tasks::submit(client, &submission, Duration::from_secs(60)).await {
        Ok(Answer::Accepted { run_id }) => Ok(run_id),
        Ok(Answer::Rejected { error }) => Err(format!("rejected: {error:?}")),
        Err(e) => Err(e.to_string()),
    }
}

fn agent_definition(name: &str, model: &str, mock: &Mock) -> AgentDefinition {
    let def = json!({
        "name": name,
        "system_prompt": "outage bench",
        "model": {"provider": "openai", "name": model, "base_url": format!("{}/v1", mock.base)},
        "api_key_env": KEY_VAR,
        "tools": [{"name": "list_files", "description": "List the run's workspace",
                   "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}],
        "budget": {"max_steps": 10, "max_tokens": 1000000, "max_attempts_per_step": 3}
    });
    AgentDefinition::parse(def.to_string().as_bytes()).expect("a valid agent definition")
}

// ---------------------------------------------------------------------------------------------
// The bench

fn main() {
    let o = opts();
    run_bench(async move {
        tokio::select! {
            () = bench(o) => {}
            _ = tokio::signal::ctrl_c() => eprintln!("interrupted: stopping the processes"),
        }
    });
}

async fn bench(o: Opts) {
    let mut deployed = Deployed::start(false, o.logs.clone()).await;
    let log_dir = deployed.children.log_dir.clone();
    let rt = deployed.client_runtime().await;
    let view: Shared = Arc::default();
    let observer = tokio::spawn(observe(rt.js.clone(), rt.journal.clone(), view.clone()));
    let _stop_observer = AbortOnDrop(observer);

    let mock = Mock {
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .expect("an HTTP client"),
        base: deployed.start_mock(&script(None)).await,
    };

    for n in 1..=o.steps {
        let id = format!("bench-serve-{n}");
        let env: Vec<(String, String)> = deployed
            .serve_env(&id)
            .into_iter()
            .filter(|(k, _)| k != "KEDGE_LOG")
            .chain(
                [
                    ("KEDGE_LOG", o.log_filter.clone()),
                    ("KEDGE_PROVIDER_PROBE_INTERVAL", o.probe_interval.clone()),
                    (
                        "KEDGE_PROVIDER_MAX_PROBE_INTERVAL",
                        o.max_probe_interval.clone(),
                    ),
                    (
                        "KEDGE_PROVIDER_RELEASE_PER_SECOND",
                        o.release_per_second.to_string(),
                    ),
                ]
                .into_iter()
                .chain(o.rpm.filter(|_| !o.learn).map(|rpm| {
                    (
                        "KEDGE_PROVIDER_LIMITS",
                        json!([{"requests_per_minute": rpm}]).to_string(),
                    )
                }))
                .map(|(k, v)| (k.to_owned(), v)),
            )
            .collect();
        deployed.serve(&id, &["all"], &env);
    }
    let children = &mut deployed.children;
    let rpm = o.rpm.map_or_else(|| "none".into(), |r| r.to_string());
    println!(
        "outage bench: {} runs, {:?} of `{}`, {} `kedge serve all` process(es), probe_interval {}, \
         max_probe_interval {}, release_per_second {}, rpm {rpm}, cap {:?} after recovery; logs in {}",
        o.runs,
        o.outage,
        o.kind,
        o.steps,
        o.probe_interval,
        o.max_probe_interval,
        o.release_per_second,
        o.cap,
        log_dir.display()
    );

    rt.agents
        .put(&agent_definition(WARM_AGENT, WARM_MODEL, &mock))
        .await
        .expect("store the warm-up agent");
    rt.agents
        .put(&agent_definition(AGENT, MODEL, &mock))
        .await
        .expect("store the agent");
    warm_up(&rt.client, &view, children, o.steps).await;
    mock.control(reqwest::Method::POST, "/_mock/reset", None)
        .await;

    // Submit, and put the outage in when about half the runs have taken their first step.
    let accepted: Arc<Mutex<Vec<RunId>>> = Arc::default();
    let t0 = Instant::now();
    let submitter = {
        let client = rt.client.clone();
        let accepted = accepted.clone();
        let n = o.runs;
        tokio::spawn(async move {
            let pid = std::process::id();
            let refused: Vec<String> = futures::stream::iter(0..n)
                .map(|i| {
                    let client = client.clone();
                    async move { submit(&client, AGENT, format!("outage-{pid}-{i}")).await }
                })
                .buffer_unordered(SUBMIT_CONCURRENCY)
                .filter_map(|r| {
                    let accepted = accepted.clone();
                    async move {
                        match r {
                            Ok(run) => {
                                accepted
                                    .lock()
                                    .unwrap_or_else(PoisonError::into_inner)
                                    .push(run);
                                None
                            }
                            Err(e) => Some(e),
                        }
                    }
                })
                .collect()
                .await;
            (refused, t0.elapsed())
        })
    };
    let ours = |accepted: &Arc<Mutex<Vec<RunId>>>| -> Vec<RunId> {
        accepted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    };
    let half = o.runs.div_ceil(2);
    let half_cap = Duration::from_secs(60) + Duration::from_millis(200) * o.runs as u32;
    let mut dead: Option<String> = None;
    let started_at_outage = loop {
        let runs = ours(&accepted);
        let started = {
            let v = lock(&view);
            runs.iter()
                .filter(|r| {
                    v.runs.get(*r).is_some_and(|evs| {
                        evs.iter()
                            .any(|(_, e)| matches!(e.event, Event::StepStarted(_)))
                    })
                })
                .count()
        };
        if started >= half {
            break started;
        }
        if t0.elapsed() >= half_cap {
            println!(
                "note: only {started} runs took their first step within {half_cap:?}: the \
                 outage begins anyway"
            );
            break started;
        }
        dead = children.dead();
        if dead.is_some() {
            break started;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let trouble = json!({"kind": o.kind});
    mock.control(reqwest::Method::PUT, "/_mock/trouble", Some(trouble))
        .await;
    let began = Instant::now();
    println!(
        "outage began {:.2} s after the first submission, with {started_at_outage} runs past their \
         first step ({} submitted)",
        (began - t0).as_secs_f64(),
        ours(&accepted).len()
    );

    // During the outage: the troubled counter every second.
    let mut samples: Vec<(Duration, u64)> = Vec::new();
    let mut failed_samples = 0;
    let mut next = began;
    while dead.is_none() {
        if let Some(c) = mock.calls().await {
            samples.push((began.elapsed(), c.troubled));
        } else {
            failed_samples += 1;
        }
        next += Duration::from_secs(1);
        let end = began + o.outage;
        if next >= end {
            tokio::time::sleep(end.saturating_duration_since(Instant::now())).await;
            break;
        }
        tokio::time::sleep(next.saturating_duration_since(Instant::now())).await;
        dead = children.dead();
    }
    let before_r = mock.calls().await;
    if let Some(c) = before_r {
        samples.push((began.elapsed(), c.troubled));
    }

    // Recovery R: the limits first (so that every call after R meets them), then the trouble
    // goes away.
    if let Some(rpm) = o.rpm {
        mock.control(
            reqwest::Method::PUT,
            "/_mock/scripts",
            Some(script(Some(rpm))),
        )
        .await;
    }
    mock.control(reqwest::Method::DELETE, "/_mock/trouble", None)
        .await;
    let r_instant = Instant::now();
    let r_wall = OffsetDateTime::now_utc();
    let outage_len = r_instant - began;
    let r_seq = rt
        .journal
        .stream_last_seq()
        .await
        .expect("KEDGE_RUNS state");
    let calls_r = mock.calls().await;
    let (breakers_r, waits_r) = providers(&rt.js).await;
    if !catch_up(&view, r_seq, Duration::from_secs(30)).await {
        println!("note: the journal reader did not reach sequence {r_seq} within 30 s");
    }

    // Every run to its end.
    let deadline = r_instant + o.cap;
    let mut ended: HashSet<RunId> = HashSet::new();
    let (refused, submit_time) = loop {
        if submitter.is_finished() {
            break submitter.await.expect("the submitting task");
        }
        if Instant::now() >= deadline {
            submitter.abort();
            break (vec!["submission not done by the cap".into()], t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let runs = ours(&accepted);
    while ended.len() < runs.len() && Instant::now() < deadline && dead.is_none() {
        {
            let v = lock(&view);
            for run in &runs {
                if ended.contains(run) {
                    continue;
                }
                let terminal = v.runs.get(run).is_some_and(|evs| {
                    fold_through(evs, u64::MAX).is_some_and(|s| s.status.is_terminal())
                });
                if terminal {
                    ended.insert(run.clone());
                }
            }
        }
        dead = children.dead();
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let end_wait = r_instant.elapsed();
    if let Ok(last) = rt.journal.stream_last_seq().await {
        let _ = catch_up(&view, last, Duration::from_secs(10)).await;
    }
    let calls_end = mock.calls().await;
    let (breakers_end, waits_end) = providers(&rt.js).await;

    // ---------------------------------------------------------------------------------------
    // Report
    let v = lock(&view);
    let no_events: Vec<(u64, Envelope)> = Vec::new();
    let events = |run: &RunId| v.runs.get(run).unwrap_or(&no_events);

    println!(
        "submitted: {} accepted, {} refused, in {:.2} s{}",
        runs.len(),
        refused.len(),
        submit_time.as_secs_f64(),
        refused
            .first()
            .map_or_else(String::new, |e| format!(" (first refusal: {e})"))
    );

    // Outcomes.
    let mut succeeded = 0;
    let mut failed = 0;
    let mut reasons: BTreeMap<String, (usize, String)> = BTreeMap::new();
    let mut unfinished: BTreeMap<String, usize> = BTreeMap::new();
    let mut completed_steps = 0usize;
    let mut reused_steps = 0usize;
    for run in &runs {
        let evs = events(run);
        for (_, e) in evs {
            if let Event::StepCompleted(c) = &e.event {
                if c.reused {
                    reused_steps += 1;
                } else {
                    completed_steps += 1;
                }
            }
        }
        match fold_through(evs, u64::MAX) {
            Some(s) if s.status == RunStatus::Succeeded => succeeded += 1,
            Some(s) if s.status == RunStatus::Failed => {
                failed += 1;
                let (reason, message) = s.failure.as_ref().map_or_else(
                    || ("?".to_owned(), String::new()),
                    |f| {
                        (
                            serde_json::to_value(f.reason)
                                .ok()
                                .and_then(|v| v.as_str().map(str::to_owned))
                                .unwrap_or_else(|| format!("{:?}", f.reason)),
                            f.message.clone(),
                        )
                    },
                );
                let entry = reasons.entry(reason).or_insert((0, message));
                entry.0 += 1;
            }
            Some(s) => *unfinished.entry(s.status.to_string()).or_default() += 1,
            None => *unfinished.entry("no journal".into()).or_default() += 1,
        }
    }
    let not_finished = runs.len() - succeeded - failed + (o.runs - runs.len());
    println!(
        "runs: {succeeded} succeeded, {failed} failed, {not_finished} not finished (of {}), \
         {:.1} s after recovery{}",
        o.runs,
        end_wait.as_secs_f64(),
        if unfinished.is_empty() {
            String::new()
        } else {
            format!("; not finished by status: {unfinished:?}")
        }
    );
    if reasons.is_empty() {
        println!("failure reasons: none");
    } else {
        for (reason, (n, message)) in &reasons {
            println!("failure reason: {reason} × {n} (e.g. {message})");
        }
    }
    if let Some(d) = &dead {
        println!("note: {d}");
    }

    // Requests to the failing endpoint.
    let troubled_total = before_r.map(|c| c.troubled);
    let at_steady = samples.iter().find(|(t, _)| *t >= STEADY_FROM).copied();
    let steady = match (at_steady, samples.last()) {
        (Some((t1, n1)), Some(&(t2, n2))) if t2 > t1 => {
            Some(((n2 - n1) as f64 / (t2 - t1).as_secs_f64(), t2 - t1, n2 - n1))
        }
        _ => None,
    };
    let stride = (outage_len.as_secs() / 24).max(5);
    let mut line = String::new();
    for (i, (t, n)) in samples.iter().enumerate() {
        if t.as_secs() % stride == 0 || i + 1 == samples.len() {
            let _ = write!(line, " {:.0}s:{n}", t.as_secs_f64());
        }
    }
    println!("troubled calls (cumulative, time since the outage began):{line}");
    println!(
        "requests to the failing endpoint during the outage ({:.1} s): {} troubled{}",
        outage_len.as_secs_f64(),
        troubled_total.map_or_else(|| "?".into(), |n| n.to_string()),
        if failed_samples > 0 {
            format!(" ({failed_samples} samples failed)")
        } else {
            String::new()
        }
    );
    match steady {
        Some((rate, span, n)) => println!(
            "steady request rate (from +{:?} to the end, {:.1} s): {n} troubled = {rate:.3} requests/s \
             from the whole fleet (goal ≤ 1)",
            STEADY_FROM,
            span.as_secs_f64()
        ),
        None => println!("steady request rate: - (the outage is not longer than {STEADY_FROM:?})"),
    }
    println!(
        "breaker settings: probe_interval {}, max_probe_interval {}, release_per_second {}, \
         open_after default (KEDGE_PROVIDER_*)",
        o.probe_interval, o.max_probe_interval, o.release_per_second
    );

    // The waiting runs at R.
    let mut at_r: BTreeMap<String, usize> = BTreeMap::new();
    let mut waiting: Vec<&RunId> = Vec::new();
    for run in &runs {
        match fold_through(events(run), r_seq) {
            Some(s) => {
                *at_r.entry(s.status.to_string()).or_default() += 1;
                if s.status == RunStatus::WaitingProvider {
                    waiting.push(run);
                }
            }
            None => *at_r.entry("not created".into()).or_default() += 1,
        }
    }
    println!(
        "at recovery R: {} runs waiting_provider; all runs by status {at_r:?}; {waits_r} waits in \
         {PROVIDERS_BUCKET}",
        waiting.len()
    );
    for (k, val) in &breakers_r {
        println!("breaker at R: {k} = {val}");
    }

    let mut from_r: Vec<f64> = Vec::new();
    let mut no_call = 0;
    // Each waiting run's first call after R: the one its release let out.
    let mut released_calls: HashSet<String> = HashSet::new();
    for run in &waiting {
        match next_call_after(events(run), r_seq) {
            Some((at, request)) => {
                from_r.push(secs_between(r_wall, at));
                released_calls.insert(request);
            }
            None => no_call += 1,
        }
    }
    // The releases after R: the probe's, and the others (the rate-paced release).
    let mut probes_after: Vec<OffsetDateTime> = Vec::new();
    let mut releases_after: Vec<OffsetDateTime> = Vec::new();
    for run in &runs {
        for (s, e) in events(run) {
            if *s > r_seq
                && let Event::ProviderReleased(p) = &e.event
            {
                if p.probe {
                    probes_after.push(e.at.0);
                } else {
                    releases_after.push(e.at.0);
                }
            }
        }
    }
    probes_after.sort();
    releases_after.sort();
    let n_wait = waiting.len();
    let per_sec = match o.rpm {
        Some(rpm) => (o.release_per_second as f64).min(rpm as f64 / 60.0),
        None => o.release_per_second as f64,
    };
    let allowed = n_wait as f64 / per_sec;
    let limit_text = match o.rpm {
        Some(rpm) => format!(
            "release_per_second {} and RPM {rpm} ({:.1}/s)",
            o.release_per_second,
            rpm as f64 / 60.0
        ),
        None => format!("release_per_second {}", o.release_per_second),
    };
    let pct_from_r = percentiles(&mut from_r);
    match pct_from_r {
        Some((p50, p99, max)) => println!(
            "R → next model call of the {n_wait} waiting runs: p50 {p50:.2} s, p99 {p99:.2} s, max \
             {max:.2} s{}",
            if no_call > 0 {
                format!(" ({no_call} made none)")
            } else {
                String::new()
            }
        ),
        None => println!("R → next model call: no run was waiting at R"),
    }
    println!(
        "allowed by {limit_text}: {allowed:.2} s for {n_wait} runs; ratio max / allowed {} (goal ≤ 1.10)",
        pct_from_r.map_or_else(|| "-".into(), |(_, _, max)| ratio(max, allowed))
    );
    let first_probe = probes_after.first().map(|t| secs_between(r_wall, *t));
    let first_release = releases_after.first().copied();
    println!(
        "R → first probe released {}; R → first release {}; releases after R: {} ({} probes){}",
        first_probe.map_or_else(|| "-".into(), |s| format!("{s:.2} s")),
        first_release.map_or_else(
            || "-".into(),
            |t| format!("{:.2} s", secs_between(r_wall, t))
        ),
        releases_after.len(),
        probes_after.len(),
        match (releases_after.first(), releases_after.last()) {
            (Some(a), Some(b)) if releases_after.len() > 1 && b > a => format!(
                ", first → last {:.2} s = {:.1} releases/s",
                secs_between(*a, *b),
                (releases_after.len() - 1) as f64 / secs_between(*a, *b)
            ),
            _ => String::new(),
        }
    );
    // From the first release after R (the probe's, when the breaker's next probe came after
    // R): the release's pacing alone, without the wait for the probe.
    let start = probes_after
        .first()
        .into_iter()
        .chain(first_release.as_ref())
        .map(|t| secs_between(r_wall, *t))
        .fold(f64::INFINITY, f64::min);
    let start = if start.is_finite() {
        start.max(0.0)
    } else {
        0.0
    };
    let mut from_release: Vec<f64> = from_r.iter().map(|s| (s - start).max(0.0)).collect();
    match percentiles(&mut from_release) {
        Some((p50, p99, max)) => println!(
            "first release ({start:.2} s after R) → next model call: p50 {p50:.2} s, p99 {p99:.2} s, \
             max {max:.2} s; ratio max / allowed {}",
            ratio(max, allowed)
        ),
        None => println!("first release → next model call: -"),
    }

    // 429s after R.
    let mut status_429 = 0;
    let mut released_429 = 0;
    let mut troubled_attempts_after = 0;
    let mut completed_after = 0;
    for run in &runs {
        for (s, e) in events(run) {
            if *s <= r_seq {
                continue;
            }
            match &e.event {
                Event::ModelAttempt(a) => {
                    if let AttemptOutcome::Error {
                        status, trouble, ..
                    } = &a.outcome
                    {
                        if *status == Some(429) || *trouble == Some(Trouble::RateLimited) {
                            status_429 += 1;
                            if released_calls.contains(&a.request_id.to_string()) {
                                released_429 += 1;
                            }
                        }
                        if trouble.is_some() {
                            troubled_attempts_after += 1;
                        }
                    }
                }
                Event::StepCompleted(c) if !c.reused => completed_after += 1,
                _ => {}
            }
        }
    }
    let extra_after = match (calls_r, calls_end) {
        (Some(a), Some(b)) => Some(b.total as i64 - a.total as i64 - completed_after as i64),
        _ => None,
    };
    println!(
        "429s after R: {status_429}, {released_429} of them on a waiting run's released call \
         (journal model.attempt 429 / rate_limited; {} troubled attempts after R in all); mock \
         calls after R that completed no step: {}{}",
        troubled_attempts_after,
        extra_after.map_or_else(|| "?".into(), |n| n.to_string()),
        match o.rpm {
            Some(rpm) if o.release_per_second as u64 * 60 <= rpm as u64 => {
                " (release_per_second × 60 ≤ RPM: 0 expected on released calls)".to_owned()
            }
            Some(_) => " (release_per_second × 60 > RPM: the limit binds)".to_owned(),
            None => " (no RPM limit)".to_owned(),
        }
    );

    // Calls per step.
    let per_step = calls_end.map(|c| {
        (
            c.total,
            c.troubled,
            (c.total - c.troubled) as f64 / completed_steps.max(1) as f64,
        )
    });
    match per_step {
        Some((total, troubled, per)) => println!(
            "model calls per step: (calls {total} − troubled {troubled}) / {completed_steps} steps \
             completed = {per:.3}{}",
            if reused_steps > 0 {
                format!(" ({reused_steps} more steps reused a stored answer)")
            } else {
                String::new()
            }
        ),
        None => println!("model calls per step: ? (the mock did not answer)"),
    }
    println!("{waits_end} waits left in {PROVIDERS_BUCKET} at the end");
    for (k, val) in &breakers_end {
        println!("breaker at the end: {k} = {val}");
    }
    if v.errors > 0 {
        println!("note: {} journal messages or reads failed", v.errors);
    }

    let fmt = |x: Option<f64>| x.map_or_else(|| "-".into(), |x| format!("{x:.2}"));
    println!(
        "SUMMARY outage runs={} kind={} outage_s={:.0} steps={} succeeded={succeeded} failed={failed} \
         not_finished={not_finished} troubled={} steady_rps={} probe_interval={} \
         max_probe_interval={} release_per_second={} rpm={rpm} waiting_at_r={n_wait} \
         next_call_p50_s={} p99_s={} max_s={} allowed_s={allowed:.2} ratio={} \
         max_from_first_release_s={} ratio_from_first_release={} first_probe_s={} 429_after_r={status_429} 429_on_released={released_429} \
         calls_per_step={}",
        o.runs,
        o.kind,
        outage_len.as_secs_f64(),
        o.steps,
        troubled_total.map_or_else(|| "?".into(), |n| n.to_string()),
        fmt(steady.map(|s| s.0)),
        o.probe_interval,
        o.max_probe_interval,
        o.release_per_second,
        fmt(pct_from_r.map(|p| p.0)),
        fmt(pct_from_r.map(|p| p.1)),
        fmt(pct_from_r.map(|p| p.2)),
        pct_from_r.map_or_else(|| "-".into(), |(_, _, max)| ratio(max, allowed)),
        fmt(from_release.last().copied()),
        from_release
            .last()
            .map_or_else(|| "-".into(), |max| ratio(*max, allowed)),
        fmt(first_probe),
        per_step.map_or_else(|| "?".into(), |(_, _, p)| format!("{p:.3}")),
    );
    if failed > 0 || not_finished > 0 || dead.is_some() {
        println!("processes' logs:\n{}", children.log_tail(20));
    }
}

fn ratio(value: f64, allowed: f64) -> String {
    if allowed > 0.0 {
        format!("{:.2}", value / allowed)
    } else {
        "-".into()
    }
}

/// Aborts the task when dropped (the journal reader, when the bench ends or unwinds).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs through the fleet before measuring (two per serve process, 60 s at most): every
/// process is up and the model answers. Panics with the logs when they do not succeed.
async fn warm_up(
    client: &async_nats::Client,
    view: &Shared,
    children: &mut Children,
    processes: usize,
) {
    let pid = std::process::id();
    let mut runs = Vec::new();
    for i in 0..processes * 2 {
        match submit(client, WARM_AGENT, format!("outage-warm-{pid}-{i}")).await {
            Ok(run) => runs.push(run),
            Err(e) => panic!("warm-up task: {e}\n{}", children.log_tail(30)),
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let statuses: Vec<Option<RunStatus>> = {
            let v = lock(view);
            runs.iter()
                .map(|r| {
                    v.runs
                        .get(r)
                        .and_then(|evs| fold_through(evs, u64::MAX))
                        .map(|s| s.status)
                })
                .collect()
        };
        if statuses.iter().all(|s| *s == Some(RunStatus::Succeeded)) {
            return;
        }
        if let Some(s) = statuses
            .iter()
            .flatten()
            .find(|s| s.is_terminal() && **s != RunStatus::Succeeded)
        {
            panic!("a warm-up run ended {s}\n{}", children.log_tail(30));
        }
        if let Some(d) = children.dead() {
            panic!("{d}\n{}", children.log_tail(30));
        }
        assert!(
            Instant::now() < deadline,
            "the warm-up runs did not succeed within 60 s ({statuses:?})\n{}",
            children.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
