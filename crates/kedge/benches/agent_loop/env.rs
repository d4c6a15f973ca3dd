//! The topology of one environment and the client that drives it. As deployed (the default): a
//! nats-server of its own (or a three-node cluster, `--cluster`), `kedge mock-llm` and `kedge
//! serve all` (or, `--split`, one `kedge serve <service>` per service) as processes of their
//! own, this process only a client. In process (`--in-process`): a nats-server of its own (or
//! a three-node cluster), the mock model on a thread, intake + step + tool (and the projector
//! with `--with-projector`) as tasks of this process, each on its own connection. Either way a
//! watcher of terminal events (an ordered consumer, as a client follows runs).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::DeliverPolicy;
use futures::StreamExt;
use kedge_core::event::EventType;
use kedge_core::ids::RunId;
use kedge_core::task::TaskSubmission;
use kedge_mock_llm::{MockHandle, Scripts};
use kedge_runtime::{Config, Runtime};
use kedge_testkit::ServerOptions;
use kedge_testkit::tls::Pki;

use crate::measure::{Cpu, ProcsMark, ms, start_mock};
use crate::support::deployed::{Broker, Deployed, services_from_env};
use crate::workload::{agent_definition, bench_config, script};
use crate::{AGENT, RUN_TIMEOUT};

/// Terminal events as a watching client sees them: one ordered consumer over every run's
/// terminal decision subjects.
#[derive(Default)]
pub struct Terminals {
    slots: Mutex<HashMap<String, Slot>>,
}

enum Slot {
    Waiting(tokio::sync::oneshot::Sender<(Instant, String)>),
    Done(Instant, String),
}

impl Terminals {
    pub fn register(&self, run: &RunId) -> tokio::sync::oneshot::Receiver<(Instant, String)> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut slots = self.slots.lock().unwrap();
        match slots.remove(run.as_str()) {
            Some(Slot::Done(at, ty)) => {
                let _ = tx.send((at, ty));
            }
            _ => {
                slots.insert(run.as_str().to_owned(), Slot::Waiting(tx));
            }
        }
        rx
    }

    pub fn seen(&self, run: &str, ty: &str, at: Instant) {
        let mut slots = self.slots.lock().unwrap();
        match slots.remove(run) {
            Some(Slot::Waiting(tx)) => {
                let _ = tx.send((at, ty.to_owned()));
            }
            _ => {
                slots.insert(run.to_owned(), Slot::Done(at, ty.to_owned()));
            }
        }
    }
}

/// The in-process broker: the durability setting, TLS and extra configuration of the
/// environment on one server, or on each node of a three-node cluster (`--cluster`).
async fn start_broker(
    sync_always: bool,
    tls: Option<&Pki>,
    extra_config: &str,
    cluster: bool,
) -> Broker {
    let mut server_config = extra_config.to_owned();
    if let Some(pki) = tls {
        server_config.push_str(&pki.server_config());
    }
    let options = ServerOptions {
        sync_always,
        extra_config: server_config,
        ..Default::default()
    };
    Broker::start(options, cluster).await
}

/// Where Kedge runs: in this process (`--in-process`) or as deployed (the default).
enum Topology {
    /// The broker, the mock model on a thread, the services as tasks of this process.
    InProcess {
        nats: Broker,
        mock: MockHandle,
        services: kedge_serve::TransientKedge,
        _dir: tempfile::TempDir,
    },
    /// nats-server, `kedge mock-llm` and `kedge serve` process(es); this process is a client.
    Deployed(Box<Deployment>),
}

/// The deployed topology's processes, by pid for the CPU accounting.
struct Deployment {
    procs: Deployed,
    /// The mock model's base URL (its `/_mock/calls` counts the calls).
    mock_url: String,
    mock_pid: u32,
    /// Each `kedge serve` process: the services it runs, its pid.
    serves: Vec<(String, u32)>,
    http: reqwest::Client,
}

/// The services of `kedge serve all`, each a process of its own with `--split` (as
/// kedge-serve's `Service` names them).
pub const SPLIT: [&str; 8] = [
    "intake",
    "step",
    "tool",
    "projector",
    "reconciler",
    "timer",
    "approval",
    "gateway",
];

pub struct Env {
    /// The bench's own runtime: the client (submits, the watcher, reading the journal back),
    /// and in process the op costs' subject.
    pub rt: Runtime,
    /// In process, the services' configuration; deployed, the client's (whose workspace root
    /// is the serve processes': the ledger is read from it).
    pub config: Config,
    pub terminals: Arc<Terminals>,
    topology: Topology,
    watcher: tokio::task::JoinHandle<()>,
    pub submitted: usize,
}

impl Env {
    /// In process. With `tls`, the server offers TLS and verifies client certificates, and
    /// every Kedge connection requires TLS (CA + client certificate); `extra_config` is appended
    /// to the server's configuration.
    pub async fn start(
        sync_always: bool,
        tls: Option<&Pki>,
        extra_config: &str,
        cluster: bool,
        park: bool,
        projector: bool,
    ) -> Env {
        let nats = start_broker(sync_always, tls, extra_config, cluster).await;
        let mock = start_mock(Scripts::from_value(script()).expect("valid script"));
        let dir = tempfile::tempdir().expect("temp dir");
        let urls = nats.urls();
        let mut config = bench_config(&urls[0], &dir.path().join("ws"), "w-bench");
        if cluster {
            config.nats_urls = urls;
            config.replicas = 3;
            config.check().expect("valid cluster bench config");
        }
        config.park_leases = park;
        if let Some(pki) = tls {
            config.nats.tls_ca = Some(pki.ca.clone());
            config.nats.tls_cert = Some(pki.client_cert.clone());
            config.nats.tls_key = Some(pki.client_key.clone());
            config.check().expect("valid TLS bench config");
        }
        let rt = Runtime::connect(config.clone()).await.expect("runtime");
        rt.agents
            .put(&agent_definition(&mock.base_url()))
            .await
            .expect("agent stored");
        let services = start_services(&config, projector);
        let (terminals, watcher) = watch_terminals(&rt).await;
        Env {
            rt,
            config,
            terminals,
            topology: Topology::InProcess {
                nats,
                mock,
                services,
                _dir: dir,
            },
            watcher,
            submitted: 0,
        }
    }

    /// As deployed: a nats-server (`sync_always`), `kedge mock-llm` and `kedge serve all` (or,
    /// `split`, one `kedge serve <service>` per service of `all`), each its own process on
    /// default settings but for what the workload needs (the ledger tool, the model's key, the
    /// workspace root, a worker id; `park: false` adds `KEDGE_PARK_LEASES=0`). This process
    /// only connects as a client.
    pub async fn start_deployed(sync_always: bool, park: bool, split: bool, cluster: bool) -> Env {
        let mut procs = Deployed::start_on(sync_always, None, cluster).await;
        // `KEDGE_BIN`: another build for `kedge serve` and `kedge mock-llm` (a copy of the
        // binary before a change).
        procs.children.set_bin(std::env::var_os("KEDGE_BIN"));
        let mock_url = procs.start_mock(&script()).await;
        let mock_pid = procs.children.pid("mock-llm").expect("mock-llm started");
        let mut config = Config {
            nats_urls: procs.broker.urls(),
            replicas: procs.broker.replicas(),
            workspace_root: procs.workspace.clone(),
            worker_id: "w-bench-client".parse().expect("worker id"),
            ..Config::default()
        };
        config.park_leases = park;
        config.check().expect("valid client config");
        let rt = Runtime::connect(config.clone()).await.expect("runtime");
        rt.agents
            .put(&agent_definition(&mock_url))
            .await
            .expect("agent stored");
        let groups: Vec<(String, Vec<String>)> = if split {
            SPLIT
                .iter()
                .map(|s| ((*s).to_owned(), vec![(*s).to_owned()]))
                .collect()
        } else {
            vec![("all".to_owned(), services_from_env())]
        };
        let mut serves = Vec::new();
        for (name, services) in groups {
            let mut env = procs.serve_env(&format!("w-{name}"));
            env.push(("KEDGE_LEDGER_TOOL".into(), "1".into()));
            if !park {
                env.push(("KEDGE_PARK_LEASES".into(), "0".into()));
            }
            // For an A/B in one build: one connection per process instead of two
            // (`KEDGE_LIGHT_LANE=0`), the shared threads' priority, how often the runs list
            // is written.
            for var in [
                "KEDGE_LIGHT_LANE",
                "KEDGE_SHARED_NICE",
                "KEDGE_BRIDGE_RUNS_LIST_INTERVAL_MS",
            ] {
                if let Ok(v) = std::env::var(var) {
                    env.push((var.into(), v));
                }
            }
            let pid = procs.serve(&format!("serve-{name}"), &services, &env);
            serves.push((name, pid));
        }
        let (terminals, watcher) = watch_terminals(&rt).await;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .expect("an HTTP client");
        Env {
            rt,
            config,
            terminals,
            topology: Topology::Deployed(Box::new(Deployment {
                procs,
                mock_url,
                mock_pid,
                serves,
                http,
            })),
            watcher,
            submitted: 0,
        }
    }

    /// Whether Kedge runs as deployed (its own processes), not in this process.
    pub fn deployed(&self) -> bool {
        matches!(self.topology, Topology::Deployed(_))
    }

    /// The processes, as the report's heading names them.
    pub fn describe(&self) -> String {
        match &self.topology {
            Topology::InProcess { .. } => "in process: intake + step + tool (+ the projector with --with-projector) as tasks of this process, the mock model on a thread of its own".to_owned(),
            Topology::Deployed(d) => {
                let serves: Vec<String> = d
                    .serves
                    .iter()
                    .map(|(name, pid)| format!("`kedge serve {name}` (pid {pid})"))
                    .collect();
                format!(
                    "deployed: {}, `kedge mock-llm` (pid {}), nats-server (pid {}); this process is only a client",
                    serves.join(", "),
                    d.mock_pid,
                    self.server_pids()
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        }
    }

    pub fn urls(&self) -> Vec<String> {
        match &self.topology {
            Topology::InProcess { nats, .. } => nats.urls(),
            Topology::Deployed(d) => d.procs.broker.urls(),
        }
    }

    pub fn server_pids(&self) -> Vec<u32> {
        match &self.topology {
            Topology::InProcess { nats, .. } => nats.pids(),
            Topology::Deployed(d) => d.procs.broker.pids(),
        }
    }

    /// The mock model in this process (the op costs call it); panics when deployed.
    pub fn mock_handle(&self) -> &MockHandle {
        match &self.topology {
            Topology::InProcess { mock, .. } => mock,
            Topology::Deployed(_) => panic!("the mock model is a process of its own"),
        }
    }

    /// The mock model's counters: (calls, request ids called more than once).
    pub async fn model_calls(&self) -> (u64, usize) {
        match &self.topology {
            Topology::InProcess { mock, .. } => {
                let calls = mock.calls();
                let repeated = calls.by_request_id.values().filter(|&&n| n != 1).count();
                (calls.total, repeated)
            }
            Topology::Deployed(d) => {
                let v: serde_json::Value = d
                    .http
                    .get(format!("{}/_mock/calls", d.mock_url))
                    .send()
                    .await
                    .expect("GET /_mock/calls")
                    .json()
                    .await
                    .expect("the mock's call counts");
                let repeated = v["by_request_id"]
                    .as_object()
                    .map_or(0, |m| m.values().filter(|n| n.as_u64() != Some(1)).count());
                (v["total"].as_u64().expect("total calls"), repeated)
            }
        }
    }

    /// The pids whose CPU a phase counts beside the server's and this process's: deployed, the
    /// serve processes then the mock model's.
    fn proc_pids(&self) -> Vec<u32> {
        match &self.topology {
            Topology::InProcess { .. } => Vec::new(),
            Topology::Deployed(d) => d
                .serves
                .iter()
                .map(|(_, pid)| *pid)
                .chain([d.mock_pid])
                .collect(),
        }
    }

    /// The CPU ticks of every process now ([`Env::cpu_since`]).
    pub fn cpu_mark(&self) -> ProcsMark {
        ProcsMark::now(&self.server_pids(), &self.proc_pids())
    }

    /// CPU ms by process since `mark`.
    pub fn cpu_since(&self, mark: &ProcsMark) -> Cpu {
        let (server, me, mock_thread) = mark.base_since(&self.server_pids());
        match &self.topology {
            Topology::InProcess { .. } => Cpu {
                server,
                kedge: me,
                mock: mock_thread,
                client: None,
                by_process: Vec::new(),
            },
            Topology::Deployed(d) => {
                let procs = mark.procs_since(&self.proc_pids());
                let by_process: Vec<(String, f64)> = d
                    .serves
                    .iter()
                    .zip(&procs)
                    .map(|((name, _), v)| (name.clone(), *v))
                    .collect();
                Cpu {
                    server,
                    kedge: by_process.iter().map(|(_, v)| v).sum(),
                    mock: procs.last().copied().unwrap_or(0.0),
                    client: Some(me),
                    by_process,
                }
            }
        }
    }

    /// Deployed: the end of every process's log (for a run that does not end).
    fn logs(&self) -> String {
        match &self.topology {
            Topology::InProcess { .. } => String::new(),
            Topology::Deployed(d) => d.procs.children.log_tail(30),
        }
    }

    /// Submits one run (the client picks its id) and waits for its terminal event.
    pub async fn run_one(&self, key: String) -> RunTiming {
        let chosen = RunId::generate();
        let run = kedge_runtime::run_ids::chosen(&"bench".parse().expect("tenant"), &chosen);
        let rx = self.terminals.register(&run);
        let t0 = Instant::now();
        self.submit(&chosen, &run, &key).await;
        let answered = Instant::now();
        let (at, _) = self.terminal(&run, rx).await;
        RunTiming {
            run,
            submit: ms(answered - t0),
            wall: ms(at - t0),
        }
    }

    /// Waits for `run`'s terminal event (`rx`, from [`Terminals::register`]), which must be
    /// `run.succeeded`; panics after [`RUN_TIMEOUT`] with the processes' logs (deployed).
    pub async fn terminal(
        &self,
        run: &RunId,
        rx: tokio::sync::oneshot::Receiver<(Instant, String)>,
    ) -> (Instant, String) {
        let (at, ty) = tokio::time::timeout(RUN_TIMEOUT, rx)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "run {run} not terminal after {RUN_TIMEOUT:?}\n{}",
                    self.logs()
                )
            })
            .expect("terminal watcher alive");
        assert_eq!(ty, "run.succeeded", "run {run} ended {ty}");
        (at, ty)
    }

    /// Submits a task choosing run id `chosen`, which makes run `run` (the id within the tenant):
    /// a client's request to `agent.task.<agent>.<tenant>`, answered by intake.
    pub async fn submit(&self, chosen: &RunId, run: &RunId, key: &str) {
        let task = TaskSubmission {
            agent: AGENT.parse().expect("agent name"),
            input: "go".into(),
            run_id: Some(chosen.clone()),
            budget: None,
            metadata: Default::default(),
            concurrency: None,
            priority: None,
        };
        let submission = kedge_intake::Submission {
            task: &task,
            key,
            tenant: "bench",
            caller: Some("bench"),
        };
        match kedge_intake::submit(&self.rt.client, &submission, Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("intake answered: {e}\n{}", self.logs()))
        {
            kedge_intake::Answer::Accepted { run_id } => assert_eq!(&run_id, run),
            kedge_intake::Answer::Rejected { error } => panic!("rejected: {error:?}"),
        }
    }

    /// In process: stops the services (the op costs run on an idle server). Deployed: checks
    /// that every process still runs (they stop with the environment).
    pub async fn stop_services(&mut self) {
        match &mut self.topology {
            Topology::InProcess { services, .. } => {
                if let Err(e) = services.shutdown().await {
                    panic!("a service failed: {e:#}");
                }
            }
            Topology::Deployed(d) => {
                if let Some(dead) = d.procs.children.dead() {
                    panic!("{dead}\n{}", d.procs.children.log_tail(30));
                }
            }
        }
    }

    /// Stops everything: the services, the watcher, the mock model, the broker (deployed: every
    /// process, by pid).
    pub async fn shutdown(mut self) {
        self.stop_services().await;
        self.watcher.abort();
        drop(self.topology);
    }
}

/// Intake, step and tool (and the projector, with `projector`), each started in this process
/// as `kedge serve` starts it, on a connection and under a worker id of its own.
fn start_services(config: &Config, projector: bool) -> kedge_serve::TransientKedge {
    use kedge_serve::Service;
    let mut services = kedge_serve::TransientKedge::new();
    let each = [
        (Service::Intake, "w-intake"),
        (Service::Step, "w-step"),
        (Service::Tool, "w-tool"),
        (Service::Projector, "w-projector"),
    ];
    for (service, worker) in each
        .into_iter()
        .filter(|(service, _)| projector || *service != Service::Projector)
    {
        let mut c = config.clone();
        c.worker_id = worker.parse().expect("worker id");
        services.start(c, &[service]);
    }
    services
}

/// The terminal watcher: an ordered consumer over every run's `run.*` decisions (one filter
/// subject: with several, nats-server walks the stream's whole subject index whenever the
/// consumer's next message lies past a filled block, docs/ARCHITECTURE.md "The broker's cost
/// per run"), feeding [`Terminals`] the terminal ones.
async fn watch_terminals(rt: &Runtime) -> (Arc<Terminals>, tokio::task::JoinHandle<()>) {
    let terminals = Arc::new(Terminals::default());
    let stream = rt.js.get_stream("KEDGE_RUNS").await.expect("KEDGE_RUNS");
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            filter_subject: "agent.run.*.d.run.*".into(),
            deliver_policy: DeliverPolicy::New,
            ..Default::default()
        })
        .await
        .expect("terminal watcher");
    let mut messages = consumer.messages().await.expect("terminal watcher stream");
    let t = terminals.clone();
    let watcher = tokio::spawn(async move {
        while let Some(m) = messages.next().await {
            let Ok(m) = m else { continue };
            let at = Instant::now();
            if let Some(p) = kedge_core::subjects::parse_event(&m.subject)
                && matches!(
                    p.event_type,
                    EventType::RunSucceeded | EventType::RunFailed | EventType::RunCancelled
                )
            {
                t.seen(p.run_id.as_str(), p.event_type.as_str(), at);
            }
        }
    });
    (terminals, watcher)
}

pub struct RunTiming {
    pub run: RunId,
    /// Submit → intake's answer, ms.
    pub submit: f64,
    /// Submit → terminal event seen, ms.
    pub wall: f64,
}
