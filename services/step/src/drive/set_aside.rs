//! Journal messages set aside: messages on a run's subjects that are not events of the run,
//! recorded once each where operators see them (`KEDGE_REJECTIONS`); the run goes on.

use kedge_core::ids::RunId;

use super::Driver;

impl Driver {
    /// Records messages set aside from a run's journal where operators see them, once each
    /// (`kedge_runtime::rejections::set_aside`). Best effort: a record that cannot be written
    /// is logged; the run goes on.
    pub(super) async fn record_set_aside(
        &self,
        run: &RunId,
        set_aside: &[kedge_journal::SetAside],
    ) {
        for a in set_aside {
            if let Err(e) = kedge_runtime::rejections::set_aside(&self.rt.js, run, a).await {
                tracing::warn!(run_id = %run, seq = a.seq, error = %e, "cannot record a set-aside journal message");
            }
        }
    }
}
