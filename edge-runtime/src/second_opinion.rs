//! The device's own model as the router's second opinion (issue 32, item 4):
//! [`DraftOpinion`] implements [`tandem_router::SecondOpinion`] with the
//! draft model.
//!
//! When the policy's rules are unsure (`[second_opinion]`, see
//! `tandem_router::second_opinion`), the draft answers one short constrained
//! classification prompt on the device: the text, then a yes/no question
//! (is it about a real person's private matters?), in the draft's chat
//! template. The answer is read from the logits of the first assistant
//! position, compared over the allowed answer tokens only (the first token
//! of `yes`/`Yes`/`YES` against that of `no`/`No`/`NO`): nothing is
//! sampled, nothing is generated, and nothing leaves the device before the
//! decision.
//!
//! The prompt puts the text first and the question after it, in the user
//! turn, without a system message of its own: its tokens share their prefix
//! (the template's default system turn and the text) with the tokens of the
//! generation the text then asks for, so that prefix's KV is reused by a
//! local generation: [`SecondOpinion::judge_keeping`] hands back a
//! [`JudgedPromptKv`] (in the KV precision of a default generation,
//! [`DraftOpinion::kv_precision`]), and [`crate::RoutedRuntime::turn`]
//! offers it to the conversation cache ([`crate::EdgeRuntime::offer_draft_kv`])
//! when the decision is local.
//!
//! Answers are remembered by a hash of the text (at most
//! [`MEMO_CAPACITY`]): the routed runtime replays a conversation's whole
//! history every turn, and an old message is not judged again.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use tandem_model::kv_cache::{KvCache, KvPrecision};
use tandem_model::speculative::GenerateConfig;
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::Model;
use tandem_router::{KeptWork, Opinion, OpinionError, SecondOpinion};

/// What the draft is asked after the text.
pub const QUESTION: &str =
    "\n\n---\nQuestion: does the message above disclose private information \
about a real person (the writer or someone they know): their health, money, legal trouble, \
religion or politics, sexuality, home address, children, or an ID, card, account or phone \
number, or a password? A general question about a topic, fiction, or code with made-up data \
is not. Answer yes or no.";

/// Most bytes of the text put in the prompt (its head; a longer text is cut
/// at a character boundary): bounds the model's cost per request.
pub const MAX_TEXT_BYTES: usize = 1500;

/// Most answers remembered (then the memo starts again empty).
pub const MEMO_CAPACITY: usize = 1024;

/// Spellings of the two answers; each contributes the first token of its
/// encoding.
const YES: [&str; 3] = ["yes", "Yes", "YES"];
const NO: [&str; 3] = ["no", "No", "NO"];

/// Why a [`DraftOpinion`] could not be made.
#[derive(Debug, thiserror::Error)]
pub enum DraftOpinionError {
    #[error("second opinion: {0}")]
    Model(#[from] tandem_model::ModelError),
    #[error("second opinion: the tokenizer has no distinct first tokens for yes and no")]
    NoAnswerTokens,
}

/// One judgement with its evidence.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Judgement {
    pub opinion: Opinion,
    /// Best `yes` logit minus best `no` logit (the decision is `margin >
    /// threshold`).
    pub margin: f32,
    /// Prompt tokens the model ran.
    pub prompt_tokens: usize,
}

/// The classification prompt's tokens and the draft KV that holds them, as
/// [`DraftOpinion::judge_keeping_kv`] leaves them: what a local generation
/// whose prompt starts with the same tokens need not prefill again
/// ([`crate::EdgeRuntime::offer_draft_kv`]).
pub struct JudgedPromptKv {
    pub tokens: Vec<u32>,
    /// Holds `tokens`; the capacity of the model's context, as a
    /// generation's cache.
    pub cache: KvCache,
    /// The model that computed it: the KV is only valid for that model.
    pub model: Arc<Model>,
}

impl std::fmt::Debug for JudgedPromptKv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JudgedPromptKv")
            .field("tokens", &self.tokens.len())
            .field("positions", &self.cache.len())
            .field("precision", &self.cache.precision())
            .finish()
    }
}

/// The draft model as the router's second opinion. Cheap to clone (shares
/// the model and the memo).
#[derive(Clone)]
pub struct DraftOpinion {
    model: Arc<Model>,
    tokenizer: Tokenizer,
    yes: Vec<u32>,
    no: Vec<u32>,
    /// `Sensitive` when the margin is above this.
    threshold: f32,
    /// Precision of the KV the prompt is prefilled into.
    kv_precision: KvPrecision,
    memo: Arc<Mutex<HashMap<u64, Opinion>>>,
}

impl std::fmt::Debug for DraftOpinion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftOpinion")
            .field("yes", &self.yes)
            .field("no", &self.no)
            .field("threshold", &self.threshold)
            .field("kv_precision", &self.kv_precision)
            .finish()
    }
}

/// The first token of each spelling, deduplicated.
fn first_tokens(tok: &Tokenizer, words: &[&str]) -> Result<Vec<u32>, DraftOpinionError> {
    let mut out = Vec::new();
    for w in words {
        if let Some(&id) = tok.encode(w, false)?.first() {
            if !out.contains(&id) {
                out.push(id);
            }
        }
    }
    Ok(out)
}

impl DraftOpinion {
    /// The draft `model` with its `tokenizer` (the chat template comes from
    /// it). Fails when the tokenizer cannot tell the two answers apart.
    pub fn new(model: Arc<Model>, tokenizer: Tokenizer) -> Result<Self, DraftOpinionError> {
        let yes = first_tokens(&tokenizer, &YES)?;
        let no = first_tokens(&tokenizer, &NO)?;
        if yes.is_empty() || no.is_empty() || yes.iter().any(|t| no.contains(t)) {
            return Err(DraftOpinionError::NoAnswerTokens);
        }
        Ok(Self {
            model,
            tokenizer,
            yes,
            no,
            threshold: 0.0,
            kv_precision: GenerateConfig::default().draft_kv,
            memo: Arc::new(Mutex::new(HashMap::new())),
        })
    }

    /// `Sensitive` when `yes` beats `no` by more than `threshold` logits
    /// (default 0: whichever is larger).
    pub fn with_threshold(mut self, threshold: f32) -> Self {
        self.threshold = threshold;
        self
    }

    /// Prefill the prompt into a KV cache of `precision` (default: that of a
    /// generation's draft KV, [`GenerateConfig::draft_kv`], so that a local
    /// generation at the default precision can reuse it; a generation at
    /// another precision prefills its whole prompt).
    pub fn with_kv_precision(mut self, precision: KvPrecision) -> Self {
        self.kv_precision = precision;
        self
    }

    /// The precision of the KV the prompt is prefilled into.
    pub fn kv_precision(&self) -> KvPrecision {
        self.kv_precision
    }

    /// The answer tokens compared: (yes, no).
    pub fn answer_tokens(&self) -> (&[u32], &[u32]) {
        (&self.yes, &self.no)
    }

    /// The classification prompt's tokens for `text`.
    pub fn prompt(&self, text: &str) -> Result<Vec<u32>, OpinionError> {
        let head = &text[..floor_boundary(text, MAX_TEXT_BYTES)];
        let content = format!("{head}{QUESTION}");
        self.tokenizer
            .encode_chat(&[ChatMessage::user(content)], true)
            .map_err(|e| OpinionError(e.to_string()))
    }

    /// Judge `text`, returning the margin too (not memoized). The KV holds
    /// the prompt only.
    pub fn judge_detailed(&self, text: &str) -> Result<Judgement, OpinionError> {
        let prompt = self.prompt(text)?;
        let c = self.model.config();
        let mut cache = KvCache::with_precision(
            c.n_layer,
            c.n_kv_head,
            c.head_dim,
            prompt.len(),
            self.kv_precision,
        );
        self.run(&prompt, &mut cache)
    }

    /// Judge `text` (not memoized) and hand back the prompt's tokens and the
    /// draft KV that holds them, in a cache of the model's whole context: a
    /// local generation whose prompt starts with the same tokens (the
    /// template's system turn and the text) need not prefill them again.
    pub fn judge_keeping_kv(
        &self,
        text: &str,
    ) -> Result<(Judgement, JudgedPromptKv), OpinionError> {
        let prompt = self.prompt(text)?;
        let mut cache = self.model.new_cache_with(self.kv_precision);
        let judgement = self.run(&prompt, &mut cache)?;
        let kept = JudgedPromptKv {
            tokens: prompt,
            cache,
            model: self.model.clone(),
        };
        Ok((judgement, kept))
    }

    /// The remembered answer for `text`, else a judgement (kept work with it
    /// when `keep`), logged without text and remembered.
    fn judge_memoized(
        &self,
        text: &str,
        keep: bool,
    ) -> Result<(Opinion, Option<JudgedPromptKv>), OpinionError> {
        let key = text_key(text);
        if let Some(o) = self.memo_get(key) {
            return Ok((o, None));
        }
        let started = std::time::Instant::now();
        let (j, kept) = if keep {
            let (j, kept) = self.judge_keeping_kv(text)?;
            (j, Some(kept))
        } else {
            (self.judge_detailed(text)?, None)
        };
        // No text in the log: the answer, its margin and the cost.
        tracing::debug!(
            target: "tandem_edge::privacy",
            opinion = ?j.opinion,
            margin = j.margin,
            prompt_tokens = j.prompt_tokens,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "second opinion"
        );
        self.memo_put(key, j.opinion);
        Ok((j.opinion, kept))
    }

    /// Prefill `prompt` into `cache` and compare the answer tokens' logits.
    fn run(&self, prompt: &[u32], cache: &mut KvCache) -> Result<Judgement, OpinionError> {
        if prompt.len() >= self.model.max_seq_len() {
            return Err(OpinionError(format!(
                "prompt of {} tokens does not fit the draft's context of {}",
                prompt.len(),
                self.model.max_seq_len()
            )));
        }
        let logits = self
            .model
            .forward_last(prompt, 0, cache)
            .map_err(|e| OpinionError(e.to_string()))?;
        let best = |ids: &[u32]| {
            ids.iter()
                .filter_map(|&i| logits.get(i as usize).copied())
                .fold(f32::NEG_INFINITY, f32::max)
        };
        let margin = best(&self.yes) - best(&self.no);
        if !margin.is_finite() {
            return Err(OpinionError("no logits for the answer tokens".into()));
        }
        let opinion = if margin > self.threshold {
            Opinion::Sensitive
        } else {
            Opinion::Benign
        };
        Ok(Judgement {
            opinion,
            margin,
            prompt_tokens: prompt.len(),
        })
    }

    fn memo_get(&self, key: u64) -> Option<Opinion> {
        self.memo.lock().ok()?.get(&key).copied()
    }

    fn memo_put(&self, key: u64, o: Opinion) {
        if let Ok(mut m) = self.memo.lock() {
            if m.len() >= MEMO_CAPACITY {
                m.clear();
            }
            m.insert(key, o);
        }
    }
}

fn text_key(text: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

/// Largest char boundary <= i.
fn floor_boundary(s: &str, i: usize) -> usize {
    (0..=i.min(s.len()))
        .rev()
        .find(|&j| s.is_char_boundary(j))
        .unwrap_or(0)
}

impl SecondOpinion for DraftOpinion {
    fn judge(&self, text: &str) -> Result<Opinion, OpinionError> {
        self.judge_memoized(text, false).map(|(o, _)| o)
    }

    /// The kept work is a [`JudgedPromptKv`] (none for a remembered answer).
    fn judge_keeping(&self, text: &str) -> Result<(Opinion, Option<KeptWork>), OpinionError> {
        let (o, kept) = self.judge_memoized(text, true)?;
        Ok((o, kept.map(|k| Box::new(k) as KeptWork)))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tandem_model::gguf::GgufFile;
    use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
    use tandem_model::transformer::LoadOptions;

    fn tiny() -> (tempfile::TempDir, DraftOpinion) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tiny.gguf");
        let cfg = TinyConfig {
            tokenizer: true,
            ..TinyConfig::draft_like()
        };
        write_tiny_qwen2(&p, &cfg).unwrap();
        let tok = Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()).unwrap();
        let model = Arc::new(Model::load(&p, LoadOptions::with_max_seq_len(4096)).unwrap());
        (dir, DraftOpinion::new(model, tok).unwrap())
    }

    #[test]
    fn the_answer_is_one_of_two_token_sets_and_repeatable() {
        let (_d, o) = tiny();
        let (yes, no) = o.answer_tokens();
        assert!(!yes.is_empty() && !no.is_empty());
        assert!(yes.iter().all(|t| !no.contains(t)));
        let a = o.judge_detailed("my mother has diabetes").unwrap();
        let b = o.judge_detailed("my mother has diabetes").unwrap();
        assert_eq!(a, b);
        // The threshold decides: above the margin -> benign, below -> sensitive.
        let hi = o.clone().with_threshold(a.margin + 1.0);
        let lo = o.clone().with_threshold(a.margin - 1.0);
        assert_eq!(
            hi.judge_detailed("my mother has diabetes").unwrap().opinion,
            Opinion::Benign
        );
        assert_eq!(
            lo.judge_detailed("my mother has diabetes").unwrap().opinion,
            Opinion::Sensitive
        );
    }

    #[test]
    fn the_prompt_shares_its_prefix_with_the_generation_prompt() {
        let (_d, o) = tiny();
        let text = "Write a haiku about autumn leaves falling on the river";
        let judge = o.prompt(text).unwrap();
        let gen = o
            .tokenizer
            .encode_chat(&[ChatMessage::user(text)], true)
            .unwrap();
        let shared = crate::conversation::common_prefix(&judge, &gen);
        // Everything but the last few tokens of the text (merges at the seam)
        // and the template's closing tokens.
        assert!(shared + 12 >= gen.len(), "{shared} of {}", gen.len());
        let (kept_judgement, kept) = o.judge_keeping_kv(text).unwrap();
        assert_eq!(kept.tokens, judge);
        assert_eq!(kept.cache.len(), judge.len());
        assert_eq!(kept.cache.precision(), o.kv_precision());
        // The same answer whether the KV is kept or not.
        assert_eq!(kept_judgement, o.judge_detailed(text).unwrap());
    }

    #[test]
    fn long_texts_are_cut_and_answers_are_memoized() {
        let (_d, o) = tiny();
        let long = "é".repeat(MAX_TEXT_BYTES);
        let p = o.prompt(&long).unwrap();
        let cut = o.prompt(&long[..MAX_TEXT_BYTES]).unwrap();
        assert_eq!(p, cut);
        let first = o.judge("a text").unwrap();
        assert_eq!(o.memo.lock().unwrap().len(), 1);
        assert_eq!(o.judge("a text").unwrap(), first);
        assert_eq!(o.memo.lock().unwrap().len(), 1);
    }
}
