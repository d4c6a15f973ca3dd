//! Adaptive admission on a real Tokio runtime (docs/ARCHITECTURE.md "Fairness across
//! tenants"): a process starved of CPU lowers its workers' limit, a calm one whose slots are all
//! in use raises it back to the configured concurrency, handlers that only wait keep it whole,
//! and a graceful stop still waits for every handler.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kedge_runtime::consumer::{Probe, Workers};

const MAX: usize = 64;
/// Far beyond what a decision takes (one every 100 ms): a bound against a limit that never
/// moves, not a timing goal.
const WITHIN: Duration = Duration::from_secs(20);

async fn until(what: &str, workers: &Workers, ok: impl Fn(usize) -> bool) {
    let deadline = Instant::now() + WITHIN;
    while !ok(workers.limit()) {
        assert!(
            Instant::now() < deadline,
            "{what}: the limit stayed at {}",
            workers.limit()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starved_process_lowers_the_limit_and_a_calm_busy_one_raises_it_back() {
    let workers = Workers::adaptive(MAX, Some(Probe::Scheduling), "test");
    assert_eq!(workers.limit(), MAX);

    // Handlers that only wait (a model, a tool) add no lag: the limit stays whole.
    for _ in 0..MAX {
        workers
            .spawn(async { tokio::time::sleep(Duration::from_millis(600)).await })
            .await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(workers.limit(), MAX, "waiting handlers cost no CPU");

    // Tasks that hold the runtime's threads for 30 ms at a time: every timer runs late.
    let hogging = Arc::new(AtomicBool::new(true));
    let hogs: Vec<_> = (0..6)
        .map(|_| {
            let hogging = hogging.clone();
            tokio::spawn(async move {
                while hogging.load(Ordering::Relaxed) {
                    let busy = Instant::now();
                    while busy.elapsed() < Duration::from_millis(30) {
                        std::hint::spin_loop();
                    }
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    until("starved", &workers, |l| l < MAX / 2).await;
    hogging.store(false, Ordering::Relaxed);
    for h in hogs {
        h.await.expect("hog");
    }

    // Calm again, and every slot the limit allows is in use: it grows back to the whole.
    let holding = Arc::new(AtomicBool::new(true));
    let filler = tokio::spawn({
        let workers = workers.clone();
        let holding = holding.clone();
        async move {
            while holding.load(Ordering::Relaxed) {
                let holding = holding.clone();
                workers
                    .spawn(async move {
                        while holding.load(Ordering::Relaxed) {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    })
                    .await;
            }
        }
    });
    until("calm and busy", &workers, |l| l == MAX).await;
    holding.store(false, Ordering::Relaxed);
    filler.abort();

    // A graceful stop gives the held permits back and waits for every handler.
    tokio::time::timeout(WITHIN, workers.drain())
        .await
        .expect("drained");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_workers_keep_their_concurrency_however_starved() {
    let workers = Workers::adaptive(MAX, None, "test");
    let busy = Instant::now();
    let hog = tokio::spawn(async move {
        while busy.elapsed() < Duration::from_secs(1) {
            std::hint::spin_loop();
        }
    });
    hog.await.expect("hog");
    assert_eq!(workers.limit(), MAX);
    assert_eq!(Workers::new(0).limit(), 1);
}
