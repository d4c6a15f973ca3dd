//! Child runs: the link between a parent's `run_agent` operation and the run it starts.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::{AgentName, OperationId, RunId};

/// Where a child run comes from: its parent run and the `run_agent` operation in it. The
/// child's run id is derived from `op` ([`RunId::for_child`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ParentLink {
    pub run_id: RunId,
    pub op: OperationId,
    /// The agents of the runs above this one, the root first and the parent last: its length
    /// is the child's depth (at most [`crate::child::MAX_DEPTH`]), and an agent in it may not
    /// be started again below (no recursion).
    pub ancestors: Vec<AgentName>,
}

/// The `run_agent` operation (the envelope's `op`) starts child run `child` of `agent`: the
/// parent's half of the link (the child's `run.created` carries the other). Journaled with the
/// operation's `tool.requested`, before the child exists (intent before effect).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ChildStarted {
    pub child: RunId,
    pub agent: AgentName,
}
