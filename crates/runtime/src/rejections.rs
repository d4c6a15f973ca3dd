//! The owner of `KEDGE_REJECTIONS`: what Kedge sets aside is recorded here, and read back here
//! (docs/RUNBOOK.md shows the `nats` recipes for the same records). Four kinds, each on its own
//! subject of the layout's registry (`kedge_core::subjects`), the stream bounded by its limits
//! (`nats/streams/KEDGE_REJECTIONS.json`):
//!
//! - a task intake refused: `agent.rejected.<agent>` ([`refused_task`]);
//! - a callback for a key no run waits on: `agent.rejected.callback` ([`unknown_callback`]);
//! - a message on a run's subjects that is not an event of the run, found by the step:
//!   `agent.rejected.journal.<run>.<seq>` ([`set_aside`], once per message);
//! - a message a consumer gave up on (its `max_deliver` reached, or poison): a dead letter,
//!   `agent.rejected.dead.<consumer>` ([`dead_letter`], read back by [`dead_letters`]).

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::stream::DirectGetErrorKind;
use kedge_core::RunId;
use kedge_core::subjects::{self, Durable, REJECTIONS_STREAM};
use kedge_journal::SetAside;

use crate::consumer::deliveries;

/// How much of a message's body a record keeps.
const KEPT_BODY: usize = 4096;

/// Publishes one record and waits for the stream to store it.
async fn record(
    js: &Context,
    subject: String,
    headers: Option<HeaderMap>,
    body: &serde_json::Value,
) -> Result<(), String> {
    let payload = body.to_string().into();
    let ack = match headers {
        Some(h) => js.publish_with_headers(subject, h, payload).await,
        None => js.publish(subject, payload).await,
    }
    .map_err(|e| e.to_string())?;
    ack.await.map(|_| ()).map_err(|e| e.to_string())
}

/// Records a task intake refused, under its agent's subject (`invalid` when the task's subject
/// names none).
pub async fn refused_task(
    js: &Context,
    agent: &str,
    body: &serde_json::Value,
) -> Result<(), String> {
    record(js, subjects::rejected_task(agent), None, body).await
}

/// Records a callback for a key no run waits on.
pub async fn unknown_callback(js: &Context, body: &serde_json::Value) -> Result<(), String> {
    record(js, subjects::REJECTED_CALLBACK.to_owned(), None, body).await
}

/// Records a message on run `run`'s subjects that is not an event of the run, once: a record
/// already there is not written again (looked up first, and `Nats-Msg-Id`
/// `journal:<run>:<seq>` within the duplicate window). Whether it was recorded now.
pub async fn set_aside(js: &Context, run: &RunId, a: &SetAside) -> Result<bool, String> {
    let subject = subjects::rejected_journal(run, a.seq);
    let stream = js
        .get_stream_no_info(REJECTIONS_STREAM)
        .await
        .map_err(|e| e.to_string())?;
    if stream.direct_get_last_for_subject(&subject).await.is_ok() {
        return Ok(false);
    }
    tracing::warn!(run_id = %run, seq = a.seq, subject = %a.subject, reason = %a.reason, "journal message set aside");
    let body = serde_json::json!({
        "at": kedge_core::event::Timestamp::now(),
        "run_id": run,
        "seq": a.seq,
        "subject": a.subject,
        "kind": a.kind,
        "reason": a.reason,
    });
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", format!("journal:{run}:{}", a.seq).as_str());
    record(js, subject, Some(headers), &body).await?;
    Ok(true)
}

/// Gives up on `msg`: records it on its dead-letter subject (its stream, sequence, subject,
/// deliveries, the reason and the start of its body; `Nats-Msg-Id` `dead:<consumer>:<stream
/// seq>`, so a repeat is stored once), logs at error and terminates it. A record that cannot be
/// written is logged too; the message is terminated anyway (the consumer would not deliver it
/// again).
pub async fn dead_letter(
    js: &Context,
    consumer: Durable,
    msg: &async_nats::jetstream::Message,
    reason: &str,
) {
    let (stream, seq) = msg
        .info()
        .map(|i| (i.stream.to_owned(), i.stream_sequence))
        .unwrap_or_default();
    let delivered = deliveries(msg);
    crate::metrics::dead_letter(consumer);
    tracing::error!(
        %consumer,
        stream = %stream,
        seq,
        subject = %msg.subject,
        delivered,
        reason,
        "giving up on a message; recorded as a dead letter"
    );
    let body = serde_json::json!({
        "at": kedge_core::event::Timestamp::now(),
        "consumer": consumer.name(),
        "stream": stream,
        "seq": seq,
        "subject": msg.subject.as_str(),
        "deliveries": delivered,
        "reason": reason,
        "body": String::from_utf8_lossy(&msg.payload[..msg.payload.len().min(KEPT_BODY)]),
    });
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", format!("dead:{consumer}:{seq}").as_str());
    let recorded = record(js, subjects::dead_letter(consumer), Some(headers), &body).await;
    if let Err(e) = recorded {
        tracing::error!(%consumer, seq, error = %e, "could not record the dead letter");
    }
    if let Err(e) = msg.ack_with(async_nats::jetstream::AckKind::Term).await {
        tracing::warn!(%consumer, seq, error = %e, "could not terminate the dead letter");
    }
}

/// Every dead letter kept, as (stream sequence, record); a record that does not parse is
/// `{"unreadable": true}`.
pub async fn dead_letters(js: &Context) -> Result<Vec<(u64, serde_json::Value)>, String> {
    let stream = js
        .get_stream_no_info(REJECTIONS_STREAM)
        .await
        .map_err(|e| format!("open {REJECTIONS_STREAM}: {e}"))?;
    let mut out = Vec::new();
    let mut from = 1;
    loop {
        match stream
            .direct_get_next_for_subject(subjects::DEAD_LETTERS_ALL, Some(from))
            .await
        {
            Ok(m) => {
                let record = serde_json::from_slice(&m.payload)
                    .unwrap_or_else(|_| serde_json::json!({"unreadable": true}));
                out.push((m.sequence, record));
                from = m.sequence + 1;
            }
            Err(e) if e.kind() == DirectGetErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(format!("read dead letters: {e}")),
        }
    }
}
