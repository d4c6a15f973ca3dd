//! What each decision does to the run, once the transition table allowed it.
//!
//! [`RunState::apply_decision`] names one helper per decision; a decision whose data does not
//! fit the run (a step out of order, an operation the writer would never name) makes the fold
//! fail. What a decision does to a tool operation is `operation`'s to say.

use crate::event::{
    ApprovalExpired, ApprovalRequested, CallbackExpected, ChildStarted, ContextCompacted,
    DecisionRef, Envelope, ModelAttempt, OutputRejected, ProviderWaiting, QuestionAsked, RunFailed,
    RunRevived, StepCompleted, StepStarted, TimerScheduled, ToolRequested,
};
use crate::ids::{ApprovalId, Attempt, ModelRequestId, OperationId, RunId};
use crate::machine::RunStatus;

use super::FoldError;
use super::run::{
    ApprovalState, ApprovalStatus, OpenStep, ProviderWait, QuestionState, RunState, TimerState,
};
use super::transcript::{ChatMessage, output_feedback, payload_text};

impl RunState {
    /// Folds a decision the transition table allowed (the status is already the one it leads
    /// to).
    pub(super) fn apply_decision(
        &mut self,
        seq: u64,
        env: &Envelope,
        decision: DecisionRef<'_>,
    ) -> Result<(), FoldError> {
        match decision {
            DecisionRef::RunCreated(_) => {
                // The table refuses a second `run.created` before we get here.
                return Err(Self::inconsistent(seq, env, "second run.created"));
            }
            DecisionRef::RunStarted(_) => self.queued = None,
            DecisionRef::RunWaiting(_) | DecisionRef::RunResumed(_) => {}
            DecisionRef::RunQueued(q) => self.queued = Some(q.clone()),
            DecisionRef::StepStarted(started) => self.step_started(seq, env, started)?,
            DecisionRef::ModelAttempt(attempt) => self.model_attempt(seq, env, attempt)?,
            DecisionRef::StepCompleted(done) => self.step_completed(seq, env, done)?,
            DecisionRef::ToolRequested(req) => self.tool_requested(seq, env, req)?,
            DecisionRef::QuestionAsked(q) => self.question_asked(env, q),
            DecisionRef::ApprovalRequested(req) => self.approval_requested(seq, env, req)?,
            DecisionRef::ApprovalInvalidated(a) => {
                self.set_approval(
                    seq,
                    env,
                    &a.approval_id,
                    ApprovalStatus::Invalidated { at: env.at },
                )?;
            }
            DecisionRef::ApprovalExpired(a) => self.approval_expired(seq, env, a)?,
            DecisionRef::TimerScheduled(t) => self.timer_scheduled(t),
            DecisionRef::CallbackExpected(c) => self.callback_expected(env, c),
            DecisionRef::ChildStarted(c) => self.child_started(seq, env, c)?,
            DecisionRef::RunCancelling(_) | DecisionRef::RunUnknown(_) => {}
            DecisionRef::RunCompensating(k) => {
                if self.compensation.is_some() {
                    return Err(Self::inconsistent(seq, env, "a second run.compensating"));
                }
                self.compensation = Some(k.clone());
            }
            // Idempotent: a second marker of the same gate changes nothing.
            DecisionRef::RunGated(g) => self.gates = self.gates.with(g.gate),
            DecisionRef::RunRevived(r) => {
                self.queued = None;
                self.run_revived(seq, env, r)?;
            }
            DecisionRef::OutputRejected(r) => self.output_rejected(seq, env, r)?,
            DecisionRef::RunSucceeded(s) => {
                self.output = Some(s.output.clone());
                self.validation = Some(s.validation.clone());
            }
            DecisionRef::RunFailed(f) => self.run_failed(f),
            DecisionRef::RunCancelled(_) => {}
            DecisionRef::ProviderWaiting(w) => self.provider_waiting(seq, env, w)?,
            DecisionRef::ContextCompacted(c) => self.context_compacted(seq, env, c)?,
        }
        Ok(())
    }

    /// `step.started`: the next attempt of the open step, or the first of the next step; the
    /// inputs its context includes move into the transcript.
    fn step_started(
        &mut self,
        seq: u64,
        env: &Envelope,
        started: &StepStarted,
    ) -> Result<(), FoldError> {
        let (Some(step), Some(attempt)) = (env.step, env.attempt) else {
            return Err(Self::inconsistent(
                seq,
                env,
                "step and attempt are required",
            ));
        };
        let expected = match &self.open_step {
            Some(open) => (open.step, open.attempt.next()),
            None => (self.step.next(), Attempt(1)),
        };
        if (step, attempt) != expected {
            return Err(Self::inconsistent(
                seq,
                env,
                format!(
                    "expected step {} attempt {}, got step {step} attempt {attempt}",
                    expected.0, expected.1
                ),
            ));
        }
        if started.request_id != ModelRequestId::new(&self.run_id, step, attempt) {
            return Err(Self::inconsistent(seq, env, "request id does not match"));
        }
        if started.inputs_through > seq {
            return Err(Self::inconsistent(
                seq,
                env,
                "inputs_through is in the future",
            ));
        }
        let consumed = self.consumable(started.inputs_through);
        self.transcript.extend(consumed);
        self.pending_messages
            .retain(|m| m.seq > started.inputs_through);
        self.step = step;
        self.open_step = Some(OpenStep {
            step,
            attempt,
            request_id: started.request_id.clone(),
            context_digest: started.context_digest.clone(),
            failed: false,
            free: self
                .open_step
                .as_ref()
                .filter(|o| o.step == step)
                .map_or(0, |o| o.free),
            model: started.model.clone(),
        });
        Ok(())
    }

    /// `model.attempt`: the open step's attempt ended with a recorded error.
    fn model_attempt(
        &mut self,
        seq: u64,
        env: &Envelope,
        attempt: &ModelAttempt,
    ) -> Result<(), FoldError> {
        match &mut self.open_step {
            Some(open) if open.request_id == attempt.request_id => {
                open.failed = true;
                if attempt.outcome.is_free() {
                    open.free = open.free.saturating_add(1);
                }
                Ok(())
            }
            _ => Err(Self::inconsistent(
                seq,
                env,
                "model.attempt for a request that is not open",
            )),
        }
    }

    /// `step.completed`: the open step's answer joins the transcript.
    fn step_completed(
        &mut self,
        seq: u64,
        env: &Envelope,
        done: &StepCompleted,
    ) -> Result<(), FoldError> {
        match &self.open_step {
            Some(open) if open.step == done.request_id.step() => {}
            _ => {
                return Err(Self::inconsistent(
                    seq,
                    env,
                    "step.completed for a step that is not open",
                ));
            }
        }
        self.open_step = None;
        self.provider = None;
        self.usage.add(done.usage);
        self.transcript.push(ChatMessage::Assistant {
            message: done.message.clone(),
        });
        Ok(())
    }

    /// `tool.requested`: checked against the run's compensation, then a dispatch of the
    /// operation ([`RunState::request_op`]).
    fn tool_requested(
        &mut self,
        seq: u64,
        env: &Envelope,
        req: &ToolRequested,
    ) -> Result<(), FoldError> {
        let Some(op) = env.op.clone() else {
            return Err(Self::inconsistent(seq, env, "op is required"));
        };
        // A compensation is requested only by a compensating run, under the id derived
        // from the operation it compensates, which is in its plan; and only it uses a
        // compensation's id.
        let planned = |c: &OperationId| {
            self.compensation.as_ref().is_some_and(|k| {
                k.plan
                    .iter()
                    .any(|p| p.op == *c && p.compensation.as_ref() == Some(&op))
            })
        };
        let valid = match &req.compensates {
            Some(c) => {
                self.status == RunStatus::Compensating
                    && c.compensation_of().as_ref() == Some(&op)
                    && planned(c)
            }
            None => !op.is_compensation(),
        };
        if !valid {
            return Err(Self::inconsistent(
                seq,
                env,
                "a compensation must be requested by a compensating run, under the id \
                 derived from an operation of its plan (and only a compensation uses one)",
            ));
        }
        self.request_op(seq, env, op, req)
    }

    /// `question.asked`: open until answered or timed out.
    fn question_asked(&mut self, env: &Envelope, q: &QuestionAsked) {
        self.questions.insert(
            q.question_id.clone(),
            QuestionState {
                op: env.op.clone(),
                prompt: q.prompt.clone(),
                answer: None,
                timed_out: false,
            },
        );
    }

    /// `approval.requested`: the operation is held back for it ([`RunState::hold_op`]).
    fn approval_requested(
        &mut self,
        seq: u64,
        env: &Envelope,
        req: &ApprovalRequested,
    ) -> Result<(), FoldError> {
        let Some(op) = env.op.clone() else {
            return Err(Self::inconsistent(seq, env, "op is required"));
        };
        self.hold_op(&op, req, env.at);
        self.approvals.insert(
            req.approval_id.clone(),
            ApprovalState {
                op: Some(op),
                request: req.clone(),
                status: ApprovalStatus::Open,
                requested_at: env.at,
            },
        );
        Ok(())
    }

    /// `approval.expired`: no decision in time.
    fn approval_expired(
        &mut self,
        seq: u64,
        env: &Envelope,
        a: &ApprovalExpired,
    ) -> Result<(), FoldError> {
        self.set_approval(seq, env, &a.approval_id, ApprovalStatus::Expired)?;
        // The model is told; the operation never runs.
        if let Some(op) = self
            .approvals
            .get(&a.approval_id)
            .and_then(|s| s.op.clone())
        {
            self.set_op_result(
                &op,
                seq,
                format!("not run: approval {} expired", a.approval_id),
                true,
            );
        }
        Ok(())
    }

    fn timer_scheduled(&mut self, t: &TimerScheduled) {
        self.timers.insert(
            t.timer_id.clone(),
            TimerState {
                fire_at: t.fire_at,
                purpose: t.purpose.clone(),
                fired: false,
            },
        );
    }

    fn callback_expected(&mut self, env: &Envelope, c: &CallbackExpected) {
        let cb = self.callbacks.entry(c.key.clone()).or_default();
        cb.expected = true;
        cb.expires_at = c.expires_at;
        cb.op = env.op.clone();
        // A callback that arrived before the run started waiting is matched now.
        if let Some((at, payload)) = cb.received.first().cloned()
            && let Some(op) = env.op.clone()
        {
            self.set_op_result(&op, at, payload_text(&payload), false);
        }
    }

    fn child_started(
        &mut self,
        seq: u64,
        env: &Envelope,
        c: &ChildStarted,
    ) -> Result<(), FoldError> {
        // The link of a `run_agent` operation just requested, to the child derived
        // from it: anything else is not what the writer journals.
        let linked = env.op.as_ref().filter(|op| {
            self.ops
                .get(*op)
                .is_some_and(|o| o.call.name == crate::child::RUN_AGENT_TOOL)
                && c.child == RunId::for_child(op)
        });
        let Some(op) = linked.cloned() else {
            return Err(Self::inconsistent(
                seq,
                env,
                "child.started must name a run_agent operation and the child derived from it",
            ));
        };
        self.children.insert(op, c.child.clone());
        Ok(())
    }

    fn run_revived(&mut self, seq: u64, env: &Envelope, r: &RunRevived) -> Result<(), FoldError> {
        if r.turn != self.turn.saturating_add(1) {
            return Err(Self::inconsistent(seq, env, "turn must grow by one"));
        }
        self.turn = r.turn;
        // A new turn: its effects are its own to compensate (the last turn's were
        // listed in its end).
        self.turn_first_step = self.step.next();
        self.compensation = None;
        self.output = None;
        self.validation = None;
        self.failure = None;
        self.output_rejections = 0;
        Ok(())
    }

    fn output_rejected(
        &mut self,
        seq: u64,
        env: &Envelope,
        r: &OutputRejected,
    ) -> Result<(), FoldError> {
        // It ends the group of the step whose answer it rejects.
        match &self.completing {
            Some(c) if Some(c.step) == env.step => {}
            _ => {
                return Err(Self::inconsistent(
                    seq,
                    env,
                    "output.rejected for a step whose answer was not just completed",
                ));
            }
        }
        self.output_rejections = self.output_rejections.saturating_add(1);
        // The rejected answer is the transcript's last turn; the model reads why next.
        self.transcript.push(ChatMessage::User {
            text: output_feedback(self.bundle.model.provider, r),
        });
        Ok(())
    }

    fn run_failed(&mut self, f: &RunFailed) {
        self.failure = Some(f.clone());
        // The run's end closes the step it failed on (a refused model call, a step's
        // attempts used up): a revived turn starts a step of its own.
        self.open_step = None;
        self.provider = None;
        // A turn that ended before its first step (a message revived a run whose
        // budget was spent, and it failed again at once) answered the messages that
        // revived it: they are not pending any more, or every drive would revive and
        // fail the run again, without end.
        if self.step < self.turn_first_step {
            self.pending_messages.clear();
        }
    }

    fn provider_waiting(
        &mut self,
        seq: u64,
        env: &Envelope,
        w: &ProviderWaiting,
    ) -> Result<(), FoldError> {
        // Journaled right after the attempt that met the trouble (or was held).
        let Some(open) = self.open_step.as_ref().filter(|o| o.failed) else {
            return Err(Self::inconsistent(
                seq,
                env,
                "provider.waiting for a step whose attempt did not end",
            ));
        };
        self.provider = Some(ProviderWait {
            step: open.step,
            endpoint: w.endpoint.clone(),
            trouble: w.trouble,
            message: w.message.clone(),
            since: w.since,
            give_up_at: w.give_up_at,
            released: None,
        });
        Ok(())
    }

    fn context_compacted(
        &mut self,
        seq: u64,
        env: &Envelope,
        c: &ContextCompacted,
    ) -> Result<(), FoldError> {
        let compaction = self
            .checked_compaction(c)
            .map_err(|why| Self::inconsistent(seq, env, format!("context.compacted: {why}")))?;
        if let Some(summary) = &c.summary {
            self.usage.add(summary.usage);
        }
        self.compaction = Some(compaction);
        Ok(())
    }

    fn set_approval(
        &mut self,
        seq: u64,
        env: &Envelope,
        id: &ApprovalId,
        status: ApprovalStatus,
    ) -> Result<(), FoldError> {
        match self.approvals.get_mut(id) {
            Some(a) => {
                a.status = status;
                Ok(())
            }
            None => Err(Self::inconsistent(
                seq,
                env,
                format!("unknown approval {id}"),
            )),
        }
    }
}
