//! Token sampling: greedy, temperature, top-k, top-p and repetition penalty, seeded.
//!
//! The pipeline that turns a row of logits into the distribution a token is drawn from
//! is [`distribution`]:
//!
//! 1. **repetition penalty** (llama.cpp semantics): every distinct token among the last
//!    [`REPETITION_WINDOW`] tokens of the history has its logit divided by the penalty
//!    when positive and multiplied by it when negative (or zero);
//! 2. **presence and frequency penalties, logit bias** (OpenAI semantics, over the
//!    completion's tokens: the history from [`SamplingParams::completion_start`]; see
//!    [`crate::penalties`]); steps 1 and 2 are [`adjusted_logits`], what greedy
//!    decoding takes the argmax of;
//! 3. **temperature** (`0` = greedy: the distribution is a point mass on the argmax);
//! 4. **top-k**: keep the `k` most likely tokens (ties: lower token id first);
//! 5. **top-p** (nucleus): keep the smallest set of most likely tokens whose cumulative
//!    probability is at least `top_p`;
//! 6. renormalise.
//!
//! Top-p is applied to the tempered probabilities (the Hugging Face order). The result
//! is a sparse [`Distribution`] sorted by token id.
//!
//! **Keyed draws.** A sampled token is drawn by [`keyed_token`]: every candidate token
//! `t` at context position `pos` gets a uniform `u = keyed_uniform(seed, pos, t)`, a
//! hash of those three numbers only, and the token with the smallest `-ln(u) / p(t)`
//! wins (an exponential race, i.e. Gumbel-max: `t` wins with probability exactly
//! `p(t)`). The draw at a position therefore depends on the seed, the position and the
//! distribution, and on nothing else: not on how many draws came before, which model
//! proposed what, how blocks were cut or which process computed it. That is what makes
//! a seeded speculative generation the target's own seeded generation, token for
//! token ([`crate::verify`]), and two close distributions (draft and target) draw the
//! same token with high probability under the same key. The hash (SplitMix64) and the
//! race are written out here, so a seed gives the same tokens with every dependency
//! version; across platforms they rest on libm's `exp` and `ln`, which
//! `tests/cross_arch_identity.rs` pins for x86-64 and aarch64 (glibc).

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::penalties::{apply_openai_penalties, check_penalty, LogitBias};
use crate::{ModelError, Result};

/// How many of the most recent history tokens the repetition penalty looks at
/// (llama.cpp's default `penalty_last_n`).
pub const REPETITION_WINDOW: usize = 64;

/// How the next token is chosen from the logits.
///
/// The default is greedy decoding with every filter off.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` turns the filter off.
    pub top_k: usize,
    /// Nucleus sampling threshold in `(0, 1]`; `1` turns the filter off.
    pub top_p: f32,
    /// Repetition penalty (`>= 1` discourages repeats); `1` turns it off.
    pub repetition_penalty: f32,
    /// Seed of the sampler's random number generator.
    pub seed: u64,
    /// OpenAI's presence penalty in `[-2, 2]` (0 = off): subtracted once from the
    /// logit of every token the completion already holds.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty in `[-2, 2]` (0 = off): subtracted from a
    /// token's logit once per occurrence in the completion.
    pub frequency_penalty: f32,
    /// OpenAI's logit bias: added to the named tokens' logits (after the penalties).
    pub logit_bias: LogitBias,
    /// Context position of the completion's first token: the presence and
    /// frequency penalties count the history from here on (the prompt does not
    /// count). The generation loops set it to the prompt's length
    /// ([`SamplingParams::for_prompt`]); it matters only with a penalty on.
    pub completion_start: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: LogitBias::default(),
            completion_start: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (the default).
    pub fn greedy() -> Self {
        Self::default()
    }

    /// True when the next token is the argmax and no randomness is involved.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// True when OpenAI's presence or frequency penalty or a logit bias is on
    /// (a verifier must then apply them too).
    pub fn has_openai_penalties(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || !self.logit_bias.is_empty()
    }

    /// These parameters for a generation whose prompt has `prompt_len` tokens
    /// (the completion starts there: [`Self::completion_start`]).
    pub fn for_prompt(mut self, prompt_len: usize) -> Self {
        self.completion_start = prompt_len;
        self
    }

    /// Checks that every field is in range; the error says which one is wrong and why.
    pub fn validate(&self) -> Result<()> {
        check_penalty("presence_penalty", self.presence_penalty)?;
        check_penalty("frequency_penalty", self.frequency_penalty)?;
        let bad = |msg: String| Err(ModelError::InvalidArgument(msg));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!(
                "temperature must be a finite number >= 0 (0 = greedy), got {}",
                self.temperature
            ));
        }
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return bad(format!(
                "top_p must be in (0, 1] (1 = off), got {}",
                self.top_p
            ));
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad(format!(
                "repetition_penalty must be a finite number > 0 (1 = off), got {}",
                self.repetition_penalty
            ));
        }
        Ok(())
    }
}

/// Index of the largest logit.
///
/// Ties go to the lowest index; NaN entries are ignored. Returns `0` for an empty or
/// all-NaN slice.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some((_, b)) if v <= b => {}
            _ => best = Some((i, v)),
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// Softmax probability of token `t` under `logits` (temperature 1), computed in
/// f64 relative to `logits[t]`: the draft's confidence in its greedy token when
/// `t` is the [`argmax`]. 0 when `t` is out of range or the sum is not finite.
pub fn token_prob(logits: &[f32], t: u32) -> f32 {
    let Some(&m) = logits.get(t as usize) else {
        return 0.0;
    };
    let z: f64 = logits.iter().map(|&l| f64::from(l - m).exp()).sum();
    if z.is_finite() && z > 0.0 {
        (1.0 / z) as f32
    } else {
        0.0
    }
}

/// A probability distribution over token ids, stored sparsely.
///
/// Entries are `(token, prob)` sorted by ascending token id, token ids are unique,
/// probabilities are finite, non-negative, sum to 1 (up to rounding) and there is at
/// least one entry with positive probability. Tokens that are absent have probability 0.
///
/// Serialised as `{"entries": [[token, prob], ...]}`; deserialising checks the same
/// invariants as [`Distribution::from_pairs`], so untrusted input cannot produce an
/// invalid distribution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "DistributionRepr", into = "DistributionRepr")]
pub struct Distribution {
    entries: Vec<(u32, f32)>,
}

impl Distribution {
    /// All mass on one token (what greedy decoding samples from).
    pub fn point(token: u32) -> Self {
        Self {
            entries: vec![(token, 1.0)],
        }
    }

    /// Builds a distribution from `(token, weight)` pairs, normalising the weights.
    ///
    /// Checks everything, as for untrusted input: weights finite and `>= 0`, token
    /// ids unique, at least one positive weight. Zero-weight entries are dropped;
    /// order is free.
    pub fn from_pairs(pairs: impl IntoIterator<Item = (u32, f32)>) -> Result<Self> {
        let mut entries: Vec<(u32, f32)> = pairs.into_iter().collect();
        for &(token, p) in &entries {
            if !p.is_finite() || p < 0.0 {
                return Err(ModelError::InvalidArgument(format!(
                    "probability of token {token} must be finite and >= 0, got {p}"
                )));
            }
        }
        entries.sort_by_key(|&(t, _)| t);
        if let Some(w) = entries.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(ModelError::InvalidArgument(format!(
                "token {} appears twice in a distribution",
                w[0].0
            )));
        }
        let weighted: Vec<(u32, f64)> = entries.iter().map(|&(t, p)| (t, p as f64)).collect();
        Self::from_weights_sorted(weighted).ok_or_else(|| {
            ModelError::InvalidArgument(
                "distribution has no token with positive probability".into(),
            )
        })
    }

    /// Normalises `(token, weight)` pairs already sorted by unique token id; drops
    /// zero weights. `None` when no weight is positive.
    fn from_weights_sorted(weights: Vec<(u32, f64)>) -> Option<Self> {
        let total: f64 = weights.iter().map(|&(_, w)| w).sum();
        if !(total > 0.0 && total.is_finite()) {
            return None;
        }
        let entries: Vec<(u32, f32)> = weights
            .into_iter()
            .filter(|&(_, w)| w > 0.0)
            .map(|(t, w)| (t, (w / total) as f32))
            .filter(|&(_, p)| p > 0.0)
            .collect();
        if entries.is_empty() {
            None
        } else {
            Some(Self { entries })
        }
    }

    /// The `(token, prob)` entries, sorted by token id.
    pub fn entries(&self) -> &[(u32, f32)] {
        &self.entries
    }

    /// Number of tokens with an entry.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Always false (a distribution has at least one token); present for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Probability of `token` (0 when it has no entry).
    pub fn prob(&self, token: u32) -> f32 {
        match self.entries.binary_search_by_key(&token, |&(t, _)| t) {
            Ok(i) => self.entries[i].1,
            Err(_) => 0.0,
        }
    }

    /// The most likely token (ties: lowest id).
    pub fn mode(&self) -> u32 {
        let mut best = (0u32, f32::NEG_INFINITY);
        for &(t, p) in &self.entries {
            if p > best.1 {
                best = (t, p);
            }
        }
        best.0
    }
}

/// The serialised form of a [`Distribution`].
#[derive(Serialize, Deserialize)]
struct DistributionRepr {
    entries: Vec<(u32, f32)>,
}

impl From<Distribution> for DistributionRepr {
    fn from(d: Distribution) -> Self {
        Self { entries: d.entries }
    }
}

impl TryFrom<DistributionRepr> for Distribution {
    type Error = ModelError;

    /// Validates like [`Distribution::from_pairs`]; entries that already sum to 1
    /// (within 1e-4) are kept bit for bit, so a round trip is exact.
    fn try_from(r: DistributionRepr) -> Result<Self> {
        let normalised = Distribution::from_pairs(r.entries.iter().copied())?;
        let sum: f64 = r.entries.iter().map(|&(_, p)| p as f64).sum();
        if (sum - 1.0).abs() <= 1e-4 {
            let mut entries: Vec<(u32, f32)> =
                r.entries.into_iter().filter(|&(_, p)| p > 0.0).collect();
            entries.sort_by_key(|&(t, _)| t);
            Ok(Self { entries })
        } else {
            Ok(normalised)
        }
    }
}

/// Applies the repetition penalty (llama.cpp semantics) to `logits` in place: each
/// distinct token among the last [`REPETITION_WINDOW`] history tokens has a positive
/// logit divided by `penalty` and a non-positive one multiplied by it. History tokens
/// outside the vocabulary are ignored. A penalty of 1 leaves the logits untouched.
pub fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let start = history.len().saturating_sub(REPETITION_WINDOW);
    let mut seen: Vec<u32> = history[start..].to_vec();
    seen.sort_unstable();
    seen.dedup();
    for t in seen {
        if let Some(l) = logits.get_mut(t as usize) {
            if *l > 0.0 {
                *l /= penalty;
            } else {
                *l *= penalty;
            }
        }
    }
}

/// The logits a token is chosen from: `logits` after the repetition penalty over
/// `history` and OpenAI's penalties over its completion part and logit bias
/// (borrowed unchanged when all are off). Greedy decoding takes their argmax;
/// logprobs are their log-softmax.
pub fn adjusted_logits<'a>(
    params: &SamplingParams,
    logits: &'a [f32],
    history: &[u32],
) -> Cow<'a, [f32]> {
    let repeat = params.repetition_penalty != 1.0 && !history.is_empty();
    if !repeat && !params.has_openai_penalties() {
        return Cow::Borrowed(logits);
    }
    let mut v = logits.to_vec();
    if repeat {
        apply_repetition_penalty(&mut v, history, params.repetition_penalty);
    }
    let completion = history.get(params.completion_start..).unwrap_or_default();
    apply_openai_penalties(
        &mut v,
        completion,
        params.presence_penalty,
        params.frequency_penalty,
        &params.logit_bias,
    );
    Cow::Owned(v)
}

/// The distribution the next token is sampled from, given the logits of the last
/// position and the tokens generated so far (for the penalties: [`adjusted_logits`]).
///
/// Greedy parameters give a point mass on the argmax of the penalised logits. NaN
/// logits count as impossible tokens; if no token is possible the result is a point
/// mass on token 0. Parameters are expected to have passed
/// [`SamplingParams::validate`]; an invalid temperature falls back to greedy and an
/// invalid `top_p` is clamped to `[0, 1]`, so the result is always a distribution.
pub fn distribution(params: &SamplingParams, logits: &[f32], history: &[u32]) -> Distribution {
    let adjusted = adjusted_logits(params, logits, history);
    let logits = &adjusted[..];

    let temperature = params.temperature as f64;
    // Greedy, and the fallback for a temperature that skipped validation (NaN, < 0, inf).
    if temperature.is_nan() || temperature <= 0.0 || temperature.is_infinite() {
        return Distribution::point(argmax(logits));
    }

    let max = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return Distribution::point(argmax(logits));
    }
    if max == f32::INFINITY {
        // Infinite logits dominate everything else: uniform over them.
        let weights: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .filter(|&(_, &v)| v == f32::INFINITY)
            .map(|(i, _)| (i as u32, 1.0))
            .collect();
        return Distribution::from_weights_sorted(weights)
            .unwrap_or_else(|| Distribution::point(argmax(logits)));
    }
    let max = max as f64;
    // (token, weight) with weight = exp((l - max) / T) in (0, 1]; the max has weight 1.
    let mut cand: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .filter(|&(_, &v)| !v.is_nan())
        .map(|(i, &v)| (i as u32, ((v as f64 - max) / temperature).exp()))
        .filter(|&(_, w)| w > 0.0)
        .collect();

    let desc = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let top_k = params.top_k;
    let top_p = (params.top_p as f64).clamp(0.0, 1.0);
    if top_k > 0 && top_k < cand.len() {
        cand.select_nth_unstable_by(top_k - 1, desc);
        cand.truncate(top_k);
    }
    if top_p < 1.0 {
        let total: f64 = cand.iter().map(|&(_, w)| w).sum();
        let target = top_p * total;
        // Only the head of the sorted order matters: partition out the `m` heaviest
        // candidates, growing `m` until they hold enough mass, and sort just those.
        let mut m = 256.min(cand.len());
        loop {
            if m < cand.len() {
                cand.select_nth_unstable_by(m - 1, desc);
            }
            let head: f64 = cand[..m].iter().map(|&(_, w)| w).sum();
            if head >= target || m == cand.len() {
                break;
            }
            m = (m * 8).min(cand.len());
        }
        cand.truncate(m);
        cand.sort_unstable_by(desc);
        let mut cum = 0.0;
        let mut keep = cand.len();
        for (i, &(_, w)) in cand.iter().enumerate() {
            cum += w;
            if cum >= target {
                keep = i + 1;
                break;
            }
        }
        cand.truncate(keep.max(1));
    }
    cand.sort_unstable_by_key(|&(t, _)| t);
    Distribution::from_weights_sorted(cand).unwrap_or_else(|| Distribution::point(argmax(logits)))
}

/// SplitMix64 step: used to expand a 64-bit seed into the xoshiro state.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A seeded random number generator (for tests and synthetic inputs; tokens are
/// drawn by [`keyed_token`], which needs no generator state).
///
/// The generator is xoshiro256** (Blackman & Vigna) with its state expanded from the
/// seed by SplitMix64, both written out here, so a seed gives the same sequence on
/// every platform and every version of every dependency.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sampler {
    s: [u64; 4],
}

impl Sampler {
    /// A sampler seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let s = [
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
        ];
        Self { s }
    }

    /// A sampler with the raw xoshiro256** state (must not be all zero; an all-zero
    /// state is replaced by the state of seed 0). For reference-vector tests.
    pub fn from_state(s: [u64; 4]) -> Self {
        if s == [0; 4] {
            Self::new(0)
        } else {
            Self { s }
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniform number in `[0, 1)` with 53 bits of precision.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// The greedy choice: the argmax of [`adjusted_logits`] (no copy when every
/// penalty is off).
pub fn greedy_token(params: &SamplingParams, logits: &[f32], history: &[u32]) -> u32 {
    argmax(&adjusted_logits(params, logits, history))
}

/// A uniform number in `(0, 1]` that depends on `seed`, the context `position` and
/// the `token` only (SplitMix64 over the three).
pub fn keyed_uniform(seed: u64, position: usize, token: u32) -> f64 {
    keyed_unit(position_key(seed, position), token)
}

/// The part of the key shared by every token of one position.
fn position_key(seed: u64, position: usize) -> u64 {
    let mut s = seed;
    let mut p = splitmix64(&mut s) ^ position as u64;
    splitmix64(&mut p)
}

/// `(0, 1]` from a position key and a token.
fn keyed_unit(key: u64, token: u32) -> f64 {
    let mut s = key ^ u64::from(token).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    ((splitmix64(&mut s) >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The token `dist` yields at context `position` under `seed`: the smallest
/// `-ln(u_t) / p(t)` over its tokens, with `u_t = keyed_uniform(seed, position, t)`
/// (ties, which have probability 0, go to the lower token id). Over seeds, token
/// `t` is drawn with probability `p(t)`; for one seed and position, the draw is a
/// fixed function of the distribution. A one-token distribution returns its token.
pub fn keyed_token(dist: &Distribution, seed: u64, position: usize) -> u32 {
    if let [(t, _)] = dist.entries() {
        return *t;
    }
    let key = position_key(seed, position);
    let mut best = (dist.mode(), f64::INFINITY);
    for &(t, p) in dist.entries() {
        let p = f64::from(p);
        if p <= 0.0 {
            continue;
        }
        let u = keyed_unit(key, t);
        // -ln(u) >= 1 - u: most tokens lose without the logarithm.
        if (1.0 - u) / p >= best.1 {
            continue;
        }
        let race = -u.ln() / p;
        if race < best.1 {
            best = (t, race);
        }
    }
    best.0
}

/// The next token from one row of logits under `params`, for the context
/// `history` (the tokens before it; its position is `history.len()`): greedy
/// parameters take the argmax of the penalised logits, sampled ones the
/// [`keyed_token`] of [`distribution`]. The one place a token is picked: the
/// target-only loop, the draft, the verifier and split execution all call it,
/// which is why a seeded generation is the same whichever of them computed a
/// position.
pub fn next_token(params: &SamplingParams, logits: &[f32], history: &[u32]) -> u32 {
    if params.is_greedy() {
        greedy_token(params, logits, history)
    } else {
        keyed_token(
            &distribution(params, logits, history),
            params.seed,
            history.len(),
        )
    }
}
