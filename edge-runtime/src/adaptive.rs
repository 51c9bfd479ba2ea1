//! Choosing the draft length `k` per round, and the speculation settings of the
//! device ([`SpeculationConfig`]: fixed or adaptive k, pipelined drafting,
//! target-only streaming).
//!
//! **The chooser.** With `a_i` the probability that draft position `i` is accepted
//! given that positions `1..i` were (estimated per position from past rounds), a
//! block of `k` drafts yields in expectation
//!
//! ```text
//! E[tokens | k] = 1 + sum_{j=1..k} prod_{i=1..j} a_i
//! ```
//!
//! tokens (the accepted prefix plus the verifier's own token). With a constant
//! `a_i = α` this is Leviathan et al.'s `(1 − α^(k+1)) / (1 − α)`. One round costs
//!
//! ```text
//! T(k) = draft(k) + rtt(k),   draft(k) = k · t_draft,   rtt(k) = r0 + v · (k + 1)
//! ```
//!
//! where `rtt(k)` is the measured verify round trip (network + the target's forward
//! over `k + 1` tokens), fitted online as a line in `k + 1` (the slope `v` pulled
//! towards `verify_ms_per_token`, at most half the measured time per position,
//! while all rounds have the same k). Positions a short block never reaches keep
//! an optimistic prior (0.8), so the chooser tries longer blocks and measures them. With pipelined
//! drafting the device drafts the next block while a verify is in flight, so a
//! block whose predecessor was fully accepted (and whose bonus token the draft
//! guessed) costs no drafting time: `draft(k) = k · t_draft · (1 − P(all k + 1
//! guessed))`. The chooser returns `argmax_k E[tokens | k] / T(k)`: a long round trip
//! makes long blocks pay, low acceptance makes them not.

use serde::{Deserialize, Serialize};
use tandem_model::speculative::MAX_K;

/// How the device speculates (the `[speculation]` table of an `EdgeConfig`).
/// Defaults: fixed k (the caller's `GenerateConfig::k`), no pipelining.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SpeculationConfig {
    /// Choose k per round with [`AdaptiveK`] (within `k_min..=k_max`).
    pub adaptive_k: bool,
    pub k_min: usize,
    pub k_max: usize,
    /// Prior for the verifier's extra cost per verified position (ms), used until
    /// rounds of different k let the chooser measure it.
    pub verify_ms_per_token: f64,
    /// Keep drafting the next block while a verify is in flight, assuming full
    /// acceptance; discard it on a rejection.
    pub pipeline: bool,
    /// Target-only streaming: draft nothing, ask the verifier for one token per
    /// round (`Draft` with k = 0), keeping `stream_window` requests in flight. The
    /// lab's "cloud generates and streams" baseline.
    pub target_stream: bool,
    pub stream_window: usize,
    /// Record every round (k, accepted, RTT) for [`crate::EdgeRuntime::last_rounds`]
    /// even with fixed k and no pipelining.
    pub record_rounds: bool,
}

impl Default for SpeculationConfig {
    fn default() -> Self {
        Self {
            adaptive_k: false,
            k_min: 1,
            k_max: 12,
            verify_ms_per_token: 20.0,
            pipeline: false,
            target_stream: false,
            stream_window: 4,
            record_rounds: false,
        }
    }
}

impl SpeculationConfig {
    /// True when the runtime runs its rounds through this module's loop.
    pub fn active(&self) -> bool {
        self.adaptive_k || self.pipeline || self.target_stream || self.record_rounds
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.k_min == 0 || self.k_min > self.k_max || self.k_max > MAX_K {
            return Err(format!(
                "speculation: need 1 <= k_min <= k_max <= {MAX_K}, got {}..={}",
                self.k_min, self.k_max
            ));
        }
        if !(self.verify_ms_per_token.is_finite() && self.verify_ms_per_token >= 0.0) {
            return Err("speculation.verify_ms_per_token must be >= 0".into());
        }
        if self.target_stream && (self.stream_window == 0 || self.stream_window > 8) {
            return Err("speculation.stream_window must be in 1..=8".into());
        }
        if self.target_stream && (self.adaptive_k || self.pipeline) {
            return Err("speculation.target_stream drafts nothing: no adaptive_k/pipeline".into());
        }
        Ok(())
    }
}

/// One verify round as the device saw it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoundRecord {
    /// Drafts sent.
    pub k: usize,
    /// Drafts accepted.
    pub accepted: usize,
    /// Verify round trip (ms).
    pub rtt_ms: f64,
    /// Device time spent drafting this block on the critical path (ms): drafts
    /// made while the previous verify was in flight do not count.
    pub draft_ms: f64,
    /// Drafts of this block that were made while the previous verify was in flight.
    pub reused: usize,
}

/// Per-position acceptance estimate: exponentially decayed counts with a prior.
#[derive(Clone, Debug)]
struct PositionEstimate {
    reached: [f64; MAX_K],
    accepted: [f64; MAX_K],
}

const PRIOR_ALPHA: f64 = 0.8;
const PRIOR_WEIGHT: f64 = 2.0;
/// Per-round decay of old observations (half-life ~ 35 rounds).
const DECAY: f64 = 0.98;

impl PositionEstimate {
    fn new() -> Self {
        Self {
            reached: [0.0; MAX_K],
            accepted: [0.0; MAX_K],
        }
    }

    fn observe(&mut self, k: usize, n: usize) {
        for i in 0..MAX_K {
            self.reached[i] *= DECAY;
            self.accepted[i] *= DECAY;
        }
        // Position i (0-based) was reached when i <= n and i < k; accepted when i < n.
        for i in 0..k.min(n + 1).min(MAX_K) {
            self.reached[i] += 1.0;
            if i < n {
                self.accepted[i] += 1.0;
            }
        }
    }

    /// Conditional acceptance at 0-based position i: the decayed counts plus an
    /// optimistic prior, so that positions a short k never reaches look worth
    /// trying (and get measured) rather than staying unexplored.
    fn alpha(&self, i: usize) -> f64 {
        let j = i.min(MAX_K - 1);
        (self.accepted[j] + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.reached[j] + PRIOR_WEIGHT)
    }
}

/// The running estimates behind the choice of k.
#[derive(Clone, Debug)]
pub struct AdaptiveK {
    cfg: SpeculationConfig,
    pos: PositionEstimate,
    /// EMA of the draft's time per drafted token (ms).
    draft_ms_per_token: Option<f64>,
    /// Decayed sums for the least-squares line rtt = r0 + v * (k + 1).
    s_w: f64,
    s_x: f64,
    s_y: f64,
    s_xx: f64,
    s_xy: f64,
}

impl AdaptiveK {
    pub fn new(cfg: &SpeculationConfig) -> Self {
        Self {
            cfg: cfg.clone(),
            pos: PositionEstimate::new(),
            draft_ms_per_token: None,
            s_w: 0.0,
            s_x: 0.0,
            s_y: 0.0,
            s_xx: 0.0,
            s_xy: 0.0,
        }
    }

    /// Records the outcome of a round: k drafts, `accepted` of them accepted.
    pub fn observe_round(&mut self, k: usize, accepted: usize, rtt_ms: f64) {
        if k > 0 {
            self.pos.observe(k, accepted);
        }
        if rtt_ms.is_finite() && rtt_ms >= 0.0 {
            let x = (k + 1) as f64;
            self.s_w = self.s_w * DECAY + 1.0;
            self.s_x = self.s_x * DECAY + x;
            self.s_y = self.s_y * DECAY + rtt_ms;
            self.s_xx = self.s_xx * DECAY + x * x;
            self.s_xy = self.s_xy * DECAY + x * rtt_ms;
        }
    }

    /// Records the draft's measured time for `tokens` forwards.
    pub fn observe_draft(&mut self, tokens: usize, ms: f64) {
        if tokens == 0 || !ms.is_finite() || ms < 0.0 {
            return;
        }
        let per = ms / tokens as f64;
        self.draft_ms_per_token = Some(match self.draft_ms_per_token {
            None => per,
            Some(old) => 0.8 * old + 0.2 * per,
        });
    }

    /// Conditional acceptance estimate at 1-based position `i`.
    pub fn alpha(&self, i: usize) -> f64 {
        self.pos.alpha(i.saturating_sub(1))
    }

    /// Expected tokens per round (accepted drafts + the verifier's token) for k.
    pub fn expected_tokens(&self, k: usize) -> f64 {
        let (mut e, mut p) = (1.0, 1.0);
        for i in 1..=k {
            p *= self.alpha(i);
            e += p;
        }
        e
    }

    /// The fitted verify round trip for a block of k (ms): (r0, v) with the slope
    /// regularised towards the prior (a pseudo-observation pair).
    pub fn rtt_ms(&self, k: usize) -> Option<f64> {
        if self.s_w <= 0.0 {
            return None;
        }
        let mean_x = self.s_x / self.s_w;
        let mean_y = self.s_y / self.s_w;
        let var = self.s_xx / self.s_w - mean_x * mean_x;
        let cov = self.s_xy / self.s_w - mean_x * mean_y;
        // Ridge towards the prior slope; with one k seen (var = 0) it is the prior.
        let lambda = 0.25;
        // The prior never claims more than half of the measured round trip per
        // position (a tiny or fast target verifies long blocks almost for free).
        let v0 = self
            .cfg
            .verify_ms_per_token
            .min(0.5 * mean_y / mean_x.max(1.0));
        let v = ((cov + lambda * v0) / (var + lambda)).max(0.0);
        let r0 = (mean_y - v * mean_x).max(0.0);
        Some(r0 + v * (k + 1) as f64)
    }

    pub fn draft_ms_per_token(&self) -> Option<f64> {
        self.draft_ms_per_token
    }

    /// Expected verified tokens per second of a block of `k` (None before any
    /// measurement).
    pub fn rate(&self, k: usize) -> Option<f64> {
        let td = self.draft_ms_per_token?;
        let rtt = self.rtt_ms(k)?;
        let mut draft = k as f64 * td;
        if self.cfg.pipeline {
            // Full acceptance and a guessed bonus token: the next block is ready.
            let full: f64 = (1..=k + 1).map(|i| self.alpha(i)).product();
            draft *= 1.0 - full;
        }
        let t = draft + rtt;
        (t > 0.0).then(|| self.expected_tokens(k) * 1000.0 / t)
    }

    /// The k for the next round, at most `limit` (room left, verifier's max
    /// block); `fallback` before anything was measured.
    pub fn choose(&self, limit: usize, fallback: usize) -> usize {
        let hi = self.cfg.k_max.min(limit).max(1);
        let lo = self.cfg.k_min.min(hi);
        if self.rate(lo).is_none() {
            return fallback.clamp(lo, hi);
        }
        let mut best = (lo, f64::MIN);
        for k in lo..=hi {
            if let Some(r) = self.rate(k) {
                if r > best.1 + 1e-9 {
                    best = (k, r);
                }
            }
        }
        best.0
    }
}

/// Speculation state of a runtime: the chooser (kept across generations, so a
/// device learns its link and its prompts) and the log of the last generation.
#[derive(Clone, Debug)]
pub struct SpecState {
    pub cfg: SpeculationConfig,
    pub chooser: AdaptiveK,
    pub rounds: Vec<RoundRecord>,
    /// Pipelined drafting: tokens drafted beyond the context (the draft cache +
    /// pending hold ctx + these), valid for the context length `ahead_at`.
    pub(crate) ahead: Vec<u32>,
    pub(crate) ahead_at: usize,
}

impl SpecState {
    pub fn new(cfg: &SpeculationConfig) -> Self {
        Self {
            cfg: cfg.clone(),
            chooser: AdaptiveK::new(cfg),
            rounds: Vec::new(),
            ahead: Vec::new(),
            ahead_at: 0,
        }
    }

    /// Starts a generation: clears the round log and any pipelined drafts.
    pub fn begin(&mut self) -> &mut Self {
        self.rounds.clear();
        self.ahead.clear();
        self.ahead_at = 0;
        self
    }

    pub fn active(&self) -> bool {
        self.cfg.active()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chooser(alpha: f64, draft_ms: f64, rtt_ms: f64, pipeline: bool) -> AdaptiveK {
        let cfg = SpeculationConfig {
            adaptive_k: true,
            k_max: 16,
            verify_ms_per_token: 0.0,
            pipeline,
            ..SpeculationConfig::default()
        };
        let mut a = AdaptiveK::new(&cfg);
        // Synthetic rounds of k = 16 whose accepted length follows a geometric law
        // with parameter alpha (deterministic: the expected counts per position).
        let rounds = 400;
        let mut reached = 1.0f64;
        let mut counts = [0usize; MAX_K + 1];
        let mut left = rounds;
        for c in counts.iter_mut().take(MAX_K) {
            let stop_here = ((reached * (1.0 - alpha)) * rounds as f64).round() as usize;
            *c = stop_here.min(left);
            left -= *c;
            reached *= alpha;
        }
        counts[MAX_K] = left;
        let mut seq = Vec::new();
        for (n, c) in counts.iter().enumerate() {
            seq.extend(std::iter::repeat_n(n, *c));
        }
        // Interleave so that the decay does not favour the last ones.
        let len = seq.len();
        for i in 0..len {
            let n = seq[(i * 7919) % len];
            a.observe_round(16, n, rtt_ms);
        }
        a.observe_draft(10, draft_ms * 10.0);
        a
    }

    #[test]
    fn estimates_follow_the_observations() {
        let a = chooser(0.8, 50.0, 100.0, false);
        for i in 1..=4 {
            assert!(
                (a.alpha(i) - 0.8).abs() < 0.06,
                "alpha({i}) = {}",
                a.alpha(i)
            );
        }
        assert!((a.rtt_ms(4).unwrap() - 100.0).abs() < 1e-6);
        assert_eq!(a.draft_ms_per_token(), Some(50.0));
        // Leviathan's closed form for a constant alpha.
        let e = a.expected_tokens(4);
        let closed = (1.0 - 0.8f64.powi(5)) / 0.2;
        assert!((e - closed).abs() < 0.3, "{e} vs {closed}");
    }

    #[test]
    fn high_rtt_chooses_a_longer_block() {
        let low = chooser(0.8, 100.0, 10.0, false).choose(16, 4);
        let high = chooser(0.8, 100.0, 1000.0, false).choose(16, 4);
        assert!(high > low, "high RTT k {high} <= low RTT k {low}");
        assert_eq!(low, 1, "10 ms RTT, 100 ms per draft: k = 1 pays best");
        assert!((4..=10).contains(&high), "k = {high}");
    }

    #[test]
    fn low_acceptance_chooses_a_shorter_block() {
        let good = chooser(0.9, 100.0, 600.0, false).choose(16, 4);
        let bad = chooser(0.2, 100.0, 600.0, false).choose(16, 4);
        assert!(
            bad < good,
            "low acceptance k {bad} >= high acceptance k {good}"
        );
        assert_eq!(bad, 1);
    }

    #[test]
    fn pipelining_makes_longer_blocks_cheaper_and_limits_bind() {
        let plain = chooser(0.85, 100.0, 300.0, false);
        let piped = chooser(0.85, 100.0, 300.0, true);
        assert!(piped.rate(6).unwrap() > plain.rate(6).unwrap());
        assert!(piped.choose(16, 4) >= plain.choose(16, 4));
        assert_eq!(plain.choose(2, 4), plain.choose(16, 4).min(2));
        // Before any measurement the fallback is used (clamped to the range).
        let fresh = AdaptiveK::new(&SpeculationConfig::default());
        assert_eq!(fresh.choose(16, 4), 4);
        assert_eq!(fresh.choose(3, 4), 3);
    }

    #[test]
    fn rtt_slope_is_learned_from_different_block_lengths() {
        let cfg = SpeculationConfig {
            verify_ms_per_token: 0.0,
            ..SpeculationConfig::default()
        };
        let mut a = AdaptiveK::new(&cfg);
        for _ in 0..50 {
            for k in [1usize, 4, 8] {
                a.observe_round(k, 0, 200.0 + 30.0 * (k + 1) as f64);
            }
        }
        let r2 = a.rtt_ms(2).unwrap();
        let r10 = a.rtt_ms(10).unwrap();
        assert!((r10 - r2 - 240.0).abs() < 25.0, "slope: {r2} -> {r10}");
    }

    #[test]
    fn config_checks() {
        assert!(SpeculationConfig::default().validate().is_ok());
        let bad = SpeculationConfig {
            k_min: 5,
            k_max: 3,
            ..SpeculationConfig::default()
        };
        assert!(bad.validate().is_err());
        let bad = SpeculationConfig {
            target_stream: true,
            pipeline: true,
            ..SpeculationConfig::default()
        };
        assert!(bad.validate().is_err());
        assert!(!SpeculationConfig::default().active());
    }
}
