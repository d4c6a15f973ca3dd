//! Liveness and readiness of a `kedge serve` process, served beside
//! `/metrics` on `metrics_addr`:
//!
//! - `GET /healthz`: 200 while the process runs (its event loop answers).
//! - `GET /readyz`: 200 when the process does its work — connected to NATS, the broker layout
//!   verified (the process got that far), every service it runs started and not in a restart
//!   back-off, and every durable consumer those services use bound — else 503 with the reasons
//!   as JSON. A load balancer or orchestrator sends work (and traffic to the bridge) only to a
//!   ready process; a restart of a failing one is for liveness to decide.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, OnceLock};

use serde::Serialize;

#[derive(Default)]
struct State {
    client: Option<async_nats::Client>,
    /// Service name → why it is not running (`None`: running).
    services: BTreeMap<String, Option<String>>,
    expected_consumers: BTreeSet<String>,
    bound_consumers: BTreeSet<String>,
    draining: bool,
}

static STATE: OnceLock<Mutex<State>> = OnceLock::new();

fn with<T>(f: impl FnOnce(&mut State) -> T) -> Option<T> {
    STATE
        .get_or_init(Mutex::default)
        .lock()
        .ok()
        .map(|mut s| f(&mut s))
}

/// The process's NATS connection, whose state readiness reports.
pub fn watch_connection(client: &async_nats::Client) {
    with(|s| s.client = Some(client.clone()));
}

/// `name` is expected to run; not ready until [`service_up`].
pub fn expect_service(name: &str, consumers: &[&str]) {
    with(|s| {
        s.services
            .insert(name.to_owned(), Some("starting".to_owned()));
        s.expected_consumers
            .extend(consumers.iter().map(|c| (*c).to_owned()));
    });
}

/// A run of service `name` started.
pub fn service_up(name: &str) {
    with(|s| s.services.insert(name.to_owned(), None));
}

/// Service `name` failed and waits to be restarted.
pub fn service_down(name: &str, reason: &str) {
    with(|s| s.services.insert(name.to_owned(), Some(reason.to_owned())));
}

/// Durable consumer `name` is bound (`kedge_runtime::consumer::durable`).
pub fn consumer_bound(name: &str) {
    with(|s| s.bound_consumers.insert(name.to_owned()));
}

/// The process is shutting down: no longer ready (it takes no new work).
pub fn draining() {
    with(|s| s.draining = true);
}

/// What `/readyz` answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Readiness {
    pub ready: bool,
    /// Why not, one line each.
    pub reasons: Vec<String>,
}

/// The process's readiness now.
pub fn readiness() -> Readiness {
    let reasons = with(|s| {
        let mut reasons = Vec::new();
        if s.draining {
            reasons.push("shutting down".to_owned());
        }
        match &s.client {
            Some(c) if c.connection_state() == async_nats::connection::State::Connected => {}
            Some(c) => reasons.push(format!("NATS connection {}", c.connection_state())),
            None => reasons.push("not connected to NATS yet".to_owned()),
        }
        for (name, down) in &s.services {
            if let Some(why) = down {
                reasons.push(format!("service {name}: {why}"));
            }
        }
        for c in s.expected_consumers.difference(&s.bound_consumers) {
            reasons.push(format!("consumer {c} not bound"));
        }
        reasons
    })
    .unwrap_or_else(|| vec!["health state unavailable".to_owned()]);
    Readiness {
        ready: reasons.is_empty(),
        reasons,
    }
}

/// `/healthz` and `/readyz`.
pub fn router() -> axum::Router {
    axum::Router::new()
        .route("/healthz", axum::routing::get(|| async { "ok\n" }))
        .route(
            "/readyz",
            axum::routing::get(|| async {
                let r = readiness();
                let code = if r.ready {
                    axum::http::StatusCode::OK
                } else {
                    axum::http::StatusCode::SERVICE_UNAVAILABLE
                };
                (code, axum::Json(r))
            }),
        )
}
