//! Run leases with a per-key TTL in `kedge_leases`.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kedge_journal::{ErrorKind, LeaseError, Leases};

async fn leases() -> (kedge_testkit::NatsServer, Leases) {
    let (server, journal) = setup().await;
    (server, Leases::new(journal.client().clone()))
}

/// Tries to acquire until it works or `within` passes; returns the lease and how long it took.
async fn acquire_when_free(
    leases: &Leases,
    run: &kedge_core::RunId,
    owner: &str,
    ttl: Duration,
    within: Duration,
) -> (kedge_journal::Lease, Duration) {
    let start = Instant::now();
    loop {
        match leases.acquire(run, &worker(owner), ttl).await {
            Ok(l) => return (l, start.elapsed()),
            Err(LeaseError::Held { .. }) if start.elapsed() < within => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("{owner} could not acquire within {within:?}: {e:?}"),
        }
    }
}

#[tokio::test]
async fn acquire_hold_renew_release_and_the_revision_grows() {
    let (_server, leases) = leases().await;
    let run = new_run();
    let ttl = Duration::from_secs(30);
    let a = leases
        .acquire(&run, &worker("worker-a"), ttl)
        .await
        .unwrap();
    assert_eq!(a.owner.as_str(), "worker-a");

    let held = leases
        .acquire(&run, &worker("worker-b"), ttl)
        .await
        .unwrap_err();
    assert_eq!(
        held,
        LeaseError::Held {
            owner: "worker-a".into(),
            revision: a.revision
        }
    );
    assert_eq!(held.kind(), ErrorKind::Conflict);
    let holder = leases.holder(&run).await.unwrap().expect("held");
    assert_eq!(
        (holder.owner.as_str(), holder.revision, holder.ttl),
        (a.owner.as_str(), a.revision, a.ttl)
    );

    let a2 = leases.renew(&a).await.unwrap();
    assert!(a2.revision > a.revision);
    // The old token is stale now.
    assert!(matches!(
        leases.renew(&a).await,
        Err(LeaseError::Lost { .. })
    ));

    leases.release(a2.clone()).await.unwrap();
    assert_eq!(leases.holder(&run).await.unwrap(), None);
    let b = leases
        .acquire(&run, &worker("worker-b"), ttl)
        .await
        .unwrap();
    assert!(b.revision > a2.revision);
    assert!(matches!(
        leases.renew(&a2).await,
        Err(LeaseError::Lost { .. })
    ));
    assert!(matches!(
        leases.release(a2).await,
        Err(LeaseError::Lost { .. })
    ));

    assert!(matches!(
        leases
            .acquire(&run, &worker("w"), Duration::from_millis(1500))
            .await,
        Err(LeaseError::InvalidTtl(_))
    ));
    assert!(matches!(
        leases.acquire(&run, &worker("w"), Duration::ZERO).await,
        Err(LeaseError::InvalidTtl(_))
    ));
}

#[tokio::test]
async fn a_lease_expires_after_its_ttl_and_can_be_taken_over() {
    let (_server, leases) = leases().await;
    let run = new_run();
    let a = leases
        .acquire(&run, &worker("worker-a"), Duration::from_secs(1))
        .await
        .unwrap();
    let (b, took) = acquire_when_free(
        &leases,
        &run,
        "worker-b",
        Duration::from_secs(1),
        Duration::from_secs(5),
    )
    .await;
    assert!(
        took >= Duration::from_millis(800),
        "expired early: {took:?}"
    );
    assert!(b.revision > a.revision);
    assert!(matches!(
        leases.renew(&a).await,
        Err(LeaseError::Lost { .. })
    ));
    // The taken-over lease expires too (the async-nats bug this module works around).
    let (c, _) = acquire_when_free(
        &leases,
        &run,
        "worker-c",
        Duration::from_secs(1),
        Duration::from_secs(5),
    )
    .await;
    assert!(c.revision > b.revision);
}

#[tokio::test]
async fn renewing_keeps_a_lease_and_a_renewed_lease_still_expires() {
    let (_server, leases) = leases().await;
    let run = new_run();
    let ttl = Duration::from_secs(2);
    let start = Instant::now();
    let a = leases
        .acquire(&run, &worker("worker-a"), ttl)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let a = leases.renew(&a).await.unwrap();
    let renewed_at = start.elapsed();
    // Past the first TTL, still held thanks to the renewal.
    tokio::time::sleep(Duration::from_millis(2500).saturating_sub(start.elapsed())).await;
    assert!(start.elapsed() < renewed_at + ttl);
    assert!(matches!(
        leases.acquire(&run, &worker("worker-b"), ttl).await,
        Err(LeaseError::Held { revision, .. }) if revision == a.revision
    ));
    // Not renewed again: it expires about one TTL after the renewal.
    let (b, _) = acquire_when_free(&leases, &run, "worker-b", ttl, Duration::from_secs(5)).await;
    assert!(
        start.elapsed() >= renewed_at + ttl - Duration::from_millis(200),
        "expired early"
    );
    assert!(b.revision > a.revision);
}

#[tokio::test]
async fn a_release_hint_takes_the_lease_back_only_while_nobody_took_it_since() {
    let (_server, leases) = leases().await;
    let run = new_run();
    let ttl = Duration::from_secs(10);
    let a = leases
        .acquire(&run, &worker("worker-a"), ttl)
        .await
        .unwrap();
    let released = leases.release(a).await.unwrap();
    // Nobody took it since: the hint works.
    let a2 = leases
        .acquire_after(&run, &worker("worker-a"), ttl, Some(released))
        .await
        .unwrap();
    // Held: a stale hint does not take it from the holder.
    assert!(matches!(
        leases
            .acquire_after(&run, &worker("worker-b"), ttl, Some(released))
            .await,
        Err(LeaseError::Held { .. })
    ));
    let released2 = leases.release(a2).await.unwrap();
    let b = leases
        .acquire(&run, &worker("worker-b"), ttl)
        .await
        .unwrap();
    leases.release(b).await.unwrap();
    // Someone took and released it since: the old hint misses, the fallback still acquires.
    let a3 = leases
        .acquire_after(&run, &worker("worker-a"), ttl, Some(released2))
        .await
        .unwrap();
    assert_eq!(
        leases.holder(&run).await.unwrap().unwrap().owner,
        "worker-a"
    );
    assert!(a3.revision > released2.seq);
}

#[tokio::test]
async fn a_gone_holders_lease_is_taken_over_at_once_by_exactly_one_taker() {
    let (_server, leases) = leases().await;
    let run = new_run();
    let ttl = Duration::from_secs(30);
    let a = leases
        .acquire(&run, &worker("worker-a"), ttl)
        .await
        .unwrap();
    let Err(LeaseError::Held { owner, revision }) =
        leases.acquire(&run, &worker("worker-b"), ttl).await
    else {
        panic!("held by a");
    };
    assert_eq!(owner, "worker-a");
    // Two takers race on the revision they saw: one wins, long before the TTL.
    let (wb, wc) = (worker("worker-b"), worker("worker-c"));
    let (b, c) = tokio::join!(
        leases.take_over(&run, &wb, ttl, revision),
        leases.take_over(&run, &wc, ttl, revision)
    );
    let won = match (b, c) {
        (Ok(l), Err(LeaseError::Lost { .. })) | (Err(LeaseError::Lost { .. }), Ok(l)) => l,
        other => panic!("exactly one taker wins: {other:?}"),
    };
    assert!(won.revision > a.revision);
    assert_eq!(
        leases.holder(&run).await.unwrap().unwrap().owner,
        won.owner.as_str()
    );
    // The old holder is fenced: its renewal and release fail.
    assert!(matches!(
        leases.renew(&a).await,
        Err(LeaseError::Lost { .. })
    ));
    assert!(matches!(
        leases.release(a).await,
        Err(LeaseError::Lost { .. })
    ));
    // A holder that renewed since the taker looked keeps its lease.
    let renewed = leases.renew(&won).await.unwrap();
    assert!(matches!(
        leases
            .take_over(&run, &worker("worker-d"), ttl, won.revision)
            .await,
        Err(LeaseError::Lost { .. })
    ));
    assert_eq!(
        leases.holder(&run).await.unwrap().unwrap().revision,
        renewed.revision
    );
}
