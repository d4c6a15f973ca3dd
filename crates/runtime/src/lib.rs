//! What every Kedge service shares.
//!
//! - [`Config`]: layered configuration (defaults, then a JSON file, then a `nats` CLI context,
//!   then `KEDGE_*` environment variables, then flags), with the timeout relations checked on
//!   load.
//! - [`connect`]: the one way to connect to NATS ([`connect_client`]): credentials, TLS, the
//!   inbox prefix; URLs shown only redacted ([`redact_url`]).
//! - [`Runtime`]: the broker connection after the layout check, the journal, leases and the KV
//!   stores every service uses.
//! - [`agents`]: agent definitions in `kedge_agents`.
//! - [`idempotency`]: stored model responses and tool operation records in `kedge_idempotency`.
//! - [`consumer`]: durable pull consumers from `nats/consumers/*.json`.
//! - [`projection`]: the read side of the `kedge_runs` projection (the run summary, get, list),
//!   shared by the bridge that reads it and the projector that writes it.
//! - [`run_ids`]: the keyed derivation of run ids and its key, held in the broker.
//! - [`schedules`]: the `kedge_schedules` bucket: schedules and their state, by compare-and-set.
//! - [`failpoint`]: crash injection for the fault tests (`KEDGE_FAILPOINTS`).
//! - [`metrics`]: the Prometheus metrics every service counts (names, labels, the recorder and
//!   the `/metrics` endpoint of `kedge serve`).
//! - [`secure`]: the secured broker configuration (accounts, least-privilege users), rendered.
//! - [`trace`]: the W3C `traceparent` a run carries, and joining a span to it.
//!
//! What outside parties may do to runs (inputs, tasks, approvals, callbacks) and what they see
//! of them (the run view) is the application layer, `kedge-app`, above this crate: nothing here
//! imports it (docs/ARCHITECTURE.md "Map of the house").
//!
//! Invariant: a service never starts against a broker that failed the layout check
//! ([`Runtime::connect`] refuses), so no code below has to wonder whether a flag is set.

mod admission;
pub mod agents;
mod cas;
pub mod config;
pub mod connect;
pub mod consumer;
pub mod failpoint;
pub mod fair;
pub mod health;
pub mod idempotency;
pub mod liveness;
pub mod metrics;
pub mod projection;
pub mod provider;
pub mod quota;
pub mod rejections;
pub mod responder;
pub mod run_ids;
pub mod schedules;
pub mod seal;
pub mod secure;
pub mod slots;
pub mod tenants;
pub mod trace;

/// A uniformly random `u64` for the jitter of a backoff (the core takes it as an input, so its
/// decisions stay pure): the step's model-call retries and the tool's attempt retries draw here.
pub fn jitter_draw() -> u64 {
    uuid::Uuid::new_v4().as_u64_pair().0
}

use std::sync::Arc;

use async_nats::jetstream;
use kedge_core::subjects;
use kedge_journal::{Journal, LayoutOptions, Leases};

pub use config::{Config, ConfigError, NatsConfig, Secret};
pub use connect::{ConnectFailure, connect_client, connect_options, redact_url};

/// Why a service cannot start or continue.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// `urls` are redacted ([`redact_url`]); `reason` never holds a configured secret.
    #[error("cannot connect to NATS at {urls}: {reason}")]
    Connect {
        urls: String,
        kind: ConnectFailure,
        reason: String,
    },
    #[error(transparent)]
    Layout(#[from] kedge_journal::LayoutError),
    #[error("{what}: {reason}")]
    Broker { what: String, reason: String },
    #[error(transparent)]
    Config(#[from] ConfigError),
}

impl RuntimeError {
    pub fn broker(what: impl Into<String>, reason: impl ToString) -> Self {
        RuntimeError::Broker {
            what: what.into(),
            reason: reason.to_string(),
        }
    }
}

/// The shared handles of a running process. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Runtime {
    pub config: Arc<Config>,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub journal: Journal,
    pub leases: Leases,
    pub agents: agents::AgentStore,
    pub idempotency: idempotency::IdempotencyStore,
    /// The operator's key for sensitive values ([`seal`]), when configured.
    pub seal: Option<seal::SealKey>,
    /// This process's failure detector, started by the first service that needs it
    /// ([`Runtime::liveness`]) and shared by the others.
    liveness: Arc<tokio::sync::OnceCell<liveness::Liveness>>,
    /// This process's view of the fleet's model endpoints, opened by the first service that
    /// needs it ([`Runtime::providers`]) and shared by the others.
    providers: Arc<tokio::sync::OnceCell<provider::Providers>>,
    /// The fleet's quota counts, opened on first use ([`Runtime::quotas`]).
    quotas: Arc<tokio::sync::OnceCell<quota::Quotas>>,
    /// The key run ids are derived with, read on first use ([`Runtime::run_ids`]).
    run_ids: Arc<tokio::sync::OnceCell<run_ids::RunIdKey>>,
    /// This process's light lane, for the work of tenants without a backlog, opened by
    /// the first service that needs it ([`Runtime::light_lane`]) and shared by the others.
    light: Arc<tokio::sync::OnceCell<LightLane>>,
    /// The light lane's own threads, for the light lane's runtime ([`Runtime::executor`]).
    executor: Option<tokio::runtime::Handle>,
}

/// The light lane of a process ([`Runtime::light_lane`]): its runtime, and the signal that
/// stops its threads once the last runtime of the process is dropped.
#[derive(Debug)]
struct LightLane {
    rt: Box<Runtime>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// Starts the light lane's threads: a Tokio runtime of its own, as many worker threads as the
/// process's, built and run by a thread of its own (never dropped in an async context) until
/// `stop` is dropped.
async fn light_threads()
-> Result<(tokio::runtime::Handle, tokio::sync::oneshot::Sender<()>), RuntimeError> {
    let failed = |e: std::io::Error| {
        RuntimeError::Config(ConfigError::Invalid {
            field: "light_lane",
            reason: format!("cannot start the light lane's threads: {e}"),
        })
    };
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (started, handle) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("kedge-light".into())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .thread_name("kedge-light")
                .enable_all()
                .build();
            match runtime {
                Ok(runtime) => {
                    let _ = started.send(Ok(runtime.handle().clone()));
                    runtime.block_on(async {
                        let _ = stopped.await;
                    });
                }
                Err(e) => {
                    let _ = started.send(Err(e));
                }
            }
        })
        .map_err(failed)?;
    let handle = handle
        .await
        .map_err(|_| failed(std::io::Error::other("its thread ended")))?
        .map_err(failed)?;
    Ok((handle, stop))
}

/// The nice value of the process's shared threads (`shared_nice`), set once its light lane's
/// threads exist; 0 until then (and with no lane).
static SHARED_NICE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

thread_local! {
    /// Whether this thread's priority was set ([`lower_shared_thread`]).
    static LOWERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Lowers the calling thread's CPU priority to `shared_nice` once the process's light lane
/// has threads (docs/ARCHITECTURE.md "Fairness across tenants"): the hook a shared Tokio
/// runtime calls on each of its worker threads as it wakes (the `kedge` binary's does). The
/// lane's threads are made by one of those threads and inherit its priority, which an
/// unprivileged process cannot raise again; so a thread is lowered only after they exist. A
/// thread the lowered one makes later (the shared runtime's blocking pool) inherits it, and so
/// would a second light lane opened by another `Runtime` of the process afterwards (`kedge
/// serve` has one runtime, one lane: a service restarted by its supervisor keeps both).
pub fn lower_shared_thread() {
    let nice = SHARED_NICE.load(std::sync::atomic::Ordering::Acquire);
    if nice == 0 || LOWERED.get() {
        return;
    }
    LOWERED.set(true);
    set_thread_nice(nice);
}

#[cfg(target_os = "linux")]
fn set_thread_nice(nice: i32) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    // On Linux a thread id names one thread to setpriority.
    if let Err(e) = rustix::process::setpriority_process(Some(rustix::thread::gettid()), nice)
        && !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        tracing::warn!(error = %e, nice, "cannot lower the shared threads' priority; the light lane's work competes with the rest for the cores");
    }
}

#[cfg(not(target_os = "linux"))]
fn set_thread_nice(_nice: i32) {}

impl Runtime {
    /// Calls `on_cancel` with the run of every `cancel.requested` input as it is published
    /// (core NATS sees every journal message, [`kedge_journal::Journal::watch_inputs`]): how the
    /// step and tool services stop a cancelled run's work at once. Best effort: a missed
    /// notification only lets work that already started run on, and the run's journal still
    /// has the cancel. Runs until the connection closes for good or the task is aborted.
    pub async fn on_cancel_requests(
        &self,
        mut on_cancel: impl FnMut(kedge_core::RunId) + Send + 'static,
    ) -> Result<tokio::task::JoinHandle<()>, RuntimeError> {
        use futures::StreamExt;
        let cancels = self
            .journal
            .watch_inputs(kedge_core::event::EventType::CancelRequested)
            .await
            .map_err(|e| RuntimeError::broker("subscribe to cancel requests", e))?;
        Ok(tokio::spawn(async move {
            tokio::pin!(cancels);
            while let Some(run) = cancels.next().await {
                on_cancel(run);
            }
        }))
    }

    /// How service `service`'s handlers are admitted ([`consumer::Workers::adaptive`]): `None`
    /// when `adaptive_concurrency` is off; a round trip through the broker on the worker's own
    /// liveness subjects when the service may use them (`broker`: the step and tool services,
    /// docs/SECURITY.md), else the scheduling lag alone.
    pub fn admission_probe(&self, service: &str, broker: bool) -> Option<consumer::Probe> {
        if !self.config.adaptive_concurrency {
            return None;
        }
        Some(if broker {
            consumer::Probe::Broker {
                client: self.client.clone(),
                subject: kedge_core::subjects::live_probe(&self.config.worker_id, service),
            }
        } else {
            consumer::Probe::Scheduling
        })
    }

    /// This process's failure detector ([`liveness::Liveness`]), started on first use with the
    /// configured worker id, heartbeat and suspicion threshold.
    pub async fn liveness(&self) -> Result<liveness::Liveness, RuntimeError> {
        self.liveness
            .get_or_try_init(|| {
                let t = &self.config.timeouts;
                liveness::Liveness::start(
                    self.client.clone(),
                    &self.config.worker_id,
                    t.heartbeat(),
                    t.suspect_after(),
                )
            })
            .await
            .cloned()
    }

    /// The fleet's view of each model endpoint ([`provider::Providers`]: breakers, waiting
    /// runs), opened and watched on first use.
    pub async fn providers(&self) -> Result<provider::Providers, RuntimeError> {
        self.providers
            .get_or_try_init(|| {
                provider::Providers::open(
                    self.js.clone(),
                    self.config.providers.clone(),
                    &self.config.worker_id,
                )
            })
            .await
            .cloned()
            .map_err(|e| RuntimeError::broker(format!("open {}", subjects::PROVIDERS_BUCKET), e))
    }

    /// The fleet's quota counts ([`quota::Quotas`], docs/ARCHITECTURE.md "Quotas"), opened on
    /// first use.
    pub async fn quotas(&self) -> Result<quota::Quotas, quota::QuotaError> {
        self.quotas
            .get_or_try_init(|| quota::Quotas::open(self.js.clone(), self.config.quotas.clone()))
            .await
            .cloned()
    }

    /// The tenant quotas when any tenant has a limit, else `None` without asking the broker
    /// (a door or a step of a fleet without quotas never fails on the bucket).
    pub async fn quotas_if_any(&self) -> Result<Option<quota::Quotas>, quota::QuotaError> {
        if !self.config.quotas.any() {
            return Ok(None);
        }
        self.quotas().await.map(Some)
    }

    /// The key run ids are derived with ([`run_ids`]), read from the broker on first use (only
    /// the kinds that derive run ids may read it) and checked against a configured one.
    pub async fn run_ids(&self) -> Result<run_ids::RunIdKey, run_ids::RunIdKeyError> {
        self.run_ids
            .get_or_try_init(|| run_ids::load(&self.js, self.config.run_id_key.as_ref()))
            .await
            .cloned()
    }

    /// The runtime of this process's light lane, for the deliveries of the intake, step and
    /// tool consumers and the work of tenants without a backlog (docs/ARCHITECTURE.md
    /// "Fairness across tenants"): a second connection to the broker and threads of its own. A
    /// connection's messages are handled in order on both sides, and a Tokio runtime's ready
    /// tasks in turn, so a tenant with a few runs would otherwise wait behind another tenant's
    /// thousands at every operation. Opened on first use
    /// with the same settings (credentials, TLS, inbox prefix) and shared by every clone and
    /// service of the process; it shares this runtime's configuration, failure detector,
    /// provider view, quota counts and run-id key. Its work is spawned with
    /// [`Runtime::executor`]. `None` when `light_lane` is off, and for the light lane itself.
    pub async fn light_lane(&self) -> Result<Option<Runtime>, RuntimeError> {
        if !self.config.light_lane || self.executor.is_some() {
            return Ok(None);
        }
        let light = self
            .light
            .get_or_try_init(|| async {
                let (executor, stop) = light_threads().await?;
                // The connection's own task runs on the lane's threads.
                let config = self.config.clone();
                let client = executor
                    .spawn(async move { connect_client(&config).await })
                    .await
                    .map_err(|e| RuntimeError::broker("connect the light lane", e))??;
                let mut light = Self::stores(self.config.clone(), client).await?;
                light.seal = self.seal.clone();
                light.liveness = self.liveness.clone();
                light.providers = self.providers.clone();
                light.quotas = self.quotas.clone();
                light.run_ids = self.run_ids.clone();
                light.executor = Some(executor);
                // From now on the shared threads give way to the lane's.
                SHARED_NICE.store(
                    i32::from(self.config.shared_nice),
                    std::sync::atomic::Ordering::Release,
                );
                Ok::<_, RuntimeError>(LightLane {
                    rt: Box::new(light),
                    _stop: stop,
                })
            })
            .await?;
        Ok(Some(Runtime::clone(&light.rt)))
    }

    /// Where this runtime's work is spawned: the light lane's own threads for the light lane
    /// ([`Runtime::light_lane`]), else `None` (the caller's Tokio runtime).
    pub fn executor(&self) -> Option<&tokio::runtime::Handle> {
        self.executor.as_ref()
    }

    /// Connects ([`connect_client`]: credentials, TLS, inbox prefix from `config.nats`), checks
    /// (and creates where missing) the broker layout, and opens the stores.
    pub async fn connect(config: Config) -> Result<Runtime, RuntimeError> {
        let client = connect_client(&config).await?;
        Self::from_client(config, client).await
    }

    /// [`Runtime::connect`] for a command that reads or sends to an existing deployment: the
    /// layout is verified, never created (a server without it is refused, unchanged).
    pub async fn connect_existing(config: Config) -> Result<Runtime, RuntimeError> {
        let client = connect_client(&config).await?;
        Self::open(config, client, false).await
    }

    /// Like [`Runtime::connect`] over an existing client.
    pub async fn from_client(
        config: Config,
        client: async_nats::Client,
    ) -> Result<Runtime, RuntimeError> {
        Self::open(config, client, true).await
    }

    async fn open(
        config: Config,
        client: async_nats::Client,
        create: bool,
    ) -> Result<Runtime, RuntimeError> {
        config.check()?;
        let opts = LayoutOptions {
            replicas: config.replicas,
        };
        let report = if create {
            kedge_journal::ensure_layout(&client, &opts).await?
        } else {
            kedge_journal::verify_layout(&client, &opts).await?
        };
        tracing::debug!(?report, "broker layout verified");
        let js = jetstream::new(client.clone());
        if create {
            // The run-id key is created with the layout (the first process, or `kedge layout` as
            // admin): a process that may not create it only logs, the readers fail clearly.
            if let Err(e) = run_ids::ensure(&js, config.run_id_key.as_ref()).await {
                tracing::warn!(error = %e, "cannot ensure the run-id key");
            }
        }
        let mut rt = Self::stores(Arc::new(config), client).await?;
        rt.seal =
            match &rt.config.seal_key {
                Some(hex) => Some(seal::SealKey::from_hex(hex.expose()).map_err(|e| {
                    ConfigError::Invalid {
                        field: "seal_key",
                        reason: e.to_string(),
                    }
                })?),
                None => None,
            };
        Ok(rt)
    }

    /// The journal and stores over `client`, with nothing shared and no seal key yet.
    async fn stores(
        config: Arc<Config>,
        client: async_nats::Client,
    ) -> Result<Runtime, RuntimeError> {
        let js = jetstream::new(client.clone());
        let kv = |bucket: &'static str| {
            let js = js.clone();
            async move {
                js.get_key_value(bucket)
                    .await
                    .map_err(|e| RuntimeError::broker(format!("open bucket {bucket}"), e))
            }
        };
        let agents = agents::AgentStore::new(kv(subjects::AGENTS_BUCKET).await?);
        let journal = Journal::new(client.clone()).with_trace_context(trace::current);
        let idempotency =
            idempotency::IdempotencyStore::new(kv(subjects::IDEMPOTENCY_BUCKET).await?)
                .with_blobs(journal.blobs().clone());
        let leases = Leases::new(client.clone());
        Ok(Runtime {
            journal,
            seal: None,
            leases,
            agents,
            idempotency,
            js,
            client,
            config,
            liveness: Arc::default(),
            providers: Arc::default(),
            quotas: Arc::default(),
            run_ids: Arc::default(),
            light: Arc::default(),
            executor: None,
        })
    }
}
