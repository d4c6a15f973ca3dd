//! docs/RUNBOOK.md's `nats` CLI inspections, done against a real deployment by a NATS client that
//! is not Kedge's own: `scripts/runbook_check.py` (nats-py, installed into
//! `.tools/nats-py` by `scripts/setup.sh --tests`) reads every `nats …` recipe from the runbook
//! itself and does what each read-only one does; this test makes runs whose traces those recipes
//! must find (one succeeded with a tool call, one failed, one waiting for the user's answer, one
//! purged into the archive, a dead letter, live workers) and checks that each found them. A
//! recipe whose stream, bucket, consumer, subject filter or key is wrong therefore fails here; the
//! second test shows that on a copy of the runbook with such mistakes.
//!
//! Skips, saying why, when python3 or nats-py is not there.

use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Harness, STORE_EVERY_ANSWER, Svc};
use kedge_core::RunStatus;
use kedge_core::event::Timestamp;
use kedge_core::ids::RunId;
use kedge_retention::{self as retention, PurgeOptions, Purged};
use kedge_runtime::secure::Kind;
use kedge_serve::Service;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);
/// Where the dead letter comes from: a decision subject whose run token is not a run id.
const POISON: &str = "agent.run.not-a-run.d.run.created";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `python3` with `.tools/nats-py` on its path, or why it cannot do the inspections.
fn python() -> Result<Command, String> {
    let python = std::env::var("KEDGE_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut path = root().join(".tools/nats-py").display().to_string();
    if let Some(p) = std::env::var_os("PYTHONPATH") {
        path = format!("{path}:{}", p.to_string_lossy());
    }
    let make = || {
        let mut c = Command::new(&python);
        c.env("PYTHONPATH", &path);
        c
    };
    let probe = make()
        .args(["-c", "import nats, nats.js.api"])
        .output()
        .map_err(|e| format!("{python} cannot be run ({e})"))?;
    if !probe.status.success() {
        return Err(format!(
            "nats-py is not importable by {python} ({}); scripts/setup.sh --tests installs it \
             into .tools/nats-py",
            String::from_utf8_lossy(&probe.stderr).trim()
        ));
    }
    Ok(make())
}

/// The run's summary in `kedge_runs`, once its status is `status` (or panics).
async fn projected(h: &Harness, run: &RunId, status: &str) -> Value {
    let tenant = h.state(run).await.bundle.tenant.to_string();
    let kv = h.rt.js.get_key_value("kedge_runs").await.expect("bucket");
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(Some(v)) = kv.get(format!("{tenant}.{run}")).await {
            let summary: Value = serde_json::from_slice(&v).expect("json");
            if summary["status"] == status {
                return summary;
            }
        }
        assert!(Instant::now() < deadline, "{run} not projected as {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The runs a deployment for the runbook has: labels and ids.
struct Runs {
    /// Succeeded, with a tool call (a model response stored per step, an operation record).
    done: RunId,
    /// Failed: its model refuses every call (400).
    failed: RunId,
    /// Waiting for the user's answer, with a message on its subjects that was set aside.
    waiting: RunId,
    /// Waiting on a timer an hour away.
    sleeping: RunId,
    /// Succeeded, then purged with `--archive`.
    archived: RunId,
}

impl Runs {
    fn args(&self) -> Vec<String> {
        [
            ("done", &self.done),
            ("failed", &self.failed),
            ("waiting", &self.waiting),
            ("sleeping", &self.sleeping),
            ("archived", &self.archived),
        ]
        .iter()
        .flat_map(|(l, r)| ["--run".to_owned(), format!("{l}={r}")])
        .collect()
    }
}

/// Intake, step, tool, timer and projector, and the runs and traces the runbook's recipes look
/// for.
async fn deployment() -> (Harness, Runs) {
    let script = json!({"models": {
        "act": {"steps": [
            {"text": "acting", "tool_calls": [{"name": "ledger_append", "arguments": {"text": "once"}}]},
            {"text": "done"}
        ]},
        "broken": {"default": {"text": "never", "fault": {"status": 400, "times": 1000}}},
        "ask": {"steps": [
            {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "which?"}}]},
            {"text": "never"}
        ]},
        "sleep": {"steps": [
            {"text": "later", "tool_calls": [{"name": "wait", "arguments": {"seconds": 3600}}]},
            {"text": "never"}
        ]}
    }});
    let mut h = Harness::start(script, &[Svc::Intake, Svc::Tool]).await;
    // A step worker that stores every answer in kedge_idempotency before committing it (as when
    // the run moves on during a model call), so the recipe for a stored response finds one.
    h.spawn_process("step", "w-step", STORE_EVERY_ANSWER);
    common::spawn_detached(&h.config, Service::Projector);
    common::spawn_detached(&h.config, Service::Timer);
    h.agent("act", "act").await;
    h.agent("broken", "broken").await;
    h.agent("ask", "ask").await;
    h.agent("sleep", "sleep").await;
    let runs = Runs {
        done: h.submit("act", "go", "rb-done").await,
        failed: h.submit("broken", "go", "rb-failed").await,
        waiting: h.submit("ask", "go", "rb-waiting").await,
        sleeping: h.submit("sleep", "go", "rb-sleeping").await,
        archived: h.submit("act", "go again", "rb-archived").await,
    };
    for (run, status) in [
        (&runs.done, RunStatus::Succeeded),
        (&runs.failed, RunStatus::Failed),
        (&runs.archived, RunStatus::Succeeded),
    ] {
        assert_eq!(h.wait_terminal(run, WAIT).await.status, status, "{run}");
    }
    h.wait_for(&runs.waiting, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    projected(&h, &runs.done, "succeeded").await;
    projected(&h, &runs.failed, "failed").await;
    projected(&h, &runs.waiting, "waiting_user").await;
    projected(&h, &runs.archived, "succeeded").await;
    h.wait_for(&runs.sleeping, WAIT, |s| {
        s.status == RunStatus::WaitingExternal
    })
    .await;
    projected(&h, &runs.sleeping, "waiting_external").await;
    let timers = h.rt.js.get_stream("KEDGE_TIMERS").await.expect("stream");
    let rejections =
        h.rt.js
            .get_stream("KEDGE_REJECTIONS")
            .await
            .expect("stream");
    let present = |stream: &async_nats::jetstream::stream::Stream, subject: String| {
        let stream = stream.clone();
        async move {
            let deadline = Instant::now() + WAIT;
            while stream.direct_get_last_for_subject(&subject).await.is_err() {
                assert!(Instant::now() < deadline, "nothing on {subject}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    // The timer service handed the wait to the broker.
    present(&timers, format!("kedge.timer.sched.{}.>", runs.sleeping)).await;

    // Something on the waiting run's subjects that is not an event: set aside and recorded.
    h.rt.js
        .publish(
            format!("agent.run.{}.i.user.message", runs.waiting),
            b"not an event".to_vec().into(),
        )
        .await
        .expect("published")
        .await
        .expect("stored");
    present(
        &rejections,
        format!("agent.rejected.journal.{}.>", runs.waiting),
    )
    .await;

    // One run purged into the archive, as `kedge runs purge --archive` does (as the admin),
    // once the projector has handled every decision (one still in flight could write the
    // purged run's summary again).
    let deadline = Instant::now() + WAIT;
    loop {
        let mut projector: async_nats::jetstream::consumer::PullConsumer =
            h.rt.js
                .get_consumer_from_stream("projector", "KEDGE_RUNS")
                .await
                .expect("projector consumer");
        let info = projector.info().await.expect("consumer info");
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the projector is behind: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let admin = h.runtime_as(Kind::Admin).await;
    let purged = retention::purge_run(
        &admin,
        &runs.archived,
        PurgeOptions {
            finished_before: Some(Timestamp::now()),
            archive: true,
            dry_run: false,
        },
    )
    .await
    .expect("purge");
    assert!(
        matches!(
            purged,
            Purged::Purged {
                archive: Some(_),
                ..
            }
        ),
        "{purged:?}"
    );

    // A dead letter: the projector gives up at once on a decision that names no run.
    h.rt.js
        .publish(POISON, b"{}".to_vec().into())
        .await
        .expect("published")
        .await
        .expect("stored");
    present(&rejections, "agent.rejected.dead.projector".into()).await;
    (h, runs)
}

/// Runs the script against the deployment (as the admin on a secured server, as an operator's
/// `kedge-admin` context would), on `runbook`; its JSON results.
fn inspect(mut python: Command, h: &Harness, runs: &Runs, runbook: &Path) -> Vec<Value> {
    python
        .arg(root().join("scripts/runbook_check.py"))
        .args(["--server", &h.nats.url(), "--json", "--sub-seconds", "0.4"])
        .arg("--runbook")
        .arg(runbook)
        .args(runs.args())
        .env_remove("NATS_URL");
    if common::secured() {
        python
            .env("NATS_USER", Kind::Admin.user())
            .env("NATS_PASSWORD", common::kind_password(Kind::Admin));
    }
    let out = python.output().expect("runbook_check.py runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let doc: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "runbook_check.py printed no JSON ({e}); status {:?}\nstdout: {stdout}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    });
    doc["results"].as_array().expect("results").clone()
}

fn runs_of(r: &Value) -> BTreeSet<String> {
    r["found"]["runs"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn set(ids: &[&RunId]) -> BTreeSet<String> {
    ids.iter().map(|r| r.to_string()).collect()
}

fn show(r: &Value) -> String {
    format!(
        "line {} [{}] {}{}: {}",
        r["line"],
        r["section"].as_str().unwrap_or_default(),
        r["command"].as_str().unwrap_or_default(),
        r["run"]
            .as_str()
            .map(|l| format!(" (run {l})"))
            .unwrap_or_default(),
        if r["ok"] == true {
            r["found"].to_string().chars().take(400).collect::<String>()
        } else {
            format!("ERROR {}", r["error"])
        }
    )
}

/// Everything the runbook's inspections should have found in [`deployment`] and did not: empty
/// when the runbook is right.
fn problems(results: &[Value], runs: &Runs) -> Vec<String> {
    let mut p = Vec::new();
    let done: Vec<&Value> = results.iter().filter(|r| r["skipped"].is_null()).collect();
    // Every inspection could be done: its stream, bucket, consumer and object store exist.
    for r in done.iter().filter(|r| r["ok"] != true) {
        p.push(format!("failed: {}", show(r)));
    }
    let ok: Vec<&Value> = done.iter().copied().filter(|r| r["ok"] == true).collect();
    let op = |r: &Value, o: &str| r["op"] == o;
    let cmd = |r: &Value, s: &str| r["command"].as_str().is_some_and(|c| c.contains(s));
    let run_is = |r: &Value, id: &RunId| r["run_id"] == id.as_str();
    let count = |r: &Value| r["found"]["count"].as_u64().unwrap_or(0);
    let across = |r: &&Value| r["section"] == "Across runs";
    if done.len() < 30 {
        p.push(format!(
            "only {} inspections were read from the runbook",
            done.len()
        ));
    }
    if done.iter().filter(|r| across(r)).count() < 10 {
        p.push("the \"Across runs\" section has fewer than 10 inspections".into());
    }
    let mut expect = |what: &str, matching: Vec<&Value>, check: &dyn Fn(&Value) -> bool| {
        if matching.is_empty() {
            p.push(format!("no recipe: {what}"));
        }
        for r in matching {
            if !check(r) {
                p.push(format!("{what}: {}", show(r)));
            }
        }
    };
    let journal_query = |r: &Value| {
        (op(r, "stream_view") || op(r, "stream_subjects") || op(r, "stream_last"))
            && r["target"]["stream"] == "KEDGE_RUNS"
    };

    // Across runs: the journal by event type, the projection, dead letters, consumers.
    expect(
        "runs that failed (the failed run, and only it)",
        ok.iter()
            .copied()
            .filter(|r| across(r) && journal_query(r) && cmd(r, "run.failed"))
            .collect(),
        &|r| runs_of(r) == set(&[&runs.failed]),
    );
    expect(
        "runs that succeeded (the succeeded run; the purged one is gone)",
        ok.iter()
            .copied()
            .filter(|r| across(r) && journal_query(r) && cmd(r, "run.succeeded"))
            .collect(),
        &|r| runs_of(r) == set(&[&runs.done]),
    );
    expect(
        "runs that asked a person",
        ok.iter()
            .copied()
            .filter(|r| across(r) && journal_query(r) && cmd(r, "question.asked"))
            .collect(),
        &|r| runs_of(r) == set(&[&runs.waiting]),
    );
    expect(
        "runs waiting on a person (kedge_runs watched and filtered)",
        ok.iter()
            .copied()
            .filter(|r| op(r, "kv_watch") && r["target"]["grep"].is_string())
            .collect(),
        &|r| r["target"]["bucket"] == "kedge_runs" && runs_of(r) == set(&[&runs.waiting]),
    );
    expect(
        "every run in kedge_runs (listed or watched)",
        ok.iter()
            .copied()
            .filter(|r| {
                (op(r, "kv_ls") || (op(r, "kv_watch") && r["target"]["grep"].is_null()))
                    && r["target"]["bucket"] == "kedge_runs"
            })
            .collect(),
        &|r| runs_of(r) == set(&[&runs.done, &runs.failed, &runs.waiting, &runs.sleeping]),
    );
    expect(
        "a run's summary in kedge_runs",
        ok.iter()
            .copied()
            .filter(|r| op(r, "kv_get") && r["target"]["bucket"] == "kedge_runs")
            .collect(),
        &|r| {
            let status = |s: &str| {
                r["found"]["values"]
                    .as_object()
                    .is_some_and(|v| v.len() == 1 && v.values().all(|v| v["status"] == s))
            };
            if run_is(r, &runs.done) {
                status("succeeded")
            } else if run_is(r, &runs.failed) {
                status("failed")
            } else if run_is(r, &runs.waiting) {
                status("waiting_user")
            } else if run_is(r, &runs.sleeping) {
                status("waiting_external")
            } else {
                count(r) == 0
            }
        },
    );
    expect(
        "the dead letters",
        ok.iter()
            .copied()
            .filter(|r| cmd(r, "rejected.dead"))
            .collect(),
        &|r| {
            r["target"]["stream"] == "KEDGE_REJECTIONS"
                && if op(r, "stream_view") {
                    r["found"]["messages"]
                        .as_array()
                        .is_some_and(|m| m.iter().any(|m| m["data"]["subject"] == POISON))
                } else {
                    r["found"]["subjects"]
                        .get("agent.rejected.dead.projector")
                        .is_some()
                }
        },
    );
    // Every durable consumer of nats/consumers/ has a recipe, and each recipe's consumer exists.
    for stream in ["KEDGE_TASKS", "KEDGE_RUNS", "KEDGE_TIMERS"] {
        let dir = root().join("nats/consumers").join(stream);
        for entry in std::fs::read_dir(&dir).expect("consumers dir") {
            let file = entry.expect("entry").path();
            let name = file
                .file_stem()
                .expect("name")
                .to_string_lossy()
                .to_string();
            expect(
                &format!("consumer info {stream} {name}"),
                ok.iter()
                    .copied()
                    .filter(|r| {
                        op(r, "consumer_info")
                            && r["target"]["stream"] == stream
                            && r["target"]["consumer"] == name.as_str()
                    })
                    .collect(),
                &|r| r["found"]["name"] == name.as_str() && r["found"]["num_pending"].is_u64(),
            );
        }
    }

    // One run: its journal, its last decision, its records, its archive.
    expect(
        "a run's journal",
        ok.iter()
            .copied()
            .filter(|r| {
                op(r, "stream_view")
                    && r["target"]["stream"] == "KEDGE_RUNS"
                    && r["target"]["filter"].as_str().is_some_and(|f| {
                        r["run_id"]
                            .as_str()
                            .is_some_and(|id| f == format!("agent.run.{id}.>"))
                    })
            })
            .collect(),
        &|r| {
            if run_is(r, &runs.archived) {
                count(r) == 0
            } else {
                count(r) >= 3
                    && runs_of(r).len() == 1
                    && runs_of(r).contains(r["run_id"].as_str().unwrap_or_default())
            }
        },
    );
    expect(
        "a run's last decision",
        ok.iter()
            .copied()
            .filter(|r| op(r, "stream_last") && r["target"]["stream"] == "KEDGE_RUNS")
            .collect(),
        &|r| {
            let last = |t: &str| {
                r["found"]["subject"].as_str().is_some_and(|s| {
                    s == format!(
                        "agent.run.{}.d.{t}",
                        r["run_id"].as_str().unwrap_or_default()
                    )
                })
            };
            if run_is(r, &runs.done) {
                last("run.succeeded")
            } else if run_is(r, &runs.failed) {
                last("run.failed")
            } else if run_is(r, &runs.waiting) || run_is(r, &runs.sleeping) {
                // Waiting on a person or a timer: `run.waiting` stays the group's last decision
                // under gate `wait_from_step_group` (only a wait on tools leaves it out).
                last("run.waiting")
            } else {
                count(r) == 0
            }
        },
    );
    expect(
        "a stored model response",
        ok.iter()
            .copied()
            .filter(|r| op(r, "kv_get") && cmd(r, "model.req_") && run_is(r, &runs.done))
            .collect(),
        &|r| r["target"]["bucket"] == "kedge_idempotency" && count(r) >= 2,
    );
    expect(
        "an operation's record",
        ok.iter()
            .copied()
            .filter(|r| {
                op(r, "kv_get")
                    && r["target"]["bucket"] == "kedge_idempotency"
                    && r["target"]["key"]
                        .as_str()
                        .is_some_and(|k| k.starts_with("op."))
                    && run_is(r, &runs.done)
            })
            .collect(),
        &|r| {
            r["found"]["values"]
                .as_object()
                .is_some_and(|v| v.len() == 1 && v.values().all(|v| v["state"] == "done"))
        },
    );
    expect(
        "an archived journal",
        ok.iter()
            .copied()
            .filter(|r| {
                op(r, "object_get")
                    && run_is(r, &runs.archived)
                    && r["target"]["name"]
                        .as_str()
                        .is_some_and(|n| n.starts_with("archive/"))
            })
            .collect(),
        &|r| {
            r["target"]["bucket"] == "kedge_blobs"
                && r["found"]["objects"].as_object().is_some_and(|o| {
                    o.len() == 1 && o.values().all(|o| o["lines"].as_u64() >= Some(3))
                })
        },
    );
    // Timers and set-aside messages, by the run's subjects.
    let filter_is = |r: &Value, stream: &str, pattern: &str| {
        r["target"]["stream"] == stream
            && r["run_id"].as_str().is_some_and(|id| {
                r["target"]["filter"].as_str() == Some(pattern.replace("{run}", id).as_str())
            })
    };
    let only = |r: &Value, run: &RunId, at_least: u64| {
        if run_is(r, run) {
            count(r) >= at_least && runs_of(r) == set(&[run])
        } else {
            count(r) == 0
        }
    };
    expect(
        "a run's pending timers",
        ok.iter()
            .copied()
            .filter(|r| {
                op(r, "stream_view") && filter_is(r, "KEDGE_TIMERS", "kedge.timer.sched.{run}.>")
            })
            .collect(),
        &|r| only(r, &runs.sleeping, 1),
    );
    expect(
        "a run's timer events in the journal",
        ok.iter()
            .copied()
            .filter(|r| {
                op(r, "stream_view") && filter_is(r, "KEDGE_RUNS", "agent.run.{run}.*.timer.>")
            })
            .collect(),
        &|r| only(r, &runs.sleeping, 1),
    );
    expect(
        "every pending timer",
        ok.iter()
            .copied()
            .filter(|r| op(r, "stream_subjects") && r["target"]["stream"] == "KEDGE_TIMERS")
            .collect(),
        &|r| runs_of(r) == set(&[&runs.sleeping]),
    );
    expect(
        "what was set aside on a run's subjects",
        ok.iter()
            .copied()
            .filter(|r| {
                op(r, "stream_view")
                    && filter_is(r, "KEDGE_REJECTIONS", "agent.rejected.journal.{run}.>")
            })
            .collect(),
        &|r| only(r, &runs.waiting, 1),
    );
    expect(
        "the workers' heartbeats",
        ok.iter()
            .copied()
            .filter(|r| op(r, "sub") && cmd(r, "kedge.live.hb"))
            .collect(),
        &|r| count(r) >= 1,
    );
    // The stream flags the runbook shows are the layout's fields, with the layout's values.
    expect(
        "stream flags",
        ok.iter()
            .copied()
            .filter(|r| op(r, "stream_info") && r["target"]["jq"].is_array())
            .collect(),
        &|r| {
            let stream = r["target"]["stream"].as_str().unwrap_or_default();
            let path = root().join(format!("nats/streams/{stream}.json"));
            let Ok(text) = std::fs::read_to_string(&path) else {
                return false;
            };
            let layout: Value = serde_json::from_str(&text).expect("layout json");
            let falsy = |v: &Value| v.is_null() || *v == json!(false) || *v == json!(0);
            r["found"]["fields"].as_object().is_some_and(|fields| {
                fields.iter().all(|(k, v)| {
                    layout
                        .get(k)
                        .is_some_and(|want| v == want || (falsy(v) && falsy(want)))
                })
            })
        },
    );
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_runbook_inspection_finds_what_it_should_with_another_nats_client() {
    let client = match python() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("SKIPPED runbook test: {why}");
            return;
        }
    };
    let started = Instant::now();
    let (h, runs) = deployment().await;
    let results = inspect(client, &h, &runs, &root().join("docs/RUNBOOK.md"));
    // What each recipe found (shown with --nocapture or when the test fails).
    for r in &results {
        if r["skipped"].is_null() {
            eprintln!("{}", show(r));
        } else {
            eprintln!("skipped: {} ({})", r["command"], r["skipped"]);
        }
    }
    let found = problems(&results, &runs);
    assert!(
        found.is_empty(),
        "docs/RUNBOOK.md's recipes did not find what they should:\n{}",
        found.join("\n")
    );

    // The same checks fail on a runbook with a wrong subject, bucket, consumer and key.
    let real = std::fs::read_to_string(root().join("docs/RUNBOOK.md")).expect("runbook");
    let broken = real
        .replace("'agent.run.*.d.run.failed'", "'agent.run.*.run.failed'")
        .replace("nats kv ls kedge_runs ", "nats kv ls kedge_run ")
        .replace(
            "consumer info KEDGE_RUNS projector",
            "consumer info KEDGE_RUNS projection",
        )
        .replace("'model.req_…'", "'req_…'");
    assert_ne!(broken, real, "the mutations apply");
    let copy = h.dir.path().join("RUNBOOK.md");
    std::fs::write(&copy, broken).expect("copy");
    let client = python().expect("python again");
    let wrong = problems(&inspect(client, &h, &runs, &copy), &runs);
    for expected in [
        "runs that failed",
        "kedge_run not found",
        "consumer info KEDGE_RUNS projector",
        "a stored model response",
    ] {
        assert!(
            wrong.iter().any(|p| p.contains(expected)),
            "a broken recipe went unnoticed ({expected}):\n{}",
            wrong.join("\n")
        );
    }
    eprintln!(
        "runbook: {} inspections checked in {:?}",
        results.iter().filter(|r| r["skipped"].is_null()).count(),
        started.elapsed()
    );
    h.shutdown().await;
}
