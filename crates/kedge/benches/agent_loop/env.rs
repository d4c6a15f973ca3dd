//! The in-process topology of one environment: a nats-server of its own (or a three-node
//! cluster), the mock model, intake + step + tool (and the projector with `--with-projector`)
//! as tasks of this process, each on its own connection, and a watcher of terminal events.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::DeliverPolicy;
use futures::StreamExt;
use kedge_core::ids::RunId;
use kedge_core::task::TaskSubmission;
use kedge_mock_llm::{MockHandle, Scripts};
use kedge_runtime::{Config, Runtime};
use kedge_testkit::tls::Pki;
use kedge_testkit::{NatsCluster, NatsServer, ServerOptions};

use crate::measure::{ms, start_mock};
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

/// The broker of one environment: one server, or a three-node cluster (`--cluster`).
pub enum Broker {
    Single(Box<NatsServer>),
    Cluster(NatsCluster),
}

impl Broker {
    /// One server, or a three-node cluster, with the durability setting, TLS and extra
    /// configuration of the environment.
    async fn start(
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
        if cluster {
            Broker::Cluster(NatsCluster::start_with(options).await)
        } else {
            Broker::Single(Box::new(NatsServer::start_with(options).await))
        }
    }

    pub fn urls(&self) -> Vec<String> {
        match self {
            Broker::Single(s) => vec![s.url()],
            Broker::Cluster(c) => c.urls(),
        }
    }

    pub fn pids(&self) -> Vec<u32> {
        match self {
            Broker::Single(s) => s.pid().into_iter().collect(),
            Broker::Cluster(c) => (0..NatsCluster::SIZE).filter_map(|n| c.pid(n)).collect(),
        }
    }
}

pub struct Env {
    pub nats: Broker,
    pub mock: MockHandle,
    _dir: tempfile::TempDir,
    pub config: Config,
    pub rt: Runtime,
    pub terminals: Arc<Terminals>,
    services: kedge_serve::TransientKedge,
    watcher: tokio::task::JoinHandle<()>,
    pub submitted: usize,
}

impl Env {
    /// With `tls`, the server offers TLS and verifies client certificates, and every Kedge
    /// connection requires TLS (CA + client certificate); `extra_config` is appended to the
    /// server's configuration.
    pub async fn start(
        sync_always: bool,
        tls: Option<&Pki>,
        extra_config: &str,
        cluster: bool,
        park: bool,
        projector: bool,
    ) -> Env {
        let nats = Broker::start(sync_always, tls, extra_config, cluster).await;
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
            nats,
            mock,
            _dir: dir,
            config,
            rt,
            terminals,
            services,
            watcher,
            submitted: 0,
        }
    }

    pub fn server_pids(&self) -> Vec<u32> {
        self.nats.pids()
    }

    /// Submits one run (the client picks its id) and waits for its terminal event.
    pub async fn run_one(&self, key: String) -> RunTiming {
        let chosen = RunId::generate();
        let run = kedge_runtime::run_ids::chosen(&"bench".parse().expect("tenant"), &chosen);
        let rx = self.terminals.register(&run);
        let t0 = Instant::now();
        self.submit(&chosen, &run, &key).await;
        let answered = Instant::now();
        let (at, ty) = tokio::time::timeout(RUN_TIMEOUT, rx)
            .await
            .unwrap_or_else(|_| panic!("run {run} not terminal after {RUN_TIMEOUT:?}"))
            .expect("terminal watcher alive");
        assert_eq!(ty, "run.succeeded", "run {run} ended {ty}");
        RunTiming {
            run,
            submit: ms(answered - t0),
            wall: ms(at - t0),
        }
    }

    /// Submits a task choosing run id `chosen`, which makes run `run` (the id within the tenant).
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
            .expect("intake answered")
        {
            kedge_intake::Answer::Accepted { run_id } => assert_eq!(&run_id, run),
            kedge_intake::Answer::Rejected { error } => panic!("rejected: {error:?}"),
        }
    }

    pub async fn stop_services(&mut self) {
        if let Err(e) = self.services.shutdown().await {
            panic!("a service failed: {e:#}");
        }
    }

    pub async fn shutdown(mut self) {
        self.stop_services().await;
        self.watcher.abort();
        drop(self.mock);
        drop(self.nats);
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

/// The terminal watcher: an ordered consumer over every run's terminal decision subjects,
/// feeding [`Terminals`].
async fn watch_terminals(rt: &Runtime) -> (Arc<Terminals>, tokio::task::JoinHandle<()>) {
    let terminals = Arc::new(Terminals::default());
    let stream = rt.js.get_stream("KEDGE_RUNS").await.expect("KEDGE_RUNS");
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            filter_subjects: vec![
                "agent.run.*.d.run.succeeded".into(),
                "agent.run.*.d.run.failed".into(),
                "agent.run.*.d.run.cancelled".into(),
            ],
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
            if let Some(p) = kedge_core::subjects::parse_event(&m.subject) {
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
