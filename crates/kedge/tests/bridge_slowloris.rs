//! The bridge's header-read timeout: a client that opens a connection and sends half a request
//! line, or trickles its headers a byte at a time, is disconnected once the timeout passes (so is
//! a kept-alive connection left idle); normal requests are still answered. Raw TCP, so the test
//! sees exactly what the server does with the socket.

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::Harness;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The header-read timeout of the bridge under test.
const TIMEOUT: Duration = Duration::from_millis(500);

/// A bridge served in this process with [`TIMEOUT`]; stops when the sender is dropped.
async fn bridge(h: &Harness) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let mut config = common::as_kind(&h.config, kedge_runtime::secure::Kind::Bridge);
    config.bridge.tokens = vec![kedge_runtime::config::BridgeToken {
        token: "acme-write-token-0123456789".into(),
        tenant: "acme".into(),
        scope: "write".into(),
    }];
    let rt = kedge_runtime::Runtime::connect(config)
        .await
        .expect("bridge runtime");
    let bridge = kedge_bridge::Bridge::new(rt).await.expect("bridge");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        kedge_bridge::serve_with_header_timeout(
            bridge,
            listener,
            async move {
                let _ = stopped.await;
            },
            TIMEOUT,
        )
        .await
        .expect("bridge served");
    });
    (addr, stop)
}

/// Reads until the server closes the connection (or 10 s pass); what it sent and when it closed.
async fn read_until_closed(conn: &mut TcpStream, since: Instant) -> (String, Option<Duration>) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = since + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, conn.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                return (
                    String::from_utf8_lossy(&got).into_owned(),
                    Some(since.elapsed()),
                );
            }
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => return (String::from_utf8_lossy(&got).into_owned(), None),
        }
    }
}

/// Sends a whole `GET /healthz` on `conn` and reads the status line of the answer.
async fn healthz(conn: &mut TcpStream) -> String {
    conn.write_all(b"GET /healthz HTTP/1.1\r\nHost: bridge\r\n\r\n")
        .await
        .expect("request sent");
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf))
            .await
            .expect("answered in time")
            .expect("read");
        assert!(
            n > 0,
            "closed before answering: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&got);
    text.lines().next().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn a_client_that_stops_mid_header_is_disconnected_and_others_are_served() {
    let h = Harness::start(json!({"models": {}}), &[]).await;
    let (addr, _stop) = bridge(&h).await;

    // Half a request line, then nothing: closed at the timeout, without an answer.
    let mut slow = TcpStream::connect(addr).await.expect("connect");
    let started = Instant::now();
    slow.write_all(b"GET /v1/ru").await.expect("sent");
    // Meanwhile a normal client is served.
    let mut normal = TcpStream::connect(addr).await.expect("connect");
    assert_eq!(healthz(&mut normal).await, "HTTP/1.1 200 OK");
    let (sent, closed) = read_until_closed(&mut slow, started).await;
    let closed = closed.expect("the half-request connection was closed");
    assert!(
        closed >= TIMEOUT - Duration::from_millis(50) && closed < TIMEOUT * 6,
        "closed after {closed:?}"
    );
    assert!(!sent.contains("200 OK"), "{sent:?}");

    // Headers trickled a byte every 100 ms: still closed at the timeout, although bytes keep
    // coming (the limit is on the whole head, not between bytes).
    let mut trickle = TcpStream::connect(addr).await.expect("connect");
    let started = Instant::now();
    let head = b"GET /healthz HTTP/1.1\r\nHost: bridge\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let mut closed_at = None;
    for byte in head {
        if trickle.write_all(&[*byte]).await.is_err() {
            closed_at = Some(started.elapsed());
            break;
        }
        let mut buf = [0u8; 256];
        match tokio::time::timeout(Duration::from_millis(100), trickle.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed_at = Some(started.elapsed());
                break;
            }
            Ok(Ok(_)) => panic!("answered a trickled request"),
            Err(_) => {}
        }
    }
    let closed_at = closed_at.expect("the trickling connection was closed before its head ended");
    assert!(closed_at < TIMEOUT * 6, "closed after {closed_at:?}");

    // A kept-alive connection left idle is closed at the timeout too (waiting for the next
    // request's head); a new connection is served.
    let (_, idle_closed) = read_until_closed(&mut normal, Instant::now()).await;
    assert!(idle_closed.is_some(), "an idle connection was kept open");
    let mut fresh = TcpStream::connect(addr).await.expect("connect");
    assert_eq!(healthz(&mut fresh).await, "HTTP/1.1 200 OK");
}
