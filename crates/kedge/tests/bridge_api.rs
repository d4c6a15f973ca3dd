//! The bridge's JSON API end to end: submit (idempotent), inspect, list from the projection,
//! history, answer, message (revive), cancel; the projection's rebuild and its stale-never-wins
//! rule; every bad input answered with its status and a reason; tenant isolation on every
//! endpoint; the OpenAPI document against the routes.

use crate::bridge_support;
use crate::common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bridge_support::{ACME, ACME_READ, Api, GLOBEX, TestBridge, bridge_config, spawn_projector};
use common::{Harness, Svc};
use kedge_core::EventType;
use reqwest::StatusCode;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);

fn qa_script(model: &str) -> Value {
    json!({"models": {model: {
        "steps": [
            {"text": "let me ask", "tool_calls": [{"name": "ask_user", "arguments": {"question": "Proceed?"}}]},
            {"text": "all done"}
        ],
        "rules": [{"when_last_user_contains": "again", "respond": {"text": "second turn done"}}]
    }}})
}

/// Polls `GET /v1/runs/{id}` until `pred` holds.
async fn wait_view(api: &Api, run: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let (s, v) = api.get(&format!("/v1/runs/{run}")).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        if pred(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "run never got there: {v:#}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `GET /v1/runs?…` until `pred` holds for the list.
async fn wait_list(api: &Api, query: &str, pred: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + WAIT;
    loop {
        let (s, v) = api.get(&format!("/v1/runs{query}")).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let runs = v["runs"].as_array().cloned().unwrap_or_default();
        if pred(&runs) {
            return runs;
        }
        assert!(
            Instant::now() < deadline,
            "list {query} never got there: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn ids(runs: &[Value]) -> BTreeSet<String> {
    runs.iter()
        .filter_map(|r| r["run_id"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_answer_revive_list_history_and_rebuild() {
    let h = Harness::start(qa_script("qa"), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("qa", "qa").await;
    let config = bridge_config(&h.config, "127.0.0.1:0");
    let projector = spawn_projector(&config);
    let bridge = TestBridge::start(config.clone(), "127.0.0.1:0").await;
    let api = Api::new(&bridge.url(), Some(ACME));

    // Submit; the same Idempotency-Key gives the same run; another tenant's same key does not.
    let (s, first) = api.submit("qa", "hello", "key-1").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{first}");
    let run = first["run_id"].as_str().expect("run id").to_owned();
    assert_eq!(first["links"]["events"], format!("/v1/runs/{run}/events"));
    let (s, again) = api.submit("qa", "hello", "key-1").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{again}");
    assert_eq!(
        again["run_id"],
        run.as_str(),
        "a repeated key is the same run"
    );
    let globex = api.with_token(Some(GLOBEX));
    let (s, other) = globex.submit("qa", "hello", "key-1").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{other}");
    assert_ne!(other["run_id"], run.as_str(), "keys are per tenant");

    // The run asks; the view says what it waits on.
    let view = wait_view(&api, &run, |v| v["status"] == "waiting_user").await;
    assert_eq!(view["tenant"], "acme");
    assert_eq!(view["waiting"]["on"], "user");
    assert_eq!(view["current_step"]["number"], 1);
    assert_eq!(view["result"], Value::Null);
    let question = view["waiting"]["questions"][0]["question_id"]
        .as_str()
        .expect("question")
        .to_owned();
    assert_eq!(view["waiting"]["questions"][0]["prompt"], "Proceed?");

    // Answer: unknown question 404, the answer 202, the same again 202 (duplicate), another 409.
    let (s, p) = api
        .post(
            &format!("/v1/runs/{run}/answers/q_nope_1_0"),
            &json!({"answer": "yes"}),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{p}");
    assert_eq!(p["field"], "question_id");
    let path = format!("/v1/runs/{run}/answers/{question}");
    let (s, a) = api.post(&path, &json!({"answer": "yes"})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{a}");
    let view = wait_view(&api, &run, |v| v["status"] == "succeeded").await;
    let (s, a) = api.post(&path, &json!({"answer": "yes"})).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{a}");
    assert_eq!(a["duplicate"], true);
    let (s, p) = api.post(&path, &json!({"answer": "no"})).await;
    assert_eq!(s, StatusCode::CONFLICT, "{p}");
    assert_eq!(p["type"], "urn:kedge:problem:question-not-open");

    // Run state, result and its validation are reported apart.
    assert_eq!(view["finished"], true);
    assert_eq!(view["result"]["output"], "all done");
    assert_eq!(view["result"]["validation"]["status"], "not_checked");
    assert!(
        view["usage"]["total_tokens"].as_u64().unwrap_or(0) > 0,
        "{view}"
    );
    assert_eq!(view["waiting"], Value::Null);

    // A new message revives the run into a second turn.
    let (s, m) = api
        .post_raw(
            &format!("/v1/runs/{run}/messages"),
            json!({"text": "again please"}).to_string(),
            &[("Idempotency-Key", "m-1")],
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{m}");
    let (s, m2) = api
        .post_raw(
            &format!("/v1/runs/{run}/messages"),
            json!({"text": "again please"}).to_string(),
            &[("Idempotency-Key", "m-1")],
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{m2}");
    assert_eq!(m2["duplicate"], true, "same key, same message");
    assert_eq!(m2["seq"], m["seq"]);
    let view = wait_view(&api, &run, |v| v["turn"] == 2 && v["status"] == "succeeded").await;
    assert_eq!(view["result"]["output"], "second turn done");

    // A finished run cannot be cancelled.
    let (s, p) = api
        .post(&format!("/v1/runs/{run}/cancel"), &json!({}))
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{p}");

    // /history: every public event, paginated by sequence, equal to the journal's.
    let history = api.history_ids(&run).await;
    let journal: Vec<u64> = h
        .events(&run.parse().expect("run id"))
        .await
        .iter()
        .filter(|r| r.envelope.event_type() != EventType::Nudge)
        .map(|r| r.seq)
        .collect();
    assert_eq!(history, journal);
    let (_, page) = api
        .get(&format!(
            "/v1/runs/{run}/history?after={}&limit=2",
            journal[1]
        ))
        .await;
    let seqs: Vec<u64> = page["events"]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| e["seq"].as_u64().expect("seq"))
        .collect();
    assert_eq!(seqs, journal[2..4].to_vec());
    assert_eq!(page["events"][0]["run_id"], run.as_str());
    assert!(page["events"][0]["digest"].is_string());

    // The list comes from the projection: eventually the run is there, succeeded, turn 2.
    let (s, second) = api.submit("qa", "second run", "key-2").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{second}");
    let run2 = second["run_id"].as_str().expect("run id").to_owned();
    let runs = wait_list(&api, "", |runs| {
        runs.iter()
            .any(|r| r["run_id"] == run.as_str() && r["turn"] == 2 && r["finished"] == true)
            && runs.iter().any(|r| r["run_id"] == run2.as_str())
    })
    .await;
    assert_eq!(ids(&runs), BTreeSet::from([run.clone(), run2.clone()]));
    assert_eq!(runs[0]["run_id"], run2.as_str(), "newest first");
    let done = wait_list(&api, "?status=succeeded&agent=qa", |runs| {
        ids(runs).contains(&run)
    })
    .await;
    assert!(done.iter().all(|r| r["status"] == "succeeded"));
    let (_, none) = api.get("/v1/runs?agent=other").await;
    assert_eq!(none["runs"], json!([]));
    // Pagination: one run per page, the cursor continues.
    let (_, p1) = api.get("/v1/runs?limit=1").await;
    let cursor = p1["next_cursor"]
        .as_str()
        .unwrap_or_else(|| panic!("a page of one of two runs has a cursor: {p1}; all: {runs:?}"))
        .to_owned();
    let (_, p2) = api.get(&format!("/v1/runs?limit=1&cursor={cursor}")).await;
    assert_eq!(p2["next_cursor"], Value::Null);
    assert_eq!(
        ids(&[p1["runs"][0].clone(), p2["runs"][0].clone()]),
        BTreeSet::from([run.clone(), run2.clone()])
    );
    // Globex sees only its own run.
    let theirs = wait_list(&globex, "", |r| !r.is_empty()).await;
    assert_eq!(
        ids(&theirs),
        BTreeSet::from([other["run_id"].as_str().expect("id").to_owned()])
    );

    // Stale never wins: an older summary is refused; a rebuild restores a deleted entry and
    // removes one whose run is not in the journal.
    let projection = bridge.bridge.projection.clone();
    let writer = kedge_projector::Writer::open(&h.rt)
        .await
        .expect("projection writer");
    let acme: kedge_core::ids::TenantId = "acme".parse().expect("tenant");
    let run_id: kedge_core::ids::RunId = run.parse().expect("run id");
    let current = projection
        .get(&acme, &run_id)
        .await
        .expect("get")
        .expect("projected");
    let mut older = current.clone();
    older.seq -= 1;
    older.status = kedge_core::RunStatus::Running;
    assert_eq!(
        writer.store(&older, false).await.expect("store"),
        kedge_projector::Stored::Stale
    );
    let kv = h.rt.js.get_key_value("kedge_runs").await.expect("bucket");
    kv.delete(kedge_runtime::projection::key(&acme, &run_id))
        .await
        .expect("delete");
    kv.put(
        "acme.run_ghost",
        serde_json::to_vec(&older).expect("json").into(),
    )
    .await
    .expect("put ghost");
    projector.abort();
    let report = kedge_projector::rebuild(&h.rt).await.expect("rebuild");
    assert_eq!(report.runs, 3, "{report:?}");
    assert_eq!(report.failed, 0);
    assert_eq!(report.removed, 1, "{report:?}");
    assert!(report.written >= 1, "{report:?}");
    let restored = projection
        .get(&acme, &run_id)
        .await
        .expect("get")
        .expect("rebuilt");
    assert_eq!(restored, current);
    let runs = wait_list(&api, "", |r| r.len() == 2).await;
    assert_eq!(ids(&runs), BTreeSet::from([run.clone(), run2.clone()]));

    // The rebuild command does the same.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kedge"))
        .args(["runs", "rebuild"])
        .env("KEDGE_NATS_URL", h.nats.url())
        .envs(common::kind_env(
            &h.config,
            kedge_runtime::secure::Kind::Admin,
        ))
        .env("KEDGE_LOG", "warn")
        .output()
        .expect("kedge runs rebuild");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("3 runs in the journal"), "{stdout}");

    // Internal events (nudges), more than a page of them, are left out of /history pages
    // without cutting the walk short.
    let journal_before = h.events(&run_id).await.len();
    for i in 0..9 {
        h.input(
            &run_id,
            kedge_core::Event::Nudge(kedge_core::event::Nudge {
                reason: "test".into(),
            }),
            &format!("nudge-history-{i}"),
        )
        .await;
    }
    // A public event after them (a cancel of the finished run: journaled, changes nothing).
    let late = h
        .input(
            &run_id,
            kedge_core::Event::CancelRequested(kedge_core::event::CancelRequested {
                reason: "late".into(),
                by: None,
            }),
            "late-cancel",
        )
        .await;
    assert_eq!(h.events(&run_id).await.len(), journal_before + 10);
    let mut expected = history.clone();
    expected.push(late);
    assert_eq!(api.history_ids(&run).await, expected);

    bridge.stop().await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_answers_with_its_status_and_a_reason() {
    let h = Harness::start(qa_script("bad"), &[Svc::Intake]).await;
    h.agent("qa", "bad").await;
    let bridge = TestBridge::start(bridge_config(&h.config, "127.0.0.1:0"), "127.0.0.1:0").await;
    let api = Api::new(&bridge.url(), Some(ACME));
    let (s, sub) = api.submit("qa", "hello", "bad-1").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{sub}");
    let run = sub["run_id"].as_str().expect("run").to_owned();

    // (method, path, body, headers, token, expected status, expected field)
    type Case<'a> = (
        &'a str,
        String,
        Option<&'a str>,
        Vec<(&'a str, &'a str)>,
        Option<&'a str>,
        u16,
        Option<&'a str>,
    );
    let big = format!(r#"{{"agent":"qa","input":"{}"}}"#, "x".repeat(70 * 1024));
    let r = |p: &str| format!("/v1/runs/{run}{p}");
    let cases: Vec<Case> = vec![
        // Auth.
        ("GET", "/v1/runs".into(), None, vec![], None, 401, None),
        (
            "GET",
            "/v1/runs".into(),
            None,
            vec![],
            Some("wrong-token"),
            401,
            None,
        ),
        (
            "GET",
            "/v1/runs".into(),
            None,
            vec![("authorization", "Basic abc")],
            None,
            401,
            None,
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some(r#"{"agent":"qa","input":"x"}"#),
            vec![],
            Some(ACME_READ),
            403,
            None,
        ),
        (
            "POST",
            r("/cancel"),
            Some("{}"),
            vec![],
            Some(ACME_READ),
            403,
            None,
        ),
        // Submissions.
        (
            "POST",
            "/v1/runs".into(),
            Some("not json"),
            vec![],
            Some(ACME),
            400,
            Some("body"),
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some("[1,2]"),
            vec![],
            Some(ACME),
            400,
            Some("body"),
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some(r#"{"agent":"qa","input":"x","colour":"red"}"#),
            vec![],
            Some(ACME),
            422,
            Some("colour"),
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some(r#"{"agent":"qa"}"#),
            vec![],
            Some(ACME),
            422,
            Some("input"),
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some(r#"{"agent":"qa","input":"   "}"#),
            vec![],
            Some(ACME),
            422,
            Some("input"),
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some(r#"{"agent":"qa","input":"x","budget":{"max_steps":0}}"#),
            vec![],
            Some(ACME),
            422,
            Some("budget.max_steps"),
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some(r#"{"agent":"qa","input":5}"#),
            vec![],
            Some(ACME),
            422,
            Some("input"),
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some(r#"{"agent":"no such/agent","input":"x"}"#),
            vec![],
            Some(ACME),
            422,
            Some("agent"),
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some(r#"{"agent":"ghost","input":"x"}"#),
            vec![],
            Some(ACME),
            422,
            Some("agent"),
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some(r#"{"agent":"qa","input":"x","run_id":"nope"}"#),
            vec![],
            Some(ACME),
            422,
            Some("run_id"),
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some(big.as_str()),
            vec![],
            Some(ACME),
            413,
            Some("body"),
        ),
        (
            "POST",
            "/v1/runs".into(),
            Some(r#"{"agent":"qa","input":"x"}"#),
            vec![("idempotency-key", "has space")],
            Some(ACME),
            400,
            Some("Idempotency-Key"),
        ),
        // Reads.
        (
            "GET",
            "/v1/runs/not-a-run".into(),
            None,
            vec![],
            Some(ACME),
            400,
            Some("run_id"),
        ),
        (
            "GET",
            "/v1/runs/run_unknown".into(),
            None,
            vec![],
            Some(ACME),
            404,
            None,
        ),
        (
            "GET",
            r("/history?after=abc"),
            None,
            vec![],
            Some(ACME),
            400,
            Some("after"),
        ),
        (
            "GET",
            r("/history?limit=0"),
            None,
            vec![],
            Some(ACME),
            422,
            Some("limit"),
        ),
        (
            "GET",
            r("/history?limit=100000"),
            None,
            vec![],
            Some(ACME),
            422,
            Some("limit"),
        ),
        (
            "GET",
            r("/events"),
            None,
            vec![("last-event-id", "abc")],
            Some(ACME),
            400,
            Some("Last-Event-ID"),
        ),
        (
            "GET",
            r("/events?after=-1"),
            None,
            vec![],
            Some(ACME),
            400,
            Some("after"),
        ),
        (
            "GET",
            "/v1/runs/run_unknown/events".into(),
            None,
            vec![],
            Some(ACME),
            404,
            None,
        ),
        (
            "GET",
            "/v1/runs?status=bogus".into(),
            None,
            vec![],
            Some(ACME),
            422,
            Some("status"),
        ),
        (
            "GET",
            "/v1/runs?agent=a%20b".into(),
            None,
            vec![],
            Some(ACME),
            422,
            Some("agent"),
        ),
        (
            "GET",
            "/v1/runs?cursor=garbage".into(),
            None,
            vec![],
            Some(ACME),
            400,
            Some("cursor"),
        ),
        // Inputs.
        (
            "POST",
            r("/messages"),
            Some("{}"),
            vec![],
            Some(ACME),
            422,
            Some("text"),
        ),
        (
            "POST",
            r("/messages"),
            Some(r#"{"text":5}"#),
            vec![],
            Some(ACME),
            422,
            Some("text"),
        ),
        (
            "POST",
            r("/messages"),
            Some(r#"{"text":""}"#),
            vec![],
            Some(ACME),
            422,
            Some("text"),
        ),
        (
            "POST",
            r("/messages"),
            Some(r#"{"text":"hi","x":1}"#),
            vec![],
            Some(ACME),
            422,
            Some("x"),
        ),
        (
            "POST",
            r("/messages"),
            Some("{"),
            vec![],
            Some(ACME),
            400,
            Some("body"),
        ),
        (
            "POST",
            "/v1/runs/run_unknown/messages".into(),
            Some(r#"{"text":"hi"}"#),
            vec![],
            Some(ACME),
            404,
            None,
        ),
        (
            "POST",
            r("/answers/not-a-question"),
            Some(r#"{"answer":"x"}"#),
            vec![],
            Some(ACME),
            400,
            Some("question_id"),
        ),
        (
            "POST",
            r("/answers/q_x_1_0"),
            Some(r#"{}"#),
            vec![],
            Some(ACME),
            422,
            Some("answer"),
        ),
        (
            "POST",
            r("/answers/q_x_1_0"),
            Some(r#"{"answer":"x"}"#),
            vec![],
            Some(ACME),
            404,
            Some("question_id"),
        ),
        (
            "POST",
            r("/cancel"),
            Some("nope"),
            vec![],
            Some(ACME),
            400,
            Some("body"),
        ),
        (
            "POST",
            r("/cancel"),
            Some(r#"{"reason":7}"#),
            vec![],
            Some(ACME),
            422,
            Some("reason"),
        ),
        // Routing.
        (
            "GET",
            "/v2/nothing".into(),
            None,
            vec![],
            Some(ACME),
            404,
            None,
        ),
        (
            "DELETE",
            "/v1/runs".into(),
            None,
            vec![],
            Some(ACME),
            405,
            None,
        ),
    ];
    let http = reqwest::Client::new();
    for (method, path, body, headers, token, status, field) in &cases {
        let mut req = http.request(
            method.parse().expect("method"),
            format!("{}{path}", bridge.url()),
        );
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(b) = body {
            req = req
                .header("content-type", "application/json")
                .body(b.to_string());
        }
        let resp = req.send().await.expect("sent");
        let got = resp.status().as_u16();
        let ct = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let www = resp.headers().get("www-authenticate").is_some();
        let problem: Value = resp.json().await.unwrap_or(Value::Null);
        let what = format!("{method} {path}: {problem}");
        assert_eq!(got, *status, "{what}");
        assert_eq!(ct, "application/problem+json", "{what}");
        assert_eq!(problem["status"], *status, "{what}");
        assert!(
            problem["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{what}"
        );
        assert!(
            problem["type"]
                .as_str()
                .is_some_and(|t| t.starts_with("urn:kedge:problem:")),
            "{what}"
        );
        if let Some(f) = field {
            assert_eq!(problem["field"], *f, "{what}");
        }
        if *status == 401 {
            assert!(www, "401 carries WWW-Authenticate: {what}");
        }
    }

    // Garbage never crashes anything: nothing answers 5xx, and the bridge stays up.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let targets = [
        "/v1/runs".to_owned(),
        r("/messages"),
        r("/answers/q_x_1_0"),
        r("/cancel"),
    ];
    for i in 0..120 {
        let len = (next() % 300) as usize;
        let mut body: Vec<u8> = (0..len).map(|_| (next() % 256) as u8).collect();
        if i % 3 == 0 {
            body = format!(
                r#"{{"agent":{},"input":{},"text":[{}]}}"#,
                next() % 7,
                i,
                next()
            )
            .into_bytes();
        }
        let target = &targets[i % targets.len()];
        let resp = http
            .post(format!("{}{target}", bridge.url()))
            .bearer_auth(ACME)
            .body(body)
            .send()
            .await
            .expect("sent");
        assert!(resp.status().as_u16() < 500, "{target}: {}", resp.status());
    }
    let api = Api::new(&bridge.url(), None);
    assert_eq!(api.get("/healthz").await.0, StatusCode::OK);
    assert_eq!(api.get("/readyz").await.0, StatusCode::OK);
    // The run was not touched by any of it.
    let state = h.state(&run.parse().expect("run")).await;
    assert_eq!(state.ignored_inputs, 0);
    assert!(state.pending_messages.is_empty());

    // Without the broker the bridge is alive but not ready, and reads answer 503; with it back,
    // ready again.
    let mut h = h;
    h.nats.kill9();
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let (s, body) = api.get("/readyz").await;
        if s == StatusCode::SERVICE_UNAVAILABLE {
            assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()));
            break;
        }
        assert!(Instant::now() < until, "readyz stayed {s} without a broker");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(api.get("/healthz").await.0, StatusCode::OK);
    let (s, p) = Api::new(&bridge.url(), Some(ACME))
        .get(&format!("/v1/runs/{run}"))
        .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{p}");
    h.nats.restart().await;
    let until = Instant::now() + Duration::from_secs(20);
    while api.get("/readyz").await.0 != StatusCode::OK {
        assert!(
            Instant::now() < until,
            "not ready after the broker came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bridge.stop().await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_isolation_holds_for_every_endpoint() {
    let h = Harness::start(qa_script("iso"), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("qa", "iso").await;
    let config = bridge_config(&h.config, "127.0.0.1:0");
    let projector = spawn_projector(&config);
    let bridge = TestBridge::start(config, "127.0.0.1:0").await;
    let acme = Api::new(&bridge.url(), Some(ACME));
    let globex = acme.with_token(Some(GLOBEX));
    let (_, sub) = acme.submit("qa", "hello", "iso-1").await;
    let run = sub["run_id"].as_str().expect("run").to_owned();
    let view = wait_view(&acme, &run, |v| v["status"] == "waiting_user").await;
    let question = view["waiting"]["questions"][0]["question_id"]
        .as_str()
        .expect("q")
        .to_owned();
    let before = h.events(&run.parse().expect("run")).await.len();

    // Acme watches it: the replay, then heartbeats while it waits.
    let http = reqwest::Client::new();
    let mut sse = bridge_support::SseStream::open(
        &http,
        &format!("{}/v1/runs/{run}/events", bridge.url()),
        Some(ACME),
        None,
    )
    .await
    .expect("open");
    assert_eq!(sse.status, StatusCode::OK);
    let mut replayed = 0;
    let beat = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(item) = sse.next().await {
            match item {
                bridge_support::Sse::Event { id: Some(_), .. } => replayed += 1,
                bridge_support::Sse::Comment => return true,
                _ => {}
            }
        }
        false
    })
    .await;
    assert_eq!(beat, Ok(true), "a heartbeat comment after the replay");
    assert!(replayed >= 5, "{replayed}");
    drop(sse);

    // Every endpoint answers globex exactly as for a run that does not exist.
    let not_found = |(s, p): (StatusCode, Value)| {
        assert_eq!(s, StatusCode::NOT_FOUND, "{p}");
        p["detail"].as_str().unwrap_or("").replace(&run, "<run>")
    };
    let d1 = not_found(globex.get(&format!("/v1/runs/{run}")).await);
    let d0 = not_found(globex.get("/v1/runs/run_doesnotexist").await);
    assert_eq!(
        d1,
        d0.replace("run_doesnotexist", "<run>"),
        "no difference to probe"
    );
    not_found(globex.get(&format!("/v1/runs/{run}/history")).await);
    not_found(globex.get(&format!("/v1/runs/{run}/events")).await);
    not_found(
        globex
            .post(&format!("/v1/runs/{run}/messages"), &json!({"text": "hi"}))
            .await,
    );
    not_found(
        globex
            .post(
                &format!("/v1/runs/{run}/answers/{question}"),
                &json!({"answer": "yes"}),
            )
            .await,
    );
    not_found(
        globex
            .post(&format!("/v1/runs/{run}/cancel"), &json!({}))
            .await,
    );
    // SSE with the token in the query (as EventSource sends it) is isolated too.
    let (s, _) = Api::new(&bridge.url(), None)
        .get(&format!("/v1/runs/{run}/events?access_token={GLOBEX}"))
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    // The list: acme's run shows for acme, never for globex.
    wait_list(&acme, "", |r| ids(r).contains(&run)).await;
    let (_, theirs) = globex.get("/v1/runs").await;
    assert_eq!(theirs["runs"], json!([]));
    // Nothing globex did reached the journal.
    assert_eq!(h.events(&run.parse().expect("run")).await.len(), before);
    // Acme can do all of it.
    let (s, _) = acme
        .post(
            &format!("/v1/runs/{run}/answers/{question}"),
            &json!({"answer": "yes"}),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED);
    wait_view(&acme, &run, |v| v["status"] == "succeeded").await;
    projector.abort();
    bridge.stop().await;
    h.shutdown().await;
}

#[test]
fn the_openapi_document_matches_the_routes() {
    let doc: Value = serde_json::from_str(kedge_bridge::OPENAPI).expect("openapi.json is JSON");
    assert!(doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")));
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("path item").keys() {
            if ["get", "post", "put", "delete", "patch", "head", "options"]
                .contains(&method.as_str())
            {
                documented.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    let served: BTreeSet<(String, String)> = kedge_bridge::ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    let missing: Vec<_> = served.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&served).collect();
    assert!(
        missing.is_empty(),
        "routes missing from schemas/openapi.json: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "documented routes the bridge does not serve: {extra:?}"
    );
    assert!(kedge_bridge::routes_have_handlers());
    // Every $ref resolves.
    fn refs(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(o) => {
                for (k, x) in o {
                    if k == "$ref" {
                        out.extend(x.as_str().map(str::to_owned));
                    } else {
                        refs(x, out);
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&doc, &mut all);
    for r in all {
        let pointer = r.trim_start_matches('#');
        assert!(doc.pointer(pointer).is_some(), "dangling $ref {r}");
    }
}
