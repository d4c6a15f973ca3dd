//! The intake service: turns tasks on `agent.task.<agent>` into runs.
//!
//! For each task (durable consumer `intake` on the work-queue stream `KEDGE_TASKS`) it validates
//! the body against the task schema, resolves the agent's current definition, and freezes the
//! run bundle into `run.created`, written with the check that the run has no decision yet.
//!
//! Idempotency: the client's `Nats-Msg-Id` is the key. Run ids are made within the tenant
//! ([`kedge_runtime::run_ids`]): a task that chose no run id gets a keyed hash, under the
//! broker-held run-id key, of (tenant, key), so a task redelivered after intake crashed mid-way
//! computes the same run and its `run.created` append is refused as already present: the same
//! key never makes two runs, also after the stream's duplicate window. A task without a Msg-Id is
//! keyed by (tenant, its stream sequence) (safe against redelivery, not against a client
//! publishing twice); a chosen run id becomes a hash of (tenant, that id). No tenant can take
//! another tenant's run id first (docs/SECURITY.md, "Run ids"), and "a run with id … already
//! exists" is only ever answered to the run's own tenant.
//!
//! A task that fails validation, or that cannot be journaled for a reason retrying will not
//! change, is acked (never retried), recorded on `agent.rejected.<agent>` (stream
//! `KEDGE_REJECTIONS`) with the reason, and answered when it asked for an answer. Only broker
//! trouble is retried, with a growing delay, and at most the consumer's `max_deliver` times:
//! the last delivery is rejected the same way ("gave up after N deliveries: …"), so no task is
//! left unanswered. A panic while handling a task is contained (the task is handed back).
//!
//! Intake also answers external callbacks over NATS: a request on `agent.callback.<key>` (queue
//! group `kedge-callbacks`; body = the payload, JSON or text; optional `Kedge-Delivery-Id`
//! header) is delivered by [`kedge_app::callbacks::deliver`] and answered with its
//! `Delivery` as JSON (`{"status": "accepted" | "early" | "duplicate" | "expired" | "closed" |
//! "unknown_key", …}`).
//!
//! Answers go to the subject in the task's `Kedge-Reply-To` header (a JetStream publish's own
//! reply subject carries the broker's ack, so it cannot carry ours): `{"run_id": …}` or
//! `{"error": {"field": …, "reason": …}}`. Only inbox subjects are answered (`_INBOX.…`, or the
//! configured inbox prefix): a task cannot make intake publish anywhere else.
//!
//! The tenant of a task is the subject's fifth token (`agent.task.<agent>.<tenant>`; none means
//! the default tenant), never a header: in a secured deployment only the tenant gateway (to
//! which the server routes a tenant account's `agent.task.<agent>` with the tenant fixed by the
//! server configuration) and the bridge (which authenticated the caller's token) may publish
//! those subjects. A tenant may start an agent only if the definition allows it
//! ([`kedge_core::agent::AgentDefinition::allows_tenant`]); to any other tenant the agent does
//! not exist.

use kedge_core::Decision;
use kedge_core::DecisionEnvelope;
use kedge_journal::RunCreator;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::Message;
use futures::FutureExt;
use kedge_core::event::{Draft, Event, RunCreated, Timestamp};
use kedge_core::fairness::Pace;
use kedge_core::ids::{RunId, TenantId};
use kedge_core::subjects::{self, Durable, TaskSubject};
use kedge_core::task::{TaskRejection, TaskSubmission};
use kedge_journal::{ErrorKind, JournalError};
use kedge_runtime::agents::AgentError;
use kedge_runtime::consumer::{Backoff, Verdict};
use kedge_runtime::fair::{self, FairFeed, Tenancy};
use kedge_runtime::responder::{self, Busy, Listen, Responder};
use kedge_runtime::{Runtime, RuntimeError, consumer, trace};
use tracing::Instrument;

pub use kedge_app::tasks::{
    Answer, CALLER_HEADER, DEFAULT_TENANT, REPLY_HEADER, Submission, SubmitError, submit,
    submit_raw,
};

/// The durable consumer's name.
const CONSUMER: Durable = Durable::Intake;
/// Tasks handled at once by one intake process.
const WORKERS: usize = 64;
/// The intake consumer's ack wait.
const ACK_WAIT: Duration = Duration::from_secs(30);
/// Redelivery delays of a task that cannot be handled now (doubled per delivery up to the cap;
/// the consumer's `max_deliver` bounds the tries, and the last one is answered).
const BACKOFF: Backoff = Backoff {
    base: Duration::from_secs(1),
    cap: Duration::from_secs(30),
};

/// Runs intake until `shutdown` resolves.
pub async fn run(rt: Runtime, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
    let workers =
        consumer::Workers::adaptive(WORKERS, rt.admission_probe("intake", false), "intake");
    // Tasks are taken in fair order across tenants (docs/ARCHITECTURE.md "Fairness across
    // tenants"): the tenant is the subject's.
    let feed = FairFeed::open(
        &rt,
        CONSUMER,
        ACK_WAIT,
        fair::window(WORKERS, consumer::max_ack_pending(CONSUMER)),
        |_| Tenancy::Task,
    )
    .await?;
    // Callbacks are answered beside the tasks, and stop with them: when this function returns
    // (a stop, or an error the supervisor restarts it for), `stop` is dropped.
    let callbacks = subscribe_callbacks(&rt).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let answering = tokio::spawn({
        let rt = rt.clone();
        async move {
            let shutdown = async move {
                let _ = stopped.await;
            };
            callbacks
                .run(shutdown, |msg| answer_callback(rt.clone(), msg))
                .await;
        }
    });
    // The light lane, for tenants without a backlog (docs/ARCHITECTURE.md "Fairness
    // across tenants").
    let light = rt.light_lane().await?;
    let light_workers = fair::light_workers(WORKERS);
    if let Some(light) = &light
        && let Some(on) = light.executor()
    {
        let (rt, light, workers) = (rt.clone(), light.clone(), light_workers.clone());
        feed.take_light(on, light_workers.clone(), move |slot, msg| {
            let rt = fair::lane(CONSUMER, Pace::Light, &rt, Some(&light)).clone();
            run_task(&workers, slot, rt, msg);
            std::future::ready(())
        });
    }
    tracing::info!(worker = %rt.config.worker_id, "intake service started");
    tokio::pin!(shutdown);
    loop {
        let (slot, msg, pace) = tokio::select! {
            _ = &mut shutdown => break,
            next = feed.next(&workers) => match next {
                Some(next) => next,
                None => break,
            },
        };
        // A tenant without a backlog has its task handled on the light lane.
        let rt = fair::lane(CONSUMER, pace, &rt, light.as_ref()).clone();
        run_task(&workers, slot, rt, msg);
    }
    feed.hand_back().await;
    workers.drain().await;
    light_workers.drain().await;
    drop(stop);
    let _ = answering.await;
    tracing::info!("intake service stopped");
    Ok(())
}

/// Handles the task `msg` on `slot` with `rt` (the process's runtime, or its light lane's) on
/// that runtime's threads.
fn run_task(workers: &consumer::Workers, slot: consumer::Slot, rt: Runtime, msg: Message) {
    let on = rt.executor().cloned();
    workers.run_on(on.as_ref(), slot, async move {
        // A panic while handling one task (a bug) is contained: the task is handed back
        // (bounded by the consumer's max_deliver; one that panics at its last delivery is a
        // dead letter).
        let seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
        if let Err(panic) = AssertUnwindSafe(handle(&rt, &msg)).catch_unwind().await {
            let reason = kedge_runtime::failpoint::panic_message(panic.as_ref());
            tracing::error!(seq, panic = %reason, "handling a task panicked; handing it back");
            let verdict = Verdict::Retry(format!("panicked: {reason}"), BACKOFF);
            consumer::settle(&rt.js, CONSUMER, &msg, verdict).await;
        }
    });
}

/// Header carrying a callback delivery's id (a webhook's own id), for deduplication.
pub const DELIVERY_ID_HEADER: &str = "Kedge-Delivery-Id";

/// Callbacks handled at once by one intake process (more wait in its subscription).
const CALLBACKS_IN_FLIGHT: usize = 64;

/// Subscribes to callbacks; the returned responder answers them ([`answer_callback`]).
async fn subscribe_callbacks(rt: &Runtime) -> Result<Responder, RuntimeError> {
    let listen = Listen {
        what: "callbacks",
        subject: subjects::CALLBACKS_ALL.to_owned(),
        queue: subjects::CALLBACKS_QUEUE,
        bound: CALLBACKS_IN_FLIGHT,
        busy: Busy::Wait,
    };
    Responder::subscribe(&rt.client, listen).await
}

/// Delivers one callback and answers what became of it.
async fn answer_callback(rt: Runtime, msg: async_nats::Message) {
    let key = subjects::parse_callback(msg.subject.as_str()).unwrap_or_default();
    let payload = serde_json::from_slice(&msg.payload).unwrap_or_else(|_| {
        serde_json::Value::String(String::from_utf8_lossy(&msg.payload).into_owned())
    });
    let delivery_id = header(msg.headers.as_ref(), DELIVERY_ID_HEADER);
    match kedge_app::callbacks::deliver(&rt, key, payload, delivery_id).await {
        Ok(d) => responder::reply(&rt.client, &msg, &d).await,
        Err(e) => {
            tracing::warn!(%key, error = %e, "callback not delivered");
            let answer = serde_json::json!({"status": "error", "reason": e.to_string()});
            responder::reply(&rt.client, &msg, &answer).await;
        }
    }
}

/// Why a task was not accepted now.
enum Refusal {
    /// The task is wrong; it will never be accepted.
    Reject(TaskRejection),
    /// The broker is unavailable; try again later.
    Retry(String),
}

fn header<'a>(headers: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    headers
        .and_then(|h| h.get(name))
        .map(|v| v.as_str())
        .filter(|v| !v.is_empty())
}

async fn handle(rt: &Runtime, msg: &Message) {
    let headers = msg.headers.as_ref();
    let reply_to = header(headers, REPLY_HEADER)
        .filter(|r| {
            let inbox = is_inbox(r, &rt.config);
            if !inbox {
                tracing::warn!(reply_to = %r.chars().take(200).collect::<String>(), "Kedge-Reply-To is not an inbox subject; not answering there");
            }
            inbox
        })
        .map(str::to_owned);
    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
    // Joins the submitter's trace (the task's `traceparent` header), as run.created will.
    let span =
        tracing::info_span!("intake", subject = %msg.subject, run_id = tracing::field::Empty);
    trace::set_parent(&span, header(headers, trace::TRACEPARENT_HEADER));
    let answer = match accept(rt, msg, seq).instrument(span.clone()).await {
        Ok(run_id) => {
            span.record("run_id", tracing::field::display(&run_id));
            tracing::info!(parent: &span, run_id = %run_id, "task accepted");
            Answer::Accepted { run_id }
        }
        Err(Refusal::Reject(rejection)) => {
            tracing::warn!(subject = %msg.subject, field = %rejection.field, reason = %rejection.reason, "task rejected");
            if let Err(e) = record_rejection(rt, msg, &rejection).await
                && !consumer::is_last_delivery(CONSUMER, msg)
            {
                tracing::warn!(error = %e, "could not record the rejection; will retry");
                consumer::settle(
                    &rt.js,
                    CONSUMER,
                    msg,
                    Verdict::Later(Duration::from_secs(1)),
                )
                .await;
                return;
            }
            kedge_runtime::metrics::task_rejected();
            Answer::Rejected { error: rejection }
        }
        Err(Refusal::Retry(reason)) if consumer::is_last_delivery(CONSUMER, msg) => {
            // Never leave a task unanswered: the last try is a rejection that says why.
            let rejection = TaskRejection::new(
                "task",
                format!(
                    "gave up after {} deliveries: {reason}",
                    consumer::deliveries(msg)
                ),
            );
            tracing::error!(subject = %msg.subject, reason = %rejection.reason, "task rejected at its last delivery");
            if let Err(e) = record_rejection(rt, msg, &rejection).await {
                tracing::error!(error = %e, "could not record the rejection");
            }
            kedge_runtime::metrics::task_rejected();
            Answer::Rejected { error: rejection }
        }
        Err(Refusal::Retry(reason)) => {
            consumer::settle(&rt.js, CONSUMER, msg, Verdict::Retry(reason, BACKOFF)).await;
            return;
        }
    };
    if let Some(reply) = reply_to
        && let Ok(body) = serde_json::to_vec(&answer)
        && let Err(e) = rt.client.publish(reply, body.into()).await
    {
        tracing::warn!(error = %e, "could not answer the task");
    }
    if let Err(e) = msg.double_ack().await {
        tracing::warn!(error = %e, "ack failed; the task may be redelivered (harmless)");
    }
}

async fn accept(rt: &Runtime, msg: &Message, seq: u64) -> Result<RunId, Refusal> {
    let headers = msg.headers.as_ref();
    let task = TaskSubmission::parse(&msg.payload).map_err(Refusal::Reject)?;
    let (tenant, revision, def) = agent_for(rt, &msg.subject, &task).await?;
    let key = header(headers, "Nats-Msg-Id").map(str::to_owned);
    // Within the tenant, under the server's key: no tenant can name another's run.
    let ids = rt
        .run_ids()
        .await
        .map_err(|e| Refusal::Retry(e.to_string()))?;
    let run_id = ids.run_of(&tenant, task.run_id.as_ref(), key.as_deref(), seq);
    let mut created = RunCreated {
        agent: task.agent.clone(),
        agent_revision: revision,
        agent_digest: def.digest(),
        model: def.model.clone(),
        prompt_digest: def.prompt_digest(),
        tools_digest: def.tools_digest(),
        policy_digest: def.policy_digest(),
        budget: task
            .budget
            .as_ref()
            .map(|b| b.apply_to(&def.budget))
            .unwrap_or_else(|| def.budget.clone()),
        tenant: tenant.clone(),
        caller: header(headers, CALLER_HEADER).map(str::to_owned),
        idempotency_key: key.clone(),
        input: task.input.clone(),
        runtime_version: env!("CARGO_PKG_VERSION").to_owned(),
        metadata: task.metadata.clone(),
        traceparent: trace::accept(header(headers, trace::TRACEPARENT_HEADER)),
        parent: None,
        // Expanded over the task before any field is sealed (docs/ARCHITECTURE.md "Concurrency
        // keys and priorities").
        concurrency: kedge_core::concurrency::for_task(
            &task,
            def.concurrency.as_ref(),
            def.priority,
            &def.sensitive_task_fields,
        )
        .map_err(Refusal::Reject)?,
    };
    seal_task_fields(rt, &def, &run_id, &mut created)?;
    // The tenant's quotas, once for the fleet (docs/ARCHITECTURE.md "Quotas"): the last check
    // before the run exists. A run the bridge admitted before publishing is admitted again
    // without counting.
    admit(rt, &tenant, &run_id).await?;
    let created = DecisionEnvelope::new(
        run_id.clone(),
        Timestamp::now(),
        Draft::new(Decision::RunCreated(Box::new(created))),
    );
    match rt.journal.create_run(&RunCreator::intake(), &created).await {
        Ok(_) => {
            kedge_runtime::metrics::run_created();
            Ok(run_id)
        }
        Err(JournalError::Duplicate { .. }) => Ok(run_id),
        Err(JournalError::Conflict { .. }) => {
            existing_run(rt, run_id, &tenant, key.as_deref()).await
        }
        Err(e) => Err(journal_refusal(&e)),
    }
}

/// The task's tenant, from its subject, and the agent it names, as its latest revision: refused
/// when the subject and the task disagree, the agent does not exist or is not shared with the
/// tenant, or the task's budget asks for what nothing would count.
async fn agent_for(
    rt: &Runtime,
    subject: &str,
    task: &TaskSubmission,
) -> Result<
    (
        TenantId,
        u64,
        std::sync::Arc<kedge_core::agent::AgentDefinition>,
    ),
    Refusal,
> {
    let TaskSubject {
        agent: subject_agent,
        tenant,
    } = subjects::parse_task(subject)
        .map_err(|e| Refusal::Reject(TaskRejection::new("subject", e.to_string())))?;
    if subject_agent != task.agent {
        return Err(Refusal::Reject(TaskRejection::new(
            "agent",
            format!(
                "the task names agent `{}` but was published for agent `{subject_agent}`",
                task.agent
            ),
        )));
    }
    let no_such_agent = || {
        Refusal::Reject(TaskRejection::new(
            "agent",
            format!("no agent named `{}`", task.agent),
        ))
    };
    let (revision, def) = rt.agents.latest(&task.agent).await.map_err(|e| match e {
        AgentError::NotFound(_) => no_such_agent(),
        AgentError::Unavailable(r) => Refusal::Retry(r),
        other => Refusal::Reject(TaskRejection::new("agent", other.to_string())),
    })?;
    if !def.allows_tenant(&tenant) {
        // To a tenant the agent is not shared with, it does not exist.
        tracing::warn!(agent = %task.agent, %tenant, "task for an agent this tenant may not start");
        return Err(no_such_agent());
    }
    if task.budget.as_ref().is_some_and(|b| b.max_cost.is_some()) && def.model.price.is_none() {
        // A cost limit that nothing would count is refused, not silently ignored.
        return Err(Refusal::Reject(TaskRejection::new(
            "budget.max_cost",
            format!(
                "agent `{}` has no model.price, so the run's cost is not counted",
                task.agent
            ),
        )));
    }
    Ok((tenant, revision, def))
}

/// The answer to a task whose run id is taken: the same task again (same tenant and key) is
/// the same run; otherwise refused, and only the run's own tenant learns that it exists.
async fn existing_run(
    rt: &Runtime,
    run_id: RunId,
    tenant: &TenantId,
    key: Option<&str>,
) -> Result<RunId, Refusal> {
    // The run exists. The same task again (same tenant and key) is the same run.
    // Its run.created (inputs may precede it: anyone may publish on a run id).
    let created = rt
        .journal
        .read_type(&run_id, kedge_core::event::EventType::RunCreated)
        .await
        .map_err(|e| journal_refusal(&e))?;
    match created.first().map(|r| &r.envelope.event) {
        Some(Event::RunCreated(c))
            if c.tenant == *tenant && key.is_some() && c.idempotency_key.as_deref() == key =>
        {
            Ok(run_id)
        }
        // Only the run's own tenant learns that it exists (its chosen run id used again
        // with another key); ids are scoped per tenant, so another tenant's run is here
        // only by a hash collision, or a run's inputs were published before it: refused
        // without a word about it.
        Some(Event::RunCreated(c)) if c.tenant == *tenant => Err(Refusal::Reject(
            TaskRejection::new("run_id", format!("a run with id {run_id} already exists")),
        )),
        _ => Err(Refusal::Reject(TaskRejection::new(
            "task",
            "the run could not be created; submit the task again with another key or run id",
        ))),
    }
}

/// Admits the run under its tenant's quotas, or refuses the task naming the quota (with when
/// to try again); the quotas unavailable is broker trouble, retried.
async fn admit(rt: &Runtime, tenant: &TenantId, run_id: &RunId) -> Result<(), Refusal> {
    let Some(quotas) = rt
        .quotas_if_any()
        .await
        .map_err(|e| Refusal::Retry(e.to_string()))?
    else {
        return Ok(());
    };
    match quotas.admit(tenant, run_id).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(exceeded)) => Err(Refusal::Reject(TaskRejection::quota(&exceeded))),
        Err(e) => Err(Refusal::Retry(e.to_string())),
    }
}

/// What a failed `run.created` append means for the task: broker trouble is retried; anything
/// else (a run that cannot be journaled as given, a broker that refuses it) will not change by
/// retrying and is answered as a rejection naming the reason.
fn journal_refusal(e: &JournalError) -> Refusal {
    match e.kind() {
        ErrorKind::Unavailable => Refusal::Retry(e.to_string()),
        ErrorKind::Conflict
        | ErrorKind::Duplicate
        | ErrorKind::TooOld
        | ErrorKind::Invalid
        | ErrorKind::Other => Refusal::Reject(TaskRejection::new(
            "task",
            format!("the run could not be journaled: {e}"),
        )),
    }
}

/// Whether `subject` is an inbox: under `_INBOX.` or the configured inbox prefix.
fn is_inbox(subject: &str, config: &kedge_runtime::Config) -> bool {
    let valid = !subject.is_empty()
        && subject.len() <= 256
        && !subject.contains(['*', '>', ' ', '\t', '\r', '\n'])
        && !subject.split('.').any(str::is_empty);
    let prefix = config.inbox_prefix();
    valid
        && (subject.starts_with("_INBOX.")
            || (subject.len() > prefix.len()
                && subject.starts_with(prefix)
                && subject.as_bytes().get(prefix.len()) == Some(&b'.')))
}

/// Seals the task fields the agent marks sensitive (`input`, `metadata.<key>`) before the run
/// is journaled ([`kedge_runtime::seal`]). Without the seal key such a task is refused: nothing
/// sensitive is journaled in clear.
fn seal_task_fields(
    rt: &Runtime,
    def: &kedge_core::agent::AgentDefinition,
    run: &RunId,
    created: &mut RunCreated,
) -> Result<(), Refusal> {
    if !def.marks_sensitive() {
        return Ok(());
    }
    let Some(key) = rt.seal.as_ref() else {
        return Err(Refusal::Reject(TaskRejection::new(
            "agent",
            format!(
                "agent `{}` marks values sensitive and this deployment has no seal key \
                 (KEDGE_SEAL_KEY)",
                def.name
            ),
        )));
    };
    for field in &def.sensitive_task_fields {
        if field == "input" {
            created.input = key.seal(run, &serde_json::Value::String(created.input.clone()));
        } else if let Some(k) = field.strip_prefix("metadata.")
            && let Some(v) = created.metadata.get_mut(k)
            && !v.as_str().is_some_and(kedge_runtime::seal::is_sealed)
        {
            *v = serde_json::Value::String(key.seal(run, v));
        }
    }
    Ok(())
}

async fn record_rejection(
    rt: &Runtime,
    msg: &Message,
    rejection: &TaskRejection,
) -> Result<(), String> {
    // The record goes to agent.rejected.<agent> (also for agent.task.<agent>.<tenant>).
    let parsed = subjects::parse_task(&msg.subject).ok();
    let agent = match &parsed {
        Some(task) => task.agent.as_str(),
        None => "invalid",
    };
    // The start of the task, for the operator; not for an agent that marks task fields
    // sensitive (they would be kept here in clear).
    let sensitive = match &parsed {
        Some(task) => rt
            .agents
            .latest(&task.agent)
            .await
            .is_ok_and(|(_, def)| def.marks_sensitive()),
        None => false,
    };
    let task = if sensitive {
        "<withheld: the agent marks task fields sensitive>".into()
    } else {
        String::from_utf8_lossy(&msg.payload[..msg.payload.len().min(4096)])
    };
    let body = serde_json::json!({
        "at": Timestamp::now(),
        "subject": msg.subject.as_str(),
        "msg_id": header(msg.headers.as_ref(), "Nats-Msg-Id"),
        "error": rejection,
        "task": task,
    });
    kedge_runtime::rejections::refused_task(&rt.js, agent, &body).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_broker_trouble_is_retried() {
        let retry = |e: JournalError| matches!(journal_refusal(&e), Refusal::Retry(_));
        assert!(retry(JournalError::Unavailable {
            op: "append",
            reason: "timeout".into()
        }));
        for permanent in [
            JournalError::BadRequest("too big".into()),
            JournalError::Rejected {
                op: "append",
                reason: "maximum payload exceeded".into(),
            },
            JournalError::Invalid {
                seq: 3,
                reason: "x".into(),
            },
            JournalError::TooOld {
                what: "x",
                reason: "y".into(),
            },
        ] {
            match journal_refusal(&permanent) {
                Refusal::Reject(r) => {
                    assert_eq!(r.field, "task");
                    assert!(r.reason.contains(&permanent.to_string()), "{}", r.reason);
                }
                Refusal::Retry(_) => panic!("{permanent} is retried"),
            }
        }
    }

    #[test]
    fn only_inboxes_are_answered() {
        let config = kedge_runtime::Config::default();
        for ok in ["_INBOX.abc", "_INBOX.abc.def"] {
            assert!(is_inbox(ok, &config), "{ok}");
        }
        for bad in [
            "agent.run.run_x.d.run.failed",
            "_INBOX",
            "_INBOX.",
            "_INBOX.a..b",
            "_INBOX.*",
            "_INBOX.>",
            "_INBOXES.x",
            "kedge.tool.resolve",
            "",
        ] {
            assert!(!is_inbox(bad, &config), "{bad}");
        }
    }
}
