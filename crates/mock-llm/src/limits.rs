//! Per-model rate limits over a sliding 60-second window, and the rate-limit headers each
//! provider sends.
//!
//! A [`Window`] holds the calls it admitted in the last 60 s (time and input tokens). A call is
//! admitted when one more request and its input tokens fit under the model's
//! `requests_per_minute` / `tokens_per_minute`; a refused call takes nothing from the window, so
//! the `retry-after` of a 429 is exactly when enough of the window has slid out. The window is
//! pure (the caller passes `now`), so its arithmetic is tested without waiting a minute.

use std::collections::VecDeque;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use tokio::time::Instant;

use crate::error::Provider;
use crate::script::Limits;

/// The length of the window: limits are per minute.
pub(crate) const WINDOW: Duration = Duration::from_secs(60);

/// The limits a `rate_limited` trouble reports for a model without scripted `limits`.
pub(crate) const TROUBLE_REQUESTS_LIMIT: u64 = 50;
pub(crate) const TROUBLE_TOKENS_LIMIT: u64 = 30_000;

/// One limit's state, as the headers report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Quota {
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    /// Until the window holds none of today's usage (the limit is fully replenished).
    pub(crate) reset: Duration,
}

/// The quotas a response reports; a limit the model does not have is `None` (no headers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub(crate) requests: Option<Quota>,
    pub(crate) tokens: Option<Quota>,
}

/// Which limit refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exceeded {
    /// `requests_per_minute` calls already in the window.
    Requests { limit: u64 },
    /// The call's tokens do not fit in what is left of `tokens_per_minute`.
    Tokens { limit: u64, used: u64 },
    /// The call alone has more tokens than `tokens_per_minute`: waiting never helps.
    TooLarge { limit: u64 },
}

/// Why [`Window::admit`] refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub(crate) exceeded: Exceeded,
    /// The quotas before this call.
    pub(crate) usage: Usage,
    /// When enough of the window frees for the call (`None`: never).
    pub(crate) retry_after: Option<Duration>,
}

/// The calls a model admitted in the last 60 s.
#[derive(Debug, Default)]
pub(crate) struct Window {
    /// (arrival, input tokens), oldest first.
    calls: VecDeque<(Instant, u64)>,
    tokens: u64,
}

impl Window {
    /// Admits (and counts) a call of `tokens` input tokens at `now`, with the quotas left
    /// after it, or says why not.
    pub(crate) fn admit(
        &mut self,
        limits: &Limits,
        tokens: u64,
        now: Instant,
    ) -> Result<Usage, Refusal> {
        self.slide(now);
        let used_requests = self.calls.len() as u64;
        if let Some(limit) = limits.requests_per_minute
            && used_requests >= limit
        {
            // The oldest call leaving the window frees a slot.
            let retry_after = self.calls.front().map(|(t, _)| frees_in(*t, now));
            return self.refused(Exceeded::Requests { limit }, limits, now, retry_after);
        }
        if let Some(limit) = limits.tokens_per_minute {
            if tokens > limit {
                return self.refused(Exceeded::TooLarge { limit }, limits, now, None);
            }
            if self.tokens + tokens > limit {
                // Free the oldest calls until this one fits.
                let mut left = self.tokens;
                let mut retry_after = None;
                for (t, n) in &self.calls {
                    left -= n;
                    if left + tokens <= limit {
                        retry_after = Some(frees_in(*t, now));
                        break;
                    }
                }
                let exceeded = Exceeded::Tokens {
                    limit,
                    used: self.tokens,
                };
                return self.refused(exceeded, limits, now, retry_after);
            }
        }
        self.calls.push_back((now, tokens));
        self.tokens += tokens;
        Ok(self.usage(limits, now))
    }

    fn refused(
        &self,
        exceeded: Exceeded,
        limits: &Limits,
        now: Instant,
        retry_after: Option<Duration>,
    ) -> Result<Usage, Refusal> {
        Err(Refusal {
            exceeded,
            usage: self.usage(limits, now),
            retry_after,
        })
    }

    /// Forgets the calls that left the window: a call at `t` counts until `t + 60 s`.
    fn slide(&mut self, now: Instant) {
        while let Some((t, n)) = self.calls.front().copied() {
            if now.saturating_duration_since(t) < WINDOW {
                break;
            }
            self.calls.pop_front();
            self.tokens -= n;
        }
    }

    fn usage(&self, limits: &Limits, now: Instant) -> Usage {
        let reset = self
            .calls
            .back()
            .map_or(Duration::ZERO, |(t, _)| frees_in(*t, now));
        Usage {
            requests: limits.requests_per_minute.map(|limit| Quota {
                limit,
                remaining: limit.saturating_sub(self.calls.len() as u64),
                reset,
            }),
            tokens: limits.tokens_per_minute.map(|limit| Quota {
                limit,
                remaining: limit.saturating_sub(self.tokens),
                reset,
            }),
        }
    }
}

/// How long until a call made at `t` leaves the window (at least 1 ms: "now" is not a wait).
fn frees_in(t: Instant, now: Instant) -> Duration {
    (t + WINDOW)
        .saturating_duration_since(now)
        .max(Duration::from_millis(1))
}

/// A duration as OpenAI's `x-ratelimit-reset-*` headers write it (Go's notation): `20ms`, `6s`,
/// `1.5s`, `1m0s`, `6m30s`, `1h0m0s`.
pub(crate) fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let hours = ms / 3_600_000;
    let minutes = ms / 60_000 % 60;
    let secs = ms / 1000 % 60;
    let frac = ms % 1000;
    let secs = if frac == 0 {
        format!("{secs}s")
    } else {
        let frac = format!("{frac:03}");
        format!("{secs}.{}s", frac.trim_end_matches('0'))
    };
    if hours > 0 {
        format!("{hours}h{minutes}m{secs}")
    } else if minutes > 0 {
        format!("{minutes}m{secs}")
    } else {
        secs
    }
}

/// The wall-clock time `d` from now, as Anthropic's `anthropic-ratelimit-*-reset` headers write
/// it: RFC 3339 in UTC, whole seconds (rounded up).
pub(crate) fn rfc3339_after(d: Duration) -> Option<String> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).ok()?;
    let at = now.checked_add(d)?;
    let secs = u64::try_from(at.as_millis().div_ceil(1000)).ok()?;
    Some(rfc3339(secs))
}

/// Seconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ` (proleptic Gregorian calendar; the
/// days-to-date conversion is Howard Hinnant's `civil_from_days`).
fn rfc3339(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let (hour, minute, second) = (rem / 3600, rem / 60 % 60, rem % 60);
    // Shift the epoch to 0000-03-01, so that leap days end each 400-year era's years.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}Z")
}

/// The rate-limit headers `usage` makes in the provider's names. Anthropic's input-token
/// limit is reported both as `tokens` and as `input-tokens` (the mock limits input tokens only).
pub(crate) fn headers(provider: Provider, usage: &Usage) -> HeaderMap {
    let mut out = HeaderMap::new();
    let mut put = |name: String, value: String| {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::try_from(value)) {
            out.insert(name, value);
        }
    };
    let quotas = [("requests", usage.requests), ("tokens", usage.tokens)];
    for (what, quota) in quotas {
        let Some(q) = quota else { continue };
        match provider {
            Provider::OpenAi => {
                put(format!("x-ratelimit-limit-{what}"), q.limit.to_string());
                put(
                    format!("x-ratelimit-remaining-{what}"),
                    q.remaining.to_string(),
                );
                put(format!("x-ratelimit-reset-{what}"), go_duration(q.reset));
            }
            Provider::Anthropic => {
                let names: &[&str] = if what == "tokens" {
                    &["tokens", "input-tokens"]
                } else {
                    &["requests"]
                };
                let reset = rfc3339_after(q.reset);
                for name in names {
                    put(
                        format!("anthropic-ratelimit-{name}-limit"),
                        q.limit.to_string(),
                    );
                    put(
                        format!("anthropic-ratelimit-{name}-remaining"),
                        q.remaining.to_string(),
                    );
                    if let Some(reset) = &reset {
                        put(format!("anthropic-ratelimit-{name}-reset"), reset.clone());
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rpm: Option<u64>, tpm: Option<u64>) -> Limits {
        Limits {
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
        }
    }

    fn allowed(v: Result<Usage, Refusal>) -> Usage {
        v.unwrap_or_else(|r| panic!("refused: {r:?}"))
    }

    fn refused(v: Result<Usage, Refusal>) -> Refusal {
        v.expect_err("refused")
    }

    #[test]
    fn requests_slide_out_after_a_minute() {
        let l = limits(Some(2), None);
        let mut w = Window::default();
        let t0 = Instant::now();
        let u = allowed(w.admit(&l, 10, t0));
        assert_eq!(
            u.requests,
            Some(Quota {
                limit: 2,
                remaining: 1,
                reset: WINDOW
            })
        );
        assert_eq!(u.tokens, None);
        let t1 = t0 + Duration::from_secs(20);
        assert_eq!(
            allowed(w.admit(&l, 10, t1)).requests.map(|q| q.remaining),
            Some(0)
        );
        // The third call 30 s in waits for the first to leave: 30 s more.
        let t2 = t0 + Duration::from_secs(30);
        let r = refused(w.admit(&l, 10, t2));
        assert_eq!(r.exceeded, Exceeded::Requests { limit: 2 });
        assert_eq!(r.retry_after, Some(Duration::from_secs(30)));
        let q = r.usage.requests.expect("quota");
        assert_eq!((q.remaining, q.reset), (0, Duration::from_secs(50)));
        // Refused calls take nothing; at t0 + 60 s the first call has left.
        let u = allowed(w.admit(&l, 10, t0 + WINDOW));
        assert_eq!(u.requests.map(|q| q.remaining), Some(0));
    }

    #[test]
    fn tokens_wait_for_enough_to_free_and_too_large_never_fits() {
        let l = limits(None, Some(100));
        let mut w = Window::default();
        let t0 = Instant::now();
        assert_eq!(
            allowed(w.admit(&l, 40, t0)).tokens.map(|q| q.remaining),
            Some(60)
        );
        allowed(w.admit(&l, 40, t0 + Duration::from_secs(10)));
        // 80 used; 70 more fit only once both earlier calls have left (the second at t0 + 70 s).
        let r = refused(w.admit(&l, 70, t0 + Duration::from_secs(15)));
        assert_eq!(
            r.exceeded,
            Exceeded::Tokens {
                limit: 100,
                used: 80
            }
        );
        assert_eq!(r.retry_after, Some(Duration::from_secs(55)));
        // 30 fit once the first call has left (t0 + 60 s).
        let r = refused(w.admit(&l, 30, t0 + Duration::from_secs(15)));
        assert_eq!(r.retry_after, Some(Duration::from_secs(45)));
        // More than the whole limit never fits.
        let r = refused(w.admit(&l, 101, t0));
        assert_eq!(
            (r.exceeded, r.retry_after),
            (Exceeded::TooLarge { limit: 100 }, None)
        );
        assert_eq!(
            allowed(w.admit(&l, 20, t0 + Duration::from_secs(15)))
                .tokens
                .map(|q| q.remaining),
            Some(0)
        );
    }

    #[test]
    fn go_durations_read_like_openais() {
        let ms = Duration::from_millis;
        assert_eq!(go_duration(ms(0)), "0s");
        assert_eq!(go_duration(ms(20)), "20ms");
        assert_eq!(go_duration(ms(6000)), "6s");
        assert_eq!(go_duration(ms(1500)), "1.5s");
        assert_eq!(go_duration(ms(59_981)), "59.981s");
        assert_eq!(go_duration(ms(60_000)), "1m0s");
        assert_eq!(go_duration(ms(390_000)), "6m30s");
        assert_eq!(go_duration(ms(3_600_000)), "1h0m0s");
    }

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_709_251_199), "2024-02-29T23:59:59Z");
        assert_eq!(rfc3339(1_735_689_600), "2025-01-01T00:00:00Z");
        assert_eq!(rfc3339(4_102_444_800), "2100-01-01T00:00:00Z");
    }

    #[test]
    fn anthropic_resets_are_rfc3339_whole_seconds() {
        let s = rfc3339_after(Duration::from_millis(1500)).expect("formats");
        assert_eq!(s.len(), "2025-01-01T00:00:00Z".len(), "{s}");
        assert!(s.ends_with('Z') && s.as_bytes()[10] == b'T', "{s}");
    }

    #[test]
    fn headers_in_each_providers_names() {
        let q = |limit, remaining| {
            Some(Quota {
                limit,
                remaining,
                reset: Duration::from_secs(6),
            })
        };
        let usage = Usage {
            requests: q(3, 1),
            tokens: q(100, 40),
        };
        let h = headers(Provider::OpenAi, &usage);
        assert_eq!(h["x-ratelimit-limit-requests"], "3");
        assert_eq!(h["x-ratelimit-remaining-requests"], "1");
        assert_eq!(h["x-ratelimit-reset-requests"], "6s");
        assert_eq!(h["x-ratelimit-remaining-tokens"], "40");
        let h = headers(Provider::Anthropic, &usage);
        assert_eq!(h["anthropic-ratelimit-requests-limit"], "3");
        assert_eq!(h["anthropic-ratelimit-tokens-remaining"], "40");
        assert_eq!(h["anthropic-ratelimit-input-tokens-remaining"], "40");
        assert!(h.contains_key("anthropic-ratelimit-requests-reset"));
        let h = headers(
            Provider::OpenAi,
            &Usage {
                requests: q(3, 1),
                tokens: None,
            },
        );
        assert!(!h.contains_key("x-ratelimit-limit-tokens"));
    }
}
