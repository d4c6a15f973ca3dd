//! [`serve`](crate::serve) with stand-in services (no broker): a service that cannot start ends
//! it, one that panics later is restarted, a run left after the drain time goes with it; the
//! durables table against the layout's registry; a [`TransientKedge`] with no broker to reach.

use std::time::Duration;

use crate::*;

fn quick() -> Backoff {
    Backoff {
        first: Duration::from_millis(10),
        max: Duration::from_millis(40),
        reset_after: Duration::from_secs(60),
    }
}

#[test]
fn the_durables_table_covers_every_service_and_every_durable_of_the_layout() {
    use kedge_core::subjects::Durable;
    let mut claimed: Vec<&str> = Vec::new();
    for service in Service::EVERY {
        for durable in durables_of(service.name()) {
            assert!(
                Durable::named(durable).is_some(),
                "{service} binds {durable}, not a durable of the layout"
            );
            claimed.push(durable);
        }
    }
    assert!(
        durables_of(Service::All.name()).is_empty(),
        "all is no service"
    );
    claimed.sort_unstable();
    let mut layout: Vec<&str> = Durable::ALL.iter().map(|d| d.name()).collect();
    layout.sort_unstable();
    assert_eq!(
        claimed, layout,
        "every durable consumer is bound by exactly one service"
    );
}

#[test]
fn every_service_has_its_own_name() {
    let mut names: Vec<&str> = Service::EVERY.iter().map(|s| s.name()).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), Service::EVERY.len());
}

/// A service that runs until it is stopped.
fn until_stopped((): (), stop: Stop) -> ServiceFuture {
    Box::pin(async move {
        stop.await;
        Ok(())
    })
}

#[tokio::test]
async fn a_service_that_cannot_start_ends_serve_with_its_error_and_stops_the_others() {
    let started: Vec<(&'static str, Runner<()>)> = vec![
        ("steady", until_stopped),
        ("broken", |(), _| {
            Box::pin(async { Err("bad configuration".to_owned()) })
        }),
    ];
    let ended = tokio::time::timeout(
        Duration::from_secs(5),
        run_supervised(
            (),
            started,
            quick(),
            Duration::from_secs(30),
            std::future::pending(),
        ),
    )
    .await
    .expect("serve ends without a shutdown");
    let e = ended.expect_err("a service could not start");
    assert_eq!(e.to_string(), "broken: bad configuration");
}

#[tokio::test]
async fn a_service_that_panics_later_is_restarted_by_serve_until_shutdown() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let started: Vec<(&'static str, Runner<()>)> = vec![("flaky", |(), stop| {
        let n = RUNS.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            if n == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                panic!("injected panic after starting");
            }
            stop.await;
            Ok(())
        })
    })];
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let serving = tokio::spawn(run_supervised(
        (),
        started,
        quick(),
        Duration::from_secs(30),
        async move {
            let _ = rx.await;
        },
    ));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while RUNS.load(Ordering::SeqCst) < 2 {
        assert!(std::time::Instant::now() < deadline, "not restarted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tx.send(()).expect("serve listens");
    let ended = tokio::time::timeout(Duration::from_secs(5), serving)
        .await
        .expect("serve stops at shutdown")
        .expect("no panic escapes");
    assert!(ended.is_ok(), "{ended:?}");
    assert_eq!(RUNS.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_run_still_going_after_the_drain_time_is_dropped_with_serve() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static DROPPED: AtomicBool = AtomicBool::new(false);
    struct Flag;
    impl Drop for Flag {
        fn drop(&mut self) {
            DROPPED.store(true, Ordering::SeqCst);
        }
    }
    let started: Vec<(&'static str, Runner<()>)> = vec![("stubborn", |(), _| {
        Box::pin(async move {
            let _flag = Flag;
            std::future::pending::<()>().await;
            Ok(())
        })
    })];
    let began = std::time::Instant::now();
    let ended = run_supervised(
        (),
        started,
        quick(),
        Duration::from_millis(100),
        tokio::time::sleep(Duration::from_millis(50)),
    )
    .await;
    assert!(ended.is_ok(), "{ended:?}");
    assert!(began.elapsed() < Duration::from_secs(5));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !DROPPED.load(Ordering::SeqCst) {
        assert!(
            std::time::Instant::now() < deadline,
            "the run outlived its serve"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_transient_kedge_that_cannot_connect_ends_with_the_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut config = kedge_runtime::Config {
        nats_urls: vec![format!("nats://127.0.0.1:{port}")],
        ..Default::default()
    };
    config.nats.connect_wait_ms = 0;
    let mut kedge = TransientKedge::new();
    let set = kedge.start(config, &[Service::Intake]);
    assert_eq!(kedge.services(set), &[Service::Intake]);
    let e = tokio::time::timeout(Duration::from_secs(10), kedge.wait(set))
        .await
        .expect("ends by itself")
        .expect_err("no broker there");
    assert!(e.to_string().starts_with("connect: "), "{e}");
    assert!(!kedge.is_running(set));
    assert!(kedge.shutdown().await.is_err(), "the error is kept");
    kedge.kill(set).await;
}
