//! Retention: `kedge runs purge` removes a finished run's journal, idempotency
//! records, lease and projection entry, archives its journal first when asked, never touches a
//! run that is not finished, and is idempotent; only the admin's credentials may purge.

use crate::common;

use std::time::Duration;

use common::{Harness, STORE_EVERY_ANSWER, Svc};
use futures::StreamExt;
use kedge_core::RunStatus;
use kedge_core::event::Timestamp;
use kedge_retention::{self as retention, PurgeOptions, Purged};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_run_is_purged_everywhere_and_archived_and_an_unfinished_one_is_left_alone() {
    let script = json!({"models": {
        "act": {"steps": [
            {"text": "acting", "tool_calls": [{"name": "ledger_append", "arguments": {"text": "once"}}]},
            // Over 64 KiB: its step.completed, run.succeeded and stored response go by reference.
            {"text": "done ".repeat(20_000)}
        ]},
        "ask": {"steps": [
            {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "which?"}}]},
            {"text": "never"}
        ]}
    }});
    let mut h = Harness::start(script, &[Svc::Intake, Svc::Tool]).await;
    // A step worker that takes each answer's commit as not landed, so it stores every answer
    // in kedge_idempotency first (as when the run moves on during a model call): the purge
    // must remove those records too.
    h.spawn_process("step", "w-step", STORE_EVERY_ANSWER);
    h.agent("act", "act").await;
    h.agent("ask", "ask").await;
    // An input over 64 KiB: its run.created goes by reference.
    let done = h.submit("act", &"go ".repeat(40_000), "ret-done").await;
    let waiting = h.submit("ask", "go", "ret-wait").await;
    assert_eq!(
        h.wait_terminal(&done, WAIT).await.status,
        RunStatus::Succeeded
    );
    h.wait_for(&waiting, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    let admin = h.runtime_as(Kind::Admin).await;
    // The projection has both runs.
    kedge_projector::rebuild(&admin).await.expect("rebuild");
    let runs_keys = keys(&admin, "kedge_runs").await;
    assert!(runs_keys.iter().any(|k| k.ends_with(done.as_str())));
    let idem = keys(&admin, "kedge_idempotency").await;
    let run_hex = done.as_str().trim_start_matches("run_");
    let mine = |keys: &[String]| keys.iter().filter(|k| k.contains(run_hex)).count();
    assert!(
        mine(&idem) >= 2,
        "a model response and an operation record: {idem:?}"
    );
    let events = h.events(&done).await;
    // Its blobs: run.created, step 2's step.completed and the run.succeeded (and the stored
    // response of step 2, in kedge_idempotency).
    let referenced = h.rt.journal.blob_references(&done).await.expect("refs");
    assert_eq!(referenced.len(), 3, "{referenced:?}");
    for (_, r) in &referenced {
        h.rt.journal
            .blobs()
            .get(&done, r)
            .await
            .expect("blob there");
    }

    // The CLI lists them from the projection (as the operator), filtered by status.
    let cli = |kind: Kind, args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kedge"))
            .args(args)
            .env("KEDGE_NATS_URL", h.nats.url())
            .env_remove("KEDGE_CONFIG")
            .envs(common::kind_env(&h.config, kind))
            .output()
            .expect("kedge runs");
        assert!(out.status.success(), "kedge {args:?}: {out:?}");
        String::from_utf8(out.stdout).expect("utf-8")
    };
    let tenant = h.state(&done).await.bundle.tenant.to_string();
    let listed = cli(
        Kind::Operator,
        &["runs", "list", "--tenant", &tenant, "--json"],
    );
    let ids: Vec<String> = listed
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["run_id"].to_string())
        .collect();
    assert_eq!(ids.len(), 2, "{listed}");
    assert_eq!(ids[0], json!(waiting).to_string(), "newest first: {listed}");
    let waiting_only = cli(
        Kind::Operator,
        &[
            "runs",
            "list",
            "--tenant",
            &tenant,
            "--status",
            "waiting_user",
            "--json",
        ],
    );
    assert_eq!(waiting_only.lines().count(), 1, "{waiting_only}");
    let array = cli(
        Kind::Operator,
        &["runs", "list", "--tenant", &tenant, "-o", "json"],
    );
    let array: serde_json::Value = serde_json::from_str(&array).expect("a JSON array");
    assert_eq!(array.as_array().map(Vec::len), Some(2), "{array}");
    // A dry run of the purge command, as the admin.
    let dry = cli(
        Kind::Admin,
        &[
            "runs",
            "purge",
            "--run",
            done.as_str(),
            "--dry-run",
            "--json",
        ],
    );
    assert!(dry.contains("\"dry_run\":true"), "{dry}");

    // A cutoff before the run ended leaves it alone.
    let early = PurgeOptions {
        finished_before: Some(events[0].envelope.at),
        ..PurgeOptions::default()
    };
    assert!(matches!(
        retention::purge_run(&admin, &done, early)
            .await
            .expect("purge"),
        Purged::TooRecent { .. }
    ));
    // A dry run counts and removes nothing.
    let dry = PurgeOptions {
        dry_run: true,
        ..PurgeOptions::default()
    };
    assert!(matches!(
        retention::purge_run(&admin, &done, dry)
            .await
            .expect("purge"),
        Purged::Purged {
            dry_run: true,
            blobs: 4,
            ..
        }
    ));
    assert_eq!(h.events(&done).await.len(), events.len());

    // Operators (and services) may not purge: the broker refuses the request (probed on an
    // unnamed connection, as the secured suites probe the boundary).
    if common::secured() {
        let operator = async_nats::ConnectOptions::with_user_and_password(
            Kind::Operator.user(),
            common::kind_password(Kind::Operator),
        )
        .request_timeout(Some(Duration::from_secs(2)))
        .connect(h.nats.url())
        .await
        .expect("operator connects");
        let filter = format!("agent.run.{done}.>");
        assert!(
            kedge_journal::purge(&operator, "KEDGE_RUNS", &filter, Duration::from_secs(2))
                .await
                .is_err(),
            "the operator's credentials cannot purge"
        );
        assert_eq!(h.events(&done).await.len(), events.len());
    }
    let opts = PurgeOptions {
        finished_before: Some(Timestamp::now()),
        archive: true,
        dry_run: false,
    };

    // The whole journal: the finished run goes, the waiting one stays.
    let report = retention::purge_finished(&admin, opts)
        .await
        .expect("purge");
    assert_eq!(
        (report.purged, report.not_finished, report.failed),
        (1, 1, 0),
        "{report:?}"
    );
    assert!(h.events(&done).await.is_empty(), "the journal is gone");
    for (_, r) in &referenced {
        assert_eq!(
            h.rt.journal
                .blobs()
                .get(&done, r)
                .await
                .expect_err("removed"),
            kedge_journal::BlobError::Missing(r.digest.clone()),
            "its blobs are gone"
        );
    }
    // Of the bucket only the archive is left (no chunk or info of the run's four blobs).
    let bucket = admin
        .js
        .get_stream("OBJ_kedge_blobs")
        .await
        .expect("bucket")
        .info()
        .await
        .expect("info")
        .state
        .clone();
    let archived = admin
        .js
        .get_object_store("kedge_blobs")
        .await
        .expect("store")
        .info(retention::archive_name(&done).as_str())
        .await
        .expect("the archive");
    assert_eq!(
        bucket.messages,
        archived.chunks as u64 + 1,
        "only the archive's chunks and info: {bucket:?}"
    );
    assert_eq!(mine(&keys(&admin, "kedge_idempotency").await), 0);
    assert!(
        !keys(&admin, "kedge_runs")
            .await
            .iter()
            .any(|k| k.ends_with(done.as_str()))
    );
    assert!(
        !keys(&admin, "kedge_leases")
            .await
            .iter()
            .any(|k| k == done.as_str())
    );
    // The archive holds every event, in order.
    let store = admin
        .js
        .get_object_store("kedge_blobs")
        .await
        .expect("store");
    let mut object = store
        .get(retention::archive_name(&done).as_str())
        .await
        .expect("archive");
    let mut body = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut object, &mut body)
        .await
        .expect("read archive");
    let lines: Vec<serde_json::Value> = body
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), events.len());
    for (line, r) in lines.iter().zip(&events) {
        assert_eq!(line["seq"], json!(r.seq));
        assert_eq!(
            line["envelope"]["type"],
            json!(r.envelope.event_type().as_str())
        );
    }
    // The waiting run is untouched and still answers.
    assert_eq!(
        h.state(&waiting).await.status,
        RunStatus::WaitingUser,
        "not finished: left alone"
    );
    assert!(matches!(
        retention::purge_run(&admin, &waiting, opts)
            .await
            .expect("purge"),
        Purged::NotFinished { .. }
    ));
    // Idempotent: a second pass finds nothing more to do.
    assert_eq!(
        retention::purge_run(&admin, &done, opts)
            .await
            .expect("purge"),
        Purged::NotFound
    );
    let again = retention::purge_finished(&admin, opts)
        .await
        .expect("purge");
    assert_eq!((again.purged, again.failed), (0, 0), "{again:?}");

    // `kedge runs show` says what the waiting run waits on with the command that answers it;
    // pasted as printed (the placeholder filled in), it moves the run on.
    let shown = cli(Kind::Operator, &["runs", "show", waiting.as_str()]);
    assert!(shown.contains("which?"), "the question: {shown}");
    let answer = shown
        .lines()
        .find_map(|l| l.trim().strip_prefix("kedge answer "))
        .expect("a ready-to-paste answer line");
    let mut words: Vec<&str> = answer.split_whitespace().collect();
    assert_eq!(words.first(), Some(&waiting.as_str()), "{answer}");
    assert_eq!(words.last(), Some(&"answer>'"), "{answer}");
    words.truncate(2);
    let mut args = vec!["answer"];
    args.extend(words);
    args.push("the blue one");
    cli(Kind::Operator, &args);
    assert_eq!(
        h.wait_terminal(&waiting, WAIT).await.status,
        RunStatus::Succeeded,
        "answered through the printed command"
    );
    let json = cli(
        Kind::Operator,
        &["runs", "show", waiting.as_str(), "-o", "json"],
    );
    let view: serde_json::Value = serde_json::from_str(&json).expect("the run view");
    assert_eq!(view["status"], "succeeded");
    h.shutdown().await;
}
