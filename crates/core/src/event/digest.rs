//! [`Digest`]: the SHA-256 of an event's data in canonical JSON (keys sorted, no whitespace),
//! and [`SeqDigest`], the same digest of a sequence taken item by item.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// `sha256:<64 hex digits>`: the digest of a canonical JSON value (or of raw bytes).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

/// A string that is not `sha256:<64 lowercase hex>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a digest of the form sha256:<64 lowercase hex digits>")]
pub struct DigestError(String);

impl Digest {
    /// Digest of raw bytes.
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self::of_hash(Sha256::digest(bytes).as_slice())
    }

    /// `sha256:` and the lowercase hex of `hash`, with no allocation but the string's.
    fn of_hash(hash: &[u8]) -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(7 + 2 * hash.len());
        s.push_str("sha256:");
        for &b in hash {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
        Self(s)
    }

    /// Digest of a JSON value in canonical form. `serde_json::Map` keeps keys sorted (the crate's
    /// `preserve_order` feature is off in this workspace), so equal values give equal digests.
    /// The serialization is hashed as it is written (the same bytes, not collected first).
    pub fn of_json(value: &serde_json::Value) -> Self {
        let mut hashing = Hashing(Sha256::new());
        hashing.canonical(value);
        Self::of_hash(hashing.0.finalize().as_slice())
    }

    /// Digest of any serializable value, through its canonical JSON form.
    pub fn of<T: Serialize>(value: &T) -> Self {
        Self::of_json(&serde_json::to_value(value).unwrap_or(serde_json::Value::Null))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Feeds what serde_json writes into the hash.
#[derive(Clone)]
struct Hashing(Sha256);

impl Hashing {
    /// Hashes `value`'s canonical JSON form.
    fn canonical(&mut self, value: &serde_json::Value) {
        // Serializing a `Value` into a writer that never fails cannot fail.
        let _ = serde_json::to_writer(self, value);
    }
}

impl std::io::Write for Hashing {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// [`Digest::of`] a sequence, item by item: after items `a, b`, [`SeqDigest::digest`] is
/// `Digest::of(&[a, b])` (the same bytes are hashed: `[`, each item's canonical form, `,`
/// between them, `]`), and a clone goes on from there. So a sequence that only grows (a run's
/// transcript) is hashed once over its life instead of whole at every step.
#[derive(Clone)]
pub struct SeqDigest {
    hashing: Hashing,
    items: usize,
}

impl Default for SeqDigest {
    fn default() -> Self {
        let mut hashing = Hashing(Sha256::new());
        hashing.0.update(b"[");
        Self { hashing, items: 0 }
    }
}

impl SeqDigest {
    /// How many items were pushed.
    pub fn items(&self) -> usize {
        self.items
    }

    pub fn push<T: Serialize>(&mut self, item: &T) {
        if self.items > 0 {
            self.hashing.0.update(b",");
        }
        self.hashing
            .canonical(&serde_json::to_value(item).unwrap_or(serde_json::Value::Null));
        self.items += 1;
    }

    /// The digest of the items pushed so far.
    pub fn digest(&self) -> Digest {
        let mut hash = self.hashing.0.clone();
        hash.update(b"]");
        Digest::of_hash(hash.finalize().as_slice())
    }
}

impl fmt::Debug for SeqDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SeqDigest")
            .field("items", &self.items)
            .finish_non_exhaustive()
    }
}

impl FromStr for Digest {
    type Err = DigestError;
    fn from_str(s: &str) -> Result<Self, DigestError> {
        let hex = s
            .strip_prefix("sha256:")
            .ok_or_else(|| DigestError(s.to_owned()))?;
        if hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            Ok(Self(s.to_owned()))
        } else {
            Err(DigestError(s.to_owned()))
        }
    }
}

impl TryFrom<String> for Digest {
    type Error = DigestError;
    fn try_from(s: String) -> Result<Self, DigestError> {
        s.parse()
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", &self.0[..self.0.len().min(19)])
    }
}

impl JsonSchema for Digest {
    fn schema_name() -> Cow<'static, str> {
        "Digest".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "type": "string", "pattern": "^sha256:[0-9a-f]{64}$" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_digested_item_by_item_is_the_digest_of_the_whole() {
        let items = [
            serde_json::json!({"b": 1, "a": [1, 2]}),
            serde_json::json!("text"),
            serde_json::json!(null),
        ];
        let mut seq = SeqDigest::default();
        assert_eq!(seq.digest(), Digest::of(&Vec::<serde_json::Value>::new()));
        for (n, item) in items.iter().enumerate() {
            seq.push(item);
            assert_eq!(seq.items(), n + 1);
            assert_eq!(seq.digest(), Digest::of(&items[..=n].to_vec()), "{n}");
        }
        // Taking the digest does not end the sequence.
        let before = seq.digest();
        seq.push(&items[0]);
        assert_ne!(seq.digest(), before);
    }

    #[test]
    fn digest_ignores_key_order() {
        let a: serde_json::Value = serde_json::from_str(r#"{"a":1,"b":[1,2]}"#).expect("json");
        let b: serde_json::Value = serde_json::from_str(r#"{"b":[1,2],"a":1}"#).expect("json");
        assert_eq!(Digest::of_json(&a), Digest::of_json(&b));
        assert!(Digest::of_json(&a).as_str().parse::<Digest>().is_ok());
    }

    /// Digests are stored in journals: their bytes never change. SHA-256 of "abc" (FIPS 180-2),
    /// and a JSON value's digest is that of its compact serialization.
    #[test]
    fn digests_are_the_sha256_of_the_bytes_in_lowercase_hex() {
        assert_eq!(
            Digest::of_bytes(b"abc").as_str(),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            Digest::of_bytes(b"").as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        let value = serde_json::json!({
            "z": [1, 2.5, -3, null, true, "é\n\"q\u{1}"],
            "a": {"nested": {"k": "v"}, "empty": {}},
            "big": "x".repeat(100_000),
        });
        let bytes = serde_json::to_vec(&value).expect("serializes");
        assert_eq!(Digest::of_json(&value), Digest::of_bytes(&bytes));
    }
}
