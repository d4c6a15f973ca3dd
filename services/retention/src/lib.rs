//! The retention service (`kedge serve retention`, [`run`]): applies the configured retention
//! policy ([`kedge_runtime::config::RetentionConfig`]) every `retention.interval`, one
//! [`apply_policy`] pass at a time; and the purge itself ([`purge_run`], [`purge_finished`],
//! also `kedge runs purge`). A service of its own, with a crate of its own (docs/ARCHITECTURE.md,
//! "Map of the house"): nothing but this service and the binary's CLI purges, so the purge
//! lives here and not in `kedge-runtime`; the policy's configuration stays in runtime's config.
//!
//! Any number of replicas may run: each pass starts from the cursor the replicas share, purging
//! is idempotent and the cursor is saved with compare-and-set (see the doc of the `purge`
//! module: what goes, in which order, and how a pass follows its cursor), so replicas at most
//! repeat one batch of each other's work. Each
//! replica waits a random part of the interval before its first pass, so replicas started
//! together do not run in step. With `retention.enabled` off the service only says so and idles.
//!
//! It needs the `retention` user's credentials (docs/SECURITY.md): no other service user may
//! purge.

mod purge;

use std::future::Future;
use std::time::Duration;

use kedge_runtime::{Runtime, RuntimeError};

pub use purge::{
    CURSOR_KEY, Cursor, PassReport, Policy, PurgeOptions, PurgeReport, Purged, RetentionError,
    apply_policy, archive_name, purge_finished, purge_run,
};

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
