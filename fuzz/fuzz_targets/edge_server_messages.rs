//! The edge runtime against a hostile verifier: an in-process gRPC server on
//! loopback answers each message a device sends with the next answer of a
//! fuzzer-chosen script (an `Opened`, `Verdict`, `Resumed` or `Closed` with
//! plausible or arbitrary fields, a refusal status with any reason, or the
//! end of the stream), while an `EdgeRuntime` with a tiny draft generates.
//!
//! Answers are mostly built relative to what the device just sent (the round
//! it asked, the block it drafted, the context length it implies), so scripts
//! reach the round loop, resumes and the provisional checks; any field can be
//! anything too.
//!
//! Invariants:
//! - no panic, no hang (every generation ends: the script always answers);
//! - `generate` returns a generation or an error;
//! - every streamed token is inside the draft's vocabulary, whether the
//!   generation ends in a result or an error (a verdict's `next_token`, an
//!   Opened's `vocab_size` and `model_id` are checked before anything is
//!   emitted);
//! - a generation has at most `max_tokens` tokens, each inside the draft's
//!   vocabulary, one status per token, and the streamed token events are
//!   exactly its tokens, in order, each index once (nothing duplicated, lost
//!   or reordered, whatever the verifier said).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use tandem_edge::{EdgeConfig, EdgeEvent, EdgeRuntime};
use tandem_model::transformer::{LoadOptions, Model};
use tandem_model::speculative::GenerateConfig;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_proto::v1::verifier_server::{Verifier, VerifierServer};
use tandem_proto::v1::{
    client_message, server_message, ClientMessage, Closed, HiddenStates, Opened, Resumed,
    ServerMessage, Verdict,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

const FP: &str = "fuzz-fingerprint";
const MODEL_ID: &str = "tiny-target";

/// A number: the plausible value (what an honest verifier would say), or anything.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Num {
    Right,
    Off(i8),
    Raw(u64),
}

impl Num {
    fn pick(self, right: u64) -> u64 {
        match self {
            Num::Right => right,
            Num::Off(d) => right.saturating_add_signed(i64::from(d)),
            Num::Raw(v) => v,
        }
    }
}

#[derive(Arbitrary, Debug, Clone)]
enum Answer {
    Opened {
        session: u8,
        resumed: bool,
        right_model: bool,
        vocab: Num,
        max_block: Num,
        max_prompt: Num,
        context_len: Num,
        reused: Num,
    },
    Verdict {
        round: Num,
        accepted: Num,
        /// `None`: the draft's own next token is unknown here, so a small id.
        next_token: Option<u32>,
        small_token: u16,
        context_len: Num,
        /// Hidden states attached (only U-shape split verdicts carry them).
        hidden: bool,
    },
    Resumed {
        context_len: Num,
        reused: Num,
    },
    Closed {
        rounds: u64,
    },
    /// A refusal: a gRPC code and a `tandem-reason` (any text).
    Refuse {
        code: u8,
        reason: String,
    },
    /// The stream ends without a status.
    End,
}

/// What the hostile verifier knows of the stream it answers.
#[derive(Default)]
struct StreamView {
    context_len: u64,
    round: u64,
}

fn answer(
    a: &Answer,
    view: &mut StreamView,
    asked: &ClientMessage,
) -> Option<Result<ServerMessage, Status>> {
    let (asked_round, drafted) = match &asked.msg {
        Some(client_message::Msg::Draft(d)) => (d.round, d.tokens.len() as u64),
        _ => (view.round, 0),
    };
    match &asked.msg {
        Some(client_message::Msg::Open(o)) => {
            view.context_len = o.prompt_tokens.len() as u64;
            view.round = o.first_round;
        }
        Some(client_message::Msg::Resume(r)) => {
            view.context_len = r.context_tokens.len() as u64;
            view.round = r.next_round;
        }
        _ => {}
    }
    let msg = |m| Some(Ok(ServerMessage { msg: Some(m) }));
    match a {
        Answer::Opened {
            session,
            resumed,
            right_model,
            vocab,
            max_block,
            max_prompt,
            context_len,
            reused,
        } => msg(server_message::Msg::Opened(Opened {
            session_id: format!("s{}", session % 4),
            resumed: *resumed,
            model_id: if *right_model {
                MODEL_ID.into()
            } else {
                "other".into()
            },
            vocab_size: vocab.pick(384) as u32,
            max_block: max_block.pick(16) as u32,
            max_prompt_tokens: max_prompt.pick(400) as u32,
            context_len: context_len.pick(view.context_len),
            n_layer: 2,
            d_model: 256,
            reused_tokens: reused.pick(0),
            features: Vec::new(),
        })),
        Answer::Verdict {
            round,
            accepted,
            next_token,
            small_token,
            context_len,
            hidden,
        } => {
            let n = accepted.pick(drafted);
            let right_len = view
                .context_len
                .saturating_add(n.min(drafted))
                .saturating_add(1);
            let v = Verdict {
                round: round.pick(asked_round),
                accepted: n as u32,
                next_token: next_token.unwrap_or(u32::from(*small_token) % 390),
                context_len: context_len.pick(right_len),
                hidden: hidden.then(HiddenStates::default),
                logprobs: Vec::new(),
            };
            view.context_len = right_len;
            view.round = asked_round.saturating_add(1);
            msg(server_message::Msg::Verdict(v))
        }
        Answer::Resumed {
            context_len,
            reused,
        } => msg(server_message::Msg::Resumed(Resumed {
            context_len: context_len.pick(view.context_len),
            reused_tokens: reused.pick(0),
        })),
        Answer::Closed { rounds } => msg(server_message::Msg::Closed(Closed { rounds: *rounds })),
        Answer::Refuse { code, reason } => {
            let mut st = Status::new(tonic::Code::from(i32::from(*code % 17)), reason.clone());
            if let Ok(v) = reason.parse() {
                st.metadata_mut()
                    .insert(tandem_proto::REASON_METADATA_KEY, v);
            }
            Some(Err(st))
        }
        Answer::End => None,
    }
}

/// The script of the current generation, shared by every stream.
type Script = Arc<Mutex<VecDeque<Answer>>>;

struct Hostile {
    script: Script,
}

#[tonic::async_trait]
impl Verifier for Hostile {
    type SessionStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<ServerMessage, Status>> + Send + 'static>>;

    async fn session(
        &self,
        req: Request<Streaming<ClientMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut inbound = req.into_inner();
        let script = self.script.clone();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let mut view = StreamView::default();
            while let Ok(Some(m)) = inbound.message().await {
                // An exhausted script ends every stream: the device must
                // finish alone.
                let next = script.lock().ok().and_then(|mut s| s.pop_front());
                let Some(a) = next else {
                    let _ = tx.send(Err(Status::unavailable("script over"))).await;
                    return;
                };
                match answer(&a, &mut view, &m) {
                    Some(r) => {
                        let end = r.is_err();
                        if tx.send(r).await.is_err() || end {
                            return;
                        }
                    }
                    None => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

struct Harness {
    _io: tokio::runtime::Runtime,
    url: String,
    script: Script,
    draft: Arc<Model>,
    vocab: u32,
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        // libFuzzer's C++ main does not ignore SIGPIPE as a Rust binary's
        // does, so a write to a closed socket (h2 writes with writev, which
        // takes no MSG_NOSIGNAL) would kill the run. The C ABI handles the
        // same for C hosts (capi `ignore_sigpipe_if_default`).
        // SAFETY: installing SIG_IGN for SIGPIPE, before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
        let dir = std::env::temp_dir().join(format!("tandem-fuzz-edge-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let path = dir.join("draft.gguf");
        write_tiny_qwen2(&path, &TinyConfig::draft_like()).expect("tiny model");
        let draft =
            Arc::new(Model::load(&path, LoadOptions::with_max_seq_len(256)).expect("load"));
        // The mapping outlives the file: leave nothing behind in /tmp.
        let _ = std::fs::remove_dir_all(&dir);
        let vocab = u32::try_from(draft.config().vocab).expect("vocab");
        let io = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let script: Script = Arc::default();
        let listener = io
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let svc = VerifierServer::new(Hostile {
            script: script.clone(),
        });
        io.spawn(async move {
            let (health, health_svc) = tonic_health::server::health_reporter();
            health
                .set_service_status(
                    tandem_proto::VERIFIER_SERVICE_NAME,
                    tonic_health::ServingStatus::Serving,
                )
                .await;
            let _ = tonic::transport::Server::builder()
                .add_service(health_svc)
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await;
        });
        Harness {
            _io: io,
            url: format!("http://{addr}"),
            script,
            draft,
            vocab,
        }
    })
}

#[derive(Arbitrary, Debug)]
struct Input {
    prompt: Vec<u16>,
    max_tokens: u8,
    k: u8,
    answers: Vec<Answer>,
}

fuzz_target!(|input: Input| {
    let h = harness();
    let prompt: Vec<u32> = input
        .prompt
        .iter()
        .take(40)
        .map(|t| u32::from(*t) % h.vocab)
        .collect();
    if prompt.is_empty() {
        return;
    }
    if let Ok(mut s) = h.script.lock() {
        s.clear();
        s.extend(input.answers.iter().take(40).cloned());
    }
    let cfg = EdgeConfig {
        verifier_url: Some(h.url.clone()),
        token: Some("fuzz-token-0123456789".into()),
        tokenizer_fingerprint: Some(FP.into()),
        model_id: MODEL_ID.into(),
        connect_timeout_ms: 500,
        open_timeout_ms: 500,
        deadline_initial_ms: 500,
        deadline_floor_ms: 100,
        deadline_max_ms: 500,
        backoff_base_ms: 1,
        backoff_max_ms: 2,
        breaker_failures: 3,
        probe_interval_ms: 5,
        probe_timeout_ms: 100,
        ..EdgeConfig::default()
    };
    let Ok(mut edge) = EdgeRuntime::builder(h.draft.clone(), cfg).build() else {
        return;
    };
    let max_tokens = usize::from(input.max_tokens % 12) + 1;
    let gen = GenerateConfig {
        max_tokens,
        k: usize::from(input.k % 6) + 1,
        ..GenerateConfig::default()
    };
    let mut streamed: Vec<(usize, u32)> = Vec::new();
    let r = edge.generate(&prompt, &gen, &mut |e| {
        if let EdgeEvent::Token { index, id, .. } = e {
            streamed.push((*index, *id));
        }
        true
    });
    for (i, t) in &streamed {
        assert!(*t < h.vocab, "streamed token {i} = {t} outside the vocabulary ({r:?})");
    }
    if let Ok(g) = r {
        assert!(g.tokens.len() <= max_tokens, "{} tokens", g.tokens.len());
        assert_eq!(g.statuses.len(), g.tokens.len());
        for t in &g.tokens {
            assert!(*t < h.vocab, "token {t} outside the vocabulary");
        }
        let expected: Vec<(usize, u32)> = g.tokens.iter().copied().enumerate().collect();
        assert_eq!(streamed, expected, "streamed events differ from the output");
    }
});
