//! The gRPC `Session` service: authentication, limits, and the verify rounds.

use crate::error::Refusal;
use crate::metrics::Metrics;
use crate::split::{self, SplitAnswer, SplitSpec};
use crate::store::{SessionState, SessionStore, StoreError};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use subtle::ConstantTimeEq;
use tandem_model::qwen2::Qwen2Model;
use tandem_model::sampling::{self, argmax, distribution, Distribution, Sampler, SamplingParams};
use tandem_model::verify::{verify_greedy, verify_sampled, Verdict};
use tandem_proto::v1::verifier_server::Verifier;
use tandem_proto::v1::{
    client_message, server_message, ClientMessage, Closed, Draft, Open, Opened, Reason, Resumed,
    ServerMessage,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

/// What the service checks requests against.
#[derive(Debug, Clone)]
pub struct ServiceLimits {
    pub max_prompt_tokens: usize,
    pub max_block: usize,
    pub rate_per_sec: f64,
    pub rate_burst: f64,
}

/// Shared state of the verify service (one per server).
pub struct VerifierState {
    pub model: Arc<Qwen2Model>,
    pub model_id: String,
    pub fingerprint: String,
    pub limits: ServiceLimits,
    pub store: Mutex<SessionStore>,
    pub metrics: Metrics,
    /// (identity, sha256(token)).
    devices: Vec<(String, [u8; 32])>,
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
    shutdown: watch::Receiver<bool>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl VerifierState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: Arc<Qwen2Model>,
        model_id: String,
        fingerprint: String,
        limits: ServiceLimits,
        store: SessionStore,
        devices: &[(String, String)],
        shutdown: watch::Receiver<bool>,
    ) -> Self {
        Self {
            model,
            model_id,
            fingerprint,
            limits,
            store: Mutex::new(store),
            metrics: Metrics::default(),
            devices: devices
                .iter()
                .map(|(id, tok)| (id.clone(), Sha256::digest(tok.as_bytes()).into()))
                .collect(),
            buckets: Mutex::new(HashMap::new()),
            shutdown,
        }
    }

    /// The store, locked.
    pub fn store(&self) -> MutexGuard<'_, SessionStore> {
        lock(&self.store)
    }

    /// Prometheus text.
    pub fn render_metrics(&self) -> String {
        let (n, b, e) = {
            let s = self.store();
            (s.len(), s.bytes(), s.evictions())
        };
        self.metrics.render(n, b, e)
    }

    /// The identity whose token this is; compares in constant time against every
    /// configured token (no early exit).
    fn authenticate(&self, meta: &tonic::metadata::MetadataMap) -> Result<String, Refusal> {
        let tok = meta
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| Refusal::new(Reason::Unauthenticated, "missing bearer token"))?;
        let h: [u8; 32] = Sha256::digest(tok.trim().as_bytes()).into();
        let mut found = None;
        for (id, want) in &self.devices {
            if bool::from(h.ct_eq(want)) {
                found = Some(id.clone());
            }
        }
        found.ok_or_else(|| Refusal::new(Reason::Unauthenticated, "unknown bearer token"))
    }

    /// Token bucket per identity; one token per client message.
    fn rate_check(&self, identity: &str) -> Result<(), Refusal> {
        let now = Instant::now();
        let mut b = lock(&self.buckets);
        let (tokens, last) = b
            .entry(identity.to_owned())
            .or_insert((self.limits.rate_burst, now));
        let refill = now.duration_since(*last).as_secs_f64() * self.limits.rate_per_sec;
        *tokens = (*tokens + refill).min(self.limits.rate_burst);
        *last = now;
        if *tokens < 1.0 {
            return Err(Refusal::new(
                Reason::RateLimited,
                format!(
                    "more than {} messages/s (burst {}) from this identity",
                    self.limits.rate_per_sec, self.limits.rate_burst
                ),
            ));
        }
        *tokens -= 1.0;
        Ok(())
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<(), Refusal> {
        let vocab = self.model.config().vocab;
        if let Some((i, t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= vocab)
        {
            return Err(Refusal::new(
                Reason::TokenOutOfVocab,
                format!("token id {t} at index {i} is not below the vocabulary size {vocab}"),
            ));
        }
        Ok(())
    }

    fn check_context(&self, tokens: &[u32]) -> Result<(), Refusal> {
        if tokens.is_empty() {
            return Err(Refusal::new(
                Reason::PromptTooLong,
                "the context is empty: send at least one token",
            ));
        }
        if tokens.len() > self.limits.max_prompt_tokens {
            return Err(Refusal::new(
                Reason::PromptTooLong,
                format!(
                    "context of {} tokens exceeds max_prompt_tokens = {}",
                    tokens.len(),
                    self.limits.max_prompt_tokens
                ),
            ));
        }
        self.check_tokens(tokens)
    }

    /// Runs `f` on a blocking thread (forward passes never block the runtime).
    async fn blocking<R: Send + 'static>(
        f: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, Refusal> {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| Refusal::new(Reason::InternalError, format!("verify task failed: {e}")))
    }
}

fn store_refusal(e: StoreError) -> Refusal {
    let reason = match e {
        StoreError::Unknown => Reason::SessionUnknown,
        StoreError::Evicted => Reason::SessionEvicted,
        StoreError::Forbidden => Reason::SessionForbidden,
        StoreError::Busy => Reason::SessionUnknown,
        StoreError::Full => Reason::TooManySessions,
        StoreError::TooLarge => Reason::ContextFull,
    };
    Refusal::new(reason, e.to_string())
}

fn sampling_from_wire(
    p: Option<tandem_proto::v1::SamplingParams>,
) -> Result<SamplingParams, Refusal> {
    let p = p.unwrap_or_default();
    let s = SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k as usize,
        top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
        repetition_penalty: if p.repetition_penalty == 0.0 {
            1.0
        } else {
            p.repetition_penalty
        },
        seed: p.seed,
    };
    s.validate()
        .map_err(|e| Refusal::new(Reason::BadRequest, format!("sampling: {e}")))?;
    Ok(s)
}

fn new_session_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Brings a state's KV cache in line with `ctx` (the device's whole context): keeps
/// the longest common prefix and recomputes the rest. Returns the reused count.
pub fn resync(
    model: &Qwen2Model,
    st: &mut SessionState,
    ctx: &[u32],
) -> tandem_model::Result<usize> {
    let lcp = st
        .context
        .iter()
        .zip(ctx)
        .take_while(|(a, b)| a == b)
        .count();
    let reuse = lcp.min(ctx.len().saturating_sub(1)).min(st.cache.len());
    st.cache.truncate(reuse);
    if ctx.len() > reuse + 1 {
        model.forward(&ctx[reuse..ctx.len() - 1], reuse, &mut st.cache)?;
    }
    st.context = ctx.to_vec();
    Ok(reuse)
}

/// One verify round on a state: one forward over `[last, d1..dk]`, the verdict, and
/// the KV cache rolled back to the accepted prefix.
pub fn verify_round(
    model: &Qwen2Model,
    st: &mut SessionState,
    draft: &[u32],
    draft_dists: &[Distribution],
) -> Result<Verdict, Refusal> {
    let internal = |e: tandem_model::ModelError| Refusal::new(Reason::InternalError, e.to_string());
    let k = draft.len();
    let base = st.cache.len();
    let Some(&last) = st.context.last() else {
        return Err(Refusal::new(
            Reason::InternalError,
            "session has no context",
        ));
    };
    if base + k + 1 > st.cache.capacity() {
        return Err(Refusal::new(
            Reason::ContextFull,
            format!(
                "context would exceed the KV capacity of {} tokens",
                st.cache.capacity()
            ),
        ));
    }
    let mut input = Vec::with_capacity(k + 1);
    input.push(last);
    input.extend_from_slice(draft);
    let logits = model
        .forward(&input, base, &mut st.cache)
        .map_err(internal)?;
    let verdict = verdict_from_logits(model.config().vocab, st, draft, draft_dists, &logits)?;
    let n = verdict.accepted;
    st.cache.truncate(base + 1 + n);
    st.context.extend_from_slice(&draft[..n]);
    st.context.push(verdict.next_token);
    st.rounds += 1;
    Ok(verdict)
}

/// The verdict for `draft` given the target's logits `[k + 1, vocab]` over
/// `[last, d1..dk]` (greedy prefix match or the lossless rejection rule, with the
/// session's sampling parameters, history and random source). Changes only the
/// session's random source.
// Rows 0..=k of the logits pair with draft tokens 0..k: an index loop is clearest.
#[allow(clippy::needless_range_loop)]
pub fn verdict_from_logits(
    vocab: usize,
    st: &mut SessionState,
    draft: &[u32],
    draft_dists: &[Distribution],
    logits: &[f32],
) -> Result<Verdict, Refusal> {
    let internal = |e: tandem_model::ModelError| Refusal::new(Reason::InternalError, e.to_string());
    let k = draft.len();
    let row = |i: usize| &logits[i * vocab..(i + 1) * vocab];
    let p = st.sampling;
    let mut hist = st.context.clone();
    let verdict = if p.is_greedy() {
        let mut am = Vec::with_capacity(k + 1);
        for i in 0..=k {
            am.push(if p.repetition_penalty == 1.0 {
                argmax(row(i))
            } else {
                let mut l = row(i).to_vec();
                sampling::apply_repetition_penalty(&mut l, &hist, p.repetition_penalty);
                argmax(&l)
            });
            if i < k {
                hist.push(draft[i]);
            }
        }
        if k == 0 {
            Verdict {
                accepted: 0,
                next_token: am[0],
            }
        } else {
            verify_greedy(draft, &am).map_err(internal)?
        }
    } else {
        let mut ps = Vec::with_capacity(k + 1);
        for i in 0..=k {
            ps.push(distribution(&p, row(i), &hist));
            if i < k {
                hist.push(draft[i]);
            }
        }
        if k == 0 {
            Verdict {
                accepted: 0,
                next_token: st.rng.sample(&ps[0]),
            }
        } else {
            verify_sampled(draft, draft_dists, &ps, &mut st.rng).map_err(|e| {
                Refusal::new(Reason::BadRequest, format!("draft distributions: {e}"))
            })?
        }
    };
    Ok(verdict)
}

/// The tonic service.
#[derive(Clone)]
pub struct VerifierService {
    pub state: Arc<VerifierState>,
}

type Out = mpsc::Sender<Result<ServerMessage, Status>>;

fn msg(m: server_message::Msg) -> ServerMessage {
    ServerMessage { msg: Some(m) }
}

/// A stream's session binding.
struct Bound {
    id: String,
    epoch: u64,
}

impl VerifierService {
    async fn open(&self, identity: &str, o: Open) -> Result<(Bound, Opened), Refusal> {
        let s = &self.state;
        if o.model_id != s.model_id {
            return Err(Refusal::new(
                Reason::ModelMismatch,
                format!(
                    "this verifier serves {:?}, not {:?}",
                    s.model_id, o.model_id
                ),
            ));
        }
        if o.tokenizer_fingerprint != s.fingerprint {
            return Err(Refusal::new(
                Reason::FingerprintMismatch,
                "the device's tokenizer fingerprint differs from the target's",
            ));
        }
        let split = o
            .split
            .as_ref()
            .map(|w| SplitSpec::from_wire(w, s.model.config().n_layer))
            .transpose()?;
        if split.is_some_and(|sp| sp.pin_head) {
            // U-shape: no token ids; the context length comes from prompt_hidden.
        } else {
            s.check_context(&o.prompt_tokens)?;
        }
        let sampling = sampling_from_wire(o.sampling)?;
        if let Some(spec) = split {
            return self.open_split(identity, o, spec, sampling).await;
        }
        let ctx = o.prompt_tokens;
        let opened = |id: &str, resumed: bool| Opened {
            session_id: id.to_owned(),
            resumed,
            model_id: s.model_id.clone(),
            vocab_size: s.model.config().vocab as u32,
            max_block: s.limits.max_block as u32,
            max_prompt_tokens: s.limits.max_prompt_tokens as u32,
            context_len: ctx.len() as u64,
            n_layer: s.model.config().n_layer as u32,
            d_model: s.model.config().d_model as u32,
        };
        if let Some(rid) = &o.resume_session_id {
            let taken = s.store().take_over(rid, identity);
            match taken {
                Ok((mut st, epoch)) => {
                    let model = s.model.clone();
                    let c = ctx.clone();
                    let (st, r) = VerifierState::blocking(move || {
                        let r = resync(&model, &mut st, &c);
                        (st, r)
                    })
                    .await?;
                    let mut st = st;
                    match r {
                        Ok(reused) => {
                            st.sampling = sampling;
                            st.next_round = o.first_round;
                            s.store().checkin(rid, st);
                            tracing::info!(session = %rid, reused, "session resumed");
                            return Ok((
                                Bound {
                                    id: rid.clone(),
                                    epoch,
                                },
                                opened(rid, true),
                            ));
                        }
                        Err(e) => {
                            s.store().remove(rid);
                            return Err(Refusal::new(Reason::InternalError, e.to_string()));
                        }
                    }
                }
                Err(StoreError::Forbidden) => return Err(store_refusal(StoreError::Forbidden)),
                Err(_) => {} // lost or busy: recompute under a new id
            }
        }
        let model = s.model.clone();
        let c = ctx.clone();
        let st = VerifierState::blocking(move || -> tandem_model::Result<SessionState> {
            let mut cache = model.new_cache();
            if c.len() > 1 {
                model.forward(&c[..c.len() - 1], 0, &mut cache)?;
            }
            Ok(SessionState {
                cache,
                context: c,
                sampling,
                rng: Sampler::from_params(&sampling),
                next_round: o.first_round,
                rounds: 0,
                split: None,
            })
        })
        .await?
        .map_err(|e| Refusal::new(Reason::InternalError, e.to_string()))?;
        let id = new_session_id();
        let epoch = s
            .store()
            .insert(id.clone(), identity.to_owned(), st)
            .map_err(store_refusal)?;
        s.metrics.session_opened();
        tracing::info!(session = %id, context_len = ctx.len(), "session opened");
        Ok((
            Bound {
                id: id.clone(),
                epoch,
            },
            opened(&id, false),
        ))
    }

    /// Opens a split session (always a fresh one: the device re-sends the hidden
    /// states of its whole context, so a resume id is ignored).
    async fn open_split(
        &self,
        identity: &str,
        o: Open,
        spec: SplitSpec,
        sampling: SamplingParams,
    ) -> Result<(Bound, Opened), Refusal> {
        let s = &self.state;
        let model = s.model.clone();
        let max_context = s.limits.max_prompt_tokens;
        let (tokens, hidden, first_round) = (o.prompt_tokens, o.prompt_hidden, o.first_round);
        let st = VerifierState::blocking(move || {
            split::open_state(
                &model,
                spec,
                tokens,
                hidden.as_ref(),
                sampling,
                first_round,
                max_context,
            )
        })
        .await??;
        let context_len = st.context.len() as u64;
        let id = new_session_id();
        let epoch = s
            .store()
            .insert(id.clone(), identity.to_owned(), st)
            .map_err(store_refusal)?;
        s.metrics.session_opened();
        tracing::info!(session = %id, context_len, split = spec.layer, pin_head = spec.pin_head, "split session opened");
        let cfg = s.model.config();
        Ok((
            Bound {
                id: id.clone(),
                epoch,
            },
            Opened {
                session_id: id,
                resumed: false,
                model_id: s.model_id.clone(),
                vocab_size: cfg.vocab as u32,
                max_block: s.limits.max_block as u32,
                max_prompt_tokens: s.limits.max_prompt_tokens as u32,
                context_len,
                n_layer: cfg.n_layer as u32,
                d_model: cfg.d_model as u32,
            },
        ))
    }

    async fn draft(&self, identity: &str, b: &Bound, d: Draft) -> Result<ServerMessage, Refusal> {
        let s = &self.state;
        // U-shape drafts carry no tokens: k is the hidden rows - 1.
        let k = if d.tokens.is_empty() {
            d.hidden
                .as_ref()
                .map_or(0, |h| (h.rows as usize).saturating_sub(1))
        } else {
            d.tokens.len()
        };
        if k > s.limits.max_block {
            return Err(Refusal::new(
                Reason::BlockTooLarge,
                format!(
                    "block of {k} tokens exceeds max_block = {}",
                    s.limits.max_block
                ),
            ));
        }
        s.check_tokens(&d.tokens)?;
        let mut dists = Vec::with_capacity(d.draft_dists.len());
        for (i, td) in d.draft_dists.iter().enumerate() {
            if td.tokens.len() != td.probs.len() {
                return Err(Refusal::new(
                    Reason::BadRequest,
                    format!(
                        "draft_dists[{i}]: {} tokens but {} probs",
                        td.tokens.len(),
                        td.probs.len()
                    ),
                ));
            }
            s.check_tokens(&td.tokens)?;
            dists.push(
                Distribution::from_pairs(td.tokens.iter().copied().zip(td.probs.iter().copied()))
                    .map_err(|e| Refusal::new(Reason::BadRequest, format!("draft_dists[{i}]: {e}")))?,
            );
        }
        let mut st = s
            .store()
            .checkout(&b.id, identity, b.epoch)
            .map_err(store_refusal)?;
        if d.round != st.next_round {
            let want = st.next_round;
            s.store().checkin(&b.id, st);
            return Err(Refusal::new(
                Reason::RoundOutOfOrder,
                format!("expected round {want}, got {}", d.round),
            ));
        }
        let greedy = st.sampling.is_greedy();
        let ushape = st.split.is_some_and(|sp| sp.pin_head);
        let bad_dists = if ushape {
            false // checked by split_round
        } else if greedy {
            !dists.is_empty()
        } else {
            dists.len() != k
        };
        if bad_dists {
            s.store().checkin(&b.id, st);
            return Err(Refusal::new(
                Reason::BadRequest,
                if greedy {
                    "greedy sessions take no draft_dists".to_string()
                } else {
                    format!("sampled mode needs one draft distribution per token ({k})")
                },
            ));
        }
        let model = s.model.clone();
        let tokens = d.tokens;
        let (hidden, start_pos) = (d.hidden, d.start_pos as usize);
        let t0 = Instant::now();
        let (mut st, r) = VerifierState::blocking(move || {
            let r = if st.split.is_some() {
                split::split_round(&model, &mut st, &tokens, &dists, hidden.as_ref(), start_pos)
            } else {
                verify_round(&model, &mut st, &tokens, &dists).map(SplitAnswer::Verdict)
            };
            (st, r)
        })
        .await?;
        let latency = t0.elapsed();
        let verdict = match r {
            Ok(v) => v,
            Err(e) => {
                if e.reason == Reason::InternalError {
                    s.store().remove(&b.id);
                } else {
                    s.store().checkin(&b.id, st);
                }
                return Err(e);
            }
        };
        st.next_round += 1;
        let ctx_len = st.context.len() as u64;
        s.store().checkin(&b.id, st);
        let (accepted, next_token, hidden) = match verdict {
            SplitAnswer::Verdict(v) => (v.accepted, v.next_token, None),
            // U-shape: context_len = positions cached = start_pos + k + 1.
            SplitAnswer::Hidden(h) => (0, 0, Some(h)),
        };
        let ctx_len = if hidden.is_some() {
            ctx_len - 1
        } else {
            ctx_len
        };
        s.metrics.verify(latency, k, accepted);
        tracing::debug!(session = %b.id, round = d.round, k, accepted, "verified");
        Ok(msg(server_message::Msg::Verdict(
            tandem_proto::v1::Verdict {
                round: d.round,
                accepted: accepted as u32,
                next_token,
                context_len: ctx_len,
                hidden,
            },
        )))
    }

    async fn resume(
        &self,
        identity: &str,
        b: &Bound,
        r: tandem_proto::v1::Resume,
    ) -> Result<ServerMessage, Refusal> {
        let s = &self.state;
        s.check_context(&r.context_tokens)?;
        let st = s
            .store()
            .checkout(&b.id, identity, b.epoch)
            .map_err(store_refusal)?;
        if st.split.is_some() {
            s.store().checkin(&b.id, st);
            return Err(Refusal::new(
                Reason::BadRequest,
                "Resume is not supported in split sessions: open a new session with the context's hidden states",
            ));
        }
        let model = s.model.clone();
        let ctx = r.context_tokens;
        let (mut st, res) = VerifierState::blocking(move || {
            let mut st = st;
            let res = resync(&model, &mut st, &ctx);
            (st, res)
        })
        .await?;
        match res {
            Ok(reused) => {
                st.next_round = r.next_round;
                let len = st.context.len() as u64;
                s.store().checkin(&b.id, st);
                Ok(msg(server_message::Msg::Resumed(Resumed {
                    context_len: len,
                    reused_tokens: reused as u64,
                })))
            }
            Err(e) => {
                s.store().remove(&b.id);
                Err(Refusal::new(Reason::InternalError, e.to_string()))
            }
        }
    }

    async fn handle(
        &self,
        identity: &str,
        bound: &mut Option<Bound>,
        m: ClientMessage,
    ) -> Result<Option<ServerMessage>, Refusal> {
        self.state.rate_check(identity)?;
        match (m.msg, bound.as_ref()) {
            (Some(client_message::Msg::Open(o)), None) => {
                let (b, opened) = self.open(identity, o).await?;
                *bound = Some(b);
                Ok(Some(msg(server_message::Msg::Opened(opened))))
            }
            (Some(client_message::Msg::Open(_)), Some(_)) => Err(Refusal::new(
                Reason::BadRequest,
                "Open may only be the first message",
            )),
            (_, None) => Err(Refusal::new(
                Reason::BadRequest,
                "the first message must be Open",
            )),
            (Some(client_message::Msg::Draft(d)), Some(b)) => {
                self.draft(identity, b, d).await.map(Some)
            }
            (Some(client_message::Msg::Resume(r)), Some(b)) => {
                self.resume(identity, b, r).await.map(Some)
            }
            (Some(client_message::Msg::Close(_)), Some(b)) => {
                let rounds = self
                    .state
                    .store()
                    .remove(&b.id)
                    .map(|s| s.rounds)
                    .unwrap_or(0);
                tracing::info!(session = %b.id, rounds, "session closed");
                Ok(Some(msg(server_message::Msg::Closed(Closed { rounds }))))
            }
            (None, Some(_)) => Err(Refusal::new(Reason::BadRequest, "empty client message")),
        }
    }

    async fn run_stream(self, identity: String, mut inbound: Streaming<ClientMessage>, tx: Out) {
        let mut bound: Option<Bound> = None;
        let mut shutdown = self.state.shutdown.clone();
        loop {
            if *shutdown.borrow() {
                let r = Refusal::new(
                    Reason::ShuttingDown,
                    "the verifier is shutting down; resume elsewhere or later",
                );
                let _ = tx.send(Err(r.to_status())).await;
                return;
            }
            let next = tokio::select! {
                _ = shutdown.changed() => continue,
                m = inbound.message() => m,
            };
            let m = match next {
                Ok(Some(m)) => m,
                Ok(None) => return, // device half-closed; the session stays for resume
                Err(_) => return,   // transport error (e.g. message too large): tonic reports it
            };
            let is_close = matches!(m.msg, Some(client_message::Msg::Close(_)));
            match self.handle(&identity, &mut bound, m).await {
                Ok(Some(out)) => {
                    if tx.send(Ok(out)).await.is_err() {
                        return;
                    }
                    if is_close {
                        return;
                    }
                }
                Ok(None) => {}
                Err(r) => {
                    self.state.metrics.error(r.reason.as_str_name());
                    let sid = bound.as_ref().map(|b| b.id.as_str()).unwrap_or("-");
                    tracing::info!(session = %sid, reason = r.reason.as_str_name(), "request refused");
                    let _ = tx.send(Err(r.to_status())).await;
                    return;
                }
            }
        }
    }
}

#[tonic::async_trait]
impl Verifier for VerifierService {
    type SessionStream =
        Pin<Box<dyn tokio_stream::Stream<Item = Result<ServerMessage, Status>> + Send + 'static>>;

    async fn session(
        &self,
        req: Request<Streaming<ClientMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let identity = match self.state.authenticate(req.metadata()) {
            Ok(i) => i,
            Err(r) => {
                self.state.metrics.error(r.reason.as_str_name());
                return Err(r.to_status());
            }
        };
        let inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let span = tracing::info_span!("stream", device = %identity);
        tokio::spawn(
            self.clone()
                .run_stream(identity, inbound, tx)
                .instrument(span),
        );
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}
