//! [`EdgeRuntime`]: the speculative loop with a remote verifier, the offline
//! fallback, and the provisional check after an outage.
//!
//! Shape (docs/edge.md, "The round loop"):
//! * [`generation`]: one generation's device side (context, draft cache,
//!   emitting, applying a verdict, final stats); knows nothing of the network.
//! * [`connection`]: the session's lifecycle (open, background re-open,
//!   resume, failures, breaker and probe, deadlines); it reports outcomes
//!   and never changes the generation. Its `RemoteVerifier` is the
//!   verifier of the generation core's round (`tandem_model::engine::round`),
//!   which the plain rounds ([`plain`]) are; the cloud-streamed rounds
//!   ([`cloud_stream`]) are the core's round with no proposal (k = 0)
//!   against a windowed verifier over the same connection.
//! * [`drive`]: the loop. A round kind is chosen once per generation
//!   ([`plain`], [`pipelined`], [`cloud_stream`], [`gated`]); every round
//!   returns an outcome and one `commit` ([`round`]: what the kinds share)
//!   does the bookkeeping.
//! * What a generation reports (token statuses, events, provisional checks,
//!   statistics, the result) is plain data in `crate::report`, re-exported
//!   here. No module of the runtime imports its parent.
//! * The wire form of blocks is a [`crate::codec::BlockCodec`] (token ids, or
//!   split execution's hidden states).
//!
//! Invariants of the loop (see `docs/edge.md`):
//! * `ctx` = prompt + every emitted token; the draft cache plus `pending` hold
//!   exactly `ctx` (pending = tokens the draft has not run yet, never empty).
//! * While a session stream is live and no provisional span is being checked, the
//!   verifier holds `ctx` too (its `last` is `ctx`'s last token).

use crate::adaptive::{RoundRecord, SpecState};
use crate::breaker::{lock, BreakerState, CircuitBreaker, OpenCost, RttTracker};
use crate::client::{Connector, Counters};
use crate::codec::{BlockCodec, TokenCodec};
use crate::config::EdgeConfig;
use crate::conversation::{
    common_prefix, ConversationCache, ConversationStats, Kept, KeptSession, SharedConversations,
    Who,
};
use crate::error::EdgeError;
use crate::open_load::OpenLoad;
pub use crate::report::{
    EdgeEvent, EdgeGeneration, EdgeStats, ProvisionalCheck, ProvisionalReport, TokenStatus,
};
use crate::second_opinion::JudgedPromptKv;
use connection::{Connection, CLOSE_TIMEOUT};
use generation::Generation;
use round::{RoundKind, Rounds};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tandem_model::kv_cache::KvCache;
use tandem_model::proposer::ProposerKind;
use tandem_model::speculative::GenerateConfig;
use tandem_model::tokenizer::Tokenizer;
use tandem_model::transformer::Model;
use tandem_proto::v1::{
    self as pb, client_message::Msg as ClientMsg, server_message::Msg as ServerMsg,
};

mod cloud_stream;
mod connection;
mod drive;
mod gated;
mod generation;
mod pipelined;
mod plain;
mod round;

/// The device runtime: draft model + verifier client + breaker. Reuse one runtime
/// for many generations (the breaker and RTT history carry over).
pub struct EdgeRuntime {
    draft: Arc<Model>,
    cfg: EdgeConfig,
    fingerprint: String,
    connector: Option<Connector>,
    rt: tokio::runtime::Runtime,
    breaker: Arc<Mutex<CircuitBreaker>>,
    rtt: RttTracker,
    open_cost: OpenCost,
    /// Opens waiting for the verifier's prefill, shared with this runtime's
    /// siblings (`crate::open_load`).
    open_load: Arc<OpenLoad>,
    probe: Option<tokio::task::JoinHandle<()>>,
    /// A session re-open a generation left in flight (the next one adopts it).
    reopening: Option<connection::Opening>,
    spec: SpecState,
    split: Option<crate::device_layers::SplitExec>,
    /// Kept conversations, shared with this runtime's siblings
    /// ([`EdgeRuntime::sibling`]); locked only to take or put an entry.
    conversations: Arc<SharedConversations>,
    /// The client scope of this runtime's anonymous requests (None: they
    /// neither find nor leave kept state); [`Self::set_anonymous_scope`].
    anonymous_scope: Option<String>,
    /// What the app reports about the device (any thread may set it).
    device: crate::device::SharedDeviceState,
    draft_pools: crate::device::DraftPools,
    /// How long the warm-up forward at load took (`EdgeConfig::warmup`).
    warmup_ms: Option<f64>,
    /// The caller's cancel flag ([`EdgeRuntime::set_cancel_flag`]).
    cancel: Option<Arc<std::sync::atomic::AtomicBool>>,
}

impl Drop for EdgeRuntime {
    fn drop(&mut self) {
        if let Some(p) = self.probe.take() {
            p.abort();
        }
        if let Some(op) = self.reopening.take() {
            op.abandon();
        }
    }
}

impl EdgeRuntime {
    /// A runtime around a loaded draft model (callers go through
    /// [`EdgeRuntime::builder`]). The tokenizer fingerprint comes from the
    /// draft GGUF (draft and target share the tokenizer) unless the config
    /// overrides it. `split_target` is the target model whose first layers the
    /// device runs: required by `[split]`, refused without it.
    pub(crate) fn new(
        draft: Arc<Model>,
        cfg: EdgeConfig,
        split_target: Option<Arc<Model>>,
    ) -> Result<Self, EdgeError> {
        cfg.validate()?;
        let split = match (cfg.split.clone(), split_target) {
            (Some(sc), Some(target)) => {
                Some(crate::device_layers::SplitExec::new(target, sc, cfg.k)?)
            }
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
        let mut spec = SpecState::new(&cfg.speculation);
        let warmup_ms = if cfg.warmup {
            let t = time_draft_forwards(&draft)?;
            t.feed(&mut spec.auto);
            Some(t.total_ms())
        } else {
            None
        };
        Ok(Self {
            device: Default::default(),
            draft_pools: Default::default(),
            warmup_ms,
            cancel: None,
            breaker: Arc::new(Mutex::new(CircuitBreaker::new(cfg.breaker_failures))),
            spec,
            split,
            conversations: Arc::new(SharedConversations::new(&cfg.conversations)),
            anonymous_scope: Some(String::new()),
            draft,
            cfg,
            fingerprint,
            connector,
            rt,
            rtt: RttTracker::default(),
            open_cost: OpenCost::default(),
            open_load: Arc::default(),
            probe: None,
            reopening: None,
        })
    }

    /// A runtime for another generation slot beside this one, for hosts that
    /// run several generations at once (`tandem serve-edge --parallel`): the
    /// same draft weights (shared, not copied: `Arc<Model>` over the mapped
    /// GGUF), config and split target; its own draft KV per generation,
    /// verifier connection, breaker, RTT history and I/O thread; and,
    /// shared with this runtime, the kept conversations (a turn may run on
    /// any slot and still continue its conversation), the device state and
    /// the count of opens waiting for the verifier's prefill (an open's
    /// deadline allows for its siblings' opens: `crate::open_load`).
    /// No warm-up: this runtime's measurement of the draft is copied.
    pub fn sibling(&self) -> Result<Self, EdgeError> {
        let cfg = EdgeConfig {
            warmup: false,
            tokenizer_fingerprint: Some(self.fingerprint.clone()),
            ..self.cfg.clone()
        };
        let target = self
            .split
            .as_ref()
            .map(crate::device_layers::SplitExec::target);
        let mut rt = Self::new(self.draft.clone(), cfg, target)?;
        rt.conversations = self.conversations.clone();
        rt.open_load = Arc::clone(&self.open_load);
        rt.anonymous_scope = self.anonymous_scope.clone();
        rt.device = self.device.clone();
        rt.warmup_ms = self.warmup_ms;
        rt.spec.auto = self.spec.auto.clone();
        rt.cancel = None;
        Ok(rt)
    }

    /// The draft GGUF's file name (messages name the served model by it).
    pub fn draft_file_name(&self) -> String {
        self.draft
            .gguf()
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
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

    /// Which client the next anonymous requests (no conversation name) come
    /// from: they reuse kept state by prompt prefix only among requests of
    /// the same scope (one identity: serve-edge's API key holders, or one OS
    /// user on loopback). `None`: they neither find nor leave state. The
    /// default, `Some("")`, is one scope for all (a device app is one user).
    /// One client's request must not learn how much of its prompt another
    /// client's cached one shares, nor evict it.
    pub fn set_anonymous_scope(&mut self, scope: Option<String>) {
        self.anonymous_scope = scope;
    }

    /// A flag the caller sets to cancel the running generation before its
    /// first token too: it is asked between the draft's prompt-prefill chunks
    /// (with a flag set, prompts are prefilled in chunks of 256 rows), while waiting for the verifier's `Opened`, and
    /// before every round; the generation then ends with
    /// `StopReason::Cancelled` (`on_event` returning false still cancels at
    /// a token). `None` (the default): only `on_event` cancels.
    pub fn set_cancel_flag(&mut self, flag: Option<Arc<std::sync::atomic::AtomicBool>>) {
        self.cancel = flag;
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

    /// The rounds of the last generation (k, accepted, RTT, drafting time), when
    /// the speculation config is active (`record_rounds`, adaptive k,
    /// pipelining or target streaming) or gating is on.
    pub fn last_rounds(&self) -> &[RoundRecord] {
        &self.spec.rounds
    }

    /// The speculation state (chooser estimates carry over between generations).
    pub fn speculation(&self) -> &SpecState {
        &self.spec
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
        let started = Instant::now();
        let conversations = Arc::clone(&self.conversations);
        let _running = conversations.enter();
        let (device, _threads) = self.device_begin()?;
        let gen = &gen.for_prompt(prompt.len());
        let who_ = who(&self.anonymous_scope, conversation);
        let mut run = Generation::begin(
            &self.draft,
            &mut conversations.lock_when_free(who_, prompt),
            who_,
            prompt,
            gen,
            on_event,
        )?;
        // A wait for the idle catch-up to hand the conversation back counts
        // in the time to first token.
        run.start = started;
        run.cancel = self.cancel.clone();
        let mut res = Ok(());
        while run.stop.is_none() && res.is_ok() {
            res = match run.prefill_pending() {
                Ok(true) => run.draft_alone(TokenStatus::Local),
                Ok(false) => Ok(()),
                Err(e) => Err(e),
            };
        }
        res?;
        // The verifier session of an earlier turn (if any) stays kept.
        let session = run.continuation.take();
        kept(&self.conversations).put(
            who(&self.anonymous_scope, conversation),
            run.take_kept(session),
        );
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
        kept(&self.conversations).stats()
    }

    /// Offers the second opinion's draft KV ([`JudgedPromptKv`]: the
    /// classification prompt's tokens and KV) to the conversation cache for
    /// the generation of `prompt` as a turn of `conversation` (`None`:
    /// anonymous) at `gen`'s draft KV precision, so that generation prefills
    /// only what follows the prefix the two prompts share. Offered only when
    /// the cache keeps state for this request and holds none it would
    /// continue (a kept turn is never replaced), the KV is this runtime's
    /// draft's at that precision and the prompts share a prefix; the entry
    /// holds that prefix alone (an anonymous request then finds it by its
    /// prompt). The generation's reuse is exact by the cache's rule
    /// ([`crate::conversation`], 2). Returns the positions offered (0: none).
    pub fn offer_draft_kv(
        &mut self,
        conversation: Option<&str>,
        prompt: &[u32],
        gen: &GenerateConfig,
        judged: JudgedPromptKv,
    ) -> usize {
        let JudgedPromptKv {
            tokens,
            mut cache,
            model,
        } = judged;
        if !Arc::ptr_eq(&model, &self.draft)
            || cache.precision() != gen.draft_kv
            || cache.capacity() != self.draft.max_seq_len()
        {
            return 0;
        }
        let shared = common_prefix(&tokens, prompt).min(cache.len());
        let who = who(&self.anonymous_scope, conversation);
        let mut conversations = kept(&self.conversations);
        if shared == 0 || !conversations.keeps(who) || conversations.holds_state_for(who, prompt) {
            return 0;
        }
        let high_water = cache.len();
        cache.truncate(shared);
        conversations.put(
            who,
            Kept {
                cache,
                tokens: prompt[..shared].to_vec(),
                session: None,
                high_water,
                caught_up: 0,
            },
        );
        shared
    }

    /// Runs the context that kept conversations' draft KV lacks through the
    /// draft, while the device is idle (docs/edge.md "Catching the draft up
    /// between turns"): a turn that prompt lookup served leaves the draft
    /// behind by its reply, which the next turn would otherwise prefill
    /// before its first token. Entries go most recently used first, in
    /// forwards of [`CATCH_UP_CHUNK`] rows; before each chunk it asks
    /// `stop` (the host has a request for this runtime) and whether a
    /// generation runs on this runtime's siblings, and yields at once if so:
    /// a request waits for at most one chunk. The rows are those the next
    /// turn would compute (same tokens and positions; the kernel contract
    /// makes a row's result independent of its forward's other rows), so
    /// no output changes. Nothing runs with `[conversations] catch_up`
    /// (or the cache) off, and an entry whose rows would not fit the
    /// budget is left as it is.
    pub fn catch_up(&mut self, stop: &dyn Fn() -> bool) -> Result<CatchUp, EdgeError> {
        let mut done = CatchUp::default();
        if !(self.cfg.conversations.enabled && self.cfg.conversations.catch_up) {
            return Ok(done);
        }
        let conversations = Arc::clone(&self.conversations);
        let busy = || stop() || conversations.running() > 0;
        if busy() {
            done.yielded = true;
            return Ok(done);
        }
        // The draft's threads as a generation started now would have them.
        let (_device, _threads) = self.device_begin()?;
        let capacity = self.draft.max_seq_len();
        while !done.yielded {
            let Some(mut out) = kept(&conversations).check_out_behind(capacity) else {
                break;
            };
            let cache = std::mem::replace(&mut out.cache, KvCache::new(0, 0, 0, 0));
            let mut pending = out.tokens[cache.len()..].to_vec();
            let mut draft = tandem_model::engine::DraftModel {
                model: &self.draft,
                cache,
                guide: None,
            };
            let fed = generation::feed_chunks(
                &mut draft,
                &mut pending,
                generation::Feed {
                    while_more_than: 0,
                    leave: 0,
                    chunk: CATCH_UP_CHUNK,
                },
                &mut || busy(),
            );
            match fed {
                Ok(f) => {
                    done.rows += f.rows;
                    done.entries += 1;
                    done.yielded = f.stopped;
                    conversations.check_in(out, Some(draft.cache), f.rows, f.stopped);
                }
                Err(e) => {
                    conversations.check_in(out, None, 0, false);
                    return Err(e);
                }
            }
        }
        if done.rows > 0 {
            tracing::debug!(
                rows = done.rows,
                entries = done.entries,
                yielded = done.yielded,
                "draft caught up between turns"
            );
        }
        Ok(done)
    }

    /// Drops a named conversation's kept state (its verifier session expires
    /// by the verifier's idle TTL); false when there was none.
    pub fn forget_conversation(&mut self, conversation: &str) -> bool {
        kept(&self.conversations).forget(conversation)
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
        let Some(connector) = self.connector.clone() else {
            return self.generate_local_in(conversation, prompt, gen, on_event);
        };
        let started = Instant::now();
        // Counted as running from here: an idle catch-up on a sibling yields.
        let conversations = Arc::clone(&self.conversations);
        let _running = conversations.enter();
        // The device state, read once: fewer draft threads, a k cap.
        let (device, _threads) = self.device_begin()?;
        let gen = &gen.for_prompt(prompt.len());
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
        if let Some(split) = self.split.as_mut() {
            // Split execution under a grammar: with the head on the verifier
            // it masks its verdicts (Open.grammar); in U-shape sessions the
            // device makes them, through its own constraint.
            let guide = match &gen.grammar {
                Some(g) if split.pin_head() => Some(g.constraint(prompt.len())?),
                _ => None,
            };
            split.set_guide(guide);
        }
        if gen.proposer == ProposerKind::Auto && !self.spec.auto.draft_measured() {
            // auto weighs the draft by its measured forward time, and the
            // target's cost here is a round trip: time the draft once (the
            // warm-up's forwards, on a throwaway cache) so that its cost is
            // the device's, not a share of the link's latency.
            time_draft_forwards(&self.draft)?.feed(&mut self.spec.auto);
        }
        let who_ = who(&self.anonymous_scope, conversation);
        let mut run = Generation::begin(
            &self.draft,
            &mut conversations.lock_when_free(who_, prompt),
            who_,
            prompt,
            gen,
            on_event,
        )?;
        // A wait for the idle catch-up to hand the conversation back counts
        // in the time to first token.
        run.start = started;
        run.cancel = self.cancel.clone();
        let mut token_codec = TokenCodec {
            vocab: u32::try_from(self.draft.config().vocab).unwrap_or(u32::MAX),
        };
        let codec: &mut dyn BlockCodec = match self.split.as_mut() {
            Some(split) => split,
            None => &mut token_codec,
        };
        // A kept verifier session is continued (not in split sessions, which
        // send hidden states of their whole context).
        let tokens_only = codec.tokens_only();

        let continuation = run.continuation.take().filter(|_| tokens_only);
        let session_key = continuation
            .as_ref()
            .map(|k| k.affinity_key.clone())
            .unwrap_or_else(crate::client::new_session_key);
        // Gating trusts the draft's confidence, a greedy notion.
        let gated = self.cfg.gate.enabled() && gen.sampling.is_greedy();
        let spec = self.spec.begin();
        let kind = RoundKind::choose(gated, spec, tokens_only);
        let conn = Connection {
            cfg: &self.cfg,
            fingerprint: &self.fingerprint,
            connector,
            rt: &self.rt,
            breaker: &self.breaker,
            rtt: &mut self.rtt,
            open_cost: &mut self.open_cost,
            open_load: &self.open_load,
            opening: None,
            retry_at: None,
            // A breaker left open by an earlier generation: the verifier was
            // unreachable, so do not wait for the next open either.
            outage: lock(&self.breaker).state() != BreakerState::Closed,
            probe: &mut self.probe,
            gen_rtt: RttTracker::default(),
            counters: Counters::default(),
            stream: None,
            in_flight: VecDeque::new(),
            session_id: None,
            session_key,
            continuation,
            reopens_left: connection::IMMEDIATE_REOPENS,
            live: false,
            round: 0,
            max_block: gen.k.min(tandem_model::speculative::MAX_K),
            k_cap,
            resends_in_a_row: 0,
            codec,
            cancel: run.cancel.clone(),
            capacity: usize::MAX,
            counts: connection::SessionCounts::default(),
        };
        let mut rounds = Rounds { conn, spec, kind };
        if let Some(op) = self.reopening.take() {
            rounds.conn.adopt(op, gen);
        }
        let res = drive::drive(&mut rounds, &mut run);
        let mut net = rounds.conn;
        // The generation ended while a re-open was in flight: the runtime
        // keeps it and the next generation adopts it. (Aborting it here meant
        // that once an open took longer than a generation none ever completed
        // and a fleet stayed provisional: docs/verifier.md "Fault soak".)
        self.reopening = net.opening.take();
        // Keep the verifier's session for the next turn when its context is
        // known (the stream is live and no provisional span is unchecked: the
        // verifier then holds the device's context, possibly plus a stop token
        // the device did not show); otherwise free its KV cache.
        let keep_session = kept(&self.conversations)
            .keeps(who(&self.anonymous_scope, conversation))
            && self.cfg.conversations.keep_verifier_sessions
            && tokens_only
            && res.is_ok()
            && run.check.is_none();
        let mut kept_session = None;
        if let Some(mut s) = net.stream.take() {
            // An error here changes nothing: the verifier's idle TTL frees it.
            let c = &mut net.counters;
            let close = ClientMsg::Close(pb::Close { keep: keep_session });
            let closed = self.rt.block_on(s.exchange(close, CLOSE_TIMEOUT, c));
            if let (true, Ok((ServerMsg::Closed(_), _)), Some(id)) =
                (keep_session, closed, net.session_id.clone())
            {
                kept_session = Some(KeptSession {
                    id,
                    context: run.ctx.clone(),
                    affinity_key: net.session_key.clone(),
                });
            }
        }
        net.counts.add_to(&mut run.stats);
        let split = net.codec.report();
        let (gen_rtt, counters, sid) = (net.gen_rtt, net.counters, net.session_id);
        // (After an error the draft KV may be half-written: not kept.)
        res?;
        kept(&self.conversations).put(
            who(&self.anonymous_scope, conversation),
            run.take_kept(kept_session),
        );
        let mut g = run.finish(sid, &gen_rtt, counters);
        g.stats.split = split;
        g.stats.device = Some(device);
        Ok(g)
    }
}

/// Rows per forward of the idle catch-up ([`EdgeRuntime::catch_up`]): a
/// request arriving meanwhile waits for at most one such forward (for the
/// 0.5B draft at a context of ~400, about 0.4 s at the 37 rows/s measured on
/// a loaded 2-core machine; far less when quiet).
pub const CATCH_UP_CHUNK: usize = 16;

/// What one [`EdgeRuntime::catch_up`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CatchUp {
    /// Draft rows computed, over how many kept conversations.
    pub rows: usize,
    pub entries: usize,
    /// It stopped for a request (or found one waiting) before every kept
    /// conversation was caught up.
    pub yielded: bool,
}

/// Which kept state a request of `conversation` (None: anonymous, of the
/// runtime's `anonymous_scope`) takes.
fn who<'s>(anonymous_scope: &'s Option<String>, conversation: Option<&'s str>) -> Who<'s> {
    match (conversation, anonymous_scope) {
        (Some(name), _) => Who::Named(name),
        (None, Some(scope)) => Who::Anonymous { scope },
        (None, None) => Who::Nobody,
    }
}

/// The kept conversations (locked while the guard lives: take it only to
/// take or put an entry).
fn kept(c: &SharedConversations) -> std::sync::MutexGuard<'_, ConversationCache> {
    c.lock()
}

/// Tokens of the warm-up forward (`EdgeConfig::warmup`): a short prefill and
/// one decode step, so both the many-row and the one-row kernels, the
/// thread pool and the model's pages are touched before the first request.
const WARMUP_PREFILL: usize = 16;

/// The times of the warm-up's draft forwards.
struct DraftTiming {
    prefill: Duration,
    decode: Option<Duration>,
}

impl DraftTiming {
    fn total_ms(&self) -> f64 {
        (self.prefill + self.decode.unwrap_or_default()).as_secs_f64() * 1000.0
    }

    /// Seeds `auto`'s cost of a decoded draft token. (Not of a prefilled
    /// one: a 16-token prefill on an empty cache is cheaper per token than a
    /// real prompt's, which the first catch-up measures.)
    fn feed(&self, auto: &mut tandem_model::proposer::AutoChooser) {
        if let Some(d) = self.decode {
            auto.draft_forward(1, d);
        }
    }
}

/// The warm-up forwards on a throwaway cache (a short prefill, then one
/// decode step), timed.
fn time_draft_forwards(draft: &Model) -> Result<DraftTiming, EdgeError> {
    let n = WARMUP_PREFILL
        .min(draft.max_seq_len().saturating_sub(1))
        .max(1);
    let vocab = u32::try_from(draft.config().vocab)
        .unwrap_or(u32::MAX)
        .max(1);
    let tokens: Vec<u32> = (0..n as u32).map(|i| i % vocab).collect();
    let mut cache = draft.new_cache();
    let t = Instant::now();
    draft.forward_last(&tokens, 0, &mut cache)?;
    let prefill = t.elapsed();
    let decode = if n < draft.max_seq_len() {
        let t = Instant::now();
        draft.forward_last(&tokens[..1], n, &mut cache)?;
        Some(t.elapsed())
    } else {
        None
    };
    Ok(DraftTiming { prefill, decode })
}
