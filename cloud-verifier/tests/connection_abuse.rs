//! What one unauthenticated peer can hold on the gRPC port: silent sockets
//! (no ClientHello), token-less `Health/Watch` streams, idle HTTP/2
//! connections. None of it may keep an honest device from being served.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use common::*;
use std::net::SocketAddr;
use std::time::Duration;
use tandem_verifier::model_fingerprint;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// A TCP connection to `addr` from the source address `from` (any 127/8
/// address is this host on Linux: another "peer").
async fn connect_from(from: &str, addr: SocketAddr) -> TcpStream {
    let s = TcpSocket::new_v4().unwrap();
    s.bind(format!("{from}:0").parse().unwrap()).unwrap();
    s.connect(addr).await.unwrap()
}

/// Whether the server closed `s` within `within` (EOF or reset).
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 256];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

fn with_token<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

fn watch_req(token: Option<&str>) -> tonic::Request<HealthCheckRequest> {
    with_token(
        HealthCheckRequest {
            service: tandem_proto::VERIFIER_SERVICE_NAME.into(),
        },
        token,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sockets_and_tokenless_watch_streams_do_not_keep_a_device_out() {
    let m = tiny_models();
    let dir = m.dir.path();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    std::fs::write(dir.join("cert.pem"), ck.cert.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), ck.signing_key.serialize_pem()).unwrap();
    let tls = format!(
        "[tls]\ncert_pem = \"{}\"\nkey_pem = \"{}\"\n",
        dir.join("cert.pem").display(),
        dir.join("key.pem").display()
    );
    let limits = "max_connections = 8\nmax_connections_per_peer = 4\nhandshake_timeout_secs = 2\n\
                  drain_timeout_secs = 2";
    let toml = format!("{}\n{tls}", config_toml(&m.target, limits, ""));
    let v = tandem_verifier::start(parse(dir, &toml)).await.unwrap();
    let fp = model_fingerprint(&load(&m.target));

    // The attacker (127.0.0.2) opens twice its per-peer share of silent
    // sockets: half are closed at accept, the other half when the handshake
    // deadline passes. Before the fix all 8 would fill max_connections until
    // the attacker let go.
    let mut silent = Vec::new();
    for _ in 0..8 {
        silent.push(connect_from("127.0.0.2", v.grpc_addr).await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut closed_at_once = 0;
    for s in &mut silent {
        if closed_within(s, Duration::from_millis(5)).await {
            closed_at_once += 1;
        }
    }
    assert_eq!(closed_at_once, 4, "per-peer cap: 4 of 8 closed at accept");

    // While the attacker holds its 4 silent sockets (the handshake deadline
    // is 2 s and has not passed yet), an honest device is
    // served, and the token-less Watch streams it tries are refused.
    let trusted = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ck.cert.pem()))
        .domain_name("localhost");
    let ch = Channel::from_shared(format!("https://localhost:{}", v.grpc_addr.port()))
        .unwrap()
        .tls_config(trusted)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut h = HealthClient::new(ch.clone());
    for _ in 0..16 {
        let st = h
            .watch(watch_req(None))
            .await
            .expect_err("token-less Watch");
        assert_eq!(st.code(), tonic::Code::Unauthenticated, "{st:?}");
    }
    // Check stays open (load balancers, the devices' breaker probe).
    let r = h.check(watch_req(None)).await.unwrap().into_inner();
    assert_eq!(r.status, 1, "SERVING");
    // A device may Watch.
    let mut w = h
        .watch(watch_req(Some(TOKEN_A)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(w.message().await.unwrap().unwrap().status, 1, "SERVING");
    let mut c = tandem_proto::v1::verifier_client::VerifierClient::new(ch);
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    s.open(open_msg(&fp, &prompt(5))).await.unwrap();
    assert_eq!(s.draft(0, &[3]).await.unwrap().round, 0);

    // Past the handshake deadline every silent socket is closed.
    for s in &mut silent {
        assert!(
            closed_within(s, Duration::from_secs(4)).await,
            "a silent socket outlived limits.handshake_timeout_secs"
        );
    }
    // A socket that sends a byte and then stalls mid-handshake is closed too.
    let mut stalled = connect_from("127.0.0.2", v.grpc_addr).await;
    stalled.write_all(&[0x16]).await.unwrap();
    assert!(closed_within(&mut stalled, Duration::from_secs(4)).await);
    // The device's session still answers.
    assert_eq!(s.draft(1, &[3]).await.unwrap().round, 1);
    drop((w, s, c));
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_is_closed_after_its_maximum_age_and_grace() {
    let m = tiny_models();
    // Keepalive (30 s + 20 s by default) would close it much later.
    let v = start_plain(
        &m,
        "max_connection_age_secs = 1\nmax_connection_age_grace_secs = 1",
    )
    .await;
    let mut s = TcpStream::connect(v.grpc_addr).await.unwrap();
    // The HTTP/2 preface and an empty SETTINGS frame, then nothing: no
    // stream, no answer to the server's frames.
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
    assert!(
        closed_within(&mut s, Duration::from_secs(8)).await,
        "an idle HTTP/2 connection outlived max_connection_age + grace"
    );
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_identity_cannot_hold_more_streams_opens_or_bytes_than_its_share() {
    let m = tiny_models();
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let mc = target.config();
    let page = tandem_model::kv_pages::KvPool::new(mc.n_layer, mc.n_kv_head, mc.head_dim, 1 << 20)
        .page_bytes() as u64;
    // A quota of 30 pages: one Open of 20 fits, two do not.
    let quota = 30 * page;
    let v = start_plain(
        &m,
        &format!(
            "max_streams_per_identity = 2\nmax_inflight_opens_per_identity = 1\n\
             max_bytes_per_identity = {quota}"
        ),
    )
    .await;
    let mut c = client(&v).await;
    // Streams: A's third is refused; B still gets its own.
    let mut a1 = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let _a2 = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let e = match connect(&mut c, Some(TOKEN_A)).await {
        Err(e) => e,
        Ok(mut s) => s.open(open_msg(&fp, &prompt(5))).await.unwrap_err(),
    };
    assert_eq!(reason(&e), tandem_proto::v1::Reason::QuotaExceeded, "{e:?}");
    assert!(e.message().contains("max_streams_per_identity"), "{e:?}");
    let mut b = connect(&mut c, Some(TOKEN_B)).await.unwrap();
    b.open(open_msg(&fp, &prompt(5))).await.unwrap();
    a1.open(open_msg(&fp, &prompt(5))).await.unwrap();
    // A stream that ends gives its slot back.
    drop(a1);
    let mut again = None;
    for _ in 0..100 {
        if let Ok(mut s) = connect(&mut c, Some(TOKEN_A)).await {
            if s.open(open_msg(&fp, &prompt(5))).await.is_ok() {
                again = Some(s);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(again.is_some(), "the ended stream's slot never came back");

    // In-flight Opens and their reservations (the state the handlers use).
    let st = v.state.clone();
    let who: std::sync::Arc<str> = "a".into();
    let slot = st.open_slot(&who).unwrap();
    let e = st.open_slot(&who).err().unwrap();
    assert_eq!(e.reason, tandem_proto::v1::Reason::QuotaExceeded);
    drop(slot);
    let slot = st.open_slot(&who).unwrap();
    drop(slot);
    // Two Opens in flight may not pass the byte quota together, though each
    // fits alone (their sessions are not in the store yet).
    let per = 20 * tandem_model::kv_pages::PAGE_TOKENS;
    let mut kv1 = st.new_kv();
    let held1 = st.reserve_open(&mut kv1, per, &who).unwrap();
    let mut kv2 = st.new_kv();
    let e = st.reserve_open(&mut kv2, per, &who).err().unwrap();
    assert_eq!(e.reason, tandem_proto::v1::Reason::QuotaExceeded, "{e:?}");
    drop(held1);
    drop(kv1);
    let held2 = st.reserve_open(&mut kv2, per, &who).unwrap();
    drop(held2);
    drop(kv2);
    drop(again);
    v.shutdown().await.unwrap();
}
