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
    #[error("token {id} differs: the draft has `{draft}` ({draft_kind}), the target `{target}` ({target_kind})")]
    Token {
        id: u32,
        draft: String,
        draft_kind: String,
        target: String,
        target_kind: String,
    },
    #[error("the {which} token differs: draft {draft:?}, target {target:?}")]
    Special {
        which: &'static str,
        draft: Option<u32>,
        target: Option<u32>,
    },
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
    compare_tokenizers(d, t, report.vocab)?;
    report.tokenizers_compared = true;
    Ok(report)
}

/// Every id below `vocab` has the same text and type on both sides, and the
/// special ids agree.
fn compare_tokenizers(d: &Tokenizer, t: &Tokenizer, vocab: usize) -> Result<(), PairError> {
    for id in 0..vocab as u32 {
        let (dt, tt) = (d.id_to_token(id), t.id_to_token(id));
        let (dk, tk) = (d.token_kind(id), t.token_kind(id));
        if dt != tt || dk != tk {
            let show = |x: Option<&str>| x.unwrap_or("<none>").to_string();
            let kind = |k: Option<crate::tokenizer::TokenKind>| {
                k.map_or("none".to_string(), |k| format!("{k:?}").to_lowercase())
            };
            return Err(PairError::Token {
                id,
                draft: show(dt),
                draft_kind: kind(dk),
                target: show(tt),
                target_kind: kind(tk),
            });
        }
    }
    for (which, a, b) in [
        ("BOS", d.bos_id(), t.bos_id()),
        ("EOS", Some(d.eos_id()), Some(t.eos_id())),
    ] {
        if a != b {
            return Err(PairError::Special {
                which,
                draft: a,
                target: b,
            });
        }
    }
    if d.fingerprint() != t.fingerprint() {
        return Err(PairError::Tokenizer(format!(
            "fingerprints {} and {}: the pre-tokenizer, merges or special ids differ",
            short(&d.fingerprint()),
            short(&t.fingerprint())
        )));
    }
    Ok(())
}

fn short(fingerprint: &str) -> &str {
    fingerprint.get(..12).unwrap_or(fingerprint)
}
