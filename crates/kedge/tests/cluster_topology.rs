//! compose.yaml's topology as processes: what `docker compose up` would run,
//! without a container engine, and the faults a deployment meets.
//!
//! Read from compose.yaml itself: its services, their commands, replicas and environment
//! (container paths mapped to temporary directories). Its `nats-config` one-shot writes the
//! secured accounts and each kind's nkey; three clustered nats-servers start with those accounts;
//! its `layout` one-shot creates the R3 layout as admin (`replicas: 3` from deploy/kedge.json);
//! then every `kedge serve <kind>` service starts as that many processes, each connecting as its
//! kind's least-privilege nkey user. Runs on the strict mock model (record a side effect, wait on
//! a durable timer, answer) are submitted throughout while the KEDGE_RUNS stream leader, one
//! replica of step and of tool, and every other kind's process are killed -9 and restarted. A
//! process that exits by itself is started again, as compose's `restart: unless-stopped` would
//! (a service whose startup layout check times out while the cluster recovers exits 1: the test
//! prints how often that happened).
//!
//! It passes when no run is lost or doubled: every submitted task became exactly one run (a
//! resubmitted key answers the same run), every run succeeded with exactly one `run.succeeded`,
//! each run's side effect is in the ledger exactly once, the projection and the bridge and the
//! gateway report them, every process is still running, and no connection hit a permission
//! violation on any node. Shorter timeouts than the defaults (as every crash test uses) keep the
//! recoveries that wait for a redelivery within seconds; bounds below are generous, never goals.
//!
//! It prints what it saw (runs, model calls beyond one per step, restarts by the restart policy);
//! the processes' logs are kept under the printed directory when it fails, or with
//! `KEDGE_TEST_KEEP=1`.

use crate::compose;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use compose::Service;
use kedge_core::event::Event;
use kedge_core::ids::RunId;
use kedge_core::task::TaskSubmission;
use kedge_mock_llm::{MockHandle, Scripts};
use kedge_runtime::{Config, Runtime};
use kedge_testkit::{NatsCluster, ServerOptions};
use serde_json::json;

const API_KEY_VAR: &str = "KEDGE_TEST_API_KEY";
const BRIDGE_TOKEN: &str = "topology-token-0123456789";
/// The example tenants file's approver of `acme` (deploy/tenants.json, docs/RUNBOOK.md).
const TENANT_USER: (&str, &str) = ("acme-alice", "alice-example-password");
/// How long all runs may take to finish after the last fault (generous: never a goal).
const SETTLE: Duration = Duration::from_secs(90);

/// compose.yaml's required variables, given values (everything else takes its default).
fn vars(name: &str) -> Option<String> {
    match name {
        "KEDGE_BRIDGE_TOKENS" => Some(format!("{BRIDGE_TOKEN}=acme")),
        _ => None,
    }
}

/// One `kedge` process of a compose service replica.
struct Proc {
    label: String,
    service: Service,
    env: BTreeMap<String, String>,
    log: PathBuf,
    child: Option<Child>,
    /// Times it exited by itself and was started again (compose's `restart: unless-stopped`).
    restarts: u32,
}

impl Proc {
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open process log");
        let child = Command::new(env!("CARGO_BIN_EXE_kedge"))
            .args(&self.service.command)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(&self.env)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone log handle"))
            .stderr(log)
            .spawn()
            .expect("spawn kedge");
        // Which process wrote what, in the log the processes of one replica share.
        let mut log = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .expect("open process log");
        let _ = writeln!(
            log,
            "=== {} pid {} started at {:?}",
            self.label,
            child.id(),
            std::time::SystemTime::now()
        );
        self.child = Some(child);
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill(); // SIGKILL
            let _ = c.wait();
        }
    }

    /// `Some(status)` if it ended by itself.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The deployment: the cluster, the processes, their directories.
struct Deployment {
    cluster: NatsCluster,
    procs: Vec<Proc>,
    rt: Runtime,
    bridge: String,
    /// When the services were started.
    born: Instant,
    /// Kept (and printed) when the test fails.
    dir: Option<tempfile::TempDir>,
}

impl Drop for Deployment {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for p in &mut self.procs {
                let exited = p.exited();
                let state = match (&p.child, exited) {
                    (None, _) => "not running".to_owned(),
                    (Some(_), Some(status)) => format!("exited ({status})"),
                    (Some(c), None) => format!("running (pid {})", c.id()),
                };
                eprintln!(
                    "{}: {state}, restarted {} time(s) by itself",
                    p.label, p.restarts
                );
            }
        }
        for p in &mut self.procs {
            p.kill9();
        }
        // KEDGE_TEST_KEEP=1 keeps it after a pass too (to read the processes' logs).
        if (std::thread::panicking() || std::env::var_os("KEDGE_TEST_KEEP").is_some())
            && let Some(dir) = self.dir.take()
        {
            eprintln!(
                "keeping the deployment's directory (logs under logs/): {}",
                dir.keep().display()
            );
        }
    }
}

fn run_cmd(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {what}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{text}",
        out.status
    );
    text
}

/// The environment of a compose service's process here: compose's own (container paths mapped),
/// then what differs on loopback: the nodes' ports, the bridge's port, the shared workspaces, the
/// mock model's key, the test-only ledger tool, and short timeouts.
fn process_env(
    s: &Service,
    volumes: &Path,
    urls: &str,
    bridge_listen: &str,
) -> BTreeMap<String, String> {
    let mut env = s.host_env(&vars, volumes);
    let workspaces = volumes.join("workspaces");
    for (k, v) in [
        ("KEDGE_NATS_URL", urls.to_owned()),
        ("KEDGE_WORKSPACE_ROOT", workspaces.display().to_string()),
        ("KEDGE_BRIDGE_LISTEN", bridge_listen.to_owned()),
        // Each container has its own 9464; processes on one host each take a free port.
        ("KEDGE_METRICS_ADDR", "127.0.0.1:0".to_owned()),
        (API_KEY_VAR, "test-key".to_owned()),
        ("KEDGE_MODEL_KEYS", API_KEY_VAR.to_owned()),
        ("KEDGE_LEDGER_TOOL", "1".to_owned()),
        ("KEDGE_LOG", "warn".to_owned()),
        ("KEDGE_LEASE_TTL_MS", "2000".to_owned()),
        ("KEDGE_LEASE_RENEW_MS", "500".to_owned()),
        ("KEDGE_STEP_ACK_WAIT_MS", "3000".to_owned()),
        ("KEDGE_MODEL_TIMEOUT_MS", "10000".to_owned()),
        ("KEDGE_TOOL_TIMEOUT_MS", "1000".to_owned()),
        ("KEDGE_TOOL_GRACE_MS", "500".to_owned()),
        ("KEDGE_TOOL_ACK_WAIT_MS", "2000".to_owned()),
        ("KEDGE_STALL_AFTER_MS", "10000".to_owned()),
        ("KEDGE_MAX_RETRY_DELAY_MS", "500".to_owned()),
    ] {
        env.insert(k.to_owned(), v);
    }
    env
}

fn script() -> serde_json::Value {
    json!({"models": {"topology": {"steps": [
        {"text": "Recording it.", "delay_ms": 300,
         "tool_calls": [{"name": "ledger_append", "arguments": {"text": "recorded"}}]},
        {"text": "Waiting a moment.", "delay_ms": 100,
         "tool_calls": [{"name": "wait", "arguments": {"seconds": 1}}]},
        {"text": "Done.", "delay_ms": 100}
    ]}}})
}

async fn deploy(mock: &MockHandle) -> Deployment {
    let doc = compose::load();
    let services = compose::services(&doc);
    let dir = tempfile::Builder::new()
        .prefix("kedge-topology-")
        .tempdir()
        .expect("temp dir");
    let volumes = dir.path().join("volumes");
    let logs = dir.path().join("logs");
    std::fs::create_dir_all(&logs).expect("logs dir");

    // 1. The secured configuration, as compose's one-shot writes it.
    let generator = services
        .iter()
        .find(|s| s.command.first().map(String::as_str) == Some("nats-config"))
        .expect("compose runs `kedge nats-config`");
    let args: Vec<String> = generator
        .command
        .iter()
        .map(|a| {
            generator
                .host_path(a, &volumes)
                .map_or(a.clone(), |p| p.display().to_string())
        })
        .collect();
    std::fs::create_dir_all(volumes.join("nats-secure")).expect("volume dir");
    run_cmd(
        Command::new(env!("CARGO_BIN_EXE_kedge"))
            .args(&args)
            .env_clear(),
        "kedge nats-config",
    );
    let secure = volumes.join("nats-secure");
    let accounts = std::fs::read_to_string(secure.join("accounts.conf")).expect("accounts.conf");
    let admin_seed = std::fs::read_to_string(secure.join("keys/admin.nk"))
        .expect("admin key")
        .trim()
        .to_owned();

    // 2. Three clustered nodes with those accounts.
    let cluster = NatsCluster::start_with(ServerOptions {
        extra_config: accounts,
        probe_nkey_seed: Some(admin_seed),
        ..Default::default()
    })
    .await;
    let urls = cluster.urls().join(",");
    let bridge_listen = format!("127.0.0.1:{}", kedge_testkit::free_port());

    // 3. The layout, as compose's `layout` one-shot creates it (admin, R3 from deploy/kedge.json).
    let layout = services
        .iter()
        .find(|s| s.command.first().map(String::as_str) == Some("layout"))
        .expect("compose runs `kedge layout`");
    let env = process_env(layout, &volumes, &urls, &bridge_listen);
    run_cmd(
        Command::new(env!("CARGO_BIN_EXE_kedge"))
            .args(&layout.command)
            .env_clear()
            .envs(&env),
        "kedge layout",
    );
    let mut config = Config {
        nats_urls: cluster.urls(),
        replicas: 3,
        worker_id: "w-topology-test".parse().expect("worker id"),
        ..Config::default()
    };
    config.nats.nkey_seed_file = Some(secure.join("keys/admin.nk"));
    let rt = Runtime::connect(config).await.expect("admin runtime");
    let info = rt
        .js
        .get_stream("KEDGE_RUNS")
        .await
        .expect("KEDGE_RUNS")
        .info()
        .await
        .expect("stream info")
        .clone();
    assert_eq!(info.config.num_replicas, 3, "the journal is R3");
    let agent = json!({
        "name": "topology",
        "system_prompt": "record, wait, answer",
        "model": {"provider": "openai", "name": "topology", "base_url": format!("{}/v1", mock.base_url())},
        "api_key_env": API_KEY_VAR,
        "tools": [{"name": "ledger_append"}, {"name": "wait"}],
        "budget": {"max_steps": 10, "max_tokens": 1000000, "max_attempts_per_step": 5}
    });
    let def = kedge_core::agent::AgentDefinition::parse(agent.to_string().as_bytes())
        .expect("valid agent");
    rt.agents.put(&def).await.expect("agent stored");

    // 4. Every service kind, as many processes as compose's replicas.
    let mut procs = Vec::new();
    for s in services.iter().filter(|s| s.serve_kind().is_some()) {
        for i in 1..=s.replicas {
            let label = format!("{}-{i}", s.name);
            let mut p = Proc {
                log: logs.join(format!("{label}.log")),
                label,
                env: process_env(s, &volumes, &urls, &bridge_listen),
                service: s.clone(),
                child: None,
                restarts: 0,
            };
            p.spawn();
            procs.push(p);
        }
    }
    Deployment {
        cluster,
        procs,
        rt,
        bridge: format!("http://{bridge_listen}"),
        born: Instant::now(),
        dir: Some(dir),
    }
}

impl Deployment {
    /// compose's `restart: unless-stopped`: a process that exited by itself (a service that
    /// could not start, say while the cluster elects a leader) is started again.
    fn supervise(&mut self) {
        for p in &mut self.procs {
            if let Some(status) = p.exited() {
                eprintln!(
                    "{:>6.1?} {} exited by itself ({status}); restarting it",
                    self.born.elapsed(),
                    p.label
                );
                p.child = None;
                p.restarts += 1;
                p.spawn();
            }
        }
    }

    /// Awaits `fut`, supervising the processes meanwhile.
    async fn during<T>(&mut self, fut: impl std::future::Future<Output = T>) -> T {
        let mut fut = std::pin::pin!(fut);
        loop {
            tokio::select! {
                v = &mut fut => return v,
                _ = tokio::time::sleep(Duration::from_millis(100)) => self.supervise(),
            }
        }
    }

    /// Waits `d`, supervising the processes meanwhile.
    async fn wait(&mut self, d: Duration) {
        let until = Instant::now() + d;
        loop {
            self.supervise();
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            tokio::time::sleep(left.min(Duration::from_millis(100))).await;
        }
    }
}

/// Submits a task through intake, retrying with the same key (an answer lost to a killed intake
/// or a failing-over node); panics after 60 s.
async fn submit(client: &async_nats::Client, key: &str) -> RunId {
    let task = TaskSubmission::new(
        "topology".parse().expect("agent name"),
        format!("task {key}"),
    );
    let submission = kedge_intake::Submission {
        task: &task,
        key,
        tenant: "acme",
        caller: Some("topology-test"),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match kedge_intake::submit(client, &submission, Duration::from_secs(5)).await {
            Ok(kedge_intake::Answer::Accepted { run_id }) => return run_id,
            Ok(kedge_intake::Answer::Rejected { error }) => panic!("task {key} rejected: {error}"),
            Err(e) if Instant::now() < deadline => {
                eprintln!("submit {key}: {e}; again with the same key");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("task {key} never answered: {e}"),
        }
    }
}

/// The name of the node that leads KEDGE_RUNS (the one whose death hurts most).
async fn runs_leader(d: &Deployment) -> usize {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut s) = d.rt.js.get_stream("KEDGE_RUNS").await
            && let Ok(info) = s.info().await
            && let Some(leader) = info.cluster.as_ref().and_then(|c| c.leader.clone())
            && let Some(i) = d.cluster.node_index(&leader)
        {
            return i;
        }
        assert!(Instant::now() < deadline, "KEDGE_RUNS has no leader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn kill_and_restart(d: &mut Deployment, label: &str) {
    let born = d.born;
    let p = d
        .procs
        .iter_mut()
        .find(|p| p.label == label)
        .unwrap_or_else(|| panic!("no process {label}"));
    eprintln!("{:>6.1?} kill -9 {label}", born.elapsed());
    p.kill9();
    // compose's `restart: unless-stopped` brings the container back moments later.
    tokio::time::sleep(Duration::from_millis(400)).await;
    p.spawn();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_compose_topology_loses_and_doubles_no_run_while_nodes_and_replicas_are_killed() {
    let mock = MockHandle::start(Scripts::from_value(script()).expect("valid script")).await;
    let mut d = deploy(&mock).await;
    let started = Instant::now();

    // The deployment works before any fault: one run end to end.
    let admin = d.rt.client.clone();
    let first = d.during(submit(&admin, "task-first")).await;
    let mut runs: Vec<(String, RunId)> = vec![("task-first".into(), first)];

    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let client = d.rt.client.clone();
    // Each task is submitted on its own (one whose answer is delayed by a fault does not hold up
    // the next), every 250 ms until the faults are over.
    let submitter = tokio::spawn(async move {
        let mut submissions = Vec::new();
        let mut n = 0;
        while !*stop_rx.borrow() {
            n += 1;
            let key = format!("task-{n}");
            let client = client.clone();
            submissions.push(tokio::spawn(async move {
                let run = submit(&client, &key).await;
                (key, run)
            }));
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                _ = stop_rx.changed() => {}
            }
        }
        let mut submitted = Vec::new();
        for s in submissions {
            submitted.push(s.await.expect("a submission"));
        }
        submitted
    });

    // A NATS node: the journal's leader, killed -9 and restarted on its store.
    d.wait(Duration::from_secs(1)).await;
    let leader = runs_leader(&d).await;
    eprintln!(
        "{:>6.1?} kill -9 nats-server {} (KEDGE_RUNS leader)",
        d.born.elapsed(),
        d.cluster.server_name(leader)
    );
    d.cluster.kill9(leader);
    d.wait(Duration::from_secs(2)).await;
    d.cluster.restart(leader).await;
    eprintln!("{:>6.1?} nats-server restarted", d.born.elapsed());
    // One replica of every kind, one after the other, each while runs are in flight.
    let victims: Vec<String> = d
        .procs
        .iter()
        .filter(|p| p.label.ends_with("-1"))
        .map(|p| p.label.clone())
        .collect();
    for label in &victims {
        d.wait(Duration::from_millis(700)).await;
        kill_and_restart(&mut d, label).await;
    }
    d.wait(Duration::from_secs(1)).await;
    stop_tx.send(true).expect("stop the submitter");
    // Its last submission may be waiting for a restarted intake: keep supervising meanwhile.
    runs.extend(d.during(submitter).await.expect("submitter"));
    let faults_done = started.elapsed();

    // Every run finishes, and succeeds.
    let deadline = Instant::now() + SETTLE;
    let mut unfinished: Vec<&RunId> = runs.iter().map(|(_, r)| r).collect();
    while !unfinished.is_empty() {
        let mut still = Vec::new();
        for run in unfinished {
            let events = d.rt.journal.read(run, 0).await.expect("journal read");
            let done = !events.is_empty()
                && kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope)))
                    .expect("journal folds")
                    .status
                    .is_terminal();
            if !done {
                still.push(run);
            }
        }
        unfinished = still;
        if !unfinished.is_empty() {
            assert!(
                Instant::now() < deadline,
                "{} runs unfinished {SETTLE:?} after the faults: {unfinished:?}",
                unfinished.len()
            );
            d.wait(Duration::from_millis(250)).await;
        }
    }

    // No run doubled: distinct keys made distinct runs, and a key submitted again answers its run.
    let ids: BTreeSet<&RunId> = runs.iter().map(|(_, r)| r).collect();
    assert_eq!(ids.len(), runs.len(), "two keys made one run");
    for (key, run) in runs.iter().step_by(7) {
        assert_eq!(
            &d.during(submit(&admin, key)).await,
            run,
            "{key} made a second run"
        );
    }

    // Exactly one run.succeeded each; one ledger_append operation each, run exactly once.
    let mut ops = BTreeSet::new();
    for (_, run) in &runs {
        let events = d.rt.journal.read(run, 0).await.expect("journal read");
        let state = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope))).expect("fold");
        assert_eq!(
            state.status,
            kedge_core::RunStatus::Succeeded,
            "{run}: {:?}",
            state.failure
        );
        let succeeded = events
            .iter()
            .filter(|r| matches!(r.envelope.event, Event::RunSucceeded(_)))
            .count();
        assert_eq!(succeeded, 1, "{run} has {succeeded} run.succeeded events");
        let run_ops: Vec<String> = events
            .iter()
            .filter_map(|r| match (&r.envelope.event, &r.envelope.op) {
                (Event::ToolRequested(t), Some(op)) if t.tool == "ledger_append" => {
                    Some(op.to_string())
                }
                _ => None,
            })
            .collect();
        assert_eq!(run_ops.len(), 1, "{run}: ledger operations {run_ops:?}");
        ops.extend(run_ops);
    }
    let ledger = std::fs::read_to_string(
        d.dir
            .as_ref()
            .expect("dir")
            .path()
            .join("volumes/workspaces/ledger.log"),
    )
    .expect("ledger");
    let mut effects: BTreeMap<String, usize> = BTreeMap::new();
    for line in ledger.lines() {
        let op = line.split('\t').next().unwrap_or_default().to_owned();
        *effects.entry(op).or_default() += 1;
    }
    let doubled: Vec<_> = effects.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "side effects run twice: {doubled:?}");
    let recorded: BTreeSet<String> = effects.into_keys().collect();
    assert_eq!(
        recorded, ops,
        "the ledger holds exactly the journaled operations"
    );

    // The restarted projector, bridge and gateway serve them.
    let kv =
        d.rt.js
            .get_key_value("kedge_runs")
            .await
            .expect("kedge_runs");
    let deadline = Instant::now() + Duration::from_secs(30);
    for (_, run) in &runs {
        loop {
            let entry = kv.get(format!("acme.{run}")).await.expect("kv get");
            let status = entry
                .and_then(|v| serde_json::from_slice::<serde_json::Value>(&v).ok())
                .and_then(|v| v["status"].as_str().map(str::to_owned));
            if status.as_deref() == Some("succeeded") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the projection never showed {run} succeeded: {status:?}"
            );
            d.wait(Duration::from_millis(100)).await;
        }
    }
    let http = reqwest::Client::new();
    let (_, last) = runs.last().expect("runs");
    let view: serde_json::Value = http
        .get(format!("{}/v1/runs/{last}", d.bridge))
        .bearer_auth(BRIDGE_TOKEN)
        .send()
        .await
        .expect("bridge answers")
        .error_for_status()
        .expect("bridge status")
        .json()
        .await
        .expect("run view");
    assert_eq!(view["status"], "succeeded", "{view}");
    let tenant = async_nats::ConnectOptions::with_user_and_password(
        TENANT_USER.0.into(),
        TENANT_USER.1.into(),
    )
    .connect(d.cluster.urls())
    .await
    .expect("a tenant connects");
    // (The gateway restarted a moment ago: it answers once it has checked the layout.)
    let deadline = Instant::now() + Duration::from_secs(20);
    let text = loop {
        let reply = tokio::time::timeout(
            Duration::from_secs(5),
            tenant.request(format!("kedge.runs.{last}"), "".into()),
        )
        .await;
        match reply {
            Ok(Ok(m)) => break String::from_utf8_lossy(&m.payload).into_owned(),
            other if Instant::now() < deadline => {
                eprintln!("gateway: {other:?}; again");
                d.wait(Duration::from_millis(250)).await;
            }
            other => panic!("the gateway never answered the tenant: {other:?}"),
        }
    };
    assert!(text.contains("\"succeeded\""), "gateway: {text}");

    // The bridge's compose healthcheck command, against this bridge.
    let bridge_service = d
        .procs
        .iter()
        .find(|p| p.service.serve_kind() == Some("bridge"))
        .expect("bridge")
        .service
        .clone();
    let check: Vec<String> = bridge_service.doc["healthcheck"]["test"]
        .as_array()
        .expect("healthcheck test list")
        .iter()
        .skip(1) // "CMD"
        .map(|w| {
            w.as_str().unwrap_or_default().replace(
                "127.0.0.1/8080",
                &d.bridge.replace("http://", "").replace(':', "/"),
            )
        })
        .collect();
    let status = Command::new(&check[0])
        .args(&check[1..])
        .status()
        .expect("run the healthcheck");
    assert!(
        status.success(),
        "the bridge's compose healthcheck fails: {check:?}"
    );

    // Every process is up at the end (none is stuck exiting again and again), and nobody (no
    // Kedge user, not the tenant) hit a permission violation on any node.
    d.wait(Duration::from_millis(500)).await;
    for p in &mut d.procs {
        if let Some(status) = p.exited() {
            let log = std::fs::read_to_string(&p.log).unwrap_or_default();
            panic!("{} exited by itself ({status}):\n{log}", p.label);
        }
    }
    for node in 0..NatsCluster::SIZE {
        let log = std::fs::read_to_string(d.cluster.log_path(node)).unwrap_or_default();
        let violations: Vec<&str> = log.lines().filter(|l| l.contains("Violation")).collect();
        assert!(
            violations.is_empty(),
            "node {node}: {}",
            violations.join("\n")
        );
    }
    let restarts: Vec<String> = d
        .procs
        .iter()
        .filter(|p| p.restarts > 0)
        .map(|p| format!("{} x{}", p.label, p.restarts))
        .collect();
    let calls = mock.calls();
    eprintln!(
        "{} runs, {} processes, faults over {faults_done:?}, all done {:?} after start; model calls {} for {} runs ({} request ids); restarted by the restart policy: {restarts:?}",
        runs.len(),
        d.procs.len(),
        started.elapsed(),
        calls.total,
        runs.len(),
        calls.by_request_id.len()
    );
}
