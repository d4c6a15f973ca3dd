//! The web console: runs, a run's live timeline, and the human side of a run, served at `/`.
//!
//! Three files (`services/bridge/console/`: `index.html`, `app.js`, `app.css`), plain HTML, CSS
//! and JavaScript with no framework and no build step, compiled into the binary with
//! `include_str!`: a bridge serves its console with no network, no CDN and no files beside it,
//! and the console is always the one that matches the API it talks to. (A framework would need a
//! toolchain and a download at build time, and vendoring one means auditing and updating code
//! that is much larger than the console itself.)
//!
//! Invariants:
//! - **Same origin as the API**, so there is no CORS and the SSE ticket cookie
//!   ([`crate::ticket`]) is sent by `EventSource` on its own.
//! - **A strict Content-Security-Policy** ([`CSP`]): scripts, styles and connections only from
//!   the bridge itself, no inline script or style, no `eval`, no framing, no forms posted
//!   elsewhere. The page renders every piece of run data with `textContent` (never
//!   `innerHTML`), so a tool result or a model answer cannot become markup.
//! - **No secret in a URL.** The bearer token lives in the tab's `sessionStorage` and travels
//!   in `Authorization` headers; event streams use the ticket cookie. Routes are URL fragments
//!   (`#/runs/<id>`), which browsers never send to a server.

use axum::Router;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::Bridge;

/// The page.
pub const INDEX_HTML: &str = include_str!("../console/index.html");
/// The console's script.
pub const APP_JS: &str = include_str!("../console/app.js");
/// The console's style sheet.
pub const APP_CSS: &str = include_str!("../console/app.css");

/// The Content-Security-Policy of every console asset.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
     frame-ancestors 'none'";

/// The console's routes (kept apart from the API's [`crate::ROUTES`] and `openapi.json`).
pub const CONSOLE_ROUTES: &[(&str, &str)] = &[
    ("GET", "/"),
    ("GET", "/console/app.js"),
    ("GET", "/console/app.css"),
];

/// The router of the console's assets.
pub fn router() -> Router<Bridge> {
    Router::new()
        .route(
            "/",
            get(|| async { asset(INDEX_HTML, "text/html; charset=utf-8") }),
        )
        .route(
            "/console/app.js",
            get(|| async { asset(APP_JS, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/console/app.css",
            get(|| async { asset(APP_CSS, "text/css; charset=utf-8") }),
        )
}

fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut r = (StatusCode::OK, body).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // The assets change only with the binary; revalidate rather than keep a stale console.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_only_its_own_assets_and_has_no_inline_script_or_style() {
        assert!(INDEX_HTML.contains(r#"<script src="/console/app.js" defer></script>"#));
        assert!(INDEX_HTML.contains(r#"href="/console/app.css""#));
        assert_eq!(INDEX_HTML.matches("<script").count(), 1, "one script tag");
        assert!(!INDEX_HTML.contains("<style"), "no inline style element");
        assert!(!INDEX_HTML.contains("style="), "no inline style attribute");
        for handler in ["onclick", "onload", "onerror", "onsubmit", "javascript:"] {
            assert!(!INDEX_HTML.contains(handler), "{handler}");
        }
        assert!(!CSP.contains("unsafe"), "{CSP}");
    }

    #[test]
    fn the_script_never_parses_data_as_markup() {
        for sink in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
            "new Function",
        ] {
            assert!(!APP_JS.contains(sink), "app.js uses {sink}");
        }
        // The token is never put into a URL.
        assert!(!APP_JS.contains("access_token"));
    }
}
