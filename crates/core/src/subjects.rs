//! The broker layout's names: streams, buckets and subjects (docs/ARCHITECTURE.md, "The journal").
//!
//! Every service builds subjects through these functions, so the layout is stated once.

use crate::event::{EventKind, EventType};
use crate::ids::{AgentName, RunId, TenantId};

/// Task intake stream (work-queue retention), subjects `agent.task.>`.
pub const TASKS_STREAM: &str = "KEDGE_TASKS";
/// The journal stream (limits retention, file storage), subjects `agent.run.>`.
pub const RUNS_STREAM: &str = "KEDGE_RUNS";
pub const LEASES_BUCKET: &str = "kedge_leases";
pub const IDEMPOTENCY_BUCKET: &str = "kedge_idempotency";
pub const RUNS_BUCKET: &str = "kedge_runs";
pub const AGENTS_BUCKET: &str = "kedge_agents";
/// The fleet's view of each model endpoint: breakers, waiting runs, releasers.
pub const PROVIDERS_BUCKET: &str = "kedge_providers";
pub const BLOBS_BUCKET: &str = "kedge_blobs";

/// Core-NATS request subject where the reconciler sends the `tool.requested` envelope of an
/// operation stuck in `running`; tool services answer in the queue group [`TOOL_RESOLVE_QUEUE`].
pub const TOOL_RESOLVE: &str = "kedge.tool.resolve";
/// Core-NATS request subject of the tools' precondition checks (same queue group): the step
/// service sends [`TargetQuery`] before it journals an `approval.requested`, and records the
/// answer as the request's `target_version`.
pub const TOOL_INSPECT: &str = "kedge.tool.inspect";
pub const TOOL_RESOLVE_QUEUE: &str = "kedge-tool";

/// Liveness of worker processes (the failure detector, `kedge_runtime::liveness`): each step
/// or tool process publishes heartbeats on `kedge.live.hb.<worker>` and answers pings on
/// `kedge.live.ping.<worker>`. Core NATS only; nothing is stored.
pub const LIVE_HEARTBEATS: &str = "kedge.live.hb.*";

/// The heartbeat subject of worker `worker` (a subject token: see [`is_token`]).
pub fn live_heartbeat(worker: &str) -> String {
    format!("kedge.live.hb.{worker}")
}

/// The ping subject of worker `worker`.
pub fn live_ping(worker: &str) -> String {
    format!("kedge.live.ping.{worker}")
}

/// The lease-yield subject of worker `worker`: a step worker woken for a run whose lease
/// `worker` keeps parked after a drive asks it there to let go (core NATS request, the run id
/// as payload; the answer is the release marker's sequence, or empty when nothing was parked).
pub fn live_yield(worker: &str) -> String {
    format!("kedge.live.yield.{worker}")
}

/// Whether `s` may be used as one subject token by Kedge: 1 to 128 of `[A-Za-z0-9_-]`.
pub fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A precondition query: where would this call's target be now?
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TargetQuery {
    pub run_id: RunId,
    pub tool: String,
    pub arguments: serde_json::Value,
}

/// The answer to a [`TargetQuery`]: the target's version, or none for a tool without a
/// precondition check. Unknown fields are refused, so a runner's refusal (`{"refused": …}`) is
/// never read as "no version".
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetAnswer {
    pub version: Option<String>,
}

/// `agent.task.<agent>`: where clients publish tasks (in Kedge's own account these are tasks of
/// the default tenant; a tenant's tasks carry its name as a fifth token, see [`task_for`]).
pub fn task(agent: &AgentName) -> String {
    format!("agent.task.{agent}")
}

/// The tenant of tasks whose subject names none (`agent.task.<agent>`).
pub const DEFAULT_TENANT: &str = "default";

/// `agent.task.<agent>.<tenant>`: a tenant's task inside Kedge's account. Tenants never write
/// this subject themselves: the tenant gateway (which the server routes a tenant account's
/// `agent.task.<agent>` to, with the tenant's name fixed by the server configuration) and the
/// HTTP bridge (which authenticated the caller's token) do. The default tenant's tasks use
/// [`task`].
pub fn task_for(agent: &AgentName, tenant: &TenantId) -> String {
    if tenant.as_str() == DEFAULT_TENANT {
        task(agent)
    } else {
        format!("agent.task.{agent}.{tenant}")
    }
}

/// What a task subject names: the agent and the tenant (the default tenant when the subject has
/// no tenant token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskSubject {
    pub agent: AgentName,
    pub tenant: TenantId,
}

/// Why a task subject is not `agent.task.<agent>[.<tenant>]`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{subject}` is not agent.task.<agent>[.<tenant>]: {reason}")]
pub struct TaskSubjectError {
    pub subject: String,
    pub reason: String,
}

/// Parses `agent.task.<agent>` and `agent.task.<agent>.<tenant>`.
pub fn parse_task(subject: &str) -> Result<TaskSubject, TaskSubjectError> {
    let err = |reason: String| TaskSubjectError {
        subject: subject.chars().take(200).collect(),
        reason,
    };
    let rest = subject
        .strip_prefix("agent.task.")
        .ok_or_else(|| err("wrong prefix".into()))?;
    let mut tokens = rest.split('.');
    let agent = tokens
        .next()
        .unwrap_or_default()
        .parse::<AgentName>()
        .map_err(|e| err(e.to_string()))?;
    let tenant = match tokens.next() {
        None => DEFAULT_TENANT
            .parse::<TenantId>()
            .map_err(|e| err(e.to_string()))?,
        Some(t) => t.parse::<TenantId>().map_err(|e| err(e.to_string()))?,
    };
    if tokens.next().is_some() {
        return Err(err("too many tokens".into()));
    }
    Ok(TaskSubject { agent, tenant })
}

/// The prefix of the tenant gateway's subjects in Kedge's account: `kedge.t.<tenant>.…`. A
/// tenant account imports `kedge.t.<its name>.>` (and only that), so a request arriving there
/// was sent by a connection the server authenticated as that tenant.
pub const GATEWAY_PREFIX: &str = "kedge.t";

/// `kedge.t.<tenant>.>`: everything one tenant may ask of Kedge.
pub fn gateway_all(tenant: &TenantId) -> String {
    format!("{GATEWAY_PREFIX}.{tenant}.>")
}

/// `agent.run.<run_id>.>`: a run's whole journal.
pub fn run_all(run: &RunId) -> String {
    format!("agent.run.{run}.>")
}

/// `agent.run.<run_id>.d.>`: a run's decisions (the optimistic-concurrency scope).
pub fn run_decisions(run: &RunId) -> String {
    format!("agent.run.{run}.d.>")
}

/// `agent.run.<run_id>.i.>`: a run's inputs.
pub fn run_inputs(run: &RunId) -> String {
    format!("agent.run.{run}.i.>")
}

/// `agent.run.<run_id>.<d|i>.<type>`: where one event is journaled.
pub fn event(run: &RunId, event_type: EventType) -> String {
    format!(
        "agent.run.{run}.{}.{}",
        event_type.kind().token(),
        event_type.as_str()
    )
}

/// `agent.delta.<run_id>`: core-NATS token deltas, never journaled.
pub fn delta(run: &RunId) -> String {
    format!("agent.delta.{run}")
}

/// What a journal subject names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSubject {
    pub run_id: RunId,
    pub kind: EventKind,
    pub event_type: EventType,
}

/// Parses `agent.run.<run_id>.<d|i>.<type>`; `None` for anything else, including a type filed
/// under the wrong kind.
pub fn parse_event(subject: &str) -> Option<EventSubject> {
    let rest = subject.strip_prefix("agent.run.")?;
    let (run, rest) = rest.split_once('.')?;
    let (kind, ty) = rest.split_once('.')?;
    let kind = match kind {
        "d" => EventKind::Decision,
        "i" => EventKind::Input,
        _ => return None,
    };
    let event_type: EventType = ty.parse().ok()?;
    if event_type.kind() != kind {
        return None;
    }
    Some(EventSubject {
        run_id: run.parse().ok()?,
        kind,
        event_type,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_subjects_parse_back() {
        let run: RunId = "run_abc".parse().expect("valid");
        for t in EventType::ALL {
            let s = event(&run, *t);
            let parsed = parse_event(&s).expect("parses");
            assert_eq!(parsed.run_id, run);
            assert_eq!(parsed.event_type, *t);
            assert_eq!(parsed.kind, t.kind());
        }
        assert_eq!(parse_event("agent.run.run_abc.i.run.created"), None);
        assert_eq!(parse_event("agent.task.x"), None);
        assert_eq!(run_decisions(&run), "agent.run.run_abc.d.>");
    }

    #[test]
    fn a_refused_precondition_query_is_not_an_answer() {
        assert!(serde_json::from_str::<TargetAnswer>(r#"{"refused": "no such run"}"#).is_err());
        let none: TargetAnswer = serde_json::from_str(r#"{"version": null}"#).expect("answer");
        assert_eq!(none.version, None);
    }

    #[test]
    fn task_subjects_name_agent_and_tenant() {
        let agent: AgentName = "helper".parse().expect("valid");
        let acme: TenantId = "acme".parse().expect("valid");
        let default: TenantId = DEFAULT_TENANT.parse().expect("valid");
        assert_eq!(task_for(&agent, &acme), "agent.task.helper.acme");
        assert_eq!(task_for(&agent, &default), "agent.task.helper");
        for (s, tenant) in [
            ("agent.task.helper", "default"),
            ("agent.task.helper.acme", "acme"),
        ] {
            let parsed = parse_task(s).expect("parses");
            assert_eq!(parsed.agent, agent);
            assert_eq!(parsed.tenant.as_str(), tenant);
        }
        for bad in [
            "agent.task.",
            "agent.task.helper.acme.extra",
            "agent.task.helper.",
            "agent.run.x",
            "agent.task.he*per",
        ] {
            assert!(parse_task(bad).is_err(), "{bad}");
        }
    }
}
