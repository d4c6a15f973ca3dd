//! The projector: the service that writes the `kedge_runs` projection (`kedge serve projector`,
//! [`run`]), one summary per run, a cache of its journal, and its rebuild ([`rebuild`], `kedge
//! runs rebuild`). A service of its own, with a crate of its own: the bridge only reads the
//! projection, through its read side in `kedge_runtime::projection` (the summary, get, list),
//! which both import (docs/ARCHITECTURE.md, "Map of the house").
//!
//! Key `<tenant>.<run_id>`, value a JSON [`RunSummary`]. The summary is always the fold of the
//! run's whole journal as read at one moment, and carries `seq`, the journal sequence it was folded
//! through. Invariants:
//!
//! - **Rebuildable.** Nothing is in the projection that is not in the journal: [`rebuild`] (the
//!   `kedge runs rebuild` command) recomputes every entry from the journal.
//! - **Stale never wins.** A write is a compare-and-set on the key's KV revision, and is made only
//!   when the summary's `seq` is newer than the stored one; a lost race re-reads and compares
//!   again. So two projectors, a slow one and a fast one, a projector and a step service, or a
//!   projector and a rebuild, converge on the newest fold whatever the order their writes
//!   arrive in.
//! - **Nobody waits on it.** The step service decides from the journal, never from a summary
//!   (it reads a stored one only to compare-and-set its own); the bridge uses it only to list
//!   runs (`GET /v1/runs`), and answers everything about one run from its journal itself. A
//!   run that is a moment old may be missing from the list: the list is eventually consistent.
//!
//! Two services write it. The step service, the runs' decision writer, writes a run's summary
//! from the fold it holds after each drive (a run that is not busy at once, before it lets go
//! of the run; a busy one at most once per `bridge.runs_list_interval_ms`): that is how a
//! run's progress reaches the list. The projector is the net under it and the list's
//! rebuild: a durable consumer (`projector`, `nats/consumers/KEDGE_RUNS/projector.json`) of the
//! runs' run-level decisions only (`agent.run.*.d.run.*`: `run.created` from intake, a run's
//! start, waits, revivals and ends; one filter subject), so it costs nothing per step of a
//! run. For each run it first reads the stored summary's `seq` (one KV get): when the step
//! service stored the run through the decisions delivered, that is all. Otherwise (the step
//! process died between its append and its write, an older step service that does not write
//! the list) it reads, folds and stores the run as before. It projects many runs at once
//! and one run at a time: the decisions of a run delivered while it is being projected are
//! covered by one more read, fold and store, and a decision at or before a summary it
//! already stored costs no request at all. A write starts from what the process last stored
//! for the run (a compare-and-set on that revision, or a create for a run first seen by its
//! `run.created`), so it is usually one request; a wrong guess falls back to reading the key.
//! It keeps the fold of each unfinished run it follows (bounded), so a read covers only the
//! events after the last one folded; that read follows the links of the decisions it was
//! delivered back to the fold, fetching only the messages between them by sequence
//! ([`kedge_journal::Journal::read_linked`]), and reads the run's subjects only when a link
//! is missing (docs/ARCHITECTURE.md "The bridge and the runs projection"). And it writes a
//! run at most once per `bridge.runs_list_interval_ms` (250 ms): after a projection the run
//! rests, holding no slot, and the decisions delivered meanwhile gather in its inbox entry
//! for the next pass (its first decision is projected at once; a stop projects what resting
//! runs gathered before it returns).
//!
//! [`RunSummary`]: kedge_runtime::projection::RunSummary

mod projector;
mod rebuild;
mod store;
mod summary;
#[cfg(test)]
mod tests;

pub use kedge_runtime::projection::Stored;
pub use projector::{PROJECTOR, run};
pub use rebuild::{RebuildReport, rebuild};
pub use store::Writer;
pub use summary::summarize;
