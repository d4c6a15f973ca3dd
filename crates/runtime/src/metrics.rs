//! Prometheus metrics of one Kedge process: every name, its labels and the one recorder.
//!
//! `kedge serve` with `metrics_addr` set ([`crate::Config::metrics_addr`], `KEDGE_METRICS_ADDR`)
//! calls [`start`]: it binds the address (a port that cannot be bound stops the process at
//! startup, naming the address), installs the `metrics-exporter-prometheus` recorder as the
//! process's global `metrics` recorder and serves `GET /metrics` in the Prometheus text format.
//! Without it no recorder is installed and every call below is a no-op of a few nanoseconds.
//!
//! Invariants:
//!
//! - **Names are defined here only** ([`METRICS`]: name, type, labels, meaning; docs/RUNBOOK.md
//!   "Metrics" has the same table and a test keeps the two together). Services call the
//!   functions of this module, never the `metrics` macros with a name of their own.
//! - **Labels are bounded**: outcomes, classes, statuses and consumer names from fixed sets
//!   (a value outside the set is counted as `other`), and a price's currency, bounded by the
//!   agent definitions. Never a run id, an operation id, a tool name or a tool's arguments.
//! - **Counting never slows or fails the hot path**: nothing here awaits, returns an error or
//!   takes a lock of Kedge's own; names and labels are `'static`, so the recorder finds each
//!   series without allocating (the cost's currency label is the one exception, once per model
//!   call). Consumer lag is read from the broker only when `/metrics` is scraped.
//!
//! Counters count what *this process* did since it started (Prometheus sums them over
//! processes and handles restarts with `rate()`/`increase()`): a run's transitions are counted
//! by the step process that journaled them (the run's single writer, so the sum over processes
//! counts each once), its creation by the intake that wrote `run.created`.

use std::future::IntoFuture as _;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use kedge_core::event::{ErrorClass, Event, WaitReason};
use kedge_core::subjects::Durable;
use kedge_core::tools::ToolErrorClass;
use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// What kind of Prometheus metric a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric: its name, kind, label names and meaning.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    pub labels: &'static [&'static str],
    pub help: &'static str,
}

macro_rules! metrics_table {
    ($($const:ident = $name:literal, $kind:ident, [$($label:literal),*], $help:literal;)*) => {
        $(
            #[doc = $help]
            // The help texts name subjects such as `agent.rejected.<agent>` as Prometheus shows
            // them, not as HTML.
            #[allow(rustdoc::invalid_html_tags)]
            pub const $const: &str = $name;
        )*
        /// Every metric a Kedge process exports (docs/RUNBOOK.md "Metrics" lists the same).
        pub const METRICS: &[Metric] = &[
            $(Metric { name: $name, kind: Kind::$kind, labels: &[$($label),*], help: $help },)*
        ];
    };
}

metrics_table! {
    BUILD_INFO = "kedge_build_info", Gauge, ["version"],
        "Always 1; the version of the kedge binary.";
    RUNS_CREATED = "kedge_runs_created_total", Counter, [],
        "Runs this intake created (run.created journaled).";
    TASKS_REJECTED = "kedge_tasks_rejected_total", Counter, [],
        "Tasks this intake rejected (recorded on agent.rejected.<agent>).";
    RUN_TRANSITIONS = "kedge_run_transitions_total", Counter, ["status"],
        "Runs this step process moved into `status` (running, waiting_tool, waiting_user, waiting_approval, waiting_external, waiting_provider, cancelling, unknown, succeeded, failed, cancelled): the decisions it journaled.";
    STEPS_COMPLETED = "kedge_steps_completed_total", Counter, [],
        "Steps this process completed (step.completed journaled), reused responses included.";
    STEP_READS = "kedge_step_reads_total", Counter, ["how"],
        "Reads of what landed on a run since the step's state of it, by how: chained (the two messages the tool service linked with run-wide checks, read by sequence), linked (a state read back from its wake to its run.created by the links: a first drive's wake is that, no request), batched (a batched direct get of the run's subjects).";
    LANE_WORK = "kedge_lane_work_total", Counter, ["consumer", "lane"],
        "Work of the intake, step and tool services (a delivery, or an adopted run) by the lane it went out on: light (the process's second connection and threads, for a tenant with fewer than 8 other deliveries waiting or handled in that service), shared (the first connection and threads, for a tenant with a backlog there, and the process's other services).";
    PROJECTOR_READS = "kedge_projector_reads_total", Counter, ["how"],
        "Reads of a run's new events by the projector, by how: covered (none: the summary stored, by the step service after a drive, covered the decisions delivered), linked (from the decisions delivered, back to its fold by the run-wide checks' links, what it lacked fetched by sequence), batched (a batched direct get of the run's subjects).";
    LIST_WRITES = "kedge_step_list_writes_total", Counter, ["when"],
        "Summaries the step service wrote to the runs list (kedge_runs) from its fold after a drive, by when: at_once (the run is not busy: waiting on a person, a timer, a slot or its provider, or ended; written before the drive let go of the run), coalesced (a busy run: at most once per bridge.runs_list_interval_ms), failed (not written; the next drive or the projector writes the run).";
    MODEL_CALLS = "kedge_model_calls_total", Counter, ["outcome"],
        "Model call attempts by outcome: ok, error, cancelled.";
    MODEL_ERRORS = "kedge_model_errors_total", Counter, ["class", "kind"],
        "Failed model calls by class (retryable, fatal) and kind (status, request, connect, timeout, stream_ended, provider, protocol).";
    MODEL_CALL_SECONDS = "kedge_model_call_seconds", Histogram, [],
        "Duration of model calls, whatever their outcome.";
    MODEL_TOKENS = "kedge_model_tokens_total", Counter, ["direction"],
        "Tokens of the model answers this process received (direction: input, output): what was billed.";
    MODEL_COST_MICROS = "kedge_model_cost_micros_total", Counter, ["currency"],
        "Cost of those answers at the run's frozen model.price, in millionths of `currency` (runs without a price count nothing).";
    MODEL_RESPONSES_REUSED = "kedge_model_responses_reused_total", Counter, [],
        "Steps completed from a stored model response instead of a second call (the no-second-bill figure).";
    TOOL_OPERATIONS = "kedge_tool_operations_total", Counter, ["outcome"],
        "Tool operations this runner settled, by outcome: succeeded, failed, stopped (ran); stored (answered from the record); confirmed, ambiguous (after a confirm query); conflict, cancelled, moved (not run).";
    TOOL_RETRIES = "kedge_tool_attempts_retried_total", Counter, ["class"],
        "Failed tool attempts handed back for another attempt, by error class (timeout, transient, rate_limited).";
    TOOL_CALL_SECONDS = "kedge_tool_call_seconds", Histogram, [],
        "Duration of tool attempts (the tool running, not the bookkeeping).";
    CONFIRM_QUERIES = "kedge_confirm_queries_total", Counter, ["result"],
        "Confirm queries of operations abandoned by a runner, by result: confirmed, not_found, in_flight, ambiguous.";
    TAKEOVERS = "kedge_takeovers_total", Counter, ["kind"],
        "Leases (kind=run) and operation records (kind=operation) this process took over from a holder that is gone.";
    TAKEOVER_SECONDS = "kedge_takeover_seconds", Histogram, ["kind"],
        "From the gone holder's last heartbeat to the takeover here (takeovers that follow a worker death this process heard).";
    INTERRUPTED_ANSWERS = "kedge_interrupted_answers_total", Counter, ["result"],
        "Model attempts a gone holder left unfinished whose answer this step process waited for (within reconnect_grace), by result: reused (stored by the holder, or committed by it), none (the next attempt calls the model).";
    REMOTE_CALLS_WAITED = "kedge_remote_calls_waited_total", Counter, [],
        "Claims of an MCP operation whose runner is gone that this tool process put back until the first attempt's deadline (the remote call may still take effect).";
    FENCED_WRITES = "kedge_fenced_writes_total", Counter, ["what"],
        "Writes of this process refused, or withheld, because another process took its work over meanwhile (back from a dropped connection, say): decision (a step's commit: the run's lease or journal moved on), lease (a renewal: the lease was taken), op_record (a tool operation's record: taken over).";
    CONSUMER_DELIVERIES = "kedge_consumer_deliveries_total", Counter, ["consumer"],
        "Messages this process received from each durable consumer.";
    CONSUMER_REDELIVERIES = "kedge_consumer_redeliveries_total", Counter, ["consumer"],
        "Of those, the ones delivered more than once (the message info's delivery count).";
    CONSUMER_PENDING = "kedge_consumer_pending", Gauge, ["consumer"],
        "Messages not yet delivered (consumer info num_pending), read at scrape time for the consumers this process runs.";
    CONSUMER_ACK_PENDING = "kedge_consumer_ack_pending", Gauge, ["consumer"],
        "Messages delivered and not yet acknowledged (num_ack_pending), read at scrape time.";
    CONSUMER_REDELIVERED = "kedge_consumer_redelivered", Gauge, ["consumer"],
        "Messages redelivered and not yet acknowledged (num_redelivered), read at scrape time.";
    DEAD_LETTERS = "kedge_dead_letters_total", Counter, ["consumer"],
        "Messages this process gave up on (recorded on agent.rejected.dead.<consumer>).";
    TIMERS_SCHEDULED = "kedge_timers_scheduled_total", Counter, [],
        "Timers this timer service handed to the broker.";
    TIMERS_FIRED = "kedge_timers_fired_total", Counter, [],
        "Timer firings this timer service journaled (timer.fired).";
    RECONCILER_NUDGES = "kedge_reconciler_nudges_total", Counter, ["kind"],
        "Nudges this reconciler journaled: kind=stalled (a quiet run with work), kind=resolve (an operation stuck in running).";
    SSE_CONNECTIONS = "kedge_sse_connections", Gauge, [],
        "Open SSE connections of this bridge.";
    PROVIDER_WAITS = "kedge_provider_waits_total", Counter, ["trouble"],
        "Runs this step process put to wait on their model provider (provider.waiting), by trouble: unavailable, rate_limited (the call met it), held (not sent: the endpoint's breaker was open), queued (waiting its turn under the model's rate limit).";
    PROVIDER_RELEASES = "kedge_provider_releases_total", Counter, ["kind"],
        "Runs this process released from a wait on the provider (provider.released), by kind: probe (the one call the fleet sends to a failing endpoint), release (the endpoint is back, or the run's turn under a rate limit came).";
    PROVIDER_WAITING_RUNS = "kedge_provider_waiting_runs", Gauge, [],
        "Runs waiting on their model provider, fleet-wide, as this process's view of the kedge_providers bucket has them.";
    PROVIDER_BREAKERS_OPEN = "kedge_provider_breakers_open", Gauge, [],
        "Model endpoints whose fleet-wide breaker is open (failing: only probes go out), as this process sees them.";
    ADMISSION_LIMIT = "kedge_admission_limit", Gauge, ["service"],
        "Handlers the service may run at once now, with adaptive_concurrency on (its configured concurrency while its work does not queue).";
}

/// Upper bounds of every histogram's buckets, in seconds (a model call may take minutes).
const BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
/// How often the recorder's upkeep runs (histogram samples are drained into their buckets).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);
/// How long a scrape waits for one consumer's info.
const CONSUMER_INFO_WAIT: Duration = Duration::from_secs(2);

/// Why the endpoint cannot start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot serve metrics on {addr} (metrics_addr, KEDGE_METRICS_ADDR): {reason}")]
    Bind { addr: String, reason: String },
    #[error("cannot install the metrics recorder: {0}")]
    Recorder(String),
}

/// The process's recorder, once [`start`] installed it.
static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
/// The durable consumers this process runs, read at scrape time.
static CONSUMERS: Mutex<Vec<(Durable, PullConsumer)>> = Mutex::new(Vec::new());

/// Whether this process records metrics.
pub fn enabled() -> bool {
    HANDLE.get().is_some()
}

/// Binds `addr`, installs the recorder and serves `GET /metrics` until the process exits.
/// Returns the bound address (`addr` may ask for port 0). Fails, naming `addr`, when it cannot
/// be bound or a recorder is already installed in this process.
pub async fn start(addr: &str) -> Result<std::net::SocketAddr, MetricsError> {
    let bind_failed = |reason: String| MetricsError::Bind {
        addr: addr.to_owned(),
        reason,
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| bind_failed(e.to_string()))?;
    let local = listener
        .local_addr()
        .map_err(|e| bind_failed(e.to_string()))?;
    let handle = PrometheusBuilder::new()
        .set_buckets(BUCKETS)
        .map_err(|e| MetricsError::Recorder(e.to_string()))?
        .install_recorder()
        .map_err(|e| MetricsError::Recorder(e.to_string()))?;
    describe();
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    let _ = HANDLE.set(handle.clone());
    let upkeep = handle.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(UPKEEP_EVERY).await;
            upkeep.run_upkeep();
        }
    });
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || scrape(handle.clone())),
        )
        .merge(crate::health::router());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).into_future().await {
            tracing::error!(error = %e, "the metrics endpoint stopped");
        }
    });
    tracing::info!(addr = %local, "serving metrics at /metrics");
    Ok(local)
}

/// HELP and TYPE lines for every metric, also for series nothing has counted yet.
fn describe() {
    for m in METRICS {
        match m.kind {
            Kind::Counter => metrics::describe_counter!(m.name, m.help),
            Kind::Gauge => metrics::describe_gauge!(m.name, m.help),
            Kind::Histogram => metrics::describe_histogram!(m.name, m.help),
        }
    }
}

async fn scrape(handle: PrometheusHandle) -> impl axum::response::IntoResponse {
    refresh_consumers().await;
    handle.run_upkeep();
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        handle.render(),
    )
}

/// Sets the consumer gauges from the broker's consumer info (each asked at once, each waited
/// for at most [`CONSUMER_INFO_WAIT`]; one that does not answer keeps its last value).
async fn refresh_consumers() {
    let watched: Vec<(Durable, PullConsumer)> = match CONSUMERS.lock() {
        Ok(list) => list.clone(),
        Err(_) => return,
    };
    let infos = futures::future::join_all(watched.iter().map(|(name, consumer)| async move {
        let info = tokio::time::timeout(CONSUMER_INFO_WAIT, consumer.get_info()).await;
        (name.name(), info)
    }))
    .await;
    for (name, info) in infos {
        match info {
            Ok(Ok(info)) => {
                gauge!(CONSUMER_PENDING, "consumer" => name).set(info.num_pending as f64);
                gauge!(CONSUMER_ACK_PENDING, "consumer" => name).set(info.num_ack_pending as f64);
                gauge!(CONSUMER_REDELIVERED, "consumer" => name).set(info.num_redelivered as f64);
            }
            Ok(Err(e)) => tracing::debug!(consumer = name, error = %e, "consumer info for metrics"),
            Err(_) => tracing::debug!(consumer = name, "consumer info for metrics timed out"),
        }
    }
}

/// Counts `$name` with one label whose value is one of `$values` (else `other`), through a
/// `'static` key: the recorder finds the series without allocating.
macro_rules! one_of {
    ($macro:ident, $name:expr, $label:literal, $value:expr, [$($v:literal),*]) => {
        match $value {
            $($v => metrics::$macro!($name, $label => $v),)*
            _ => metrics::$macro!($name, $label => "other"),
        }
    };
}

/// Counter `name` of `consumer` (the label's value is `'static`: no allocation).
fn consumer_counter(name: &'static str, consumer: Durable) -> metrics::Counter {
    counter!(name, "consumer" => consumer.name())
}

/// Remembers durable consumer `name` (one of Kedge's) for the lag gauges. Only when metrics are
/// on; a consumer created again (a service restarted) replaces the one before.
pub fn watch_consumer(name: Durable, consumer: &PullConsumer) {
    if !enabled() {
        return;
    }
    if let Ok(mut list) = CONSUMERS.lock() {
        list.retain(|(n, _)| *n != name);
        list.push((name, consumer.clone()));
    }
}

/// A message consumer `consumer` delivered for the `deliveries`-th time.
pub fn delivered(consumer: Durable, deliveries: i64) {
    consumer_counter(CONSUMER_DELIVERIES, consumer).increment(1);
    if deliveries > 1 {
        consumer_counter(CONSUMER_REDELIVERIES, consumer).increment(1);
    }
}

/// A message of `consumer` given up on.
pub fn dead_letter(consumer: Durable) {
    consumer_counter(DEAD_LETTERS, consumer).increment(1);
}

/// Intake journaled a run's `run.created`.
pub fn run_created() {
    counter!(RUNS_CREATED).increment(1);
}

/// Intake rejected a task.
pub fn task_rejected() {
    counter!(TASKS_REJECTED).increment(1);
}

/// A run moved into a waiting status: by `run.waiting`, or by the end of a step group that
/// journals none (gate `wait_from_step_group`, `RunState::settled_by`).
pub fn waiting(on: WaitReason) {
    transition(match on {
        WaitReason::Tool => "waiting_tool",
        WaitReason::User => "waiting_user",
        WaitReason::Approval => "waiting_approval",
        WaitReason::External => "waiting_external",
    })
}

fn transition(status: &'static str) {
    one_of!(
        counter,
        RUN_TRANSITIONS,
        "status",
        status,
        [
            "running",
            "waiting_tool",
            "waiting_user",
            "waiting_approval",
            "waiting_external",
            "waiting_provider",
            "cancelling",
            "unknown",
            "succeeded",
            "failed",
            "cancelled"
        ]
    )
    .increment(1)
}

/// The step journaled `event`, a decision: counts the status it moves the run into, a
/// completed step and a reused response.
pub fn decision(event: &Event) {
    // Decisions that do not settle a status (run.created is intake's) count nothing here; new
    // event types count nothing until they are listed.
    match event {
        Event::StepCompleted(c) => {
            counter!(STEPS_COMPLETED).increment(1);
            if c.reused {
                counter!(MODEL_RESPONSES_REUSED).increment(1);
            }
        }
        Event::RunStarted(_) | Event::RunResumed(_) | Event::RunRevived(_) => transition("running"),
        Event::RunWaiting(w) => waiting(w.on),
        Event::RunCancelling(_) => transition("cancelling"),
        Event::RunUnknown(_) => transition("unknown"),
        Event::RunSucceeded(_) => transition("succeeded"),
        Event::RunFailed(_) => transition("failed"),
        Event::RunCancelled(_) => transition("cancelled"),
        Event::ProviderWaiting(_) => transition("waiting_provider"),
        _ => {}
    }
}

/// Why a run waits on its provider ([`PROVIDER_WAITS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProviderWait {
    Unavailable,
    RateLimited,
    Held,
    /// Waiting its turn under the endpoint's rate limits.
    Queued,
}

/// A run was put to wait on its provider.
pub fn provider_wait(why: ProviderWait) {
    match why {
        ProviderWait::Unavailable => counter!(PROVIDER_WAITS, "trouble" => "unavailable"),
        ProviderWait::RateLimited => counter!(PROVIDER_WAITS, "trouble" => "rate_limited"),
        ProviderWait::Held => counter!(PROVIDER_WAITS, "trouble" => "held"),
        ProviderWait::Queued => counter!(PROVIDER_WAITS, "trouble" => "queued"),
    }
    .increment(1);
}

/// A run was released from its wait on the provider (`probe`: as the fleet's probe).
pub fn provider_released(probe: bool) {
    if probe {
        counter!(PROVIDER_RELEASES, "kind" => "probe").increment(1);
    } else {
        counter!(PROVIDER_RELEASES, "kind" => "release").increment(1);
    }
}

/// Service `service`'s adaptive admission limit ([`ADMISSION_LIMIT`]).
pub fn admission_limit(service: &'static str, limit: usize) {
    gauge!(ADMISSION_LIMIT, "service" => service).set(limit as f64);
}

/// The fleet's provider trouble as this process sees it: runs waiting, breakers open.
pub fn provider_view(waiting: usize, open: usize) {
    gauge!(PROVIDER_WAITING_RUNS).set(waiting as f64);
    gauge!(PROVIDER_BREAKERS_OPEN).set(open as f64);
}

/// How the step read what landed on a run ([`STEP_READS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepRead {
    Chained,
    Linked,
    Batched,
}

/// The step read a run's new messages `how`.
pub fn step_read(how: StepRead) {
    let how = match how {
        StepRead::Chained => "chained",
        StepRead::Linked => "linked",
        StepRead::Batched => "batched",
    };
    counter!(STEP_READS, "how" => how).increment(1);
}

/// A delivery's work went out on the light lane or the shared connection ([`LANE_WORK`]).
pub fn lane_work(consumer: Durable, light: bool) {
    let lane = if light { "light" } else { "shared" };
    counter!(LANE_WORK, "consumer" => consumer.name(), "lane" => lane).increment(1);
}

/// How the projector read what landed on a run ([`PROJECTOR_READS`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProjectorRead {
    Covered,
    Linked,
    Batched,
}

/// The projector read a run's new events `how`.
pub fn projector_read(how: ProjectorRead) {
    let how = match how {
        ProjectorRead::Covered => "covered",
        ProjectorRead::Linked => "linked",
        ProjectorRead::Batched => "batched",
    };
    counter!(PROJECTOR_READS, "how" => how).increment(1);
}

/// When the step service wrote a run's summary to the list ([`LIST_WRITES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListWrite {
    AtOnce,
    Coalesced,
    Failed,
}

/// The step service wrote a summary (or failed to), `when`.
pub fn list_write(when: ListWrite) {
    let when = match when {
        ListWrite::AtOnce => "at_once",
        ListWrite::Coalesced => "coalesced",
        ListWrite::Failed => "failed",
    };
    counter!(LIST_WRITES, "when" => when).increment(1);
}

/// How a model call attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelOutcome {
    Ok,
    Error,
    Cancelled,
}

/// A model call attempt ended after `took`.
pub fn model_call(outcome: ModelOutcome, took: Duration) {
    match outcome {
        ModelOutcome::Ok => counter!(MODEL_CALLS, "outcome" => "ok"),
        ModelOutcome::Error => counter!(MODEL_CALLS, "outcome" => "error"),
        ModelOutcome::Cancelled => counter!(MODEL_CALLS, "outcome" => "cancelled"),
    }
    .increment(1);
    histogram!(MODEL_CALL_SECONDS).record(took.as_secs_f64());
}

/// A model call failed with an error of `class` and `kind` (the model crate's error kind:
/// `status`, `request`, `connect`, `timeout`, `stream_ended`, `provider`, `protocol`).
pub fn model_error(class: ErrorClass, kind: &str) {
    macro_rules! kinds {
        ($class:literal) => {
            match kind {
                "status" => counter!(MODEL_ERRORS, "class" => $class, "kind" => "status"),
                "request" => counter!(MODEL_ERRORS, "class" => $class, "kind" => "request"),
                "connect" => counter!(MODEL_ERRORS, "class" => $class, "kind" => "connect"),
                "timeout" => counter!(MODEL_ERRORS, "class" => $class, "kind" => "timeout"),
                "stream_ended" => {
                    counter!(MODEL_ERRORS, "class" => $class, "kind" => "stream_ended")
                }
                "provider" => counter!(MODEL_ERRORS, "class" => $class, "kind" => "provider"),
                "protocol" => counter!(MODEL_ERRORS, "class" => $class, "kind" => "protocol"),
                _ => counter!(MODEL_ERRORS, "class" => $class, "kind" => "other"),
            }
        };
    }
    match class {
        ErrorClass::Retryable => kinds!("retryable"),
        ErrorClass::Fatal => kinds!("fatal"),
    }
    .increment(1);
}

/// A model answer arrived: its tokens, and its cost in `currency` when the run has a price.
pub fn model_usage(input_tokens: u64, output_tokens: u64, cost: Option<(f64, &str)>) {
    counter!(MODEL_TOKENS, "direction" => "input").increment(input_tokens);
    counter!(MODEL_TOKENS, "direction" => "output").increment(output_tokens);
    if let Some((cost, currency)) = cost
        && cost.is_finite()
        && cost > 0.0
    {
        // Whole millionths: a counter holds integers.
        let micros = (cost * 1e6).round() as u64;
        counter!(MODEL_COST_MICROS, "currency" => currency.to_owned()).increment(micros);
    }
}

/// How a tool runner settled an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolOutcome {
    /// It ran and its result is not an error.
    Succeeded,
    /// It ran and its result is an error (after the last attempt).
    Failed,
    /// It was stopped by its run's cancellation.
    Stopped,
    /// Its record already held the result.
    Stored,
    /// Abandoned by a runner that is gone; the confirm query found it happened.
    Confirmed,
    /// Its outcome cannot be known (a person decides).
    Ambiguous,
    /// Same operation id, other arguments: not run.
    Conflict,
    /// Not run: the run's cancellation was requested.
    Cancelled,
    /// Not run: its approved target moved.
    Moved,
}

/// A tool operation was settled.
pub fn tool_operation(outcome: ToolOutcome) {
    match outcome {
        ToolOutcome::Succeeded => counter!(TOOL_OPERATIONS, "outcome" => "succeeded"),
        ToolOutcome::Failed => counter!(TOOL_OPERATIONS, "outcome" => "failed"),
        ToolOutcome::Stopped => counter!(TOOL_OPERATIONS, "outcome" => "stopped"),
        ToolOutcome::Stored => counter!(TOOL_OPERATIONS, "outcome" => "stored"),
        ToolOutcome::Confirmed => counter!(TOOL_OPERATIONS, "outcome" => "confirmed"),
        ToolOutcome::Ambiguous => counter!(TOOL_OPERATIONS, "outcome" => "ambiguous"),
        ToolOutcome::Conflict => counter!(TOOL_OPERATIONS, "outcome" => "conflict"),
        ToolOutcome::Cancelled => counter!(TOOL_OPERATIONS, "outcome" => "cancelled"),
        ToolOutcome::Moved => counter!(TOOL_OPERATIONS, "outcome" => "moved"),
    }
    .increment(1);
}

/// A tool attempt ran for `took`.
pub fn tool_call(took: Duration) {
    histogram!(TOOL_CALL_SECONDS).record(took.as_secs_f64());
}

/// A failed tool attempt of `class` will be tried again.
pub fn tool_retried(class: ToolErrorClass) {
    match class {
        ToolErrorClass::Timeout => counter!(TOOL_RETRIES, "class" => "timeout"),
        ToolErrorClass::Transient => counter!(TOOL_RETRIES, "class" => "transient"),
        ToolErrorClass::RateLimited => counter!(TOOL_RETRIES, "class" => "rate_limited"),
    }
    .increment(1);
}

/// What a confirm query answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfirmResult {
    Confirmed,
    NotFound,
    InFlight,
    Ambiguous,
}

/// A confirm query answered `result`.
pub fn confirm_query(result: ConfirmResult) {
    match result {
        ConfirmResult::Confirmed => counter!(CONFIRM_QUERIES, "result" => "confirmed"),
        ConfirmResult::NotFound => counter!(CONFIRM_QUERIES, "result" => "not_found"),
        ConfirmResult::InFlight => counter!(CONFIRM_QUERIES, "result" => "in_flight"),
        ConfirmResult::Ambiguous => counter!(CONFIRM_QUERIES, "result" => "ambiguous"),
    }
    .increment(1);
}

/// What was taken over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Takeover {
    /// A run's lease.
    Run,
    /// A tool operation's record.
    Operation,
}

/// A step process waited for the answer of an attempt a gone holder left unfinished
/// (`reused`: it came, stored or committed by that holder).
pub fn interrupted_answer(reused: bool) {
    if reused {
        counter!(INTERRUPTED_ANSWERS, "result" => "reused").increment(1);
    } else {
        counter!(INTERRUPTED_ANSWERS, "result" => "none").increment(1);
    }
}

/// What a fenced write was about ([`fenced_write`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// A step's decisions: the run's lease was lost, or its journal moved on.
    Decision,
    /// A lease renewal: the lease was taken.
    Lease,
    /// A tool operation's record: taken over.
    OpRecord,
}

/// A write of this process was refused or withheld because another process took its work over.
pub fn fenced_write(what: Fenced) {
    let what = match what {
        Fenced::Decision => "decision",
        Fenced::Lease => "lease",
        Fenced::OpRecord => "op_record",
    };
    counter!(FENCED_WRITES, "what" => what).increment(1);
}

/// A claim of an MCP operation whose runner is gone was put back until its first attempt's
/// deadline.
pub fn remote_call_waited() {
    counter!(REMOTE_CALLS_WAITED).increment(1);
}

/// This process took over a lease or a record from a holder that is gone; `since` is how long
/// ago that holder's last heartbeat was heard, when this process heard its death.
pub fn takeover(what: Takeover, since: Option<Duration>) {
    let (count, latency) = match what {
        Takeover::Run => (
            counter!(TAKEOVERS, "kind" => "run"),
            histogram!(TAKEOVER_SECONDS, "kind" => "run"),
        ),
        Takeover::Operation => (
            counter!(TAKEOVERS, "kind" => "operation"),
            histogram!(TAKEOVER_SECONDS, "kind" => "operation"),
        ),
    };
    count.increment(1);
    if let Some(since) = since {
        latency.record(since.as_secs_f64());
    }
}

/// The timer service handed a timer to the broker.
pub fn timer_scheduled() {
    counter!(TIMERS_SCHEDULED).increment(1);
}

/// The timer service journaled a firing.
pub fn timer_fired() {
    counter!(TIMERS_FIRED).increment(1);
}

/// Why the reconciler nudged a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nudge {
    /// A quiet run with work and no lease.
    Stalled,
    /// An operation stuck in `running`.
    Resolve,
}

/// The reconciler journaled a nudge.
pub fn reconciler_nudge(why: Nudge) {
    match why {
        Nudge::Stalled => counter!(RECONCILER_NUDGES, "kind" => "stalled"),
        Nudge::Resolve => counter!(RECONCILER_NUDGES, "kind" => "resolve"),
    }
    .increment(1);
}

/// One open SSE connection, counted in [`SSE_CONNECTIONS`] while it lives.
#[derive(Debug)]
#[must_use = "the connection is counted only while this lives"]
pub struct SseConnection(());

impl SseConnection {
    pub fn open() -> SseConnection {
        gauge!(SSE_CONNECTIONS).increment(1.0);
        SseConnection(())
    }
}

impl Drop for SseConnection {
    fn drop(&mut self) {
        gauge!(SSE_CONNECTIONS).decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_prometheus_names_and_unique() {
        let mut seen = std::collections::BTreeSet::new();
        for m in METRICS {
            assert!(seen.insert(m.name), "{} twice", m.name);
            assert!(m.name.starts_with("kedge_"), "{}", m.name);
            assert!(
                m.name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{}",
                m.name
            );
            assert_eq!(
                m.kind == Kind::Counter,
                m.name.ends_with("_total"),
                "{}: counters, and only counters, end in _total",
                m.name
            );
            for label in m.labels {
                assert!(
                    !["run_id", "run", "op", "operation", "tool", "arguments"].contains(label),
                    "{}: unbounded label {label}",
                    m.name
                );
            }
        }
    }

    /// docs/RUNBOOK.md "Metrics" has a row `| name | type | labels | meaning |` for every
    /// metric, with the same type and labels and a meaning that starts with the metric's help
    /// (the runbook may say more), and no row for a metric that does not exist.
    #[test]
    fn the_runbook_documents_every_metric() {
        let runbook = include_str!("../../../docs/RUNBOOK.md");
        let section = runbook
            .split("\n## Metrics")
            .nth(1)
            .expect("a Metrics section in docs/RUNBOOK.md");
        let section = section.split("\n## ").next().unwrap_or(section);
        let rows: Vec<Vec<&str>> = section
            .lines()
            .filter(|l| l.starts_with("| `kedge_"))
            .map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect())
            .collect();
        for m in METRICS {
            let row = rows
                .iter()
                .find(|r| r[0] == format!("`{}`", m.name))
                .unwrap_or_else(|| panic!("docs/RUNBOOK.md has no row for {}", m.name));
            let kind = match m.kind {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "histogram",
            };
            assert_eq!(row[1], kind, "{}", m.name);
            let labels: Vec<String> = m.labels.iter().map(|l| format!("`{l}`")).collect();
            let labels = if labels.is_empty() {
                "—".to_owned()
            } else {
                labels.join(", ")
            };
            assert_eq!(row[2], labels, "{}: labels", m.name);
            assert!(
                row.get(3)
                    .is_some_and(|meaning| meaning.starts_with(m.help)),
                "{}: the runbook's meaning does not start with the help {:?}",
                m.name,
                m.help
            );
        }
        for row in &rows {
            assert!(
                METRICS.iter().any(|m| row[0] == format!("`{}`", m.name)),
                "docs/RUNBOOK.md documents {} that no process exports",
                row[0]
            );
        }
    }

    #[test]
    fn counting_without_a_recorder_does_nothing_and_does_not_fail() {
        decision(&Event::RunResumed(Default::default()));
        delivered(Durable::Step, 3);
        model_usage(1, 2, Some((0.5, "USD")));
        let c = SseConnection::open();
        drop(c);
        assert!(!enabled());
    }
}
