//! Pre-tokenizers of GPT-2 byte-level BPE vocabularies: the regex lists that
//! llama.cpp's `llama-vocab.cpp` assigns to each `tokenizer.ggml.pre` name.
//!
//! A list is applied like llama.cpp's `unicode_regex_split`: the first regex
//! splits the text into matches and the gaps between them (both kept as
//! pieces), the next regex splits each piece the same way, and so on. Each
//! regex sees one piece at a time, so a lookahead never looks past the end of
//! its piece. llama.cpp runs most of these regexes through hand-written
//! matchers or `std::regex` over a category-collapsed text; `fancy_regex`
//! with the same patterns gives the same pieces (the fixtures against
//! llama.cpp check it).

use super::vocab::err;
use crate::Result;

/// The pre-tokenizer families this tokenizer implements (llama.cpp's
/// `LLAMA_VOCAB_PRE_TYPE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreType {
    /// No or `default` pre name: llama.cpp's fallback regex list.
    Default,
    /// Llama 3 (`llama-bpe`, `llama3`, …): digits in runs of up to three.
    Llama3,
    /// Qwen2 (`qwen2`, …): single digits.
    Qwen2,
    /// StarCoder-style (`smollm`, `starcoder`, …): single digits, then GPT-2.
    Smollm,
    /// GPT-2 (`gpt-2`, `mpt`, `olmo`, …).
    Gpt2,
}

/// The `tokenizer.ggml.pre` names accepted, and their family (as in
/// llama.cpp's `llama_vocab::impl::load`).
const NAMES: &[(&str, PreType)] = &[
    ("default", PreType::Default),
    ("llama3", PreType::Llama3),
    ("llama-v3", PreType::Llama3),
    ("llama-bpe", PreType::Llama3),
    ("falcon3", PreType::Llama3),
    ("pixtral", PreType::Llama3),
    ("dbrx", PreType::Llama3),
    ("smaug-bpe", PreType::Llama3),
    ("qwen2", PreType::Qwen2),
    ("deepseek-r1-qwen", PreType::Qwen2),
    ("megrez", PreType::Qwen2),
    ("stablelm2", PreType::Qwen2),
    ("smollm", PreType::Smollm),
    ("starcoder", PreType::Smollm),
    ("refact", PreType::Smollm),
    ("codeshell", PreType::Smollm),
    ("gpt-2", PreType::Gpt2),
    ("phi-2", PreType::Gpt2),
    ("mpt", PreType::Gpt2),
    ("olmo", PreType::Gpt2),
];

const CONTRACTIONS_CI: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

impl PreType {
    /// The family of a `tokenizer.ggml.pre` name (`None`: absent, llama.cpp's
    /// `default`), or an error naming the supported ones.
    pub fn from_name(name: Option<&str>) -> Result<Self> {
        let Some(name) = name else {
            return Ok(Self::Default);
        };
        NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, t)| t)
            .ok_or_else(|| {
                err(format!(
                    "unsupported pre-tokenizer `{name}` (supported: {})",
                    supported_names().join(", ")
                ))
            })
    }

    /// llama.cpp's `ignore_merges`: a pre-token that is itself in the
    /// vocabulary becomes that token without running the merges.
    pub fn ignore_merges(self) -> bool {
        self == Self::Llama3
    }

    /// llama.cpp's default `add_bos` for this family (metadata overrides it).
    pub fn add_bos_default(self) -> bool {
        self == Self::Llama3
    }

    fn regexes(self) -> Vec<String> {
        match self {
            Self::Llama3 => vec![format!(
                r"{CONTRACTIONS_CI}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            )],
            Self::Qwen2 => vec![format!(
                r"{CONTRACTIONS_CI}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            )],
            Self::Smollm => vec![r"\p{N}".into(), GPT2.into()],
            Self::Gpt2 => vec![GPT2.into()],
            Self::Default => vec![
                r"[\p{P}\$\+<=>\^~\|]+".into(),
                GPT2.into(),
                r"\p{N}+".into(),
                "[0-9][0-9][0-9]".into(),
            ],
        }
    }
}

/// Every accepted `tokenizer.ggml.pre` name.
pub fn supported_names() -> Vec<&'static str> {
    NAMES.iter().map(|(n, _)| *n).collect()
}

/// A compiled regex list.
pub(crate) struct PreTokenizer {
    regexes: Vec<fancy_regex::Regex>,
}

impl PreTokenizer {
    pub(crate) fn new(pre: PreType) -> Result<Self> {
        let regexes = pre
            .regexes()
            .iter()
            .map(|r| {
                fancy_regex::Regex::new(r).map_err(|e| err(format!("pre-tokenizer regex: {e}")))
            })
            .collect::<Result<_>>()?;
        Ok(Self { regexes })
    }

    /// Split `text` into pre-tokens (their concatenation is `text`).
    pub(crate) fn split<'t>(&self, text: &'t str) -> Result<Vec<&'t str>> {
        let mut pieces = vec![text];
        for re in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for piece in pieces {
                let mut last = 0;
                for m in re.find_iter(piece) {
                    let m = m.map_err(|e| err(format!("pre-tokenizer: {e}")))?;
                    if m.start() > last {
                        next.push(&piece[last..m.start()]);
                    }
                    if m.end() > m.start() {
                        next.push(m.as_str());
                    }
                    last = m.end();
                }
                if last < piece.len() {
                    next.push(&piece[last..]);
                }
            }
            pieces = next;
        }
        Ok(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pre: PreType, s: &str) -> Vec<String> {
        PreTokenizer::new(pre)
            .unwrap()
            .split(s)
            .unwrap()
            .into_iter()
            .map(String::from)
            .collect()
    }

    #[test]
    fn qwen2_splits_single_digits_and_contractions() {
        assert_eq!(
            split(PreType::Qwen2, "Hello'Ve world 123\n\n  foo"),
            ["Hello", "'Ve", " world", " ", "1", "2", "3", "\n\n", " ", " foo"]
        );
    }

    #[test]
    fn llama3_groups_three_digits() {
        assert_eq!(
            split(PreType::Llama3, "x 12345 I'M"),
            ["x", " ", "123", "45", " I", "'M"]
        );
    }

    #[test]
    fn smollm_isolates_digits_before_gpt2() {
        assert_eq!(
            split(PreType::Smollm, "ab 123  c"),
            ["ab", " ", "1", "2", "3", " ", " c"]
        );
        // GPT-2 contractions are case-sensitive.
        assert_eq!(
            split(PreType::Gpt2, "I'M it's"),
            ["I", "'", "M", " it", "'s"]
        );
    }

    #[test]
    fn unknown_pre_names_list_the_supported_ones() {
        let e = PreType::from_name(Some("tekken")).unwrap_err().to_string();
        assert!(
            e.contains("tekken") && e.contains("llama-bpe") && e.contains("smollm"),
            "{e}"
        );
        assert_eq!(PreType::from_name(None).unwrap(), PreType::Default);
    }
}
