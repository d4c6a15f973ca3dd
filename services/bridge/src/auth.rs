//! Bearer tokens mapped to tenants.
//!
//! A request carries `Authorization: Bearer <token>` (or, for `EventSource`, which cannot set
//! headers, an SSE ticket cookie on a run's event stream ([`crate::ticket`]), or
//! `?access_token=<token>` on a GET, which leaks the token into logs). The token names a tenant and a scope (`read`: GETs
//! only; `write`: also submit, message, answer, cancel, deliver callbacks; `approve`: read and
//! decide approvals; `write+approve`: both). Deciding approvals is its own scope, so the token an
//! application submits with cannot approve what its own runs ask for. A tenant sees and acts on only its own runs: the run's tenant is
//! the one `run.created` froze, and another tenant's run answers 404, exactly like a run that does
//! not exist, so run ids cannot be probed.
//!
//! Tokens are kept only as SHA-256 digests, and looked up by digest, so the table holds no secret
//! and a lookup does not compare secrets byte by byte. In open (development) mode a request without
//! a token acts for the configured open tenant; an unknown token is still refused.

use std::collections::HashMap;

use axum::http::{HeaderMap, Method, header};
use kedge_core::ids::{RunId, TenantId};
use kedge_runtime::config::BridgeConfig;
use sha2::{Digest, Sha256};

use crate::problem::Problem;
use crate::ticket::{self, TICKET_TTL, TicketError, TicketKey};

/// What a token allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Read,
    Write,
    Approve,
    WriteApprove,
}

impl Scope {
    /// `read`, `write`, `approve` or `write+approve`.
    pub fn parse(s: &str) -> Option<Scope> {
        match s {
            "read" => Some(Scope::Read),
            "write" => Some(Scope::Write),
            "approve" => Some(Scope::Approve),
            "write+approve" | "approve+write" => Some(Scope::WriteApprove),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Write => "write",
            Scope::Approve => "approve",
            Scope::WriteApprove => "write+approve",
        }
    }

    pub fn can_write(self) -> bool {
        matches!(self, Scope::Write | Scope::WriteApprove)
    }

    pub fn can_approve(self) -> bool {
        matches!(self, Scope::Approve | Scope::WriteApprove)
    }
}

/// Who is calling: the tenant they act for and what they may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub tenant: TenantId,
    pub scope: Scope,
    /// A name for `Kedge-Caller` and `by` fields: never the token itself.
    pub name: String,
    /// The id of the key its SSE tickets are signed with ([`crate::ticket`]).
    pub ticket_key: String,
}

impl Caller {
    /// 403 unless the caller may change runs.
    pub fn require_write(&self) -> Result<(), Problem> {
        if self.scope.can_write() {
            return Ok(());
        }
        Err(Problem::forbidden(
            "this token cannot write; submitting, messaging, answering and cancelling need a \
             token with the write scope",
        ))
    }

    /// 403 unless the caller may decide approvals (scope `approve`).
    pub fn require_approve(&self) -> Result<(), Problem> {
        if self.scope.can_approve() {
            return Ok(());
        }
        Err(Problem::forbidden(
            "deciding approvals needs a token with the approve scope",
        ))
    }
}

/// Why the bridge's auth configuration is unusable.
#[derive(Debug, thiserror::Error)]
pub enum AuthConfigError {
    #[error(
        "the bridge has no tokens (bridge.tokens / KEDGE_BRIDGE_TOKENS) and is not in open \
         development mode (bridge.open / KEDGE_BRIDGE_OPEN=1); refusing to serve"
    )]
    NoTokens,
    #[error("bridge.tokens: {0}")]
    Invalid(String),
}

/// The token table.
#[derive(Debug, Clone)]
pub struct Auth {
    by_digest: HashMap<[u8; 32], Caller>,
    open: Option<Caller>,
    /// SSE ticket keys by id, with the caller a ticket acts for ([`crate::ticket`]).
    tickets: HashMap<String, (Caller, TicketKey)>,
    ticket_ttl: std::time::Duration,
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Auth {
    pub fn from_config(config: &BridgeConfig) -> Result<Auth, AuthConfigError> {
        let mut by_digest = HashMap::new();
        let mut tickets = HashMap::new();
        for t in &config.tokens {
            let tenant: TenantId = t
                .tenant
                .parse()
                .map_err(|e: kedge_core::ids::IdError| AuthConfigError::Invalid(e.to_string()))?;
            let scope = Scope::parse(&t.scope).ok_or_else(|| {
                AuthConfigError::Invalid(format!(
                    "scope `{}` is not read, write, approve or write+approve",
                    t.scope
                ))
            })?;
            let d = digest(&t.token);
            let hex: String = d[..4].iter().map(|b| format!("{b:02x}")).collect();
            let key = TicketKey::for_token(&t.token);
            let caller = Caller {
                tenant,
                scope,
                name: format!("token-{hex}"),
                ticket_key: key.id.clone(),
            };
            tickets.insert(key.id.clone(), (caller.clone(), key));
            by_digest.insert(d, caller);
        }
        let open =
            if config.open {
                let key = TicketKey::open(&config.open_tenant);
                let caller =
                    Caller {
                        tenant: config.open_tenant.parse().map_err(
                            |e: kedge_core::ids::IdError| AuthConfigError::Invalid(e.to_string()),
                        )?,
                        scope: Scope::WriteApprove,
                        name: "open-mode".into(),
                        ticket_key: key.id.clone(),
                    };
                tickets.insert(key.id.clone(), (caller.clone(), key));
                Some(caller)
            } else {
                None
            };
        if by_digest.is_empty() && open.is_none() {
            return Err(AuthConfigError::NoTokens);
        }
        Ok(Auth {
            by_digest,
            open,
            tickets,
            ticket_ttl: TICKET_TTL,
        })
    }

    /// The caller a bearer token stands for, if the table has it.
    pub fn caller_of_token(&self, token: &str) -> Option<Caller> {
        self.by_digest.get(&digest(token)).cloned()
    }

    /// How long the SSE tickets this table issues stay valid.
    pub fn ticket_ttl(&self) -> std::time::Duration {
        self.ticket_ttl
    }

    /// This table with another ticket lifetime (tests).
    pub fn with_ticket_ttl(mut self, ttl: std::time::Duration) -> Auth {
        self.ticket_ttl = ttl;
        self
    }

    /// An SSE ticket for `caller` to read `run`'s events, issued at `now` (unix seconds): the
    /// ticket and its expiry.
    pub fn issue_ticket(&self, caller: &Caller, run: &RunId, now: u64) -> Option<(String, u64)> {
        let (_, key) = self.tickets.get(&caller.ticket_key)?;
        let expires = now.saturating_add(self.ticket_ttl.as_secs());
        Some((key.issue(&caller.tenant, run, expires), expires))
    }

    /// The caller an SSE ticket acts for, on `run`'s event stream at `now`: its token's tenant,
    /// read-only. 401 for a ticket that is malformed, signed by no known key, for another run or
    /// tenant, or expired.
    pub fn ticket_caller(&self, ticket: &str, run: &RunId, now: u64) -> Result<Caller, Problem> {
        let parsed = ticket::parse(ticket)
            .ok_or_else(|| Problem::unauthorized(TicketError::Invalid.to_string()))?;
        let (caller, key) = self
            .tickets
            .get(parsed.key_id)
            .ok_or_else(|| Problem::unauthorized(TicketError::Invalid.to_string()))?;
        key.verify(&parsed, &caller.tenant, run, now)
            .map_err(|e| Problem::unauthorized(e.to_string()))?;
        Ok(Caller {
            scope: Scope::Read,
            ..caller.clone()
        })
    }

    pub fn is_open(&self) -> bool {
        self.open.is_some()
    }

    /// The caller of a request, from its `Authorization` header or (GET only) its
    /// `access_token` query parameter.
    pub fn authenticate(
        &self,
        method: &Method,
        headers: &HeaderMap,
        query: Option<&str>,
    ) -> Result<Caller, Problem> {
        let token = match headers.get(header::AUTHORIZATION) {
            Some(v) => {
                let v = v
                    .to_str()
                    .map_err(|_| Problem::unauthorized("the Authorization header is not ASCII"))?;
                let (scheme, token) = v.split_once(' ').unwrap_or((v, ""));
                if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
                    return Err(Problem::unauthorized(
                        "the Authorization header must be `Bearer <token>`",
                    ));
                }
                Some(token.trim().to_owned())
            }
            None if method == Method::GET => query_token(query),
            None => None,
        };
        match token {
            Some(token) => self
                .by_digest
                .get(&digest(&token))
                .cloned()
                .ok_or_else(|| Problem::unauthorized("unknown token")),
            None => self.open.clone().ok_or_else(|| {
                Problem::unauthorized("a bearer token is required (Authorization: Bearer <token>)")
            }),
        }
    }
}

/// `access_token` from a raw query string.
pub(crate) fn query_token(query: Option<&str>) -> Option<String> {
    let query = query?;
    let params: Vec<(String, String)> =
        axum::extract::Query::<Vec<(String, String)>>::try_from_uri(
            &format!("/?{query}").parse().ok()?,
        )
        .ok()?
        .0;
    params
        .into_iter()
        .find(|(k, _)| k == "access_token")
        .map(|(_, v)| v)
        .filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use kedge_runtime::config::BridgeToken;

    fn config(open: bool) -> BridgeConfig {
        BridgeConfig {
            tokens: vec![
                BridgeToken {
                    token: "write-token-0123456789".into(),
                    tenant: "acme".into(),
                    scope: "write".into(),
                },
                BridgeToken {
                    token: "read-token-0123456789".into(),
                    tenant: "acme".into(),
                    scope: "read".into(),
                },
                BridgeToken {
                    token: "approve-token-0123456789".into(),
                    tenant: "acme".into(),
                    scope: "approve".into(),
                },
            ],
            open,
            ..BridgeConfig::default()
        }
    }

    fn bearer(t: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {t}")).expect("header"),
        );
        h
    }

    #[test]
    fn tokens_map_to_tenants_and_scopes() {
        let auth = Auth::from_config(&config(false)).expect("auth");
        let c = auth
            .authenticate(&Method::POST, &bearer("write-token-0123456789"), None)
            .expect("known");
        assert_eq!(c.tenant.as_str(), "acme");
        assert!(c.require_write().is_ok());
        assert_eq!(
            c.require_approve().map_err(|p| p.status),
            Err(403),
            "write does not approve"
        );
        let a = auth
            .authenticate(&Method::POST, &bearer("approve-token-0123456789"), None)
            .expect("known");
        assert!(a.require_approve().is_ok());
        assert_eq!(a.require_write().map_err(|p| p.status), Err(403));
        assert_eq!(Scope::parse("write+approve"), Some(Scope::WriteApprove));
        assert_eq!(Scope::parse("admin"), None);
        let r = auth
            .authenticate(&Method::GET, &bearer("read-token-0123456789"), None)
            .expect("known");
        assert_eq!(r.require_write().map_err(|p| p.status), Err(403));
        let none = auth.authenticate(&Method::GET, &HeaderMap::new(), None);
        assert_eq!(none.map_err(|p| p.status), Err(401));
        let bad = auth.authenticate(&Method::GET, &bearer("nope"), None);
        assert_eq!(bad.map_err(|p| p.status), Err(401));
        let q = auth.authenticate(
            &Method::GET,
            &HeaderMap::new(),
            Some("after=3&access_token=read-token-0123456789"),
        );
        assert_eq!(q.map(|c| c.scope), Ok(Scope::Read));
        // The query token is for GETs (EventSource) only.
        let q = auth.authenticate(
            &Method::POST,
            &HeaderMap::new(),
            Some("access_token=write-token-0123456789"),
        );
        assert_eq!(q.map_err(|p| p.status), Err(401));
        assert!(!c.name.contains("write-token"));
    }

    #[test]
    fn a_ticket_acts_for_its_tokens_tenant_read_only_on_one_run_until_it_expires() {
        let auth = Auth::from_config(&config(false)).expect("auth");
        let writer = auth
            .authenticate(&Method::POST, &bearer("write-token-0123456789"), None)
            .expect("known");
        let run = RunId::generate();
        let other = RunId::generate();
        let (t, expires) = auth.issue_ticket(&writer, &run, 1_000).expect("issued");
        assert_eq!(expires, 1_000 + TICKET_TTL.as_secs());
        let c = auth.ticket_caller(&t, &run, 1_001).expect("valid");
        assert_eq!(c.tenant, writer.tenant);
        assert_eq!(c.scope, Scope::Read, "a ticket only reads");
        let status = |r: Result<Caller, Problem>| r.map(|c| c.scope).map_err(|p| p.status);
        assert_eq!(status(auth.ticket_caller(&t, &other, 1_001)), Err(401));
        assert_eq!(status(auth.ticket_caller(&t, &run, expires)), Err(401));
        assert_eq!(status(auth.ticket_caller("v1.nope", &run, 1_001)), Err(401));
        // A table without that token (the token was revoked) refuses its tickets.
        let mut fewer = config(false);
        fewer.tokens.remove(0);
        let fewer = Auth::from_config(&fewer).expect("auth");
        assert_eq!(status(fewer.ticket_caller(&t, &run, 1_001)), Err(401));
        let short = Auth::from_config(&config(false))
            .expect("auth")
            .with_ticket_ttl(std::time::Duration::from_secs(5));
        assert_eq!(short.issue_ticket(&writer, &run, 10).map(|t| t.1), Some(15));
    }

    #[test]
    fn open_mode_serves_tokenless_requests_but_not_unknown_tokens() {
        let auth = Auth::from_config(&config(true)).expect("auth");
        let c = auth
            .authenticate(&Method::POST, &HeaderMap::new(), None)
            .expect("open");
        assert_eq!(c.tenant.as_str(), "default");
        assert!(
            auth.authenticate(&Method::GET, &bearer("nope"), None)
                .is_err()
        );
        let empty = BridgeConfig::default();
        assert!(matches!(
            Auth::from_config(&empty),
            Err(AuthConfigError::NoTokens)
        ));
    }
}
