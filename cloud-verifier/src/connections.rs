//! The connection cap: accepted TCP connections hold a permit of a semaphore
//! for their lifetime; when none is left, a new connection is closed at once
//! (counted as `CONNECTION_LIMIT` in the refusal metrics).

use crate::metrics::Metrics;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// An accepted connection and its permit.
pub struct CappedConn {
    inner: TcpStream,
    _permit: OwnedSemaphorePermit,
}

/// The listener's connections, at most `max` open at once, with TCP_NODELAY
/// set. (`Server::tcp_nodelay` only applies to listeners tonic binds itself;
/// with our own listener Nagle stays on unless set here, and a verdict — a
/// small write after the previous one is still unacknowledged — then waits
/// for the peer's delayed ACK, tens of ms per round; docs/verifier.md.)
pub fn capped(
    listener: TcpListener,
    max: usize,
    metrics: Arc<Metrics>,
) -> impl Stream<Item = io::Result<CappedConn>> {
    let permits = Arc::new(Semaphore::new(max.min(Semaphore::MAX_PERMITS)));
    TcpListenerStream::new(listener).filter_map(move |conn| match conn {
        Ok(stream) => match permits.clone().try_acquire_owned() {
            Ok(permit) => {
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::warn!("TCP_NODELAY on an accepted connection: {e}");
                }
                Some(Ok(CappedConn {
                    inner: stream,
                    _permit: permit,
                }))
            }
            Err(_) => {
                metrics.error("CONNECTION_LIMIT");
                tracing::warn!(max, "connection refused: limits.max_connections reached");
                None
            }
        },
        Err(e) => Some(Err(e)),
    })
}

impl Connected for CappedConn {
    type ConnectInfo = TcpConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl AsyncRead for CappedConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for CappedConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
