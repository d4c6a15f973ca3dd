//! One compare-and-set write on a KV bucket, telling a lost race from broker trouble: what the
//! quota and slot records are changed with (a lost race is read again; trouble is not retried
//! here, so a caller's bounded wait stays bounded).

use async_nats::jetstream::kv;
use bytes::Bytes;

/// Writes `body` at `key` if the key is still at `revision` (`None`: it must not exist).
/// `Ok(Some(revision))`: written; `Ok(None)`: another writer was first; `Err`: the broker's
/// answer, or none.
pub(crate) async fn write(
    kv: &kv::Store,
    key: &str,
    body: Bytes,
    revision: Option<u64>,
) -> Result<Option<u64>, String> {
    match revision {
        None => match kv.create(key, body).await {
            Ok(r) => Ok(Some(r)),
            Err(e) if matches!(e.kind(), kv::CreateErrorKind::AlreadyExists) => Ok(None),
            Err(e) => Err(e.to_string()),
        },
        Some(revision) => match kv.update(key, body, revision).await {
            Ok(r) => Ok(Some(r)),
            Err(e) if matches!(e.kind(), kv::UpdateErrorKind::WrongLastRevision) => Ok(None),
            Err(e) => Err(e.to_string()),
        },
    }
}
