//! The verifier's shared state (one per server), in one struct as mini-redis
//! keeps its `Db`: the model's identity, the limits, the session store, the KV
//! pool, the scheduler, admission control and metrics. Handlers borrow it;
//! nothing here runs a forward itself.

use crate::admission::Admission;
use crate::error::Refusal;
use crate::lock::lock;
use crate::metrics::{Gauges, Metrics};
use crate::scheduler::{Done, Job, Outcome, Scheduler, Work};
use crate::session::SessionState;
use crate::store::{SessionStore, StoreError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tandem_model::kv_pages::{KvPool, PagedKv};
use tandem_model::transformer::Model;
use tandem_proto::v1::Reason;
use tokio::sync::{oneshot, watch};

/// What the handlers check requests against.
#[derive(Debug, Clone)]
pub struct ServiceLimits {
    pub max_prompt_tokens: usize,
    pub max_block: usize,
    /// A stream idle this long is ended (STREAM_IDLE).
    pub stream_idle: Duration,
    /// Most streams one identity has open at once.
    pub max_streams_per_identity: usize,
    /// Most Opens one identity has in flight (admitted, not yet answered).
    pub max_inflight_opens_per_identity: usize,
}

/// Per-identity counts of what is in flight outside the session store:
/// open streams, Opens being handled, and the KV bytes those Opens reserved
/// (counted in the identity's byte quota before their sessions are stored).
#[derive(Default)]
pub struct InFlight {
    streams: HashMap<Arc<str>, usize>,
    opens: HashMap<Arc<str>, usize>,
    open_bytes: HashMap<Arc<str>, u64>,
}

/// A slot in one of [`InFlight`]'s counts, given back on drop.
pub struct InFlightSlot {
    state: Arc<VerifierState>,
    who: Arc<str>,
    kind: SlotKind,
}

#[derive(Clone, Copy)]
enum SlotKind {
    Stream,
    Open,
}

impl Drop for InFlightSlot {
    fn drop(&mut self) {
        let mut f = lock(&self.state.in_flight);
        let m = match self.kind {
            SlotKind::Stream => &mut f.streams,
            SlotKind::Open => &mut f.opens,
        };
        if let Some(n) = m.get_mut(&self.who) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.who);
            }
        }
    }
}

/// The KV bytes an Open reserved, counted for its identity until the session
/// is stored (or refused); given back on drop.
pub struct OpenBytes<'a> {
    state: &'a VerifierState,
    who: Arc<str>,
    bytes: u64,
}

impl Drop for OpenBytes<'_> {
    fn drop(&mut self) {
        let mut f = lock(&self.state.in_flight);
        if let Some(b) = f.open_bytes.get_mut(&self.who) {
            *b = b.saturating_sub(self.bytes);
            if *b == 0 {
                f.open_bytes.remove(&self.who);
            }
        }
    }
}

/// Shared state of the verify service.
pub struct VerifierState {
    pub model: Arc<Model>,
    pub model_id: String,
    pub fingerprint: String,
    pub limits: ServiceLimits,
    pub store: Mutex<SessionStore>,
    pub pool: Arc<KvPool>,
    pub scheduler: Scheduler,
    pub admission: Arc<Admission>,
    pub metrics: Arc<Metrics>,
    /// Per-session KV cap (positions): the configured `max_seq_len`.
    pub max_seq_len: usize,
    pub shutdown: watch::Receiver<bool>,
    /// Streams, Opens and Open reservations in flight per identity.
    pub in_flight: Mutex<InFlight>,
    /// Serializes an Open's reservation with its registration in
    /// `in_flight` (so concurrent Opens of one identity see each other).
    pub open_gate: Mutex<()>,
    /// The target tokenizer's grammar vocabulary (`Open.grammar`), built on
    /// the first Open that asks for a grammar (about half a second for a
    /// 151k-token vocabulary: docs/grammar.md); the error when the target has
    /// no usable tokenizer.
    pub grammar_vocab: tokio::sync::OnceCell<Result<tandem_grammar::GrammarVocab, String>>,
}

impl VerifierState {
    /// [`Self::grammar_vocab`], built off the async workers on first use.
    pub async fn grammar_vocab(&self) -> Result<tandem_grammar::GrammarVocab, Refusal> {
        let model = Arc::clone(&self.model);
        let built = self
            .grammar_vocab
            .get_or_init(|| async move {
                tokio::task::spawn_blocking(move || {
                    let tok = tandem_model::tokenizer::Tokenizer::from_gguf(model.gguf())
                        .map_err(|e| format!("the target model has no usable tokenizer ({e})"))?;
                    tandem_grammar::GrammarVocab::new(&tok).map_err(|e| e.to_string())
                })
                .await
                .unwrap_or_else(|e| Err(format!("building the grammar vocabulary: {e}")))
            })
            .await;
        built
            .clone()
            .map_err(|e| Refusal::new(Reason::BadRequest, format!("grammar: {e}")))
    }

    /// A stream slot of `who` (`limits.max_streams_per_identity`).
    pub fn stream_slot(self: &Arc<Self>, who: &Arc<str>) -> Result<InFlightSlot, Refusal> {
        self.slot(who, SlotKind::Stream, self.limits.max_streams_per_identity)
    }

    /// An in-flight Open slot of `who` (`limits.max_inflight_opens_per_identity`).
    pub fn open_slot(self: &Arc<Self>, who: &Arc<str>) -> Result<InFlightSlot, Refusal> {
        self.slot(
            who,
            SlotKind::Open,
            self.limits.max_inflight_opens_per_identity,
        )
    }

    fn slot(
        self: &Arc<Self>,
        who: &Arc<str>,
        kind: SlotKind,
        cap: usize,
    ) -> Result<InFlightSlot, Refusal> {
        let mut f = lock(&self.in_flight);
        let (m, what, setting) = match kind {
            SlotKind::Stream => (&mut f.streams, "streams open", "max_streams_per_identity"),
            SlotKind::Open => (
                &mut f.opens,
                "Opens in flight",
                "max_inflight_opens_per_identity",
            ),
        };
        let n = m.entry(who.clone()).or_insert(0);
        if *n >= cap {
            return Err(Refusal::new(
                Reason::QuotaExceeded,
                format!("this identity already has {n} {what} (limits.{setting} = {cap})"),
            ));
        }
        *n += 1;
        Ok(InFlightSlot {
            state: self.clone(),
            who: who.clone(),
            kind,
        })
    }

    /// Bytes `owner`'s Opens reserved that are not in the store yet.
    fn open_bytes(&self, owner: &str) -> u64 {
        lock(&self.in_flight)
            .open_bytes
            .get(owner)
            .copied()
            .unwrap_or(0)
    }

    /// [`VerifierState::reserve`] for a new session's Open: the reservation
    /// is counted in `who`'s byte quota (with every other Open of `who` in
    /// flight) until the returned guard is dropped (once the session is in
    /// the store, or refused).
    pub fn reserve_open(
        &self,
        kv: &mut PagedKv,
        tokens: usize,
        who: &Arc<str>,
    ) -> Result<OpenBytes<'_>, Refusal> {
        let _gate = lock(&self.open_gate);
        self.reserve(kv, tokens, who, None)?;
        let bytes = kv.bytes_held();
        let mut f = lock(&self.in_flight);
        let b = f.open_bytes.entry(who.clone()).or_insert(0);
        *b = b.saturating_add(bytes);
        Ok(OpenBytes {
            state: self,
            who: who.clone(),
            bytes,
        })
    }

    /// The store, locked.
    pub fn store(&self) -> MutexGuard<'_, SessionStore> {
        lock(&self.store)
    }

    /// Prometheus text.
    pub fn render_metrics(&self) -> String {
        let g = {
            let s = self.store();
            Gauges {
                sessions: s.len(),
                bytes: s.bytes(),
                evictions: s.evictions(),
                pages_used: self.pool.pages_used(),
                pages_free: self.pool.pages_free(),
                pages_allocated: self.pool.pages_allocated(),
                page_bytes: self.pool.page_bytes(),
                per_identity: s.sessions_per_identity(),
            }
        };
        self.metrics.render(&g)
    }

    /// An empty KV for a new session.
    pub fn new_kv(&self) -> PagedKv {
        PagedKv::new(self.pool.clone(), self.max_seq_len)
    }

    /// Refuses token ids outside the vocabulary.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<(), Refusal> {
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

    /// Checks a whole context: at least one token, at most `max_prompt_tokens`,
    /// every id in the vocabulary.
    pub fn check_context(&self, tokens: &[u32]) -> Result<(), Refusal> {
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

    /// Positions a session with a context of `context_len` tokens reserves:
    /// its KV plus room for one block (capped at the sequence limit).
    pub fn room_for(&self, context_len: usize) -> usize {
        context_len
            .saturating_add(self.limits.max_block)
            .min(self.max_seq_len)
    }

    /// Gives `kv` pages for `tokens` positions, evicting idle sessions to
    /// make room (`owner`'s own first, never `keep`), within `owner`'s byte
    /// quota. Pages are reserved before any work is scheduled, so a forward
    /// never runs out of memory.
    pub fn reserve(
        &self,
        kv: &mut PagedKv,
        tokens: usize,
        owner: &str,
        keep: Option<&str>,
    ) -> Result<(), Refusal> {
        if tokens > kv.max_tokens() {
            return Err(Refusal::new(
                Reason::ContextFull,
                format!(
                    "context of {tokens} positions exceeds the KV capacity of {} tokens",
                    kv.max_tokens()
                ),
            ));
        }
        let more_pages = KvPool::pages_for(tokens).saturating_sub(kv.pages_held());
        let more = (more_pages as u64).saturating_mul(self.pool.page_bytes() as u64);
        // Pages of this identity's Opens in flight count too (read before
        // the store's lock: never both at once).
        let opening = self.open_bytes(owner);
        loop {
            let mut store = self.store();
            let quota = store.limits().max_bytes_per_identity;
            let (_, stored) = store.usage(owner);
            let held = stored.saturating_add(opening);
            if held.saturating_add(more) > quota {
                if store.evict_own(owner, keep) {
                    continue;
                }
                return Err(Refusal::new(
                    Reason::QuotaExceeded,
                    format!(
                        "this identity's sessions hold {held} bytes; {more} more would pass its \
                         quota of {quota} bytes"
                    ),
                ));
            }
            match kv.reserve(tokens) {
                Ok(()) => return Ok(()),
                Err(full) => {
                    if !store.make_room(owner, keep) {
                        return Err(Refusal::new(
                            Reason::TooManySessions,
                            format!("no KV memory free and no idle session to evict: {full}"),
                        ));
                    }
                }
            }
        }
    }

    /// Runs `work` on the scheduler with `state`; the answer's state is `None`
    /// when it was lost (the caller removes the session).
    pub async fn run(
        &self,
        identity: &Arc<str>,
        session: &Arc<str>,
        state: SessionState,
        work: Work,
    ) -> (Option<SessionState>, Result<Outcome, Refusal>) {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            identity: identity.clone(),
            session: session.clone(),
            state,
            work,
            reply,
        };
        if let Err(r) = self.scheduler.submit(job) {
            return (None, Err(r));
        }
        match answer.await {
            Ok(Done { state, outcome }) => (state, outcome),
            Err(_) => (
                None,
                Err(Refusal::new(
                    Reason::InternalError,
                    "the scheduler dropped the round",
                )),
            ),
        }
    }
}

/// A store error as the refusal the device sees.
pub fn store_refusal(e: StoreError) -> Refusal {
    let reason = match e {
        StoreError::Unknown => Reason::SessionUnknown,
        StoreError::Evicted => Reason::SessionEvicted,
        StoreError::Forbidden => Reason::SessionForbidden,
        StoreError::Busy => Reason::SessionUnknown,
        StoreError::Full => Reason::TooManySessions,
        StoreError::Quota => Reason::QuotaExceeded,
        StoreError::TooLarge => Reason::ContextFull,
    };
    Refusal::new(reason, e.to_string())
}
