//! The Qwen2 tokenizer, built from GGUF metadata alone (no `tokenizer.json`).
//!
//! It is a GPT-2 style byte-level BPE, written to reproduce llama.cpp's tokenizer
//! for `tokenizer.ggml.pre = qwen2` id for id:
//!
//! 1. **Special-token partition.** Control tokens (`<|im_start|>`, …, GGUF
//!    token type 3) are cut out of the text only when the caller asks for it
//!    (`parse_special`); user-defined tokens (type 4, e.g. `<tool_call>`) are
//!    always cut out, as llama.cpp and Hugging Face do. Longest token first.
//! 2. **Pre-tokenizer.** The Qwen2 regex splits each remaining fragment into
//!    words (letters, single digits, punctuation runs, whitespace runs).
//! 3. **BPE.** Each word starts as its UTF-8 bytes (one token per byte) and the
//!    adjacent pair with the lowest merge rank is merged until none is left.
//!
//! No Unicode normalisation is applied (llama.cpp applies none either), so
//! `decode(encode(text)) == text` for every string.
//!
//! Decoding concatenates the raw bytes of each token and converts them to UTF-8
//! (invalid sequences become U+FFFD, as in `String::from_utf8_lossy`).
//! [`StreamDecoder`] does the same incrementally and never splits a character.

use crate::gguf::GgufFile;
use crate::{ModelError, Result};
use candle_core::quantized::gguf_file::Value;
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// Rustc's Fx hash: the maps below are built once from trusted model
/// metadata and only read afterwards, so SipHash's DoS resistance buys nothing
/// while costing a large share of the startup time.
#[derive(Default, Clone, Copy)]
struct FxHasher(u64);

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

type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// llama.cpp's pre-tokenizer regex for `qwen2` (the tokenizer.json regex with
/// the case-insensitive contractions spelled out).
const QWEN2_PRE_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>";
const END_OF_TEXT: &str = "<|endoftext|>";

/// The system prompt the Qwen2.5 chat template inserts when the conversation
/// does not start with one.
pub const DEFAULT_SYSTEM_PROMPT: &str =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

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
    Byte,
}

impl TokenKind {
    fn from_gguf(v: i64) -> Self {
        match v {
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Normal,
        }
    }

    fn code(self) -> u8 {
        match self {
            Self::Normal => 1,
            Self::Unknown => 2,
            Self::Control => 3,
            Self::UserDefined => 4,
            Self::Unused => 5,
            Self::Byte => 6,
        }
    }
}

/// Who speaks a chat message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    /// A tool's answer (rendered inside `<tool_response>` in a user turn).
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "system" => Ok(Self::System),
            "user" => Ok(Self::User),
            "assistant" => Ok(Self::Assistant),
            "tool" => Ok(Self::Tool),
            other => Err(ModelError::InvalidArgument(format!(
                "unknown chat role `{other}` (expected system, user, assistant or tool)"
            ))),
        }
    }
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }
}

/// A piece of rendered chat: trusted template control tokens vs. text.
enum ChatPiece<'a> {
    /// A control token written by the template itself.
    Control(&'a str),
    /// Template text or message content: always encoded as plain text.
    Text(&'a str),
}

struct Inner {
    /// Token text as stored in the GGUF (byte-level form, e.g. `Ġworld`).
    tokens: Vec<String>,
    /// The bytes each token stands for when decoded.
    pieces: Vec<Vec<u8>>,
    kinds: Vec<TokenKind>,
    token_to_id: FxMap<String, u32>,
    /// Id of the one-byte token for each byte value.
    byte_to_id: [u32; 256],
    /// `(left, right) -> (rank, merged)`.
    merges: FxMap<(u32, u32), (u32, u32)>,
    /// Control / user-defined / unknown tokens, longest text first.
    specials: Vec<u32>,
    pre: fancy_regex::Regex,
    im_start: u32,
    im_end: u32,
    end_of_text: u32,
    eos: u32,
    bos: Option<u32>,
    fingerprint: String,
}

/// The Qwen2 byte-level BPE tokenizer. Cloning is cheap (shared state).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.tokens.len())
            .field("merges", &self.inner.merges.len())
            .field("fingerprint", &self.inner.fingerprint)
            .finish()
    }
}

fn err(msg: impl Into<String>) -> ModelError {
    ModelError::Tokenizer(msg.into())
}

fn meta<'a>(gguf: &'a GgufFile, key: &str) -> Result<&'a Value> {
    gguf.metadata
        .get(key)
        .ok_or_else(|| ModelError::MissingMetadata(key.to_string()))
}

fn meta_id(gguf: &GgufFile, key: &str) -> Result<Option<u32>> {
    let Some(v) = gguf.metadata.get(key) else {
        return Ok(None);
    };
    value_as_i64(v)
        .and_then(|x| u32::try_from(x).ok())
        .map(Some)
        .ok_or_else(|| err(format!("`{key}` is not a token id: {v:?}")))
}

fn value_as_i64(v: &Value) -> Option<i64> {
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

fn string_array<'a>(gguf: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
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

/// GPT-2's reversible byte <-> printable-char table: printable Latin-1 bytes
/// map to themselves, the rest to U+0100.. in byte order.
pub(crate) fn byte_level_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
        let cp = if printable {
            b as u32
        } else {
            let cp = next;
            next += 1;
            cp
        };
        *slot = char::from_u32(cp).unwrap_or('\0');
    }
    table
}

impl Tokenizer {
    /// Build the tokenizer from a GGUF's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let model = meta(gguf, "tokenizer.ggml.model")?
            .to_string()
            .map_err(|_| err("`tokenizer.ggml.model` is not a string"))?;
        if model != "gpt2" {
            return Err(err(format!(
                "unsupported tokenizer model `{model}` (supported: gpt2 byte-level BPE)"
            )));
        }
        let pre = match gguf.metadata.get("tokenizer.ggml.pre") {
            Some(v) => v
                .to_string()
                .map_err(|_| err("`tokenizer.ggml.pre` is not a string"))?
                .as_str(),
            None => "default",
        };
        if pre != "qwen2" {
            return Err(err(format!(
                "unsupported pre-tokenizer `{pre}` (supported: qwen2)"
            )));
        }

        let token_texts = string_array(gguf, "tokenizer.ggml.tokens")?;
        let n = token_texts.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(err(format!("vocabulary of {n} tokens")));
        }
        // Every id the model can produce must decode, and every id the
        // tokenizer produces must have an embedding row.
        if let Some(embd) = gguf.tensors.get("token_embd.weight") {
            let rows = embd.dims.get(1).copied().unwrap_or(1);
            if rows != n {
                return Err(err(format!(
                    "`tokenizer.ggml.tokens` has {n} tokens but `token_embd.weight` has {rows} rows"
                )));
            }
        }
        let kinds: Vec<TokenKind> = match gguf.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => {
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
                    .collect::<Result<_>>()?
            }
            None => vec![TokenKind::Normal; n],
        };

        let chars = byte_level_chars();
        // Byte-level chars are all below U+0144: a flat table beats a map.
        let mut char_to_byte = [None::<u8>; 0x144];
        for (b, c) in chars.iter().enumerate() {
            if let Some(slot) = char_to_byte.get_mut(*c as usize) {
                *slot = Some(b as u8);
            }
        }

        // The two halves of the vocabulary work run side by side: the decoded
        // bytes of every token (parallel) and the text -> id map (sequential).
        let piece_of = |id: usize, text: &str, kind: TokenKind| -> Result<Vec<u8>> {
            Ok(match kind {
                TokenKind::Normal | TokenKind::Byte => {
                    let mut bytes = Vec::with_capacity(text.len());
                    for c in text.chars() {
                        let b = char_to_byte.get(c as usize).copied().flatten().ok_or_else(|| {
                            err(format!(
                                "token {id} `{text}` has a character outside the byte-level alphabet"
                            ))
                        })?;
                        bytes.push(b);
                    }
                    bytes
                }
                TokenKind::Unused => Vec::new(),
                _ => text.as_bytes().to_vec(),
            })
        };
        let ((pieces, tokens), token_to_id) = rayon::join(
            || {
                let pieces = token_texts
                    .par_iter()
                    .zip(kinds.par_iter())
                    .enumerate()
                    .map(|(id, (text, kind))| piece_of(id, text, *kind))
                    .collect::<Result<Vec<_>>>();
                let tokens: Vec<String> = token_texts.par_iter().map(|t| t.to_string()).collect();
                (pieces, tokens)
            },
            || {
                let mut map: FxMap<String, u32> =
                    FxMap::with_capacity_and_hasher(n, Default::default());
                for (id, text) in token_texts.iter().enumerate() {
                    // As in llama.cpp, a duplicated text maps to its last id.
                    map.insert(text.to_string(), id as u32);
                }
                map
            },
        );
        let pieces = pieces?;

        let mut byte_to_id = [0u32; 256];
        for (b, c) in chars.iter().enumerate() {
            let id = token_to_id
                .get(c.encode_utf8(&mut [0; 4]) as &str)
                .copied()
                .ok_or_else(|| err(format!("no token for byte 0x{b:02x}")))?;
            byte_to_id[b] = id;
        }

        let merge_texts = string_array(gguf, "tokenizer.ggml.merges")?;
        // Resolving the merge strings to ids is read-only: do it in parallel,
        // then insert in rank order.
        let resolved = merge_texts
            .par_iter()
            .enumerate()
            .map_init(String::new, |joined, (rank, m)| {
                let (a, b) = m
                    .split_once(' ')
                    .ok_or_else(|| err(format!("merge {rank} `{m}` has no space")))?;
                let lookup = |t: &str| {
                    token_to_id.get(t).copied().ok_or_else(|| {
                        err(format!(
                            "merge {rank} `{m}`: `{t}` is not in the vocabulary"
                        ))
                    })
                };
                joined.clear();
                joined.push_str(a);
                joined.push_str(b);
                Ok(((lookup(a)?, lookup(b)?), lookup(joined)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut merges = FxMap::with_capacity_and_hasher(resolved.len(), Default::default());
        for (rank, (pair, merged)) in resolved.into_iter().enumerate() {
            // Like llama.cpp, the first (lowest-rank) occurrence of a pair wins.
            merges.entry(pair).or_insert((rank as u32, merged));
        }

        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&id| {
                matches!(
                    kinds[id as usize],
                    TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown
                ) && !tokens[id as usize].is_empty()
            })
            .collect();
        specials.sort_by(|&a, &b| {
            tokens[b as usize]
                .len()
                .cmp(&tokens[a as usize].len())
                .then(a.cmp(&b))
        });

        let special_id = |t: &str| {
            token_to_id
                .get(t)
                .copied()
                .ok_or_else(|| err(format!("special token `{t}` is not in the vocabulary")))
        };
        let im_start = special_id(IM_START)?;
        let im_end = special_id(IM_END)?;
        let end_of_text = special_id(END_OF_TEXT)?;
        let eos = meta_id(gguf, "tokenizer.ggml.eos_token_id")?.unwrap_or(im_end);
        let bos = meta_id(gguf, "tokenizer.ggml.bos_token_id")?;
        let pad = meta_id(gguf, "tokenizer.ggml.padding_token_id")?;
        for (name, id) in [("eos", Some(eos)), ("bos", bos), ("padding", pad)] {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(err(format!(
                        "{name} token id {id} is outside the vocabulary of {n}"
                    )));
                }
            }
        }

        let pre_re = fancy_regex::Regex::new(QWEN2_PRE_REGEX)
            .map_err(|e| err(format!("pre-tokenizer regex: {e}")))?;

        let fingerprint = {
            let mut h = Sha256::new();
            h.update(b"tandem-tokenizer-v1\0gpt2\0");
            h.update(pre.as_bytes());
            h.update([0]);
            h.update((n as u64).to_le_bytes());
            for (t, k) in tokens.iter().zip(&kinds) {
                h.update((t.len() as u64).to_le_bytes());
                h.update(t.as_bytes());
                h.update([k.code()]);
            }
            h.update((merge_texts.len() as u64).to_le_bytes());
            for m in &merge_texts {
                h.update((m.len() as u64).to_le_bytes());
                h.update(m.as_bytes());
            }
            for id in [Some(eos), bos, pad] {
                h.update(id.map_or(u64::MAX, u64::from).to_le_bytes());
            }
            let digest = h.finalize();
            digest
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        };

        Ok(Self {
            inner: Arc::new(Inner {
                tokens,
                pieces,
                kinds,
                token_to_id,
                byte_to_id,
                merges,
                specials,
                pre: pre_re,
                im_start,
                im_end,
                end_of_text,
                eos,
                bos,
                fingerprint,
            }),
        })
    }

    /// Number of token ids (the embedding's row count; includes padding slots).
    pub fn vocab_size(&self) -> usize {
        self.inner.tokens.len()
    }

    /// Id of a token by its vocabulary text (GGUF form, e.g. `Ġworld` for
    /// " world", or `<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id.get(token).copied()
    }

    /// Vocabulary text of a token (inverse of [`Tokenizer::token_to_id`]).
    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.inner.tokens.get(id as usize).map(String::as_str)
    }

    /// The raw bytes a token decodes to (may be part of a UTF-8 character;
    /// control tokens give their text, padding slots nothing).
    pub fn id_to_piece(&self, id: u32) -> Option<&[u8]> {
        self.inner.pieces.get(id as usize).map(Vec::as_slice)
    }

    /// The GGUF token type of `id`.
    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.inner.kinds.get(id as usize).copied()
    }

    /// `<|im_start|>`.
    pub fn im_start_id(&self) -> u32 {
        self.inner.im_start
    }
    /// `<|im_end|>` (the chat models' end of turn).
    pub fn im_end_id(&self) -> u32 {
        self.inner.im_end
    }
    /// `<|endoftext|>`.
    pub fn endoftext_id(&self) -> u32 {
        self.inner.end_of_text
    }
    /// `tokenizer.ggml.eos_token_id`.
    pub fn eos_id(&self) -> u32 {
        self.inner.eos
    }
    /// `tokenizer.ggml.bos_token_id` (never added to prompts: `add_bos` is false).
    pub fn bos_id(&self) -> Option<u32> {
        self.inner.bos
    }

    /// Whether generation stops at `id` (end of generation).
    pub fn is_eog(&self, id: u32) -> bool {
        id == self.inner.im_end || id == self.inner.end_of_text || id == self.inner.eos
    }

    /// sha256 (hex) over pre-tokenizer, vocabulary, token types, merges and
    /// special ids. Two sides may exchange token ids only if these agree.
    pub fn fingerprint(&self) -> String {
        self.inner.fingerprint.clone()
    }

    /// Encode text. With `parse_special`, control-token texts such as
    /// `<|im_start|>` become their ids; without, they are tokenized as plain
    /// text (use `false` for anything a user wrote). No BOS is added.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        self.encode_into(text, parse_special, &mut out)?;
        Ok(out)
    }

    fn encode_into(&self, text: &str, parse_special: bool, out: &mut Vec<u32>) -> Result<()> {
        // Fragments: Ok(id) for a special token, Err(text) for plain text.
        let mut fragments: Vec<std::result::Result<u32, &str>> = vec![Err(text)];
        for &id in &self.inner.specials {
            let kind = self.inner.kinds[id as usize];
            if !parse_special && kind != TokenKind::UserDefined {
                continue;
            }
            let needle = self.inner.tokens[id as usize].as_str();
            if !fragments
                .iter()
                .any(|f| matches!(f, Err(t) if t.contains(needle)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for f in fragments {
                match f {
                    Err(mut t) => {
                        while let Some(pos) = t.find(needle) {
                            if pos > 0 {
                                next.push(Err(&t[..pos]));
                            }
                            next.push(Ok(id));
                            t = &t[pos + needle.len()..];
                        }
                        if !t.is_empty() {
                            next.push(Err(t));
                        }
                    }
                    ok => next.push(ok),
                }
            }
            fragments = next;
        }
        for f in fragments {
            match f {
                Ok(id) => out.push(id),
                Err(t) => self.encode_plain(t, out)?,
            }
        }
        Ok(())
    }

    /// Pre-tokenize and BPE-encode text that contains no special tokens.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let mut last = 0;
        for m in self.inner.pre.find_iter(text) {
            let m = m.map_err(|e| err(format!("pre-tokenizer: {e}")))?;
            // The last alternative `\s+` makes the regex cover every
            // character; keep any gap anyway rather than drop text.
            if m.start() > last {
                self.bpe_word(&text.as_bytes()[last..m.start()], out);
            }
            self.bpe_word(m.as_str().as_bytes(), out);
            last = m.end();
        }
        if last < text.len() {
            self.bpe_word(&text.as_bytes()[last..], out);
        }
        Ok(())
    }

    /// BPE over one pre-token: merge the lowest-rank adjacent pair (leftmost on
    /// ties) until no pair has a merge. O(n log n) with a heap of candidates.
    fn bpe_word(&self, bytes: &[u8], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        struct Sym {
            id: u32,
            prev: usize,
            next: usize,
            alive: bool,
        }
        let merges = &self.inner.merges;
        match bytes.len() {
            0 => return,
            1 => {
                out.push(self.inner.byte_to_id[bytes[0] as usize]);
                return;
            }
            _ => {}
        }
        let mut syms: Vec<Sym> = bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| Sym {
                id: self.inner.byte_to_id[b as usize],
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == bytes.len() { NONE } else { i + 1 },
                alive: true,
            })
            .collect();
        // (rank, left index, right index)
        let mut heap: BinaryHeap<Reverse<(u32, usize, usize)>> = BinaryHeap::new();
        for i in 0..syms.len() - 1 {
            if let Some(&(rank, _)) = merges.get(&(syms[i].id, syms[i + 1].id)) {
                heap.push(Reverse((rank, i, i + 1)));
            }
        }
        while let Some(Reverse((rank, l, r))) = heap.pop() {
            if !syms[l].alive || !syms[r].alive || syms[l].next != r {
                continue;
            }
            let Some(&(cur_rank, merged)) = merges.get(&(syms[l].id, syms[r].id)) else {
                continue;
            };
            if cur_rank != rank {
                continue;
            }
            syms[l].id = merged;
            syms[r].alive = false;
            let after = syms[r].next;
            syms[l].next = after;
            if after != NONE {
                syms[after].prev = l;
            }
            let before = syms[l].prev;
            if before != NONE {
                if let Some(&(rk, _)) = merges.get(&(syms[before].id, merged)) {
                    heap.push(Reverse((rk, before, l)));
                }
            }
            if after != NONE {
                if let Some(&(rk, _)) = merges.get(&(merged, syms[after].id)) {
                    heap.push(Reverse((rk, l, after)));
                }
            }
        }
        let mut i = 0;
        while i != NONE {
            out.push(syms[i].id);
            i = syms[i].next;
        }
    }

    /// The bytes of `ids`, or an error for an id outside the vocabulary.
    fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.piece_for_decode(id, skip_special)?);
        }
        Ok(bytes)
    }

    fn piece_for_decode(&self, id: u32, skip_special: bool) -> Result<&[u8]> {
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

    /// Decode ids to text. `skip_special` drops control tokens (`<|im_end|>` …).
    /// Byte sequences that are not valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let bytes = self.decode_bytes(ids, skip_special)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    fn chat_pieces<'a>(
        &self,
        messages: &'a [ChatMessage],
        add_generation_prompt: bool,
    ) -> Vec<ChatPiece<'a>> {
        use ChatPiece::{Control, Text};
        let mut p = Vec::with_capacity(messages.len() * 6 + 6);
        match messages.first() {
            Some(m) if m.role == Role::System => {
                p.extend([Control(IM_START), Text("system\n"), Text(&m.content)]);
            }
            _ => p.extend([
                Control(IM_START),
                Text("system\n"),
                Text(DEFAULT_SYSTEM_PROMPT),
            ]),
        }
        p.extend([Control(IM_END), Text("\n")]);
        for (i, m) in messages.iter().enumerate() {
            match m.role {
                Role::System if i == 0 => {}
                Role::System | Role::User | Role::Assistant => {
                    p.extend([
                        Control(IM_START),
                        Text(m.role.as_str()),
                        Text("\n"),
                        Text(&m.content),
                        Control(IM_END),
                        Text("\n"),
                    ]);
                }
                Role::Tool => {
                    let prev_is_tool = i > 0 && messages[i - 1].role == Role::Tool;
                    if !prev_is_tool {
                        p.extend([Control(IM_START), Text("user")]);
                    }
                    p.extend([
                        Text("\n<tool_response>\n"),
                        Text(&m.content),
                        Text("\n</tool_response>"),
                    ]);
                    let next_is_tool = messages.get(i + 1).is_some_and(|n| n.role == Role::Tool);
                    if !next_is_tool {
                        p.extend([Control(IM_END), Text("\n")]);
                    }
                }
            }
        }
        if add_generation_prompt {
            p.extend([Control(IM_START), Text("assistant\n")]);
        }
        p
    }

    /// Render a conversation with the model's ChatML template (the GGUF's
    /// `tokenizer.chat_template` without tools). A default system prompt is
    /// inserted when the first message is not a system message.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> String {
        let mut s = String::new();
        for piece in self.chat_pieces(messages, add_generation_prompt) {
            match piece {
                ChatPiece::Control(t) | ChatPiece::Text(t) => s.push_str(t),
            }
        }
        s
    }

    /// Tokenize a conversation: the template's control tokens become their
    /// ids, while message contents are always plain text, so a message that
    /// contains `<|im_end|>` cannot end its turn early. For contents free of
    /// control-token text this equals
    /// `encode(&apply_chat_template(..), true)`.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        let mut text = String::new();
        for piece in self.chat_pieces(messages, add_generation_prompt) {
            match piece {
                ChatPiece::Text(t) => text.push_str(t),
                ChatPiece::Control(t) => {
                    // Text between two control tokens is tokenized as one run,
                    // exactly as when the whole rendered string is encoded.
                    self.encode_into(&text, false, &mut out)?;
                    text.clear();
                    let id = self
                        .token_to_id(t)
                        .ok_or_else(|| err(format!("`{t}` is not in the vocabulary")))?;
                    out.push(id);
                }
            }
        }
        self.encode_into(&text, false, &mut out)?;
        Ok(out)
    }

    /// A streaming decoder over this tokenizer.
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder {
        StreamDecoder::new(self, skip_special)
    }
}

/// Turns a stream of token ids into text chunks without ever splitting a
/// UTF-8 character (a byte-level token can end in the middle of one). The
/// concatenation of all chunks, plus [`StreamDecoder::flush`], equals
/// [`Tokenizer::decode`] of all the ids.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    skip_special: bool,
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new(tokenizer: &Tokenizer, skip_special: bool) -> Self {
        Self {
            tokenizer: tokenizer.clone(),
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Add one token; returns the text it completes, if any. An id outside
    /// the vocabulary yields U+FFFD (the model never produces one; use
    /// [`Tokenizer::decode`] to get an error instead).
    pub fn push(&mut self, id: u32) -> Option<String> {
        match self.tokenizer.piece_for_decode(id, self.skip_special) {
            Ok(piece) => self.pending.extend_from_slice(piece),
            Err(_) => {
                tracing::warn!(id, "stream decoder: token id out of range");
                // Flush what is pending first so the mark lands in order.
                let mut s = self.take_lossy();
                s.push(char::REPLACEMENT_CHARACTER);
                return Some(s);
            }
        }
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix is valid UTF-8 by construction.
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // Incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                        // Invalid bytes: same replacement as from_utf8_lossy.
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + len);
                        }
                    }
                }
            }
        }
        (!out.is_empty()).then_some(out)
    }

    fn take_lossy(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }

    /// End of stream: whatever is pending (an incomplete character becomes
    /// U+FFFD).
    pub fn flush(&mut self) -> Option<String> {
        let s = self.take_lossy();
        (!s.is_empty()).then_some(s)
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_a_bijection() {
        let t = byte_level_chars();
        let mut seen = std::collections::HashSet::new();
        for c in t {
            assert!(c != '\0');
            assert!(seen.insert(c));
        }
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
    }

    #[test]
    fn pre_tokenizer_splits_like_qwen2() {
        let re = fancy_regex::Regex::new(QWEN2_PRE_REGEX).unwrap();
        let words: Vec<&str> = re
            .find_iter("Hello'Ve world 123\n\n  foo")
            .map(|m| m.unwrap().as_str())
            .collect();
        assert_eq!(
            words,
            ["Hello", "'Ve", " world", " ", "1", "2", "3", "\n\n", " ", " foo"]
        );
    }

    #[test]
    fn role_parses_and_rejects() {
        assert_eq!("assistant".parse::<Role>().unwrap(), Role::Assistant);
        assert!("admin".parse::<Role>().is_err());
    }
}
