//! The tenant gateway: the NATS API of a tenant account.
//!
//! In a secured deployment (`kedge nats-config`, docs/SECURITY.md) each tenant has a NATS account
//! of its own with no JetStream and no view of Kedge's streams. The server maps what a tenant
//! publishes into Kedge's account under `kedge.t.<tenant>.…`, with the tenant's name written by
//! the server's import, and this service (queue group `kedge-gateway`) answers there. So the
//! tenant of every request is the one the server authenticated; nothing the sender writes in a
//! header or body can change it.
//!
//! | the tenant sends (its account) | body | answer |
//! | --- | --- | --- |
//! | `agent.task.<agent>` (a JetStream-style publish, `Nats-Msg-Id` = idempotency key) | the task | a PubAck `{stream, seq, duplicate}` plus `run_id`; or `{"error": {code, description}}` |
//! | `kedge.runs.<run>` | – | the run view (status, waits, usage, result) |
//! | `kedge.runs.<run>.history` | `{"after": N, "limit": M}` | `{"events": […], "more": bool}` |
//! | `kedge.runs.<run>.follow` | `{"after": N}` | one message per public event (header `Kedge-Seq`), then an empty message with `Kedge-End: finished \| timeout \| error`; a run not made yet (its task just acknowledged) is waited for up to [`PENDING_RUN_WAIT`] |
//! | `kedge.runs.<run>.message` | `{"text", "key"?}` | `{"seq", "duplicate"}` |
//! | `kedge.runs.<run>.answer.<question>` | `{"answer"}` | `{"seq", "duplicate"}` |
//! | `kedge.runs.<run>.cancel` | `{"reason"?}` | `{"seq", "duplicate"}` |
//! | `kedge.callback.<key>` (`Kedge-Delivery-Id`) | the payload | the delivery (`{"status": "accepted" …}`) |
//! | `kedge.approve.<approver>.<run>.<approval>` (approvers only) | `{"verdict", "args_digest", "comment"?}` | `{"seq"}` |
//!
//! Refusals are `{"error": {"status": 404 | 409 | 410 | 422 | 429 | 503, "kind", "field"?, "reason"}}`
//! (429: a tenant already has [`MAX_FOLLOWS_PER_TENANT`] follows open on this process);
//! another tenant's run is answered exactly like a run that does not exist. A task is forwarded
//! to `agent.task.<agent>.<tenant>` with `Nats-Msg-Id` `<tenant>/<key>` (so two tenants' keys
//! never collide in the stream's deduplication) and only the headers Kedge sets: a tenant cannot
//! smuggle `Nats-*` or `Kedge-*` headers into Kedge's streams. The approver of a decision is the
//! subject's approver token, which the server lets only that approver publish.
//!
//! The server's `Nats-Request-Info` header (the imports `share` it; the server overwrites any
//! the sender set) is checked when present: its account must be the tenant's.

mod schedules;

use std::future::Future;
use std::time::Duration;

use async_nats::HeaderMap;
use bytes::Bytes;
use futures::StreamExt;
use kedge_app::inputs::{self, Refusal};
use kedge_app::view;
use kedge_core::ids::{ApprovalId, QuestionId, RunId, TenantId};
use kedge_core::subjects::{self, GatewayRequest};
use kedge_core::task::TaskSubmission;
use kedge_runtime::responder::{self, Busy, Listen, Responder};
use kedge_runtime::{Runtime, RuntimeError};
use serde::Deserialize;
use serde_json::{Value, json};
use tracing::Instrument;

/// Queue group of the gateways.
pub const QUEUE: &str = subjects::GATEWAY_QUEUE;
/// Requests one gateway process handles at once (follows included).
pub const MAX_IN_FLIGHT: usize = 1024;
/// How long one follow request streams before it ends with `Kedge-End: timeout` (the client
/// asks again from its last `Kedge-Seq`). Under the server's default response threshold.
pub const FOLLOW_FOR: Duration = Duration::from_secs(60);

/// How long a follow waits for a run not made yet (its task just acknowledged) before it is
/// refused as not found (see `owned_or_pending`).
pub const PENDING_RUN_WAIT: Duration = Duration::from_secs(3);

/// Follows one tenant may have open on one gateway process at once (each holds a request slot
/// for up to [`FOLLOW_FOR`]): one tenant cannot take every slot from the others.
pub const MAX_FOLLOWS_PER_TENANT: usize = 64;
/// Largest page of `history`.
pub const MAX_PAGE: usize = 1000;
/// Header carrying an event's journal sequence in a follow.
pub const SEQ_HEADER: &str = "Kedge-Seq";
/// Header of the message that ends a follow.
pub const END_HEADER: &str = "Kedge-End";

/// Runs the gateway until `shutdown` resolves.
pub async fn run(rt: Runtime, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
    let listen = Listen {
        what: "tenant requests",
        subject: subjects::gateway_requests(),
        queue: QUEUE,
        bound: MAX_IN_FLIGHT,
        busy: Busy::Refuse(refuse_busy),
    };
    let requests = Responder::subscribe(&rt.client, listen).await?;
    tracing::info!(worker = %rt.config.worker_id, "tenant gateway started");
    requests
        .run(shutdown, |msg| {
            let rt = rt.clone();
            async move { handle(&rt, msg).await }
        })
        .await;
    tracing::info!("tenant gateway stopped");
    Ok(())
}

/// Answers a request that finds every slot of this gateway taken: 503, retry.
fn refuse_busy(client: &async_nats::Client, msg: async_nats::Message) {
    let client = client.clone();
    tokio::spawn(async move {
        let body = error_body(503, "unavailable", None, "the gateway is busy; retry");
        responder::reply(&client, &msg, &body).await;
    });
}

/// The part of the server's `Nats-Request-Info` the gateway reads.
#[derive(Debug, Deserialize)]
struct RequestInfo {
    #[serde(default)]
    acc: Option<String>,
    #[serde(default)]
    user: Option<String>,
}

fn header<'a>(headers: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    headers
        .and_then(|h| h.get(name))
        .map(|v| v.as_str())
        .filter(|v| !v.is_empty())
}

async fn handle(rt: &Runtime, msg: async_nats::Message) {
    let (tenant, request) = match subjects::parse_gateway(msg.subject.as_str()) {
        Ok(p) => p,
        Err(reason) => {
            tracing::warn!(subject = %msg.subject, %reason, "malformed gateway request");
            reply_error(rt, &msg, 400, "invalid", Some("subject"), &reason).await;
            return;
        }
    };
    let info: Option<RequestInfo> = header(msg.headers.as_ref(), "Nats-Request-Info")
        .and_then(|h| serde_json::from_str(h).ok());
    if let Some(acc) = info.as_ref().and_then(|i| i.acc.as_deref())
        && acc != kedge_runtime::secure::tenant_account(&tenant)
    {
        tracing::warn!(%tenant, account = %acc, "gateway request from another account; refused");
        reply_error(
            rt,
            &msg,
            403,
            "forbidden",
            None,
            "not this tenant's account",
        )
        .await;
        return;
    }
    let user = info.and_then(|i| i.user);
    let span = tracing::info_span!("gateway", %tenant, request = ?request);
    dispatch(rt, &msg, &tenant, request, user.as_deref())
        .instrument(span)
        .await;
}

async fn dispatch(
    rt: &Runtime,
    msg: &async_nats::Message,
    tenant: &TenantId,
    request: GatewayRequest,
    user: Option<&str>,
) {
    let result = match request {
        GatewayRequest::Task { agent } => return task(rt, msg, tenant, &agent, user).await,
        GatewayRequest::Follow { run } => return follow(rt, msg, tenant, &run).await,
        GatewayRequest::Schedule { verb, name } => {
            return schedules::handle(rt, msg, tenant, verb, name).await;
        }
        GatewayRequest::Get { run } => get(rt, tenant, &run).await,
        GatewayRequest::History { run } => history(rt, tenant, &run, &msg.payload).await,
        GatewayRequest::Message { run } => message(rt, tenant, &run, &msg.payload).await,
        GatewayRequest::Answer { run, question } => {
            answer(rt, tenant, &run, &question, &msg.payload).await
        }
        GatewayRequest::Cancel { run } => cancel(rt, tenant, &run, &msg.payload, user).await,
        GatewayRequest::Callback { key } => {
            let delivery = header(msg.headers.as_ref(), "Kedge-Delivery-Id");
            callback(rt, tenant, &key, &msg.payload, delivery).await
        }
        GatewayRequest::Approve {
            approver,
            run,
            approval,
        } => approve(rt, tenant, &approver, user, &run, approval, &msg.payload).await,
    };
    match result {
        Ok(body) => reply(rt, msg, &body).await,
        Err(r) => {
            tracing::info!(refusal = %r, "gateway request refused");
            let (kind, field) = refusal_parts(&r);
            reply_error(rt, msg, r.status(), kind, field, &r.to_string()).await;
        }
    }
}

fn refusal_parts(r: &Refusal) -> (&'static str, Option<&'static str>) {
    match r {
        Refusal::NotFound { field, .. } => ("not_found", *field),
        Refusal::Conflict { code, field, .. } => (code, *field),
        Refusal::Invalid { field, .. } => ("invalid", Some(field)),
        Refusal::Gone { field, .. } => ("gone", Some(field)),
        Refusal::Unavailable { .. } => ("unavailable", None),
        Refusal::Internal { .. } => ("internal", None),
    }
}

async fn reply(rt: &Runtime, msg: &async_nats::Message, body: &Value) {
    responder::reply(&rt.client, msg, body).await;
}

async fn reply_error(
    rt: &Runtime,
    msg: &async_nats::Message,
    status: u16,
    kind: &str,
    field: Option<&str>,
    reason: &str,
) {
    reply(rt, msg, &error_body(status, kind, field, reason)).await;
}

/// The answer of a refused request: `{"error": {"status", "kind", "reason"[, "field"]}}`.
fn error_body(status: u16, kind: &str, field: Option<&str>, reason: &str) -> Value {
    let mut error = json!({"status": status, "kind": kind, "reason": reason});
    if let Some(f) = field {
        error["field"] = json!(f);
    }
    json!({ "error": error })
}

/// A request body: empty means `{}`; anything else must be a JSON object of the given shape.
fn body<T: serde::de::DeserializeOwned>(payload: &[u8]) -> Result<T, Refusal> {
    let payload: &[u8] = if payload.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        payload
    };
    serde_json::from_slice(payload).map_err(|e| Refusal::Invalid {
        field: "body",
        reason: e.to_string(),
    })
}

/// Forwards a task into `KEDGE_TASKS` for this tenant and answers with the stream's ack and the
/// run id the task will have.
async fn task(
    rt: &Runtime,
    msg: &async_nats::Message,
    tenant: &TenantId,
    agent: &kedge_core::ids::AgentName,
    user: Option<&str>,
) {
    // A JetStream client reads `{"error": {code, description}}` as a failed publish.
    let refuse = |code: u16, description: String| json!({"error": {"code": code, "description": description}});
    let task = match TaskSubmission::parse(&msg.payload) {
        Ok(t) => t,
        Err(r) => {
            return reply(
                rt,
                msg,
                &refuse(400, format!("task rejected: {}: {}", r.field, r.reason)),
            )
            .await;
        }
    };
    if task.agent != *agent {
        let why = format!(
            "task rejected: agent: the task names agent `{}` but was published to {}",
            task.agent,
            subjects::task(agent)
        );
        return reply(rt, msg, &refuse(400, why)).await;
    }
    let key = header(msg.headers.as_ref(), "Nats-Msg-Id");
    if let Some(k) = key
        && (k.len() > 200 || !k.chars().all(|c| c.is_ascii_graphic()))
    {
        let why = "task rejected: Nats-Msg-Id: at most 200 printable ASCII characters".to_owned();
        return reply(rt, msg, &refuse(400, why)).await;
    }
    let msg_id = key.map(|k| format!("{tenant}/{k}"));
    let mut headers = HeaderMap::new();
    if let Some(id) = &msg_id {
        headers.insert("Nats-Msg-Id", id.as_str());
    }
    if let Some(u) = user {
        headers.insert(
            kedge_app::tasks::CALLER_HEADER,
            format!("{tenant}/{u}").as_str(),
        );
    }
    // The run id the task will have, made as intake makes it (docs/SECURITY.md, "Run ids").
    let ids = match rt.run_ids().await {
        Ok(ids) => ids,
        Err(e) => {
            tracing::warn!(error = %e, "cannot derive run ids");
            return reply(
                rt,
                msg,
                &refuse(503, "the task was not stored: try again".into()),
            )
            .await;
        }
    };
    // The tenant's quotas (docs/ARCHITECTURE.md "Quotas"): a task with a key admits its run
    // now (intake admits it again without counting); one without is checked, and intake
    // decides. Refused: the JetStream error names the quota, and the task is not stored.
    if let Some(refused) = quota_refusal(rt, tenant, &ids, &task, msg_id.as_deref()).await {
        return reply(rt, msg, &refuse(refused.0, refused.1)).await;
    }
    let subject = subjects::task_for(agent, tenant);
    let ack = match rt
        .js
        .publish_with_headers(subject, headers, msg.payload.clone())
        .await
    {
        Ok(pending) => pending.await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let answer = match ack {
        Ok(ack) => {
            let run_id = ids.run_of(
                tenant,
                task.run_id.as_ref(),
                msg_id.as_deref(),
                ack.sequence,
            );
            tracing::info!(run_id = %run_id, seq = ack.sequence, duplicate = ack.duplicate, "task forwarded");
            json!({
                "stream": ack.stream,
                "seq": ack.sequence,
                "duplicate": ack.duplicate,
                "run_id": run_id,
            })
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot forward a task");
            refuse(503, format!("the task was not stored: {e}"))
        }
    };
    reply(rt, msg, &answer).await;
}

/// Why the tenant's quotas refuse its task now (the code and description of the JetStream
/// error answered), if they do.
async fn quota_refusal(
    rt: &Runtime,
    tenant: &TenantId,
    ids: &kedge_runtime::run_ids::RunIdKey,
    task: &TaskSubmission,
    msg_id: Option<&str>,
) -> Option<(u16, String)> {
    let quotas = match rt.quotas_if_any().await {
        Ok(None) => return None,
        Ok(Some(q)) => q,
        Err(e) => return Some((503, format!("the task was not stored: {e}"))),
    };
    let decided = match msg_id {
        Some(key) => {
            let run = ids.run_of(tenant, task.run_id.as_ref(), Some(key), 0);
            quotas.admit(tenant, &run).await
        }
        None => quotas.check(tenant).await,
    };
    match decided {
        Ok(Ok(())) => None,
        Ok(Err(e)) => {
            let r = kedge_core::task::TaskRejection::quota(&e);
            Some((429, format!("task rejected: {}: {}", r.field, r.reason)))
        }
        Err(e) => Some((503, format!("the task was not stored: {e}"))),
    }
}

async fn get(rt: &Runtime, tenant: &TenantId, run: &RunId) -> Result<Value, Refusal> {
    let events = inputs::owned_run(rt, tenant, run).await?;
    let state = inputs::state_of(run, &events)?;
    let mut v = view::run_view(&state, &events);
    view::add_children(&rt.journal, &state, &mut v).await;
    serde_json::to_value(v).map_err(|e| Refusal::Internal {
        reason: e.to_string(),
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Page {
    #[serde(default)]
    after: u64,
    #[serde(default)]
    limit: Option<usize>,
}

async fn history(
    rt: &Runtime,
    tenant: &TenantId,
    run: &RunId,
    payload: &[u8],
) -> Result<Value, Refusal> {
    let page: Page = body(payload)?;
    let limit = page.limit.unwrap_or(100).clamp(1, MAX_PAGE);
    // A page costs a page, not the run's whole journal.
    inputs::check_tenant(rt, tenant, run).await?;
    let (public, more) = inputs::public_page(rt, run, page.after, limit).await?;
    let listed: Vec<Value> = public.iter().map(view::event_json).collect();
    Ok(json!({ "run_id": run, "events": listed, "more": more }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FollowFrom {
    #[serde(default)]
    after: u64,
}

/// Streams the run's public events after `after` to the reply subject, live, until the run has
/// finished or [`FOLLOW_FOR`] passed; then an end message.
/// Open follows per tenant in this process.
fn follows() -> &'static std::sync::Mutex<std::collections::HashMap<TenantId, usize>> {
    static FOLLOWS: std::sync::OnceLock<
        std::sync::Mutex<std::collections::HashMap<TenantId, usize>>,
    > = std::sync::OnceLock::new();
    FOLLOWS.get_or_init(Default::default)
}

/// One of a tenant's open follows; given back when dropped.
struct FollowSlot(TenantId);

impl FollowSlot {
    fn take(tenant: &TenantId) -> Option<FollowSlot> {
        let mut open = follows().lock().ok()?;
        let n = open.entry(tenant.clone()).or_insert(0);
        if *n >= MAX_FOLLOWS_PER_TENANT {
            return None;
        }
        *n += 1;
        Some(FollowSlot(tenant.clone()))
    }
}

impl Drop for FollowSlot {
    fn drop(&mut self) {
        if let Ok(mut open) = follows().lock()
            && let Some(n) = open.get_mut(&self.0)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.0);
            }
        }
    }
}

/// The tenant's run's events for a follow, waiting up to [`PENDING_RUN_WAIT`] for a run that is
/// not there yet: the answer to `agent.task.<agent>` says the task is stored, and intake makes
/// its run a moment later, so a client that follows the run at once may be early. The run's
/// first message ends the wait (it is read again then, once). Not found only after the whole
/// wait, whatever the reason (no such run, another tenant's, intake refused the task): how long
/// a refusal takes says nothing about another tenant's runs.
async fn owned_or_pending(
    rt: &Runtime,
    tenant: &TenantId,
    run: &RunId,
) -> Result<Vec<kedge_journal::Recorded>, Refusal> {
    let deadline = tokio::time::Instant::now() + PENDING_RUN_WAIT;
    let refusal = match inputs::owned_run(rt, tenant, run).await {
        Err(r @ Refusal::NotFound { .. }) => r,
        found => return found,
    };
    let mut tail = Box::pin(rt.journal.tail(run, 0));
    let appeared = tokio::time::timeout_at(deadline, async {
        loop {
            match tail.next().await {
                Some(Ok(_)) => return true,
                // Broker trouble: the tail recreates itself and goes on.
                Some(Err(e)) => tracing::debug!(error = %e, "follow: waiting for the run"),
                None => return false,
            }
        }
    })
    .await;
    drop(tail);
    if appeared == Ok(true) {
        match inputs::owned_run(rt, tenant, run).await {
            Err(Refusal::NotFound { .. }) => {}
            found => return found,
        }
    }
    tokio::time::sleep_until(deadline).await;
    Err(refusal)
}

async fn follow(rt: &Runtime, msg: &async_nats::Message, tenant: &TenantId, run: &RunId) {
    let Some(to) = msg.reply.clone() else { return };
    let Some(_slot) = FollowSlot::take(tenant) else {
        let why = format!(
            "tenant {tenant} has {MAX_FOLLOWS_PER_TENANT} follows open on this gateway; close one \
             or retry"
        );
        return reply_error(rt, msg, 429, "quota_exceeded", None, &why).await;
    };
    let from: FollowFrom = match body(&msg.payload) {
        Ok(f) => f,
        Err(r) => {
            return reply_error(rt, msg, r.status(), "invalid", Some("body"), &r.to_string()).await;
        }
    };
    let mut events = match owned_or_pending(rt, tenant, run).await {
        Ok(e) => e,
        Err(r) => {
            let (kind, field) = refusal_parts(&r);
            return reply_error(rt, msg, r.status(), kind, field, &r.to_string()).await;
        }
    };
    let send = |r: &kedge_journal::Recorded| {
        let mut h = HeaderMap::new();
        h.insert(SEQ_HEADER, r.seq.to_string().as_str());
        let bytes: Bytes = serde_json::to_vec(&view::event_json(r))
            .unwrap_or_default()
            .into();
        rt.client.publish_with_headers(to.clone(), h, bytes)
    };
    let end = |why: &str| {
        let mut h = HeaderMap::new();
        h.insert(END_HEADER, why);
        rt.client.publish_with_headers(to.clone(), h, Bytes::new())
    };
    for r in events.iter().filter(|r| r.seq > from.after) {
        if view::is_public(r.envelope.event_type()) && send(r).await.is_err() {
            return;
        }
    }
    let finished = |events: &[kedge_journal::Recorded]| {
        inputs::state_of(run, events).is_ok_and(|s| view::finished(&s))
    };
    if finished(&events) {
        let _ = end("finished").await;
        return;
    }
    let last = events.last().map(|r| r.seq).unwrap_or(0).max(from.after);
    let mut tail = Box::pin(rt.journal.tail(run, last));
    let deadline = tokio::time::sleep(FOLLOW_FOR);
    tokio::pin!(deadline);
    loop {
        let next = tokio::select! {
            _ = &mut deadline => { let _ = end("timeout").await; return; }
            next = tail.next() => next,
        };
        match next {
            Some(Ok(r)) => {
                if view::is_public(r.envelope.event_type()) && send(&r).await.is_err() {
                    return;
                }
                let decision = r.envelope.event_type().kind() == kedge_core::EventKind::Decision;
                events.push(r);
                if decision && finished(&events) {
                    let _ = end("finished").await;
                    return;
                }
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "follow: journal trouble (the tail goes on)");
            }
            None => {
                let _ = end("error").await;
                return;
            }
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MessageBody {
    text: String,
    #[serde(default)]
    key: Option<String>,
}

async fn message(
    rt: &Runtime,
    tenant: &TenantId,
    run: &RunId,
    payload: &[u8],
) -> Result<Value, Refusal> {
    let m: MessageBody = body(payload)?;
    if let Some(k) = &m.key
        && (k.is_empty() || k.len() > 200 || !k.chars().all(|c| c.is_ascii_graphic()))
    {
        return Err(Refusal::Invalid {
            field: "key",
            reason: "1-200 printable ASCII characters".into(),
        });
    }
    let events = inputs::owned_run(rt, tenant, run).await?;
    let done = inputs::message(rt, run, &events, m.text, m.key.as_deref()).await?;
    Ok(json!({ "run_id": run, "seq": done.seq, "duplicate": done.duplicate }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AnswerBody {
    answer: String,
}

async fn answer(
    rt: &Runtime,
    tenant: &TenantId,
    run: &RunId,
    question: &QuestionId,
    payload: &[u8],
) -> Result<Value, Refusal> {
    let a: AnswerBody = body(payload)?;
    let events = inputs::owned_run(rt, tenant, run).await?;
    let done = inputs::answer(rt, run, &events, question, a.answer).await?;
    Ok(
        json!({ "run_id": run, "question_id": question, "seq": done.seq, "duplicate": done.duplicate }),
    )
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    #[serde(default)]
    reason: Option<String>,
}

async fn cancel(
    rt: &Runtime,
    tenant: &TenantId,
    run: &RunId,
    payload: &[u8],
    user: Option<&str>,
) -> Result<Value, Refusal> {
    let c: CancelBody = body(payload)?;
    let events = inputs::owned_run(rt, tenant, run).await?;
    let reason = c.reason.unwrap_or_else(|| "cancelled over NATS".into());
    let by = Some(match user {
        Some(u) => format!("{tenant}/{u}"),
        None => tenant.to_string(),
    });
    let done = inputs::cancel(rt, run, &events, reason, by).await?;
    Ok(json!({ "run_id": run, "seq": done.seq, "duplicate": done.duplicate }))
}

async fn callback(
    rt: &Runtime,
    tenant: &TenantId,
    key: &str,
    payload: &[u8],
    delivery_id: Option<&str>,
) -> Result<Value, Refusal> {
    let payload: Value = if payload.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(payload)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(payload).into_owned()))
    };
    let delivery = inputs::callback(rt, tenant, key, payload, delivery_id).await?;
    serde_json::to_value(&delivery).map_err(|e| Refusal::Internal {
        reason: e.to_string(),
    })
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DecisionBody {
    verdict: kedge_core::event::Verdict,
    args_digest: kedge_core::event::Digest,
    #[serde(default)]
    comment: Option<String>,
}

async fn approve(
    rt: &Runtime,
    tenant: &TenantId,
    approver: &str,
    user: Option<&str>,
    run: &RunId,
    approval: ApprovalId,
    payload: &[u8],
) -> Result<Value, Refusal> {
    // The server lets only approver `<name>` publish `kedge.approve.<name>.>`; a password user's
    // login is that name too, which the server's request info confirms.
    let is_nkey = |u: &str| u.len() == 56 && u.starts_with('U');
    if let Some(u) = user
        && !is_nkey(u)
        && u != approver
    {
        tracing::warn!(%approver, user = %u, "approval decision under another approver's name");
        return Err(Refusal::NotFound {
            field: Some("approver"),
            reason: format!("no approver {approver} here"),
        });
    }
    let d: DecisionBody = body(payload)?;
    inputs::owned_run(rt, tenant, run).await?;
    let request = kedge_app::approvals::DecisionRequest {
        approval_id: approval.clone(),
        verdict: d.verdict,
        args_digest: d.args_digest,
        comment: d.comment,
    };
    let seq = inputs::approve(rt, run, &format!("{tenant}/{approver}"), request).await?;
    Ok(json!({ "run_id": run, "approval_id": approval, "seq": seq }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_are_capped_per_tenant_and_given_back() {
        let acme: TenantId = "acme-follow-test".parse().expect("tenant");
        let other: TenantId = "other-follow-test".parse().expect("tenant");
        let held: Vec<FollowSlot> = (0..MAX_FOLLOWS_PER_TENANT)
            .map(|_| FollowSlot::take(&acme).expect("under the cap"))
            .collect();
        assert!(FollowSlot::take(&acme).is_none(), "over the cap");
        assert!(
            FollowSlot::take(&other).is_some(),
            "another tenant is not affected"
        );
        drop(held);
        assert!(FollowSlot::take(&acme).is_some(), "slots come back");
    }
}
