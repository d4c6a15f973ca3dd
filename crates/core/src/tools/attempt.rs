//! Where an operation under a retry policy stands: the number its record in
//! `kedge_idempotency` is claimed under ([`claim_dispatch`]) and its next attempt
//! ([`NextAttempt`]).

use super::{MAX_BACKOFF_MS, MAX_TOOL_ATTEMPTS};

/// The dispatch number an operation's record in `kedge_idempotency` is claimed under, for
/// attempt `attempt` (1 for the first) of dispatch `dispatch` of an operation whose request
/// carries a retry policy (`retried`). The record's claim orders dispatches: a claim with a
/// greater number than the record's takes over what the journal has superseded, without a
/// confirm query. Attempts are ordered the same way inside a dispatch: attempt n+1 is claimed
/// only after attempt n's failure is journaled (`tool.attempt`), so it supersedes it.
/// An operation without a policy (one attempt) keeps the plain dispatch number, so records
/// written before policies existed mean what they meant.
pub fn claim_dispatch(dispatch: u32, attempt: u32, retried: bool) -> u32 {
    if !retried {
        return dispatch;
    }
    // Room for MAX_TOOL_ATTEMPTS per dispatch (16 > 10); a later dispatch is always greater
    // than any attempt of an earlier one.
    const STRIDE: u32 = 16;
    dispatch
        .saturating_mul(STRIDE)
        .saturating_add(attempt.clamp(1, STRIDE) - 1)
}

/// Whether a claim under `code` takes over a `running` record claimed under `held` as
/// superseded, without a confirm query (what the record's call did, the journal already moved
/// past): a record of an earlier dispatch (below `supersedes_below`, the first number of the
/// claimer's dispatch: [`claim_dispatch`] of its attempt 1) at once, even while its runner still
/// runs (the journal ordered the later dispatch); a record of an earlier attempt of the
/// claimer's own dispatch (below `code`) only once its runner is gone or its record abandoned
/// (`holder_gone`): the journal holds that attempt's failure, and nothing starts beside a live
/// attempt. One rule for every taker: the operation record's claim and the takeover of a gone
/// runner's operation (docs/ARCHITECTURE.md "Tool retries").
pub fn supersedes(held: u32, code: u32, supersedes_below: u32, holder_gone: bool) -> bool {
    held < supersedes_below || (holder_gone && held < code)
}

/// Where an operation under a retry policy stands in one dispatch, from its journaled
/// `tool.attempt`s: the attempt to make next, and when it is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NextAttempt {
    /// 1 when no attempt of the dispatch has failed yet.
    pub number: u32,
    /// The last failed attempt's `retry_at`: no runner starts the next one earlier.
    pub due: Option<crate::event::Timestamp>,
}

impl NextAttempt {
    /// Before any attempt of a dispatch failed.
    pub const FIRST: NextAttempt = NextAttempt {
        number: 1,
        due: None,
    };

    /// Where the dispatch stands after `failed`, a `tool.attempt` of it journaled at `at` (its
    /// envelope's time), or `None` when `failed` changes nothing: the one rule for reading a
    /// `tool.attempt`, which the fold ([`crate::fold()`]) and the runners both apply.
    ///
    /// A failure is taken only if it is later than what is known (attempts are numbered up,
    /// a repeat changes nothing) and a real attempt: numbers outside 1..=[`MAX_TOOL_ATTEMPTS`]
    /// are set aside (no policy makes them: a forged or buggy event). Its `retry_at` is held to
    /// at most [`MAX_BACKOFF_MS`] after `at`, so no event parks an operation longer than the
    /// longest backoff a policy can ask for.
    pub fn after(
        self,
        failed: &crate::event::ToolAttempt,
        at: crate::event::Timestamp,
    ) -> Option<NextAttempt> {
        if !(1..=MAX_TOOL_ATTEMPTS).contains(&failed.attempt) || failed.attempt < self.number {
            return None;
        }
        let latest = at.saturating_add(std::time::Duration::from_millis(MAX_BACKOFF_MS as u64));
        let due = if failed.retry_at.0 > latest.0 {
            latest
        } else {
            failed.retry_at
        };
        Some(NextAttempt {
            number: failed.attempt + 1,
            due: Some(due),
        })
    }
}

/// The next attempt of dispatch `dispatch`, given the operation's `tool.attempt`s in journal
/// order, each with its envelope's time (repeats and other dispatches included): what
/// [`NextAttempt::after`] makes of them.
pub fn next_attempt<'a>(
    attempts: impl IntoIterator<Item = (&'a crate::event::ToolAttempt, crate::event::Timestamp)>,
    dispatch: u32,
) -> NextAttempt {
    attempts
        .into_iter()
        .filter(|(a, _)| a.dispatch == dispatch)
        .fold(NextAttempt::FIRST, |next, (a, at)| {
            next.after(a, at).unwrap_or(next)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::ToolErrorClass;

    #[test]
    fn claim_numbers_order_dispatches_then_attempts_and_keep_plain_dispatches() {
        for d in 0..50 {
            assert_eq!(
                claim_dispatch(d, 1, false),
                d,
                "no policy: the plain dispatch"
            );
        }
        let mut last = None;
        for d in 0..6u32 {
            for a in 1..=MAX_TOOL_ATTEMPTS {
                let n = claim_dispatch(d, a, true);
                if let Some(prev) = last {
                    assert!(n > prev, "({d}, {a}) = {n} after {prev}");
                }
                last = Some(n);
            }
        }
        // A later dispatch supersedes every attempt of an earlier one.
        assert!(claim_dispatch(1, 1, true) > claim_dispatch(0, MAX_TOOL_ATTEMPTS, true));
        assert_eq!(claim_dispatch(u32::MAX, 5, true), u32::MAX, "saturates");
    }

    #[test]
    fn an_earlier_dispatch_is_superseded_at_once_and_an_earlier_attempt_once_its_runner_is_gone() {
        for gone in [false, true] {
            // Without a policy the numbers are dispatches: an earlier one is superseded even
            // while its runner runs; the same one never.
            let (d0, d1) = (claim_dispatch(0, 1, false), claim_dispatch(1, 1, false));
            assert!(supersedes(d0, d1, d1, gone));
            assert!(!supersedes(d1, d1, d1, gone));
            // Under a policy: every attempt of an earlier dispatch, at once.
            let first = claim_dispatch(1, 1, true);
            for a in 1..=MAX_TOOL_ATTEMPTS {
                assert!(supersedes(claim_dispatch(0, a, true), first, first, gone));
            }
        }
        // An earlier attempt of the same dispatch (its failure journaled): only once its runner
        // is gone or its record abandoned, never beside a live one.
        let (first, held, now) = (
            claim_dispatch(2, 1, true),
            claim_dispatch(2, 2, true),
            claim_dispatch(2, 3, true),
        );
        assert!(supersedes(held, now, first, true));
        assert!(!supersedes(held, now, first, false));
        // The attempt being claimed, or a later record (a newer dispatch's): never.
        assert!(!supersedes(now, now, first, true));
        assert!(!supersedes(now, held, first, true));
        let later = claim_dispatch(3, 1, true);
        assert!(!supersedes(later, now, first, true));
    }

    #[test]
    fn the_next_attempt_follows_the_last_failed_one_of_the_same_dispatch() {
        use crate::event::{Timestamp, ToolAttempt};
        let at = |s: i64| Timestamp(time::OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(s));
        let failed = |attempt, dispatch, t| {
            (
                ToolAttempt {
                    attempt,
                    dispatch,
                    class: ToolErrorClass::Transient,
                    error: "x".into(),
                    delay_ms: 1,
                    retry_at: at(t),
                },
                at(0),
            )
        };
        let of =
            |j: &[(ToolAttempt, Timestamp)], d| next_attempt(j.iter().map(|(a, t)| (a, *t)), d);
        assert_eq!(of(&[], 0), NextAttempt::FIRST);
        let journal = [
            failed(2, 0, 20),
            failed(1, 0, 10),
            failed(2, 0, 20),
            failed(5, 1, 99),
        ];
        assert_eq!(
            of(&journal, 0),
            NextAttempt {
                number: 3,
                due: Some(at(20))
            }
        );
        assert_eq!(
            of(&journal, 1),
            NextAttempt {
                number: 6,
                due: Some(at(99))
            }
        );
        assert_eq!(of(&journal, 2), NextAttempt::FIRST);
    }

    #[test]
    fn a_tool_attempt_parks_an_operation_no_longer_than_the_longest_backoff() {
        use crate::event::{Timestamp, ToolAttempt};
        let at = |s: i64| Timestamp(time::OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(s));
        let failed = |attempt, retry_at| ToolAttempt {
            attempt,
            dispatch: 0,
            class: ToolErrorClass::Transient,
            error: "x".into(),
            delay_ms: 1,
            retry_at,
        };
        let max = MAX_BACKOFF_MS / 1000;
        // Years ahead, or the end of time: due at most the longest backoff after the event.
        for far in [at(100 + 3 * 365 * 86_400), Timestamp::MAX] {
            assert_eq!(
                NextAttempt::FIRST.after(&failed(1, far), at(100)),
                Some(NextAttempt {
                    number: 2,
                    due: Some(at(100 + max))
                })
            );
        }
        // Within the bound: as journaled.
        assert_eq!(
            NextAttempt::FIRST.after(&failed(1, at(130)), at(100)),
            Some(NextAttempt {
                number: 2,
                due: Some(at(130))
            })
        );
        // No policy makes attempt 0 or more than MAX_TOOL_ATTEMPTS: set aside, whatever came
        // before; an earlier number than what is known changes nothing.
        for n in [0, MAX_TOOL_ATTEMPTS + 1, u32::MAX] {
            assert_eq!(NextAttempt::FIRST.after(&failed(n, at(1)), at(0)), None);
        }
        let third = NextAttempt {
            number: 3,
            due: Some(at(5)),
        };
        assert_eq!(third.after(&failed(1, at(9)), at(0)), None);
        assert_eq!(
            third.after(&failed(MAX_TOOL_ATTEMPTS, at(9)), at(0)),
            Some(NextAttempt {
                number: MAX_TOOL_ATTEMPTS + 1,
                due: Some(at(9))
            })
        );
    }
}
