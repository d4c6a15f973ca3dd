//! The registry of the broker layout: every stream, bucket, durable consumer and subject
//! grammar Kedge uses, built and parsed here and nowhere else (docs/ARCHITECTURE.md, "The
//! journal" and "The broker layout"). A test (`crates/core/tests/layout_names.rs`) fails when a
//! product source file outside this module spells one of these names.

mod broker;
mod schedules;
mod storage;

pub use broker::*;
pub use schedules::ScheduleVerb;
pub use storage::*;

use crate::event::{EventKind, EventType};
use crate::ids::{AgentName, ApprovalId, QuestionId, RunId, TenantId, TimerId, WorkerId};

/// A subject wildcard standing for exactly one token (`*`).
pub const ONE_TOKEN: &str = "*";

/// A subject wildcard standing for one or more tokens at the end of a subject (`>`).
pub const ANY_TAIL: &str = ">";

/// The durable consumers of the layout; each one's configuration is
/// `nats/consumers/<stream>/<name>.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Durable {
    /// Tasks into runs (intake), on [`TASKS_STREAM`].
    Intake,
    /// Work for the step service, on the journal: every run's inputs (one wildcard filter; the
    /// step passes over those that do not wake a run, [`crate::event::EventType::wakes_step`]).
    /// Each journal consumer has a single filter subject (docs/ARCHITECTURE.md "The broker's
    /// cost per run").
    Step,
    /// Work for the step service, on the journal: every new run's `run.created`.
    StepCreated,
    /// Work for the tool service, on the journal.
    Tool,
    /// The runs projection (the projector service), on the journal.
    Projector,
    /// Timers to schedule, on the journal.
    Timer,
    /// Fired timers, on [`TIMERS_STREAM`].
    TimerFired,
}

impl Durable {
    pub const ALL: [Durable; 7] = [
        Durable::Intake,
        Durable::Step,
        Durable::StepCreated,
        Durable::Tool,
        Durable::Projector,
        Durable::Timer,
        Durable::TimerFired,
    ];

    /// The consumer's durable name.
    pub const fn name(self) -> &'static str {
        match self {
            Durable::Intake => "intake",
            Durable::Step => "step",
            Durable::StepCreated => "step-created",
            Durable::Tool => "tool",
            Durable::Projector => "projector",
            Durable::Timer => "timer",
            Durable::TimerFired => "timer-fired",
        }
    }

    /// The stream it consumes.
    pub const fn stream(self) -> &'static str {
        match self {
            Durable::Intake => TASKS_STREAM,
            Durable::Step
            | Durable::StepCreated
            | Durable::Tool
            | Durable::Projector
            | Durable::Timer => RUNS_STREAM,
            Durable::TimerFired => TIMERS_STREAM,
        }
    }

    /// The consumer named `name`, if the layout has one.
    pub fn named(name: &str) -> Option<Durable> {
        Durable::ALL.into_iter().find(|d| d.name() == name)
    }
}

impl std::fmt::Display for Durable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Core-NATS request subject where the reconciler sends the `tool.requested` envelope of an
/// operation stuck in `running`; tool services answer in the queue group [`TOOL_RESOLVE_QUEUE`].
pub const TOOL_RESOLVE: &str = "kedge.tool.resolve";
/// Core-NATS request subject of the tools' precondition checks (same queue group): the step
/// service sends [`crate::answers::TargetQuery`] before it journals an `approval.requested`, and records the
/// answer as the request's `target_version`.
pub const TOOL_INSPECT: &str = "kedge.tool.inspect";
pub const TOOL_RESOLVE_QUEUE: &str = "kedge-tool";

/// Liveness of worker processes (the failure detector, `kedge_runtime::liveness`): each step
/// or tool process publishes heartbeats on `kedge.live.hb.<worker>` and answers pings on
/// `kedge.live.ping.<worker>`. Core NATS only; nothing is stored.
pub const LIVE_HEARTBEATS: &str = "kedge.live.hb.*";

/// Every subject of the failure detector: heartbeats, pings and lease yields (`kedge.live.>`).
pub const LIVE_ALL: &str = "kedge.live.>";

/// The heartbeat subject of worker `worker`.
pub fn live_heartbeat(worker: &WorkerId) -> String {
    format!("kedge.live.hb.{worker}")
}

/// The worker a heartbeat's subject names, when it is a worker id.
pub fn parse_live_heartbeat(subject: &str) -> Option<WorkerId> {
    subject.strip_prefix("kedge.live.hb.")?.parse().ok()
}

/// The ping subject of worker `worker`.
pub fn live_ping(worker: &WorkerId) -> String {
    format!("kedge.live.ping.{worker}")
}

/// The lease-yield subject of worker `worker`: a step worker woken for a run whose lease
/// `worker` keeps parked after a drive asks it there to let go (core NATS request, the run id
/// as payload; the answer is the release marker's sequence, or empty when nothing was parked).
pub fn live_yield(worker: &WorkerId) -> String {
    format!("kedge.live.yield.{worker}")
}

/// The subject on which a service of worker `worker` sends itself a message to time a round
/// trip through the broker (adaptive admission, `kedge_runtime::consumer::Workers::adaptive`).
pub fn live_probe(worker: &WorkerId, service: &str) -> String {
    format!("kedge.live.probe.{worker}.{service}")
}

/// The queue group of a step process's yield subscription (one member: the subject is the
/// worker's own).
pub const YIELD_QUEUE: &str = "kedge-yield";

/// Whether `s` may be used as one subject token by Kedge: 1 to 128 of `[A-Za-z0-9_-]`.
pub fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
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

/// `kedge.t.<tenant>.>`: everything one tenant may ask of Kedge (what Kedge's account exports
/// to the tenant's).
pub fn gateway_all(tenant: &str) -> String {
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

/// The token that marks an inline subject (docs/ARCHITECTURE.md "Inline tools").
const INLINE: &str = "inline";

/// Where an event of an operation its run's drive runs itself is journaled
/// ([`crate::event::Envelope::inline`]): a decision at `agent.run.<run_id>.d.inline.<type>`
/// (within the run's decisions, `d.>`, outside every consumer's `d.<type>` filter) and an input
/// at `agent.run.<run_id>.inline.<type>` (outside the inputs, `i.>`: it wakes no step).
pub fn inline_event(run: &RunId, event_type: EventType) -> String {
    match event_type.kind() {
        EventKind::Decision => format!("agent.run.{run}.d.{INLINE}.{}", event_type.as_str()),
        EventKind::Input => format!("agent.run.{run}.{INLINE}.{}", event_type.as_str()),
    }
}

/// Every run's inline inputs (`agent.run.*.inline.>`): what a step service that runs tools
/// inline publishes besides its decisions.
pub fn inline_inputs_all_runs() -> String {
    format!("agent.run.*.{INLINE}.{ANY_TAIL}")
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
    /// On the event's inline subject ([`inline_event`]).
    pub inline: bool,
}

/// Parses `agent.run.<run_id>.<d|i>.<type>` and the inline subjects ([`inline_event`]); `None`
/// for anything else, including a type filed under the wrong kind and a type that is never
/// inline on an inline subject.
pub fn parse_event(subject: &str) -> Option<EventSubject> {
    let rest = subject.strip_prefix("agent.run.")?;
    let (run, rest) = rest.split_once('.')?;
    let (kind, ty) = rest.split_once('.')?;
    let (kind, ty, inline) = match kind {
        "d" => match ty.strip_prefix("inline.") {
            Some(ty) => (EventKind::Decision, ty, true),
            None => (EventKind::Decision, ty, false),
        },
        "i" => (EventKind::Input, ty, false),
        INLINE => (EventKind::Input, ty, true),
        _ => return None,
    };
    let event_type: EventType = ty.parse().ok()?;
    if event_type.kind() != kind || (inline && !event_type.may_be_inline()) {
        return None;
    }
    Some(EventSubject {
        run_id: run.parse().ok()?,
        kind,
        event_type,
        inline,
    })
}

/// Every subject of the journal (`agent.run.>`).
pub const JOURNAL_ALL: &str = "agent.run.>";

/// Every run's events of one kind (`agent.run.*.d.>`, every decision; `agent.run.*.i.>`, every
/// input).
pub fn kind_all_runs(kind: EventKind) -> String {
    format!("agent.run.*.{}.{ANY_TAIL}", kind.token())
}

/// Every task subject (`agent.task.>`: the default tenant's and every tenant's).
pub const TASKS_ALL: &str = "agent.task.>";

/// Every run's token deltas (`agent.delta.*`).
pub const DELTAS_ALL: &str = "agent.delta.*";

/// The prefix of every subject of run `run` in the journal (`agent.run.<run>.`).
pub fn run_prefix(run: &RunId) -> String {
    format!("agent.run.{run}.")
}

/// The run whose journal tree `subject` is in (`agent.run.<run>.…`); `None` for anything else.
pub fn run_of(subject: &str) -> Option<RunId> {
    let rest = subject.strip_prefix("agent.run.")?;
    let (run, _) = rest.split_once('.')?;
    run.parse().ok()
}

/// Every run's events of one type (`agent.run.*.<d|i>.<type>`): a filter across runs.
pub fn event_all_runs(event_type: EventType) -> String {
    format!(
        "agent.run.*.{}.{}",
        event_type.kind().token(),
        event_type.as_str()
    )
}

/// One filter subject that covers every run's events of all of `types`: theirs token by token,
/// `*` where they differ, `>` from where their lengths differ (e.g. `run.succeeded`,
/// `run.failed` and `run.cancelled`: `agent.run.*.d.run.*`). It may cover other types too:
/// a reader of it keeps only the types it wants. One filter, because nats-server walks its
/// whole subject index for a consumer of several, once per block it reads
/// (docs/ARCHITECTURE.md "The broker's cost per run, and the journal's stalls").
pub fn events_all_runs(types: &[EventType]) -> String {
    let subjects: Vec<String> = types.iter().map(|t| event_all_runs(*t)).collect();
    let Some((first, rest)) = subjects.split_first() else {
        return JOURNAL_ALL.to_owned();
    };
    let mut tokens: Vec<&str> = first.split('.').collect();
    for subject in rest {
        let other: Vec<&str> = subject.split('.').collect();
        if other.len() != tokens.len() {
            let common = tokens
                .iter()
                .zip(&other)
                .take_while(|(a, b)| a == b)
                .count();
            tokens.truncate(common);
            tokens.push(ANY_TAIL);
            break;
        }
        for (mine, theirs) in tokens.iter_mut().zip(&other) {
            if mine != theirs {
                *mine = ONE_TOKEN;
            }
        }
    }
    tokens.join(".")
}

/// Request subject of approval decisions for run `run` (`agent.approval.<run>`; the approval
/// service answers).
pub fn approval(run: &RunId) -> String {
    format!("agent.approval.{run}")
}

/// Every run's approval decisions (the approval service's subscription).
pub const APPROVALS_ALL: &str = "agent.approval.*";

/// The approval services' queue group.
pub const APPROVALS_QUEUE: &str = "kedge-approvals";

/// The run an approval decision's subject names (anything after `agent.approval.`, unparsed).
pub fn parse_approval(subject: &str) -> Option<&str> {
    subject.strip_prefix("agent.approval.")
}

/// Every callback (intake's subscription).
pub const CALLBACKS_ALL: &str = "agent.callback.*";

/// The intake services' queue group for callbacks.
pub const CALLBACKS_QUEUE: &str = "kedge-callbacks";

/// The key a callback's subject names (anything after `agent.callback.`, unparsed).
pub fn parse_callback(subject: &str) -> Option<&str> {
    subject.strip_prefix("agent.callback.")
}

/// Where intake sets aside a refused task of agent `agent` (in [`REJECTIONS_STREAM`]).
pub fn rejected_task(agent: &str) -> String {
    format!("agent.rejected.{agent}")
}

/// Where a journal message at stream sequence `seq` of run `run` that failed its checks is set
/// aside (in [`REJECTIONS_STREAM`]).
pub fn rejected_journal(run: &RunId, seq: u64) -> String {
    format!("agent.rejected.journal.{run}.{seq}")
}

/// Every set-aside journal message of run `run`.
pub fn rejected_journal_of(run: &RunId) -> String {
    format!("agent.rejected.journal.{run}.>")
}

/// Every set-aside journal message of every run.
pub const REJECTED_JOURNAL_ALL: &str = "agent.rejected.journal.>";

/// Everything [`REJECTIONS_STREAM`] holds (`agent.rejected.>`).
pub const REJECTED_ALL: &str = "agent.rejected.>";

/// Where intake records a callback for a key no run waits on (in [`REJECTIONS_STREAM`]).
pub const REJECTED_CALLBACK: &str = "agent.rejected.callback";

/// Every dead letter of every consumer.
pub const DEAD_LETTERS_ALL: &str = "agent.rejected.dead.>";

/// Where consumer `consumer` puts the messages it gave up on (in [`REJECTIONS_STREAM`]).
pub fn dead_letter(consumer: Durable) -> String {
    format!("agent.rejected.dead.{consumer}")
}

/// `kedge.timer.sched.<run_id>.<timer_id>`: where a timer's schedule is kept until it fires.
pub fn timer_scheduled(run: &RunId, timer: &TimerId) -> String {
    format!("kedge.timer.sched.{run}.{timer}")
}

/// `kedge.timer.fired.<run_id>.<timer_id>`: where the broker puts the timer's firing.
pub fn timer_fired(run: &RunId, timer: &TimerId) -> String {
    format!("kedge.timer.fired.{run}.{timer}")
}

/// Every pending schedule of every run (what the timer service publishes).
pub const TIMERS_SCHEDULED_ALL: &str = "kedge.timer.sched.>";

/// Every pending schedule of run `run`.
pub fn timers_scheduled_of(run: &RunId) -> String {
    format!("kedge.timer.sched.{run}.>")
}

/// Every firing of run `run`'s timers.
pub fn timers_fired_of(run: &RunId) -> String {
    format!("kedge.timer.fired.{run}.>")
}

/// Every fired timer (the `timer-fired` consumer's filter).
pub const TIMERS_FIRED_ALL: &str = "kedge.timer.fired.>";

/// The run and timer a fired subject names; `None` for anything else.
pub fn parse_timer_fired(subject: &str) -> Option<(RunId, TimerId)> {
    let rest = subject.strip_prefix("kedge.timer.fired.")?;
    let (run, timer) = rest.split_once('.')?;
    Some((run.parse().ok()?, timer.parse().ok()?))
}

/// Every tenant request the gateway serves (`kedge.t.*.>`).
pub fn gateway_requests() -> String {
    format!("{GATEWAY_PREFIX}.*.>")
}

/// The gateways' queue group.
pub const GATEWAY_QUEUE: &str = "kedge-gateway";

/// What a tenant's request subject (`kedge.t.<tenant>.<request…>`, as the broker maps it from
/// the tenant's account: [`TENANT_IMPORTS`]) asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GatewayRequest {
    Task {
        agent: AgentName,
    },
    Get {
        run: RunId,
    },
    History {
        run: RunId,
    },
    Follow {
        run: RunId,
    },
    Message {
        run: RunId,
    },
    Answer {
        run: RunId,
        question: QuestionId,
    },
    Cancel {
        run: RunId,
    },
    Callback {
        key: String,
    },
    Approve {
        approver: String,
        run: RunId,
        approval: ApprovalId,
    },
    /// `schedules.list` (`name` empty) or `schedules.<name>.<verb>`: the tenant's schedules
    /// (docs/API.md, "Schedules"). The name is unchecked here.
    Schedule {
        verb: ScheduleVerb,
        name: String,
    },
}

/// Parses `kedge.t.<tenant>.<request…>`; the reason when it is not one.
pub fn parse_gateway(subject: &str) -> Result<(TenantId, GatewayRequest), String> {
    let rest = subject
        .strip_prefix(GATEWAY_PREFIX)
        .and_then(|r| r.strip_prefix('.'))
        .ok_or("not a gateway subject")?;
    let tokens: Vec<&str> = rest.split('.').collect();
    let id = |e: crate::ids::IdError| e.to_string();
    let tenant: TenantId = tokens
        .first()
        .copied()
        .unwrap_or_default()
        .parse()
        .map_err(id)?;
    let run = |s: &str| s.parse::<RunId>().map_err(id);
    let request = match tokens.get(1..).unwrap_or_default() {
        ["task", agent] => GatewayRequest::Task {
            agent: agent.parse().map_err(id)?,
        },
        ["runs", r] => GatewayRequest::Get { run: run(r)? },
        ["runs", r, "history"] => GatewayRequest::History { run: run(r)? },
        ["runs", r, "follow"] => GatewayRequest::Follow { run: run(r)? },
        ["runs", r, "message"] => GatewayRequest::Message { run: run(r)? },
        ["runs", r, "cancel"] => GatewayRequest::Cancel { run: run(r)? },
        ["runs", r, "answer", q] => GatewayRequest::Answer {
            run: run(r)?,
            question: q.parse().map_err(id)?,
        },
        ["callback", key] => GatewayRequest::Callback {
            key: (*key).to_owned(),
        },
        ["schedules", "list"] => GatewayRequest::Schedule {
            verb: ScheduleVerb::List,
            name: String::new(),
        },
        ["schedules", name, verb] => GatewayRequest::Schedule {
            verb: ScheduleVerb::of_token(verb).ok_or("unknown schedule request")?,
            name: (*name).to_owned(),
        },
        ["approve", approver, r, a] => GatewayRequest::Approve {
            approver: (*approver).to_owned(),
            run: run(r)?,
            approval: a.parse().map_err(id)?,
        },
        _ => return Err("unknown request".into()),
    };
    Ok((tenant, request))
}

/// What a tenant's account imports from Kedge's, as (the gateway subject's tail after
/// `kedge.t.<tenant>.`, the subject the tenant publishes): a tenant publishes
/// `agent.task.<agent>`, `kedge.runs.<run>[.<verb>…]`, `kedge.callback.<key>`,
/// `kedge.schedules.…` and (an approver) `kedge.approve.<approver>.<run>.<approval>`, and the
/// broker maps each to its gateway subject.
pub const TENANT_IMPORTS: [(&str, &str); 5] = [
    ("task.*", "agent.task.*"),
    ("runs.>", "kedge.runs.>"),
    ("callback.*", "kedge.callback.*"),
    ("approve.>", "kedge.approve.>"),
    ("schedules.>", "kedge.schedules.>"),
];

/// What a tenant's user may publish: every import but approvals, which only an approver
/// publishes, under its own name ([`tenant_approvals`]).
pub fn tenant_publish() -> Vec<String> {
    TENANT_IMPORTS
        .iter()
        .filter(|(from, _)| !from.starts_with("approve."))
        .map(|(_, to)| (*to).to_owned())
        .collect()
}

/// The approvals approver `approver` of a tenant may publish.
pub fn tenant_approvals(approver: &str) -> String {
    format!("kedge.approve.{approver}.>")
}

/// The gateway subject a tenant's import `tail` (the first of a [`TENANT_IMPORTS`] pair) maps
/// to for tenant `tenant`.
pub fn gateway_import(tenant: &str, tail: &str) -> String {
    format!("{GATEWAY_PREFIX}.{tenant}.{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_filter_covers_several_types_and_is_as_narrow_as_their_subjects_allow() {
        use EventType as T;
        let terminal = [T::RunSucceeded, T::RunFailed, T::RunCancelled];
        assert_eq!(events_all_runs(&terminal), "agent.run.*.d.run.*");
        assert_eq!(
            events_all_runs(&[T::RunCreated]),
            "agent.run.*.d.run.created"
        );
        // A decision and an input differ in their kind's token.
        assert_eq!(
            events_all_runs(&[T::StepStarted, T::ToolResult]),
            "agent.run.*.*.*.*"
        );
        assert_eq!(events_all_runs(&[]), JOURNAL_ALL);
        // Whatever the types, every one of their subjects is covered.
        for types in [
            &terminal[..],
            &[T::RunCreated, T::ToolResult, T::StepCompleted],
        ] {
            let filter = events_all_runs(types);
            let run: RunId = "run_abc".parse().expect("valid");
            for t in types {
                assert!(covers(&filter, &event(&run, *t)), "{filter} {t:?}");
            }
        }
    }

    /// Whether NATS filter `filter` matches subject `subject` (`*` one token, `>` the rest).
    fn covers(filter: &str, subject: &str) -> bool {
        let (mut f, mut s) = (filter.split('.'), subject.split('.'));
        loop {
            match (f.next(), s.next()) {
                (Some(ANY_TAIL), Some(_)) => return true,
                (Some(ONE_TOKEN), Some(_)) => {}
                (Some(a), Some(b)) if a == b => {}
                (None, None) => return true,
                _ => return false,
            }
        }
    }

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
    fn inline_subjects_parse_back_and_stay_out_of_the_consumers_filters() {
        let run: RunId = "run_abc".parse().expect("valid");
        let inline: Vec<_> = EventType::ALL
            .iter()
            .filter(|t| t.may_be_inline())
            .collect();
        assert_eq!(
            inline,
            [
                &EventType::ToolRequested,
                &EventType::ToolStarted,
                &EventType::ToolResult
            ]
        );
        for t in inline {
            let s = inline_event(&run, *t);
            let parsed = parse_event(&s).expect("parses");
            assert_eq!(
                (parsed.run_id.as_str(), parsed.event_type, parsed.kind),
                ("run_abc", *t, t.kind())
            );
            assert!(parsed.inline, "{s}");
            // In the run's tree, its decision within the run's decisions; never on a filter of
            // a consumer that acts on it (the tool service's requests, the step's wakes).
            assert!(covers(&run_all(&run), &s), "{s}");
            assert_eq!(
                covers(&run_decisions(&run), &s),
                t.kind() == EventKind::Decision
            );
            assert!(!covers(&event_all_runs(*t), &s), "{s}");
            assert!(!covers(&kind_all_runs(EventKind::Input), &s), "{s}");
            assert!(covers(&inline_inputs_all_runs(), &s) || t.kind() == EventKind::Decision);
        }
        assert_eq!(
            inline_event(&run, EventType::ToolRequested),
            "agent.run.run_abc.d.inline.tool.requested"
        );
        assert_eq!(
            inline_event(&run, EventType::ToolResult),
            "agent.run.run_abc.inline.tool.result"
        );
        // Only an operation's request, start and result are ever inline, each under its kind.
        for bad in [
            "agent.run.run_abc.d.inline.run.succeeded",
            "agent.run.run_abc.inline.user.message",
            "agent.run.run_abc.d.inline.tool.result",
            "agent.run.run_abc.inline.tool.requested",
            "agent.run.run_abc.i.inline.tool.result",
        ] {
            assert_eq!(parse_event(bad), None, "{bad}");
        }
    }

    #[test]
    fn timer_subjects_parse_back() {
        let run: RunId = "run_t1".parse().expect("valid");
        let timer: TimerId = "tmr_t1_1_0".parse().expect("valid");
        assert_eq!(
            timer_scheduled(&run, &timer),
            "kedge.timer.sched.run_t1.tmr_t1_1_0"
        );
        assert_eq!(
            parse_timer_fired(&timer_fired(&run, &timer)),
            Some((run.clone(), timer.clone()))
        );
        assert_eq!(parse_timer_fired("kedge.timer.sched.run_t1.tmr_x"), None);
        assert_eq!(parse_timer_fired("kedge.timer.fired.run_t1"), None);
        assert_eq!(parse_timer_fired("kedge.timer.fired.run_t1.op_x"), None);
    }

    #[test]
    fn gateway_subjects_parse_and_every_import_reaches_the_gateway() {
        let (t, r) = parse_gateway("kedge.t.acme.task.helper").expect("task");
        assert_eq!(t.as_str(), "acme");
        assert!(matches!(r, GatewayRequest::Task { agent } if agent.as_str() == "helper"));
        let (_, r) = parse_gateway("kedge.t.acme.runs.run_x.answer.q_1").expect("answer");
        assert!(matches!(r, GatewayRequest::Answer { .. }));
        let (_, r) = parse_gateway("kedge.t.acme.approve.alice.run_x.apr_1").expect("approve");
        assert!(matches!(r, GatewayRequest::Approve { approver, .. } if approver == "alice"));
        for bad in [
            "kedge.t.acme",
            "kedge.t.acme.runs",
            "kedge.t.acme.runs.x",
            "kedge.t.acme.runs.run_x.delete",
            "kedge.t.ac*me.runs.run_x",
            "kedge.tool.resolve",
            "kedge.t.acme.approve.alice.run_x",
        ] {
            assert!(parse_gateway(bad).is_err(), "{bad}");
        }
        // Each import's gateway side is a subject the gateway's subscription covers.
        let all = gateway_requests();
        let prefix = all.trim_end_matches("*.>");
        for (tail, _) in TENANT_IMPORTS {
            assert!(gateway_import("acme", tail).starts_with(prefix), "{tail}");
        }
        assert_eq!(
            tenant_publish(),
            [
                "agent.task.*",
                "kedge.runs.>",
                "kedge.callback.*",
                "kedge.schedules.>"
            ]
        );
    }

    #[test]
    fn every_durable_is_named_once_on_its_stream() {
        for d in Durable::ALL {
            assert_eq!(Durable::named(d.name()), Some(d));
        }
        assert_eq!(Durable::named("nope"), None);
        assert_eq!(
            dead_letter(Durable::TimerFired),
            "agent.rejected.dead.timer-fired"
        );
    }

    #[test]
    fn the_broker_apis_are_spelled_as_nats_server_expects() {
        assert_eq!(
            js_durable_use(RUNS_STREAM, Durable::Step.name()),
            [
                "$JS.API.CONSUMER.CREATE.KEDGE_RUNS.step",
                "$JS.API.CONSUMER.CREATE.KEDGE_RUNS.step.>",
                "$JS.API.CONSUMER.DURABLE.CREATE.KEDGE_RUNS.step",
                "$JS.API.CONSUMER.INFO.KEDGE_RUNS.step",
                "$JS.API.CONSUMER.MSG.NEXT.KEDGE_RUNS.step",
                "$JS.ACK.KEDGE_RUNS.step.>",
            ]
        );
        assert_eq!(
            js_durable_delete(TASKS_STREAM, "intake"),
            "$JS.API.CONSUMER.DELETE.KEDGE_TASKS.intake"
        );
        assert_eq!(
            StreamApi::Purge.on(BLOBS_STREAM),
            "$JS.API.STREAM.PURGE.OBJ_kedge_blobs"
        );
        assert_eq!(StreamApi::MsgGet.on(ONE_TOKEN), "$JS.API.STREAM.MSG.GET.*");
        assert_eq!(StreamApi::Names.subject(), "$JS.API.STREAM.NAMES");
        assert_eq!(ConsumerApi::Pause.on(ANY_TAIL), "$JS.API.CONSUMER.PAUSE.>");
        assert_eq!(
            js_direct_get(ONE_TOKEN),
            ["$JS.API.DIRECT.GET.*", "$JS.API.DIRECT.GET.*.>"]
        );
        assert_eq!(
            object_writes(BLOBS_BUCKET),
            ["$O.kedge_blobs.C.>", "$O.kedge_blobs.M.>"]
        );
        assert_eq!(kv_all(LEASES_BUCKET), "$KV.kedge_leases.>");
        assert_eq!(kind_all_runs(EventKind::Decision), "agent.run.*.d.>");
        assert_eq!(kind_all_runs(EventKind::Input), "agent.run.*.i.>");
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
