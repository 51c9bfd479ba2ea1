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
}

impl VerifierState {
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
        loop {
            let mut store = self.store();
            let quota = store.limits().max_bytes_per_identity;
            let (_, held) = store.usage(owner);
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
