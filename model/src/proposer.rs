//! What proposes the tokens of a speculative round.
//!
//! Any proposal is safe: the target verifies every token, so a proposer changes
//! how many tokens a round yields, never which tokens (greedy output is the
//! target's own, and sampled output keeps the target's distribution).
//!
//! - [`ProposerKind::Draft`]: the draft model, token by token.
//! - [`ProposerKind::Lookup`]: prompt lookup. The longest suffix of the history
//!   (n = [`MAX_NGRAM`] down to [`MIN_NGRAM`] tokens) that occurred before is
//!   looked up in an [`NgramIndex`] (O(1) per token to maintain and per lookup,
//!   no rescan), and the tokens that followed its latest occurrence are
//!   proposed. Costs no model forward; in sampled mode each token is a point
//!   mass (q = 1), which the lossless rule handles exactly.
//! - [`ProposerKind::Auto`]: per round, whichever of lookup, the draft model
//!   and no proposal (a plain target step) promises the most tokens per
//!   second, from running acceptance estimates per proposer and measured
//!   forward times ([`AutoChooser`]). The draft's cache is filled lazily, so a
//!   generation that lookup serves never pays for the draft's prefill.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

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

/// Per-token acceptance estimate: a Beta prior of `PRIOR_WEIGHT` tokens at
/// `prior`, then the running count (so a few early rounds cannot swing it).
fn acceptance(stat: &ProposerStat, prior: f64) -> f64 {
    const PRIOR_WEIGHT: f64 = 8.0;
    (stat.accepted as f64 + prior * PRIOR_WEIGHT) / (stat.drafted as f64 + PRIOR_WEIGHT)
}

/// Expected accepted tokens of a `len`-token proposal at per-token acceptance
/// `a` (acceptance stops at the first rejection): Σ_{i=1..len} a^i.
fn expected_accepted(a: f64, len: usize) -> f64 {
    (1..=len).map(|i| a.powi(i as i32)).sum()
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

/// [`ProposerKind::Auto`]'s choice per round: the source with the most
/// expected tokens (accepted + the target's own) per second of forwards.
///
/// Costs come from measured times: the target's per rows verified
/// (1..=[`crate::speculative::MAX_K`] + 1; over a network, the round trip),
/// the draft's per token, and per token it still has to be fed (its lazy
/// prefill). A row count not measured yet costs the nearest measured one
/// plus [`EXTRA_ROW`] of a row's compute per extra row (a round trip's
/// latency does not grow with rows); a row's compute is a draft token over
/// [`DRAFT_TOKEN`] once the draft is timed, else the measured time scaled
/// down. An untimed draft token is [`DRAFT_TOKEN`] of a one-row target
/// forward, an untimed prefill token [`PREFILL_TOKEN`] of a draft token
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
}

impl Default for AutoChooser {
    fn default() -> Self {
        Self {
            target: vec![Ema::default(); crate::speculative::MAX_K + 2],
            draft_token: Ema::default(),
            draft_prefill_token: Ema::default(),
        }
    }
}

impl AutoChooser {
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
                let extra = EXTRA_ROW * (rows as f64 - m as f64) * u;
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
    /// tokens, the draft up to `k`, the draft has not yet seen
    /// `draft_backlog` tokens, and the generation may still produce
    /// `remaining` tokens. Every length up to the offer is considered (a
    /// shorter block is cheaper to verify), so this also picks k.
    ///
    /// The draft's backlog (its lazy prefill of the prompt) is paid once and
    /// then serves the rest of the generation, so a round is charged its share
    /// over the rounds the draft would run in the next `remaining` tokens (at
    /// most [`AMORTIZE_TOKENS`]: a generation may stop early), and must beat
    /// the alternatives by [`CATCH_UP_MARGIN`]. Charging it all to one round
    /// would decline the draft forever, since declining it never shrinks the
    /// backlog.
    pub fn choose(
        &self,
        stats: &ProposerStats,
        lookup_len: usize,
        k: usize,
        draft_backlog: usize,
        remaining: usize,
    ) -> (Source, usize) {
        let per_s = |tokens: f64, cost: f64| if cost > 0.0 { tokens / cost } else { 0.0 };
        let mut best = ((Source::Nothing, 0), per_s(1.0, self.target_cost(1)));
        let a = acceptance(&stats.lookup, 0.6);
        for len in 1..=lookup_len {
            let v = per_s(1.0 + expected_accepted(a, len), self.target_cost(len + 1));
            if v > best.1 {
                best = ((Source::Lookup, len), v);
            }
        }
        let a = acceptance(&stats.draft, 0.7);
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
            let tokens = 1.0 + expected_accepted(a, len);
            let rounds = (horizon / tokens).max(1.0);
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
}

/// What proposes a round of at most `k` tokens after `history` (which
/// `index` has indexed): the draft model (`k`), lookup's offer (none: no
/// proposal), or `auto`'s choice from `chooser` and `stats`.
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
    stats: &ProposerStats,
    draft_backlog: impl FnOnce() -> usize,
) -> Plan {
    // What lookup offers (looked up once; the draft-only loop never asks).
    let mut offer = match kind {
        ProposerKind::Draft => Vec::new(),
        ProposerKind::Lookup | ProposerKind::Auto => index.propose(history, k).0,
    };
    let (source, len) = match kind {
        ProposerKind::Draft => (Source::Draft, k),
        ProposerKind::Lookup => match offer.len() {
            0 => (Source::Nothing, 0),
            n => (Source::Lookup, n),
        },
        ProposerKind::Auto => chooser.choose(stats, offer.len(), k, draft_backlog(), remaining),
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

    /// Statistics where the draft ran `rounds` rounds, `accepted` of
    /// `drafted` tokens accepted.
    fn draft_record(rounds: u64, drafted: u64, accepted: u64) -> ProposerStats {
        ProposerStats {
            draft: ProposerStat {
                rounds,
                drafted,
                accepted,
            },
            ..ProposerStats::default()
        }
    }

    #[test]
    fn auto_prefers_free_lookup_and_skips_a_cold_draft_with_a_long_backlog() {
        let c = AutoChooser::default();
        let fresh = ProposerStats::default();
        assert_eq!(c.choose(&fresh, 4, 4, 1, 100).0, Source::Lookup);
        // A draft that has been right 95 % of the time beats a plain step.
        let good = draft_record(50, 200, 190);
        let (source, len) = c.choose(&good, 0, 4, 1, 100);
        assert_eq!(source, Source::Draft);
        assert!((1..=4).contains(&len));
        // ... but not when its whole prefill (2,000 tokens) is still owed.
        assert_eq!(c.choose(&good, 0, 4, 2000, 100).0, Source::Nothing);
        // A lookup that keeps failing loses to the good draft.
        let bad_lookup = ProposerStats {
            lookup: ProposerStat {
                rounds: 50,
                drafted: 200,
                accepted: 0,
            },
            ..good
        };
        assert_eq!(c.choose(&bad_lookup, 4, 4, 1, 100).0, Source::Draft);
        // Measured costs count: a target forward of 2 rows as slow as 5 one-row
        // forwards makes any proposal lose.
        let mut slow = AutoChooser::default();
        slow.target_forward(1, Duration::from_millis(10));
        for rows in 2..=17 {
            slow.target_forward(rows, Duration::from_millis(50));
        }
        assert_eq!(slow.choose(&good, 4, 4, 1, 100).0, Source::Nothing);
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
        let good = draft_record(50, 200, 170);
        // 300 prompt tokens owed (300 ms): charged to one round it would lose
        // to a plain 100 ms step; spread over the rounds of 64 tokens it wins.
        assert_eq!(net.choose(&good, 0, 4, 300, 200).0, Source::Draft);
        // Two tokens from the end the catch-up is not worth it.
        assert_eq!(net.choose(&good, 0, 4, 300, 2).0, Source::Nothing);
        // A prompt so long that even spread it costs more than it saves.
        assert_eq!(net.choose(&good, 0, 4, 100_000, 200).0, Source::Nothing);
    }

    #[test]
    fn an_unmeasured_row_count_is_priced_from_a_measured_one_in_the_same_unit() {
        // A LAN as the lab measured it: only 2-row round trips (54 ms) timed so
        // far, a draft token 23 ms, its prefill 9 ms per token, 59 prompt
        // tokens owed, 32 tokens to go, the draft right 72 % of the time.
        let mut lan = AutoChooser::default();
        lan.target_forward(2, Duration::from_millis(54));
        lan.draft_forward(1, Duration::from_millis(23));
        lan.draft_forward(60, Duration::from_millis(540));
        let stats = draft_record(64, 64, 46);
        // A plain step (~39 ms: the 2-row trip minus a row's compute) beats
        // a draft round (≥ 105 ms for 1.7 tokens). Priced in relative units
        // (1.0 "s") the plain step looked 25x too dear and the draft won.
        assert_eq!(lan.choose(&stats, 0, 4, 60, 32).0, Source::Nothing);
        // The same device over a 200 ms link: the draft's round pays.
        let mut far = AutoChooser::default();
        far.target_forward(1, Duration::from_millis(200));
        far.draft_forward(1, Duration::from_millis(23));
        far.draft_forward(60, Duration::from_millis(540));
        assert_eq!(far.choose(&stats, 0, 4, 60, 32).0, Source::Draft);
    }

    #[test]
    fn proposer_names_round_trip() {
        for k in ProposerKind::ALL {
            assert_eq!(k.name().parse::<ProposerKind>().ok(), Some(k));
        }
        assert!("ngram".parse::<ProposerKind>().is_err());
    }
}
