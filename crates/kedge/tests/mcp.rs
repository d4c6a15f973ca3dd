//! MCP tools through the whole runtime, against the real reference servers (installed by
//! `scripts/mcp-servers.sh`): an agent's `<server>__<tool>` calls reach the server with the
//! operation id in `_meta`, the model reads their results (errors included), and cancelling a
//! run mid-call sends the server `notifications/cancelled` for that very request. Servers
//! configured with `"sandbox"` are confined by the tool service's bubblewrap sandbox (tested with
//! `tests/fixtures/probe-mcp-server.js`, on the same `node`).

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::event::{CancelRequested, Event};
use kedge_core::fold::OpStatus;
use kedge_mcp::ServerConfig;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

fn launcher(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../.tools/bin")
        .join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `bash scripts/mcp-servers.sh` from the repo root",
        path.display()
    );
    path.canonicalize().expect("launcher path")
}

/// server-everything over stdio, with every byte Kedge sends it appended to `log` (`tee`).
fn everything_teed(log: &Path) -> ServerConfig {
    ServerConfig::Stdio {
        command: "sh".into(),
        args: vec![
            "-c".into(),
            r#"tee -a "$KEDGE_TEST_LOG" | exec "$KEDGE_TEST_LAUNCHER" stdio"#.into(),
        ],
        env: BTreeMap::from([
            ("KEDGE_TEST_LOG".into(), log.display().to_string()),
            (
                "KEDGE_TEST_LAUNCHER".into(),
                launcher("mcp-server-everything").display().to_string(),
            ),
        ]),
        sandbox: None,
    }
}

/// The JSON-RPC messages Kedge sent to the teed server.
fn sent(log: &Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn tuned(log: &Path) -> impl FnOnce(&mut kedge_runtime::Config) {
    let everything = everything_teed(log);
    move |c| {
        c.mcp_servers.insert("everything".into(), everything);
        c.mcp_servers.insert(
            "time".into(),
            ServerConfig::stdio(
                launcher("mcp-server-time").display().to_string(),
                ["--local-timezone", "UTC"],
            ),
        );
        // Starting a Node server counts against the first call's timeout.
        c.timeouts.tool_timeout_ms = 30_000;
        c.timeouts.tool_grace_ms = 5_000;
        c.timeouts.tool_ack_wait_ms = 40_000;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_tools_run_with_the_operation_id_and_the_model_reads_their_results() {
    let dir = tempfile::tempdir().expect("dir");
    let log = dir.path().join("sent.jsonl");
    let script = json!({"models": {"mc": {"steps": [
        {"text": "asking", "tool_calls": [
            {"name": "everything__echo", "arguments": {"message": "hello from kedge"}},
            {"name": "time__get_current_time", "arguments": {"timezone": "UTC"}},
            {"name": "everything__no-such-tool", "arguments": {}}
        ]},
        {"text": "done"}
    ]}}});
    let h = Harness::start_with(script, &[Svc::Intake, Svc::Step, Svc::Tool], tuned(&log)).await;
    h.agent_with_tools(
        "mc",
        "mc",
        &[
            "everything__echo",
            "time__get_current_time",
            "everything__no-such-tool",
        ],
    )
    .await;
    let run = h.submit("mc", "go", "mc-1").await;
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    let results: Vec<_> = done
        .ops
        .values()
        .map(|o| o.result.clone().expect("a result"))
        .collect();
    assert_eq!(results[0].content, "Echo: hello from kedge");
    assert!(!results[0].is_error);
    assert!(
        results[1].content.contains("UTC") && !results[1].is_error,
        "{:?}",
        results[1]
    );
    assert!(results[2].is_error, "unknown MCP tool: {:?}", results[2]);
    // The model read all three.
    let last = h.mock.requests("mc").pop().expect("request").to_string();
    assert!(last.contains("Echo: hello from kedge"), "{last}");
    // The server got the operation id.
    let echo_op = done.ops.keys().next().expect("op").to_string();
    assert!(
        sent(&log).iter().any(|m| m["method"] == "tools/call"
            && m["params"]["name"] == "echo"
            && m["params"]["_meta"]["kedge/operation_id"] == echo_op.as_str()),
        "tools/call for {echo_op} with its operation id"
    );
    common::assert_schema_valid(&h.events(&run).await);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_mcp_call_sends_the_server_a_cancel_for_that_request() {
    let dir = tempfile::tempdir().expect("dir");
    let log = dir.path().join("sent.jsonl");
    let script = json!({"models": {"mx": {"steps": [
        {"text": "working", "tool_calls": [
            {"name": "everything__trigger-long-running-operation", "arguments": {"duration": 30, "steps": 30}}
        ]},
        {"text": "done"}
    ]}}});
    let h = Harness::start_with(script, &[Svc::Intake, Svc::Step, Svc::Tool], tuned(&log)).await;
    h.agent_with_tools("mx", "mx", &["everything__trigger-long-running-operation"])
        .await;
    let run = h.submit("mx", "go", "mx-1").await;
    let state = h
        .wait_for(&run, WAIT, |s| {
            s.ops
                .values()
                .any(|o| matches!(o.status, OpStatus::Started { .. }))
        })
        .await;
    let op = state.ops.keys().next().expect("op").to_string();
    // Until the call is on the wire.
    let deadline = std::time::Instant::now() + WAIT;
    while !sent(&log).iter().any(|m| {
        m["method"] == "tools/call" && m["params"]["_meta"]["kedge/operation_id"] == op.as_str()
    }) {
        assert!(
            std::time::Instant::now() < deadline,
            "the call never went out"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let asked = std::time::Instant::now();
    h.input(
        &run,
        Event::CancelRequested(CancelRequested {
            reason: "changed my mind".into(),
            by: Some("alice".into()),
        }),
        "cancel-mx",
    )
    .await;
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Cancelled);
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "cancelled in {:?}, not after the 30 s operation",
        asked.elapsed()
    );
    let result = done
        .ops
        .values()
        .next()
        .and_then(|o| o.result.clone())
        .expect("result");
    assert!(result.stopped && result.is_error, "{result:?}");
    let messages = sent(&log);
    let id = messages
        .iter()
        .find(|m| {
            m["method"] == "tools/call" && m["params"]["_meta"]["kedge/operation_id"] == op.as_str()
        })
        .map(|m| m["id"].clone())
        .expect("the call");
    assert!(
        messages
            .iter()
            .any(|m| m["method"] == "notifications/cancelled" && m["params"]["requestId"] == id),
        "notifications/cancelled for request {id}"
    );
    let Some(Event::RunCancelled(c)) = h
        .events(&run)
        .await
        .into_iter()
        .map(|r| r.envelope.event)
        .find(|e| matches!(e, Event::RunCancelled(_)))
    else {
        panic!("run.cancelled")
    };
    assert_eq!(c.operations.len(), 1);
    assert_eq!(c.operations[0].fate, kedge_core::event::OpFate::Stopped);
    h.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Sandboxed MCP stdio servers: a server whose configuration has "sandbox" is
// confined by the tool service's sandbox (bubblewrap). The server is `fixtures/probe-mcp-server.js`
// (plain Node, no packages: the same `node` the reference servers' launchers run).

/// `node`, as the reference servers' launchers find it (on PATH); panics with the fix when it is
/// missing, as [`launcher`] does.
fn node() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("node"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("node is missing: install it, then run `bash scripts/mcp-servers.sh` from the repo root")
        })
        .canonicalize()
        .expect("node path")
}

/// The probe server's script.
fn probe_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/probe-mcp-server.js")
        .canonicalize()
        .expect("probe script")
}

/// The probe server; confined with `sandbox` when given. Node's own install is made readable
/// when it does not live under /usr.
fn probe(sandbox: Option<kedge_mcp::StdioSandbox>) -> ServerConfig {
    let node = node();
    let sandbox = sandbox.map(|mut s| {
        s.read_only.push(probe_script());
        if !node.starts_with("/usr") {
            // <prefix>/bin/node: the prefix holds its libraries too.
            let prefix = node.parent().and_then(Path::parent).expect("node prefix");
            s.read_only.push(prefix.to_owned());
        }
        s
    });
    ServerConfig::Stdio {
        command: node.display().to_string(),
        args: vec![probe_script().display().to_string()],
        env: BTreeMap::from([("PROBE_TOKEN".into(), "given".into())]),
        sandbox,
    }
}

fn boxed(network: bool) -> Option<kedge_mcp::StdioSandbox> {
    Some(kedge_mcp::StdioSandbox {
        network,
        read_only: Vec::new(),
    })
}

async fn bwrap() -> std::sync::Arc<dyn kedge_tool::sandbox::Sandbox> {
    kedge_tool::sandbox::from_config(kedge_runtime::config::SandboxKind::Bwrap)
        .await
        .expect("bubblewrap works here (scripts/setup.sh installs it)")
}

/// Calls `tool` of `server` and returns (content, is_error).
async fn probe_call(
    pool: &kedge_mcp::Pool,
    server: &str,
    tool: &str,
    args: Value,
) -> (String, bool) {
    let Value::Object(args) = args else {
        panic!("arguments are an object")
    };
    match pool
        .call(
            server,
            tool,
            args,
            "op-probe",
            Duration::from_secs(30),
            std::future::pending(),
        )
        .await
    {
        Ok(kedge_mcp::Outcome::Completed { content, is_error }) => (content, is_error),
        other => panic!("{server}/{tool}: {other:?}"),
    }
}

/// A secret file outside everything a server is given, and a listener on the host's loopback.
struct Outside {
    _dir: tempfile::TempDir,
    secret: PathBuf,
    listener: std::net::TcpListener,
    port: u16,
}

impl Outside {
    fn new() -> Outside {
        let dir = tempfile::tempdir().expect("dir");
        let secret = dir.path().join("secret.txt");
        std::fs::write(&secret, "the host's secret").expect("secret");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        Outside {
            _dir: dir,
            secret,
            listener,
            port,
        }
    }

    /// Whether a connection arrived since the last look.
    fn accepted(&self) -> bool {
        match self.listener.accept() {
            Ok(_) => true,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
            Err(e) => panic!("accept: {e}"),
        }
    }
}

/// A sandboxed server's tools work, and it reads, writes and reaches nothing outside its own
/// directory and its read-only paths: not a file of the host (which the same server unsandboxed
/// reads), not a listener on the host's 127.0.0.1 (which the unsandboxed one reaches), not the
/// tool service's environment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxed_mcp_server_reaches_nothing_outside_its_directory_and_read_only_paths() {
    let outside = Outside::new();
    let root = tempfile::tempdir().expect("workspace root");
    let pool = kedge_tool::sandbox::mcp_pool_in(
        BTreeMap::from([
            ("boxed".to_owned(), probe(boxed(false))),
            ("open".to_owned(), probe(None)),
        ]),
        bwrap().await,
        root.path(),
    );
    let secret = json!({"path": outside.secret});
    let connect = json!({"host": "127.0.0.1", "port": outside.port});

    // Its tools work.
    let (echo, is_error) = probe_call(&pool, "boxed", "echo", json!({"message": "hi"})).await;
    assert_eq!((echo.as_str(), is_error), ("Echo: hi", false));
    // Unsandboxed (as before this option existed), the same server reads the file and reaches
    // the listener: the checks below can fail.
    let (read, _) = probe_call(&pool, "open", "read", secret.clone()).await;
    assert_eq!(read, "the host's secret");
    assert_eq!(
        probe_call(&pool, "open", "connect", connect.clone()).await,
        ("CONNECTED".to_owned(), false)
    );
    assert!(outside.accepted(), "the unsandboxed server's connection");

    // Sandboxed: the host's file does not exist, nor does any of /work, /root, /home, /etc/passwd.
    let (read, is_error) = probe_call(&pool, "boxed", "read", secret.clone()).await;
    assert!(is_error && read.contains("ENOENT"), "{read}");
    for path in ["/etc/passwd", "/root/.bashrc"] {
        let (read, is_error) = probe_call(&pool, "boxed", "read", json!({"path": path})).await;
        assert!(is_error, "{path}: {read}");
    }
    let (write, is_error) = probe_call(
        &pool,
        "boxed",
        "write",
        json!({"path": outside.secret, "text": "overwritten"}),
    )
    .await;
    assert!(is_error, "{write}");
    assert_eq!(
        std::fs::read_to_string(&outside.secret).expect("secret"),
        "the host's secret"
    );
    // Its read-only paths it reads, and cannot write.
    let script = json!({"path": probe_script()});
    let (read, is_error) = probe_call(&pool, "boxed", "read", script).await;
    assert!(
        !is_error && read.contains("minimal MCP stdio server"),
        "{read}"
    );
    let (write, is_error) = probe_call(
        &pool,
        "boxed",
        "write",
        json!({"path": probe_script(), "text": "x"}),
    )
    .await;
    assert!(is_error, "{write}");
    // Its own directory it writes: <workspace_root>/.mcp/<server>/, mode 0700, its cwd and HOME.
    let (write, is_error) = probe_call(
        &pool,
        "boxed",
        "write",
        json!({"path": "note.txt", "text": "mine"}),
    )
    .await;
    assert!(!is_error, "{write}");
    let dir = root.path().canonicalize().expect("root").join(".mcp/boxed");
    assert_eq!(
        std::fs::read_to_string(dir.join("note.txt")).expect("note"),
        "mine"
    );
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&dir).expect("dir").permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "{mode:o}");
    }
    let (who, _) = probe_call(&pool, "boxed", "whoami", json!({})).await;
    let who: Value = serde_json::from_str(&who).expect("whoami JSON");
    assert_eq!(who["cwd"], dir.display().to_string());
    assert_eq!(who["home"], dir.display().to_string());
    // Its configured env, and nothing of the tool service's (bubblewrap sets PWD).
    assert_eq!(
        who["env"],
        json!(["HOME", "PATH", "PROBE_TOKEN", "PWD", "TMPDIR"]),
        "{who}"
    );

    // No network: the host's loopback listener gets nothing.
    let (connected, is_error) = probe_call(&pool, "boxed", "connect", connect).await;
    assert!(is_error && !connected.contains("CONNECTED"), "{connected}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!outside.accepted(), "a sandboxed server reached the host");
    pool.close().await;
}

/// `"network": true` gives a sandboxed server the host's network, and nothing else changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxed_mcp_server_reaches_the_network_only_when_its_option_grants_it() {
    let outside = Outside::new();
    let root = tempfile::tempdir().expect("workspace root");
    let pool = kedge_tool::sandbox::mcp_pool_in(
        BTreeMap::from([("online".to_owned(), probe(boxed(true)))]),
        bwrap().await,
        root.path(),
    );
    let connect = json!({"host": "127.0.0.1", "port": outside.port});
    assert_eq!(
        probe_call(&pool, "online", "connect", connect).await,
        ("CONNECTED".to_owned(), false)
    );
    assert!(outside.accepted(), "the granted connection arrived");
    let (read, is_error) =
        probe_call(&pool, "online", "read", json!({"path": outside.secret})).await;
    assert!(is_error && read.contains("ENOENT"), "{read}");
    pool.close().await;
}

/// A sandboxed configuration is refused, with an error naming the server, by a pool without a
/// sandboxing launcher (`Pool::new`), and by the tool service's launcher when the program or a
/// read-only path would undo the confinement. Nothing is started unconfined.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxed_mcp_server_that_cannot_be_confined_is_refused() {
    let root = tempfile::tempdir().expect("workspace root");
    let elsewhere = tempfile::tempdir().expect("dir");
    let copy = elsewhere.path().join("probe.js");
    std::fs::copy(probe_script(), &copy).expect("copy");
    let expect_refused = |result: Result<Vec<kedge_mcp::ToolInfo>, kedge_mcp::McpError>,
                          server: &str,
                          needle: &str| match result {
        Err(kedge_mcp::McpError::Connect { server: s, reason }) => {
            assert_eq!(s, server);
            assert!(reason.contains(needle), "{server}: {reason}");
        }
        other => panic!("{server}: {other:?}"),
    };

    // No sandboxing launcher.
    let plain = kedge_mcp::Pool::new(BTreeMap::from([("boxed".to_owned(), probe(boxed(false)))]));
    expect_refused(plain.tools("boxed").await, "boxed", "asks for a sandbox");

    // A program outside /usr and the read-only paths (a shell script in a temp dir).
    let script = elsewhere.path().join("server.sh");
    std::fs::write(&script, "#!/bin/sh\nexec cat /etc/passwd\n").expect("script");
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let stray = ServerConfig::Stdio {
        command: script.display().to_string(),
        args: vec![],
        env: BTreeMap::new(),
        sandbox: boxed(false),
    };
    // A read-only path holding the workspace root (the runs' workspaces).
    let mut exposing = probe(boxed(false));
    if let ServerConfig::Stdio {
        sandbox: Some(s), ..
    } = &mut exposing
    {
        s.read_only.push(root.path().to_owned());
    }
    let pool = kedge_tool::sandbox::mcp_pool_in(
        BTreeMap::from([
            ("stray".to_owned(), stray),
            ("exposing".to_owned(), exposing),
        ]),
        bwrap().await,
        &root.path().join("ws"),
    );
    expect_refused(pool.tools("stray").await, "stray", "neither under /usr");
    expect_refused(
        pool.tools("exposing").await,
        "exposing",
        "overlaps the workspace root",
    );
    pool.close().await;
}

/// With the `unconfined` sandbox (development), a server that asks for a sandbox still runs,
/// unconfined (with a warning), in its own directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_unconfined_sandbox_a_sandboxed_mcp_server_runs_unconfined() {
    let outside = Outside::new();
    let root = tempfile::tempdir().expect("workspace root");
    let pool = kedge_tool::sandbox::mcp_pool_in(
        BTreeMap::from([("boxed".to_owned(), probe(boxed(false)))]),
        std::sync::Arc::new(kedge_tool::sandbox::Unconfined),
        root.path(),
    );
    let (read, is_error) =
        probe_call(&pool, "boxed", "read", json!({"path": outside.secret})).await;
    assert_eq!((read.as_str(), is_error), ("the host's secret", false));
    let (who, _) = probe_call(&pool, "boxed", "whoami", json!({})).await;
    assert!(who.contains(".mcp/boxed"), "{who}");
    pool.close().await;
}

/// Through the whole runtime: the tool service confines a server configured with "sandbox"; an
/// agent's calls to it work, and what it reads or reaches outside fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_service_runs_a_sandboxed_mcp_server_confined() {
    let outside = Outside::new();
    let script = json!({"models": {"bx": {"steps": [
        {"text": "probing", "tool_calls": [
            {"name": "boxed__echo", "arguments": {"message": "from the sandbox"}},
            {"name": "boxed__read", "arguments": {"path": outside.secret}},
            {"name": "boxed__connect", "arguments": {"host": "127.0.0.1", "port": outside.port}}
        ]},
        {"text": "done"}
    ]}}});
    let server = probe(boxed(false));
    let h = Harness::start_with(script, &[Svc::Intake, Svc::Step, Svc::Tool], move |c| {
        c.mcp_servers.insert("boxed".into(), server);
        c.timeouts.tool_timeout_ms = 30_000;
        c.timeouts.tool_grace_ms = 5_000;
        c.timeouts.tool_ack_wait_ms = 40_000;
    })
    .await;
    h.agent_with_tools(
        "bx",
        "bx",
        &["boxed__echo", "boxed__read", "boxed__connect"],
    )
    .await;
    let run = h.submit("bx", "go", "bx-1").await;
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    let results: Vec<_> = done
        .ops
        .values()
        .map(|o| o.result.clone().expect("a result"))
        .collect();
    assert_eq!(results[0].content, "Echo: from the sandbox");
    assert!(
        results[1].is_error && results[1].content.contains("ENOENT"),
        "{:?}",
        results[1]
    );
    assert!(
        results[2].is_error && !results[2].content.contains("CONNECTED"),
        "{:?}",
        results[2]
    );
    assert!(!outside.accepted(), "a sandboxed server reached the host");
    assert!(
        h.config.workspace_root.join(".mcp/boxed").is_dir(),
        "its directory under the workspace root"
    );
    h.shutdown().await;
}
