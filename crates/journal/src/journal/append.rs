//! Appends: a run's decisions by its single writer ([`DecisionWriter`], checked run-wide, see
//! [`Check`]), its first decision ([`Journal::create_run`]), inputs deduplicated by
//! `Nats-Msg-Id`, and the decision message ids a retried append is recognised by
//! (docs/ARCHITECTURE.md "The journal").

use async_nats::HeaderMap;
use kedge_core::ids::{DecisionSeq, InputId};
use kedge_core::subjects::{self, RUNS_STREAM};
use kedge_core::{DecisionEnvelope, EventType, InputEnvelope, RunId};
use tracing::Instrument;

use super::Journal;
use crate::error::JournalError;
use crate::wire::{self, BatchMessage, StoredMessage, WireError, codes};

/// Most decisions one atomic group may hold (the server's batch limit).
pub const MAX_GROUP: usize = 1000;

/// Where a decision append landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    /// Stream sequence of the first event appended.
    pub first_seq: u64,
    /// Stream sequence of the last event appended (equal to `first_seq` for one event). A group
    /// is contiguous: `last_seq - first_seq + 1` events.
    pub last_seq: u64,
}

impl Appended {
    /// The run's last decision once this append landed: what the writer's next append is
    /// checked against.
    pub fn last_decision(&self) -> DecisionSeq {
        DecisionSeq::at(self.last_seq)
    }
}

/// Where an input landed ([`Journal::append_input`], [`Journal::append_input_after`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputAppended {
    /// Its stream sequence; for a duplicate, the sequence of the input first stored with its id.
    pub seq: u64,
    /// An input with the same [`InputId`] was stored before (within the stream's duplicate
    /// window): this append stored nothing, and `seq` is the first one's. Not an error: a repeat
    /// of an input lands once, whoever repeats it.
    pub duplicate: bool,
    /// It was stored with the run-wide check on the sequence asked for: nothing of the run
    /// lies between that message and this one (see [`Journal::read_chained`]).
    pub chained: bool,
}

/// The right to start a run: [`Journal::create_run`] appends a run's first decision only for
/// a holder of one. Intake has one for the runs its tasks ask for ([`RunCreator::intake`],
/// behind this crate's `create-runs` feature, which only intake and tests enable), and the
/// writer of a run for its child runs ([`RunCreator::child_of`]).
#[derive(Debug)]
pub struct RunCreator {
    _private: (),
}

impl RunCreator {
    /// Intake's: it starts the run an accepted task asks for.
    #[cfg(feature = "create-runs")]
    pub fn intake() -> RunCreator {
        RunCreator { _private: () }
    }

    /// A run's writer's: the holder of a run's lease starts the run's child runs.
    pub fn child_of(_parent: &DecisionWriter) -> RunCreator {
        RunCreator { _private: () }
    }
}

/// The writer name of [`Journal::create_run`].
const CREATOR: &str = "intake";

/// What a decision append's `Nats-Expected-Last-Subject-Sequence` is checked on.
///
/// Every decision of a run but its first is checked on the same subject, `agent.run.<id>.>`
/// (the run's last message of any kind), because that is what keeps two writers apart on a
/// clustered stream. Its leader checks a publish against what is applied, and refuses one
/// while another publish *checked on the same subject string* is in flight (proposed, not yet
/// applied: 10164), but not while one checked on another string, or not checked, is: on a
/// three-node cluster, a decision checked on `agent.run.<id>.>` and one checked on
/// `agent.run.<id>.d.>`, published at once with the same expected sequence, *both* landed in
/// 299 of 300 tries, which is two writers deciding on the same state; with the plain append's
/// look first, 30 to 38 of 400. Both checked on the one subject (and the plain append's two
/// lookups asked one after the other, see [`Journal::append_decisions`]): 0 of 3,200
/// (`crates/journal/tests/cluster.rs`). An input is never checked, so an input in flight does
/// not stop a run-wide checked append (300 of 300 landed past one): that is why the step reads
/// the sequences its appends stepped over (docs/ARCHITECTURE.md, "skipped").
#[derive(Debug, Clone, Copy)]
enum Check {
    /// The run's last message of any kind is at this sequence (which implies its last decision).
    RunLast(u64),
    /// The run's last decision is at the expected sequence (`agent.run.<id>.d.>`): only for
    /// the run's first decision ([`Journal::create_run`]), which nothing else can race (no
    /// writer of a run exists before its `run.created`; two creations are checked alike).
    Decisions,
}

/// The right to append one run's decisions: the single-writer rule as a type. Made only by
/// [`crate::Lease::writer`] from a lease this process acquired (or, for benches and tests of the
/// journal itself, `DecisionWriter::unfenced` behind the `unfenced-writer` feature). Its name,
/// `<worker>-<lease revision>`, goes into every decision's `Nats-Msg-Id`, so a retried append is
/// recognised as this holding's own.
///
/// Nothing else can make one:
///
/// ```compile_fail
/// # use kedge_journal::DecisionWriter;
/// let run: kedge_core::RunId = "run_x".parse().expect("valid");
/// let forged = DecisionWriter::new(run, "me".to_owned()); // private: hold a lease instead
/// ```
///
/// ```compile_fail
/// # use std::time::Duration;
/// let run: kedge_core::RunId = "run_x".parse().expect("valid");
/// // A `Lease` is made only by `Leases` (it has a private field).
/// let lease = kedge_journal::Lease { run, owner: "me".into(), revision: 1, ttl: Duration::from_secs(5) };
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecisionWriter {
    run: RunId,
    name: String,
}

impl DecisionWriter {
    pub(crate) fn new(run: RunId, name: String) -> Self {
        Self { run, name }
    }

    /// A writer that holds no lease: for benches and tests of the journal's own checks only.
    #[cfg(feature = "unfenced-writer")]
    pub fn unfenced(run: &RunId, name: &str) -> Self {
        Self::new(run.clone(), name.to_owned())
    }

    pub fn run(&self) -> &RunId {
        &self.run
    }

    pub fn name(&self) -> &str {
        &self.name
    }
}

/// The `Nats-Msg-Id` of the `index`-th decision (0-based) of an append by `writer` after
/// `expected_last`. Deterministic, so a retry carries the same ids; includes the writer, so two
/// racing writers never share one.
pub fn decision_msg_id(
    run: &RunId,
    expected_last: DecisionSeq,
    index: usize,
    writer: &str,
) -> String {
    format!("d:{run}:{expected_last}:{index}:{writer}")
}

/// What a decision's `Nats-Msg-Id` says (see [`decision_msg_id`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecisionMsgId {
    pub run: RunId,
    /// The run's last decision when the writer appended (0: none yet).
    pub expected_last: u64,
    /// The decision's place in its group (0-based).
    pub index: usize,
    pub writer: String,
}

/// Parses a decision's `Nats-Msg-Id` (`d:<run>:<expected_last>:<index>:<writer>`); `None` for
/// anything else. A message on a decision subject without one was not appended by
/// [`Journal::append_decisions`]. The id is a claim, not a proof: it says which append the
/// message presents itself as, and a reader can check that against where it was stored.
pub fn parse_decision_msg_id(id: &str) -> Option<DecisionMsgId> {
    let rest = id.strip_prefix("d:")?;
    // A run id has no `:`; a writer may.
    let (run, rest) = rest.split_once(':')?;
    let (expected_last, rest) = rest.split_once(':')?;
    let (index, writer) = rest.split_once(':')?;
    if writer.is_empty() || expected_last.starts_with('+') || index.starts_with('+') {
        return None;
    }
    Some(DecisionMsgId {
        run: run.parse().ok()?,
        expected_last: expected_last.parse().ok()?,
        index: index.parse().ok()?,
        writer: writer.to_owned(),
    })
}

/// What the run's last decision (`last`, as the stream's leader has it) says of a decision
/// append expecting `expected_last` whose last message id is `ours`: it landed already
/// (`Duplicate`), another decision did (`Conflict`), or neither (`Ok`).
fn judge_last_decision(
    last: Option<&StoredMessage>,
    expected_last: DecisionSeq,
    ours: &str,
) -> Result<(), JournalError> {
    match last {
        Some(m) if m.header(wire::MSG_ID) == Some(ours) => {
            Err(JournalError::Duplicate { seq: m.seq })
        }
        _ => match last.map_or(0, |m| m.seq) {
            actual if actual == expected_last.get() => Ok(()),
            actual => Err(JournalError::Conflict {
                expected: expected_last.get(),
                actual,
            }),
        },
    }
}

/// A header-safe token: non-empty, printable ASCII without spaces.
fn check_token(what: &str, value: &str) -> Result<(), JournalError> {
    if value.is_empty() {
        return Err(JournalError::BadRequest(format!("{what} is empty")));
    }
    if value.len() > 256 {
        return Err(JournalError::BadRequest(format!(
            "{what} is longer than 256 bytes"
        )));
    }
    if let Some(c) = value.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(JournalError::BadRequest(format!(
            "{what} `{value}` contains {c:?}; only printable ASCII without spaces is allowed"
        )));
    }
    Ok(())
}

/// Checks a decision group before anything is sent.
fn check_group(run: &RunId, writer: &str, events: &[DecisionEnvelope]) -> Result<(), JournalError> {
    check_token("writer", writer)?;
    if events.is_empty() {
        return Err(JournalError::BadRequest(
            "a decision append needs at least one event".into(),
        ));
    }
    if events.len() > MAX_GROUP {
        return Err(JournalError::BadRequest(format!(
            "{} decisions in one group; at most {MAX_GROUP}",
            events.len()
        )));
    }
    for e in events {
        if &e.run_id != run {
            return Err(JournalError::BadRequest(format!(
                "event `{}` belongs to {}, not {run}",
                e.event_type(),
                e.run_id
            )));
        }
    }
    Ok(())
}

impl Journal {
    /// Appends decisions of the writer's run, provided the run's last decision is at
    /// `expected_last`. Only the holder of the run's lease has a [`DecisionWriter`]
    /// ([`crate::Lease::writer`]); the run's first decision is [`Journal::create_run`]'s.
    ///
    /// One event is one publish; several are one atomic batch (all stored contiguously, or
    /// none). The run's last message, then its last decision, are first asked of the stream's
    /// leader (two round trips, one after the other) and the append is checked against the
    /// first, as [`Journal::append_decision_current`]'s is: every decision append of a run is
    /// checked on the same subject, `agent.run.<id>.>`, which is what makes a clustered
    /// stream's leader refuse one while another is in flight (see `Check`). An input that
    /// lands between the look and the append only makes it look again (for up to the
    /// journal's request timeout of inputs in a row). Errors: [`JournalError::Conflict`] when
    /// another decision was appended since `expected_last` (a zombie writer whose lease was
    /// taken over lands here); [`JournalError::Duplicate`] when this very append (same writer,
    /// `expected_last` and number of events) already landed, e.g. on a retry after a timeout;
    /// [`JournalError::Unavailable`] for broker trouble (retry the same call).
    pub async fn append_decisions(
        &self,
        writer: &DecisionWriter,
        expected_last: DecisionSeq,
        events: &[DecisionEnvelope],
    ) -> Result<Appended, JournalError> {
        let run = &writer.run;
        check_group(run, &writer.name, events)?;
        let ours = decision_msg_id(run, expected_last, events.len() - 1, &writer.name);
        // Inputs landing between the look and the append (a step's parallel tools starting and
        // answering) only make it look again, for as long as a request may take: they never
        // conflict, and they stop.
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            // One after the other, the run's last message first: a decision stored before that
            // answer is in the second. Asked at once, the two answers could straddle another
            // writer's decision (its last message, and the last decision before it), and the
            // append checked on that decision would land after it: both writers' decisions in
            // the journal (in about 1 of 200 races on a cluster).
            let map = |e| JournalError::from_wire("look up the run's last messages", e);
            let last = self
                .leader_last(subjects::run_all(run))
                .await
                .map_err(map)?;
            let last_decision = self
                .leader_last(subjects::run_decisions(run))
                .await
                .map_err(map)?;
            judge_last_decision(last_decision.as_ref(), expected_last, &ours)?;
            let run_last = last.map_or(0, |m| m.seq);
            match self
                .append_decisions_as(
                    run,
                    expected_last,
                    Check::RunLast(run_last),
                    &writer.name,
                    events,
                )
                .await
            {
                // Something of the run landed since the look (an input, or a decision still
                // in flight then): look again.
                Err(JournalError::Behind { .. }) if tokio::time::Instant::now() < deadline => {}
                Err(JournalError::Behind { .. }) => {
                    return Err(JournalError::Unavailable {
                        op: "append decisions",
                        reason: format!(
                            "the run's inputs kept landing between look and append for {:?}",
                            self.timeout
                        ),
                    });
                }
                other => return other,
            }
        }
    }

    /// [`Journal::append_decisions`] of one decision, provided moreover that the run's last
    /// message of any kind is at `run_last`: the writer's state holds the whole run, so the
    /// decision was made on everything there is, and what it appends follows the state's last
    /// event directly (no read back needed, however many other runs' messages were stored in
    /// between). The run's inputs that landed meanwhile (a cancel request during a model call)
    /// fail it with [`JournalError::Behind`]: the writer reads them and decides again. Checked
    /// by the stream's leader as it stores the message, so nothing slips in between.
    /// `Conflict` and `Duplicate` as for [`Journal::append_decisions`], whose message id it
    /// shares: a plain append of the same decision after a `Behind` is recognised as the same.
    pub async fn append_decision_current(
        &self,
        writer: &DecisionWriter,
        expected_last: DecisionSeq,
        run_last: u64,
        event: &DecisionEnvelope,
    ) -> Result<Appended, JournalError> {
        check_group(&writer.run, &writer.name, std::slice::from_ref(event))?;
        self.append_decisions_as(
            &writer.run,
            expected_last,
            Check::RunLast(run_last),
            &writer.name,
            std::slice::from_ref(event),
        )
        .await
    }

    /// Writes a run's first decision, its `run.created`, with the check that the run has no
    /// decision yet: the narrow path by which intake (which holds no lease: the run has no
    /// writer before it exists) and the writer of a parent run start a run ([`RunCreator`]).
    /// Anything but a `run.created` is refused. `Conflict` means the run already exists;
    /// `Duplicate` that this very append landed.
    pub async fn create_run(
        &self,
        _creator: &RunCreator,
        created: &DecisionEnvelope,
    ) -> Result<Appended, JournalError> {
        if created.event_type() != EventType::RunCreated {
            return Err(JournalError::BadRequest(format!(
                "a run starts with run.created, not `{}`",
                created.event_type()
            )));
        }
        check_group(&created.run_id, CREATOR, std::slice::from_ref(created))?;
        self.append_decisions_as(
            &created.run_id,
            DecisionSeq::NONE,
            Check::Decisions,
            CREATOR,
            std::slice::from_ref(created),
        )
        .await
    }

    /// Appends a checked group (see [`Check`]); the group is checked already.
    async fn append_decisions_as(
        &self,
        run: &RunId,
        expected_last: DecisionSeq,
        check: Check,
        writer: &str,
        events: &[DecisionEnvelope],
    ) -> Result<Appended, JournalError> {
        let run_last = match check {
            Check::RunLast(seq) => Some(seq),
            Check::Decisions => None,
        };
        let span = tracing::debug_span!(
            "append_decisions",
            run_id = %run,
            expected_last = expected_last.get(),
            run_last,
            writer,
            events = events.len()
        );
        self.append_decisions_inner(run, expected_last, run_last, writer, events)
            .instrument(span)
            .await
    }

    async fn append_decisions_inner(
        &self,
        run: &RunId,
        expected_last: DecisionSeq,
        run_last: Option<u64>,
        writer: &str,
        events: &[DecisionEnvelope],
    ) -> Result<Appended, JournalError> {
        let mut messages = Vec::with_capacity(events.len());
        for (index, envelope) in events.iter().enumerate() {
            let mut headers = HeaderMap::new();
            headers.insert(
                wire::MSG_ID,
                decision_msg_id(run, expected_last, index, writer).as_str(),
            );
            self.trace_header(&mut headers);
            if index == 0 {
                // The run's last message (it implies the last decision); the last decision
                // only for a run's first decision (see `Check`).
                let (seq, scope) = match run_last {
                    Some(seq) => (seq, subjects::run_all(run)),
                    None => (expected_last.get(), subjects::run_decisions(run)),
                };
                headers.insert(wire::EXPECTED_LAST_SUBJECT_SEQ, seq.to_string().as_str());
                headers.insert(wire::EXPECTED_LAST_SUBJECT_SEQ_SUBJECT, scope.as_str());
            }
            messages.push(BatchMessage {
                subject: envelope.subject(),
                headers,
                payload: self.stored_form(envelope).await?,
            });
        }
        let count = messages.len() as u64;
        let result = if messages.len() == 1 {
            let m = messages.remove(0);
            wire::publish(&self.client, m.subject, m.headers, m.payload, self.timeout).await
        } else {
            let batch_id = uuid::Uuid::new_v4().simple().to_string();
            let ack = wire::publish_batch(&self.client, &batch_id, messages, self.timeout).await;
            match ack {
                // A server that ignores the batch headers acks the last message like any other
                // (having stored the others one by one): refuse to pretend it was atomic.
                Ok(ack) if ack.batch_count != Some(count) => {
                    return Err(JournalError::TooOld {
                        what: "atomic batch publish",
                        reason: format!(
                            "the commit ack counted {:?} messages instead of {count}",
                            ack.batch_count
                        ),
                    });
                }
                other => other,
            }
        };
        match result {
            Ok(ack) if ack.duplicate => Err(JournalError::Duplicate { seq: ack.seq }),
            Ok(ack) => {
                tracing::debug!(last_seq = ack.seq, "decisions appended");
                Ok(Appended {
                    first_seq: (ack.seq + 1).saturating_sub(count),
                    last_seq: ack.seq,
                })
            }
            Err(err)
                if err.is_wrong_last() || err.api_code() == Some(codes::BATCH_DUPLICATE_MSG_ID) =>
            {
                let ours = decision_msg_id(run, expected_last, events.len() - 1, writer);
                let outcome = self
                    .classify_rejection(run, expected_last, run_last, &ours)
                    .await;
                tracing::debug!(error = %err, outcome = ?outcome, "decision append rejected");
                Err(outcome)
            }
            Err(err) => Err(JournalError::from_wire("append decisions", err)),
        }
    }

    /// After a rejected decision append: did our earlier attempt land, or did someone else
    /// decide? Asks the stream leader (a replica could trail it and make us answer wrongly).
    async fn classify_rejection(
        &self,
        run: &RunId,
        expected_last: DecisionSeq,
        run_last: Option<u64>,
        our_last_msg_id: &str,
    ) -> JournalError {
        let last = match self.leader_last(subjects::run_decisions(run)).await {
            Ok(last) => last,
            Err(e) => return JournalError::from_wire("classify a rejected decision append", e),
        };
        match judge_last_decision(last.as_ref(), expected_last, our_last_msg_id) {
            Err(e) => e,
            // Checked against the run's last message: with the last decision the expected
            // one, only inputs (or messages set aside) landed since.
            Ok(()) => match run_last.filter(|seq| *seq >= expected_last.get()) {
                Some(expected) => JournalError::Behind { expected },
                None => JournalError::Conflict {
                    expected: expected_last.get(),
                    actual: expected_last.get(),
                },
            },
        }
    }

    /// The last message on `filter` (a subject of a run's tree), asked of the stream's leader.
    async fn leader_last(&self, filter: String) -> Result<Option<StoredMessage>, WireError> {
        let query = serde_json::json!({ "last_by_subj": filter });
        wire::leader_get(&self.client, RUNS_STREAM, query, self.timeout).await
    }

    /// Appends an input (anyone may). `id` deduplicates it: the same id within the stream's
    /// duplicate window (1 h) is stored once, and a repeat is answered with the first one's
    /// sequence and `duplicate` set.
    pub async fn append_input(
        &self,
        id: &InputId,
        input: &InputEnvelope,
    ) -> Result<InputAppended, JournalError> {
        self.append_input_after(id, input, None).await
    }

    /// [`Journal::append_input`], first checked run-wide on `after` when given: stored so only
    /// if the run's last message is at `after` (the message the appender acts on, e.g. the
    /// tool service's `tool.requested`). The stored check is a link the step service reads the
    /// run by ([`Journal::read_chained`]). When the check fails (something of the run landed
    /// since), the input is appended without it at once: an input never waits on the run.
    /// `chained` says which. (A retry of an input that landed fails the check, then is
    /// recognised by its id: `duplicate`.)
    pub async fn append_input_after(
        &self,
        id: &InputId,
        input: &InputEnvelope,
        after: Option<u64>,
    ) -> Result<InputAppended, JournalError> {
        let msg_id = id.as_str();
        let span = tracing::debug_span!(
            "append_input",
            run_id = %input.run_id,
            event_type = %input.event_type(),
            msg_id,
            after
        );
        async {
            check_token("input id", msg_id)?;
            let mut headers = HeaderMap::new();
            headers.insert(wire::MSG_ID, msg_id);
            self.trace_header(&mut headers);
            let payload = self.stored_form(input).await?;
            let publish = |headers| {
                wire::publish(
                    &self.client,
                    input.subject(),
                    headers,
                    payload.clone(),
                    self.timeout,
                )
            };
            let map = |e| JournalError::from_wire("append input", e);
            let (ack, chained) = match after {
                None => (publish(headers).await.map_err(map)?, false),
                Some(after) => {
                    let mut checked = headers.clone();
                    checked.insert(wire::EXPECTED_LAST_SUBJECT_SEQ, after.to_string().as_str());
                    let scope = subjects::run_all(&input.run_id);
                    checked.insert(wire::EXPECTED_LAST_SUBJECT_SEQ_SUBJECT, scope.as_str());
                    match publish(checked).await {
                        Ok(ack) => (ack, true),
                        Err(e) if e.is_wrong_last() => {
                            tracing::debug!(error = %e, "the run moved on; appended unchained");
                            (publish(headers).await.map_err(map)?, false)
                        }
                        Err(e) => return Err(map(e)),
                    }
                }
            };
            Ok(InputAppended {
                seq: ack.seq,
                duplicate: ack.duplicate,
                chained: chained && !ack.duplicate,
            })
        }
        .instrument(span)
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::fixtures::{decision, run};

    #[test]
    fn msg_ids_carry_run_sequence_index_and_writer() {
        assert_eq!(
            decision_msg_id(&run(), DecisionSeq::at(7), 2, "step-1"),
            "d:run_j1:7:2:step-1"
        );
        assert_ne!(
            decision_msg_id(&run(), DecisionSeq::at(7), 0, "a"),
            decision_msg_id(&run(), DecisionSeq::at(7), 0, "b")
        );
    }

    #[test]
    fn decision_msg_ids_parse_back() {
        let id = decision_msg_id(&run(), DecisionSeq::at(7), 2, "step:1");
        assert_eq!(
            parse_decision_msg_id(&id),
            Some(DecisionMsgId {
                run: run(),
                expected_last: 7,
                index: 2,
                writer: "step:1".into(),
            })
        );
        for bad in [
            "",
            "tool.result:op_x_1_0",
            "d:run_j1:7:2:",
            "d:run_j1:x:2:w",
            "d:run_j1:+7:2:w",
            "d:run_j1:7:-1:w",
            "d:not a run:7:2:w",
            "d:run_j1:7",
        ] {
            assert_eq!(parse_decision_msg_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn groups_are_checked_before_sending() {
        let r = run();
        assert!(check_group(&r, "w", &[decision(&r)]).is_ok());
        assert!(matches!(
            check_group(&r, "w", &[]),
            Err(JournalError::BadRequest(_))
        ));
        assert!(matches!(
            check_group(&r, "has space", &[decision(&r)]),
            Err(JournalError::BadRequest(_))
        ));
        let other: RunId = "run_other".parse().expect("valid");
        assert!(matches!(
            check_group(&r, "w", &[decision(&other)]),
            Err(JournalError::BadRequest(_))
        ));
        let many = vec![decision(&r); MAX_GROUP + 1];
        assert!(matches!(
            check_group(&r, "w", &many),
            Err(JournalError::BadRequest(_))
        ));
    }
}
