//! The verifier's message handling, structure-aware: a few streams (from two
//! identities), each a sequence of `ClientMessage`s built from an
//! `arbitrary`-derived description, run against one in-process verifier
//! serving a tiny target model (`VerifierService::handle`, what the stream
//! loop calls after its transport checks).
//!
//! Fields are drawn mostly from plausible values (the session ids the
//! verifier handed out, the round the stream is at, the right digest of a
//! held context, hidden states of the right width and row count, the
//! position a split session is at) so inputs reach deep into the handlers,
//! split sessions (head here and U-shape, at every layer) included, and
//! otherwise from anything.
//!
//! Streams run two at a time, concurrently on one task (so their jobs share
//! the scheduler's forwards), and a stream can be cancelled after a number of
//! polls: its handler is dropped wherever it waits (admission, the
//! scheduler's answer), as when a device's connection goes away mid-message.
//!
//! Invariants:
//! - no panic;
//! - every refusal names a reason (never `UNSPECIFIED`) and a message, and its
//!   status carries the reason metadata;
//! - a verdict answers the round asked, accepts at most the tokens drafted,
//!   gives a token inside the vocabulary and, for an unsplit session (greedy
//!   or sampled: keyed draws need nothing but the tokens) whose context the
//!   driver tracks, the context length that context implies;
//! - no leaked store slot: once every session the verifier handed out is
//!   evicted, the store holds no session and no byte, the KV pool no page
//!   (after the scheduler has dropped the jobs of cancelled handlers), and
//!   the in-flight prefill budgets no token.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use std::cell::RefCell;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, OnceLock};
use std::task::Poll;
use std::time::{Duration, Instant};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_proto::v1::{
    client_message, server_message, ClientMessage, Close, Continuation, Draft, HiddenStates,
    LogitBias, Open, Reason, Resume, SamplingParams, Split,
};
use tandem_verifier::handlers::Bound;
use tandem_verifier::service::VerifierService;
use tandem_verifier::RunningVerifier;

const MODEL_ID: &str = "tiny-target";
const IDENTITIES: [&str; 2] = ["a", "b"];

struct Harness {
    rt: tokio::runtime::Runtime,
    verifier: RunningVerifier,
    vocab: u32,
    d_model: usize,
    n_layer: u32,
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        // As in a Rust binary: a write to a closed socket is an error, not
        // a SIGPIPE (see edge_server_messages).
        // SAFETY: installing SIG_IGN for SIGPIPE, before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_IGN);
        }
        let dir = std::env::temp_dir().join(format!("tandem-fuzz-verifier-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let model = dir.join("target.gguf");
        let tiny = TinyConfig::default();
        write_tiny_qwen2(&model, &tiny).expect("tiny model");
        // Small limits, so eviction, quotas and context limits are reached;
        // rates high, so the fuzzer's speed is not what gets refused.
        let toml = format!(
            r#"
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
model_path = "{}"
model_id = "{MODEL_ID}"
max_seq_len = 96
insecure_loopback = true
reflection = false

[[devices]]
id = "a"
token = "device-a-token-0123456789"

[[devices]]
id = "b"
token = "device-b-token-0123456789"

[limits]
max_sessions = 3
max_sessions_per_identity = 2
session_budget_bytes = 393216
max_bytes_per_identity = 262144
max_prompt_tokens = 64
max_block = 8
rate_per_sec = 1e9
rate_burst = 1e9
prefill_tokens_per_sec = 1e9
prefill_burst_tokens = 1e9
max_inflight_prefill_tokens = 256
max_inflight_prefill_tokens_per_identity = 128
prefill_wait_secs = 1

[batching]
max_batch_rows = 32
prefill_chunk = 16
gather_window_us = 0
"#,
            model.display()
        );
        let cfg_path = dir.join("verifier.toml");
        std::fs::write(&cfg_path, toml).expect("config");
        let cfg = tandem_verifier::VerifierConfig::from_file(&cfg_path).expect("valid config");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let verifier = rt
            .block_on(tandem_verifier::start(cfg))
            .expect("verifier starts");
        // The model is mapped and the config read: leave nothing in /tmp.
        let _ = std::fs::remove_dir_all(&dir);
        let c = verifier.state.model.config();
        Harness {
            vocab: u32::try_from(c.vocab).expect("vocab"),
            d_model: c.d_model,
            n_layer: u32::try_from(c.n_layer).expect("layers"),
            rt,
            verifier,
        }
    })
}

/// A token: mostly inside the vocabulary, sometimes just past it, sometimes anything.
#[derive(Arbitrary, Debug)]
enum TokenChoice {
    Small(u16),
    Raw(u32),
}

#[derive(Arbitrary, Debug)]
struct Tokens {
    tokens: Vec<TokenChoice>,
    /// Repeat the list this many times (long prompts without long inputs).
    repeat: u8,
}

impl Tokens {
    fn build(&self, vocab: u32) -> Vec<u32> {
        let one: Vec<u32> = self
            .tokens
            .iter()
            .map(|t| match t {
                TokenChoice::Small(v) => u32::from(*v) % (vocab + 4),
                TokenChoice::Raw(v) => *v,
            })
            .collect();
        let times = usize::from(self.repeat % 12).max(1);
        one.iter()
            .copied()
            .cycle()
            .take(one.len() * times)
            .collect()
    }
}

/// A session id: one the verifier handed out, or anything.
#[derive(Arbitrary, Debug)]
enum SessionRef {
    Known(u8),
    Raw(String),
}

impl SessionRef {
    fn build(&self, known: &[Known]) -> String {
        match self {
            SessionRef::Known(i) if !known.is_empty() => {
                known[usize::from(*i) % known.len()].id.clone()
            }
            SessionRef::Known(_) => String::new(),
            SessionRef::Raw(s) => s.clone(),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum RoundChoice {
    /// The round the stream is at.
    Next,
    Raw(u64),
}

#[derive(Arbitrary, Debug)]
enum HiddenChoice {
    /// The rows the message needs (prompt - 1 for an Open, k + 1 for a
    /// Draft), finite values.
    Fit {
        seed: u8,
        f16: bool,
    },
    /// `rows` rows of the model's width, finite values.
    Sized {
        rows: u8,
        seed: u8,
        f16: bool,
    },
    Raw {
        rows: u32,
        data: Vec<u8>,
    },
}

impl HiddenChoice {
    /// The states; `fit` is the row count the message needs.
    fn build(&self, d_model: usize, fit: usize) -> HiddenStates {
        match self {
            HiddenChoice::Fit { seed, f16 } => rows_of(fit, d_model, *seed, *f16),
            HiddenChoice::Sized { rows, seed, f16 } => {
                rows_of(usize::from(*rows % 20), d_model, *seed, *f16)
            }
            HiddenChoice::Raw { rows, data } => HiddenStates {
                rows: *rows,
                data: data.clone(),
            },
        }
    }
}

/// `rows` rows of finite values (f32, or f16 bits).
fn rows_of(rows: usize, d_model: usize, seed: u8, f16: bool) -> HiddenStates {
    let n = rows * d_model;
    let mut data = Vec::with_capacity(n * 4);
    for i in 0..n {
        let v = ((i as f32 + f32::from(seed)) * 0.37).sin() * 2.0;
        if f16 {
            data.extend_from_slice(&half_bits(v).to_le_bytes());
        } else {
            data.extend_from_slice(&v.to_le_bytes());
        }
    }
    HiddenStates {
        rows: rows as u32,
        data,
    }
}

/// f32 -> IEEE half bits (truncating; the values are small and finite).
fn half_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    if exp <= 0 {
        return sign;
    }
    sign | ((exp.min(30) as u16) << 10) | ((b >> 13) & 0x3ff) as u16
}

#[derive(Arbitrary, Debug)]
struct SamplingChoice {
    temperature: f32,
    top_k: u32,
    top_p: f32,
    repetition_penalty: f32,
    seed: u64,
    presence_penalty: f32,
    frequency_penalty: f32,
    logit_bias: Vec<(u16, f32)>,
    completion_start: u16,
    /// `Open.top_logprobs` (rides here to keep the Open variant's shape).
    top_logprobs: Option<u8>,
}

#[derive(Arbitrary, Debug)]
enum DigestChoice {
    /// sha256 of the first `prefix_len` tokens the driver tracks for the session.
    Right,
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Open {
        right_model: bool,
        right_fingerprint: bool,
        prompt: Tokens,
        sampling: Option<SamplingChoice>,
        resume: Option<SessionRef>,
        first_round: u8,
        /// (layer, pin_head, f16, U-shape Open keeps its prompt tokens).
        split: Option<(u8, bool, bool, bool)>,
        hidden: Option<HiddenChoice>,
        continuation: Option<(SessionRef, u8, DigestChoice)>,
    },
    Draft {
        round: RoundChoice,
        tokens: Tokens,
        hidden: Option<HiddenChoice>,
        start_pos: Option<u64>,
    },
    Resume {
        context: Tokens,
        next_round: RoundChoice,
    },
    Close {
        keep: bool,
    },
    Empty,
}

#[derive(Arbitrary, Debug)]
struct StreamOps {
    identity_b: bool,
    /// Drop the stream's future after this many polls that found it waiting.
    cancel_after: Option<u8>,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    streams: Vec<StreamOps>,
}

/// A session the verifier handed out, and its context when the driver can
/// track it (unsplit).
struct Known {
    id: String,
    context: Option<Vec<u32>>,
}

/// What the stream is at.
struct StreamState {
    bound: Option<Bound>,
    next_round: u64,
    /// Index into `known` of the session this stream drives.
    session: Option<usize>,
    /// Tracks the context (unsplit).
    tracked: bool,
    /// A U-shape split session (no token ids on the wire).
    u_shape: bool,
    /// Positions the verifier holds for the session, as its answers say
    /// (the next Draft's `start_pos`).
    cached: u64,
}

fn check_refusal(r: &tandem_verifier::Refusal) {
    assert_ne!(
        r.reason,
        Reason::Unspecified,
        "a refusal without a reason: {r}"
    );
    assert!(!r.message.is_empty(), "a refusal without a message: {r:?}");
    let st = r.to_status();
    assert_eq!(tandem_verifier::reason_of(&st), Some(r.reason), "{st:?}");
}

/// The Open message, whether the driver tracks its context, the index of
/// the known session it names, and whether it is a U-shape split session.
fn build_open(
    h: &Harness,
    known: &[Known],
    op: &Op,
) -> Option<(ClientMessage, bool, Option<usize>, bool)> {
    let Op::Open {
        right_model,
        right_fingerprint,
        prompt,
        sampling,
        resume,
        first_round,
        split,
        hidden,
        continuation,
    } = op
    else {
        return None;
    };
    let state = &h.verifier.state;
    let mut prompt_tokens = prompt.build(h.vocab);
    let fit_rows = prompt_tokens.len().saturating_sub(1);
    let mut session = None;
    let continuation = continuation.as_ref().map(|(r, prefix, digest)| {
        let id = r.build(known);
        let idx = known.iter().position(|k| k.id == id);
        session = idx;
        let prefix_len = u64::from(*prefix);
        let prefix_sha256 = match digest {
            DigestChoice::Right => idx
                .and_then(|i| known[i].context.as_ref())
                .map(|c| {
                    let n = usize::from(*prefix).min(c.len());
                    tandem_proto::context_digest(&c[..n]).to_vec()
                })
                .unwrap_or_default(),
            DigestChoice::Raw(b) => b.clone(),
        };
        Continuation {
            session_id: id,
            prefix_len,
            prefix_sha256,
        }
    });
    let resume_session_id = resume.as_ref().map(|r| {
        let id = r.build(known);
        session = known.iter().position(|k| k.id == id);
        id
    });
    let split = split.map(|(layer, pin_head, f16, keep_tokens)| {
        if pin_head && !keep_tokens {
            // U-shape: the prompt is a length only.
            prompt_tokens.clear();
        }
        Split {
            layer: u32::from(layer) % (h.n_layer + 2),
            pin_head,
            format: i32::from(f16),
        }
    });
    let tracked = split.is_none();
    let u_shape = split.as_ref().is_some_and(|s| s.pin_head);
    let m = Open {
        model_id: if *right_model {
            MODEL_ID.into()
        } else {
            "other".into()
        },
        tokenizer_fingerprint: if *right_fingerprint {
            state.fingerprint.clone()
        } else {
            "x".into()
        },
        prompt_tokens,
        sampling: sampling.as_ref().map(|s| SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            repetition_penalty: s.repetition_penalty,
            seed: s.seed,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            logit_bias: s
                .logit_bias
                .iter()
                .map(|&(token, bias)| LogitBias {
                    token: u32::from(token),
                    bias,
                })
                .collect(),
            completion_start: u64::from(s.completion_start),
        }),
        top_logprobs: sampling
            .as_ref()
            .and_then(|s| s.top_logprobs.map(u32::from)),
        resume_session_id,
        first_round: u64::from(*first_round),
        split,
        prompt_hidden: hidden.as_ref().map(|x| x.build(h.d_model, fit_rows)),
        continuation,
        grammar: None,
    };
    Some((
        ClientMessage {
            msg: Some(client_message::Msg::Open(m)),
        },
        tracked,
        session,
        u_shape,
    ))
}

/// Runs `fut`, or drops it after it was found waiting `polls` times (None:
/// never): a cancelled stream.
async fn cancel_after(fut: impl Future<Output = ()>, polls: Option<u8>) {
    let mut fut = pin!(fut);
    let mut left = polls;
    std::future::poll_fn(move |cx| {
        if fut.as_mut().poll(cx).is_ready() {
            return Poll::Ready(());
        }
        match &mut left {
            Some(0) => Poll::Ready(()), // dropped here, wherever it waits
            Some(n) => {
                *n -= 1;
                Poll::Pending
            }
            None => Poll::Pending,
        }
    })
    .await
}

/// Polls both futures on this task until both are done.
async fn both(a: impl Future<Output = ()>, b: impl Future<Output = ()>) {
    let mut a = pin!(a);
    let mut b = pin!(b);
    let (mut a_done, mut b_done) = (false, false);
    std::future::poll_fn(move |cx| {
        if !a_done {
            a_done = a.as_mut().poll(cx).is_ready();
        }
        if !b_done {
            b_done = b.as_mut().poll(cx).is_ready();
        }
        if a_done && b_done {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await
}

/// One stream's messages in order. `known` is shared with the stream run
/// beside it (never borrowed across an await).
async fn run_stream(
    h: &Harness,
    svc: &VerifierService,
    known: &RefCell<Vec<Known>>,
    s: &StreamOps,
) {
    let who: Arc<str> = Arc::from(IDENTITIES[usize::from(s.identity_b)]);
    let mut st = StreamState {
        bound: None,
        next_round: 0,
        session: None,
        tracked: false,
        u_shape: false,
        cached: 0,
    };
    for op in s.ops.iter().take(12) {
        let mut drafted: Option<Vec<u32>> = None;
        let mut asked_round = None;
        let mut open_prompt = None;
        let m = match op {
            Op::Open { first_round, .. } => {
                let Some((m, tracked, session, u_shape)) = build_open(h, &known.borrow(), op)
                else {
                    return;
                };
                st.u_shape = u_shape;
                if let Some(client_message::Msg::Open(o)) = &m.msg {
                    open_prompt = Some(o.prompt_tokens.clone());
                }
                st.tracked = tracked;
                st.session = session;
                st.next_round = u64::from(*first_round);
                m
            }
            Op::Draft {
                round,
                tokens,
                hidden,
                start_pos,
            } => {
                let round = match round {
                    RoundChoice::Next => st.next_round,
                    RoundChoice::Raw(r) => *r,
                };
                asked_round = Some(round);
                let mut tokens = tokens.build(h.vocab);
                let fit_rows = tokens.len() + 1;
                if st.u_shape && matches!(hidden, Some(HiddenChoice::Fit { .. })) {
                    // A U-shape block is its rows only.
                    tokens.clear();
                }
                drafted = Some(tokens.clone());
                ClientMessage {
                    msg: Some(client_message::Msg::Draft(Draft {
                        round,
                        tokens,
                        hidden: hidden.as_ref().map(|x| x.build(h.d_model, fit_rows)),
                        start_pos: start_pos.unwrap_or(st.cached),
                    })),
                }
            }
            Op::Resume {
                context,
                next_round,
            } => {
                let next_round = match next_round {
                    RoundChoice::Next => st.next_round,
                    RoundChoice::Raw(r) => *r,
                };
                let context_tokens = context.build(h.vocab);
                open_prompt = Some(context_tokens.clone());
                st.next_round = next_round;
                ClientMessage {
                    msg: Some(client_message::Msg::Resume(Resume {
                        context_tokens,
                        next_round,
                    })),
                }
            }
            Op::Close { keep } => ClientMessage {
                msg: Some(client_message::Msg::Close(Close { keep: *keep })),
            },
            Op::Empty => ClientMessage { msg: None },
        };
        let is_close = matches!(m.msg, Some(client_message::Msg::Close(_)));
        match svc.handle(&who, &mut st.bound, m).await {
            Err(r) => {
                check_refusal(&r);
                // A refusal ends the stream. The session's context may have
                // changed under a refused resume: stop tracking it.
                let mut known = known.borrow_mut();
                if let Some(k) = st.session.and_then(|i| known.get_mut(i)) {
                    if matches!(op, Op::Resume { .. } | Op::Open { .. }) {
                        k.context = None;
                    }
                }
                return;
            }
            Ok(out) => match out.msg {
                Some(server_message::Msg::Opened(o)) => {
                    assert!(!o.session_id.is_empty(), "{o:?}");
                    st.cached = o.context_len.saturating_sub(1);
                    let mut known = known.borrow_mut();
                    let idx = match known.iter().position(|k| k.id == o.session_id) {
                        Some(i) => i,
                        None => {
                            known.push(Known {
                                id: o.session_id.clone(),
                                context: None,
                            });
                            known.len() - 1
                        }
                    };
                    st.session = Some(idx);
                    // A fresh or continued session holds the prompt it was
                    // sent; a resumed one what it held (not tracked here).
                    known[idx].context = match (&open_prompt, st.tracked && !o.resumed) {
                        (Some(p), true) => {
                            assert_eq!(o.context_len, p.len() as u64, "{o:?}");
                            Some(p.clone())
                        }
                        _ => None,
                    };
                }
                Some(server_message::Msg::Verdict(v)) => {
                    let Some(round) = asked_round else {
                        panic!("a verdict answered a non-Draft message: {v:?}");
                    };
                    assert_eq!(v.round, round, "{v:?}");
                    assert!(v.next_token < h.vocab, "{v:?}");
                    st.next_round = round.saturating_add(1);
                    // U-shape: context_len is the positions held.
                    st.cached = if st.u_shape {
                        v.context_len
                    } else {
                        v.context_len.saturating_sub(1)
                    };
                    let mut known = known.borrow_mut();
                    if let Some(k) = st.session.and_then(|i| known.get_mut(i)) {
                        if let (Some(ctx), Some(block), true) =
                            (&mut k.context, &drafted, st.tracked)
                        {
                            let n = v.accepted as usize;
                            assert!(n <= block.len(), "{v:?} for {} drafted", block.len());
                            ctx.extend_from_slice(&block[..n]);
                            ctx.push(v.next_token);
                            assert_eq!(v.context_len, ctx.len() as u64, "{v:?}");
                        }
                    }
                }
                Some(server_message::Msg::Resumed(r)) => {
                    st.cached = r.context_len.saturating_sub(1);
                    let mut known = known.borrow_mut();
                    if let Some(k) = st.session.and_then(|i| known.get_mut(i)) {
                        k.context = match (&open_prompt, st.tracked) {
                            (Some(p), true) => {
                                assert_eq!(r.context_len, p.len() as u64, "{r:?}");
                                Some(p.clone())
                            }
                            _ => None,
                        };
                    }
                }
                Some(server_message::Msg::Closed(_)) => {
                    assert!(is_close);
                    return;
                }
                None => panic!("an empty server message"),
            },
        }
        if is_close {
            return;
        }
    }
}

fuzz_target!(|input: Input| {
    let h = harness();
    let svc = VerifierService {
        state: h.verifier.state.clone(),
    };
    let known: RefCell<Vec<Known>> = RefCell::new(Vec::new());
    h.rt.block_on(async {
        let streams: Vec<&StreamOps> = input.streams.iter().take(6).collect();
        for pair in streams.chunks(2) {
            match pair {
                [a, b] => {
                    both(
                        cancel_after(run_stream(h, &svc, &known, a), a.cancel_after),
                        cancel_after(run_stream(h, &svc, &known, b), b.cancel_after),
                    )
                    .await
                }
                [a] => cancel_after(run_stream(h, &svc, &known, a), a.cancel_after).await,
                _ => {}
            }
        }
    });
    let known = known.into_inner();
    let state = &h.verifier.state;
    // Nothing runs now but the jobs of cancelled handlers (their sessions
    // are already out of the store): every session is idle and evictable.
    {
        let mut store = state.store();
        for k in &known {
            store.evict(&k.id);
        }
        assert_eq!(
            store.len(),
            0,
            "a session the verifier never handed out is held"
        );
        assert_eq!(store.bytes(), 0, "bytes held by no session");
    }
    // A cancelled handler's job may still sit in the scheduler's queue with
    // its state and pages; the scheduler drops it on its next pass.
    let until = Instant::now() + Duration::from_secs(10);
    while state.pool.pages_used() > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(state.pool.pages_used(), 0, "KV pages held by no session");
    assert_eq!(
        state.admission.prefill_tokens_in_flight(),
        0,
        "a prefill permit was not given back"
    );
});
