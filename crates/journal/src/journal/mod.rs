//! The journal: appends, reads and tails of a run's events in `KEDGE_RUNS`.
//!
//! The [`Journal`] handle is defined here; its methods live with their role: `append`
//! (decisions, inputs, run creation, decision message ids), `decode` (what a stored message is:
//! an event, set aside, or held by reference), `read` (a run's events after a sequence, pages),
//! `linked` (a run's events from messages held back to a sequence, by the checks' links),
//! `tail` (the live tail) and `scan` (whole-stream queries, purges, last-event lookups).
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
//!
//! [`JournalError::Behind`]: crate::JournalError::Behind
//! [`JournalError::Duplicate`]: crate::JournalError::Duplicate
//! [`JournalError::Conflict`]: crate::JournalError::Conflict

use std::time::Duration;

use async_nats::{Client, HeaderMap};

use crate::blob::Blobs;
use crate::wire;

mod append;
mod decode;
mod linked;
mod read;
mod scan;
mod tail;

pub use append::{
    Appended, DecisionMsgId, DecisionWriter, InputAppended, MAX_GROUP, RunCreator, decision_msg_id,
    parse_decision_msg_id,
};
pub use decode::{Delivered, Delivery, Recorded, SetAside};
pub use read::ReadPage;
pub use scan::{LastEvent, Latest, Scanned, purge};

/// Default timeout of one broker request. A cluster failover makes requests fail fast with "no
/// responders" for a few seconds, which is reported as retryable, so this only bounds a broker
/// that accepted the request and went silent.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

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
    /// Where events larger than [`blob::INLINE_MAX`](crate::blob::INLINE_MAX) keep their data.
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
}

/// A run and a decision of it, for the unit tests of the journal's modules.
#[cfg(test)]
mod fixtures {
    use kedge_core::event::{RunStarted, Timestamp};
    use kedge_core::{Draft, RunId};

    pub(super) fn run() -> RunId {
        "run_j1".parse().expect("valid")
    }

    pub(super) fn decision(run: &RunId) -> kedge_core::DecisionEnvelope {
        kedge_core::DecisionEnvelope::new(
            run.clone(),
            Timestamp::now(),
            Draft::new(kedge_core::Decision::RunStarted(RunStarted {})),
        )
    }
}
