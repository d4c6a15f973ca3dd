//! The folded states of runs this process drove, kept between drives so that a drive reads only
//! what was appended since (the journal is append-only, so a cached state plus the events after
//! it is exact), each with the sequences its appends stepped over; and the reads that bring a
//! state up to date: batched, or by a wake's chain (docs/ARCHITECTURE.md "The step service",
//! "Chained wakes").

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::Message;
use kedge_core::bounded::Bounded;
use kedge_core::decide::{Next, decide};
use kedge_core::fold::{FoldError, RunState};
use kedge_core::ids::RunId;
use kedge_journal::Delivered;
use kedge_runtime::metrics::{self, StepRead};

use super::children::needs_tending;
use super::{DriveError, Driver};

/// Stream sequences a run's state stepped over without reading them: an append checked against
/// the run's last message ([`kedge_journal::Journal::append_decision_current`]) is folded in as
/// it lands, and the sequences between the state's last event and it are other runs' messages
/// as far as the broker's check says. Nothing relies on that alone (a clustered stream's leader
/// does not see a message of the run still in flight): the state's next read
/// ([`Driver::refresh`]) starts at the first of them, and a message of the run found there (the
/// broker accepted an append past it after all) makes the state be folded again from the
/// journal, so a state never stands on a missed input.
pub(super) type Skipped = Vec<(u64, u64)>;

/// Most skipped ranges a state may carry into a chained read ([`Driver::refresh`]); with more,
/// the run is read the batched way, which checks and clears them. A chained agent-loop step
/// notes about five (its three appends and the two links), so this is about 25 steps.
const CHAINED_SKIPPED_MAX: usize = 128;

/// The wake `msg` as the journal reads it, when it is the message `through` names (a drive
/// that absorbed later wakes reads through the newest of them instead).
pub(super) fn delivered(msg: &Message, through: Option<u64>) -> Option<Delivered<'_>> {
    let seq = msg.info().ok()?.stream_sequence;
    (Some(seq) == through).then(|| Delivered {
        seq,
        subject: msg.subject.as_str(),
        headers: msg.headers.as_ref(),
        payload: &msg.payload,
    })
}

/// A run's state as read for a drive, with the sequences it stepped over.
pub(super) struct Read {
    pub(super) state: RunState,
    pub(super) skipped: Skipped,
    /// Brought up to date by its chain ([`Driver::refresh`]).
    pub(super) chained: bool,
}

/// Whether `seq` is one the state stepped over.
fn was_skipped(skipped: &Skipped, seq: u64) -> bool {
    skipped
        .iter()
        .any(|&(first, last)| first <= seq && seq <= last)
}

/// Folds `events` and the messages `set_aside` among them into `state`, in sequence order.
fn fold_merged<'a>(
    state: &mut RunState,
    events: impl Iterator<Item = &'a kedge_journal::Recorded>,
    set_aside: &[kedge_journal::SetAside],
) -> Result<(), FoldError> {
    let mut aside = set_aside.iter().peekable();
    for r in events {
        while let Some(a) = aside.next_if(|a| a.seq < r.seq) {
            state.set_aside(a.seq, a.kind);
        }
        state.apply(r.seq, &r.envelope)?;
    }
    for a in aside {
        state.set_aside(a.seq, a.kind);
    }
    Ok(())
}

/// Runs whose folded state is kept between drives; beyond it one state makes room for another.
pub(super) const CACHE_RUNS: usize = 10_000;

/// A wake stored longer ago than this is a backlog (a fresh process catching up on the
/// journal, a redelivery): its run is looked at before its lease is taken
/// ([`Driver::backlog_look`]). A live run's wakes are milliseconds old and keep the one round
/// trip of lease and read together.
const BACKLOG_AGE: Duration = Duration::from_secs(2);

/// Whether `msg` was stored more than [`BACKLOG_AGE`] ago.
pub(super) fn is_backlog(msg: &Message) -> bool {
    msg.info()
        .is_ok_and(|info| stored_long_ago(info.published, time::OffsetDateTime::now_utc()))
}

/// Whether a message stored at `published` is more than [`BACKLOG_AGE`] old at `now`.
fn stored_long_ago(published: time::OffsetDateTime, now: time::OffsetDateTime) -> bool {
    now - published > time::Duration::try_from(BACKLOG_AGE).unwrap_or(time::Duration::MAX)
}

/// One of this process's per-run memories, which hold at most [`CACHE_RUNS`] runs: when full,
/// the runs it stopped using make room ([`Bounded`]; not all at once: a burst of more runs than
/// that would forget every run, and with it, e.g., that nobody else held their leases).
pub(super) fn per_run<V>() -> Arc<std::sync::Mutex<Bounded<RunId, V>>> {
    Arc::new(std::sync::Mutex::new(Bounded::new(CACHE_RUNS)))
}

/// The sequences between `after` and `seq` (both excluded), when there are any: what a state
/// at `after` steps over when `seq` is folded into it next.
pub(super) fn gap(after: u64, seq: u64) -> Option<(u64, u64)> {
    let next = after.saturating_add(1);
    (seq > next).then(|| (next, seq - 1))
}

/// Where a batched read of a state whose last event is `last` starts (after which sequence) and
/// what it reads through: from the first sequence the state `skipped`, when it skipped any.
fn batched_range(skipped: &Skipped, last: u64, through: Option<u64>) -> (u64, Option<u64>) {
    match skipped.first() {
        // Through the state's last event at least: it is an acknowledged event of the run.
        Some(&(first, _)) => (
            first.saturating_sub(1).min(last),
            through.map(|t| t.max(last)),
        ),
        None => (last, through),
    }
}

impl Driver {
    /// The run's state from its whole journal; `None` for a run with no `run.created` (a wake by
    /// an input published on a run id that does not exist: nothing to drive, and when the run is
    /// created its own wake drives it, the early input ignored).
    pub(super) async fn load(
        &self,
        run: &RunId,
        through: Option<u64>,
    ) -> Result<Option<RunState>, DriveError> {
        let page = self.read(run, 0, through).await?;
        self.fold_whole(run, page).await
    }

    /// The run's state from `page`, its whole journal as read; `None` for a run with no
    /// `run.created`.
    async fn fold_whole(
        &self,
        run: &RunId,
        page: kedge_journal::ReadPage,
    ) -> Result<Option<RunState>, DriveError> {
        if !page.set_aside.is_empty() {
            self.record_set_aside(run, &page.set_aside).await;
        }
        // `fold` takes the run up to its first decision (inputs before it are ignored); the rest
        // is folded in order with the messages set aside.
        let Some(created) = page
            .events
            .iter()
            .position(|r| r.envelope.kind() == kedge_core::event::EventKind::Decision)
        else {
            return Ok(None);
        };
        let (head, tail) = page.events.split_at(created + 1);
        let mut state = kedge_core::fold::fold(head.iter().map(|r| (r.seq, &r.envelope)))?;
        fold_merged(&mut state, tail.iter(), &page.set_aside)?;
        Ok(Some(state))
    }

    /// The run's events after `after`: complete through `through` when given (no leader
    /// lookup, see [`kedge_journal::Journal::read_through`]), else everything acknowledged.
    async fn read(
        &self,
        run: &RunId,
        after: u64,
        through: Option<u64>,
    ) -> Result<kedge_journal::ReadPage, DriveError> {
        Ok(match through {
            Some(through) => self.rt.journal.read_through(run, after, through).await?,
            None => self.rt.journal.read_with_set_aside(run, after).await?,
        })
    }

    /// Reads what landed after the state's last event (through `through`, see
    /// [`Driver::read`]) and folds it in. When the state's appends `skipped` sequences, the read
    /// starts at the first of them (the run's own appends since are passed over) and a message
    /// of the run found in one makes the state be folded again from the whole journal; either
    /// way they are checked and cleared.
    ///
    /// With the `wake` being handled (the message `through` names), the run is first read by
    /// its chain ([`kedge_journal::Journal::read_chained`]: a tool's result linked to its
    /// `tool.started`, linked to the state's last event, by the broker's run-wide checks): two
    /// messages by sequence instead of a batched read of the run's subjects from the first
    /// skipped sequence. The sequences the links step over are noted as skipped, like those of
    /// the state's own appends, and checked by the next batched read, which comes at the latest
    /// once [`CHAINED_SKIPPED_MAX`] ranges are noted.
    pub(super) async fn refresh(
        &self,
        state: &mut RunState,
        skipped: &mut Skipped,
        through: Option<u64>,
        wake: Option<Delivered<'_>>,
    ) -> Result<bool, DriveError> {
        let last = state.last_seq;
        if let Some(wake) = wake.filter(|w| w.seq > last && skipped.len() < CHAINED_SKIPPED_MAX)
            && let Some(page) = self
                .rt
                .journal
                .read_chained(&state.run_id, last, wake)
                .await?
        {
            metrics::step_read(StepRead::Chained);
            let mut before = last;
            for r in &page.events {
                skipped.extend(gap(before, r.seq));
                before = r.seq;
            }
            fold_merged(state, page.events.iter(), &[])?;
            return Ok(true);
        }
        metrics::step_read(StepRead::Batched);
        let (after, through) = batched_range(skipped, last, through);
        let page = self.read(&state.run_id, after, through).await?;
        let missed = page
            .events
            .iter()
            .map(|r| r.seq)
            .chain(page.set_aside.iter().map(|a| a.seq))
            .find(|&seq| was_skipped(skipped, seq));
        skipped.clear();
        if let Some(seq) = missed {
            // A clustered stream's leader does this when the message was in flight as the
            // append was checked (docs/ARCHITECTURE.md, "skipped"): not an error of anyone's.
            tracing::warn!(
                run_id = %state.run_id,
                seq,
                state_through = last,
                "an append checked against the run's last message landed past a message of the run (in flight on a clustered stream); folding the run again"
            );
            *state = self
                .load(&state.run_id, None)
                .await?
                .ok_or(DriveError::NoRun)?;
            return Ok(false);
        }
        let set_aside: Vec<kedge_journal::SetAside> = page
            .set_aside
            .into_iter()
            .filter(|a| a.seq > last)
            .collect();
        fold_merged(
            state,
            page.events.iter().filter(|r| r.seq > last),
            &set_aside,
        )?;
        if !set_aside.is_empty() {
            self.record_set_aside(&state.run_id, &set_aside).await;
        }
        Ok(false)
    }

    /// A backlog wake's look at its run before any lease: `None` when there is nothing to do
    /// (no such run, or `decide` says idle and no child run needs tending), else the state read,
    /// for the drive to go on with under the lease. Reading through the wake makes this exact for
    /// the wake: `decide` is a function of the journal, an input that lands later wakes the run
    /// again, and a holder that appends meanwhile reads back what landed before its append (the
    /// concurrency check and `Driver::catch_up`). A state found idle this way is not cached: a
    /// backlog of runs that wait for hours is not worth holding in memory.
    pub(super) async fn backlog_look(
        &self,
        run: &RunId,
        through: Option<u64>,
    ) -> Result<Option<RunState>, DriveError> {
        let Some(Read { state, .. }) = self.read_state(run, through, None).await? else {
            return Ok(None);
        };
        if !needs_tending(&state) && matches!(decide(&state), Next::Idle(_)) {
            tracing::debug!(run_id = %run, status = %state.status, "backlog wake: idle, no lease taken");
            return Ok(None);
        }
        Ok(Some(state))
    }

    /// The run's state: the one cached from this process's last drive, brought up to date
    /// (by the `wake`'s chain when it holds, see [`Driver::refresh`]), or the whole journal
    /// folded. `None` for a run with no `run.created`.
    pub(super) async fn read_state(
        &self,
        run: &RunId,
        through: Option<u64>,
        wake: Option<Delivered<'_>>,
    ) -> Result<Option<Read>, DriveError> {
        let cached = self.cache.lock().ok().and_then(|mut c| c.remove(run));
        match cached {
            Some((mut state, mut skipped)) => {
                let chained = self
                    .refresh(&mut state, &mut skipped, through, wake)
                    .await?;
                Ok(Some(Read {
                    state,
                    skipped,
                    chained,
                }))
            }
            None => {
                // A run not kept here (its first drive, a state evicted, another process's run
                // taken over): read back from the wake by its links to its `run.created` (the
                // first drive's wake is that: no request at all), a short run's journal by
                // sequence instead of a read that walks the stream between its messages.
                let first = match wake {
                    Some(wake) => self.rt.journal.read_linked(run, 0, &[wake]).await?,
                    None => None,
                };
                // What the links stepped over is noted as skipped, as for a chained wake (see
                // `refresh`): checked by a later batched read, and at once by a drive under a
                // lease someone else may have held meanwhile.
                let mut skipped = Skipped::new();
                let state = match first {
                    Some(page) if page.events.last().map(|r| r.seq) == through => {
                        metrics::step_read(StepRead::Linked);
                        for pair in page.events.windows(2) {
                            skipped.extend(gap(pair[0].seq, pair[1].seq));
                        }
                        self.fold_whole(run, page).await?
                    }
                    _ => self.load(run, through).await?,
                };
                Ok(state.map(|state| Read {
                    state,
                    chained: !skipped.is_empty(),
                    skipped,
                }))
            }
        }
    }

    /// Keeps a run's state, with what its appends `skipped`, for its next drive here (not a
    /// finished run's with nothing pending).
    pub(super) fn keep(&self, state: RunState, skipped: Skipped) {
        if let Ok(mut cache) = self.cache.lock()
            && (!state.status.is_terminal() || !state.pending_messages.is_empty())
        {
            cache.insert(state.run_id.clone(), (state, skipped));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kedge_core::event::{Draft, Envelope, Event, EventKind, Timestamp, UserMessage};
    use kedge_journal::{Recorded, SetAside};

    fn run() -> RunId {
        "run_cache1".parse().expect("a run id")
    }

    fn env(event: Event) -> Envelope {
        Envelope::new(run(), Timestamp::now(), Draft::new(event))
    }

    fn recorded(seq: u64, text: &str) -> Recorded {
        let envelope = env(Event::UserMessage(UserMessage { text: text.into() }));
        Recorded {
            seq,
            envelope,
            msg_id: None,
        }
    }

    fn aside(seq: u64, kind: EventKind) -> SetAside {
        SetAside {
            seq,
            subject: format!("agent.run.{}.i.user.message", run()),
            kind,
            reason: "not an envelope".into(),
        }
    }

    #[test]
    fn skipped_ranges_hold_both_their_ends() {
        let skipped: Skipped = vec![(3, 5), (9, 9)];
        for seq in [3, 4, 5, 9] {
            assert!(was_skipped(&skipped, seq), "{seq}");
        }
        for seq in [0, 2, 6, 8, 10] {
            assert!(!was_skipped(&skipped, seq), "{seq}");
        }
        assert!(!was_skipped(&Skipped::new(), 1));
    }

    #[test]
    fn a_gap_is_what_lies_strictly_between_two_sequences() {
        assert_eq!(gap(4, 5), None);
        assert_eq!(gap(4, 4), None);
        assert_eq!(gap(4, 2), None);
        assert_eq!(gap(4, 6), Some((5, 5)));
        assert_eq!(gap(4, 10), Some((5, 9)));
        assert_eq!(gap(u64::MAX, 3), None);
    }

    #[test]
    fn a_batched_read_starts_at_the_first_skipped_sequence_and_reaches_the_last_event() {
        assert_eq!(batched_range(&Skipped::new(), 10, Some(12)), (10, Some(12)));
        assert_eq!(batched_range(&Skipped::new(), 10, None), (10, None));
        let skipped: Skipped = vec![(5, 7), (9, 9)];
        assert_eq!(batched_range(&skipped, 10, Some(8)), (4, Some(10)));
        assert_eq!(batched_range(&skipped, 10, Some(15)), (4, Some(15)));
        assert_eq!(batched_range(&skipped, 10, None), (4, None));
        // A range noted past the state's last event: the read still starts right after it.
        assert_eq!(batched_range(&vec![(12, 14)], 10, Some(20)), (10, Some(20)));
    }

    #[test]
    fn events_and_set_aside_messages_fold_in_sequence_order() {
        let created = env(Event::RunCreated(Box::new(
            kedge_core::fixtures::run_created("demo", "hello"),
        )));
        let mut state = kedge_core::fold::fold([(1, &created)]).expect("folds");
        let events = [recorded(3, "one"), recorded(5, "two")];
        let set_aside = [
            aside(2, EventKind::Input),
            aside(4, EventKind::Decision),
            aside(6, EventKind::Input),
        ];
        fold_merged(&mut state, events.iter(), &set_aside).expect("folds");
        assert_eq!(state.pending_messages.len(), 2);
        assert_eq!(state.set_aside, 3);
        assert_eq!(state.last_seq, 6);
        // The decision set aside at 4 moved the expected decision sequence: it was folded
        // between the events around it, not after them.
        assert_eq!(state.last_decision_seq.get(), 4);
    }

    #[test]
    fn a_wake_stored_more_than_two_seconds_ago_is_a_backlog() {
        let now = time::OffsetDateTime::now_utc();
        let ago = |ms: i64| now - time::Duration::milliseconds(ms);
        assert!(!stored_long_ago(now, now));
        assert!(!stored_long_ago(ago(1_999), now));
        assert!(!stored_long_ago(ago(2_000), now));
        assert!(stored_long_ago(ago(2_001), now));
        assert!(stored_long_ago(ago(5 * 3_600_000), now));
        // A clock that runs behind the broker's: a fresh wake, not a backlog.
        assert!(!stored_long_ago(ago(-60_000), now));
    }

    #[test]
    fn a_full_per_run_memory_makes_room_for_new_runs_and_keeps_the_used_ones() {
        let run = |i: usize| -> RunId { format!("run_{i:032x}").parse().expect("run id") };
        let small = per_run::<u32>();
        let mut small = small.lock().expect("lock");
        small.insert(run(0), 1);
        small.insert(run(1), 2);
        small.insert(run(0), 3);
        assert_eq!(small.len(), 2);
        assert_eq!(small.get(&run(0)), Some(&3));
        let full = per_run::<usize>();
        let mut full = full.lock().expect("lock");
        for i in 0..CACHE_RUNS {
            full.insert(run(i), i);
        }
        assert_eq!(full.len(), CACHE_RUNS);
        // Run 7 is still being used; the other early ones are not.
        assert_eq!(full.get(&run(7)), Some(&7));
        full.insert(run(CACHE_RUNS), 0);
        assert!(full.len() <= CACHE_RUNS, "room was made");
        assert_eq!(full.get(&run(CACHE_RUNS)), Some(&0));
        assert_eq!(full.get(&run(7)), Some(&7), "what is used is kept");
        // A run already there is noted again in its place.
        full.insert(run(CACHE_RUNS), 1);
        assert_eq!(full.get(&run(CACHE_RUNS)), Some(&1));
        // A burst of twice the bound keeps its newest runs (evicting whichever run the map
        // yielded first kept the oldest and forgot the newest at once).
        for i in 0..2 * CACHE_RUNS {
            full.insert(run(100_000 + i), i);
        }
        assert!(full.len() <= CACHE_RUNS);
        let newest =
            (0..100).filter(|i| full.get(&run(100_000 + 2 * CACHE_RUNS - 1 - i)).is_some());
        assert_eq!(newest.count(), 100);
    }
}
