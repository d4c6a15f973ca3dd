//! Running Kedge: any subset of its services in one process, each supervised and restarted
//! with backoff, until a shutdown future resolves (docs/ARCHITECTURE.md "Map of the house").
//!
//! This crate owns the orchestration every way of running Kedge shares: the [`Service`] names,
//! [`serve`] (what `kedge serve` is: health registration, one supervisor per service, the
//! bounded drain), [`supervise`] and its [`Backoff`], [`shutdown_signal`] (SIGINT/SIGTERM) and
//! the durable consumers each service binds ([`durables_of`], what readiness waits for). The
//! binary's `kedge serve` is a thin call into it; the end-to-end tests, the benches and
//! `kedge demo` start services in their own process through [`TransientKedge`], which runs
//! [`serve`] too (docs/ARCHITECTURE.md "Tests"), so nothing starts a service another way.

use std::time::Duration;

use kedge_runtime::Runtime;

mod service;
pub use service::Service;
mod transient;
pub use transient::{Started, TransientKedge};

/// Runs the named services in this process until `shutdown`, then drains them.
///
/// Each service is supervised ([`supervise`]): one that panics, fails or ends before shutdown is
/// restarted with backoff and logged, and the others keep going. Only a service that cannot even
/// start (its first run fails: a misconfiguration) ends the process, with an error.
pub async fn serve(
    rt: Runtime,
    services: &[Service],
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use kedge_runtime::RuntimeError;
    let all = services.contains(&Service::All);
    let wanted = |s: Service| all || services.contains(&s);
    let mut started: Vec<(&'static str, Runner<Runtime>)> = Vec::new();
    kedge_runtime::health::watch_connection(&rt.client);
    let mut start = |name: &'static str, run: Runner<Runtime>| {
        started.push((name, run));
    };
    fn boxed<E: std::fmt::Display>(
        f: impl std::future::Future<Output = Result<(), E>> + Send + 'static,
    ) -> ServiceFuture {
        Box::pin(async move { f.await.map_err(|e| e.to_string()) })
    }
    if wanted(Service::Intake) {
        start("intake", |rt, stop| boxed(kedge_intake::run(rt, stop)));
    }
    if wanted(Service::Step) && wanted(Service::Tool) {
        // Built-in tools run inside the step's drives (`inline_tools`, docs/ARCHITECTURE.md
        // "Inline tools"): this process has the tool service's sandbox and workspace root.
        start("step", |rt, stop| {
            boxed(kedge_step::run_with(rt, stop, kedge_step::Tools::Inline))
        });
    } else if wanted(Service::Step) {
        start("step", |rt, stop| boxed(kedge_step::run(rt, stop)));
    }
    if wanted(Service::Tool) {
        start("tool", |rt, stop| boxed(kedge_tool::run(rt, stop)));
    }
    if wanted(Service::Timer) {
        start("timer", |rt, stop| boxed(kedge_timer::run(rt, stop)));
    }
    if wanted(Service::Reconciler) {
        start("reconciler", |rt, stop| {
            boxed(kedge_reconciler::run(rt, stop))
        });
    }
    if services.contains(&Service::Retention) {
        start("retention", |rt, stop| {
            boxed(kedge_retention::run(rt, stop))
        });
    }
    if wanted(Service::Projector) {
        start("projector", |rt, stop| {
            boxed(kedge_projector::run(rt, stop))
        });
    }
    if services.contains(&Service::Bridge) {
        start("bridge", |rt, stop| {
            boxed(async move {
                kedge_bridge::run(rt, stop)
                    .await
                    .map_err(|e| RuntimeError::broker("bridge", e))
            })
        });
    }
    if wanted(Service::Approval) {
        start("approval", |rt, stop| boxed(kedge_approval::run(rt, stop)));
    }
    if wanted(Service::Gateway) {
        start("gateway", |rt, stop| boxed(kedge_gateway::run(rt, stop)));
    }
    let drain = rt.config.timeouts.drain();
    run_supervised(rt, started, Backoff::default(), drain, shutdown).await
}

/// How [`serve`] starts one run of a service: on the process's runtime (`R`; a test's stand-in
/// in this crate's tests), until the stop future resolves.
type Runner<R> = fn(R, Stop) -> ServiceFuture;

/// The rest of [`serve`]: each service started under its own [`supervise`], shutdown turned into
/// the stop every run sees, then the bounded drain; the first service that cannot start stops
/// the others and is the error.
async fn run_supervised<R: Clone + Send + 'static>(
    rt: R,
    started: Vec<(&'static str, Runner<R>)>,
    backoff: Backoff,
    drain: Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (tx, stopping) = tokio::sync::watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    for (name, run) in started {
        let rt = rt.clone();
        kedge_runtime::health::expect_service(name, durables_of(name));
        tasks.spawn(supervise(name, stopping.clone(), backoff, move |stop| {
            run(rt.clone(), stop)
        }));
    }
    let signal = tx.clone();
    tokio::spawn(async move {
        shutdown.await;
        kedge_runtime::health::draining();
        let _ = signal.send(true);
    });
    let mut stopped = tx.subscribe();
    // Shutting down: what is still in flight after the drain time is left; the process exits,
    // its connection closes, and the other workers adopt its work.
    let drained = async move {
        let _ = stopped.wait_for(|s| *s).await;
        tokio::time::sleep(drain).await;
    };
    tokio::pin!(drained);
    let mut failed = None;
    loop {
        let done = tokio::select! {
            done = tasks.join_next() => done,
            () = &mut drained => {
                tracing::warn!(left = tasks.len(), drain_ms = drain.as_millis() as u64, "drain time is up; exiting with work in flight (it is adopted by the other workers)");
                break;
            }
        };
        let Some(done) = done else { break };
        let outcome = done.map_err(|e| e.to_string()).and_then(|r| r);
        if let Err(e) = outcome {
            // A service that cannot start: stop the others and report it.
            let _ = tx.send(true);
            failed.get_or_insert(e);
        }
    }
    match failed {
        Some(e) => Err(anyhow::anyhow!(e)),
        None => Ok(()),
    }
}

/// The durable consumers a service binds (what readiness waits for), by its [`Service::name`].
pub fn durables_of(service: &str) -> &'static [&'static str] {
    match service {
        "intake" => &["intake"],
        "step" => &["step", "step-created"],
        "tool" => &["tool"],
        "timer" => &["timer", "timer-fired"],
        "projector" => &["projector"],
        _ => &[],
    }
}

/// Resolves when the process shuts down.
pub type Stop = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// One run of a service.
pub type ServiceFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>>;

/// How long [`supervise`] waits before a restart: `first`, doubling to `max`; back to `first`
/// after a run that lasted `reset_after`.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
    pub reset_after: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            first: Duration::from_millis(500),
            max: Duration::from_secs(30),
            reset_after: Duration::from_secs(60),
        }
    }
}

/// Runs a service until shutdown, each run in its own task. A run that panics, fails or ends
/// before shutdown is logged and restarted after a backoff. The first run failing (returning an
/// error, not panicking) is a service that cannot start: that error is returned.
pub async fn supervise(
    name: &'static str,
    stopping: tokio::sync::watch::Receiver<bool>,
    backoff: Backoff,
    run: impl Fn(Stop) -> ServiceFuture,
) -> Result<(), String> {
    let mut delay = backoff.first;
    let mut first = true;
    loop {
        let stop: Stop = {
            let mut rx = stopping.clone();
            Box::pin(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
        };
        let started = std::time::Instant::now();
        kedge_runtime::health::service_up(name);
        let task = tokio::spawn(run(stop));
        // A supervisor dropped (its `serve` ended after the drain time, or a [`TransientKedge`]
        // killed) takes its run with it, as a process's exit does.
        let _abort = AbortOnDrop(task.abort_handle());
        let outcome = task.await;
        if *stopping.borrow() {
            return Ok(());
        }
        kedge_runtime::health::service_down(name, "restarting after a failure");
        match outcome {
            Ok(Err(e)) if first => {
                tracing::error!(service = name, error = %e, "service cannot start");
                return Err(format!("{name}: {e}"));
            }
            Ok(Err(e)) => {
                tracing::error!(service = name, error = %e, retry_in = ?delay, "service failed; restarting")
            }
            Ok(Ok(())) => {
                tracing::warn!(service = name, retry_in = ?delay, "service ended before shutdown; restarting")
            }
            Err(e) => {
                tracing::error!(service = name, error = %e, retry_in = ?delay, "service panicked; restarting")
            }
        }
        first = false;
        if started.elapsed() >= backoff.reset_after {
            delay = backoff.first;
        }
        let mut rx = stopping.clone();
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = rx.wait_for(|s| *s) => return Ok(()),
        }
        delay = (delay * 2).min(backoff.max);
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Resolves on the first SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
    tracing::info!("shutting down");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quick() -> Backoff {
        Backoff {
            first: Duration::from_millis(10),
            max: Duration::from_millis(40),
            reset_after: Duration::from_secs(60),
        }
    }

    #[tokio::test]
    async fn a_service_that_panics_is_restarted_and_the_supervisor_stops_at_shutdown() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let runs = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = tokio::sync::watch::channel(false);
        let counted = runs.clone();
        let supervisor = tokio::spawn(supervise("test", rx, quick(), move |stop| {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                if n < 2 {
                    panic!("injected panic {n}");
                }
                stop.await;
                Ok(())
            })
        }));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while runs.load(Ordering::SeqCst) < 3 {
            assert!(std::time::Instant::now() < deadline, "not restarted");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tx.send(true).expect("send");
        let ended = tokio::time::timeout(Duration::from_secs(5), supervisor)
            .await
            .expect("stops at shutdown")
            .expect("no panic escapes");
        assert_eq!(ended, Ok(()));
        assert_eq!(runs.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_service_that_cannot_start_is_reported_and_one_that_fails_later_restarts() {
        let (_tx, rx) = tokio::sync::watch::channel(false);
        let cannot = supervise("test", rx.clone(), quick(), |_| {
            Box::pin(async { Err("bad configuration".to_owned()) })
        })
        .await;
        assert_eq!(cannot, Err("test: bad configuration".to_owned()));
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        let (tx, rx) = tokio::sync::watch::channel(false);
        let supervisor = tokio::spawn(supervise("test", rx, quick(), move |stop| {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                match n {
                    0 => Ok(()), // ended early: restarted
                    1 => Err("broker gone".to_owned()),
                    _ => {
                        stop.await;
                        Ok(())
                    }
                }
            })
        }));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while runs.load(Ordering::SeqCst) < 3 {
            assert!(std::time::Instant::now() < deadline, "not restarted");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tx.send(true).expect("send");
        assert_eq!(supervisor.await.expect("joins"), Ok(()));
    }
}

// The tests of `serve` itself, with stand-in services.
#[cfg(test)]
mod serve_tests;
