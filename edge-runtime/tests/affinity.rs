//! The session-affinity header (`x-tandem-session`) and the immediate re-open of
//! a broken stream, against a fake in-process verifier that records the header of
//! every `Session` call and can break a stream or go away.
//!
//! What a load balancer in front of several verifier replicas relies on: every
//! stream of one generation carries the same random key (so a consistent hash
//! keeps the generation on one replica), a new generation draws a new key, and a
//! stream that breaks is re-opened at once through the same URL (the balancer
//! sends it to another replica) instead of the device drafting alone.

// Tests may unwrap (helpers outside #[test] functions included).
#![allow(clippy::unwrap_used)]
mod common;

use common::{load, tiny_models, FP};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tandem_edge::{EdgeConfig, EdgeRuntime, TokenStatus};
use tandem_model::speculative::GenerateConfig;

const PROMPT: &[u32] = &[5, 17, 42, 99, 3, 250, 7];

/// What the fake does after `break_after` verdicts on the first stream.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Break {
    /// Nothing: every stream is served to the end.
    Never,
    /// End the first stream with a bare `UNAVAILABLE` (no `tandem-reason`): what
    /// the device sees when the verifier behind a balancer dies mid-stream.
    Stream,
    /// Close the listening socket first, then end the stream the same way: the
    /// re-open is refused (no replica left).
    StreamAndListener,
    /// Right after a verdict (between two rounds), end the first stream with
    /// `UNAVAILABLE` + `tandem-reason: SHUTTING_DOWN`, as a draining verifier does.
    Draining,
    /// Answer the first stream's Open with a bare `UNAVAILABLE`: nginx's 502
    /// when the replica it picked died as the Open reached it.
    Open,
}

mod fake {
    use super::Break;
    use std::sync::{Arc, Mutex};
    use tandem_proto::v1::verifier_server::{Verifier, VerifierServer};
    use tandem_proto::v1::{
        client_message, server_message, ClientMessage, Closed, Opened, Resumed, ServerMessage,
        Verdict,
    };
    use tokio_stream::wrappers::ReceiverStream;

    /// Accepts every drafted token and answers token 1 after them; records the
    /// affinity header of every call.
    pub struct Fake {
        pub keys: Arc<Mutex<Vec<Option<String>>>>,
        pub mode: Break,
        pub break_after: usize,
        pub stop: Arc<tokio::sync::Notify>,
    }

    fn out(m: server_message::Msg) -> Result<ServerMessage, tonic::Status> {
        Ok(ServerMessage { msg: Some(m) })
    }

    #[tonic::async_trait]
    impl Verifier for Fake {
        type SessionStream = ReceiverStream<Result<ServerMessage, tonic::Status>>;
        async fn session(
            &self,
            req: tonic::Request<tonic::Streaming<ClientMessage>>,
        ) -> Result<tonic::Response<Self::SessionStream>, tonic::Status> {
            let key = req
                .metadata()
                .get(tandem_proto::SESSION_AFFINITY_HEADER)
                .map(|v| v.to_str().unwrap().to_owned());
            let call = {
                let mut k = self.keys.lock().unwrap();
                k.push(key);
                k.len()
            };
            let breaks = call == 1 && self.mode != Break::Never;
            let (mode, break_after, stop) = (self.mode, self.break_after, self.stop.clone());
            let mut incoming = req.into_inner();
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            tokio::spawn(async move {
                let mut ctx = 0u64;
                let mut verdicts = 0;
                while let Ok(Some(m)) = incoming.message().await {
                    let answer = match m.msg {
                        Some(client_message::Msg::Open(_)) if breaks && mode == Break::Open => {
                            let _ = tx
                                .send(Err(tonic::Status::unavailable("bad gateway")))
                                .await;
                            return;
                        }
                        Some(client_message::Msg::Open(o)) => {
                            ctx = o.prompt_tokens.len() as u64;
                            server_message::Msg::Opened(Opened {
                                session_id: format!("fake-{call}"),
                                resumed: false,
                                max_block: 16,
                                max_prompt_tokens: 4096,
                                vocab_size: 384,
                                model_id: tandem_edge::EdgeConfig::default().model_id,
                                context_len: ctx,
                                ..Opened::default()
                            })
                        }
                        Some(client_message::Msg::Draft(d)) => {
                            if breaks && mode != Break::Draining && verdicts == break_after {
                                if mode == Break::StreamAndListener {
                                    stop.notify_one();
                                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                                }
                                let _ = tx
                                    .send(Err(tonic::Status::unavailable("connection reset")))
                                    .await;
                                return;
                            }
                            verdicts += 1;
                            ctx += d.tokens.len() as u64 + 1;
                            let v = server_message::Msg::Verdict(Verdict {
                                round: d.round,
                                accepted: d.tokens.len() as u32,
                                next_token: 1,
                                context_len: ctx,
                                hidden: None,
                                logprobs: Vec::new(),
                            });
                            if breaks && mode == Break::Draining && verdicts == break_after {
                                let _ = tx.send(out(v)).await;
                                let mut st = tonic::Status::unavailable(
                                    "SHUTTING_DOWN: the verifier is shutting down",
                                );
                                st.metadata_mut().insert(
                                    tandem_proto::REASON_METADATA_KEY,
                                    "SHUTTING_DOWN".parse().unwrap(),
                                );
                                let _ = tx.send(Err(st)).await;
                                return;
                            }
                            v
                        }
                        Some(client_message::Msg::Resume(r)) => {
                            ctx = r.context_tokens.len() as u64;
                            server_message::Msg::Resumed(Resumed {
                                context_len: ctx,
                                ..Resumed::default()
                            })
                        }
                        Some(client_message::Msg::Close(_)) => {
                            let _ = tx
                                .send(out(server_message::Msg::Closed(Closed::default())))
                                .await;
                            return;
                        }
                        None => return,
                    };
                    if tx.send(out(answer)).await.is_err() {
                        return;
                    }
                }
            });
            Ok(tonic::Response::new(ReceiverStream::new(rx)))
        }
    }

    pub fn server(f: Fake) -> VerifierServer<Fake> {
        VerifierServer::new(f)
    }
}

struct Running {
    _rt: tokio::runtime::Runtime,
    addr: SocketAddr,
    keys: Arc<Mutex<Vec<Option<String>>>>,
}

fn start_fake(mode: Break, break_after: usize) -> Running {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let keys = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(tokio::sync::Notify::new());
    let svc = fake::server(fake::Fake {
        keys: keys.clone(),
        mode,
        break_after,
        stop: stop.clone(),
    });
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                async move { stop.notified().await },
            ),
    );
    Running {
        _rt: rt,
        addr,
        keys,
    }
}

fn edge(addr: SocketAddr) -> EdgeRuntime {
    let dir = tempfile::tempdir().unwrap();
    let (_, draft) = tiny_models(dir.path());
    let cfg = EdgeConfig {
        verifier_url: Some(format!("http://{addr}")),
        tokenizer_fingerprint: Some(FP.into()),
        connect_timeout_ms: 500,
        backoff_base_ms: 5,
        backoff_max_ms: 20,
        probe_interval_ms: 20,
        probe_timeout_ms: 200,
        ..EdgeConfig::default()
    };
    EdgeRuntime::builder(load(&draft), cfg).build().unwrap()
}

fn gen_cfg() -> GenerateConfig {
    GenerateConfig {
        k: 4,
        max_tokens: 24,
        ..GenerateConfig::default()
    }
}

fn is_key(k: &str) -> bool {
    k.len() == 32
        && k.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[test]
fn every_stream_of_a_generation_carries_the_same_affinity_key() {
    let fake = start_fake(Break::Stream, 2);
    let mut edge = edge(fake.addr);
    let g = edge.generate(PROMPT, &gen_cfg(), &mut |_| true).unwrap();
    let first: Vec<Option<String>> = fake.keys.lock().unwrap().clone();
    // The first stream broke after two verdicts; the device re-opened at once.
    assert_eq!(first.len(), 2, "one open and one re-open: {first:?}");
    let key = first[0].clone().expect("the open carries x-tandem-session");
    assert!(is_key(&key), "128-bit lowercase hex: {key:?}");
    assert_eq!(
        first[1].as_deref(),
        Some(key.as_str()),
        "same key on the re-open"
    );
    assert_eq!(g.stats.immediate_reopens, 1);
    assert_eq!(g.stats.opens, 2);
    assert_eq!(g.stats.failures, 0, "a re-homed stream is not a failure");
    assert_eq!(g.stats.background_opens, 0);
    assert_eq!(g.tokens.len(), 24);
    assert!(
        g.statuses.iter().all(|s| *s == TokenStatus::Verified),
        "no provisional token: the re-open was immediate: {:?}",
        g.statuses
    );

    // A new generation draws a new key (and, with no break, opens once).
    let g2 = edge.generate(PROMPT, &gen_cfg(), &mut |_| true).unwrap();
    let all: Vec<Option<String>> = fake.keys.lock().unwrap().clone();
    assert_eq!(all.len(), 3, "{all:?}");
    let key2 = all[2]
        .clone()
        .expect("the second generation's open carries the key");
    assert!(is_key(&key2));
    assert_ne!(key2, key, "one key per generation");
    assert_eq!(g2.stats.immediate_reopens, 0);
    assert!(g2.statuses.iter().all(|s| *s == TokenStatus::Verified));
}

#[test]
fn an_open_refused_as_unavailable_is_retried_at_once_with_the_same_key() {
    let fake = start_fake(Break::Open, 0);
    let mut edge = edge(fake.addr);
    let g = edge.generate(PROMPT, &gen_cfg(), &mut |_| true).unwrap();
    let keys: Vec<Option<String>> = fake.keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 2, "the refused open and its retry: {keys:?}");
    assert_eq!(keys[0], keys[1], "the retry carries the same key");
    assert_eq!(g.stats.immediate_reopens, 1, "{:?}", g.stats);
    assert_eq!(g.stats.failures, 0, "a re-homed open is not a failure");
    assert_eq!(g.stats.background_opens, 0);
    assert_eq!(g.tokens.len(), 24);
    assert!(
        g.statuses.iter().all(|s| *s == TokenStatus::Verified),
        "no provisional token: the retry was immediate: {:?}",
        g.statuses
    );
}

#[test]
fn the_key_is_not_derived_from_the_prompt() {
    let fake = start_fake(Break::Never, 0);
    let mut edge = edge(fake.addr);
    for _ in 0..2 {
        edge.generate(PROMPT, &gen_cfg(), &mut |_| true).unwrap();
    }
    let keys: Vec<String> = fake
        .keys
        .lock()
        .unwrap()
        .iter()
        .map(|k| k.clone().unwrap())
        .collect();
    assert_eq!(keys.len(), 2);
    assert_ne!(keys[0], keys[1], "the same prompt twice: two keys");
    assert!(keys.iter().all(|k| is_key(k)));
}

#[test]
fn a_refused_immediate_reopen_falls_back_to_drafting_alone() {
    let fake = start_fake(Break::StreamAndListener, 2);
    let mut edge = edge(fake.addr);
    let g = edge.generate(PROMPT, &gen_cfg(), &mut |_| true).unwrap();
    // Two re-opens at once (both refused: nothing listens any more), then
    // the usual outage path: failures counted, the device drafts alone.
    assert_eq!(g.stats.immediate_reopens, 2);
    assert!(g.stats.failures >= 1, "{:?}", g.stats);
    assert_eq!(g.tokens.len(), 24);
    let first_prov = g
        .statuses
        .iter()
        .position(|s| *s == TokenStatus::Provisional)
        .expect("provisional tokens after the refused re-open");
    assert!(g.statuses[..first_prov]
        .iter()
        .all(|s| *s == TokenStatus::Verified));
    assert!(g.statuses[first_prov..]
        .iter()
        .all(|s| *s == TokenStatus::Provisional));
    assert_eq!(
        fake.keys.lock().unwrap().len(),
        1,
        "only the first stream reached the fake"
    );
}

#[test]
fn shutting_down_between_rounds_is_read_as_busy_and_the_device_moves() {
    // The verifier ends the stream right after a verdict; the device's next
    // send finds it closed and must read why (SHUTTING_DOWN: busy, back off,
    // re-open in the foreground), not take it for a broken link.
    let fake = start_fake(Break::Draining, 2);
    let mut edge = edge(fake.addr);
    let g = edge.generate(PROMPT, &gen_cfg(), &mut |_| true).unwrap();
    let keys: Vec<Option<String>> = fake.keys.lock().unwrap().clone();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert_eq!(keys[0], keys[1], "the re-open carries the same key");
    assert_eq!(
        g.stats.failures, 1,
        "SHUTTING_DOWN is a (busy) failure: {:?}",
        g.stats
    );
    assert_eq!(g.stats.immediate_reopens, 0, "{:?}", g.stats);
    assert_eq!(g.stats.background_opens, 0);
    assert_eq!(g.stats.opens, 2);
    assert_eq!(g.tokens.len(), 24);
    assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
}
