//! Speculative verification math: pure functions shared by the local speculative loop
//! and the cloud verifier.
//!
//! A round drafts `k` tokens `d1..dk` after the last accepted token; the target runs
//! one forward over `[last, d1..dk]` and so has `k + 1` next-token predictions: for the
//! positions after `last`, `d1`, …, `dk`. The answer is a [`Verdict`]: accept the first
//! `accepted` draft tokens, then emit `next_token` (the target's correction at the
//! first rejected position, or a bonus token from the last prediction when all `k`
//! were accepted). Every round therefore emits `accepted + 1` tokens.
//!
//! - [`verify_greedy`]: longest prefix of the draft matching the target's argmax.
//!   The output is token for token the target's own greedy output.
//! - [`verify_sampled`]: the lossless rejection rule of Leviathan et al. (2023) and
//!   Chen et al. (2023): accept `d_i` with probability `min(1, p_i(d_i) / q_i(d_i))`;
//!   at the first rejection draw from `norm(max(0, p_i - q_i))`; if all are accepted
//!   draw the bonus from `p_{k+1}`. The emitted tokens are distributed exactly as if
//!   sampled from the target's distributions `p` one at a time, provided the draft
//!   really drew `d_i` from `q_i` — which is why the draft samples from its
//!   top-k-truncated distribution ([`crate::sampling::top_k_truncate`]) and sends those
//!   `(token, prob)` pairs along.

use serde::{Deserialize, Serialize};

use crate::sampling::{
    distribution, greedy_token, sample_weighted, Distribution, Sampler, SamplingParams,
};
use crate::{ModelError, Result};

/// The verifier's answer to a drafted block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Verdict {
    /// How many draft tokens (a prefix of the block) are accepted.
    pub accepted: usize,
    /// The token emitted after the accepted prefix: the target's correction, or the
    /// bonus token when the whole block was accepted.
    pub next_token: u32,
}

impl Verdict {
    /// The tokens this verdict emits, given the draft it answers:
    /// `draft[..accepted]` followed by `next_token`.
    pub fn emitted(&self, draft: &[u32]) -> Vec<u32> {
        let n = self.accepted.min(draft.len());
        let mut out = Vec::with_capacity(n + 1);
        out.extend_from_slice(&draft[..n]);
        out.push(self.next_token);
        out
    }

    /// True when every draft token was accepted (`next_token` is the bonus token).
    pub fn all_accepted(&self, k: usize) -> bool {
        self.accepted == k
    }
}

fn invalid(msg: String) -> ModelError {
    ModelError::InvalidArgument(msg)
}

/// Greedy verification.
///
/// `target_argmax[i]` is the argmax of the target's logits at the position that
/// predicts `draft[i]` (and `target_argmax[k]` the one after `draft[k-1]`), so it has
/// `k + 1` entries. Accepts the longest prefix where `draft[i] == target_argmax[i]`;
/// `next_token = target_argmax[accepted]`.
///
/// Errors when the draft is empty or `target_argmax.len() != draft.len() + 1`.
pub fn verify_greedy(draft: &[u32], target_argmax: &[u32]) -> Result<Verdict> {
    let k = draft.len();
    if k == 0 {
        return Err(invalid(
            "cannot verify an empty draft (k must be >= 1)".into(),
        ));
    }
    if target_argmax.len() != k + 1 {
        return Err(invalid(format!(
            "greedy verify of {k} draft tokens needs {} target predictions, got {}",
            k + 1,
            target_argmax.len()
        )));
    }
    let accepted = draft
        .iter()
        .zip(target_argmax)
        .take_while(|(d, t)| d == t)
        .count();
    Ok(Verdict {
        accepted,
        next_token: target_argmax[accepted],
    })
}

/// The verdict for `draft` (k tokens, `k = 0` allowed: a plain next-token step)
/// from the target's logits `[k + 1, vocab]` over `[last, d1..dk]`: the greedy
/// prefix match or the lossless rejection rule, under `params` (temperature,
/// top-k/p, repetition penalty over `history` = the context up to and
/// including `last`). The one place this step exists: the local speculative
/// loop, the verifier and split execution all call it. Consumes randomness
/// from `rng` only in sampled mode.
///
/// Errors on mismatched lengths, and in sampled mode when the draft
/// distributions are not one per token or do not contain their token.
pub fn verdict_from_logits(
    params: &SamplingParams,
    history: &[u32],
    draft: &[u32],
    draft_dists: &[Distribution],
    logits: &[f32],
    rng: &mut Sampler,
) -> Result<Verdict> {
    let k = draft.len();
    let vocab = logits.len() / (k + 1);
    if vocab == 0 || logits.len() != (k + 1) * vocab {
        return Err(invalid(format!(
            "verdict of {k} draft tokens needs {} rows of logits, got {} floats",
            k + 1,
            logits.len()
        )));
    }
    let row = |i: usize| &logits[i * vocab..(i + 1) * vocab];
    // The history each position's prediction sees: ..last, d1..d(i-1).
    let mut hist = history.to_vec();
    if params.is_greedy() {
        let mut am = Vec::with_capacity(k + 1);
        for i in 0..=k {
            am.push(greedy_token(params, row(i), &hist));
            if let Some(&d) = draft.get(i) {
                hist.push(d);
            }
        }
        if k == 0 {
            return Ok(Verdict {
                accepted: 0,
                next_token: am[0],
            });
        }
        verify_greedy(draft, &am)
    } else {
        let mut ps = Vec::with_capacity(k + 1);
        for i in 0..=k {
            ps.push(distribution(params, row(i), &hist));
            if let Some(&d) = draft.get(i) {
                hist.push(d);
            }
        }
        if k == 0 {
            return Ok(Verdict {
                accepted: 0,
                next_token: rng.sample(&ps[0]),
            });
        }
        verify_sampled(draft, draft_dists, &ps, rng)
    }
}

/// Lossless rejection-sampling verification.
///
/// - `draft`: the `k` drafted tokens; `draft[i]` was sampled from `draft_dists[i]`.
/// - `draft_dists`: the draft's (top-k-truncated) distributions `q_1..q_k`; tokens
///   without an entry have `q = 0`.
/// - `target_dists`: the target's sampling distributions `p_1..p_{k+1}` at the same
///   positions (after temperature / top-k / top-p, see
///   [`crate::sampling::distribution`]).
/// - `rng`: the verifier's random source; each call consumes one uniform per examined
///   draft token plus one for the emitted token (none when that distribution has a
///   single token).
///
/// Errors on an empty draft, on mismatched lengths, and when `q_i(d_i) = 0` (the draft
/// could not have sampled that token: a caller bug that would break losslessness).
pub fn verify_sampled(
    draft: &[u32],
    draft_dists: &[Distribution],
    target_dists: &[Distribution],
    rng: &mut Sampler,
) -> Result<Verdict> {
    let k = draft.len();
    if k == 0 {
        return Err(invalid(
            "cannot verify an empty draft (k must be >= 1)".into(),
        ));
    }
    if draft_dists.len() != k {
        return Err(invalid(format!(
            "sampled verify of {k} draft tokens needs {k} draft distributions, got {}",
            draft_dists.len()
        )));
    }
    if target_dists.len() != k + 1 {
        return Err(invalid(format!(
            "sampled verify of {k} draft tokens needs {} target distributions, got {}",
            k + 1,
            target_dists.len()
        )));
    }
    // Check every position before drawing anything, so a bad block fails as a whole.
    for (i, (&d, q)) in draft.iter().zip(draft_dists).enumerate() {
        if q.prob(d) <= 0.0 {
            return Err(invalid(format!(
                "draft token {d} at position {i} has probability 0 in its draft \
                 distribution (the draft must sample from the distribution it sends)"
            )));
        }
    }

    for (i, ((&d, q), p)) in draft.iter().zip(draft_dists).zip(target_dists).enumerate() {
        let q_d = q.prob(d) as f64;
        let p_d = p.prob(d) as f64;
        // Accept with probability min(1, p/q): u < p/q  <=>  u * q < p.
        if rng.uniform() * q_d < p_d {
            continue;
        }
        let next_token = sample_residual(p, q, rng);
        return Ok(Verdict {
            accepted: i,
            next_token,
        });
    }
    Ok(Verdict {
        accepted: k,
        next_token: rng.sample(&target_dists[k]),
    })
}

/// Draws from `norm(max(0, p - q))`; falls back to `p` when the residual has no mass
/// (possible only through rounding, since a rejection implies `p != q`).
fn sample_residual(p: &Distribution, q: &Distribution, rng: &mut Sampler) -> u32 {
    // Only tokens in p's support can have a positive residual.
    let residual = p.entries().iter().map(|&(t, pt)| {
        let r = pt as f64 - q.prob(t) as f64;
        (t, if r > 0.0 { r } else { 0.0 })
    });
    match sample_weighted(rng, residual) {
        Some(t) => t,
        None => rng.sample(p),
    }
}
