//! Connections with a send timeout: a client that stops reading cannot hold a stream (and its
//! request slot, queue share and frames) for as long as its TCP connection stays open.
//!
//! The clock runs only while a write is blocked, that is while encoded bytes are waiting for
//! the socket, and restarts whenever the socket takes a byte; so a slow server (nothing to
//! send) never times out a healthy client, and a slow but reading client is never cut. On
//! expiry the write fails, hyper drops the connection (the response ends without its final
//! chunk), the response body is dropped, and the request's job sees its client gone.
//! [`ConnInfo::timed_out`] tells the job why, for the `client_timeout` outcome.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Sleep;

/// A TCP listener whose connections carry the send timeout.
pub struct TimeoutListener {
    inner: TcpListener,
    send_timeout: Option<Duration>,
}

impl TimeoutListener {
    /// `send_timeout`: `None` turns the timeout off.
    pub fn new(inner: TcpListener, send_timeout: Option<Duration>) -> Self {
        TimeoutListener {
            inner,
            send_timeout,
        }
    }
}

/// What a handler can learn about its connection (`ConnectInfo<ConnInfo>`).
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub remote: SocketAddr,
    timed_out: Arc<AtomicBool>,
}

impl ConnInfo {
    /// Whether the connection was closed because the client stopped taking bytes.
    pub fn timed_out(&self) -> bool {
        self.timed_out.load(Ordering::SeqCst)
    }
}

impl Listener for TimeoutListener {
    type Io = TimeoutIo;
    type Addr = ConnInfo;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, remote)) => {
                    let _ = stream.set_nodelay(true);
                    let timed_out = Arc::new(AtomicBool::new(false));
                    let io = TimeoutIo {
                        inner: stream,
                        timeout: self.send_timeout,
                        stalled: None,
                        timed_out: timed_out.clone(),
                    };
                    return (io, ConnInfo { remote, timed_out });
                }
                Err(e) => {
                    // Per-connection errors (reset before accept) are the client's; running out
                    // of file descriptors is ours: wait a little for some to be released.
                    if !matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionRefused
                            | io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                    ) {
                        tracing::error!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(ConnInfo {
            remote: self.inner.local_addr()?,
            timed_out: Arc::new(AtomicBool::new(false)),
        })
    }
}

impl Connected<IncomingStream<'_, TimeoutListener>> for ConnInfo {
    fn connect_info(stream: IncomingStream<'_, TimeoutListener>) -> Self {
        stream.remote_addr().clone()
    }
}

/// A TCP stream whose writes fail after being blocked for longer than the timeout.
pub struct TimeoutIo {
    inner: TcpStream,
    timeout: Option<Duration>,
    /// Running while a write or flush is blocked.
    stalled: Option<Pin<Box<Sleep>>>,
    timed_out: Arc<AtomicBool>,
}

impl TimeoutIo {
    /// A write-side poll result, with the clock started, kept or reset.
    fn watch<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match r {
            Poll::Pending => {
                let Some(timeout) = self.timeout else {
                    return Poll::Pending;
                };
                let sleep = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if sleep.as_mut().poll(cx).is_ready() {
                    self.timed_out.store(true, Ordering::SeqCst);
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client took no bytes within the send timeout",
                    )));
                }
                Poll::Pending
            }
            done => {
                self.stalled = None;
                done
            }
        }
    }
}

impl AsyncRead for TimeoutIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for TimeoutIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn pair(timeout: Duration) -> (TimeoutIo, ConnInfo, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut l = TimeoutListener::new(listener, Some(timeout));
        // A small receive buffer, so that each read opens the window again.
        let client = tokio::spawn(async move {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.set_recv_buffer_size(64 << 10).unwrap();
            s.connect(addr).await.unwrap()
        });
        let (io, info) = l.accept().await;
        (io, info, client.await.unwrap())
    }

    #[tokio::test]
    async fn a_client_that_reads_nothing_times_out_and_one_that_reads_slowly_does_not() {
        // Nobody reads: the socket buffers fill, then the write blocks past the timeout.
        let (mut io, info, _client) = pair(Duration::from_millis(300)).await;
        let chunk = vec![7u8; 64 << 10];
        let err = loop {
            match io.write_all(&chunk).await {
                Ok(()) => continue,
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(info.timed_out());

        // A reader that takes a little every 100 ms keeps a 300 ms timeout from firing,
        // although the writer is blocked most of the time.
        let (mut io, info, mut client) = pair(Duration::from_millis(300)).await;
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 64 << 10];
            let mut total = 0usize;
            while total < 2 << 20 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                match client.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => total += n,
                }
            }
            total
        });
        for _ in 0..(2 << 20) / chunk.len() {
            io.write_all(&chunk)
                .await
                .expect("a reading client is never timed out");
        }
        drop(io);
        assert!(reader.await.unwrap() > 0);
        assert!(!info.timed_out());
    }
}
