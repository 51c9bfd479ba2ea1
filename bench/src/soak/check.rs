//! The soak's correctness check against the target model, run in the bench
//! process after the soak (so the edge RSS measured during it holds no
//! target weights).
//!
//! Greedy mode guarantees: every `Verified` token is the target's greedy
//! choice given the tokens streamed before it (docs/edge.md, "Output
//! guarantee after an outage"). With no provisional token the output is the
//! target-only greedy output; a provisional token the target disagrees with
//! stays, and what follows is the target's greedy continuation of the text
//! shown. So each prompt's target-only greedy output is computed once
//! ([`Reference`], keeping the target's KV cache of it), a generation that is
//! a prefix of it needs no model work, and one that departs from it (at a
//! provisional token) costs one forward over its tokens after the departure,
//! on a copy of the reference's cache cut there.

use super::device::Finished;
use anyhow::{Context, Result};
use std::path::Path;
use tandem_edge::conversation::common_prefix;
use tandem_edge::TokenStatus;
use tandem_model::kv_cache::KvCache;
use tandem_model::sampling::argmax;
use tandem_model::transformer::{LoadOptions, Model};

/// A prompt's target-only greedy generation.
struct Reference {
    prompt: Vec<u32>,
    /// The target's greedy choice at each output position; the last one is a
    /// stop token when the generation stopped on it (stop tokens are not
    /// emitted), so there is one more choice than tokens then.
    choices: Vec<u32>,
    /// The emitted tokens (the choices without a final stop token).
    tokens: Vec<u32>,
    /// The target's KV cache of at least `prompt + tokens[..len - 1]`.
    cache: KvCache,
}

/// The target model and every prompt's reference.
pub struct TargetOracle {
    model: Model,
    references: Vec<Reference>,
}

/// The check of one generation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GenerationCheck {
    pub verified_tokens: usize,
    /// Output positions of verified tokens that are not the target's greedy
    /// choice given the tokens before them (must be empty).
    pub verified_differing: Vec<usize>,
    pub provisional_tokens: usize,
    /// Provisional tokens inside spans the verifier checked.
    pub provisional_checked: usize,
    /// Provisional positions the target disagrees with.
    pub provisional_disagreeing: usize,
    /// Positions where the provisional report is wrong: a reported mismatch
    /// the target agrees with, or, in a checked span, a disagreement not
    /// reported (must be empty).
    pub misreported: Vec<usize>,
    /// Provisional positions outside every reported span (must be empty).
    pub unreported_provisional: Vec<usize>,
    /// The output equals the prompt's target-only greedy output.
    pub equals_target_only: bool,
    /// The output departs from the target-only output (at a provisional token).
    pub departed: bool,
}

impl TargetOracle {
    /// Loads the target and computes every prompt's greedy reference of at most
    /// `max_tokens` tokens (ending early on a `stop_tokens` choice).
    pub fn new(
        target: &Path,
        prompts: &[Vec<u32>],
        max_tokens: usize,
        stop_tokens: &[u32],
    ) -> Result<Self> {
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let capacity = longest.saturating_add(max_tokens).saturating_add(8);
        let model = Model::load(target, LoadOptions::with_max_seq_len(capacity))
            .with_context(|| format!("loading {}", target.display()))?;
        let references = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                reference(&model, p, max_tokens, stop_tokens)
                    .with_context(|| format!("target-only greedy output of prompt {i}"))
            })
            .collect::<Result<_>>()?;
        Ok(Self { model, references })
    }

    /// The target-only greedy output of prompt `prompt`.
    pub fn reference(&self, prompt: usize) -> Option<&[u32]> {
        self.references.get(prompt).map(|r| r.tokens.as_slice())
    }

    /// The target's greedy choice at each position of `output` given the
    /// prompt and `output[..i]`.
    pub fn choices(&self, prompt: usize, output: &[u32]) -> Result<Vec<u32>> {
        let r = self
            .references
            .get(prompt)
            .with_context(|| format!("no prompt {prompt}"))?;
        // Up to and including the first departure, the reference's choices
        // hold (their context is the same tokens).
        let same = common_prefix(output, &r.tokens);
        let known = output.len().min(same.saturating_add(1));
        let mut choices: Vec<u32> = r.choices.iter().take(known).copied().collect();
        anyhow::ensure!(
            choices.len() == known,
            "prompt {prompt}: the reference has {} choices, {known} needed",
            r.choices.len()
        );
        if output.len() > known {
            // Forward output[same..len - 1] after prompt + output[..same]; row j
            // is the choice at position same + 1 + j.
            let mut cache = r.cache.clone();
            let at = r.prompt.len().saturating_add(same);
            anyhow::ensure!(cache.len() >= at, "the reference cache is too short");
            cache.truncate(at);
            let rows = &output[same..output.len() - 1];
            let logits = self
                .model
                .forward(rows, at, &mut cache)
                .context("target forward over a departed output")?;
            let vocab = self.model.config().vocab;
            anyhow::ensure!(logits.len() == rows.len() * vocab, "short logits");
            choices.extend(logits.chunks_exact(vocab).map(argmax));
        }
        Ok(choices)
    }

    /// Checks one generation of prompt `prompt` against the target.
    pub fn check(&self, prompt: usize, g: &Finished) -> Result<GenerationCheck> {
        let choices = self.choices(prompt, &g.tokens)?;
        let reference = self.reference(prompt).unwrap_or_default();
        Ok(judge(
            &g.tokens,
            &g.statuses,
            &g.provisional,
            &choices,
            reference,
        ))
    }
}

/// The target-only greedy generation of `prompt`, one token at a time.
fn reference(
    model: &Model,
    prompt: &[u32],
    max_tokens: usize,
    stop_tokens: &[u32],
) -> Result<Reference> {
    anyhow::ensure!(!prompt.is_empty(), "empty prompt");
    let mut cache = model.new_cache();
    let mut logits = model.forward_last(prompt, 0, &mut cache)?;
    let mut choices = Vec::new();
    let mut tokens = Vec::new();
    while tokens.len() < max_tokens {
        let t = argmax(&logits);
        choices.push(t);
        if stop_tokens.contains(&t) {
            break;
        }
        tokens.push(t);
        if tokens.len() < max_tokens {
            logits = model.forward_last(&[t], cache.len(), &mut cache)?;
        }
    }
    Ok(Reference {
        prompt: prompt.to_vec(),
        choices,
        tokens,
        cache,
    })
}

/// The invariants of one generation given the target's `choices` at each of
/// its positions (pure: unit-tested without a model).
pub fn judge(
    tokens: &[u32],
    statuses: &[TokenStatus],
    report: &tandem_edge::ProvisionalReport,
    choices: &[u32],
    reference: &[u32],
) -> GenerationCheck {
    let mut c = GenerationCheck {
        equals_target_only: tokens == reference,
        departed: common_prefix(tokens, reference) < tokens.len(),
        ..GenerationCheck::default()
    };
    let agrees = |i: usize| choices.get(i) == tokens.get(i);
    let span_of = |i: usize| report.spans.iter().find(|s| (s.start..s.end).contains(&i));
    for (i, status) in statuses.iter().enumerate() {
        match status {
            TokenStatus::Verified => {
                c.verified_tokens += 1;
                if !agrees(i) {
                    c.verified_differing.push(i);
                }
            }
            TokenStatus::Provisional => {
                c.provisional_tokens += 1;
                if !agrees(i) {
                    c.provisional_disagreeing += 1;
                }
                match span_of(i) {
                    None => c.unreported_provisional.push(i),
                    Some(s) => {
                        let reported = s.mismatches.contains(&i);
                        if s.checked {
                            c.provisional_checked += 1;
                        }
                        // A reported mismatch must be a disagreement; in a
                        // checked span every disagreement must be reported.
                        if (reported && agrees(i)) || (s.checked && !reported && !agrees(i)) {
                            c.misreported.push(i);
                        }
                    }
                }
            }
            TokenStatus::Local => c.unreported_provisional.push(i),
        }
    }
    // A mismatch reported at a verified position is wrong too.
    for s in &report.spans {
        for &m in &s.mismatches {
            if statuses.get(m) != Some(&TokenStatus::Provisional) && !c.misreported.contains(&m) {
                c.misreported.push(m);
            }
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_edge::{ProvisionalCheck, ProvisionalReport};
    use TokenStatus::{Provisional as P, Verified as V};

    fn report(spans: &[(usize, usize, &[usize], bool)]) -> ProvisionalReport {
        ProvisionalReport {
            spans: spans
                .iter()
                .map(|&(start, end, m, checked)| ProvisionalCheck {
                    start,
                    end,
                    mismatches: m.to_vec(),
                    checked,
                })
                .collect(),
            ..ProvisionalReport::default()
        }
    }

    #[test]
    fn all_verified_and_equal_to_target_only() {
        let c = judge(&[1, 2, 3], &[V, V, V], &report(&[]), &[1, 2, 3], &[1, 2, 3]);
        assert_eq!(c.verified_tokens, 3);
        assert!(c.verified_differing.is_empty() && c.misreported.is_empty());
        assert!(c.equals_target_only && !c.departed);
    }

    #[test]
    fn a_verified_token_the_target_would_not_choose_is_caught() {
        let c = judge(&[1, 9, 3], &[V, V, V], &report(&[]), &[1, 2, 3], &[1, 2, 3]);
        assert_eq!(c.verified_differing, vec![1]);
        assert!(c.departed);
    }

    #[test]
    fn provisional_disagreements_must_be_reported_exactly() {
        // Position 1 is provisional and the target disagrees: the departure.
        // Verified tokens after it follow the target given the shown text.
        let tokens = [1, 9, 4];
        let choices = [1, 2, 4];
        let st = [V, P, V];
        let right = judge(
            &tokens,
            &st,
            &report(&[(1, 2, &[1], true)]),
            &choices,
            &[1, 2, 3],
        );
        assert!(right.misreported.is_empty() && right.verified_differing.is_empty());
        assert_eq!(right.provisional_disagreeing, 1);
        assert_eq!(right.provisional_checked, 1);
        assert!(right.departed && !right.equals_target_only);
        // Not reported in a checked span.
        let missed = judge(
            &tokens,
            &st,
            &report(&[(1, 2, &[], true)]),
            &choices,
            &[1, 2, 3],
        );
        assert_eq!(missed.misreported, vec![1]);
        // Not reported in an unchecked span: fine (never judged).
        let unchecked = judge(
            &tokens,
            &st,
            &report(&[(1, 2, &[], false)]),
            &choices,
            &[1, 2, 3],
        );
        assert!(unchecked.misreported.is_empty());
        // A false alarm: reported where the target agrees.
        let agree = [1, 2, 3];
        let alarm = judge(&agree, &st, &report(&[(1, 2, &[1], true)]), &agree, &agree);
        assert_eq!(alarm.misreported, vec![1]);
        // A provisional token outside every span.
        let outside = judge(&agree, &st, &report(&[]), &agree, &agree);
        assert_eq!(outside.unreported_provisional, vec![1]);
        // A mismatch reported at a verified position.
        let at_verified = judge(&agree, &st, &report(&[(1, 2, &[0], true)]), &agree, &agree);
        assert_eq!(at_verified.misreported, vec![0]);
    }
}
