//! SSE tickets: how a browser's `EventSource` authenticates without a token in its URL.
//!
//! `EventSource` cannot set an `Authorization` header. Rather than putting the bearer token in the
//! address (`?access_token=`, which ends up in access logs, proxies and the browser's history),
//! the web console asks `POST /v1/runs/{id}/sse-ticket` with its bearer token, and the bridge
//! answers with an `HttpOnly; SameSite=Strict` cookie scoped to that run's event stream
//! (`Path=/v1/runs/{id}/events`). The browser sends it with the stream request and every
//! reconnect; page scripts cannot read it, other sites cannot make the browser send it, and it
//! authenticates nothing but reading that one run's events.
//!
//! A ticket is **stateless**, so any bridge accepts a ticket another bridge issued, also after a
//! restart (the console's stream resumes with `Last-Event-ID` on whichever bridge answers):
//! `v1.<key id>.<expiry>.<mac>`, where the MAC is HMAC-SHA256 over the key id, the tenant, the
//! run and the expiry (unix seconds), keyed by a key derived from the bearer token that asked for
//! it. A bridge with the same token table derives the same keys; a token removed from the table
//! invalidates its tickets at once. A ticket is bound to:
//! - its **tenant** and **scope**: it acts as its token's tenant, read-only;
//! - its **run**: the MAC covers the run id, so it does not open another run's stream (nor
//!   another tenant's: that tenant's runs are not visible to the token's tenant anyway);
//! - its **expiry**: [`TICKET_TTL`] after it was issued. It is checked when a stream is opened
//!   (or re-opened by a reconnect); an open stream is not cut when its ticket expires. The console
//!   renews the cookie while it watches a run.

use std::time::Duration;

use kedge_core::ids::{RunId, TenantId};
use sha2::{Digest, Sha256};

/// The cookie that carries a ticket.
pub const TICKET_COOKIE: &str = "kedge_sse";

/// How long a ticket opens streams after it was issued.
pub const TICKET_TTL: Duration = Duration::from_secs(120);

/// A ticket key: derived from one bearer token (or, in open mode, from the open tenant).
#[derive(Clone)]
pub struct TicketKey {
    /// Names the key inside a ticket: not secret, says nothing about the token.
    pub id: String,
    key: [u8; 32],
}

impl std::fmt::Debug for TicketKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TicketKey")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl TicketKey {
    /// The key of a bearer token.
    pub fn for_token(token: &str) -> TicketKey {
        let id = Sha256::new()
            .chain_update(b"kedge sse ticket id v1\0")
            .chain_update(token.as_bytes())
            .finalize();
        TicketKey {
            id: hex(&id[..8]),
            key: hmac_sha256(token.as_bytes(), b"kedge sse ticket key v1"),
        }
    }

    /// The key of open (development) mode, where a stream needs no credentials anyway.
    pub fn open(tenant: &str) -> TicketKey {
        TicketKey {
            id: "open".into(),
            key: hmac_sha256(tenant.as_bytes(), b"kedge sse ticket open v1"),
        }
    }

    fn mac(&self, tenant: &TenantId, run: &RunId, expires: u64) -> [u8; 32] {
        let msg = format!("v1\n{}\n{tenant}\n{run}\n{expires}", self.id);
        hmac_sha256(&self.key, msg.as_bytes())
    }

    /// A ticket for `run` of `tenant`, valid until `expires` (unix seconds).
    pub fn issue(&self, tenant: &TenantId, run: &RunId, expires: u64) -> String {
        format!(
            "v1.{}.{expires}.{}",
            self.id,
            hex(&self.mac(tenant, run, expires))
        )
    }

    /// Whether `ticket` (already split by [`parse`]) is this key's for `run` of `tenant`, and
    /// unexpired at `now` (unix seconds).
    pub fn verify(
        &self,
        ticket: &Parsed<'_>,
        tenant: &TenantId,
        run: &RunId,
        now: u64,
    ) -> Result<(), TicketError> {
        let expected = hex(&self.mac(tenant, run, ticket.expires));
        if !constant_time_eq(expected.as_bytes(), ticket.mac.as_bytes()) {
            return Err(TicketError::Invalid);
        }
        if now >= ticket.expires {
            return Err(TicketError::Expired);
        }
        Ok(())
    }
}

/// A ticket split into its parts (not yet verified).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed<'a> {
    pub key_id: &'a str,
    pub expires: u64,
    mac: &'a str,
}

/// Why a ticket does not open a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TicketError {
    #[error(
        "the SSE ticket is not valid for this run; ask POST /v1/runs/{{id}}/sse-ticket for one"
    )]
    Invalid,
    #[error("the SSE ticket has expired; ask POST /v1/runs/{{id}}/sse-ticket for a new one")]
    Expired,
}

/// Splits `v1.<key id>.<expiry>.<mac>`.
pub fn parse(ticket: &str) -> Option<Parsed<'_>> {
    let mut parts = ticket.split('.');
    let (Some("v1"), Some(key_id), Some(expires), Some(mac), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return None;
    };
    let expires = expires.parse().ok()?;
    (mac.len() == 64 && !key_id.is_empty()).then_some(Parsed {
        key_id,
        expires,
        mac,
    })
}

/// The values of every `kedge_sse` cookie in a request's `Cookie` headers.
pub fn cookies(headers: &axum::http::HeaderMap) -> Vec<String> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            (name == TICKET_COOKIE).then(|| value.trim().to_owned())
        })
        .collect()
}

/// The `Set-Cookie` value that hands `ticket` for `run` to a browser.
pub fn set_cookie(run: &RunId, ticket: &str, max_age: Duration, secure: bool) -> String {
    format!(
        "{TICKET_COOKIE}={ticket}; Path=/v1/runs/{run}/events; Max-Age={}; HttpOnly; SameSite=Strict{}",
        max_age.as_secs(),
        if secure { "; Secure" } else { "" }
    )
}

/// Seconds since the Unix epoch.
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// HMAC-SHA256 (RFC 2104) over `sha2`, so the bridge needs no other crate for it.
pub fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let ipad: Vec<u8> = k.iter().map(|b| b ^ 0x36).collect();
    let opad: Vec<u8> = k.iter().map(|b| b ^ 0x5c).collect();
    let inner = Sha256::new()
        .chain_update(&ipad)
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(&opad)
        .chain_update(inner)
        .finalize()
        .into()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 2 and test case 6 (a key longer than the block).
        assert_eq!(
            hex(&hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(
            hex(&hmac_sha256(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    fn ids() -> (TenantId, TenantId, RunId, RunId) {
        (
            "acme".parse().expect("tenant"),
            "globex".parse().expect("tenant"),
            RunId::generate(),
            RunId::generate(),
        )
    }

    #[test]
    fn a_ticket_is_bound_to_its_key_tenant_run_and_expiry() {
        let (acme, globex, run, other) = ids();
        let key = TicketKey::for_token("acme-write-token-0123456789");
        let t = key.issue(&acme, &run, 1_000);
        assert!(!t.contains("acme-write-token"), "{t}");
        let p = parse(&t).expect("parses");
        assert_eq!(p.key_id, key.id);
        assert_eq!(key.verify(&p, &acme, &run, 999), Ok(()));
        assert_eq!(
            key.verify(&p, &acme, &run, 1_000),
            Err(TicketError::Expired)
        );
        assert_eq!(
            key.verify(&p, &acme, &other, 999),
            Err(TicketError::Invalid)
        );
        assert_eq!(
            key.verify(&p, &globex, &run, 999),
            Err(TicketError::Invalid)
        );
        let stranger = TicketKey::for_token("globex-write-token-0123456789");
        assert_ne!(stranger.id, key.id);
        assert_eq!(
            stranger.verify(&p, &acme, &run, 999),
            Err(TicketError::Invalid)
        );
        // A later expiry written into the ticket does not verify.
        let forged = t.replace(".1000.", ".9999999999.");
        let pf = parse(&forged).expect("parses");
        assert_eq!(key.verify(&pf, &acme, &run, 999), Err(TicketError::Invalid));
        // Another bridge with the same token derives the same key.
        let again = TicketKey::for_token("acme-write-token-0123456789");
        assert_eq!(again.verify(&p, &acme, &run, 999), Ok(()));
    }

    #[test]
    fn malformed_tickets_do_not_parse() {
        for bad in [
            "",
            "v1",
            "v2.abc.10.0000000000000000000000000000000000000000000000000000000000000000",
            "v1.abc.ten.0000000000000000000000000000000000000000000000000000000000000000",
            "v1.abc.10.00",
            "v1..10.0000000000000000000000000000000000000000000000000000000000000000",
            "v1.a.10.0000000000000000000000000000000000000000000000000000000000000000.x",
        ] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_cookie_is_http_only_strict_and_scoped_to_the_runs_stream() {
        let run = RunId::generate();
        let c = set_cookie(&run, "v1.x.1.y", TICKET_TTL, false);
        assert!(c.starts_with("kedge_sse=v1.x.1.y; "), "{c}");
        assert!(c.contains(&format!("Path=/v1/runs/{run}/events;")), "{c}");
        assert!(
            c.contains("HttpOnly") && c.contains("SameSite=Strict"),
            "{c}"
        );
        assert!(c.contains("Max-Age=120") && !c.contains("Secure"), "{c}");
        let mut h = axum::http::HeaderMap::new();
        h.insert(
            axum::http::header::COOKIE,
            "a=b; kedge_sse=t1 ;c=d".parse().expect("header"),
        );
        h.append(
            axum::http::header::COOKIE,
            "kedge_sse=t2".parse().expect("header"),
        );
        assert_eq!(cookies(&h), vec!["t1".to_owned(), "t2".to_owned()]);
    }
}
