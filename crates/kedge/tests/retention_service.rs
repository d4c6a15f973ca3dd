//! The retention policy applied by a service: `kedge serve retention`
//! (`kedge_retention`) purges a finished run past the horizon everywhere (journal,
//! idempotency records, lease, projection, and the tool host removes its workspace), never
//! touches an unfinished run, and two replicas at once do it once in effect; agent revisions stay
//! readable however often the agent is edited while a run uses an old one.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{Harness, Svc};
use futures::StreamExt;
use kedge_core::RunStatus;
use kedge_core::event::Event;
use kedge_core::ids::RunId;
use kedge_retention::{self as retention, CURSOR_KEY, Cursor, Policy};
use kedge_runtime::secure::Kind;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

/// Keys of a KV bucket (empty when it has none).
async fn keys(rt: &kedge_runtime::Runtime, bucket: &str) -> Vec<String> {
    let kv = rt.js.get_key_value(bucket).await.expect("bucket");
    match kv.keys().await {
        Ok(keys) => keys.filter_map(|k| async move { k.ok() }).collect().await,
        Err(_) => Vec::new(),
    }
}

/// Keys of `bucket` that belong to `run` (its id's body appears in them).
async fn keys_of(rt: &kedge_runtime::Runtime, bucket: &str, run: &RunId) -> Vec<String> {
    let body = run.as_str().trim_start_matches("run_").to_owned();
    keys(rt, bucket)
        .await
        .into_iter()
        .filter(|k| k.contains(&body))
        .collect()
}

async fn wait_until(what: &str, mut ok: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !ok().await {
        assert!(start.elapsed() < WAIT, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn workspace(root: &Path, run: &RunId) -> std::path::PathBuf {
    root.join(run.as_str())
}

/// Two retention replicas (the service itself, as the `retention` user), a run that finishes and
/// one that waits for a person. The finished one goes everywhere once past the horizon, its
/// workspace too; the waiting one, its workspace and its records stay; once answered and past the
/// horizon it goes as well. No pass fails, and a pass after that reads nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retention_service_purges_finished_runs_everywhere_and_never_an_unfinished_one() {
    let write = json!({"name": "write_file", "arguments": {"path": "notes.txt", "content": "kept until purged"}});
    let script = json!({"models": {
        "act": {"steps": [
            {"text": "acting", "tool_calls": [write, {"name": "ledger_append", "arguments": {"text": "once"}}]},
            {"text": "done"}
        ]},
        "ask": {"steps": [
            {"text": "writing", "tool_calls": [write]},
            {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "which?"}}]},
            {"text": "answered"}
        ]}
    }});
    let mut h = Harness::start_with(script, &[Svc::Intake, Svc::Step, Svc::Tool], |c| {
        c.retention.enabled = true;
        c.retention.finished_after = Duration::from_secs(2);
        c.retention.interval = Duration::from_millis(300);
        c.retention.workspace_sweep = Duration::from_millis(200);
        c.retention.archive = true;
    })
    .await;
    h.agent("act", "act").await;
    h.agent("ask", "ask").await;
    let root = h.config.workspace_root.clone();
    let done = h.submit("act", "go", "rs-done").await;
    let waiting = h.submit("ask", "go", "rs-wait").await;
    assert_eq!(
        h.wait_terminal(&done, WAIT).await.status,
        RunStatus::Succeeded
    );
    let state = h
        .wait_for(&waiting, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    assert!(workspace(&root, &done).join("notes.txt").exists());
    assert!(workspace(&root, &waiting).join("notes.txt").exists());
    let admin = h.runtime_as(Kind::Admin).await;
    kedge_projector::rebuild(&admin)
        .await
        .expect("projection rebuilt");
    assert!(!keys_of(&admin, "kedge_idempotency", &done).await.is_empty());
    assert!(!keys_of(&admin, "kedge_runs", &done).await.is_empty());
    let waiting_events = h.events(&waiting).await.len();
    let waiting_records = keys_of(&admin, "kedge_idempotency", &waiting).await;
    assert!(!waiting_records.is_empty());

    // Two replicas of the service: `kedge serve retention` processes, as the retention user.
    for worker in ["w-ret-1", "w-ret-2"] {
        h.spawn_process_with_env(
            "retention",
            worker,
            "",
            &[
                ("KEDGE_RETENTION", "1".into()),
                ("KEDGE_RETENTION_FINISHED_AFTER", "2s".into()),
                ("KEDGE_RETENTION_INTERVAL", "300ms".into()),
            ],
        );
    }

    // Past the horizon, the finished run goes: journal, records, projection, then its workspace.
    wait_until("the finished run's journal is purged", async || {
        h.events(&done).await.is_empty()
    })
    .await;
    assert!(keys_of(&admin, "kedge_idempotency", &done).await.is_empty());
    assert!(keys_of(&admin, "kedge_runs", &done).await.is_empty());
    assert!(
        !keys(&admin, "kedge_leases")
            .await
            .iter()
            .any(|k| k == done.as_str())
    );
    assert!(
        admin
            .js
            .get_object_store("kedge_blobs")
            .await
            .expect("store")
            .info(retention::archive_name(&done).as_str())
            .await
            .is_ok(),
        "archived first"
    );
    wait_until(
        "the tool host removes the purged run's workspace",
        async || !workspace(&root, &done).exists(),
    )
    .await;

    // The waiting run, well past the horizon too, is untouched.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(h.events(&waiting).await.len(), waiting_events);
    assert_eq!(
        keys_of(&admin, "kedge_idempotency", &waiting).await,
        waiting_records
    );
    assert!(workspace(&root, &waiting).join("notes.txt").exists());
    assert_eq!(h.state(&waiting).await.status, RunStatus::WaitingUser);

    // Answered, it finishes, and goes in turn.
    let q = state.questions.keys().next().expect("a question").clone();
    h.input(
        &waiting,
        Event::QuestionAnswered(kedge_core::event::QuestionAnswered {
            question_id: q,
            answer: "the blue one".into(),
        }),
        "rs-answer",
    )
    .await;
    assert_eq!(
        h.wait_terminal(&waiting, WAIT).await.status,
        RunStatus::Succeeded
    );
    wait_until("the answered run is purged", async || {
        h.events(&waiting).await.is_empty()
    })
    .await;
    wait_until("its workspace is removed", async || {
        !workspace(&root, &waiting).exists()
    })
    .await;
    assert!(
        keys_of(&admin, "kedge_idempotency", &waiting)
            .await
            .is_empty()
    );

    // The cursor is past both runs' endings; a pass now reads nothing.
    let kv = admin
        .js
        .get_key_value("kedge_leases")
        .await
        .expect("bucket");
    let cursor: Cursor =
        serde_json::from_slice(&kv.get(CURSOR_KEY).await.expect("get").expect("a cursor"))
            .expect("cursor json");
    assert!(cursor.through > 0);
    let ret = h.runtime_as(Kind::Retention).await;
    let policy = Policy::from(&h.config.retention);
    let again = retention::apply_policy(&ret, policy).await.expect("a pass");
    assert_eq!(
        (again.read, again.purged, again.failed),
        (0, 0, 0),
        "{again:?}"
    );
    if common::secured() {
        let log = std::fs::read_to_string(h.nats.log_path()).unwrap_or_default();
        let violations = common::kedge_violations(&log);
        assert!(violations.is_empty(), "{violations:?}");
    }
    h.shutdown().await;
}

/// Many finished runs and two passes at once (two replicas starting together, small batches so
/// that they overlap and race for the cursor): every run is purged, none fails, the cursor ends
/// past the last ending, and an unfinished run among them is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_at_once_purge_each_finished_run_and_nothing_else() {
    let script = json!({"models": {
        "quick": {"default": {"text": "done"}},
        "ask": {"steps": [
            {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "which?"}}]},
            {"text": "answered"}
        ]}
    }});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("quick", "quick").await;
    h.agent("ask", "ask").await;
    let waiting = h.submit("ask", "go", "tr-wait").await;
    h.wait_for(&waiting, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    // A reconciler that has seen the journal so far: what follows is purged before its next
    // scan, which must not wait for messages that are gone.
    let mut reconciler = kedge_reconciler::Reconciler::new(h.runtime_as(Kind::Reconciler).await);
    reconciler.scan().await.expect("first scan");
    let mut runs = Vec::new();
    for i in 0..24 {
        runs.push(h.submit("quick", "go", &format!("tr-{i}")).await);
    }
    for run in &runs {
        assert_eq!(
            h.wait_terminal(run, WAIT).await.status,
            RunStatus::Succeeded
        );
    }
    h.wait_for(&waiting, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    let waiting_events = h.events(&waiting).await.len();
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let policy = Policy {
        finished_after: Duration::from_secs(1),
        archive: false,
        batch: 5,
    };
    let (a, b) = (
        h.runtime_as(Kind::Retention).await,
        h.runtime_as(Kind::Retention).await,
    );
    let (ra, rb) = tokio::join!(
        retention::apply_policy(&a, policy),
        retention::apply_policy(&b, policy)
    );
    let (ra, rb) = (ra.expect("pass a"), rb.expect("pass b"));
    assert_eq!((ra.failed, rb.failed), (0, 0), "{ra:?} {rb:?}");
    // A replica overtaken stops; a pass after that finishes whatever it left.
    let rc = retention::apply_policy(&a, policy).await.expect("pass c");
    assert_eq!(rc.failed, 0, "{rc:?}");
    assert!(
        ra.purged + rb.purged + rc.purged >= runs.len(),
        "{ra:?} {rb:?} {rc:?}"
    );
    for run in &runs {
        assert!(h.events(run).await.is_empty(), "{run} purged");
    }
    assert_eq!(h.events(&waiting).await.len(), waiting_events);
    let last = h.rt.journal.stream_last_seq().await.expect("last seq");
    assert!(rc.through <= last && rc.through > 0, "{rc:?}");
    let rd = retention::apply_policy(&b, policy).await.expect("pass d");
    assert_eq!((rd.read, rd.purged), (0, 0), "{rd:?}");
    let scan = tokio::time::timeout(Duration::from_secs(5), reconciler.scan())
        .await
        .expect("the scan does not wait for purged messages")
        .expect("the scan after the purge");
    assert!(scan.nudged.is_empty(), "{scan:?}");
    h.shutdown().await;
}

/// `kedge_agents` keeps 64 values per key: a run pinned to revision r must still read it after
/// the agent has been edited 70 times while the run waits, and finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_pinned_to_an_old_revision_finishes_after_70_edits_of_its_agent() {
    let script = json!({"models": {"ask": {"steps": [
        {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "which?"}}]},
        {"text": "answered"}
    ]}}});
    // The step service runs as a process, so that the one that finishes the run is a new one,
    // with no definition cached.
    let mut h = Harness::start(script, &[Svc::Intake]).await;
    h.agent("ask", "ask").await;
    let first = h.spawn_process("step", "w-pin-1", "");
    let run = h.submit("ask", "go", "pin-1").await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    let name: kedge_core::ids::AgentName = "ask".parse().expect("name");
    let pinned = state.bundle.agent_revision;
    let (_, def) = h.rt.agents.latest(&name).await.expect("stored");
    for i in 0..70 {
        let mut edited = (*def).clone();
        edited.system_prompt = format!("edited {i}");
        h.rt.agents.put(&edited).await.expect("edited");
    }
    // The key's own history no longer holds the pinned revision; its copy does.
    let kv = h.rt.js.get_key_value("kedge_agents").await.expect("bucket");
    assert!(
        kv.entry_for_revision("ask", pinned)
            .await
            .ok()
            .flatten()
            .is_none(),
        "revision {pinned} aged out of the key's history"
    );
    // A fresh store (no cache) reads it back.
    let fresh = kedge_runtime::agents::AgentStore::new(kv);
    let read = fresh
        .at_revision(&name, pinned)
        .await
        .expect("pinned revision");
    assert_eq!(read.system_prompt, def.system_prompt);
    let history = fresh.history(&name).await.expect("history");
    assert_eq!(history.len(), 71, "{history:?}");
    assert_eq!(history.first(), Some(&pinned));
    // The list shows the agent once.
    assert_eq!(h.rt.agents.list().await.expect("list").len(), 1);

    // A new step service (no cache) takes the answer and finishes on the pinned revision.
    h.kill9(first);
    h.spawn_process("step", "w-pin-2", "");
    let q = state.questions.keys().next().expect("a question").clone();
    h.input(
        &run,
        Event::QuestionAnswered(kedge_core::event::QuestionAnswered {
            question_id: q,
            answer: "the blue one".into(),
        }),
        "pin-answer",
    )
    .await;
    let end = h.wait_terminal(&run, WAIT).await;
    assert_eq!(end.status, RunStatus::Succeeded, "{end:?}");
    assert_eq!(end.bundle.agent_revision, pinned);
    h.shutdown().await;
}
