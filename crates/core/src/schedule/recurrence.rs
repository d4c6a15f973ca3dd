//! When a schedule fires: a cron expression read in an IANA time zone (croner, chrono-tz), or a
//! fixed interval aligned to the Unix epoch. Instants are whole seconds.
//!
//! Daylight saving (croner follows the Open Cron Pattern Specification): a wall time that a
//! spring-forward gap skips fires once, at the first instant after the gap; a wall time a
//! fall-back repeats fires once, at its first occurrence. Intervals ignore the zone: every
//! `every_secs` seconds since 1970-01-01T00:00:00Z, so that every scheduler computes the same
//! instants and an interval of 3600 fires on the hour.

use std::str::FromStr as _;

use chrono::{DateTime, TimeZone as _, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use serde::{Deserialize, Serialize};

use super::{MAX_INTERVAL_SECS, ScheduleRejection, from_unix, secs};
use crate::event::Timestamp;

/// How late an instant may be handled and still count as on time rather than missed (a
/// scheduler that woke late, a broker round trip, a replica taking over).
pub const ON_TIME_GRACE_SECS: u64 = 30;

/// Longest cron expression.
const MAX_CRON_LEN: usize = 256;

/// When a schedule fires.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Recurrence {
    /// A cron expression: 5 fields (minute first) or 6 (second first); nicknames (`@daily`),
    /// `L`, `#` and `W` as croner reads them.
    Cron { expr: String },
    /// Every `every_secs` seconds since the Unix epoch.
    Interval { every_secs: u64 },
}

fn parser() -> CronParser {
    CronParser::builder()
        .seconds(Seconds::Optional)
        .year(Year::Disallowed)
        .build()
}

fn parse_cron(expr: &str) -> Result<Cron, String> {
    parser().parse(expr).map_err(|e| e.to_string())
}

/// Whether `name` is an IANA time zone name chrono-tz knows.
pub(super) fn check_time_zone(name: &str) -> Result<Tz, ScheduleRejection> {
    Tz::from_str(name).map_err(|_| {
        ScheduleRejection::new(
            "time_zone",
            format!(
                "`{}` is not an IANA time zone name (e.g. Europe/Paris, UTC)",
                name.chars().take(64).collect::<String>()
            ),
        )
    })
}

impl Recurrence {
    /// A cron recurrence, checked: it parses and fires at least once (from 2000 on, in `zone`).
    pub fn cron(expr: &str, zone: &str) -> Result<Recurrence, ScheduleRejection> {
        let expr = expr.trim();
        if expr.is_empty() || expr.len() > MAX_CRON_LEN {
            return Err(ScheduleRejection::new(
                "cron",
                format!("must be 1 to {MAX_CRON_LEN} characters"),
            ));
        }
        let cron = parse_cron(expr).map_err(|e| ScheduleRejection::new("cron", e))?;
        let tz = check_time_zone(zone)?;
        let reference = Utc
            .timestamp_opt(946_684_800, 0)
            .single()
            .map(|t| t.with_timezone(&tz));
        let fires = reference.is_some_and(|r| cron.find_next_occurrence(&r, false).is_ok());
        if !fires {
            return Err(ScheduleRejection::new("cron", "never fires"));
        }
        Ok(Recurrence::Cron {
            expr: expr.to_owned(),
        })
    }

    /// An interval recurrence, checked: 1 second to [`MAX_INTERVAL_SECS`].
    pub fn interval(every_secs: u64) -> Result<Recurrence, ScheduleRejection> {
        if every_secs == 0 || every_secs > MAX_INTERVAL_SECS {
            return Err(ScheduleRejection::new(
                "interval_secs",
                format!("must be 1 to {MAX_INTERVAL_SECS}"),
            ));
        }
        Ok(Recurrence::Interval { every_secs })
    }

    /// The first instant strictly after `t` (read in `zone` for a cron expression).
    pub fn next_after(&self, zone: &str, t: Timestamp) -> Option<Timestamp> {
        match self {
            Recurrence::Interval { every_secs } => {
                let e = i64::try_from(*every_secs).ok()?.max(1);
                let k = secs(t).div_euclid(e).checked_add(1)?;
                Some(from_unix(k.checked_mul(e)?))
            }
            Recurrence::Cron { expr } => {
                let (cron, at) = zoned(expr, zone, t)?;
                let next = cron.find_next_occurrence(&at, false).ok()?;
                Some(from_unix(next.timestamp()))
            }
        }
    }

    /// The latest instant at or before `t`.
    pub fn latest_at_or_before(&self, zone: &str, t: Timestamp) -> Option<Timestamp> {
        match self {
            Recurrence::Interval { every_secs } => {
                let e = i64::try_from(*every_secs).ok()?.max(1);
                Some(from_unix(secs(t).div_euclid(e).checked_mul(e)?))
            }
            Recurrence::Cron { expr } => {
                let (cron, at) = zoned(expr, zone, t)?;
                let prev = cron.find_previous_occurrence(&at, true).ok()?;
                Some(from_unix(prev.timestamp()))
            }
        }
    }
}

/// The parsed expression and `t` (floored to the second) in `zone`.
fn zoned(expr: &str, zone: &str, t: Timestamp) -> Option<(Cron, DateTime<Tz>)> {
    let cron = parse_cron(expr).ok()?;
    let tz = Tz::from_str(zone).ok()?;
    let at = Utc.timestamp_opt(secs(t), 0).single()?.with_timezone(&tz);
    Some((cron, at))
}
