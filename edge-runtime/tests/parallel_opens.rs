//! Two generations of one device open at the same time (`tandem serve-edge
//! --parallel`: sibling runtimes). A verifier prefills opens one after the
//! other (or joined in one forward), so a short open sent just after a long
//! one is answered only when the long one's prefill is done. The short one's
//! `Opened` deadline, estimated from its own earlier short opens, used to
//! expire first: the completion then started provisional, as if the verifier
//! were down (seen with the official client, `tests/openai/test_client.py`).
//! The deadline now allows for the device's own other opens
//! (`tandem_edge::open_load`), and both generations stay verified.
//!
//! A fake verifier on loopback (tiny draft): it prefills opens in arrival
//! order at a fixed cost per position, rejects every drafted token and
//! corrects with token 7.

#![allow(clippy::unwrap_used)]
mod common;
use common::load;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tandem_edge::{EdgeConfig, EdgeGeneration, EdgeRuntime, TokenStatus};
use tandem_model::speculative::GenerateConfig;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_proto::v1::verifier_server::Verifier;
use tandem_proto::v1::{
    client_message, server_message, ClientMessage, Opened, ServerMessage, Verdict,
};
use tokio_stream::wrappers::ReceiverStream;

const TOKEN: &str = "edge-test-token-0123456789";
const MODEL_ID: &str = "tiny-target";
/// The fake's prefill cost per position.
const PER_POSITION: Duration = Duration::from_millis(5);
const SHORT: &[u32] = &[5, 17, 42, 99, 3, 250];
const LONG_LEN: usize = 120;

/// Prefills one open at a time, in arrival order.
struct Fake {
    vocab: u32,
    /// When the prefill queue is empty again.
    busy_until: Arc<Mutex<tokio::time::Instant>>,
    /// Set when an open of more than `SHORT`'s length arrived.
    long_open_seen: Arc<AtomicBool>,
}

#[tonic::async_trait]
impl Verifier for Fake {
    type SessionStream = ReceiverStream<Result<ServerMessage, tonic::Status>>;
    async fn session(
        &self,
        req: tonic::Request<tonic::Streaming<ClientMessage>>,
    ) -> Result<tonic::Response<Self::SessionStream>, tonic::Status> {
        let mut incoming = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let vocab = self.vocab;
        let busy_until = Arc::clone(&self.busy_until);
        let long_open_seen = Arc::clone(&self.long_open_seen);
        tokio::spawn(async move {
            let mut ctx = 0u64;
            while let Ok(Some(m)) = incoming.message().await {
                let msg = match m.msg {
                    Some(client_message::Msg::Open(o)) => {
                        let n = o.prompt_tokens.len();
                        ctx = n as u64;
                        let done = {
                            let mut b = busy_until.lock().unwrap();
                            let start = (*b).max(tokio::time::Instant::now());
                            *b = start + PER_POSITION * u32::try_from(n).unwrap();
                            *b
                        };
                        if n > SHORT.len() {
                            long_open_seen.store(true, Ordering::SeqCst);
                        }
                        tokio::time::sleep_until(done).await;
                        server_message::Msg::Opened(Opened {
                            session_id: format!("s{n}"),
                            model_id: MODEL_ID.into(),
                            vocab_size: vocab,
                            max_block: 16,
                            max_prompt_tokens: 4096,
                            context_len: ctx,
                            n_layer: 2,
                            d_model: 256,
                            ..Opened::default()
                        })
                    }
                    Some(client_message::Msg::Draft(d)) => {
                        ctx += 1;
                        server_message::Msg::Verdict(Verdict {
                            round: d.round,
                            accepted: 0,
                            next_token: 7,
                            context_len: ctx,
                            ..Verdict::default()
                        })
                    }
                    _ => return,
                };
                if tx.send(Ok(ServerMessage { msg: Some(msg) })).await.is_err() {
                    return;
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

fn generate(edge: &mut EdgeRuntime, prompt: &[u32]) -> EdgeGeneration {
    let gen = GenerateConfig {
        k: 4,
        max_tokens: 6,
        ..GenerateConfig::default()
    };
    edge.generate(prompt, &gen, &mut |_| true).unwrap()
}

fn all_verified(g: &EdgeGeneration) -> bool {
    g.statuses.iter().all(|s| *s == TokenStatus::Verified)
}

#[test]
fn a_short_open_behind_a_sibling_s_long_open_waits_for_it_instead_of_going_provisional() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("draft.gguf");
    write_tiny_qwen2(&path, &TinyConfig::draft_like()).unwrap();
    let draft = load(&path);
    let vocab = u32::try_from(draft.config().vocab).unwrap();

    let long_open_seen = Arc::new(AtomicBool::new(false));
    let (rt, url) = common::serve_fake(Fake {
        vocab,
        busy_until: Arc::new(Mutex::new(tokio::time::Instant::now())),
        long_open_seen: Arc::clone(&long_open_seen),
    });

    let cfg = EdgeConfig {
        verifier_url: Some(url),
        token: Some(TOKEN.into()),
        tokenizer_fingerprint: Some(common::FP.into()),
        model_id: MODEL_ID.into(),
        connect_timeout_ms: 500,
        ..EdgeConfig::default()
    };
    let mut long_edge = EdgeRuntime::builder(Arc::clone(&draft), cfg)
        .build()
        .unwrap();
    let mut short_edge = long_edge.sibling().unwrap();

    // The short slot learns what its opens cost: alone, a few positions.
    let warm = generate(&mut short_edge, SHORT);
    assert!(all_verified(&warm), "warm-up: {:?}", warm.statuses);

    let long_prompt: Vec<u32> = (0..LONG_LEN).map(|i| 3 + (i as u32 * 7) % 200).collect();
    let long = std::thread::spawn(move || {
        let g = generate(&mut long_edge, &long_prompt);
        (g, long_edge)
    });
    // The short open goes out once the long one waits in the prefill queue:
    // it is answered LONG_LEN × 5 ms = 600 ms later, well past the 250 ms its
    // own history allows.
    while !long_open_seen.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(2));
    }
    let short = generate(&mut short_edge, SHORT);
    let (long, _long_edge) = long.join().unwrap();

    assert!(all_verified(&long), "long: {:?}", long.statuses);
    assert!(
        all_verified(&short),
        "the short generation went provisional behind its sibling's open: {:?} \
         (background opens {})",
        short.statuses,
        short.stats.background_opens
    );
    assert_eq!(short.stats.background_opens, 0);
    drop(short_edge);
    drop(rt);
}
