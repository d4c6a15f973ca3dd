//! External callbacks: delivering an event for a correlation key into its run's journal.
//!
//! A key made by `CallbackKey::for_operation` names its run and operation, so any ingress (the
//! NATS responder on `agent.callback.<key>` in the intake service, the bridge's
//! `POST /v1/callbacks/{key}`) delivers through [`deliver`]:
//!
//! - a key whose run exists and is still waiting (or not yet waiting: an **early** callback is
//!   journaled and matched when the run starts waiting) → `callback.received` is journaled, its
//!   `Nats-Msg-Id` derived from the key and the caller's delivery id (or the payload digest), so
//!   a redelivered callback is stored once; the fold takes the first payload per key;
//! - a key that already has its payload → `Duplicate`, nothing journaled (also after the run
//!   ended: the sender's retry succeeds);
//! - a key whose deadline passed, or whose run ended → refused (`Expired` / `Closed`);
//! - a key that names no run → recorded on `agent.rejected.callback` (stream
//!   `KEDGE_REJECTIONS`) with its payload, never lost, and answered `UnknownKey`.

use kedge_core::Input;
use kedge_core::InputEnvelope;
use kedge_core::event::{CallbackReceived, Digest, Draft, Timestamp};
use kedge_core::ids::{CallbackKey, RunId};
use kedge_core::subjects;
use kedge_journal::JournalError;
use kedge_runtime::Runtime;
use serde::Serialize;

/// What became of a delivered callback.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Delivery {
    /// Journaled; the waiting operation has its result.
    Accepted { run_id: RunId, seq: u64 },
    /// Journaled before the run started waiting; it is matched when it does.
    Early { run_id: RunId, seq: u64 },
    /// The key already has its payload; nothing changed.
    Duplicate { run_id: RunId },
    /// The key's deadline has passed; refused.
    Expired {
        run_id: RunId,
        expires_at: Timestamp,
    },
    /// The run has ended; refused.
    Closed { run_id: RunId },
    /// No run has this key; recorded on `agent.rejected.callback`.
    UnknownKey { recorded: bool },
}

#[derive(Debug, thiserror::Error)]
pub enum CallbackError {
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error("the run's journal does not fold: {0}")]
    Fold(#[from] kedge_core::FoldError),
    #[error("cannot record the unknown callback: {0}")]
    Record(String),
}

/// Delivers `payload` for `key`. `delivery_id` identifies the caller's delivery (a webhook id);
/// without one the payload's digest does.
pub async fn deliver(
    rt: &Runtime,
    key: &str,
    payload: serde_json::Value,
    delivery_id: Option<&str>,
) -> Result<Delivery, CallbackError> {
    let parsed = key
        .parse::<CallbackKey>()
        .ok()
        .and_then(|k| k.operation().map(|op| (k, op)));
    let Some((key, op)) = parsed else {
        return record_unknown(rt, key, &payload).await;
    };
    let run = op.run().clone();
    let events = rt.journal.read(&run, 0).await?;
    if events.is_empty() {
        return record_unknown(rt, key.as_str(), &payload).await;
    }
    let state = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope)))?;
    let cb = state.callbacks.get(&key);
    // A repeat of a delivery that counted is a duplicate, also once the run has moved on or
    // ended: a sender retrying a webhook it already delivered gets a success, not an error.
    if cb.is_some_and(|c| !c.received.is_empty()) {
        return Ok(Delivery::Duplicate { run_id: run });
    }
    if state.status.is_terminal() {
        return Ok(Delivery::Closed { run_id: run });
    }
    let now = Timestamp::now();
    if let Some(expires_at) = cb.and_then(|c| c.expires_at)
        && now > expires_at
    {
        return Ok(Delivery::Expired {
            run_id: run,
            expires_at,
        });
    }
    let expected = cb.is_some_and(|c| c.expected);
    let input = InputEnvelope::new(
        run.clone(),
        now,
        Draft::new(Input::CallbackReceived(CallbackReceived {
            key: key.clone(),
            payload: payload.clone(),
        })),
    );
    let id = match delivery_id {
        Some(id) => id.to_owned(),
        None => Digest::of_json(&payload).as_str().to_owned(),
    };
    let appended = rt
        .journal
        .append_input(&crate::inputs::InputId::callback(&key, &id), &input)
        .await?;
    if appended.duplicate {
        return Ok(Delivery::Duplicate { run_id: run });
    }
    let seq = appended.seq;
    Ok(if expected {
        Delivery::Accepted { run_id: run, seq }
    } else {
        Delivery::Early { run_id: run, seq }
    })
}

/// How much of an unknown callback's payload (as JSON text) is recorded.
pub const MAX_RECORDED_PAYLOAD: usize = 4096;

async fn record_unknown(
    rt: &Runtime,
    key: &str,
    payload: &serde_json::Value,
) -> Result<Delivery, CallbackError> {
    // Anyone may send callbacks for made-up keys: the record keeps the start of the payload,
    // never megabytes (and the stream itself is bounded, nats/streams/KEDGE_REJECTIONS.json).
    let text = payload.to_string();
    let kept: String = text.chars().take(MAX_RECORDED_PAYLOAD).collect();
    let body = serde_json::json!({
        "at": Timestamp::now(),
        "kind": "callback",
        "key": key.chars().take(256).collect::<String>(),
        "reason": "no run has this correlation key",
        "payload": kept,
        "payload_bytes": text.len(),
        "truncated": kept.len() < text.len(),
    });
    kedge_runtime::rejections::unknown_callback(&rt.js, &body)
        .await
        .map_err(CallbackError::Record)?;
    tracing::warn!(%key, subject = subjects::REJECTED_CALLBACK, "callback for an unknown key recorded");
    Ok(Delivery::UnknownKey { recorded: true })
}
