//! The retention service (`kedge serve retention`): applies the configured retention policy
//! ([`kedge_runtime::config::RetentionConfig`]) every `retention.interval`, one
//! [`kedge_runtime::retention::apply_policy`] pass at a time.
//!
//! Any number of replicas may run: each pass starts from the cursor the replicas share, purging
//! is idempotent and the cursor is saved with compare-and-set (see
//! [`kedge_runtime::retention`]), so replicas at most repeat one batch of each other's work. Each
//! replica waits a random part of the interval before its first pass, so replicas started
//! together do not run in step. With `retention.enabled` off the service only says so and idles.
//!
//! It needs the `retention` user's credentials (docs/SECURITY.md): no other service user may
//! purge.

use std::future::Future;
use std::time::Duration;

use kedge_runtime::retention::{Policy, apply_policy};
use kedge_runtime::{Runtime, RuntimeError};

/// Runs the retention policy until `shutdown` resolves.
pub async fn run(rt: Runtime, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
    tokio::pin!(shutdown);
    let config = rt.config.retention.clone();
    if !config.enabled {
        tracing::info!("retention is off (retention.enabled / KEDGE_RETENTION): nothing is purged");
        shutdown.await;
        return Ok(());
    }
    let policy = Policy::from(&config);
    tracing::info!(
        worker = %rt.config.worker_id,
        finished_after_s = config.finished_after.as_secs(),
        interval_ms = config.interval.as_millis() as u64,
        archive = config.archive,
        "retention started"
    );
    let mut wait = jitter(config.interval);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(wait) => {}
        }
        match apply_policy(&rt, policy).await {
            Ok(report) => tracing::info!(
                read = report.read,
                purged = report.purged,
                events = report.events,
                skipped = report.skipped,
                failed = report.failed,
                through = report.through,
                overtaken = report.overtaken,
                "retention pass"
            ),
            Err(e) => tracing::warn!(error = %e, "retention pass failed; the next one retries"),
        }
        wait = config.interval + jitter(config.interval / 10);
    }
    tracing::info!("retention stopped");
    Ok(())
}

/// A random wait up to `max`.
fn jitter(max: Duration) -> Duration {
    let ms = max.as_millis().max(1) as u64;
    Duration::from_millis(kedge_runtime::jitter_draw() % ms)
}
