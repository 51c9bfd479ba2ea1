//! What proposes the tokens of a speculative round.
//!
//! Any proposal is safe: the target verifies every token, so a proposer changes
//! how many tokens a round yields, never which tokens (greedy output is the
//! target's own, and sampled output the target's own for the seed: keyed
//! draws, [`crate::verify`]).
//!
//! - [`ProposerKind::Draft`]: the draft model, token by token.
//! - [`ProposerKind::Lookup`]: prompt lookup. The longest suffix of the history
//!   (n = [`MAX_NGRAM`] down to [`MIN_NGRAM`] tokens) that occurred before is
//!   looked up in an [`NgramIndex`] (O(1) per token to maintain and per lookup,
//!   no rescan), and the tokens that followed its latest occurrence are
//!   proposed. Costs no model forward.
//! - [`ProposerKind::Auto`]: per round, whichever of lookup, the draft model
//!   and no proposal (a plain target step) promises the most tokens per
//!   second, from running acceptance estimates per proposer and measured
//!   forward times ([`AutoChooser`]). The draft's cache is filled lazily, so a
//!   generation that lookup serves never pays for the draft's prefill.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::verify::MAX_K;
use crate::{ModelError, Result};

/// Longest suffix looked up.
pub const MAX_NGRAM: usize = 4;
/// Shortest suffix looked up (one token matches too often to pay).
pub const MIN_NGRAM: usize = 2;

/// Most tokens over which `auto` spreads the draft's catch-up cost
/// ([`AutoChooser::choose`]).
pub const AMORTIZE_TOKENS: usize = 64;
/// How much better than the best alternative a draft round that still owes
/// a catch-up must look ([`AutoChooser::choose`]): the catch-up is a sunk
/// cost and the estimates behind the comparison are rough. Without it auto
/// paid a 3.2–3.5 s catch-up of a 330-token editing prompt over `fast-4g`
/// for a draft round that looked 2–4 % better than a plain step, and ended
/// 17 % below lookup on those prompts; spreading the catch-up over half the
/// horizon instead cost 16 % on short general prompts, where the draft's
/// advantage is 30–40 % (docs/benchmarks.md).
pub const CATCH_UP_MARGIN: f64 = 1.15;

/// An untimed draft token, in one-row target forwards ([`AutoChooser`]).
pub const DRAFT_TOKEN: f64 = 0.45;
/// An untimed draft prefill token, in draft tokens ([`AutoChooser`]).
pub const PREFILL_TOKEN: f64 = 0.4;
/// What one more verified row adds to a target forward, in one-row forwards.
pub const EXTRA_ROW: f64 = 0.3;
/// What one more row adds to the nearest measured target forward when a
/// longer block was never measured: optimistic (half of [`EXTRA_ROW`]), so
/// that `auto` tries the longer block once and then prices it from its
/// measured time. With the realistic price it kept to the lengths it had
/// measured first (measured on this machine: c(5) = 1.93 one-row forwards,
/// priced 2.2 unmeasured, so four-token lookup blocks never got tried).
pub const EXPLORE_ROW: f64 = 0.15;
/// Priors of the per-position acceptance estimates ([`PositionAcceptance`]):
/// lookup's first position, its later ones, and the draft model's.
const LOOKUP_FIRST_PRIOR: f64 = 0.6;
const LOOKUP_LATER_PRIOR: f64 = 0.8;
const DRAFT_PRIOR: f64 = 0.7;
/// Prior share of rounds in which lookup offers nothing ([`AutoChooser`]).
const NO_OFFER_PRIOR: f64 = 0.5;

/// A target forward of `rows` rows in one-row forwards, untimed.
fn rows_factor(rows: usize) -> f64 {
    1.0 + EXTRA_ROW * rows.saturating_sub(1) as f64
}

/// Which proposer drafts the speculative rounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProposerKind {
    /// The draft model (the default).
    #[default]
    Draft,
    /// Prompt lookup (no model).
    Lookup,
    /// Per round: lookup, the draft model, or no proposal.
    Auto,
}

impl ProposerKind {
    pub const ALL: [ProposerKind; 3] = [Self::Draft, Self::Lookup, Self::Auto];

    pub fn name(self) -> &'static str {
        match self {
            Self::Draft => "draft",
            Self::Lookup => "lookup",
            Self::Auto => "auto",
        }
    }
}

impl std::fmt::Display for ProposerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ProposerKind {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| {
                ModelError::InvalidArgument(format!(
                    "unknown proposer {s:?} (expected draft, lookup or auto)"
                ))
            })
    }
}

/// Where one round's proposal came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Draft,
    Lookup,
    /// No proposal: the round is one target step.
    Nothing,
}

/// The n-grams of a growing token history, each mapped to where the tokens
/// after its latest occurrence begin.
#[derive(Clone, Debug, Default)]
pub struct NgramIndex {
    /// `maps[n - MIN_NGRAM]`: n tokens (zero-padded) → index of the token
    /// that followed their latest occurrence.
    maps: [HashMap<[u32; MAX_NGRAM], usize>; MAX_NGRAM - MIN_NGRAM + 1],
    /// Length of the history prefix indexed so far.
    indexed: usize,
}

fn key(tokens: &[u32]) -> [u32; MAX_NGRAM] {
    let mut k = [0; MAX_NGRAM];
    k[..tokens.len()].copy_from_slice(tokens);
    k
}

impl NgramIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Index `history[self.indexed..]` (`history` must extend what was
    /// indexed before). An n-gram is indexed once the token after it exists,
    /// so a lookup never finds the suffix it looks for.
    pub fn extend(&mut self, history: &[u32]) {
        for i in self.indexed.max(1)..history.len() {
            for n in MIN_NGRAM..=MAX_NGRAM.min(i) {
                self.maps[n - MIN_NGRAM].insert(key(&history[i - n..i]), i);
            }
        }
        self.indexed = self.indexed.max(history.len());
    }

    /// Up to `k` tokens that followed the latest earlier occurrence of the
    /// longest matching suffix of `history` (empty: no match). Returns the
    /// proposal and the matched length n.
    pub fn propose(&self, history: &[u32], k: usize) -> (Vec<u32>, usize) {
        let len = history.len().min(self.indexed);
        for n in (MIN_NGRAM..=MAX_NGRAM.min(len)).rev() {
            if let Some(&start) = self.maps[n - MIN_NGRAM].get(&key(&history[len - n..len])) {
                let end = len.min(start.saturating_add(k));
                if start < end {
                    return (history[start..end].to_vec(), n);
                }
            }
        }
        (Vec::new(), 0)
    }
}

/// Running statistics of one proposer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProposerStat {
    /// Rounds this proposer drafted.
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
}

/// Acceptance and rounds per proposer over one generation (schema in
/// docs/cli.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProposerStats {
    pub draft: ProposerStat,
    pub lookup: ProposerStat,
    /// Rounds with no proposal (one target step each).
    pub none_rounds: u64,
}

impl ProposerStat {
    fn add(&mut self, other: &ProposerStat) {
        self.rounds += other.rounds;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
    }
}

impl ProposerStats {
    /// Add another generation's statistics (totals over a prompt set).
    pub fn add(&mut self, other: &ProposerStats) {
        self.draft.add(&other.draft);
        self.lookup.add(&other.lookup);
        self.none_rounds += other.none_rounds;
    }

    pub fn record(&mut self, source: Source, drafted: usize, accepted: usize) {
        let s = match source {
            Source::Draft => &mut self.draft,
            Source::Lookup => &mut self.lookup,
            Source::Nothing => {
                self.none_rounds += 1;
                return;
            }
        };
        s.rounds += 1;
        s.drafted += drafted as u64;
        s.accepted += accepted as u64;
    }
}

/// Per-position acceptance of a proposer's blocks: `alpha(i)` estimates the
/// probability that position `i` (0-based) of a block is accepted given that
/// the positions before it were, from exponentially decayed counts of past
/// rounds plus a prior of [`PositionAcceptance::PRIOR_WEIGHT`] rounds. A prior
/// above what is measured keeps positions that short blocks never reach worth
/// trying, so they get measured rather than stay unexplored.
///
/// A constant per-token acceptance (a geometric model) fits a draft model
/// roughly, but not prompt lookup: a copied span tends to be right or wrong as
/// a whole, so lookup's acceptance rises along the block (replayed on the
/// first 8 editing prompts: 77 % at the first position, then 85, 89 and 93 %
/// given the ones before). Shared by the edge's adaptive-k chooser and
/// [`AutoChooser`].
#[derive(Clone, Debug)]
pub struct PositionAcceptance {
    reached: [f64; MAX_K],
    accepted: [f64; MAX_K],
    first_prior: f64,
    later_prior: f64,
}

impl PositionAcceptance {
    /// Rounds the prior weighs.
    pub const PRIOR_WEIGHT: f64 = 2.0;
    /// Per-round decay of old observations (half-life ~35 rounds).
    pub const DECAY: f64 = 0.98;

    /// Prior `first_prior` at position 0, `later_prior` after it.
    pub fn new(first_prior: f64, later_prior: f64) -> Self {
        Self {
            reached: [0.0; MAX_K],
            accepted: [0.0; MAX_K],
            first_prior,
            later_prior,
        }
    }

    /// A block of `k` was proposed and its first `n` tokens accepted.
    pub fn observe(&mut self, k: usize, n: usize) {
        for i in 0..MAX_K {
            self.reached[i] *= Self::DECAY;
            self.accepted[i] *= Self::DECAY;
        }
        // Position i was reached when i <= n and i < k; accepted when i < n.
        for i in 0..k.min(n.saturating_add(1)).min(MAX_K) {
            self.reached[i] += 1.0;
            if i < n {
                self.accepted[i] += 1.0;
            }
        }
    }

    /// Conditional acceptance at 0-based position `i` (positions past
    /// [`MAX_K`] share the last one's).
    pub fn alpha(&self, i: usize) -> f64 {
        let j = i.min(MAX_K - 1);
        let prior = if j == 0 {
            self.first_prior
        } else {
            self.later_prior
        };
        (self.accepted[j] + prior * Self::PRIOR_WEIGHT) / (self.reached[j] + Self::PRIOR_WEIGHT)
    }

    /// Expected accepted tokens of a `len`-token block (acceptance stops at
    /// the first rejection): Σ_{j=1..len} Π_{i<j} alpha(i).
    pub fn expected_accepted(&self, len: usize) -> f64 {
        let (mut e, mut p) = (0.0, 1.0);
        for i in 0..len {
            p *= self.alpha(i);
            e += p;
        }
        e
    }
}

/// Exponential moving average of a time in seconds (`None` until measured).
#[derive(Clone, Copy, Debug, Default)]
struct Ema(Option<f64>);

impl Ema {
    fn add(&mut self, v: f64) {
        self.0 = Some(match self.0 {
            Some(a) => 0.8 * a + 0.2 * v,
            None => v,
        });
    }
}

/// The estimate slot of a lookup match of `ngram` tokens.
fn lookup_slot(ngram: usize) -> usize {
    ngram.clamp(MIN_NGRAM, MAX_NGRAM) - MIN_NGRAM
}

/// [`ProposerKind::Auto`]'s choice per round: the source with the most
/// expected tokens (accepted + the target's own) per second of forwards.
///
/// Expected accepted tokens come from per-position acceptance estimates
/// ([`PositionAcceptance`], fed by [`AutoChooser::observe`]): one for the
/// draft model, and one per matched length for lookup.
///
/// Costs come from measured times: the target's per rows verified
/// (1..=[`crate::verify::MAX_K`] + 1; over a network, the round trip),
/// the draft's per token, and per token it still has to be fed (its lazy
/// prefill). A row count not measured yet costs the nearest measured one
/// plus [`EXPLORE_ROW`] of a row's compute per extra row ([`EXTRA_ROW`] per
/// row fewer; a round trip's latency does not grow with rows); a row's
/// compute is a draft token over [`DRAFT_TOKEN`] once the draft is timed,
/// else the measured time scaled down. An untimed draft token is
/// [`DRAFT_TOKEN`] of a one-row target forward, an untimed prefill token
/// [`PREFILL_TOKEN`] of a draft token
/// (docs/benchmarks.md measured a draft token at 0.4–0.5 of a target step
/// and c(5) ≈ 2–2.4 on CPUs; the lab measured the 0.5B's prompt prefill at
/// 8–10 ms per token against 23 ms per decoded token on one Zen core).
/// Nothing measured at all: everything in units of one target row, so the
/// costs compared are always in one unit.
#[derive(Clone, Debug)]
pub struct AutoChooser {
    target: Vec<Ema>,
    draft_token: Ema,
    draft_prefill_token: Ema,
    /// The draft model's acceptance per position.
    draft: PositionAcceptance,
    /// Lookup's acceptance per position, one estimate per matched length
    /// (`lookup[n - MIN_NGRAM]`): a longer match is the likelier copy.
    lookup: [PositionAcceptance; MAX_NGRAM - MIN_NGRAM + 1],
    /// Decayed counts of the rounds lookup was asked about, and of those
    /// where it offered nothing.
    lookup_asked: f64,
    lookup_empty: f64,
}

impl Default for AutoChooser {
    fn default() -> Self {
        Self {
            target: vec![Ema::default(); MAX_K + 2],
            draft_token: Ema::default(),
            draft_prefill_token: Ema::default(),
            draft: PositionAcceptance::new(DRAFT_PRIOR, DRAFT_PRIOR),
            lookup: std::array::from_fn(|_| {
                PositionAcceptance::new(LOOKUP_FIRST_PRIOR, LOOKUP_LATER_PRIOR)
            }),
            lookup_asked: 0.0,
            lookup_empty: 0.0,
        }
    }
}

impl AutoChooser {
    /// A round's outcome: lookup's match was `lookup_match` (`None`: not
    /// asked; `Some(0)`: nothing matched), `source` proposed `drafted`
    /// tokens and the first `accepted` were accepted.
    pub fn observe(
        &mut self,
        source: Source,
        lookup_match: Option<usize>,
        drafted: usize,
        accepted: usize,
    ) {
        if let Some(n) = lookup_match {
            self.lookup_asked = self.lookup_asked * PositionAcceptance::DECAY + 1.0;
            self.lookup_empty =
                self.lookup_empty * PositionAcceptance::DECAY + if n == 0 { 1.0 } else { 0.0 };
        }
        if drafted == 0 {
            return;
        }
        let estimate = match source {
            Source::Draft => &mut self.draft,
            Source::Lookup => &mut self.lookup[lookup_slot(lookup_match.unwrap_or(0))],
            Source::Nothing => return,
        };
        estimate.observe(drafted, accepted);
    }

    /// Estimated share of rounds in which lookup offers nothing: the rounds
    /// left to the draft model (where lookup offers, it mostly wins: its
    /// proposal costs nothing).
    fn no_offer_share(&self) -> f64 {
        let w = PositionAcceptance::PRIOR_WEIGHT;
        (self.lookup_empty + NO_OFFER_PRIOR * w) / (self.lookup_asked + w)
    }

    /// A target forward over `rows` rows took `t`.
    pub fn target_forward(&mut self, rows: usize, t: Duration) {
        if let Some(e) = self.target.get_mut(rows) {
            e.add(t.as_secs_f64());
        }
    }

    /// A draft forward over `tokens` new tokens took `t`.
    pub fn draft_forward(&mut self, tokens: usize, t: Duration) {
        if tokens == 1 {
            self.draft_token.add(t.as_secs_f64());
        } else if tokens > 1 {
            self.draft_prefill_token
                .add(t.as_secs_f64() / tokens as f64);
        }
    }

    /// Whether a one-token draft forward has been timed. Until then the
    /// draft's cost is a guess relative to the target's measured cost, which
    /// is only right when that cost is a local forward: over a network it is
    /// a round trip, and the guess would price the draft at a share of the
    /// link's latency. Callers that verify remotely time the draft once first
    /// (the edge runtime does).
    pub fn draft_measured(&self) -> bool {
        self.draft_token.0.is_some()
    }

    /// One target row's compute: from the timed draft, else from the
    /// measured target times, else 1 (relative units).
    fn row_compute(&self) -> f64 {
        if let Some(d) = self.draft_token.0 {
            return d / DRAFT_TOKEN;
        }
        self.measured_target()
            .next()
            .map_or(1.0, |(m, t)| t / rows_factor(m))
    }

    /// The measured target times: (rows, seconds).
    fn measured_target(&self) -> impl Iterator<Item = (usize, f64)> + '_ {
        self.target
            .iter()
            .enumerate()
            .filter_map(|(m, e)| e.0.map(|t| (m, t)))
    }

    fn target_cost(&self, rows: usize) -> f64 {
        if let Some(t) = self.target.get(rows).and_then(|e| e.0) {
            return t;
        }
        let u = self.row_compute();
        match self.measured_target().min_by_key(|(m, _)| m.abs_diff(rows)) {
            Some((m, t)) => {
                // Longer than measured: priced optimistically, to be tried.
                let per_row = if rows > m { EXPLORE_ROW } else { EXTRA_ROW };
                let extra = per_row * (rows as f64 - m as f64) * u;
                (t + extra).max(0.25 * t)
            }
            None => u * rows_factor(rows),
        }
    }

    fn draft_token_cost(&self) -> f64 {
        self.draft_token
            .0
            .unwrap_or_else(|| DRAFT_TOKEN * self.row_compute())
    }

    /// The source and length for a round: lookup offers `lookup_len`
    /// tokens after a match of `ngram` tokens, the draft up to `k`, the
    /// draft has not yet seen `draft_backlog` tokens, and the generation may
    /// still produce `remaining` tokens. Every length up to the offer is considered (a
    /// shorter block is cheaper to verify), so this also picks k.
    ///
    /// The draft's backlog (its lazy prefill of the prompt) is paid once and
    /// then serves the rest of the generation, so a round is charged its share
    /// over the rounds the draft would run in the next `remaining` tokens (at
    /// most [`AMORTIZE_TOKENS`]: a generation may stop early; only the share
    /// of rounds lookup leaves to it), and must beat the alternatives by
    /// [`CATCH_UP_MARGIN`]. Charging it all to one round
    /// would decline the draft forever, since declining it never shrinks the
    /// backlog.
    pub fn choose(
        &self,
        lookup_len: usize,
        ngram: usize,
        k: usize,
        draft_backlog: usize,
        remaining: usize,
    ) -> (Source, usize) {
        let per_s = |tokens: f64, cost: f64| if cost > 0.0 { tokens / cost } else { 0.0 };
        let mut best = ((Source::Nothing, 0), per_s(1.0, self.target_cost(1)));
        let lookup = &self.lookup[lookup_slot(ngram)];
        for len in 1..=lookup_len {
            let v = per_s(
                1.0 + lookup.expected_accepted(len),
                self.target_cost(len + 1),
            );
            if v > best.1 {
                best = ((Source::Lookup, len), v);
            }
        }
        let draft_token = self.draft_token_cost();
        let prefill = self
            .draft_prefill_token
            .0
            .unwrap_or(PREFILL_TOKEN * draft_token);
        // Feeding the backlog: one token rides in the first draft step.
        let backlog = draft_backlog.saturating_sub(1) as f64 * prefill;
        let horizon = remaining.clamp(1, AMORTIZE_TOKENS) as f64;
        // More than a round's tokens to feed: a catch-up, not a round's lag.
        let margin = if draft_backlog > k + 1 {
            CATCH_UP_MARGIN
        } else {
            1.0
        };
        for len in 1..=k {
            let tokens = 1.0 + self.draft.expected_accepted(len);
            let rounds = (horizon / tokens * self.no_offer_share()).max(1.0);
            let cost = self.target_cost(len + 1) + len as f64 * draft_token + backlog / rounds;
            let v = per_s(tokens, cost) / margin;
            if v > best.1 {
                best = ((Source::Draft, len), v);
            }
        }
        best.0
    }
}

/// A round's proposal: the source, its length, and the tokens when the
/// source is lookup (the draft's are drafted by the caller).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub source: Source,
    pub len: usize,
    pub lookup: Vec<u32>,
    /// Lookup's match for this round (`None`: lookup was not asked, as by
    /// the draft-only proposer; `Some(0)`: nothing matched): what
    /// [`AutoChooser::observe`] files the round's outcome under.
    pub lookup_match: Option<usize>,
}

/// What proposes a round of at most `k` tokens after `history` (which
/// `index` has indexed): the draft model (`k`), lookup's offer (none: no
/// proposal), or `auto`'s choice from `chooser`'s estimates.
/// `draft_backlog` (tokens the draft has not run yet) is asked only by
/// `auto`; `remaining` is how many tokens the generation may still produce.
/// The local loop and the edge runtime plan their rounds here.
#[allow(clippy::too_many_arguments)]
pub fn plan_round(
    kind: ProposerKind,
    index: &NgramIndex,
    history: &[u32],
    k: usize,
    remaining: usize,
    chooser: &AutoChooser,
    draft_backlog: impl FnOnce() -> usize,
) -> Plan {
    // What lookup offers (looked up once; the draft-only loop never asks).
    let (mut offer, ngram) = match kind {
        ProposerKind::Draft => (Vec::new(), None),
        ProposerKind::Lookup | ProposerKind::Auto => {
            let (offer, n) = index.propose(history, k);
            (offer, Some(n))
        }
    };
    let (source, len) = match kind {
        ProposerKind::Draft => (Source::Draft, k),
        ProposerKind::Lookup => match offer.len() {
            0 => (Source::Nothing, 0),
            n => (Source::Lookup, n),
        },
        ProposerKind::Auto => chooser.choose(
            offer.len(),
            ngram.unwrap_or(0),
            k,
            draft_backlog(),
            remaining,
        ),
    };
    if source == Source::Lookup {
        // The first `len` tokens of the offer (auto may take fewer).
        offer.truncate(len);
    } else {
        offer.clear();
    }
    Plan {
        source,
        len,
        lookup: offer,
        lookup_match: ngram,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_proposes_what_followed_the_longest_earlier_match() {
        // ... 5 6 7 8 9 ... 1 6 7 → (6 7) matched, then 8 9 follow.
        let h = [5, 6, 7, 8, 9, 1, 6, 7];
        let mut ix = NgramIndex::new();
        ix.extend(&h);
        assert_eq!(ix.propose(&h, 4), (vec![8, 9, 1, 6], 2));
        assert_eq!(ix.propose(&h, 1), (vec![8], 2));
        // A longer match wins over a more recent shorter one.
        let h = [1, 2, 3, 4, 10, 9, 3, 4, 11, 1, 2, 3, 4];
        let mut ix = NgramIndex::new();
        ix.extend(&h);
        assert_eq!(ix.propose(&h, 2).0, vec![10, 9]);
        // The most recent occurrence of the same n-gram wins.
        let h = [7, 8, 1, 7, 8, 2, 7, 8];
        let mut ix = NgramIndex::new();
        ix.extend(&h);
        assert_eq!(ix.propose(&h, 3).0, vec![2, 7, 8]);
    }

    #[test]
    fn lookup_finds_nothing_without_a_repeat_and_never_the_suffix_itself() {
        let h = [1, 2, 3, 4, 5];
        let mut ix = NgramIndex::new();
        ix.extend(&h);
        assert_eq!(ix.propose(&h, 4), (vec![], 0));
        // A single repeated token is below MIN_NGRAM.
        let h = [1, 2, 9, 3, 9];
        let mut ix = NgramIndex::new();
        ix.extend(&h);
        assert_eq!(ix.propose(&h, 4), (vec![], 0));
        let mut ix = NgramIndex::new();
        ix.extend(&[]);
        assert_eq!(ix.propose(&[], 4), (vec![], 0));
    }

    #[test]
    fn extending_in_steps_indexes_what_one_pass_does() {
        let h: Vec<u32> = (0..200).map(|i| (i * 7 % 13) as u32).collect();
        let mut whole = NgramIndex::new();
        whole.extend(&h);
        let mut steps = NgramIndex::new();
        for end in [1, 2, 3, 10, 11, 57, 199, 200] {
            steps.extend(&h[..end]);
        }
        for len in 2..h.len() {
            for k in [1, 4, 16] {
                // Lookups on a prefix only see that prefix's n-grams.
                let mut prefix = NgramIndex::new();
                prefix.extend(&h[..len]);
                let p = prefix.propose(&h[..len], k);
                assert!(p.0.len() <= k);
                if p.1 > 0 {
                    let n = p.1;
                    // The proposal follows an earlier occurrence of the suffix.
                    let suffix = &h[len - n..len];
                    assert!(h[..len - 1].windows(n).any(|w| w == suffix));
                }
            }
        }
        assert_eq!(whole.propose(&h, 8), steps.propose(&h, 8));
    }

    /// `chooser` saw `times` times the rounds `outcomes` ((proposed,
    /// accepted) each) from `source` (lookup after a match of `ngram`).
    fn feed(
        chooser: &mut AutoChooser,
        source: Source,
        ngram: usize,
        outcomes: &[(usize, usize)],
        times: usize,
    ) {
        for _ in 0..times {
            for &(k, n) in outcomes {
                chooser.observe(source, Some(ngram), k, n);
            }
        }
    }

    /// This machine's target forwards (2 vCPU EPYC, the 1.5B, ms per rows).
    fn measured_here(c: &mut AutoChooser, rows: &[usize]) {
        for &r in rows {
            let ms = [0.0, 27.1, 31.3, 41.1, 46.7, 52.3][r];
            c.target_forward(r, Duration::from_secs_f64(ms / 1e3));
        }
    }

    #[test]
    fn auto_prefers_free_lookup_and_skips_a_cold_draft_with_a_long_backlog() {
        let fresh = AutoChooser::default();
        assert_eq!(fresh.choose(4, 3, 4, 1, 100).0, Source::Lookup);
        // A draft that has been right every time beats a plain step.
        let mut good = AutoChooser::default();
        feed(&mut good, Source::Draft, 0, &[(4, 4)], 50);
        let (source, len) = good.choose(0, 0, 4, 1, 100);
        assert_eq!(source, Source::Draft);
        assert!((1..=4).contains(&len));
        // ... but not when its whole prefill (2,000 tokens) is still owed.
        assert_eq!(good.choose(0, 0, 4, 2000, 100).0, Source::Nothing);
        // A lookup that keeps failing loses to the good draft.
        let mut bad_lookup = good.clone();
        feed(&mut bad_lookup, Source::Lookup, 3, &[(4, 0)], 50);
        assert_eq!(bad_lookup.choose(4, 3, 4, 1, 100).0, Source::Draft);
        // Measured costs count: a target forward of 2 rows as slow as 5 one-row
        // forwards makes any proposal lose.
        let mut slow = good.clone();
        slow.target_forward(1, Duration::from_millis(10));
        for rows in 2..=17 {
            slow.target_forward(rows, Duration::from_millis(50));
        }
        assert_eq!(slow.choose(4, 3, 4, 1, 100).0, Source::Nothing);
    }

    #[test]
    fn lookup_is_judged_per_position_and_per_match_length() {
        // Half of the 4-gram matches were copies accepted whole, half were
        // rejected at once: 50 % per token, but a block that gets past its
        // first token is accepted to the end. A geometric model at 50 % would
        // propose one token; per position, the whole offer pays (on this
        // machine: 3 expected tokens for 52 ms against 1.5 for 31 ms).
        let mut c = AutoChooser::default();
        measured_here(&mut c, &[1, 2, 3, 4, 5]);
        feed(&mut c, Source::Lookup, 4, &[(4, 4), (4, 0)], 20);
        assert_eq!(c.choose(4, 4, 4, 300, 100), (Source::Lookup, 4));
        // 2-gram matches that were always wrong are declined (the draft still
        // owes a 300-token prompt), while 4-gram offers are still taken.
        feed(&mut c, Source::Lookup, 2, &[(4, 0)], 20);
        assert_eq!(c.choose(4, 2, 4, 300, 100).0, Source::Nothing);
        assert_eq!(c.choose(4, 4, 4, 300, 100), (Source::Lookup, 4));
    }

    #[test]
    fn a_longer_block_never_measured_is_tried() {
        // Only one- and two-row forwards timed so far, no lookup round seen:
        // a four-token offer is priced optimistically (EXPLORE_ROW), so it is
        // proposed once and its five-row forward measured. At the realistic
        // price (EXTRA_ROW) one token looked better, and with only two-row
        // forwards ever measured, auto never learnt that c(5) is 1.93.
        let mut c = AutoChooser::default();
        measured_here(&mut c, &[1, 2]);
        assert_eq!(c.choose(4, 4, 4, 0, 100), (Source::Lookup, 4));
    }

    #[test]
    fn auto_pays_the_draft_s_catch_up_once_when_the_generation_has_far_to_go() {
        // Over a network: a verify costs one round trip (100 ms) whatever its
        // rows, a draft token 10 ms, its prefill 1 ms per token.
        let mut net = AutoChooser::default();
        for rows in 1..=17 {
            net.target_forward(rows, Duration::from_millis(100));
        }
        net.draft_forward(1, Duration::from_millis(10));
        net.draft_forward(300, Duration::from_millis(300));
        // Three of four drafts accepted per round.
        feed(&mut net, Source::Draft, 0, &[(4, 3)], 50);
        // 300 prompt tokens owed (300 ms): charged to one round it would lose
        // to a plain 100 ms step; spread over the rounds of 64 tokens it wins.
        assert_eq!(net.choose(0, 0, 4, 300, 200).0, Source::Draft);
        // Two tokens from the end the catch-up is not worth it.
        assert_eq!(net.choose(0, 0, 4, 300, 2).0, Source::Nothing);
        // A prompt so long that even spread it costs more than it saves.
        assert_eq!(net.choose(0, 0, 4, 100_000, 200).0, Source::Nothing);
    }

    #[test]
    fn the_catch_up_is_charged_to_the_rounds_lookup_leaves_to_the_draft() {
        // fast-4g as the lab measured it: a 200 ms round trip whatever the
        // rows, a draft token 23 ms, its prefill 9 ms per token; an editing
        // prompt of 280 tokens owed, 40 tokens to go, the draft right three
        // times in four. Lookup had no offer this round.
        let link = || {
            let mut c = AutoChooser::default();
            for rows in 1..=17 {
                c.target_forward(rows, Duration::from_millis(200));
            }
            c.draft_forward(1, Duration::from_millis(23));
            c.draft_forward(100, Duration::from_millis(900));
            c
        };
        // Lookup rarely offers (general text): the draft would run most
        // rounds, and its catch-up pays.
        let mut general = link();
        feed(&mut general, Source::Draft, 0, &[(4, 3)], 5);
        feed(&mut general, Source::Nothing, 0, &[(0, 0)], 20);
        assert_eq!(general.choose(0, 0, 4, 280, 40).0, Source::Draft);
        // Lookup offered in nine rounds of ten (an edit that copies): the
        // draft would run in one round of ten, too few to repay 2.5 s.
        let mut editing = link();
        feed(&mut editing, Source::Draft, 0, &[(4, 3)], 5);
        for _ in 0..4 {
            feed(&mut editing, Source::Lookup, 4, &[(4, 4)], 9);
            feed(&mut editing, Source::Nothing, 0, &[(0, 0)], 1);
        }
        assert_eq!(editing.choose(0, 0, 4, 280, 40).0, Source::Nothing);
    }

    #[test]
    fn an_unmeasured_row_count_is_priced_from_a_measured_one_in_the_same_unit() {
        // A LAN as the lab measured it: only 2-row round trips (54 ms) timed so
        // far, a draft token 23 ms, its prefill 9 ms per token, 59 prompt
        // tokens owed, 32 tokens to go, the draft right 72 % of the time
        // (18 of 25 one-token rounds).
        let draft_seen = |c: &mut AutoChooser| {
            let mut rounds = vec![(1, 1); 18];
            rounds.extend([(1, 0); 7]);
            feed(c, Source::Draft, 0, &rounds, 3);
        };
        let mut lan = AutoChooser::default();
        lan.target_forward(2, Duration::from_millis(54));
        lan.draft_forward(1, Duration::from_millis(23));
        lan.draft_forward(60, Duration::from_millis(540));
        draft_seen(&mut lan);
        // A plain step (~39 ms: the 2-row trip minus a row's compute) beats
        // a draft round (≥ 105 ms for 1.7 tokens). Priced in relative units
        // (1.0 "s") the plain step looked 25x too dear and the draft won.
        assert_eq!(lan.choose(0, 0, 4, 60, 32).0, Source::Nothing);
        // The same device over a 200 ms link: the draft's round pays.
        let mut far = AutoChooser::default();
        far.target_forward(1, Duration::from_millis(200));
        far.draft_forward(1, Duration::from_millis(23));
        far.draft_forward(60, Duration::from_millis(540));
        draft_seen(&mut far);
        assert_eq!(far.choose(0, 0, 4, 60, 32).0, Source::Draft);
    }

    #[test]
    fn position_acceptance_estimates_conditional_on_the_positions_before() {
        let mut p = PositionAcceptance::new(0.5, 0.5);
        // Blocks of 3: position 0 always accepted, position 1 never.
        for _ in 0..200 {
            p.observe(3, 1);
        }
        assert!(p.alpha(0) > 0.95, "{}", p.alpha(0));
        assert!(p.alpha(1) < 0.05, "{}", p.alpha(1));
        // Position 2 was never reached: still the prior.
        assert!((p.alpha(2) - 0.5).abs() < 1e-9);
        let want = p.alpha(0) * (1.0 + p.alpha(1) * (1.0 + p.alpha(2)));
        assert!((p.expected_accepted(3) - want).abs() < 1e-9);
        assert_eq!(p.expected_accepted(0), 0.0);
        // Positions past MAX_K share the last one's estimate.
        assert_eq!(p.alpha(MAX_K + 5), p.alpha(MAX_K - 1));
    }

    #[test]
    fn proposer_names_round_trip() {
        for k in ProposerKind::ALL {
            assert_eq!(k.name().parse::<ProposerKind>().ok(), Some(k));
        }
        assert!("ngram".parse::<ProposerKind>().is_err());
    }
}
