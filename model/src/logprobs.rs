//! Log-probabilities of chosen tokens, as OpenAI's `logprobs` reports them.
//!
//! A token's logprob is the log-softmax (temperature 1) of the logits it was
//! chosen from after the penalties and the logit bias
//! ([`crate::sampling::adjusted_logits`]): the distribution greedy decoding takes
//! the argmax of. Temperature, top-k and top-p are not applied (as OpenAI and
//! vLLM report them). The verifier computes them for the target's tokens and the
//! device for the draft's, with this one function.

use serde::{Deserialize, Serialize};

use crate::sampling::{adjusted_logits, SamplingParams};

/// Most alternatives a token's logprobs list (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One chosen token's log-probability and the most likely tokens at its
/// position.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// The chosen token.
    pub token: u32,
    /// Its log-probability (`-inf` when impossible).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first
    /// (ties: lower token id first).
    pub top: Vec<(u32, f32)>,
}

/// The log-softmax of `logits` at `token`, and the `top` most likely tokens
/// (at most [`MAX_TOP_LOGPROBS`]). NaN logits count as impossible tokens; the
/// normaliser is computed in f64.
pub fn token_logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let lse = if max.is_finite() {
        let sum: f64 = logits
            .iter()
            .filter(|v| !v.is_nan())
            .map(|&v| (f64::from(v) - f64::from(max)).exp())
            .sum();
        f64::from(max) + sum.ln()
    } else {
        f64::from(max)
    };
    let lp = |v: f32| -> f32 {
        if v.is_nan() || !lse.is_finite() {
            f32::NEG_INFINITY
        } else {
            (f64::from(v) - lse) as f32
        }
    };
    let logprob = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&v| lp(v));
    let n = top.min(MAX_TOP_LOGPROBS).min(logits.len());
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &v) in logits.iter().enumerate() {
            if v.is_nan() {
                continue;
            }
            // Keep the n largest, sorted by (value desc, id asc); ids come in
            // ascending order, so a tie never displaces an earlier id.
            if best.len() == n && best.last().is_some_and(|&(_, w)| v <= w) {
                continue;
            }
            let at = best.partition_point(|&(_, w)| w >= v);
            best.insert(at, (i as u32, v));
            best.truncate(n);
        }
    }
    TokenLogprobs {
        token,
        logprob,
        top: best.into_iter().map(|(t, v)| (t, lp(v))).collect(),
    }
}

/// The logprobs of `token`, chosen under `params` from one row of raw
/// `logits` after `history`: [`token_logprobs`] of
/// [`adjusted_logits`]. The one place a chosen token's logprobs are computed
/// (the verifier for the target's tokens, the device for the draft's).
pub fn chosen_logprobs(
    params: &SamplingParams,
    logits: &[f32],
    history: &[u32],
    token: u32,
    top: usize,
) -> TokenLogprobs {
    token_logprobs(&adjusted_logits(params, logits, history), token, top)
}
