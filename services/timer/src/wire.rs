//! The timer stream's message format: the one place that states it (its names are in the
//! layout's registry, `kedge_core::subjects`).
//!
//! `KEDGE_TIMERS` (file storage, limits retention, `allow_msg_schedules`, `allow_msg_ttl`) holds
//! two subject trees:
//!
//! | subject | what | written by |
//! | --- | --- | --- |
//! | `kedge.timer.sched.<run_id>.<timer_id>` | the pending schedule of one timer | the timer service |
//! | `kedge.timer.fired.<run_id>.<timer_id>` | the timer's firing | the broker, at `fire_at` |
//!
//! A schedule message carries `Nats-Schedule: @at <fire_at, RFC 3339 UTC>`,
//! `Nats-Schedule-Target: <its fired subject>`, `Nats-Schedule-TTL: 720h` and
//! `Nats-Msg-Id: timer:<timer_id>`; its body is a [`Due`] (JSON), which the broker copies into the
//! fired message. See the crate docs for what the broker does with them.

use std::time::Duration;

use async_nats::{Client, HeaderMap, Request, RequestErrorKind, StatusCode};
use bytes::Bytes;
use kedge_core::event::Timestamp;
use kedge_core::ids::{OperationId, RunId, StepNo, TimerId};
use kedge_core::subjects::{timer_fired, timer_scheduled};
use serde::{Deserialize, Serialize};
use time::UtcOffset;
use time::format_description::well_known::Rfc3339;

/// How long a fired message stays in `KEDGE_TIMERS` (`Nats-Schedule-TTL`). The `timer-fired`
/// consumer journals it within milliseconds; the TTL only bounds how long the stream keeps
/// fired messages, and how long a stopped timer service may stay down before a fired timer is
/// lost (30 days).
pub const FIRED_TTL: &str = "720h";

const SCHEDULE: &str = "Nats-Schedule";
const SCHEDULE_TARGET: &str = "Nats-Schedule-Target";
const SCHEDULE_TTL: &str = "Nats-Schedule-TTL";
const MSG_ID: &str = "Nats-Msg-Id";

/// `Nats-Msg-Id` of a timer's schedule message: a redelivered `timer.scheduled` schedules it once.
pub fn schedule_msg_id(timer: &TimerId) -> String {
    format!("timer:{timer}")
}

/// The `Nats-Schedule` value for `fire_at`: `@at <RFC 3339 in UTC>`, nanoseconds included (the
/// broker keeps them: it fires at or after that instant, not at the whole second before).
pub fn at_schedule(fire_at: Timestamp) -> String {
    let utc = fire_at.0.to_offset(UtcOffset::UTC);
    match utc.format(&Rfc3339) {
        Ok(s) => format!("@at {s}"),
        // Out of RFC 3339's range (years outside 0..=9999): cannot come from `complete_step`,
        // which clamps waits to seven days. The broker refuses the pattern; the message is kept.
        Err(_) => format!("@at {utc}"),
    }
}

/// What a timer's schedule (and so its firing) carries: enough to journal `timer.fired` without
/// reading the run's journal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Due {
    pub run_id: RunId,
    pub timer_id: TimerId,
    pub fire_at: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<StepNo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<OperationId>,
}

/// Why a schedule could not be stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// Broker trouble worth retrying (timeout, no responders, disconnected, 503).
    #[error("{stream} unavailable: {0}", stream = kedge_core::subjects::TIMERS_STREAM)]
    Unavailable(String),
    /// The broker refused the schedule (no schedules on the stream, invalid pattern or target):
    /// retrying as is will not help until an operator fixes the stream.
    #[error("{stream} refused the schedule: {0}", stream = kedge_core::subjects::TIMERS_STREAM)]
    Refused(String),
}

/// Where a schedule landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    pub seq: u64,
    /// The same `Nats-Msg-Id` was stored before (a redelivered `timer.scheduled`).
    pub duplicate: bool,
}

/// The schedule message of `due`: subject, headers, body.
pub fn schedule_message(due: &Due) -> (String, HeaderMap, Bytes) {
    let mut headers = HeaderMap::new();
    headers.insert(SCHEDULE, at_schedule(due.fire_at).as_str());
    headers.insert(
        SCHEDULE_TARGET,
        timer_fired(&due.run_id, &due.timer_id).as_str(),
    );
    headers.insert(SCHEDULE_TTL, FIRED_TTL);
    headers.insert(MSG_ID, schedule_msg_id(&due.timer_id).as_str());
    // A `Due` is plain data with string keys: serialization cannot fail.
    let body = serde_json::to_vec(due).unwrap_or_default();
    (
        timer_scheduled(&due.run_id, &due.timer_id),
        headers,
        Bytes::from(body),
    )
}

#[derive(Deserialize)]
struct RawAck {
    #[serde(default)]
    error: Option<RawError>,
    #[serde(default)]
    seq: u64,
    #[serde(default)]
    duplicate: bool,
}

#[derive(Deserialize)]
struct RawError {
    #[serde(default)]
    code: u16,
    #[serde(default)]
    err_code: u64,
    #[serde(default)]
    description: String,
}

/// Stores `due`'s schedule in `KEDGE_TIMERS` and waits for the broker's ack.
pub async fn schedule(
    client: &Client,
    due: &Due,
    timeout: Duration,
) -> Result<Stored, ScheduleError> {
    let (subject, headers, body) = schedule_message(due);
    let req = Request::new()
        .headers(headers)
        .payload(body)
        .timeout(Some(timeout));
    let reply = client
        .send_request(subject, req)
        .await
        .map_err(|e| match e.kind() {
            RequestErrorKind::TimedOut
            | RequestErrorKind::NoResponders
            | RequestErrorKind::Other => ScheduleError::Unavailable(e.to_string()),
            RequestErrorKind::InvalidSubject | RequestErrorKind::MaxPayloadExceeded => {
                ScheduleError::Refused(e.to_string())
            }
        })?;
    if let Some(status) = reply.status {
        let why = format!(
            "status {status}: {}",
            reply.description.as_deref().unwrap_or("no description")
        );
        return Err(
            if status == StatusCode::NO_RESPONDERS || status.as_u16() == 503 {
                ScheduleError::Unavailable(why)
            } else {
                ScheduleError::Refused(why)
            },
        );
    }
    parse_ack(&reply.payload)
}

fn parse_ack(payload: &[u8]) -> Result<Stored, ScheduleError> {
    let ack: RawAck = serde_json::from_slice(payload).map_err(|e| {
        ScheduleError::Refused(format!(
            "unreadable ack `{}`: {e}",
            String::from_utf8_lossy(payload)
        ))
    })?;
    match ack.error {
        Some(e) if matches!(e.code, 503 | 408) => Err(ScheduleError::Unavailable(format!(
            "{} (code {}, err_code {})",
            e.description, e.code, e.err_code
        ))),
        Some(e) => Err(ScheduleError::Refused(format!(
            "{} (code {}, err_code {})",
            e.description, e.code, e.err_code
        ))),
        None if ack.seq == 0 => Err(ScheduleError::Refused(format!(
            "ack without a sequence: `{}`",
            String::from_utf8_lossy(payload)
        ))),
        None => Ok(Stored {
            seq: ack.seq,
            duplicate: ack.duplicate,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn due() -> Due {
        let run: RunId = "run_t1".parse().expect("valid");
        let op = OperationId::new(&run, StepNo(1), 0);
        let fire_at = Timestamp(
            time::OffsetDateTime::parse("2030-01-02T03:04:05.123456789+02:00", &Rfc3339)
                .expect("valid time"),
        );
        Due {
            timer_id: TimerId::for_operation(&op),
            run_id: run,
            fire_at,
            step: Some(StepNo(1)),
            op: Some(op),
        }
    }

    #[test]
    fn the_schedule_is_in_utc_with_nanoseconds() {
        assert_eq!(
            at_schedule(due().fire_at),
            "@at 2030-01-02T01:04:05.123456789Z"
        );
    }

    #[test]
    fn a_schedule_message_targets_its_fired_subject_and_carries_its_due() {
        let d = due();
        let (subject, headers, body) = schedule_message(&d);
        assert_eq!(subject, "kedge.timer.sched.run_t1.tmr_t1_1_0");
        let h = |k: &str| headers.get(k).map(|v| v.as_str().to_owned());
        assert_eq!(
            h(SCHEDULE_TARGET).as_deref(),
            Some("kedge.timer.fired.run_t1.tmr_t1_1_0")
        );
        assert_eq!(h(MSG_ID).as_deref(), Some("timer:tmr_t1_1_0"));
        assert_eq!(h(SCHEDULE_TTL).as_deref(), Some(FIRED_TTL));
        let back: Due = serde_json::from_slice(&body).expect("a due");
        assert_eq!(back, d);
    }

    #[test]
    fn acks_are_classified() {
        assert_eq!(
            parse_ack(br#"{"stream":"KEDGE_TIMERS","seq":4}"#),
            Ok(Stored {
                seq: 4,
                duplicate: false
            })
        );
        assert_eq!(
            parse_ack(br#"{"stream":"KEDGE_TIMERS","seq":4,"duplicate": true}"#),
            Ok(Stored {
                seq: 4,
                duplicate: true
            })
        );
        let refused = parse_ack(
            br#"{"error":{"code":400,"err_code":10189,"description":"message schedules pattern is invalid"},"stream":"T","seq":0}"#,
        );
        assert!(matches!(refused, Err(ScheduleError::Refused(m)) if m.contains("10189")));
        let busy = parse_ack(br#"{"error":{"code":503,"err_code":10008,"description":"x"}}"#);
        assert!(matches!(busy, Err(ScheduleError::Unavailable(_))));
        assert!(matches!(parse_ack(b"nope"), Err(ScheduleError::Refused(_))));
    }
}
