//! The device's conversation cache: what a conversation keeps between turns, so
//! that the next turn prefills only what is new (docs/edge.md "Conversations").
//!
//! A chat app sends the whole conversation every turn. Each finished generation
//! leaves behind the draft model's KV cache of its context and, when the verifier
//! kept its session (`Close.keep`), which session that is and the context it holds.
//! The next request takes that state back:
//!
//! 1. **Which entry.** A named conversation (`conversation_id` in serve-edge, a
//!    conversation handle in the C ABI) takes its own entry. An anonymous request
//!    takes the anonymous entry of its own client scope ([`Who::Anonymous`]: one
//!    identity, such as the holders of serve-edge's API key or one OS user on
//!    loopback) whose tokens share the longest prefix with its prompt, if that
//!    prefix covers at least half of the entry's tokens (a growing conversation
//!    covers all of them; two conversations that share only a system prompt do
//!    not steal each other's state). Another scope's entries are never matched:
//!    one client must not learn how much of its prompt another's shares, nor
//!    take its state.
//! 2. **Exact reuse.** The draft keeps `min(longest common prefix, prompt - 1)`
//!    positions of the entry's KV and prefills the rest: a turn whose earlier
//!    message was edited misses exactly from the edit. The verifier session is
//!    continued the same way (`Open.continuation`: the common prefix's length and
//!    digest, then only the tokens after it); a verifier that no longer holds it
//!    answers `CONTEXT_NOT_HELD` and the device resends the whole context.
//! 3. **Bounded.** The entries' draft KV bytes stay within `budget_mib`; the least
//!    recently used entry is dropped first (its verifier session then expires by
//!    the verifier's idle TTL). An entry is counted at the most positions its KV
//!    ever held, since RSS does not shrink when a cache is truncated, and at the
//!    whole memory pages those positions occupy in each of its buffers
//!    (`KvCache::resident_bytes`: for a short conversation the rounding is as
//!    large as its data). At most
//!    [`MAX_ENTRIES`] entries are kept whatever their size (each holds a cache's
//!    allocations: many tiny conversations must not add up unseen).
//! 4. **Caught up between turns.** A turn whose rounds lookup served leaves the
//!    draft's KV behind its context (the draft runs lazily). While the device is
//!    idle the host may run those rows through the draft
//!    (`EdgeRuntime::catch_up`): an entry is checked out
//!    ([`ConversationCache::check_out_behind`]), fed in small chunks and checked
//!    back in ([`ConversationCache::check_in`]). A request that wants a checked-out
//!    entry waits for it ([`SharedConversations::lock_when_free`]); a generation
//!    starting on any sibling runtime makes the catch-up yield after its current
//!    chunk ([`SharedConversations::running`]). The rows are the ones the next
//!    turn would have computed (same tokens, same positions; a row's result does
//!    not depend on the other rows of its forward), so nothing a turn proposes
//!    changes.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use tandem_model::kv_cache::KvCache;

/// `[conversations]` of the edge config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConversationConfig {
    /// Keep each conversation's draft KV between turns and reuse the longest
    /// common prefix of the next request.
    pub enabled: bool,
    /// Draft KV bytes all kept conversations may hold together, in MiB.
    pub budget_mib: u64,
    /// Ask the verifier to keep the session after a turn (`Close.keep`) and
    /// continue it on the next turn with only the new tokens.
    pub keep_verifier_sessions: bool,
    /// What a chat front end does with a conversation that no longer fits the
    /// context (`crate::context_policy`).
    pub context_policy: crate::context_policy::ContextPolicy,
    /// Let `EdgeRuntime::catch_up` run kept conversations' lagging context
    /// through the draft while the device is idle (serve-edge calls it when
    /// a generation slot has nothing queued; see the module doc, 4).
    pub catch_up: bool,
}

impl Default for ConversationConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            budget_mib: 64,
            keep_verifier_sessions: true,
            context_policy: Default::default(),
            catch_up: true,
        }
    }
}

impl ConversationConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.budget_mib > 1 << 20 {
            return Err(format!(
                "conversations.budget_mib must be at most 1048576 (1 TiB), got {}",
                self.budget_mib
            ));
        }
        Ok(())
    }
}

/// Most conversations kept at once (least recently used dropped first).
pub const MAX_ENTRIES: usize = 64;

/// A verifier session kept after a turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptSession {
    pub id: String,
    /// A prefix of the context the verifier holds for it (the device's context
    /// when the turn ended).
    pub context: Vec<u32>,
    /// The session-affinity key its streams carried (a load balancer keeps the
    /// conversation on the replica that holds it).
    pub affinity_key: String,
}

/// One conversation's state between turns.
#[derive(Debug)]
pub struct Kept {
    /// The draft's KV: holds `tokens[..cache.len()]`.
    pub cache: KvCache,
    /// The conversation's context when the turn ended.
    pub tokens: Vec<u32>,
    pub session: Option<KeptSession>,
    /// Most positions `cache` has held (what its RSS covers).
    pub high_water: usize,
    /// The last rows of `cache` that the idle catch-up computed since the
    /// turn ended (the next turn reports how many it reused).
    pub caught_up: usize,
}

impl Kept {
    /// What the entry's draft KV occupies: its cache's resident pages at the
    /// most positions it held (`KvCache::resident_bytes`).
    fn bytes(&self) -> u64 {
        self.cache.resident_bytes(self.high_water)
    }
}

/// Length of the longest common prefix of two token sequences.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Which kept state a request may take and leave.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Who<'a> {
    /// A named conversation: its own entry, whatever the prompt.
    Named(&'a str),
    /// An anonymous request of one client scope: the entries that scope left,
    /// found by prompt prefix.
    Anonymous { scope: &'a str },
    /// An anonymous request whose client has no known identity: it neither
    /// finds nor leaves state.
    Nobody,
}

/// Which entry: a named conversation, or an anonymous one (found by prefix
/// within its scope).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Key {
    Named(String),
    Anonymous { scope: String, n: u64 },
}

struct Entry {
    kept: Kept,
    last_used: u64,
    /// Checked out for the catch-up ([`ConversationCache::check_out_behind`]):
    /// `kept.cache` is a placeholder, and this is the real one's bytes
    /// ([`Kept::bytes`]; the budget still counts it).
    out: Option<u64>,
}

impl Entry {
    fn bytes(&self) -> u64 {
        self.out.unwrap_or_else(|| self.kept.bytes())
    }
}

/// A kept entry's draft KV checked out for the catch-up, with its context:
/// the rows `tokens[cache.len()..]` are missing. Goes back with
/// [`ConversationCache::check_in`].
pub struct CheckedOut {
    key: Key,
    pub cache: KvCache,
    pub tokens: Vec<u32>,
}

/// Counters of the cache since the runtime started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConversationStats {
    /// Requests that found an entry (named, or anonymous by prefix).
    pub hits: u64,
    pub misses: u64,
    /// Entries dropped to stay within the budget.
    pub evictions: u64,
    /// Entries held now, and their bytes.
    pub entries: usize,
    pub bytes: u64,
    /// Draft rows the idle catch-up computed, and the times it yielded to a
    /// request before it was done.
    #[serde(default)]
    pub caught_up_rows: u64,
    #[serde(default)]
    pub catch_up_yields: u64,
}

/// The kept conversations, bounded by a byte budget (LRU).
pub struct ConversationCache {
    /// `[conversations] enabled`: off, nothing is taken or kept.
    enabled: bool,
    budget_bytes: u64,
    entries: HashMap<Key, Entry>,
    clock: u64,
    next_anonymous: u64,
    stats: ConversationStats,
}

impl ConversationCache {
    pub fn new(cfg: &ConversationConfig) -> Self {
        Self {
            enabled: cfg.enabled,
            budget_bytes: cfg.budget_mib.saturating_mul(1 << 20),
            entries: HashMap::new(),
            clock: 0,
            next_anonymous: 0,
            stats: ConversationStats::default(),
        }
    }

    /// Whether a request of `who` may keep state.
    pub fn keeps(&self, who: Who<'_>) -> bool {
        self.enabled && who != Who::Nobody
    }

    /// Takes the state a request should continue from (see the module doc, 1):
    /// the named conversation's, or the best match for `prompt` among its
    /// scope's anonymous entries (none when the cache is disabled).
    pub fn take(&mut self, who: Who<'_>, prompt: &[u32]) -> Option<Kept> {
        if !self.keeps(who) {
            return None;
        }
        let found = self
            .find(who, prompt)
            .filter(|k| self.entries.get(k).is_some_and(|e| e.out.is_none()));
        match found.and_then(|k| self.entries.remove(&k)) {
            Some(e) => {
                self.stats.hits += 1;
                Some(e.kept)
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Whether [`Self::take`] would find state for a request of `who` with
    /// `prompt` (counts nothing).
    pub fn holds_state_for(&self, who: Who<'_>, prompt: &[u32]) -> bool {
        self.find(who, prompt).is_some()
    }

    /// Whether the entry a request of `who` with `prompt` would take is
    /// checked out for the catch-up (the request waits for it).
    pub fn busy_for(&self, who: Who<'_>, prompt: &[u32]) -> bool {
        self.find(who, prompt)
            .and_then(|k| self.entries.get(&k))
            .is_some_and(|e| e.out.is_some())
    }

    /// Checks out the most recently used entry whose draft KV lags its
    /// context (at most `capacity` positions), if the rows it lacks fit the
    /// budget without dropping another entry (the catch-up is idle work; it
    /// never evicts). The entry stays findable and counted; a request that
    /// wants it waits until it is checked back in.
    pub fn check_out_behind(&mut self, capacity: usize) -> Option<CheckedOut> {
        let (budget, used) = (self.budget_bytes, self.bytes());
        let key = self
            .entries
            .iter()
            .filter(|(_, e)| e.out.is_none())
            .filter(|(_, e)| e.kept.cache.len() < e.kept.tokens.len().min(capacity))
            .filter(|(_, e)| {
                let caught_up = e.kept.tokens.len().min(capacity).max(e.kept.high_water);
                let extra = e
                    .kept
                    .cache
                    .resident_bytes(caught_up)
                    .saturating_sub(e.kept.bytes());
                used.saturating_add(extra) <= budget
            })
            .max_by_key(|(_, e)| e.last_used)
            .map(|(k, _)| k.clone())?;
        let e = self.entries.get_mut(&key)?;
        e.out = Some(e.kept.bytes());
        let cache = std::mem::replace(&mut e.kept.cache, KvCache::new(0, 0, 0, 0));
        let mut tokens = e.kept.tokens.clone();
        tokens.truncate(capacity);
        Some(CheckedOut { key, cache, tokens })
    }

    /// Puts a checked-out cache back with the `rows` the catch-up added
    /// (`None`: the catch-up failed and the cache may be half-written; the
    /// entry is dropped). An entry dropped meanwhile (forgotten, evicted)
    /// stays dropped. `yielded`: the catch-up stopped for a request.
    pub fn check_in(
        &mut self,
        out: CheckedOut,
        cache: Option<KvCache>,
        rows: usize,
        yielded: bool,
    ) {
        self.stats.caught_up_rows += rows as u64;
        self.stats.catch_up_yields += u64::from(yielded);
        let Some(e) = self.entries.get_mut(&out.key).filter(|e| e.out.is_some()) else {
            return;
        };
        let Some(cache) = cache else {
            self.entries.remove(&out.key);
            return;
        };
        e.out = None;
        e.kept.high_water = e.kept.high_water.max(cache.len());
        e.kept.cache = cache;
        e.kept.caught_up += rows;
        self.shrink();
    }

    /// The entry a request of `who` with `prompt` continues (see the module
    /// doc, 1), if any.
    fn find(&self, who: Who<'_>, prompt: &[u32]) -> Option<Key> {
        if !self.keeps(who) {
            return None;
        }
        match who {
            Who::Nobody => None,
            Who::Named(n) => {
                Some(Key::Named(n.to_owned())).filter(|k| self.entries.contains_key(k))
            }
            Who::Anonymous { scope } => self
                .entries
                .iter()
                .filter(|(k, _)| matches!(k, Key::Anonymous { scope: s, .. } if s == scope))
                .map(|(k, e)| {
                    (
                        k,
                        common_prefix(&e.kept.tokens, prompt),
                        e.kept.tokens.len(),
                    )
                })
                .filter(|&(_, lcp, len)| lcp > 0 && lcp.saturating_mul(2) >= len)
                .max_by_key(|&(_, lcp, _)| lcp)
                .map(|(k, _, _)| k.clone()),
        }
    }

    /// Keeps a turn's state under its name (or as a new anonymous entry of
    /// its scope), then drops least recently used entries until the budget
    /// holds. An entry that alone exceeds the budget is not kept; nothing is
    /// kept when the cache is disabled or for [`Who::Nobody`].
    pub fn put(&mut self, who: Who<'_>, kept: Kept) {
        let key = match who {
            _ if !self.keeps(who) => return,
            Who::Nobody => return,
            Who::Named(n) => Key::Named(n.to_owned()),
            Who::Anonymous { scope } => {
                self.next_anonymous = self.next_anonymous.wrapping_add(1);
                Key::Anonymous {
                    scope: scope.to_owned(),
                    n: self.next_anonymous,
                }
            }
        };
        self.clock = self.clock.wrapping_add(1);
        self.entries.insert(
            key,
            Entry {
                kept,
                last_used: self.clock,
                out: None,
            },
        );
        self.shrink();
    }

    /// Drops least recently used entries until the budget and the entry
    /// count hold.
    fn shrink(&mut self) {
        while self.bytes() > self.budget_bytes || self.entries.len() > MAX_ENTRIES {
            let Some(lru) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            self.entries.remove(&lru);
            self.stats.evictions += 1;
        }
    }

    /// Drops a named conversation's state; false when there was none.
    pub fn forget(&mut self, name: &str) -> bool {
        self.entries.remove(&Key::Named(name.to_owned())).is_some()
    }

    fn bytes(&self) -> u64 {
        self.entries
            .values()
            .fold(0u64, |s, e| s.saturating_add(e.bytes()))
    }

    pub fn stats(&self) -> ConversationStats {
        ConversationStats {
            entries: self.entries.len(),
            bytes: self.bytes(),
            ..self.stats
        }
    }
}

/// The kept conversations of a runtime and its siblings, with what the idle
/// catch-up needs to stay out of a request's way (see the module doc, 4).
pub struct SharedConversations {
    cache: Mutex<ConversationCache>,
    /// Signalled when a checked-out entry comes back.
    returned: Condvar,
    /// Generations running now on the runtimes that share this cache.
    running: AtomicUsize,
}

/// Counts a running generation until dropped ([`SharedConversations::enter`]).
pub struct Running<'a>(&'a SharedConversations);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl SharedConversations {
    pub fn new(cfg: &ConversationConfig) -> Self {
        Self {
            cache: Mutex::new(ConversationCache::new(cfg)),
            returned: Condvar::new(),
            running: AtomicUsize::new(0),
        }
    }

    /// The cache (locked while the guard lives: take it only to take, put or
    /// check out an entry). A panic while holding it cannot leave the cache
    /// inconsistent (its methods complete their updates): a poisoned lock is
    /// taken as it is.
    pub fn lock(&self) -> MutexGuard<'_, ConversationCache> {
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cache, once the entry a request of `who` with `prompt` would take
    /// is not checked out (the catch-up yields after its current chunk,
    /// since the caller counts as running: [`Self::enter`]).
    pub fn lock_when_free(
        &self,
        who: Who<'_>,
        prompt: &[u32],
    ) -> MutexGuard<'_, ConversationCache> {
        let mut g = self.lock();
        while g.busy_for(who, prompt) {
            g = self
                .returned
                .wait(g)
                .unwrap_or_else(PoisonError::into_inner);
        }
        g
    }

    /// Checks a cache back in ([`ConversationCache::check_in`]) and wakes the
    /// requests waiting for it.
    pub fn check_in(&self, out: CheckedOut, cache: Option<KvCache>, rows: usize, yielded: bool) {
        self.lock().check_in(out, cache, rows, yielded);
        self.returned.notify_all();
    }

    /// Counts a generation as running until the guard is dropped.
    pub fn enter(&self) -> Running<'_> {
        self.running.fetch_add(1, Ordering::SeqCst);
        Running(self)
    }

    /// Generations running now on the runtimes sharing this cache.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_model::kv_cache::KvPrecision;

    fn kept(tokens: &[u32], positions: usize) -> Kept {
        // 1 layer, 1 head of 8 floats: 64 bytes per position.
        // One f32 row of 4 KiB per buffer: 8 KiB a position, whole pages.
        let cache = KvCache::new(1, 1, 1024, 64);
        Kept {
            cache,
            tokens: tokens.to_vec(),
            session: None,
            high_water: positions,
            caught_up: 0,
        }
    }

    const ANON: Who<'static> = Who::Anonymous { scope: "uid:1000" };
    /// Bytes a position of [`kept`]'s cache occupies.
    const POSITION: u64 = 8192;

    #[test]
    fn an_entry_is_counted_at_the_pages_its_positions_occupy() {
        // 8 floats a row: 3 positions write 96 B of each of the two
        // buffers, which occupy a page each.
        let mut c = cache(1 << 20);
        let mut k = kept(&[1, 2, 3], 3);
        k.cache = KvCache::new(1, 1, 8, 64);
        c.put(Who::Named("small"), k);
        assert_eq!(c.stats().bytes, 2 * 4096);
        // INT8: values and scales are buffers of their own.
        let int8 = KvCache::with_precision(2, 2, 64, 4096, KvPrecision::Int8);
        assert_eq!(int8.resident_bytes(0), 0);
        assert_eq!(int8.resident_bytes(1), 2 * 2 * 2 * 4096);
        // 33 positions: 33 · 128 B of values (2 pages), 33 · 8 B of scales.
        assert_eq!(int8.resident_bytes(33), 2 * 2 * (2 + 1) * 4096);
        // Never past the capacity.
        assert_eq!(int8.resident_bytes(1 << 40), int8.resident_bytes(4096));
    }

    fn cache(budget_bytes: u64) -> ConversationCache {
        let mut c = ConversationCache::new(&ConversationConfig::default());
        c.budget_bytes = budget_bytes;
        c
    }

    #[test]
    fn anonymous_requests_find_the_conversation_they_continue() {
        let mut c = cache(1 << 20);
        c.put(ANON, kept(&[1, 2, 3, 4], 4));
        c.put(ANON, kept(&[1, 9, 9, 9], 4));
        // Shares all four tokens with the first entry: a hit, and that entry.
        let k = c.take(ANON, &[1, 2, 3, 4, 5, 6]).expect("hit");
        assert_eq!(k.tokens, vec![1, 2, 3, 4]);
        // Shares only the first token (a common system prompt) with the other:
        // not enough to take it.
        assert!(c.take(ANON, &[1, 5, 5, 5, 5]).is_none());
        assert_eq!(c.stats().hits, 1);
        assert_eq!(c.stats().misses, 1);
        assert_eq!(c.stats().entries, 1);
    }

    #[test]
    fn anonymous_scopes_never_see_each_other_and_nobody_keeps_nothing() {
        let mut c = cache(1 << 20);
        c.put(ANON, kept(&[1, 2, 3, 4], 4));
        let other = Who::Anonymous { scope: "uid:1001" };
        assert!(c.take(other, &[1, 2, 3, 4, 5]).is_none());
        assert!(c.take(Who::Nobody, &[1, 2, 3, 4, 5]).is_none());
        c.put(Who::Nobody, kept(&[7, 7], 2));
        assert_eq!(c.stats().entries, 1, "Nobody leaves nothing");
        assert!(c.take(ANON, &[1, 2, 3, 4, 5]).is_some());
    }

    #[test]
    fn holds_state_for_answers_as_take_finds_and_counts_nothing() {
        let mut c = cache(1 << 20);
        c.put(ANON, kept(&[1, 2, 3, 4], 4));
        c.put(Who::Named("a"), kept(&[1, 2], 2));
        assert!(c.holds_state_for(ANON, &[1, 2, 3, 4, 5]));
        assert!(!c.holds_state_for(ANON, &[1, 5, 5, 5, 5]));
        assert!(c.holds_state_for(Who::Named("a"), &[9]));
        assert!(!c.holds_state_for(Who::Named("b"), &[1, 2]));
        assert!(!c.holds_state_for(Who::Nobody, &[1, 2, 3, 4]));
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.entries), (0, 0, 2));
    }

    #[test]
    fn named_conversations_are_taken_by_name_only() {
        let mut c = cache(1 << 20);
        c.put(Who::Named("a"), kept(&[1, 2, 3], 3));
        assert!(c.take(ANON, &[1, 2, 3, 4]).is_none());
        assert!(c.take(Who::Named("b"), &[1, 2, 3, 4]).is_none());
        let k = c
            .take(Who::Named("a"), &[7])
            .expect("by name, whatever the prefix");
        assert_eq!(k.tokens, vec![1, 2, 3]);
        c.put(Who::Named("a"), k);
        assert!(c.forget("a"));
        assert!(!c.forget("a"));
    }

    #[test]
    fn the_budget_drops_least_recently_used_entries() {
        // 8 KiB per position: room for 10 positions.
        let mut c = cache(10 * POSITION);
        c.put(Who::Named("old"), kept(&[1], 4));
        c.put(Who::Named("mid"), kept(&[2], 4));
        assert_eq!(c.stats().bytes, 8 * POSITION);
        c.put(Who::Named("new"), kept(&[3], 4));
        let s = c.stats();
        assert_eq!((s.entries, s.evictions, s.bytes), (2, 1, 8 * POSITION));
        assert!(c.take(Who::Named("old"), &[1]).is_none());
        // Taking and putting back makes an entry the most recent.
        let mid = c.take(Who::Named("mid"), &[2]).expect("mid");
        c.put(Who::Named("mid"), mid);
        c.put(Who::Named("newer"), kept(&[4], 4));
        assert!(c.take(Who::Named("new"), &[3]).is_none());
        assert!(c.take(Who::Named("mid"), &[2]).is_some());
        // Alone larger than the budget: not kept.
        c.put(Who::Named("huge"), kept(&[5], 11));
        assert!(c.take(Who::Named("huge"), &[5]).is_none());
    }

    #[test]
    fn the_number_of_entries_is_capped() {
        let mut c = cache(u64::MAX);
        for i in 0..MAX_ENTRIES + 5 {
            c.put(Who::Named(&format!("c{i}")), kept(&[1], 1));
        }
        let s = c.stats();
        assert_eq!((s.entries, s.evictions), (MAX_ENTRIES, 5));
        // The oldest went first.
        assert!(c.take(Who::Named("c0"), &[1]).is_none());
        assert!(c
            .take(Who::Named(&format!("c{}", MAX_ENTRIES + 4)), &[1])
            .is_some());
    }

    #[test]
    fn a_checked_out_entry_is_waited_for_counted_and_never_grown_past_the_budget() {
        // 8 KiB per position: room for 10 positions.
        let mut c = cache(10 * POSITION);
        c.put(Who::Named("a"), kept(&[1, 2, 3, 4, 5, 6], 0));
        let out = c.check_out_behind(64).expect("behind by 6 rows");
        assert_eq!(out.tokens, vec![1, 2, 3, 4, 5, 6]);
        // Findable (a request waits for it), not taken, not offered twice.
        assert!(c.busy_for(Who::Named("a"), &[1]));
        assert!(c.holds_state_for(Who::Named("a"), &[1]));
        assert!(c.take(Who::Named("a"), &[1]).is_none());
        assert!(c.check_out_behind(64).is_none());
        // Back with 6 rows: no longer behind, counted at its new size.
        let cache6 = {
            let mut k = KvCache::new(1, 1, 1024, 64);
            let rows = vec![0.0; 6 * 1024];
            tandem_model::kv_cache::KvStore::append(&mut k, 0, 0, &rows, &rows);
            k
        };
        c.check_in(out, Some(cache6), 6, false);
        assert!(!c.busy_for(Who::Named("a"), &[1]));
        assert!(c.check_out_behind(64).is_none());
        let s = c.stats();
        assert_eq!((s.caught_up_rows, s.bytes), (6, 6 * POSITION));
        let k = c
            .take(Who::Named("a"), &[1, 2, 3, 4, 5, 6, 7])
            .expect("back");
        assert_eq!((k.cache.len(), k.caught_up, k.high_water), (6, 6, 6));
        c.put(Who::Named("a"), k);
        // 6 + 5 positions would pass the budget: never checked out.
        c.put(Who::Named("b"), kept(&[1, 2, 3, 4, 5], 0));
        assert!(c.check_out_behind(64).is_none());
        // Forgotten while out: stays forgotten.
        c.forget("a");
        let out = c.check_out_behind(64).expect("b fits now");
        assert!(c.forget("b"));
        c.check_in(out, Some(KvCache::new(1, 1, 1024, 64)), 0, true);
        assert_eq!(c.stats().entries, 0);
        assert_eq!(c.stats().catch_up_yields, 1);
    }

    #[test]
    fn common_prefix_stops_at_the_first_difference() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 3]), 2);
    }
}
