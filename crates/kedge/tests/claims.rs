//! The operation claim in `kedge_idempotency` owns the abandonment rule: a young `running`
//! record is held, an old one (or one whose dispatch the journal superseded) is taken over by
//! exactly one of concurrent takers, and a released dispatch never runs again.

mod common;

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
        ids.claim(&op, &d, "a", 0, LONG).await.expect("claim"),
        Claim::Fresh { .. }
    ));
    // Young: a live runner.
    match ids.claim(&op, &d, "b", 0, LONG).await.expect("claim") {
        Claim::Held { runner, retry_in } => {
            assert_eq!(runner, "a");
            assert!(retry_in <= LONG && retry_in > LONG - Duration::from_secs(60));
        }
        other => panic!("held expected: {other:?}"),
    }
    // Old (abandonment age zero): of two concurrent takers exactly one wins.
    let (b, c) = tokio::join!(
        ids.claim(&op, &d, "b", 0, Duration::ZERO),
        ids.claim(&op, &d, "c", 0, Duration::ZERO)
    );
    let outcomes = [b.expect("claim"), c.expect("claim")];
    let won = outcomes
        .iter()
        .filter(|o| matches!(o, Claim::TakenOver { redispatched: false, previous, .. } if previous == "a"))
        .count();
    assert_eq!(won, 1, "{outcomes:?}");
    // A later dispatch the journal ordered takes over however young the record is.
    let revision = match ids.claim(&op, &d, "d", 1, LONG).await.expect("claim") {
        Claim::TakenOver {
            revision,
            redispatched: true,
            ..
        } => revision,
        other => panic!("taken over expected: {other:?}"),
    };
    // Given back: that dispatch never runs again; the next one claims it afresh.
    ids.release(&op, revision, &d, "d", 1)
        .await
        .expect("release");
    assert_eq!(
        ids.claim(&op, &d, "e", 1, Duration::ZERO)
            .await
            .expect("claim"),
        Claim::Released
    );
    assert!(matches!(
        ids.claim(&op, &d, "e", 2, LONG).await.expect("claim"),
        Claim::Fresh { .. }
    ));
    // Other arguments under the same id: a conflict, whatever the record's age.
    assert!(matches!(
        ids.claim(&op, &Digest::of_bytes(b"other"), "f", 2, Duration::ZERO)
            .await
            .expect("claim"),
        Claim::Conflict { .. }
    ));
    h.shutdown().await;
}
