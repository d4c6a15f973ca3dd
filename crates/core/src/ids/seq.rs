//! [`DecisionSeq`]: the stream sequence of a run's decision.

use serde::{Deserialize, Serialize};

/// The stream sequence of a run's decision (in `KEDGE_RUNS`): what a decision append is checked
/// against (the run's last decision when the writer decided, `DecisionSeq::NONE` before its
/// first). A type of its own because a writer handles two sequences side by side, the run's last
/// decision and the run's last message of any kind (docs/ARCHITECTURE.md "The journal"), and the
/// two must not be swapped.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct DecisionSeq(u64);

impl DecisionSeq {
    /// No decision yet: what a run's first decision (`run.created`) is appended after.
    pub const NONE: DecisionSeq = DecisionSeq(0);

    /// The decision stored at stream sequence `seq`.
    pub const fn at(seq: u64) -> DecisionSeq {
        DecisionSeq(seq)
    }

    pub const fn get(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for DecisionSeq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}
