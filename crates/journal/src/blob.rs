//! Large payloads by reference: the object store `kedge_blobs`, content-addressed.
//!
//! A journal message carries at most [`INLINE_MAX`] bytes. An event whose envelope is larger
//! (a long tool output, a big model response, a large task input or callback payload) is
//! journaled *by reference*: its `data` goes to `kedge_blobs` first, named by its run and its own
//! digest (`<run_id>/sha256:<hex>`, the envelope's `digest`: the SHA-256 of the data's canonical
//! JSON), and the message carries the envelope without `data` and with
//! `data_ref: {digest, size, media_type}` instead. Every read of the journal ([`crate::Journal`]:
//! reads, tails, last-event lookups, [`crate::Journal::open`]) puts the data back before anyone
//! sees the event, so the fold, the context sent to the model, `/history`, SSE and
//! `kedge journal` see the same event as if it had been inline.
//!
//! Order: the blob is stored (and acknowledged) before the message that refers to it is
//! published, so a journaled reference always resolves; a crash between the two leaves an
//! unreferenced blob, never a dangling reference. Content addressing makes a retried put a no-op
//! and lets two events of a run with the same data share one object. Blobs are not shared across
//! runs, so removing a finished run removes its blobs without asking who else refers to them
//! ([`Blobs::delete`], retention).
//!
//! Integrity: a blob is read back chunk by chunk with direct gets (no consumer) and checked
//! against the digest it is named by before it is used; a blob that is missing, too large or
//! does not hash to its name is never used (the message is set aside like any malformed one).
//!
//! The objects are ordinary object-store objects:
//! `nats object get kedge_blobs <run_id>/sha256:<hex>`.

use std::io::Cursor;
use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream::object_store::{ObjectInfo, ObjectMetadata, ObjectStore, PutErrorKind};
use bytes::Bytes;
use kedge_core::RunId;
use kedge_core::event::Digest;
use kedge_core::subjects::{self, BLOBS_BUCKET, BLOBS_STREAM};
use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;

use crate::error::JournalError;
use crate::wire::{self, BatchInbox, WireError};

/// The largest journal message kept inline, in bytes of its JSON envelope. Larger events go by
/// reference. Well under nats-server's default `max_payload` (1 MiB), so no journal message is
/// ever refused for its size.
pub const INLINE_MAX: usize = 64 * 1024;

/// The largest blob a reader accepts. A reference claiming more is not followed.
pub const MAX_BLOB: u64 = 64 * 1024 * 1024;

/// The media type of a spilled event's data.
pub const EVENT_DATA: &str = "application/json";

/// How many chunks one direct get asks for.
const CHUNK_BATCH: usize = 32;

/// What a journal message carries instead of data it holds by reference.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobRef {
    /// SHA-256 of the blob's bytes; also its object name.
    pub digest: Digest,
    pub size: u64,
    pub media_type: String,
}

/// The object name in `kedge_blobs` of run `run`'s blob `digest`.
pub fn object_name(run: &RunId, digest: &Digest) -> String {
    format!("{run}/{digest}")
}

/// Why a blob could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlobError {
    /// No such object (never stored, or purged).
    #[error("blob {0} is not in {bucket}", bucket = BLOBS_BUCKET)]
    Missing(Digest),
    /// The object is there but is not what its name says, or is too large to read.
    #[error("blob {digest} is unusable: {reason}")]
    Corrupt { digest: Digest, reason: String },
    /// Broker trouble: try again.
    #[error("{bucket} unavailable: {0}", bucket = BLOBS_BUCKET)]
    Unavailable(String),
}

impl From<BlobError> for JournalError {
    fn from(e: BlobError) -> Self {
        match e {
            BlobError::Unavailable(reason) => JournalError::Unavailable { op: "blob", reason },
            other => JournalError::BadRequest(other.to_string()),
        }
    }
}

fn unavailable(e: impl std::fmt::Display) -> BlobError {
    BlobError::Unavailable(e.to_string())
}

/// Handle on `kedge_blobs`. Cheap to clone.
#[derive(Clone)]
pub struct Blobs {
    client: Client,
    js: async_nats::jetstream::Context,
    inbox: BatchInbox,
    timeout: Duration,
    store: std::sync::Arc<OnceCell<ObjectStore>>,
}

impl std::fmt::Debug for Blobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blobs")
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Blobs {
    pub(crate) fn with_inbox(client: Client, inbox: BatchInbox, timeout: Duration) -> Self {
        Self {
            js: async_nats::jetstream::new(client.clone()),
            client,
            inbox,
            timeout,
            store: Default::default(),
        }
    }

    /// A handle of its own (one reply subscription for its reads).
    pub fn new(client: Client) -> Self {
        let inbox = BatchInbox::new(client.clone());
        Self::with_inbox(client, inbox, crate::journal::DEFAULT_TIMEOUT)
    }

    async fn store(&self) -> Result<&ObjectStore, BlobError> {
        self.store
            .get_or_try_init(|| async {
                self.js
                    .get_object_store(BLOBS_BUCKET)
                    .await
                    .map_err(unavailable)
            })
            .await
    }

    /// The object's info, `None` when there is no such object.
    async fn info(&self, name: &str, digest: &Digest) -> Result<Option<ObjectInfo>, BlobError> {
        let subject = subjects::object_meta(BLOBS_BUCKET, &base64_url(name.as_bytes()));
        let found = wire::direct_last(&self.client, BLOBS_STREAM, &subject, self.timeout)
            .await
            .map_err(unavailable)?;
        let Some(m) = found else { return Ok(None) };
        let info: ObjectInfo =
            serde_json::from_slice(&m.payload).map_err(|e| BlobError::Corrupt {
                digest: digest.clone(),
                reason: format!("object info: {e}"),
            })?;
        Ok((!info.deleted).then_some(info))
    }

    /// Stores `bytes` as run `run`'s blob named by their digest (nothing is written when it is
    /// already there) and returns the reference. Returns once the broker has acknowledged every
    /// chunk and the object's info.
    pub async fn put(
        &self,
        run: &RunId,
        bytes: &[u8],
        media_type: &str,
    ) -> Result<BlobRef, BlobError> {
        let digest = Digest::of_bytes(bytes);
        let reference = BlobRef {
            digest: digest.clone(),
            size: bytes.len() as u64,
            media_type: media_type.to_owned(),
        };
        let name = object_name(run, &digest);
        if let Some(info) = self.info(&name, &digest).await?
            && info.size as u64 == reference.size
        {
            return Ok(reference);
        }
        let store = self.store().await?;
        let meta = ObjectMetadata {
            name,
            description: Some(media_type.to_owned()),
            ..Default::default()
        };
        match store.put(meta, &mut Cursor::new(bytes)).await {
            Ok(_) => Ok(reference),
            // Two writers stored the same blob at once: the second's info replaced the first's
            // and its purge of the first's chunks is not a service's to make. Both hold the
            // same bytes; the object is whole.
            Err(e) if e.kind() == PutErrorKind::PurgeOldChunks => Ok(reference),
            Err(e) => Err(unavailable(e)),
        }
    }

    /// Removes run `run`'s blob `digest` (its chunks and its info). Removing one that is not
    /// there is no error. Needs the right to purge `OBJ_kedge_blobs` (retention).
    pub async fn delete(&self, run: &RunId, digest: &Digest) -> Result<(), BlobError> {
        let name = object_name(run, digest);
        let Some(info) = self.info(&name, digest).await? else {
            return Ok(());
        };
        let mut to_purge = Vec::with_capacity(2);
        if usable_nuid(&info.nuid) {
            to_purge.push(subjects::object_chunks(BLOBS_BUCKET, &info.nuid));
        }
        // The info last: a delete cut short is found again and finished.
        to_purge.push(subjects::object_meta(
            BLOBS_BUCKET,
            &base64_url(name.as_bytes()),
        ));
        for subject in to_purge {
            wire::purge(&self.client, BLOBS_STREAM, &subject, None, self.timeout)
                .await
                .map_err(unavailable)?;
        }
        Ok(())
    }

    /// Run `run`'s blob, checked against its digest.
    pub async fn get(&self, run: &RunId, reference: &BlobRef) -> Result<Bytes, BlobError> {
        let digest = &reference.digest;
        let corrupt = |reason: String| BlobError::Corrupt {
            digest: digest.clone(),
            reason,
        };
        if reference.size > MAX_BLOB {
            return Err(corrupt(format!(
                "the reference claims {} bytes, more than the {MAX_BLOB} a reader takes",
                reference.size
            )));
        }
        let info = self
            .info(&object_name(run, digest), digest)
            .await?
            .ok_or_else(|| BlobError::Missing(digest.clone()))?;
        if info.size as u64 != reference.size {
            return Err(corrupt(format!(
                "{} bytes stored, the reference says {}",
                info.size, reference.size
            )));
        }
        if !usable_nuid(&info.nuid) {
            return Err(corrupt("object info without a usable chunk id".into()));
        }
        let subject = subjects::object_chunks(BLOBS_BUCKET, &info.nuid);
        let mut data = Vec::with_capacity(info.size);
        let mut from = 1;
        let mut chunks = 0usize;
        let mut overflow = false;
        while chunks < info.chunks {
            let want = (info.chunks - chunks).min(CHUNK_BATCH);
            let mut got = 0usize;
            let mut last = from;
            wire::direct_batch(
                &self.inbox,
                BLOBS_STREAM,
                &subject,
                from,
                want,
                self.timeout,
                |m| {
                    got += 1;
                    last = m.seq;
                    if data.len() + m.payload.len() > info.size {
                        overflow = true;
                    } else {
                        data.extend_from_slice(&m.payload);
                    }
                },
            )
            .await
            .map_err(|e| match e {
                WireError::Api(_) | WireError::Malformed(_) | WireError::BadRequest(_) => {
                    corrupt(e.to_string())
                }
                other => unavailable(other),
            })?;
            if overflow {
                return Err(corrupt("its chunks hold more than its size".into()));
            }
            if got == 0 {
                return Err(corrupt(format!("{chunks} of {} chunks found", info.chunks)));
            }
            chunks += got;
            from = last.saturating_add(1);
        }
        if data.len() != info.size {
            return Err(corrupt(format!(
                "its chunks hold {} bytes, its info says {}",
                data.len(),
                info.size
            )));
        }
        if Digest::of_bytes(&data) != *digest {
            return Err(corrupt("its bytes do not hash to its name".into()));
        }
        Ok(Bytes::from(data))
    }
}

/// A chunk id that is one subject token.
fn usable_nuid(nuid: &str) -> bool {
    !nuid.is_empty() && !nuid.contains(['.', '*', '>', ' '])
}

/// An object's name as the last token of its info subject: base64url with padding (what the
/// object store and the `nats` CLI use).
fn base64_url(input: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The stored form of an envelope whose data goes by reference: the envelope's JSON object
/// without `data`, with `data_ref`.
pub(crate) fn by_reference(envelope_json: &mut serde_json::Value, reference: &BlobRef) {
    if let Some(map) = envelope_json.as_object_mut() {
        map.remove("data");
        map.insert(
            "data_ref".to_owned(),
            serde_json::to_value(reference).unwrap_or_default(),
        );
    }
}

/// The reference of a stored message that holds its data by reference, if it is one.
pub(crate) fn reference_of(payload: &[u8]) -> Option<BlobRef> {
    #[derive(Deserialize)]
    struct Probe {
        data_ref: BlobRef,
    }
    serde_json::from_slice::<Probe>(payload)
        .ok()
        .map(|p| p.data_ref)
}

/// Puts the blob's data back into a stored message's envelope.
pub(crate) fn with_data(payload: &[u8], data: &[u8]) -> Result<Vec<u8>, String> {
    let mut envelope: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(payload).map_err(|e| e.to_string())?;
    let data: serde_json::Value =
        serde_json::from_slice(data).map_err(|e| format!("its blob is not JSON: {e}"))?;
    envelope.remove("data_ref");
    envelope.insert("data".to_owned(), data);
    serde_json::to_vec(&envelope).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64url_matches_the_object_store_encoding() {
        assert_eq!(base64_url(b""), "");
        assert_eq!(base64_url(b"f"), "Zg==");
        assert_eq!(base64_url(b"fo"), "Zm8=");
        assert_eq!(base64_url(b"foo"), "Zm9v");
        assert_eq!(base64_url(b"\xfb\xff\xbf"), "-_-_");
        assert_eq!(base64_url(b"sha256:ab"), "c2hhMjU2OmFi");
    }

    #[test]
    fn a_reference_is_found_only_in_a_stored_reference() {
        let d = Digest::of_bytes(b"x");
        let r = BlobRef {
            digest: d.clone(),
            size: 1,
            media_type: EVENT_DATA.into(),
        };
        let mut v =
            serde_json::json!({"type": "tool.result", "data": {"content": "x"}, "digest": d});
        assert!(reference_of(&serde_json::to_vec(&v).expect("json")).is_none());
        by_reference(&mut v, &r);
        let stored = serde_json::to_vec(&v).expect("json");
        assert_eq!(reference_of(&stored), Some(r));
        let back = with_data(&stored, br#"{"content":"x"}"#).expect("restores");
        let back: serde_json::Value = serde_json::from_slice(&back).expect("json");
        assert_eq!(back["data"]["content"], "x");
        assert!(back.get("data_ref").is_none());
        assert!(with_data(&stored, b"not json").is_err());
    }
}
