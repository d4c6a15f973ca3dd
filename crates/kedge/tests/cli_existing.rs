//! The CLI against a server it did not set up: commands that read or send to a
//! deployment never create the broker layout, and `kedge watch` on a run that does not exist
//! says so instead of waiting forever.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kedge_core::ids::RunId;
use kedge_testkit::NatsServer;

/// Runs `kedge args…`; a command still running after 30 s is killed and fails the test (the
/// bug this guards against is a command that never returns).
fn kedge(server: &NatsServer, args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kedge"))
        .args(args)
        .env("KEDGE_NATS_URL", server.url())
        .env_remove("KEDGE_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kedge runs");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("`kedge {}` did not return", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

async fn stream_count(server: &NatsServer) -> u64 {
    let client = server.client().await;
    let names = client
        .request("$JS.API.STREAM.NAMES", "".into())
        .await
        .expect("stream names");
    let names: serde_json::Value = serde_json::from_slice(&names.payload).expect("json");
    names["total"].as_u64().unwrap_or(u64::MAX)
}

#[tokio::test]
async fn read_only_commands_create_nothing_and_watch_refuses_an_unknown_run() {
    let server = NatsServer::start().await;
    let run = RunId::generate().to_string();
    for args in [
        vec!["status", run.as_str()],
        vec!["journal", run.as_str()],
        vec!["watch", run.as_str()],
        vec!["dead", "list"],
    ] {
        let out = kedge(&server, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} on an empty server");
        assert!(
            stderr.contains("kedge layout"),
            "{args:?} says what to do: {stderr}"
        );
    }
    assert_eq!(stream_count(&server).await, 0, "nothing was created");

    // Set up, a mistyped run id is refused at once (it used to wait forever).
    let out = kedge(&server, &["layout"]);
    assert!(out.status.success(), "{out:?}");
    let out = kedge(&server, &["watch", run.as_str()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains(&format!("no run {run}")), "{stderr}");
}

/// A command against a broker that does not answer fails at once instead of waiting as long as
/// a service would (configured here to 60 s: the helper's 30 s guard fails the test if it waits).
#[test]
fn a_command_fails_fast_when_nats_is_unreachable() {
    let port = kedge_testkit::free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kedge"))
        .args(["status", &RunId::generate().to_string()])
        .env("KEDGE_NATS_URL", format!("nats://127.0.0.1:{port}"))
        .env("KEDGE_NATS_CONNECT_WAIT_MS", "60000")
        .env_remove("KEDGE_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kedge runs");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kedge status kept waiting for an unreachable broker");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("output");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot connect to NATS"), "{stderr}");
}

#[test]
fn completion_scripts_are_printed_for_each_shell() {
    for (shell, marker) in [
        ("bash", "complete"),
        ("zsh", "#compdef kedge"),
        ("fish", "complete -c kedge"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kedge"))
            .args(["completion", shell])
            .output()
            .expect("kedge runs");
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{shell}: {out:?}");
        assert!(script.contains(marker), "{shell}: {script:.200}");
        assert!(
            script.contains("purge"),
            "{shell}: subcommands are completed"
        );
    }
}
