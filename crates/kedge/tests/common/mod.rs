//! The harness of the end-to-end tests: a real nats-server (kedge-testkit), the strict mock model,
//! Kedge's services in this process or as separate `kedge` processes, and helpers to submit tasks
//! and wait for runs.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kedge_core::agent::AgentDefinition;
use kedge_core::event::{Draft, Envelope, Event, Timestamp};
use kedge_core::ids::RunId;
use kedge_core::task::TaskSubmission;
use kedge_core::{RunState, RunStatus};
use kedge_journal::Recorded;
use kedge_mock_llm::{MockHandle, Scripts};
use kedge_runtime::config::Secret;
use kedge_runtime::secure::Kind;
use kedge_runtime::{Config, Runtime};
use kedge_serve::{Service, TransientKedge};
use kedge_testkit::NatsServer;

// Also included by `bridge_support` (the bridge bench uses that without `common`).
#[allow(clippy::duplicate_mod)]
#[path = "../support/secure.rs"]
pub mod secure;
#[allow(unused_imports)]
pub use secure::{
    TENANTS, as_kind, kind_env, kind_password, secured, secured_accounts, tenant_password,
    test_server,
};

pub const API_KEY_VAR: &str = "KEDGE_TEST_API_KEY";

/// The failpoints of a step worker that dies with a model answer stored in the idempotency
/// bucket and not committed: the switch makes it take its commit as not landed (as when the
/// run moved on during the call), so it stores the answer, and dies right after.
pub const STORED_NOT_COMMITTED: &str = "switch:step.answer_not_committed,step.after_model_stored";

/// The failpoint of a step worker that takes every answer's commit as not landed, so it
/// stores each answer in the idempotency bucket and then commits it (and lives on): for tests
/// that look at or purge stored model responses.
pub const STORE_EVERY_ANSWER: &str = "switch:step.answer_not_committed";

/// Tools every test agent has (their JSON Schemas are permissive on purpose).
fn test_agent(name: &str, model: &str, base_url: &str) -> AgentDefinition {
    let tool = |n: &str| serde_json::json!({"name": n, "description": n, "parameters": {"type": "object", "properties": {}}});
    let tools: Vec<serde_json::Value> = [
        "read_file",
        "write_file",
        "list_files",
        "shell",
        "ask_user",
        "ledger_append",
        "wait",
        "await_callback",
    ]
    .iter()
    .map(|n| tool(n))
    .collect();
    let v = serde_json::json!({
        "name": name,
        "system_prompt": "test agent",
        "model": {"provider": "openai", "name": model, "base_url": format!("{base_url}/v1")},
        "api_key_env": API_KEY_VAR,
        "tools": tools,
        "budget": {"max_steps": 20, "max_tokens": 1000000, "max_attempts_per_step": 3}
    });
    AgentDefinition::parse(v.to_string().as_bytes()).expect("valid test agent")
}

pub struct Harness {
    pub nats: NatsServer,
    pub mock: MockHandle,
    pub rt: Runtime,
    pub config: Config,
    pub dir: tempfile::TempDir,
    /// The services in this process, each started as its own `kedge serve` would run it.
    services: TransientKedge,
    children: Vec<Child>,
    /// A test that cuts processes' broker connections sets this: a reply a process owed on a
    /// connection that dropped goes out on the next one, where the broker refuses it (its
    /// response permission was the old connection's) and logs a publish violation on an inbox
    /// subject. Those, and only those, are not counted as Kedge's users hitting permissions
    /// (docs/RUNBOOK.md "Permission violations after a dropped connection").
    pub replies_cut_off: bool,
}

/// The error lines of the in-process services (one that cannot start, one restarting after a
/// failure) go to the output of the test that caused them, shown when it fails; `RUST_LOG` asks
/// for more.
/// The worker id `name` (a test's own, always valid).
pub fn worker(name: &str) -> kedge_core::ids::WorkerId {
    name.parse().expect("worker id")
}

pub fn log_errors() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Short timeouts so that crash recovery happens within seconds.
pub fn fast_config(nats_url: &str, workspace: &Path, worker: &str) -> Config {
    let mut config = Config {
        nats_urls: vec![nats_url.to_owned()],
        workspace_root: workspace.to_owned(),
        worker_id: worker.parse().expect("worker id"),
        ..Config::default()
    };
    config
        .api_keys
        .insert(API_KEY_VAR.into(), "test-key".into());
    config.shell_allowlist.push("sleep".into());
    config.ledger_tool = true;
    let t = &mut config.timeouts;
    t.lease_ttl_ms = 2_000;
    t.lease_renew_ms = 500;
    t.step_ack_wait_ms = 3_000;
    t.model_timeout_ms = 10_000;
    t.tool_timeout_ms = 1_000;
    t.tool_grace_ms = 500;
    t.tool_ack_wait_ms = 2_000;
    t.stall_after_ms = 10_000;
    t.max_retry_delay_ms = 500;
    t.reconnect_grace_ms = 2_000;
    config.check().expect("valid test config");
    config
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Svc {
    Intake,
    Step,
    Tool,
    Approval,
    Gateway,
    Timer,
}

impl Svc {
    /// The service `kedge serve` knows it by.
    pub fn service(self) -> Service {
        match self {
            Svc::Intake => Service::Intake,
            Svc::Step => Service::Step,
            Svc::Tool => Service::Tool,
            Svc::Approval => Service::Approval,
            Svc::Gateway => Service::Gateway,
            Svc::Timer => Service::Timer,
        }
    }
}

impl Harness {
    /// A broker, the mock with `script` (JSON), the agent `agent` on model `model`, and the
    /// given services running in this process.
    pub async fn start(script: serde_json::Value, services: &[Svc]) -> Harness {
        Self::start_with(script, services, |_| {}).await
    }

    /// Like [`Harness::start`], with the configuration adjusted by `tune` first.
    pub async fn start_with(
        script: serde_json::Value,
        services: &[Svc],
        tune: impl FnOnce(&mut Config),
    ) -> Harness {
        log_errors();
        let nats = test_server().await;
        let mock = MockHandle::start(Scripts::from_value(script).expect("valid script")).await;
        let dir = tempfile::tempdir().expect("temp dir");
        let mut config = fast_config(&nats.url(), &dir.path().join("ws"), "w-main");
        if secured() {
            // The test itself is the operator with every right; each service gets its own user.
            config.nats.user = Some(Kind::Admin.user());
            config.nats.password = Some(Secret::new(kind_password(Kind::Admin)));
        }
        tune(&mut config);
        config.check().expect("valid tuned config");
        let rt = Runtime::connect(config.clone()).await.expect("runtime");
        let mut h = Harness {
            nats,
            mock,
            rt,
            config,
            dir,
            services: TransientKedge::new(),
            children: Vec::new(),
            replies_cut_off: false,
        };
        // One worker id per service, as separate processes would have: services sharing an id
        // would each see "another live process" under it, and a lease one of them lost under
        // load would never be taken back (`Liveness::id_is_unique`).
        for s in services {
            h.spawn_service(*s, &format!("w-main-{}", format!("{s:?}").to_lowercase()));
        }
        h
    }

    /// Stores a test agent named `name` whose model is `model` in the mock.
    pub async fn agent(&self, name: &str, model: &str) {
        let def = test_agent(name, model, &self.mock.base_url());
        self.rt.agents.put(&def).await.expect("agent stored");
    }

    /// Stores a test agent whose tools follow `policy` (the definition's `policy` object).
    pub async fn agent_with_policy(&self, name: &str, model: &str, policy: serde_json::Value) {
        let mut def = test_agent(name, model, &self.mock.base_url());
        def.policy = serde_json::from_value(policy).expect("valid policy");
        def.validate().expect("valid definition");
        self.rt.agents.put(&def).await.expect("agent stored");
    }

    /// Stores a test agent changed by `edit` (checked like any definition).
    pub async fn agent_edited(
        &self,
        name: &str,
        model: &str,
        edit: impl FnOnce(&mut AgentDefinition),
    ) {
        let mut def = test_agent(name, model, &self.mock.base_url());
        edit(&mut def);
        def.validate().expect("valid definition");
        self.rt.agents.put(&def).await.expect("agent stored");
    }

    /// Stores a test agent that also has the tools `extra` (e.g. MCP tools `<server>__<tool>`).
    pub async fn agent_with_tools(&self, name: &str, model: &str, extra: &[&str]) {
        let mut def = test_agent(name, model, &self.mock.base_url());
        for n in extra {
            def.tools.push(
                serde_json::from_value(serde_json::json!({"name": n, "description": n}))
                    .expect("valid tool"),
            );
        }
        def.validate().expect("valid definition");
        self.rt.agents.put(&def).await.expect("agent stored");
    }

    /// A runtime connected as the user of `kind` (the test's own `rt` is admin).
    pub async fn runtime_as(&self, kind: Kind) -> Runtime {
        Runtime::connect(as_kind(&self.config, kind))
            .await
            .expect("runtime of a kind")
    }

    /// Runs a service in this process as worker `worker` (its own connection and runtime), as
    /// `kedge serve <svc>` runs it (`kedge_serve::TransientKedge`).
    pub fn spawn_service(&mut self, svc: Svc, worker: &str) {
        self.spawn_service_with(svc, worker, |_| {});
    }

    /// [`Harness::spawn_service`] with its configuration changed by `edit` (e.g. its NATS URL
    /// pointed at a proxy).
    pub fn spawn_service_with(&mut self, svc: Svc, worker: &str, edit: impl FnOnce(&mut Config)) {
        let kind = match svc {
            Svc::Intake => Kind::Intake,
            Svc::Step => Kind::Step,
            Svc::Tool => Kind::Tool,
            Svc::Approval => Kind::Approval,
            Svc::Gateway => Kind::Gateway,
            Svc::Timer => Kind::Timer,
        };
        let mut config = as_kind(&self.config, kind);
        config.worker_id = worker.parse().expect("worker id");
        edit(&mut config);
        self.services.start(config, &[svc.service()]);
    }

    /// Runs several services in this process as one `kedge serve <svc>…` runs them (one
    /// connection, as the user of every service, `all`), as worker `worker`: a step service
    /// beside the tool service runs built-in tools inline (docs/ARCHITECTURE.md "Inline
    /// tools").
    pub fn spawn_services(&mut self, svcs: &[Svc], worker: &str) {
        let mut config = as_kind(&self.config, Kind::All);
        config.worker_id = worker.parse().expect("worker id");
        let services: Vec<Service> = svcs.iter().map(|s| s.service()).collect();
        self.services.start(config, &services);
    }

    /// Runs `kedge serve <svc>` as a separate process, with failpoints armed (e.g.
    /// [`STORED_NOT_COMMITTED`]).
    pub fn spawn_process(&mut self, svc: &str, worker: &str, failpoints: &str) -> usize {
        self.spawn_process_with_env(svc, worker, failpoints, &[])
    }

    /// Like [`Harness::spawn_process`], with extra environment variables (e.g. the bridge's
    /// `KEDGE_BRIDGE_LISTEN` and `KEDGE_BRIDGE_TOKENS`).
    pub fn spawn_process_with_env(
        &mut self,
        svc: &str,
        worker: &str,
        failpoints: &str,
        env: &[(&str, String)],
    ) -> usize {
        let t = &self.config.timeouts;
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kedge"));
        cmd.args(["serve", svc])
            .env("KEDGE_NATS_URL", self.nats.url())
            .env("KEDGE_WORKER_ID", worker)
            .env("KEDGE_WORKSPACE_ROOT", &self.config.workspace_root)
            .env(API_KEY_VAR, "test-key")
            .env("KEDGE_MODEL_KEYS", API_KEY_VAR)
            .env("KEDGE_LEDGER_TOOL", "1")
            .env("KEDGE_LEASE_TTL_MS", t.lease_ttl_ms.to_string())
            .env("KEDGE_LEASE_RENEW_MS", t.lease_renew_ms.to_string())
            .env("KEDGE_STEP_ACK_WAIT_MS", t.step_ack_wait_ms.to_string())
            .env("KEDGE_MODEL_TIMEOUT_MS", t.model_timeout_ms.to_string())
            .env("KEDGE_TOOL_TIMEOUT_MS", t.tool_timeout_ms.to_string())
            .env("KEDGE_TOOL_GRACE_MS", t.tool_grace_ms.to_string())
            .env("KEDGE_TOOL_ACK_WAIT_MS", t.tool_ack_wait_ms.to_string())
            .env("KEDGE_STALL_AFTER_MS", t.stall_after_ms.to_string())
            .env("KEDGE_RECONNECT_GRACE_MS", t.reconnect_grace_ms.to_string())
            .env("KEDGE_FAILPOINTS", failpoints)
            .env("KEDGE_LOG", "warn")
            .stdin(Stdio::null());
        // `svc` names one kind (`step`, `all`, `bridge` …): the process connects as its user.
        let kind: Kind = svc.parse().expect("a kind of Kedge user");
        for (k, v) in kind_env(&self.config, kind) {
            cmd.env(k, v);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        self.children.push(cmd.spawn().expect("spawn kedge serve"));
        self.children.len() - 1
    }

    /// Waits for a child process to exit (e.g. at its failpoint); returns whether it did.
    pub async fn wait_exit(&mut self, index: usize, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.children[index].try_wait() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// The process id of a child started by [`Harness::spawn_process`].
    pub fn pid(&self, index: usize) -> u32 {
        self.children[index].id()
    }

    pub fn kill9(&mut self, index: usize) {
        let _ = self.children[index].kill();
        let _ = self.children[index].wait();
    }

    /// Submits a task and returns the accepted run id (panics on a rejection).
    pub async fn submit(&self, agent: &str, input: &str, key: &str) -> RunId {
        let task = TaskSubmission::new(agent.parse().expect("agent name"), input);
        match self.submit_task(&task, key).await {
            kedge_intake::Answer::Accepted { run_id } => run_id,
            kedge_intake::Answer::Rejected { error } => panic!("rejected: {error}"),
        }
    }

    /// The run a task of the harness's tenant (`acme`) choosing run id `chosen` makes: the chosen
    /// id within the tenant (`kedge_runtime::run_ids::chosen`).
    pub fn chosen_run(&self, chosen: &RunId) -> RunId {
        kedge_runtime::run_ids::chosen(&"acme".parse().expect("tenant"), chosen)
    }

    pub async fn submit_task(&self, task: &TaskSubmission, key: &str) -> kedge_intake::Answer {
        let submission = kedge_intake::Submission {
            task,
            key,
            tenant: "acme",
            caller: Some("test"),
        };
        kedge_intake::submit(&self.rt.client, &submission, Duration::from_secs(20))
            .await
            .expect("intake answered")
    }

    /// Waits (at most 30 s) until worker `worker` has published a heartbeat (it is up and
    /// watching the others), then one beat more, so it has heard the others'.
    pub async fn heartbeat_of(&self, worker: &str) {
        use futures::StreamExt as _;
        let mut sub = self
            .rt
            .client
            .subscribe(kedge_core::subjects::live_heartbeat(
                &crate::common::worker(worker),
            ))
            .await
            .expect("subscribe");
        tokio::time::timeout(Duration::from_secs(30), sub.next())
            .await
            .unwrap_or_else(|_| panic!("no heartbeat from {worker}"));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    pub async fn events(&self, run: &RunId) -> Vec<Recorded> {
        self.rt.journal.read(run, 0).await.expect("journal read")
    }

    /// Checks that this build makes every decision the run's journal records, decided again at
    /// every point from the state folded up to there ([`kedge_core::replay::check`], with the
    /// run's agent revision). With `KEDGE_BLESS=all` (or a comma-separated list of names that
    /// holds `name`) the journal is also kept as the replay fixture `name` of
    /// crates/core/tests/fixtures (with its agent definition and the summary of its
    /// fold), so later builds are checked against what this one decided. For a finished run.
    pub async fn check_replay(&self, run: &RunId, name: &str) {
        let events = self.events(run).await;
        let journal: Vec<(u64, Envelope)> =
            events.iter().map(|r| (r.seq, r.envelope.clone())).collect();
        let state = self.state(run).await;
        assert!(
            state.status.is_terminal(),
            "{name}: {} is not finished",
            state.status
        );
        let def = self
            .rt
            .agents
            .at_revision(&state.bundle.agent, state.bundle.agent_revision)
            .await
            .expect("the run's agent revision");
        let contract = kedge_core::tools::Contract::of(&def);
        let checked = kedge_core::replay::check(&journal, &contract)
            .unwrap_or_else(|d| panic!("{name}: this build decides differently: {d}"));
        assert!(checked.groups > 0, "{name}: no decision checked");
        // `KEDGE_BLESS=all`, or a comma-separated list of fixture names.
        let bless = std::env::var("KEDGE_BLESS").unwrap_or_default();
        if bless != "all" && !bless.split(',').any(|n| n.trim() == name) {
            return;
        }
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../core/tests/fixtures");
        let mut lines = String::new();
        for (seq, env) in &journal {
            lines.push_str(&serde_json::json!({ "seq": seq, "event": env }).to_string());
            lines.push('\n');
        }
        std::fs::write(dir.join(format!("{name}.jsonl")), lines).expect("write the journal");
        let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).expect("json") + "\n";
        std::fs::write(
            dir.join(format!("{name}.expect.json")),
            pretty(&kedge_core::replay::summary(&state)),
        )
        .expect("write the summary");
        std::fs::write(
            dir.join(format!("{name}.agent.json")),
            pretty(&serde_json::to_value(&*def).expect("json")),
        )
        .expect("write the agent");
    }

    pub async fn state(&self, run: &RunId) -> RunState {
        let events = self.events(run).await;
        kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope))).expect("journal folds")
    }

    /// Polls the run until `pred` holds (or panics after `within`, showing the journal).
    pub async fn wait_for(
        &self,
        run: &RunId,
        within: Duration,
        pred: impl Fn(&RunState) -> bool,
    ) -> RunState {
        let deadline = Instant::now() + within;
        loop {
            let events = self.events(run).await;
            if !events.is_empty() {
                let state = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope)))
                    .expect("journal folds");
                if pred(&state) {
                    return state;
                }
                if Instant::now() > deadline {
                    let lines: Vec<String> = events
                        .iter()
                        .map(|r| {
                            format!(
                                "{} {} {}",
                                r.seq,
                                r.envelope.event_type(),
                                r.envelope.event.data_json()
                            )
                        })
                        .collect();
                    panic!(
                        "run {run} is {} after {within:?}; journal:\n{}",
                        state.status,
                        lines.join("\n")
                    );
                }
            } else if Instant::now() > deadline {
                panic!("run {run} has no events after {within:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the run is finished, then checks that this build makes every decision its
    /// journal records ([`Harness::check_replay`]; the fixture name is the test's, with `-`
    /// for `_`).
    pub async fn wait_terminal(&self, run: &RunId, within: Duration) -> RunState {
        let state = self.wait_for(run, within, |s| s.status.is_terminal()).await;
        let name = std::thread::current()
            .name()
            .unwrap_or("run")
            .rsplit("::")
            .next()
            .unwrap_or("run")
            .replace('_', "-");
        self.check_replay(run, &name).await;
        state
    }

    /// Appends an input to a run (`event` must be an input); its sequence (the first one's
    /// for a repeated `key`).
    pub async fn input(&self, run: &RunId, event: Event, key: &str) -> u64 {
        let env = Envelope::new(run.clone(), Timestamp::now(), Draft::new(event));
        let input = kedge_core::InputEnvelope::try_from(env).expect("an input");
        self.rt
            .journal
            .append_input(&kedge_core::ids::InputId::arbitrary(key), &input)
            .await
            .expect("input appended")
            .seq
    }

    /// Asks for `run`'s cancel (by "tester", reason "test", as a client's input with its key
    /// `cancel:<run>`); the input's sequence.
    pub async fn cancel(&self, run: &RunId) -> u64 {
        self.input(
            run,
            Event::CancelRequested(kedge_core::event::CancelRequested {
                reason: "test".into(),
                by: Some("tester".into()),
            }),
            &format!("cancel:{run}"),
        )
        .await
    }

    pub fn ledger(&self) -> Vec<String> {
        std::fs::read_to_string(self.config.workspace_root.join("ledger.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Stops the in-process services (they drain together) and the child processes.
    pub async fn shutdown(mut self) {
        if let Err(e) = self.services.shutdown().await {
            eprintln!("an in-process service failed: {e:#}");
        }
        for mut c in self.children.drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `service` in this process, as `kedge serve <service>` runs it, connected as the user of
/// its kind, until the test ends or the returned handle is aborted (which kills it).
pub fn spawn_detached(config: &Config, service: Service) -> tokio::task::JoinHandle<()> {
    let kind: Kind = service.name().parse().expect("a kind of Kedge user");
    let config = as_kind(config, kind);
    tokio::spawn(async move {
        let mut services = TransientKedge::new();
        let set = services.start(config, &[service]);
        if let Err(e) = services.wait(set).await {
            panic!("{service} service failed: {e:#}");
        }
    })
}

/// The permission violations of Kedge's services in a server log (`Publish Violation` /
/// `Subscription Violation` lines of a connection named `kedge-<worker>`, as every Kedge process
/// names its connection, under a `KEDGE/user:kedge-…` user): a service asked for something its
/// least-privilege user may not do. Unnamed connections (a test probing the boundary) are exempt.
pub fn kedge_violations(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| {
            l.contains("Violation") && l.contains("/user:kedge-") && l.contains(":rust:kedge-")
        })
        .map(str::to_owned)
        .collect()
}

impl Drop for Harness {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        // Every suite that runs on the secured layout also proves that the permissions fit the
        // services: a violation by a Kedge user fails the test that caused it.
        if secured() && !std::thread::panicking() {
            let log = std::fs::read_to_string(self.nats.log_path()).unwrap_or_default();
            let inboxes = format!(
                "Publish Violation - Subject \"{}.",
                self.config.inbox_prefix()
            );
            let violations: Vec<String> = kedge_violations(&log)
                .into_iter()
                .filter(|v| !(self.replies_cut_off && v.contains(&inboxes)))
                .collect();
            assert!(
                violations.is_empty(),
                "Kedge's own users hit permission violations (nats/secure/permissions.json):\n{}",
                violations.join("\n")
            );
        }
    }
}

/// Every journaled event of the run validates against `schemas/envelope.schema.json`.
pub fn assert_schema_valid(events: &[Recorded]) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../schemas/envelope.schema.json");
    let schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("schema file")).expect("json");
    let validator = jsonschema::validator_for(&schema).expect("valid schema");
    for r in events {
        let value: serde_json::Value =
            serde_json::from_slice(&r.envelope.to_json_bytes()).expect("json");
        let errors: Vec<String> = validator
            .iter_errors(&value)
            .map(|e| e.to_string())
            .collect();
        assert!(
            errors.is_empty(),
            "event {} ({}) is invalid: {errors:?}",
            r.seq,
            r.envelope.event_type()
        );
    }
}

pub fn statuses(state: &RunState) -> RunStatus {
    state.status
}

/// Takes up to 10 deliveries `durable` (ack wait `ack_wait`) holds now, waiting at most
/// `expires`, and acknowledges them unread: a wake or a request lost after its delivery. How
/// many were taken.
pub async fn swallow(
    js: &async_nats::jetstream::Context,
    durable: kedge_core::subjects::Durable,
    ack_wait: Duration,
    expires: Duration,
) -> usize {
    use futures::StreamExt as _;
    let consumer = kedge_runtime::consumer::durable(js, durable, ack_wait)
        .await
        .expect("the durable consumer");
    let mut batch = consumer
        .fetch()
        .max_messages(10)
        .expires(expires)
        .messages()
        .await
        .expect("fetch");
    let mut taken = 0;
    while let Some(Ok(msg)) = batch.next().await {
        msg.double_ack().await.expect("ack");
        taken += 1;
    }
    taken
}
