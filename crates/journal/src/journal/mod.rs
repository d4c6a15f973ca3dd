//! The journal: appends, reads and tails of a run's events in `KEDGE_RUNS`.
//!
//! Invariants this module keeps (principles 1–3):
//!
//! - **One decision writer.** A decision append carries `Nats-Expected-Last-Subject-Sequence`
//!   scoped by `Nats-Expected-Last-Subject-Sequence-Subject: agent.run.<id>.>`: the run's last
//!   message of any kind as the writer knows it (after checking that the run's last decision is
//!   the one it expects), so it lands only if nothing of the run was stored since the writer
//!   last looked. Every decision but a run's first is checked on that one subject, so that a
//!   clustered stream's leader also refuses one while another is in flight (see `Check`). An
//!   input that lands in between only makes a writer look again (or, for a writer whose state
//!   is current, read it and decide again: [`JournalError::Behind`]).
//! - **Groups are atomic.** Several decisions go out as one JetStream atomic batch: all of them
//!   are stored, contiguously, or none.
//! - **Retries are recognisable.** Every decision message carries a `Nats-Msg-Id` of the form
//!   `d:<run>:<expected_last>:<index>:<writer>`. Retrying an append whose first attempt landed gets
//!   a rejection from the server (10071, or 10201 for a batch), not a duplicate ack; the journal
//!   then reads the run's last decision *from the stream leader* and answers
//!   [`JournalError::Duplicate`] if it is ours, [`JournalError::Conflict`] otherwise.
//! - **Reads are exact and consistent.** [`Journal::read`] returns exactly the run's events after a
//!   sequence, in order, including every event acknowledged before the call (see its docs).
//! - Messages under a run's tree that are neither `.d.` nor `.i.` (a reserved place for non-event
//!   subtrees; timer schedules live in their own stream, `KEDGE_TIMERS`) are skipped.
//! - **A malformed message never makes a run unreadable.** Anyone may publish on a run's input
//!   subjects (and, on an unsecured broker, on its decision subjects), and the stream denies
//!   deletes, so a message under `.d.`/`.i.` that is not a valid envelope of the run (not JSON,
//!   the wrong shape, another run's or another type's envelope, a digest that does not match, a
//!   decision without the writer's `Nats-Msg-Id`) is *set aside*: reads return the well-formed
//!   events and report the others as [`SetAside`] (sequence, subject, reason) in
//!   [`ReadPage::set_aside`], never fail on them. A set-aside decision still moved the run's
//!   last decision sequence (the server counts it), so the writer folds it in as such
//!   (`RunState::set_aside`).

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use async_nats::{Client, HeaderMap};
use bytes::Bytes;
use futures::StreamExt;
use kedge_core::subjects::{self, RUNS_STREAM};
use kedge_core::{Envelope, EventType, RunId};

use crate::blob::{self, BlobRef, Blobs};
use crate::error::{ErrorKind, JournalError};
use crate::wire::{self, StoredMessage, WireError};

mod append;
mod decode;
mod tail;

pub use append::{
    Appended, DecisionMsgId, DecisionWriter, InputAppended, MAX_GROUP, decision_msg_id,
    parse_decision_msg_id,
};
use decode::{Decoded, decode};
pub use decode::{Delivered, Recorded, SetAside};
use tail::{consumer_error, ordered_error};

/// Default timeout of one broker request. A cluster failover makes requests fail fast with "no
/// responders" for a few seconds, which is reported as retryable, so this only bounds a broker
/// that accepted the request and went silent.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// Messages asked for per direct-get page in [`Journal::read`].
const READ_PAGE: usize = 256;

/// A read through a known sequence starts with [`NEAR_BATCH`] messages instead of a probe of
/// one when it starts at most this many sequences before it (see `Journal::read_filtered`).
const NEAR_TAIL: u64 = 4096;
const NEAR_BATCH: usize = 8;

/// How often [`Journal::read`] re-asks a replica that trails the leader before reading the rest
/// from the leader itself.
const STALE_RETRIES: u32 = 3;

/// A read whose run spans at least `SPREAD_MIN_SPAN` stream sequences, and at least
/// `SPREAD_RATIO` per message of the run, is read by its literal subjects (see
/// `Journal::read_literal`): the server walks the messages between a wildcard's matches, but
/// skips the blocks a literal subject is not in.
const SPREAD_MIN_SPAN: u64 = 16_384;
const SPREAD_RATIO: u64 = 2048;

/// Most subjects a run may have for the literal read (one request per subject); a run with more
/// (garbage published on many subjects) is read by its wildcard.
const MAX_LANES: usize = 64;

/// The sequence a stored message of `run` was checked on run-wide: its
/// `Nats-Expected-Last-Subject-Sequence`, when its `-Subject` is the run's whole tree. The
/// broker stores a message so checked only if the run's last message then was at that
/// sequence, and keeps the headers with it, so whoever reads the message reads the check.
fn checked_after(headers: Option<&HeaderMap>, run: &RunId) -> Option<u64> {
    let headers = headers?;
    let scope = headers
        .get(wire::EXPECTED_LAST_SUBJECT_SEQ_SUBJECT)?
        .as_str();
    if scope != subjects::run_all(run) {
        return None;
    }
    headers
        .get(wire::EXPECTED_LAST_SUBJECT_SEQ)?
        .as_str()
        .parse()
        .ok()
}

/// The latest message of one subject ([`Journal::latest_per_subject`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Latest {
    pub seq: u64,
    pub subject: String,
    pub payload: Bytes,
    /// A KV bucket's delete or purge marker (`KV-Operation`): the entry is gone.
    pub deleted: bool,
}

/// A run's last event, as [`Journal::last_event`] finds it.
#[derive(Debug, Clone, PartialEq)]
pub struct LastEvent {
    pub seq: u64,
    /// When the stream stored it (the server's clock; now, if the server did not say).
    pub stored_at: time::OffsetDateTime,
    /// Its type, from the subject (`None` for a subject outside the layout).
    pub event_type: Option<EventType>,
    /// The envelope (`None` if the payload does not parse).
    pub envelope: Option<Envelope>,
}

/// What [`Journal::read_at_most`] and [`Journal::read_with_set_aside`] return.
#[derive(Debug, Clone, Default)]
pub struct ReadPage {
    /// The well-formed events, in order.
    pub events: Vec<Recorded>,
    /// The messages in the same range that are not events of the run, in order.
    pub set_aside: Vec<SetAside>,
    /// The run has events after the last one returned (as of the read).
    pub more: bool,
    /// Messages that hold their data by reference, resolved before the page is returned.
    by_reference: Vec<StoredMessage>,
}

impl ReadPage {
    /// Adds what `decode` made of a message.
    fn push(&mut self, run: &RunId, d: Decoded) {
        match d {
            Decoded::Event(r) => self.events.push(r),
            Decoded::Skip => {}
            Decoded::SetAside(a) => {
                tracing::debug!(run_id = %run, seq = a.seq, reason = %a.reason, "journal message set aside");
                let at = self.set_aside.partition_point(|s| s.seq < a.seq);
                self.set_aside.insert(at, a);
            }
            Decoded::ByReference(m) => self.by_reference.push(m),
        }
    }
}

/// A read in progress ([`Journal::read_at_most`]): what came back so far.
struct Reading<'a> {
    run: &'a RunId,
    out: ReadPage,
    /// The last sequence taken (the read's `after` before any).
    reached: u64,
    /// The first sequence taken (0 before any).
    first: u64,
    /// Messages taken (events, set aside and skipped alike).
    fetched: u64,
    max: usize,
}

impl Reading<'_> {
    /// Takes the next message of a page, in order: one at or before `reached` (a page asked
    /// again from an earlier sequence) is left out, and nothing more once `max` events are in.
    fn take(&mut self, m: StoredMessage) {
        if m.seq <= self.reached || self.full() {
            return;
        }
        self.reached = m.seq;
        if self.fetched == 0 {
            self.first = m.seq;
        }
        self.fetched += 1;
        self.out.push(self.run, decode(self.run, m));
    }

    fn full(&self) -> bool {
        self.out.events.len() + self.out.by_reference.len() >= self.max
    }
}

/// Whether a run whose messages from `first` number `count` and end at `last` is spread over
/// enough of the stream to be read by its literal subjects.
fn spread(first: u64, count: u64, last: u64) -> bool {
    let span = last.saturating_sub(first).saturating_add(1);
    first > 0 && span >= SPREAD_MIN_SPAN && span / count.max(1) >= SPREAD_RATIO
}

/// Handle on the journal stream. Cheap to clone (it clones a NATS client handle).
#[derive(Debug, Clone)]
pub struct Journal {
    client: Client,
    js: async_nats::jetstream::Context,
    timeout: Duration,
    /// The one reply subscription of this journal's (and its clones') batched reads.
    inbox: wire::BatchInbox,
    /// The W3C `traceparent` of the span an append is made in, put on the appended messages as
    /// the `traceparent` header, so the service that handles one (the tool runner a
    /// `tool.requested`) continues the trace under it ([`Journal::with_trace_context`]).
    trace_context: Option<fn() -> Option<String>>,
    /// Where events larger than [`blob::INLINE_MAX`] keep their data.
    blobs: Blobs,
}

/// The header that carries a message's W3C trace context.
pub const TRACEPARENT_HEADER: &str = "traceparent";

impl Journal {
    /// A journal over `KEDGE_RUNS` (which [`crate::ensure_layout`] creates or verifies).
    pub fn new(client: Client) -> Self {
        let js = async_nats::jetstream::new(client.clone());
        let inbox = wire::BatchInbox::new(client.clone());
        Self {
            blobs: Blobs::with_inbox(client.clone(), inbox.clone(), DEFAULT_TIMEOUT),
            inbox,
            client,
            js,
            timeout: DEFAULT_TIMEOUT,
            trace_context: None,
        }
    }

    /// Puts `current()` (the trace context of the span an append is made in, `None` when spans
    /// are not exported) on every appended message as its [`TRACEPARENT_HEADER`].
    pub fn with_trace_context(mut self, current: fn() -> Option<String>) -> Self {
        self.trace_context = Some(current);
        self
    }

    fn trace_header(&self, headers: &mut HeaderMap) {
        if let Some(traceparent) = self.trace_context.and_then(|current| current()) {
            headers.insert(TRACEPARENT_HEADER, traceparent.as_str());
        }
    }

    /// Sets the timeout of each broker request.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self.blobs = Blobs::with_inbox(self.client.clone(), self.inbox.clone(), timeout);
        self
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The object store where large events keep their data ([`crate::blob`]).
    pub fn blobs(&self) -> &Blobs {
        &self.blobs
    }

    /// The blobs the run's journal refers to (messages that hold their data by reference),
    /// with their sequences, without reading the blobs: e.g. to check that a blob a caller asks
    /// for is the run's before serving it.
    pub async fn blob_references(&self, run: &RunId) -> Result<Vec<(u64, BlobRef)>, JournalError> {
        let page = self
            .read_stored(run, &subjects::run_all(run), 0, usize::MAX, None)
            .await?;
        Ok(page
            .by_reference
            .iter()
            .filter_map(|m| blob::reference_of(&m.payload).map(|r| (m.seq, r)))
            .collect())
    }

    /// Resolves the messages of a page that hold their data by reference, putting each event
    /// (or what is set aside) in its place.
    async fn resolve_page(&self, run: &RunId, page: &mut ReadPage) -> Result<(), JournalError> {
        for m in std::mem::take(&mut page.by_reference) {
            let decoded = self.resolve(run, m).await?;
            match decoded {
                Decoded::Event(r) => {
                    let at = page.events.partition_point(|e| e.seq < r.seq);
                    page.events.insert(at, r);
                }
                other => page.push(run, other),
            }
        }
        Ok(())
    }

    /// Exactly the run's events with a stream sequence greater than `after`, in order.
    ///
    /// Mechanism (chosen by measurement, see the crate docs): batched direct gets over
    /// `agent.run.<id>.>`, sent concurrently with one leader-answered "last message of the run"
    /// lookup. Direct gets may be answered by a replica that trails the leader; if the pages end
    /// before the leader's last sequence, the replica is asked again and, failing that, the rest
    /// is read from the leader. So every event acknowledged before the call is returned.
    /// Returns promptly (one round trip) when there is nothing after `after`.
    ///
    /// Messages that are not events of the run are left out (see [`SetAside`]); use
    /// [`Journal::read_with_set_aside`] to see them.
    pub async fn read(&self, run: &RunId, after: u64) -> Result<Vec<Recorded>, JournalError> {
        Ok(self.read_at_most(run, after, usize::MAX).await?.events)
    }

    /// [`Journal::read`], with the messages set aside in the same range: what the run's
    /// decision writer folds (a set-aside decision still moved the run's last decision).
    pub async fn read_with_set_aside(
        &self,
        run: &RunId,
        after: u64,
    ) -> Result<ReadPage, JournalError> {
        self.read_at_most(run, after, usize::MAX).await
    }

    /// The run's events after `after`, complete through sequence `through`: a message of the
    /// run the caller knows is acknowledged (the wake it handles, its own last append). Reads
    /// [`Journal::read_with_set_aside`] would return except what was acknowledged after
    /// `through` and not yet applied by the replica that answered — which is what a decision
    /// writer needs (its appends carry the concurrency check), at one round trip instead of
    /// two: no leader lookup. A replica that trails `through` is asked again, then the leader.
    pub async fn read_through(
        &self,
        run: &RunId,
        after: u64,
        through: u64,
    ) -> Result<ReadPage, JournalError> {
        self.read_filtered(
            run,
            &subjects::run_all(run),
            after,
            usize::MAX,
            Some(through),
        )
        .await
    }

    /// The run's events after `after` through the delivered message `wake`, read by sequence,
    /// when the two links of a chain hold: `wake` was stored checked run-wide on the run's last
    /// message being some `prev`, and `prev` (read by its sequence: one direct get, no subject
    /// walk and no count of what matches) checked on it being `after`. Then, as far as the
    /// broker's checks say, `prev` and `wake` are the run's only messages in `(after, wake]`
    /// (the tool service chains `tool.started` on the `tool.requested` it runs and
    /// `tool.result` on that). `None` when a link is missing or does not fit, when either
    /// message is not a well-formed event held inline, or when the replica that answered has
    /// not stored `prev` yet: read the usual way. The caller notes the sequences stepped over,
    /// as after its own checked appends (the same trust in the same check).
    pub async fn read_chained(
        &self,
        run: &RunId,
        after: u64,
        wake: Delivered<'_>,
    ) -> Result<Option<ReadPage>, JournalError> {
        let Some(prev) = checked_after(wake.headers, run) else {
            return Ok(None);
        };
        if prev <= after || prev >= wake.seq {
            return Ok(None);
        }
        let stored = wire::direct_seq(&self.client, RUNS_STREAM, prev, self.timeout)
            .await
            .map_err(|e| JournalError::from_wire("read a chained message", e))?;
        let Some(stored) =
            stored.filter(|m| m.seq == prev && checked_after(Some(&m.headers), run) == Some(after))
        else {
            return Ok(None);
        };
        let delivered = StoredMessage {
            seq: wake.seq,
            subject: wake.subject.to_owned(),
            headers: wake.headers.cloned().unwrap_or_default(),
            payload: wake.payload.clone(),
        };
        let mut page = ReadPage::default();
        for m in [stored, delivered] {
            match decode(run, m) {
                Decoded::Event(r) => page.events.push(r),
                Decoded::Skip | Decoded::SetAside(_) | Decoded::ByReference(_) => return Ok(None),
            }
        }
        Ok(Some(page))
    }

    /// The first `max` of the run's events after `after` (all of them if fewer), in order, and
    /// whether more may follow. A page of a long run costs a page, not the rest of the run.
    /// The page also lists the messages set aside up to its last event.
    pub async fn read_at_most(
        &self,
        run: &RunId,
        after: u64,
        max: usize,
    ) -> Result<ReadPage, JournalError> {
        self.read_filtered(run, &subjects::run_all(run), after, max, None)
            .await
    }

    /// Exactly the run's events of one type (`agent.run.<id>.<d|i>.<type>`), in order, with
    /// the same consistency as [`Journal::read`]; costs what those events cost, not the whole
    /// journal. E.g. the `tool.requested` decisions of a run, or its `run.created` (none: the
    /// run does not exist).
    pub async fn read_type(
        &self,
        run: &RunId,
        event_type: EventType,
    ) -> Result<Vec<Recorded>, JournalError> {
        let filter = subjects::event(run, event_type);
        Ok(self
            .read_filtered(run, &filter, 0, usize::MAX, None)
            .await?
            .events)
    }

    /// [`Journal::read_at_most`] over `filter`, a subject filter inside the run's tree.
    ///
    /// Cost does not grow with the stream's history (`cargo bench -p kedge-journal
    /// --bench journal -- --history 1000,10000,100000`). A batched direct get asks the server
    /// for the next `batch` messages matching the filter; when fewer match, it looks for the one
    /// after the last match, and for a wildcard filter on a stream with many subjects (more than
    /// 64k: ~10k runs) nats-server 2.15 cannot skip blocks for that search, so it walks every
    /// message block from the run's last event to the end of the stream: a read of an old run
    /// cost tens of ms at 100k runs. So a wildcard read never asks for more than match:
    ///
    /// 1. a probe of one message from `after + 1`, sent with the leader's "last message of the
    ///    run" lookup; its end-of-batch status carries `Nats-Num-Pending`, the number of matching
    ///    messages after it (as the responder sees the stream);
    /// 2. pages of exactly `min(pending, page)` messages, each reporting what is pending after
    ///    it. From sequence 1 (`after == 0`) the first page starts over at 1 rather than after
    ///    the probe: the server counts what is pending from the stream's start out of its subject
    ///    index, but from a later sequence by visiting message blocks.
    ///
    /// 3. a run spread over history (its messages from the probe's on span at least
    ///    `SPREAD_MIN_SPAN` sequences and `SPREAD_RATIO` per message, e.g. a long-lived run
    ///    among many others) is read instead by its literal subjects, merged by sequence
    ///    (`Journal::read_literal`): the wildcard's cost is the messages between the run's,
    ///    the literal subjects' only those between two of a subject's messages in one block.
    ///
    /// A literal filter ([`Journal::read_type`]) needs no probe: the server skips blocks for it.
    /// The consistency argument is unchanged: pages may come from a replica that trails the
    /// leader; the read is complete only when it reaches the leader's last sequence, asked in the
    /// same round trip as the probe.
    ///
    /// With `through` (see [`Journal::read_through`]) the leader is not asked: the read is
    /// complete once it reaches that sequence and nothing is pending. Its first request asks
    /// for a few messages at once when `after` is near `through` (a recent read of a live
    /// run, where the server's search past the last match covers only the stream's tail).
    async fn read_filtered(
        &self,
        run: &RunId,
        filter: &str,
        after: u64,
        max: usize,
        through: Option<u64>,
    ) -> Result<ReadPage, JournalError> {
        let mut page = self.read_stored(run, filter, after, max, through).await?;
        self.resolve_page(run, &mut page).await?;
        Ok(page)
    }

    /// [`Journal::read_filtered`] before the messages that hold their data by reference are
    /// resolved.
    async fn read_stored(
        &self,
        run: &RunId,
        filter: &str,
        after: u64,
        max: usize,
        through: Option<u64>,
    ) -> Result<ReadPage, JournalError> {
        let op = "read";
        let max = max.max(1);
        let page_size = READ_PAGE.min(max);
        let t = self.timeout;
        let wildcard = filter.split('.').any(|token| token == ">" || token == "*");
        let mut r = Reading {
            run,
            out: ReadPage::default(),
            reached: after,
            first: 0,
            fetched: 0,
            max,
        };
        // A read from far behind a known end (the step service's cached fold of a run that
        // slept while the stream grew, woken by a timer or an answer): the probe below would
        // walk every message since `after` to find the next; the run's literal subjects skip
        // the blocks it is not in. What the literal read leaves goes on as below.
        if let Some(through) = through
            && wildcard
            && after > 0
            && through.saturating_sub(after) >= SPREAD_MIN_SPAN
            && self
                .read_literal(&mut r, filter, after.saturating_add(1), page_size, through)
                .await?
        {
            r.out.more = r.reached < through;
            return Ok(r.out);
        }
        let leader_q = serde_json::json!({ "last_by_subj": filter });
        let first_batch = match through {
            _ if !wildcard => page_size,
            Some(through) if after > 0 && through.saturating_sub(after) <= NEAR_TAIL => {
                NEAR_BATCH.min(page_size)
            }
            _ => 1,
        };
        let leader = async {
            match through {
                Some(through) => Ok(Some(through)),
                None => wire::leader_get(&self.client, RUNS_STREAM, leader_q.clone(), t)
                    .await
                    .map(|m| m.map(|m| m.seq)),
            }
        };
        let (leader_last, first) = futures::join!(
            leader,
            wire::direct_batch(
                &self.inbox,
                RUNS_STREAM,
                filter,
                after.saturating_add(1),
                first_batch,
                t,
                |m| r.take(m),
            ),
        );
        let map = |e: WireError| JournalError::from_wire(op, e);
        let mut leader_last = leader_last.map_err(map)?.unwrap_or(0);
        let mut pending = first.map_err(map)?;
        let mut before = after;
        let mut stale = 0;
        // A run spread over history: read by its literal subjects. What it leaves (a replica
        // that trails, too many subjects) the loop below reads, probing first.
        if wildcard
            && !r.full()
            && pending > 0
            && spread(r.first, r.fetched.saturating_add(pending), leader_last)
        {
            let from = if after == 0 {
                1
            } else {
                r.reached.saturating_add(1)
            };
            if self
                .read_literal(&mut r, filter, from, page_size, leader_last)
                .await?
            {
                pending = 0;
            } else {
                pending = 1;
                before = after;
            }
        }
        loop {
            // A prefix of what follows `after` is gap-free whoever answered.
            if r.full() {
                r.out.more = r.reached < leader_last;
                return Ok(r.out);
            }
            if pending == 0 && r.reached >= leader_last {
                r.out.more = false;
                return Ok(r.out);
            }
            let mut from = r.reached.saturating_add(1);
            let batch = if pending == 0 || r.reached == before {
                // The replica that answered trails the leader (or made no progress).
                stale += 1;
                if stale > STALE_RETRIES {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(u64::from(stale))).await;
                // Probe again: the answer says how many to ask for.
                1
            } else {
                let want = usize::try_from(pending)
                    .unwrap_or(usize::MAX)
                    .min(page_size);
                let again = usize::try_from(r.fetched).unwrap_or(usize::MAX);
                if wildcard && after == 0 && again.saturating_add(want) <= page_size {
                    // Start over at 1: what is pending from there is counted from the subject
                    // index (see above); the messages already read are skipped.
                    from = 1;
                    again + want
                } else {
                    want
                }
            };
            before = r.reached;
            pending = wire::direct_batch(&self.inbox, RUNS_STREAM, filter, from, batch, t, |m| {
                r.take(m)
            })
            .await
            .map_err(map)?;
        }
        if through.is_some() {
            // Known only as a lower bound so far: ask the leader where the run ends.
            let last = wire::leader_get(&self.client, RUNS_STREAM, leader_q, t)
                .await
                .map_err(map)?;
            leader_last = leader_last.max(last.map_or(0, |m| m.seq));
        }
        tracing::debug!(run_id = %run, reached = r.reached, leader_last, "read: finishing from the leader");
        while r.reached < leader_last && !r.full() {
            let q =
                serde_json::json!({ "seq": r.reached.saturating_add(1), "next_by_subj": filter });
            let Some(m) = wire::leader_get(&self.client, RUNS_STREAM, q, t)
                .await
                .map_err(map)?
            else {
                break;
            };
            r.take(m);
        }
        r.out.more = r.reached < leader_last;
        Ok(r.out)
    }

    /// Reads on from `r.reached` by the literal subjects under `filter` (the run's tree), merged
    /// by sequence: for a run whose messages are spread over much of the stream.
    ///
    /// Why (nats-server 2.15, `filestore.go`): to find the next match of a wildcard,
    /// `LoadNextMsg` walks message by message through every block between two of the run's
    /// messages (`firstMatching` scans a block linearly once its cache is loaded and it holds
    /// many subjects, and past 64k subjects `checkSkipFirstBlock` does not skip blocks for a
    /// wildcard), so a run that lived while many others came and went costs the messages its
    /// life spans. For a literal subject the server asks each block's subject index
    /// (`mb.fss`: first and last sequence of each subject in the block) and does not look at a
    /// block's messages unless the subject is in it; it jumps to the subject's first block
    /// (`psim` `fblk`) and stops after its last (`lblk`), and the batch's pending count is
    /// taken from the same indexes. Inside a block it still walks from one match to the next.
    ///
    /// 1. `multi_last` on `filter` lists the run's subjects with their last sequences, and the
    ///    sequence through which that holds (`Nats-UpTo-Sequence`): one request, answered from
    ///    the subject tree;
    /// 2. one batched direct get per subject from `from`, all at once, then more pages of a
    ///    subject only as the merge reaches its last message; messages are taken in sequence
    ///    order up to the smallest sequence every unfinished subject has reached.
    ///
    /// Complete (`true`) when the subject list holds through `leader_last` and every subject
    /// was read through its last message as listed: a replica stores a prefix of the stream,
    /// so a subject read through a sequence has nothing missing before it, and nothing after
    /// the list's sequence is taken (a subject that appeared since is not in the list).
    /// `false` leaves the rest (from `r.reached`) to the caller's read by wildcard.
    async fn read_literal(
        &self,
        r: &mut Reading<'_>,
        filter: &str,
        from: u64,
        page: usize,
        leader_last: u64,
    ) -> Result<bool, JournalError> {
        struct Lane {
            subject: String,
            /// The subject's last sequence, as listed.
            last: u64,
            /// Where its next page starts.
            from: u64,
            /// The last sequence read of it (0: none yet).
            read: u64,
            done: bool,
        }
        let t = self.timeout;
        let map = |e: WireError| JournalError::from_wire("read", e);
        let mut lanes: Vec<Lane> = Vec::new();
        let listed = wire::direct_subjects_last(
            &self.inbox,
            RUNS_STREAM,
            filter,
            r.reached.saturating_add(1),
            MAX_LANES + 1,
            t,
            |m| {
                lanes.push(Lane {
                    subject: m.subject,
                    last: m.seq,
                    from,
                    read: 0,
                    done: false,
                })
            },
        )
        .await;
        let up_to = match listed {
            Ok(eob) if eob.pending == 0 && lanes.len() <= MAX_LANES => match eob.up_to {
                Some(up_to) if up_to >= leader_last => up_to,
                _ => return Ok(false),
            },
            Ok(_) => return Ok(false),
            // More subjects than the server lists at once.
            Err(WireError::Api(e)) if e.code == 413 => return Ok(false),
            Err(e) => return Err(map(e)),
        };
        // A bounded read asks each subject for its share of the page (a subject read ahead
        // past what the page takes costs the messages walked to find it); more as it is taken.
        let batch = if lanes.is_empty() {
            page
        } else {
            page.div_ceil(lanes.len()).max(2).min(page)
        };
        let batch = if page < READ_PAGE { batch } else { page };
        // Taken in sequence order; a message is read by exactly one subject.
        let mut merged: std::collections::BTreeMap<u64, StoredMessage> = Default::default();
        loop {
            // Every unfinished subject whose messages read so far are all taken reads a page.
            let reached = r.reached;
            let pages = lanes
                .iter()
                .enumerate()
                .filter(|(_, lane)| !lane.done && lane.read <= reached)
                .map(|(i, lane)| async move {
                    let mut got = Vec::new();
                    let pending = wire::direct_batch(
                        &self.inbox,
                        RUNS_STREAM,
                        &lane.subject,
                        lane.from,
                        batch,
                        t,
                        |m| got.push(m),
                    )
                    .await;
                    (i, pending.map(|pending| (got, pending)))
                });
            for (i, result) in futures::future::join_all(pages).await {
                let (got, pending) = result.map_err(map)?;
                let lane = &mut lanes[i];
                let progress = lane.read;
                for m in got {
                    if m.seq > up_to {
                        // After the list: another subject may hold messages before it.
                        lane.done = true;
                        break;
                    }
                    if m.seq >= lane.from && m.subject == lane.subject {
                        lane.from = m.seq.saturating_add(1);
                        lane.read = m.seq;
                        merged.insert(m.seq, m);
                    }
                }
                if pending == 0 {
                    lane.done = true;
                }
                if lane.done && lane.read < lane.last {
                    // The replica that answered trails the one that listed the subjects.
                    return Ok(false);
                }
                if !lane.done && lane.read == progress {
                    // Pending, but nothing came: leave it to the wildcard read.
                    return Ok(false);
                }
            }
            let through = lanes
                .iter()
                .filter(|lane| !lane.done)
                .map(|lane| lane.read)
                .min()
                .unwrap_or(u64::MAX);
            while let Some(entry) = merged.first_entry() {
                if *entry.key() > through {
                    break;
                }
                r.take(entry.remove());
                if r.full() {
                    return Ok(true);
                }
            }
            if through == u64::MAX {
                return Ok(true);
            }
        }
    }

    /// The latest message of each subject of `stream` under `filter` (wildcards allowed):
    /// e.g. every entry of a KV bucket under a key prefix, for a stream that keeps one message
    /// per subject. Read by batched direct gets in stream order, each page answered as one
    /// snapshot of the stream: a subject written while the pages are read moves to a later
    /// sequence, which a later page reads, so none is missed, and a subject met twice keeps
    /// its later message. (An ephemeral consumer has no such guarantee: the pending count it
    /// reports is kept as messages come and go, and a rewrite in between can make it say 0
    /// while a subject is still to come.) A page that finds nothing where the one before said
    /// more was pending came from a replica that trails: asked again, then of the leader.
    /// Costs the messages under `filter` and those of other subjects between them.
    pub async fn latest_per_subject(
        &self,
        stream: &str,
        filter: &str,
    ) -> Result<Vec<Latest>, JournalError> {
        let map = |e: WireError| JournalError::from_wire("read the latest per subject", e);
        let mut latest: HashMap<String, Latest> = HashMap::new();
        let mut keep = |m: StoredMessage| {
            let found = Latest {
                seq: m.seq,
                deleted: matches!(m.header(wire::KV_OPERATION), Some("DEL" | "PURGE")),
                subject: m.subject,
                payload: m.payload,
            };
            match latest.get(&found.subject) {
                Some(earlier) if earlier.seq >= found.seq => {}
                _ => {
                    latest.insert(found.subject.clone(), found);
                }
            }
        };
        let mut from = 1u64;
        let mut owed = false;
        let mut stale = 0;
        loop {
            let mut last = None;
            let pending = wire::direct_batch(
                &self.inbox,
                stream,
                filter,
                from,
                READ_PAGE,
                self.timeout,
                |m| {
                    last = Some(m.seq);
                    keep(m);
                },
            )
            .await
            .map_err(map)?;
            match last {
                Some(seq) => {
                    from = seq.saturating_add(1);
                    stale = 0;
                }
                None if owed && stale < STALE_RETRIES => {
                    stale += 1;
                    tokio::time::sleep(Duration::from_millis(u64::from(stale))).await;
                    continue;
                }
                None if owed => {
                    // The leader reads on, one message at a time.
                    loop {
                        let q = serde_json::json!({ "seq": from, "next_by_subj": filter });
                        let Some(m) = wire::leader_get(&self.client, stream, q, self.timeout)
                            .await
                            .map_err(map)?
                        else {
                            break;
                        };
                        from = m.seq.saturating_add(1);
                        keep(m);
                    }
                    break;
                }
                None => break,
            }
            if pending == 0 {
                break;
            }
            owed = true;
        }
        let mut out: Vec<Latest> = latest.into_values().collect();
        out.sort_by_key(|l| l.seq);
        Ok(out)
    }

    /// Every run in the journal (each subject `agent.run.<id>.d.run.created`), from the
    /// stream's subject list: no consumer is made and no message is read.
    pub async fn run_ids(&self) -> Result<Vec<RunId>, JournalError> {
        let unavailable = |e: &dyn std::fmt::Display| JournalError::Unavailable {
            op: "list runs",
            reason: e.to_string(),
        };
        let stream = self
            .js
            .get_stream_no_info(RUNS_STREAM)
            .await
            .map_err(|e| unavailable(&e))?;
        let mut created = stream
            .info_with_subjects("agent.run.*.d.run.created")
            .await
            .map_err(|e| unavailable(&e))?;
        let mut runs = Vec::new();
        while let Some(entry) = created.next().await {
            let (subject, _) = entry.map_err(|e| unavailable(&e))?;
            if let Some(parsed) = subjects::parse_event(&subject) {
                runs.push(parsed.run_id);
            }
        }
        Ok(runs)
    }

    /// The stream's last sequence (0 when empty), from the stream's state: where a
    /// [`Journal::runs_touched_after`] that follows should start.
    pub async fn stream_last_seq(&self) -> Result<u64, JournalError> {
        let info = wire::api(
            &self.client,
            &format!("STREAM.INFO.{RUNS_STREAM}"),
            Bytes::new(),
            self.timeout,
        )
        .await
        .map_err(|e| JournalError::from_wire("stream state", e))?;
        Ok(info["state"]["last_seq"].as_u64().unwrap_or(0))
    }

    /// The runs with at least one message in the journal after sequence `after`, and the
    /// sequence through which they were looked for (`after` when there is nothing new). Costs
    /// what was appended since `after`, not the journal's history: an ordered consumer over
    /// `agent.run.>` that delivers headers only (no payload), drained up to the stream's last
    /// sequence as of the call. What the reconciler uses to keep its set of runs to look at.
    pub async fn runs_touched_after(
        &self,
        after: u64,
    ) -> Result<(std::collections::BTreeSet<RunId>, u64), JournalError> {
        let op = "runs touched";
        let mut runs = std::collections::BTreeSet::new();
        let target = self.stream_last_seq().await?;
        if target <= after {
            return Ok((runs, after));
        }
        let stream =
            self.js
                .get_stream_no_info(RUNS_STREAM)
                .await
                .map_err(|e| JournalError::Rejected {
                    op,
                    reason: e.to_string(),
                })?;
        let consumer = stream
            .create_consumer(OrderedConfig {
                filter_subject: "agent.run.>".to_owned(),
                headers_only: true,
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: after.saturating_add(1),
                },
                ..Default::default()
            })
            .await
            .map_err(|e| consumer_error(op, e))?;
        // Messages removed since `target` was read (a retention purge of the stream's last
        // runs) never arrive: nothing left to deliver means everything through `target` is seen.
        if consumer.cached_info().num_pending == 0 {
            return Ok((runs, target));
        }
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| JournalError::Unavailable {
                op,
                reason: e.to_string(),
            })?;
        let mut through = after;
        while through < target {
            let next = tokio::time::timeout(self.timeout, messages.next()).await;
            let msg = match next {
                Err(_) => {
                    return Err(JournalError::Unavailable {
                        op,
                        reason: format!("no message after {through} (waiting for {target})"),
                    });
                }
                Ok(None) => {
                    return Err(JournalError::Unavailable {
                        op,
                        reason: "the consumer ended".to_owned(),
                    });
                }
                Ok(Some(Err(e))) => return Err(ordered_error(e)),
                Ok(Some(Ok(msg))) => msg,
            };
            let info = msg.info().map_err(|e| JournalError::Rejected {
                op,
                reason: format!("message without JetStream metadata: {e}"),
            })?;
            let (seq, last) = (info.stream_sequence, info.pending == 0);
            if seq <= through {
                continue;
            }
            through = seq;
            runs.extend(touched_run(msg.subject.as_str()));
            if last && seq < target {
                // "Nothing more" before `target`: what followed was removed, or the count is
                // short. The broker counts a new message into the consumer's pending a moment
                // after storing it but takes a removed one out at once, so a message appended
                // and purged meanwhile leaves the count one short: the stream says which.
                self.touched_through(&mut runs, seq, target).await?;
                through = target;
            }
        }
        Ok((runs, through))
    }

    /// The runs of the rest of [`Journal::runs_touched_after`], from `after` through `target`,
    /// asked of the stream's leader message by message (its next message on `agent.run.>` each
    /// time). Only what the consumer's pending count left out: normally one request that finds
    /// nothing before `target`.
    async fn touched_through(
        &self,
        runs: &mut std::collections::BTreeSet<RunId>,
        mut after: u64,
        target: u64,
    ) -> Result<(), JournalError> {
        while after < target {
            let q = serde_json::json!({ "seq": after.saturating_add(1), "next_by_subj": "agent.run.>" });
            match wire::leader_get(&self.client, RUNS_STREAM, q, self.timeout)
                .await
                .map_err(|e| JournalError::from_wire("runs touched", e))?
            {
                Some(m) if m.seq <= target => {
                    after = m.seq;
                    runs.extend(touched_run(&m.subject));
                }
                _ => break,
            }
        }
        Ok(())
    }

    /// Removes the run's journal (`agent.run.<id>.>`) from the stream, up to and including
    /// sequence `through`: for retention of finished runs only (`kedge_runtime::retention`
    /// checks that first, on the journal it read through `through`). A message that landed
    /// after that read (an input reviving the run) is not removed. Returns how many messages
    /// were removed (0 when there are none: purging twice is harmless). Needs the
    /// `$JS.API.STREAM.PURGE` permission, which no service user has.
    pub async fn purge_run(&self, run: &RunId, through: u64) -> Result<u64, JournalError> {
        wire::purge(
            &self.client,
            RUNS_STREAM,
            &subjects::run_all(run),
            Some(through.saturating_add(1)),
            self.timeout,
        )
        .await
        .map_err(|e| JournalError::from_wire("purge", e))
    }

    /// Sequence of the run's last event of any kind; `None` for a run with no events.
    /// By direct get, so in a cluster it may trail the leader by the replication apply delay
    /// (a decision append's own check is authoritative).
    pub async fn last_seq(&self, run: &RunId) -> Result<Option<u64>, JournalError> {
        let last = wire::direct_last(
            &self.client,
            RUNS_STREAM,
            &subjects::run_all(run),
            self.timeout,
        )
        .await
        .map_err(|e| JournalError::from_wire("last sequence", e))?;
        Ok(last.map(|m| m.seq))
    }

    /// The run's last event of any kind, for a quick look without reading the journal: its
    /// sequence, its type (from the subject), its envelope (`None` if it does not parse) and when
    /// the stream stored it (the server's clock). `None` for a run with no events. Same
    /// consistency as [`Journal::last_seq`].
    pub async fn last_event(&self, run: &RunId) -> Result<Option<LastEvent>, JournalError> {
        let last = wire::direct_last(
            &self.client,
            RUNS_STREAM,
            &subjects::run_all(run),
            self.timeout,
        )
        .await
        .map_err(|e| JournalError::from_wire("last event", e))?;
        let Some(m) = last else { return Ok(None) };
        let envelope = match Envelope::from_json_bytes(&m.payload) {
            Ok(envelope) => Some(envelope),
            Err(_) => match self.open(&m.payload).await {
                Ok(envelope) => Some(envelope),
                Err(e) if e.kind() == ErrorKind::Unavailable => return Err(e),
                Err(_) => None,
            },
        };
        Ok(Some(m).map(|m| LastEvent {
            seq: m.seq,
            stored_at: m
                .header("Nats-Time-Stamp")
                .and_then(|t| {
                    time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
                        .ok()
                })
                .unwrap_or_else(time::OffsetDateTime::now_utc),
            event_type: subjects::parse_event(&m.subject).map(|p| p.event_type),
            envelope,
        }))
    }

    /// Whether the run has at least one event of `event_type` (one direct get of that type's
    /// subject; e.g. has a cancel been requested).
    pub async fn has_event(
        &self,
        run: &RunId,
        event_type: EventType,
    ) -> Result<bool, JournalError> {
        let last = wire::direct_last(
            &self.client,
            RUNS_STREAM,
            &subjects::event(run, event_type),
            self.timeout,
        )
        .await
        .map_err(|e| JournalError::from_wire("event lookup", e))?;
        Ok(last.is_some())
    }

    /// The run's last event of each of `types` (one batched direct get, `multi_last`), in
    /// stream order; a type the run has none of is left out, as is a message that is not an
    /// event of the run. Same consistency as [`Journal::has_event`]: e.g. a runner's one look
    /// at a run before an operation (its `run.created`, a `cancel.requested`, its last
    /// `tool.attempt`).
    pub async fn last_of(
        &self,
        run: &RunId,
        types: &[EventType],
    ) -> Result<Vec<Recorded>, JournalError> {
        let filters: Vec<String> = types.iter().map(|t| subjects::event(run, *t)).collect();
        let mut out = Vec::with_capacity(types.len());
        if filters.is_empty() {
            return Ok(out);
        }
        let mut by_reference = Vec::new();
        wire::direct_multi_last(
            &self.inbox,
            RUNS_STREAM,
            &filters,
            self.timeout,
            |m| match decode(run, m) {
                Decoded::Event(r) => out.push(r),
                Decoded::ByReference(m) => by_reference.push(m),
                Decoded::Skip | Decoded::SetAside(_) => {}
            },
        )
        .await
        .map_err(|e| JournalError::from_wire("last events", e))?;
        for m in by_reference {
            if let Decoded::Event(r) = self.resolve(run, m).await? {
                let at = out.partition_point(|e| e.seq < r.seq);
                out.insert(at, r);
            }
        }
        Ok(out)
    }

    /// Sequence of the run's last decision; 0 if it has none (the `expected_last` of its first
    /// decision). Same consistency as [`Journal::last_seq`].
    pub async fn last_decision_seq(&self, run: &RunId) -> Result<u64, JournalError> {
        let last = wire::direct_last(
            &self.client,
            RUNS_STREAM,
            &subjects::run_decisions(run),
            self.timeout,
        )
        .await
        .map_err(|e| JournalError::from_wire("last decision sequence", e))?;
        Ok(last.map_or(0, |m| m.seq))
    }
}

/// The run a message on `agent.run.<id>.…` belongs to; `None` when its third token is not a run
/// id (then it is not a run's).
fn touched_run(subject: &str) -> Option<RunId> {
    subject
        .split('.')
        .nth(2)
        .and_then(|id| id.parse::<RunId>().ok())
}

/// Removes the messages of `stream` on subjects matching `filter` (a stream purge with a subject
/// filter); how many were removed. What retention uses for the run-scoped subjects of other
/// streams and buckets (`$KV.<bucket>.<key>`, timers, rejections).
pub async fn purge(
    client: &Client,
    stream: &str,
    filter: &str,
    timeout: Duration,
) -> Result<u64, JournalError> {
    if filter.is_empty()
        || filter.split('.').any(str::is_empty)
        || filter.contains(char::is_whitespace)
    {
        return Err(JournalError::BadRequest(format!(
            "`{filter}` is not a subject filter"
        )));
    }
    wire::purge(client, stream, filter, None, timeout)
        .await
        .map_err(|e| JournalError::from_wire("purge", e))
}

/// A run and a decision of it, for the unit tests of the journal's modules.
#[cfg(test)]
mod fixtures {
    use kedge_core::event::{RunStarted, Timestamp};
    use kedge_core::{Draft, Envelope, Event, RunId};

    pub(super) fn run() -> RunId {
        "run_j1".parse().expect("valid")
    }

    pub(super) fn decision(run: &RunId) -> Envelope {
        Envelope::new(
            run.clone(),
            Timestamp::now(),
            Draft::new(Event::RunStarted(RunStarted {})),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_run_spread_far_and_thin_is_read_by_its_subjects() {
        // A compact run, one written side by side with others, a run near the tail.
        assert!(!spread(1_000, 50, 1_049));
        assert!(!spread(1_000, 50, 1_000 + 64 * 50));
        assert!(!spread(1_000, 1, 1_000 + SPREAD_MIN_SPAN - 2));
        // A 50-event run over 10k other runs (5 messages each): as dense as a block's worth of
        // messages, where the subjects' walks inside blocks cost more than the wildcard's.
        assert!(!spread(1_000, 50, 51_000));
        // Over 30k and 100k other runs.
        assert!(spread(1_000, 50, 151_000));
        assert!(spread(1_000, 50, 501_000));
        // A long run that is dense: as many messages as its span holds over the ratio.
        assert!(!spread(1, 10_000, 200_000));
        // No first message (nothing read), no count.
        assert!(!spread(0, 50, 501_000));
        assert!(spread(1, 0, 501_000));
    }
}
