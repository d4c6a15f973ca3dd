//! Journal messages set aside: messages on a run's subjects that are not events of the run,
//! recorded once each where operators see them (`KEDGE_REJECTIONS`); the run goes on.

use kedge_core::event::Timestamp;
use kedge_core::ids::RunId;
use kedge_core::subjects;

use super::Driver;

impl Driver {
    /// Records messages set aside from a run's journal where operators see them, once each:
    /// `agent.rejected.journal.<run>.<seq>` in `KEDGE_REJECTIONS` (looked up first, and
    /// `Nats-Msg-Id` `journal:<run>:<seq>` within the duplicate window). Best effort: a record
    /// that cannot be written is logged; the run goes on.
    pub(super) async fn record_set_aside(
        &self,
        run: &RunId,
        set_aside: &[kedge_journal::SetAside],
    ) {
        let stream = match self
            .rt
            .js
            .get_stream_no_info(subjects::REJECTIONS_STREAM)
            .await
        {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(run_id = %run, error = %e, "cannot record set-aside journal messages");
                return;
            }
        };
        for a in set_aside {
            let subject = subjects::rejected_journal(run, a.seq);
            if stream.direct_get_last_for_subject(&subject).await.is_ok() {
                continue;
            }
            tracing::warn!(run_id = %run, seq = a.seq, subject = %a.subject, reason = %a.reason, "journal message set aside");
            let body = serde_json::json!({
                "at": Timestamp::now(),
                "run_id": run,
                "seq": a.seq,
                "subject": a.subject,
                "kind": a.kind,
                "reason": a.reason,
            });
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", format!("journal:{run}:{}", a.seq).as_str());
            let published = match self
                .rt
                .js
                .publish_with_headers(subject, headers, body.to_string().into())
                .await
            {
                Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = published {
                tracing::warn!(run_id = %run, seq = a.seq, error = %e, "cannot record a set-aside journal message");
            }
        }
    }
}
