//! The vocabulary as the GGUF stores it: token texts, GGUF token types,
//! scores, and the typed readers of `tokenizer.ggml.*` metadata.

use crate::gguf::GgufFile;
use crate::{ModelError, Result};
use candle_core::quantized::gguf_file::Value;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Rustc's Fx hash: the maps of the tokenizer are built once from model
/// metadata and only read afterwards, so SipHash's DoS resistance buys nothing
/// while costing a large share of the startup time.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        for &b in chunks.remainder() {
            self.add(u64::from(b));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

impl FxHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

pub(crate) type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    Normal,
    Unknown,
    /// Control tokens such as `<|im_start|>`: only parsed from text on request,
    /// omitted by `decode(.., skip_special = true)`.
    Control,
    /// Added tokens that are plain text (`<tool_call>`): always parsed.
    UserDefined,
    /// Padding slots of the embedding matrix (`[PAD151665]`): never produced by
    /// `encode`, decode to nothing.
    Unused,
    /// SentencePiece byte-fallback tokens `<0xXX>`.
    Byte,
}

impl TokenKind {
    pub(crate) fn from_gguf(v: i64) -> Self {
        match v {
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Normal,
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            Self::Normal => 1,
            Self::Unknown => 2,
            Self::Control => 3,
            Self::UserDefined => 4,
            Self::Unused => 5,
            Self::Byte => 6,
        }
    }

    /// Cut out of text by the special-token partition (control and unknown
    /// only when the caller parses special tokens).
    pub(crate) fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::UserDefined | Self::Unknown)
    }
}

pub(crate) fn err(msg: impl Into<String>) -> ModelError {
    ModelError::Tokenizer(msg.into())
}

pub(crate) fn meta<'a>(gguf: &'a GgufFile, key: &str) -> Result<&'a Value> {
    gguf.metadata
        .get(key)
        .ok_or_else(|| ModelError::MissingMetadata(key.to_string()))
}

pub(crate) fn meta_str<'a>(gguf: &'a GgufFile, key: &str) -> Result<Option<&'a str>> {
    match gguf.metadata.get(key) {
        None => Ok(None),
        Some(v) => v
            .to_string()
            .map(|s| Some(s.as_str()))
            .map_err(|_| err(format!("`{key}` is not a string"))),
    }
}

pub(crate) fn meta_bool(gguf: &GgufFile, key: &str) -> Result<Option<bool>> {
    match gguf.metadata.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => value_as_i64(v)
            .map(|x| Some(x != 0))
            .ok_or_else(|| err(format!("`{key}` is not a boolean: {v:?}"))),
    }
}

pub(crate) fn meta_id(gguf: &GgufFile, key: &str) -> Result<Option<u32>> {
    let Some(v) = gguf.metadata.get(key) else {
        return Ok(None);
    };
    value_as_i64(v)
        .and_then(|x| u32::try_from(x).ok())
        .map(Some)
        .ok_or_else(|| err(format!("`{key}` is not a token id: {v:?}")))
}

pub(crate) fn value_as_i64(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => i64::from(*x),
        Value::I8(x) => i64::from(*x),
        Value::U16(x) => i64::from(*x),
        Value::I16(x) => i64::from(*x),
        Value::U32(x) => i64::from(*x),
        Value::I32(x) => i64::from(*x),
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}

pub(crate) fn string_array<'a>(gguf: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    let arr = meta(gguf, key)?
        .to_vec()
        .map_err(|_| err(format!("`{key}` is not an array")))?;
    arr.iter()
        .enumerate()
        .map(|(i, v)| {
            v.to_string()
                .map(String::as_str)
                .map_err(|_| err(format!("`{key}`[{i}] is not a string")))
        })
        .collect()
}

/// `tokenizer.ggml.token_type`, or every token normal when absent.
pub(crate) fn token_kinds(gguf: &GgufFile, n: usize) -> Result<Vec<TokenKind>> {
    let Some(v) = gguf.metadata.get("tokenizer.ggml.token_type") else {
        return Ok(vec![TokenKind::Normal; n]);
    };
    let arr = v
        .to_vec()
        .map_err(|_| err("`tokenizer.ggml.token_type` is not an array"))?;
    if arr.len() != n {
        return Err(err(format!(
            "`tokenizer.ggml.token_type` has {} entries for {n} tokens",
            arr.len()
        )));
    }
    arr.iter()
        .map(|v| {
            value_as_i64(v)
                .map(TokenKind::from_gguf)
                .ok_or_else(|| err("`tokenizer.ggml.token_type` is not numeric"))
        })
        .collect()
}

/// `tokenizer.ggml.scores` (SentencePiece piece scores), as llama.cpp reads
/// them: f32 or i32 entries, at least one per token.
pub(crate) fn scores(gguf: &GgufFile, n: usize) -> Result<Vec<f32>> {
    let arr = meta(gguf, "tokenizer.ggml.scores")?
        .to_vec()
        .map_err(|_| err("`tokenizer.ggml.scores` is not an array"))?;
    if arr.len() < n {
        return Err(err(format!(
            "`tokenizer.ggml.scores` has {} entries for {n} tokens",
            arr.len()
        )));
    }
    arr.iter()
        .take(n)
        .map(|v| match v {
            Value::F32(x) => Ok(*x),
            Value::I32(x) => Ok(*x as f32),
            other => Err(err(format!(
                "`tokenizer.ggml.scores` holds {other:?} (expected f32 or i32)"
            ))),
        })
        .collect()
}

/// The byte of a `<0xXX>` byte-fallback token text.
pub(crate) fn byte_token_value(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// Number of ids before the trailing padding slots: the vocabulary two
/// models of a family share. Padding is an `Unused` token, or a `[PAD…]`
/// text, at the end of the table (Qwen2.5-0.5B pads 151,665 real tokens to
/// 151,936 rows, 7B to 152,064).
pub(crate) fn real_vocab_size(tokens: &[String], kinds: &[TokenKind]) -> usize {
    let mut n = tokens.len();
    while n > 0 {
        let i = n - 1;
        let pad = kinds[i] == TokenKind::Unused
            || (tokens[i].starts_with("[PAD") && tokens[i].ends_with(']'));
        if !pad {
            break;
        }
        n = i;
    }
    n
}
