//! The JetStream wire protocol, spoken directly over core NATS requests.
//!
//! async-nats 0.51 has no API for atomic batches, no update-with-TTL for KV, and folds request
//! errors into kinds that lose the JetStream error code. Everything the journal and the leases need
//! is therefore sent here as plain requests to stream subjects and to the `$JS.API`, and every
//! answer is classified into [`WireError`] in one place, so that the public error types map each
//! failure deliberately.
//!
//! Invariant: nothing in this module panics on anything that came from the network.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use async_nats::{Client, HeaderMap, Message, Request, RequestErrorKind, StatusCode};
use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;

/// The JetStream API prefix (no domains or account imports are used by Kedge).
pub(crate) const API_PREFIX: &str = kedge_core::subjects::JS_API;

pub(crate) const MSG_ID: &str = "Nats-Msg-Id";
pub(crate) const EXPECTED_LAST_SUBJECT_SEQ: &str = "Nats-Expected-Last-Subject-Sequence";
pub(crate) const EXPECTED_LAST_SUBJECT_SEQ_SUBJECT: &str =
    "Nats-Expected-Last-Subject-Sequence-Subject";
pub(crate) const BATCH_ID: &str = "Nats-Batch-Id";
pub(crate) const BATCH_SEQUENCE: &str = "Nats-Batch-Sequence";
pub(crate) const BATCH_COMMIT: &str = "Nats-Batch-Commit";
pub(crate) const TTL: &str = "Nats-TTL";
pub(crate) const KV_OPERATION: &str = "KV-Operation";
pub(crate) const MARKER_REASON: &str = "Nats-Marker-Reason";
pub(crate) const SEQUENCE: &str = "Nats-Sequence";
pub(crate) const SUBJECT: &str = "Nats-Subject";
pub(crate) const NUM_PENDING: &str = "Nats-Num-Pending";
pub(crate) const UP_TO_SEQUENCE: &str = "Nats-UpTo-Sequence";

/// JetStream error codes Kedge branches on.
pub(crate) mod codes {
    /// `wrong last sequence` (an expected-last-(subject-)sequence check failed).
    pub(crate) const WRONG_LAST_SEQUENCE: u64 = 10071;
    /// `wrong last sequence` without one: in a cluster, the check's subject has a message in
    /// flight (proposed, not yet applied) whose outcome the leader cannot know yet.
    pub(crate) const WRONG_LAST_SEQUENCE_IN_FLIGHT: u64 = 10164;
    /// `stream not found`.
    pub(crate) const STREAM_NOT_FOUND: u64 = 10059;
    /// `no message found`.
    pub(crate) const NO_MESSAGE_FOUND: u64 = 10037;
    /// `stream name already in use with a different configuration`.
    pub(crate) const STREAM_NAME_IN_USE: u64 = 10058;
    /// `atomic publish batch contains duplicate message id`: a retried batch whose first
    /// attempt landed (its message ids are still in the duplicate window).
    pub(crate) const BATCH_DUPLICATE_MSG_ID: u64 = 10201;
    /// `atomic publish is disabled` (the stream lacks `allow_atomic`).
    pub(crate) const ATOMIC_DISABLED: u64 = 10174;
}

/// A JetStream API error as the server sends it: `{"code": 400, "err_code": 10071, ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub(crate) struct ApiError {
    pub(crate) code: u16,
    #[serde(default)]
    pub(crate) err_code: u64,
    #[serde(default)]
    pub(crate) description: String,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (code {}, err_code {})",
            self.description, self.code, self.err_code
        )
    }
}

/// Why a request to the broker failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WireError {
    /// No answer within the timeout.
    TimedOut,
    /// Nobody listens on the subject: the stream is gone or, during a cluster failover, has no
    /// leader yet (async-nats calls this `StreamNotFound` on publishes).
    NoResponders,
    /// The client could not send (disconnected, closed, I/O).
    Client(String),
    /// The request itself is not sendable (subject or size); a caller bug, not broker trouble.
    BadRequest(String),
    /// The server answered with a JetStream error.
    Api(ApiError),
    /// The server answered something this code cannot read.
    Malformed(String),
}

impl WireError {
    pub(crate) fn api_code(&self) -> Option<u64> {
        match self {
            WireError::Api(e) => Some(e.err_code),
            _ => None,
        }
    }

    /// An expected-last-(subject-)sequence check refused the publish: the sequence moved
    /// (10071), or, in a cluster, a message on the checked subject is still in flight (10164).
    pub(crate) fn is_wrong_last(&self) -> bool {
        matches!(
            self.api_code(),
            Some(codes::WRONG_LAST_SEQUENCE | codes::WRONG_LAST_SEQUENCE_IN_FLIGHT)
        )
    }

    /// Broker trouble worth retrying: timeouts, no responders, disconnections, and API errors the
    /// server marks as temporary (HTTP-like 503/408, e.g. "JetStream system temporarily
    /// unavailable", no stream leader).
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            WireError::TimedOut | WireError::NoResponders | WireError::Client(_) => true,
            WireError::Api(e) => matches!(e.code, 503 | 408),
            WireError::BadRequest(_) | WireError::Malformed(_) => false,
        }
    }
}

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WireError::TimedOut => f.write_str("timed out waiting for the broker"),
            WireError::NoResponders => {
                f.write_str("no responders (stream missing or without a leader)")
            }
            WireError::Client(e) => write!(f, "client error: {e}"),
            WireError::BadRequest(e) => write!(f, "request refused by the client: {e}"),
            WireError::Api(e) => write!(f, "JetStream error: {e}"),
            WireError::Malformed(e) => write!(f, "unreadable answer from the broker: {e}"),
        }
    }
}

fn from_request_error(err: async_nats::RequestError) -> WireError {
    match err.kind() {
        RequestErrorKind::TimedOut => WireError::TimedOut,
        RequestErrorKind::NoResponders => WireError::NoResponders,
        RequestErrorKind::InvalidSubject | RequestErrorKind::MaxPayloadExceeded => {
            WireError::BadRequest(err.to_string())
        }
        RequestErrorKind::Other => WireError::Client(err.to_string()),
    }
}

/// One request with its own timeout.
pub(crate) async fn request(
    client: &Client,
    subject: String,
    headers: Option<HeaderMap>,
    payload: Bytes,
    timeout: Duration,
) -> Result<Message, WireError> {
    let mut req = Request::new().payload(payload).timeout(Some(timeout));
    if let Some(headers) = headers {
        req = req.headers(headers);
    }
    client
        .send_request(subject, req)
        .await
        .map_err(from_request_error)
}

/// A JetStream publish acknowledgement (also the commit ack of an atomic batch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PubAck {
    pub(crate) seq: u64,
    pub(crate) duplicate: bool,
    /// Set on the commit ack of an atomic batch: how many messages it stored.
    pub(crate) batch_count: Option<u64>,
}

#[derive(Deserialize)]
struct RawAck {
    #[serde(default)]
    error: Option<ApiError>,
    #[serde(default)]
    seq: Option<u64>,
    #[serde(default)]
    duplicate: bool,
    #[serde(default)]
    count: Option<u64>,
}

/// Reads the answer to a publish: an ack, or a JetStream error.
pub(crate) fn parse_pub_ack(payload: &[u8]) -> Result<PubAck, WireError> {
    let raw: RawAck = serde_json::from_slice(payload).map_err(|e| {
        WireError::Malformed(format!(
            "publish ack `{}`: {e}",
            String::from_utf8_lossy(payload)
        ))
    })?;
    if let Some(error) = raw.error {
        return Err(WireError::Api(error));
    }
    match raw.seq {
        Some(seq) if seq > 0 => Ok(PubAck {
            seq,
            duplicate: raw.duplicate,
            batch_count: raw.count,
        }),
        _ => Err(WireError::Malformed(format!(
            "publish ack without a sequence: `{}`",
            String::from_utf8_lossy(payload)
        ))),
    }
}

fn status_error(msg: &Message) -> Option<WireError> {
    let status = msg.status?;
    if status == StatusCode::NO_RESPONDERS {
        return Some(WireError::NoResponders);
    }
    Some(WireError::Api(ApiError {
        code: status.as_u16(),
        err_code: 0,
        description: msg
            .description
            .clone()
            .unwrap_or_else(|| "status without description".to_owned()),
    }))
}

/// Publishes one message to a stream subject and waits for its ack.
pub(crate) async fn publish(
    client: &Client,
    subject: String,
    headers: HeaderMap,
    payload: Bytes,
    timeout: Duration,
) -> Result<PubAck, WireError> {
    let msg = request(client, subject, Some(headers), payload, timeout).await?;
    if let Some(err) = status_error(&msg) {
        return Err(err);
    }
    parse_pub_ack(&msg.payload)
}

/// One message of an atomic batch.
#[derive(Debug)]
pub(crate) struct BatchMessage {
    pub(crate) subject: String,
    pub(crate) headers: HeaderMap,
    pub(crate) payload: Bytes,
}

/// Publishes an atomic batch and waits for the commit ack.
///
/// On the wire (measured with nats-server 2.15.1): every message carries `Nats-Batch-Id` and a
/// 1-based `Nats-Batch-Sequence`; the last also carries `Nats-Batch-Commit: 1`. A message sent
/// with a reply subject before the commit is answered with an *empty* payload (flow control
/// only), so the messages before the commit are sent without a reply. The commit is answered with
/// `{"stream", "seq": <last>, "batch": <id>, "count": <n>}` once the whole batch is stored, or
/// with the batch's error (a failed expected-sequence check on the first message is reported
/// here as 10071, and nothing of the batch is stored).
pub(crate) async fn publish_batch(
    client: &Client,
    batch_id: &str,
    messages: Vec<BatchMessage>,
    timeout: Duration,
) -> Result<PubAck, WireError> {
    let total = messages.len();
    let mut commit = None;
    for (i, mut m) in messages.into_iter().enumerate() {
        m.headers.insert(BATCH_ID, batch_id);
        m.headers
            .insert(BATCH_SEQUENCE, (i + 1).to_string().as_str());
        if i + 1 == total {
            m.headers.insert(BATCH_COMMIT, "1");
            commit = Some(m);
        } else {
            client
                .publish_with_headers(m.subject, m.headers, m.payload)
                .await
                .map_err(|e| WireError::Client(e.to_string()))?;
        }
    }
    let Some(commit) = commit else {
        return Err(WireError::BadRequest("empty batch".to_owned()));
    };
    publish(
        client,
        commit.subject,
        commit.headers,
        commit.payload,
        timeout,
    )
    .await
}

/// A message read back from a stream (by direct get or the leader's message get).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StoredMessage {
    pub(crate) seq: u64,
    pub(crate) subject: String,
    pub(crate) headers: HeaderMap,
    pub(crate) payload: Bytes,
}

impl StoredMessage {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.as_str())
    }
}

/// Reads a direct-get answer: `None` for 404, the message with its stream sequence otherwise.
fn parse_direct(msg: Message) -> Result<Option<StoredMessage>, WireError> {
    if msg.status == Some(StatusCode::NOT_FOUND) {
        return Ok(None);
    }
    if let Some(err) = status_error(&msg) {
        return Err(err);
    }
    let headers = msg.headers.unwrap_or_default();
    let seq = headers
        .get(SEQUENCE)
        .and_then(|v| v.as_str().parse::<u64>().ok())
        .ok_or_else(|| WireError::Malformed("direct get answer without Nats-Sequence".into()))?;
    let subject = headers
        .get(SUBJECT)
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default();
    Ok(Some(StoredMessage {
        seq,
        subject,
        headers,
        payload: msg.payload,
    }))
}

/// Direct get of the last message on a subject (wildcards allowed). Answered by any replica
/// that is current (and by the leader), so in a cluster it may trail the leader by the
/// replication apply delay.
pub(crate) async fn direct_last(
    client: &Client,
    stream: &str,
    subject: &str,
    timeout: Duration,
) -> Result<Option<StoredMessage>, WireError> {
    let body = serde_json::json!({ "last_by_subj": subject }).to_string();
    direct_one(client, stream, body, timeout).await
}

/// Direct get of the message at sequence `seq` (`None` when there is none, or the replica that
/// answered has not stored it yet). Answered like [`direct_last`], from the store by sequence:
/// no subject walk.
pub(crate) async fn direct_seq(
    client: &Client,
    stream: &str,
    seq: u64,
    timeout: Duration,
) -> Result<Option<StoredMessage>, WireError> {
    direct_one(client, stream, format!("{{\"seq\":{seq}}}"), timeout).await
}

/// One direct get of one message by the request `body`.
async fn direct_one(
    client: &Client,
    stream: &str,
    body: String,
    timeout: Duration,
) -> Result<Option<StoredMessage>, WireError> {
    let subject = format!("{API_PREFIX}.DIRECT.GET.{stream}");
    let msg = request(client, subject, None, body.into(), timeout).await?;
    parse_direct(msg)
}

/// Batched direct get: up to `batch` messages matching `subject` from sequence `from` on,
/// handed to `each` as they arrive (the caller's work on one overlaps the server sending the
/// next), followed by an end-of-batch status (204) whose `Nats-Num-Pending` is returned: the
/// matching messages left after the batch, as the responder saw the stream. A 404 means none.
///
/// Ask for no more than match (see `Journal::read_filtered`): when fewer do, the server looks
/// for the next one to the end of the stream.
pub(crate) async fn direct_batch(
    inbox: &BatchInbox,
    stream: &str,
    subject: &str,
    from: u64,
    batch: usize,
    timeout: Duration,
    mut each: impl FnMut(StoredMessage),
) -> Result<u64, WireError> {
    let body = serde_json::json!({ "seq": from, "next_by_subj": subject, "batch": batch });
    direct_batch_request(inbox, stream, body, timeout, &mut each)
        .await
        .map(|eob| eob.pending)
}

/// Batched direct get of the last message on each of `subjects` (`multi_last`; literal subjects),
/// handed to `each` in stream order. One request, answered like [`direct_batch`] (by any
/// current replica); subjects with no message are left out.
pub(crate) async fn direct_multi_last(
    inbox: &BatchInbox,
    stream: &str,
    subjects: &[String],
    timeout: Duration,
    mut each: impl FnMut(StoredMessage),
) -> Result<(), WireError> {
    let body = serde_json::json!({ "multi_last": subjects, "batch": subjects.len().max(1) });
    direct_batch_request(inbox, stream, body, timeout, &mut each)
        .await
        .map(|_| ())
}

/// The end of a batched direct get, as the responder saw the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct EndOfBatch {
    /// `Nats-Num-Pending`: what matched and was not sent (for `multi_last`, the subjects left).
    pub(crate) pending: u64,
    /// `Nats-UpTo-Sequence` of a `multi_last` answer: the responder's last sequence, through
    /// which the answer is complete. `None` when absent (or when nothing matched).
    pub(crate) up_to: Option<u64>,
}

/// `multi_last` over one `filter` (wildcards allowed): the last message of each subject
/// matching it, those stored at or after `min_seq` handed to `each` in stream order, at most
/// `batch` of them. One request, answered from the server's subject index (no message scan) by
/// any current replica; the end of batch says how many subjects were left out and through which
/// sequence the answer holds. A filter matching more than 1024 subjects is refused (413).
pub(crate) async fn direct_subjects_last(
    inbox: &BatchInbox,
    stream: &str,
    filter: &str,
    min_seq: u64,
    batch: usize,
    timeout: Duration,
    mut each: impl FnMut(StoredMessage),
) -> Result<EndOfBatch, WireError> {
    let body = serde_json::json!({ "multi_last": [filter], "seq": min_seq, "batch": batch.max(1) });
    direct_batch_request(inbox, stream, body, timeout, &mut each).await
}

async fn direct_batch_request(
    inbox: &BatchInbox,
    stream: &str,
    body: serde_json::Value,
    timeout: Duration,
    each: &mut impl FnMut(StoredMessage),
) -> Result<EndOfBatch, WireError> {
    let client = &inbox.client;
    let mut replies = inbox.open().await?;
    client
        .publish_with_reply(
            format!("{API_PREFIX}.DIRECT.GET.{stream}"),
            replies.subject.clone(),
            body.to_string().into(),
        )
        .await
        .map_err(|e| WireError::Client(e.to_string()))?;
    let mut received = 0usize;
    loop {
        let msg = match tokio::time::timeout(timeout, replies.next()).await {
            Err(_) => return Err(WireError::TimedOut),
            Ok(None) => return Err(WireError::Client("subscription closed".into())),
            Ok(Some(msg)) => msg,
        };
        match msg.status {
            Some(status) if status.as_u16() == 204 => {
                // End of batch.
                let header = |name: &str| {
                    msg.headers
                        .as_ref()
                        .and_then(|h| h.get(name))
                        .and_then(|v| v.as_str().parse().ok())
                };
                return Ok(EndOfBatch {
                    pending: header(NUM_PENDING).unwrap_or(0),
                    up_to: header(UP_TO_SEQUENCE),
                });
            }
            Some(StatusCode::NOT_FOUND) if received == 0 => return Ok(EndOfBatch::default()),
            Some(_) => {
                return Err(status_error(&msg)
                    .unwrap_or_else(|| WireError::Malformed("unexpected status".into())));
            }
            None => {
                if let Some(m) = parse_direct(msg)? {
                    received += 1;
                    each(m);
                }
            }
        }
    }
}

/// The reply subscription of a client's batched direct gets: one wildcard subscription
/// (`<inbox>.*`) for all of them, each read getting its own last token, instead of a subscribe
/// and an unsubscribe per read (which the server's subject index pays for on every read).
/// Cheap to clone; made on first use; its subscription ends when the last clone is dropped.
#[derive(Debug, Clone)]
pub(crate) struct BatchInbox {
    client: Client,
    mux: Arc<tokio::sync::OnceCell<Arc<InboxMux>>>,
}

#[derive(Debug)]
struct InboxMux {
    prefix: String,
    next: AtomicU64,
    routes: Mutex<HashMap<u64, mpsc::UnboundedSender<Message>>>,
    /// Closed when the mux is dropped: ends the dispatching task (and the subscription).
    _stop: oneshot::Sender<()>,
}

/// The replies of one batched read; unregistered when dropped.
pub(crate) struct Replies {
    subject: String,
    rx: mpsc::UnboundedReceiver<Message>,
    token: u64,
    mux: Arc<InboxMux>,
}

impl Replies {
    async fn next(&mut self) -> Option<Message> {
        self.rx.recv().await
    }
}

impl Drop for Replies {
    fn drop(&mut self) {
        if let Ok(mut routes) = self.mux.routes.lock() {
            routes.remove(&self.token);
        }
    }
}

impl BatchInbox {
    pub(crate) fn new(client: Client) -> Self {
        Self {
            client,
            mux: Arc::default(),
        }
    }

    async fn open(&self) -> Result<Replies, WireError> {
        let mux = self
            .mux
            .get_or_try_init(|| InboxMux::start(&self.client))
            .await?
            .clone();
        let token = mux.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        mux.routes
            .lock()
            .map_err(|_| WireError::Client("reply routes poisoned".into()))?
            .insert(token, tx);
        Ok(Replies {
            subject: format!("{}.{token}", mux.prefix),
            rx,
            token,
            mux,
        })
    }
}

impl InboxMux {
    async fn start(client: &Client) -> Result<Arc<InboxMux>, WireError> {
        let prefix = client.new_inbox();
        let mut sub = client
            .subscribe(format!("{prefix}.*"))
            .await
            .map_err(|e| WireError::Client(e.to_string()))?;
        let (stop, mut stopped) = oneshot::channel::<()>();
        let mux = Arc::new(InboxMux {
            prefix,
            next: AtomicU64::new(0),
            routes: Mutex::new(HashMap::new()),
            _stop: stop,
        });
        let weak = Arc::downgrade(&mux);
        tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    _ = &mut stopped => break,
                    msg = sub.next() => match msg {
                        Some(msg) => msg,
                        None => break,
                    },
                };
                let Some(mux) = weak.upgrade() else { break };
                // A reply for a read that already gave up (timed out) finds no route: dropped.
                let token = msg.subject.rsplit('.').next().and_then(|t| t.parse().ok());
                let route = token
                    .and_then(|t: u64| mux.routes.lock().ok().and_then(|r| r.get(&t).cloned()));
                if let Some(route) = route {
                    let _ = route.send(msg);
                }
            }
            let _ = sub.unsubscribe().await;
        });
        Ok(mux)
    }
}

#[derive(Deserialize)]
struct RawPurge {
    #[serde(default)]
    error: Option<ApiError>,
    #[serde(default)]
    success: bool,
    #[serde(default)]
    purged: u64,
}

/// A stream purge of the messages on subjects matching `filter` (`STREAM.PURGE`), only those
/// before sequence `before` when given; how many were removed.
pub(crate) async fn purge(
    client: &Client,
    stream: &str,
    filter: &str,
    before: Option<u64>,
    timeout: Duration,
) -> Result<u64, WireError> {
    let body = match before {
        Some(seq) => serde_json::json!({ "filter": filter, "seq": seq }),
        None => serde_json::json!({ "filter": filter }),
    }
    .to_string();
    let msg = request(
        client,
        format!("{API_PREFIX}.STREAM.PURGE.{stream}"),
        None,
        body.into(),
        timeout,
    )
    .await?;
    if let Some(err) = status_error(&msg) {
        return Err(err);
    }
    let raw: RawPurge = serde_json::from_slice(&msg.payload)
        .map_err(|e| WireError::Malformed(format!("purge answer: {e}")))?;
    match raw.error {
        Some(e) => Err(WireError::Api(e)),
        None if raw.success => Ok(raw.purged),
        None => Err(WireError::Malformed("purge answer without success".into())),
    }
}

#[derive(Deserialize)]
struct RawMsgGet {
    #[serde(default)]
    error: Option<ApiError>,
    #[serde(default)]
    message: Option<async_nats::jetstream::stream::RawMessage>,
}

/// The stream leader's message get (`STREAM.MSG.GET`): `{"last_by_subj"}` or
/// `{"seq", "next_by_subj"}`. Only the leader answers, so it sees every acknowledged write.
pub(crate) async fn leader_get(
    client: &Client,
    stream: &str,
    query: serde_json::Value,
    timeout: Duration,
) -> Result<Option<StoredMessage>, WireError> {
    let msg = request(
        client,
        format!("{API_PREFIX}.STREAM.MSG.GET.{stream}"),
        None,
        query.to_string().into(),
        timeout,
    )
    .await?;
    if let Some(err) = status_error(&msg) {
        return Err(err);
    }
    let raw: RawMsgGet = serde_json::from_slice(&msg.payload)
        .map_err(|e| WireError::Malformed(format!("message get answer: {e}")))?;
    if let Some(error) = raw.error {
        if error.err_code == codes::NO_MESSAGE_FOUND {
            return Ok(None);
        }
        return Err(WireError::Api(error));
    }
    let raw = raw
        .message
        .ok_or_else(|| WireError::Malformed("message get answer without a message".into()))?;
    let stored = async_nats::jetstream::message::StreamMessage::try_from(raw)
        .map_err(|e| WireError::Malformed(format!("stored message: {e}")))?;
    Ok(Some(StoredMessage {
        seq: stored.sequence,
        subject: stored.subject.to_string(),
        headers: stored.headers,
        payload: stored.payload,
    }))
}

/// A `$JS.API` request with a JSON answer that may be a JetStream error.
pub(crate) async fn api(
    client: &Client,
    endpoint: &str,
    body: Bytes,
    timeout: Duration,
) -> Result<serde_json::Value, WireError> {
    let msg = request(
        client,
        format!("{API_PREFIX}.{endpoint}"),
        None,
        body,
        timeout,
    )
    .await?;
    if let Some(err) = status_error(&msg) {
        return Err(err);
    }
    let value: serde_json::Value = serde_json::from_slice(&msg.payload)
        .map_err(|e| WireError::Malformed(format!("{endpoint} answer: {e}")))?;
    if let Some(error) = value.get("error") {
        let error: ApiError = serde_json::from_value(error.clone())
            .map_err(|e| WireError::Malformed(format!("{endpoint} error: {e}")))?;
        return Err(WireError::Api(error));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_and_errors_parse() {
        assert_eq!(
            parse_pub_ack(br#"{"stream":"R","seq":8}"#),
            Ok(PubAck {
                seq: 8,
                duplicate: false,
                batch_count: None
            })
        );
        assert_eq!(
            parse_pub_ack(br#"{"stream":"R","seq":8,"duplicate": true}"#).map(|a| a.duplicate),
            Ok(true)
        );
        assert_eq!(
            parse_pub_ack(br#"{"stream":"R","seq":3,"batch":"b1","count":3}"#)
                .map(|a| a.batch_count),
            Ok(Some(3))
        );
        let err = parse_pub_ack(
            br#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 3"},"stream":"R","seq":0}"#,
        )
        .expect_err("an error");
        assert_eq!(err.api_code(), Some(codes::WRONG_LAST_SEQUENCE));
        assert!(!err.is_transient());
        assert!(matches!(parse_pub_ack(b""), Err(WireError::Malformed(_))));
        assert!(matches!(
            parse_pub_ack(br#"{"stream":"R"}"#),
            Err(WireError::Malformed(_))
        ));
    }

    #[test]
    fn transient_errors_are_the_retryable_ones() {
        assert!(WireError::TimedOut.is_transient());
        assert!(WireError::NoResponders.is_transient());
        assert!(WireError::Client("disconnected".into()).is_transient());
        let unavailable = WireError::Api(ApiError {
            code: 503,
            err_code: 10008,
            description: "JetStream system temporarily unavailable".into(),
        });
        assert!(unavailable.is_transient());
        assert!(!WireError::BadRequest("x".into()).is_transient());
        assert!(!WireError::Malformed("x".into()).is_transient());
    }
}
