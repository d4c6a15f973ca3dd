//! Liveness, readiness and a bounded drain of `kedge serve`: `/readyz` says
//! ready only when the process is connected with its consumers bound, and says why not while the
//! broker is away; `/healthz` answers throughout; SIGTERM ends the process within its drain time.
//! And how its threads share the cores: the light lane's at the process's priority, the shared
//! runtime's lowered (docs/ARCHITECTURE.md "Fairness across tenants").

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kedge_testkit::{NatsServer, free_port};

struct Serve {
    child: Child,
}

impl Serve {
    /// `kedge serve all` on the broker at `url`, its metrics and probes on `port`, configured
    /// by these variables and `env` (no configuration file, the light lane and the shared
    /// threads' priority as defaulted unless `env` sets them).
    fn all(
        url: &str,
        workspace: &std::path::Path,
        port: u16,
        worker: &str,
        env: &[(&str, &str)],
    ) -> Serve {
        let child = Command::new(env!("CARGO_BIN_EXE_kedge"))
            .args(["serve", "all"])
            .env("KEDGE_NATS_URL", url)
            .env("KEDGE_METRICS_ADDR", format!("127.0.0.1:{port}"))
            .env("KEDGE_WORKSPACE_ROOT", workspace)
            .env("KEDGE_WORKER_ID", worker)
            .env_remove("KEDGE_CONFIG")
            .env_remove("KEDGE_LIGHT_LANE")
            .env_remove("KEDGE_SHARED_NICE")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("kedge serve");
        Serve { child }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn get(url: &str) -> Option<(u16, String)> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .ok()?;
    let r = client.get(url).send().await.ok()?;
    let code = r.status().as_u16();
    Some((code, r.text().await.unwrap_or_default()))
}

/// Polls `url` until `pred` holds (30 s at most).
async fn until(url: &str, what: &str, pred: impl Fn(u16, &str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some((code, body)) = get(url).await
            && pred(code, &body)
        {
            return body;
        }
        assert!(Instant::now() < deadline, "{url}: never {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_broker_and_sigterm_ends_within_the_drain_time() {
    let mut nats = NatsServer::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut serve = Serve::all(
        &nats.url(),
        dir.path(),
        port,
        "w-health",
        &[("KEDGE_DRAIN_MS", "2000")],
    );

    let ready = until(&format!("{base}/readyz"), "ready", |c, _| c == 200).await;
    let ready: serde_json::Value = serde_json::from_str(&ready).expect("json");
    assert_eq!(ready["ready"], true, "{ready}");
    assert_eq!(
        get(&format!("{base}/healthz")).await.map(|(c, _)| c),
        Some(200)
    );

    // The broker goes away: not ready, saying why; still alive.
    nats.kill9();
    let why = until(&format!("{base}/readyz"), "unready", |c, _| c == 503).await;
    assert!(why.contains("NATS connection"), "{why}");
    assert_eq!(
        get(&format!("{base}/healthz")).await.map(|(c, _)| c),
        Some(200)
    );
    // Back: ready again.
    nats.restart().await;
    until(&format!("{base}/readyz"), "ready again", |c, _| c == 200).await;

    // SIGTERM: the process stops taking work and exits within its drain time.
    let pid = serve.child.id().to_string();
    let sent = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(sent.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if serve.child.try_wait().expect("wait").is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "kedge serve did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The nice value of each thread of process `pid`, by thread name.
#[cfg(target_os = "linux")]
fn thread_priorities(pid: u32) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // The fields after the name in parentheses: state is the 3rd field, nice the 19th.
        let nice = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(16))
            .and_then(|n| n.parse().ok());
        if let Some(nice) = nice {
            out.push((comm.trim().to_owned(), nice));
        }
    }
    out
}

/// With the light lane open, the shared runtime's worker threads run at `shared_nice` (10 by
/// default) and the lane's own threads at the process's priority, so the work of a tenant
/// without a backlog gets a core first (docs/ARCHITECTURE.md "Fairness across tenants").
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_threads_give_the_cores_to_the_light_lanes() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    // Defaults: the light lane on, `shared_nice` 10 (`Serve::all` passes no other setting).
    let serve = Serve::all(&nats.url(), dir.path(), port, "w-nice", &[]);
    until(
        &format!("http://127.0.0.1:{port}/readyz"),
        "ready",
        |c, _| c == 200,
    )
    .await;
    let pid = serve.child.id();
    // A worker lowers itself as it next wakes: at once in a process that serves.
    let deadline = Instant::now() + Duration::from_secs(15);
    let threads = loop {
        let threads = thread_priorities(pid);
        let lowered = threads
            .iter()
            .filter(|(name, nice)| name == "tokio-rt-worker" && *nice == 10)
            .count();
        if lowered >= 1 || Instant::now() > deadline {
            break threads;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let light: Vec<_> = threads.iter().filter(|(n, _)| n == "kedge-light").collect();
    assert!(!light.is_empty(), "no light lane threads: {threads:?}");
    assert!(
        light.iter().all(|(_, nice)| *nice == 0),
        "the light lane's threads keep the process's priority: {threads:?}"
    );
    let lowered = threads
        .iter()
        .filter(|(name, nice)| name == "tokio-rt-worker" && *nice == 10)
        .count();
    // At least one (a one-core machine has one worker); the test fails with none lowered.
    assert!(
        lowered >= 1,
        "the shared runtime's workers run at nice 10: {threads:?}"
    );
}
