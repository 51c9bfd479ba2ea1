//! The bounded session store: per-session target KV caches under a byte budget, a
//! session cap and an idle TTL, evicted least-recently-used first.
//!
//! A verify *checks out* a session's state (so the forward pass runs without the
//! store's lock) and checks it back in; checked-out sessions are never evicted.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};
use tandem_model::kv_cache::KvCache;
use tandem_model::sampling::{Sampler, SamplingParams};

/// One session's verifier-side state.
pub struct SessionState {
    /// Target KV cache: holds `context[..context.len() - 1]`.
    pub cache: KvCache,
    /// Whole context (prompt + emitted tokens); the last one is `last`.
    pub context: Vec<u32>,
    pub sampling: SamplingParams,
    pub rng: Sampler,
    /// Round number the next Draft must carry.
    pub next_round: u64,
    /// Rounds verified so far.
    pub rounds: u64,
    /// Split execution: the device runs layers `[0, split.layer)`; `None` = whole
    /// target here. In U-shape sessions `context` holds placeholders (the verifier
    /// never sees token ids), only its length is meaningful.
    pub split: Option<crate::split::SplitSpec>,
}

impl SessionState {
    /// Bytes this session holds: used KV rows plus the context ids.
    pub fn bytes(&self) -> u64 {
        (self.cache.len() * self.cache.bytes_per_token() + self.context.len() * 4) as u64
    }
}

/// Limits of the store.
#[derive(Debug, Clone, Copy)]
pub struct StoreLimits {
    pub max_sessions: usize,
    pub budget_bytes: u64,
    pub idle_ttl: Duration,
}

/// Why a session could not be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("unknown session")]
    Unknown,
    #[error("session was evicted")]
    Evicted,
    #[error("session belongs to another identity")]
    Forbidden,
    #[error("session is busy (driven by another stream)")]
    Busy,
    #[error("session limit reached and no idle session can be evicted")]
    Full,
    #[error("session alone exceeds the store's byte budget")]
    TooLarge,
}

struct Entry {
    owner: String,
    /// `None` while checked out.
    state: Option<SessionState>,
    bytes: u64,
    last_used: Instant,
    /// Bumped when another stream takes the session over.
    epoch: u64,
}

/// Bounded map from session id to state.
pub struct SessionStore {
    limits: StoreLimits,
    entries: HashMap<String, Entry>,
    total_bytes: u64,
    /// Recently evicted ids, to answer SESSION_EVICTED rather than SESSION_UNKNOWN.
    evicted: HashSet<String>,
    evicted_order: VecDeque<String>,
    evictions: u64,
}

const TOMBSTONES: usize = 4096;

impl SessionStore {
    pub fn new(limits: StoreLimits) -> Self {
        Self {
            limits,
            entries: HashMap::new(),
            total_bytes: 0,
            evicted: HashSet::new(),
            evicted_order: VecDeque::new(),
            evictions: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes held by all sessions (as of their last check-in).
    pub fn bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Sessions evicted since start.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Adds a session; evicts idle sessions (LRU) to respect the limits.
    /// Returns the session's epoch.
    pub fn insert(
        &mut self,
        id: String,
        owner: String,
        state: SessionState,
    ) -> Result<u64, StoreError> {
        let now = Instant::now();
        self.expire(now);
        let bytes = state.bytes();
        if bytes > self.limits.budget_bytes {
            return Err(StoreError::TooLarge);
        }
        while self.entries.len() >= self.limits.max_sessions {
            if !self.evict_lru(None) {
                return Err(StoreError::Full);
            }
        }
        self.entries.insert(
            id.clone(),
            Entry {
                owner,
                state: Some(state),
                bytes,
                last_used: now,
                epoch: 0,
            },
        );
        self.total_bytes += bytes;
        self.enforce_budget(&id);
        Ok(0)
    }

    /// Takes a session's state out for a verify. `epoch` must be the one the caller
    /// got (a stream that was superseded gets `Unknown`).
    pub fn checkout(
        &mut self,
        id: &str,
        owner: &str,
        epoch: u64,
    ) -> Result<SessionState, StoreError> {
        let now = Instant::now();
        self.expire(now);
        let Some(e) = self.entries.get_mut(id) else {
            return Err(if self.evicted.contains(id) {
                StoreError::Evicted
            } else {
                StoreError::Unknown
            });
        };
        if e.owner != owner {
            return Err(StoreError::Forbidden);
        }
        if e.epoch != epoch {
            return Err(StoreError::Unknown);
        }
        let st = e.state.take().ok_or(StoreError::Busy)?;
        e.last_used = now;
        Ok(st)
    }

    /// Takes a session over for a new stream (resume): bumps its epoch and checks its
    /// state out. Returns `(state, new_epoch)`.
    pub fn take_over(&mut self, id: &str, owner: &str) -> Result<(SessionState, u64), StoreError> {
        let epoch = match self.entries.get(id) {
            Some(e) => e.epoch,
            None => return self.checkout(id, owner, 0).map(|s| (s, 0)),
        };
        let st = self.checkout(id, owner, epoch)?;
        let e = self.entries.get_mut(id).ok_or(StoreError::Unknown)?;
        e.epoch += 1;
        Ok((st, e.epoch))
    }

    /// Puts a state back after a verify; enforces the byte budget (never evicting
    /// this session). A session removed meanwhile is dropped.
    pub fn checkin(&mut self, id: &str, state: SessionState) {
        let Some(e) = self.entries.get_mut(id) else {
            return;
        };
        let bytes = state.bytes();
        self.total_bytes = self.total_bytes - e.bytes + bytes;
        e.bytes = bytes;
        e.state = Some(state);
        e.last_used = Instant::now();
        self.enforce_budget(id);
    }

    /// Removes a session (Close). Returns its state if it was not checked out.
    pub fn remove(&mut self, id: &str) -> Option<SessionState> {
        let e = self.entries.remove(id)?;
        self.total_bytes -= e.bytes;
        e.state
    }

    /// Evicts idle sessions past the TTL.
    pub fn expire(&mut self, now: Instant) {
        let ttl = self.limits.idle_ttl;
        let old: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| e.state.is_some() && now.duration_since(e.last_used) > ttl)
            .map(|(k, _)| k.clone())
            .collect();
        for id in old {
            self.evict(&id);
        }
    }

    /// Evicts a specific session (tests and admin use; also the LRU policy).
    pub fn evict(&mut self, id: &str) -> bool {
        match self.entries.get(id) {
            Some(e) if e.state.is_some() => {}
            _ => return false,
        }
        if let Some(e) = self.entries.remove(id) {
            self.total_bytes -= e.bytes;
            self.evictions += 1;
            tracing::info!(session = %id, "session evicted");
            if self.evicted.insert(id.to_owned()) {
                self.evicted_order.push_back(id.to_owned());
                if self.evicted_order.len() > TOMBSTONES {
                    if let Some(x) = self.evicted_order.pop_front() {
                        self.evicted.remove(&x);
                    }
                }
            }
        }
        true
    }

    fn evict_lru(&mut self, keep: Option<&str>) -> bool {
        let victim = self
            .entries
            .iter()
            .filter(|(k, e)| e.state.is_some() && Some(k.as_str()) != keep)
            .min_by_key(|(_, e)| e.last_used)
            .map(|(k, _)| k.clone());
        match victim {
            Some(v) => self.evict(&v),
            None => false,
        }
    }

    fn enforce_budget(&mut self, keep: &str) {
        while self.total_bytes > self.limits.budget_bytes {
            if !self.evict_lru(Some(keep)) {
                break;
            }
        }
    }
}
