//! Errors of the journal, classified by what the caller does next.
//!
//! Every failure maps to one [`ErrorKind`]; a consumer handling a message branches on it:
//! `Unavailable` → retry later (NAK with delay), `Conflict` → the run's decisions moved on
//! (drop the lease and re-read), `Duplicate` → the write is already there (ack), `Invalid` →
//! a poison message or a caller bug (term), `TooOld` → the broker lacks a feature (refuse to run).

use crate::wire::{WireError, codes};

/// What a caller does with a failure; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Someone else appended a decision since the expected sequence: the caller is no longer the
    /// run's decision writer (or its view is stale).
    Conflict,
    /// The write is already in the journal (an earlier attempt of the same append landed).
    Duplicate,
    /// Retryable broker trouble: timeouts, no responders (also what a cluster failover looks
    /// like), disconnection, a stream without a leader.
    Unavailable,
    /// The broker does not support what the journal needs (or the stream lacks the flag).
    TooOld,
    /// Data that cannot be journaled or read back: a stored message that is not an envelope, an
    /// event of the wrong kind, a malformed request.
    Invalid,
    /// Anything else the broker refused; not retryable as is.
    Other,
}

/// A journal operation's failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JournalError {
    /// The expected-last-decision check failed: another writer decided.
    #[error("decision conflict: expected last decision at {expected}, the run's is at {actual}")]
    Conflict { expected: u64, actual: u64 },
    /// An append checked against the run's last message (any message, not only decisions)
    /// found more of the run after it, inputs or messages set aside, but no other writer's
    /// decision: the writer's state is behind the run; it reads what landed and decides again.
    #[error("the run moved on: expected its last message at {expected}")]
    Behind { expected: u64 },
    /// The append is already journaled; `seq` is the sequence of its (last) message.
    #[error("already journaled at sequence {seq}")]
    Duplicate { seq: u64 },
    /// Retryable broker trouble.
    #[error("journal unavailable during {op}: {reason}")]
    Unavailable { op: &'static str, reason: String },
    /// The broker lacks a feature the journal relies on.
    #[error("the broker does not support {what}: {reason}")]
    TooOld { what: &'static str, reason: String },
    /// A stored message that is not a valid envelope of this run.
    #[error("journal message at sequence {seq} is invalid: {reason}")]
    Invalid { seq: u64, reason: String },
    /// A request that cannot be journaled as given (empty group, events of another run, …).
    #[error("bad journal request: {0}")]
    BadRequest(String),
    /// The broker refused the operation for another reason.
    #[error("broker refused {op}: {reason}")]
    Rejected { op: &'static str, reason: String },
}

impl JournalError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            JournalError::Conflict { .. } | JournalError::Behind { .. } => ErrorKind::Conflict,
            JournalError::Duplicate { .. } => ErrorKind::Duplicate,
            JournalError::Unavailable { .. } => ErrorKind::Unavailable,
            JournalError::TooOld { .. } => ErrorKind::TooOld,
            JournalError::Invalid { .. } | JournalError::BadRequest(_) => ErrorKind::Invalid,
            JournalError::Rejected { .. } => ErrorKind::Other,
        }
    }

    /// Shorthand for `kind() == ErrorKind::Unavailable`.
    pub fn is_retryable(&self) -> bool {
        self.kind() == ErrorKind::Unavailable
    }

    /// Maps a wire failure of operation `op`. Codes with an operation-specific meaning (10071,
    /// 10201) are handled by the callers before this.
    pub(crate) fn from_wire(op: &'static str, err: WireError) -> Self {
        if err.is_transient() {
            return JournalError::Unavailable {
                op,
                reason: err.to_string(),
            };
        }
        match err {
            WireError::Api(e) if e.err_code == codes::ATOMIC_DISABLED => JournalError::TooOld {
                what: "atomic batch publish (stream flag allow_atomic)",
                reason: e.to_string(),
            },
            WireError::Api(e) if e.err_code == codes::STREAM_NOT_FOUND => JournalError::Rejected {
                op,
                reason: format!("{e}; run ensure_layout first"),
            },
            WireError::BadRequest(reason) => JournalError::BadRequest(reason),
            other => JournalError::Rejected {
                op,
                reason: other.to_string(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::ApiError;

    fn api(code: u16, err_code: u64) -> WireError {
        WireError::Api(ApiError {
            code,
            err_code,
            description: "x".into(),
        })
    }

    #[test]
    fn wire_errors_map_to_kinds() {
        let cases = [
            (WireError::TimedOut, ErrorKind::Unavailable),
            (WireError::NoResponders, ErrorKind::Unavailable),
            (WireError::Client("closed".into()), ErrorKind::Unavailable),
            (api(503, 10008), ErrorKind::Unavailable),
            (api(400, codes::ATOMIC_DISABLED), ErrorKind::TooOld),
            (api(404, codes::STREAM_NOT_FOUND), ErrorKind::Other),
            (WireError::BadRequest("too big".into()), ErrorKind::Invalid),
            (WireError::Malformed("?".into()), ErrorKind::Other),
        ];
        for (wire, kind) in cases {
            let shown = wire.to_string();
            assert_eq!(JournalError::from_wire("t", wire).kind(), kind, "{shown}");
        }
    }
}
