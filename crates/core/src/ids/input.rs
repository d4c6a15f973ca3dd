//! [`InputId`]: the deduplication ids of journal inputs.

use super::{ApprovalId, CallbackKey, OperationId, QuestionId, RunId, TimerId};

/// The deduplication id (`Nats-Msg-Id`) of a journal input: what makes a repeat of the same input
/// land once. Every id Kedge gives an input is built by one of these constructors, so the scheme
/// is stated once (and two kinds of input can never share an id by accident).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InputId(String);

impl InputId {
    /// A user message; `key` is the caller's idempotency key (a fresh id when it has none).
    pub fn message(run: &RunId, key: Option<&str>) -> InputId {
        let key = key
            .map(str::to_owned)
            .unwrap_or_else(|| uuid::Uuid::now_v7().simple().to_string());
        InputId(format!("msg:{run}:{key}"))
    }
    /// The one answer a question gets.
    pub fn answer(question: &QuestionId) -> InputId {
        InputId(format!("answer:{question}"))
    }
    /// The one cancel request a run records.
    pub fn cancel(run: &RunId) -> InputId {
        InputId(format!("cancel:{run}"))
    }
    /// The one decision an approval gets.
    pub fn approval_decided(approval: &ApprovalId) -> InputId {
        InputId(format!("approval.decided:{approval}"))
    }
    /// One delivery of a callback (`delivery` is the sender's id, or the payload's digest).
    pub fn callback(key: &CallbackKey, delivery: &str) -> InputId {
        InputId(format!("callback:{key}:{delivery}"))
    }
    /// The one result an operation gets (a confirmed outcome uses the same id, so at most one
    /// of the two lands).
    pub fn tool_result(op: &OperationId) -> InputId {
        InputId(format!("tool.result:{op}"))
    }
    /// A person's resolution of the ambiguity of an operation's `dispatch` (its count of
    /// dispatches when found ambiguous): one per ambiguity, a repeat is a duplicate.
    pub fn outcome_resolved(op: &OperationId, dispatch: u32) -> InputId {
        InputId(format!("outcome.resolved:{op}:{dispatch}"))
    }
    /// `tool.started` of one claim of an operation (`revision`: the claim's record revision).
    pub fn tool_started(op: &OperationId, revision: u64) -> InputId {
        InputId(format!("tool.started:{op}:{revision}"))
    }
    /// `tool.attempt`: one failed attempt of one dispatch of an operation, to be tried again.
    pub fn tool_attempt(op: &OperationId, dispatch: u32, attempt: u32) -> InputId {
        InputId(format!("tool.attempt:{op}:{dispatch}:{attempt}"))
    }
    /// `outcome.ambiguous` of one dispatch of an operation.
    pub fn outcome_ambiguous(op: &OperationId, dispatch: u32) -> InputId {
        InputId(format!("outcome.ambiguous:{op}:{dispatch}"))
    }
    /// `target.moved` of one dispatch of an operation.
    pub fn target_moved(op: &OperationId, dispatch: u32) -> InputId {
        InputId(format!("target.moved:{op}:{dispatch}"))
    }
    /// The firing of a durable timer.
    pub fn timer_fired(timer: &TimerId) -> InputId {
        InputId(format!("timer.fired:{timer}"))
    }
    /// The reconciler's nudge of a stalled run, once per last event it saw.
    pub fn nudge(run: &RunId, last_seq: u64) -> InputId {
        InputId(format!("nudge:{run}:{last_seq}"))
    }
    /// The fleet's release of a run from its wait on the provider: once per wait (`since`:
    /// the wait's registration, a revision of the fleet's wait list), so a releaser that
    /// repeats itself after a crash releases nothing twice.
    pub fn provider_released(run: &RunId, since: u64) -> InputId {
        InputId(format!("provider.released:{run}:{since}"))
    }
    /// A slot of the run's concurrency key handed to it (`record_revision`: the revision of the
    /// key's record that made it a holder), so a releaser that repeats itself wakes it once.
    pub fn slot_granted(run: &RunId, record_revision: u64) -> InputId {
        InputId(format!("slot.granted:{run}:{record_revision}"))
    }
    /// An operator's retry of a run whose wake became dead letter `dead_seq`
    /// (`kedge dead retry`).
    pub fn dead_retry(run: &RunId, dead_seq: u64) -> InputId {
        InputId(format!("retry:{run}:{dead_seq}"))
    }
    /// The reconciler's nudge naming an operation stuck in one dispatch.
    pub fn resolve_nudge(op: &OperationId, dispatch: u32) -> InputId {
        InputId(format!("resolve:{op}:{dispatch}"))
    }
    /// Any id: for tests and benches that append inputs of their own.
    #[cfg(any(test, feature = "test-util"))]
    pub fn arbitrary(id: impl Into<String>) -> InputId {
        InputId(id.into())
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for InputId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_ids_name_what_they_deduplicate() {
        let run: RunId = "run_abc".parse().expect("valid");
        let q: QuestionId = "q_1".parse().expect("valid");
        assert_eq!(InputId::answer(&q).as_str(), "answer:q_1");
        assert_eq!(InputId::cancel(&run).as_str(), "cancel:run_abc");
        assert_eq!(InputId::message(&run, Some("k")).as_str(), "msg:run_abc:k");
        assert_ne!(InputId::message(&run, None), InputId::message(&run, None));
        assert_eq!(InputId::nudge(&run, 7).as_str(), "nudge:run_abc:7");
    }
}
