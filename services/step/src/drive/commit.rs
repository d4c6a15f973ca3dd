//! Committing a run's decisions under its lease: each appended with the concurrency check and
//! folded into the state as it lands, or read back later (docs/ARCHITECTURE.md "The step
//! service").

use kedge_core::Decision;
use kedge_core::DecisionEnvelope;
use kedge_core::event::{Draft, Event, Timestamp};
use kedge_core::fold::RunState;
use kedge_core::ids::DecisionSeq;
use kedge_core::ids::ModelRequestId;
use kedge_journal::{DecisionWriter, JournalError};
use kedge_runtime::failpoint;
use kedge_runtime::metrics;

use super::cache::{Skipped, gap};
use super::{DriveError, Driver};

/// How one drive writes the run's decisions.
pub(super) struct Writing<'a> {
    pub(super) writer: &'a DecisionWriter,
    /// Set when an append was not folded in: the state lacks the journal through this
    /// sequence until [`Driver::catch_up`].
    pub(super) stale_through: Option<u64>,
    /// What the state's appends skipped since it was last read.
    pub(super) skipped: Skipped,
    /// The inline requests appended and not run yet (`Driver::run_inline`).
    pub(super) inline: Vec<super::inline::Requested>,
    /// How many more operations this drive may run inline (`inline::INLINE_PER_DRIVE`).
    pub(super) inline_budget: u32,
}

impl Driver {
    /// Appends decisions one after another, each with the concurrency check against the one
    /// before (a single append costs ~0.05 ms where an atomic batch costs ~2 ms and stalls the
    /// stream; a group cut short by a crash is finished by the next writer, see
    /// `kedge_core::decide::finish_step`), and brings the state up to date. A conflict means
    /// another writer decided: the state is re-read and the caller decides again.
    pub(super) async fn commit(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        drafts: Vec<Draft<Decision>>,
    ) -> Result<bool, DriveError> {
        if !self.append(state, w, drafts).await? {
            return Ok(false);
        }
        self.catch_up(state, w).await?;
        Ok(true)
    }

    /// Commits the end of the model call `request` (the decisions `end` makes on the state):
    /// a fact whatever landed during the call. An input the state lacks makes the append read
    /// the run and give up; the end is then made and committed again on that state, while the
    /// call is still the run's open attempt with no end recorded. Whether it was committed.
    pub(super) async fn commit_attempt_end(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        request: &ModelRequestId,
        end: impl Fn(&RunState) -> Vec<Draft<Decision>>,
    ) -> Result<bool, DriveError> {
        for _ in 0..3 {
            if self.commit(state, w, end(state)).await? {
                return Ok(true);
            }
            let open = state
                .open_step
                .as_ref()
                .is_some_and(|o| o.request_id == *request && !o.failed);
            if !open {
                break;
            }
        }
        Ok(false)
    }

    /// Folds in what the state lacks after appends that could not be folded in as they landed.
    pub(super) async fn catch_up(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
    ) -> Result<(), DriveError> {
        if let Some(through) = w.stale_through.take() {
            self.refresh(state, &mut w.skipped, Some(through), None)
                .await?;
        }
        Ok(())
    }

    /// The appends of [`Driver::commit`]. While the state holds the whole run (no append left
    /// unfolded), each append is checked against the run's last message of any kind
    /// ([`kedge_journal::Journal::append_decision_current`]) and folded in as it lands, the
    /// sequences between it and the state's last event (other runs' messages) noted as
    /// [`Skipped`] and checked by the state's next read. When the run moved on (an input
    /// landed: a cancel request during a model call, a tool's result), the group's first
    /// decision is not appended: what landed is read (through the stream's leader) and the
    /// caller decides again on it, so nothing is dispatched on a state that misses an input
    /// acknowledged before the append (no read is needed after a model call for it). A later
    /// decision of the group goes on with the plain check (inputs do not conflict with
    /// decisions) and the state stays behind the journal until [`Driver::catch_up`], which the
    /// caller must call before deciding again.
    pub(super) async fn append(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        drafts: Vec<Draft<Decision>>,
    ) -> Result<bool, DriveError> {
        let mut drafts = drafts;
        self.observe_targets(&state.run_id, &mut drafts).await?;
        // A step group that journals no `run.waiting` moves the run into its waiting status
        // when its last decision lands: counted then.
        let settles = state.settled_by(&drafts);
        let now = Timestamp::now();
        let mut expected = state.last_decision_seq;
        let count = drafts.len();
        for (index, mut draft) in drafts.into_iter().enumerate() {
            let inline = self.mark_inline(w, &mut draft);
            let event = DecisionEnvelope::new(state.run_id.clone(), now, draft);
            let journal = &self.rt.journal;
            let mut current = w.stale_through.is_none();
            // A test's stand-in for a broker that accepts an append past an input: the plain
            // check, taken as the run-wide one.
            let past_input =
                current && failpoint::fires("step.append_past_input", state.run_id.as_str());
            let mut result = if current && !past_input {
                journal
                    .append_decision_current(w.writer, expected, state.last_seq, &event)
                    .await
            } else {
                journal
                    .append_decisions(w.writer, expected, std::slice::from_ref(&event))
                    .await
            };
            if let Err(JournalError::Behind { .. }) = result {
                if index == 0 {
                    tracing::debug!(run_id = %state.run_id, "the run moved on; reading it and deciding again");
                    self.refresh(state, &mut w.skipped, None, None).await?;
                    return Ok(false);
                }
                // The same message id: an earlier attempt that landed is recognised.
                current = false;
                result = journal
                    .append_decisions(w.writer, expected, std::slice::from_ref(&event))
                    .await;
            }
            let landed = match &result {
                Ok(appended) => Some(appended.last_seq),
                Err(JournalError::Duplicate { seq }) => Some(*seq),
                Err(_) => None,
            };
            if let (Some(seq), Some(mut requested)) = (landed, inline) {
                requested.seq = seq;
                w.inline.push(requested);
            }
            match result {
                // Nothing of the run was stored in between, says the run-wide check: folded as
                // it lands, what it stepped over noted for the next read to check.
                Ok(appended) if current => {
                    metrics::decision(&event.event);
                    w.skipped.extend(gap(state.last_seq, appended.first_seq));
                    state.apply(appended.last_seq, &event)?;
                    expected = appended.last_decision();
                }
                // Appended after an unfolded append or past an input: read back later.
                Ok(appended) => {
                    metrics::decision(&event.event);
                    expected = appended.last_decision();
                    w.stale_through = Some(appended.last_seq);
                }
                // This very append landed before (a retry after a lost ack).
                Err(JournalError::Duplicate { seq }) => {
                    metrics::decision(&event.event);
                    expected = DecisionSeq::at(seq);
                    w.stale_through = Some(seq);
                }
                Err(JournalError::Conflict { expected, actual }) => {
                    tracing::warn!(run_id = %state.run_id, expected, actual, "decision conflict; re-reading");
                    metrics::fenced_write(metrics::Fenced::Decision);
                    w.stale_through = None;
                    w.skipped.clear();
                    *state = self
                        .load(&state.run_id, None)
                        .await?
                        .ok_or(DriveError::NoRun)?;
                    return Ok(false);
                }
                Err(e) => return Err(e.into()),
            }
            if index + 1 < count && matches!(event.event, Event::StepCompleted(_)) {
                failpoint::hit("step.after_answer_committed");
            }
        }
        if let Some(on) = settles {
            metrics::waiting(on);
        }
        Ok(true)
    }
}
