//! Concurrency keys and priorities (docs/ARCHITECTURE.md "Concurrency keys and priorities"),
//! the pure parts: a key's template and its expansion over a task, the order waiting runs start
//! in, and the transitions of a key's slot record (`kedge_slots`, taken by compare-and-set).
//!
//! A task (or its agent's default) may name `concurrency: {key, limit}` and a `priority`. Intake
//! expands the key's template over the task and freezes the key, its limit and the priority
//! into `run.created` ([`RunConcurrency`]); the step service takes a slot of the key before
//! the run's first step (or before a revived run's next one), and gives it back when the run
//! ends. A run that finds its key full journals `run.queued` (the key, its limit, its place) and
//! waits; whoever frees a slot hands it to the next waiting run ([`SlotRecord::release`]) and
//! wakes it with a `slot.granted` input.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::event::Timestamp;
use crate::ids::{AgentName, RunId, TenantId};
use crate::task::TaskRejection;

/// The largest `limit` a key may have.
pub const MAX_LIMIT: u32 = 10_000;
/// The lowest `priority`.
pub const MIN_PRIORITY: i32 = -1_000;
/// The highest `priority`.
pub const MAX_PRIORITY: i32 = 1_000;
/// The longest key template, and the longest key once expanded, in bytes.
pub const MAX_KEY_BYTES: usize = 256;
/// Most runs a key's record lists (holders and waiting runs together): a record is one KV
/// value, and each waiting run costs a few dozen bytes of it. A run that would be past this is
/// refused a place and tried again later (the step service hands its wake back).
pub const MAX_LISTED: usize = 4_096;

/// A concurrency key as a task or an agent definition gives it: a template over the task and
/// how many runs of one expanded key may run at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConcurrencySpec {
    /// Literal text and placeholders: `{metadata.<name>}` (a string, number or boolean of the
    /// task's metadata; `.` descends into objects) and `{agent}`. E.g. `"{metadata.customer}"`,
    /// `"ticket-{metadata.ticket}"`.
    pub key: String,
    /// Runs of one key that may run at once, 1..=10000.
    pub limit: u32,
}

/// One part of a parsed key template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part<'a> {
    Text(&'a str),
    Agent,
    /// A path into the task's metadata (its segments).
    Metadata(Vec<&'a str>),
}

fn parse_template(template: &str) -> Result<Vec<Part<'_>>, String> {
    if template.is_empty() {
        return Err("must not be empty".into());
    }
    if template.len() > MAX_KEY_BYTES {
        return Err(format!(
            "{} bytes is over the {MAX_KEY_BYTES}-byte limit",
            template.len()
        ));
    }
    let mut parts = Vec::new();
    let mut rest = template;
    while !rest.is_empty() {
        match rest.find(['{', '}']) {
            None => {
                parts.push(Part::Text(rest));
                break;
            }
            Some(i) if rest.as_bytes()[i] == b'}' => {
                return Err(format!(
                    "a `}}` without its `{{` at byte {}",
                    offset(template, rest) + i
                ));
            }
            Some(i) => {
                if i > 0 {
                    parts.push(Part::Text(&rest[..i]));
                }
                let after = &rest[i + 1..];
                let Some(end) = after.find('}') else {
                    return Err("a `{` without its `}`".into());
                };
                let name = &after[..end];
                parts.push(placeholder(name)?);
                rest = &after[end + 1..];
            }
        }
    }
    if parts
        .iter()
        .any(|p| matches!(p, Part::Text(t) if t.chars().any(char::is_control)))
    {
        return Err("must not contain control characters".into());
    }
    Ok(parts)
}

fn offset(whole: &str, tail: &str) -> usize {
    whole.len() - tail.len()
}

fn placeholder(name: &str) -> Result<Part<'_>, String> {
    if name == "agent" {
        return Ok(Part::Agent);
    }
    let Some(path) = name.strip_prefix("metadata.") else {
        return Err(format!(
            "unknown placeholder `{{{name}}}`; expected `{{agent}}` or `{{metadata.<name>}}`"
        ));
    };
    let segments: Vec<&str> = path.split('.').collect();
    let ok = |s: &&str| {
        !s.is_empty()
            && s.len() <= 64
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    };
    if !segments.iter().all(ok) {
        return Err(format!(
            "placeholder `{{{name}}}`: each name after `metadata.` is 1 to 64 of [A-Za-z0-9_-]"
        ));
    }
    Ok(Part::Metadata(segments))
}

impl ConcurrencySpec {
    /// Checks the template's syntax and the limit's range; `field` names it in a rejection
    /// (`concurrency`, or an agent's `concurrency`).
    pub fn validate(&self, field: &str) -> Result<(), TaskRejection> {
        parse_template(&self.key)
            .map_err(|reason| TaskRejection::new(format!("{field}.key"), reason))?;
        if self.limit == 0 || self.limit > MAX_LIMIT {
            return Err(TaskRejection::new(
                format!("{field}.limit"),
                format!("{} is not in 1..={MAX_LIMIT}", self.limit),
            ));
        }
        Ok(())
    }

    /// The key expanded over the task: what `run.created` freezes. A placeholder whose value
    /// is missing, or not a string, number or boolean, refuses the task naming `field.key`.
    pub fn resolve(
        &self,
        field: &str,
        agent: &AgentName,
        metadata: &serde_json::Map<String, serde_json::Value>,
        priority: i32,
    ) -> Result<RunConcurrency, TaskRejection> {
        self.validate(field)?;
        let reject = |reason: String| TaskRejection::new(format!("{field}.key"), reason);
        let parts = parse_template(&self.key).map_err(reject)?;
        let mut key = String::new();
        for part in parts {
            match part {
                Part::Text(t) => key.push_str(t),
                Part::Agent => key.push_str(agent.as_str()),
                Part::Metadata(path) => {
                    let value = lookup(metadata, &path)
                        .ok_or_else(|| reject(format!("metadata.{} is missing", path.join("."))))?;
                    match value {
                        serde_json::Value::String(s) => key.push_str(s),
                        serde_json::Value::Number(n) => key.push_str(&n.to_string()),
                        serde_json::Value::Bool(b) => {
                            key.push_str(if *b { "true" } else { "false" })
                        }
                        _ => {
                            return Err(reject(format!(
                                "metadata.{} must be a string, a number or a boolean",
                                path.join(".")
                            )));
                        }
                    }
                }
            }
        }
        if key.is_empty() {
            return Err(reject("expands to an empty key".into()));
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(reject(format!(
                "expands to {} bytes, over the {MAX_KEY_BYTES}-byte limit",
                key.len()
            )));
        }
        if key.chars().any(char::is_control) {
            return Err(reject("expands to a key with control characters".into()));
        }
        Ok(RunConcurrency {
            key,
            limit: self.limit,
            priority,
        })
    }
}

/// A task's concurrency key and priority, as `run.created` freezes them: the task's own key, else
/// its agent's default (`agent_key`), expanded over the task; the task's priority, else the
/// agent's, else 0. `None`: the run takes no slot. A key over a metadata field the agent marks
/// sensitive (`metadata.<name>` in `sensitive`) is refused: the expanded key is stored in clear.
pub fn for_task(
    task: &crate::task::TaskSubmission,
    agent_key: Option<&ConcurrencySpec>,
    agent_priority: Option<i32>,
    sensitive: &[String],
) -> Result<Option<RunConcurrency>, TaskRejection> {
    let Some(spec) = task.concurrency.as_ref().or(agent_key) else {
        return Ok(None);
    };
    let priority = task.priority.or(agent_priority).unwrap_or(0);
    check_priority("priority", priority)?;
    let parts = parse_template(&spec.key)
        .map_err(|reason| TaskRejection::new("concurrency.key", reason))?;
    for part in parts {
        if let Part::Metadata(path) = part
            && let Some(first) = path.first()
            && sensitive
                .iter()
                .any(|f| f.strip_prefix("metadata.") == Some(*first))
        {
            return Err(TaskRejection::new(
                "concurrency.key",
                format!("metadata.{first} is sensitive and cannot be part of a concurrency key"),
            ));
        }
    }
    spec.resolve("concurrency", &task.agent, &task.metadata, priority)
        .map(Some)
}

fn lookup<'m>(
    metadata: &'m serde_json::Map<String, serde_json::Value>,
    path: &[&str],
) -> Option<&'m serde_json::Value> {
    let (first, rest) = path.split_first()?;
    let mut value = metadata.get(*first)?;
    for segment in rest {
        value = value.as_object()?.get(*segment)?;
    }
    Some(value)
}

/// Checks a priority's range; `field` names it in a rejection.
pub fn check_priority(field: &str, priority: i32) -> Result<(), TaskRejection> {
    if (MIN_PRIORITY..=MAX_PRIORITY).contains(&priority) {
        Ok(())
    } else {
        Err(TaskRejection::new(
            field,
            format!("{priority} is not in {MIN_PRIORITY}..={MAX_PRIORITY}"),
        ))
    }
}

/// A run's concurrency key, expanded and frozen into `run.created`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RunConcurrency {
    /// The expanded key (scoped to the run's tenant: the same key of another tenant is another
    /// key).
    pub key: String,
    pub limit: u32,
    /// The run's place in the waiting order: higher first (the task's `priority`, else the
    /// agent's, else 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: i32,
}

fn is_zero(p: &i32) -> bool {
    *p == 0
}

/// The name of a key's record in `kedge_slots` within its tenant: 32 hex digits of SHA-256 of
/// the key (any text of up to 256 bytes becomes a subject-safe token of fixed length). The
/// registry puts the tenant in front (`kedge_core::subjects::slot_key`).
pub fn key_digest(key: &str) -> String {
    use sha2::Digest as _;
    let hash = sha2::Sha256::digest(key.as_bytes());
    hash.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// A run waiting for a slot of its key, or asking for one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Claim {
    pub run: RunId,
    /// Higher first.
    #[serde(default)]
    pub priority: i32,
    /// When the run was created (its `run.created`'s `at`): earlier first among equal
    /// priorities.
    pub arrival: Timestamp,
}

impl Claim {
    /// Whether `self` starts before `other`: higher priority first, then earlier arrival, then
    /// the run id (so the order is total and every process computes the same one).
    pub fn before(&self, other: &Claim) -> bool {
        (
            std::cmp::Reverse(self.priority),
            self.arrival,
            self.run.as_str(),
        ) < (
            std::cmp::Reverse(other.priority),
            other.arrival,
            other.run.as_str(),
        )
    }
}

/// A key's slot record: who holds its slots and who waits, in `kedge_slots` under
/// `<tenant>.<key digest>`. Every change is a compare-and-set on the record's revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SlotRecord {
    pub tenant: TenantId,
    pub key: String,
    /// The limit the latest claim carried (runs of one key normally share it).
    pub limit: u32,
    /// Runs holding a slot, in the order they got it.
    pub holders: Vec<RunId>,
    /// Runs waiting, in the order they start ([`Claim::before`]).
    pub waiting: Vec<Claim>,
}

/// What [`SlotRecord::take`] answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// The run holds a slot (it already did, or it got one now).
    Granted,
    /// The key is at its limit: the run waits at `place` (1 = next).
    Queued { place: u32 },
    /// The record lists [`MAX_LISTED`] runs: no place now, try again later.
    Full,
}

impl SlotRecord {
    pub fn new(tenant: TenantId, key: String, limit: u32) -> SlotRecord {
        SlotRecord {
            tenant,
            key,
            limit,
            holders: Vec::new(),
            waiting: Vec::new(),
        }
    }

    /// A run asks for a slot. It gets one when it holds one already, or when a slot is free and
    /// no waiting run starts before it; otherwise it waits in order (a repeat ask keeps its
    /// place, with the claim's priority).
    pub fn take(&mut self, claim: &Claim, limit: u32) -> Admission {
        self.limit = limit.max(1);
        if self.holders.contains(&claim.run) {
            return Admission::Granted;
        }
        self.waiting.retain(|w| w.run != claim.run);
        let ahead = self.waiting.iter().filter(|w| w.before(claim)).count();
        if self.free() > ahead {
            // Room for every run before it and for it: it goes now (the runs before it were
            // left waiting only by a release not yet handed on; `promote` hands it on).
            self.holders.push(claim.run.clone());
            return Admission::Granted;
        }
        if self.holders.len() + self.waiting.len() >= MAX_LISTED {
            return Admission::Full;
        }
        self.waiting.insert(ahead, claim.clone());
        Admission::Queued {
            place: u32::try_from(ahead + 1).unwrap_or(u32::MAX),
        }
    }

    /// Slots not held.
    pub fn free(&self) -> usize {
        (self.limit as usize).saturating_sub(self.holders.len())
    }

    /// The run's place among the waiting (1 = next), if it waits.
    pub fn place_of(&self, run: &RunId) -> Option<u32> {
        self.waiting
            .iter()
            .position(|w| &w.run == run)
            .map(|i| u32::try_from(i + 1).unwrap_or(u32::MAX))
    }

    /// The run gives back its slot (or its place, if it waits): the freed slots go to the next
    /// waiting runs, which are returned, to be woken with `slot.granted`.
    pub fn release(&mut self, run: &RunId) -> Vec<RunId> {
        self.holders.retain(|h| h != run);
        self.waiting.retain(|w| &w.run != run);
        self.promote()
    }

    /// Removes every run `gone` says is finished or gone (the reconciler's recovery of a slot a
    /// dead process kept), then hands the freed slots on; returns the runs promoted.
    pub fn forget(&mut self, gone: impl Fn(&RunId) -> bool) -> Vec<RunId> {
        self.holders.retain(|h| !gone(h));
        self.waiting.retain(|w| !gone(&w.run));
        self.promote()
    }

    /// Moves waiting runs into free slots, first in order first; returns them.
    pub fn promote(&mut self) -> Vec<RunId> {
        let mut promoted = Vec::new();
        while self.free() > 0 && !self.waiting.is_empty() {
            let next = self.waiting.remove(0);
            self.holders.push(next.run.clone());
            promoted.push(next.run);
        }
        promoted
    }

    /// Whether no run holds or waits (the record may be deleted).
    pub fn is_idle(&self) -> bool {
        self.holders.is_empty() && self.waiting.is_empty()
    }
}

/// Whether a step's opening decisions start the run's work (`run.started`, or `run.revived` for
/// a finished run a message continues): the moment a run with a concurrency key must hold a
/// slot.
pub fn starts_work(start: &[crate::event::Draft<crate::event::Decision>]) -> bool {
    use crate::event::Decision;
    start
        .iter()
        .any(|d| matches!(d.event, Decision::RunStarted(_) | Decision::RunRevived(_)))
}

/// The run's claim on its key: its priority, and its arrival (when `run.created` was
/// journaled).
pub fn claim_of(state: &crate::fold::RunState, conc: &RunConcurrency) -> Claim {
    Claim {
        run: state.run_id.clone(),
        priority: conc.priority,
        arrival: state.created_at,
    }
}

/// What the writer journals when the run's key answered that it waits at `place`: `run.queued`
/// once per wait (none when the run already journaled that it waits).
pub fn queued(
    state: &crate::fold::RunState,
    conc: &RunConcurrency,
    place: u32,
) -> Option<crate::event::Draft<crate::event::Decision>> {
    use crate::event::{Decision, Draft, RunQueued};
    if state.queued.is_some() {
        return None;
    }
    Some(Draft::new(Decision::RunQueued(RunQueued {
        key: conc.key.clone(),
        limit: conc.limit,
        place,
        priority: conc.priority,
    })))
}

#[cfg(test)]
mod tests;
