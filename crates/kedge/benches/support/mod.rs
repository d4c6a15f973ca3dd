//! What the benches that fill the journal and watch `kedge serve` processes share: a run's
//! `run.created` as the core would freeze it, the JetStream API by hand, /proc figures, and the
//! `kedge` command with none of the bench's own `KEDGE_*` variables, and Kedge as deployed
//! ([`deployed`]: nats-server, `kedge mock-llm` and `kedge serve` processes).
//! Included with `#[path]`; not a bench target of its own.

#![allow(dead_code, clippy::unwrap_used)]

use std::process::{Child, Command};

use kedge_core::event::RunCreated;

pub mod deployed;

/// A `run.created` of agent `agent` (tenant `acme`, the mock model) with `input`.
pub fn created(agent: &str, input: &str) -> RunCreated {
    RunCreated {
        caller: Some("bench".into()),
        runtime_version: "bench".into(),
        ..kedge_testkit::fixtures::run_created(agent, input)
    }
}

/// The bench's own runtime on `server` (worker `bench-writer`, workspaces under `dir`): what
/// fills the journal and reads it back, apart from the services under test.
pub async fn writer_runtime(
    server: &kedge_testkit::NatsServer,
    dir: &std::path::Path,
) -> kedge_runtime::Runtime {
    writer_runtime_on(vec![server.url()], 1, dir).await
}

/// [`writer_runtime`] on a broker of these URLs, creating what it creates with `replicas`.
pub async fn writer_runtime_on(
    nats_urls: Vec<String>,
    replicas: usize,
    dir: &std::path::Path,
) -> kedge_runtime::Runtime {
    let config = kedge_runtime::Config {
        nats_urls,
        replicas,
        workspace_root: dir.join("ws"),
        worker_id: "bench-writer".parse().expect("worker id"),
        ..kedge_runtime::Config::default()
    };
    kedge_runtime::Runtime::connect(config).await.unwrap()
}

/// A multi-thread runtime running `bench` to its end.
pub fn run_bench<F: std::future::Future<Output = ()>>(bench: F) {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench);
}

/// A JetStream API request (`$JS.API.<subject>`) and its JSON answer.
pub async fn api(
    client: &async_nats::Client,
    subject: &str,
    body: serde_json::Value,
) -> serde_json::Value {
    let reply = client
        .request(format!("$JS.API.{subject}"), body.to_string().into())
        .await
        .unwrap();
    serde_json::from_slice(&reply.payload).unwrap()
}

/// Pending schedules in KEDGE_TIMERS.
pub async fn pending_schedules(client: &async_nats::Client) -> u64 {
    let info = api(
        client,
        "STREAM.INFO.KEDGE_TIMERS",
        serde_json::json!({"subjects_filter": "kedge.timer.sched.>"}),
    )
    .await;
    info["state"]["subjects"]
        .as_object()
        .map_or(0, |s| s.len() as u64)
}

/// A process's resident memory, threads and CPU time, from /proc.
#[derive(Debug, Clone, Copy, Default)]
pub struct Proc {
    pub rss_kb: u64,
    pub threads: u64,
    /// utime + stime, in clock ticks.
    pub cpu_ticks: u64,
}

pub fn read_proc(pid: u32) -> Proc {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Proc {
        rss_kb: field("VmRSS:"),
        threads: field("Threads:"),
        cpu_ticks: kedge_testkit::cpu_ticks(&format!("/proc/{pid}/stat")).unwrap_or(0),
    }
}

/// The CPU time (utime + stime, clock ticks) the processes `pids` have spent so far.
pub fn cpu_ticks_of(pids: &[u32]) -> u64 {
    pids.iter()
        .filter_map(|p| kedge_testkit::cpu_ticks(&format!("/proc/{p}/stat")))
        .sum()
}

/// The machine's load averages over 1, 5 and 15 minutes (other processes share these cores:
/// read a bench's numbers with it).
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Kills a process this bench started and reaps it.
pub fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// `kedge <args>` (the binary under test) with no `KEDGE_*` variable of the bench's own
/// environment: the process's configuration is what the bench gives it, as a user's would be.
pub fn kedge_command(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kedge"));
    cmd.args(args);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KEDGE_") {
            cmd.env_remove(k);
        }
    }
    cmd
}
