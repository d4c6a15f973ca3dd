//! The Prometheus endpoint of `kedge serve`, scraped over HTTP like Prometheus
//! does: a `kedge serve all` process with `KEDGE_METRICS_ADDR` runs a run with a tool call and a
//! slow model step; the scrape taken while the model is still answering shows the first step,
//! its tool operation and its tokens counted, the one after the run shows the run succeeded;
//! every scrape is checked line by line against the text exposition format, and the consumers the
//! process runs report their lag. A standby that takes a run over counts the takeover, its
//! latency and the reused model answer; a bridge counts its open event streams. An address that
//! cannot be bound stops `kedge serve` at once, naming it.

use crate::common;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Harness, STORED_NOT_COMMITTED, Svc};
use kedge_core::RunStatus;
use kedge_core::event::Event;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

/// A port nothing listens on now (bound, then let go).
fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").to_string()
}

/// A histogram series' buckets: (upper bound, cumulative count).
type Buckets = Vec<(f64, f64)>;

/// One sample of a scrape: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A scrape parsed by the rules of the Prometheus text format (version 0.0.4): `# HELP` and
/// `# TYPE` lines, one TYPE per family before its samples, samples `name{l="v",…} value`,
/// label values with `\\`, `\"` and `\n` escapes; a histogram's `_bucket` series carry `le` and
/// grow with it up to `+Inf`, which equals `_count`. Panics naming the first line that breaks a
/// rule.
fn parse(text: &str) -> Vec<Sample> {
    fn is_name(s: &str, colon: bool) -> bool {
        let mut chars = s.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':'))
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':'))
    }
    fn value(s: &str) -> Option<f64> {
        match s {
            "+Inf" => Some(f64::INFINITY),
            "-Inf" => Some(f64::NEG_INFINITY),
            "NaN" => Some(f64::NAN),
            _ => s.parse().ok(),
        }
    }
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let bad = |why: &str| -> ! { panic!("line {}: {why}: {line:?}", n + 1) };
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("HELP"), Some(name), _) if is_name(name, true) => {}
                (Some("TYPE"), Some(name), Some(kind)) if is_name(name, true) => {
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                        bad("unknown type");
                    }
                    if types.insert(name.to_owned(), kind.to_owned()).is_some() {
                        bad("a second TYPE for one family");
                    }
                    if samples
                        .iter()
                        .any(|s: &Sample| family(&s.name, &types) == name)
                    {
                        bad("TYPE after the family's samples");
                    }
                }
                (Some("HELP" | "TYPE"), _, _) => bad("malformed HELP or TYPE"),
                _ => {} // a comment
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (series, rest) = match line.find('{') {
            Some(_) => {
                let close = line.rfind('}').unwrap_or_else(|| bad("no closing brace"));
                (&line[..close + 1], &line[close + 1..])
            }
            None => match line.find(' ') {
                Some(space) => (&line[..space], &line[space..]),
                None => bad("no value"),
            },
        };
        let (name, labels) = match series.split_once('{') {
            Some((name, body)) => {
                let body = body.strip_suffix('}').unwrap_or_else(|| bad("labels"));
                let mut labels = BTreeMap::new();
                let mut chars = body.chars().peekable();
                while chars.peek().is_some() {
                    let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
                    if !is_name(&key, false) {
                        bad("label name");
                    }
                    if chars.next() != Some('"') {
                        bad("label value must be quoted");
                    }
                    let mut v = String::new();
                    loop {
                        match chars.next() {
                            Some('\\') => match chars.next() {
                                Some('\\') => v.push('\\'),
                                Some('"') => v.push('"'),
                                Some('n') => v.push('\n'),
                                _ => bad("bad escape in a label value"),
                            },
                            Some('"') => break,
                            Some(c) => v.push(c),
                            None => bad("unterminated label value"),
                        }
                    }
                    if labels.insert(key, v).is_some() {
                        bad("a label twice");
                    }
                    match chars.next() {
                        Some(',') | None => {}
                        _ => bad("labels must be separated by commas"),
                    }
                }
                (name, labels)
            }
            None => (series, BTreeMap::new()),
        };
        if !is_name(name, true) {
            bad("metric name");
        }
        let mut fields = rest.split_whitespace();
        let v = fields
            .next()
            .and_then(value)
            .unwrap_or_else(|| bad("value"));
        if let Some(ts) = fields.next()
            && ts.parse::<i64>().is_err()
        {
            bad("timestamp");
        }
        if fields.next().is_some() {
            bad("trailing fields");
        }
        if !types.contains_key(family(name, &types)) {
            bad("a sample without a TYPE");
        }
        samples.push(Sample {
            name: name.to_owned(),
            labels,
            value: v,
        });
    }
    // Histograms: buckets cumulative up to +Inf, which is the count.
    for (fam, kind) in &types {
        if kind != "histogram" {
            continue;
        }
        let mut series: BTreeMap<Vec<(String, String)>, Buckets> = BTreeMap::new();
        for s in samples.iter().filter(|s| s.name == format!("{fam}_bucket")) {
            let le = s.labels.get("le").expect("a bucket has le");
            let le = value(le).expect("le is a number");
            let rest: Vec<_> = s
                .labels
                .iter()
                .filter(|(k, _)| *k != "le")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            series.entry(rest).or_default().push((le, s.value));
        }
        for (labels, buckets) in series {
            let mut sorted = buckets.clone();
            sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
            assert!(
                sorted.windows(2).all(|w| w[0].1 <= w[1].1),
                "{fam}{labels:?}: buckets not cumulative"
            );
            let inf = sorted.last().expect("buckets");
            assert!(inf.0.is_infinite(), "{fam}{labels:?}: no +Inf bucket");
            let count = samples
                .iter()
                .find(|s| {
                    s.name == format!("{fam}_count")
                        && s.labels
                            .iter()
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect::<Vec<_>>()
                            == labels
                })
                .unwrap_or_else(|| panic!("{fam}{labels:?}: no _count"));
            assert_eq!(
                inf.1, count.value,
                "{fam}{labels:?}: +Inf bucket is not the count"
            );
        }
    }
    samples
}

/// The family a sample belongs to (a histogram's `_bucket`, `_sum`, `_count` are its own).
fn family<'a>(name: &'a str, types: &BTreeMap<String, String>) -> &'a str {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix)
            && types
                .get(base)
                .is_some_and(|k| k == "histogram" || k == "summary")
        {
            return base;
        }
    }
    name
}

/// The value of the series `name` with exactly the labels `labels` (0 when absent: a counter
/// nothing has counted yet).
fn get(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let want: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    samples
        .iter()
        .find(|s| s.name == name && s.labels == want)
        .map_or(0.0, |s| s.value)
}

fn present(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> bool {
    samples.iter().any(|s| {
        s.name == name
            && labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
    })
}

/// GET /metrics; `None` while nothing answers.
async fn scrape(http: &reqwest::Client, addr: &str) -> Option<(String, String)> {
    let resp = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .ok()?;
    assert_eq!(resp.status(), 200);
    let kind = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    Some((kind, resp.text().await.expect("body")))
}

/// Scrapes until `ready` holds for the parsed samples.
async fn scrape_until(
    http: &reqwest::Client,
    addr: &str,
    what: &str,
    ready: impl Fn(&[Sample]) -> bool,
) -> Vec<Sample> {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some((kind, text)) = scrape(http, addr).await {
            assert!(
                kind.starts_with("text/plain; version=0.0.4"),
                "content type {kind}"
            );
            let samples = parse(&text);
            if ready(&samples) {
                return samples;
            }
        }
        assert!(Instant::now() < deadline, "metrics never showed {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts `kedge serve all` as worker `worker` with its metrics on a free address; that address
/// and a client to scrape it.
fn serve_all_with_metrics(h: &mut Harness, worker: &str) -> (String, reqwest::Client) {
    let addr = free_addr();
    h.spawn_process_with_env("all", worker, "", &[("KEDGE_METRICS_ADDR", addr.clone())]);
    (addr, reqwest::Client::new())
}

/// Tenant `globex` has 12 runs in their model calls (3 s each) when tenant `acme` submits one:
/// the step service drives acme's on the light lane (docs/ARCHITECTURE.md "Fairness across
/// tenants"), and globex's, once it holds a backlog (8), on the shared one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_tenants_drive_passes_another_tenants_backlog_on_the_light_lane() {
    const BACKLOG: usize = 12;
    let script = json!({"models": {"m": {"default": {"text": "done", "delay_ms": 3000}}}});
    let mut h = Harness::start(script, &[]).await;
    h.agent("lanes", "m").await;
    let (addr, http) = serve_all_with_metrics(&mut h, "w-lanes");
    scrape_until(&http, &addr, "the process up", |s| {
        present(s, "kedge_consumer_pending", &[("consumer", "step")])
    })
    .await;
    let task = kedge_core::task::TaskSubmission::new("lanes".parse().expect("agent"), "go");
    for i in 0..BACKLOG {
        let key = format!("globex-{i}");
        let submission = kedge_intake::Submission {
            task: &task,
            key: &key,
            tenant: "globex",
            caller: Some("test"),
        };
        let answer = kedge_intake::submit(&h.rt.client, &submission, WAIT)
            .await
            .expect("intake answered");
        assert!(
            matches!(answer, kedge_intake::Answer::Accepted { .. }),
            "{answer:?}"
        );
    }
    // Every one of globex's runs is in its model call, holding a drive: the first ones went
    // light, those from its eighth on shared.
    let step = |s: &[Sample], lane| {
        get(
            s,
            "kedge_lane_work_total",
            &[("consumer", "step"), ("lane", lane)],
        )
    };
    let before = scrape_until(&http, &addr, "globex's drives started", |s| {
        step(s, "shared") + step(s, "light") >= BACKLOG as f64
    })
    .await;
    let shared = step(&before, "shared");
    assert!(
        shared >= (BACKLOG - kedge_core::fairness::BACKLOG_FROM) as f64,
        "globex's backlog went shared: {shared}"
    );
    let light = step(&before, "light");
    let run = h.submit("lanes", "go", "acme-0").await;
    h.wait_for(&run, WAIT, |s| s.status == RunStatus::Succeeded)
        .await;
    scrape_until(&http, &addr, "acme's drive on the light lane", |s| {
        step(s, "light") >= light + 1.0
    })
    .await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_moves_the_counters_of_the_process_that_served_it() {
    // Step 1 calls a tool; step 2 answers after 3 s, so a scrape lands while the run is still
    // going, between its first and second step.
    let script = json!({"models": {"m": {"steps": [
        {"text": "recording", "tool_calls": [{"name": "ledger_append", "arguments": {"text": "one"}}]},
        {"text": "done", "delay_ms": 3000}
    ]}}});
    let mut h = Harness::start(script, &[]).await;
    h.agent("metered", "m").await;
    // Priced so that a step's cost in millionths is a whole number: 3 per input token, 15 per
    // output token.
    let name = "metered".parse().expect("agent name");
    let (_, def) = h.rt.agents.latest(&name).await.expect("stored");
    let mut def = (*def).clone();
    def.model.price = Some(
        serde_json::from_value(
            json!({"input_per_mtok": 3, "output_per_mtok": 15, "currency": "EUR"}),
        )
        .expect("price"),
    );
    h.rt.agents.put(&def).await.expect("priced agent stored");
    let (addr, http) = serve_all_with_metrics(&mut h, "w-metrics");

    // Up: every metric is described, the consumers it runs report their lag.
    let idle = scrape_until(&http, &addr, "the consumers' lag", |s| {
        [
            "intake",
            "step",
            "tool",
            "projector",
            "timer",
            "timer-fired",
        ]
        .iter()
        .all(|c| present(s, "kedge_consumer_pending", &[("consumer", c)]))
    })
    .await;
    assert_eq!(
        get(
            &idle,
            "kedge_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0
    );
    for c in ["step", "tool"] {
        assert!(present(
            &idle,
            "kedge_consumer_ack_pending",
            &[("consumer", c)]
        ));
        assert!(present(
            &idle,
            "kedge_consumer_redelivered",
            &[("consumer", c)]
        ));
    }
    assert_eq!(get(&idle, "kedge_steps_completed_total", &[]), 0.0);

    let run = h.submit("metered", "go", "task-metrics").await;
    // During the run: the first step, its tool operation and its tokens are counted while the
    // second model call is still under way.
    let during = scrape_until(&http, &addr, "the first step and its tool", |s| {
        get(s, "kedge_steps_completed_total", &[]) >= 1.0
            && get(
                s,
                "kedge_tool_operations_total",
                &[("outcome", "succeeded")],
            ) >= 1.0
    })
    .await;
    let state = h.state(&run).await;
    assert!(
        !state.status.is_terminal(),
        "the scrape was meant to land mid-run, the run is {}",
        state.status
    );
    assert_eq!(get(&during, "kedge_runs_created_total", &[]), 1.0);
    assert_eq!(get(&during, "kedge_steps_completed_total", &[]), 1.0);
    assert_eq!(
        get(
            &during,
            "kedge_tool_operations_total",
            &[("outcome", "succeeded")]
        ),
        1.0
    );
    assert_eq!(
        get(&during, "kedge_model_calls_total", &[("outcome", "ok")]),
        1.0
    );
    assert!(
        get(
            &during,
            "kedge_model_tokens_total",
            &[("direction", "input")]
        ) > 0.0
    );
    assert!(
        get(
            &during,
            "kedge_model_tokens_total",
            &[("direction", "output")]
        ) > 0.0
    );
    assert_eq!(
        get(
            &during,
            "kedge_run_transitions_total",
            &[("status", "waiting_tool")]
        ),
        1.0
    );
    assert_eq!(
        get(
            &during,
            "kedge_run_transitions_total",
            &[("status", "succeeded")]
        ),
        0.0
    );
    assert_eq!(get(&during, "kedge_tool_call_seconds_count", &[]), 1.0);
    assert!(
        get(
            &during,
            "kedge_consumer_deliveries_total",
            &[("consumer", "step-created")]
        ) >= 1.0
    );
    // The built-in tool ran inside the step's drive (docs/ARCHITECTURE.md "Inline tools"): no
    // tool worker was delivered its request, and its start and result woke no step.
    for c in ["tool", "step"] {
        assert_eq!(
            get(
                &during,
                "kedge_consumer_deliveries_total",
                &[("consumer", c)]
            ),
            0.0,
            "{c}"
        );
    }
    assert!(
        get(
            &during,
            "kedge_consumer_deliveries_total",
            &[("consumer", "intake")]
        ) >= 1.0
    );

    let end = h.wait_terminal(&run, WAIT).await;
    assert_eq!(end.status, RunStatus::Succeeded);
    let after = scrape_until(&http, &addr, "the run succeeded", |s| {
        get(s, "kedge_run_transitions_total", &[("status", "succeeded")]) >= 1.0
    })
    .await;
    assert_eq!(get(&after, "kedge_steps_completed_total", &[]), 2.0);
    assert_eq!(
        get(&after, "kedge_model_calls_total", &[("outcome", "ok")]),
        2.0
    );
    assert_eq!(get(&after, "kedge_model_call_seconds_count", &[]), 2.0);
    assert!(
        get(&after, "kedge_model_call_seconds_sum", &[]) >= 3.0,
        "the second call took the mock's 3 s"
    );
    assert_eq!(get(&after, "kedge_model_responses_reused_total", &[]), 0.0);
    // The tool ran inside the drive (docs/ARCHITECTURE.md "Inline tools"): nothing woke the run
    // for its result, and the drive folded its tool.started and tool.result as they landed,
    // each stored on the message before it: no read of the run, chained or batched.
    assert_eq!(
        get(&after, "kedge_step_reads_total", &[("how", "chained")]),
        0.0
    );
    // Its first drive folded the run.created that woke it, with no read.
    assert_eq!(
        get(&after, "kedge_step_reads_total", &[("how", "linked")]),
        1.0
    );
    assert_eq!(
        get(&after, "kedge_step_reads_total", &[("how", "batched")]),
        0.0
    );
    assert_eq!(
        get(&after, "kedge_dead_letters_total", &[("consumer", "step")]),
        0.0
    );
    // A lone run is no backlog: its task and its drive (its tool operation inside it) went out
    // on the light lane, where its deliveries came, none on the lane backlogs share.
    for consumer in ["intake", "step"] {
        let on = |lane| {
            get(
                &after,
                "kedge_lane_work_total",
                &[("consumer", consumer), ("lane", lane)],
            )
        };
        assert!(on("light") >= 1.0, "{consumer}'s work on the light lane");
        assert_eq!(on("shared"), 0.0, "{consumer}'s work on the shared one");
    }
    // The step service wrote the run's summaries to the runs list from its own fold: the busy
    // run's coalesced, its end at once. So the projector, delivered the run's run-level
    // decisions, found its later passes covered by what was stored (one KV get each), and
    // never read the run's subjects (one read per pass walked every message stored since,
    // however many other runs').
    let projected = scrape_until(&http, &addr, "the run's end listed", |s| {
        get(s, "kedge_step_list_writes_total", &[("when", "at_once")]) >= 1.0
            && get(s, "kedge_projector_reads_total", &[("how", "covered")]) >= 1.0
    })
    .await;
    assert!(
        get(
            &projected,
            "kedge_step_list_writes_total",
            &[("when", "coalesced")]
        ) >= 1.0
    );
    assert_eq!(
        get(
            &projected,
            "kedge_step_list_writes_total",
            &[("when", "failed")]
        ),
        0.0
    );
    assert_eq!(
        get(
            &projected,
            "kedge_projector_reads_total",
            &[("how", "batched")]
        ),
        0.0
    );
    // The tokens counted are the run's, as journaled.
    let (mut input, mut output) = (0u64, 0u64);
    for r in h.events(&run).await {
        if let Event::StepCompleted(c) = &r.envelope.event {
            input += c.usage.input_tokens;
            output += c.usage.output_tokens;
        }
    }
    assert_eq!(
        get(
            &after,
            "kedge_model_tokens_total",
            &[("direction", "input")]
        ),
        input as f64
    );
    assert_eq!(
        get(
            &after,
            "kedge_model_tokens_total",
            &[("direction", "output")]
        ),
        output as f64
    );
    assert_eq!(
        get(
            &after,
            "kedge_model_cost_micros_total",
            &[("currency", "EUR")]
        ),
        (input * 3 + output * 15) as f64
    );
    // No series names a run or an operation.
    let run_text = run.to_string();
    assert!(
        after.iter().all(|s| s
            .labels
            .values()
            .all(|v| !v.contains(&run_text) && !v.starts_with("op_"))),
        "a label holds a run or operation id"
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metrics_address_that_cannot_be_bound_stops_kedge_serve_naming_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_kedge"))
            .args(["serve", "step"])
            // Never reached: the endpoint is bound before the broker is dialled.
            .env("KEDGE_NATS_URL", "nats://127.0.0.1:1")
            .env("KEDGE_METRICS_ADDR", &addr)
            .stdin(Stdio::null())
            .output()
            .expect("run kedge")
    })
    .await
    .expect("join");
    drop(taken);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("cannot serve metrics on 127.0.0.1:")
            && stderr.contains("KEDGE_METRICS_ADDR"),
        "{stderr}"
    );
    let bad = Command::new(env!("CARGO_BIN_EXE_kedge"))
        .args(["serve", "step"])
        .env("KEDGE_NATS_URL", "nats://127.0.0.1:1")
        .env("KEDGE_METRICS_ADDR", "9464")
        .stdin(Stdio::null())
        .output()
        .expect("run kedge");
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    assert!(stderr.contains("metrics_addr"), "{stderr}");
}

#[test]
fn the_parser_refuses_what_prometheus_refuses() {
    let ok = "# HELP a_total A.\n# TYPE a_total counter\na_total{k=\"v\\\"q\"} 3\n\
              # TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 1.5\nh_count 2\n";
    let s = parse(ok);
    assert_eq!(get(&s, "a_total", &[("k", "v\"q")]), 3.0);
    for bad in [
        "a_total 1\n",                             // no TYPE
        "# TYPE a counter\na{k=v} 1\n",            // unquoted value
        "# TYPE a counter\na{k=\"v\"} one\n",      // not a number
        "# TYPE a counter\n# TYPE a gauge\na 1\n", // two TYPEs
        "# TYPE 1a counter\n1a 1\n",               // bad name
        "# TYPE h histogram\nh_bucket{le=\"1\"} 3\nh_bucket{le=\"+Inf\"} 2\nh_count 2\n", // not cumulative
    ] {
        let refused = std::panic::catch_unwind(|| parse(bad)).is_err();
        assert!(refused, "accepted {bad:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_counts_the_takeover_its_latency_and_the_model_call_it_did_not_pay_twice() {
    // Both workers abort right after the model answered and the answer was stored; whichever
    // drives the run dies there, and the other takes the run over and reuses the answer (the
    // reuse does not pass the failpoint).
    let script = json!({"models": {"once": {"steps": [{"text": "done", "delay_ms": 500}]}}});
    let mut h = Harness::start(script, &[]).await;
    h.agent("once", "once").await;
    let addrs = [free_addr(), free_addr()];
    let workers = [
        h.spawn_process_with_env(
            "all",
            "w-a",
            STORED_NOT_COMMITTED,
            &[("KEDGE_METRICS_ADDR", addrs[0].clone())],
        ),
        h.spawn_process_with_env(
            "all",
            "w-b",
            STORED_NOT_COMMITTED,
            &[("KEDGE_METRICS_ADDR", addrs[1].clone())],
        ),
    ];
    h.heartbeat_of("w-a").await;
    h.heartbeat_of("w-b").await;
    let run = h.submit("once", "go", "task-takeover").await;
    let end = h.wait_terminal(&run, WAIT).await;
    assert_eq!(end.status, RunStatus::Succeeded);
    let mut survivor = None;
    for (i, index) in workers.into_iter().enumerate() {
        if !h.wait_exit(index, Duration::from_millis(100)).await {
            survivor = Some(i);
        }
    }
    let survivor = survivor.expect("one worker is still up");
    assert!(
        h.wait_exit(workers[1 - survivor], Duration::from_secs(1))
            .await,
        "the other one died at its failpoint"
    );
    assert_eq!(h.mock.calls().total, 1, "the model was paid once");
    let http = reqwest::Client::new();
    let s = scrape_until(&http, &addrs[survivor], "the takeover", |s| {
        get(s, "kedge_run_transitions_total", &[("status", "succeeded")]) >= 1.0
    })
    .await;
    assert_eq!(get(&s, "kedge_takeovers_total", &[("kind", "run")]), 1.0);
    assert_eq!(
        get(&s, "kedge_takeover_seconds_count", &[("kind", "run")]),
        1.0,
        "the takeover followed a death this process heard"
    );
    let latency = get(&s, "kedge_takeover_seconds_sum", &[("kind", "run")]);
    assert!(
        latency > 0.0 && latency < 10.0,
        "from the last heartbeat to the takeover: {latency} s"
    );
    assert_eq!(get(&s, "kedge_model_responses_reused_total", &[]), 1.0);
    assert_eq!(get(&s, "kedge_steps_completed_total", &[]), 1.0);
    assert_eq!(
        get(&s, "kedge_model_calls_total", &[("outcome", "ok")]),
        0.0
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_counts_its_open_event_streams() {
    const TOKEN: &str = "metrics-test-token-0123456789";
    let script = json!({"models": {"slow": {"steps": [{"text": "done", "delay_ms": 4000}]}}});
    let mut h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("slow", "slow").await;
    let (listen, metrics) = (free_addr(), free_addr());
    // Frequent SSE heartbeats: a closed stream is noticed at the next write.
    let file = h.dir.path().join("bridge.json");
    std::fs::write(&file, r#"{"bridge": {"heartbeat_ms": 200}}"#).expect("config file");
    h.spawn_process_with_env(
        "bridge",
        "w-bridge",
        "",
        &[
            ("KEDGE_BRIDGE_LISTEN", listen.clone()),
            ("KEDGE_BRIDGE_TOKENS", format!("{TOKEN}=acme")),
            ("KEDGE_METRICS_ADDR", metrics.clone()),
            ("KEDGE_CONFIG", file.display().to_string()),
        ],
    );
    let http = reqwest::Client::new();
    let base = format!("http://{listen}");
    let deadline = Instant::now() + WAIT;
    while http.get(format!("{base}/readyz")).send().await.is_err() {
        assert!(Instant::now() < deadline, "bridge never came up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let idle = scrape_until(&http, &metrics, "the bridge", |s| {
        present(s, "kedge_build_info", &[])
    })
    .await;
    assert_eq!(get(&idle, "kedge_sse_connections", &[]), 0.0);
    let created: serde_json::Value = http
        .post(format!("{base}/v1/runs"))
        .bearer_auth(TOKEN)
        .header("Idempotency-Key", "sse-metrics")
        .json(&json!({"agent": "slow", "input": "go"}))
        .send()
        .await
        .expect("submit")
        .json()
        .await
        .expect("json");
    let run = created["run_id"].as_str().expect("a run id").to_owned();
    // Two event streams open while the model is still answering.
    let mut streams = Vec::new();
    for _ in 0..2 {
        let resp = http
            .get(format!("{base}/v1/runs/{run}/events"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .expect("events");
        assert_eq!(resp.status(), 200);
        streams.push(resp);
    }
    scrape_until(&http, &metrics, "two open streams", |s| {
        get(s, "kedge_sse_connections", &[]) == 2.0
    })
    .await;
    drop(streams.pop());
    scrape_until(&http, &metrics, "one stream closed", |s| {
        get(s, "kedge_sse_connections", &[]) == 1.0
    })
    .await;
    drop(streams);
    scrape_until(&http, &metrics, "every stream closed", |s| {
        get(s, "kedge_sse_connections", &[]) == 0.0
    })
    .await;
    h.shutdown().await;
}
