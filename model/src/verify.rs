//! Speculative verification math: pure functions shared by the local speculative loop,
//! the cloud verifier and split execution.
//!
//! A round drafts `k` tokens `d1..dk` after the last accepted token; the target runs
//! one forward over `[last, d1..dk]` and so has `k + 1` next-token predictions: for the
//! positions after `last`, `d1`, …, `dk`. The answer is a [`Verdict`]: accept the first
//! `accepted` draft tokens, then emit `next_token` (the target's token at the first
//! rejected position, or a bonus token from the last prediction when all `k` were
//! accepted). Every round therefore emits `accepted + 1` tokens.
//!
//! The target's token at each position is [`crate::sampling::next_token`]: its argmax
//! in greedy mode, its keyed draw ([`crate::sampling::keyed_token`]) in sampled mode,
//! and [`verify_prefix`] accepts the longest prefix of the draft equal to those tokens.
//! So the output is, token for token, what the target alone would produce with the
//! same parameters and seed, in both modes and for any proposal: the proposer (draft
//! model, prompt lookup, an old client) only changes how many tokens a round yields.
//! The draft samples with the same key, so where its distribution is close to the
//! target's it draws the target's token (Gumbel-max coupling; the acceptance rate is
//! at least `(1 - tv) / (1 + tv)` for total variation distance `tv`, against `1 - tv`
//! for the rejection rule of Leviathan et al., which gives up this reproducibility:
//! its output depends on what was drafted).

use serde::{Deserialize, Serialize};

use crate::logprobs::{chosen_logprobs, TokenLogprobs};
use crate::sampling::{next_token, SamplingParams};
use crate::{ModelError, Result};

/// Largest draft block a verify accepts. (Here, in the leaf both the
/// proposers and the loops use, so that neither imports the other for it.)
pub const MAX_K: usize = 16;

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

/// The verdict on `draft` given the target's tokens.
///
/// `target[i]` is the target's token ([`next_token`]) at the position that predicts
/// `draft[i]` (and `target[k]` the one after `draft[k-1]`), so it has `k + 1`
/// entries. Accepts the longest prefix where `draft[i] == target[i]`;
/// `next_token = target[accepted]`.
///
/// Errors when the draft is empty or `target.len() != draft.len() + 1`.
pub fn verify_prefix(draft: &[u32], target: &[u32]) -> Result<Verdict> {
    let k = draft.len();
    if k == 0 {
        return Err(invalid(
            "cannot verify an empty draft (k must be >= 1)".into(),
        ));
    }
    if target.len() != k + 1 {
        return Err(invalid(format!(
            "verify of {k} draft tokens needs {} target predictions, got {}",
            k + 1,
            target.len()
        )));
    }
    Ok(first_disagreement(draft, |i| target[i]))
}

/// The prefix rule, the one place it exists: walks `draft` while it equals the
/// target's token at each position (`target_at(i)`, asked in order and only up
/// to the first disagreement, or `k` when all agree) and answers that position's
/// target token.
fn first_disagreement(draft: &[u32], mut target_at: impl FnMut(usize) -> u32) -> Verdict {
    let mut accepted = 0;
    loop {
        let t = target_at(accepted);
        match draft.get(accepted) {
            Some(&d) if d == t => accepted += 1,
            _ => {
                return Verdict {
                    accepted,
                    next_token: t,
                }
            }
        }
    }
}

/// The verdict for `draft` (k tokens, `k = 0` allowed: a plain next-token step)
/// from the target's logits `[k + 1, vocab]` over `[last, d1..dk]`, under `params`
/// (temperature, top-k/p, repetition penalty over `history` = the context up to and
/// including `last`, and the seed, keyed by each token's position in it). The one
/// place this step exists: the local speculative loop, the verifier and split
/// execution all call it.
///
/// Errors on mismatched lengths.
pub fn verdict_from_logits(
    params: &SamplingParams,
    history: &[u32],
    draft: &[u32],
    logits: &[f32],
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
    // The history each position's prediction sees: ..last, d1..d(i-1). Rows
    // past the first disagreement are never turned into tokens (in sampled
    // mode each is a full-vocabulary distribution).
    let mut hist = history.to_vec();
    Ok(first_disagreement(draft, |i| {
        if let Some(&d) = i.checked_sub(1).and_then(|j| draft.get(j)) {
            hist.push(d);
        }
        next_token(params, &logits[i * vocab..(i + 1) * vocab], &hist)
    }))
}

/// The logprobs of the tokens `verdict` emits on `draft` (`draft[..accepted]`,
/// then `next_token`), each from its row of the target's `logits`
/// (`[k + 1, vocab]` over `[last, d1..dk]`) after `history` and the accepted
/// drafts before it, with `top` alternatives ([`chosen_logprobs`]): what
/// the verifier returns when a session asks for logprobs.
///
/// Errors on mismatched lengths.
pub fn verdict_logprobs(
    params: &SamplingParams,
    history: &[u32],
    draft: &[u32],
    logits: &[f32],
    verdict: &Verdict,
    top: usize,
) -> Result<Vec<TokenLogprobs>> {
    let k = draft.len();
    let vocab = logits.len() / (k + 1);
    if vocab == 0 || logits.len() != (k + 1) * vocab || verdict.accepted > k {
        return Err(invalid(format!(
            "logprobs of a verdict on {k} draft tokens need {} rows of logits, got {} floats",
            k + 1,
            logits.len()
        )));
    }
    let emitted = verdict.emitted(draft);
    let mut hist = history.to_vec();
    let mut out = Vec::with_capacity(emitted.len());
    for (i, &t) in emitted.iter().enumerate() {
        let row = &logits[i * vocab..(i + 1) * vocab];
        out.push(chosen_logprobs(params, row, &hist, t, top));
        hist.push(t);
    }
    Ok(out)
}
