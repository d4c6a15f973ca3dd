//! `GET /v1/runs/{id}/events`: a run's public events as Server-Sent Events, resumable.
//!
//! The SSE stream is an observation channel, not a store (principle 9): every event it sends was
//! journaled first, its `id:` is the journal sequence, and a client that reconnects with
//! `Last-Event-ID` (or `?after=`) continues right after the last event it saw, from any bridge.
//!
//! ## Fan-out
//!
//! Per bridge process there is at most one **feed** per watched run: one ordered consumer on the
//! run's journal (`Journal::tail`) and one core-NATS subscription to its token deltas, broadcast
//! to every connection on that run through a bounded ring (`tokio::sync::broadcast`). Each frame
//! is rendered once and shared (`Bytes`). A connection that stops reading stops taking frames from
//! the ring; the ring overwrites them for it, so it never slows the feed or the other connections.
//! When it reads again it learns that it lagged and catches up from the journal by itself.
//! A feed whose last connection left closes after a short grace period.
//!
//! ## No gap, no duplicate
//!
//! Per connection: (1) the handler reads the run's journal (it needs `run.created` for the tenant
//! check, and the fold to know whether the run is finished) and sends the public events after the
//! resume point; (2) it subscribes to the run's feed once the feed is *initialized* (the feed read
//! the journal through some sequence `p` and tails from `p + 1`), then reads the journal again
//! after the last sequence it sent; (3) it forwards ring frames, skipping any sequence it already
//! sent. Every event is covered: one with sequence `<= p`, or put on the ring before the
//! subscription, was stored before the second read began, so that read returns it
//! (`Journal::read` returns every event acknowledged before the call); every later one arrives on
//! the ring, in order. Sequences only grow, so "skip what is `<=` the last sent" removes the
//! overlap. A connection that lagged (frames overwritten for it) repeats (2) and (3) with a fresh
//! subscription.
//!
//! ## End of stream
//!
//! The stream ends after the event that leaves the run *finished* (terminal, and no user message
//! about to revive it), a fact the feed computes once per event from its own fold and puts on the
//! frame; the feed also publishes the latest `(sequence, finished)` so that a connection that
//! caught up from the journal past the frame can tell. A client that reconnects to a finished run
//! with nothing left to send gets `204 No Content`, which tells a browser's `EventSource` to stop
//! reconnecting. Token deltas (`event: delta`, no `id:`) are sent only while live; the journaled
//! `step.completed` is the authoritative message.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use kedge_core::RunState;
use kedge_core::ids::RunId;
use kedge_journal::{ErrorKind, Journal, Recorded};
use tokio::sync::{OwnedSemaphorePermit, broadcast, mpsc, watch};

use crate::view;

/// Frames queued for one connection's socket.
const CONNECTION_QUEUE: usize = 16;
/// How long a feed with no connection stays open (so a reconnecting client finds it).
const FEED_GRACE: Duration = Duration::from_secs(5);
/// Journal reads a catching-up connection retries through broker trouble.
const CATCH_UP_TRIES: u32 = 4;
/// Consecutive non-retryable tail errors after which a feed gives up (its connections rejoin).
const MAX_TAIL_ERRORS: u32 = 20;

/// One frame on a feed's ring.
#[derive(Debug, Clone)]
pub enum Frame {
    /// A public journal event, and whether the run is finished after it.
    Event {
        seq: u64,
        bytes: Bytes,
        finished: bool,
    },
    Delta(Bytes),
}

/// A feed as connections see it. The sender is taken out when the feed task ends, so that every
/// subscriber then sees the ring closed and rejoins a new feed.
#[derive(Debug)]
pub struct Feed {
    tx: Mutex<Option<broadcast::Sender<Frame>>>,
    ready: watch::Receiver<FeedState>,
    /// The last public event the feed put on the ring, and whether the run was finished then.
    status: watch::Receiver<(u64, bool)>,
}

impl Feed {
    fn subscribe(&self) -> Option<broadcast::Receiver<Frame>> {
        self.tx.lock().ok()?.as_ref().map(|tx| tx.subscribe())
    }

    fn close(&self) {
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum FeedState {
    Starting,
    Ready,
    Failed(String),
}

/// The feeds of this process, by run.
#[derive(Debug)]
pub struct Hub {
    journal: Journal,
    client: async_nats::Client,
    feeds: Mutex<HashMap<RunId, Arc<Feed>>>,
    lagged: AtomicU64,
    /// Frames one feed keeps for connections that are behind.
    ring: usize,
}

impl Hub {
    pub fn new(journal: Journal, client: async_nats::Client, ring: usize) -> Arc<Hub> {
        Arc::new(Hub {
            ring: ring.max(1),
            journal,
            client,
            feeds: Mutex::new(HashMap::new()),
            lagged: AtomicU64::new(0),
        })
    }

    /// Feeds currently open (for tests and metrics).
    pub fn feeds(&self) -> usize {
        self.feeds.lock().map(|f| f.len()).unwrap_or(0)
    }

    /// How many times a connection fell behind its feed's ring and caught up from the journal.
    pub fn lagged(&self) -> u64 {
        self.lagged.load(Ordering::Relaxed)
    }

    /// A subscription to the run's feed, once the feed is initialized: the subscriber gets every
    /// public event after the feed's start on the ring.
    async fn subscribe(
        self: &Arc<Self>,
        run: &RunId,
    ) -> Result<(Arc<Feed>, broadcast::Receiver<Frame>), String> {
        for _ in 0..3 {
            let feed = self.feed(run)?;
            let mut ready = feed.ready.clone();
            let state = ready
                .wait_for(|s| *s != FeedState::Starting)
                .await
                .map(|s| s.clone())
                .map_err(|_| "feed stopped while starting".to_owned())?;
            match state {
                FeedState::Ready => match feed.subscribe() {
                    Some(rx) => return Ok((feed, rx)),
                    // The feed closed between the lookup and now: take a new one.
                    None => self.forget(run, &feed),
                },
                FeedState::Failed(why) => {
                    self.forget(run, &feed);
                    return Err(why);
                }
                FeedState::Starting => return Err("feed did not start".into()),
            }
        }
        Err("feeds kept closing".into())
    }

    /// The run's feed, started if there is none.
    fn feed(self: &Arc<Self>, run: &RunId) -> Result<Arc<Feed>, String> {
        let mut feeds = self.feeds.lock().map_err(|_| "feed table poisoned")?;
        if let Some(f) = feeds.get(run)
            && !matches!(*f.ready.borrow(), FeedState::Failed(_))
        {
            return Ok(f.clone());
        }
        let (tx, _) = broadcast::channel(self.ring);
        let (ready_tx, ready) = watch::channel(FeedState::Starting);
        let (status_tx, status) = watch::channel((0, false));
        let feed = Arc::new(Feed {
            tx: Mutex::new(Some(tx.clone())),
            ready,
            status,
        });
        feeds.insert(run.clone(), feed.clone());
        tokio::spawn(run_feed(
            self.clone(),
            run.clone(),
            feed.clone(),
            tx,
            (ready_tx, status_tx),
        ));
        Ok(feed)
    }

    /// Removes `feed` from the table if it is still the run's feed.
    fn forget(&self, run: &RunId, feed: &Arc<Feed>) {
        if let Ok(mut feeds) = self.feeds.lock()
            && feeds.get(run).is_some_and(|f| Arc::ptr_eq(f, feed))
        {
            feeds.remove(run);
        }
    }
}

/// The feed task: read and fold the run, then tail it and its deltas onto the ring until no
/// connection has been on it for [`FEED_GRACE`].
async fn run_feed(
    hub: Arc<Hub>,
    run: RunId,
    feed: Arc<Feed>,
    tx: broadcast::Sender<Frame>,
    (ready, status): (watch::Sender<FeedState>, watch::Sender<(u64, bool)>),
) {
    let fail = |why: String| {
        tracing::warn!(run_id = %run, reason = %why, "SSE feed could not start");
        feed.close();
        hub.forget(&run, &feed);
        let _ = ready.send(FeedState::Failed(why));
    };
    let events = match hub.journal.read(&run, 0).await {
        Ok(e) => e,
        Err(e) => return fail(e.to_string()),
    };
    let mut state = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope))).ok();
    let start = events.last().map_or(0, |r| r.seq);
    let last_public = events
        .iter()
        .rev()
        .find(|r| view::is_public(r.envelope.event_type()))
        .map_or(0, |r| r.seq);
    status.send_replace((last_public, state.as_ref().is_some_and(view::finished)));
    drop(events);
    let mut deltas = match hub
        .client
        .subscribe(kedge_core::subjects::delta(&run))
        .await
    {
        Ok(s) => s,
        Err(e) => return fail(e.to_string()),
    };
    let mut tail = std::pin::pin!(hub.journal.tail(&run, start));
    let _ = ready.send(FeedState::Ready);
    tracing::debug!(run_id = %run, start, "SSE feed started");
    let mut idle = tokio::time::interval(FEED_GRACE);
    idle.tick().await;
    let mut was_idle = false;
    let mut errors = 0u32;
    loop {
        tokio::select! {
            next = tail.next() => match next {
                Some(Ok(r)) => {
                    errors = 0;
                    let finished = match &mut state {
                        Some(s) => match s.apply(r.seq, &r.envelope) {
                            Ok(()) => view::finished(s),
                            Err(e) => {
                                tracing::warn!(run_id = %run, error = %e, "feed fold failed");
                                false
                            }
                        },
                        None => false,
                    };
                    if view::is_public(r.envelope.event_type()) {
                        status.send_replace((r.seq, finished));
                        let _ = tx.send(Frame::Event { seq: r.seq, bytes: view::sse_frame(&r), finished });
                    }
                }
                Some(Err(e)) if e.kind() == ErrorKind::Unavailable => {
                    tracing::debug!(run_id = %run, error = %e, "feed tail hiccup");
                }
                Some(Err(e)) => {
                    errors += 1;
                    tracing::warn!(run_id = %run, error = %e, "feed tail error");
                    if errors >= MAX_TAIL_ERRORS {
                        break;
                    }
                }
                None => break,
            },
            Some(msg) = deltas.next() => {
                if let Some(frame) = view::delta_frame(&msg.payload) {
                    let _ = tx.send(Frame::Delta(frame));
                }
            }
            _ = idle.tick() => {
                if tx.receiver_count() == 0 {
                    if was_idle {
                        break;
                    }
                    was_idle = true;
                } else {
                    was_idle = false;
                }
            }
        }
    }
    hub.forget(&run, &feed);
    feed.close();
    drop(tx);
    tracing::debug!(run_id = %run, "SSE feed closed");
}

/// Everything one SSE connection needs.
pub struct Connection {
    pub hub: Arc<Hub>,
    pub journal: Journal,
    pub run: RunId,
    /// The last sequence the client has (its resume point).
    pub after: u64,
    /// The run's journal as the handler read it, and its fold.
    pub events: Vec<Recorded>,
    pub state: RunState,
    pub retry_ms: u64,
    pub heartbeat: Duration,
    pub shutdown: watch::Receiver<bool>,
    /// The connection's slot under `max_sse_connections`.
    pub permit: OwnedSemaphorePermit,
    /// Its slot under the tenant's `max_sse_per_tenant`.
    pub tenant_slot: crate::quota::SseSlot,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("run", &self.run)
            .field("after", &self.after)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Whether there is nothing to send: the run is finished and no public event is after the
    /// resume point.
    pub fn nothing_to_send(&self) -> bool {
        view::finished(&self.state)
            && !self
                .events
                .iter()
                .any(|r| r.seq > self.after && view::is_public(r.envelope.event_type()))
    }

    /// The response body: frames produced by a task that ends when the client goes away.
    pub fn into_body(
        self,
    ) -> impl futures::Stream<Item = Result<Bytes, Infallible>> + Send + 'static {
        let (tx, mut rx) = mpsc::channel::<Bytes>(CONNECTION_QUEUE);
        tokio::spawn(self.pump(tx));
        futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|b| b.map(Ok)))
    }

    async fn pump(self, tx: mpsc::Sender<Bytes>) {
        let _counted = kedge_runtime::metrics::SseConnection::open();
        let Connection {
            hub,
            journal,
            run,
            after,
            events,
            state,
            retry_ms,
            heartbeat,
            mut shutdown,
            permit: _permit,
            tenant_slot: _tenant_slot,
        } = self;
        let mut out = Out {
            tx,
            last: after,
            shutdown: &mut shutdown,
        };
        if !out
            .send(Bytes::from(format!("retry: {retry_ms}\n\n")))
            .await
        {
            return;
        }
        for r in events.iter().filter(|r| r.seq > after) {
            if view::is_public(r.envelope.event_type()) && !out.event(r).await {
                return;
            }
        }
        if view::finished(&state) {
            return;
        }
        drop(events);
        drop(state);
        loop {
            let (feed, mut rx) = match hub.subscribe(&run).await {
                Ok(f) => f,
                Err(why) => {
                    tracing::warn!(run_id = %run, reason = %why, "SSE connection cannot go live; the client will reconnect");
                    return;
                }
            };
            // Catch up: every event after the last one sent, stored before now (retried through
            // short broker trouble; after that the client reconnects with its Last-Event-ID).
            let mut tries = 0;
            let more = loop {
                match journal.read(&run, out.last).await {
                    Ok(more) => break more,
                    Err(e) if e.is_retryable() && tries < CATCH_UP_TRIES => {
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(100 << tries)).await;
                    }
                    Err(e) => {
                        tracing::warn!(run_id = %run, error = %e, "SSE catch-up failed; the client will reconnect");
                        return;
                    }
                }
            };
            for r in &more {
                if view::is_public(r.envelope.event_type()) && !out.event(r).await {
                    return;
                }
            }
            drop(more);
            // Finished as of the last event sent: the feed saw it before this subscription.
            if *feed.status.borrow() == (out.last, true) {
                return;
            }
            let mut beat = tokio::time::interval(heartbeat);
            beat.tick().await;
            loop {
                tokio::select! {
                    frame = rx.recv() => match frame {
                        Ok(Frame::Event { seq, bytes, finished }) => {
                            if seq > out.last {
                                out.last = seq;
                                if !out.send(bytes).await {
                                    return;
                                }
                            }
                            // The run is finished as of the last event this client has.
                            if finished && seq == out.last {
                                return;
                            }
                        }
                        Ok(Frame::Delta(bytes)) => {
                            if !out.send(bytes).await {
                                return;
                            }
                        }
                        Err(broadcast::error::RecvError::Lagged(n)) => {
                            hub.lagged.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(run_id = %run, skipped = n, "SSE connection lagged; catching up from the journal");
                            break;
                        }
                        Err(broadcast::error::RecvError::Closed) => {
                            hub.forget(&run, &feed);
                            break;
                        }
                    },
                    _ = beat.tick() => {
                        if !out.send(Bytes::from_static(b": keep-alive\n\n")).await {
                            return;
                        }
                    }
                    _ = out.shutdown.changed() => return,
                }
            }
        }
    }
}

/// The sending side of a connection.
struct Out<'a> {
    tx: mpsc::Sender<Bytes>,
    /// The last sequence sent.
    last: u64,
    shutdown: &'a mut watch::Receiver<bool>,
}

impl Out<'_> {
    /// Sends a frame; `false` when the client is gone or the bridge shuts down.
    async fn send(&mut self, bytes: Bytes) -> bool {
        if *self.shutdown.borrow() {
            return false;
        }
        tokio::select! {
            r = self.tx.send(bytes) => r.is_ok(),
            _ = self.shutdown.changed() => false,
        }
    }

    async fn event(&mut self, r: &Recorded) -> bool {
        self.last = r.seq;
        self.send(view::sse_frame(r)).await
    }
}
