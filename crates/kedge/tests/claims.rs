//! The operation claim in `kedge_idempotency` owns the abandonment rule: a young `running`
//! record is held, an old one (or one whose dispatch the journal superseded) is taken over by
//! exactly one of concurrent takers, and a released dispatch never runs again.

use crate::common;

use std::time::Duration;

use common::Harness;
use kedge_core::event::Digest;
use kedge_core::ids::{OperationId, RunId, StepNo};
use kedge_runtime::idempotency::Claim;
use serde_json::json;

const LONG: Duration = Duration::from_secs(3600);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_taken_over_once_and_released() {
    let h = Harness::start(json!({"models": {}}), &[]).await;
    let ids = &h.rt.idempotency;
    let run = RunId::generate();
    let op = OperationId::new(&run, StepNo(1), 0);
    let d = Digest::of_bytes(b"args");

    assert!(matches!(
        ids.claim(&op, &d, &common::worker("a"), 0, LONG)
            .await
            .expect("claim"),
        Claim::Fresh { .. }
    ));
    // Young: a live runner.
    match ids
        .claim(&op, &d, &common::worker("b"), 0, LONG)
        .await
        .expect("claim")
    {
        Claim::Held {
            runner,
            retry_in,
            dispatch,
        } => {
            assert_eq!(runner, "a");
            assert_eq!(dispatch, 0);
            assert!(retry_in <= LONG && retry_in > LONG - Duration::from_secs(60));
        }
        other => panic!("held expected: {other:?}"),
    }
    // Old (abandonment age zero): of two concurrent takers exactly one wins.
    let (wb, wc) = (common::worker("b"), common::worker("c"));
    let (b, c) = tokio::join!(
        ids.claim(&op, &d, &wb, 0, Duration::ZERO),
        ids.claim(&op, &d, &wc, 0, Duration::ZERO)
    );
    let outcomes = [b.expect("claim"), c.expect("claim")];
    let won = outcomes
        .iter()
        .filter(|o| matches!(o, Claim::TakenOver { redispatched: false, previous, .. } if previous == "a"))
        .count();
    assert_eq!(won, 1, "{outcomes:?}");
    // A later dispatch the journal ordered takes over however young the record is.
    let revision = match ids
        .claim(&op, &d, &common::worker("d"), 1, LONG)
        .await
        .expect("claim")
    {
        Claim::TakenOver {
            revision,
            redispatched: true,
            ..
        } => revision,
        other => panic!("taken over expected: {other:?}"),
    };
    // Given back: that dispatch never runs again; the next one claims it afresh.
    ids.release(&op, revision, &d, &common::worker("d"), 1)
        .await
        .expect("release");
    assert_eq!(
        ids.claim(&op, &d, &common::worker("e"), 1, Duration::ZERO)
            .await
            .expect("claim"),
        Claim::Released
    );
    assert!(matches!(
        ids.claim(&op, &d, &common::worker("e"), 2, LONG)
            .await
            .expect("claim"),
        Claim::Fresh { .. }
    ));
    // Other arguments under the same id: a conflict, whatever the record's age.
    assert!(matches!(
        ids.claim(
            &op,
            &Digest::of_bytes(b"other"),
            &common::worker("f"),
            2,
            Duration::ZERO
        )
        .await
        .expect("claim"),
        Claim::Conflict { .. }
    ));
    h.shutdown().await;
}

/// Under a retry policy, a later attempt's number does not supersede an earlier attempt that
/// still runs (a `tool.attempt` in the journal is not proof the attempt ended): it is held, or
/// taken over with a confirm query once its runner is gone; a later dispatch still supersedes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_attempt_never_supersedes_a_running_one() {
    use kedge_core::tools::claim_dispatch;
    let h = Harness::start(json!({"models": {}}), &[]).await;
    let ids = &h.rt.idempotency;
    let run = RunId::generate();
    let op = OperationId::new(&run, StepNo(1), 0);
    let d = Digest::of_bytes(b"args");
    let base = claim_dispatch(0, 1, true);
    assert!(matches!(
        ids.claim_attempt(&op, &d, &common::worker("a"), base, base, LONG)
            .await
            .expect("claim"),
        Claim::Fresh { .. }
    ));
    // Attempt 2 while attempt 1 runs on a live runner: held.
    let second = claim_dispatch(0, 2, true);
    assert!(matches!(
        ids.claim_attempt(&op, &d, &common::worker("b"), second, base, LONG)
            .await
            .expect("claim"),
        Claim::Held { .. }
    ));
    // Its runner gone: superseded without a confirm query (attempt 2 is claimed only once the
    // journal holds attempt 1's failure; its runner died before giving the record back).
    assert!(matches!(
        ids.claim_from(&op, &d, &common::worker("b"), second, base, LONG, Some("a"))
            .await
            .expect("claim"),
        Claim::TakenOver {
            redispatched: true,
            ..
        }
    ));
    // The same attempt of a gone runner is taken over, but asked about first.
    assert!(matches!(
        ids.claim_from(&op, &d, &common::worker("c"), second, base, LONG, Some("b"))
            .await
            .expect("claim"),
        Claim::TakenOver {
            redispatched: false,
            ..
        }
    ));
    // A later dispatch supersedes a running attempt of an earlier one.
    let next_dispatch = claim_dispatch(1, 1, true);
    assert!(matches!(
        ids.claim_attempt(
            &op,
            &d,
            &common::worker("c"),
            next_dispatch,
            next_dispatch,
            LONG
        )
        .await
        .expect("claim"),
        Claim::TakenOver {
            redispatched: true,
            ..
        }
    ));
    h.shutdown().await;
}
