//! Connections a handler can reset: how the `reset` trouble closes a connection without any
//! HTTP response.
//!
//! [`serve`](crate::serve) accepts through a [`ResettableListener`], whose streams carry a shared
//! [`ConnReset`] flag; the router is served with that flag as its connect info, so a handler can
//! raise it. Once raised, the stream refuses every read and write: when hyper goes to write the
//! handler's response, the write fails before a byte leaves, hyper drops the connection, and the
//! stream, closing with `SO_LINGER` 0, sends a TCP RST. The client sees its connection reset
//! before any response header, as it would behind a failing gateway.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// The flag that resets one connection. Cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub(crate) struct ConnReset(Arc<AtomicBool>);

impl ConnReset {
    /// Resets the connection: nothing more is read or written on it, and it closes with a RST.
    pub(crate) fn reset(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn is_reset(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

impl Connected<IncomingStream<'_, ResettableListener>> for ConnReset {
    fn connect_info(stream: IncomingStream<'_, ResettableListener>) -> ConnReset {
        stream.io().reset.clone()
    }
}

/// A TCP listener whose connections can be reset by the handler serving them.
#[derive(Debug)]
pub(crate) struct ResettableListener(pub(crate) TcpListener);

impl Listener for ResettableListener {
    type Io = ResettableStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (ResettableStream, SocketAddr) {
        // axum's accept loop: it retries (and logs) accept errors itself.
        let (stream, addr) = Listener::accept(&mut self.0).await;
        let stream = ResettableStream {
            stream,
            reset: ConnReset::default(),
        };
        (stream, addr)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.0.local_addr()
    }
}

/// A TCP stream that fails every operation once its [`ConnReset`] is raised.
#[derive(Debug)]
pub(crate) struct ResettableStream {
    stream: TcpStream,
    reset: ConnReset,
}

impl ResettableStream {
    fn check(&self) -> io::Result<()> {
        if self.reset.is_reset() {
            Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "mock-llm: connection reset by trouble",
            ))
        } else {
            Ok(())
        }
    }
}

impl AsyncRead for ResettableStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for ResettableStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.stream).poll_shutdown(cx)
    }
}

impl Drop for ResettableStream {
    fn drop(&mut self) {
        if self.reset.is_reset() {
            // Closing with a zero linger sends a RST instead of a FIN: a reset, not an end.
            if let Err(e) = self.stream.set_zero_linger() {
                tracing::debug!(error = %e, "mock-llm: could not set SO_LINGER 0 for a reset");
            }
        }
    }
}
