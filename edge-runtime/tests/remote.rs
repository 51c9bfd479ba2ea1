//! The edge runtime against a real in-process `tandem-verifier` on 127.0.0.1 (tiny
//! random models), plus a fake verifier that stalls.

// Tests may unwrap (helpers outside #[test] functions included).
#![allow(clippy::unwrap_used)]
mod common;
use common::{greedy_predictions, load, target_greedy};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;
use tandem_edge::{BreakerState, EdgeConfig, EdgeError, EdgeEvent, EdgeRuntime, TokenStatus};
use tandem_model::proposer::ProposerKind;
use tandem_model::speculative::{generate_single_with, GenerateConfig, StopReason};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::transformer::Model;
use tandem_verifier::RunningVerifier;

const TOKEN: &str = "edge-test-token-0123456789";
const FP: &str = "tiny-test-fingerprint";
const PROMPT: &[u32] = &[5, 17, 42, 99, 3, 250, 7];

struct Models {
    _dir: tempfile::TempDir,
    target: PathBuf,
    draft: PathBuf,
}

fn models() -> Models {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("target.gguf");
    let draft = dir.path().join("draft.gguf");
    write_tiny_qwen2(&target, &TinyConfig::default()).unwrap();
    write_tiny_qwen2(&draft, &TinyConfig::draft_like()).unwrap();
    Models {
        _dir: dir,
        target,
        draft,
    }
}

fn io_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

fn verifier_toml(target: &Path, listen: SocketAddr, extra: &str) -> String {
    format!(
        "listen = \"{listen}\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {target:?}\n\
         tokenizer_fingerprint = \"{FP}\"\nmax_seq_len = 4096\ninsecure_loopback = true\n{extra}\n\
         [[devices]]\nid = \"dev\"\ntoken = \"{TOKEN}\"\n"
    )
}

fn start_verifier(rt: &tokio::runtime::Runtime, toml_text: &str) -> RunningVerifier {
    let cfg: tandem_verifier::VerifierConfig = toml::from_str(toml_text).unwrap();
    rt.block_on(tandem_verifier::start(cfg)).unwrap()
}

fn edge_config(url: String) -> EdgeConfig {
    EdgeConfig {
        verifier_url: Some(url),
        token: Some(TOKEN.into()),
        tokenizer_fingerprint: Some(FP.into()),
        connect_timeout_ms: 500,
        backoff_base_ms: 5,
        backoff_max_ms: 20,
        probe_interval_ms: 20,
        probe_timeout_ms: 500,
        ..EdgeConfig::default()
    }
}

/// The draft's KV in f32: a draft that is the target is then a perfect draft,
/// and provisional tokens are `greedy_predictions(draft)` (INT8 KV, the
/// default, makes it an imperfect one).
fn gen_cfg(k: usize, max_tokens: usize) -> GenerateConfig {
    GenerateConfig {
        k,
        max_tokens,
        draft_kv: tandem_model::kv_cache::KvPrecision::F32,
        ..GenerateConfig::default()
    }
}

fn target_only(target: &Model, max_tokens: usize) -> Vec<u32> {
    target_greedy(target, PROMPT, max_tokens)
}

#[test]
fn greedy_output_equals_target_only_for_k_1_4_16() {
    let m = models();
    let target = load(&m.target);
    let expected = target_only(&target, 40);
    let vrt = io_runtime();
    let v = start_verifier(
        &vrt,
        &verifier_toml(&m.target, "127.0.0.1:0".parse().unwrap(), ""),
    );
    let url = format!("http://{}", v.grpc_addr);
    // A different draft (acceptance ~0) and the target itself as draft (all accepted).
    for (draft_path, same) in [(&m.draft, false), (&m.target, true)] {
        let mut edge = EdgeRuntime::builder(load(draft_path), edge_config(url.clone()))
            .build()
            .unwrap();
        for k in [1, 4, 16] {
            let mut streamed = Vec::new();
            let g = edge
                .generate(PROMPT, &gen_cfg(k, 40), &mut |e| {
                    if let EdgeEvent::Token {
                        index, id, status, ..
                    } = e
                    {
                        streamed.push((*index, *id, *status));
                    }
                    true
                })
                .unwrap();
            assert_eq!(g.tokens, expected, "k = {k}, same draft = {same}");
            assert_eq!(g.stop, StopReason::MaxTokens);
            assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
            let idx: Vec<usize> = streamed.iter().map(|s| s.0).collect();
            assert_eq!(idx, (0..40).collect::<Vec<_>>());
            let ids: Vec<u32> = streamed.iter().map(|s| s.1).collect();
            assert_eq!(ids, expected);
            let s = &g.stats;
            assert_eq!(s.verified_tokens, 40);
            assert_eq!(s.opens, 1);
            assert!(s.rounds > 0 && s.bytes_sent > 0 && s.bytes_received > 0);
            assert!(s.rtt_mean_ms > 0.0 && s.rtt_p95_ms >= s.rtt_mean_ms * 0.5);
            assert_eq!(s.verifier_passes, s.rounds + 1);
            // Every round yields its accepted tokens plus the verifier's one (the
            // last round may be cut by max_tokens).
            assert!(s.accepted + s.rounds >= 40 && s.accepted + s.rounds < 40 + k as u64 + 1);
            if same {
                assert_eq!(s.acceptance_rate, 1.0, "k = {k}");
                assert!(s.mean_accepted_len > (k as f64) * 0.5);
            }
        }
    }
    vrt.block_on(v.shutdown()).unwrap();
}

#[test]
fn no_verifier_means_local_tokens_equal_to_draft_only() {
    let m = models();
    let draft = load(&m.draft);
    let expected = generate_single_with(
        &draft,
        gen_cfg(1, 20).draft_kv,
        PROMPT,
        &gen_cfg(1, 20),
        &mut |_| true,
    )
    .unwrap()
    .tokens;
    let mut edge = EdgeRuntime::builder(draft, EdgeConfig::default())
        .build()
        .unwrap();
    let g = edge
        .generate(PROMPT, &gen_cfg(4, 20), &mut |_| true)
        .unwrap();
    assert_eq!(g.tokens, expected);
    assert!(g.statuses.iter().all(|s| *s == TokenStatus::Local));
    assert_eq!(g.stats.local_tokens, 20);
    assert_eq!(g.stats.bytes_sent, 0);
    // Without a verifier the draft generates alone whatever the proposer
    // (proposers propose blocks for a verifier).
    for proposer in [ProposerKind::Lookup, ProposerKind::Auto] {
        let cfg = GenerateConfig {
            proposer,
            ..gen_cfg(4, 20)
        };
        let g = edge.generate(PROMPT, &cfg, &mut |_| true).unwrap();
        assert_eq!(g.tokens, expected, "{proposer}");
        assert!(g.statuses.iter().all(|s| *s == TokenStatus::Local));
    }
}

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

#[test]
fn verifier_killed_mid_generation_then_restarted_resumes_without_loss() {
    let m = models();
    let (target, draft) = (load(&m.target), load(&m.draft));
    let addr = free_addr();
    let toml_text = verifier_toml(&m.target, addr, "");
    let first_rt = io_runtime();
    let first = start_verifier(&first_rt, &toml_text);
    let server: Mutex<Option<(tokio::runtime::Runtime, RunningVerifier)>> =
        Mutex::new(Some((first_rt, first)));
    let mut cfg = edge_config(format!("http://{addr}"));
    cfg.breaker_failures = 2;
    let mut edge = EdgeRuntime::builder(draft.clone(), cfg).build().unwrap();
    let (mut killed, mut restarted, mut provisional_seen) = (false, false, 0);
    let mut events = Vec::new();
    let max = 48;
    let g = edge
        .generate(PROMPT, &gen_cfg(4, max), &mut |e| {
            events.push(e.clone());
            if let EdgeEvent::Token { index, status, .. } = e {
                if *index == 5 && !killed {
                    // Kill: drop every task and socket of the verifier at once.
                    if let Some((rt, v)) = server.lock().unwrap().take() {
                        drop(v);
                        rt.shutdown_background();
                    }
                    killed = true;
                }
                if *status == TokenStatus::Provisional {
                    provisional_seen += 1;
                    if provisional_seen == 8 && !restarted {
                        let rt = io_runtime();
                        let v = start_verifier(&rt, &toml_text);
                        assert_eq!(v.grpc_addr, addr);
                        *server.lock().unwrap() = Some((rt, v));
                        restarted = true;
                    }
                    if restarted {
                        // Let the background health probe see it.
                        std::thread::sleep(Duration::from_millis(15));
                    }
                }
            }
            true
        })
        .unwrap();
    assert!(killed && restarted);
    assert_eq!(g.tokens.len(), max, "output complete");
    // Streamed exactly once each, in order.
    let streamed: Vec<(usize, u32, TokenStatus)> = events
        .iter()
        .filter_map(|e| match e {
            EdgeEvent::Token {
                index, id, status, ..
            } => Some((*index, *id, *status)),
            _ => None,
        })
        .collect();
    assert_eq!(
        streamed.iter().map(|s| s.0).collect::<Vec<_>>(),
        (0..max).collect::<Vec<_>>()
    );
    assert_eq!(streamed.iter().map(|s| s.1).collect::<Vec<_>>(), g.tokens);
    // Verified, then provisional, then verified again.
    let first_prov = g
        .statuses
        .iter()
        .position(|s| *s == TokenStatus::Provisional)
        .unwrap();
    let last_prov = g
        .statuses
        .iter()
        .rposition(|s| *s == TokenStatus::Provisional)
        .unwrap();
    assert!(first_prov >= 6, "tokens before the kill were verified");
    assert!(g.statuses[..first_prov]
        .iter()
        .all(|s| *s == TokenStatus::Verified));
    assert!(g.statuses[first_prov..=last_prov]
        .iter()
        .all(|s| *s == TokenStatus::Provisional));
    assert!(last_prov + 1 < max, "speculative decoding resumed");
    assert!(g.statuses[last_prov + 1..]
        .iter()
        .all(|s| *s == TokenStatus::Verified));
    // Verified tokens are the target's greedy choice given the streamed prefix;
    // provisional ones are the draft's.
    let t_pred = greedy_predictions(&target, PROMPT, &g.tokens);
    let d_pred = greedy_predictions(&draft, PROMPT, &g.tokens);
    let mut expected_mismatches = Vec::new();
    for i in 0..max {
        match g.statuses[i] {
            TokenStatus::Verified => assert_eq!(g.tokens[i], t_pred[i], "verified token {i}"),
            _ => {
                assert_eq!(g.tokens[i], d_pred[i], "provisional token {i}");
                if t_pred[i] != g.tokens[i] {
                    expected_mismatches.push(i);
                }
            }
        }
    }
    assert!(
        !expected_mismatches.is_empty(),
        "random draft vs target must differ somewhere"
    );
    let r = &g.provisional;
    assert_eq!(r.provisional_tokens, last_prov + 1 - first_prov);
    assert_eq!(r.checked_tokens, r.provisional_tokens);
    assert_eq!(r.mismatched_tokens, expected_mismatches.len());
    assert_eq!(r.first_mismatch, expected_mismatches.first().copied());
    assert_eq!(r.spans.len(), 1);
    assert_eq!(r.spans[0].mismatches, expected_mismatches);
    assert_eq!(
        (r.spans[0].start, r.spans[0].end),
        (first_prov, last_prov + 1)
    );
    assert!(r.spans[0].checked);
    assert!(events.iter().any(
        |e| matches!(e, EdgeEvent::ProvisionalChecked(c) if c.mismatches == expected_mismatches)
    ));
    let s = &g.stats;
    // The re-open after the first failure runs in the background while the
    // device drafts alone; whether the breaker opened before the restart
    // depends on how fast the refused connects come back.
    assert!(s.failures >= 1);
    assert!(s.opens >= 2, "the session was reopened");
    assert!(s.check_rounds >= 1);
    assert_eq!(edge.breaker_state(), BreakerState::Closed);
    let last = server.lock().unwrap().take();
    if let Some((rt, v)) = last {
        rt.block_on(v.shutdown()).unwrap();
    }
}

#[test]
fn evicted_session_is_resent_and_output_is_identical() {
    let m = models();
    let target = load(&m.target);
    let expected = target_only(&target, 24);
    let vrt = io_runtime();
    let v = start_verifier(
        &vrt,
        &verifier_toml(
            &m.target,
            "127.0.0.1:0".parse().unwrap(),
            "[limits]\nidle_ttl_secs = 1",
        ),
    );
    let mut edge = EdgeRuntime::builder(
        load(&m.draft),
        edge_config(format!("http://{}", v.grpc_addr)),
    )
    .build()
    .unwrap();
    let mut slept = false;
    let g = edge
        .generate(PROMPT, &gen_cfg(4, 24), &mut |e| {
            if matches!(e, EdgeEvent::Token { index: 6, .. }) && !slept {
                // Idle past the verifier's TTL: the session is evicted.
                std::thread::sleep(Duration::from_millis(2200));
                slept = true;
            }
            true
        })
        .unwrap();
    assert_eq!(g.tokens, expected);
    assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
    assert!(g.stats.resends >= 1, "the device resent its context");
    assert_eq!(g.stats.opens, 2);
    assert_eq!(g.stats.failures, 0);
    assert!(v.state.store().evictions() >= 1);
    vrt.block_on(v.shutdown()).unwrap();
}

mod stall {
    use tandem_proto::v1::verifier_server::{Verifier, VerifierServer};
    use tandem_proto::v1::{server_message, ClientMessage, Opened, ServerMessage};
    use tokio_stream::wrappers::ReceiverStream;

    /// Answers Open, then never answers a Draft.
    pub struct Stall;

    #[tonic::async_trait]
    impl Verifier for Stall {
        type SessionStream = ReceiverStream<Result<ServerMessage, tonic::Status>>;
        async fn session(
            &self,
            req: tonic::Request<tonic::Streaming<ClientMessage>>,
        ) -> Result<tonic::Response<Self::SessionStream>, tonic::Status> {
            let mut incoming = req.into_inner();
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            tokio::spawn(async move {
                if let Ok(Some(_open)) = incoming.message().await {
                    let opened = Opened {
                        session_id: "stall".into(),
                        max_block: 16,
                        max_prompt_tokens: 4096,
                        vocab_size: 384,
                        model_id: tandem_edge::EdgeConfig::default().model_id,
                        context_len: super::PROMPT.len() as u64,
                        ..Opened::default()
                    };
                    let _ = tx
                        .send(Ok(ServerMessage {
                            msg: Some(server_message::Msg::Opened(opened)),
                        }))
                        .await;
                }
                // Keep the stream open, read drafts, answer nothing.
                while let Ok(Some(_)) = incoming.message().await {}
                drop(tx);
            });
            Ok(tonic::Response::new(ReceiverStream::new(rx)))
        }
    }

    pub fn server() -> VerifierServer<Stall> {
        VerifierServer::new(Stall)
    }
}

#[test]
fn stalling_verifier_opens_the_breaker_and_drafting_continues_alone() {
    let m = models();
    let draft = load(&m.draft);
    let rt = io_runtime();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(stall::server())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let mut cfg = edge_config(format!("http://{addr}"));
    cfg.deadline_initial_ms = 150;
    cfg.breaker_failures = 2;
    cfg.probe_interval_ms = 50;
    let mut edge = EdgeRuntime::builder(draft.clone(), cfg).build().unwrap();
    // After the first timeout the device drafts alone while it re-opens in the
    // background; a device slower than the tiny model (10 ms per token) lets
    // that open (answered at once by the fake) complete, so the provisional
    // check's verify times out too and the breaker opens.
    let g = edge
        .generate(PROMPT, &gen_cfg(4, 16), &mut |_| {
            std::thread::sleep(Duration::from_millis(10));
            true
        })
        .unwrap();
    let draft_only = generate_single_with(
        &draft,
        gen_cfg(1, 16).draft_kv,
        PROMPT,
        &gen_cfg(1, 16),
        &mut |_| true,
    )
    .unwrap()
    .tokens;
    assert_eq!(g.tokens, draft_only);
    assert!(g.statuses.iter().all(|s| *s == TokenStatus::Provisional));
    assert_eq!(g.stats.timeouts, 2);
    assert_eq!(g.stats.breaker_opens, 1);
    assert_eq!(g.stats.background_opens, 1);
    // The fake has no health service: the breaker stays open.
    assert_eq!(edge.breaker_state(), BreakerState::Open);
    assert_eq!(g.provisional.checked_tokens, 0);
    assert_eq!(g.provisional.spans.len(), 1);
    assert!(!g.provisional.spans[0].checked);
}

struct Tls {
    _dir: tempfile::TempDir,
    cert: PathBuf,
    key: PathBuf,
    other_ca: PathBuf,
}

fn tls_files() -> Tls {
    let dir = tempfile::tempdir().unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert, key, other_ca) = (
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
        dir.path().join("other.pem"),
    );
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    std::fs::write(&other_ca, other.cert.pem()).unwrap();
    Tls {
        _dir: dir,
        cert,
        key,
        other_ca,
    }
}

#[test]
fn tls_with_a_self_signed_cert_works_and_an_untrusted_ca_fails_clearly() {
    let m = models();
    let target = load(&m.target);
    let tls = tls_files();
    let vrt = io_runtime();
    let toml_text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {:?}\n\
         tokenizer_fingerprint = \"{FP}\"\nmax_seq_len = 4096\n\
         [tls]\ncert_pem = {:?}\nkey_pem = {:?}\n[[devices]]\nid = \"dev\"\ntoken = \"{TOKEN}\"\n",
        m.target, tls.cert, tls.key
    );
    let v = start_verifier(&vrt, &toml_text);
    let url = format!("https://localhost:{}", v.grpc_addr.port());
    let mut cfg = edge_config(url.clone());
    cfg.ca_cert_pem = Some(tls.cert.clone());
    let mut edge = EdgeRuntime::builder(load(&m.draft), cfg).build().unwrap();
    let g = edge
        .generate(PROMPT, &gen_cfg(4, 12), &mut |_| true)
        .unwrap();
    assert_eq!(g.tokens, target_only(&target, 12));
    assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));

    let mut cfg = edge_config(url);
    cfg.ca_cert_pem = Some(tls.other_ca.clone());
    let mut edge = EdgeRuntime::builder(load(&m.draft), cfg).build().unwrap();
    let err = edge
        .generate(PROMPT, &gen_cfg(4, 12), &mut |_| true)
        .unwrap_err();
    assert!(matches!(err, EdgeError::Tls(_)), "{err}");
    assert!(err.to_string().contains("TLS"), "{err}");
    vrt.block_on(v.shutdown()).unwrap();
}

#[test]
fn wrong_token_and_wrong_fingerprint_are_refused_with_their_reason() {
    let m = models();
    let vrt = io_runtime();
    let v = start_verifier(
        &vrt,
        &verifier_toml(&m.target, "127.0.0.1:0".parse().unwrap(), ""),
    );
    let url = format!("http://{}", v.grpc_addr);
    let mut cfg = edge_config(url.clone());
    cfg.token = Some("not-the-right-token-at-all".into());
    let err = EdgeRuntime::builder(load(&m.draft), cfg)
        .build()
        .unwrap()
        .generate(PROMPT, &gen_cfg(4, 8), &mut |_| true)
        .unwrap_err();
    assert!(
        matches!(&err, EdgeError::Refused { reason, .. } if reason == "UNAUTHENTICATED"),
        "{err}"
    );
    let mut cfg = edge_config(url);
    cfg.tokenizer_fingerprint = Some("something-else".into());
    let err = EdgeRuntime::builder(load(&m.draft), cfg)
        .build()
        .unwrap()
        .generate(PROMPT, &gen_cfg(4, 8), &mut |_| true)
        .unwrap_err();
    assert!(
        matches!(&err, EdgeError::Refused { reason, .. } if reason == "FINGERPRINT_MISMATCH"),
        "{err}"
    );
    vrt.block_on(v.shutdown()).unwrap();
}
