//! The timer service (being built): turns `timer.scheduled` decisions into broker message
//! schedules that fire `timer.fired` inputs into the run's journal.

use std::future::Future;

use kedge_runtime::{Runtime, RuntimeError};

/// Runs the timer service until `shutdown` resolves.
pub async fn run(rt: Runtime, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
    let _ = rt;
    shutdown.await;
    Ok(())
}
