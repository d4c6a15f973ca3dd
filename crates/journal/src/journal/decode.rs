//! Decoding: what a message stored under a run's tree is. [`decode`] turns a pulled message
//! into a [`Recorded`] event or a [`SetAside`] one (or skips it); [`Journal::stored_form`] and
//! [`Journal::open`] put an envelope's data by reference into `kedge_blobs` and read it back
//! (docs/ARCHITECTURE.md "Large payloads by reference").

use async_nats::HeaderMap;
use bytes::Bytes;
use kedge_core::{Envelope, EventKind, RunId};
use serde::Serialize;

use super::Journal;
use super::append::parse_decision_msg_id;
use crate::blob::{self, BlobError};
use crate::error::JournalError;
use crate::wire::{self, StoredMessage};

/// A message of a run as a consumer of the journal stream delivered it (the step's wake):
/// its stream sequence, subject, stored headers and payload.
#[derive(Debug, Clone, Copy)]
pub struct Delivered<'a> {
    pub seq: u64,
    pub subject: &'a str,
    pub headers: Option<&'a HeaderMap>,
    pub payload: &'a Bytes,
}

/// What a message a consumer of the journal delivered is: the one decoding every consumer of
/// `KEDGE_RUNS` applies ([`Journal::decode_delivered`]), the same checks a read applies.
/// Short-lived (matched on at once), so the size of its event variant does not matter.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub enum Delivery {
    /// An event of the run its subject names (every check passed; data held by reference read
    /// back).
    Event(Recorded),
    /// Under a run's tree but not on an event subject (`.d.`/`.i.`): nothing to act on.
    NotAnEvent,
    /// On a run's event subject but not an event of that run, with the reason.
    SetAside(SetAside),
}

/// An event as the journal holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    /// The stream sequence: the event's number (SSE `id:`, /history cursor).
    pub seq: u64,
    pub envelope: Envelope,
    /// The message's `Nats-Msg-Id`, if it had one.
    pub msg_id: Option<String>,
}

/// A message on a run's event subjects that is not a valid event of the run: left in the stream
/// (it cannot be deleted), skipped by reads and reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SetAside {
    /// Its stream sequence.
    pub seq: u64,
    pub subject: String,
    /// Whether it sits on a decision (`.d.`) or an input (`.i.`) subject.
    pub kind: EventKind,
    /// Why it is not an event, for operators.
    pub reason: String,
}

/// What [`decode`] makes of a stored message. Short-lived (moved straight into a page), so the
/// size of its event variant does not matter.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub(super) enum Decoded {
    Event(Recorded),
    /// Under the run's tree but not an event subject (`.d.`/`.i.`).
    Skip,
    SetAside(SetAside),
    /// An envelope that holds its data by reference ([`crate::blob`]): decoded again once the
    /// blob is read.
    ByReference(StoredMessage),
}

/// The longest reason kept for a set-aside message.
const MAX_REASON: usize = 300;

fn shorten(mut reason: String) -> String {
    if reason.len() > MAX_REASON {
        let mut end = MAX_REASON;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
        reason.push('…');
    }
    reason
}

/// Turns a stored message of `run` into a [`Recorded`], or sets it aside with the reason.
pub(super) fn decode(run: &RunId, m: StoredMessage) -> Decoded {
    let prefix = kedge_core::subjects::run_prefix(run);
    let set_aside = |kind: EventKind, reason: String| {
        Decoded::SetAside(SetAside {
            seq: m.seq,
            subject: m.subject.chars().take(MAX_REASON).collect(),
            kind,
            reason: shorten(reason),
        })
    };
    let Some(rest) = m.subject.strip_prefix(&prefix) else {
        // Never asked for (reads filter on the run's tree); set aside rather than trusted.
        return set_aside(
            EventKind::Input,
            format!("subject `{}` is not in {run}'s journal", m.subject),
        );
    };
    // An inline input (`agent.run.<run>.inline.<type>`, docs/ARCHITECTURE.md "Inline tools")
    // is an input like any other; an inline decision is under `d.`.
    let kind = if rest.starts_with("d.") {
        EventKind::Decision
    } else if rest.starts_with("i.") || rest.starts_with("inline.") {
        EventKind::Input
    } else {
        return Decoded::Skip;
    };
    let envelope = match Envelope::from_json_bytes(&m.payload) {
        Ok(envelope) => envelope,
        Err(_) if blob::reference_of(&m.payload).is_some() => return Decoded::ByReference(m),
        Err(e) => return set_aside(kind, format!("not an event envelope: {e}")),
    };
    if envelope.inline && !envelope.event_type().may_be_inline() {
        return set_aside(kind, format!("`{}` is never inline", envelope.event_type()));
    }
    if envelope.run_id != *run || envelope.subject() != m.subject {
        return set_aside(
            kind,
            format!(
                "an envelope of {} `{}` stored on `{}`",
                envelope.run_id,
                envelope.event_type(),
                m.subject
            ),
        );
    }
    let msg_id = m.header(wire::MSG_ID).map(str::to_owned);
    if kind == EventKind::Decision {
        // Every decision the journal appends carries the writer's id, naming this run and the
        // decision the writer saw last, before the group it belongs to (a group is stored
        // contiguously: its first message is `index` before this one); a message without one
        // was not appended by a writer.
        let first = |id: &super::DecisionMsgId| {
            u64::try_from(id.index)
                .ok()
                .and_then(|i| m.seq.checked_sub(i))
        };
        match msg_id.as_deref().map(parse_decision_msg_id) {
            Some(Some(id))
                if id.run == *run && first(&id).is_some_and(|f| f > id.expected_last) => {}
            Some(Some(id)) if id.run != *run => {
                return set_aside(
                    kind,
                    format!("a decision whose Nats-Msg-Id names run {}", id.run),
                );
            }
            Some(Some(id)) => {
                return set_aside(
                    kind,
                    format!(
                        "a decision whose Nats-Msg-Id (expecting decision {}, place {} in its group) cannot be stored at sequence {}",
                        id.expected_last, id.index, m.seq
                    ),
                );
            }
            Some(None) | None => {
                return set_aside(
                    kind,
                    "a decision without the writer's Nats-Msg-Id (d:<run>:<expected>:<index>:<writer>)"
                        .to_owned(),
                );
            }
        }
    }
    Decoded::Event(Recorded {
        seq: m.seq,
        envelope,
        msg_id,
    })
}

/// The run an envelope names.
#[derive(serde::Deserialize)]
struct RunOf {
    run_id: RunId,
}

impl Journal {
    /// What is published for `envelope`: its JSON, or, above [`blob::INLINE_MAX`], the envelope
    /// with its data stored in `kedge_blobs` first and referred to (`data_ref`).
    pub async fn stored_form(&self, envelope: &Envelope) -> Result<Bytes, JournalError> {
        let bytes = envelope.to_json_bytes();
        if bytes.len() <= blob::INLINE_MAX {
            return Ok(Bytes::from(bytes));
        }
        // The canonical JSON of the data: its SHA-256 is the envelope's digest, so the blob is
        // named by the digest the envelope already carries.
        let data = serde_json::to_vec(&envelope.event.data_json()).unwrap_or_default();
        let reference = self
            .blobs
            .put(&envelope.run_id, &data, blob::EVENT_DATA)
            .await?;
        let mut stored = serde_json::to_value(envelope).unwrap_or_default();
        blob::by_reference(&mut stored, &reference);
        tracing::debug!(
            run_id = %envelope.run_id,
            event_type = %envelope.event_type(),
            size = reference.size,
            "event data stored by reference"
        );
        Ok(Bytes::from(serde_json::to_vec(&stored).unwrap_or_default()))
    }

    /// The envelope a stored message holds (as a consumer delivered it), its data read back
    /// from `kedge_blobs` when it holds it by reference. Its digest is checked either way.
    /// `Unavailable` when the blob could not be read for broker trouble; `Invalid` (sequence 0)
    /// when the message is not an envelope or its blob is missing or corrupt.
    pub async fn open(&self, payload: &[u8]) -> Result<Envelope, JournalError> {
        let invalid = |reason: String| JournalError::Invalid { seq: 0, reason };
        match Envelope::from_json_bytes(payload) {
            Ok(envelope) => Ok(envelope),
            Err(e) => {
                let Some(reference) = blob::reference_of(payload) else {
                    return Err(invalid(format!("not an event envelope: {e}")));
                };
                // The run is the envelope's (the blob is read under that run's name, and the
                // envelope it completes must name the same run to parse).
                let run = serde_json::from_slice::<RunOf>(payload)
                    .map_err(|e| invalid(format!("not an event envelope: {e}")))?
                    .run_id;
                let data = self
                    .blobs
                    .get(&run, &reference)
                    .await
                    .map_err(|e| match e {
                        BlobError::Unavailable(_) => JournalError::from(e),
                        other => invalid(other.to_string()),
                    })?;
                let whole = blob::with_data(payload, &data).map_err(invalid)?;
                Envelope::from_json_bytes(&whole)
                    .map_err(|e| invalid(format!("not an event envelope: {e}")))
            }
        }
    }

    /// Decodes a message a consumer of the journal delivered: the checks every read applies
    /// (the subject's run, the envelope's run and subject, the writer's `Nats-Msg-Id` on a
    /// decision) and data held by reference read back. Broker trouble reading a blob is an
    /// error (deliver it again); anything else that is not an event of its run is set aside.
    pub async fn decode_delivered(&self, d: Delivered<'_>) -> Result<Delivery, JournalError> {
        let m = StoredMessage {
            seq: d.seq,
            subject: d.subject.to_owned(),
            headers: d.headers.cloned().unwrap_or_default(),
            payload: d.payload.clone(),
        };
        let Some(run) = kedge_core::subjects::run_of(d.subject) else {
            return Ok(Delivery::SetAside(SetAside {
                seq: d.seq,
                subject: d.subject.chars().take(MAX_REASON).collect(),
                kind: EventKind::Input,
                reason: "not a subject of the journal".into(),
            }));
        };
        let decoded = match decode(&run, m) {
            Decoded::ByReference(m) => self.resolve(&run, m).await?,
            other => other,
        };
        Ok(match decoded {
            Decoded::Event(recorded) => Delivery::Event(recorded),
            Decoded::Skip => Delivery::NotAnEvent,
            Decoded::SetAside(s) => Delivery::SetAside(s),
            // `resolve` reads a reference once and never returns another.
            Decoded::ByReference(m) => Delivery::SetAside(SetAside {
                seq: m.seq,
                subject: m.subject.chars().take(MAX_REASON).collect(),
                kind: EventKind::Input,
                reason: "its blob holds another reference".into(),
            }),
        })
    }

    /// [`decode`] of a message that holds its data by reference, once the blob is read: a
    /// missing or corrupt blob sets the message aside; broker trouble is an error.
    pub(super) async fn resolve(
        &self,
        run: &RunId,
        mut m: StoredMessage,
    ) -> Result<Decoded, JournalError> {
        let kind = if m.subject.contains(".d.") {
            EventKind::Decision
        } else {
            EventKind::Input
        };
        let set_aside = |m: &StoredMessage, reason: String| {
            Decoded::SetAside(SetAside {
                seq: m.seq,
                subject: m.subject.chars().take(MAX_REASON).collect(),
                kind,
                reason: shorten(reason),
            })
        };
        let Some(reference) = blob::reference_of(&m.payload) else {
            return Ok(set_aside(&m, "not an event envelope".into()));
        };
        let data = match self.blobs.get(run, &reference).await {
            Ok(data) => data,
            Err(e @ BlobError::Unavailable(_)) => return Err(e.into()),
            Err(e) => return Ok(set_aside(&m, format!("its data is held by reference: {e}"))),
        };
        match blob::with_data(&m.payload, &data) {
            Ok(whole) => {
                m.payload = Bytes::from(whole);
                Ok(match decode(run, m) {
                    // Resolved once: a blob that holds another reference is not followed.
                    Decoded::ByReference(m) => {
                        set_aside(&m, "its blob holds another reference".into())
                    }
                    other => other,
                })
            }
            Err(reason) => Ok(set_aside(&m, reason)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::decision_msg_id;
    use crate::journal::fixtures::{decision, run};
    use kedge_core::event::{StepStarted, Timestamp, UserMessage};
    use kedge_core::ids::DecisionSeq;
    use kedge_core::{Draft, Event};

    fn stored(seq: u64, subject: &str, payload: Vec<u8>) -> StoredMessage {
        stored_with_id(seq, subject, payload, None)
    }

    fn stored_with_id(
        seq: u64,
        subject: &str,
        payload: Vec<u8>,
        msg_id: Option<&str>,
    ) -> StoredMessage {
        let mut headers = HeaderMap::new();
        if let Some(id) = msg_id {
            headers.insert(wire::MSG_ID, id);
        }
        StoredMessage {
            seq,
            subject: subject.to_owned(),
            headers,
            payload: payload.into(),
        }
    }

    fn set_aside_at(d: Decoded) -> Option<(u64, EventKind)> {
        match d {
            Decoded::SetAside(a) => Some((a.seq, a.kind)),
            Decoded::Event(_) | Decoded::Skip | Decoded::ByReference(_) => None,
        }
    }

    #[test]
    fn decode_sets_aside_what_is_not_an_event_of_the_run() {
        let r = run();
        let env = decision(&r);
        let id = |expected: u64| decision_msg_id(&r, DecisionSeq::at(expected), 0, "w");
        let ok = decode(
            &r,
            stored_with_id(3, &env.subject(), env.to_json_bytes(), Some(&id(2))),
        );
        assert!(
            matches!(ok, Decoded::Event(ref rec) if rec.seq == 3),
            "{ok:?}"
        );
        // Not an envelope.
        let bad = decode(
            &r,
            stored(4, "agent.run.run_j1.d.run.started", b"{}".to_vec()),
        );
        assert_eq!(set_aside_at(bad), Some((4, EventKind::Decision)));
        // An envelope stored under the wrong type.
        let misfiled = decode(
            &r,
            stored_with_id(
                5,
                "agent.run.run_j1.d.run.created",
                env.to_json_bytes(),
                Some(&id(2)),
            ),
        );
        assert_eq!(set_aside_at(misfiled), Some((5, EventKind::Decision)));
        // Another run's tree.
        let foreign = decode(
            &r,
            stored(6, "agent.run.run_x.d.run.started", env.to_json_bytes()),
        );
        assert!(set_aside_at(foreign).is_some());
        // The writer's id must place the message's group after the decision it expected: the
        // third of a group (index 2) at sequence 10 starts at 8, after decision 7, not 8.
        let placed = |expected: u64, index: usize| {
            decode(
                &r,
                stored_with_id(
                    10,
                    &env.subject(),
                    env.to_json_bytes(),
                    Some(&decision_msg_id(&r, DecisionSeq::at(expected), index, "w")),
                ),
            )
        };
        assert!(matches!(placed(7, 2), Decoded::Event(_)));
        assert_eq!(set_aside_at(placed(8, 2)), Some((10, EventKind::Decision)));
        assert_eq!(set_aside_at(placed(10, 0)), Some((10, EventKind::Decision)));
        // A non-event subtree is skipped.
        let sched = decode(&r, stored(7, "agent.run.run_j1.s.timer", b"x".to_vec()));
        assert_eq!(sched, Decoded::Skip);
        // A decision with data that fails its digest.
        let step = Envelope::new(
            r.clone(),
            Timestamp::now(),
            Draft::new(Event::StepStarted(StepStarted {
                request_id: kedge_core::ids::ModelRequestId::new(
                    &r,
                    kedge_core::StepNo(1),
                    kedge_core::Attempt(1),
                ),
                context_digest: kedge_core::event::Digest::of_bytes(b"c"),
                inputs_through: 0,
                model: None,
            })),
        );
        let mut value: serde_json::Value =
            serde_json::from_slice(&step.to_json_bytes()).expect("json");
        value["data"]["inputs_through"] = 9.into();
        let tampered = decode(
            &r,
            stored_with_id(
                8,
                &step.subject(),
                serde_json::to_vec(&value).expect("json"),
                Some(&id(2)),
            ),
        );
        assert_eq!(set_aside_at(tampered), Some((8, EventKind::Decision)));
        // Decisions without the writer's id, with another run's, or with an impossible place.
        let other: RunId = "run_other".parse().expect("valid");
        for (seq, msg_id) in [
            (9, None),
            (10, Some("client-key".to_owned())),
            (
                11,
                Some(decision_msg_id(&other, DecisionSeq::at(2), 0, "w")),
            ),
            (12, Some(id(12))),
        ] {
            let d = decode(
                &r,
                stored_with_id(seq, &env.subject(), env.to_json_bytes(), msg_id.as_deref()),
            );
            assert_eq!(
                set_aside_at(d),
                Some((seq, EventKind::Decision)),
                "{msg_id:?}"
            );
        }
        // An input needs no particular id; a garbage input is set aside as an input.
        let input = Envelope::new(
            r.clone(),
            Timestamp::now(),
            Draft::new(Event::UserMessage(UserMessage { text: "hi".into() })),
        );
        assert!(matches!(
            decode(&r, stored(13, &input.subject(), input.to_json_bytes())),
            Decoded::Event(_)
        ));
        let garbage = decode(
            &r,
            stored(14, &input.subject(), vec![0xff; 10 * MAX_REASON]),
        );
        match garbage {
            Decoded::SetAside(a) => {
                assert_eq!((a.seq, a.kind), (14, EventKind::Input));
                assert!(a.reason.len() <= MAX_REASON + 3, "{}", a.reason);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_inline_event_is_read_on_its_inline_subject_only() {
        let r = run();
        let op = kedge_core::ids::OperationId::new(&r, kedge_core::StepNo(1), 0);
        let result = |inline: bool| {
            let draft = Draft::new(Event::ToolResult(kedge_core::event::ToolResult {
                content: "ok".into(),
                is_error: false,
                stopped: false,
            }))
            .op(op.clone());
            let draft = if inline { draft.inline() } else { draft };
            Envelope::new(r.clone(), Timestamp::now(), draft)
        };
        let inline = result(true);
        assert_eq!(inline.subject(), "agent.run.run_j1.inline.tool.result");
        match decode(&r, stored(3, &inline.subject(), inline.to_json_bytes())) {
            Decoded::Event(rec) => assert!(rec.envelope.inline && rec.seq == 3),
            other => panic!("{other:?}"),
        }
        // Either shape on the other's subject is set aside.
        let plain = result(false);
        for (seq, subject, bytes) in [
            (4, plain.subject(), inline.to_json_bytes()),
            (5, inline.subject(), plain.to_json_bytes()),
        ] {
            assert_eq!(
                set_aside_at(decode(&r, stored(seq, &subject, bytes))),
                Some((seq, EventKind::Input))
            );
        }
        // A type that is never inline, on the subject its envelope names.
        let mut message = Envelope::new(
            r.clone(),
            Timestamp::now(),
            Draft::new(Event::UserMessage(UserMessage { text: "hi".into() })),
        );
        message.inline = true;
        assert_eq!(
            set_aside_at(decode(
                &r,
                stored(6, &message.subject(), message.to_json_bytes())
            )),
            Some((6, EventKind::Input))
        );
    }
}
