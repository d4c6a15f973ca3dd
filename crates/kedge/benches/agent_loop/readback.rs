//! Reading a run back: its events with their writer stamps and the server's stored stamps, and
//! the figures derived from them (actions, the segments of a loop iteration).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use futures::StreamExt;
use kedge_core::RunStatus;
use kedge_core::event::EventType;
use kedge_core::ids::RunId;
use kedge_journal::Recorded;
use kedge_runtime::Runtime;
use time::OffsetDateTime;

use crate::K;
use crate::env::{Env, RunTiming};
use crate::measure::dt_ms;

struct Ev {
    ty: EventType,
    step: u32,
    at: OffsetDateTime,
    stored: OffsetDateTime,
}

/// The server's store time of every message of the run (batched direct get).
async fn stored_times(client: &async_nats::Client, run: &RunId) -> HashMap<u64, OffsetDateTime> {
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await.expect("subscribe");
    let body = serde_json::json!({"seq": 1, "next_by_subj": kedge_core::subjects::run_all(run),
                                  "batch": 1000});
    client
        .publish_with_reply(
            "$JS.API.DIRECT.GET.KEDGE_RUNS",
            inbox,
            body.to_string().into(),
        )
        .await
        .expect("direct get");
    let mut out = HashMap::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), sub.next())
            .await
            .expect("direct get answer")
            .expect("subscription open");
        if m.status.is_some() {
            break; // 204 end of batch (or 404)
        }
        let h = m.headers.as_ref().expect("direct get headers");
        let seq: u64 = h
            .get("Nats-Sequence")
            .and_then(|v| v.as_str().parse().ok())
            .expect("Nats-Sequence");
        let ts = h
            .get("Nats-Time-Stamp")
            .and_then(|v| {
                OffsetDateTime::parse(v.as_str(), &time::format_description::well_known::Rfc3339)
                    .ok()
            })
            .expect("Nats-Time-Stamp");
        out.insert(seq, ts);
    }
    out
}

async fn load_run(rt: &Runtime, run: &RunId) -> (Vec<Recorded>, Vec<Ev>) {
    let recorded = rt.journal.read(run, 0).await.expect("journal read");
    let stored = stored_times(&rt.client, run).await;
    let evs = recorded
        .iter()
        .map(|r| Ev {
            ty: r.envelope.event_type(),
            step: r.envelope.step.map_or(0, |s| s.get()),
            at: r.envelope.at.0,
            stored: *stored.get(&r.seq).expect("stored time of every event"),
        })
        .collect();
    (recorded, evs)
}

/// Per-run figures derived from the journal.
#[derive(Default)]
struct RunFigures {
    model_actions: Vec<f64>,
    tool_actions: Vec<f64>,
    /// run.created → run.succeeded (stamps), ms.
    journal_wall: f64,
    steps: u64,
    /// Segments of the steady-state loop iterations (steps 2..=K), by name.
    segments: BTreeMap<&'static str, Vec<f64>>,
}

pub const SEGMENTS: &[(&str, &str)] = &[
    (
        "1 wake->intent",
        "tool.result stored -> step.started stamped (step consumer wake, lease acquire, journal load, decide)",
    ),
    (
        "2 step.started append",
        "step.started stamp -> stored (1 decision)",
    ),
    (
        "3 model span",
        "step.started stored -> step.completed stamped (refresh read, model HTTP, KV put of the response)",
    ),
    (
        "4 group batch arrival",
        "step.completed stamp -> the group's last decision stored (step.completed + tool.requested, chained single appends)",
    ),
    (
        "5 commit+tool wake+claim",
        "group end stored -> tool.started stamped (tool consumer wake, op claim: KV create, cancel check)",
    ),
    ("6 tool.started append", "stamp -> stored (input)"),
    (
        "7 tool run+finish",
        "tool.started stored -> tool.result stamped (ledger append, KV update of the op record)",
    ),
    ("8 tool.result append", "stamp -> stored (input)"),
    ("= loop", "tool.result(k-1) stored -> tool.result(k) stored"),
];

fn figures(run: &RunId, recorded: &[Recorded], evs: &[Ev]) -> RunFigures {
    let state = kedge_core::fold(recorded.iter().map(|r| (r.seq, &r.envelope))).expect("folds");
    assert_eq!(
        state.status,
        RunStatus::Succeeded,
        "run {run}: {:?}",
        state.failure
    );
    let mut f = RunFigures {
        steps: u64::from(state.step.get()),
        ..Default::default()
    };
    let find = |ty: EventType, step: u32| evs.iter().find(|e| e.ty == ty && e.step == step);
    // Where a step's decision group ends: its `run.waiting`, or without one (gate
    // `wait_from_step_group`) its last decision before the step's first tool result.
    let group_end = |step: u32| {
        find(EventType::RunWaiting, step).or_else(|| {
            evs.iter()
                .filter(|e| e.step == step)
                .take_while(|e| e.ty != EventType::ToolStarted && e.ty != EventType::ToolResult)
                .filter(|e| e.ty.kind() == kedge_core::event::EventKind::Decision)
                .last()
        })
    };
    let created = evs
        .iter()
        .find(|e| e.ty == EventType::RunCreated)
        .expect("run.created");
    let succeeded = evs
        .iter()
        .find(|e| e.ty == EventType::RunSucceeded)
        .expect("run.succeeded");
    f.journal_wall = dt_ms(succeeded.at, created.at);
    let mut wake = created.at;
    for e in evs {
        match e.ty {
            EventType::StepCompleted => f.model_actions.push(dt_ms(e.at, wake)),
            EventType::ToolResult => {
                wake = e.at;
                let waiting = group_end(e.step).expect("the step's decision group");
                f.tool_actions.push(dt_ms(e.at, waiting.at));
            }
            _ => {}
        }
    }
    for k in 2..=K as u32 {
        let (Some(prev), Some(ss), Some(sc), Some(rw), Some(ts), Some(tr)) = (
            find(EventType::ToolResult, k - 1),
            find(EventType::StepStarted, k),
            find(EventType::StepCompleted, k),
            group_end(k),
            find(EventType::ToolStarted, k),
            find(EventType::ToolResult, k),
        ) else {
            continue;
        };
        let mut put = |name: &'static str, v: f64| f.segments.entry(name).or_default().push(v);
        put("1 wake->intent", dt_ms(ss.at, prev.stored));
        put("2 step.started append", dt_ms(ss.stored, ss.at));
        put("3 model span", dt_ms(sc.at, ss.stored));
        put("4 group batch arrival", dt_ms(rw.stored, sc.at));
        put("5 commit+tool wake+claim", dt_ms(ts.at, rw.stored));
        put("6 tool.started append", dt_ms(ts.stored, ts.at));
        put("7 tool run+finish", dt_ms(tr.at, ts.stored));
        put("8 tool.result append", dt_ms(tr.stored, tr.at));
        put("= loop", dt_ms(tr.stored, prev.stored));
    }
    f
}

#[derive(Default)]
pub struct Collected {
    pub model: Vec<f64>,
    pub tool: Vec<f64>,
    pub journal_wall: Vec<f64>,
    pub client_wall: Vec<f64>,
    pub submit: Vec<f64>,
    pub segments: BTreeMap<&'static str, Vec<f64>>,
    pub steps: u64,
    pub runs: usize,
}

impl Collected {
    fn add(&mut self, t: &RunTiming, f: RunFigures) {
        self.model.extend(&f.model_actions);
        self.tool.extend(&f.tool_actions);
        self.journal_wall.push(f.journal_wall);
        self.client_wall.push(t.wall);
        self.submit.push(t.submit);
        for (k, v) in f.segments {
            self.segments.entry(k).or_default().extend(v);
        }
        self.steps += f.steps;
        self.runs += 1;
    }

    pub fn merge(&mut self, other: &Collected) {
        self.model.extend(&other.model);
        self.tool.extend(&other.tool);
        self.journal_wall.extend(&other.journal_wall);
        self.client_wall.extend(&other.client_wall);
        self.submit.extend(&other.submit);
        for (k, v) in &other.segments {
            self.segments.entry(k).or_default().extend(v);
        }
        self.steps += other.steps;
        self.runs += other.runs;
    }

    pub fn actions(&self) -> Vec<f64> {
        let mut all = self.model.clone();
        all.extend(&self.tool);
        all
    }
}

pub async fn collect(env: &Env, timings: &[RunTiming], into: &mut Collected) {
    for t in timings {
        let (recorded, evs) = load_run(&env.rt, &t.run).await;
        let f = figures(&t.run, &recorded, &evs);
        into.add(t, f);
    }
}
