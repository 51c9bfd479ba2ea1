//! The proxy as a user meets it: real TCP on 127.0.0.1, an echo (or sink)
//! server made here, timing checked with strict lower bounds (never faster
//! than configured) and loose upper bounds (the machine is shared).

#![allow(clippy::unwrap_used)] // test helpers; a panic is a test failure

use std::net::SocketAddr;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tandem_netsim::{Jitter, LinkConfig, NetConfig, Proxy, ProxyHandle, Segment, Step, Timeline};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::{timeout, Instant};

fn ms(x: u64) -> Duration {
    Duration::from_millis(x)
}

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// An echo server: writes back what it reads, closes its side after EOF.
async fn echo_server() -> SocketAddr {
    let l = TcpListener::bind(any_port()).await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                if tokio::io::copy(&mut r, &mut w).await.is_ok() {
                    let _ = w.shutdown().await;
                }
            });
        }
    });
    addr
}

/// A server that reports (arrival time, bytes) of every read.
async fn recording_server() -> (SocketAddr, mpsc::UnboundedReceiver<(Instant, Vec<u8>)>) {
    let l = TcpListener::bind(any_port()).await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            });
        }
    });
    (addr, rx)
}

async fn start(upstream: SocketAddr, config: NetConfig) -> ProxyHandle {
    Proxy::start(any_port(), upstream, config).await.unwrap()
}

fn link(latency_ms: u64) -> LinkConfig {
    LinkConfig {
        latency: ms(latency_ms),
        ..LinkConfig::default()
    }
}

async fn roundtrip(s: &mut TcpStream, msg: &[u8]) -> Duration {
    let t = Instant::now();
    s.write_all(msg).await.unwrap();
    let mut back = vec![0u8; msg.len()];
    s.read_exact(&mut back).await.unwrap();
    assert_eq!(back, msg);
    t.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_arrives_intact_and_in_order_under_jitter_and_loss() {
    let echo = echo_server().await;
    let cfg = NetConfig::symmetric(
        "rough",
        LinkConfig {
            latency: ms(3),
            jitter: Jitter::Uniform { max: ms(3) },
            loss: 0.05,
            rto: ms(20),
            ..LinkConfig::default()
        },
    );
    let proxy = Proxy::start_seeded(any_port(), echo, cfg, 42)
        .await
        .unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let data: Vec<u8> = (0..400_000).map(|_| rng.gen()).collect();
    let s = TcpStream::connect(proxy.local_addr()).await.unwrap();
    let (mut r, mut w) = s.into_split();
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        // Irregular write sizes so chunks are many and varied.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
        let mut i = 0;
        while i < sent.len() {
            let n = rng.gen_range(1..5000).min(sent.len() - i);
            w.write_all(&sent[i..i + n]).await.unwrap();
            i += n;
        }
        w.shutdown().await.unwrap();
    });
    let mut back = Vec::new();
    timeout(Duration::from_secs(15), r.read_to_end(&mut back))
        .await
        .expect("echo did not finish")
        .unwrap();
    writer.await.unwrap();
    assert_eq!(back.len(), data.len());
    assert!(back == data, "bytes corrupted or reordered");
    let st = proxy.stats();
    assert_eq!(st.bytes_up, data.len() as u64);
    assert_eq!(st.bytes_down, data.len() as u64);
    assert!(st.stalls > 0, "loss 5% never stalled: {st:?}");
    assert_eq!(st.resets, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_way_delay_is_the_configured_latency() {
    let (server, mut arrivals) = recording_server().await;
    let cfg = NetConfig {
        name: "asym".into(),
        up: link(80),
        down: link(0),
    };
    let proxy = start(server, cfg).await;
    let mut s = TcpStream::connect(proxy.local_addr()).await.unwrap();
    for i in 0..4u8 {
        let t = Instant::now();
        s.write_all(&[i; 10]).await.unwrap();
        let (at, bytes) = timeout(Duration::from_secs(5), arrivals.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(bytes, [i; 10]);
        let d = at - t;
        assert!(d >= ms(80), "message {i} arrived after {d:?} < 80 ms");
        assert!(d < ms(400), "message {i} took {d:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_is_twice_the_latency_of_a_named_profile() {
    let echo = echo_server().await;
    // fast-4g: 165 ms RTT.
    let proxy = start(echo, NetConfig::profile("fast-4g").unwrap()).await;
    let mut s = TcpStream::connect(proxy.local_addr()).await.unwrap();
    for _ in 0..2 {
        let rtt = roundtrip(&mut s, b"ping").await;
        assert!(rtt >= ms(165), "{rtt:?}");
        assert!(rtt < ms(600), "{rtt:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bandwidth_limit_holds_for_a_1mb_transfer() {
    let (server, mut arrivals) = recording_server().await;
    let cfg = NetConfig {
        name: "8mbps-up".into(),
        up: LinkConfig {
            bandwidth_bps: Some(8_000_000), // 1,000,000 B/s
            ..LinkConfig::default()
        },
        down: LinkConfig::default(),
    };
    let proxy = start(server, cfg).await;
    let mut s = TcpStream::connect(proxy.local_addr()).await.unwrap();
    let total = 1_000_000usize;
    let t = Instant::now();
    s.write_all(&vec![7u8; total]).await.unwrap();
    let mut got = 0;
    let mut last = t;
    while got < total {
        let (at, b) = timeout(Duration::from_secs(10), arrivals.recv())
            .await
            .unwrap()
            .unwrap();
        got += b.len();
        last = at;
    }
    let secs = (last - t).as_secs_f64();
    // (1 MB - 1500 B burst) at 1 MB/s: never faster than 0.9985 s.
    assert!(secs >= 0.998, "1 MB at 8 Mbps took only {secs:.3} s");
    assert!(secs < 2.5, "1 MB at 8 Mbps took {secs:.3} s");
    assert_eq!(got, total);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_blackholes_then_resumes_without_closing() {
    let echo = echo_server().await;
    let proxy = start(echo, NetConfig::perfect()).await;
    let mut s = TcpStream::connect(proxy.local_addr()).await.unwrap();
    roundtrip(&mut s, b"before").await;

    proxy.set_profile(NetConfig::offline()).unwrap();
    s.write_all(b"during").await.unwrap();
    let mut buf = [0u8; 6];
    // Nothing comes back, and nothing is closed (no EOF, no error).
    assert!(timeout(ms(400), s.read(&mut buf)).await.is_err());
    // New connections are still accepted during the outage.
    let mut s2 = TcpStream::connect(proxy.local_addr()).await.unwrap();
    s2.write_all(b"second").await.unwrap();
    let mut buf2 = [0u8; 6];
    assert!(timeout(ms(200), s2.read(&mut buf2)).await.is_err());

    proxy.set_profile(NetConfig::perfect()).unwrap();
    timeout(Duration::from_secs(5), s.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&buf, b"during");
    timeout(Duration::from_secs(5), s2.read_exact(&mut buf2))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&buf2, b"second");
    roundtrip(&mut s, b"after").await;
    assert_eq!(proxy.stats().resets, 0);
}

fn assert_reset(r: std::io::Result<usize>) {
    match r {
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        Ok(n) => panic!("expected a connection reset, read {n} bytes"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commanded_reset_gives_the_client_a_connection_reset() {
    let echo = echo_server().await;
    let proxy = start(echo, NetConfig::perfect()).await;
    let mut s = TcpStream::connect(proxy.local_addr()).await.unwrap();
    roundtrip(&mut s, b"hello").await;
    proxy.reset_connections();
    let mut buf = [0u8; 8];
    let r = timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .unwrap();
    assert_reset(r);
    // The proxy keeps serving new connections.
    let mut s2 = TcpStream::connect(proxy.local_addr()).await.unwrap();
    roundtrip(&mut s2, b"again").await;
    assert_eq!(proxy.stats().resets, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_reset_fires_with_probability_one() {
    let echo = echo_server().await;
    let cfg = NetConfig::perfect().map_links(|l| l.reset_prob = 1.0);
    let proxy = start(echo, cfg).await;
    let mut s = TcpStream::connect(proxy.local_addr()).await.unwrap();
    s.write_all(b"x").await.unwrap();
    let mut buf = [0u8; 8];
    let r = timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .unwrap();
    assert_reset(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_resets_the_client() {
    // Bind then drop: a port with nobody listening.
    let dead = TcpListener::bind(any_port())
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let proxy = start(dead, NetConfig::perfect()).await;
    // The RST may even beat the end of the client's connect on loopback.
    match TcpStream::connect(proxy.local_addr()).await {
        Ok(mut s) => {
            let mut buf = [0u8; 8];
            let r = timeout(Duration::from_secs(5), s.read(&mut buf))
                .await
                .unwrap();
            assert_reset(r);
        }
        Err(e) => assert_reset(Err(e)),
    }
    assert_eq!(proxy.stats().resets, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_close_delays_the_fin() {
    let echo = echo_server().await;
    let cfg = NetConfig::perfect().map_links(|l| l.close_delay = ms(250));
    let proxy = start(echo, cfg).await;
    let mut s = TcpStream::connect(proxy.local_addr()).await.unwrap();
    roundtrip(&mut s, b"data").await;
    let t = Instant::now();
    s.shutdown().await.unwrap();
    let mut rest = Vec::new();
    timeout(Duration::from_secs(5), s.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    // FIN up (250 ms), echo closes, FIN down (250 ms).
    let d = t.elapsed();
    assert!(d >= ms(500), "{d:?}");
    assert!(d < ms(2000), "{d:?}");
    assert!(rest.is_empty());
}

fn seg(config: NetConfig, d: Option<u64>) -> Segment {
    Segment {
        step: Step::Conditions(config),
        duration: d.map(ms),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeline_switches_conditions_over_time() {
    let echo = echo_server().await;
    let proxy = start(echo, NetConfig::perfect()).await;
    let timeline = Timeline::new(vec![
        seg(NetConfig::symmetric("fast", link(0)), Some(300)),
        seg(NetConfig::offline(), Some(500)),
        seg(NetConfig::symmetric("slow", link(100)), None),
    ])
    .unwrap();
    let t0 = Instant::now();
    proxy.set_timeline(timeline);
    let mut s = TcpStream::connect(proxy.local_addr()).await.unwrap();
    let rtt = roundtrip(&mut s, b"a").await;
    assert!(rtt < ms(250), "fast segment took {rtt:?}");
    assert_eq!(proxy.config().name, "fast");

    tokio::time::sleep_until(t0 + ms(400)).await;
    assert_eq!(proxy.config().name, "offline");
    roundtrip(&mut s, b"b").await;
    // Sent during the outage: held until it ends at 800 ms, then 2 x 100 ms.
    let done = t0.elapsed();
    assert!(
        done >= ms(1000),
        "echo during the outage came back at {done:?}"
    );
    assert_eq!(proxy.config().name, "slow");

    let rtt = roundtrip(&mut s, b"c").await;
    assert!(rtt >= ms(200) && rtt < ms(800), "slow segment RTT {rtt:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parsed_timeline_with_reset_resets_open_connections() {
    let echo = echo_server().await;
    let proxy = start(echo, NetConfig::perfect()).await;
    proxy.set_timeline(Timeline::parse("loopback 300ms, reset, lan").unwrap());
    let mut s = TcpStream::connect(proxy.local_addr()).await.unwrap();
    roundtrip(&mut s, b"ok").await;
    let mut buf = [0u8; 4];
    let r = timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .unwrap();
    assert_reset(r);
    assert_eq!(proxy.config().name, "lan");
    let mut s2 = TcpStream::connect(proxy.local_addr()).await.unwrap();
    roundtrip(&mut s2, b"fine").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_profile_rejects_invalid_conditions_and_shutdown_stops_listening() {
    let echo = echo_server().await;
    let proxy = start(echo, NetConfig::perfect()).await;
    assert!(proxy
        .set_profile(NetConfig::perfect().with_loss(2.0))
        .is_err());
    assert_eq!(proxy.config().name, "perfect");
    let addr = proxy.local_addr();
    proxy.shutdown().await;
    assert!(TcpStream::connect(addr).await.is_err());
    assert!(
        Proxy::start(any_port(), echo, NetConfig::perfect().with_loss(-1.0))
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_reset_and_a_freed_slot_is_reused() {
    let echo = echo_server().await;
    let proxy = start(echo, NetConfig::perfect()).await;
    proxy.set_max_connections(2);
    let mut a = TcpStream::connect(proxy.local_addr()).await.unwrap();
    let mut b = TcpStream::connect(proxy.local_addr()).await.unwrap();
    roundtrip(&mut a, b"a").await;
    roundtrip(&mut b, b"b").await;
    // The third is reset on arrival (the RST may beat the end of connect).
    match TcpStream::connect(proxy.local_addr()).await {
        Ok(mut c) => {
            let w = c.write_all(b"c").await;
            let mut buf = [0u8; 8];
            let r = timeout(Duration::from_secs(5), c.read(&mut buf))
                .await
                .unwrap();
            // The socket reports the RST once: to the write when it arrived
            // first (the read then sees a closed socket, 0 bytes), else to
            // the read.
            match w {
                Err(e) => assert!(
                    matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                    ),
                    "{e}"
                ),
                Ok(()) => assert_reset(r),
            }
        }
        Err(e) => assert_reset(Err(e)),
    }
    assert_eq!(proxy.stats().refused, 1);
    assert_eq!(proxy.stats().connections, 2);
    // The open ones are untouched; closing one frees its slot.
    roundtrip(&mut a, b"still").await;
    drop(b);
    let mut d = None;
    for _ in 0..500 {
        // The proxy notices b's close asynchronously: retry until a new
        // connection is admitted (bounded; each refused try is counted).
        // A refused try may be reset before connect() even returns.
        let Ok(mut s) = TcpStream::connect(proxy.local_addr()).await else {
            tokio::time::sleep(ms(10)).await;
            continue;
        };
        if s.write_all(b"d").await.is_ok() {
            let mut buf = [0u8; 1];
            if let Ok(Ok(1)) = timeout(Duration::from_secs(5), s.read(&mut buf)).await {
                d = Some(s);
                break;
            }
        }
        tokio::time::sleep(ms(10)).await;
    }
    let mut d = d.expect("a freed slot was never reused");
    roundtrip(&mut d, b"again").await;
    assert_eq!(proxy.stats().connections, 3);
}
