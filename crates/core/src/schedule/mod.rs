//! Schedules: an agent's task fired on a cron expression or an interval (docs/ARCHITECTURE.md,
//! "Schedules"). Pure: what a schedule is ([`ScheduleSpec`]), how a request becomes one
//! ([`ScheduleRequest::validate`], the same checks a task gets for its template), when it fires
//! ([`ScheduleSpec::next_after`], [`ScheduleSpec::plan`]), what a firing is called
//! ([`firing_key`]) and the record the bucket keeps ([`ScheduleRecord`]). The scheduler (in the
//! timer service) and the edges (bridge, gateway, CLI) are shells around these.

mod recurrence;
#[cfg(test)]
mod tests;

use serde::{Deserialize, Serialize};

pub use recurrence::{ON_TIME_GRACE_SECS, Recurrence};

use crate::event::Timestamp;
use crate::ids::{RunId, TenantId};
use crate::task::{TaskRejection, TaskSubmission};

/// Most schedules one tenant may keep.
pub const MAX_SCHEDULES_PER_TENANT: usize = 100;
/// Longest schedule name.
pub const MAX_NAME_LEN: usize = 64;
/// Largest task template (its JSON).
pub const MAX_TEMPLATE_BYTES: usize = 64 * 1024;
/// Longest interval: a year and a day.
pub const MAX_INTERVAL_SECS: u64 = 366 * 24 * 3600;
/// Longest catch-up window: seven days.
pub const MAX_CATCH_UP_WINDOW_SECS: u64 = 7 * 24 * 3600;
/// The catch-up window when none is given: one hour.
pub const DEFAULT_CATCH_UP_WINDOW_SECS: u64 = 3600;
/// Most missed instants `catch_up: all` fires at once.
pub const MAX_CATCH_UP_COUNT: u32 = 100;
/// The bound on `catch_up: all` when none is given.
pub const DEFAULT_CATCH_UP_COUNT: u32 = 10;

/// What to do with an instant that falls due while the previous firing's run is unfinished.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// The instant is skipped (counted, not fired).
    #[default]
    Skip,
    /// At most one firing waits; it fires when the previous run ends (a later instant replaces a
    /// waiting one).
    QueueOne,
    /// Every instant fires, whatever runs.
    Allow,
    /// The previous run is asked to cancel, then the instant fires.
    CancelPrevious,
}

/// What to do with instants missed while no scheduler ran (or the schedule could not fire).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CatchUp {
    /// Missed instants are not fired; only an instant due within [`ON_TIME_GRACE_SECS`] is.
    #[default]
    None,
    /// Only the most recent missed instant fires (if within the window).
    Last,
    /// Every missed instant within the window fires, the latest `catch_up_max` of them.
    All,
}

/// A schedule as a client asks for it (HTTP body, gateway request, CLI file). Unknown fields
/// are refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleRequest {
    pub agent: String,
    /// The task template: what a task has but `agent` and `run_id` (input, metadata, budget…).
    pub task: serde_json::Map<String, serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cron: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval_secs: Option<u64>,
    /// An IANA time zone name; UTC when absent. Cron expressions are read in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    #[serde(default)]
    pub overlap: Overlap,
    #[serde(default)]
    pub catch_up: CatchUp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catch_up_window_secs: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catch_up_max: Option<u32>,
}

/// A validated schedule: what the bucket keeps and the scheduler fires.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSpec {
    pub name: String,
    /// The task each firing submits (agent included, never a `run_id`).
    pub task: TaskSubmission,
    pub recurrence: Recurrence,
    pub time_zone: String,
    pub overlap: Overlap,
    pub catch_up: CatchUp,
    pub catch_up_window_secs: u64,
    pub catch_up_max: u32,
}

/// Why a request is not a schedule: the field and the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{field}: {reason}")]
pub struct ScheduleRejection {
    pub field: String,
    pub reason: String,
}

impl ScheduleRejection {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl From<TaskRejection> for ScheduleRejection {
    fn from(r: TaskRejection) -> Self {
        let field = match r.field.as_str() {
            "agent" => "agent".to_owned(),
            "body" => "task".to_owned(),
            f => format!("task.{f}"),
        };
        Self::new(field, r.reason)
    }
}

/// Whether `name` may name a schedule: 1 to [`MAX_NAME_LEN`] of `[a-z0-9_-]`, starting with a
/// letter or digit (it is a key token of the schedules bucket).
pub fn check_name(name: &str) -> Result<(), ScheduleRejection> {
    let bad = |reason: &str| Err(ScheduleRejection::new("name", reason));
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return bad(&format!("must be 1 to {MAX_NAME_LEN} characters"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
    {
        return bad("may hold only a-z, 0-9, `_` and `-`");
    }
    if !name.as_bytes()[0].is_ascii_alphanumeric() {
        return bad("must start with a letter or a digit");
    }
    Ok(())
}

impl ScheduleRequest {
    /// Parses a request body; a rejection names the field.
    pub fn parse(body: &[u8]) -> Result<ScheduleRequest, ScheduleRejection> {
        if body.len() > MAX_TEMPLATE_BYTES + 4096 {
            return Err(ScheduleRejection::new(
                "body",
                format!("over {} bytes", MAX_TEMPLATE_BYTES + 4096),
            ));
        }
        serde_json::from_slice(body).map_err(|e| ScheduleRejection::new("body", e.to_string()))
    }

    /// The schedule `name` this request describes, checked as a task is (the template with the
    /// agent put in must pass [`TaskSubmission::parse`]), or the first field that is wrong.
    pub fn validate(&self, name: &str) -> Result<ScheduleSpec, ScheduleRejection> {
        check_name(name)?;
        let time_zone = self.time_zone.clone().unwrap_or_else(|| "UTC".to_owned());
        recurrence::check_time_zone(&time_zone)?;
        let recurrence = match (&self.cron, self.interval_secs) {
            (Some(expr), None) => Recurrence::cron(expr, &time_zone)?,
            (None, Some(every)) => Recurrence::interval(every)?,
            (Some(_), Some(_)) => {
                return Err(ScheduleRejection::new(
                    "cron",
                    "give either `cron` or `interval_secs`, not both",
                ));
            }
            (None, None) => {
                return Err(ScheduleRejection::new(
                    "cron",
                    "give `cron` or `interval_secs`",
                ));
            }
        };
        let task = self.template()?;
        let catch_up_window_secs = self
            .catch_up_window_secs
            .unwrap_or(DEFAULT_CATCH_UP_WINDOW_SECS);
        if catch_up_window_secs > MAX_CATCH_UP_WINDOW_SECS {
            return Err(ScheduleRejection::new(
                "catch_up_window_secs",
                format!("at most {MAX_CATCH_UP_WINDOW_SECS}"),
            ));
        }
        let catch_up_max = self.catch_up_max.unwrap_or(DEFAULT_CATCH_UP_COUNT);
        if catch_up_max == 0 || catch_up_max > MAX_CATCH_UP_COUNT {
            return Err(ScheduleRejection::new(
                "catch_up_max",
                format!("must be 1 to {MAX_CATCH_UP_COUNT}"),
            ));
        }
        Ok(ScheduleSpec {
            name: name.to_owned(),
            task,
            recurrence,
            time_zone,
            overlap: self.overlap,
            catch_up: self.catch_up,
            catch_up_window_secs,
            catch_up_max,
        })
    }

    fn template(&self) -> Result<TaskSubmission, ScheduleRejection> {
        for reserved in ["agent", "run_id"] {
            if self.task.contains_key(reserved) {
                return Err(ScheduleRejection::new(
                    format!("task.{reserved}"),
                    "is set by the schedule, not the template",
                ));
            }
        }
        let mut task = self.task.clone();
        task.insert(
            "agent".to_owned(),
            serde_json::Value::String(self.agent.clone()),
        );
        let body =
            serde_json::to_vec(&task).map_err(|e| ScheduleRejection::new("task", e.to_string()))?;
        if body.len() > MAX_TEMPLATE_BYTES {
            return Err(ScheduleRejection::new(
                "task",
                format!(
                    "{} bytes is over the {MAX_TEMPLATE_BYTES}-byte limit",
                    body.len()
                ),
            ));
        }
        Ok(TaskSubmission::parse(&body)?)
    }
}

impl ScheduleSpec {
    /// The request that makes this spec again (what `list` and `get` show).
    pub fn request(&self) -> ScheduleRequest {
        let mut task = serde_json::to_value(&self.task)
            .ok()
            .and_then(|v| v.as_object().cloned())
            .unwrap_or_default();
        task.remove("agent");
        let (cron, interval_secs) = match &self.recurrence {
            Recurrence::Cron { expr } => (Some(expr.clone()), None),
            Recurrence::Interval { every_secs } => (None, Some(*every_secs)),
        };
        ScheduleRequest {
            agent: self.task.agent.to_string(),
            task,
            cron,
            interval_secs,
            time_zone: Some(self.time_zone.clone()),
            overlap: self.overlap,
            catch_up: self.catch_up,
            catch_up_window_secs: Some(self.catch_up_window_secs),
            catch_up_max: Some(self.catch_up_max),
        }
    }

    /// The first instant strictly after `t` (whole seconds), or `None` when there is none.
    pub fn next_after(&self, t: Timestamp) -> Option<Timestamp> {
        self.recurrence.next_after(&self.time_zone, t)
    }

    /// The latest instant at or before `t`, or `None` when there is none.
    pub fn latest_at_or_before(&self, t: Timestamp) -> Option<Timestamp> {
        self.recurrence.latest_at_or_before(&self.time_zone, t)
    }

    /// What to fire at `now` when every instant up to `from` was handled, oldest first.
    /// Instants at or after `on_time_from` are on time and all fire (the latest
    /// [`MAX_CATCH_UP_COUNT`] of them); the ones before it were missed, and the catch-up policy
    /// says which fire: `none`, none of them; `last`, the most recent, if within the window;
    /// `all`, every one within the window, the latest `catch_up_max` of them. The scheduler
    /// passes the later of its own start and `now` less [`ON_TIME_GRACE_SECS`]: what fell due
    /// while no scheduler ran (or could reach the broker for long) was missed.
    pub fn plan(&self, from: Timestamp, now: Timestamp, on_time_from: Timestamp) -> Plan {
        let window_start = secs(now).saturating_sub(self.catch_up_window_secs as i64);
        // Missed means strictly before `on_time_from`: the first whole second at or after it.
        let boundary = secs(on_time_from) + i64::from(on_time_from.0.nanosecond() > 0);
        let mut plan = Plan::default();
        // Missed: (from, boundary).
        let missed_until = from_unix(boundary - 1);
        let latest_missed = self.latest_at_or_before(missed_until).filter(|l| *l > from);
        let earlier_than = |l: Timestamp| {
            self.latest_at_or_before(from_unix(secs(l) - 1))
                .is_some_and(|e| e > from)
        };
        match (self.catch_up, latest_missed) {
            (_, None) => {}
            (CatchUp::None, Some(_)) => plan.missed = true,
            (CatchUp::Last, Some(l)) if secs(l) >= window_start => {
                plan.fire.push(l);
                plan.missed = earlier_than(l);
            }
            (CatchUp::Last, Some(_)) => plan.missed = true,
            (CatchUp::All, Some(_)) => {
                let start = from_unix(window_start - 1);
                let after = if start > from { start } else { from };
                let (found, dropped) =
                    self.between(after, missed_until, self.catch_up_max as usize);
                plan.missed = dropped || found.first().is_none_or(|f| earlier_than(*f));
                plan.fire.extend(found);
            }
        }
        // On time: [boundary, now].
        let first = from_unix(boundary - 1);
        let first = if first > from { first } else { from };
        let (on_time, _) = self.between(first, now, MAX_CATCH_UP_COUNT as usize);
        plan.fire.extend(on_time);
        plan
    }

    /// The instants in `(after, until]`, the latest `max` of them, oldest first; and whether
    /// more were left out. Walks back from `until`, so a long outage costs `max` steps, not one
    /// per instant missed.
    fn between(&self, after: Timestamp, until: Timestamp, max: usize) -> (Vec<Timestamp>, bool) {
        let mut out = Vec::new();
        let mut at = until;
        while out.len() <= max {
            match self.latest_at_or_before(at) {
                Some(l) if l > after => {
                    out.push(l);
                    at = from_unix(secs(l) - 1);
                }
                _ => break,
            }
        }
        let dropped = out.len() > max;
        out.truncate(max);
        out.reverse();
        (out, dropped)
    }
}

/// What [`ScheduleSpec::plan`] fires, oldest first; and whether the catch-up policy left
/// missed instants unfired.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub fire: Vec<Timestamp>,
    pub missed: bool,
}

fn secs(t: Timestamp) -> i64 {
    t.0.unix_timestamp()
}

/// The instant `secs` seconds after the Unix epoch (clamped to what a timestamp holds).
pub fn from_unix(secs: i64) -> Timestamp {
    time::OffsetDateTime::from_unix_timestamp(secs).map_or(
        if secs < 0 {
            Timestamp::MIN
        } else {
            Timestamp::MAX
        },
        Timestamp,
    )
}

/// `t` floored to the whole second.
pub fn floor_secs(t: Timestamp) -> Timestamp {
    from_unix(secs(t))
}

/// The bucket key of schedule `name` of `tenant` (`<tenant>.<name>`).
pub fn record_key(tenant: &TenantId, name: &str) -> String {
    format!("{tenant}.{name}")
}

/// The tenant and name a bucket key names.
pub fn parse_record_key(key: &str) -> Option<(TenantId, String)> {
    let (tenant, name) = key.split_once('.')?;
    check_name(name).ok()?;
    Some((tenant.parse().ok()?, name.to_owned()))
}

/// The idempotency key (`Nats-Msg-Id`) of the firing of schedule `name` of `tenant` at
/// `instant`: `schedule:<tenant>.<name>@<unix seconds>`. Intake makes the run id from it within
/// the tenant (docs/SECURITY.md, "Run ids"), so every scheduler that fires this instant, however
/// often, makes the same run. No bridge or gateway key has this shape (theirs start with
/// `<tenant>/`).
pub fn firing_key(tenant: &TenantId, name: &str, instant: Timestamp) -> String {
    format!("schedule:{tenant}.{name}@{}", secs(instant))
}

/// A schedule's progress, written only by compare-and-set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleState {
    /// Instants at or before this never fire: when the schedule was created or resumed.
    pub since: Timestamp,
    /// The latest instant handled (fired, skipped, queued or missed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_instant: Option<Timestamp>,
    /// The latest instant that fired, and its run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_fired: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_run: Option<RunId>,
    /// `queue_one`'s waiting firing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued: Option<Timestamp>,
    /// An instant `trigger` asked to fire now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub triggered: Option<Timestamp>,
    #[serde(default)]
    pub fired: u64,
    #[serde(default)]
    pub skipped: u64,
    /// How many times the catch-up policy left missed instants unfired.
    #[serde(default)]
    pub missed: u64,
    /// Why the latest firing failed (intake's rejection), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

impl ScheduleState {
    pub fn new(since: Timestamp) -> Self {
        Self {
            since,
            last_instant: None,
            last_fired: None,
            last_run: None,
            queued: None,
            triggered: None,
            fired: 0,
            skipped: 0,
            missed: 0,
            last_error: None,
        }
    }

    /// Every instant up to this one was handled.
    pub fn handled_through(&self) -> Timestamp {
        match self.last_instant {
            Some(l) if l > self.since => l,
            _ => self.since,
        }
    }
}

/// What the schedules bucket keeps under `<tenant>.<name>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleRecord {
    pub tenant: TenantId,
    pub spec: ScheduleSpec,
    #[serde(default)]
    pub paused: bool,
    pub state: ScheduleState,
}

impl ScheduleRecord {
    /// The next instant this schedule fires after `now`, if it is not paused.
    pub fn next_fire(&self, now: Timestamp) -> Option<Timestamp> {
        if self.paused {
            return None;
        }
        let from = self.state.handled_through();
        let at = if now > from { now } else { from };
        self.spec.next_after(floor_secs(at))
    }
}

/// What the overlap policy makes of an instant due while the previous firing's run is
/// unfinished (`previous_running`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDue {
    /// Fire it.
    Fire,
    /// Skip it.
    Skip,
    /// Keep it as the one waiting firing.
    Queue,
    /// Cancel the previous run, then fire it.
    CancelThenFire,
}

/// The overlap policy's verdict on an instant.
pub fn on_due(overlap: Overlap, previous_running: bool) -> OnDue {
    match (overlap, previous_running) {
        (_, false) | (Overlap::Allow, true) => OnDue::Fire,
        (Overlap::Skip, true) => OnDue::Skip,
        (Overlap::QueueOne, true) => OnDue::Queue,
        (Overlap::CancelPrevious, true) => OnDue::CancelThenFire,
    }
}
