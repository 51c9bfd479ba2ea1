//! The bounded session store: sessions under a byte budget (KV pages actually
//! held), a session cap, per-identity quotas and an idle TTL, evicted
//! least-recently-used first (the caller's own idle sessions before anyone
//! else's).
//!
//! A round *checks out* a session's state (so the forward runs without the
//! store's lock) and checks it back in; checked-out sessions are never evicted.
//! [`CheckedOut`] is the drop guard around that: dropped, it checks the state
//! back in (removal is asked for explicitly); while the state is out on the
//! scheduler a [`Lent`] guard stands in, and if the round's task dies
//! (panic, cancelled stream) the entry is removed instead of staying checked
//! out forever.

use crate::lock::lock;
use crate::session::SessionState;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Limits of the store.
#[derive(Debug, Clone, Copy)]
pub struct StoreLimits {
    pub max_sessions: usize,
    pub budget_bytes: u64,
    pub idle_ttl: Duration,
    /// Most sessions one identity holds.
    pub max_sessions_per_identity: usize,
    /// Most bytes one identity's sessions hold.
    pub max_bytes_per_identity: u64,
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
    #[error("this identity's session or byte quota is used by sessions that are not idle")]
    Quota,
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

    pub fn limits(&self) -> &StoreLimits {
        &self.limits
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

    /// `(sessions, bytes)` held by `owner`.
    pub fn usage(&self, owner: &str) -> (usize, u64) {
        self.entries
            .values()
            .filter(|e| e.owner == owner)
            .fold((0, 0), |(n, b), e| (n + 1, b.saturating_add(e.bytes)))
    }

    /// Sessions per identity (identities are the configured devices: a bounded set).
    pub fn sessions_per_identity(&self) -> Vec<(String, usize)> {
        let mut m: HashMap<&str, usize> = HashMap::new();
        for e in self.entries.values() {
            *m.entry(e.owner.as_str()).or_default() += 1;
        }
        let mut v: Vec<(String, usize)> = m.into_iter().map(|(k, n)| (k.to_owned(), n)).collect();
        v.sort();
        v
    }

    /// Adds a session; evicts idle sessions (the owner's own first, then LRU)
    /// to respect the per-identity and global limits. Returns the epoch.
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
        while self.usage(&owner).0 >= self.limits.max_sessions_per_identity {
            if !self.evict_lru(Some(&owner), None) {
                return Err(StoreError::Quota);
            }
        }
        while self.entries.len() >= self.limits.max_sessions {
            if !self.evict_lru(Some(&owner), None) && !self.evict_lru(None, None) {
                return Err(StoreError::Full);
            }
        }
        self.entries.insert(
            id.clone(),
            Entry {
                owner: owner.clone(),
                state: Some(state),
                bytes,
                last_used: now,
                epoch: 0,
            },
        );
        self.total_bytes = self.total_bytes.saturating_add(bytes);
        self.enforce_budget(&id, &owner);
        Ok(0)
    }

    /// Evicts one idle session to free memory for `owner` (its own first, then
    /// anyone's least recently used; never `keep`). False when none is idle.
    pub fn make_room(&mut self, owner: &str, keep: Option<&str>) -> bool {
        self.expire(Instant::now());
        self.evict_lru(Some(owner), keep) || self.evict_lru(None, keep)
    }

    /// Evicts one of `owner`'s own idle sessions (never `keep`).
    pub fn evict_own(&mut self, owner: &str, keep: Option<&str>) -> bool {
        self.evict_lru(Some(owner), keep)
    }

    /// Takes a session's state out for a round. `epoch` must be the one the
    /// caller got (a stream that was superseded gets `Unknown`).
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
        e.epoch = e.epoch.wrapping_add(1);
        Ok((st, e.epoch))
    }

    /// Puts a state back after a round; enforces the budget and the owner's
    /// byte quota (never evicting this session). A session removed meanwhile is
    /// dropped (its pages go back to the pool).
    pub fn checkin(&mut self, id: &str, state: SessionState) {
        let Some(e) = self.entries.get_mut(id) else {
            return;
        };
        let bytes = state.bytes();
        self.total_bytes = self
            .total_bytes
            .saturating_sub(e.bytes)
            .saturating_add(bytes);
        e.bytes = bytes;
        e.state = Some(state);
        e.last_used = Instant::now();
        let owner = e.owner.clone();
        self.enforce_budget(id, &owner);
    }

    /// Removes a session (Close, or a round that failed) when `owner` and
    /// `epoch` match. Returns its state if it was not checked out.
    pub fn remove(&mut self, id: &str, owner: &str, epoch: u64) -> Option<SessionState> {
        match self.entries.get(id) {
            Some(e) if e.owner == owner && e.epoch == epoch => {}
            _ => return None,
        }
        let e = self.entries.remove(id)?;
        self.total_bytes = self.total_bytes.saturating_sub(e.bytes);
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

    /// Evicts a specific idle session (tests and admin use; also the LRU policy).
    pub fn evict(&mut self, id: &str) -> bool {
        match self.entries.get(id) {
            Some(e) if e.state.is_some() => {}
            _ => return false,
        }
        if let Some(e) = self.entries.remove(id) {
            self.total_bytes = self.total_bytes.saturating_sub(e.bytes);
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

    /// Evicts the least recently used idle session (of `owner` only, when
    /// given), never `keep`.
    fn evict_lru(&mut self, owner: Option<&str>, keep: Option<&str>) -> bool {
        let victim = self
            .entries
            .iter()
            .filter(|(k, e)| {
                e.state.is_some() && Some(k.as_str()) != keep && owner.is_none_or(|o| e.owner == o)
            })
            .min_by_key(|(_, e)| e.last_used)
            .map(|(k, _)| k.clone());
        match victim {
            Some(v) => self.evict(&v),
            None => false,
        }
    }

    fn enforce_budget(&mut self, keep: &str, owner: &str) {
        while self.usage(owner).1 > self.limits.max_bytes_per_identity {
            if !self.evict_lru(Some(owner), Some(keep)) {
                break;
            }
        }
        while self.total_bytes > self.limits.budget_bytes {
            if !self.evict_lru(None, Some(keep)) {
                break;
            }
        }
    }
}

/// A checked-out session and its state. Dropped, it checks the state back in
/// ([`SessionStore::checkin`]): every early return of a handler puts the
/// session back as it is. The other outcome is set explicitly with
/// [`remove`](Self::remove); a guard dropped while its thread panics removes
/// the session too (its state may be half-updated).
///
/// To run the state on the scheduler, [`lend`](Self::lend) moves it out and
/// leaves a [`Lent`] guard, which removes the entry when dropped without the
/// state coming back (the round's task was cancelled or the state was lost):
/// the device's next message gets SESSION_UNKNOWN and re-sends its context.
pub struct CheckedOut<'a> {
    slot: Slot<'a>,
    /// `Some` from construction until `lend` or drop (both consume the guard).
    state: Option<SessionState>,
}

/// A session's state out on the scheduler (see [`CheckedOut::lend`]).
pub struct Lent<'a> {
    slot: Slot<'a>,
    /// Set once the state came back ([`Lent::restore`]) or the entry was removed.
    resolved: bool,
}

/// Where a checked-out state belongs.
struct Slot<'a> {
    store: &'a Mutex<SessionStore>,
    id: String,
    owner: String,
    epoch: u64,
}

impl Slot<'_> {
    /// This slot's contents, leaving an empty one behind (in a guard that is
    /// being consumed).
    fn take(&mut self) -> Self {
        Slot {
            store: self.store,
            id: std::mem::take(&mut self.id),
            owner: std::mem::take(&mut self.owner),
            epoch: self.epoch,
        }
    }

    fn remove(&self) {
        lock(self.store).remove(&self.id, &self.owner, self.epoch);
    }
}

impl<'a> CheckedOut<'a> {
    /// Checks `id` out of `store`.
    pub fn take(
        store: &'a Mutex<SessionStore>,
        id: &str,
        owner: &str,
        epoch: u64,
    ) -> Result<Self, StoreError> {
        let st = lock(store).checkout(id, owner, epoch)?;
        Ok(Self::guard(store, id, owner, epoch, st))
    }

    /// Takes `id` over for a new stream ([`SessionStore::take_over`]).
    pub fn take_over(
        store: &'a Mutex<SessionStore>,
        id: &str,
        owner: &str,
    ) -> Result<Self, StoreError> {
        let (st, epoch) = lock(store).take_over(id, owner)?;
        Ok(Self::guard(store, id, owner, epoch, st))
    }

    fn guard(
        store: &'a Mutex<SessionStore>,
        id: &str,
        owner: &str,
        epoch: u64,
        state: SessionState,
    ) -> Self {
        let slot = Slot {
            store,
            id: id.to_owned(),
            owner: owner.to_owned(),
            epoch,
        };
        Self {
            slot,
            state: Some(state),
        }
    }

    pub fn epoch(&self) -> u64 {
        self.slot.epoch
    }

    /// Moves the state out (to run it on the scheduler); the [`Lent`] guard
    /// takes it back.
    pub fn lend(mut self) -> (Lent<'a>, SessionState) {
        let Some(state) = self.state.take() else {
            unreachable!("a CheckedOut holds its state until it is consumed")
        };
        let lent = Lent {
            slot: self.slot.take(),
            resolved: false,
        };
        (lent, state)
    }

    /// The session's outcome is removal (its state is dropped here and its
    /// pages go back to the pool).
    pub fn remove(mut self) {
        self.state = None;
        self.slot.remove();
    }
}

impl std::ops::Deref for CheckedOut<'_> {
    type Target = SessionState;
    fn deref(&self) -> &SessionState {
        match &self.state {
            Some(s) => s,
            None => unreachable!("a CheckedOut holds its state until it is consumed"),
        }
    }
}

impl std::ops::DerefMut for CheckedOut<'_> {
    fn deref_mut(&mut self) -> &mut SessionState {
        match &mut self.state {
            Some(s) => s,
            None => unreachable!("a CheckedOut holds its state until it is consumed"),
        }
    }
}

impl Drop for CheckedOut<'_> {
    fn drop(&mut self) {
        let Some(st) = self.state.take() else {
            return;
        };
        if std::thread::panicking() {
            tracing::warn!(session = %self.slot.id, "handler panicked; session removed");
            self.slot.remove();
        } else {
            lock(self.slot.store).checkin(&self.slot.id, st);
        }
    }
}

impl<'a> Lent<'a> {
    /// The state is back: a guard that checks it in when dropped.
    pub fn restore(mut self, state: SessionState) -> CheckedOut<'a> {
        self.resolved = true;
        CheckedOut {
            slot: self.slot.take(),
            state: Some(state),
        }
    }

    /// The state is lost or in doubt: the session is removed.
    pub fn remove(mut self) {
        self.resolved = true;
        self.slot.remove();
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        if !self.resolved {
            tracing::warn!(session = %self.slot.id, "round ended without its state; session removed");
            self.slot.remove();
        }
    }
}
