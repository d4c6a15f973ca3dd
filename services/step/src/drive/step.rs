//! One step of a run: the plan's model call made (or its stored answer reused), and its end
//! committed: the answer kept the moment it returns, in the journal when the commit lands at
//! once and in `kedge_idempotency` otherwise; a failed attempt recorded and its retry delay
//! waited (docs/ARCHITECTURE.md "The step service", "Crash windows").

use kedge_core::Decision;
use std::time::Duration;

use kedge_core::agent::AgentDefinition;
use kedge_core::decide::{ModelResponse, StepPlan, complete_step};
use kedge_core::event::{
    Draft, ErrorClass, FailureReason, ModelAttempt, ModelSpec, RunFailed, Timestamp,
};
use kedge_core::fold::RunState;
use kedge_core::tools::Contract;
use kedge_model::ModelError;
use kedge_runtime::failpoint;
use kedge_runtime::idempotency::StoredResponse;
use kedge_runtime::metrics;
use kedge_runtime::provider::{Endpoint, Route};
use tokio::sync::watch;
use tracing::Instrument;

use super::cache::Skipped;
use super::commit::Writing;
use super::context::compaction;
use super::model::{CallError, retry_delay};
use super::provider::{Called, ProviderTrouble, WaitList, hold_or_admit, routed};
use super::{DriveError, Driver, internal_failure};

/// What became of an attempt a gone holder left unfinished
/// ([`Driver::await_interrupted_answer`]).
enum Interrupted {
    /// Its answer, stored: reused.
    Answer(StoredResponse),
    /// The run moved on meanwhile (its holder came back and committed): decided again.
    Moved,
    /// No answer within the grace (or no reason to wait): the next attempt calls the model.
    NoAnswer,
}

/// How often the stored answer of an interrupted attempt is looked for
/// ([`Driver::await_interrupted_answer`]).
const INTERRUPTED_POLL: Duration = Duration::from_millis(200);

/// What one attempt of a step is made with: the run's agent revision and its tool contract,
/// the plan (its `step.started` journaled), and the model it calls (`probe`: the call is the
/// fleet's probe of that model's failing endpoint).
struct Attempt<'a> {
    def: &'a AgentDefinition,
    contract: &'a Contract,
    plan: &'a StepPlan,
    called: &'a Called,
    probe: bool,
}

impl Attempt<'_> {
    /// The step's decisions with a fresh `response` of this attempt.
    fn complete(&self, state: &RunState, response: ModelResponse) -> Vec<Draft<Decision>> {
        complete_step(
            state,
            self.plan.step,
            self.plan.attempt,
            self.plan.request_id.clone(),
            response,
            false,
            Timestamp::now(),
            self.contract,
        )
    }
}

impl Driver {
    /// Takes the step `plan` of the run ([`Next::Step`](kedge_core::decide::Next::Step)), in
    /// the step's span.
    pub(super) async fn step(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        plan: StepPlan,
        lost: &mut watch::Receiver<bool>,
    ) -> Result<(), DriveError> {
        let run = state.run_id.clone();
        let span =
            tracing::info_span!("step", run_id = %run, step = %plan.step, attempt = %plan.attempt);
        kedge_runtime::trace::set_parent(&span, state.bundle.traceparent.as_deref());
        self.take_step(state, w, plan, lost).instrument(span).await
    }

    /// The step on the run's agent revision: the stored answer of an attempt left unfinished is
    /// reused; a context that would not fit the model's window is compacted first; else the
    /// model is called ([`Driver::call_step`]).
    async fn take_step(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        plan: StepPlan,
        lost: &mut watch::Receiver<bool>,
    ) -> Result<(), DriveError> {
        let (def, contract) = match self.definition(state).await? {
            Ok(found) => found,
            Err(reason) => {
                self.commit(state, w, vec![internal_failure(reason)])
                    .await?;
                return Ok(());
            }
        };
        // The tool contract of the run's revision: calls it refuses were not dispatched,
        // and the model reads the refusal as their result.
        let mut plan = plan;
        plan.answer_refused(&contract);
        // A worker that died after the model answered left the response behind; one whose
        // connection dropped mid call may still store it, within the reconnect grace.
        let interrupted = match &plan.unfinished {
            Some((request, digest)) => {
                self.await_interrupted_answer(state, request, digest, lost)
                    .await?
            }
            None => Interrupted::NoAnswer,
        };
        if let Interrupted::Moved = interrupted {
            // Decided again from what the run is now.
            return Ok(());
        }
        if let Some((request, _)) = &plan.unfinished
            && let Interrupted::Answer(stored) = interrupted
        {
            tracing::info!(request_id = %request, "reusing the stored model response");
            let drafts = complete_step(
                state,
                request.step(),
                request.attempt(),
                request.clone(),
                stored.response,
                true,
                Timestamp::now(),
                &contract,
            );
            self.commit(state, w, drafts).await?;
            return Ok(());
        }
        // The model's context window (docs/ARCHITECTURE.md "The context window"): a
        // conversation that would not fit is compacted first, a decision of its own; the
        // step is then decided again on the compacted context.
        if let Some(compacted) = compaction(state, &def, None) {
            return self.compact(state, w, &def, &plan, compacted).await;
        }
        self.call_step(state, w, &def, &contract, plan, lost).await
    }

    /// The plan's model call: routed (to the run's model, a fallback, or nowhere yet), its
    /// `step.started` journaled, its turn under the called model's rate limits taken, then made
    /// ([`Driver::make_call`]). A call held, or queued for its turn, puts the run to wait on its
    /// provider instead.
    async fn call_step(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        def: &AgentDefinition,
        contract: &Contract,
        plan: StepPlan,
        lost: &mut watch::Receiver<bool>,
    ) -> Result<(), DriveError> {
        let mut plan = plan;
        // Where the call goes (docs/ARCHITECTURE.md "Provider trouble"): the run's model
        // unless the fleet's breaker of its endpoint holds it (a failing endpoint gets the
        // fleet's probes, not every run's retry); a fallback once that endpoint has been
        // failing for `fallback_after_secs`. A fallback is named in the attempt's
        // `step.started`.
        let providers = self.providers().await?;
        let primary = Called::primary(state, def);
        let fallbacks: Vec<Called> = def.fallbacks.iter().map(Called::fallback).collect();
        let fallback_endpoints: Vec<Endpoint> =
            fallbacks.iter().map(|c| c.endpoint.clone()).collect();
        let route = providers
            .route(
                &primary.endpoint,
                &fallback_endpoints,
                def.fallback_after(),
                plan.released,
            )
            .await;
        let (called, probe) = routed(&route, &primary, &fallbacks);
        if let Route::Fallback(_) = route {
            tracing::info!(model = %called.spec.name, endpoint = %called.endpoint.label, "the run's model is unavailable; calling its fallback");
            name_model(&mut plan.start, &called.spec);
        }
        // The rate limits the fleet keeps to for the called model at its endpoint; a run
        // that waits (its turn, or out trouble) on its own model is released into a slot
        // under that model's.
        let to_fallback = matches!(route, Route::Fallback(_));
        let waits_with = primary.turn(&self.rt.config, &providers, def, &plan.context);
        let turn = if to_fallback {
            called.turn(&self.rt.config, &providers, def, &plan.context)
        } else {
            waits_with.clone()
        };
        let queue = WaitList {
            providers: &providers,
            endpoint: &primary.endpoint,
            turn: waits_with,
            fallbacks: &fallback_endpoints,
            fallback_after: (!def.fallbacks.is_empty()).then(|| def.fallback_after()),
        };
        // Not caught up if behind: the call needs only the plan and the bundle, and the
        // journal is read right after it.
        if !self.append(state, w, plan.start.clone()).await? {
            return Ok(());
        }
        failpoint::hit("step.after_step_started");
        // A run released to its own model had its slot reserved by its release.
        let reserved = plan.released.is_some() && !to_fallback;
        let turn = turn.as_ref().filter(|_| !reserved);
        // The tenant's tokens and cost of the day (docs/ARCHITECTURE.md "Quotas").
        if let Some(over) = self.quota_holds(state).await {
            return self.hold_for_quota(state, w, &plan, &queue, over).await;
        }
        if let Some(wait) = hold_or_admit(route, &primary, called, turn, &providers).await {
            return self.wait_on_provider(state, w, &plan, &queue, wait).await;
        }
        let at = Attempt {
            def,
            contract,
            plan: &plan,
            called,
            probe,
        };
        self.make_call(state, w, &at, &queue, lost).await
    }

    /// Makes the attempt's model call and commits how it ended: its answer kept
    /// ([`Driver::keep_answer`]), its cancel recorded, the provider's trouble waited on, any
    /// other failure recorded ([`Driver::end_failed_attempt`]).
    async fn make_call(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        at: &Attempt<'_>,
        queue: &WaitList<'_>,
        lost: &mut watch::Receiver<bool>,
    ) -> Result<(), DriveError> {
        let run = state.run_id.clone();
        let plan = at.plan;
        let endpoint = &at.called.endpoint;
        let connects = self.connects();
        let result = self
            .call_reported(state, at.def, at.called, plan, queue.providers, at.probe)
            .await;
        if result.is_err() {
            // Read with the leader's check: what ended the call (a cancel) is in it. (A
            // test's switch skips the read: an input that landed during the call then
            // stands for one stored right after the read, found by the append.)
            w.stale_through = None;
            if !failpoint::fires("step.input_after_failed_call_read", run.as_str()) {
                self.refresh(state, &mut w.skipped, None, None).await?;
            }
        }
        match result {
            Ok(response) => {
                // This process's broker connection dropped during the call (or is down
                // now): the run may have been taken over meanwhile, and a standby waiting
                // for this answer appends nothing that would fence a commit. The answer is
                // stored first (once the broker is back), then the lease read: a lease
                // taken leaves the answer to its holder and commits nothing.
                let cut_off = self.connects() != connects
                    || self.rt.client.connection_state()
                        != async_nats::connection::State::Connected;
                self.keep_answer(state, w, at, response, cut_off, lost)
                    .await
            }
            Err(CallError::Cancelled) => {
                tracing::info!("cancel requested; model call aborted");
                let attempt = Draft::new(Decision::ModelAttempt(ModelAttempt {
                    request_id: plan.request_id.clone(),
                    outcome: kedge_core::event::AttemptOutcome::Cancelled,
                }))
                .step(plan.step)
                .attempt(plan.attempt);
                // The cancel itself can be stored after the read above (the watcher hears
                // it on core NATS as it is published): the append then finds it.
                self.commit_attempt_end(state, w, &plan.request_id, |_| vec![attempt.clone()])
                    .await?;
                Ok(())
            }
            Err(CallError::Model(e)) if e.trouble.is_some() => {
                tracing::info!(error = %e, endpoint = %endpoint.label, "model provider trouble; the run waits on it");
                let wait = ProviderTrouble::met(endpoint, &e);
                self.wait_on_provider(state, w, plan, queue, wait).await
            }
            Err(CallError::Model(e)) => self.end_failed_attempt(state, w, at, e).await,
        }
    }

    /// Keeps the model's `response` to the attempt (`cut_off`: this process's broker
    /// connection dropped during the call, or is down now): committed at once when it can be
    /// ([`Driver::commit_answer`]), else stored first and then committed, unless the lease was
    /// lost meanwhile (docs/ARCHITECTURE.md, "Crash windows").
    async fn keep_answer(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        at: &Attempt<'_>,
        response: ModelResponse,
        cut_off: bool,
        lost: &mut watch::Receiver<bool>,
    ) -> Result<(), DriveError> {
        let run = state.run_id.clone();
        let plan = at.plan;
        let stored = StoredResponse {
            context_digest: plan.context_digest.clone(),
            response: response.clone(),
        };
        // The answer is kept the moment it returns, where it is cheapest: in the
        // journal, by `step.completed`, when the commit lands at once (a state that
        // holds the whole run, the lease still held). Inputs that arrived during the
        // call (a cancel above all) shape the commit, and such a state needs no read
        // for them: its appends are checked against the run's last message, so one
        // that finds an input acknowledged meanwhile is not appended. The answer is
        // then stored in the idempotency bucket and the step decided again on what
        // landed, reusing it. Either way it is durable nowhere for one round trip
        // (docs/ARCHITECTURE.md, "Crash windows").
        let behind = w.stale_through.is_some();
        if !behind
            && !cut_off
            && !*lost.borrow()
            && !failpoint::fires("step.answer_not_committed", run.as_str())
        {
            return self.commit_answer(state, w, at, response, &stored).await;
        }
        // A state left behind by `step.started` is read now, with the leader's
        // check, while the response is stored; a lost lease stores it for the
        // run's holder. Nothing is committed before the response is stored: a crash
        // from here on never pays for it twice.
        w.stale_through = None;
        let (put, read) = futures::join!(
            self.rt
                .idempotency
                .store_response(&plan.request_id, &stored),
            async {
                if behind {
                    self.refresh(state, &mut w.skipped, None, None)
                        .await
                        .map(|_| ())
                } else {
                    Ok(())
                }
            }
        );
        put?;
        failpoint::hit("step.after_model_stored");
        if *lost.borrow() || (cut_off && !self.still_holds(&run).await) {
            // Stored: the run's holder now reuses it instead of paying again.
            tracing::warn!(
                "lease lost during the model call; gave the step up (its response is stored for the next holder, nothing committed)"
            );
            metrics::fenced_write(metrics::Fenced::Decision);
            return Err(DriveError::LeaseLost);
        }
        read?;
        let drafts = at.complete(state, response);
        self.commit(state, w, drafts).await?;
        Ok(())
    }

    /// Commits the step's decisions with the answer at once (`step.completed` carries it); the
    /// answer (`stored`) is stored for the step's next attempt when that commit does not land
    /// or is not known to have.
    async fn commit_answer(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        at: &Attempt<'_>,
        response: ModelResponse,
        stored: &StoredResponse,
    ) -> Result<(), DriveError> {
        let drafts = at.complete(state, response);
        let committed = self.commit(state, w, drafts).await;
        if let Ok(true) = committed {
            return Ok(());
        }
        // Not landed (the run moved on, another writer decided) or not known
        // to have: kept for this step's next attempt, here or elsewhere.
        let put = self
            .rt
            .idempotency
            .store_response(&at.plan.request_id, stored)
            .await;
        failpoint::hit("step.after_model_stored");
        match (committed, put) {
            (Err(e), put) => {
                if let Err(p) = put {
                    tracing::warn!(error = %p, "the uncommitted model response could not be stored either; this process keeps it");
                }
                Err(e)
            }
            (Ok(_), put) => put.map_err(DriveError::from),
        }
    }

    /// Records the attempt's failure `e` on what the run holds now (`model.attempt`; a
    /// compaction after a request too long for the model's window; `run.failed` after a fatal
    /// refusal) and, once recorded, waits out a retryable failure's delay.
    async fn end_failed_attempt(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        at: &Attempt<'_>,
        e: ModelError,
    ) -> Result<(), DriveError> {
        let plan = at.plan;
        tracing::warn!(error = %e, "model call failed");
        let attempt = Draft::new(Decision::ModelAttempt(ModelAttempt {
            request_id: plan.request_id.clone(),
            outcome: e.to_attempt_outcome(),
        }))
        .step(plan.step)
        .attempt(plan.attempt);
        // An input stored after the read above (a user's message) makes the append
        // read the run again; unrecorded, the failure's retry delay would not be
        // waited and a refusal would be called again.
        let committed = self
            .commit_attempt_end(state, w, &plan.request_id, |state| {
                let mut drafts = vec![attempt.clone()];
                // Too long for the model's window: compacted, and the step tried
                // again (an attempt spent), while anything is left to take out.
                let compacted = e
                    .is_too_long()
                    .then(|| compaction(state, at.def, Some(&e)))
                    .flatten();
                if let Some(compacted) = compacted {
                    drafts.push(Draft::new(Decision::ContextCompacted(compacted)));
                } else if e.class == ErrorClass::Fatal {
                    drafts.push(Draft::new(Decision::RunFailed(RunFailed {
                        reason: FailureReason::ModelRejected,
                        message: e.message.clone(),
                        effects: Vec::new(),
                    })));
                }
                // A fatal refusal ends the run: through its compensation, if its
                // agent compensates failures.
                kedge_core::compensation::intercept(state, drafts)
            })
            .await?;
        if committed && e.class == ErrorClass::Retryable {
            let delay = retry_delay(
                &e,
                plan.attempt.get(),
                self.rt.config.timeouts.max_retry_delay(),
            );
            tokio::time::sleep(delay).await;
        }
        Ok(())
    }

    /// The stored answer of the attempt `request` (with the context `digest`) that a holder
    /// of the run left unfinished. When this process took the run over from a worker found
    /// gone, that worker may only have lost its broker connection: its call may still answer
    /// and be stored as soon as it reconnects (docs/ARCHITECTURE.md "Takeover"). So until
    /// `reconnect_grace` after the worker was last heard, the answer is waited for (the record
    /// read every [`INTERRUPTED_POLL`]); the wait ends early when the run moves on (the worker
    /// came back and committed it) or this process loses the lease. `None`: no answer to reuse,
    /// the next attempt calls the model.
    async fn await_interrupted_answer(
        &self,
        state: &mut RunState,
        request: &kedge_core::ids::ModelRequestId,
        digest: &kedge_core::event::Digest,
        lost: &mut watch::Receiver<bool>,
    ) -> Result<Interrupted, DriveError> {
        let stored = |s: Option<StoredResponse>| s.filter(|s| s.context_digest == *digest);
        if let Some(found) = stored(self.rt.idempotency.stored_response(request).await?) {
            return Ok(Interrupted::Answer(found));
        }
        let heard = self
            .taken_from
            .lock()
            .ok()
            .and_then(|mut t| t.get(&state.run_id).copied());
        let Some(until) = heard.map(|h| h + self.rt.config.timeouts.reconnect_grace()) else {
            return Ok(Interrupted::NoAnswer);
        };
        if std::time::Instant::now() >= until {
            return Ok(Interrupted::NoAnswer);
        }
        tracing::info!(request_id = %request, "waiting for the interrupted attempt's answer before calling the model again");
        let started = std::time::Instant::now();
        let seq = state.last_seq;
        let found = loop {
            if *lost.borrow() {
                return Err(DriveError::LeaseLost);
            }
            let wait =
                INTERRUPTED_POLL.min(until.saturating_duration_since(std::time::Instant::now()));
            if wait.is_zero() {
                break Interrupted::NoAnswer;
            }
            tokio::time::sleep(wait).await;
            if let Some(found) = stored(self.rt.idempotency.stored_response(request).await?) {
                break Interrupted::Answer(found);
            }
            // The worker came back and committed its answer itself: the run moved on.
            let mut skipped = Skipped::default();
            self.refresh(state, &mut skipped, None, None).await?;
            if state.last_seq != seq {
                break Interrupted::Moved;
            }
        };
        if let Ok(mut t) = self.taken_from.lock() {
            t.remove(&state.run_id);
        }
        let answered = !matches!(found, Interrupted::NoAnswer);
        metrics::interrupted_answer(answered);
        tracing::info!(request_id = %request, answered, waited_ms = started.elapsed().as_millis() as u64, "done waiting for the interrupted attempt's answer");
        Ok(found)
    }
}

/// Names `model` in the `step.started` among a step's first decisions `start`: the attempt
/// calls it instead of the run's own.
fn name_model(start: &mut [Draft<Decision>], model: &ModelSpec) {
    for d in start {
        if let Decision::StepStarted(started) = &mut d.event {
            started.model = Some(model.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kedge_core::event::{RunStarted, StepStarted};
    use kedge_core::ids::{ModelRequestId, RunId};
    use kedge_core::{Attempt, StepNo};

    #[test]
    fn a_fallback_is_named_in_the_attempts_step_started_alone() {
        let run: RunId = "run_fallback1".parse().expect("a run id");
        let started = StepStarted {
            request_id: ModelRequestId::new(&run, StepNo(2), Attempt(1)),
            context_digest: kedge_core::event::Digest::of_bytes(b"context"),
            inputs_through: 4,
            model: None,
        };
        let mut start = vec![
            Draft::new(Decision::RunStarted(RunStarted {})),
            Draft::new(Decision::StepStarted(started.clone())),
        ];
        let fallback = ModelSpec {
            name: "fallback".into(),
            ..kedge_core::fixtures::run_created("demo", "hello").model
        };
        name_model(&mut start, &fallback);
        assert!(matches!(start[0].event, Decision::RunStarted(_)));
        let Decision::StepStarted(named) = &start[1].event else {
            panic!("not a step.started: {:?}", start[1].event);
        };
        assert_eq!(named.model.as_ref(), Some(&fallback));
        assert_eq!(named.request_id, started.request_id);
        assert_eq!(named.inputs_through, 4);
    }
}
