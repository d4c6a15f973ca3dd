//! Kedge's journal over NATS JetStream: the only place that talks to the journal stream.
//!
//! - [`layout`]: the streams, KV buckets and object store as data (the JSON files under `nats/`,
//!   embedded), and [`ensure_layout`], the startup check that the broker is new enough and has
//!   them with every flag Kedge relies on.
//! - [`journal`]: [`Journal`] — decision appends (single writer, optimistic concurrency on the
//!   run's decision subjects, atomic groups), input appends (deduplicated by `Nats-Msg-Id`),
//!   exact reads after a sequence (of the whole run or of one event type; messages that are not
//!   events of the run are set aside and reported, never fatal), live tails,
//!   last-sequence lookups.
//! - [`lease`]: [`Leases`] — per-run leases with a TTL in `kedge_leases`, whose revision is a
//!   fencing token.
//! - [`error`]: [`JournalError`] and the [`ErrorKind`] callers branch on.
//!
//! Invariants (principles 1–3): a run's journal is the subject tree `agent.run.<id>.>` of
//! the one stream `KEDGE_RUNS`; the stream sequence is the event's number; a decision lands only
//! if the run's last decision is the one its writer saw; a group of decisions lands whole or not
//! at all; an input with a given `Nats-Msg-Id` is stored once. Nothing here panics on data from
//! the network.
//!
//! Mechanisms chosen by measurement (nats-server 2.15.1, loopback, 2 shared cores; run
//! `cargo bench -p kedge-journal --bench journal` for your machine):
//! - [`Journal::read`] uses batched direct gets, checked against the stream leader so that it never
//!   misses an acknowledged event. On one node it costs about what an ordered consumer does
//!   (~1.2 ms for 50 events); on a three-node R3 cluster it was twice as fast (p50 ~1 ms vs ~2 ms,
//!   p99 ~3 ms vs ~5 ms), and it creates no consumer: nats-server 2.15 caps a stream's consumers
//!   (1000 by default), and an ordered consumer lingers 30 s after use.
//! - [`Journal::tail`] uses an ordered consumer (it has to follow live appends).
//! - A decision group is one atomic batch: ~2–3 ms at p50 on a single-node file stream (the server
//!   stages batches on disk; its tail follows disk contention, up to tens of ms) against
//!   ~0.05–0.4 ms for a single decision. Put several intents in one decision where a batch is not
//!   worth it.

pub mod blob;
pub mod error;
pub mod journal;
pub mod layout;
pub mod lease;
mod wire;

pub use blob::{BlobError, BlobRef, Blobs};
pub use error::{ErrorKind, JournalError};
pub use journal::{
    Appended, DecisionMsgId, DecisionWriter, Delivered, Delivery, InputAppended, Journal,
    LastEvent, Latest, ReadPage, Recorded, RunCreator, Scanned, SetAside, TRACEPARENT_HEADER,
    decision_msg_id, parse_decision_msg_id, purge,
};
pub use layout::{LAYOUT, LayoutError, LayoutOptions, LayoutReport, ensure_layout, verify_layout};
pub use lease::{Lease, LeaseError, LeaseHolder, Leases, Released};
