//! The one way a service answers core-NATS requests: [`serve`] subscribes (in a queue group),
//! handles each request on its own task with at most `bound` in flight, and on shutdown stops
//! taking requests (the subscription is dropped, so the broker sends the next ones to another
//! member of the group) and waits a bounded time for those in flight. A request that finds
//! every slot taken either waits for one ([`Busy::Wait`]: the broker buffers behind it) or is
//! answered at once ([`Busy::Refuse`], for an API whose callers retry).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, Message};
use futures::StreamExt as _;
use tokio::sync::Semaphore;

use crate::RuntimeError;

/// How long a stopping responder waits for the requests it is handling.
pub const DRAIN_FOR: Duration = Duration::from_secs(10);

/// What a responder does with a request when every slot is taken.
#[derive(Debug, Clone, Copy)]
pub enum Busy {
    /// Wait for a free slot (requests queue in the subscription meanwhile).
    Wait,
    /// Answer it at once with this function (e.g. "busy, retry") and go on.
    Refuse(fn(&Client, Message)),
}

/// Where and how a responder listens.
#[derive(Debug, Clone)]
pub struct Listen {
    /// What it answers, for logs (`"approval decisions"`).
    pub what: &'static str,
    pub subject: String,
    /// Its queue group: one member of the group gets each request.
    pub queue: &'static str,
    /// Requests handled at once.
    pub bound: usize,
    pub busy: Busy,
}

/// Answers requests on `listen.subject` with `handle` until `shutdown` resolves, then drains
/// (at most [`DRAIN_FOR`]). A subscription the broker ends (the connection closed for good)
/// ends it too.
pub async fn serve<H, F>(
    client: &Client,
    listen: Listen,
    shutdown: impl Future<Output = ()>,
    handle: H,
) -> Result<(), RuntimeError>
where
    H: Fn(Message) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    Responder::subscribe(client, listen)
        .await?
        .run(shutdown, handle)
        .await;
    Ok(())
}

/// A responder subscribed and not yet answering: [`serve`] in two halves, for a service that
/// must know it is subscribed before it goes on (and answers on a task of its own).
#[derive(Debug)]
pub struct Responder {
    client: Client,
    listen: Listen,
    requests: async_nats::Subscriber,
}

impl Responder {
    /// Subscribes to `listen.subject` in its queue group.
    pub async fn subscribe(client: &Client, listen: Listen) -> Result<Self, RuntimeError> {
        let requests = client
            .queue_subscribe(listen.subject.clone(), listen.queue.to_owned())
            .await
            .map_err(|e| RuntimeError::broker(format!("subscribe to {}", listen.what), e))?;
        Ok(Self {
            client: client.clone(),
            listen,
            requests,
        })
    }

    /// Answers with `handle` until `shutdown` resolves (or the subscription ends), then drains
    /// (at most [`DRAIN_FOR`]).
    pub async fn run<H, F>(self, shutdown: impl Future<Output = ()>, handle: H)
    where
        H: Fn(Message) -> F,
        F: Future<Output = ()> + Send + 'static,
    {
        let Self {
            client,
            listen,
            mut requests,
        } = self;
        let bound = listen.bound.max(1);
        let slots = Arc::new(Semaphore::new(bound));
        tokio::pin!(shutdown);
        loop {
            let msg = tokio::select! {
                _ = &mut shutdown => break,
                next = requests.next() => match next {
                    Some(msg) => msg,
                    None => break,
                },
            };
            let slot = match (slots.clone().try_acquire_owned(), listen.busy) {
                (Ok(slot), _) => slot,
                (Err(_), Busy::Refuse(refuse)) => {
                    tracing::warn!(what = listen.what, subject = %msg.subject, "busy; request refused");
                    refuse(&client, msg);
                    continue;
                }
                (Err(_), Busy::Wait) => {
                    let acquired = tokio::select! {
                        _ = &mut shutdown => None,
                        slot = slots.clone().acquire_owned() => slot.ok(),
                    };
                    match acquired {
                        Some(slot) => slot,
                        None => break,
                    }
                }
            };
            let work = handle(msg);
            tokio::spawn(async move {
                work.await;
                drop(slot);
            });
        }
        drop(requests);
        let all = u32::try_from(bound).unwrap_or(u32::MAX);
        if tokio::time::timeout(DRAIN_FOR, slots.acquire_many(all))
            .await
            .is_err()
        {
            tracing::warn!(
                what = listen.what,
                "stopped with requests still being handled"
            );
        }
    }
}

/// Publishes `body` as it is to a request's reply subject, if it has one; a failure is logged.
pub async fn reply_raw(client: &Client, msg: &Message, body: bytes::Bytes) {
    let Some(to) = msg.reply.clone() else {
        return;
    };
    if let Err(e) = client.publish(to, body).await {
        tracing::warn!(subject = %msg.subject, error = %e, "cannot answer a request");
    }
}

/// Publishes `body` (JSON) to a request's reply subject, if it has one; a failure is logged
/// (the asker times out and asks again).
pub async fn reply<T: serde::Serialize>(client: &Client, msg: &Message, body: &T) {
    let Some(to) = msg.reply.clone() else {
        return;
    };
    match serde_json::to_vec(body) {
        Ok(bytes) => {
            if let Err(e) = client.publish(to, bytes.into()).await {
                tracing::warn!(subject = %msg.subject, error = %e, "cannot answer a request");
            }
        }
        Err(e) => tracing::warn!(subject = %msg.subject, error = %e, "cannot encode an answer"),
    }
}
