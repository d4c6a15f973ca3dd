//! The secured broker configuration: NATS accounts and least-privilege users, whose permissions
//! are built from the layout registry ([`permissions`]), rendered for nats-server.
//!
//! The server decides who a connection is. This module writes the nats-server `accounts` block
//! that says so (`kedge nats-config` is its command-line face; docs/SECURITY.md the threat model):
//!
//! - **`KEDGE`**, the account that owns the streams and buckets. One user per service kind
//!   ([`Kind`]) holding only what that service does ([`permissions`], built from the layout
//!   registry; `nats/secure/permissions.json` shows them: only step and intake may publish
//!   decisions, and intake only `run.created`; only tool runners subscribe to the tool subjects;
//!   only the reconciler asks them to resolve; each kind pulls and acks only its own durable
//!   consumers; nobody but `admin` may create, update, delete or purge a stream or a consumer,
//!   or write agent definitions). `all` is the union of the services, for a process that runs
//!   several (`kedge serve all`); `operator` is a person with the CLI.
//! - **One account per tenant** (`TENANT_<name>`), with no JetStream of its own. It imports five
//!   services of the `KEDGE` account, each exported to that account alone, and the import maps the
//!   tenant's subjects into `kedge.t.<tenant>.…`, where the tenant gateway answers:
//!
//!   | the tenant publishes (its account) | arrives in `KEDGE` as |
//!   | --- | --- |
//!   | `agent.task.<agent>` (with `Nats-Msg-Id`) | `kedge.t.<tenant>.task.<agent>` |
//!   | `kedge.runs.<run>[.history\|.follow\|.message\|.answer.<q>\|.cancel]` | `kedge.t.<tenant>.runs.…` |
//!   | `kedge.schedules.list`, `kedge.schedules.<name>.<verb>` | `kedge.t.<tenant>.schedules.…` |
//!   | `kedge.callback.<key>` | `kedge.t.<tenant>.callback.<key>` |
//!   | `kedge.approve.<approver>.<run>.<approval>` (approvers only) | `kedge.t.<tenant>.approve.…` |
//!
//!   The tenant's name in those subjects is written by the server's import, so a tenant can
//!   speak only for itself; the imports also `share` the requester's identity (the server's
//!   `Nats-Request-Info` header, which it overwrites). A tenant user may publish only those
//!   subjects and subscribe only to its inboxes; an approver may in addition publish
//!   `kedge.approve.<its name>.>`, so the approver a decision names is the one the server
//!   authenticated. Another tenant's account, Kedge's streams and the `$JS.API` are out of reach.
//!
//! Rendering is pure ([`render`]): the caller supplies each service user's identity (an nkey's
//! public key or a password) and the tenants; no secret is generated here.

pub mod permissions;

use std::collections::BTreeMap;
use std::fmt;

use kedge_core::ids::TenantId;
use kedge_core::subjects;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

pub use permissions::kind_permissions;

/// The account that owns Kedge's streams and buckets.
pub const KEDGE_ACCOUNT: &str = "KEDGE";

/// The account of a tenant.
pub fn tenant_account(tenant: &TenantId) -> String {
    format!("TENANT_{tenant}")
}

/// A kind of Kedge user in the `KEDGE` account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Everything, including creating the layout and deleting streams. For operators' hands and
    /// `kedge layout`, never for a service.
    Admin,
    /// A person with the CLI: reads, submits, answers, approves, cancels, resolves.
    Operator,
    Intake,
    Step,
    Tool,
    Approval,
    Timer,
    Reconciler,
    /// The retention service (`kedge serve retention`): the one service that may purge, and only
    /// the streams a finished run has data in. Not part of [`Kind::All`]: a deployment that
    /// applies a retention policy gives these credentials to that process alone.
    Retention,
    Projector,
    Bridge,
    Gateway,
    /// The union of every service kind (not admin, not operator): one process running several
    /// services (`kedge serve all`).
    All,
}

impl Kind {
    pub const EVERY: &[Kind] = &[
        Kind::Admin,
        Kind::Operator,
        Kind::Intake,
        Kind::Step,
        Kind::Tool,
        Kind::Approval,
        Kind::Timer,
        Kind::Reconciler,
        Kind::Retention,
        Kind::Projector,
        Kind::Bridge,
        Kind::Gateway,
        Kind::All,
    ];

    /// The service kinds [`Kind::All`] unites.
    pub const SERVICES: &[Kind] = &[
        Kind::Intake,
        Kind::Step,
        Kind::Tool,
        Kind::Approval,
        Kind::Timer,
        Kind::Reconciler,
        Kind::Projector,
        Kind::Bridge,
        Kind::Gateway,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Admin => "admin",
            Kind::Operator => "operator",
            Kind::Intake => "intake",
            Kind::Step => "step",
            Kind::Tool => "tool",
            Kind::Approval => "approval",
            Kind::Timer => "timer",
            Kind::Reconciler => "reconciler",
            Kind::Retention => "retention",
            Kind::Projector => "projector",
            Kind::Bridge => "bridge",
            Kind::Gateway => "gateway",
            Kind::All => "all",
        }
    }

    /// The user name of this kind in the `KEDGE` account (for password users).
    pub fn user(self) -> String {
        format!("kedge-{}", self.as_str())
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Kind {
    type Err = SecureError;
    fn from_str(s: &str) -> Result<Self, SecureError> {
        Kind::EVERY
            .iter()
            .copied()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| SecureError::Spec(format!("`{s}` is not a kind of Kedge user")))
    }
}

/// How the server recognises a user. The password is written into the server configuration as
/// given: pass a bcrypt hash (`$2a$…`) to keep the clear text out of it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Identity {
    /// An nkey's public key (`U…`); the seed stays with the user.
    Nkey(String),
    /// A user name and password.
    Password { user: String, password: String },
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Identity::Nkey(k) => write!(f, "Nkey({k})"),
            Identity::Password { user, .. } => write!(f, "Password({user}, <redacted>)"),
        }
    }
}

/// A tenant's user or approver in the spec file.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UserSpec {
    /// The user's name: for password users the login, for approvers the name their decisions
    /// carry (a subject token: letters, digits, `_`, `-`).
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// An nkey public key (`U…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nkey: Option<String>,
}

impl fmt::Debug for UserSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UserSpec")
            .field("name", &self.name)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("nkey", &self.nkey)
            .finish()
    }
}

/// One tenant: its users (submit, follow, answer, message, cancel, callbacks) and its
/// approvers (the same, and decide approvals).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    pub name: TenantId,
    #[serde(default)]
    pub users: Vec<UserSpec>,
    #[serde(default)]
    pub approvers: Vec<UserSpec>,
}

/// The input of `kedge nats-config`: the tenants (`nats/secure/tenants.example.json`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    #[serde(default)]
    pub tenants: Vec<TenantSpec>,
}

/// A spec that cannot be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecureError {
    #[error("tenants spec: {0}")]
    Spec(String),
}

fn token_ok(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

fn nkey_ok(k: &str) -> bool {
    k.len() == 56
        && k.starts_with('U')
        && k.chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
}

impl Spec {
    /// Parses and checks a spec: unique tenant and user names, subject-safe names, exactly one of
    /// password or nkey per user.
    pub fn parse(text: &str) -> Result<Spec, SecureError> {
        let spec: Spec =
            serde_json::from_str(text).map_err(|e| SecureError::Spec(e.to_string()))?;
        spec.check()?;
        Ok(spec)
    }

    pub fn check(&self) -> Result<(), SecureError> {
        let mut tenants = std::collections::BTreeSet::new();
        let mut logins = std::collections::BTreeSet::new();
        for kind in Kind::EVERY {
            logins.insert(kind.user());
        }
        for t in &self.tenants {
            if !tenants.insert(t.name.clone()) {
                return Err(SecureError::Spec(format!(
                    "tenant `{}` appears twice",
                    t.name
                )));
            }
            let mut names = std::collections::BTreeSet::new();
            for u in t.users.iter().chain(&t.approvers) {
                let at = format!("tenant `{}`, user `{}`", t.name, u.name);
                if !token_ok(&u.name) {
                    return Err(SecureError::Spec(format!(
                        "{at}: a name is 1-64 of [A-Za-z0-9_-]"
                    )));
                }
                if !names.insert(u.name.clone()) {
                    return Err(SecureError::Spec(format!("{at}: appears twice")));
                }
                match (&u.password, &u.nkey) {
                    (Some(p), None) => {
                        if p.len() < 12 {
                            return Err(SecureError::Spec(format!(
                                "{at}: a password needs at least 12 characters"
                            )));
                        }
                        // A login is server-wide: no two accounts may have the same user.
                        if !logins.insert(u.name.clone()) {
                            return Err(SecureError::Spec(format!(
                                "{at}: the login is used elsewhere (logins are server-wide)"
                            )));
                        }
                    }
                    (None, Some(k)) if nkey_ok(k) => {}
                    (None, Some(_)) => {
                        return Err(SecureError::Spec(format!(
                            "{at}: `nkey` must be a user public key (56 characters, starting with U)"
                        )));
                    }
                    _ => {
                        return Err(SecureError::Spec(format!(
                            "{at}: give exactly one of `password` or `nkey`"
                        )));
                    }
                }
            }
        }
        Ok(())
    }
}

fn user_entry(identity: &Identity, permissions: Option<Value>) -> Value {
    let mut u = match identity {
        Identity::Nkey(k) => json!({ "nkey": k }),
        Identity::Password { user, password } => json!({ "user": user, "password": password }),
    };
    if let Some(p) = permissions {
        u["permissions"] = p;
    }
    u
}

/// What a tenant gateway user and approver may publish, and the imports of its account.
fn tenant_user(spec: &UserSpec, approver: bool) -> Value {
    let mut publish = subjects::tenant_publish();
    if approver {
        publish.push(subjects::tenant_approvals(&spec.name));
    }
    let permissions = json!({
        "publish": {"allow": publish},
        "subscribe": {"allow": [subjects::INBOXES]},
    });
    let identity = match (&spec.nkey, &spec.password) {
        (Some(k), _) => Identity::Nkey(k.clone()),
        (None, p) => Identity::Password {
            user: spec.name.clone(),
            password: p.clone().unwrap_or_default(),
        },
    };
    user_entry(&identity, Some(permissions))
}

/// The `accounts` block (as a nats-server configuration fragment: `accounts: {…}`) for the given
/// service identities and tenants. Kinds without an identity get no user.
pub fn render(spec: &Spec, services: &BTreeMap<Kind, Identity>) -> Result<String, SecureError> {
    spec.check()?;
    let mut kedge_users = Vec::new();
    for (kind, identity) in services {
        kedge_users.push(user_entry(identity, kind_permissions(*kind)));
    }
    let mut exports = Vec::new();
    let mut accounts = serde_json::Map::new();
    for t in &spec.tenants {
        let account = tenant_account(&t.name);
        exports.push(json!({
            "service": subjects::gateway_all(t.name.as_str()),
            "accounts": [account],
            "response_type": "stream",
        }));
        let import = |from: &str, to: &str| {
            json!({
                "service": {"account": KEDGE_ACCOUNT, "subject": subjects::gateway_import(t.name.as_str(), from)},
                "to": to,
                "share": true,
            })
        };
        let users: Vec<Value> = t
            .users
            .iter()
            .map(|u| tenant_user(u, false))
            .chain(t.approvers.iter().map(|u| tenant_user(u, true)))
            .collect();
        accounts.insert(
            account,
            json!({
                "users": users,
                "imports": subjects::TENANT_IMPORTS
                    .iter()
                    .map(|(from, to)| import(from, to))
                    .collect::<Vec<_>>(),
            }),
        );
    }
    accounts.insert(
        KEDGE_ACCOUNT.to_owned(),
        json!({
            "jetstream": "enabled",
            "users": kedge_users,
            "exports": exports,
        }),
    );
    let body = serde_json::to_string_pretty(&Value::Object(accounts))
        .map_err(|e| SecureError::Spec(e.to_string()))?;
    Ok(format!(
        "# Generated by `kedge nats-config`: Kedge's account, its least-privilege users and one\n\
         # account per tenant. Do not edit by hand; change the tenants file and generate it\n\
         # again (the users' permissions are built by Kedge). docs/SECURITY.md explains it.\n\
         accounts: {body}\n"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(name: &str) -> UserSpec {
        UserSpec {
            name: name.into(),
            password: Some(format!("{name}-password-123")),
            nkey: None,
        }
    }

    fn spec() -> Spec {
        Spec {
            tenants: vec![TenantSpec {
                name: "acme".parse().expect("valid"),
                users: vec![user("acme-app")],
                approvers: vec![user("alice")],
            }],
        }
    }

    #[test]
    fn tenants_get_an_account_of_their_own_with_mapped_imports() {
        let mut services = BTreeMap::new();
        services.insert(Kind::Step, Identity::Nkey("U".repeat(56)));
        let text = render(&spec(), &services).expect("renders");
        assert!(text.starts_with("# Generated"));
        let json_text = text
            .split_once("accounts: ")
            .map(|(_, b)| b)
            .expect("accounts block");
        let v: Value = serde_json::from_str(json_text).expect("the block is JSON");
        let acme = &v["TENANT_acme"];
        assert!(acme.get("jetstream").is_none(), "tenants have no JetStream");
        let imports = acme["imports"].as_array().expect("imports");
        assert!(imports.iter().all(|i| i["share"] == true));
        assert!(
            imports
                .iter()
                .any(|i| i["to"] == "agent.task.*"
                    && i["service"]["subject"] == "kedge.t.acme.task.*")
        );
        let exports = v["KEDGE"]["exports"].as_array().expect("exports");
        assert_eq!(exports[0]["accounts"], json!(["TENANT_acme"]));
        let users = acme["users"].as_array().expect("users");
        let app = &users[0]["permissions"]["publish"]["allow"];
        assert!(!app.to_string().contains("kedge.approve"), "{app}");
        let alice = &users[1]["permissions"]["publish"]["allow"];
        assert!(
            alice.to_string().contains("kedge.approve.alice.>"),
            "{alice}"
        );
        assert_eq!(v["KEDGE"]["users"][0]["nkey"], "U".repeat(56));
    }

    #[test]
    fn bad_specs_are_refused_with_a_reason() {
        let mut s = spec();
        s.tenants[0].users[0].nkey = Some("UABC".into());
        assert!(
            s.check()
                .expect_err("both")
                .to_string()
                .contains("exactly one")
        );
        s.tenants[0].users[0].password = None;
        assert!(
            s.check()
                .expect_err("short nkey")
                .to_string()
                .contains("public key")
        );
        let mut s = spec();
        s.tenants.push(s.tenants[0].clone());
        assert!(s.check().expect_err("dup").to_string().contains("twice"));
        let mut s = spec();
        s.tenants[0].approvers[0].name = "al.ice".into();
        assert!(s.check().is_err());
        let mut s = spec();
        s.tenants[0].users[0].name = "kedge-step".into();
        assert!(
            s.check()
                .expect_err("clash")
                .to_string()
                .contains("server-wide")
        );
        let debug = format!("{:?}", spec());
        assert!(!debug.contains("password-123"), "{debug}");
    }
}
