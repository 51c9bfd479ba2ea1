//! The tokenizer, built from GGUF metadata alone (no `tokenizer.json`), written
//! to reproduce llama.cpp's `llama_tokenize` id for id:
//!
//! 1. **Special-token partition** ([`special`]). Control tokens
//!    (`<|im_start|>`, …, GGUF token type 3) are cut out of the text only when
//!    the caller asks for it (`parse_special`); user-defined tokens (type 4,
//!    e.g. `<tool_call>`) are always cut out, as llama.cpp and Hugging Face do.
//!    Longest token first.
//! 2. **The vocabulary's model** on each remaining fragment:
//!    - `gpt2`: byte-level BPE ([`bpe`]) after the pre-tokenizer that
//!      `tokenizer.ggml.pre` names ([`pre`]);
//!    - `llama`: SentencePiece ([`spm`]), spaces as `▁`, byte fallback.
//! 3. **BOS/EOS** ([`special`]): added by [`Tokenizer::encode_prompt`] as the
//!    metadata says (`add_bos_token`, with llama.cpp's defaults), never by
//!    [`Tokenizer::encode`].
//!
//! Chat goes through the GGUF's own Jinja template ([`chat`]); the verifier
//! and draft agree on a vocabulary through [`Tokenizer::fingerprint`] and
//! [`Tokenizer::check_pair`] ([`pair`]). The types ([`Tokenizer`],
//! [`TokenizerModel`]) are in `types`, a leaf that `pair` and `stream` use:
//! no file under `tokenizer/` uses this one.
//!
//! No Unicode normalisation is applied (llama.cpp applies none either).
//! Decoding concatenates the bytes of each token (byte-level BPE tokens their
//! bytes, SentencePiece tokens their text with `▁` as a space, `<0xXX>` its
//! byte) and converts them to UTF-8 (invalid sequences become U+FFFD, as in
//! `String::from_utf8_lossy`). llama.cpp's detokenizer options that lose text
//! (removing the space-prefix space, `clean_up_tokenization_spaces`) are not
//! applied: `decode` is the concatenation of token pieces, what a stream of
//! generated tokens shows. [`StreamDecoder`] does the same incrementally and
//! never splits a character.

mod bpe;
mod chat;
mod pair;
mod pre;
mod special;
mod spm;
mod stream;
mod types;
mod vocab;

pub use chat::{ChatMessage, Role, ToolCall, QWEN2_CHAT_TEMPLATE};
pub use pair::PairError;
pub use pre::{supported_names as supported_pre_tokenizers, PreType};
pub use special::FimTokens;
pub use stream::StreamDecoder;
pub use types::{Tokenizer, TokenizerModel};
pub use vocab::TokenKind;

// The tiny test models' byte-level vocabulary (`crate::testing`).
#[cfg(feature = "testing")]
pub(crate) use bpe::byte_level_chars;

use crate::gguf::GgufFile;
use crate::{ModelError, Result};
use bpe::Bpe;
use chat::ChatTemplate;
use rayon::prelude::*;
use special::{Fragment, Specials};
use spm::Spm;
use std::sync::Arc;
use types::{Algo, Inner};
use vocab::{err, meta_str, string_array, FxMap};

impl Tokenizer {
    /// Build the tokenizer from a GGUF's `tokenizer.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let model_name = meta_str(gguf, "tokenizer.ggml.model")?
            .ok_or_else(|| ModelError::MissingMetadata("tokenizer.ggml.model".into()))?;
        let model = match model_name {
            "gpt2" => TokenizerModel::Gpt2,
            "llama" => TokenizerModel::Llama,
            other => {
                return Err(err(format!(
                    "unsupported tokenizer model `{other}` (supported: gpt2 byte-level BPE, \
                     llama SentencePiece)"
                )))
            }
        };
        let pre_name = meta_str(gguf, "tokenizer.ggml.pre")?;
        // llama.cpp gives pre-tokenizers to BPE vocabularies only.
        let pre = match model {
            TokenizerModel::Gpt2 => Some(PreType::from_name(pre_name)?),
            TokenizerModel::Llama => None,
        };

        let token_texts = string_array(gguf, "tokenizer.ggml.tokens")?;
        let n = token_texts.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(err(format!("vocabulary of {n} tokens")));
        }
        let mut kinds = vocab::token_kinds(gguf, n)?;

        let (tokens, token_to_id) = rayon::join(
            || {
                token_texts
                    .par_iter()
                    .map(|t| t.to_string())
                    .collect::<Vec<String>>()
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

        let defaults = match model {
            TokenizerModel::Gpt2 => special::Defaults {
                bos: Some(11),
                eos: Some(11),
                unk: None,
                add_bos: pre.is_some_and(PreType::add_bos_default),
            },
            TokenizerModel::Llama => special::Defaults {
                bos: Some(1),
                eos: Some(2),
                unk: Some(0),
                add_bos: true,
            },
        };
        let ids = Specials::from_gguf(gguf, defaults, &tokens, &mut kinds, &token_to_id)?;

        let real_vocab_size = vocab::real_vocab_size(&tokens, &kinds);
        // Every id the model can produce must decode, and every id the
        // tokenizer produces must have an embedding row: as llama.cpp, the
        // embedding has exactly one row per token (padding slots included;
        // pairing across padding compares real_vocab_size, not rows).
        if let Some(embd) = gguf.tensors.get("token_embd.weight") {
            let rows = embd.dims.get(1).copied().unwrap_or(1);
            if rows != n {
                return Err(err(format!(
                    "`tokenizer.ggml.tokens` has {n} tokens but `token_embd.weight` has {rows} rows"
                )));
            }
        }

        // The algorithm's tables (merges resolved in parallel) and the decoded
        // bytes of every token are independent: build them side by side.
        let (built, pieces) = rayon::join(
            || -> Result<(Algo, Vec<&str>, bool)> {
                Ok(match model {
                    TokenizerModel::Gpt2 => {
                        let pre = pre.unwrap_or(PreType::Default);
                        let (bpe, merges) = Bpe::from_gguf(gguf, pre, &token_to_id)?;
                        (Algo::Bpe(bpe), merges, false)
                    }
                    TokenizerModel::Llama => {
                        let scores = vocab::scores(gguf, n)?;
                        let space = vocab::meta_bool(gguf, "tokenizer.ggml.add_space_prefix")?
                            .unwrap_or(true);
                        let spm = Spm::new(&tokens, &kinds, scores, &token_to_id, ids.unk);
                        (Algo::Spm(spm), Vec::new(), space)
                    }
                })
            },
            || -> Vec<Vec<u8>> {
                let table = bpe::char_to_byte_table();
                tokens
                    .par_iter()
                    .zip(kinds.par_iter())
                    .map(|(text, &kind)| match model {
                        TokenizerModel::Llama => spm::piece_bytes(text, kind),
                        TokenizerModel::Gpt2 => match kind {
                            TokenKind::Normal | TokenKind::Byte => vocab::byte_token_value(text)
                                .filter(|_| kind == TokenKind::Byte)
                                .map(|b| vec![b])
                                .or_else(|| bpe::byte_level_decode(text, &table))
                                // llama.cpp marks such bytes; keep the text itself.
                                .unwrap_or_else(|| text.as_bytes().to_vec()),
                            TokenKind::Unused => Vec::new(),
                            _ => text.as_bytes().to_vec(),
                        },
                    })
                    .collect()
            },
        );
        let (algo, merge_texts, add_space_prefix) = built?;

        let specials = special::special_ids(&tokens, &kinds);
        let fingerprint = pair::fingerprint(
            model,
            pre_name.unwrap_or("default"),
            &tokens[..real_vocab_size],
            &kinds[..real_vocab_size],
            &merge_texts,
            &ids,
            add_space_prefix,
        );

        let chat = match meta_str(gguf, "tokenizer.chat_template")? {
            Some(src) => Some(Arc::new(ChatTemplate::new(src)?)),
            None => None,
        };

        Ok(Self {
            inner: Arc::new(Inner {
                model,
                pre_name: pre_name.map(str::to_string),
                tokens,
                pieces,
                kinds,
                token_to_id,
                algo,
                specials,
                ids,
                add_space_prefix,
                real_vocab_size,
                fingerprint,
            }),
            chat,
        })
    }

    /// The same tokenizer with an operator-given Jinja chat template instead
    /// of the GGUF's (or for a GGUF without one).
    pub fn with_chat_template(&self, template: &str) -> Result<Self> {
        Ok(Self {
            inner: self.inner.clone(),
            chat: Some(Arc::new(ChatTemplate::new(template)?)),
        })
    }

    /// The Jinja chat template in use, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat.as_deref().map(ChatTemplate::source)
    }

    /// Ids below this are real tokens; the rest are trailing padding slots
    /// (`[PAD…]`, unused) that differ between sizes of a family.
    pub fn real_vocab_size(&self) -> usize {
        self.inner.real_vocab_size
    }

    /// `tokenizer.ggml.model`.
    pub fn model(&self) -> TokenizerModel {
        self.inner.model
    }

    /// SentencePiece's `add_space_prefix`: a space is put before text that
    /// starts the input or follows a special token (so `decode(encode(s))`
    /// is `" " + s` for plain text). Always false for BPE.
    pub fn add_space_prefix(&self) -> bool {
        self.inner.add_space_prefix
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

    /// The token type of `id` (GGUF's, with llama.cpp's corrections: tokens
    /// it recognises as end of turn are control tokens).
    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.inner.kinds.get(id as usize).copied()
    }

    /// Beginning of sequence (`tokenizer.ggml.bos_token_id`, or llama.cpp's
    /// default for the vocabulary type).
    pub fn bos_id(&self) -> Option<u32> {
        self.inner.ids.bos
    }
    /// Whether a prompt starts with BOS (`tokenizer.ggml.add_bos_token`, or
    /// llama.cpp's default: SentencePiece and Llama 3 yes, other BPE no).
    pub fn add_bos(&self) -> bool {
        self.inner.ids.add_bos
    }
    /// End of sequence (`tokenizer.ggml.eos_token_id` or the default).
    pub fn eos_id(&self) -> Option<u32> {
        self.inner.ids.eos
    }
    /// End of turn (`tokenizer.ggml.eot_token_id`, else found by text as
    /// llama.cpp does: `<|im_end|>`, `<end_of_turn>`, `<|eot_id|>`, …).
    pub fn eot_id(&self) -> Option<u32> {
        self.inner.ids.eot
    }
    /// End of message with a tool call (`<|eom_id|>`, Llama 3.1).
    pub fn eom_id(&self) -> Option<u32> {
        self.inner.ids.eom
    }
    /// `tokenizer.ggml.padding_token_id`.
    pub fn padding_id(&self) -> Option<u32> {
        self.inner.ids.pad
    }

    /// Whether generation stops at `id`: llama.cpp's end-of-generation set
    /// (EOS, EOT, EOM, the tokens whose text ends a turn such as
    /// `<|im_end|>`, `<|endoftext|>`, `<end_of_turn>`, and FIM pad / repo /
    /// file-separator tokens).
    pub fn is_eog(&self, id: u32) -> bool {
        self.inner.ids.eog.binary_search(&id).is_ok()
    }

    /// The fill-in-the-middle tokens ([`FimTokens`]).
    pub fn fim_tokens(&self) -> FimTokens {
        self.inner.ids.fim
    }

    /// The fill-in-the-middle prompt of the model's prefix-suffix-middle
    /// format, `[BOS] <fim_pre> prefix <fim_suf> suffix <fim_mid>` (Qwen2.5-
    /// Coder: `<|fim_prefix|>…<|fim_suffix|>…<|fim_middle|>`); the model
    /// writes the middle. The texts are never parsed for control tokens. An
    /// error names the tokens the model lacks ([`FimTokens::missing`]).
    pub fn encode_fim(&self, prefix: &str, suffix: &str) -> Result<Vec<u32>> {
        let (pre, suf, mid) = self.fim_core()?;
        let mut out = self.bos_if_added();
        out.push(pre);
        self.encode_into(prefix, false, &[], &mut out)?;
        out.push(suf);
        self.encode_into(suffix, false, &[], &mut out)?;
        out.push(mid);
        Ok(out)
    }

    /// llama.cpp server's `/infill` prompt (`format_infill`, repo-level
    /// layout): `<fim_rep>myproject\n` when the model has a repo token, then
    /// per `extra` file (`(filename, text)`) `<fim_sep>filename\n` + text
    /// (or `\n\n--- snippet ---\n\n` + text without a file separator),
    /// `<fim_sep>filename\n` for the current file, then
    /// `[BOS] <fim_pre> prefix prompt <fim_suf> suffix <fim_mid>`. Nothing is
    /// cut to fit (llama.cpp trims the prefix to 3/4 of a batch): a prompt
    /// over the context is refused by the runtime instead.
    pub fn encode_infill(
        &self,
        prefix: &str,
        suffix: &str,
        prompt: &str,
        extra: &[(String, String)],
    ) -> Result<Vec<u32>> {
        let (pre, suf, mid) = self.fim_core()?;
        let fim = self.inner.ids.fim;
        let mut out = Vec::new();
        if let Some(rep) = fim.rep {
            out.push(rep);
            self.encode_into("myproject\n", false, &[], &mut out)?;
        }
        for (filename, text) in extra {
            match fim.sep {
                Some(sep) => {
                    out.push(sep);
                    self.encode_into(&format!("{filename}\n"), false, &[], &mut out)?;
                }
                None => self.encode_into("\n\n--- snippet ---\n\n", false, &[], &mut out)?,
            }
            self.encode_into(text, false, &[], &mut out)?;
        }
        if let Some(sep) = fim.sep {
            out.push(sep);
            self.encode_into("filename\n", false, &[], &mut out)?;
        }
        out.extend(self.bos_if_added());
        out.push(pre);
        self.encode_into(prefix, false, &[], &mut out)?;
        self.encode_into(prompt, false, &[], &mut out)?;
        out.push(suf);
        self.encode_into(suffix, false, &[], &mut out)?;
        out.push(mid);
        Ok(out)
    }

    /// The prefix, suffix and middle tokens, or the error naming those
    /// missing.
    fn fim_core(&self) -> Result<(u32, u32, u32)> {
        let f = self.inner.ids.fim;
        match (f.pre, f.suf, f.mid) {
            (Some(p), Some(s), Some(m)) => Ok((p, s, m)),
            _ => Err(ModelError::InvalidArgument(format!(
                "this model has no fill-in-the-middle tokens ({} missing: neither \
                 tokenizer.ggml.fim_*_token_id metadata nor tokens such as <|fim_prefix|>)",
                f.missing().join(", ")
            ))),
        }
    }

    /// `[BOS]` when the model adds one, else nothing.
    fn bos_if_added(&self) -> Vec<u32> {
        match (self.add_bos(), self.bos_id()) {
            (true, Some(bos)) => vec![bos],
            _ => Vec::new(),
        }
    }

    /// The model's own stop set: every end-of-generation id, ascending.
    pub fn chat_stop_tokens(&self) -> Vec<u32> {
        self.inner.ids.eog.clone()
    }

    /// sha256 (hex) over tokenizer model, pre-tokenizer, the shared
    /// vocabulary (trailing padding slots excluded), token types, merges,
    /// special ids and flags. Two sides may exchange token ids only if these
    /// agree; two sizes of one family that differ only by padding agree.
    pub fn fingerprint(&self) -> String {
        self.inner.fingerprint.clone()
    }

    /// Whether `other` (e.g. the target of this draft) can exchange token ids
    /// with this tokenizer, and why not.
    pub fn check_pair(&self, other: &Tokenizer) -> std::result::Result<(), PairError> {
        pair::check(self, other)
    }

    /// Encode text. With `parse_special`, control-token texts such as
    /// `<|im_start|>` become their ids; without, they are tokenized as plain
    /// text (use `false` for anything a user wrote). No BOS is added.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        self.encode_into(text, parse_special, &[], &mut out)?;
        Ok(out)
    }

    /// What a raw prompt becomes for generation: BOS first when the model
    /// adds one ([`Tokenizer::add_bos`]), then the text, never parsed for
    /// control tokens (llama.cpp's `tokenize(text, add_special = true,
    /// parse_special = false)`). EOS is appended when `add_eos_token` says so.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 4);
        if let (true, Some(bos)) = (self.add_bos(), self.bos_id()) {
            out.push(bos);
        }
        self.encode_into(text, false, &[], &mut out)?;
        if let (true, Some(eos)) = (self.inner.ids.add_eos, self.eos_id()) {
            out.push(eos);
        }
        Ok(out)
    }

    fn encode_into(
        &self,
        text: &str,
        parse_special: bool,
        protected: &[(usize, usize)],
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let inner = &*self.inner;
        let frags = special::partition(
            text,
            parse_special,
            protected,
            &inner.specials,
            &inner.tokens,
            &inner.kinds,
        );
        // SentencePiece: a space goes in front of text that starts the input
        // or follows a special token (llama.cpp's `is_prev_special`).
        let mut prev_special = true;
        let mut buf = String::new();
        for f in frags {
            match f {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(s, e) => {
                    let t = &text[s..e];
                    match &inner.algo {
                        Algo::Bpe(bpe) => bpe.encode(t, &inner.token_to_id, out)?,
                        Algo::Spm(spm) => {
                            buf.clear();
                            if inner.add_space_prefix && prev_special {
                                buf.push(spm::SPACE);
                            }
                            buf.extend(t.chars().map(|c| if c == ' ' { spm::SPACE } else { c }));
                            spm.encode(&buf, &inner.token_to_id, out)?;
                        }
                    }
                    prev_special = false;
                }
            }
        }
        Ok(())
    }

    /// The bytes of `ids`, or an error for an id outside the vocabulary.
    fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            bytes.extend_from_slice(self.piece_for_decode(id, skip_special)?);
        }
        Ok(bytes)
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

    fn template(&self) -> Result<&ChatTemplate> {
        self.chat.as_deref().ok_or(ModelError::NoChatTemplate)
    }

    fn token_text(&self, id: Option<u32>) -> &str {
        id.and_then(|i| self.id_to_token(i)).unwrap_or("")
    }

    fn render(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<chat::Rendered> {
        let inner = &*self.inner;
        let has_special = |content: &str| {
            inner.specials.iter().any(|&id| {
                inner.kinds[id as usize] != TokenKind::UserDefined
                    && content.contains(inner.tokens[id as usize].as_str())
            })
        };
        self.template()?.render(
            messages,
            tools,
            add_generation_prompt,
            self.token_text(inner.ids.bos),
            self.token_text(inner.ids.eos),
            has_special,
        )
    }

    /// Render a conversation with the model's chat template (the GGUF's
    /// `tokenizer.chat_template`, or the one given by
    /// [`Tokenizer::with_chat_template`]). Errors with
    /// [`ModelError::NoChatTemplate`] when there is none.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`Tokenizer::apply_chat_template`] with `tools` (OpenAI / Hugging
    /// Face tool objects, `{"type": "function", "function": {…}}`) given to
    /// the template as `tools` (absent when empty).
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        Ok(self.render(messages, tools, add_generation_prompt)?.text)
    }

    /// Whether the chat template reads `tools` at all: without, tools given
    /// to it would be dropped silently (callers refuse them instead).
    pub fn chat_template_renders_tools(&self) -> bool {
        self.chat
            .as_deref()
            .is_some_and(ChatTemplate::renders_tools)
    }

    /// Tokenize a conversation: the template's control tokens become their
    /// ids, while message contents are always plain text, so a message that
    /// contains `<|im_end|>` cannot end its turn early (see [`chat`]). For
    /// contents free of control-token text this equals
    /// `encode(&apply_chat_template(..), true)`, with BOS put first when the
    /// model adds one and the template did not write it (never twice).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.encode_chat_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`Tokenizer::encode_chat`] with `tools` (see
    /// [`Tokenizer::apply_chat_template_with_tools`]). The free text of the
    /// tools and of the messages' tool-call arguments is plain text like the
    /// contents; keys, names, types and ids holding special-token text are
    /// refused ([`ModelError::ChatTemplate`]).
    pub fn encode_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let r = self.render(messages, tools, add_generation_prompt)?;
        let mut out = Vec::with_capacity(r.text.len() / 3 + 4);
        if let (true, Some(bos)) = (self.add_bos(), self.bos_id()) {
            let bos_text = self.token_text(Some(bos));
            if bos_text.is_empty() || !r.text.starts_with(bos_text) {
                out.push(bos);
            }
        }
        self.encode_into(&r.text, true, &r.contents, &mut out)?;
        Ok(out)
    }

    /// A streaming decoder over this tokenizer.
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder {
        StreamDecoder::new(self, skip_special)
    }
}
