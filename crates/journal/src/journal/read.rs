//! Reads of one run: exactly its events after a sequence, in order, by batched direct gets
//! checked against the stream's leader ([`Journal::read`] and its variants), pages of them
//! ([`ReadPage`]), the read of a chain of run-wide checks by sequence, and the read of a run
//! spread over history by its literal subjects (docs/ARCHITECTURE.md "The journal", "Scale with
//! history").

use std::time::Duration;

use async_nats::HeaderMap;
use kedge_core::subjects::{self, RUNS_STREAM};
use kedge_core::{EventType, RunId};

use super::Journal;
use super::decode::{Decoded, Delivered, Recorded, SetAside, decode};
use crate::blob::{self, BlobRef};
use crate::error::JournalError;
use crate::wire::{self, StoredMessage, WireError};

/// Messages asked for per direct-get page in [`Journal::read`].
pub(super) const READ_PAGE: usize = 256;

/// A read through a known sequence starts with [`NEAR_BATCH`] messages instead of a probe of
/// one when it starts at most this many sequences before it (see `Journal::read_filtered`).
const NEAR_TAIL: u64 = 4096;
const NEAR_BATCH: usize = 8;

/// How often [`Journal::read`] re-asks a replica that trails the leader before reading the rest
/// from the leader itself.
pub(super) const STALE_RETRIES: u32 = 3;

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
pub(super) fn checked_after(headers: Option<&HeaderMap>, run: &RunId) -> Option<u64> {
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
    pub(super) fn push(&mut self, run: &RunId, d: Decoded) {
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

impl<'a> Reading<'a> {
    /// A read of `run` after `after` that takes at most `max` events.
    fn new(run: &'a RunId, after: u64, max: usize) -> Self {
        Self {
            run,
            out: ReadPage::default(),
            reached: after,
            first: 0,
            fetched: 0,
            max,
        }
    }

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

/// One subject of a run in [`Journal::read_literal`], read page by page.
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

/// Whether a run whose messages from `first` number `count` and end at `last` is spread over
/// enough of the stream to be read by its literal subjects.
fn spread(first: u64, count: u64, last: u64) -> bool {
    let span = last.saturating_sub(first).saturating_add(1);
    first > 0 && span >= SPREAD_MIN_SPAN && span / count.max(1) >= SPREAD_RATIO
}

impl Journal {
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

    /// Exactly the run's events of one type (`agent.run.<id>.<d|i>.<type>`, and for a type
    /// that may be inline its inline subject too, `subjects::inline_event`), in order, with
    /// the same consistency as [`Journal::read`]; costs what those events cost, not the whole
    /// journal. E.g. the `tool.requested` decisions of a run, or its `run.created` (none: the
    /// run does not exist).
    pub async fn read_type(
        &self,
        run: &RunId,
        event_type: EventType,
    ) -> Result<Vec<Recorded>, JournalError> {
        let filter = subjects::event(run, event_type);
        if !event_type.may_be_inline() {
            return Ok(self
                .read_filtered(run, &filter, 0, usize::MAX, None)
                .await?
                .events);
        }
        // Both subjects at once: one round trip's wait, not two.
        let inline = subjects::inline_event(run, event_type);
        let (plain, inline) = futures::try_join!(
            self.read_filtered(run, &filter, 0, usize::MAX, None),
            self.read_filtered(run, &inline, 0, usize::MAX, None)
        )?;
        let mut events = plain.events;
        events.extend(inline.events);
        events.sort_by_key(|r| r.seq);
        Ok(events)
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
        let mut r = Reading::new(run, after, max);
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
        let first_batch = match through {
            _ if !wildcard => page_size,
            Some(through) if after > 0 && through.saturating_sub(after) <= NEAR_TAIL => {
                NEAR_BATCH.min(page_size)
            }
            _ => 1,
        };
        let (leader_last, mut pending) = self
            .first_request(
                &mut r,
                filter,
                after.saturating_add(1),
                first_batch,
                through,
            )
            .await?;
        let map = |e: WireError| JournalError::from_wire(op, e);
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
        let leader_last = self
            .finish_from_leader(&mut r, filter, leader_last, through)
            .await?;
        r.out.more = r.reached < leader_last;
        Ok(r.out)
    }

    /// The first round trip of [`Journal::read_stored`]: the leader's last message of the run
    /// under `filter` (`through` instead, when the caller knows it) and, at once, the first
    /// `batch` messages from `from`, taken into `r`. Returns that last sequence (0: none) and
    /// how many matching messages are pending after the batch.
    async fn first_request(
        &self,
        r: &mut Reading<'_>,
        filter: &str,
        from: u64,
        batch: usize,
        through: Option<u64>,
    ) -> Result<(u64, u64), JournalError> {
        let t = self.timeout;
        let leader_q = serde_json::json!({ "last_by_subj": filter });
        let leader = async {
            match through {
                Some(through) => Ok(Some(through)),
                None => wire::leader_get(&self.client, RUNS_STREAM, leader_q, t)
                    .await
                    .map(|m| m.map(|m| m.seq)),
            }
        };
        let first = wire::direct_batch(&self.inbox, RUNS_STREAM, filter, from, batch, t, |m| {
            r.take(m)
        });
        let (leader_last, first) = futures::join!(leader, first);
        let map = |e: WireError| JournalError::from_wire("read", e);
        let leader_last = leader_last.map_err(map)?.unwrap_or(0);
        let pending = first.map_err(map)?;
        Ok((leader_last, pending))
    }

    /// The end of a [`Journal::read_stored`] whose pages stopped short (the replica that
    /// answered trails the leader, or made no progress): the leader reads on, one message at a
    /// time, until `r` is full or reaches `leader_last`. With `through`, `leader_last` is known
    /// only as a lower bound, so the leader is asked first where the run ends. Returns the
    /// run's last sequence so found.
    async fn finish_from_leader(
        &self,
        r: &mut Reading<'_>,
        filter: &str,
        mut leader_last: u64,
        through: Option<u64>,
    ) -> Result<u64, JournalError> {
        let t = self.timeout;
        let map = |e: WireError| JournalError::from_wire("read", e);
        if through.is_some() {
            // Known only as a lower bound so far: ask the leader where the run ends.
            let leader_q = serde_json::json!({ "last_by_subj": filter });
            let last = wire::leader_get(&self.client, RUNS_STREAM, leader_q, t)
                .await
                .map_err(map)?;
            leader_last = leader_last.max(last.map_or(0, |m| m.seq));
        }
        tracing::debug!(run_id = %r.run, reached = r.reached, leader_last, "read: finishing from the leader");
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
        Ok(leader_last)
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
        let t = self.timeout;
        let map = |e: WireError| JournalError::from_wire("read", e);
        let Some((mut lanes, up_to)) = self
            .list_lanes(filter, r.reached.saturating_add(1), from, leader_last)
            .await?
        else {
            return Ok(false);
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

    /// Step 1 of [`Journal::read_literal`]: the subjects under `filter` with a message at or
    /// after `after`, each with its last sequence and to be read from `from`, and the sequence
    /// through which the list holds. `None` when the list does not hold through `leader_last`
    /// or has more than [`MAX_LANES`] subjects: the read goes on by wildcard.
    async fn list_lanes(
        &self,
        filter: &str,
        after: u64,
        from: u64,
        leader_last: u64,
    ) -> Result<Option<(Vec<Lane>, u64)>, JournalError> {
        let mut lanes: Vec<Lane> = Vec::new();
        let listed = wire::direct_subjects_last(
            &self.inbox,
            RUNS_STREAM,
            filter,
            after,
            MAX_LANES + 1,
            self.timeout,
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
                _ => return Ok(None),
            },
            Ok(_) => return Ok(None),
            // More subjects than the server lists at once.
            Err(WireError::Api(e)) if e.code == 413 => return Ok(None),
            Err(e) => return Err(JournalError::from_wire("read", e)),
        };
        Ok(Some((lanes, up_to)))
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
    pub(super) async fn resolve_page(
        &self,
        run: &RunId,
        page: &mut ReadPage,
    ) -> Result<(), JournalError> {
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
