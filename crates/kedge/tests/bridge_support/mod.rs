//! What the bridge tests share: tokens, an in-process bridge that can be stopped and started
//! again on the same port, the projector, a small HTTP client, and an SSE client that parses the
//! wire format itself (so the tests see exactly what a browser would).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use futures::StreamExt;
use kedge_runtime::config::BridgeToken;
use kedge_runtime::{Config, Runtime};

#[allow(clippy::duplicate_mod)]
#[path = "../support/secure.rs"]
mod secure;
use reqwest::StatusCode;
use serde_json::Value;

pub const ACME: &str = "acme-write-token-0123456789";
pub const ACME_READ: &str = "acme-read-token-0123456789";
pub const GLOBEX: &str = "globex-write-token-0123456789";
/// An acme token that may write but not decide approvals.
pub const ACME_NO_APPROVE: &str = "acme-noapprove-token-0123456789";

/// `base` with the bridge listening on `listen` and the test tokens (ACME and GLOBEX may write
/// and approve).
pub fn bridge_config(base: &Config, listen: &str) -> Config {
    let mut c = base.clone();
    c.bridge.listen = listen.to_owned();
    c.bridge.tokens = vec![
        BridgeToken {
            token: ACME.into(),
            tenant: "acme".into(),
            scope: "write+approve".into(),
        },
        BridgeToken {
            token: ACME_NO_APPROVE.into(),
            tenant: "acme".into(),
            scope: "write".into(),
        },
        BridgeToken {
            token: ACME_READ.into(),
            tenant: "acme".into(),
            scope: "read".into(),
        },
        BridgeToken {
            token: GLOBEX.into(),
            tenant: "globex".into(),
            scope: "write+approve".into(),
        },
    ];
    c.bridge.heartbeat_ms = 500;
    c.bridge.sse_retry_ms = 200;
    c.bridge.max_body_bytes = 64 * 1024;
    c.check().expect("valid bridge config");
    c
}

/// A bridge served by this process.
pub struct TestBridge {
    pub addr: SocketAddr,
    pub bridge: kedge_bridge::Bridge,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl TestBridge {
    /// Starts a bridge on `addr` (`127.0.0.1:0` for any port); retries a port still held by a
    /// bridge that just stopped.
    pub async fn start(config: Config, addr: &str) -> TestBridge {
        let config = secure::as_kind(&config, kedge_runtime::secure::Kind::Bridge);
        let rt = Runtime::connect(config).await.expect("bridge runtime");
        let bridge = kedge_bridge::Bridge::new(rt).await.expect("bridge");
        let mut tries = 0;
        let listener = loop {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => break l,
                Err(e) if tries < 50 => {
                    tries += 1;
                    tracing::debug!(error = %e, "port busy; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("cannot bind {addr}: {e}"),
            }
        };
        let addr = listener.local_addr().expect("addr");
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let b = bridge.clone();
        let task = tokio::spawn(async move {
            kedge_bridge::serve(b, listener, async move {
                let _ = rx.await;
            })
            .await
            .expect("bridge served");
        });
        TestBridge {
            addr,
            bridge,
            stop,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Graceful stop: SSE streams end, the port is released.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(15), self.task).await;
    }
}

/// Runs the projector in this process, as `kedge serve projector` runs it, until the returned
/// handle is aborted (which kills it: `kedge_serve::TransientKedge` dropped).
pub fn spawn_projector(config: &Config) -> tokio::task::JoinHandle<()> {
    let config = secure::as_kind(config, kedge_runtime::secure::Kind::Projector);
    tokio::spawn(async move {
        let mut services = kedge_serve::TransientKedge::new();
        let projector = services.start(config, &[kedge_serve::Service::Projector]);
        services.wait(projector).await.expect("projector");
    })
}

/// A JSON client of the API with one token (or none).
#[derive(Clone)]
pub struct Api {
    pub http: reqwest::Client,
    pub base: String,
    pub token: Option<String>,
}

impl Api {
    pub fn new(base: &str, token: Option<&str>) -> Api {
        Api {
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .expect("client"),
            base: base.to_owned(),
            token: token.map(str::to_owned),
        }
    }

    pub fn with_token(&self, token: Option<&str>) -> Api {
        Api {
            token: token.map(str::to_owned),
            ..self.clone()
        }
    }

    fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    async fn finish(r: reqwest::RequestBuilder) -> (StatusCode, Value) {
        let resp = r.send().await.expect("request sent");
        let status = resp.status();
        let ct = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let bytes = resp.bytes().await.expect("body");
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        if !status.is_success() {
            assert_eq!(
                ct, "application/problem+json",
                "error {status} without problem details: {body}"
            );
            assert_eq!(body["status"], status.as_u16(), "{body}");
            assert!(
                body["detail"].as_str().is_some_and(|d| !d.is_empty()),
                "{body}"
            );
        }
        (status, body)
    }

    pub async fn get(&self, path: &str) -> (StatusCode, Value) {
        Self::finish(self.req(reqwest::Method::GET, path)).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        Self::finish(self.req(reqwest::Method::POST, path).json(body)).await
    }

    pub async fn post_raw(
        &self,
        path: &str,
        body: impl Into<reqwest::Body>,
        headers: &[(&str, &str)],
    ) -> (StatusCode, Value) {
        let mut r = self
            .req(reqwest::Method::POST, path)
            .header("content-type", "application/json")
            .body(body);
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        Self::finish(r).await
    }

    pub async fn submit(&self, agent: &str, input: &str, key: &str) -> (StatusCode, Value) {
        self.post_raw(
            "/v1/runs",
            serde_json::json!({"agent": agent, "input": input}).to_string(),
            &[("Idempotency-Key", key)],
        )
        .await
    }

    /// Every public event id of a run, through `/history` pages.
    pub async fn history_ids(&self, run: &str) -> Vec<u64> {
        let mut ids = Vec::new();
        let mut after = 0;
        loop {
            let (s, body) = self
                .get(&format!("/v1/runs/{run}/history?after={after}&limit=7"))
                .await;
            assert_eq!(s, StatusCode::OK, "{body}");
            for e in body["events"].as_array().expect("events") {
                ids.push(e["seq"].as_u64().expect("seq"));
            }
            match body["next_after"].as_u64() {
                Some(n) => after = n,
                None => return ids,
            }
        }
    }
}

/// One SSE item as it came over the wire.
#[derive(Debug, Clone, PartialEq)]
pub enum Sse {
    Event {
        id: Option<u64>,
        event: String,
        data: Value,
    },
    Comment,
    Retry(u64),
}

/// A parsed SSE response.
pub struct SseStream {
    pub status: StatusCode,
    body: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: Vec<u8>,
}

impl SseStream {
    /// `GET <url>` with an optional `Last-Event-ID`.
    pub async fn open(
        http: &reqwest::Client,
        url: &str,
        token: Option<&str>,
        last_event_id: Option<u64>,
    ) -> reqwest::Result<SseStream> {
        let mut r = http.get(url).header("accept", "text/event-stream");
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        if let Some(id) = last_event_id {
            r = r.header("last-event-id", id.to_string());
        }
        let resp = r.send().await?;
        Ok(SseStream {
            status: resp.status(),
            body: resp.bytes_stream().boxed(),
            buf: Vec::new(),
        })
    }

    /// The next item; `None` when the stream ended (or broke).
    pub async fn next(&mut self) -> Option<Sse> {
        loop {
            if let Some(pos) = find_blank_line(&self.buf) {
                let block: Vec<u8> = self.buf.drain(..pos + 2).collect();
                if let Some(item) = parse_block(&block[..pos]) {
                    return Some(item);
                }
                continue;
            }
            match self.body.next().await {
                Some(Ok(chunk)) => self.buf.extend_from_slice(&chunk),
                Some(Err(_)) | None => return None,
            }
        }
    }
}

fn find_blank_line(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\n\n")
}

fn parse_block(block: &[u8]) -> Option<Sse> {
    let text = String::from_utf8_lossy(block);
    let mut id = None;
    let mut event = None;
    let mut data = String::new();
    let mut comment = false;
    for line in text.lines() {
        if line.starts_with(':') {
            comment = true;
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "id" => id = value.parse().ok(),
            "event" => event = Some(value.to_owned()),
            "data" => {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(value);
            }
            "retry" => return value.parse().ok().map(Sse::Retry),
            _ => {}
        }
    }
    if data.is_empty() && event.is_none() {
        return comment.then_some(Sse::Comment);
    }
    Some(Sse::Event {
        id,
        event: event.unwrap_or_else(|| "message".into()),
        data: serde_json::from_str(&data).unwrap_or(Value::String(data)),
    })
}

/// Whether an SSE event type ends a run's stream when the run is finished.
pub fn is_terminal(event: &str) -> bool {
    matches!(event, "run.succeeded" | "run.failed" | "run.cancelled")
}
