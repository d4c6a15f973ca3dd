//! The failure detector: which worker processes are alive, and what a dead one held.
//!
//! One [`Liveness`] per process that drives runs or runs tools (`kedge serve step`, `tool`,
//! `all`), shared by its services ([`crate::Runtime::liveness`]). It
//!
//! - publishes a **heartbeat** on `kedge.live.hb.<worker>` every `heartbeat_ms`, naming what
//!   it holds: the runs whose lease it holds and the tool operations it is running. A newly held
//!   run or operation is announced at once, before the holder acts on it (so a process killed
//!   right after it took a run, at the worst moment, is still known to have held it); a released
//!   run stays listed for one more heartbeat interval, so that taking it again within it (an
//!   agent loop's next drive) needs no announcement (a listed released run costs a standby at
//!   most a harmless, idle drive of it, and only when this process dies in between).
//!   Core NATS: nothing is stored, and a broker
//!   leader election (a JetStream matter) does not interrupt it;
//! - answers **pings** on `kedge.live.ping.<worker>`;
//! - **watches** every other worker's heartbeats. One silent for `suspect_after_ms` is a suspect
//!   and is pinged. The broker answers a ping to a process whose connection is closed (killed,
//!   crashed, partitioned away from the broker) with *no responders* at once: that process is
//!   **gone**, and a [`Death`] with what its last heartbeat said it held goes to every
//!   [`Liveness::deaths`] receiver. A suspect that answers, or does not answer in time (a
//!   process paused by the OS or a long GC-like stall: its connection is open), is alive; it is
//!   pinged again every [`PROBE_EVERY`] while it stays silent.
//!
//! Nobody takes anything from a live process, however slow: the broker's verdict on its
//! connection is the only way to "gone". What is held is still fenced the usual way (lease
//! revisions, operation records' compare-and-set), so a wrong verdict (a process whose
//! connection dropped and came back) costs repeated work, never a double effect.
//!
//! [`Liveness::is_gone`] asks the same question about any worker on demand (a lease or an
//! operation record left by a process this one never heard, e.g. before a restart).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_nats::{Client, RequestErrorKind};
use futures::StreamExt as _;
use kedge_core::ids::{OperationId, RunId, WorkerId};
use kedge_core::subjects::{self, LIVE_HEARTBEATS};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::RuntimeError;

/// How often a silent process that answered (or did not answer) a ping is pinged again.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);
/// A worker silent this long is forgotten (it left without a verdict: e.g. stopped cleanly).
const FORGET_AFTER: Duration = Duration::from_secs(600);
/// At most this many workers are tracked (a flood of made-up names cannot grow memory).
const MAX_PEERS: usize = 4096;
/// At most this many runs and this many operations are remembered per worker (far above any
/// `step_concurrency` / `tool_concurrency` in use; beyond it, a gone worker's extra holdings are
/// recovered by redelivery instead).
const MAX_HELD: usize = 10_000;
/// Ids one "added" heartbeat may contribute (a process sends one per run or operation it takes).
const MAX_ADDED: usize = 16;
/// After how many `suspect_after` of silence another process that heartbeat under this
/// process's worker id is taken to be gone ([`Liveness::id_is_unique`]).
pub const SHARED_ID_SILENCE: u32 = 10;

/// What a heartbeat says its process holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Beat {
    /// Runs whose lease the process holds (it is driving them).
    #[serde(default)]
    pub runs: Vec<RunId>,
    /// Tool operations the process is running.
    #[serde(default)]
    pub ops: Vec<OperationId>,
    /// Only what was just taken, to add to what the last full heartbeat said (a newly held
    /// run or operation is announced at once, with one id instead of everything held).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub added: bool,
    /// Which process sent it (random per process): two live processes configured with the same
    /// worker id are told apart, and each logs it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
}

impl Beat {
    /// What a watcher knows its sender holds after this heartbeat, `known` before it.
    /// At most [`MAX_HELD`] runs and operations are kept.
    fn onto(self, known: &mut Beat) {
        if self.added {
            // A process announces what it just took one id at a time; a heartbeat on this
            // subject claiming more (anyone may publish one) is cut to a few, so each costs at
            // most a few linear scans of what is known, never a quadratic one.
            for run in self.runs.into_iter().take(MAX_ADDED) {
                if known.runs.len() < MAX_HELD && !known.runs.contains(&run) {
                    known.runs.push(run);
                }
            }
            for op in self.ops.into_iter().take(MAX_ADDED) {
                if known.ops.len() < MAX_HELD && !known.ops.contains(&op) {
                    known.ops.push(op);
                }
            }
        } else {
            *known = self;
            known.runs.truncate(MAX_HELD);
            known.ops.truncate(MAX_HELD);
        }
    }
}

/// A process found gone, and what its last heartbeat said it held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Death {
    pub worker: WorkerId,
    pub held: Beat,
    /// How long its heartbeats had been silent when the broker said it is gone.
    pub silent_for: Duration,
}

/// A process's verdict on another, from a ping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It answered.
    Alive,
    /// Its connection is open but it did not answer in time (paused, overloaded): alive.
    Unresponsive,
    /// The broker knows no subscriber: the process is gone.
    Gone,
    /// The ping itself failed (this process's own broker trouble): no verdict.
    Unknown,
}

struct Peer {
    seen: Instant,
    held: Beat,
    probing: bool,
    next_probe: Instant,
}

struct Inner {
    client: Client,
    me: WorkerId,
    /// This process among those that may (wrongly) share its worker id.
    instance: String,
    /// When another process last heartbeat under this worker id (milliseconds after `started`,
    /// 0 for never).
    id_shared_at: std::sync::atomic::AtomicU64,
    started: Instant,
    heartbeat: Duration,
    suspect_after: Duration,
    runs: Mutex<BTreeSet<RunId>>,
    /// Runs let go of lately, and when: still listed in the heartbeats for one heartbeat
    /// interval, so that holding one again within it needs no announcement (see
    /// [`Liveness::hold_run`]).
    released: Mutex<HashMap<RunId, Instant>>,
    ops: Mutex<BTreeSet<OperationId>>,
    peers: Mutex<HashMap<WorkerId, Peer>>,
    deaths: broadcast::Sender<Death>,
}

/// This process's liveness: its heartbeat, its answers to pings and its view of the others.
/// Cheap to clone.
#[derive(Clone)]
pub struct Liveness {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Liveness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Liveness")
            .field("worker", &self.inner.me)
            .finish_non_exhaustive()
    }
}

/// A run or an operation this process holds, announced in its heartbeats until dropped.
#[must_use = "what is held is announced only while the Hold lives"]
pub struct Hold {
    inner: Arc<Inner>,
    what: Held,
}

#[derive(Debug)]
enum Held {
    Run(RunId),
    Op(OperationId),
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Hold").field(&self.what).finish()
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        match &self.what {
            Held::Run(run) => {
                let was = self.inner.runs.lock().is_ok_and(|mut s| s.remove(run));
                if was && let Ok(mut released) = self.inner.released.lock() {
                    if released.len() >= MAX_HELD {
                        released.clear();
                    }
                    released.insert(run.clone(), Instant::now());
                }
            }
            Held::Op(op) => drop(self.inner.ops.lock().map(|mut s| s.remove(op))),
        }
    }
}

impl Liveness {
    /// Starts answering pings, heartbeating and watching the other workers. The tasks stop when
    /// the last clone is dropped.
    pub async fn start(
        client: Client,
        worker: &WorkerId,
        heartbeat: Duration,
        suspect_after: Duration,
    ) -> Result<Liveness, RuntimeError> {
        let pings = client
            .subscribe(subjects::live_ping(worker))
            .await
            .map_err(|e| RuntimeError::broker("subscribe to liveness pings", e))?;
        let beats = client
            .subscribe(LIVE_HEARTBEATS)
            .await
            .map_err(|e| RuntimeError::broker("subscribe to liveness heartbeats", e))?;
        let (deaths, _) = broadcast::channel(256);
        let inner = Arc::new(Inner {
            client,
            me: worker.clone(),
            instance: uuid::Uuid::new_v4().simple().to_string(),
            id_shared_at: std::sync::atomic::AtomicU64::new(0),
            started: Instant::now(),
            heartbeat,
            suspect_after,
            runs: Mutex::default(),
            released: Mutex::default(),
            ops: Mutex::default(),
            peers: Mutex::default(),
            deaths,
        });
        tokio::spawn(answer_pings(Arc::downgrade(&inner), pings));
        tokio::spawn(send_heartbeats(Arc::downgrade(&inner)));
        tokio::spawn(watch_heartbeats(Arc::downgrade(&inner), beats));
        tokio::spawn(probe_suspects(Arc::downgrade(&inner)));
        tracing::info!(worker = %worker, ?heartbeat, ?suspect_after, "liveness started");
        Ok(Liveness { inner })
    }

    /// This process's worker id.
    pub fn worker(&self) -> &WorkerId {
        &self.inner.me
    }

    /// Announces that this process holds `run`'s lease until the [`Hold`] is dropped. The
    /// heartbeat saying so is sent before this returns (not at the next beat): whatever the
    /// holder does next (a model call) happens after a standby can know it holds the run.
    /// Except for a run let go of less than one heartbeat interval ago (an agent loop's next
    /// drive, after its tool's result): every heartbeat sent since still lists it (a released
    /// run stays in them for that long), so a standby already knows, and one publish (and every
    /// watcher's parse of it) per drive is saved. Listing a released run costs at most an idle
    /// drive of it by a standby, when this process dies within the interval.
    pub async fn hold_run(&self, run: &RunId) -> Hold {
        self.hold(Held::Run(run.clone())).await
    }

    /// Announces that this process runs operation `op` until the [`Hold`] is dropped; like
    /// [`Liveness::hold_run`], announced before this returns (before the tool runs).
    pub async fn hold_op(&self, op: &OperationId) -> Hold {
        self.hold(Held::Op(op.clone())).await
    }

    async fn hold(&self, what: Held) -> Hold {
        let mut added = Beat {
            added: true,
            instance: self.inner.instance.clone(),
            ..Beat::default()
        };
        let new = match &what {
            Held::Run(run) => {
                added.runs.push(run.clone());
                let listed = self
                    .inner
                    .released
                    .lock()
                    .ok()
                    .and_then(|mut r| r.remove(run))
                    .is_some_and(|at| at.elapsed() < self.inner.heartbeat);
                let new = self
                    .inner
                    .runs
                    .lock()
                    .is_ok_and(|mut s| s.insert(run.clone()));
                new && !listed
            }
            Held::Op(op) => {
                added.ops.push(op.clone());
                self.inner
                    .ops
                    .lock()
                    .is_ok_and(|mut s| s.insert(op.clone()))
            }
        };
        if new {
            publish(&self.inner, &added).await;
        }
        Hold {
            inner: self.inner.clone(),
            what,
        }
    }

    /// The deaths of other workers, as this process finds them.
    pub fn deaths(&self) -> broadcast::Receiver<Death> {
        self.inner.deaths.subscribe()
    }

    /// Whether no other live process heartbeats under this process's worker id. Only then may
    /// a lease or record under that id be taken for a leftover of this process's own (e.g.
    /// from before a restart): with two live processes sharing an id, it may be the other's.
    /// The other is taken to be gone once it has been silent for [`SHARED_ID_SILENCE`] times
    /// `suspect_after` (a rolling restart that briefly ran two processes under one id does not
    /// leave this one unable to take its own leftovers for the rest of its life).
    pub fn id_is_unique(&self) -> bool {
        let at = self
            .inner
            .id_shared_at
            .load(std::sync::atomic::Ordering::Relaxed);
        at == 0
            || self.inner.started.elapsed()
                > Duration::from_millis(at)
                    .saturating_add(self.inner.suspect_after.saturating_mul(SHARED_ID_SILENCE))
    }

    /// When this process last heard `worker`'s heartbeat (`None`: never, or long forgotten).
    pub fn last_heard(&self, worker: &WorkerId) -> Option<Instant> {
        self.inner
            .peers
            .lock()
            .ok()
            .and_then(|peers| peers.get(worker).map(|p| p.seen))
    }

    /// Whether `worker` is gone: this process itself never is; one whose heartbeat arrived
    /// within `suspect_after` is alive without asking; any other is pinged.
    pub async fn is_gone(&self, worker: &WorkerId) -> bool {
        if *worker == self.inner.me {
            return false;
        }
        let recent = self.inner.peers.lock().is_ok_and(|peers| {
            peers
                .get(worker)
                .is_some_and(|p| p.seen.elapsed() < self.inner.suspect_after)
        });
        if recent {
            return false;
        }
        ping(&self.inner.client, worker, self.inner.suspect_after).await == Verdict::Gone
    }
}

/// Pings `worker`, waiting at most `wait` for its answer.
pub async fn ping(client: &Client, worker: &WorkerId, wait: Duration) -> Verdict {
    let request = async_nats::Request::new().timeout(Some(wait));
    match client
        .send_request(subjects::live_ping(worker), request)
        .await
    {
        Ok(_) => Verdict::Alive,
        Err(e) => match e.kind() {
            RequestErrorKind::NoResponders => Verdict::Gone,
            RequestErrorKind::TimedOut => Verdict::Unresponsive,
            RequestErrorKind::InvalidSubject
            | RequestErrorKind::MaxPayloadExceeded
            | RequestErrorKind::Other => Verdict::Unknown,
        },
    }
}

async fn answer_pings(inner: Weak<Inner>, mut pings: async_nats::Subscriber) {
    while let Some(ping) = pings.next().await {
        // Once the process's liveness is dropped, it stops answering (and unsubscribes).
        let Some(live) = inner.upgrade() else { return };
        if let Some(reply) = ping.reply
            && let Err(e) = live.client.publish(reply, bytes::Bytes::new()).await
        {
            tracing::debug!(error = %e, "cannot answer a liveness ping");
        }
    }
}

/// What this process holds now.
fn snapshot(live: &Inner) -> Beat {
    let mut runs: Vec<RunId> = live
        .runs
        .lock()
        .map(|s| s.iter().cloned().collect())
        .unwrap_or_default();
    if let Ok(mut released) = live.released.lock() {
        released.retain(|_, at| at.elapsed() < live.heartbeat);
        runs.extend(released.keys().cloned());
    }
    Beat {
        runs,
        ops: live
            .ops
            .lock()
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default(),
        added: false,
        instance: live.instance.clone(),
    }
}

/// Publishes `beat` on this process's heartbeat subject.
async fn publish(live: &Inner, beat: &Beat) {
    match serde_json::to_vec(beat) {
        Ok(body) => {
            if let Err(e) = live
                .client
                .publish(subjects::live_heartbeat(&live.me), body.into())
                .await
            {
                tracing::debug!(error = %e, "cannot publish a heartbeat");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot encode a heartbeat"),
    }
}

/// Publishes a full heartbeat every `heartbeat`: what this process holds now.
async fn send_heartbeats(inner: Weak<Inner>) {
    loop {
        let Some(live) = inner.upgrade() else { return };
        publish(&live, &snapshot(&live)).await;
        let every = live.heartbeat;
        drop(live);
        tokio::time::sleep(every).await;
    }
}

async fn watch_heartbeats(inner: Weak<Inner>, mut beats: async_nats::Subscriber) {
    while let Some(msg) = beats.next().await {
        let Some(live) = inner.upgrade() else { return };
        let Some(worker) = subjects::parse_live_heartbeat(msg.subject.as_str()) else {
            continue;
        };
        // A heartbeat that does not parse still says its sender is alive.
        let held = serde_json::from_slice::<Beat>(&msg.payload).ok();
        if worker == live.me {
            let other = held
                .as_ref()
                .is_some_and(|b| !b.instance.is_empty() && b.instance != live.instance);
            if other {
                let now = u64::try_from(live.started.elapsed().as_millis())
                    .unwrap_or(u64::MAX)
                    .max(1);
                let before = live
                    .id_shared_at
                    .swap(now, std::sync::atomic::Ordering::Relaxed);
                let silence = live
                    .suspect_after
                    .saturating_mul(SHARED_ID_SILENCE)
                    .as_millis();
                if before == 0 || u128::from(now.saturating_sub(before)) > silence {
                    tracing::error!(
                        worker = %live.me,
                        "another live process uses this worker id: worker ids must be unique \
                         (leases it left behind are not taken for this process's own while the \
                         other heartbeats)"
                    );
                }
            }
            continue;
        }
        let Ok(mut peers) = live.peers.lock() else {
            return;
        };
        let now = Instant::now();
        if let Some(peer) = peers.get_mut(&worker) {
            peer.seen = now;
            if let Some(held) = held {
                held.onto(&mut peer.held);
            }
        } else if peers.len() < MAX_PEERS {
            peers.insert(
                worker,
                Peer {
                    seen: now,
                    held: held.map_or_else(Beat::default, |h| {
                        let mut known = Beat::default();
                        h.onto(&mut known);
                        known
                    }),
                    probing: false,
                    next_probe: now,
                },
            );
        }
    }
}

async fn probe_suspects(inner: Weak<Inner>) {
    loop {
        let Some(live) = inner.upgrade() else { return };
        let tick = (live.heartbeat / 2).max(Duration::from_millis(10));
        let now = Instant::now();
        let mut suspects = Vec::new();
        if let Ok(mut peers) = live.peers.lock() {
            peers.retain(|_, p| p.seen.elapsed() < FORGET_AFTER);
            for (worker, peer) in peers.iter_mut() {
                if !peer.probing
                    && peer.seen.elapsed() >= live.suspect_after
                    && peer.next_probe <= now
                {
                    peer.probing = true;
                    suspects.push(worker.clone());
                }
            }
        }
        for worker in suspects {
            let inner = Arc::downgrade(&live);
            tokio::spawn(async move {
                let Some(live) = inner.upgrade() else { return };
                let verdict = ping(&live.client, &worker, live.suspect_after).await;
                let Ok(mut peers) = live.peers.lock() else {
                    return;
                };
                match verdict {
                    Verdict::Gone => {
                        if let Some(peer) = peers.remove(&worker) {
                            let death = Death {
                                worker: worker.clone(),
                                held: peer.held,
                                silent_for: peer.seen.elapsed(),
                            };
                            tracing::warn!(
                                worker = %death.worker,
                                silent_ms = death.silent_for.as_millis() as u64,
                                runs = death.held.runs.len(),
                                ops = death.held.ops.len(),
                                "worker gone (the broker has no connection for it); taking over what it held"
                            );
                            let _ = live.deaths.send(death);
                        }
                    }
                    Verdict::Alive | Verdict::Unresponsive | Verdict::Unknown => {
                        if let Some(peer) = peers.get_mut(&worker) {
                            tracing::info!(%worker, ?verdict, silent_ms = peer.seen.elapsed().as_millis() as u64, "silent worker is not gone");
                            peer.probing = false;
                            peer.next_probe = Instant::now() + PROBE_EVERY;
                        }
                    }
                }
            });
        }
        drop(live);
        tokio::time::sleep(tick).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_added_beat_contributes_a_few_ids_however_many_it_claims() {
        let mut known = Beat::default();
        Beat {
            runs: (0..50_000).map(|_| RunId::generate()).collect(),
            added: true,
            ..Beat::default()
        }
        .onto(&mut known);
        assert_eq!(known.runs.len(), MAX_ADDED);
    }

    #[test]
    fn an_added_beat_adds_and_a_full_one_replaces() {
        let (a, b) = (RunId::generate(), RunId::generate());
        let mut known = Beat::default();
        let added = |run: &RunId| Beat {
            runs: vec![run.clone()],
            ops: vec![],
            added: true,
            instance: String::new(),
        };
        added(&a).onto(&mut known);
        added(&b).onto(&mut known);
        added(&a).onto(&mut known);
        assert_eq!(known.runs, vec![a.clone(), b.clone()]);
        Beat {
            runs: vec![b.clone()],
            ops: vec![],
            added: false,
            instance: String::new(),
        }
        .onto(&mut known);
        assert_eq!(known.runs, vec![b]);
        // On the wire, a full beat says nothing about `added`.
        let body = serde_json::to_string(&Beat::default()).expect("encodes");
        assert_eq!(body, r#"{"runs":[],"ops":[]}"#);
        let parsed: Beat = serde_json::from_str(r#"{"runs":[],"added":true}"#).expect("parses");
        assert!(parsed.added);
        // A heartbeat cannot make a watcher remember more than MAX_HELD of either.
        let flood = Beat {
            runs: (0..MAX_HELD + 5).map(|_| RunId::generate()).collect(),
            ..Beat::default()
        };
        flood.onto(&mut known);
        assert_eq!(known.runs.len(), MAX_HELD);
        added(&RunId::generate()).onto(&mut known);
        assert_eq!(known.runs.len(), MAX_HELD);
    }

    #[test]
    fn beats_parse_leniently() {
        let b: Beat = serde_json::from_str("{}").expect("empty");
        assert_eq!(b, Beat::default());
        let run = RunId::generate();
        let body = serde_json::to_vec(&Beat {
            runs: vec![run.clone()],
            ops: vec![],
            added: false,
            instance: String::new(),
        })
        .expect("encodes");
        let back: Beat = serde_json::from_slice(&body).expect("decodes");
        assert_eq!(back.runs, vec![run]);
    }
}
