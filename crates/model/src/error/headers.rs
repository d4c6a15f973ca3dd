//! What the providers' response headers say about waiting: `retry-after`, when an exhausted
//! rate limit resets, and the rate limits they enforce.

use std::time::{Duration, SystemTime};

use reqwest::header::HeaderMap;

/// `retry-after-ms` (milliseconds, possibly fractional) if present and valid, else
/// `retry-after` (delay in seconds, or an HTTP date relative to `now`).
pub fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    if let Some(ms) = header("retry-after-ms").and_then(parse_non_negative) {
        return Duration::try_from_secs_f64(ms / 1000.0).ok();
    }
    let value = header("retry-after")?;
    if let Some(secs) = parse_non_negative(value) {
        return Duration::try_from_secs_f64(secs).ok();
    }
    let at =
        time::OffsetDateTime::parse(value, &time::format_description::well_known::Rfc2822).ok()?;
    let at = SystemTime::from(at);
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// When an exhausted rate limit resets, from the providers' rate-limit headers: OpenAI's
/// `x-ratelimit-reset-{requests,tokens}` (a duration such as `6s`, `1m0s`, `20ms`) and
/// Anthropic's `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-reset` (an
/// RFC 3339 time), for each limit whose `…-remaining` is 0; the latest of them.
pub fn rate_limit_reset(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    let exhausted = |remaining: &str| header(remaining).is_some_and(|v| v == "0");
    let mut latest: Option<Duration> = None;
    let mut consider = |d: Option<Duration>| {
        if let Some(d) = d {
            latest = Some(latest.map_or(d, |l| l.max(d)));
        }
    };
    for limit in ["requests", "tokens"] {
        if exhausted(&format!("x-ratelimit-remaining-{limit}")) {
            consider(header(&format!("x-ratelimit-reset-{limit}")).and_then(parse_go_duration));
        }
    }
    for limit in ["requests", "tokens", "input-tokens", "output-tokens"] {
        if exhausted(&format!("anthropic-ratelimit-{limit}-remaining")) {
            consider(
                header(&format!("anthropic-ratelimit-{limit}-reset"))
                    .and_then(|v| {
                        time::OffsetDateTime::parse(
                            v,
                            &time::format_description::well_known::Rfc3339,
                        )
                        .ok()
                    })
                    .map(|at| {
                        SystemTime::from(at)
                            .duration_since(now)
                            .unwrap_or(Duration::ZERO)
                    }),
            );
        }
    }
    latest
}

/// The rate limits a provider says it enforces on the caller, from its response headers:
/// OpenAI's `x-ratelimit-limit-{requests,tokens}` and Anthropic's
/// `anthropic-ratelimit-requests-limit` and `anthropic-ratelimit-input-tokens-limit` (else
/// `-tokens-limit`). Both are per minute. Kedge paces its calls by input tokens, which is what
/// Anthropic's input-token limit counts (OpenAI also counts the requested output tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateLimits {
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
}

impl RateLimits {
    /// The limits the headers name; `None` when they name none.
    pub fn from_headers(headers: &HeaderMap) -> Option<RateLimits> {
        let number = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|n| *n > 0)
        };
        let limits = RateLimits {
            requests_per_minute: number("x-ratelimit-limit-requests")
                .or_else(|| number("anthropic-ratelimit-requests-limit")),
            tokens_per_minute: number("x-ratelimit-limit-tokens")
                .or_else(|| number("anthropic-ratelimit-input-tokens-limit"))
                .or_else(|| number("anthropic-ratelimit-tokens-limit")),
        };
        (limits != RateLimits::default()).then_some(limits)
    }
}

/// A duration as OpenAI's rate-limit headers write it: numbers with units `h`, `m`, `s`, `ms`
/// (`1m0s`, `6s`, `20ms`, `0.5s`).
fn parse_go_duration(text: &str) -> Option<Duration> {
    let mut total = 0.0_f64;
    let mut rest = text;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let split = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        let (number, tail) = rest.split_at(split);
        let value: f64 = number.parse().ok()?;
        let (scale, tail) = if let Some(t) = tail.strip_prefix("ms") {
            (0.001, t)
        } else if let Some(t) = tail.strip_prefix('h') {
            (3600.0, t)
        } else if let Some(t) = tail.strip_prefix('m') {
            (60.0, t)
        } else if let Some(t) = tail.strip_prefix('s') {
            (1.0, t)
        } else {
            return None;
        };
        total += value * scale;
        rest = tail;
    }
    Duration::try_from_secs_f64(total).ok()
}

fn parse_non_negative(s: &str) -> Option<f64> {
    s.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::error::ModelError;
    use reqwest::header::HeaderValue;

    #[test]
    fn rate_limits_in_each_providers_headers() {
        let openai = headers(&[
            ("x-ratelimit-limit-requests", "1500"),
            ("x-ratelimit-limit-tokens", "40000"),
            ("x-ratelimit-remaining-requests", "1499"),
        ]);
        assert_eq!(
            RateLimits::from_headers(&openai),
            Some(RateLimits {
                requests_per_minute: Some(1500),
                tokens_per_minute: Some(40000),
            })
        );
        let anthropic = headers(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-tokens-limit", "90000"),
            ("anthropic-ratelimit-input-tokens-limit", "30000"),
        ]);
        assert_eq!(
            RateLimits::from_headers(&anthropic),
            Some(RateLimits {
                requests_per_minute: Some(50),
                tokens_per_minute: Some(30000),
            })
        );
        // Nothing named, a zero or garbage: nothing learned.
        assert_eq!(RateLimits::from_headers(&headers(&[])), None);
        let bad = headers(&[
            ("x-ratelimit-limit-requests", "0"),
            ("x-ratelimit-limit-tokens", "lots"),
        ]);
        assert_eq!(RateLimits::from_headers(&bad), None);
    }

    pub(crate) fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("header"));
        }
        h
    }

    #[test]
    fn a_429_without_retry_after_waits_for_the_exhausted_limit_to_reset() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let openai = headers(&[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "1m30s"),
            ("x-ratelimit-remaining-tokens", "100"),
            ("x-ratelimit-reset-tokens", "5m0s"),
        ]);
        let e = ModelError::from_response(429, &openai, b"", now);
        assert_eq!(e.retry_after, Some(Duration::from_secs(90)));
        assert_eq!(parse_go_duration("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(
            parse_go_duration("1h2m3.5s"),
            Some(Duration::from_millis(3_723_500))
        );
        assert_eq!(parse_go_duration("soon"), None);
        let at = time::OffsetDateTime::from(now + Duration::from_secs(42))
            .format(&time::format_description::well_known::Rfc3339)
            .expect("format");
        let anthropic = headers(&[
            ("anthropic-ratelimit-tokens-remaining", "0"),
            ("anthropic-ratelimit-tokens-reset", at.as_str()),
        ]);
        let e = ModelError::from_response(429, &anthropic, b"", now);
        assert_eq!(e.retry_after, Some(Duration::from_secs(42)));
        // A retry-after wins; nothing exhausted says nothing; only a 429 reads them.
        let both = headers(&[
            ("retry-after", "3"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "1m0s"),
        ]);
        assert_eq!(
            ModelError::from_response(429, &both, b"", now).retry_after,
            Some(Duration::from_secs(3))
        );
        let fine = headers(&[
            ("x-ratelimit-remaining-requests", "10"),
            ("x-ratelimit-reset-requests", "1m0s"),
        ]);
        assert_eq!(
            ModelError::from_response(429, &fine, b"", now).retry_after,
            None
        );
        assert_eq!(
            ModelError::from_response(503, &openai, b"", now).retry_after,
            None
        );
    }

    #[test]
    fn retry_after_prefers_milliseconds() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_400);
        let h = headers(&[("retry-after-ms", "250"), ("retry-after", "3")]);
        assert_eq!(retry_after(&h, now), Some(Duration::from_millis(250)));
        let h = headers(&[("retry-after-ms", "1.5")]);
        assert_eq!(retry_after(&h, now), Some(Duration::from_micros(1500)));
        let h = headers(&[("retry-after-ms", "soon"), ("retry-after", "3")]);
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(3)));
        let h = headers(&[("retry-after", "-1")]);
        assert_eq!(retry_after(&h, now), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

    #[test]
    fn retry_after_accepts_an_http_date() {
        // Wed, 21 Oct 2015 07:28:00 GMT = 1445412480.
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_470);
        let h = headers(&[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")]);
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(10)));
        let later = now + Duration::from_secs(60);
        assert_eq!(retry_after(&h, later), Some(Duration::ZERO));
    }
}
