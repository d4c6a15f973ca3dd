//! A controllable TCP proxy, to cut the network between one process and its nats-server.
//!
//! [`TcpProxy::start`] listens on a free loopback port and forwards every connection it accepts
//! to one upstream address (a test's [`NatsServer`](crate::NatsServer)). The process under test
//! is given [`TcpProxy::url`] instead of the server's own URL; everything else (other services,
//! the test's own client) keeps talking to the server directly. The test then injects a network
//! fault between that one process and the broker:
//!
//! - [`TcpProxy::reset`]: every open connection is reset, both sides at once (`SO_LINGER` 0, so
//!   each peer reads a TCP RST). Models a connection dropped by the network, a NAT table or a
//!   load balancer: the client notices at once and reconnects, and the reconnect succeeds.
//! - [`TcpProxy::reset_for`]: the same, and for a while every new connection is accepted and
//!   reset at once, so reconnect attempts fail. Models a few seconds of network loss.
//! - [`TcpProxy::blackhole`]: a silent partition. Connections stay open but nothing passes in
//!   either direction (not even a close), so the client only notices through its own timeouts
//!   (pings, request deadlines). Bytes are **held, not dropped**: the proxy stops reading, so
//!   they wait in the kernel's socket buffers, and once the partition is lifted they are
//!   delivered in order, as TCP would after retransmitting. A process that gave up on the
//!   connection meanwhile has closed it, and that close is delivered as well.
//!
//! ```no_run
//! # async fn demo() {
//! use std::net::{Ipv4Addr, SocketAddr};
//! use std::time::Duration;
//! use kedge_testkit::{NatsServer, proxy::TcpProxy};
//!
//! let server = NatsServer::start().await;
//! let proxy = TcpProxy::start(SocketAddr::from((Ipv4Addr::LOCALHOST, server.port())))
//!     .await
//!     .expect("start the proxy");
//! let client = async_nats::connect(proxy.url()).await.expect("connect through the proxy");
//! // Three seconds without network for this client only; it reconnects afterwards.
//! proxy.reset_for(Duration::from_secs(3));
//! # drop(client);
//! # }
//! ```
//!
//! The control methods are synchronous and may be called from any thread. The forwarding runs on
//! tokio tasks of the runtime that called [`TcpProxy::start`]; dropping the [`TcpProxy`] stops
//! them and closes every connection. An I/O error on either side of a connection just ends that
//! connection (the other side is reset).

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// Size of each direction's copy buffer: the most a connection holds in the proxy itself.
const BUFFER_SIZE: usize = 16 * 1024;
/// Cap of a [`TcpProxy::reset_for`] window (so that `Instant + d` cannot overflow).
const LONGEST_REFUSAL: Duration = Duration::from_secs(365 * 24 * 3600);
/// Pause after a failed `accept` (for example too many open files) before the next one.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(20);

/// A TCP proxy on 127.0.0.1 to one upstream address, with fault injection; see the
/// [module docs](self).
///
/// Dropping it stops the accept loop and every forwarding task, which closes all connections.
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    /// The accept loop; it owns the connections' tasks, so aborting it aborts them all.
    accept_task: JoinHandle<()>,
}

/// State shared by the handle and the tasks.
#[derive(Debug)]
struct Shared {
    upstream: SocketAddr,
    /// Bumped by every reset: each connection watches it and resets itself when it changes.
    reset_epoch: watch::Sender<u64>,
    /// Whether the proxy is blackholed (nothing is forwarded).
    blackhole: watch::Sender<bool>,
    /// New connections are reset at once until this instant.
    refuse_until: Mutex<Option<Instant>>,
    /// Client connections currently open through the proxy.
    open: AtomicUsize,
}

impl Shared {
    fn refusing(&self) -> bool {
        let until = *self
            .refuse_until
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        until.is_some_and(|until| Instant::now() < until)
    }
}

impl TcpProxy {
    /// Listens on `127.0.0.1:0` and, for every accepted connection, connects to `upstream` and
    /// copies bytes both ways on tokio tasks of the current runtime.
    ///
    /// # Errors
    /// If the listener cannot be bound.
    pub async fn start(upstream: SocketAddr) -> io::Result<TcpProxy> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream,
            reset_epoch: watch::Sender::new(0),
            blackhole: watch::Sender::new(false),
            refuse_until: Mutex::new(None),
            open: AtomicUsize::new(0),
        });
        let accept_task = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(TcpProxy {
            addr,
            shared,
            accept_task,
        })
    }

    /// The address clients connect to (`127.0.0.1:<port>`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `nats://127.0.0.1:<port>`: the URL to give the process under test.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.addr.port())
    }

    /// The upstream address connections are forwarded to.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream
    }

    /// Resets every open connection at once, both the client's and the upstream side, with
    /// `SO_LINGER` 0 so each peer reads a TCP RST (a connection dropped by the network, a NAT or
    /// a load balancer). New connections are accepted normally afterwards.
    pub fn reset(&self) {
        self.shared.reset_epoch.send_modify(|epoch| *epoch += 1);
    }

    /// Like [`TcpProxy::reset`], and for `d` from now every new connection is accepted and reset
    /// at once without reaching upstream, so a client cannot reconnect until `d` has passed (a
    /// few seconds of network loss). A later call can only lengthen a window still running; a `d`
    /// over a year counts as a year.
    pub fn reset_for(&self, d: Duration) {
        {
            let mut until = self
                .shared
                .refuse_until
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let new_until = Instant::now() + d.min(LONGEST_REFUSAL);
            *until = Some(until.map_or(new_until, |old| old.max(new_until)));
        }
        // After the window is set: a connection accepted concurrently is either refused by the
        // accept loop or sees this reset.
        self.reset();
    }

    /// Turns the silent partition on or off. While on, no byte passes in either direction on
    /// any connection, nor does a close; open connections stay open and new ones are accepted
    /// (and connected upstream) but carry nothing. Bytes are held, not dropped: they stay unread
    /// in the socket buffers (plus at most one 16 KiB buffer per direction in the proxy) and are
    /// delivered in order after `blackhole(false)`, which resumes forwarding on every connection
    /// still open. Bytes already handed to the kernel before the call may still arrive.
    pub fn blackhole(&self, on: bool) {
        self.shared.blackhole.send_replace(on);
    }

    /// Whether the partition of [`TcpProxy::blackhole`] is on.
    pub fn is_blackholed(&self) -> bool {
        *self.shared.blackhole.borrow()
    }

    /// Client connections currently open through the proxy (refused ones are not counted).
    pub fn connections(&self) -> usize {
        self.shared.open.load(Ordering::SeqCst)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        // Dropping the accept loop's future drops its JoinSet, which aborts every connection
        // task, whose streams are then closed.
        self.accept_task.abort();
    }
}

/// Counts one open connection in [`Shared::open`] for as long as it lives (also when its task
/// is aborted).
#[derive(Debug)]
struct OpenGuard(Arc<Shared>);

impl OpenGuard {
    fn new(shared: &Arc<Shared>) -> OpenGuard {
        shared.open.fetch_add(1, Ordering::SeqCst);
        OpenGuard(Arc::clone(shared))
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        let accepted = listener.accept().await;
        // Reap finished connection tasks so the set does not grow.
        while connections.try_join_next().is_some() {}
        let client = match accepted {
            Ok((client, _)) => client,
            Err(_) => {
                // Transient (a connection aborted before it was accepted, no file descriptors
                // left): try again shortly.
                tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                continue;
            }
        };
        // Subscribed before the refusal check: a `reset_for` racing with this accept is either
        // seen by the check or changes the epoch after the subscription.
        let reset = shared.reset_epoch.subscribe();
        if shared.refusing() {
            abort(client);
            continue;
        }
        let guard = OpenGuard::new(&shared);
        connections.spawn(serve(client, Arc::clone(&shared), reset, guard));
    }
}

/// Forwards one client connection until it ends, fails or is reset.
async fn serve(
    client: TcpStream,
    shared: Arc<Shared>,
    mut reset: watch::Receiver<u64>,
    _open: OpenGuard,
) {
    let upstream = tokio::select! {
        connected = TcpStream::connect(shared.upstream) => match connected {
            Ok(upstream) => upstream,
            Err(_) => {
                // Upstream refused or unreachable: the client sees its connection reset.
                abort(client);
                return;
            }
        },
        _ = reset.changed() => {
            abort(client);
            return;
        }
    };
    // Small protocol messages should not wait for Nagle: the proxy adds no latency of its own.
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (mut client, mut upstream) = (client, upstream);
    let clean_end = {
        let (client_read, client_write) = client.split();
        let (upstream_read, upstream_write) = upstream.split();
        let forward = async {
            tokio::try_join!(
                pump(client_read, upstream_write, shared.blackhole.subscribe()),
                pump(upstream_read, client_write, shared.blackhole.subscribe()),
            )
        };
        tokio::select! {
            result = forward => result.is_ok(),
            _ = reset.changed() => false,
        }
    };
    if clean_end {
        // Both sides closed their end in turn: close normally.
        drop(client);
        drop(upstream);
    } else {
        // Reset by the test, or an I/O error on one side: reset both.
        abort(client);
        abort(upstream);
    }
}

/// Copies `from` to `to` until `from` ends (then closes `to`'s write side, a half close) or
/// either fails. Holds everything, end of stream included, while the proxy is blackholed.
async fn pump(
    mut from: ReadHalf<'_>,
    mut to: WriteHalf<'_>,
    mut blackhole: watch::Receiver<bool>,
) -> io::Result<()> {
    let mut buf = vec![0_u8; BUFFER_SIZE];
    loop {
        // Not reading while blackholed leaves the bytes in the socket buffer: held, not lost.
        wait_while_blackholed(&mut blackhole).await?;
        let n = from.read(&mut buf).await?;
        if n == 0 {
            wait_while_blackholed(&mut blackhole).await?;
            to.shutdown().await?;
            return Ok(());
        }
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            wait_while_blackholed(&mut blackhole).await?;
            tokio::select! {
                written = to.write(rest) => {
                    let written = written?;
                    if written == 0 {
                        return Err(io::ErrorKind::WriteZero.into());
                    }
                    rest = &rest[written..];
                }
                // A write waiting for buffer space is abandoned (nothing of it was written) when
                // the partition starts, and retried after.
                started = blackhole.wait_for(|on| *on) => {
                    if started.is_err() {
                        return Err(proxy_gone());
                    }
                }
            }
        }
    }
}

/// Returns once the proxy is not blackholed (at once if it is not).
async fn wait_while_blackholed(blackhole: &mut watch::Receiver<bool>) -> io::Result<()> {
    match blackhole.wait_for(|on| !*on).await {
        Ok(_) => Ok(()),
        Err(_) => Err(proxy_gone()),
    }
}

fn proxy_gone() -> io::Error {
    io::Error::other("the proxy was dropped")
}

/// Closes a stream with a TCP RST: `SO_LINGER` 0, then close. If the option cannot be set, a
/// plain close.
fn abort(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}
