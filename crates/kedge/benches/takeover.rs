//! Takeover: how long a run stands still after the process driving it is killed -9, with a
//! standby replica running and the *default* configuration. Black-box: real
//! processes, observed only through the journal, the lease bucket and the mock model's counters.
//!
//! ```text
//! cargo bench -p kedge --bench takeover                          # 10 trials per scenario, cap 60 s
//! cargo bench -p kedge --bench takeover -- --trials 3 --cap 150  # a longer cap per trial
//! cargo bench -p kedge --bench takeover -- --only model,pause --trials 1 --logs /tmp/takeover --verbose
//! ```
//!
//! Options: `--trials N` (10), `--cap SECS` (60), `--only model,tool,pause`, `--pause-ms MS`
//! (3000), `--tool-kill-delay-ms MS` (500), `--settle-ms MS` (3000, after each restart and trial), `--logs DIR` (keep the `kedge`
//! processes' logs there), `--log FILTER` (their `KEDGE_LOG`, `warn`), `--verbose` (print each
//! trial's journal).
//!
//! Setup: one nats-server (kedge-testkit: free port, temporary store), the strict mock model in
//! this process, and two `kedge serve all` processes, slot a and slot b, with worker ids
//! `bench-a-<n>` / `bench-b-<n>` (n grows each time a slot is (re)started). Every `KEDGE_*`
//! variable of the bench's own environment is removed from theirs; the only configuration is a
//! JSON file (`KEDGE_CONFIG`) adding `sh` and `sleep` to `shell_allowlist`, plus the model key
//! variable. No timeout is overridden. Each trial uses its own agent and mock model name.
//!
//! Scenarios (each trial, one run):
//!
//! - **model**: the model answers step 1 with a `list_files` call, then *hangs* on step 2 (its
//!   first call only; `fail_times: 1`). Once the mock holds that call and the journal has its
//!   `step.started`, the bench kills -9 the process whose worker id is the writer of that
//!   `step.started` (the `<worker>-<revision>` at the end of the decision's `Nats-Msg-Id`; the
//!   lease owner in `kedge_leases` when that names no worker of ours).
//! - **tool**: the model calls `shell` `sh -c "sleep 3 && echo ran >> effects.log"` (an effect
//!   that takes 3 s; the sandbox should die with its runner). Once `tool.started` is journaled and
//!   `--tool-kill-delay-ms` (500) more have passed, so that the command is running, the bench
//!   kills -9 the process named by its `runner`. A `shell` command has no confirm query, so the
//!   standby is expected to journal `outcome.ambiguous`; the bench then resolves it at once as the
//!   operator would, from the effect it can see (`effects.log` has the line: `completed`, else
//!   `retry`). kill→done therefore includes a re-run of the 3 s command and that resolution.
//! - **pause** (false takeover): the model takes `pause + 2 s` to answer the only step. Once its
//!   `step.started` is journaled the bench SIGSTOPs the writer's process for `--pause-ms` (3 s),
//!   then SIGCONTs it. A false takeover is any of: a decision of the run written after the stop by
//!   another writer, another owner in `kedge_leases` for the run at any sample until the run ends,
//!   or a second model call.
//!
//! Measured per kill: **kill→next**, from the instant of `kill -9` to the first event appended to
//! the run's journal after the killed process was reaped (whatever it is: the standby's
//! `step.started`, a reused response's `step.completed`, `outcome.*`, `tool.started`,
//! `tool.result` …; its type and writer are printed), and **kill→done**, to the run's terminal
//! event. The journal is read when a message arrives on `agent.run.<id>.>` (or every 50 ms), so
//! the figures carry a few ms of observation delay. A trial that does not progress within
//! `--cap` seconds counts as the cap and is flagged `TIMEOUT`; the bench never waits longer.
//!
//! Checks per trial: the run succeeded; **repeated model answers** = answers the mock gave for
//! the run (calls minus the one hung call of the model scenario) minus the `step.completed`
//! events that did not reuse a stored response: an answer paid for and thrown away; for the tool
//! scenario, **effects** = lines in the run's `effects.log` (1 expected), also counted right
//! after the kill and when the operator looks: an effect appearing in between is the killed
//! runner's command finishing after kill -9.
//!
//! After each kill the killed slot is restarted (new worker id) and given `--settle-ms` before
//! the next trial, so every trial starts with an active process and a standby.

#![allow(clippy::unwrap_used)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "support/mod.rs"]
mod support;

use futures::StreamExt;
use kedge_app::tasks::{Answer, Submission};
use kedge_core::agent::AgentDefinition;
use kedge_core::event::{OutcomeResolved, Resolution, Timestamp};
use kedge_core::fold::OpStatus;
use kedge_core::task::TaskSubmission;
use kedge_core::{Draft, Event, RunId, RunState, RunStatus};
use kedge_journal::Recorded;
use kedge_mock_llm::{MockHandle, Scripts};
use kedge_runtime::{Config, Runtime};
use kedge_testkit::NatsServer;
use serde_json::json;

const KEY_VAR: &str = "KEDGE_BENCH_API_KEY";
const LEASES: &str = "kedge_leases";
const TOOL_SECS: u64 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Model,
    Tool,
    Pause,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Model => "model",
            Scenario::Tool => "tool",
            Scenario::Pause => "pause",
        }
    }
}

struct Opts {
    trials: usize,
    cap: Duration,
    pause: Duration,
    tool_kill_delay: Duration,
    settle: Duration,
    only: Vec<Scenario>,
    logs: Option<PathBuf>,
    log_filter: String,
    verbose: bool,
}

fn opts() -> Opts {
    let mut o = Opts {
        trials: 10,
        cap: Duration::from_secs(60),
        pause: Duration::from_secs(3),
        tool_kill_delay: Duration::from_millis(500),
        settle: Duration::from_secs(3),
        only: vec![Scenario::Model, Scenario::Tool, Scenario::Pause],
        logs: None,
        log_filter: "warn".into(),
        verbose: false,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    let value = |i: usize| -> &str {
        args.get(i)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("{} needs a value", args[i - 1]))
    };
    while i < args.len() {
        match args[i].as_str() {
            "--trials" => {
                i += 1;
                o.trials = value(i).parse().expect("--trials N");
            }
            "--cap" => {
                i += 1;
                o.cap = Duration::from_secs_f64(value(i).parse().expect("--cap SECS"));
            }
            "--tool-kill-delay-ms" => {
                i += 1;
                o.tool_kill_delay =
                    Duration::from_millis(value(i).parse().expect("--tool-kill-delay-ms MS"));
            }
            "--pause-ms" => {
                i += 1;
                o.pause = Duration::from_millis(value(i).parse().expect("--pause-ms MS"));
            }
            "--settle-ms" => {
                i += 1;
                o.settle = Duration::from_millis(value(i).parse().expect("--settle-ms MS"));
            }
            "--only" => {
                i += 1;
                o.only = value(i)
                    .split(',')
                    .map(|s| match s.trim() {
                        "model" => Scenario::Model,
                        "tool" => Scenario::Tool,
                        "pause" => Scenario::Pause,
                        other => panic!("unknown scenario `{other}` (model, tool, pause)"),
                    })
                    .collect();
            }
            "--logs" => {
                i += 1;
                o.logs = Some(PathBuf::from(value(i)));
            }
            "--log" => {
                i += 1;
                o.log_filter = value(i).to_owned();
            }
            "--verbose" => o.verbose = true,
            // cargo bench passes --bench; ignore what we do not know.
            _ => {}
        }
        i += 1;
    }
    o
}

// ---------------------------------------------------------------------------------------------
// The two `kedge serve all` processes

/// A `kedge serve all` process this bench spawned; killed (by its pid) when dropped.
struct Worker {
    id: String,
    child: Child,
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SIGKILL also ends a stopped process.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Fleet {
    nats_url: String,
    workspace: PathBuf,
    config_file: PathBuf,
    log_dir: PathBuf,
    log_filter: String,
    slots: [Option<Worker>; 2],
    generation: [u32; 2],
}

impl Fleet {
    fn spawn(&mut self, slot: usize) {
        self.generation[slot] += 1;
        let id = format!("bench-{}-{}", ["a", "b"][slot], self.generation[slot]);
        let log = std::fs::File::create(self.log_dir.join(format!("{id}.log"))).unwrap();
        // The default configuration: nothing of the bench's own environment leaks in.
        let mut cmd = support::kedge_command(&["serve", "all"]);
        cmd.env("KEDGE_CONFIG", &self.config_file)
            .env("KEDGE_NATS_URL", &self.nats_url)
            .env("KEDGE_WORKER_ID", &id)
            .env("KEDGE_WORKSPACE_ROOT", &self.workspace)
            .env("KEDGE_MODEL_KEYS", KEY_VAR)
            .env(KEY_VAR, "bench-key")
            .env("KEDGE_LOG", &self.log_filter)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        let child = cmd.spawn().expect("spawn kedge serve all");
        self.slots[slot] = Some(Worker { id, child });
    }

    fn id(&self, slot: usize) -> String {
        self.slots[slot]
            .as_ref()
            .map_or_else(|| "-".into(), |w| w.id.clone())
    }

    /// The slot whose worker id `name` is, or starts (a writer is `<worker>-<revision>`).
    fn slot_of(&self, name: &str) -> Option<usize> {
        (0..2).find(|&s| {
            self.slots[s].as_ref().is_some_and(|w| {
                name.strip_prefix(w.id.as_str())
                    .is_some_and(|rest| !rest.starts_with(|c: char| c.is_ascii_alphanumeric()))
            })
        })
    }

    /// kill -9 by pid; returns the instant of the signal.
    fn kill9(&mut self, slot: usize) -> Instant {
        let mut w = self.slots[slot].take().expect("a live worker");
        let at = Instant::now();
        let _ = w.child.kill();
        let _ = w.child.wait();
        at
    }

    fn signal(&self, slot: usize, sig: &str) {
        let pid = self.slots[slot].as_ref().expect("a live worker").child.id();
        let ok = Command::new("kill")
            .args(["-s", sig, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -s {sig} {pid}");
    }

    /// Restarts any slot whose process is gone; returns the slots restarted.
    fn ensure_alive(&mut self) -> Vec<String> {
        let mut restarted = Vec::new();
        for slot in 0..2 {
            let dead = match &mut self.slots[slot] {
                None => true,
                Some(w) => !matches!(w.child.try_wait(), Ok(None)),
            };
            if dead {
                let old = self.id(slot);
                self.slots[slot] = None;
                self.spawn(slot);
                restarted.push(format!("{old} -> {}", self.id(slot)));
            }
        }
        restarted
    }

    fn log_tail(&self, lines: usize) -> String {
        let mut out = String::new();
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.log_dir)
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        files.sort();
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            let from = all.len().saturating_sub(lines);
            if all.is_empty() {
                continue;
            }
            let _ = writeln!(
                out,
                "  --- {} (last {} lines)",
                f.display(),
                all.len() - from
            );
            for l in &all[from..] {
                let _ = writeln!(out, "  {l}");
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Following a run's journal

/// The writer of a decision: the last field of its `Nats-Msg-Id` `d:<run>:<expected>:<i>:<writer>`.
fn writer(r: &Recorded) -> Option<String> {
    let id = r.msg_id.as_deref()?;
    let rest = id.strip_prefix("d:")?;
    rest.splitn(4, ':').nth(3).map(str::to_owned)
}

/// Who wrote an event, as far as it says: a decision's writer, a `tool.started`'s runner.
fn author(r: &Recorded) -> String {
    match &r.envelope.event {
        Event::ToolStarted(t) => format!("runner {}", t.runner),
        _ => writer(r).map_or_else(|| "input".into(), |w| format!("writer {w}")),
    }
}

struct Follow {
    rt: Arc<Runtime>,
    run: RunId,
    sub: async_nats::Subscriber,
    events: Vec<Recorded>,
    /// When the bench first saw each event.
    seen: Vec<Instant>,
    /// The kill (or stop): journal listings show times relative to it.
    origin: Option<Instant>,
}

impl Follow {
    async fn start(rt: &Arc<Runtime>, run: RunId) -> Follow {
        let sub = rt
            .client
            .subscribe(format!("agent.run.{run}.>"))
            .await
            .unwrap();
        let mut f = Follow {
            rt: rt.clone(),
            run,
            sub,
            events: Vec::new(),
            seen: Vec::new(),
            origin: None,
        };
        f.refresh().await;
        f
    }

    fn last_seq(&self) -> u64 {
        self.events.last().map_or(0, |r| r.seq)
    }

    async fn refresh(&mut self) -> usize {
        match self.rt.journal.read(&self.run, self.last_seq()).await {
            Ok(new) => {
                let n = new.len();
                self.events.extend(new);
                self.seen.resize(self.events.len(), Instant::now());
                n
            }
            Err(e) => {
                eprintln!("journal read failed: {e}");
                0
            }
        }
    }

    fn state(&self) -> Option<RunState> {
        if self.events.is_empty() {
            return None;
        }
        kedge_core::fold(self.events.iter().map(|r| (r.seq, &r.envelope))).ok()
    }

    /// Reads the journal until `check` answers (then: its answer and the instant it was seen)
    /// or `deadline` passes. Reads when a message arrives on the run's subjects, else every 50 ms.
    async fn until<T>(
        &mut self,
        deadline: Instant,
        mut check: impl FnMut(&Follow) -> Option<T>,
    ) -> Option<(T, Instant)> {
        let mut fast = 0u32;
        loop {
            let new = self.refresh().await;
            if let Some(t) = check(self) {
                return Some((t, Instant::now()));
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            if new > 0 {
                fast = 0;
            }
            if fast > 0 {
                // A message arrived that the stream did not show yet: look again soon.
                fast -= 1;
                tokio::time::sleep(Duration::from_millis(3)).await;
                continue;
            }
            let wait = (deadline - now).min(Duration::from_millis(50));
            if let Ok(Some(_)) = tokio::time::timeout(wait, self.sub.next()).await {
                // Drain what else arrived at once.
                while let Ok(Some(_)) =
                    tokio::time::timeout(Duration::from_millis(1), self.sub.next()).await
                {
                }
                fast = 10;
            }
        }
    }
}

fn count(events: &[Recorded], pred: impl Fn(&Event) -> bool) -> usize {
    events.iter().filter(|r| pred(&r.envelope.event)).count()
}

async fn lease_owner(rt: &Runtime, run: &RunId) -> Option<String> {
    let kv = rt.js.get_key_value(LEASES).await.ok()?;
    let value = kv.get(run.as_str()).await.ok()??;
    let v: serde_json::Value = serde_json::from_slice(&value).ok()?;
    v.get("owner")?.as_str().map(str::to_owned)
}

// ---------------------------------------------------------------------------------------------
// Trials

#[derive(Debug, Default)]
struct Trial {
    killed: String,
    /// kill → next event (or the cap), and whether it timed out.
    next: Option<(Duration, bool)>,
    next_event: String,
    done: Option<(Duration, bool)>,
    status: String,
    repeated_answers: i64,
    reused: usize,
    effects: Option<usize>,
    /// Effects right after the kill, and when the operator first looked (before any re-run).
    effects_at_kill: Option<usize>,
    effects_seen: Option<usize>,
    resolutions: usize,
    false_takeover: Option<String>,
    notes: Vec<String>,
    journal: String,
}

struct Bench {
    o: Opts,
    rt: Arc<Runtime>,
    mock: MockHandle,
    fleet: Fleet,
}

impl Bench {
    fn model_calls(&self, model: &str) -> u64 {
        self.mock.calls().by_model.get(model).copied().unwrap_or(0)
    }

    async fn start_run(
        &self,
        scenario: Scenario,
        trial: usize,
        steps: serde_json::Value,
    ) -> (RunId, String) {
        let model = format!("{}-{trial}", scenario.name());
        let agent = format!("takeover-{}-{trial}", scenario.name());
        self.mock.set_scripts(
            Scripts::from_value(json!({"models": {model.clone(): {"steps": steps}}})).unwrap(),
        );
        let tool = |n: &str| json!({"name": n, "description": n, "parameters": {"type": "object", "properties": {}}});
        let def = json!({
            "name": agent,
            "system_prompt": "takeover bench",
            "model": {"provider": "openai", "name": model, "base_url": format!("{}/v1", self.mock.base_url())},
            "api_key_env": KEY_VAR,
            "tools": [tool("shell"), tool("list_files")],
            "budget": {"max_steps": 10, "max_tokens": 1000000, "max_attempts_per_step": 3}
        });
        let def = AgentDefinition::parse(def.to_string().as_bytes()).unwrap();
        self.rt.agents.put(&def).await.unwrap();
        let task = TaskSubmission::new(agent.parse().unwrap(), "go");
        let key = format!(
            "takeover-{}-{trial}-{}",
            scenario.name(),
            std::process::id()
        );
        let submission = Submission {
            task: &task,
            key: &key,
            tenant: "acme",
            caller: Some("bench"),
        };
        match kedge_app::tasks::submit(&self.rt.client, &submission, Duration::from_secs(20))
            .await
            .expect("intake answered")
        {
            Answer::Accepted { run_id } => (run_id, model),
            Answer::Rejected { error } => panic!("task rejected: {error:?}"),
        }
    }

    /// Waits for the run's end, resolving ambiguous operations as the operator would.
    async fn finish(&self, f: &mut Follow, deadline: Instant, t: &mut Trial) -> Option<Instant> {
        loop {
            let seen = f
                .until(deadline, |f| {
                    let s = f.state()?;
                    if s.status.is_terminal() {
                        return Some(None);
                    }
                    s.ops
                        .iter()
                        .find(|(_, op)| matches!(op.status, OpStatus::Ambiguous { .. }))
                        .map(|(id, _)| Some(id.clone()))
                })
                .await;
            match seen {
                None => return None,
                Some((None, at)) => return Some(at),
                Some((Some(op), _)) => {
                    // The operator looks at the effect: the line is there, or it did not happen.
                    let effects = effects(&self.fleet.workspace, &f.run);
                    t.effects_seen.get_or_insert(effects);
                    let resolution = if effects > 0 {
                        Resolution::Completed {
                            content: "ran".into(),
                        }
                    } else {
                        Resolution::Retry
                    };
                    let mut draft =
                        Draft::new(kedge_core::Input::OutcomeResolved(OutcomeResolved {
                            resolution,
                            by: "bench-operator".into(),
                        }));
                    draft.op = Some(op.clone());
                    let input =
                        kedge_core::InputEnvelope::new(f.run.clone(), Timestamp::now(), draft);
                    let key = kedge_core::ids::InputId::arbitrary(format!(
                        "bench-resolve-{op}-{}",
                        t.resolutions
                    ));
                    self.rt.journal.append_input(&key, &input).await.unwrap();
                    t.resolutions += 1;
                    // Wait until the resolution is folded before looking again.
                    let _ = f
                        .until(deadline, |f| {
                            f.state().filter(|s| {
                                s.ops
                                    .get(&op)
                                    .is_none_or(|o| !matches!(o.status, OpStatus::Ambiguous { .. }))
                            })
                        })
                        .await;
                }
            }
        }
    }

    /// The common end of a kill trial: next event, completion, checks, restart.
    async fn after_kill(
        &mut self,
        f: &mut Follow,
        slot: usize,
        killed_at: Instant,
        model: &str,
        hung_calls: u64,
        t: &mut Trial,
    ) {
        let cap = self.o.cap;
        let deadline = killed_at + cap;
        f.origin = Some(killed_at);
        f.refresh().await;
        let base = f.last_seq();
        match f
            .until(deadline, |f| {
                f.events
                    .iter()
                    .find(|r| r.seq > base)
                    .map(|r| format!("{} ({})", r.envelope.event_type(), author(r)))
            })
            .await
        {
            Some((what, at)) => {
                t.next = Some((at - killed_at, false));
                t.next_event = what;
                match self.finish(f, deadline, t).await {
                    Some(at) => t.done = Some((at - killed_at, false)),
                    None => t.done = Some((cap, true)),
                }
            }
            None => {
                t.next = Some((cap, true));
                t.done = Some((cap, true));
                t.next_event = "-".into();
            }
        }
        let state = f.state();
        t.status = state
            .as_ref()
            .map_or_else(|| "?".into(), |s| s.status.to_string());
        t.journal = journal_text(f);
        let completed = count(
            &f.events,
            |e| matches!(e, Event::StepCompleted(c) if !c.reused),
        );
        t.reused = count(
            &f.events,
            |e| matches!(e, Event::StepCompleted(c) if c.reused),
        );
        let given = self.model_calls(model).saturating_sub(hung_calls);
        t.repeated_answers = given as i64 - completed as i64;
        if t.next.is_some_and(|(_, timed_out)| timed_out) {
            t.notes.push(format!(
                "no event within {cap:?} of the kill; journal:\n{}\n{}",
                journal_text(f),
                self.fleet.log_tail(15)
            ));
        }
        // Restart the killed slot so the next trial again has an active process and a standby.
        self.fleet.spawn(slot);
    }

    async fn model_trial(&mut self, trial: usize) -> Trial {
        let mut t = Trial::default();
        let steps = json!([
            {"text": "looking", "tool_calls": [{"name": "list_files", "arguments": {}}]},
            {"text": "done", "hang": true, "fail_times": 1}
        ]);
        let (run, model) = self.start_run(Scenario::Model, trial, steps).await;
        let mut f = Follow::start(&self.rt, run.clone()).await;
        let deadline = Instant::now() + self.o.cap;
        let mock = self.mock.mock().clone();
        let m = model.clone();
        let point = f
            .until(deadline, |f| {
                let started: Vec<&Recorded> = f
                    .events
                    .iter()
                    .filter(|r| matches!(r.envelope.event, Event::StepStarted(_)))
                    .collect();
                let calls = mock.calls().by_model.get(&m).copied().unwrap_or(0);
                (started.len() >= 2 && calls >= 2).then(|| writer(started[started.len() - 1]))
            })
            .await;
        let Some((w, _)) = point else {
            t.notes.push(format!(
                "the run never reached step 2's model call; journal:\n{}",
                journal_text(&f)
            ));
            t.status = "no kill point".into();
            return t;
        };
        let slot = self.holder(w.as_deref(), &run, &mut t).await;
        let Some(slot) = slot else {
            t.status = "no holder".into();
            return t;
        };
        t.killed = self.fleet.id(slot);
        let at = self.fleet.kill9(slot);
        self.after_kill(&mut f, slot, at, &model, 1, &mut t).await;
        t
    }

    async fn tool_trial(&mut self, trial: usize) -> Trial {
        let mut t = Trial::default();
        let steps = json!([
            {"text": "working", "tool_calls": [{"name": "shell", "arguments": {
                "command": "sh", "args": ["-c", format!("sleep {TOOL_SECS} && echo ran >> effects.log")]}}]},
            {"text": "done"}
        ]);
        let (run, model) = self.start_run(Scenario::Tool, trial, steps).await;
        let mut f = Follow::start(&self.rt, run.clone()).await;
        let deadline = Instant::now() + self.o.cap;
        let point = f
            .until(deadline, |f| {
                f.events.iter().find_map(|r| match &r.envelope.event {
                    Event::ToolStarted(s) => Some(s.runner.clone()),
                    _ => None,
                })
            })
            .await;
        let Some((runner, _)) = point else {
            t.notes.push(format!(
                "the run never journaled tool.started; journal:\n{}",
                journal_text(&f)
            ));
            t.status = "no kill point".into();
            return t;
        };
        let Some(slot) = self.fleet.slot_of(&runner) else {
            t.notes
                .push(format!("runner `{runner}` is none of our workers"));
            t.status = "no holder".into();
            return t;
        };
        t.killed = self.fleet.id(slot);
        // Into the command itself rather than the sandbox's start (`--tool-kill-delay-ms 0`
        // kills while bwrap may still be setting up).
        tokio::time::sleep(self.o.tool_kill_delay).await;
        let at = self.fleet.kill9(slot);
        t.effects_at_kill = Some(effects(&self.fleet.workspace, &run));
        self.after_kill(&mut f, slot, at, &model, 0, &mut t).await;
        // Let a late effect (a runner that outlived its process) show before counting.
        tokio::time::sleep(Duration::from_millis(200)).await;
        t.effects = Some(effects(&self.fleet.workspace, &run));
        if let (Some(a), Some(b)) = (t.effects_at_kill, t.effects_seen)
            && b > a
        {
            t.notes.push(format!(
                "the killed runner's command took effect after kill -9 ({a} effect(s) at the \
                 kill, {b} when the operator looked): its sandbox outlived it"
            ));
        }
        t
    }

    async fn pause_trial(&mut self, trial: usize) -> Trial {
        let mut t = Trial::default();
        let pause = self.o.pause;
        let answer_after = pause + Duration::from_secs(2);
        let steps = json!([{"text": "done", "delay_ms": answer_after.as_millis() as u64}]);
        let (run, model) = self.start_run(Scenario::Pause, trial, steps).await;
        let mut f = Follow::start(&self.rt, run.clone()).await;
        let deadline = Instant::now() + self.o.cap;
        let mock = self.mock.mock().clone();
        let m = model.clone();
        let point = f
            .until(deadline, |f| {
                let started = f
                    .events
                    .iter()
                    .rfind(|r| matches!(r.envelope.event, Event::StepStarted(_)))?;
                let calls = mock.calls().by_model.get(&m).copied().unwrap_or(0);
                (calls >= 1).then(|| writer(started))
            })
            .await;
        let Some((w, _)) = point else {
            t.status = "no kill point".into();
            t.notes.push(journal_text(&f));
            return t;
        };
        let Some(slot) = self.holder(w.as_deref(), &run, &mut t).await else {
            t.status = "no holder".into();
            return t;
        };
        let paused = self.fleet.id(slot);
        t.killed = paused.clone();
        let base = f.last_seq();
        self.fleet.signal(slot, "STOP");
        let stopped_at = Instant::now();
        f.origin = Some(stopped_at);
        let mut owners: Vec<String> = Vec::new();
        while stopped_at.elapsed() < pause {
            if let Some(o) = lease_owner(&self.rt, &run).await {
                owners.push(o);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.fleet.signal(slot, "CONT");
        let resumed = Instant::now();
        let deadline = resumed + self.o.cap;
        let rt = self.rt.clone();
        let r2 = run.clone();
        // Until the end: sample the lease owner too.
        let done = loop {
            let step = Duration::from_millis(100);
            let seen = f
                .until((Instant::now() + step).min(deadline), |f| {
                    f.state().filter(|s| s.status.is_terminal()).map(|_| ())
                })
                .await;
            if let Some((_, at)) = seen {
                break Some(at);
            }
            if let Some(o) = lease_owner(&rt, &r2).await {
                owners.push(o);
            }
            if Instant::now() >= deadline {
                break None;
            }
        };
        t.done = Some(done.map_or((self.o.cap, true), |at| (at - stopped_at, false)));
        let state = f.state();
        t.status = state
            .as_ref()
            .map_or_else(|| "?".into(), |s| s.status.to_string());
        t.journal = journal_text(&f);
        let mut why = Vec::new();
        for r in f.events.iter().filter(|r| r.seq > base) {
            if let Some(w) = writer(r)
                && self.fleet.slot_of(&w) != Some(slot)
                && w != "intake"
            {
                why.push(format!("{} by {w}", r.envelope.event_type()));
            }
        }
        if let Some(o) = owners.iter().find(|o| **o != paused) {
            why.push(format!("lease owner {o}"));
        }
        let calls = self.model_calls(&model);
        if calls > 1 {
            why.push(format!("{calls} model calls"));
        }
        let completed = count(
            &f.events,
            |e| matches!(e, Event::StepCompleted(c) if !c.reused),
        );
        t.reused = count(
            &f.events,
            |e| matches!(e, Event::StepCompleted(c) if c.reused),
        );
        t.repeated_answers = calls as i64 - completed as i64;
        t.false_takeover = Some(if why.is_empty() {
            "no".into()
        } else {
            format!("YES: {}", why.join(", "))
        });
        t
    }

    /// The slot holding the run: from the writer of its `step.started`, else the lease owner.
    async fn holder(&self, writer: Option<&str>, run: &RunId, t: &mut Trial) -> Option<usize> {
        let by_writer = writer.and_then(|w| self.fleet.slot_of(w));
        let owner = lease_owner(&self.rt, run).await;
        let by_lease = owner.as_deref().and_then(|o| self.fleet.slot_of(o));
        if let (Some(a), Some(b)) = (by_writer, by_lease)
            && a != b
        {
            t.notes.push(format!(
                "writer {writer:?} and lease owner {owner:?} disagree; killing the writer's"
            ));
        }
        let slot = by_writer.or(by_lease);
        if slot.is_none() {
            t.notes.push(format!(
                "neither the writer {writer:?} nor the lease owner {owner:?} is one of ours"
            ));
        }
        slot
    }
}

fn effects(workspace: &Path, run: &RunId) -> usize {
    std::fs::read_to_string(workspace.join(run.as_str()).join("effects.log"))
        .map_or(0, |s| s.lines().count())
}

fn journal_text(f: &Follow) -> String {
    f.events
        .iter()
        .zip(&f.seen)
        .map(|(r, seen)| {
            let at = f.origin.map_or_else(String::new, |o| {
                if *seen >= o {
                    format!("+{:.3}s ", (*seen - o).as_secs_f64())
                } else {
                    format!("-{:.3}s ", (o - *seen).as_secs_f64())
                }
            });
            format!(
                "    {at}{} {} ({}) {}",
                r.seq,
                r.envelope.event_type(),
                author(r),
                r.envelope.event.data_json()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

// ---------------------------------------------------------------------------------------------
// Report

fn secs(d: Duration, timed_out: bool) -> String {
    if timed_out {
        format!("≥{:.2} s TIMEOUT", d.as_secs_f64())
    } else {
        format!("{:.3} s", d.as_secs_f64())
    }
}

/// p50, p90 and max (nearest rank) of the figures, and how many timed out.
fn summary(values: &[(Duration, bool)]) -> String {
    if values.is_empty() {
        return "- | - | -".into();
    }
    let mut v: Vec<f64> = values.iter().map(|(d, _)| d.as_secs_f64()).collect();
    v.sort_by(f64::total_cmp);
    let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    let timeouts = values.iter().filter(|(_, t)| *t).count();
    let flag = if timeouts > 0 { " ⚑" } else { "" };
    format!(
        "{:.3} | {:.3} | {:.3}{flag}",
        rank(0.5),
        rank(0.9),
        v[v.len() - 1]
    )
}

fn print_trial(scenario: Scenario, i: usize, t: &Trial, verbose: bool) {
    let mut line = format!("{:<6} #{i:<3} {:<12}", scenario.name(), t.killed);
    match scenario {
        Scenario::Pause => {
            let _ = write!(
                line,
                " stop→done {:<16} {:<10} repeated answers {} false takeover: {}",
                t.done.map_or("-".into(), |(d, to)| secs(d, to)),
                t.status,
                t.repeated_answers,
                t.false_takeover.as_deref().unwrap_or("-"),
            );
        }
        _ => {
            let _ = write!(
                line,
                " kill→next {:<16} kill→done {:<16} {:<10} next: {} | repeated answers {}, reused {}",
                t.next.map_or("-".into(), |(d, to)| secs(d, to)),
                t.done.map_or("-".into(), |(d, to)| secs(d, to)),
                t.status,
                t.next_event,
                t.repeated_answers,
                t.reused,
            );
            if let Some(e) = t.effects {
                let _ = write!(
                    line,
                    ", effects {e} (at kill {}, seen by the operator {}), operator resolutions {}",
                    t.effects_at_kill.map_or("-".into(), |v| v.to_string()),
                    t.effects_seen.map_or("-".into(), |v| v.to_string()),
                    t.resolutions
                );
            }
        }
    }
    println!("{line}");
    for n in &t.notes {
        println!("    note: {n}");
    }
    if verbose {
        println!("    journal (seq type (author) data):\n{}", t.journal);
    }
}

fn main() {
    let o = opts();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(bench(o));
}

async fn bench(o: Opts) {
    let server = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let log_dir = o.logs.clone().unwrap_or_else(|| dir.path().join("logs"));
    std::fs::create_dir_all(&log_dir).unwrap();
    let workspace = dir.path().join("ws");
    std::fs::create_dir_all(&workspace).unwrap();
    let config_file = dir.path().join("kedge.json");
    let mut allow: Vec<String> = Config::default().shell_allowlist;
    allow.extend(["sh".to_owned(), "sleep".to_owned()]);
    std::fs::write(&config_file, json!({"shell_allowlist": allow}).to_string()).unwrap();
    let config = Config {
        nats_urls: vec![server.url()],
        workspace_root: workspace.clone(),
        worker_id: "bench-observer".parse().expect("worker id"),
        ..Config::default()
    };
    let rt = Arc::new(Runtime::connect(config).await.unwrap());
    let mock = MockHandle::start(Scripts::default()).await;
    let t = &Config::default().timeouts;
    println!(
        "takeover bench: {} trial(s) per scenario {:?}, cap {:?}, pause {:?}; default timeouts \
         (lease ttl {} ms, step ack wait {} ms, tool ack wait {} ms); logs in {}",
        o.trials,
        o.only.iter().map(|s| s.name()).collect::<Vec<_>>(),
        o.cap,
        o.pause,
        t.lease_ttl_ms,
        t.step_ack_wait_ms,
        t.tool_ack_wait_ms,
        log_dir.display()
    );
    let fleet = Fleet {
        nats_url: server.url(),
        workspace,
        config_file,
        log_dir,
        log_filter: o.log_filter.clone(),
        slots: [None, None],
        generation: [0, 0],
    };
    let mut b = Bench { o, rt, mock, fleet };
    b.fleet.spawn(0);
    b.fleet.spawn(1);
    tokio::time::sleep(b.o.settle).await;
    warm_up(&b).await;

    let mut results: Vec<(Scenario, Vec<Trial>)> = Vec::new();
    for scenario in b.o.only.clone() {
        let mut trials = Vec::new();
        for i in 1..=b.o.trials {
            let restarted = b.fleet.ensure_alive();
            if !restarted.is_empty() {
                println!("  (restarted dead workers: {})", restarted.join(", "));
                tokio::time::sleep(b.o.settle).await;
            }
            let t = match scenario {
                Scenario::Model => b.model_trial(i).await,
                Scenario::Tool => b.tool_trial(i).await,
                Scenario::Pause => b.pause_trial(i).await,
            };
            print_trial(scenario, i, &t, b.o.verbose);
            trials.push(t);
            tokio::time::sleep(b.o.settle).await;
        }
        results.push((scenario, trials));
    }

    println!();
    println!(
        "| kill point | trials | kill→next p50 (s) | p90 | max | kill→done p50 (s) | p90 | max | succeeded | timeouts | repeated model answers | effects |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
    for (scenario, trials) in &results {
        if *scenario == Scenario::Pause {
            continue;
        }
        let next: Vec<(Duration, bool)> = trials.iter().filter_map(|t| t.next).collect();
        let done: Vec<(Duration, bool)> = trials.iter().filter_map(|t| t.done).collect();
        let ok = trials.iter().filter(|t| t.status == "succeeded").count();
        let timeouts = trials
            .iter()
            .filter(|t| t.done.is_some_and(|(_, to)| to))
            .count();
        let repeated: i64 = trials.iter().map(|t| t.repeated_answers).sum();
        let effects = if *scenario == Scenario::Tool {
            let e: Vec<String> = trials
                .iter()
                .map(|t| t.effects.map_or("-".into(), |e| e.to_string()))
                .collect();
            format!("per run: {}", e.join(","))
        } else {
            "-".into()
        };
        println!(
            "| {} | {} | {} | {} | {ok} / {} | {timeouts} | {repeated} | {effects} |",
            scenario.name(),
            trials.len(),
            summary(&next),
            summary(&done),
            trials.len(),
        );
    }
    for (scenario, trials) in &results {
        if *scenario != Scenario::Pause {
            continue;
        }
        let n = trials.iter().filter(|t| t.false_takeover.is_some()).count();
        let k = trials
            .iter()
            .filter(|t| t.false_takeover.as_deref().is_some_and(|s| s != "no"))
            .count();
        let ok = trials.iter().filter(|t| t.status == "succeeded").count();
        let done: Vec<(Duration, bool)> = trials.iter().filter_map(|t| t.done).collect();
        println!(
            "\npause {:?} mid model call: false takeovers: {k} / {n}; succeeded {ok} / {}; \
             stop→done p50 / p90 / max (s): {}; repeated model answers {}",
            b.o.pause,
            trials.len(),
            summary(&done),
            trials.iter().map(|t| t.repeated_answers).sum::<i64>()
        );
    }
    println!(
        "\n(⚑: a trial hit the cap and counts as the cap. kill→next: kill -9 to the first event \
         journaled after it; kill→done: to the run's terminal event.)"
    );
}

/// One run through the fleet before measuring: both processes are up and serving.
async fn warm_up(b: &Bench) {
    b.mock.set_scripts(
        Scripts::from_value(json!({"models": {"warm": {"default": {"text": "ok"}}}})).unwrap(),
    );
    let def = json!({
        "name": "takeover-warm",
        "system_prompt": "warm up",
        "model": {"provider": "openai", "name": "warm", "base_url": format!("{}/v1", b.mock.base_url())},
        "api_key_env": KEY_VAR,
        "budget": {"max_steps": 10, "max_tokens": 1000000, "max_attempts_per_step": 3}
    });
    b.rt.agents
        .put(&AgentDefinition::parse(def.to_string().as_bytes()).unwrap())
        .await
        .unwrap();
    for i in 0..2 {
        let task = TaskSubmission::new("takeover-warm".parse().unwrap(), "hi");
        let key = format!("warm-{i}-{}", std::process::id());
        let submission = Submission {
            task: &task,
            key: &key,
            tenant: "acme",
            caller: Some("bench"),
        };
        let run = match kedge_app::tasks::submit(&b.rt.client, &submission, Duration::from_secs(30))
            .await
            .expect("intake answered")
        {
            Answer::Accepted { run_id } => run_id,
            Answer::Rejected { error } => panic!("warm-up rejected: {error:?}"),
        };
        let mut f = Follow::start(&b.rt, run).await;
        let ok = f
            .until(Instant::now() + Duration::from_secs(30), |f| {
                f.state()
                    .filter(|s| s.status.is_terminal())
                    .map(|s| s.status)
            })
            .await;
        match ok {
            Some((RunStatus::Succeeded, _)) => {}
            other => panic!(
                "warm-up run did not succeed ({other:?}); logs:\n{}",
                b.fleet.log_tail(30)
            ),
        }
    }
}
