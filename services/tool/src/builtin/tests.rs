//! Unit tests of the built-in tools: the workspace's confinement, the shell's allowlist and
//! time limit, the test ledger.

use super::*;

fn env(dir: &Path) -> Env {
    Env {
        root: dir.to_owned(),
        shell_allowlist: vec!["echo".into(), "sleep".into(), "ls".into()],
        timeout: Duration::from_millis(500),
        max_output: 64,
        sandbox: Arc::new(crate::sandbox::Unconfined),
        ledger: true,
    }
}

fn op(i: u32) -> OperationId {
    let run: RunId = "run_tooltest".parse().expect("valid");
    OperationId::new(&run, kedge_core::ids::StepNo(1), i)
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kedge-tool-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[tokio::test]
async fn files_round_trip_inside_the_workspace_only() {
    let dir = tmp("files");
    let env = env(&dir);
    let w = env
        .run(
            Builtin::WriteFile,
            &op(0),
            &serde_json::json!({"path": "notes/a.txt", "content": "hello"}),
        )
        .await;
    assert!(!w.is_error, "{w:?}");
    let r = env
        .run(
            Builtin::ReadFile,
            &op(1),
            &serde_json::json!({"path": "notes/a.txt"}),
        )
        .await;
    assert_eq!(r, Output::ok("hello"));
    let l = env
        .run(Builtin::ListFiles, &op(2), &serde_json::json!({}))
        .await;
    assert_eq!(l.content, "notes/");
    for bad in ["../x", "/etc/passwd", "a/../../x"] {
        let r = env
            .run(Builtin::ReadFile, &op(3), &serde_json::json!({"path": bad}))
            .await;
        assert!(
            r.is_error && r.content.contains("leaves the workspace"),
            "{bad}: {r:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn shell_is_allowlisted_and_timed_out() {
    let dir = tmp("shell");
    let env = env(&dir);
    let ok = env
        .run(
            Builtin::Shell,
            &op(0),
            &serde_json::json!({"command": "echo", "args": ["hi"]}),
        )
        .await;
    assert_eq!(ok, Output::ok("hi\n"));
    let denied = env
        .run(
            Builtin::Shell,
            &op(1),
            &serde_json::json!({"command": "rm", "args": ["-rf", "x"]}),
        )
        .await;
    assert!(denied.is_error && denied.content.contains("not allowed"));
    let slow = env
        .run(
            Builtin::Shell,
            &op(2),
            &serde_json::json!({"command": "sleep", "args": ["5"]}),
        )
        .await;
    assert!(
        slow.is_error && slow.content.contains("timed out"),
        "{slow:?}"
    );
    let outside = env
        .run(
            Builtin::Shell,
            &op(3),
            &serde_json::json!({"command": "ls", "args": ["/"]}),
        )
        .await;
    assert!(outside.is_error);
    let _ = std::fs::remove_dir_all(&dir);
}

/// One `ledger_append` of "paid 5" as operation 0.
async fn pay(env: &Env) -> Output {
    env.run(
        Builtin::LedgerAppend,
        &op(0),
        &serde_json::json!({"text": "paid 5"}),
    )
    .await
}

#[tokio::test]
async fn the_test_ledger_is_not_offered_unless_configured() {
    let dir = tmp("ledger-off");
    let env = Env {
        ledger: false,
        ..env(&dir)
    };
    let out = pay(&env).await;
    assert!(
        out.is_error && out.content.contains("not offered"),
        "{out:?}"
    );
    assert!(!env.ledger().exists(), "nothing was appended");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_ledger_is_written_under_a_root_not_made_yet() {
    let dir = tmp("ledger-root");
    let env = Env {
        root: dir.join("not").join("yet"),
        ..env(&dir)
    };
    let out = pay(&env).await;
    assert!(!out.is_error, "{out:?}");
    let text = std::fs::read_to_string(env.ledger()).expect("ledger");
    assert_eq!(text, format!("{}\tpaid 5\n", op(0)));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_ledger_counts_every_run_and_confirms() {
    let dir = tmp("ledger");
    let env = env(&dir);
    assert_eq!(
        env.confirm(Builtin::LedgerAppend, &op(0)).await,
        Confirm::NotFound
    );
    let args = serde_json::json!({"text": "paid 5"});
    env.run(Builtin::LedgerAppend, &op(0), &args).await;
    env.run(Builtin::LedgerAppend, &op(0), &args).await;
    let text = std::fs::read_to_string(env.ledger()).expect("ledger");
    assert_eq!(
        text.lines().count(),
        2,
        "the tool itself does not deduplicate"
    );
    assert!(matches!(
        env.confirm(Builtin::LedgerAppend, &op(0)).await,
        Confirm::Confirmed(_)
    ));
    let long = env
        .run(
            Builtin::WriteFile,
            &op(5),
            &serde_json::json!({"path": "big", "content": "x".repeat(200)}),
        )
        .await;
    assert!(!long.is_error);
    let r = env
        .run(
            Builtin::ReadFile,
            &op(6),
            &serde_json::json!({"path": "big"}),
        )
        .await;
    assert!(r.content.contains("[truncated: 200 bytes"), "{r:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_core_knows_which_built_ins_are_idempotent() {
    // A retry policy's `timeout` rule is checked in the core, against its table.
    for b in Builtin::ALL {
        let core = kedge_core::tools::builtin(b.name()).expect("the core lists it");
        assert_eq!(core.idempotent, b.idempotent(), "{}", b.name());
    }
}
