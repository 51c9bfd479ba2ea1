//! TLS (self-signed cert from rcgen, untrusted CA), startup refusals, admin HTTP and
//! the gRPC health service.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use common::*;
use tandem_verifier::model_fingerprint;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    http_get_with(addr, path, "").await
}

/// GET with extra header lines (each ending in `\r\n`).
async fn http_get_with(addr: std::net::SocketAddr, path: &str, headers: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let code = buf[9..12].parse().unwrap();
    (code, buf)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_and_metrics_change_after_a_verify() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    assert_eq!(http_get(v.admin_addr, "/healthz").await.0, 200);
    assert_eq!(http_get(v.admin_addr, "/readyz").await.0, 200);
    assert_eq!(http_get(v.admin_addr, "/nope").await.0, 404);
    let (code, before) = http_get(v.admin_addr, "/metrics").await;
    assert_eq!(code, 200);
    assert!(
        before.contains("tandem_verifier_verify_seconds_count 0"),
        "{before}"
    );
    let fp = model_fingerprint(&load(&m.target));
    let mut c = client(&v).await;
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    s.open(open_msg(&fp, &prompt(6))).await.unwrap();
    s.draft(0, &[1, 2, 3]).await.unwrap();
    let (_, after) = http_get(v.admin_addr, "/metrics").await;
    assert!(
        after.contains("tandem_verifier_verify_seconds_count 1"),
        "{after}"
    );
    assert!(
        after.contains("tandem_verifier_drafted_tokens_total 3"),
        "{after}"
    );
    assert!(after.contains("tandem_verifier_sessions 1"), "{after}");
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_token_guards_metrics_only_and_reflection_can_be_turned_off() {
    let m = tiny_models();
    let metrics_token = "metrics-token-0123456789";
    let toml = config_toml(
        &m.target,
        "",
        &format!(
            "insecure_loopback = true\nmetrics_token = \"{metrics_token}\"\nreflection = false"
        ),
    );
    let v = tandem_verifier::start(parse(m.dir.path(), &toml))
        .await
        .unwrap();
    // Probes stay open.
    assert_eq!(http_get(v.admin_addr, "/healthz").await.0, 200);
    assert_eq!(http_get(v.admin_addr, "/readyz").await.0, 200);
    // /metrics without a token, with a device's token, with a wrong one of the
    // same length or a prefix: 401 and no metric in the body.
    for auth in [
        String::new(),
        format!("Authorization: Bearer {TOKEN_A}\r\n"),
        "Authorization: Bearer metrics-token-0123456780\r\n".into(),
        "Authorization: Bearer metrics-token\r\n".into(),
        format!("Authorization: {metrics_token}\r\n"),
    ] {
        let (code, body) = http_get_with(v.admin_addr, "/metrics", &auth).await;
        assert_eq!(code, 401, "{auth:?}: {body}");
        assert!(body.contains("www-authenticate: Bearer"), "{body}");
        assert!(!body.contains("tandem_verifier_"), "{body}");
    }
    let (code, body) = http_get_with(
        v.admin_addr,
        "/metrics",
        &format!("Authorization: Bearer {metrics_token}\r\n"),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("tandem_verifier_sessions 0"), "{body}");
    // Reflection is off: the service is not there.
    let status = reflection_list(v.grpc_addr, Some(TOKEN_A))
        .await
        .expect_err("reflection must be off");
    assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
    v.shutdown().await.unwrap();

    // The config refuses a short token and two sources.
    let e = |extra: &str| {
        let p = m.dir.path().join("bad-metrics.toml");
        std::fs::write(
            &p,
            config_toml(&m.target, "", &format!("insecure_loopback = true\n{extra}")),
        )
        .unwrap();
        tandem_verifier::VerifierConfig::from_file(&p)
            .and_then(|c| c.metrics_token().map(|_| ()))
            .unwrap_err()
            .to_string()
    };
    let short = e("metrics_token = \"short\"");
    assert!(
        short.contains("metrics_token: token must be at least 16"),
        "{short}"
    );
    let both = e("metrics_token = \"metrics-token-0123456789\"\nmetrics_token_env = \"X\"");
    assert!(both.contains("at most one of metrics_token"), "{both}");
}

/// The services gRPC reflection lists at `addr`, or the status the
/// reflection call ends with.
async fn reflection_list(
    addr: std::net::SocketAddr,
    token: Option<&str>,
) -> Result<Vec<String>, tonic::Status> {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let ch = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut call = tonic::Request::new(tokio_stream::iter([req]));
    if let Some(t) = token {
        call.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let mut stream = ServerReflectionClient::new(ch)
        .server_reflection_info(call)
        .await?
        .into_inner();
    let msg = stream.message().await?.expect("an answer to ListServices");
    let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
        panic!("{msg:?}");
    };
    Ok(list.service.into_iter().map(|s| s.name).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_is_off_by_default_and_when_on_answers_devices_only() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let status = reflection_list(v.grpc_addr, Some(TOKEN_A))
        .await
        .expect_err("reflection is off by default");
    assert_eq!(status.code(), tonic::Code::Unimplemented, "{status:?}");
    v.shutdown().await.unwrap();
    let toml = config_toml(&m.target, "", "insecure_loopback = true\nreflection = true");
    let v = tandem_verifier::start(parse(m.dir.path(), &toml))
        .await
        .unwrap();
    let status = reflection_list(v.grpc_addr, None)
        .await
        .expect_err("reflection without a token");
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    let names = reflection_list(v.grpc_addr, Some(TOKEN_A)).await.unwrap();
    assert!(
        names
            .iter()
            .any(|n| n == tandem_proto::VERIFIER_SERVICE_NAME),
        "{names:?}"
    );
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_service_reports_serving() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let ch = Channel::from_shared(format!("http://{}", v.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut h = HealthClient::new(ch);
    let r = h
        .check(HealthCheckRequest {
            service: tandem_proto::VERIFIER_SERVICE_NAME.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.status, 1, "SERVING");
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_to_start_without_tls_unless_loopback_plain_text_is_configured() {
    let m = tiny_models();
    let dir = m.dir.path();
    let write = |s: String| {
        let p = dir.join("bad.toml");
        std::fs::write(&p, s).unwrap();
        tandem_verifier::VerifierConfig::from_file(&p)
            .unwrap_err()
            .to_string()
    };
    let e = write(config_toml(&m.target, "", ""));
    assert!(e.contains("TLS is not configured"), "{e}");
    let e = write(
        config_toml(&m.target, "", "insecure_loopback = true")
            .replace("127.0.0.1:0\"\nadmin", "0.0.0.0:0\"\nadmin"),
    );
    assert!(e.contains("only allows a loopback"), "{e}");
    let e = write(config_toml(
        &m.target,
        "max_block = 17",
        "insecure_loopback = true",
    ));
    assert!(e.contains("max_block"), "{e}");
    // Sums of limits are checked, not wrapped.
    let mut cfg = parse(dir, &config_toml(&m.target, "", "insecure_loopback = true"));
    cfg.limits.max_prompt_tokens = usize::MAX;
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("max_prompt_tokens"), "{e}");

    // Two devices with one token (the last one used to win silently), or
    // one id twice: refused at load, naming them.
    let dup = config_toml(&m.target, "", "insecure_loopback = true").replace(TOKEN_B, TOKEN_A);
    let e = tandem_verifier::start(parse(dir, &dup))
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("\"a\" and \"b\" have the same token"), "{e}");
    let dup =
        config_toml(&m.target, "", "insecure_loopback = true").replace("id = \"b\"", "id = \"a\"");
    let e = tandem_verifier::start(parse(dir, &dup))
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("two [[devices]] have the id \"a\""), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_self_signed_cert_and_untrusted_ca_failure() {
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
    // [tls] must come after the top-level keys: put it at the very end.
    let toml = format!("{}\n{tls}", config_toml(&m.target, "", ""));
    let v = tandem_verifier::start(parse(dir, &toml)).await.unwrap();
    let fp = model_fingerprint(&load(&m.target));
    let url = format!("https://localhost:{}", v.grpc_addr.port());

    let trusted = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ck.cert.pem()))
        .domain_name("localhost");
    let ch = Channel::from_shared(url.clone())
        .unwrap()
        .tls_config(trusted)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = tandem_proto::v1::verifier_client::VerifierClient::new(ch);
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    s.open(open_msg(&fp, &prompt(5))).await.unwrap();
    let verdict = s.draft(0, &[3]).await.unwrap();
    assert_eq!(verdict.round, 0);

    // A client trusting another CA cannot connect.
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let untrusted = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(other.cert.pem()))
        .domain_name("localhost");
    let r = Channel::from_shared(url)
        .unwrap()
        .tls_config(untrusted)
        .unwrap()
        .connect()
        .await;
    assert!(r.is_err(), "untrusted CA must fail the handshake");
    // Plain text to a TLS port fails too.
    let plain = tandem_proto::v1::verifier_client::VerifierClient::connect(format!(
        "http://127.0.0.1:{}",
        v.grpc_addr.port()
    ))
    .await;
    if let Ok(mut pc) = plain {
        assert!(connect(&mut pc, Some(TOKEN_A)).await.is_err());
    }
    v.shutdown().await.unwrap();
}
