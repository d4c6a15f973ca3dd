//! The fault-injecting TCP proxy: plain TCP against an echo server, and one real NATS client
//! reconnecting through it (that one needs a nats-server: run `scripts/setup.sh` first, or set
//! `KEDGE_NATS_SERVER`).

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use kedge_testkit::NatsServer;
use kedge_testkit::proxy::TcpProxy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Bound of every wait that is expected to succeed.
const WAIT: Duration = Duration::from_secs(3);
/// How long an echo that must not come back is waited for.
const SILENCE: Duration = Duration::from_millis(300);

/// An echo server on a loopback port: every connection gets back what it sends, and is closed
/// when its client closes. Aborted on drop.
struct Echo {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Echo {
    async fn start() -> Echo {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the echo server");
        let addr = listener.local_addr().expect("echo server address");
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                tokio::spawn(async move {
                    let (mut read, mut write) = stream.split();
                    // Ends on EOF or an error (a reset); the stream is then closed.
                    let _ = tokio::io::copy(&mut read, &mut write).await;
                });
            }
        });
        Echo { addr, task }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn connect(proxy: &TcpProxy) -> TcpStream {
    tokio::time::timeout(WAIT, TcpStream::connect(proxy.addr()))
        .await
        .expect("connect to the proxy in time")
        .expect("connect to the proxy")
}

/// Writes `message` and reads exactly as many bytes back, within `within`.
async fn echo(stream: &mut TcpStream, message: &[u8], within: Duration) -> io::Result<Vec<u8>> {
    let round_trip = async {
        stream.write_all(message).await?;
        let mut back = vec![0_u8; message.len()];
        stream.read_exact(&mut back).await?;
        Ok(back)
    };
    tokio::time::timeout(within, round_trip)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no echo in time"))?
}

/// Reads exactly `len` bytes within [`WAIT`].
async fn read_exactly(stream: &mut TcpStream, len: usize) -> Vec<u8> {
    let mut back = vec![0_u8; len];
    tokio::time::timeout(WAIT, stream.read_exact(&mut back))
        .await
        .expect("bytes arrive in time")
        .expect("read the bytes");
    back
}

/// Asserts that the stream ends (EOF or an error such as a reset) within [`WAIT`]; returns the
/// error, `None` for EOF.
async fn assert_closed(stream: &mut TcpStream, what: &str) -> Option<io::Error> {
    let mut buf = [0_u8; 64];
    let started = Instant::now();
    loop {
        match tokio::time::timeout(
            WAIT.saturating_sub(started.elapsed()),
            stream.read(&mut buf),
        )
        .await
        {
            Err(_) => panic!("{what}: the connection was not closed within {WAIT:?}"),
            Ok(Ok(0)) => return None,
            Ok(Err(e)) => return Some(e),
            // Bytes still in flight before the close: keep reading.
            Ok(Ok(_)) => {}
        }
    }
}

/// Asserts that the stream is reset (a TCP RST, not an orderly close) within [`WAIT`].
async fn assert_reset(stream: &mut TcpStream, what: &str) {
    let end = assert_closed(stream, what).await;
    assert!(
        end.as_ref()
            .is_some_and(|e| e.kind() == io::ErrorKind::ConnectionReset),
        "{what}: expected a connection reset, got {end:?}"
    );
}

/// Polls until the proxy counts `n` open connections, within [`WAIT`].
async fn wait_connections(proxy: &TcpProxy, n: usize) {
    let deadline = Instant::now() + WAIT;
    while proxy.connections() != n {
        assert!(
            Instant::now() < deadline,
            "the proxy counts {} connections, expected {n}",
            proxy.connections()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn bytes_go_through_both_ways() {
    let echo_server = Echo::start().await;
    let proxy = TcpProxy::start(echo_server.addr)
        .await
        .expect("start the proxy");
    assert_eq!(proxy.addr().ip().to_string(), "127.0.0.1");
    assert_eq!(
        proxy.url(),
        format!("nats://127.0.0.1:{}", proxy.addr().port())
    );
    assert_eq!(proxy.upstream(), echo_server.addr);

    let mut client = connect(&proxy).await;
    assert_eq!(
        echo(&mut client, b"hello", WAIT).await.expect("echo"),
        b"hello"
    );
    // More than one proxy buffer, so it takes several reads and writes each way.
    let big: Vec<u8> = (0..200_000_u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(echo(&mut client, &big, WAIT).await.expect("big echo"), big);
}

#[tokio::test]
async fn connections_are_counted_and_dropping_the_proxy_closes_them() {
    let echo_server = Echo::start().await;
    let proxy = TcpProxy::start(echo_server.addr)
        .await
        .expect("start the proxy");
    assert_eq!(proxy.connections(), 0);

    let mut clients = Vec::new();
    for _ in 0..3 {
        let mut client = connect(&proxy).await;
        echo(&mut client, b"x", WAIT).await.expect("echo");
        clients.push(client);
    }
    assert_eq!(proxy.connections(), 3);

    // A client closing its end closes the connection through the proxy.
    drop(clients.pop());
    wait_connections(&proxy, 2).await;

    drop(proxy);
    for (i, client) in clients.iter_mut().enumerate() {
        assert_closed(client, &format!("client {i} after the proxy was dropped")).await;
    }
}

#[tokio::test]
async fn reset_closes_every_connection_and_new_ones_work() {
    let echo_server = Echo::start().await;
    let proxy = TcpProxy::start(echo_server.addr)
        .await
        .expect("start the proxy");
    let mut first = connect(&proxy).await;
    let mut second = connect(&proxy).await;
    echo(&mut first, b"one", WAIT).await.expect("echo on first");
    echo(&mut second, b"two", WAIT)
        .await
        .expect("echo on second");
    assert_eq!(proxy.connections(), 2);

    let reset_at = Instant::now();
    proxy.reset();
    assert_reset(&mut first, "first client after reset").await;
    assert_reset(&mut second, "second client after reset").await;
    assert!(
        reset_at.elapsed() < Duration::from_secs(1),
        "the reset took {:?}",
        reset_at.elapsed()
    );
    wait_connections(&proxy, 0).await;

    let mut third = connect(&proxy).await;
    assert_eq!(
        echo(&mut third, b"three", WAIT)
            .await
            .expect("echo after reset"),
        b"three"
    );
    assert_eq!(proxy.connections(), 1);
}

#[tokio::test]
async fn reset_for_refuses_new_connections_until_the_window_has_passed() {
    let window = Duration::from_millis(500);
    let echo_server = Echo::start().await;
    let proxy = TcpProxy::start(echo_server.addr)
        .await
        .expect("start the proxy");
    let mut before = connect(&proxy).await;
    echo(&mut before, b"before", WAIT).await.expect("echo");

    let reset_at = Instant::now();
    proxy.reset_for(window);
    assert_reset(&mut before, "the connection open at reset_for").await;

    // Within the window, a connection is accepted (or not) but carries nothing.
    let attempt_at = reset_at.elapsed();
    assert!(
        attempt_at < window,
        "the machine is too slow to test inside a {window:?} window ({attempt_at:?})"
    );
    if let Ok(mut during) = TcpStream::connect(proxy.addr()).await {
        let result = echo(&mut during, b"during", WAIT).await;
        assert!(
            result.is_err(),
            "a connection made {attempt_at:?} into the window carried data: {result:?}"
        );
    }
    assert_eq!(
        proxy.connections(),
        0,
        "a refused connection is not counted"
    );

    // Retry until a connection carries data: the first that does comes after the window.
    let deadline = reset_at + window + WAIT;
    loop {
        let attempt_at = reset_at.elapsed();
        let worked = match TcpStream::connect(proxy.addr()).await {
            Ok(mut stream) => echo(&mut stream, b"after", Duration::from_millis(500))
                .await
                .is_ok_and(|back| back == b"after"),
            Err(_) => false,
        };
        if worked {
            assert!(
                attempt_at + Duration::from_millis(5) >= window,
                "a connection made {attempt_at:?} after reset_for({window:?}) carried data"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no connection worked within {WAIT:?} after the window"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test]
async fn blackhole_holds_bytes_and_keeps_connections_open() {
    let echo_server = Echo::start().await;
    let proxy = TcpProxy::start(echo_server.addr)
        .await
        .expect("start the proxy");
    let mut client = connect(&proxy).await;
    echo(&mut client, b"warm", WAIT).await.expect("echo");

    proxy.blackhole(true);
    assert!(proxy.is_blackholed());
    client
        .write_all(b"ping")
        .await
        .expect("write while blackholed");
    let mut buf = [0_u8; 4];
    let read = tokio::time::timeout(SILENCE, client.read(&mut buf)).await;
    assert!(
        read.is_err(),
        "something came back through the blackhole: {read:?}"
    );
    assert_eq!(proxy.connections(), 1, "the connection stays open");

    // A new connection is accepted but carries nothing either.
    let mut newcomer = connect(&proxy).await;
    let read = echo(&mut newcomer, b"new", SILENCE).await;
    assert!(
        read.as_ref()
            .is_err_and(|e| e.kind() == io::ErrorKind::TimedOut),
        "the new connection got an answer or was closed: {read:?}"
    );
    wait_connections(&proxy, 2).await;

    proxy.blackhole(false);
    assert!(!proxy.is_blackholed());
    // Bytes are held, not dropped: what was written during the partition arrives first.
    assert_eq!(read_exactly(&mut client, 4).await, b"ping");
    assert_eq!(
        echo(&mut client, b"pong", WAIT)
            .await
            .expect("echo on the same connection after the partition"),
        b"pong"
    );
    assert_eq!(read_exactly(&mut newcomer, 3).await, b"new");
    assert_eq!(
        echo(&mut newcomer, b"again", WAIT)
            .await
            .expect("echo on the connection made during the partition"),
        b"again"
    );
}

#[tokio::test]
async fn a_nats_client_reconnects_after_reset_for() {
    let server = NatsServer::start().await;
    let upstream = SocketAddr::from(([127, 0, 0, 1], server.port()));
    let proxy = TcpProxy::start(upstream).await.expect("start the proxy");
    let client = tokio::time::timeout(WAIT, async_nats::connect(proxy.url()))
        .await
        .expect("connect through the proxy in time")
        .expect("connect through the proxy");
    // The test's own view of the broker goes around the proxy: only the client's path is cut.
    let direct = jetstream::new(server.client().await);
    let stream = direct
        .create_stream(stream::Config {
            name: "PROXY".to_owned(),
            subjects: vec!["proxy.test.>".to_owned()],
            ..Default::default()
        })
        .await
        .expect("create the stream");
    let js = jetstream::new(client.clone());

    let seq = round_trip(&client, &js, "before", Duration::from_secs(5))
        .await
        .expect("round trip before the fault");
    let stored = stream.get_raw_message(seq).await.expect("stored message");
    assert_eq!(&stored.payload[..], b"before");
    assert_eq!(proxy.connections(), 1);
    let connects_before = client.statistics().connects.load(Ordering::SeqCst);

    let reset_at = Instant::now();
    proxy.reset_for(Duration::from_secs(1));
    // Once the old connection is gone, nothing can pass until the client has reconnected, which
    // the proxy refuses for the first second.
    wait_connections(&proxy, 0).await;

    let deadline = reset_at + Duration::from_secs(10);
    let seq = loop {
        match round_trip(&client, &js, "after", Duration::from_millis(500)).await {
            Ok(seq) => break seq,
            Err(e) => assert!(
                Instant::now() < deadline,
                "no round trip through the proxy within 10 s of reset_for(1s): {e}"
            ),
        }
    };
    let recovered_after = reset_at.elapsed();
    assert!(
        recovered_after >= Duration::from_secs(1),
        "a round trip worked {recovered_after:?} after reset_for(1s)"
    );
    let connects_after = client.statistics().connects.load(Ordering::SeqCst);
    assert!(
        connects_after > connects_before,
        "the client did not reconnect ({connects_before} -> {connects_after} connects)"
    );
    let stored = stream.get_raw_message(seq).await.expect("stored message");
    assert_eq!(&stored.payload[..], b"after");
    assert_eq!(proxy.connections(), 1);
}

/// Round trips through `client`, bounded by `within`: a core NATS request answered by the server
/// (JetStream account info, `$JS.API.INFO`), then a JetStream publish whose ack comes back on the
/// client's reply subscription. Returns the stored message's sequence.
async fn round_trip(
    client: &async_nats::Client,
    js: &jetstream::Context,
    payload: &'static str,
    within: Duration,
) -> Result<u64, String> {
    let attempt = async {
        let reply = client
            .request("$JS.API.INFO", "".into())
            .await
            .map_err(|e| format!("request: {e}"))?;
        let reply = String::from_utf8_lossy(&reply.payload);
        if !reply.contains("account_info_response") {
            return Err(format!("unexpected account info reply: {reply}"));
        }
        let ack = js
            .publish("proxy.test.events", payload.into())
            .await
            .map_err(|e| format!("publish: {e}"))?
            .await
            .map_err(|e| format!("publish ack: {e}"))?;
        Ok(ack.sequence)
    };
    tokio::time::timeout(within, attempt)
        .await
        .map_err(|_| format!("no round trip within {within:?}"))?
}
