//! A re-open that takes longer than a generation (a verifier slow to open
//! sessions after a failure, as in the fault soak, docs/verifier.md) must still
//! complete: the runtime keeps it in flight across generations and the next
//! generation adopts it. It used to be aborted at the end of every generation,
//! so none ever completed and every later generation stayed provisional.
//! Tiny random models, a real in-process verifier behind a proxy that cuts the
//! live connections and delays every new one.

#![allow(clippy::unwrap_used)]

mod common;
use common::{io_runtime, load, start_tiny_verifier, target_greedy, tiny_models, FP};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tandem_edge::{EdgeConfig, EdgeEvent, EdgeRuntime, TokenStatus};
use tandem_model::speculative::GenerateConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOKEN: &str = "reopen-liveness-token-0123456789";
const PROMPT: &[u32] = &[5, 17, 42, 99, 3, 250, 7];
/// New connections wait this long before they reach the verifier once the
/// link is cut: longer than a generation of the devices below.
const CONNECT_DELAY: Duration = Duration::from_millis(700);

/// A proxy; `cut` (an epoch) silences every connection made before it, and
/// from the first cut on every new connection waits `CONNECT_DELAY`.
fn start_cutting_proxy(
    rt: &tokio::runtime::Runtime,
    upstream: SocketAddr,
) -> (SocketAddr, Arc<AtomicU64>) {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let epoch = Arc::new(AtomicU64::new(0));
    let e = epoch.clone();
    rt.spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let e = e.clone();
            tokio::spawn(async move {
                let mine = e.load(Ordering::SeqCst);
                if mine > 0 {
                    tokio::time::sleep(CONNECT_DELAY).await;
                }
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pump(cr, sw, mine, e.clone()));
                tokio::spawn(pump(sr, cw, mine, e));
            });
        }
    });
    (addr, epoch)
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mine: u64,
    epoch: Arc<AtomicU64>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if epoch.load(Ordering::SeqCst) != mine {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[test]
fn a_reopen_slower_than_a_generation_is_adopted_by_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    let (draft, target) = tiny_models(dir.path());
    let vrt = io_runtime();
    let v = start_tiny_verifier(&vrt, &target, TOKEN);
    let (addr, epoch) = start_cutting_proxy(&vrt, v.grpc_addr);
    let cfg = EdgeConfig {
        verifier_url: Some(format!("http://{addr}")),
        token: Some(TOKEN.into()),
        tokenizer_fingerprint: Some(FP.into()),
        connect_timeout_ms: 3000,
        deadline_initial_ms: 300,
        deadline_max_ms: 300,
        backoff_base_ms: 5,
        backoff_max_ms: 20,
        // The first timeout opens the breaker; the probe (its connection
        // delayed too) half-opens it, and every later generation starts in an
        // outage and re-opens in the background, as in the soak.
        breaker_failures: 1,
        probe_interval_ms: 20,
        probe_timeout_ms: 3000,
        ..EdgeConfig::default()
    };
    let mut edge = EdgeRuntime::builder(load(&draft), cfg).build().unwrap();
    let gen = GenerateConfig {
        k: 4,
        max_tokens: 24,
        ..GenerateConfig::default()
    };
    // A device slower than the tiny model: a generation drafted alone takes
    // about 24 x 10 ms, well under CONNECT_DELAY.
    let mut slow = |e: &EdgeEvent| {
        if let EdgeEvent::Token {
            status: TokenStatus::Provisional,
            ..
        } = e
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    };
    let first = edge
        .generate(PROMPT, &gen, &mut |e| {
            if let EdgeEvent::Token { index: 4, .. } = e {
                epoch.store(1, Ordering::SeqCst);
            }
            slow(e)
        })
        .unwrap();
    assert!(first.stats.failures >= 1, "{:?}", first.stats);
    // Generations until one has verified tokens again (the link works, only
    // new connections are slow).
    let expected = target_greedy(&load(&target), PROMPT, 24);
    let start = Instant::now();
    let mut recovered = None;
    let mut generations = 0;
    while start.elapsed() < Duration::from_secs(8) {
        let g = edge.generate(PROMPT, &gen, &mut slow).unwrap();
        generations += 1;
        if g.statuses.contains(&TokenStatus::Verified) {
            recovered = Some(g);
            break;
        }
    }
    let g = recovered.unwrap_or_else(|| {
        panic!("no verified token in {generations} generations: every re-open was abandoned")
    });
    // The invariant holds through the adoption: a greedy generation is the
    // target's output wherever it is not provisional, and its provisional span
    // was checked (mismatches reported).
    assert_eq!(g.tokens.len(), 24);
    let r = &g.provisional;
    assert_eq!(r.checked_tokens, r.provisional_tokens, "{r:?}");
    if r.mismatched_tokens == 0 {
        assert_eq!(g.tokens, expected);
    }
    vrt.block_on(v.shutdown()).unwrap();
}
