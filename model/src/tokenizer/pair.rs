//! Whether two tokenizers can exchange token ids (a draft and its target, the
//! device and the verifier): the fingerprint compared at session Open, and a
//! check that says why two vocabularies do not pair.
//!
//! Two tokenizers pair when they have the same tokenizer model and
//! pre-tokenizer, the same text and type for every id of the shared
//! vocabulary (ids below both [`Tokenizer::real_vocab_size`]s), the same
//! merges, and the same BOS / EOS / EOT ids. Trailing padding slots may
//! differ: Qwen2.5-0.5B has 151,936 rows, 7B 152,064, over the same 151,665
//! real tokens.

use super::special::Specials;
use super::types::{Algo, Tokenizer, TokenizerModel};
use super::vocab::TokenKind;
use sha2::{Digest, Sha256};

/// Why two tokenizers cannot exchange token ids.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PairError {
    #[error("tokenizer models differ: {0} vs {1}")]
    Model(String, String),
    #[error("pre-tokenizers differ: {0} vs {1}")]
    Pre(String, String),
    #[error("real vocabulary sizes differ: {0} vs {1} tokens")]
    VocabSize(usize, usize),
    #[error("token {id} differs: {a:?} vs {b:?}")]
    Token { id: u32, a: String, b: String },
    #[error("token {id} has type {a:?} vs {b:?}")]
    Kind { id: u32, a: TokenKind, b: TokenKind },
    #[error("{what} differs: {a:?} vs {b:?}")]
    Special {
        what: &'static str,
        a: Option<u32>,
        b: Option<u32>,
    },
    #[error("{what} differs: {a} vs {b}")]
    Flag {
        what: &'static str,
        a: bool,
        b: bool,
    },
    #[error("BPE merges differ (fingerprints {0} vs {1})")]
    Merges(String, String),
}

pub(crate) fn fingerprint(
    model: TokenizerModel,
    pre: &str,
    tokens: &[String],
    kinds: &[TokenKind],
    merges: &[&str],
    ids: &Specials,
    add_space_prefix: bool,
) -> String {
    let mut h = Sha256::new();
    h.update(b"tandem-tokenizer-v2\0");
    h.update(model.as_str().as_bytes());
    h.update([0]);
    h.update(pre.as_bytes());
    h.update([0]);
    h.update((tokens.len() as u64).to_le_bytes());
    for (t, k) in tokens.iter().zip(kinds) {
        h.update((t.len() as u64).to_le_bytes());
        h.update(t.as_bytes());
        h.update([k.code()]);
    }
    h.update((merges.len() as u64).to_le_bytes());
    for m in merges {
        h.update((m.len() as u64).to_le_bytes());
        h.update(m.as_bytes());
    }
    for id in [ids.bos, ids.eos, ids.eot, ids.eom, ids.pad] {
        h.update(id.map_or(u64::MAX, u64::from).to_le_bytes());
    }
    h.update([
        u8::from(ids.add_bos),
        u8::from(ids.add_eos),
        u8::from(add_space_prefix),
    ]);
    let digest = h.finalize();
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn check(a: &Tokenizer, b: &Tokenizer) -> Result<(), PairError> {
    let (x, y) = (&*a.inner, &*b.inner);
    if x.model != y.model {
        return Err(PairError::Model(
            x.model.as_str().into(),
            y.model.as_str().into(),
        ));
    }
    if a.pre_name() != b.pre_name() {
        return Err(PairError::Pre(a.pre_name().into(), b.pre_name().into()));
    }
    if x.real_vocab_size != y.real_vocab_size {
        return Err(PairError::VocabSize(x.real_vocab_size, y.real_vocab_size));
    }
    for id in 0..x.real_vocab_size {
        if x.tokens[id] != y.tokens[id] {
            return Err(PairError::Token {
                id: id as u32,
                a: x.tokens[id].clone(),
                b: y.tokens[id].clone(),
            });
        }
        if x.kinds[id] != y.kinds[id] {
            return Err(PairError::Kind {
                id: id as u32,
                a: x.kinds[id],
                b: y.kinds[id],
            });
        }
    }
    for (what, p, q) in [
        ("BOS", x.ids.bos, y.ids.bos),
        ("EOS", x.ids.eos, y.ids.eos),
        ("EOT", x.ids.eot, y.ids.eot),
        ("EOM", x.ids.eom, y.ids.eom),
    ] {
        if p != q {
            return Err(PairError::Special { what, a: p, b: q });
        }
    }
    for (what, p, q) in [
        ("add_bos_token", x.ids.add_bos, y.ids.add_bos),
        ("add_eos_token", x.ids.add_eos, y.ids.add_eos),
        ("add_space_prefix", x.add_space_prefix, y.add_space_prefix),
    ] {
        if p != q {
            return Err(PairError::Flag { what, a: p, b: q });
        }
    }
    if x.fingerprint != y.fingerprint {
        // Everything above agrees: what is left are the BPE merges (or the
        // padding id).
        if let (Algo::Bpe(_), Algo::Bpe(_)) = (&x.algo, &y.algo) {
            return Err(PairError::Merges(
                x.fingerprint.clone(),
                y.fingerprint.clone(),
            ));
        }
        return Err(PairError::Special {
            what: "padding id",
            a: x.ids.pad,
            b: y.ids.pad,
        });
    }
    Ok(())
}
