//! Child runs (docs/ARCHITECTURE.md "Child runs"): what an idle run owes the child runs of its
//! `run_agent` operations (each made to exist, or the operation refused; each asked to cancel
//! while the run is cancelling), and what a child that ended owes its parent (its result).

use kedge_core::agent::AgentDefinition;
use kedge_core::child;
use kedge_core::event::{CancelRequested, Draft, Event, Timestamp, ToolResult};
use kedge_core::fold::{RunState, ToolOp};
use kedge_core::ids::{InputId, OperationId, RunId};
use kedge_core::machine::RunStatus;
use kedge_core::{Decision, DecisionEnvelope, Input, InputEnvelope};
use kedge_journal::{DecisionWriter, JournalError, RunCreator};
use kedge_runtime::Runtime;
use kedge_runtime::agents::AgentError;
use kedge_runtime::failpoint;
use kedge_runtime::metrics;
use kedge_runtime::seal::{self, SealError};

use super::cache::CACHE_RUNS;
use super::{DriveError, Driver};

/// Whether `state`'s run has child runs to tend, or is a child run: the parent of an open
/// `run_agent` operation, or a child whose result its parent may still lack.
pub(super) fn needs_tending(state: &RunState) -> bool {
    state.bundle.parent.is_some()
        || state
            .ops
            .values()
            .any(|o| o.call.name == child::RUN_AGENT_TOOL && o.result.is_none())
}

/// The refusal of a `run_agent` operation whose child's run id another run holds.
fn taken(id: &RunId) -> String {
    format!("not run: the child's run id {id} is taken by a run this operation did not start")
}

impl Driver {
    /// What an idle run owes its child runs, and a child its parent (docs/ARCHITECTURE.md
    /// "Child runs"). Every step is idempotent and repeated on every idle drive until it shows
    /// in the journal, so a crash anywhere in between only delays it:
    ///
    /// - each open `run_agent` operation without a link gets its refusal as its result;
    /// - each linked child is made to exist (its `run.created`, written like intake's with the
    ///   check that the run has none: a run already there is this operation's child or the
    ///   operation fails), and is asked to cancel while the run is cancelling;
    /// - a child that ended gives its parent's operation its result (`Nats-Msg-Id` the
    ///   operation's result id; the parent's fold keeps the first result).
    pub(super) async fn tend_children(
        &self,
        state: &RunState,
        writer: &DecisionWriter,
    ) -> Result<(), DriveError> {
        if !state.status.is_terminal() {
            let open = state
                .ops
                .values()
                .filter(|o| o.call.name == child::RUN_AGENT_TOOL && o.result.is_none());
            for op in open {
                let refusal = match state.children.get(&op.op) {
                    None => match child::plan(state, &op.op, &op.call) {
                        child::Plan::Refuse(why) => Some(why),
                        // Linked by the rest of its group, which the next decision finishes.
                        child::Plan::Start { .. } => None,
                    },
                    Some(id) => self.ensure_child(state, writer, op, id).await?,
                };
                if let Some(why) = refusal {
                    tracing::info!(run_id = %state.run_id, op = %op.op, reason = %why, "run_agent refused");
                    let result = ToolResult {
                        content: why,
                        is_error: true,
                        stopped: false,
                    };
                    self.give_result(&state.run_id, &op.op, result).await?;
                } else if let Some(id) = state.children.get(&op.op)
                    && state.status == RunStatus::Cancelling
                {
                    self.cancel_child(state, id).await?;
                }
            }
        }
        if let Some(link) = &state.bundle.parent
            && let Some(result) = child::result(state)
        {
            failpoint::hit("step.before_child_result");
            self.give_result(&link.run_id, &link.op, result).await?;
        }
        Ok(())
    }

    /// Makes child run `id` of the `run_agent` operation `op` exist; `Some(refusal)` when it
    /// cannot (no such agent for the run's tenant, no budget left, its id taken by another run).
    async fn ensure_child(
        &self,
        state: &RunState,
        writer: &DecisionWriter,
        op: &ToolOp,
        id: &RunId,
    ) -> Result<Option<String>, DriveError> {
        if self.children.lock().is_ok_and(|c| c.contains(id)) {
            return Ok(None);
        }
        // The child may exist already (created before a restart, a takeover, by another
        // worker): then it is this operation's child or its id is taken, whatever the registry
        // says now. Only a child that does not exist yet is planned and created.
        match self.child_link(state, op, id).await? {
            Some(true) => {}
            Some(false) => return Ok(Some(taken(id))),
            None => {
                if let Some(refusal) = self.create_child(state, writer, op, id).await? {
                    return Ok(Some(refusal));
                }
                // Created, or created meanwhile by someone else (a duplicate message id proves
                // nothing about whose run it is): the link decides.
                if self.child_link(state, op, id).await? != Some(true) {
                    return Ok(Some(taken(id)));
                }
            }
        }
        failpoint::hit("step.after_child_created");
        if let Ok(mut children) = self.children.lock() {
            if children.len() >= CACHE_RUNS {
                children.clear();
            }
            children.insert(id.clone());
        }
        Ok(None)
    }

    /// Whether run `id` exists and is the child of `op` of `state`'s run: `None` when it has no
    /// `run.created`, `Some(false)` when another run holds the id.
    async fn child_link(
        &self,
        state: &RunState,
        op: &ToolOp,
        id: &RunId,
    ) -> Result<Option<bool>, DriveError> {
        let found = self
            .rt
            .journal
            .read_type(id, kedge_core::event::EventType::RunCreated)
            .await?;
        Ok(found.first().map(|r| {
            matches!(&r.envelope.event,
                Event::RunCreated(c) if child::is_child_of(c, &state.run_id, &op.op))
        }))
    }

    /// Creates child run `id` of `op` (as the parent's `writer`); `Some(refusal)` when the call
    /// may not start one (no such agent for the run's tenant, no budget left).
    async fn create_child(
        &self,
        state: &RunState,
        writer: &DecisionWriter,
        op: &ToolOp,
        id: &RunId,
    ) -> Result<Option<String>, DriveError> {
        let (agent, input) = match child::plan(state, &op.op, &op.call) {
            child::Plan::Start { agent, input, .. } => (agent, input),
            child::Plan::Refuse(why) => return Ok(Some(why)),
        };
        let (revision, def) = match self.rt.agents.latest(&agent).await {
            Ok(found) => found,
            Err(AgentError::NotFound(_)) => {
                return Ok(Some(format!("not run: no agent named `{agent}`")));
            }
            Err(e @ AgentError::Unavailable(_)) => return Err(e.into()),
            Err(e) => return Ok(Some(format!("not run: {e}"))),
        };
        let now = Timestamp::now();
        let mut created = match child::created(state, &op.op, revision, &def, input, now) {
            Ok(created) => created,
            Err(why) => return Ok(Some(why)),
        };
        if let Err(e) = seal_child_input(&self.rt, state, id, &def, &mut created.input) {
            return Ok(Some(format!("not run: {e}")));
        }
        let created = DecisionEnvelope::new(
            id.clone(),
            now,
            Draft::new(Decision::RunCreated(Box::new(created))),
        );
        let creator = RunCreator::child_of(writer);
        match self.rt.journal.create_run(&creator, &created).await {
            Ok(_) => {
                metrics::run_created();
                tracing::info!(run_id = %state.run_id, op = %op.op, child = %id, agent = %agent, "child run created");
                Ok(None)
            }
            Err(JournalError::Duplicate { .. } | JournalError::Conflict { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Asks child run `id` of the cancelling run `state` to cancel (once: the child's cancel
    /// request has its run's one `Nats-Msg-Id`, and its fold ignores a second).
    async fn cancel_child(&self, state: &RunState, id: &RunId) -> Result<(), DriveError> {
        let reason = format!(
            "its parent run {} is cancelling: {}",
            state.run_id,
            state.cancel_requested.as_deref().unwrap_or_default()
        );
        let input = InputEnvelope::new(
            id.clone(),
            Timestamp::now(),
            Draft::new(Input::CancelRequested(CancelRequested {
                reason,
                by: Some(format!("run:{}", state.run_id)),
            })),
        );
        // A repeat (this drive's earlier self, or another worker's) asked nothing twice.
        self.rt
            .journal
            .append_input(&InputId::cancel(id), &input)
            .await?;
        Ok(())
    }

    /// Appends `result` as the one result of operation `op` of run `run`.
    async fn give_result(
        &self,
        run: &RunId,
        op: &OperationId,
        result: ToolResult,
    ) -> Result<(), DriveError> {
        let input = InputEnvelope::new(
            run.clone(),
            Timestamp::now(),
            Draft::new(Input::ToolResult(result))
                .step(op.step())
                .op(op.clone()),
        );
        // Given before (a redelivered wake, a nudge, another worker): the one result stands.
        self.rt
            .journal
            .append_input(&InputId::tool_result(op), &input)
            .await?;
        Ok(())
    }
}

/// A child's input as its `run.created` keeps it: a value the parent holds sealed
/// (`policy.run_agent.sensitive`) is opened and sealed again for the child (a token opens only
/// in its own run), and one the child's agent marks sensitive is sealed. So it is sealed when
/// either side marks it, never journaled in clear.
fn seal_child_input(
    rt: &Runtime,
    parent: &RunState,
    child: &RunId,
    def: &AgentDefinition,
    input: &mut String,
) -> Result<(), SealError> {
    let held_sealed = seal::is_sealed(input);
    if !held_sealed && !def.sensitive_task_fields.iter().any(|f| f == "input") {
        return Ok(());
    }
    let key = rt.seal.as_ref().ok_or(SealError::NoKey)?;
    let clear = if held_sealed {
        match key.open(&parent.run_id, input)? {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        }
    } else {
        std::mem::take(input)
    };
    *input = key.seal(child, &serde_json::Value::String(clear));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kedge_core::StepNo;
    use kedge_core::event::Envelope;
    use kedge_core::event::{ParentLink, RunCreated};

    fn folded(parent: Option<ParentLink>) -> RunState {
        let run: RunId = "run_child1".parse().expect("a run id");
        let created = RunCreated {
            parent,
            ..kedge_core::fixtures::run_created("demo", "hello")
        };
        let env = Envelope::new(
            run,
            Timestamp::now(),
            Draft::new(Decision::RunCreated(Box::new(created))),
        );
        kedge_core::fold::fold([(1, &env)]).expect("folds")
    }

    #[test]
    fn a_child_run_is_tended_and_a_run_without_children_is_not() {
        assert!(!needs_tending(&folded(None)));
        let parent: RunId = "run_parent1".parse().expect("a run id");
        let link = ParentLink {
            op: OperationId::new(&parent, StepNo(1), 0),
            run_id: parent,
            ancestors: vec!["boss".parse().expect("an agent name")],
        };
        assert!(needs_tending(&folded(Some(link))));
    }

    #[test]
    fn a_taken_child_id_is_named_in_the_refusal() {
        let id: RunId = "run_taken1".parse().expect("a run id");
        let refusal = taken(&id);
        assert!(refusal.starts_with("not run: "), "{refusal}");
        assert!(refusal.contains("run_taken1"), "{refusal}");
    }
}
