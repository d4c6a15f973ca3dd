//! The sandbox is the boundary: allowlisted commands whose options name files
//! or programs outside the run's workspace read, write and run nothing there; the file tools do
//! not follow symlinks out of it; endless output is cut while it is read; a command's stray
//! children die with it at the timeout. End to end: the mock model calls the tools of a real tool
//! service (sandbox `bwrap`, the default) on a real broker.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::event::Event;
use kedge_core::ids::RunId;
use kedge_core::task::TaskSubmission;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

fn call(name: &str, args: serde_json::Value) -> serde_json::Value {
    json!({"name": name, "arguments": args})
}

fn shell(command: &str, args: &[&str]) -> serde_json::Value {
    call("shell", json!({"command": command, "args": args}))
}

/// Submits a task for a run id of our choosing (so its workspace can be prepared first, at
/// `h.chosen_run(chosen)`); the run it made.
async fn submit_as(h: &Harness, agent: &str, chosen: &RunId) -> RunId {
    let task = TaskSubmission {
        agent: agent.parse().expect("agent name"),
        input: "go".into(),
        run_id: Some(chosen.clone()),
        budget: None,
        metadata: Default::default(),
        concurrency: None,
        priority: None,
    };
    let run = h.chosen_run(chosen);
    match h.submit_task(&task, chosen.as_str()).await {
        kedge_intake::Answer::Accepted { run_id } => assert_eq!(run_id, run),
        kedge_intake::Answer::Rejected { error } => panic!("rejected: {error}"),
    }
    run
}

/// The tool results of a run, by operation index (step 1 only).
async fn results(h: &Harness, run: &RunId) -> Vec<(u32, String, bool)> {
    let mut out: Vec<(u32, String, bool)> = h
        .events(run)
        .await
        .into_iter()
        .filter_map(|r| match (&r.envelope.event, &r.envelope.op) {
            (Event::ToolResult(res), Some(op)) => {
                Some((op.index(), res.content.clone(), res.is_error))
            }
            _ => None,
        })
        .collect();
    out.sort_by_key(|(i, _, _)| *i);
    out
}

/// PIDs of live processes whose command line contains `marker`.
fn processes_with(marker: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .map(|c| {
                    String::from_utf8_lossy(&c)
                        .replace('\0', " ")
                        .contains(marker)
                })
                .unwrap_or(false)
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowlisted_commands_and_file_tools_reach_nothing_outside_the_workspace() {
    // Outside: a secret, a NUL-separated list naming it, a program that leaves a mark if run.
    let outside = tempfile::tempdir().expect("outside dir");
    let o = outside.path();
    let secret_text = format!("TOPSECRET-{}", std::process::id());
    let secret = o.join("secret.txt");
    std::fs::write(&secret, format!("{secret_text}\n")).expect("secret");
    let list0 = o.join("list0");
    std::fs::write(&list0, format!("{}\0", secret.display())).expect("list");
    let evil = o.join("evil.sh");
    std::fs::write(
        &evil,
        format!("#!/bin/sh\ntouch {}\ncat\n", o.join("RAN").display()),
    )
    .expect("evil");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&evil, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let p = |path: &Path| path.display().to_string();

    let script = json!({"models": {"sx": {"steps": [
        {"text": "escaping", "tool_calls": [
            shell("grep", &[&format!("--file={}", p(&secret)), "-r", "."]),
            shell("sort", &[&format!("--files0-from={}", p(&list0))]),
            shell("wc", &[&format!("--files0-from={}", p(&list0))]),
            shell("cat", &["link"]),
            shell("head", &["-n", "5", "link"]),
            shell("tail", &["dirlink/secret.txt"]),
            shell("sort", &[&format!("--output={}", p(&o.join("written"))), "in.txt"]),
            shell("sort", &["-S", "64k", &format!("--compress-program={}", p(&evil)),
                            "-o", "sorted.txt", "big.txt"]),
            call("read_file", json!({"path": "link"})),
            call("read_file", json!({"path": "dirlink/secret.txt"})),
            call("write_file", json!({"path": "link", "content": "pwned"})),
            call("write_file", json!({"path": "dirlink/new.txt", "content": "pwned"})),
            call("list_files", json!({"path": "dirlink"})),
            shell("cat", &["in.txt"]),
        ]},
        {"text": "done"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("sx", "sx").await;
    let chosen: RunId = format!("run_sbx_{}", std::process::id())
        .parse()
        .expect("run id");
    let run = h.chosen_run(&chosen);
    // The run's workspace, prepared: symlinks out, an input, a file big enough for sort to
    // spill to temporary files (and so run a compress program).
    let ws = h.config.workspace_root.join(run.as_str());
    std::fs::create_dir_all(&ws).expect("workspace");
    std::os::unix::fs::symlink(&secret, ws.join("link")).expect("symlink");
    std::os::unix::fs::symlink(o, ws.join("dirlink")).expect("dir symlink");
    std::fs::write(ws.join("in.txt"), "b\na\n").expect("input");
    let big: String = (0..200_000u32)
        .map(|i| format!("{}\n", i.wrapping_mul(2_654_435_761)))
        .collect();
    std::fs::write(ws.join("big.txt"), big).expect("big input");

    submit_as(&h, "sx", &chosen).await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let res = results(&h, &run).await;
    assert_eq!(res.len(), 14, "{res:#?}");
    for (i, content, is_error) in &res {
        assert!(
            !content.contains(&secret_text),
            "call {i} read the secret: {content}"
        );
        if *i < 13 && *i != 7 {
            assert!(is_error, "call {i} should have failed: {content}");
        }
    }
    // The shell calls failed because the files are not there, not because of a policy check.
    for i in [0, 1, 2, 3, 4, 5, 6] {
        assert!(
            res[i].1.contains("No such file or directory"),
            "call {i}: {}",
            res[i].1
        );
    }
    // The file tools refused the ways out.
    for i in [8, 9, 10, 11, 12] {
        assert!(
            res[i].1.contains("leads out of the workspace"),
            "call {i}: {}",
            res[i].1
        );
    }
    // Nothing written or run outside; the secret is intact.
    assert!(!o.join("written").exists(), "sort -o wrote outside");
    assert!(!o.join("RAN").exists(), "sort ran a program from outside");
    assert!(
        !o.join("new.txt").exists(),
        "write_file wrote through a symlink"
    );
    assert_eq!(
        std::fs::read_to_string(&secret).expect("secret"),
        format!("{secret_text}\n")
    );
    // And the sandbox does let the commands work inside.
    assert_eq!(res[13], (13, "b\na\n".to_owned(), false));
    assert!(ws.join("sorted.txt").exists(), "{:?}", res[7]);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_output_is_cut_while_read_and_stray_children_die_at_the_timeout() {
    let marker = format!("3{}.25", std::process::id() % 1000);
    let script = json!({"models": {"sy": {"steps": [
        {"text": "loud and slow", "tool_calls": [
            shell("yes", &["spam"]),
            shell("sh", &["-c", &format!("sleep {marker} & sleep {marker}")]),
        ]},
        {"text": "done"}
    ]}}});
    let h = Harness::start_with(script, &[Svc::Intake, Svc::Step, Svc::Tool], |c| {
        c.shell_allowlist.extend(["yes".into(), "sh".into()]);
        c.max_tool_output_bytes = 4096;
    })
    .await;
    h.agent("sy", "sy").await;
    let started = Instant::now();
    let run = h.submit("sy", "go", "task-sandbox-loud").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let res = results(&h, &run).await;
    assert_eq!(res.len(), 2, "{res:#?}");
    let (_, yes, yes_err) = &res[0];
    assert!(*yes_err, "{yes}");
    assert!(
        yes.contains("printed more than 4096 bytes and was killed"),
        "{yes}"
    );
    assert!(yes.len() < 4096 + 200, "{}", yes.len());
    let (_, slow, slow_err) = &res[1];
    assert!(*slow_err && slow.contains("timed out"), "{slow}");
    assert!(started.elapsed() < Duration::from_secs(20));
    // Both sleeps (the parent's and the background child's) are gone.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let left = processes_with(&format!("sleep {marker}"));
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "left running: {left:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    h.shutdown().await;
}

/// A `shell` command has no network unless its tool's policy grants it (`policy.shell.network`,
/// carried on `tool.requested`): without the grant it cannot connect to a listener on the host's
/// loopback (the sandbox's loopback is another namespace's, and down); with it, it can. The
/// tool service's environment applied to a request, with the real bubblewrap sandbox.
#[tokio::test]
async fn a_command_reaches_the_network_only_when_its_tool_policy_grants_it() {
    use kedge_core::event::{Digest, ToolRequested};
    use kedge_core::ids::{OperationId, StepNo};
    use kedge_tool::builtin::{Builtin, Env};

    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    let sandbox = kedge_tool::sandbox::from_config(kedge_runtime::config::SandboxKind::Bwrap)
        .await
        .expect("bubblewrap works here (scripts/setup.sh installs it)");
    let root = tempfile::tempdir().expect("workspace root");
    let env = Env {
        root: root.path().to_owned(),
        shell_allowlist: vec!["bash".into()],
        timeout: Duration::from_secs(10),
        max_output: 4096,
        sandbox,
        ledger: false,
    };
    let run: RunId = format!("run_net_{}", std::process::id())
        .parse()
        .expect("run id");
    let op = OperationId::new(&run, StepNo(1), 0);
    let args = json!({"command": "bash", "args": ["-c",
        format!("echo hello > /dev/tcp/127.0.0.1/{port} && echo CONNECTED")]});
    let request = |network: bool| ToolRequested {
        call_id: "c1".into(),
        tool: "shell".into(),
        arguments: args.clone(),
        args_digest: Digest::of_json(&args),
        redispatch: 0,
        expect_version: None,
        limits: kedge_core::tools::RunLimits {
            network,
            ..Default::default()
        },
        reversibility: None,
        compensates: None,
    };
    let accepted = || match listener.accept() {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(e) => panic!("accept: {e}"),
    };

    let denied = env
        .for_request(&request(false))
        .run(Builtin::Shell, &op, &args)
        .await;
    assert!(!denied.content.contains("CONNECTED"), "{denied:?}");
    assert!(!accepted(), "a command without the grant reached the host");

    let granted = env
        .for_request(&request(true))
        .run(Builtin::Shell, &op, &args)
        .await;
    assert!(granted.content.contains("CONNECTED"), "{granted:?}");
    assert!(accepted(), "the granted command's connection arrived");
}

/// The same through the tool service: the grant travels from the agent's policy through
/// `tool.requested` to the sandbox of that one command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_agent_whose_policy_grants_network_reaches_the_host() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = listener.local_addr().expect("addr").port();
    let connect = format!("echo hello > /dev/tcp/127.0.0.1/{port} && echo CONNECTED");
    let script = json!({"models": {"net": {"steps": [
        {"text": "calling", "tool_calls": [shell("bash", &["-c", &connect])]},
        {"text": "done"}
    ]}}});
    let h = Harness::start_with(script, &[Svc::Intake, Svc::Step, Svc::Tool], |c| {
        c.shell_allowlist.push("bash".into());
    })
    .await;
    h.agent_with_policy("offline", "net", json!({})).await;
    h.agent_with_policy("online", "net", json!({"shell": {"network": true}}))
        .await;
    let mut out = Vec::new();
    for agent in ["offline", "online"] {
        let run = submit_as(&h, agent, &RunId::generate()).await;
        let state = h.wait_terminal(&run, WAIT).await;
        assert_eq!(state.status, RunStatus::Succeeded, "{agent}");
        let (_, content, _) = results(&h, &run).await.pop().expect("a tool result");
        out.push(content);
    }
    assert!(
        !out[0].contains("CONNECTED"),
        "without the grant: {}",
        out[0]
    );
    assert!(out[1].contains("CONNECTED"), "with the grant: {}", out[1]);
    h.shutdown().await;
}
