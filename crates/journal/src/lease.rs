//! Run leases: who may append a run's decisions right now.
//!
//! A lease is the key `<run_id>` in the KV bucket `kedge_leases`, holding the owner's name, written
//! with a per-message TTL (`Nats-TTL`) so that it disappears by itself when its holder stops
//! renewing it. Every write is a compare-and-set on the key's last sequence
//! (`Nats-Expected-Last-Subject-Sequence`), so of two workers racing for a run exactly one wins.
//!
//! Invariants:
//! - **The revision is a fencing token.** It is the stream sequence of the lease's last write, so
//!   it only grows — across renewals, expiry, release and takeover.
//! - **A lease always expires unless renewed.** Acquisition (over a never-used key, an expired one
//!   — the server leaves a delete marker — or a released one) and every renewal carry the TTL.
//!
//! async-nats 0.51 cannot do this through its KV API (`create_with_ttl` over a tombstone falls
//! back to an update without TTL, and there is no update-with-TTL), so leases are raw publishes
//! to `$KV.kedge_leases.<key>`; `nats kv get kedge_leases <run_id>` shows them as usual.

use std::time::Duration;

use async_nats::{Client, HeaderMap};
use bytes::Bytes;
use kedge_core::RunId;
use kedge_core::ids::WorkerId;
use kedge_core::subjects::LEASES_BUCKET;
use serde::{Deserialize, Serialize};

use crate::error::ErrorKind;
use crate::wire::{self, StoredMessage, WireError};

/// How many times [`Leases::acquire`] re-reads and retries a compare-and-set lost to a race
/// before reporting the current holder.
const ACQUIRE_ATTEMPTS: usize = 3;

/// A lease held on a run.
/// The release marker a [`Leases::release`] left: a hint for this process's next
/// [`Leases::acquire_after`] of the same run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Stream sequence of the marker.
    pub seq: u64,
}

/// A lease this process acquired (and renews). Only [`Leases`] makes one (the private field keeps
/// a struct literal out of other crates), so [`Lease::writer`], the right to append the run's
/// decisions, comes only from holding it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub run: RunId,
    pub owner: WorkerId,
    /// Sequence of the lease's last write: the fencing token. Grows with every renewal.
    pub revision: u64,
    /// Time to live of each write; the lease expires this long after its last renewal.
    pub ttl: Duration,
    _held: Held,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held;

impl Lease {
    fn held(run: &RunId, owner: &WorkerId, revision: u64, ttl: Duration) -> Lease {
        Lease {
            run: run.clone(),
            owner: owner.clone(),
            revision,
            ttl,
            _held: Held,
        }
    }

    /// The writer of the run's decisions for this holding, named `<worker>-<revision>` after the
    /// revision it was acquired at (a writer made after a renewal gets another name).
    pub fn writer(&self) -> crate::DecisionWriter {
        crate::DecisionWriter::new(
            self.run.clone(),
            format!("{}-{}", self.owner, self.revision),
        )
    }
}

/// Who holds a run's lease, as anyone may look it up ([`Leases::holder`]). Not a [`Lease`]:
/// looking gives no right to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseHolder {
    pub run: RunId,
    pub owner: String,
    pub revision: u64,
    pub ttl: Duration,
}

/// Why a lease operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// Someone holds the lease.
    #[error("lease held by `{owner}` (revision {revision})")]
    Held { owner: String, revision: u64 },
    /// The lease is no longer ours: it expired, or was taken over, or released.
    #[error("lease on {run} at revision {revision} is lost")]
    Lost { run: RunId, revision: u64 },
    /// TTLs are whole seconds, at least one.
    #[error("lease TTL {0:?} is not a whole number of seconds >= 1")]
    InvalidTtl(Duration),
    /// Retryable broker trouble.
    #[error("leases unavailable during {op}: {reason}")]
    Unavailable { op: &'static str, reason: String },
    /// The broker refused the operation.
    #[error("broker refused {op}: {reason}")]
    Rejected { op: &'static str, reason: String },
}

impl LeaseError {
    /// `Held` and `Lost` are conflicts; see [`ErrorKind`].
    pub fn kind(&self) -> ErrorKind {
        match self {
            LeaseError::Held { .. } | LeaseError::Lost { .. } => ErrorKind::Conflict,
            LeaseError::InvalidTtl(_) => ErrorKind::Invalid,
            LeaseError::Unavailable { .. } => ErrorKind::Unavailable,
            LeaseError::Rejected { .. } => ErrorKind::Other,
        }
    }

    fn wire(op: &'static str, e: WireError) -> Self {
        if e.is_transient() {
            LeaseError::Unavailable {
                op,
                reason: e.to_string(),
            }
        } else {
            LeaseError::Rejected {
                op,
                reason: e.to_string(),
            }
        }
    }
}

/// The value of a lease key.
#[derive(Debug, Serialize, Deserialize)]
struct LeaseValue {
    owner: String,
    ttl_secs: u64,
}

/// The TTL in whole seconds (≥ 1).
pub fn ttl_secs(ttl: Duration) -> Result<u64, LeaseError> {
    if ttl.subsec_nanos() != 0 || ttl.as_secs() == 0 {
        return Err(LeaseError::InvalidTtl(ttl));
    }
    Ok(ttl.as_secs())
}

/// A delete or purge marker, or the marker the server leaves when a key's TTL runs out.
fn is_tombstone(m: &StoredMessage) -> bool {
    m.header(wire::MARKER_REASON).is_some()
        || matches!(m.header(wire::KV_OPERATION), Some("DEL" | "PURGE"))
}

fn holder_of(m: &StoredMessage) -> LeaseValue {
    serde_json::from_slice(&m.payload).unwrap_or_else(|_| LeaseValue {
        owner: String::from_utf8_lossy(&m.payload).into_owned(),
        ttl_secs: 0,
    })
}

/// Handle on the `kedge_leases` bucket. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Leases {
    client: Client,
    stream: String,
    timeout: Duration,
}

impl Leases {
    pub fn new(client: Client) -> Self {
        Self {
            client,
            stream: format!("KV_{LEASES_BUCKET}"),
            timeout: crate::journal::DEFAULT_TIMEOUT,
        }
    }

    /// Sets the timeout of each broker request.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn key(run: &RunId) -> String {
        kedge_core::subjects::kv_key(LEASES_BUCKET, run.as_str())
    }

    async fn last(&self, run: &RunId, leader: bool) -> Result<Option<StoredMessage>, LeaseError> {
        let key = Self::key(run);
        let got = if leader {
            let q = serde_json::json!({ "last_by_subj": key });
            wire::leader_get(&self.client, &self.stream, q, self.timeout).await
        } else {
            wire::direct_last(&self.client, &self.stream, &key, self.timeout).await
        };
        got.map_err(|e| LeaseError::wire("read lease", e))
    }

    /// Writes the key if its last sequence is `expected`; returns the new revision.
    async fn write(
        &self,
        run: &RunId,
        expected: u64,
        ttl_secs: u64,
        value: Option<&LeaseValue>,
    ) -> Result<u64, WireError> {
        let mut headers = HeaderMap::new();
        headers.insert(wire::TTL, format!("{ttl_secs}s").as_str());
        headers.insert(
            wire::EXPECTED_LAST_SUBJECT_SEQ,
            expected.to_string().as_str(),
        );
        let payload = match value {
            Some(v) => Bytes::from(serde_json::to_vec(v).unwrap_or_default()),
            None => {
                headers.insert(wire::KV_OPERATION, "DEL");
                Bytes::new()
            }
        };
        let ack =
            wire::publish(&self.client, Self::key(run), headers, payload, self.timeout).await?;
        Ok(ack.seq)
    }

    /// Like [`Leases::acquire`], first trying to take over the release marker `hint` (what this
    /// process's own [`Leases::release`] returned): when nobody took the lease since, that is one
    /// round trip instead of two. Any other state falls back to [`Leases::acquire`].
    pub async fn acquire_after(
        &self,
        run: &RunId,
        owner: &WorkerId,
        ttl: Duration,
        hint: Option<Released>,
    ) -> Result<Lease, LeaseError> {
        if let Some(hint) = hint
            && let Some(lease) = self.retake(run, owner, ttl, hint).await?
        {
            return Ok(lease);
        }
        self.acquire(run, owner, ttl).await
    }

    /// Takes the lease over the release marker `hint` (what `owner`'s own
    /// [`Leases::release`] returned), in one compare-and-set: `None` when the marker is not the
    /// lease's last write any more (someone took the lease since, or the marker expired). A
    /// lease so taken was held by nobody else between the release and now.
    pub async fn retake(
        &self,
        run: &RunId,
        owner: &WorkerId,
        ttl: Duration,
        hint: Released,
    ) -> Result<Option<Lease>, LeaseError> {
        let secs = ttl_secs(ttl)?;
        let value = LeaseValue {
            owner: owner.to_string(),
            ttl_secs: secs,
        };
        match self.write(run, hint.seq, secs, Some(&value)).await {
            Ok(revision) => Ok(Some(Lease::held(run, owner, revision, ttl))),
            Err(e) if e.is_wrong_last() => Ok(None),
            Err(e) => Err(LeaseError::wire("acquire lease", e)),
        }
    }

    /// Takes the lease on `run` for `owner` if nobody holds it (never used, expired or released).
    /// [`LeaseError::Held`] names the holder otherwise (also when it is `owner` itself).
    ///
    /// The first look may come from a replica, which can lag: a `Held` answer may name a
    /// holder that has since lost the lease or let it go. Fine for a caller that is asked again
    /// (a wake is redelivered); see [`Leases::acquire_confirmed`] for one that is not.
    pub async fn acquire(
        &self,
        run: &RunId,
        owner: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, LeaseError> {
        self.acquire_reading(run, owner, ttl, false).await
    }

    /// [`Leases::acquire`] with every look at the lease asked of the stream's leader, so that a
    /// `Held` answer names the holder of now, not one a lagging replica still shows (e.g. a
    /// holder that was taken over while that replica was cut off). For a caller that acts on
    /// `Held` once, with nothing to ask it again: a run adopted from a gone worker. One round
    /// trip like the other, through the leader.
    pub async fn acquire_confirmed(
        &self,
        run: &RunId,
        owner: &WorkerId,
        ttl: Duration,
    ) -> Result<Lease, LeaseError> {
        self.acquire_reading(run, owner, ttl, true).await
    }

    /// [`Leases::acquire`], its first look at the leader's copy when `leader`.
    async fn acquire_reading(
        &self,
        run: &RunId,
        owner: &WorkerId,
        ttl: Duration,
        mut leader: bool,
    ) -> Result<Lease, LeaseError> {
        let secs = ttl_secs(ttl)?;
        let value = LeaseValue {
            owner: owner.to_string(),
            ttl_secs: secs,
        };
        // After losing a race, the leader is asked (a replica's look may lag the write that won).
        for _ in 0..ACQUIRE_ATTEMPTS {
            let expected = match self.last(run, leader).await? {
                None => 0,
                Some(m) if is_tombstone(&m) => m.seq,
                Some(m) => {
                    return Err(LeaseError::Held {
                        owner: holder_of(&m).owner,
                        revision: m.seq,
                    });
                }
            };
            match self.write(run, expected, secs, Some(&value)).await {
                Ok(revision) => {
                    tracing::debug!(run_id = %run, %owner, revision, "lease acquired");
                    return Ok(Lease::held(run, owner, revision, ttl));
                }
                Err(e) if e.is_wrong_last() => leader = true,
                Err(e) => return Err(LeaseError::wire("acquire lease", e)),
            }
        }
        Err(LeaseError::Unavailable {
            op: "acquire lease",
            reason: format!("still contended after {ACQUIRE_ATTEMPTS} attempts"),
        })
    }

    /// Takes the lease on `run` for `owner` from a holder that is gone (its connection closed:
    /// see `kedge_runtime::liveness`), without waiting for its TTL. `revision` is the holder's
    /// last write as [`LeaseError::Held`] reported it; the write is a compare-and-set on it, so
    /// of several takers exactly one wins, and a holder that renewed meanwhile (it was not gone
    /// after all) keeps the lease: the others get [`LeaseError::Lost`]. The old holder's writes
    /// are fenced as after an expiry: its renewals fail, and its appends meet the concurrency
    /// check.
    pub async fn take_over(
        &self,
        run: &RunId,
        owner: &WorkerId,
        ttl: Duration,
        revision: u64,
    ) -> Result<Lease, LeaseError> {
        let secs = ttl_secs(ttl)?;
        let value = LeaseValue {
            owner: owner.to_string(),
            ttl_secs: secs,
        };
        match self.write(run, revision, secs, Some(&value)).await {
            Ok(new) => {
                tracing::info!(run_id = %run, %owner, revision = new, "lease taken over from a gone holder");
                Ok(Lease::held(run, owner, new, ttl))
            }
            Err(e) if e.is_wrong_last() => Err(LeaseError::Lost {
                run: run.clone(),
                revision,
            }),
            Err(e) => Err(LeaseError::wire("take over lease", e)),
        }
    }

    /// Extends the lease by its TTL from now. The result has a new revision (the fencing token
    /// to use from now on); the lease still expires unless renewed again.
    /// [`LeaseError::Lost`] if it expired or someone else took it meanwhile.
    pub async fn renew(&self, lease: &Lease) -> Result<Lease, LeaseError> {
        let secs = ttl_secs(lease.ttl)?;
        let value = LeaseValue {
            owner: lease.owner.to_string(),
            ttl_secs: secs,
        };
        match self
            .write(&lease.run, lease.revision, secs, Some(&value))
            .await
        {
            Ok(revision) => Ok(Lease {
                revision,
                ..lease.clone()
            }),
            Err(e) if e.is_wrong_last() => Err(LeaseError::Lost {
                run: lease.run.clone(),
                revision: lease.revision,
            }),
            Err(e) => Err(LeaseError::wire("renew lease", e)),
        }
    }

    /// Gives the lease up at once (a delete marker, itself expiring after the lease's TTL).
    /// [`LeaseError::Lost`] if it was not ours anymore.
    pub async fn release(&self, lease: Lease) -> Result<Released, LeaseError> {
        let secs = ttl_secs(lease.ttl)?;
        match self.write(&lease.run, lease.revision, secs, None).await {
            Ok(seq) => {
                tracing::debug!(run_id = %lease.run, owner = %lease.owner, "lease released");
                Ok(Released { seq })
            }
            Err(e) if e.is_wrong_last() => Err(LeaseError::Lost {
                run: lease.run,
                revision: lease.revision,
            }),
            Err(e) => Err(LeaseError::wire("release lease", e)),
        }
    }

    /// The current holder of `run`'s lease, if any (by direct get: may trail the leader in a
    /// cluster).
    pub async fn holder(&self, run: &RunId) -> Result<Option<LeaseHolder>, LeaseError> {
        Ok(self.last(run, false).await?.and_then(|m| {
            if is_tombstone(&m) {
                return None;
            }
            let v = holder_of(&m);
            Some(LeaseHolder {
                run: run.clone(),
                owner: v.owner,
                revision: m.seq,
                ttl: Duration::from_secs(v.ttl_secs),
            })
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_are_whole_seconds() {
        assert_eq!(ttl_secs(Duration::from_secs(5)), Ok(5));
        assert!(ttl_secs(Duration::ZERO).is_err());
        assert!(ttl_secs(Duration::from_millis(1500)).is_err());
        assert!(ttl_secs(Duration::from_millis(500)).is_err());
    }

    fn msg(headers: &[(&str, &str)], payload: &[u8]) -> StoredMessage {
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.insert(*k, *v);
        }
        StoredMessage {
            seq: 1,
            subject: "$KV.kedge_leases.run_x".into(),
            headers: h,
            payload: Bytes::copy_from_slice(payload),
        }
    }

    #[test]
    fn tombstones_are_recognised() {
        assert!(is_tombstone(&msg(&[("KV-Operation", "DEL")], b"")));
        assert!(is_tombstone(&msg(&[("KV-Operation", "PURGE")], b"")));
        assert!(is_tombstone(&msg(&[("Nats-Marker-Reason", "MaxAge")], b"")));
        assert!(!is_tombstone(&msg(
            &[("Nats-TTL", "5s")],
            br#"{"owner":"a"}"#
        )));
        assert_eq!(
            holder_of(&msg(&[], br#"{"owner":"a","ttl_secs":5}"#)).owner,
            "a"
        );
        assert_eq!(holder_of(&msg(&[], b"legacy")).owner, "legacy");
    }
}
