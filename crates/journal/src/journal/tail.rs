//! The live tail of a run ([`Journal::tail`]): its events after a sequence, then each new one
//! as it lands, from an ordered consumer; and the mapping of the consumers' errors, which the
//! scan of touched runs shares.

use std::time::Duration;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::{OrderedConfig, OrderedErrorKind};
use async_nats::jetstream::stream::ConsumerErrorKind;
use futures::{FutureExt, Stream, StreamExt};
use kedge_core::RunId;
use kedge_core::subjects::{self, RUNS_STREAM};

use super::Journal;
use super::decode::{Decoded, Recorded, decode};
use crate::error::{ErrorKind, JournalError};
use crate::wire::StoredMessage;

impl Journal {
    /// The runs that receive an input of type `event_type` from now on, as it is appended:
    /// what the broker publishes on the journal's subjects of that type, for every run (core
    /// NATS, nothing stored, nothing replayed). A hint to act at once, never a fact: the run's
    /// journal says what happened. Ends when the connection closes for good. What the step and
    /// tool services stop a cancelled run's work with.
    pub async fn watch_inputs(
        &self,
        event_type: kedge_core::EventType,
    ) -> Result<impl Stream<Item = RunId> + Send + 'static, JournalError> {
        let sub = self
            .client
            .subscribe(subjects::event_all_runs(event_type))
            .await
            .map_err(|e| JournalError::Unavailable {
                op: "watch inputs",
                reason: e.to_string(),
            })?;
        Ok(sub.filter_map(|msg| async move {
            subjects::parse_event(&msg.subject).map(|parsed| parsed.run_id)
        }))
    }

    /// The run's events after `after`, then every new one as it is appended: no gap, no
    /// duplicate. Backed by an ordered consumer (`DeliverPolicy::ByStartSequence`, filter
    /// `agent.run.<id>.>`), which recreates itself after broker trouble from the last delivered
    /// sequence. Errors are yielded as items and the stream goes on. Messages that are not
    /// events of the run are skipped (see [`SetAside`](super::SetAside)).
    pub fn tail(
        &self,
        run: &RunId,
        after: u64,
    ) -> impl Stream<Item = Result<Recorded, JournalError>> + Send + 'static {
        let journal = self.clone();
        let run = run.clone();
        futures::stream::once(async move { journal.open_tail(run, after).await }).flat_map(
            |opened| match opened {
                Ok(stream) => stream.left_stream(),
                Err(e) => futures::stream::once(async move { Err(e) }).right_stream(),
            },
        )
    }

    async fn open_tail(
        self,
        run: RunId,
        after: u64,
    ) -> Result<impl Stream<Item = Result<Recorded, JournalError>> + Send + 'static, JournalError>
    {
        let op = "tail";
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
                filter_subject: subjects::run_all(&run),
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: after.saturating_add(1),
                },
                ..Default::default()
            })
            .await
            .map_err(|e| consumer_error(op, e))?;
        let messages = consumer.messages().await.map_err(|e| {
            if e.kind() == async_nats::jetstream::consumer::StreamErrorKind::TimedOut {
                JournalError::Unavailable {
                    op,
                    reason: e.to_string(),
                }
            } else {
                JournalError::Rejected {
                    op,
                    reason: e.to_string(),
                }
            }
        })?;
        let mut last = after;
        let journal = self.clone();
        Ok(messages.filter_map(move |item| {
            let decoded = match item {
                Err(e) => Err(ordered_error(e)),
                Ok(msg) => match msg.info() {
                    Err(e) => Err(JournalError::Rejected {
                        op,
                        reason: format!("message without JetStream metadata: {e}"),
                    }),
                    Ok(info) if info.stream_sequence <= last => Ok(Decoded::Skip),
                    Ok(info) => {
                        let seq = info.stream_sequence;
                        last = seq;
                        Ok(decode(
                            &run,
                            StoredMessage {
                                seq,
                                subject: msg.subject.to_string(),
                                headers: msg.headers.clone().unwrap_or_default(),
                                payload: msg.payload.clone(),
                            },
                        ))
                    }
                },
            };
            let report = |run: &RunId, decoded: Result<Decoded, JournalError>| match decoded {
                Err(e) => Some(Err(e)),
                Ok(Decoded::Event(r)) => Some(Ok(r)),
                Ok(Decoded::Skip | Decoded::ByReference(_)) => None,
                Ok(Decoded::SetAside(a)) => {
                    tracing::debug!(run_id = %run, seq = a.seq, reason = %a.reason, "tail: journal message set aside");
                    None
                }
            };
            match decoded {
                // Only a message that holds its data by reference waits for the broker again.
                Ok(Decoded::ByReference(m)) => {
                    let (journal, run) = (journal.clone(), run.clone());
                    async move { report(&run, journal.resolve_retrying(&run, m).await) }
                        .left_future()
                }
                other => futures::future::ready(report(&run, other)).right_future(),
            }
        }))
    }

    /// [`Journal::resolve`] for a tail, which cannot come back to a message: broker trouble
    /// reading the blob is waited out a few times before it is reported.
    async fn resolve_retrying(
        &self,
        run: &RunId,
        m: StoredMessage,
    ) -> Result<Decoded, JournalError> {
        let mut tries = 0u64;
        loop {
            match self.resolve(run, m.clone()).await {
                Err(e) if e.kind() == ErrorKind::Unavailable && tries < 5 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(200 * tries)).await;
                }
                other => return other,
            }
        }
    }
}

pub(super) fn consumer_error(
    op: &'static str,
    e: async_nats::jetstream::stream::ConsumerError,
) -> JournalError {
    let reason = e.to_string();
    match e.kind() {
        ConsumerErrorKind::TimedOut | ConsumerErrorKind::Request => {
            JournalError::Unavailable { op, reason }
        }
        ConsumerErrorKind::JetStream(err) if matches!(err.code(), 503 | 408) => {
            JournalError::Unavailable { op, reason }
        }
        _ => JournalError::Rejected { op, reason },
    }
}

pub(super) fn ordered_error(
    e: async_nats::jetstream::consumer::pull::OrderedError,
) -> JournalError {
    let op = "tail";
    let reason = e.to_string();
    match e.kind() {
        OrderedErrorKind::MissingHeartbeat
        | OrderedErrorKind::NoResponders
        | OrderedErrorKind::Recreate
        | OrderedErrorKind::Pull => JournalError::Unavailable { op, reason },
        OrderedErrorKind::ConsumerDeleted
        | OrderedErrorKind::PushBasedConsumer
        | OrderedErrorKind::RequestLimitExceeded
        | OrderedErrorKind::Other => JournalError::Rejected { op, reason },
    }
}
