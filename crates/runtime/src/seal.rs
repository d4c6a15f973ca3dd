//! Sensitive values: sealed with the operator's key before they are journaled, opened only
//! where they are used (the argument is in docs/SECURITY.md).
//!
//! An agent marks task fields (`sensitive_task_fields`: `input`, `metadata.<key>`) and tool
//! parameters (`policy.<tool>.sensitive`) sensitive. Their values are replaced, before anything
//! is stored, by a token `kedge:sealed:v1:<base64url>`: the value's JSON, encrypted with
//! AES-256-GCM under a key derived from the operator's [`crate::config::Config::seal_key`], bound
//! to the run (the run id is the associated data: a token moved to another run does not open).
//! Intake seals task fields as it creates the run; the step seals tool-call arguments the moment
//! the model's response arrives (before the response is stored or anything is decided from it).
//! So the journal, the idempotency records, the blobs, SSE, `/history`, the projection and the
//! logs only ever hold tokens. The step opens the tokens of the context it sends the model (the
//! model's view of the transcript is unchanged), and the tool runner those of the arguments it
//! runs an operation with.
//!
//! The seal is deterministic for a run: the nonce is an HMAC of the run and the value (a
//! synthetic IV, as in AES-SIV), so the same value in the same run seals to the same token.
//! That keeps the core pure and replayable (the decisions made from a sealed response are the
//! same whenever they are made again, and an operation's argument digest is stable), and
//! reveals only that two sealed values of one run are equal.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use kedge_core::RunId;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::hmac;
use serde_json::Value;

/// What every sealed value starts with.
pub const PREFIX: &str = "kedge:sealed:v1:";

/// Why a value could not be sealed or opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("the seal key must be 64 hex digits (32 bytes)")]
    BadKey,
    #[error("a sensitive value is sealed and this process has no seal key (KEDGE_SEAL_KEY)")]
    NoKey,
    #[error("a sealed value does not open with this key for this run: {0}")]
    Unopenable(&'static str),
}

/// The operator's key, ready to seal and open. `Debug` prints nothing of it.
#[derive(Clone)]
pub struct SealKey {
    aead: std::sync::Arc<LessSafeKey>,
    siv: hmac::Key,
}

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey(<redacted>)")
    }
}

impl SealKey {
    /// The key from its 64 hex digits.
    pub fn from_hex(hex: &str) -> Result<SealKey, SealError> {
        let hex = hex.trim();
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(SealError::BadKey);
        }
        let mut master = [0u8; 32];
        for (i, byte) in master.iter_mut().enumerate() {
            *byte =
                u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| SealError::BadKey)?;
        }
        let master = hmac::Key::new(hmac::HMAC_SHA256, &master);
        let derive = |label: &[u8]| hmac::sign(&master, label);
        let enc = derive(b"kedge seal v1: encryption key");
        let siv = derive(b"kedge seal v1: nonce key");
        let aead = UnboundKey::new(&AES_256_GCM, enc.as_ref()).map_err(|_| SealError::BadKey)?;
        Ok(SealKey {
            aead: std::sync::Arc::new(LessSafeKey::new(aead)),
            siv: hmac::Key::new(hmac::HMAC_SHA256, siv.as_ref()),
        })
    }

    /// `value` sealed for run `run`: the token that replaces it.
    pub fn seal(&self, run: &RunId, value: &Value) -> String {
        let plain = serde_json::to_vec(value).unwrap_or_default();
        let mut ctx = hmac::Context::with_key(&self.siv);
        ctx.update(&(run.as_str().len() as u64).to_be_bytes());
        ctx.update(run.as_str().as_bytes());
        ctx.update(&plain);
        let tag = ctx.sign();
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&tag.as_ref()[..NONCE_LEN]);
        let mut sealed = plain;
        // Sealing with a well-formed key and nonce cannot fail.
        let _ = self.aead.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(run.as_str().as_bytes()),
            &mut sealed,
        );
        let mut out = Vec::with_capacity(NONCE_LEN + sealed.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(out))
    }

    /// The value a token of run `run` seals.
    pub fn open(&self, run: &RunId, token: &str) -> Result<Value, SealError> {
        let body = token
            .strip_prefix(PREFIX)
            .ok_or(SealError::Unopenable("not a sealed value"))?;
        let mut bytes = URL_SAFE_NO_PAD
            .decode(body)
            .map_err(|_| SealError::Unopenable("not base64url"))?;
        if bytes.len() < NONCE_LEN + AES_256_GCM.tag_len() {
            return Err(SealError::Unopenable("too short"));
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&bytes[..NONCE_LEN]);
        let plain = self
            .aead
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(run.as_str().as_bytes()),
                &mut bytes[NONCE_LEN..],
            )
            .map_err(|_| SealError::Unopenable("wrong key, wrong run or altered"))?;
        serde_json::from_slice(plain).map_err(|_| SealError::Unopenable("not JSON"))
    }
}

/// Whether `s` is a sealed value.
pub fn is_sealed(s: &str) -> bool {
    s.starts_with(PREFIX)
}

/// Seals the top-level fields `names` of the object `value` (a tool call's arguments) for run
/// `run`; a field that is absent or already sealed is left. The number sealed.
pub fn seal_fields(
    key: Option<&SealKey>,
    run: &RunId,
    value: &mut Value,
    names: &[String],
) -> Result<usize, SealError> {
    let Some(map) = value.as_object_mut() else {
        return Ok(0);
    };
    let mut sealed = 0;
    for name in names {
        let Some(v) = map.get_mut(name) else { continue };
        if v.as_str().is_some_and(is_sealed) {
            continue;
        }
        let key = key.ok_or(SealError::NoKey)?;
        *v = Value::String(key.seal(run, v));
        sealed += 1;
    }
    Ok(sealed)
}

/// Opens, in place, every string of `value` that is a sealed value of run `run` (wherever it
/// sits: a message's text, a tool call's arguments). The number opened. A string that only
/// looks sealed (the model or a tool wrote it, or it is another run's) is left as written:
/// text from outside never fails the run. Without a key, a sealed value is an error.
pub fn open_all(key: Option<&SealKey>, run: &RunId, value: &mut Value) -> Result<usize, SealError> {
    match value {
        Value::String(s) if is_sealed(s) => {
            let key = key.ok_or(SealError::NoKey)?;
            match key.open(run, s) {
                Ok(opened) => {
                    *value = opened;
                    Ok(1)
                }
                Err(e) => {
                    tracing::warn!(run_id = %run, error = %e, "a string that looks sealed does not open; left as written");
                    Ok(0)
                }
            }
        }
        Value::Array(items) => {
            let mut n = 0;
            for item in items {
                n += open_all(key, run, item)?;
            }
            Ok(n)
        }
        Value::Object(map) => {
            let mut n = 0;
            for item in map.values_mut() {
                n += open_all(key, run, item)?;
            }
            Ok(n)
        }
        _ => Ok(0),
    }
}

/// Whether anything in `value` is sealed.
pub fn holds_sealed(value: &Value) -> bool {
    match value {
        Value::String(s) => is_sealed(s),
        Value::Array(items) => items.iter().any(holds_sealed),
        Value::Object(map) => map.values().any(holds_sealed),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const HEX: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    fn run(s: &str) -> RunId {
        s.parse().expect("run id")
    }

    #[test]
    fn a_sealed_value_opens_only_with_its_key_and_run() {
        let key = SealKey::from_hex(HEX).expect("key");
        let (a, b) = (run("run_a"), run("run_b"));
        let value = json!({"card": "4111 1111 1111 1111"});
        let token = key.seal(&a, &value);
        assert!(is_sealed(&token));
        assert!(!token.contains("4111"));
        assert_eq!(key.open(&a, &token), Ok(value.clone()));
        // Deterministic within a run, different across runs.
        assert_eq!(key.seal(&a, &value), token);
        assert_ne!(key.seal(&b, &value), token);
        assert!(key.open(&b, &token).is_err(), "bound to its run");
        let other = SealKey::from_hex(&HEX.replace("00", "ff")).expect("key");
        assert!(other.open(&a, &token).is_err(), "bound to its key");
        let mut altered = token.clone();
        altered.pop();
        altered.push(if token.ends_with('A') { 'B' } else { 'A' });
        assert!(key.open(&a, &altered).is_err(), "altered");
        assert!(key.open(&a, "kedge:sealed:v1:").is_err());
        assert!(key.open(&a, "kedge:sealed:v1:!!!").is_err());
    }

    #[test]
    fn keys_are_64_hex_digits() {
        assert_eq!(
            SealKey::from_hex("abc").expect_err("short"),
            SealError::BadKey
        );
        assert_eq!(
            SealKey::from_hex(&"g".repeat(64)).expect_err("not hex"),
            SealError::BadKey
        );
        assert!(SealKey::from_hex(&format!(" {HEX}\n")).is_ok());
        assert!(!format!("{:?}", SealKey::from_hex(HEX).expect("key")).contains("0102"));
    }

    #[test]
    fn fields_are_sealed_and_everything_sealed_is_opened() {
        let key = SealKey::from_hex(HEX).expect("key");
        let r = run("run_x");
        let mut args = json!({"to": "bob", "token": "s3cret", "n": 5});
        let names = ["token".to_owned(), "n".to_owned(), "absent".to_owned()];
        assert_eq!(seal_fields(Some(&key), &r, &mut args, &names), Ok(2));
        assert_eq!(args["to"], "bob");
        assert!(!args.to_string().contains("s3cret"));
        assert!(holds_sealed(&args));
        // Sealing again leaves sealed fields.
        let again = args.clone();
        assert_eq!(seal_fields(Some(&key), &r, &mut args, &names), Ok(0));
        assert_eq!(args, again);
        // Without a key nothing sensitive is let through in clear.
        let mut clear = json!({"token": "s3cret"});
        assert_eq!(
            seal_fields(None, &r, &mut clear, &names),
            Err(SealError::NoKey)
        );
        // Opened anywhere in a structure.
        let mut context = json!([{"role": "assistant", "tool_calls": [{"arguments": args}]}]);
        assert_eq!(open_all(Some(&key), &r, &mut context), Ok(2));
        assert_eq!(
            context[0]["tool_calls"][0]["arguments"],
            json!({"to": "bob", "token": "s3cret", "n": 5})
        );
        assert!(!holds_sealed(&context));
        let mut sealed = json!([key.seal(&r, &json!("x"))]);
        assert_eq!(open_all(None, &r, &mut sealed), Err(SealError::NoKey));
        // What only looks sealed (another run's, or forged) stays as written.
        let foreign = key.seal(&run("run_other"), &json!("x"));
        let mut mixed = json!([
            foreign.clone(),
            "kedge:sealed:v1:forged",
            key.seal(&r, &json!("y"))
        ]);
        assert_eq!(open_all(Some(&key), &r, &mut mixed), Ok(1));
        assert_eq!(mixed, json!([foreign, "kedge:sealed:v1:forged", "y"]));
    }
}
