//! What each input does to the run; an input that no longer matters is ignored (and counted).
//!
//! [`RunState::apply_input`] names one helper per input. An input on a tool operation moves it
//! as `operation` says; the others act on a question, an approval, a timer or a callback, which
//! may give their operation its result.

use crate::event::{
    ApprovalDecided, CallbackReceived, Envelope, InputRef, ProviderReleased, QuestionAnswered,
    TimerFired, TimerPurpose, Verdict,
};
use crate::machine::RunStatus;

use super::run::{ApprovalStatus, PendingInput, RunState};
use super::transcript::payload_text;

impl RunState {
    /// Folds an input; `false` if it was ignored.
    pub(super) fn apply_input(&mut self, seq: u64, env: &Envelope, input: InputRef<'_>) -> bool {
        if self.status == RunStatus::Cancelled && !matches!(input, InputRef::ToolResult(_)) {
            return false;
        }
        match input {
            InputRef::UserMessage(m) => {
                self.pending_messages.push(PendingInput {
                    seq,
                    text: m.text.clone(),
                });
                true
            }
            InputRef::ToolStarted(s) => self
                .open_op(env)
                .is_some_and(|op| op.start(&s.runner, env.at)),
            InputRef::ToolResult(r) => {
                self.set_result(env, seq, r.content.clone(), r.is_error, r.stopped)
            }
            InputRef::ToolAttempt(a) => self
                .open_op(env)
                .is_some_and(|op| op.fail_attempt(a, env.at)),
            InputRef::OutcomeConfirmed(c) => {
                self.set_result(env, seq, c.content.clone(), false, false)
            }
            InputRef::OutcomeNotFound(_) => match self.open_op(env) {
                Some(op) => {
                    op.not_found();
                    true
                }
                None => false,
            },
            InputRef::OutcomeAmbiguous(a) => match self.open_op(env) {
                Some(op) => {
                    op.ambiguous(&a.detail);
                    true
                }
                None => false,
            },
            InputRef::OutcomeResolved(r) => self
                .open_op(env)
                .is_some_and(|op| op.resolve(&r.resolution, seq)),
            InputRef::QuestionAnswered(a) => self.question_answered(seq, a),
            InputRef::ApprovalDecided(d) => self.approval_decided(seq, env, d),
            InputRef::TimerFired(t) => self.timer_fired(seq, t),
            InputRef::CallbackReceived(c) => self.callback_received(seq, env, c),
            InputRef::CancelRequested(c) => {
                if self.status.is_terminal() || self.cancel_requested.is_some() {
                    return false;
                }
                self.cancel_requested = Some(c.reason.clone());
                true
            }
            InputRef::TargetMoved(m) => self
                .open_op(env)
                .is_some_and(|op| op.move_target(m, env.at)),
            InputRef::Nudge(_) => !self.status.is_terminal(),
            InputRef::ProviderReleased(r) => self.provider_released(r),
            // A wake only: the run's writer asks its key's record again (docs/ARCHITECTURE.md
            // "Concurrency keys and priorities"); it counts while the run waits for a slot.
            InputRef::SlotGranted(_) => self.queued.is_some(),
        }
    }

    /// `question.answered`: the first answer to an open question counts, and is its
    /// operation's result.
    fn question_answered(&mut self, seq: u64, a: &QuestionAnswered) -> bool {
        let Some(q) = self.questions.get_mut(&a.question_id) else {
            return false;
        };
        if !q.is_open() {
            return false;
        }
        q.answer = Some(a.answer.clone());
        let op = q.op.clone();
        if let Some(op) = op {
            self.set_op_result(&op, seq, a.answer.clone(), false);
        }
        true
    }

    /// `approval.decided`: the first decision on an open request counts.
    fn approval_decided(&mut self, seq: u64, env: &Envelope, d: &ApprovalDecided) -> bool {
        match self.approvals.get_mut(&d.approval_id) {
            Some(a) if a.status == ApprovalStatus::Open => {
                a.status = ApprovalStatus::Decided {
                    verdict: d.verdict,
                    args_digest: d.args_digest.clone(),
                    approver: d.approver.clone(),
                    at: env.at,
                };
                // A denial stands whatever was shown: the model is told and continues.
                if d.verdict == Verdict::Deny
                    && let Some(op) = a.op.clone()
                {
                    let comment = d
                        .comment
                        .as_deref()
                        .map(|c| format!(": {c}"))
                        .unwrap_or_default();
                    self.set_op_result(
                        &op,
                        seq,
                        format!("not run: denied by {}{comment}", d.approver),
                        true,
                    );
                }
                true
            }
            _ => false,
        }
    }

    /// `timer.fired`: a timer fires once; what it was for decides what follows.
    fn timer_fired(&mut self, seq: u64, t: &TimerFired) -> bool {
        match self.timers.get_mut(&t.timer_id) {
            Some(timer) if !timer.fired => {
                timer.fired = true;
                let fire_at = timer.fire_at;
                match timer.purpose.clone() {
                    // A `wait` operation's result is its timer firing.
                    TimerPurpose::Wait { op } => {
                        self.set_op_result(&op, seq, format!("waited until {fire_at}"), false);
                    }
                    // No callback in time: the operation fails (a late one is refused).
                    TimerPurpose::CallbackExpiry { key } => {
                        if let Some(op) = self.callbacks.get(&key).and_then(|c| c.op.clone()) {
                            self.set_op_result(
                                &op,
                                seq,
                                format!("no callback for {key} before {fire_at}"),
                                true,
                            );
                        }
                    }
                    // No answer in time: the question closes and the model is told.
                    TimerPurpose::QuestionTimeout { question_id } => {
                        if let Some(q) = self.questions.get_mut(&question_id)
                            && q.is_open()
                        {
                            q.timed_out = true;
                            if let Some(op) = q.op.clone() {
                                self.set_op_result(
                                    &op,
                                    seq,
                                    format!("no answer before {fire_at}"),
                                    true,
                                );
                            }
                        }
                    }
                    // Acted on by the decision (a wait on the provider that outlasted it).
                    TimerPurpose::RunDeadline
                    | TimerPurpose::ApprovalExpiry { .. }
                    | TimerPurpose::ProviderWait { .. } => {}
                }
                true
            }
            _ => false,
        }
    }

    /// `callback.received`: the first payload in time counts, and is its operation's result.
    fn callback_received(&mut self, seq: u64, env: &Envelope, c: &CallbackReceived) -> bool {
        let cb = self.callbacks.entry(c.key.clone()).or_default();
        if cb.expires_at.is_some_and(|exp| env.at > exp) {
            return false; // too late: the operation already failed or will
        }
        if !cb.received.is_empty() {
            return false; // a duplicate: the first one counts
        }
        // Kept even before `callback.expected`: an early callback is matched later.
        cb.received.push((seq, c.payload.clone()));
        if let Some(op) = cb.op.clone() {
            self.set_op_result(&op, seq, payload_text(&c.payload), false);
        }
        true
    }

    /// `provider.released`: counts once per wait: a second release (a releaser repeating
    /// itself) changes nothing, and one that comes after the run moved on is ignored.
    fn provider_released(&mut self, r: &ProviderReleased) -> bool {
        match &mut self.provider {
            Some(wait) if self.status == RunStatus::WaitingProvider && wait.released.is_none() => {
                wait.released = Some(r.probe);
                true
            }
            _ => false,
        }
    }
}
