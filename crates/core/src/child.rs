//! Child runs: an agent started as a tool (`run_agent`), as pure functions.
//!
//! An agent that declares `{"name": "run_agent", "agents": [..]}` offers its model a tool whose
//! arguments are the agent to start (an enum of those names) and the child's input. A call the
//! run may make ([`plan`]) becomes, in the step's decision group, the operation's
//! `tool.requested` and `child.started {child, agent}`; the child's id is derived from the
//! operation ([`RunId::for_child`]), so whoever finishes the group or drives the run after a
//! crash finds the same child: one child per operation. The step service then writes the
//! child's `run.created` ([`created`]: the parent's tenant, a budget no looser than what the
//! parent has left, the link back to the parent) and the parent waits, holding nothing. When the
//! child ends, its own drive appends [`result`] to the parent as the operation's `tool.result`
//! (one per operation: its `Nats-Msg-Id` is the operation's, and the fold keeps the first).
//!
//! Invariants: everything here is a function of the journaled call, the parent's fold and the
//! child's frozen definition (the clock only through `now`, which is recorded in the child's
//! bundle), so every worker makes the same verdict; a refused call never starts a child and its
//! refusal is the operation's error result, which the model reads.

use serde_json::{Value, json};

use crate::agent::{AgentDefinition, ToolSpec};
use crate::event::{
    Budget, ModelSpec, OutputValidation, ParentLink, RunCreated, Timestamp, ToolCall, ToolResult,
};
use crate::fold::RunState;
use crate::ids::{AgentName, OperationId, RunId};
use crate::machine::RunStatus;

/// The tool that starts a child run.
pub const RUN_AGENT_TOOL: &str = "run_agent";

/// How deep child runs nest: a run started by a task is at depth 0, its children at 1; a run at
/// this depth may not start children.
pub const MAX_DEPTH: usize = 4;

/// The JSON Schema of `run_agent`'s arguments for an agent that may start `agents`.
pub fn parameters(agents: &[AgentName]) -> Value {
    let names: Vec<&str> = agents.iter().map(AgentName::as_str).collect();
    json!({
        "type": "object",
        "properties": {
            "agent": {"type": "string", "enum": names, "description": "The agent to start"},
            "input": {"type": "string", "minLength": 1,
                      "description": "The child run's task: its first user message"}
        },
        "required": ["agent", "input"],
        "additionalProperties": false
    })
}

/// What the model reads about `run_agent` when the definition gives no description.
pub fn default_description(agents: &[AgentName]) -> String {
    let names: Vec<&str> = agents.iter().map(AgentName::as_str).collect();
    format!(
        "Start a run of another agent (a child run) with an input and wait for its final \
         answer, which is this tool's result. Agents you may start: {}.",
        names.join(", ")
    )
}

/// The agents a `run_agent` tool may start: the enum of its `agent` argument; `None` when its
/// parameters are not the ones [`parameters`] makes for that list.
pub fn allowed(spec: &ToolSpec) -> Option<Vec<AgentName>> {
    let names = spec
        .parameters
        .pointer("/properties/agent/enum")?
        .as_array()?;
    let agents: Vec<AgentName> = names
        .iter()
        .map(|n| n.as_str().and_then(|s| s.parse().ok()))
        .collect::<Option<_>>()?;
    (!agents.is_empty() && spec.parameters == parameters(&agents)).then_some(agents)
}

/// The verdict on one `run_agent` call of the run `parent`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Start child run `child` of `agent` with `input`.
    Start {
        child: RunId,
        agent: AgentName,
        input: String,
    },
    /// Not run; the text is the operation's error result.
    Refuse(String),
}

/// The agents above a child of `parent` (the root first, `parent`'s own agent last).
pub fn lineage(parent: &RunCreated) -> Vec<AgentName> {
    let mut chain = parent
        .parent
        .as_ref()
        .map(|p| p.ancestors.clone())
        .unwrap_or_default();
    chain.push(parent.agent.clone());
    chain
}

/// Whether `parent`'s `run_agent` operation `op` (the call `call`, which passed the tool
/// contract) may start a child: the depth is bounded ([`MAX_DEPTH`]) and an agent may not
/// start itself, directly or further down.
pub fn plan(parent: &RunState, op: &OperationId, call: &ToolCall) -> Plan {
    let agent = match call
        .arguments
        .get("agent")
        .and_then(Value::as_str)
        .map(str::parse::<AgentName>)
    {
        Some(Ok(agent)) => agent,
        _ => return Plan::Refuse("not run: run_agent needs `agent`, an agent's name".into()),
    };
    let Some(input) = call.arguments.get("input").and_then(Value::as_str) else {
        return Plan::Refuse("not run: run_agent needs `input`, the child's task as text".into());
    };
    let chain = lineage(&parent.bundle);
    if chain.len() > MAX_DEPTH {
        return Plan::Refuse(format!(
            "not run: this run is {} child runs deep; child runs nest at most {MAX_DEPTH} deep",
            chain.len() - 1
        ));
    }
    if chain.contains(&agent) {
        let names: Vec<&str> = chain.iter().map(AgentName::as_str).collect();
        return Plan::Refuse(format!(
            "not run: `{agent}` is already running above this child ({}): an agent may not \
             start itself",
            names.join(" → ")
        ));
    }
    Plan::Start {
        child: RunId::for_child(op),
        agent,
        input: input.to_owned(),
    }
}

/// The child's budget: its agent's own (`own`), tightened to what the parent has left at `now`.
/// Steps, tokens and cost left, attempts per step, and the time to the parent's deadline are
/// each the smaller of the two; nothing the parent lacks is added. Refused when the parent has
/// nothing left of one of them, or when the parent's cost limit could not be enforced on the
/// child (its model has no price, or one in another currency).
pub fn budget(
    parent: &RunState,
    own: &Budget,
    child_model: &ModelSpec,
    now: Timestamp,
) -> Result<Budget, String> {
    let p = &parent.bundle.budget;
    let steps_left = p.max_steps.saturating_sub(parent.step.get());
    let tokens_left = p.max_tokens.saturating_sub(parent.usage.total());
    if steps_left == 0 || tokens_left == 0 {
        return Err("not run: the parent run has no steps or tokens left for a child".into());
    }
    let mut b = Budget {
        max_steps: own.max_steps.min(steps_left),
        max_tokens: own.max_tokens.min(tokens_left),
        max_attempts_per_step: own.max_attempts_per_step.min(p.max_attempts_per_step),
        deadline_secs: own.deadline_secs,
        max_cost: own.max_cost,
    };
    if let Some(secs) = p.deadline_secs {
        let end = parent
            .created_at
            .saturating_add(std::time::Duration::from_secs(secs));
        let left = (end.0 - now.0).whole_seconds();
        if left < 1 {
            return Err("not run: the parent run's deadline has passed".into());
        }
        let left = left as u64;
        b.deadline_secs = Some(own.deadline_secs.map_or(left, |d| d.min(left)));
    }
    if let Some(max_cost) = p.max_cost {
        let parent_currency = parent.bundle.model.currency();
        if child_model.currency().is_none() || child_model.currency() != parent_currency {
            return Err(format!(
                "not run: the parent run has a cost limit in {} and the child's model has no \
                 price in that currency, so its cost could not be held to it",
                parent_currency.unwrap_or("its currency")
            ));
        }
        let left = max_cost - parent.usage.cost.unwrap_or(0.0);
        if left <= 0.0 {
            return Err("not run: the parent run has no cost left for a child".into());
        }
        b.max_cost = Some(own.max_cost.map_or(left, |c| c.min(left)));
    }
    Ok(b)
}

/// The child's `run.created`: revision `revision` of `def` (the agent `agent`, as its current
/// revision was read), in the parent's tenant and trace, its budget from [`budget`], linked to
/// the parent's operation `op`. Refused when the agent is not shared with the parent's tenant
/// (to that tenant it does not exist) or the budget cannot be made.
pub fn created(
    parent: &RunState,
    op: &OperationId,
    revision: u64,
    def: &AgentDefinition,
    input: String,
    now: Timestamp,
) -> Result<RunCreated, String> {
    let tenant = &parent.bundle.tenant;
    if !def.allows_tenant(tenant) {
        return Err(format!("not run: no agent named `{}`", def.name));
    }
    let budget = budget(parent, &def.budget, &def.model, now)?;
    Ok(RunCreated {
        agent: def.name.clone(),
        agent_revision: revision,
        agent_digest: def.digest(),
        model: def.model.clone(),
        prompt_digest: def.prompt_digest(),
        tools_digest: def.tools_digest(),
        policy_digest: def.policy_digest(),
        budget,
        tenant: tenant.clone(),
        caller: Some(format!("run:{}", parent.run_id)),
        idempotency_key: None,
        input,
        runtime_version: env!("CARGO_PKG_VERSION").to_owned(),
        metadata: Default::default(),
        traceparent: parent.bundle.traceparent.clone(),
        parent: Some(ParentLink {
            run_id: parent.run_id.clone(),
            op: op.clone(),
            ancestors: lineage(&parent.bundle),
        }),
        concurrency: None,
    })
}

/// Whether `created` (a run found under a child's id) is the child of `parent`'s `op`: a run
/// made there by anyone else (a client choosing that run id) is not, and is never taken for it.
pub fn is_child_of(created: &RunCreated, parent: &RunId, op: &OperationId) -> bool {
    created
        .parent
        .as_ref()
        .is_some_and(|p| p.run_id == *parent && p.op == *op)
}

/// What a child run that ended gives its parent's operation: the final answer (an answer that
/// failed the child's `output_schema` is an error result naming the errors), or an error saying
/// how it failed or that it was cancelled. `None` while the child has not ended.
pub fn result(child: &RunState) -> Option<ToolResult> {
    let id = &child.run_id;
    let error = |content: String, stopped: bool| ToolResult {
        content,
        is_error: true,
        stopped,
    };
    match child.status {
        RunStatus::Succeeded => {
            let output = child.output.clone().unwrap_or_default();
            Some(match &child.validation {
                Some(OutputValidation::Invalid { errors }) => error(
                    format!(
                        "child run {id} answered, but its answer does not match its \
                         output_schema: {}\nIts answer: {output}",
                        errors.join("; ")
                    ),
                    false,
                ),
                Some(OutputValidation::Valid | OutputValidation::NotChecked) | None => ToolResult {
                    content: output,
                    is_error: false,
                    stopped: false,
                },
            })
        }
        RunStatus::Failed => {
            let (reason, message) = child
                .failure
                .as_ref()
                .map(|f| {
                    let reason = serde_json::to_value(f.reason)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default();
                    (reason, f.message.clone())
                })
                .unwrap_or_default();
            Some(error(
                format!("child run {id} failed ({reason}): {message}"),
                false,
            ))
        }
        RunStatus::Cancelled => Some(error(format!("child run {id} was cancelled"), true)),
        RunStatus::Queued
        | RunStatus::Running
        | RunStatus::WaitingTool
        | RunStatus::WaitingUser
        | RunStatus::WaitingApproval
        | RunStatus::WaitingExternal
        | RunStatus::WaitingProvider
        | RunStatus::Cancelling
        | RunStatus::Compensating
        | RunStatus::Unknown => None,
    }
}
