//! Kedge as deployed, for the benches that drive it from outside: a nats-server of its own
//! (kedge-testkit: free port, temporary store, optionally `sync_interval: always`), `kedge
//! mock-llm` as its own process, and `kedge serve <services>` processes configured by their
//! environment alone. The bench is a client: it stores agents, publishes tasks and reads the
//! journal; the processes' pids are there for /proc CPU accounting.
//!
//! Every process is started by [`Children`], which kills (by pid) and reaps the ones it started
//! when dropped: at the end, on a panic, or when the bench is interrupted (the benches select on
//! ctrl-c, so the drop runs).

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kedge_testkit::{NatsCluster, NatsServer, ServerOptions};

/// The variable naming the mock model's API key, in every bench's agent definitions; its value
/// is given to the serve processes ([`Deployed::serve_env`]).
pub const MODEL_KEY_VAR: &str = "KEDGE_BENCH_API_KEY";

/// The processes a bench started: killed by their pid and reaped when dropped, also when the
/// bench panics or is interrupted.
pub struct Children {
    procs: Vec<(String, Child)>,
    pub log_dir: PathBuf,
    /// Another `kedge` binary than the one built with the bench (`KEDGE_BIN`).
    bin: Option<OsString>,
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.procs {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Children {
    /// No process yet; logs go to `log_dir` (created).
    pub fn new(log_dir: PathBuf) -> Children {
        std::fs::create_dir_all(&log_dir).expect("the log directory");
        Children {
            procs: Vec::new(),
            log_dir,
            bin: None,
        }
    }

    /// Runs `bin` instead of the `kedge` built with the bench (none: that one).
    pub fn set_bin(&mut self, bin: Option<OsString>) {
        self.bin = bin;
    }

    /// `kedge <args>` with no `KEDGE_*` variable of the bench's own environment, `env` added,
    /// stderr to `<name>.log` and stdout to `<name>.out` (`stdout_file`) or the log.
    pub fn spawn(
        &mut self,
        name: &str,
        args: &[&str],
        env: &[(String, String)],
        stdout_file: bool,
    ) {
        let log = std::fs::File::create(self.log_dir.join(format!("{name}.log")))
            .expect("create a log file");
        let stdout = if stdout_file {
            std::fs::File::create(self.log_dir.join(format!("{name}.out")))
                .expect("create an output file")
        } else {
            log.try_clone().expect("clone the log file")
        };
        let mut cmd = match &self.bin {
            Some(bin) => {
                let mut c = Command::new(bin);
                c.args(args);
                for (k, _) in std::env::vars_os() {
                    if k.to_string_lossy().starts_with("KEDGE_") {
                        c.env_remove(k);
                    }
                }
                c
            }
            None => super::kedge_command(args),
        };
        cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(log);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn kedge {}: {e}", args.join(" ")));
        self.procs.push((name.to_owned(), child));
    }

    /// The pid of the process started as `name`.
    pub fn pid(&self, name: &str) -> Option<u32> {
        self.procs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c.id())
    }

    /// The first process that is no longer running, with its exit status.
    pub fn dead(&mut self) -> Option<String> {
        self.procs
            .iter_mut()
            .find_map(|(name, child)| match child.try_wait() {
                Ok(None) => None,
                Ok(Some(status)) => Some(format!("{name} exited ({status})")),
                Err(e) => Some(format!("{name}: {e}")),
            })
    }

    /// The last `lines` lines of every log and output file.
    pub fn log_tail(&self, lines: usize) -> String {
        let mut out = String::new();
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.log_dir)
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        files.sort();
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            if all.is_empty() {
                continue;
            }
            let from = all.len().saturating_sub(lines);
            let _ = writeln!(
                out,
                "  --- {} (last {} lines)",
                f.display(),
                all.len() - from
            );
            for l in &all[from..] {
                let _ = writeln!(out, "  {l}");
            }
        }
        out
    }
}

/// Starts `kedge mock-llm` (process `mock-llm`) on a free port with the script in `script_file`
/// and waits (at most 30 s) for the line naming where it listens: its base URL.
pub async fn start_mock(children: &mut Children, script_file: &Path) -> String {
    let script = script_file.to_string_lossy().into_owned();
    children.spawn(
        "mock-llm",
        &["mock-llm", "--port", "0", "--script", &script],
        &[("KEDGE_LOG".into(), "warn".into())],
        true,
    );
    let out = children.log_dir.join("mock-llm.out");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        if let Some(url) = text
            .lines()
            .find_map(|l| l.strip_prefix("mock-llm listening on "))
        {
            return url.trim().to_owned();
        }
        if let Some(dead) = children.dead() {
            panic!("{dead}\n{}", children.log_tail(20));
        }
        assert!(
            Instant::now() < deadline,
            "kedge mock-llm did not say where it listens within 30 s\n{}",
            children.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The broker of one deployment: one server, or a three-node cluster on this machine (streams
/// and buckets with three replicas).
pub enum Broker {
    Single(Box<NatsServer>),
    Cluster(NatsCluster),
}

impl Broker {
    /// One server or a three-node cluster, each node started with `options`.
    pub async fn start(options: ServerOptions, cluster: bool) -> Broker {
        if cluster {
            Broker::Cluster(NatsCluster::start_with(options).await)
        } else {
            Broker::Single(Box::new(NatsServer::start_with(options).await))
        }
    }

    /// The client URLs: one, or one per node.
    pub fn urls(&self) -> Vec<String> {
        match self {
            Broker::Single(s) => vec![s.url()],
            Broker::Cluster(c) => c.urls(),
        }
    }

    /// The nats-server pids (one per node).
    pub fn pids(&self) -> Vec<u32> {
        match self {
            Broker::Single(s) => s.pid().into_iter().collect(),
            Broker::Cluster(c) => (0..NatsCluster::SIZE).filter_map(|n| c.pid(n)).collect(),
        }
    }

    /// The replicas of every stream and bucket Kedge creates on this broker.
    pub fn replicas(&self) -> usize {
        match self {
            Broker::Single(_) => 1,
            Broker::Cluster(_) => NatsCluster::SIZE,
        }
    }
}

/// One deployment: the broker, the processes, a temporary directory (the server's store is the
/// testkit's; here the mock's script, the workspaces and, unless given, the logs).
///
/// Fields drop in order: the processes are killed before the broker stops.
pub struct Deployed {
    pub children: Children,
    pub broker: Broker,
    /// `KEDGE_WORKSPACE_ROOT` of every serve process ([`Deployed::serve_env`]).
    pub workspace: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Deployed {
    /// A nats-server (`sync_always`: `jetstream { sync_interval: always }`) and no process yet;
    /// logs in `log_dir` (none: `logs/` in the temporary directory).
    pub async fn start(sync_always: bool, log_dir: Option<PathBuf>) -> Deployed {
        Self::start_on(sync_always, log_dir, false).await
    }

    /// As [`Deployed::start`]; with `cluster`, a three-node cluster instead of one server, and
    /// every serve process told to create its streams and buckets with three replicas.
    pub async fn start_on(sync_always: bool, log_dir: Option<PathBuf>, cluster: bool) -> Deployed {
        let options = ServerOptions {
            sync_always,
            // Diagnostics: extra top-level lines for the bench's nats-server (a `prof_port`
            // to read its goroutines during a burst, for example).
            extra_config: std::env::var("KEDGE_BENCH_NATS_CONFIG").unwrap_or_default(),
            ..Default::default()
        };
        let broker = Broker::start(options, cluster).await;
        let dir = tempfile::tempdir().expect("a temporary directory");
        let children = Children::new(log_dir.unwrap_or_else(|| dir.path().join("logs")));
        let workspace = dir.path().join("workspaces");
        std::fs::create_dir_all(&workspace).expect("the workspace root");
        Deployed {
            children,
            broker,
            workspace,
            dir,
        }
    }

    /// The bench's own runtime on the server (worker `bench-writer`): the client.
    pub async fn client_runtime(&self) -> kedge_runtime::Runtime {
        super::writer_runtime_on(self.broker.urls(), self.broker.replicas(), self.dir.path()).await
    }

    /// `kedge mock-llm` with `script` (written to the temporary directory): its base URL.
    pub async fn start_mock(&mut self, script: &serde_json::Value) -> String {
        let file = self.dir.path().join("script.json");
        std::fs::write(&file, script.to_string()).expect("write the script");
        start_mock(&mut self.children, &file).await
    }

    /// What every serve process is given: the broker's URLs and replicas, `worker` as its worker
    /// id, the workspace root, the mock model's key ([`MODEL_KEY_VAR`]) and `KEDGE_LOG=warn`.
    pub fn serve_env(&self, worker: &str) -> Vec<(String, String)> {
        [
            ("KEDGE_NATS_URL", self.broker.urls().join(",")),
            ("KEDGE_REPLICAS", self.broker.replicas().to_string()),
            ("KEDGE_WORKER_ID", worker.to_owned()),
            (
                "KEDGE_WORKSPACE_ROOT",
                self.workspace.to_string_lossy().into_owned(),
            ),
            ("KEDGE_MODEL_KEYS", MODEL_KEY_VAR.into()),
            (MODEL_KEY_VAR, "bench-key".into()),
            ("KEDGE_LOG", "warn".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// `kedge serve <services>` as process `name` with `env`; its pid.
    pub fn serve<S: AsRef<str>>(
        &mut self,
        name: &str,
        services: &[S],
        env: &[(String, String)],
    ) -> u32 {
        let args: Vec<&str> = std::iter::once("serve")
            .chain(services.iter().map(AsRef::as_ref))
            .collect();
        self.children.spawn(name, &args, env, false);
        self.children.pid(name).expect("just started")
    }

    /// The (first) nats-server's pid.
    pub fn server_pid(&self) -> Option<u32> {
        self.broker.pids().first().copied()
    }
}

/// The services `kedge serve` runs: `KEDGE_BENCH_SERVICES` (a diagnostic, e.g. `"intake step
/// tool"` leaves the others out, to price what an always-on service costs), else `all`.
pub fn services_from_env() -> Vec<String> {
    let listed: Vec<String> = std::env::var("KEDGE_BENCH_SERVICES")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    if listed.is_empty() {
        vec!["all".to_owned()]
    } else {
        listed
    }
}

/// The state of one durable consumer of the journal (`KEDGE_RUNS`); `None` when the
/// deployment runs no such consumer or the broker does not answer.
pub async fn journal_consumer(
    js: &async_nats::jetstream::Context,
    durable: kedge_core::subjects::Durable,
) -> Option<async_nats::jetstream::consumer::Info> {
    let stream = js
        .get_stream(kedge_core::subjects::RUNS_STREAM)
        .await
        .ok()?;
    stream.consumer_info(durable.name()).await.ok()
}
