//! Holding a run: its lease taken (taken back from parking, over this process's own release
//! marker, over a holder that is gone, or yielded by a live one), renewed while a drive runs,
//! parked between drives that leave the run waiting on its tools, and released
//! (docs/ARCHITECTURE.md "The step service", its parked leases; "Takeover").

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::jetstream::{AckKind, Message};
use kedge_core::ids::{RunId, WorkerId};
use kedge_core::subjects;
use kedge_journal::{Lease, LeaseError, Released};
use kedge_runtime::Runtime;
use kedge_runtime::liveness::Hold;
use kedge_runtime::metrics::{self, Takeover};
use tokio::sync::{oneshot, watch};

use super::cache::CACHE_RUNS;
use super::{DriveError, Driver};

/// How long a worker woken for a run whose lease another live worker holds waits for that
/// worker's answer to "let go of it if you keep it parked" (no answer: busy, as before).
const YIELD_TIMEOUT: Duration = Duration::from_millis(500);

/// A lease with less than this left of its parking window is released at once instead.
const MIN_PARK: Duration = Duration::from_millis(50);

/// A lease held by this process and when it was last written (taken before the write was
/// sent, so on the safe side of the TTL the broker counts from its store).
pub(super) struct Holding {
    pub(super) lease: Lease,
    pub(super) written: Instant,
    /// The run's announcement in the heartbeats, kept from a parked holding.
    pub(super) hold: Option<Hold>,
    /// Nobody else held the lease since this process last did: taken back from its parking or
    /// over its own release marker.
    pub(super) continuous: bool,
}

impl Holding {
    /// A lease taken at `written` with a write that may follow another holder's, not yet
    /// announced in the heartbeats.
    fn fresh(lease: Lease, written: Instant) -> Holding {
        Holding {
            lease,
            written,
            hold: None,
            continuous: false,
        }
    }
}

/// A lease kept after a drive that left its run waiting on its tools (the agent loop's next
/// drive follows in milliseconds): that drive takes it back without a write, instead of a
/// release now and an acquire then. Parked at most until the lease's next renewal was due
/// (`lease_renew_ms` after its last write), so a parked lease is never older than one in use
/// between two renewals; then released. Another step worker woken for the run asks for it on
/// `kedge.live.yield.<worker>` ([`Driver::yield_parked`]).
pub(super) struct Parked {
    /// With the run's announcement in the heartbeats (`hold` is set).
    held: Holding,
    /// Tells this parking from a later one of the same run: the expiry releases only its own.
    id: u64,
}

/// Keeps a lease alive in the background and marks the wake message in progress.
pub(super) struct Keeper {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Option<(Lease, Instant)>>,
    pub(super) lost: watch::Receiver<bool>,
}

impl Keeper {
    /// Renews `lease` every `lease_renew` after its last write at `written`.
    pub(super) fn start(
        rt: &Runtime,
        lease: Lease,
        written: Instant,
        msg: Option<Arc<Message>>,
    ) -> Keeper {
        let (stop, mut stopped) = oneshot::channel();
        let (lost_tx, lost) = watch::channel(false);
        let leases = rt.leases.clone();
        let every = rt.config.timeouts.lease_renew();
        let task = tokio::spawn(async move {
            let mut lease = lease;
            let mut written = written;
            // The last renewal tried (one that failed is tried again `every` later, not at once).
            let mut tried = written;
            loop {
                tokio::select! {
                    _ = &mut stopped => return Some((lease, written)),
                    _ = tokio::time::sleep_until((tried + every).into()) => {}
                }
                let at = Instant::now();
                tried = at;
                match leases.renew(&lease).await {
                    Ok(renewed) => {
                        lease = renewed;
                        written = at;
                    }
                    // Broker trouble (a leader election, a reconnect): the lease is still ours
                    // until its TTL runs out or someone takes it; try again next time.
                    Err(e @ LeaseError::Unavailable { .. }) => {
                        tracing::warn!(run_id = %lease.run, error = %e, "lease renewal failed; will try again");
                    }
                    Err(e) => {
                        tracing::warn!(run_id = %lease.run, error = %e, "lease lost; giving the run up");
                        metrics::fenced_write(metrics::Fenced::Lease);
                        let _ = lost_tx.send(true);
                        return None;
                    }
                }
                if let Some(msg) = &msg {
                    let _ = msg.ack_with(AckKind::Progress).await;
                }
            }
        });
        Keeper { stop, task, lost }
    }

    /// Stops renewing and returns the lease if it is still held, and when it was last written.
    pub(super) async fn finish(self) -> Option<(Lease, Instant)> {
        let _ = self.stop.send(());
        self.task.await.ok().flatten()
    }
}

impl Driver {
    /// Notes that `run` is adopted from a worker whose last heartbeat was heard at `last_heard`
    /// (for the takeover latency metric; forgotten once the lease is taken, or in bulk).
    pub fn adopting(&self, run: &RunId, last_heard: std::time::Instant) {
        if let Ok(mut adopted) = self.adopted.lock() {
            adopted.insert(run.clone(), last_heard);
        }
    }

    /// Releases `lease`; its marker is this process's hint for the run's next acquire.
    pub(super) async fn release(&self, lease: Lease) {
        let run = lease.run.clone();
        match self.rt.leases.release(lease).await {
            Ok(marker) => {
                if let Ok(mut released) = self.released.lock() {
                    released.insert(run, marker);
                }
            }
            Err(e) => {
                tracing::debug!(run_id = %run, error = %e, "lease release failed; it will expire")
            }
        }
    }

    /// Keeps `lease` (last written at `written`) for the run's next drive here until its next
    /// renewal would be due, then releases it ([`Parked`]).
    pub(super) async fn park(&self, lease: Lease, written: Instant, hold: Hold) {
        let renew = self.rt.config.timeouts.lease_renew();
        let Some(left) = park_window(renew, written.elapsed()) else {
            self.release(lease).await;
            return;
        };
        let run = lease.run.clone();
        let id = self.park_ids.fetch_add(1, Ordering::Relaxed);
        let refused = match self.parked.lock() {
            Ok(mut parked) if parked.len() < CACHE_RUNS => {
                let entry = Parked {
                    held: Holding {
                        lease,
                        written,
                        hold: Some(hold),
                        continuous: true,
                    },
                    id,
                };
                parked.insert(run.clone(), entry);
                None
            }
            _ => Some(lease),
        };
        if let Some(lease) = refused {
            self.release(lease).await;
            return;
        }
        let driver = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(left).await;
            let expired = driver
                .parked
                .lock()
                .ok()
                .and_then(|mut parked| match parked.get(&run) {
                    Some(p) if p.id == id => parked.remove(&run),
                    _ => None,
                });
            if let Some(p) = expired {
                driver.release(p.held.lease).await;
            }
        });
    }

    /// Lets go of `run`'s lease if this process keeps it parked, for another worker woken for
    /// the run (asked on `kedge.live.yield.<worker>`): released at once, and the marker's
    /// sequence is returned for the asker's acquire. `None` when nothing is parked for it (the
    /// run is being driven here, or this process does not hold it).
    pub async fn yield_parked(&self, run: &RunId) -> Option<Released> {
        let p = self.parked.lock().ok().and_then(|mut p| p.remove(run))?;
        tracing::debug!(run_id = %run, "parked lease yielded to another worker");
        self.rt.leases.release(p.held.lease).await.ok()
    }

    /// Releases every parked lease (the service is stopping).
    pub async fn release_parked(&self) {
        let all: Vec<Parked> = self
            .parked
            .lock()
            .map(|mut p| p.drain().map(|(_, p)| p).collect())
            .unwrap_or_default();
        for p in all {
            self.release(p.held.lease).await;
        }
    }

    /// Takes the run's lease: `None` when another live worker holds it. `adopted`: the run has
    /// no wake of its own (adopted from a gone worker, or driven again after such a drive), so
    /// a `None` is final here: the lease is read from the stream's leader, never from a replica
    /// that may still name the gone worker or a holder since taken over (docs/ARCHITECTURE.md
    /// "Takeover").
    pub(super) async fn acquire(
        &self,
        run: &RunId,
        adopted: bool,
    ) -> Result<Option<Holding>, DriveError> {
        let cfg = &self.rt.config;
        // A lease this process parked after the run's last drive: taken back without a write.
        let parked = self.parked.lock().ok().and_then(|mut p| p.remove(run));
        if let Some(p) = parked {
            let held = p.held;
            if held.written.elapsed() < cfg.timeouts.lease_renew() {
                return Ok(Some(held));
            }
            // Its window ran out before its expiry let it go: renewed, as the keeper would.
            let at = Instant::now();
            match self.rt.leases.renew(&held.lease).await {
                Ok(lease) => {
                    return Ok(Some(Holding {
                        lease,
                        written: at,
                        hold: held.hold,
                        continuous: true,
                    }));
                }
                Err(LeaseError::Lost { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let hint = self.released.lock().ok().and_then(|mut r| r.remove(run));
        let ttl = cfg.timeouts.lease_ttl();
        let at = Instant::now();
        let fresh = |lease| Some(Holding::fresh(lease, at));
        // Over this process's own release marker: nobody held it in between.
        if let Some(hint) = hint
            && let Some(lease) = self
                .rt
                .leases
                .retake(run, &cfg.worker_id, ttl, hint)
                .await?
        {
            return Ok(Some(Holding {
                lease,
                written: at,
                hold: None,
                continuous: true,
            }));
        }
        let acquired = if adopted {
            self.rt
                .leases
                .acquire_confirmed(run, &cfg.worker_id, ttl)
                .await
        } else {
            self.rt.leases.acquire(run, &cfg.worker_id, ttl).await
        };
        match acquired {
            Ok(lease) => Ok(fresh(lease)),
            Err(LeaseError::Held { owner, revision }) => {
                self.held_by(run, &owner, revision, at).await
            }
            Err(e) => Err(e.into()),
        }
    }

    /// `run`'s lease is held by `owner` (as the broker names it) at `revision`. Held by a
    /// process that is gone (the broker has no connection for it), or by this process itself
    /// (one drive per run per process, so such a lease is left over from an earlier holding
    /// whose release failed, possibly before a restart under the same worker id; unless another
    /// live process heartbeats under that id): taken over now instead of waiting out its TTL.
    /// Held by a live worker: between two drives it keeps the lease parked, and lets go when
    /// asked.
    async fn held_by(
        &self,
        run: &RunId,
        owner: &str,
        revision: u64,
        at: Instant,
    ) -> Result<Option<Holding>, DriveError> {
        // A name that is no worker id is no Kedge process's: nobody heartbeats or answers for it.
        let Ok(owner) = owner.parse::<WorkerId>() else {
            return self.take_over(run, None, revision, at).await;
        };
        let mine = owner == self.rt.config.worker_id;
        if (mine && self.liveness.id_is_unique()) || self.liveness.is_gone(&owner).await {
            self.take_over(run, Some(&owner), revision, at).await
        } else if mine {
            Ok(None)
        } else {
            self.ask_to_yield(run, &owner).await
        }
    }

    /// Takes `run`'s lease over from `owner`, a holder that is gone or this process itself
    /// (`None`: a holder whose name is no worker id; see [`Driver::held_by`]), at the lease's
    /// `revision`; `at`: when the acquire began. `None` when another worker took it first.
    async fn take_over(
        &self,
        run: &RunId,
        owner: Option<&WorkerId>,
        revision: u64,
        at: Instant,
    ) -> Result<Option<Holding>, DriveError> {
        let cfg = &self.rt.config;
        let ttl = cfg.timeouts.lease_ttl();
        let fresh = |lease| Some(Holding::fresh(lease, at));
        match self
            .rt
            .leases
            .take_over(run, &cfg.worker_id, ttl, revision)
            .await
        {
            Ok(lease) => {
                tracing::warn!(run_id = %run, previous = %owner.map_or("(no worker id)", WorkerId::as_str), "took over the run from a holder that is gone");
                let heard = self.adopted.lock().ok().and_then(|mut a| a.remove(run));
                metrics::takeover(Takeover::Run, heard.map(|at| at.elapsed()));
                // Its model call in flight may still deliver (a dropped connection is
                // not a dead process): remembered for `await_interrupted_answer`.
                if owner != Some(&cfg.worker_id) {
                    let last = heard
                        .or_else(|| owner.and_then(|o| self.liveness.last_heard(o)))
                        .unwrap_or_else(std::time::Instant::now);
                    if let Ok(mut taken) = self.taken_from.lock() {
                        taken.insert(run.clone(), last);
                    }
                }
                Ok(fresh(lease))
            }
            // Our own parked lease, released by its expiry meanwhile: taken afresh.
            Err(LeaseError::Lost { .. }) if owner == Some(&cfg.worker_id) => {
                match self.rt.leases.acquire(run, &cfg.worker_id, ttl).await {
                    Ok(lease) => Ok(fresh(lease)),
                    Err(LeaseError::Held { .. }) => Ok(None),
                    Err(e) => Err(e.into()),
                }
            }
            Err(LeaseError::Lost { .. } | LeaseError::Held { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Asks `owner`, a live worker holding `run`'s lease, to let go of it if it keeps it parked
    /// ([`Driver::yield_parked`]), and takes it if so. `None` (busy) when the owner is driving
    /// the run, does not answer in [`YIELD_TIMEOUT`] or runs a build without parking (no
    /// responders), or another worker took the lease first.
    async fn ask_to_yield(
        &self,
        run: &RunId,
        owner: &WorkerId,
    ) -> Result<Option<Holding>, DriveError> {
        let request = async_nats::Request::new()
            .payload(run.as_str().to_owned().into())
            .timeout(Some(YIELD_TIMEOUT));
        let Ok(answer) = self
            .rt
            .client
            .send_request(subjects::live_yield(owner), request)
            .await
        else {
            return Ok(None);
        };
        let Some(seq) = yielded_seq(&answer.payload) else {
            return Ok(None);
        };
        let cfg = &self.rt.config;
        let at = Instant::now();
        match self
            .rt
            .leases
            .acquire_after(
                run,
                &cfg.worker_id,
                cfg.timeouts.lease_ttl(),
                Some(Released { seq }),
            )
            .await
        {
            Ok(lease) => Ok(Some(Holding::fresh(lease, at))),
            Err(LeaseError::Held { .. } | LeaseError::Lost { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// How many times this process's broker connection was made (it grows on a reconnect).
    pub(super) fn connects(&self) -> u64 {
        self.rt
            .client
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether this process still holds `run`'s lease, as the broker has it (an answer the
    /// lease cannot be read for is not committed: it is stored for whoever holds the run).
    pub(super) async fn still_holds(&self, run: &RunId) -> bool {
        match self.rt.leases.holder(run).await {
            Ok(Some(h)) => h.owner == self.rt.config.worker_id.as_str(),
            Ok(None) | Err(_) => false,
        }
    }
}

/// How long a lease last written `since_written` ago may stay parked: until its next renewal
/// (every `renew`) would be due; `None` when less than [`MIN_PARK`] is left of that.
fn park_window(renew: Duration, since_written: Duration) -> Option<Duration> {
    let left = renew.saturating_sub(since_written);
    (left >= MIN_PARK).then_some(left)
}

/// The release marker's sequence in a worker's answer to a yield request
/// ([`Driver::ask_to_yield`]); `None` for an empty answer (nothing parked) or one that is not
/// a sequence.
fn yielded_seq(payload: &[u8]) -> Option<u64> {
    std::str::from_utf8(payload)
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_parked_only_while_enough_is_left_before_its_renewal() {
        let renew = Duration::from_secs(5);
        assert_eq!(
            park_window(renew, Duration::from_secs(1)),
            Some(Duration::from_secs(4))
        );
        assert_eq!(park_window(renew, Duration::ZERO), Some(renew));
        assert_eq!(park_window(renew, renew - MIN_PARK), Some(MIN_PARK));
        let just_short = renew - MIN_PARK + Duration::from_millis(1);
        assert_eq!(park_window(renew, just_short), None);
        assert_eq!(park_window(renew, Duration::from_secs(9)), None);
    }

    #[test]
    fn a_yield_answer_is_a_release_markers_sequence_or_nothing() {
        assert_eq!(yielded_seq(b"42"), Some(42));
        assert_eq!(yielded_seq(b"18446744073709551615"), Some(u64::MAX));
        // Nothing parked: the empty answer.
        assert_eq!(yielded_seq(b""), None);
        for garbage in [
            &b"-1"[..],
            b"42 ",
            b"0x2a",
            b"\xff\x34",
            b"18446744073709551616",
        ] {
            assert_eq!(yielded_seq(garbage), None, "{garbage:?}");
        }
    }
}
