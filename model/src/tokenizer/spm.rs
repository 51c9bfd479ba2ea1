//! SentencePiece-style tokenization (`tokenizer.ggml.model = llama`: Gemma 3,
//! Llama 2, TinyLlama, Mistral), as llama.cpp's `llm_tokenizer_spm`:
//!
//! - spaces become `▁` (U+2581), and with `add_space_prefix` a space is put
//!   in front of every text fragment that starts the text or follows a
//!   special token (done by the caller, [`super::Tokenizer`]);
//! - the text starts as one symbol per character; the adjacent pair whose
//!   concatenation is a vocabulary token with the highest score (leftmost on
//!   ties) is merged until no pair forms a token;
//! - a symbol that is not a token falls back to its bytes' `<0xXX>` tokens.
//!
//! Decoding: `▁` becomes a space, `<0xXX>` its byte.

use super::vocab::{byte_token_value, err, FxMap, TokenKind};
use crate::Result;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

pub(crate) const SPACE: char = '\u{2581}';

pub(crate) struct Spm {
    scores: Vec<f32>,
    /// The `<0xXX>` token of each byte (else a one-byte text token).
    byte_to_id: [Option<u32>; 256],
    unk: Option<u32>,
}

/// A candidate merge: higher score first, then the leftmost.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

impl Spm {
    pub(crate) fn new(
        tokens: &[String],
        kinds: &[TokenKind],
        scores: Vec<f32>,
        token_to_id: &FxMap<String, u32>,
        unk: Option<u32>,
    ) -> Self {
        let mut byte_to_id = [None; 256];
        for (id, (t, k)) in tokens.iter().zip(kinds).enumerate() {
            if *k == TokenKind::Byte {
                if let Some(b) = byte_token_value(t) {
                    // As llama.cpp's map: a duplicated text keeps its last id.
                    byte_to_id[b as usize] =
                        token_to_id.get(t.as_str()).copied().or(Some(id as u32));
                }
            }
        }
        for (b, slot) in byte_to_id.iter_mut().enumerate() {
            if slot.is_none() {
                let text = format!("<0x{b:02X}>");
                *slot = token_to_id.get(&text).copied();
                if slot.is_none() && b < 0x80 {
                    *slot = token_to_id.get(&(b as u8 as char).to_string()).copied();
                }
            }
        }
        Self {
            scores,
            byte_to_id,
            unk,
        }
    }

    /// Tokenize `text`, whose spaces are already `▁` (and which has no
    /// special tokens).
    pub(crate) fn encode(
        &self,
        text: &str,
        token_to_id: &FxMap<String, u32>,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        const NONE: usize = usize::MAX;
        struct Sym {
            start: usize,
            len: usize,
            prev: usize,
            next: usize,
        }
        if text.is_empty() {
            return Ok(());
        }
        let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            syms.push(Sym {
                start,
                len: c.len_utf8(),
                prev: if i == 0 { NONE } else { i - 1 },
                next: i + 1,
            });
        }
        if let Some(last) = syms.last_mut() {
            last.next = NONE;
        }
        let mut heap = BinaryHeap::new();
        let try_add = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], l: usize, r: usize| {
            if l == NONE || r == NONE {
                return;
            }
            let (s, e) = (syms[l].start, syms[r].start + syms[r].len);
            if let Some(&id) = token_to_id.get(&text[s..e]) {
                if let Some(&score) = self.scores.get(id as usize) {
                    heap.push(Bigram {
                        score,
                        left: l,
                        right: r,
                        size: e - s,
                    });
                }
            }
        };
        for i in 1..syms.len() {
            try_add(&mut heap, &syms, i - 1, i);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (b.left, b.right);
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != b.size {
                continue;
            }
            syms[l].len += syms[r].len;
            syms[r].len = 0;
            let after = syms[r].next;
            syms[l].next = after;
            if after != NONE {
                syms[after].prev = l;
            }
            let before = syms[l].prev;
            try_add(&mut heap, &syms, before, l);
            try_add(&mut heap, &syms, l, after);
        }
        let mut i = 0;
        while i != NONE {
            let s = &syms[i];
            let piece = &text[s.start..s.start + s.len];
            match token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &b in piece.as_bytes() {
                        let id = self.byte_to_id[b as usize].or(self.unk).ok_or_else(|| {
                            err(format!(
                                "no byte-fallback token <0x{b:02X}> (and no unknown token) for `{piece}`"
                            ))
                        })?;
                        out.push(id);
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }
}

/// The bytes a SentencePiece token decodes to.
pub(crate) fn piece_bytes(text: &str, kind: TokenKind) -> Vec<u8> {
    match kind {
        TokenKind::Normal => text.replace(SPACE, " ").into_bytes(),
        TokenKind::Byte => match byte_token_value(text) {
            Some(b) => vec![b],
            None => text.replace(SPACE, " ").into_bytes(),
        },
        TokenKind::Unused => Vec::new(),
        TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown => {
            text.as_bytes().to_vec()
        }
    }
}
