//! Special tokens as llama.cpp's `llama_vocab::impl::load` finds them: BOS,
//! EOS, EOT, EOM and padding ids from metadata (with llama.cpp's defaults per
//! vocabulary type), `add_bos_token` / `add_eos_token`, the end-of-generation
//! set, and the partition of text into special tokens and plain fragments.

use super::vocab::{err, meta_bool, meta_id, FxMap, TokenKind};
use crate::gguf::GgufFile;
use crate::Result;

/// Texts llama.cpp takes for the end-of-turn token when the metadata names
/// none, in its order of preference.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Texts that end generation in llama.cpp (`special_eog_ids`).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
];

/// FIM tokens llama.cpp also stops at (pad, repo, file separator).
const FIM_EOG_TEXTS: &[&[&str]] = &[
    &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"],
    &[
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ],
    &["<|file_sep|>"],
];

/// Fill-in-the-middle token texts llama.cpp recognises when the metadata
/// names none (`llama_vocab::impl::load`), in its order of preference:
/// prefix, suffix, middle.
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
];

/// Reads a token id from a metadata key, with a default when it is absent.
type ReadId<'a> = dyn Fn(&str, Option<u32>) -> Result<Option<u32>> + 'a;

/// A model's fill-in-the-middle tokens (llama.cpp's `fim_pre`, `fim_suf`,
/// `fim_mid`, `fim_pad`, `fim_rep`, `fim_sep`): from the metadata
/// `tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id`, else found by
/// their text as llama.cpp does (Qwen2.5-Coder's GGUFs name none in their
/// metadata; their vocabulary has `<|fim_prefix|>` …).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FimTokens {
    pub pre: Option<u32>,
    pub suf: Option<u32>,
    pub mid: Option<u32>,
    pub pad: Option<u32>,
    /// Repository name (`<|repo_name|>`): repo-level infill.
    pub rep: Option<u32>,
    /// File separator (`<|file_sep|>`): repo-level infill.
    pub sep: Option<u32>,
}

impl FimTokens {
    /// The names (`fim_pre`, `fim_suf`, `fim_mid`) of the tokens a
    /// fill-in-the-middle prompt needs and this model lacks (empty: it can).
    pub fn missing(&self) -> Vec<&'static str> {
        [
            ("fim_pre", self.pre),
            ("fim_suf", self.suf),
            ("fim_mid", self.mid),
        ]
        .into_iter()
        .filter(|(_, id)| id.is_none())
        .map(|(n, _)| n)
        .collect()
    }

    /// Reads them with `read` (a metadata key and the default when it is
    /// absent), the default being the first text found (see the type).
    fn read(read: &ReadId, token_to_id: &FxMap<String, u32>) -> Result<Self> {
        let find = |key: &str, texts: &[&str]| read(key, first_of(texts, token_to_id));
        Ok(Self {
            pre: find("tokenizer.ggml.fim_pre_token_id", FIM_PRE_TEXTS)?,
            suf: find("tokenizer.ggml.fim_suf_token_id", FIM_SUF_TEXTS)?,
            mid: find("tokenizer.ggml.fim_mid_token_id", FIM_MID_TEXTS)?,
            pad: find("tokenizer.ggml.fim_pad_token_id", FIM_EOG_TEXTS[0])?,
            rep: find("tokenizer.ggml.fim_rep_token_id", FIM_EOG_TEXTS[1])?,
            sep: find("tokenizer.ggml.fim_sep_token_id", FIM_EOG_TEXTS[2])?,
        })
    }
}

/// The special ids and flags of a vocabulary.
#[derive(Clone, Debug)]
pub(crate) struct Specials {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub pad: Option<u32>,
    pub unk: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    /// End-of-generation ids, ascending.
    pub eog: Vec<u32>,
    /// Fill-in-the-middle tokens (not part of the pairing fingerprint: a
    /// draft and target pair by their shared vocabulary, which holds them).
    pub fim: FimTokens,
}

/// Defaults llama.cpp assumes before reading metadata.
pub(crate) struct Defaults {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub add_bos: bool,
}

fn first_of(texts: &[&str], token_to_id: &FxMap<String, u32>) -> Option<u32> {
    texts.iter().find_map(|t| token_to_id.get(*t).copied())
}

impl Specials {
    /// Read the special ids. Tokens llama.cpp recognises by text (EOT, EOM,
    /// the EOG texts) become control tokens in `kinds`, as in llama.cpp.
    pub(crate) fn from_gguf(
        gguf: &GgufFile,
        defaults: Defaults,
        tokens: &[String],
        kinds: &mut [TokenKind],
        token_to_id: &FxMap<String, u32>,
    ) -> Result<Self> {
        let n = tokens.len();
        let in_range = |id: Option<u32>| id.filter(|&i| (i as usize) < n);
        let read = |key: &str, default: Option<u32>| -> Result<Option<u32>> {
            match meta_id(gguf, key)? {
                Some(id) if id as usize >= n => Err(err(format!(
                    "`{key}` = {id} is outside the vocabulary of {n} tokens"
                ))),
                Some(id) => Ok(Some(id)),
                None => Ok(in_range(default)),
            }
        };
        let fim = FimTokens::read(&read, token_to_id)?;
        let bos = read("tokenizer.ggml.bos_token_id", defaults.bos)?;
        let eos = read("tokenizer.ggml.eos_token_id", defaults.eos)?;
        let unk = read("tokenizer.ggml.unknown_token_id", defaults.unk)?;
        let pad = read("tokenizer.ggml.padding_token_id", None)?;
        let mut eot = read("tokenizer.ggml.eot_token_id", None)?;
        let mut eom = read("tokenizer.ggml.eom_token_id", None)?;
        let add_bos = meta_bool(gguf, "tokenizer.ggml.add_bos_token")?.unwrap_or(defaults.add_bos);
        let add_eos = meta_bool(gguf, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(err(
                "`tokenizer.ggml.add_bos_token` is set but there is no BOS token",
            ));
        }
        if add_eos && eos.is_none() {
            return Err(err(
                "`tokenizer.ggml.add_eos_token` is set but there is no EOS token",
            ));
        }

        let mut make_control = |id: u32| {
            if let Some(k) = kinds.get_mut(id as usize) {
                if !matches!(*k, TokenKind::Control) {
                    *k = TokenKind::Control;
                }
            }
        };
        if eot.is_none() {
            // llama.cpp takes the first match of an unordered map walk; take
            // EOS when it is one of the texts, else the first in list order.
            let eos_is_eot = eos
                .and_then(|e| tokens.get(e as usize))
                .is_some_and(|t| EOT_TEXTS.contains(&t.as_str()));
            eot = if eos_is_eot {
                eos
            } else {
                first_of(EOT_TEXTS, token_to_id)
            };
            if let Some(id) = eot {
                make_control(id);
            }
        }
        if eom.is_none() {
            eom = token_to_id.get("<|eom_id|>").copied();
            if let Some(id) = eom {
                make_control(id);
            }
        }
        let mut eog: Vec<u32> = Vec::new();
        for group in FIM_EOG_TEXTS {
            if let Some(id) = first_of(group, token_to_id) {
                make_control(id);
                eog.push(id);
            }
        }
        for t in EOG_TEXTS {
            if let Some(&id) = token_to_id.get(*t) {
                make_control(id);
                eog.push(id);
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        eog.sort_unstable();
        eog.dedup();
        Ok(Self {
            bos,
            eos,
            eot,
            eom,
            pad,
            unk,
            add_bos,
            add_eos,
            eog,
            fim,
        })
    }
}

/// A fragment of text after the special-token partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment {
    Token(u32),
    /// Byte range of plain text.
    Text(usize, usize),
}

/// Cut special tokens out of `text` like llama.cpp's
/// `tokenizer_st_partition`: for each special token, longest text first,
/// every occurrence in the remaining text fragments. Control and unknown
/// tokens only with `parse_special`, and never inside a `protected` byte
/// range (message contents of a chat); user-defined tokens always.
pub(crate) fn partition(
    text: &str,
    parse_special: bool,
    protected: &[(usize, usize)],
    specials: &[u32],
    tokens: &[String],
    kinds: &[TokenKind],
) -> Vec<Fragment> {
    let mut frags = vec![Fragment::Text(0, text.len())];
    if text.is_empty() {
        return Vec::new();
    }
    for &id in specials {
        let kind = kinds[id as usize];
        let control = kind != TokenKind::UserDefined;
        if control && !parse_special {
            continue;
        }
        let needle = tokens[id as usize].as_str();
        if needle.is_empty() || !text.contains(needle) {
            continue;
        }
        let blocked =
            |s: usize, e: usize| control && protected.iter().any(|&(ps, pe)| s < pe && ps < e);
        let mut next = Vec::with_capacity(frags.len() + 2);
        for f in frags {
            let Fragment::Text(mut s, e) = f else {
                next.push(f);
                continue;
            };
            let mut from = s;
            while let Some(rel) = text[from..e].find(needle) {
                let pos = from + rel;
                let end = pos + needle.len();
                if blocked(pos, end) {
                    // Skip this occurrence (at least one byte on).
                    from = pos + text[pos..].chars().next().map_or(1, char::len_utf8);
                    continue;
                }
                if pos > s {
                    next.push(Fragment::Text(s, pos));
                }
                next.push(Fragment::Token(id));
                s = end;
                from = end;
            }
            if s < e {
                next.push(Fragment::Text(s, e));
            }
        }
        frags = next;
    }
    frags
}

/// Ids the partition looks for: control, user-defined and unknown tokens with
/// a text, longest text first.
pub(crate) fn special_ids(tokens: &[String], kinds: &[TokenKind]) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..tokens.len() as u32)
        .filter(|&id| kinds[id as usize].is_special() && !tokens[id as usize].is_empty())
        .collect();
    ids.sort_by(|&a, &b| {
        tokens[b as usize]
            .len()
            .cmp(&tokens[a as usize].len())
            .then(a.cmp(&b))
    });
    ids
}
