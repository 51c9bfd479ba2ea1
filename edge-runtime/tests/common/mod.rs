//! Helpers shared by the speculation tests (adaptive k, pipelining).

#![allow(clippy::unwrap_used, dead_code)]

use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A TCP proxy that delays every chunk by `delay` in each direction.
pub fn start_delay_proxy(
    rt: &tokio::runtime::Runtime,
    upstream: SocketAddr,
    delay: Duration,
) -> SocketAddr {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                continue;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::spawn(pump(cr, sw, delay));
            tokio::spawn(pump(sr, cw, delay));
        }
    });
    addr
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        tokio::time::sleep(delay).await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
