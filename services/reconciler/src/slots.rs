//! The recovery of concurrency keys' slots (docs/ARCHITECTURE.md "Concurrency keys and
//! priorities"): a run's writer gives its slot back after the run's terminal decision, but a
//! process that dies in between (or a run purged, or a waiting run that vanished) leaves the
//! slot held. Each reconciler pass reads every record of `kedge_slots` and removes the runs the
//! journal says are finished or gone, handing their slots on; a holder that has not started
//! (its `slot.granted` may have been lost with the process that promoted it) is woken again once
//! it has been quiet for `stall_after`.

use kedge_core::decide::finished;
use kedge_core::ids::RunId;
use kedge_core::machine::RunStatus;
use kedge_runtime::Runtime;
use kedge_runtime::slots::{SlotError, Slots};

/// What the journal says of a run listed in a record.
enum Listed {
    /// Finished (nothing will revive it), never created, or purged: its place is freed.
    Gone,
    /// Holds a slot but has not started since, quiet for `stall_after`: woken again.
    Stalled,
    Live,
}

async fn look(rt: &Runtime, run: &RunId) -> Listed {
    let events = match rt.journal.read(run, 0).await {
        Ok(events) => events,
        // Not known now: left as it is until a later pass.
        Err(_) => return Listed::Live,
    };
    if events.is_empty() {
        return Listed::Gone;
    }
    let Ok(state) = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope))) else {
        return Listed::Live;
    };
    if finished(&state) {
        return Listed::Gone;
    }
    let waits_to_start = state.status == RunStatus::Queued
        || (state.status.is_terminal() && !state.pending_messages.is_empty());
    let quiet = events.last().is_some_and(|last| {
        let age = time::OffsetDateTime::now_utc() - last.envelope.at.0;
        age >= time::Duration::try_from(rt.config.timeouts.stall_after())
            .unwrap_or(time::Duration::MAX)
    });
    if waits_to_start && quiet {
        Listed::Stalled
    } else {
        Listed::Live
    }
}

/// One pass over every key's record: returns the runs removed and the runs woken.
pub async fn recover(rt: &Runtime) -> Result<(usize, usize), SlotError> {
    let slots = Slots::open(&rt.js).await?;
    let (mut removed, mut woken) = (0, 0);
    for (at, record, revision) in slots.list().await? {
        let mut gone = Vec::new();
        let mut stalled = Vec::new();
        for run in record
            .holders
            .iter()
            .chain(record.waiting.iter().map(|w| &w.run))
        {
            match look(rt, run).await {
                Listed::Gone => gone.push(run.clone()),
                Listed::Stalled if record.holders.contains(run) => stalled.push(run.clone()),
                Listed::Stalled | Listed::Live => {}
            }
        }
        if !gone.is_empty() {
            removed += gone.len();
            woken += slots.forget(&rt.journal, &at, &record, &gone).await?;
            // The runs promoted were woken; the stalled holders are looked at next pass.
            continue;
        }
        for run in &stalled {
            slots.regrant(&rt.journal, &record, run, revision).await?;
            woken += 1;
        }
    }
    Ok((removed, woken))
}
