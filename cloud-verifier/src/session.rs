//! One device session's verifier-side state (the leaf of the module graph:
//! `session` ← `store` ← `split`, `scheduler` ← `handlers` ← `service`).

use crate::error::Refusal;
use tandem_model::kv_pages::PagedKv;
use tandem_model::logprobs::TokenLogprobs;
use tandem_model::sampling::SamplingParams;
use tandem_model::verify::{verdict_from_logits, verdict_logprobs, Verdict};
use tandem_proto::v1::{HiddenFormat, Reason};

/// One session's state: its KV pages, context and round bookkeeping.
pub struct SessionState {
    /// Target KV in pages of the verifier's pool: holds `context[..len - 1]`.
    pub kv: PagedKv,
    /// Whole context (prompt + emitted tokens); the last one is `last`.
    pub context: Vec<u32>,
    /// The generation's sampling; a seeded token is keyed by its position in
    /// `context`, so the session holds no random state.
    pub sampling: SamplingParams,
    /// The device asked for logprobs (`Open.top_logprobs`): each verdict's
    /// emitted tokens' logprobs with this many alternatives.
    pub top_logprobs: Option<usize>,
    /// The logprobs of the last verdict's emitted tokens (`top_logprobs`
    /// sessions; taken by the Draft handler into its Verdict).
    pub last_logprobs: Vec<TokenLogprobs>,
    /// Round number the next Draft must carry.
    pub next_round: u64,
    /// Rounds verified so far.
    pub rounds: u64,
    /// Split execution: the device runs layers `[0, split.layer)`; `None` = whole
    /// target here. In U-shape sessions `context` holds placeholders (the verifier
    /// never sees token ids), only its length is meaningful.
    pub split: Option<SplitSpec>,
    /// Structured output (`Open.grammar`): the constraint, advanced over the
    /// output in `context` so far; verdicts choose among what it allows.
    pub grammar: Option<tandem_grammar::Guide>,
}

impl SessionState {
    /// A session with an empty KV and `context`.
    pub fn new(kv: PagedKv, context: Vec<u32>, sampling: SamplingParams, first_round: u64) -> Self {
        Self {
            kv,
            context,
            sampling,
            top_logprobs: None,
            last_logprobs: Vec::new(),
            next_round: first_round,
            rounds: 0,
            split: None,
            grammar: None,
        }
    }

    /// Bytes this session holds: its KV pages plus the context ids.
    pub fn bytes(&self) -> u64 {
        self.kv
            .bytes_held()
            .saturating_add((self.context.len() as u64).saturating_mul(4))
    }

    /// The verdict of a block `[last, d1..dk]` whose `k + 1` rows the KV holds
    /// from position `base` on (`logits`: one row per block row), applied:
    /// see [`Self::apply_verdict`]. When no verdict can be had the block's
    /// rows are dropped from the KV (`base` positions stay) and the round is
    /// refused as an internal error.
    pub fn verify_block(
        &mut self,
        base: usize,
        draft: &[u32],
        logits: &[f32],
    ) -> Result<Verdict, Refusal> {
        let (verdict, masked) = match self.grammar.as_mut() {
            None => (
                verdict_from_logits(&self.sampling, &self.context, draft, logits),
                None,
            ),
            Some(c) => {
                // (Brought to the context first: a Resume may have moved it.)
                match c.verdict(&self.sampling, &self.context, draft, logits) {
                    Ok((v, masked)) => (Ok(v), Some(masked)),
                    Err(e) => {
                        self.kv.truncate(base);
                        return Err(Refusal::new(
                            Reason::InternalError,
                            format!("verdict under the grammar: {e}"),
                        ));
                    }
                }
            }
        };
        // Under a grammar, the logprobs of the distribution that chose: the
        // masked one.
        let rows = masked.as_deref().unwrap_or(logits);
        let logprobs = match (&verdict, self.top_logprobs) {
            (Ok(v), Some(top)) => {
                verdict_logprobs(&self.sampling, &self.context, draft, rows, v, top)
            }
            _ => Ok(Vec::new()),
        };
        let committed = verdict.as_ref().map_or(0, |v| v.accepted + 1);
        match verdict.and_then(|v| Ok((v, logprobs?))) {
            Ok((v, logprobs)) => {
                self.last_logprobs = logprobs;
                self.apply_verdict(base, draft, &v);
                Ok(v)
            }
            Err(e) => {
                self.kv.truncate(base);
                if let Some(c) = self.grammar.as_mut() {
                    // The verdict was made and advanced the grammar: take it
                    // back with the rest of the round.
                    let _ = c.undo(committed);
                }
                Err(Refusal::new(Reason::InternalError, format!("verdict: {e}")))
            }
        }
    }

    /// Applies a verdict on the block `[last, d1..dk]` whose rows the KV holds
    /// from position `base`: the KV keeps `[.., last, d1..dn]` (n accepted,
    /// truncated to `base + 1 + n`), and the context gains `d1..dn` and the
    /// verdict's next token (the new `last`, not in the KV yet).
    pub fn apply_verdict(&mut self, base: usize, draft: &[u32], v: &Verdict) {
        let n = v.accepted.min(draft.len());
        self.kv.truncate(base.saturating_add(1).saturating_add(n));
        self.context.extend_from_slice(&draft[..n]);
        self.context.push(v.next_token);
    }

    /// The round after `next_round`, or a refusal when the device's numbering
    /// would wrap.
    pub fn advance_round(&mut self) -> Result<(), Refusal> {
        self.next_round = self.next_round.checked_add(1).ok_or_else(|| {
            Refusal::new(
                Reason::BadRequest,
                "round number would pass 2^64 - 1: open a new session with first_round = 0",
            )
        })?;
        self.rounds = self.rounds.saturating_add(1);
        Ok(())
    }
}

/// How a split session divides the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitSpec {
    /// s: the device runs `[0, s)`, this verifier `[s, N)`.
    pub layer: usize,
    /// U-shape: head and verdict on the device.
    pub pin_head: bool,
    pub format: HiddenFormat,
}

impl SplitSpec {
    /// Checks the wire message against the model.
    pub fn from_wire(w: &tandem_proto::v1::Split, n_layer: usize) -> Result<Self, Refusal> {
        let bad = |m: String| Refusal::new(Reason::BadRequest, m);
        let layer = usize::try_from(w.layer).unwrap_or(usize::MAX);
        if layer > n_layer {
            return Err(bad(format!(
                "split.layer {} is beyond the target's {n_layer} layers",
                w.layer
            )));
        }
        let format = HiddenFormat::try_from(w.format)
            .map_err(|_| bad(format!("split.format {} is unknown", w.format)))?;
        Ok(Self {
            layer,
            pin_head: w.pin_head,
            format,
        })
    }
}
