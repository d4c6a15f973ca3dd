//! Scans and lookups without a read of the run: the latest message per subject of a stream,
//! the runs in the journal and those touched since a sequence (docs/ARCHITECTURE.md "The
//! journal", the reconciler), purges for retention, and the last event of a run or of some of
//! its types.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use bytes::Bytes;
use futures::StreamExt;
use kedge_core::subjects::{self, RUNS_STREAM};
use kedge_core::{Envelope, EventType, RunId};

use super::Journal;
use super::decode::{Decoded, Recorded, decode};
use super::read::{READ_PAGE, STALE_RETRIES};
use super::tail::{consumer_error, ordered_error};
use crate::error::{ErrorKind, JournalError};
use crate::wire::{self, StoredMessage, WireError};

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

/// What a scan for some types of events found ([`Journal::runs_with_events`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scanned {
    /// Each event of the types, as (sequence, run), in stream order.
    pub events: Vec<(u64, RunId)>,
    /// The last sequence looked at (the scan's `after` when none was): everything of the
    /// types through it is in `events`.
    pub through: u64,
    /// More may follow: as many messages as asked for were looked at, none too young.
    pub more: bool,
}

impl Journal {
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
            .info_with_subjects(subjects::event_all_runs(EventType::RunCreated))
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

    /// The events of the given types (any run) among the next `max` messages of their subjects
    /// after sequence `after` published before `before` ([`Scanned`]): one short-lived
    /// consumer of one filter subject covering the types ([`subjects::events_all_runs`]; a
    /// consumer of several would make nats-server walk its whole subject index once per block
    /// read), headers only, the other types passed over here. The retention service's scan for
    /// terminal runs.
    pub async fn runs_with_events(
        &self,
        types: &[EventType],
        after: u64,
        max: usize,
        before: time::OffsetDateTime,
    ) -> Result<Scanned, JournalError> {
        use async_nats::jetstream::consumer::{AckPolicy, pull};
        let op = "runs with events";
        let unavailable = |e: &dyn std::fmt::Display| JournalError::Unavailable {
            op,
            reason: e.to_string(),
        };
        let stream = self
            .js
            .get_stream_no_info(RUNS_STREAM)
            .await
            .map_err(|e| unavailable(&e))?;
        let consumer = stream
            .create_consumer(pull::Config {
                filter_subject: subjects::events_all_runs(types),
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: after.saturating_add(1),
                },
                ack_policy: AckPolicy::None,
                headers_only: true,
                memory_storage: true,
                inactive_threshold: Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable(&e))?;
        let mut messages = consumer
            .fetch()
            .max_messages(max)
            .messages()
            .await
            .map_err(|e| unavailable(&e))?;
        let mut scanned = Scanned {
            through: after,
            ..Scanned::default()
        };
        let (mut read, mut young) = (0, false);
        while let Some(msg) = messages.next().await {
            let msg = msg.map_err(|e| unavailable(&e))?;
            let info = msg.info().map_err(|e| unavailable(&e))?;
            if info.published >= before {
                young = true;
                break;
            }
            read += 1;
            scanned.through = info.stream_sequence;
            if let Some(parsed) = subjects::parse_event(&msg.subject)
                && types.contains(&parsed.event_type)
            {
                scanned.events.push((info.stream_sequence, parsed.run_id));
            }
        }
        drop(messages);
        // The consumer goes away by itself after `inactive_threshold`; deleting it now keeps the
        // stream's consumer count low between scans.
        let name = consumer.cached_info().name.clone();
        let _ = stream.delete_consumer(&name).await;
        scanned.more = !young && read >= max;
        Ok(scanned)
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
                filter_subject: subjects::JOURNAL_ALL.to_owned(),
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
            let q = serde_json::json!({ "seq": after.saturating_add(1), "next_by_subj": subjects::JOURNAL_ALL });
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
    /// sequence `through`: for retention of finished runs only (`kedge_retention`
    /// checks that first, on the journal it read through `through`). A message that landed
    /// after that read (an input reviving the run) is not removed. Returns how many messages
    /// were removed (0 when there are none: purging twice is harmless). Needs the
    /// `$JS.API.STREAM.PURGE` permission, which of the service users only `retention` has
    /// (docs/SECURITY.md "What each Kedge user may do").
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
