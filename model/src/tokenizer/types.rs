//! The tokenizer's types: [`Tokenizer`] with the vocabulary state it shares
//! (`Inner`), [`TokenizerModel`] and the algorithm (`Algo`), and the few
//! methods `pair` and `stream` use. A leaf below those two: they take these
//! from here, not from their parent; building and running the tokenizer is
//! `tokenizer`'s (its `impl Tokenizer`), which re-exports the public types.

use super::bpe::Bpe;
use super::chat::ChatTemplate;
use super::special::Specials;
use super::spm::Spm;
use super::vocab::{FxMap, TokenKind};
use crate::{ModelError, Result};
use std::sync::Arc;

/// The vocabulary's tokenization algorithm (`tokenizer.ggml.model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerModel {
    /// `gpt2`: GPT-2 byte-level BPE.
    Gpt2,
    /// `llama`: SentencePiece with byte fallback.
    Llama,
}

impl TokenizerModel {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt2",
            Self::Llama => "llama",
        }
    }
}

pub(super) enum Algo {
    Bpe(Bpe),
    Spm(Spm),
}

pub(super) struct Inner {
    pub(super) model: TokenizerModel,
    /// `tokenizer.ggml.pre` as stored (`None` when absent).
    pub(super) pre_name: Option<String>,
    /// Token text as stored in the GGUF (byte-level form, e.g. `Ġworld`, or
    /// SentencePiece form, `▁world`).
    pub(super) tokens: Vec<String>,
    /// The bytes each token stands for when decoded.
    pub(super) pieces: Vec<Vec<u8>>,
    pub(super) kinds: Vec<TokenKind>,
    pub(super) token_to_id: FxMap<String, u32>,
    pub(super) algo: Algo,
    /// Control / user-defined / unknown tokens, longest text first.
    pub(super) specials: Vec<u32>,
    pub(super) ids: Specials,
    pub(super) add_space_prefix: bool,
    pub(super) real_vocab_size: usize,
    pub(super) fingerprint: String,
}

/// The tokenizer of a GGUF model. Cloning is cheap (shared state).
#[derive(Clone)]
pub struct Tokenizer {
    pub(super) inner: Arc<Inner>,
    pub(super) chat: Option<Arc<ChatTemplate>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.inner.model)
            .field("pre", &self.inner.pre_name)
            .field("vocab_size", &self.inner.tokens.len())
            .field("fingerprint", &self.inner.fingerprint)
            .finish()
    }
}

impl Tokenizer {
    /// Number of token ids (includes trailing padding slots).
    pub fn vocab_size(&self) -> usize {
        self.inner.tokens.len()
    }

    /// `tokenizer.ggml.pre` (`default` when absent; SentencePiece
    /// vocabularies have none).
    pub fn pre_name(&self) -> &str {
        self.inner.pre_name.as_deref().unwrap_or("default")
    }

    /// The bytes `id` decodes to (none for a special token when
    /// `skip_special`), or an error for an id outside the vocabulary.
    pub(super) fn piece_for_decode(&self, id: u32, skip_special: bool) -> Result<&[u8]> {
        let i = id as usize;
        let piece = self
            .inner
            .pieces
            .get(i)
            .ok_or(ModelError::TokenOutOfRange {
                id,
                vocab: self.vocab_size(),
            })?;
        let skip =
            skip_special && matches!(self.inner.kinds[i], TokenKind::Control | TokenKind::Unknown);
        Ok(if skip { &[] } else { piece })
    }
}
