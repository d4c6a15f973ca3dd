//! The step service: the single decision writer of each run.
//!
//! Driven by the journal's own events through the durable pull consumer `step` (a run's
//! `run.created` and every input wake it; there is no separate wake queue and no polling). For a
//! woken run it takes the run's lease, folds the journal, and loops on
//! [`kedge_core::decide`] until the run is idle:
//!
//! - `Commit(decisions)`: append them with the optimistic-concurrency check;
//! - `Step(plan)`: journal `step.started` (intent before effect), call the model while renewing
//!   the lease (a lost renewal aborts the call), store the response in `kedge_idempotency` the
//!   moment it returns, then commit the step's decisions as one atomic group. A plan that names
//!   an unfinished earlier attempt first looks for that attempt's stored response and reuses it,
//!   so a worker killed after the model answered costs no second call.
//!
//! Wakes for a run this process is already driving are folded into the running drive (it reads
//! the journal again before letting go), so a burst of inputs costs one drive, not one each.
//! A wake for a run whose lease another worker holds is handed back with a short delay.

mod drive;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::AckKind;
use futures::StreamExt;
use kedge_core::ids::RunId;
use kedge_model::ModelClient;
use kedge_runtime::{Runtime, RuntimeError, consumer};

pub use drive::{DriveError, Outcome};

/// Redelivery delay of a wake whose run is leased by another worker.
const BUSY_DELAY: Duration = Duration::from_millis(250);

/// Per-run bookkeeping of this process: whether more wakes arrived during the drive.
type Active = Arc<Mutex<HashMap<RunId, bool>>>;

/// Forwards `cancel.requested` inputs as they are published (core NATS sees every journal
/// message) so that in-flight model calls of cancelled runs are aborted at once. Best effort: a
/// missed notification only means the call runs to its end, and the commit after it still sees
/// the cancel in the journal.
async fn watch_cancels(
    rt: &Runtime,
    tx: tokio::sync::broadcast::Sender<RunId>,
) -> Result<(), RuntimeError> {
    let mut sub = rt
        .client
        .subscribe("agent.run.*.i.cancel.requested")
        .await
        .map_err(|e| RuntimeError::broker("subscribe to cancel requests", e))?;
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            if let Some(parsed) = kedge_core::subjects::parse_event(&msg.subject) {
                let _ = tx.send(parsed.run_id);
            }
        }
    });
    Ok(())
}

/// Runs the step service until `shutdown` resolves, then lets in-flight drives finish.
pub async fn run(rt: Runtime, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
    let consumer = consumer::durable(&rt.js, "step", rt.config.timeouts.step_ack_wait()).await?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| RuntimeError::broker("step consumer", e))?;
    let (cancels, _) = tokio::sync::broadcast::channel(1024);
    watch_cancels(&rt, cancels.clone()).await?;
    let driver = drive::Driver::new(rt.clone(), ModelClient::new(), cancels);
    let active: Active = Arc::default();
    let workers = consumer::Workers::new(rt.config.step_concurrency);
    tracing::info!(worker = %rt.config.worker_id, "step service started");
    tokio::pin!(shutdown);
    loop {
        let msg = tokio::select! {
            _ = &mut shutdown => break,
            next = consumer::next_message(&mut messages, "step") => match next {
                Some(msg) => msg,
                None => break,
            },
        };
        let Some(parsed) = kedge_core::subjects::parse_event(&msg.subject) else {
            tracing::warn!(subject = %msg.subject, "not a journal event subject; terminating it");
            let _ = msg.ack_with(AckKind::Term).await;
            continue;
        };
        let run_id = parsed.run_id;
        // Whether a drive of this run is already in progress here (then it absorbs this wake).
        let absorbed = match active.lock() {
            Ok(mut map) => match map.get_mut(&run_id) {
                Some(dirty) => {
                    *dirty = true;
                    true
                }
                None => {
                    map.insert(run_id.clone(), false);
                    false
                }
            },
            Err(_) => break,
        };
        if absorbed {
            // The drive in progress will read this event before it lets go.
            let _ = msg.ack().await;
            continue;
        }
        let driver = driver.clone();
        let active = active.clone();
        workers.spawn(async move {
            let msg = Arc::new(msg);
            let result = loop {
                let result = driver.drive(&run_id, Some(msg.clone())).await;
                let again = match active.lock() {
                    Ok(mut map) => match map.get_mut(&run_id) {
                        Some(dirty) if *dirty && result.is_ok() => {
                            *dirty = false;
                            true
                        }
                        _ => {
                            map.remove(&run_id);
                            false
                        }
                    },
                    Err(_) => false,
                };
                if !again {
                    break result;
                }
            };
            let ack = match &result {
                Ok(Outcome::Idle) => msg.ack().await,
                Ok(Outcome::Busy) => msg.ack_with(AckKind::Nak(Some(BUSY_DELAY))).await,
                Err(e) if e.is_retryable() => {
                    tracing::warn!(run_id = %run_id, error = %e, "drive failed; will retry");
                    msg.ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                        .await
                }
                Err(e) => {
                    tracing::error!(run_id = %run_id, error = %e, "drive failed");
                    msg.ack_with(AckKind::Nak(Some(Duration::from_secs(5))))
                        .await
                }
            };
            if let Err(e) = ack {
                tracing::warn!(run_id = %run_id, error = %e, "ack failed; the wake will be redelivered");
            }
        }).await;
    }
    // Drain: wait for every in-flight drive to finish.
    workers.drain().await;
    tracing::info!("step service stopped");
    Ok(())
}
