//! The fleet's pacing of an endpoint's calls under its rate limits (docs/ARCHITECTURE.md,
//! "Provider trouble"): pure, stored at `pace.<endpoint>` in `kedge_providers` and changed by
//! compare-and-set ([`super::Providers::admit`], the releaser).
//!
//! Each limit is a generic cell rate algorithm (GCRA, "virtual scheduling"): the record holds the
//! theoretical time of the next call, a call reserves the earliest slot at or after
//! `next - BURST`, and moves `next` on by the limit's interval (a request's, or the call's
//! tokens times a token's). Any `n` calls the pace lets go span at least `(n − 1) × interval −
//! BURST`; with an interval of `(60 s + BURST) × (1 + MARGIN) / limit`, `limit + 1` calls span
//! more than a minute, so a provider counting over a sliding minute never answers 429 to the
//! fleet's pace. The 2 % margin absorbs the spread between a slot and the call's arrival.

use std::time::Duration;

use kedge_core::event::Timestamp;
use serde::{Deserialize, Serialize};

/// How far ahead of its slot time a call may go: calls arriving together after a quiet spell
/// go at once, up to about a second's worth.
pub const BURST: Duration = Duration::from_secs(1);
/// The furthest ahead a pace's next time can be when the fleet keeps it (a minute's interval
/// past a reservation, with room); further is taken for a broken record.
const MOST_AHEAD: Duration = Duration::from_secs(180);
/// The share the pace keeps below the limit (see the module's text).
const MARGIN: f64 = 0.02;

/// Rate limits of one endpoint, per minute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
}

impl Limits {
    pub fn is_none(&self) -> bool {
        self.requests_per_minute.is_none() && self.tokens_per_minute.is_none()
    }

    /// Each limit the lower of the two (a limit either names).
    pub fn lower(self, other: Limits) -> Limits {
        let min = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Limits {
            requests_per_minute: min(self.requests_per_minute, other.requests_per_minute),
            tokens_per_minute: min(self.tokens_per_minute, other.tokens_per_minute),
        }
    }
}

impl std::fmt::Display for Limits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.requests_per_minute, self.tokens_per_minute) {
            (Some(r), Some(t)) => write!(f, "{r} requests and {t} tokens per minute"),
            (Some(r), None) => write!(f, "{r} requests per minute"),
            (None, Some(t)) => write!(f, "{t} tokens per minute"),
            (None, None) => f.write_str("no limit"),
        }
    }
}

/// An endpoint's pace, as stored at `pace.<endpoint>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pace {
    pub endpoint: String,
    /// The model whose calls it paces (providers count limits per model).
    #[serde(default)]
    pub model: String,
    /// The limits the operator configured (as the last process to write the record has them).
    #[serde(default)]
    pub configured: Limits,
    /// The limits the provider named in its rate-limit headers.
    #[serde(default)]
    pub learned: Limits,
    /// The theoretical time of the next request, and of the next token.
    pub next_request_at: Timestamp,
    pub next_token_at: Timestamp,
    pub updated_at: Timestamp,
}

/// How long from `from` to `to` (zero when `to` is not later).
fn until(from: Timestamp, to: Timestamp) -> Duration {
    Duration::try_from(to.0 - from.0).unwrap_or_default()
}

/// The interval per unit of a limit of `per_minute` units (see the module's text).
fn interval(per_minute: u64) -> Duration {
    let window = (Duration::from_secs(60) + BURST).as_secs_f64() * (1.0 + MARGIN);
    #[allow(clippy::cast_precision_loss)]
    let per = window / (per_minute.max(1) as f64);
    Duration::from_secs_f64(per)
}

impl Pace {
    pub fn new(endpoint: &str, model: &str, now: Timestamp) -> Pace {
        Pace {
            endpoint: endpoint.to_owned(),
            model: model.to_owned(),
            configured: Limits::default(),
            learned: Limits::default(),
            next_request_at: now,
            next_token_at: now,
            updated_at: now,
        }
    }

    /// The limits kept to: each the lower of the configured and the learned one.
    pub fn limits(&self) -> Limits {
        self.configured.lower(self.learned)
    }

    /// Reserves a slot for a call of `tokens` input tokens arriving at `now`: the wait until
    /// the slot and the pace after it, or, when the slot is more than `max_wait` away, how far
    /// it is (nothing reserved). A call larger than the whole token limit counts as the limit
    /// (the provider, not the pace, refuses it).
    pub fn reserve(
        &self,
        now: Timestamp,
        tokens: u64,
        max_wait: Duration,
    ) -> Result<(Duration, Pace), Duration> {
        let limits = self.limits();
        // A pace kept by the fleet is never further ahead than about a minute (one interval past
        // the furthest slot reserved); one that is (a clock that jumped, a record written by
        // hand or broken) would hold every call of the model: it starts again from now.
        let sane = |at: Timestamp| if until(now, at) > MOST_AHEAD { now } else { at };
        let (next_request_at, next_token_at) =
            (sane(self.next_request_at), sane(self.next_token_at));
        let mut slot = now;
        if limits.requests_per_minute.is_some() {
            slot = slot.max(next_request_at.saturating_add_signed(-burst()));
        }
        if limits.tokens_per_minute.is_some() {
            slot = slot.max(next_token_at.saturating_add_signed(-burst()));
        }
        let wait = until(now, slot);
        if wait > max_wait {
            return Err(wait);
        }
        let mut next = self.clone();
        next.updated_at = now;
        if let Some(rpm) = limits.requests_per_minute {
            next.next_request_at = next_request_at.max(slot).saturating_add(interval(rpm));
        }
        if let Some(tpm) = limits.tokens_per_minute {
            let per_token = interval(tpm);
            #[allow(clippy::cast_precision_loss)]
            let cost = per_token.mul_f64(tokens.min(tpm) as f64);
            next.next_token_at = next_token_at.max(slot).saturating_add(cost);
        }
        Ok((wait, next))
    }

    /// Reserves slots within `max_wait` for as many of `calls` (each its input tokens) as fit,
    /// in order: how many, and the pace after them.
    pub fn reserve_many(
        &self,
        now: Timestamp,
        calls: impl IntoIterator<Item = u64>,
        max_wait: Duration,
    ) -> (usize, Pace) {
        let mut pace = self.clone();
        let mut n = 0;
        for tokens in calls {
            match pace.reserve(now, tokens, max_wait) {
                Ok((_, next)) => {
                    pace = next;
                    n += 1;
                }
                Err(_) => break,
            }
        }
        (n, pace)
    }
}

fn burst() -> time::Duration {
    time::Duration::try_from(BURST).unwrap_or(time::Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at_ms(ms: i64) -> Timestamp {
        Timestamp(
            time::OffsetDateTime::UNIX_EPOCH
                + time::Duration::seconds(1_800_000_000)
                + time::Duration::milliseconds(ms),
        )
    }

    fn pace(rpm: Option<u64>, tpm: Option<u64>) -> Pace {
        let mut p = Pace::new("e", "m", at_ms(0));
        p.configured = Limits {
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
        };
        p
    }

    /// Calls arriving every `every_ms` for `for_ms`: the times of those sent.
    fn drive(mut p: Pace, every_ms: i64, for_ms: i64, tokens: u64) -> Vec<i64> {
        let mut sent = Vec::new();
        let mut t = 0;
        while t < for_ms {
            let now = at_ms(t);
            // A call that would wait is dropped (it would wait its turn in the queue).
            if let Ok((_, next)) = p.reserve(now, tokens, Duration::ZERO) {
                sent.push(t);
                p = next;
            }
            t += every_ms;
        }
        sent
    }

    /// The most calls in any window of 60 s (a provider's sliding minute).
    fn busiest_minute(sent: &[i64]) -> usize {
        let mut sorted = sent.to_vec();
        sorted.sort_unstable();
        let mut most = 0;
        let mut lo = 0;
        for hi in 0..sorted.len() {
            while sorted[hi] - sorted[lo] >= 60_000 {
                lo += 1;
            }
            most = most.max(hi - lo + 1);
        }
        most
    }

    #[test]
    fn no_sliding_minute_holds_more_requests_than_the_limit_and_the_pace_comes_close_to_it() {
        for rpm in [1, 2, 20, 60, 1500, 10_000] {
            // Far more calls than allowed, arriving all the time, for three minutes.
            let sent = drive(pace(Some(rpm), None), 1, 180_000, 1);
            let most = busiest_minute(&sent);
            assert!(most as u64 <= rpm, "{rpm} rpm: {most} calls in one minute");
            // Over three minutes the fleet gets within ~5 % of what the limit allows.
            let allowed = 3 * rpm;
            assert!(
                sent.len() as f64 >= allowed as f64 * 0.95 - 2.0,
                "{rpm} rpm: only {} of {allowed} calls in three minutes",
                sent.len()
            );
        }
    }

    #[test]
    fn a_burst_after_a_quiet_spell_goes_at_once_up_to_about_a_seconds_worth() {
        let p = pace(Some(1500), None);
        let (n, _) = p.reserve_many(at_ms(0), std::iter::repeat_n(1, 100), Duration::ZERO);
        // 1500 per minute is 25 a second: about that many go without waiting.
        assert!((20..=30).contains(&n), "{n} went at once");
    }

    #[test]
    fn tokens_pace_by_each_calls_size() {
        // 60 000 tokens a minute, calls of 5 000: about 12 a minute.
        let sent = drive(pace(None, Some(60_000)), 10, 180_000, 5_000);
        let per_minute = sent.len() as f64 / 3.0;
        assert!(
            (10.0..=12.5).contains(&per_minute),
            "{per_minute} calls a minute"
        );
        // A call larger than the whole limit counts as the limit, and still goes.
        let p = pace(None, Some(1_000));
        assert!(p.reserve(at_ms(0), 50_000, Duration::ZERO).is_ok());
    }

    #[test]
    fn a_slot_too_far_away_reserves_nothing_and_says_how_far() {
        let p = pace(Some(60), None);
        let (n, full) = p.reserve_many(at_ms(0), std::iter::repeat_n(1, 10), Duration::ZERO);
        assert!(n >= 1);
        let far = full
            .reserve(at_ms(0), 1, Duration::from_millis(10))
            .expect_err("no slot within 10 ms");
        assert!(far > Duration::from_millis(10) && far <= Duration::from_secs(2));
        // Within the wait asked for, the same call gets its slot.
        let (wait, _) = full.reserve(at_ms(0), 1, far).expect("a slot");
        assert_eq!(wait, far);
    }

    #[test]
    fn a_pace_far_in_the_future_holds_no_call() {
        let mut p = pace(Some(60), None);
        p.next_request_at = at_ms(3_600_000);
        let (wait, next) = p
            .reserve(at_ms(0), 1, Duration::ZERO)
            .expect("a broken record starts again from now");
        assert_eq!(wait, Duration::ZERO);
        assert!(next.next_request_at < at_ms(70_000));
        // A pace a minute ahead is the fleet's own: kept to.
        p.next_request_at = at_ms(60_000);
        assert!(p.reserve(at_ms(0), 1, Duration::ZERO).is_err());
    }

    #[test]
    fn the_lower_of_the_configured_and_the_learned_limit_is_kept_to() {
        let mut p = pace(Some(1500), None);
        p.learned = Limits {
            requests_per_minute: Some(500),
            tokens_per_minute: Some(40_000),
        };
        assert_eq!(
            p.limits(),
            Limits {
                requests_per_minute: Some(500),
                tokens_per_minute: Some(40_000),
            }
        );
        assert_eq!(
            p.limits().to_string(),
            "500 requests and 40000 tokens per minute"
        );
        assert!(Pace::new("e", "m", at_ms(0)).limits().is_none());
        // No limit: every call goes at once, and the pace does not move.
        let free = Pace::new("e", "m", at_ms(0));
        let (n, after) = free.reserve_many(at_ms(0), std::iter::repeat_n(1, 1000), Duration::ZERO);
        assert_eq!(n, 1000);
        assert_eq!(after.next_request_at, free.next_request_at);
    }
}
