//! [`EdgeRuntime`]: the speculative loop with a remote verifier, the offline
//! fallback, and the provisional check after an outage.
//!
//! Invariants of the loop (see `docs/edge.md`):
//! * `ctx` = prompt + every emitted token; the draft cache plus `pending` hold
//!   exactly `ctx` (pending = tokens the draft has not run yet, never empty).
//! * While a session stream is live and no provisional span is being checked, the
//!   verifier holds `ctx` too (its `last` is `ctx`'s last token).

use crate::breaker::{BreakerState, CircuitBreaker, OpenCost, RttTracker};
use crate::client::{Connector, Counters, NetError, OpenDeadlines, Stream};
use crate::config::EdgeConfig;
use crate::conversation::{common_prefix, ConversationCache, ConversationStats, Kept, KeptSession};
use crate::error::EdgeError;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tandem_model::kv_cache::KvCache;
use tandem_model::proposer::ProposerKind;
use tandem_model::qwen2::Qwen2Model;
use tandem_model::sampling::{
    apply_repetition_penalty, argmax, distribution, token_prob, top_k_truncate, Distribution,
    Sampler, SamplingParams,
};
use tandem_model::speculative::{GenerateConfig, StopReason};
use tandem_model::tokenizer::Tokenizer;
use tandem_proto::v1::{
    self as pb, client_message::Msg as Cm, server_message::Msg as Sm, ClientMessage,
};

// Adaptive k, pipelined drafting, target streaming: a child module, so it works on
// `Run`/`Net` directly (see `crate::adaptive`).
#[path = "pipeline.rs"]
mod pipeline;
// Uncertainty-gated verification (`[gate]`), the same way.
#[path = "gate.rs"]
mod gate;

/// Where an emitted token came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenStatus {
    /// Came through a verdict of the verifier (greedy: the target's own token).
    Verified,
    /// Drafted on the device alone while the verifier was unreachable.
    Provisional,
    /// The whole request ran on the device (no verifier, or the router said so).
    Local,
}

/// The verifier's judgement of one provisional span, after it came back.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProvisionalCheck {
    /// Output positions `start..end` were provisional.
    pub start: usize,
    pub end: usize,
    /// Output positions where the target (given the streamed tokens before it)
    /// would have chosen a different token. Empty in sampled mode, where spans
    /// are not checked (see `checked`).
    pub mismatches: Vec<usize>,
    /// False when the span was not checked (sampled mode).
    pub checked: bool,
}

/// Summary of every provisional span of a generation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProvisionalReport {
    pub provisional_tokens: usize,
    /// Provisional tokens the verifier has checked.
    pub checked_tokens: usize,
    pub mismatched_tokens: usize,
    /// First output position that differs from what the target would have produced.
    pub first_mismatch: Option<usize>,
    pub spans: Vec<ProvisionalCheck>,
}

/// What the runtime reports while generating.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EdgeEvent {
    /// Output token number `index` (0-based), final as emitted.
    Token {
        index: usize,
        id: u32,
        status: TokenStatus,
    },
    /// The verifier came back and judged a provisional span.
    ProvisionalChecked(ProvisionalCheck),
}

/// Statistics of one generation.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EdgeStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub verified_tokens: usize,
    pub provisional_tokens: usize,
    pub local_tokens: usize,
    /// Speculative rounds answered by a verdict.
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// accepted / drafted.
    pub acceptance_rate: f64,
    /// Mean accepted draft tokens per round.
    pub mean_accepted_len: f64,
    /// Verify-only rounds over provisional spans (+ Resumes they needed).
    pub check_rounds: u64,
    /// Verify round trips of this generation.
    pub rtt_mean_ms: f64,
    pub rtt_p95_ms: f64,
    /// Encoded protobuf bytes (prost `encoded_len`) sent / received.
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Target forward passes the verifier ran for this generation: prefills
    /// (Open/Resume) + verify rounds.
    pub verifier_passes: u64,
    pub verifier_passes_per_token: f64,
    pub draft_forwards: u64,
    /// Sessions opened (the first one plus every resume).
    pub opens: u64,
    /// Opens started in the background after a failure (the device drafted
    /// alone, provisional, while they were in flight).
    #[serde(default)]
    pub background_opens: u64,
    /// Streams that broke after they had worked and were re-opened at once, in
    /// the foreground, before the device drafted alone (a load balancer re-homes
    /// such a re-open to another verifier replica; docs/edge.md).
    #[serde(default)]
    pub immediate_reopens: u64,
    /// Drafted blocks shown as provisional without a round trip (`[gate]`),
    /// and their tokens.
    #[serde(default)]
    pub gated_rounds: u64,
    #[serde(default)]
    pub gated_tokens: u64,
    /// SESSION_EVICTED / SESSION_UNKNOWN answers that made the device resend.
    pub resends: u64,
    pub timeouts: u64,
    pub failures: u64,
    pub breaker_opens: u64,
    /// Prompt tokens whose draft KV came from the conversation cache, and the
    /// prompt tokens the draft prefilled (the rest).
    #[serde(default)]
    pub draft_reused_tokens: usize,
    #[serde(default)]
    pub draft_prefill_tokens: usize,
    /// Context positions the verifier reused from a kept or resumed session,
    /// and the positions it prefilled, summed over this generation's opens.
    #[serde(default)]
    pub verifier_reused_tokens: u64,
    #[serde(default)]
    pub verifier_prefill_tokens: u64,
    /// The verifier session was continued from an earlier turn (only the new
    /// tokens went up).
    #[serde(default)]
    pub continued_session: bool,
    /// Messages the context policy dropped from the start of the conversation
    /// (`drop_oldest`; set by the chat front ends, 0 otherwise).
    #[serde(default)]
    pub dropped_messages: usize,
    pub ttft_ms: f64,
    pub total_ms: f64,
    pub tokens_per_s: f64,
    /// Split execution (when configured): s, format, per-round times, prediction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<crate::split::SplitReport>,
    /// What the device state changed for this generation (draft threads, k
    /// cap; read once at its start: `crate::device`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<crate::device::DeviceAdjustments>,
}

/// The result of [`EdgeRuntime::generate`].
#[derive(Clone, Debug)]
pub struct EdgeGeneration {
    pub tokens: Vec<u32>,
    pub statuses: Vec<TokenStatus>,
    pub stop: StopReason,
    pub stats: EdgeStats,
    pub provisional: ProvisionalReport,
    /// The verifier's session id (last one), if any session was opened.
    pub session_id: Option<String>,
}

/// The device runtime: draft model + verifier client + breaker. Reuse one runtime
/// for many generations (the breaker and RTT history carry over).
pub struct EdgeRuntime {
    draft: Arc<Qwen2Model>,
    cfg: EdgeConfig,
    fingerprint: String,
    connector: Option<Connector>,
    rt: tokio::runtime::Runtime,
    breaker: Arc<Mutex<CircuitBreaker>>,
    rtt: RttTracker,
    open_cost: OpenCost,
    probe: Option<tokio::task::JoinHandle<()>>,
    spec: crate::adaptive::SpecState,
    split: Option<crate::split::SplitExec>,
    conversations: ConversationCache,
    /// What the app reports about the device (any thread may set it).
    device: crate::device::SharedDeviceState,
    draft_pools: crate::device::DraftPools,
    /// How long the warm-up forward at load took (`EdgeConfig::warmup`).
    warmup_ms: Option<f64>,
}

impl Drop for EdgeRuntime {
    fn drop(&mut self) {
        if let Some(p) = self.probe.take() {
            p.abort();
        }
    }
}

fn lock(b: &Mutex<CircuitBreaker>) -> MutexGuard<'_, CircuitBreaker> {
    // A panic while holding this lock cannot leave the breaker inconsistent.
    b.lock().unwrap_or_else(|p| p.into_inner())
}

fn to_pb_sampling(p: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k as u32,
        top_p: p.top_p,
        repetition_penalty: p.repetition_penalty,
        seed: p.seed,
    }
}

impl EdgeRuntime {
    /// A runtime around a loaded draft model (callers go through
    /// [`EdgeRuntime::builder`]). The tokenizer fingerprint comes from the
    /// draft GGUF (draft and target share the tokenizer) unless the config
    /// overrides it. `split_target` is the target model whose first layers the
    /// device runs: required by `[split]`, refused without it.
    pub(crate) fn new(
        draft: Arc<Qwen2Model>,
        cfg: EdgeConfig,
        split_target: Option<Arc<Qwen2Model>>,
    ) -> Result<Self, EdgeError> {
        cfg.validate()?;
        let split = match (cfg.split.clone(), split_target) {
            (Some(sc), Some(target)) => Some(crate::split::SplitExec::new(target, sc, cfg.k)?),
            (None, None) => None,
            (Some(_), None) => {
                return Err(EdgeError::Config(
                    "[split] is set, but no target model was given for the device's layers \
                     (split_target); give the target GGUF or remove [split]"
                        .into(),
                ))
            }
            (None, Some(_)) => {
                return Err(EdgeError::Config(
                    "a split target model was given, but the config has no [split]".into(),
                ))
            }
        };
        let fingerprint = match &cfg.tokenizer_fingerprint {
            Some(f) => f.clone(),
            None => match Tokenizer::from_gguf(draft.gguf()) {
                Ok(t) => t.fingerprint(),
                Err(e) if cfg.verifier_url.is_some() => {
                    return Err(EdgeError::Config(format!(
                        "the draft GGUF has no tokenizer ({e}); set tokenizer_fingerprint"
                    )))
                }
                Err(_) => String::new(),
            },
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tandem-edge-io")
            .enable_all()
            .build()
            .map_err(|e| EdgeError::Runtime(e.to_string()))?;
        let connector = match &cfg.verifier_url {
            Some(url) => {
                let _g = rt.enter();
                Some(Connector::new(&cfg, url)?)
            }
            None => None,
        };
        let warmup_ms = if cfg.warmup {
            Some(warm_up(&draft)?)
        } else {
            None
        };
        Ok(Self {
            device: Default::default(),
            draft_pools: Default::default(),
            warmup_ms,
            breaker: Arc::new(Mutex::new(CircuitBreaker::new(cfg.breaker_failures))),
            spec: crate::adaptive::SpecState::new(&cfg.speculation),
            split,
            conversations: ConversationCache::new(&cfg.conversations),
            draft,
            cfg,
            fingerprint,
            connector,
            rt,
            rtt: RttTracker::default(),
            open_cost: OpenCost::default(),
            probe: None,
        })
    }

    pub fn config(&self) -> &EdgeConfig {
        &self.cfg
    }

    /// Reports the device's state (thermal, battery, power save); it applies
    /// from the next generation on (`crate::device`). Refused (and nothing
    /// changed) for a battery level over 100 %.
    pub fn set_device_state(&self, state: crate::device::DeviceState) -> Result<(), EdgeError> {
        self.device.set(state)
    }

    pub fn device_state(&self) -> crate::device::DeviceState {
        self.device.get()
    }

    /// A handle to set the device state from another thread (e.g. the app's
    /// thermal listener, or an admin API) while this runtime generates.
    pub fn device_handle(&self) -> crate::device::SharedDeviceState {
        self.device.clone()
    }

    /// The adjustments a generation started now would run with.
    pub fn device_adjustments(&self) -> crate::device::DeviceAdjustments {
        self.device.adjustments()
    }

    /// How long the warm-up forward at load took (ms), when `warmup` is on.
    pub fn warmup_ms(&self) -> Option<f64> {
        self.warmup_ms
    }

    /// Reads the device state once for a generation: its adjustments and the
    /// guard that runs this thread's draft forwards on the chosen number of
    /// threads until the generation ends.
    fn device_begin(
        &mut self,
    ) -> Result<
        (
            crate::device::DeviceAdjustments,
            Option<tandem_model::forward_threads::ForwardPoolGuard>,
        ),
        EdgeError,
    > {
        let base = tandem_model::forward_threads::current();
        let mut adj = crate::device::adjustments(&self.device.get(), base);
        let guard = self
            .draft_pools
            .get(adj.draft_threads, base)?
            .map(tandem_model::forward_threads::use_pool);
        // What the draft's forwards will really use.
        adj.draft_threads = tandem_model::forward_threads::current();
        if !adj.reasons.is_empty() {
            tracing::debug!(
                threads = adj.draft_threads,
                k_cap = ?adj.k_cap,
                reasons = ?adj.reasons,
                "device state adjusts this generation"
            );
        }
        Ok((adj, guard))
    }

    pub fn breaker_state(&self) -> BreakerState {
        lock(&self.breaker).state()
    }

    /// RTT samples of recent verifies (across generations), for the router.
    pub fn rtt(&self) -> &RttTracker {
        &self.rtt
    }

    /// Generates with the draft alone; every token is [`TokenStatus::Local`]
    /// (nothing leaves the device).
    pub fn generate_local(
        &mut self,
        prompt: &[u32],
        gen: &GenerateConfig,
        on_event: &mut dyn FnMut(&EdgeEvent) -> bool,
    ) -> Result<EdgeGeneration, EdgeError> {
        self.generate_local_in(None, prompt, gen, on_event)
    }

    /// [`Self::generate_local`] as a turn of `conversation` (see
    /// [`Self::generate_in`]).
    pub fn generate_local_in(
        &mut self,
        conversation: Option<&str>,
        prompt: &[u32],
        gen: &GenerateConfig,
        on_event: &mut dyn FnMut(&EdgeEvent) -> bool,
    ) -> Result<EdgeGeneration, EdgeError> {
        let (device, _threads) = self.device_begin()?;
        let mut run = Run::begin(
            &self.draft,
            &mut self.conversations,
            conversation,
            prompt,
            gen,
            on_event,
        )?;
        let mut res = Ok(());
        while run.stop.is_none() && res.is_ok() {
            res = run.draft_alone(TokenStatus::Local);
        }
        res?;
        // The verifier session of an earlier turn (if any) stays kept.
        let session = run.continuation.take();
        self.conversations.put(conversation, run.take_kept(session));
        let mut g = run.finish(None, &RttTracker::default(), Counters::default());
        g.stats.device = Some(device);
        Ok(g)
    }

    /// Speculative generation against the verifier (or local when none is
    /// configured). `on_event` returns false to cancel. With `[conversations]`
    /// on (the default) the draft KV of the context is kept afterwards and a
    /// later request that continues it prefills only what is new (see
    /// [`crate::conversation`]).
    pub fn generate(
        &mut self,
        prompt: &[u32],
        gen: &GenerateConfig,
        on_event: &mut dyn FnMut(&EdgeEvent) -> bool,
    ) -> Result<EdgeGeneration, EdgeError> {
        self.generate_in(None, prompt, gen, on_event)
    }

    /// Most tokens a context may have on this device (the draft's KV capacity).
    pub fn context_limit(&self) -> usize {
        self.draft.max_seq_len()
    }

    /// What the conversation cache holds now.
    pub fn conversation_stats(&self) -> ConversationStats {
        self.conversations.stats()
    }

    /// Drops a named conversation's kept state (its verifier session expires
    /// by the verifier's idle TTL); false when there was none.
    pub fn forget_conversation(&mut self, conversation: &str) -> bool {
        self.conversations.forget(conversation)
    }

    /// [`Self::generate`] as one turn of the conversation named
    /// `conversation`: its kept state is used whatever the prompt shares with
    /// it (the longest common prefix is reused, exactly), and the turn's state
    /// is kept under that name. `None`: an anonymous request, matched to kept
    /// state by its prompt.
    pub fn generate_in(
        &mut self,
        conversation: Option<&str>,
        prompt: &[u32],
        gen: &GenerateConfig,
        on_event: &mut dyn FnMut(&EdgeEvent) -> bool,
    ) -> Result<EdgeGeneration, EdgeError> {
        if gen.proposer != ProposerKind::Draft {
            // Until the round loop takes a proposer (issue 21), say so rather
            // than silently drafting with the model.
            return Err(EdgeError::Model(tandem_model::ModelError::InvalidArgument(
                format!(
                    "proposer {} is not supported by the edge runtime yet (only draft)",
                    gen.proposer
                ),
            )));
        }
        let Some(connector) = self.connector.clone() else {
            return self.generate_local_in(conversation, prompt, gen, on_event);
        };
        // The device state, read once: fewer draft threads, a k cap.
        let (device, _threads) = self.device_begin()?;
        let k_cap = device
            .k_cap
            .unwrap_or(tandem_model::speculative::MAX_K)
            .max(1);
        let capped;
        let gen = if gen.k > k_cap {
            capped = GenerateConfig {
                k: k_cap,
                ..gen.clone()
            };
            &capped
        } else {
            gen
        };
        let mut run = Run::begin(
            &self.draft,
            &mut self.conversations,
            conversation,
            prompt,
            gen,
            on_event,
        )?;
        // A kept verifier session is continued (not in split sessions, which
        // send hidden states of their whole context).
        let split_on = self.split.is_some();
        let continuation = run.continuation.take().filter(|_| !split_on);
        let session_key = continuation
            .as_ref()
            .map(|k| k.affinity_key.clone())
            .unwrap_or_else(crate::client::new_session_key);
        run.want_conf = self.cfg.gate.enabled() && gen.sampling.is_greedy();
        let mut net = Net {
            cfg: &self.cfg,
            fingerprint: &self.fingerprint,
            connector,
            rt: &self.rt,
            breaker: &self.breaker,
            rtt: &mut self.rtt,
            open_cost: &mut self.open_cost,
            opening: None,
            retry_at: None,
            // A breaker left open by an earlier generation: the verifier was
            // unreachable, so do not wait for the next open either.
            outage: lock(&self.breaker).state() != BreakerState::Closed,
            probe: &mut self.probe,
            gen_rtt: RttTracker::default(),
            counters: Counters::default(),
            stream: None,
            session_id: None,
            session_key,
            continuation,
            reopen_now: true,
            live: false,
            round: 0,
            max_block: gen.k.min(tandem_model::speculative::MAX_K),
            k_cap,
            resends_in_a_row: 0,
            spec: self.spec.begin(),
            split: self.split.as_mut(),
        };
        let res = net.drive(&mut run);
        if let Some(op) = net.opening.take() {
            // The generation ended while a re-open was in flight: drop it. The
            // verifier does not free what that open made: it keeps the session
            // for a resume until its idle TTL or an eviction, and prefills an
            // Open even after its stream went away (docs/verifier.md "Fault
            // soak": under load, re-opens that never finish keep a fleet
            // provisional).
            op.task.abort();
        }
        // Keep the verifier's session for the next turn when its context is
        // known (the stream is live and no provisional span is unchecked: the
        // verifier then holds the device's context, possibly plus a stop token
        // the device did not show); otherwise free its KV cache.
        let keep_session = self.cfg.conversations.enabled
            && self.cfg.conversations.keep_verifier_sessions
            && !split_on
            && res.is_ok()
            && run.check.is_none();
        let mut kept_session = None;
        if let Some(mut s) = net.stream.take() {
            // An error here changes nothing: the verifier's idle TTL frees it.
            let c = &mut net.counters;
            let close = Cm::Close(pb::Close { keep: keep_session });
            let closed = self
                .rt
                .block_on(s.exchange(close, Duration::from_secs(1), c));
            if let (true, Ok((Sm::Closed(_), _)), Some(id)) =
                (keep_session, closed, net.session_id.clone())
            {
                kept_session = Some(KeptSession {
                    id,
                    context: run.ctx.clone(),
                    affinity_key: net.session_key.clone(),
                });
            }
        }
        let (gen_rtt, counters, sid) = (net.gen_rtt, net.counters, net.session_id);
        // (After an error the draft KV may be half-written: not kept.)
        res?;
        self.conversations
            .put(conversation, run.take_kept(kept_session));
        let mut g = run.finish(sid, &gen_rtt, counters);
        g.stats.split = self.split.as_ref().map(|s| s.report.clone());
        g.stats.device = Some(device);
        Ok(g)
    }
}

/// Progress of checking a provisional span.
struct Check {
    start: usize,
    next: usize,
    mismatches: Vec<usize>,
}

/// One generation's device-side state.
struct Run<'a, 'b> {
    draft: &'a Qwen2Model,
    gen: &'a GenerateConfig,
    prompt_len: usize,
    ctx: Vec<u32>,
    statuses: Vec<TokenStatus>,
    cache: KvCache,
    pending: Vec<u32>,
    capacity: usize,
    rng: Sampler,
    stop: Option<StopReason>,
    on_event: &'a mut (dyn FnMut(&EdgeEvent) -> bool + 'b),
    stats: EdgeStats,
    report: ProvisionalReport,
    check: Option<Check>,
    /// The open `check` is a gated span (verified with the next block sent).
    gated: bool,
    /// Compute `conf` in greedy drafting (gating is on).
    want_conf: bool,
    /// The draft's top-1 probability of its last greedy token (`want_conf`).
    conf: f32,
    start: Instant,
    first: Option<Instant>,
    /// The verifier session a kept conversation left (taken by `generate`).
    continuation: Option<KeptSession>,
    /// Most positions `cache` has held (for the conversation cache's budget).
    high_water: usize,
}

impl<'a, 'b> Run<'a, 'b> {
    /// A generation of `prompt` as a turn of `conversation`: takes its kept
    /// state from `conversations` (which gives none when disabled) and puts
    /// it back when the request is refused, so a refusal loses nothing.
    fn begin(
        draft: &'a Qwen2Model,
        conversations: &mut ConversationCache,
        conversation: Option<&str>,
        prompt: &[u32],
        gen: &'a GenerateConfig,
        on_event: &'a mut (dyn FnMut(&EdgeEvent) -> bool + 'b),
    ) -> Result<Self, EdgeError> {
        let mut kept = conversations.take(conversation, prompt);
        Self::new(draft, prompt, gen, on_event, &mut kept).inspect_err(|_| {
            if let Some(k) = kept.take() {
                conversations.put(conversation, k);
            }
        })
    }

    /// A generation of `prompt`; with `kept` (a conversation's earlier turn)
    /// its draft KV is reused for the longest common prefix, exactly. `kept`
    /// is taken only once the request is valid (a refused request leaves the
    /// conversation's state where it was).
    fn new(
        draft: &'a Qwen2Model,
        prompt: &[u32],
        gen: &'a GenerateConfig,
        on_event: &'a mut (dyn FnMut(&EdgeEvent) -> bool + 'b),
        kept: &mut Option<Kept>,
    ) -> Result<Self, EdgeError> {
        gen.validate()?;
        let capacity = draft.max_seq_len();
        if prompt.is_empty() {
            return Err(EdgeError::Model(tandem_model::ModelError::InvalidArgument(
                "the prompt is empty".into(),
            )));
        }
        if prompt.len() >= capacity {
            return Err(EdgeError::Model(
                tandem_model::ModelError::SequenceTooLong {
                    needed: prompt.len() + 1,
                    capacity,
                },
            ));
        }
        // The draft's KV in the generation's precision (`draft_kv`, INT8 by
        // default: it changes acceptance only, never a verified token).
        let fresh = draft.new_cache_with(gen.draft_kv);
        let (mut cache, reuse, continuation, high_water) = match kept.take() {
            Some(k)
                if k.cache.capacity() == fresh.capacity()
                    && k.cache.precision() == fresh.precision() =>
            {
                // Keep at least the prompt's last token to run (its logits).
                let reuse = common_prefix(&k.tokens, prompt)
                    .min(k.cache.len())
                    .min(prompt.len().saturating_sub(1));
                (k.cache, reuse, k.session, k.high_water)
            }
            Some(k) => (fresh, 0, k.session, 0),
            None => (fresh, 0, None, 0),
        };
        cache.truncate(reuse);
        let stop = (gen.max_tokens == 0).then_some(StopReason::MaxTokens);
        Ok(Self {
            draft,
            gen,
            prompt_len: prompt.len(),
            ctx: prompt.to_vec(),
            statuses: Vec::new(),
            cache,
            pending: prompt[reuse..].to_vec(),
            capacity,
            rng: Sampler::from_params(&gen.sampling),
            stop,
            on_event,
            stats: EdgeStats {
                prompt_tokens: prompt.len(),
                draft_reused_tokens: reuse,
                draft_prefill_tokens: prompt.len() - reuse,
                ..EdgeStats::default()
            },
            report: ProvisionalReport::default(),
            check: None,
            gated: false,
            want_conf: false,
            conf: 1.0,
            start: Instant::now(),
            first: None,
            continuation,
            high_water,
        })
    }

    /// The state this turn leaves for the conversation's next one: the draft
    /// KV, cut to the context (a stop token or a cancelled block may have run
    /// past it), and the context.
    fn take_kept(&mut self, session: Option<KeptSession>) -> Kept {
        let mut cache = std::mem::replace(&mut self.cache, KvCache::new(0, 0, 0, 0));
        let high_water = self.high_water.max(cache.len());
        cache.truncate(cache.len().min(self.ctx.len()));
        Kept {
            cache,
            tokens: self.ctx.clone(),
            session,
            high_water,
        }
    }

    fn out_len(&self) -> usize {
        self.ctx.len() - self.prompt_len
    }

    fn out(&self) -> &[u32] {
        &self.ctx[self.prompt_len..]
    }

    /// Emits one token (already in the draft's view via `pending` by the caller);
    /// false when generation must end.
    fn emit(&mut self, t: u32, status: TokenStatus) -> bool {
        if self.stop.is_some() {
            return false;
        }
        self.first.get_or_insert_with(Instant::now);
        if self.gen.stop_tokens.contains(&t) {
            self.stop = Some(StopReason::Stop);
            return false;
        }
        self.ctx.push(t);
        self.statuses.push(status);
        let index = self.out_len() - 1;
        if !(self.on_event)(&EdgeEvent::Token {
            index,
            id: t,
            status,
        }) {
            self.stop = Some(StopReason::Cancelled);
            return false;
        }
        if self.out_len() >= self.gen.max_tokens {
            self.stop = Some(StopReason::MaxTokens);
            return false;
        }
        if self.ctx.len() >= self.capacity {
            self.stop = Some(StopReason::ContextFull);
            return false;
        }
        true
    }

    /// Runs the draft over `pending`; returns its next token (and, sampled, the
    /// top-k distribution it was drawn from). Leaves `pending = [token]`.
    fn draft_next(&mut self, hist: &[u32]) -> Result<(u32, Option<Distribution>), EdgeError> {
        let pos = self.cache.len();
        let logits = self
            .draft
            .forward_last(&self.pending, pos, &mut self.cache)?;
        self.stats.draft_forwards += 1;
        self.high_water = self.high_water.max(self.cache.len());
        let params = &self.gen.sampling;
        let (t, q) = if params.is_greedy() {
            let mut l = logits;
            if params.repetition_penalty != 1.0 {
                apply_repetition_penalty(&mut l, hist, params.repetition_penalty);
            }
            let t = argmax(&l);
            if self.want_conf {
                self.conf = token_prob(&l, t);
            }
            (t, None)
        } else {
            let q = top_k_truncate(&distribution(params, &logits, hist), self.gen.draft_top_k);
            (self.rng.sample(&q), Some(q))
        };
        self.pending.clear();
        self.pending.push(t);
        Ok((t, q))
    }

    /// One token from the draft alone.
    fn draft_alone(&mut self, status: TokenStatus) -> Result<(), EdgeError> {
        let hist = self.ctx.clone();
        let (t, _) = self.draft_next(&hist)?;
        if status == TokenStatus::Provisional && self.check.is_none() {
            let n = self.out_len();
            self.check = Some(Check {
                start: n,
                next: n,
                mismatches: Vec::new(),
            });
        }
        self.emit(t, status);
        Ok(())
    }

    /// Applies a verdict: `n` of `drafted` (drafted from a context of
    /// `ctx_before` tokens; the draft cache holds ctx_before + a prefix of them,
    /// the rest is pending) are accepted, then the verifier's token `t`. Rolls
    /// the draft back to ctx_before + drafted[..n], queues `t`, and emits
    /// drafted[..n] and `t` as verified.
    fn accept(&mut self, ctx_before: usize, drafted: &[u32], n: usize, t: u32) {
        let keep = ctx_before + n;
        let cache_len = self.cache.len();
        if cache_len >= keep {
            self.cache.truncate(keep);
            self.pending.clear();
        } else {
            self.pending = drafted[cache_len.saturating_sub(ctx_before)..n].to_vec();
        }
        self.pending.push(t);
        for &x in &drafted[..n] {
            if !self.emit(x, TokenStatus::Verified) {
                return;
            }
        }
        self.emit(t, TokenStatus::Verified);
    }

    /// Undo a drafted block whose verdict never came: the draft holds `ctx`.
    fn rollback_unverified(&mut self) {
        let keep = self.ctx.len() - 1;
        self.cache.truncate(keep.min(self.cache.len()));
        if self.cache.len() < keep {
            // Cannot happen after drafting (the cache covered ctx), but stay exact.
            self.pending = self.ctx[self.cache.len()..].to_vec();
        } else {
            self.pending = vec![self.ctx[keep]];
        }
    }

    fn finish(
        mut self,
        session_id: Option<String>,
        gen_rtt: &RttTracker,
        counters: Counters,
    ) -> EdgeGeneration {
        let mut s = std::mem::take(&mut self.stats);
        let now = Instant::now();
        s.total_ms = (now - self.start).as_secs_f64() * 1000.0;
        if let Some(f) = self.first {
            s.ttft_ms = (f - self.start).as_secs_f64() * 1000.0;
        }
        s.generated_tokens = self.out_len();
        let count = |st| self.statuses.iter().filter(|&&x| x == st).count();
        s.verified_tokens = count(TokenStatus::Verified);
        s.provisional_tokens = count(TokenStatus::Provisional);
        s.local_tokens = count(TokenStatus::Local);
        if s.total_ms > 0.0 {
            s.tokens_per_s = s.generated_tokens as f64 / (s.total_ms / 1000.0);
        }
        if s.drafted > 0 {
            s.acceptance_rate = s.accepted as f64 / s.drafted as f64;
        }
        if s.rounds > 0 {
            s.mean_accepted_len = s.accepted as f64 / s.rounds as f64;
        }
        s.rtt_mean_ms = gen_rtt.mean_ms().unwrap_or(0.0);
        s.rtt_p95_ms = gen_rtt.p95_ms().unwrap_or(0.0);
        s.bytes_sent = counters.sent;
        s.bytes_received = counters.received;
        if s.generated_tokens > 0 {
            s.verifier_passes_per_token = s.verifier_passes as f64 / s.generated_tokens as f64;
        }
        // A span still unchecked at the end stays in the report as unchecked.
        if let Some(c) = self.check.take() {
            let end = self.out_len();
            self.report.checked_tokens += c.next - c.start;
            self.report.mismatched_tokens += c.mismatches.len();
            if self.report.first_mismatch.is_none() {
                self.report.first_mismatch = c.mismatches.first().copied();
            }
            self.report.spans.push(ProvisionalCheck {
                start: c.start,
                end,
                mismatches: c.mismatches,
                checked: false,
            });
        }
        self.report.provisional_tokens = s.provisional_tokens;
        let stop = self.stop.unwrap_or(StopReason::MaxTokens);
        EdgeGeneration {
            tokens: self.ctx[self.prompt_len..].to_vec(),
            statuses: self.statuses,
            stop,
            stats: s,
            provisional: self.report,
            session_id,
        }
    }

    /// Records a finished span check and tells the caller.
    fn complete_check(&mut self, c: Check, checked: bool) {
        let end = self.out_len();
        let span = ProvisionalCheck {
            start: c.start,
            end,
            mismatches: c.mismatches,
            checked,
        };
        if checked {
            self.report.checked_tokens += end - c.start;
        }
        self.report.mismatched_tokens += span.mismatches.len();
        if self.report.first_mismatch.is_none() {
            self.report.first_mismatch = span.mismatches.first().copied();
        }
        if !span.mismatches.is_empty() {
            tracing::warn!(
                start = span.start,
                end = span.end,
                mismatches = span.mismatches.len(),
                "provisional tokens differ from the verifier's"
            );
        }
        self.report.spans.push(span.clone());
        if !(self.on_event)(&EdgeEvent::ProvisionalChecked(span)) && self.stop.is_none() {
            self.stop = Some(StopReason::Cancelled);
        }
    }
}

/// The network side of one generation.
struct Net<'a> {
    cfg: &'a EdgeConfig,
    fingerprint: &'a str,
    connector: Connector,
    rt: &'a tokio::runtime::Runtime,
    breaker: &'a Arc<Mutex<CircuitBreaker>>,
    rtt: &'a mut RttTracker,
    open_cost: &'a mut OpenCost,
    /// A session open running in the background (after a failure) while the
    /// device drafts alone.
    opening: Option<Opening>,
    /// No new open before this instant (backoff after a failure); the device
    /// drafts alone meanwhile.
    retry_at: Option<Instant>,
    /// The last failure was a timeout or a broken link (not a busy verifier).
    outage: bool,
    probe: &'a mut Option<tokio::task::JoinHandle<()>>,
    gen_rtt: RttTracker,
    counters: Counters,
    stream: Option<Stream>,
    session_id: Option<String>,
    /// This generation's session-affinity key, sent on every stream
    /// ([`tandem_proto::SESSION_AFFINITY_HEADER`]).
    session_key: String,
    /// A verifier session kept by this conversation's earlier turn: the first
    /// open continues it (`Open.continuation`); taken by that open, so a
    /// refused continuation is followed by an open of the whole context.
    continuation: Option<KeptSession>,
    /// A stream that breaks may be re-opened once at once (set again by every
    /// success); see [`Net::fail`].
    reopen_now: bool,
    /// A stream is (or was, until the failure being handled) open.
    live: bool,
    round: u64,
    max_block: usize,
    /// Most drafts per round the device state allows (`crate::device`).
    k_cap: usize,
    resends_in_a_row: u32,
    spec: &'a mut crate::adaptive::SpecState,
    split: Option<&'a mut crate::split::SplitExec>,
}

type OpenResult = Result<(Stream, pb::ServerMessage, Duration), NetError>;

/// Positions a verifier's forward covers for a draft of `k` tokens: the last
/// committed token and the k drafts.
pub(crate) fn draft_positions(k: usize) -> usize {
    k + 1
}

/// A session open in flight on the I/O runtime.
struct Opening {
    task: tokio::task::JoinHandle<(OpenResult, Counters)>,
    /// The context length the Open carries (the verifier will hold `ctx[..upto]`).
    upto: usize,
}

/// Outcome of a network step.
enum Step {
    Ok,
    /// The stream is gone; the loop decides what next.
    Lost,
}

impl Net<'_> {
    fn drive(&mut self, run: &mut Run<'_, '_>) -> Result<(), EdgeError> {
        while run.stop.is_none() {
            if let Some(op) = self.opening.take() {
                if !op.task.is_finished() {
                    // The verifier is not (yet) reachable: keep generating alone.
                    self.opening = Some(op);
                    run.draft_alone(TokenStatus::Provisional)?;
                    continue;
                }
                let (r, c) = match self.rt.block_on(op.task) {
                    Ok(x) => x,
                    Err(e) => (
                        Err(NetError::Unavailable(format!("open task failed: {e}"))),
                        Counters::default(),
                    ),
                };
                self.counters.add(c);
                if let Step::Lost = self.opened(run, r, op.upto)? {
                    continue;
                }
                self.check_provisional(run)?;
                continue;
            }
            let allowed = lock(self.breaker).allows_request();
            if !allowed {
                run.draft_alone(TokenStatus::Provisional)?;
                continue;
            }
            if self.stream.is_none() {
                if self.open_in_background() {
                    if self.retry_at.is_some_and(|t| Instant::now() < t) {
                        run.draft_alone(TokenStatus::Provisional)?;
                    } else {
                        self.retry_at = None;
                        self.spawn_open(run)?;
                    }
                    continue;
                }
                if let Step::Lost = self.open(run)? {
                    continue;
                }
                if let Step::Lost = self.check_provisional(run)? {
                    continue;
                }
                continue;
            }
            if run.want_conf && self.split.is_none() {
                self.gated_round(run)?;
            } else if self.spec.active() && self.split.is_none() {
                self.round_trip_spec(run)?;
            } else {
                self.round_trip(run)?;
            }
        }
        // Gated tokens still waiting at the end: verify them now (one pass), so
        // the report says whether they were right (not after a cancel: nobody
        // is listening).
        let cancelled = run.stop == Some(StopReason::Cancelled);
        if run.gated && run.check.is_some() && self.stream.is_some() && !cancelled {
            self.check_provisional(run)?;
        }
        Ok(())
    }

    /// After a failure the device does not wait for a session: it opens one in
    /// the background and drafts alone (provisional) until it is there. Split
    /// sessions always open in the foreground (the device's layers would have
    /// to follow the provisional tokens).
    fn open_in_background(&self) -> bool {
        self.outage && self.split.is_none() && lock(self.breaker).consecutive_failures() > 0
    }

    /// Deadlines of the next open of a context of `ctx_len` tokens. The headers
    /// come after about one round trip on a live link; `Opened` after the
    /// prefill, estimated from the measured cost of earlier opens of this
    /// runtime scaled by the context (none measured yet: `open_timeout_ms`).
    /// Both double with every consecutive failure (a slow verifier is
    /// eventually waited for), within `open_timeout_ms`.
    fn open_deadlines(&self, ctx_len: usize) -> OpenDeadlines {
        let c = self.cfg;
        let total = c.open_timeout();
        let fails = lock(self.breaker).consecutive_failures();
        let scale = f64::from(1u32 << fails.clamp(1, 5).saturating_sub(1));
        let headers = (c.connect_timeout() + self.deadline(1)).mul_f64(scale);
        let opened = match self.open_cost.estimate(ctx_len) {
            Some(est) => {
                let rtt = Duration::from_secs_f64(self.rtt.p95_ms().unwrap_or(0.0) / 1000.0);
                (est + rtt)
                    .mul_f64(c.deadline_factor)
                    .max(Duration::from_millis(c.deadline_floor_ms))
                    .mul_f64(scale)
            }
            _ => total,
        };
        OpenDeadlines {
            headers: headers.min(total),
            opened: opened.min(total),
            total,
        }
    }

    /// Deadline of an exchange whose verifier forward covers `positions` tokens
    /// (a draft of k: k + 1).
    fn deadline(&self, positions: usize) -> Duration {
        let c = self.cfg;
        self.rtt.deadline(
            positions,
            Duration::from_millis(c.deadline_initial_ms),
            Duration::from_millis(c.deadline_floor_ms),
            c.deadline_factor,
            Duration::from_millis(c.deadline_max_ms),
        )
    }

    /// Reacts to a failed exchange; Err only for fatal conditions.
    fn fail(&mut self, run: &mut Run<'_, '_>, e: NetError) -> Result<Step, EdgeError> {
        // The failure came from an opened stream (not from an open); pipelined
        // exchanges hold the stream elsewhere, so this is tracked on its own.
        let was_live = std::mem::take(&mut self.live);
        self.stream = None;
        tracing::debug!(error = %e, session = ?self.session_id, "verifier exchange failed");
        // A live stream that broke (reset, ended; not a timeout): the link to
        // the verifier's address often still works and only what was behind it
        // went away (a verifier replica behind a load balancer, which sends the
        // re-open to another replica). Re-open once at once, in the foreground,
        // before counting a failure and drafting alone. A refused or failing
        // re-open then takes the usual path below.
        if was_live && self.reopen_now && matches!(e, NetError::Unavailable(_)) {
            self.reopen_now = false;
            self.outage = false;
            run.stats.immediate_reopens += 1;
            tracing::info!(error = %e, session = ?self.session_id, "session stream broke: re-opening at once");
            return Ok(Step::Lost);
        }
        // Only a silent or broken link makes the next open a background one; a
        // verifier that answers (busy, evicting) is retried in the foreground.
        let outage = matches!(e, NetError::Timeout | NetError::Unavailable(_));
        match e {
            NetError::Fatal(e) => return Err(e),
            NetError::ContextFull => {
                run.stop.get_or_insert(StopReason::ContextFull);
                return Ok(Step::Lost);
            }
            NetError::Resend(_) if self.resends_in_a_row < 3 => {
                self.resends_in_a_row += 1;
                run.stats.resends += 1;
                return Ok(Step::Lost);
            }
            NetError::Timeout => run.stats.timeouts += 1,
            NetError::Resend(_) | NetError::Unavailable(_) | NetError::Busy(_) => {}
        }

        run.stats.failures += 1;
        self.outage = outage;
        let (opened, attempt) = {
            let mut b = lock(self.breaker);
            (b.on_failure(), b.consecutive_failures())
        };
        if opened {
            run.stats.breaker_opens += 1;
            tracing::warn!(session = ?self.session_id, "verifier unreachable: circuit breaker open, drafting alone");
            self.start_probe();
        } else if lock(self.breaker).state() == BreakerState::Closed {
            if self.open_in_background() {
                // The device drafts alone until then (see `drive`).
                self.retry_at = Some(Instant::now() + self.cfg.backoff(attempt));
            } else {
                std::thread::sleep(self.cfg.backoff(attempt));
            }
        }
        Ok(Step::Lost)
    }

    fn start_probe(&mut self) {
        if let Some(p) = self.probe.take() {
            p.abort();
        }
        let (b, c) = (self.breaker.clone(), self.connector.clone());
        let (every, timeout) = (self.cfg.probe_interval(), self.cfg.probe_timeout());
        *self.probe = Some(self.rt.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if c.probe(timeout).await {
                    lock(&b).probe_succeeded();
                    tracing::info!("verifier healthy again: circuit breaker half-open");
                    return;
                }
            }
        }));
    }

    fn success(&mut self) {
        self.outage = false;
        self.reopen_now = true;
        lock(self.breaker).on_success();
        self.resends_in_a_row = 0;
    }

    /// The Open (or resume) carrying the context the verifier must hold, and that
    /// context's length.
    fn open_message(&mut self, run: &mut Run<'_, '_>) -> Result<(ClientMessage, usize), EdgeError> {
        let greedy = run.gen.sampling.is_greedy();
        if !greedy || self.split.is_some() {
            // Sampled mode and split sessions: provisional spans are not checked;
            // send everything.
            if let Some(c) = run.check.take() {
                run.complete_check(c, false);
            }
        }
        let upto = match &run.check {
            Some(c) => run.prompt_len + c.next,
            None => run.ctx.len(),
        };
        let mut open = pb::Open {
            model_id: self.cfg.model_id.clone(),
            tokenizer_fingerprint: self.fingerprint.to_owned(),
            prompt_tokens: run.ctx[..upto].to_vec(),
            sampling: Some(to_pb_sampling(&run.gen.sampling)),
            resume_session_id: self.session_id.clone(),
            first_round: self.round,
            ..pb::Open::default()
        };
        // A conversation's kept session: send only what follows the prefix
        // both sides hold (at least the last token). Taken here, so a refusal
        // (CONTEXT_NOT_HELD) is followed by an open of the whole context.
        if let Some(kept) = self.continuation.take().filter(|_| self.split.is_none()) {
            let ctx = &run.ctx[..upto];
            let prefix = common_prefix(&kept.context, ctx).min(upto.saturating_sub(1));
            if prefix > 0 {
                open.prompt_tokens = ctx[prefix..].to_vec();
                open.resume_session_id = None;
                open.continuation = Some(pb::Continuation {
                    session_id: kept.id.clone(),
                    prefix_len: prefix as u64,
                    prefix_sha256: tandem_proto::context_digest(&ctx[..prefix]).to_vec(),
                });
                self.session_id = Some(kept.id);
            }
        }
        let open = match self.split.as_deref_mut() {
            Some(sp) => sp.open_message(&run.ctx[..upto], &run.gen.sampling, open)?,
            None => open,
        };
        let msg = ClientMessage {
            msg: Some(Cm::Open(open)),
        };
        Ok((msg, upto))
    }

    /// Opens (or resumes) the session and waits for it.
    fn open(&mut self, run: &mut Run<'_, '_>) -> Result<Step, EdgeError> {
        let (msg, upto) = self.open_message(run)?;
        let d = self.open_deadlines(upto);
        let r =
            self.rt.block_on(
                self.connector
                    .open(msg, &self.session_key, d, &mut self.counters),
            );
        self.opened(run, r, upto)
    }

    /// Starts opening the session on the I/O runtime; `drive` drafts alone until
    /// it completes.
    fn spawn_open(&mut self, run: &mut Run<'_, '_>) -> Result<(), EdgeError> {
        let (msg, upto) = self.open_message(run)?;
        let d = self.open_deadlines(upto);
        let connector = self.connector.clone();
        let key = self.session_key.clone();
        let task = self.rt.spawn(async move {
            let mut c = Counters::default();
            let r = connector.open(msg, &key, d, &mut c).await;
            (r, c)
        });
        run.stats.background_opens += 1;
        tracing::debug!(session = ?self.session_id, context = upto, ?d, "re-opening in the background");
        self.opening = Some(Opening { task, upto });
        Ok(())
    }

    /// Applies the answer to an Open of `ctx[..upto]`.
    fn opened(
        &mut self,
        run: &mut Run<'_, '_>,
        r: OpenResult,
        upto: usize,
    ) -> Result<Step, EdgeError> {
        match r {
            Ok((
                stream,
                pb::ServerMessage {
                    msg: Some(Sm::Opened(o)),
                },
                after_headers,
            )) => {
                if o.context_len != upto as u64 {
                    return Err(EdgeError::Protocol(format!(
                        "Opened.context_len {} != {upto}",
                        o.context_len
                    )));
                }
                if let Some(sp) = self.split.as_deref() {
                    sp.check_opened(&o)?;
                }
                // Not a success for the breaker yet: a verifier that opens sessions
                // but never answers a verify must still trip it. The first verdict
                // closes it.
                run.stats.opens += 1;
                run.stats.verifier_passes += 1;
                let positions = (upto as u64).saturating_sub(1);
                let reused = o.reused_tokens.min(positions);
                let prefilled = positions - reused;
                run.stats.verifier_reused_tokens =
                    run.stats.verifier_reused_tokens.saturating_add(reused);
                run.stats.verifier_prefill_tokens =
                    run.stats.verifier_prefill_tokens.saturating_add(prefilled);
                if run.stats.opens == 1 && o.resumed {
                    // The first open of a turn resumed: a kept session.
                    run.stats.continued_session = true;
                }
                // The open's cost per position it prefilled (a continued
                // session's cheap open must not shorten a later full open's
                // deadline).
                let prefilled = usize::try_from(prefilled).unwrap_or(upto);
                self.open_cost
                    .record(prefilled.saturating_add(1), after_headers);
                self.max_block = (o.max_block as usize)
                    .clamp(1, tandem_model::speculative::MAX_K)
                    .min(self.k_cap);
                if o.max_prompt_tokens > 0 {
                    run.capacity = run.capacity.min(o.max_prompt_tokens as usize);
                }
                tracing::debug!(session = %o.session_id, resumed = o.resumed, "session open");
                self.session_id = Some(o.session_id);
                self.stream = Some(stream);
                self.live = true;
                if upto < run.ctx.len() {
                    // Opened in the background while the device drafted alone.
                    // Greedy: `check_provisional` verifies those tokens from
                    // `upto` on. Otherwise they are not checked: give the
                    // verifier the rest of the context.
                    let checks = run.gen.sampling.is_greedy()
                        && self.split.is_none()
                        && run.check.as_ref().map(|c| run.prompt_len + c.next) == Some(upto);
                    if !checks {
                        if let Some(c) = run.check.take() {
                            run.complete_check(c, false);
                        }
                        return self.resume_to_end(run, upto);
                    }
                }
                Ok(Step::Ok)
            }
            Ok(_) => Err(EdgeError::Protocol("first answer was not Opened".into())),
            Err(e) => self.fail(run, e),
        }
    }

    /// Sends the whole context (`Resume`) to a session that holds a prefix of it.
    /// `held`: the context length the session holds now.
    fn resume_to_end(&mut self, run: &mut Run<'_, '_>, held: usize) -> Result<Step, EdgeError> {
        let fresh = run.ctx.len().saturating_sub(held);
        self.resume_at(run, run.ctx.len(), fresh)
    }

    /// Moves the session to the context `ctx[..upto]` (`Resume`); the verifier
    /// prefills `fresh` tokens for it (sets the deadline).
    fn resume_at(
        &mut self,
        run: &mut Run<'_, '_>,
        upto: usize,
        fresh: usize,
    ) -> Result<Step, EdgeError> {
        let resume = pb::Resume {
            context_tokens: run.ctx[..upto].to_vec(),
            next_round: self.round,
        };
        match self.exchange(Cm::Resume(resume), fresh) {
            Ok((Sm::Resumed(r), _)) => {
                if r.context_len != upto as u64 {
                    return Err(EdgeError::Protocol("Resumed.context_len differs".into()));
                }
                run.stats.verifier_passes += 1;
                Ok(Step::Ok)
            }
            Ok(_) => Err(EdgeError::Protocol("expected Resumed".into())),
            Err(e) => self.fail(run, e),
        }
    }

    /// One request and its answer; `positions`: what the verifier's forward
    /// covers (sets the deadline; [`draft_positions`] for a `Draft`).
    fn exchange(&mut self, msg: Cm, positions: usize) -> Result<(Sm, Duration), NetError> {
        let deadline = self.deadline(positions);
        let Some(s) = self.stream.as_mut() else {
            return Err(NetError::Unavailable("no session".into()));
        };
        self.rt
            .block_on(s.exchange(msg, deadline, &mut self.counters))
    }

    fn verdict(&self, answer: Sm, k: usize, ctx_before: usize) -> Result<pb::Verdict, EdgeError> {
        let Sm::Verdict(v) = answer else {
            return Err(EdgeError::Protocol("expected a Verdict".into()));
        };
        let n = v.accepted as usize;
        if v.round != self.round || n > k || v.context_len != (ctx_before + n + 1) as u64 {
            return Err(EdgeError::Protocol(format!(
                "verdict (round {}, accepted {n}, context {}) does not fit round {} with k = {k} at context {ctx_before}",
                v.round, v.context_len, self.round
            )));
        }
        Ok(v)
    }

    /// Verify-only pass over the provisional span (greedy): the verifier holds the
    /// context up to `check.next`; send the streamed tokens as drafts and compare.
    fn check_provisional(&mut self, run: &mut Run<'_, '_>) -> Result<Step, EdgeError> {
        loop {
            let Some(c) = run.check.as_ref() else {
                return Ok(Step::Ok);
            };
            let (p, e) = (c.next, run.out_len());
            if p >= e {
                if let Some(c) = run.check.take() {
                    run.complete_check(c, true);
                }
                return Ok(Step::Ok);
            }
            let chunk = run.out()[p..e.min(p + self.max_block)].to_vec();
            let k = chunk.len();
            let draft = pb::Draft {
                round: self.round,
                tokens: chunk,
                draft_dists: Vec::new(),
                ..pb::Draft::default()
            };
            let (answer, rtt) = match self.exchange(Cm::Draft(draft), draft_positions(k)) {
                Ok(a) => a,
                Err(e) => return self.fail(run, e),
            };
            let v = self.verdict(answer, k, run.prompt_len + p)?;
            self.record_rtt(rtt, draft_positions(k));
            self.success();
            self.round += 1;
            run.stats.check_rounds += 1;
            run.stats.verifier_passes += 1;
            let n = v.accepted as usize;
            if p + n < e {
                let differs = v.next_token != run.out()[p + n];
                if let Some(c) = run.check.as_mut() {
                    c.next = p + n + 1;
                    if differs {
                        c.mismatches.push(p + n);
                    }
                }
                if differs {
                    if let Step::Lost = self.resume_shown(run, run.prompt_len + p + n + 1)? {
                        return Ok(Step::Lost);
                    }
                }
            } else {
                // The whole rest matched; the verdict's token follows the span and
                // is the target's own: emit it (the verifier already holds it).
                if let Some(c) = run.check.take() {
                    let mut c = c;
                    c.next = e;
                    run.complete_check(c, true);
                }
                run.pending.push(v.next_token);
                run.emit(v.next_token, TokenStatus::Verified);
                return Ok(Step::Ok);
            }
        }
    }

    /// After a verdict that disagreed with a shown (provisional) token: move the
    /// verifier's session to the shown context `ctx[..upto]`.
    /// The session holds `ctx[..upto - 1]` plus the target's own token.
    fn resume_shown(&mut self, run: &mut Run<'_, '_>, upto: usize) -> Result<Step, EdgeError> {
        let step = self.resume_at(run, upto, 1)?;
        if let Step::Ok = step {
            // Part of checking provisional tokens.
            run.stats.check_rounds += 1;
        }
        Ok(step)
    }

    /// A round trip whose verifier forward covered `positions` tokens.
    fn record_rtt(&mut self, rtt: Duration, positions: usize) {
        self.rtt.record(rtt, positions);
        self.gen_rtt.record(rtt, positions);
    }

    /// One speculative round: draft k, verify remotely, apply the verdict.
    fn round_trip(&mut self, run: &mut Run<'_, '_>) -> Result<(), EdgeError> {
        let room_out = run.gen.max_tokens.saturating_sub(run.out_len());
        let k = run
            .gen
            .k
            .min(self.max_block)
            .min(run.capacity.saturating_sub(run.ctx.len()))
            .min(room_out.max(1));
        if k == 0 {
            run.stop = Some(StopReason::ContextFull);
            return Ok(());
        }
        let ctx_before = run.ctx.len();
        let mut hist = run.ctx.clone();
        let mut block = Vec::with_capacity(k);
        let mut dists = Vec::new();
        for _ in 0..k {
            let (d, q) = run.draft_next(&hist)?;
            hist.push(d);
            block.push(d);
            if let Some(q) = q {
                let (tokens, probs) = q.entries().iter().copied().unzip();
                dists.push(pb::TokenDistribution { tokens, probs });
            }
        }
        let draft = pb::Draft {
            round: self.round,
            tokens: block.clone(),
            draft_dists: dists,
            ..pb::Draft::default()
        };
        let draft = match self.split.as_deref_mut() {
            Some(sp) => sp.draft_message(&run.ctx, draft)?,
            None => draft,
        };
        // U-shape at s = N: the device computed everything; no exchange.
        let local = match self.split.as_deref_mut() {
            Some(sp) => sp.local_answer(self.round, ctx_before),
            None => None,
        };
        let (answer, rtt) = match local {
            Some(v) => (Sm::Verdict(v), None),
            None => match self.exchange(Cm::Draft(draft), draft_positions(k)) {
                Ok((a, rtt)) => (a, Some(rtt)),
                Err(e) => {
                    run.rollback_unverified();
                    if let Some(sp) = self.split.as_deref_mut() {
                        sp.rollback(ctx_before);
                    }
                    self.fail(run, e)?;
                    return Ok(());
                }
            },
        };
        let v = match (self.split.as_deref_mut(), answer) {
            (Some(sp), Sm::Verdict(v)) if sp.pin_head() => {
                if v.round != self.round {
                    return Err(EdgeError::Protocol(format!(
                        "verdict for round {}, expected {}",
                        v.round, self.round
                    )));
                }
                sp.local_verdict(&v, &run.ctx, &run.gen.sampling)?
            }
            (_, answer) => self.verdict(answer, k, ctx_before)?,
        };
        let replanned = match self.split.as_deref_mut() {
            Some(sp) => sp.accept(
                ctx_before,
                v.accepted as usize,
                rtt.map(|r| r.as_secs_f64() * 1e3),
                k,
            ),
            None => false,
        };
        if replanned {
            // auto chose another s: the next round opens a new split session.
            self.live = false;
            if let Some(mut st) = self.stream.take() {
                let c = &mut self.counters;
                let _ = self.rt.block_on(st.exchange(
                    Cm::Close(pb::Close::default()),
                    Duration::from_secs(1),
                    c,
                ));
            }
        }
        if let Some(rtt) = rtt {
            self.record_rtt(rtt, draft_positions(k));
            self.success();
            // Round numbers count the verifier's rounds (all-local ones are not).
            self.round += 1;
        }
        run.stats.rounds += 1;
        run.stats.drafted += k as u64;
        run.stats.accepted += v.accepted as u64;
        run.stats.verifier_passes += 1;
        run.accept(ctx_before, &block, v.accepted as usize, v.next_token);
        Ok(())
    }
}

/// Tokens of the warm-up forward (`EdgeConfig::warmup`): a short prefill and
/// one decode step, so both the many-row and the one-row kernels, the
/// thread pool and the model's pages are touched before the first request.
const WARMUP_PREFILL: usize = 16;

/// Runs the warm-up forward on a throwaway cache; returns its time (ms).
fn warm_up(draft: &Qwen2Model) -> Result<f64, EdgeError> {
    let t = Instant::now();
    let n = WARMUP_PREFILL
        .min(draft.max_seq_len().saturating_sub(1))
        .max(1);
    let vocab = u32::try_from(draft.config().vocab)
        .unwrap_or(u32::MAX)
        .max(1);
    let tokens: Vec<u32> = (0..n as u32).map(|i| i % vocab).collect();
    let mut cache = draft.new_cache();
    draft.forward_last(&tokens, 0, &mut cache)?;
    if n < draft.max_seq_len() {
        draft.forward_last(&tokens[..1], n, &mut cache)?;
    }
    Ok(t.elapsed().as_secs_f64() * 1000.0)
}
