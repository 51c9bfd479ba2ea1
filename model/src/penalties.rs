//! OpenAI's presence and frequency penalties and its logit bias, on f32 logits.
//!
//! Definitions (OpenAI's): for every token `t` that occurs `c[t]` times among the
//! tokens generated so far in this completion (the prompt does not count),
//!
//! ```text
//! logit[t] -= c[t] * frequency_penalty + (c[t] > 0) * presence_penalty
//! ```
//!
//! then `logit[t] += bias[t]` for every entry of the logit bias. Both sides of a
//! speculative generation (the device's draft and local tokens, the verifier's
//! target) call [`apply_openai_penalties`], the one place this arithmetic exists,
//! so a position's adjusted logits are the same bits wherever they are computed
//! (the f32 operations and their order are fixed here).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{ModelError, Result};

/// Most entries a logit bias may hold (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;

/// A bias is in `[-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]` (OpenAI: -100..100).
pub const LOGIT_BIAS_LIMIT: f32 = 100.0;

/// A presence or frequency penalty is in `[-PENALTY_LIMIT, PENALTY_LIMIT]`
/// (OpenAI: -2..2).
pub const PENALTY_LIMIT: f32 = 2.0;

/// A logit bias: token id → value added to its logit, at most
/// [`MAX_LOGIT_BIAS`] entries, sorted by token id, each id once, each value
/// finite and within [`LOGIT_BIAS_LIMIT`].
///
/// Stored inline (a fixed array) so that [`crate::sampling::SamplingParams`]
/// stays `Copy`. Serialised as `[[token, bias], ...]`; deserialising checks
/// the same rules as [`LogitBias::new`].
#[derive(Clone, Copy, PartialEq)]
pub struct LogitBias {
    len: usize,
    entries: [(u32, f32); MAX_LOGIT_BIAS],
}

impl Default for LogitBias {
    fn default() -> Self {
        Self {
            len: 0,
            entries: [(0, 0.0); MAX_LOGIT_BIAS],
        }
    }
}

impl std::fmt::Debug for LogitBias {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.entries()).finish()
    }
}

impl LogitBias {
    /// A bias from `(token, value)` pairs in any order; errors name the rule a
    /// pair breaks (too many, a value out of range or not finite, a token twice).
    pub fn new(pairs: impl IntoIterator<Item = (u32, f32)>) -> Result<Self> {
        let mut b = Self::default();
        for (token, bias) in pairs {
            if b.len == MAX_LOGIT_BIAS {
                return Err(ModelError::InvalidArgument(format!(
                    "logit_bias takes at most {MAX_LOGIT_BIAS} tokens"
                )));
            }
            if !bias.is_finite() || bias.abs() > LOGIT_BIAS_LIMIT {
                return Err(ModelError::InvalidArgument(format!(
                    "logit_bias of token {token} must be in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}], got {bias}"
                )));
            }
            b.entries[b.len] = (token, bias);
            b.len += 1;
        }
        let e = &mut b.entries[..b.len];
        e.sort_by_key(|&(t, _)| t);
        if let Some(w) = e.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(ModelError::InvalidArgument(format!(
                "logit_bias names token {} twice",
                w[0].0
            )));
        }
        Ok(b)
    }

    /// The `(token, bias)` entries, sorted by token id.
    pub fn entries(&self) -> &[(u32, f32)] {
        &self.entries[..self.len]
    }

    /// No entry.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The largest token id named (to check it against a vocabulary).
    pub fn max_token(&self) -> Option<u32> {
        self.entries().last().map(|&(t, _)| t)
    }
}

impl Serialize for LogitBias {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.entries().serialize(s)
    }
}

impl<'de> Deserialize<'de> for LogitBias {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let pairs = Vec::<(u32, f32)>::deserialize(d)?;
        if pairs.len() > MAX_LOGIT_BIAS {
            return Err(serde::de::Error::custom(format!(
                "logit_bias takes at most {MAX_LOGIT_BIAS} tokens"
            )));
        }
        LogitBias::new(pairs).map_err(serde::de::Error::custom)
    }
}

/// Checks that a presence or frequency penalty named `what` is finite and in
/// `[-PENALTY_LIMIT, PENALTY_LIMIT]`.
pub fn check_penalty(what: &str, value: f32) -> Result<()> {
    if value.is_finite() && value.abs() <= PENALTY_LIMIT {
        Ok(())
    } else {
        Err(ModelError::InvalidArgument(format!(
            "{what} must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}], got {value}"
        )))
    }
}

/// Applies OpenAI's presence and frequency penalties over `completion` (the
/// tokens generated so far, not the prompt) and then `bias`, to `logits` in
/// place (see the module documentation). Tokens outside the vocabulary are
/// ignored. Penalties of 0 and an empty bias leave the logits untouched.
pub fn apply_openai_penalties(
    logits: &mut [f32],
    completion: &[u32],
    presence: f32,
    frequency: f32,
    bias: &LogitBias,
) {
    if (presence != 0.0 || frequency != 0.0) && !completion.is_empty() {
        let mut sorted = completion.to_vec();
        sorted.sort_unstable();
        for run in sorted.chunk_by(|a, b| a == b) {
            if let Some(l) = logits.get_mut(run[0] as usize) {
                let count = run.len() as f32;
                *l -= count * frequency + presence;
            }
        }
    }
    for &(t, b) in bias.entries() {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
}
