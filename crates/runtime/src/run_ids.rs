//! Run ids no tenant can predict or take (docs/SECURITY.md, "Run ids"; docs/ARCHITECTURE.md,
//! "Intake").
//!
//! Intake makes every new run's id within the task's tenant. A task that chose no run id gets a
//! keyed hash (HMAC-SHA256, under a server-held key) of (tenant, idempotency key), or of (tenant,
//! the task's stream sequence) when it has no key: the same task redelivered, or sent again with
//! the same key, is the same run, and no tenant can compute, and so take first, the id of another
//! tenant's run. A task that chose a `run_id` gets [`chosen`]: a hash of (tenant, that id),
//! without a key, so the client can compute it and follow its run at once; another tenant
//! choosing the same id gets another run, and no choice of another tenant (nor any keyed id) can
//! hit it short of a hash collision. So no answer tells a tenant whether another tenant's key or
//! id exists.
//!
//! The key is held in the broker, `run-ids` of bucket `kedge_secrets`: 32 random bytes the first
//! process that ensures the layout creates ([`ensure`]; `kedge layout` as admin in a secured
//! deployment), or the operator's `run_id_key` (`KEDGE_RUN_ID_KEY`) when that process has one.
//! Every process that derives ids ([`load`]: intake, the tenant gateway, and the bridge and CLI
//! when the broker answers a task as a duplicate) reads it there, so they agree with no
//! configuration; one configured with `run_id_key` checks that the broker holds the same. The
//! bucket has no direct gets, and only those kinds may read it (`crate::secure::permissions`).

use async_nats::jetstream;
use kedge_core::ids::{RunId, TenantId};
use kedge_core::subjects::{RUN_ID_KEY_ENTRY, SECRETS_BUCKET, SECRETS_STREAM};
use ring::hmac;

use crate::config::Secret;

/// Why the run-id key could not be had.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RunIdKeyError {
    #[error("the run-id key must be 64 hex digits (32 bytes)")]
    BadKey,
    #[error(
        "no run-id key in {bucket} (run `kedge layout` as admin to create it)",
        bucket = SECRETS_BUCKET
    )]
    Missing,
    #[error(
        "run_id_key (KEDGE_RUN_ID_KEY) differs from the key in {bucket}: every process must \
         derive run ids with the same key",
        bucket = SECRETS_BUCKET
    )]
    Mismatch,
    #[error("{bucket} unavailable: {0}", bucket = SECRETS_BUCKET)]
    Unavailable(String),
}

/// The key run ids are derived with. `Debug` prints nothing of it.
#[derive(Clone)]
pub struct RunIdKey {
    key: hmac::Key,
    /// The key's own digest, to compare a configured key with the broker's without its bytes.
    check: [u8; 32],
}

impl std::fmt::Debug for RunIdKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RunIdKey(<redacted>)")
    }
}

impl PartialEq for RunIdKey {
    fn eq(&self, other: &Self) -> bool {
        self.check == other.check
    }
}

fn parse_hex(hex: &str) -> Result<[u8; 32], RunIdKeyError> {
    let hex = hex.trim();
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(RunIdKeyError::BadKey);
    }
    let mut bytes = [0u8; 32];
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte =
            u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| RunIdKeyError::BadKey)?;
    }
    Ok(bytes)
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl RunIdKey {
    /// The key from its 64 hex digits.
    pub fn from_hex(hex: &str) -> Result<RunIdKey, RunIdKeyError> {
        let bytes = parse_hex(hex)?;
        let key = hmac::Key::new(hmac::HMAC_SHA256, &bytes);
        let tag = hmac::sign(&key, b"kedge run ids v1: key check");
        let mut check = [0u8; 32];
        check.copy_from_slice(tag.as_ref());
        Ok(RunIdKey { key, check })
    }

    fn derive(&self, kind: &str, tenant: &TenantId, basis: &str) -> RunId {
        // Each part is delimited (NUL cannot occur in a tenant, a key or a run id), and the kind
        // keeps the three derivations apart.
        let message = format!("{kind}\u{0}{tenant}\u{0}{basis}");
        let tag = hmac::sign(&self.key, message.as_bytes());
        // 128 bits in 32 hex digits: valid run-id characters.
        match format!("run_{}", to_hex(&tag.as_ref()[..16])).parse() {
            Ok(id) => id,
            Err(_) => RunId::generate(),
        }
    }

    /// The run of a task of `tenant` with idempotency key `key` (`Nats-Msg-Id`).
    pub fn keyed(&self, tenant: &TenantId, key: &str) -> RunId {
        self.derive("key", tenant, key)
    }

    /// The run of a task of `tenant` with no key, stored at stream sequence `seq`.
    pub fn keyless(&self, tenant: &TenantId, seq: u64) -> RunId {
        self.derive("seq", tenant, &seq.to_string())
    }

    /// The run a task makes: its chosen id, else its key, else its stream sequence, each within
    /// `tenant`.
    pub fn run_of(
        &self,
        tenant: &TenantId,
        chosen: Option<&RunId>,
        key: Option<&str>,
        seq: u64,
    ) -> RunId {
        match (chosen, key) {
            (Some(id), _) => self::chosen(tenant, id),
            (None, Some(k)) => self.keyed(tenant, k),
            (None, None) => self.keyless(tenant, seq),
        }
    }
}

/// The run of a task of `tenant` that chose run id `chosen`: the id within the tenant, `run_` and
/// the first 32 hex digits of SHA-256 of `chosen\0<tenant>\0<chosen>` (public: a client computes
/// it to follow its run before intake answers).
pub fn chosen(tenant: &TenantId, chosen: &RunId) -> RunId {
    let basis = format!("chosen\u{0}{tenant}\u{0}{chosen}");
    let digest = kedge_core::event::Digest::of_bytes(basis.as_bytes());
    let hex = digest.as_str().trim_start_matches("sha256:");
    match format!("run_{}", &hex[..32]).parse() {
        Ok(id) => id,
        Err(_) => RunId::generate(),
    }
}

async fn bucket(js: &jetstream::Context) -> Result<jetstream::kv::Store, RunIdKeyError> {
    js.get_key_value(SECRETS_BUCKET)
        .await
        .map_err(|e| RunIdKeyError::Unavailable(e.to_string()))
}

/// Reads the broker's run-id key (the kinds that derive run ids may; see the module docs), and
/// checks that a configured one is the same.
pub async fn load(
    js: &jetstream::Context,
    configured: Option<&Secret>,
) -> Result<RunIdKey, RunIdKeyError> {
    let configured = configured
        .map(|s| RunIdKey::from_hex(s.expose()))
        .transpose()?;
    let stored = bucket(js)
        .await?
        .get(RUN_ID_KEY_ENTRY)
        .await
        .map_err(|e| RunIdKeyError::Unavailable(e.to_string()))?
        .ok_or(RunIdKeyError::Missing)?;
    let stored = RunIdKey::from_hex(&String::from_utf8_lossy(&stored))?;
    match configured {
        Some(c) if c != stored => Err(RunIdKeyError::Mismatch),
        _ => Ok(stored),
    }
}

/// Creates the broker's run-id key if it has none: the configured one, else 32 random bytes.
/// Whether it exists is read from the stream's message count, which every kind may read, so a
/// process that may not read the key never asks for it. Run by [`crate::Runtime::connect`].
pub async fn ensure(
    js: &jetstream::Context,
    configured: Option<&Secret>,
) -> Result<(), RunIdKeyError> {
    let mut stream = js
        .get_stream(SECRETS_STREAM)
        .await
        .map_err(|e| RunIdKeyError::Unavailable(e.to_string()))?;
    let info = stream
        .info()
        .await
        .map_err(|e| RunIdKeyError::Unavailable(e.to_string()))?;
    if info.state.messages > 0 {
        return Ok(());
    }
    let hex = match configured {
        Some(s) => {
            RunIdKey::from_hex(s.expose())?;
            s.expose().trim().to_ascii_lowercase()
        }
        None => {
            let mut bytes = [0u8; 32];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
                .map_err(|_| RunIdKeyError::Unavailable("no random bytes".into()))?;
            to_hex(&bytes)
        }
    };
    match bucket(js)
        .await?
        .create(RUN_ID_KEY_ENTRY, hex.into_bytes().into())
        .await
    {
        Ok(_) => {
            tracing::info!(bucket = SECRETS_BUCKET, "run-id key created");
            Ok(())
        }
        // Another process created it meanwhile.
        Err(e) if e.kind() == jetstream::kv::CreateErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(RunIdKeyError::Unavailable(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
    const OTHER: &str = "ff0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    fn tenant(t: &str) -> TenantId {
        t.parse().expect("tenant")
    }

    #[test]
    fn run_ids_are_keyed_stable_and_scoped_to_the_tenant() {
        let k = RunIdKey::from_hex(KEY).expect("key");
        let other = RunIdKey::from_hex(OTHER).expect("key");
        let (acme, evil) = (tenant("acme"), tenant("evil"));
        // The same inputs: the same run (a redelivered or repeated task finds its run).
        assert_eq!(k.keyed(&acme, "k1"), k.keyed(&acme, "k1"));
        assert_eq!(k.keyless(&acme, 7), k.keyless(&acme, 7));
        let mine: RunId = "run_mine".parse().expect("run id");
        assert_eq!(k.run_of(&acme, None, Some("k1"), 3), k.keyed(&acme, "k1"));
        assert_eq!(
            k.run_of(&acme, Some(&mine), Some("k1"), 3),
            chosen(&acme, &mine)
        );
        assert_eq!(
            other.run_of(&acme, Some(&mine), None, 3),
            chosen(&acme, &mine)
        );
        assert_eq!(k.run_of(&acme, None, None, 3), k.keyless(&acme, 3));
        // Another key string, tenant, sequence or secret: another run.
        assert_ne!(k.keyed(&acme, "k1"), k.keyed(&acme, "k2"));
        assert_ne!(k.keyed(&acme, "k1"), k.keyed(&evil, "k1"));
        assert_ne!(k.keyed(&acme, "k1"), other.keyed(&acme, "k1"));
        assert_ne!(k.keyless(&acme, 7), k.keyless(&acme, 8));
        assert_ne!(k.keyless(&acme, 7), k.keyless(&evil, 7));
        assert_ne!(k.keyless(&acme, 7), other.keyless(&acme, 7));
        // A chosen id is scoped to its tenant.
        assert_ne!(chosen(&acme, &mine), chosen(&evil, &mine));
        assert_ne!(chosen(&acme, &mine), mine);
        assert_eq!(chosen(&acme, &mine).as_str().len(), 4 + 32);
        // The three derivations are kept apart.
        assert_ne!(k.keyed(&acme, "7"), k.keyless(&acme, 7));
        // Not the old unkeyed hash of the same basis.
        let unkeyed = |basis: &str| {
            let d = kedge_core::event::Digest::of_bytes(basis.as_bytes());
            format!("run_{}", &d.as_str().trim_start_matches("sha256:")[..32])
        };
        assert_ne!(
            k.keyed(&acme, "k1").as_str(),
            unkeyed("key\u{0}acme\u{0}k1")
        );
        assert_ne!(k.keyless(&acme, 7).as_str(), unkeyed("seq\u{0}7"));
        // Valid run ids, 128 bits of HMAC-SHA256.
        let id = k.keyed(&acme, "k1");
        assert_eq!(id.as_str().len(), 4 + 32, "{id}");
        let tag = hmac::sign(
            &hmac::Key::new(hmac::HMAC_SHA256, &parse_hex(KEY).expect("hex")),
            b"key\0acme\0k1",
        );
        assert_eq!(id.as_str(), format!("run_{}", to_hex(&tag.as_ref()[..16])));
    }

    #[test]
    fn keys_parse_compare_and_print_nothing() {
        assert!(matches!(
            RunIdKey::from_hex("abc"),
            Err(RunIdKeyError::BadKey)
        ));
        assert!(matches!(
            RunIdKey::from_hex(&"g".repeat(64)),
            Err(RunIdKeyError::BadKey)
        ));
        let k = RunIdKey::from_hex(KEY).expect("key");
        assert_eq!(k, RunIdKey::from_hex(&KEY.to_uppercase()).expect("key"));
        assert_ne!(k, RunIdKey::from_hex(OTHER).expect("key"));
        assert!(!format!("{k:?}").contains("0001"));
    }
}
