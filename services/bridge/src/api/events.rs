//! A run's events as they happen: `GET /v1/runs/{id}/events` (SSE) and the ticket that lets a
//! browser open it (`POST /v1/runs/{id}/sse-ticket`).

use std::collections::HashMap;
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::Bridge;
use crate::auth::Caller;
use crate::problem::Problem;
use crate::sse::Connection;
use crate::view::Links;

use super::{Result, check_owner, fold, number, owned_run, query, run_id};

/// `GET /v1/runs/{id}/events`
pub(crate) async fn events(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    params: std::result::Result<
        Query<HashMap<String, String>>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Response> {
    let run = run_id(&id)?;
    let params = query(params)?;
    // A browser reconnects to the same URL with Last-Event-ID: the header wins over `after`.
    let after = match headers.get("last-event-id") {
        Some(v) => {
            let s = v.to_str().unwrap_or("").trim();
            if s.is_empty() {
                0
            } else {
                s.parse::<u64>().map_err(|_| {
                    Problem::malformed(
                        "Last-Event-ID",
                        format!("`{s}` is not an event id (a journal sequence)"),
                    )
                })?
            }
        }
        None => number(&params, "after")?.unwrap_or(0),
    };
    let tenant_slot = bridge.quotas.open_stream(&caller.tenant)?;
    let permit = bridge.sse_slots.clone().try_acquire_owned().map_err(|_| {
        Problem::unavailable("this bridge serves its maximum of SSE connections", 2)
    })?;
    let events = match owned_run(&bridge, &caller, &run).await {
        Ok(e) => e,
        // Broker trouble must not make a browser's EventSource give up (it does on any status
        // but 200 and 204): answer an empty stream with the retry hint, so it reconnects.
        Err(p) if p.status == 503 => {
            let body = format!("retry: {}\n\n", bridge.config.sse_retry_ms);
            return Ok(sse_response(Body::from(body)));
        }
        Err(p) => return Err(p),
    };
    let state = fold(&run, &events)?;
    let conn = Connection {
        hub: bridge.hub.clone(),
        journal: bridge.rt.journal.clone(),
        run,
        after,
        events,
        state,
        retry_ms: bridge.config.sse_retry_ms,
        heartbeat: Duration::from_millis(bridge.config.heartbeat_ms),
        shutdown: bridge.shutdown.clone(),
        permit,
        tenant_slot,
    };
    if conn.nothing_to_send() {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    Ok(sse_response(Body::from_stream(conn.into_body())))
}

fn sse_response(body: Body) -> Response {
    let mut r = Response::new(body);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    r
}

/// `POST /v1/runs/{id}/sse-ticket`: an SSE ticket for the run's event stream, as an `HttpOnly;
/// SameSite=Strict` cookie scoped to `/v1/runs/{id}/events` ([`crate::ticket`]), so a browser's
/// `EventSource` needs no token in its URL. Any scope may ask (it only reads).
pub(crate) async fn sse_ticket(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response> {
    let run = run_id(&id)?;
    check_owner(&bridge, &caller, &run).await?;
    let (ticket, expires) = bridge
        .auth
        .issue_ticket(&caller, &run, crate::ticket::now_unix())
        .ok_or_else(|| Problem::internal("no ticket key for this caller"))?;
    // Behind a TLS-terminating proxy the cookie is marked Secure (it only ever names the proxy's
    // own scheme, so a forged header can only make the cookie stricter).
    let secure = headers
        .get("x-forwarded-proto")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    let ttl = bridge.auth.ticket_ttl();
    let cookie = crate::ticket::set_cookie(&run, &ticket, ttl, secure);
    let expires_at = time::OffsetDateTime::from_unix_timestamp(expires as i64)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        });
    let mut response = Json(json!({
        "run_id": run,
        "expires_at": expires_at,
        "ttl_secs": ttl.as_secs(),
        "events": Links::for_run(&run).events,
    }))
    .into_response();
    let h = response.headers_mut();
    h.insert(
        header::SET_COOKIE,
        HeaderValue::from_str(&cookie).map_err(|e| Problem::internal(e.to_string()))?,
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(response)
}
