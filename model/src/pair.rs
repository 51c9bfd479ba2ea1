//! Whether a draft and a target model can pair for speculative decoding, and
//! why not.
//!
//! A pair exchanges token ids, so both sides must mean the same thing by
//! every id either can produce:
//! 1. the same vocabulary ([`ModelConfig::vocab`]: the tokens without the
//!    embedding's trailing padding rows). The embedding tables may differ by
//!    up to [`MAX_PADDING_DIFFERENCE`] padding rows (Qwen2.5-0.5B has
//!    151,936 rows, Qwen2.5-7B 152,064, for the same 151,665 tokens), as
//!    llama.cpp allows; since logits cover the vocabulary only, verification
//!    never accepts or emits an id outside it;
//! 2. the same tokenizer: the same token text and type for every id, the
//!    same special ids (BOS, EOS, end of turn) and the same tokenizer
//!    fingerprint (which covers the shared vocabulary, not the row count).
//!
//! [`check_pair`] returns the first reason the pair fails, in words a user
//! can act on (`tandem models check-pair DRAFT TARGET` prints it).

use crate::arch::ModelConfig;
use crate::tokenizer::Tokenizer;

/// How many more embedding rows one side may have than the other (the
/// difference must be padding; llama.cpp's `SPEC_VOCAB_MAX_SIZE_DIFFERENCE`).
pub const MAX_PADDING_DIFFERENCE: usize = 128;

/// What two compatible models share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairReport {
    /// The shared vocabulary (logits width on both sides).
    pub vocab: usize,
    /// Embedding rows of the draft and the target (padding included).
    pub draft_rows: usize,
    pub target_rows: usize,
    /// Whether both files carry a tokenizer that was compared.
    pub tokenizers_compared: bool,
}

/// Why two models cannot pair.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PairError {
    #[error(
        "the vocabularies differ: the draft has {draft} tokens, the target {target} \
         (a pair needs the same tokens; only trailing padding rows may differ)"
    )]
    Vocabulary { draft: usize, target: usize },
    #[error(
        "the embedding tables differ by {difference} rows (draft {draft}, target {target}); \
         at most {MAX_PADDING_DIFFERENCE} padding rows may differ"
    )]
    Padding {
        draft: usize,
        target: usize,
        difference: usize,
    },
    #[error("only the {has} carries a tokenizer; both files need one to be compared")]
    OneTokenizer { has: &'static str },
    #[error("the tokenizers differ ({0})")]
    Tokenizer(String),
    #[error("the {who} cannot run: {reason}")]
    Unrunnable { who: &'static str, reason: String },
}

/// Check the models' shapes (vocabulary and padding) alone: what the local
/// loop checks on every generation.
pub fn check_vocab(draft: &ModelConfig, target: &ModelConfig) -> Result<PairReport, PairError> {
    if draft.vocab != target.vocab {
        return Err(PairError::Vocabulary {
            draft: draft.vocab,
            target: target.vocab,
        });
    }
    let difference = draft.embd_rows.abs_diff(target.embd_rows);
    if difference > MAX_PADDING_DIFFERENCE {
        return Err(PairError::Padding {
            draft: draft.embd_rows,
            target: target.embd_rows,
            difference,
        });
    }
    Ok(PairReport {
        vocab: draft.vocab,
        draft_rows: draft.embd_rows,
        target_rows: target.embd_rows,
        tokenizers_compared: false,
    })
}

/// Check a draft and a target: shapes ([`check_vocab`]) and, where the files
/// carry tokenizers, every token of the shared vocabulary and the special ids.
pub fn check_pair(
    draft: &ModelConfig,
    draft_tok: Option<&Tokenizer>,
    target: &ModelConfig,
    target_tok: Option<&Tokenizer>,
) -> Result<PairReport, PairError> {
    let mut report = check_vocab(draft, target)?;
    let (d, t) = match (draft_tok, target_tok) {
        (None, None) => return Ok(report),
        (Some(_), None) => return Err(PairError::OneTokenizer { has: "draft" }),
        (None, Some(_)) => return Err(PairError::OneTokenizer { has: "target" }),
        (Some(d), Some(t)) => (d, t),
    };
    compare_tokenizers(d, t)?;
    report.tokenizers_compared = true;
    Ok(report)
}

/// The tokenizers agree on the shared vocabulary ([`Tokenizer::check_pair`]:
/// model, pre-tokenizer, every token's text and type, special ids, merges).
fn compare_tokenizers(d: &Tokenizer, t: &Tokenizer) -> Result<(), PairError> {
    d.check_pair(t)
        .map_err(|e| PairError::Tokenizer(e.to_string()))
}
