//! `tandem-grammar`: what a request may constrain its output to (a JSON object,
//! a JSON schema, a Lark grammar, a regex) as token masks over a Tandem
//! tokenizer, computed by `llguidance` (the engine llama.cpp, vLLM and SGLang
//! embed). The device masks its proposals and the verifier masks the target's
//! choice with the same masks, so greedy output under a grammar is the target's
//! own greedy output under that grammar (issue 30 item 2; docs/api.md
//! "Structured output").
//!
//! The contract:
//!
//! 1. **What is asked.** A [`GrammarSpec`] has a wire form, a kind and a text
//!    ([`GrammarSpec::to_wire`], [`GrammarSpec::from_wire`]), that a session's
//!    Open carries. Texts over [`MAX_GRAMMAR_BYTES`] are refused
//!    ([`GrammarError::TooLarge`]); so is a grammar llguidance cannot compile
//!    ([`GrammarError::Invalid`], with its message). Compiling is the check: a
//!    refused grammar has changed nothing.
//! 2. **One vocabulary per tokenizer.** [`GrammarVocab`] is built once from a
//!    tokenizer's *shared* vocabulary (its padding rows excluded, as the
//!    tokenizer fingerprint excludes them): a draft and a target that pair
//!    build the same vocabulary. Control tokens are special: no grammar emits
//!    them as text. Building it for a 151k-token vocabulary takes tens of
//!    milliseconds: keep it beside the tokenizer.
//! 3. **Deterministic masks.** A [`Constraint`] is one generation's grammar
//!    state. The same spec, vocabulary and accepted tokens give the same mask
//!    on every machine: llguidance's limits are the fixed constants of
//!    [`limits`] (its "fuel" counts operations, not time), and nothing here
//!    depends on threads or the clock.
//! 4. **Stops.** The model's end-of-generation ids ([`Tokenizer::chat_stop_tokens`])
//!    are allowed exactly when the grammar accepts what was generated; accepting
//!    one completes the constraint, after which only they are allowed (and
//!    change nothing).
//! 5. **Rollback.** [`Constraint::rollback`] takes back the last accepted
//!    tokens, so a speculative round can test a block and keep only what was
//!    accepted.
//! 6. **Refusals.** Accepting a token the mask does not allow is
//!    [`GrammarError::Refused`]: the caller masked wrongly (never a user's
//!    doing), and the constraint is unchanged.
//! 7. **Following a context.** A [`Guide`] is a constraint that knows where
//!    the output starts and which tokens it holds: [`Guide::sync`] brings it
//!    to any context (rolling back to the common prefix, accepting the
//!    rest), or refuses and leaves it as it was. The generation core's
//!    draft and local target use it through `tandem_model::engine`'s
//!    `OutputConstraint` ([`Grammar`] is the `OutputGrammar` a
//!    `GenerateConfig` carries); the verifier's sessions hold one, so a
//!    `Resume` to another context is followed too.
//! 8. **Lazy grammars.** A [`GrammarSpec::Lazy`] leaves the output free
//!    until one of its trigger words appears in the output's text (as
//!    llama.cpp's lazy grammars do: serve-edge's `tool_choice: "auto"`
//!    triggers on `<tool_call>`). Until then nothing is masked (the output
//!    is the unconstrained one, and no mask is computed); the token that
//!    completes a trigger word activates the grammar, which then holds the
//!    output's text from the word's first byte to that token's end (fed to
//!    it byte by byte) and masks every token after. An occurrence whose
//!    text the grammar refuses (the completing token carried more text
//!    than the grammar allows) does not activate it. Activation depends on
//!    the output's tokens only, so device and verifier agree; a rollback
//!    to before the activating token makes the output free again.

use std::sync::Arc;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use tandem_model::tokenizer::{TokenKind, Tokenizer};
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// The largest grammar text accepted (bytes), whatever its kind: a JSON
/// schema of a few hundred properties fits; a grammar that would take the
/// verifier's memory or time does not.
pub const MAX_GRAMMAR_BYTES: usize = 64 * 1024;

/// Why a grammar or a token was refused.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("grammar of {bytes} bytes is larger than the {max}-byte limit")]
    TooLarge { bytes: usize, max: usize },
    #[error("unknown grammar kind {0:?} (json_object, json_schema, lark, regex, lazy)")]
    UnknownKind(String),
    #[error("invalid grammar: {0}")]
    Invalid(String),
    #[error("token {token} is not allowed by the grammar here")]
    Refused { token: u32 },
    #[error("output token {index} (id {token}) is not allowed by the grammar")]
    RefusedAt { index: usize, token: u32 },
    #[error("grammar engine: {0}")]
    Engine(String),
}

pub type Result<T> = std::result::Result<T, GrammarError>;

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid against this JSON schema (`"json_schema"`).
    JsonSchema(serde_json::Value),
    /// A Lark grammar (llguidance's dialect; a documented extension).
    Lark(String),
    /// A regular expression the whole output matches (an extension).
    Regex(String),
    /// Free output until a trigger word appears; from that word on, the
    /// Lark grammar `lark` (whose text starts with the word). Contract 8.
    Lazy {
        triggers: Vec<Trigger>,
        lark: String,
    },
}

/// Where a lazy grammar ([`GrammarSpec::Lazy`]) starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trigger {
    /// The text that starts the constrained part (non-empty, at most
    /// [`MAX_TRIGGER_BYTES`]).
    pub word: String,
    /// Only at the start of the output, after any leading ASCII whitespace;
    /// otherwise anywhere in it.
    pub at_start: bool,
}

/// Most triggers one lazy grammar may have (serve-edge's: one per
/// declared tool, at most 128, and one more).
pub const MAX_TRIGGERS: usize = 256;

/// The longest trigger word (bytes).
pub const MAX_TRIGGER_BYTES: usize = 128;

impl GrammarSpec {
    /// The wire form: (kind, text).
    pub fn to_wire(&self) -> (&'static str, String) {
        match self {
            Self::JsonObject => ("json_object", String::new()),
            Self::JsonSchema(s) => ("json_schema", s.to_string()),
            Self::Lark(g) => ("lark", g.clone()),
            Self::Regex(r) => ("regex", r.clone()),
            Self::Lazy { triggers, lark } => {
                let triggers: Vec<serde_json::Value> = triggers
                    .iter()
                    .map(|t| serde_json::json!({"word": t.word, "at_start": t.at_start}))
                    .collect();
                let text = serde_json::json!({"triggers": triggers, "lark": lark});
                ("lazy", text.to_string())
            }
        }
    }

    /// The wire text of a lazy grammar: `{"triggers": [{"word", "at_start"}],
    /// "lark"}`, each field checked.
    fn lazy_from_wire(text: &str) -> Result<Self> {
        let bad = |m: &str| GrammarError::Invalid(format!("lazy grammar: {m}"));
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| GrammarError::Invalid(format!("lazy grammar: not JSON: {e}")))?;
        let lark = v
            .get("lark")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| bad("`lark` must be a string"))?;
        let list = v
            .get("triggers")
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| bad("`triggers` must be an array"))?;
        if list.is_empty() || list.len() > MAX_TRIGGERS {
            return Err(bad(&format!("1 to {MAX_TRIGGERS} triggers")));
        }
        let mut triggers = Vec::with_capacity(list.len());
        for t in list {
            let word = t
                .get("word")
                .and_then(serde_json::Value::as_str)
                .filter(|w| !w.is_empty() && w.len() <= MAX_TRIGGER_BYTES)
                .ok_or_else(|| {
                    bad(&format!(
                        "a trigger's `word` must be a string of 1 to {MAX_TRIGGER_BYTES} bytes"
                    ))
                })?;
            let at_start = match t.get("at_start") {
                None | Some(serde_json::Value::Null) => false,
                Some(serde_json::Value::Bool(b)) => *b,
                Some(_) => return Err(bad("a trigger's `at_start` must be a boolean")),
            };
            triggers.push(Trigger {
                word: word.to_string(),
                at_start,
            });
        }
        Ok(Self::Lazy {
            triggers,
            lark: lark.to_string(),
        })
    }

    /// Parses the wire form; the size limit and JSON syntax are checked here,
    /// the grammar itself when it is compiled ([`Constraint::new`]).
    pub fn from_wire(kind: &str, text: &str) -> Result<Self> {
        if text.len() > MAX_GRAMMAR_BYTES {
            return Err(GrammarError::TooLarge {
                bytes: text.len(),
                max: MAX_GRAMMAR_BYTES,
            });
        }
        match kind {
            "json_object" => Ok(Self::JsonObject),
            "json_schema" => serde_json::from_str(text)
                .map(Self::JsonSchema)
                .map_err(|e| GrammarError::Invalid(format!("the JSON schema is not JSON: {e}"))),
            "lark" => Ok(Self::Lark(text.to_string())),
            "regex" => Ok(Self::Regex(text.to_string())),
            "lazy" => Self::lazy_from_wire(text),
            other => Err(GrammarError::UnknownKind(other.to_string())),
        }
    }

    fn top_level(&self) -> TopLevelGrammar {
        match self {
            Self::JsonObject => TopLevelGrammar::from_json_schema(json_options(
                serde_json::json!({"type": "object"}),
            )),
            Self::JsonSchema(s) => TopLevelGrammar::from_json_schema(json_options(s.clone())),
            Self::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Self::Regex(r) => TopLevelGrammar::from_regex(r),
            // What applies from a trigger on.
            Self::Lazy { lark, .. } => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

/// Why a `response_format` was refused ([`GrammarSpec::from_response_format`]).
#[derive(Debug, Clone, PartialEq)]
pub struct FormatError {
    /// The field, as a path under the request (`response_format.type`).
    pub param: String,
    pub message: String,
    /// A value known but not implemented (an unknown `type`), rather than a
    /// malformed one.
    pub unsupported: bool,
}

impl std::fmt::Display for FormatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.param, self.message)
    }
}

fn format_error(param: &str, expected: &str) -> FormatError {
    FormatError {
        param: param.into(),
        message: format!("`{param}` must be {expected}"),
        unsupported: false,
    }
}

impl GrammarSpec {
    /// An OpenAI `response_format` object: `{"type": "text"}` (none),
    /// `{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
    /// {"name", "schema", "strict"?, "description"?}}`, or Tandem's extension
    /// `{"type": "grammar", "syntax": "lark" | "regex", "definition": "…"}`
    /// (the shape of OpenAI's grammar custom tools). The output always
    /// follows the format: `strict: false` constrains as `true` does. What
    /// serve-edge, the C ABI and JNI accept alike (docs/api.md).
    pub fn from_response_format(
        v: &serde_json::Value,
    ) -> std::result::Result<Option<Self>, FormatError> {
        use serde_json::Value;
        const P: &str = "response_format";
        let Some(f) = v.as_object() else {
            return Err(format_error(P, "an object {\"type\": …}"));
        };
        match f.get("type").and_then(Value::as_str) {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(Self::JsonObject)),
            Some("json_schema") => {
                const J: &str = "response_format.json_schema";
                let Some(js) = f.get("json_schema").and_then(Value::as_object) else {
                    return Err(format_error(
                        J,
                        "an object {\"name\", \"schema\", \"strict\"}",
                    ));
                };
                match js.get("name") {
                    Some(Value::String(n)) if !n.is_empty() && n.len() <= 64 => {}
                    _ => {
                        return Err(format_error(
                            "response_format.json_schema.name",
                            "a string of 1 to 64 characters",
                        ))
                    }
                }
                if !matches!(js.get("strict"), None | Some(Value::Null | Value::Bool(_))) {
                    return Err(format_error(
                        "response_format.json_schema.strict",
                        "a boolean",
                    ));
                }
                if !matches!(
                    js.get("description"),
                    None | Some(Value::Null | Value::String(_))
                ) {
                    return Err(format_error(
                        "response_format.json_schema.description",
                        "a string",
                    ));
                }
                match js.get("schema") {
                    // No schema: any JSON object.
                    None | Some(Value::Null) => Ok(Some(Self::JsonObject)),
                    Some(s @ Value::Object(_)) => Ok(Some(Self::JsonSchema(s.clone()))),
                    Some(_) => Err(format_error(
                        "response_format.json_schema.schema",
                        "a JSON schema object",
                    )),
                }
            }
            Some("grammar") => {
                let Some(definition) = f.get("definition").and_then(Value::as_str) else {
                    return Err(format_error("response_format.definition", "a string"));
                };
                match f.get("syntax").and_then(Value::as_str) {
                    Some("lark") => Ok(Some(Self::Lark(definition.into()))),
                    Some("regex") => Ok(Some(Self::Regex(definition.into()))),
                    _ => Err(format_error(
                        "response_format.syntax",
                        "\"lark\" or \"regex\"",
                    )),
                }
            }
            Some(other) => Err(FormatError {
                param: "response_format.type".into(),
                message: format!(
                    "the response_format type `{other}` (text, json_object, json_schema, grammar)"
                ),
                unsupported: true,
            }),
            None => Err(format_error(
                "response_format.type",
                "\"text\", \"json_object\", \"json_schema\" or \"grammar\"",
            )),
        }
    }
}

/// The whitespace JSON output may have between two tokens of JSON, as
/// llama.cpp's JSON grammars allow: one space, or a line break and an
/// indentation of at most 20 spaces or tabs. llguidance's default (any run
/// of whitespace) lets a model write whitespace until `max_tokens`, which
/// small models do.
pub const JSON_WHITESPACE: &str = r"(?:\x20|\x0A[\x20\x09]{0,20})";

/// A JSON schema with Tandem's compile options ([`JSON_WHITESPACE`]),
/// unless it sets llguidance's own (`x-guidance`). Applied to every JSON
/// schema a spec compiles; a Lark grammar's `%json {…}` gets it from
/// whoever writes it.
pub fn json_options(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        if !o.contains_key("x-guidance") {
            o.insert(
                "x-guidance".into(),
                serde_json::json!({"whitespace_pattern": JSON_WHITESPACE}),
            );
        }
    }
    schema
}

/// llguidance's limits, fixed here so that both sides compute the same masks
/// (a limit hit is an error at the same token on every machine). Its defaults,
/// except that grammars are smaller ([`MAX_GRAMMAR_BYTES`]).
pub fn limits() -> ParserLimits {
    ParserLimits {
        max_grammar_size: 100_000,
        ..ParserLimits::default()
    }
}

/// A tokenizer's vocabulary as llguidance sees it (contract 2). Cheap to
/// clone.
#[derive(Clone)]
pub struct GrammarVocab {
    factory: Arc<ParserFactory>,
    /// The model's end-of-generation ids.
    stops: Arc<[u32]>,
    /// The id llguidance treats as end of sequence (the first stop).
    eos: u32,
    /// Ids below this are the shared vocabulary; the rest are never allowed.
    vocab: usize,
    /// Each id's text as a lazy grammar's triggers are looked for in it: a
    /// text token's bytes, a special token's own text.
    texts: Arc<[Box<[u8]>]>,
    /// A token of each single byte (text tokens only), to feed a lazy
    /// grammar the text of a trigger byte by byte.
    byte_tokens: Arc<[Option<u32>]>,
}

impl std::fmt::Debug for GrammarVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarVocab")
            .field("vocab", &self.vocab)
            .field("stops", &self.stops)
            .finish()
    }
}

/// Tandem's tokenizer behind llguidance's `TokenizerEnv`.
struct Env {
    trie: TokTrie,
    tok: Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Text as the model would tokenize it (llguidance uses this for forced
    /// text); bytes that are not UTF-8, greedily over the trie.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tok
                .encode(text, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

impl GrammarVocab {
    /// Builds the vocabulary of `tok` (contract 2).
    pub fn new(tok: &Tokenizer) -> Result<Self> {
        let vocab = tok.real_vocab_size();
        let stops: Arc<[u32]> = tok.chat_stop_tokens().into();
        let eos = stops
            .first()
            .copied()
            .or_else(|| tok.eos_id())
            .ok_or_else(|| {
                GrammarError::Engine("the tokenizer names no end-of-generation token".into())
            })?;
        let mut texts: Vec<Box<[u8]>> = Vec::with_capacity(vocab);
        let words: Vec<Vec<u8>> = (0..vocab)
            .map(|i| {
                let id = u32::try_from(i).unwrap_or(u32::MAX);
                let special = || {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tok.id_to_token(id).unwrap_or("").as_bytes());
                    w
                };
                let piece = match tok.token_kind(id) {
                    Some(TokenKind::Normal | TokenKind::Byte | TokenKind::UserDefined) => {
                        tok.id_to_piece(id).filter(|p| !p.is_empty())
                    }
                    _ => None,
                };
                match piece {
                    Some(p) => {
                        texts.push(p.into());
                        p.to_vec()
                    }
                    None => {
                        let w = special();
                        texts.push(w[1..].into());
                        w
                    }
                }
            })
            .collect();
        let mut byte_tokens = vec![None; 256];
        for (i, w) in texts.iter().enumerate() {
            if let ([b], [_]) = (&w[..], words[i].as_slice()) {
                let slot = &mut byte_tokens[usize::from(*b)];
                if slot.is_none() {
                    *slot = u32::try_from(i).ok();
                }
            }
        }
        let n = u32::try_from(vocab)
            .map_err(|_| GrammarError::Engine(format!("vocabulary of {vocab} tokens")))?;
        let trie = TokTrie::from(&TokRxInfo::new(n, eos), &words);
        let env: TokEnv = Arc::new(Env {
            trie,
            tok: tok.clone(),
        });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Engine(e.to_string()))?;
        // Nothing on stderr: a terminal user's streamed text is there.
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(Self {
            factory: Arc::new(factory),
            stops,
            eos,
            vocab,
            texts: texts.into(),
            byte_tokens: byte_tokens.into(),
        })
    }

    /// The shared vocabulary's size (masks cover these ids).
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }
}

/// One generation's grammar state (contract 3–6).
pub struct Constraint {
    matcher: Matcher,
    vocab: GrammarVocab,
    /// Tokens accepted so far (for rollback bookkeeping and errors).
    accepted: usize,
    /// Stops accepted after the first one (the engine saw only the first).
    stops_after_complete: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("accepted", &self.accepted)
            .finish()
    }
}

/// The ids allowed at one position.
#[derive(Clone, Debug)]
pub struct TokenMask {
    allowed: SimpleVob,
    vocab: usize,
}

impl TokenMask {
    pub fn allows(&self, t: u32) -> bool {
        (t as usize) < self.vocab && self.allowed.is_allowed(t)
    }

    /// How many ids are allowed.
    pub fn count(&self) -> usize {
        self.allowed.num_set()
    }

    /// Sets every logit the mask does not allow to −∞ (padding rows
    /// included).
    pub fn apply(&self, logits: &mut [f32]) {
        for (i, l) in logits.iter_mut().enumerate() {
            let ok = i < self.vocab && self.allowed.is_allowed(i as u32);
            if !ok {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

impl Constraint {
    /// Compiles `spec` against `vocab` (contract 1).
    pub fn new(vocab: &GrammarVocab, spec: &GrammarSpec) -> Result<Self> {
        let parser = vocab
            .factory
            .create_parser(spec.top_level())
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(e));
        }
        Ok(Self {
            matcher,
            vocab: vocab.clone(),
            accepted: 0,
            stops_after_complete: 0,
        })
    }

    /// The ids allowed next: what the grammar allows, with every stop id
    /// standing in for llguidance's end of sequence (contract 4).
    pub fn mask(&mut self) -> Result<TokenMask> {
        let mut allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Engine(e.to_string()))?;
        if allowed.is_allowed(self.vocab.eos) {
            for &s in self.vocab.stops.iter() {
                if (s as usize) < self.vocab.vocab {
                    allowed.allow_token(s);
                }
            }
        }
        Ok(TokenMask {
            allowed,
            vocab: self.vocab.vocab,
        })
    }

    /// Accepts `t` (it must be allowed: contract 6). Checks only `t`, not
    /// the whole mask.
    pub fn accept(&mut self, t: u32) -> Result<()> {
        let refused = Err(GrammarError::Refused { token: t });
        if (t as usize) >= self.vocab.vocab {
            return refused;
        }
        if self.vocab.stops.contains(&t) {
            if self.matcher.is_stopped() {
                // Complete already: further stops are allowed and change
                // nothing but the count.
                self.stops_after_complete += 1;
                self.accepted += 1;
                return Ok(());
            }
            if !self.is_accepting() {
                return refused;
            }
            self.consume(self.vocab.eos)?;
            return Ok(());
        }
        if self.matcher.is_stopped() {
            return refused;
        }
        let ok = self
            .matcher
            .validate_tokens(&[t])
            .map_err(|e| GrammarError::Engine(e.to_string()))?
            == 1;
        if !ok {
            return refused;
        }
        self.consume(t)
    }

    fn consume(&mut self, t: u32) -> Result<()> {
        self.matcher
            .consume_token(t)
            .map_err(|e| GrammarError::Engine(e.to_string()))?;
        self.accepted += 1;
        Ok(())
    }

    /// Takes back the last `n` accepted tokens (contract 5).
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        if n > self.accepted {
            return Err(GrammarError::Engine(format!(
                "rollback of {n} tokens after {} accepted",
                self.accepted
            )));
        }
        let extra = n.min(self.stops_after_complete);
        self.stops_after_complete -= extra;
        self.matcher
            .rollback(n - extra)
            .map_err(|e| GrammarError::Engine(e.to_string()))?;
        self.accepted -= n;
        Ok(())
    }

    /// Whether what was accepted so far is a complete match.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// A stop was accepted: only stops are allowed from here.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Tokens accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted
    }

    /// An independent copy in the same state.
    fn deep_clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            vocab: self.vocab.clone(),
            accepted: self.accepted,
            stops_after_complete: self.stops_after_complete,
        }
    }
}

/// The verdict on a block `draft` (the tokens after `history`, whose last
/// token is the block's `last`) from the target's `logits` (`[k + 1, vocab]`
/// over `[last, d1..dk]`) under the constraint `c`: at each position the
/// target's choice ([`tandem_model::sampling::next_token`], greedy or keyed)
/// among the tokens the grammar allows there, accepting drafts while they equal
/// it. `c` is advanced over what the verdict commits (the accepted drafts and
/// the next token); on an error it is as it was. Also returns the logits with
/// each row up to the verdict's masked (the rows logprobs are read from).
pub fn masked_verdict(
    params: &tandem_model::sampling::SamplingParams,
    history: &[u32],
    draft: &[u32],
    logits: &[f32],
    c: &mut Constraint,
) -> Result<(tandem_model::verify::Verdict, Vec<f32>)> {
    walk_verdict(params, history, draft, logits, c)
}

/// What a verdict walks: a grammar state that masks (or, a lazy grammar
/// before its trigger, masks nothing), accepts and takes back tokens.
trait Step {
    /// The ids allowed next; `None`: every id (nothing to mask).
    fn step_mask(&mut self) -> Result<Option<TokenMask>>;
    fn step_accept(&mut self, t: u32) -> Result<()>;
    fn step_rollback(&mut self, n: usize) -> Result<()>;
    fn step_accepted(&self) -> usize;
}

impl Step for Constraint {
    fn step_mask(&mut self) -> Result<Option<TokenMask>> {
        self.mask().map(Some)
    }
    fn step_accept(&mut self, t: u32) -> Result<()> {
        self.accept(t)
    }
    fn step_rollback(&mut self, n: usize) -> Result<()> {
        self.rollback(n)
    }
    fn step_accepted(&self) -> usize {
        self.accepted()
    }
}

/// [`masked_verdict`] over any [`Step`].
fn walk_verdict<S: Step + ?Sized>(
    params: &tandem_model::sampling::SamplingParams,
    history: &[u32],
    draft: &[u32],
    logits: &[f32],
    c: &mut S,
) -> Result<(tandem_model::verify::Verdict, Vec<f32>)> {
    let k = draft.len();
    let vocab = logits.len() / (k + 1);
    if vocab == 0 || logits.len() != (k + 1) * vocab {
        return Err(GrammarError::Engine(format!(
            "a verdict on {k} draft tokens needs {} rows of logits, got {} floats",
            k + 1,
            logits.len()
        )));
    }
    let mut masked = logits.to_vec();
    let mut hist = history.to_vec();
    let before = c.step_accepted();
    let mut walk = || -> Result<tandem_model::verify::Verdict> {
        for i in 0..=k {
            let row = &mut masked[i * vocab..(i + 1) * vocab];
            if let Some(mask) = c.step_mask()? {
                if mask.count() == 0 {
                    return Err(GrammarError::Engine("the grammar allows no token".into()));
                }
                mask.apply(row);
            }
            let t = tandem_model::sampling::next_token(params, row, &hist);
            c.step_accept(t)?;
            match draft.get(i) {
                Some(&d) if d == t => hist.push(t),
                _ => {
                    return Ok(tandem_model::verify::Verdict {
                        accepted: i,
                        next_token: t,
                    })
                }
            }
        }
        // Unreachable: the last position has no draft to agree with.
        Err(GrammarError::Engine("verdict past the block".into()))
    };
    match walk() {
        Ok(v) => Ok((v, masked)),
        Err(e) => {
            let n = c.step_accepted().saturating_sub(before);
            c.step_rollback(n)?;
            Err(e)
        }
    }
}

/// A lazy grammar's state (contract 8): the output's text so far, and the
/// grammar once a trigger has activated it.
struct Lazy {
    vocab: GrammarVocab,
    triggers: Vec<Trigger>,
    /// The grammar from a trigger on, compiled and untouched: each
    /// activation starts from a copy.
    pristine: Constraint,
    /// The accepted output's text ([`GrammarVocab::texts`]) and where each
    /// accepted token's text ends in it.
    text: Vec<u8>,
    ends: Vec<usize>,
    /// Active from the token at this index on: the constraint holds the
    /// text from the trigger word to that token's end, then every token
    /// after it.
    active: Option<(usize, Constraint)>,
}

impl Lazy {
    fn new(vocab: &GrammarVocab, spec: &GrammarSpec) -> Result<Self> {
        let GrammarSpec::Lazy { triggers, .. } = spec else {
            return Err(GrammarError::Engine("not a lazy grammar".into()));
        };
        Ok(Self {
            vocab: vocab.clone(),
            triggers: triggers.clone(),
            pristine: Constraint::new(vocab, spec)?,
            text: Vec::new(),
            ends: Vec::new(),
            active: None,
        })
    }

    /// Where trigger words complete inside the last accepted token's text:
    /// their first bytes, in order.
    fn completed_in_last(&self) -> Vec<usize> {
        let hi = self.text.len();
        let lo = match self.ends.len() {
            0 | 1 => 0,
            n => self.ends[n - 2],
        };
        let mut starts = Vec::new();
        // Where the output's text starts after its leading whitespace.
        let first = self
            .text
            .iter()
            .position(|b| !b.is_ascii_whitespace())
            .unwrap_or(hi);
        for t in &self.triggers {
            let w = t.word.as_bytes();
            if t.at_start {
                let p = first;
                let end = p.saturating_add(w.len());
                if end > lo && end <= hi && self.text[p..end] == *w {
                    starts.push(p);
                }
            } else if hi >= w.len() {
                for p in (lo + 1).saturating_sub(w.len())..=hi - w.len() {
                    if self.text[p..p + w.len()] == *w {
                        starts.push(p);
                    }
                }
            }
        }
        starts.sort_unstable();
        starts.dedup();
        starts
    }

    /// After a token was accepted while free: activates the grammar at the
    /// first trigger the token completed whose text the grammar accepts.
    fn try_activate(&mut self) {
        let j = self.ends.len().saturating_sub(1);
        for p in self.completed_in_last() {
            let mut c = self.pristine.deep_clone();
            let fed = self.text[p..].iter().all(|&b| {
                self.vocab
                    .byte_tokens
                    .get(usize::from(b))
                    .copied()
                    .flatten()
                    .is_some_and(|id| c.accept(id).is_ok())
            });
            if fed {
                self.active = Some((j, c));
                return;
            }
        }
    }
}

impl Step for Lazy {
    fn step_mask(&mut self) -> Result<Option<TokenMask>> {
        match self.active.as_mut() {
            Some((_, c)) => c.mask().map(Some),
            None => Ok(None),
        }
    }

    fn step_accept(&mut self, t: u32) -> Result<()> {
        if let Some((_, c)) = self.active.as_mut() {
            c.accept(t)?;
        }
        let text = self.vocab.texts.get(t as usize).map_or(&[][..], |b| &b[..]);
        self.text.extend_from_slice(text);
        self.ends.push(self.text.len());
        if self.active.is_none() {
            self.try_activate();
        }
        Ok(())
    }

    fn step_rollback(&mut self, n: usize) -> Result<()> {
        let Some(keep) = self.ends.len().checked_sub(n) else {
            return Err(GrammarError::Engine(format!(
                "rollback of {n} tokens after {} accepted",
                self.ends.len()
            )));
        };
        match self.active.as_mut() {
            Some((j, c)) if keep > *j => c.rollback(n)?,
            Some(_) => self.active = None,
            None => {}
        }
        self.ends.truncate(keep);
        self.text.truncate(self.ends.last().copied().unwrap_or(0));
        Ok(())
    }

    fn step_accepted(&self) -> usize {
        self.ends.len()
    }
}

/// A [`Guide`]'s grammar state: a grammar over the whole output, or a lazy
/// one.
enum Inner {
    Eager(Box<Constraint>),
    Lazy(Box<Lazy>),
}

impl Step for Inner {
    fn step_mask(&mut self) -> Result<Option<TokenMask>> {
        match self {
            Self::Eager(c) => c.step_mask(),
            Self::Lazy(l) => l.step_mask(),
        }
    }
    fn step_accept(&mut self, t: u32) -> Result<()> {
        match self {
            Self::Eager(c) => c.step_accept(t),
            Self::Lazy(l) => l.step_accept(t),
        }
    }
    fn step_rollback(&mut self, n: usize) -> Result<()> {
        match self {
            Self::Eager(c) => c.step_rollback(n),
            Self::Lazy(l) => l.step_rollback(n),
        }
    }
    fn step_accepted(&self) -> usize {
        match self {
            Self::Eager(c) => c.step_accepted(),
            Self::Lazy(l) => l.step_accepted(),
        }
    }
}

/// A constraint that follows a context (contract 7): the output starts at
/// context position `start`, and the constraint holds exactly `held`.
pub struct Guide {
    c: Inner,
    start: usize,
    held: Vec<u32>,
}

impl std::fmt::Debug for Guide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guide")
            .field("start", &self.start)
            .field("held", &self.held.len())
            .finish()
    }
}

impl Guide {
    /// Compiles `spec` for an output starting at context position `start`.
    pub fn new(vocab: &GrammarVocab, spec: &GrammarSpec, start: usize) -> Result<Self> {
        let c = match spec {
            GrammarSpec::Lazy { .. } => Inner::Lazy(Box::new(Lazy::new(vocab, spec)?)),
            _ => Inner::Eager(Box::new(Constraint::new(vocab, spec)?)),
        };
        Ok(Self {
            c,
            start,
            held: Vec::new(),
        })
    }

    /// Where the output starts.
    pub fn start(&self) -> usize {
        self.start
    }

    /// The output tokens the constraint holds.
    pub fn held(&self) -> &[u32] {
        &self.held
    }

    /// Brings the constraint to `context` (its output: `context[start..]`):
    /// takes back what differs from it, accepts the rest. On a refused token
    /// it is as it was, and the error names the output index.
    pub fn sync(&mut self, context: &[u32]) -> Result<()> {
        let want = context.get(self.start..).unwrap_or(&[]);
        let common = self
            .held
            .iter()
            .zip(want)
            .take_while(|(a, b)| a == b)
            .count();
        if common == self.held.len() && common == want.len() {
            return Ok(());
        }
        let undone = self.held.split_off(common);
        self.c.step_rollback(undone.len())?;
        for (i, &t) in want[common..].iter().enumerate() {
            if let Err(e) = self.c.step_accept(t) {
                // Back to where it was.
                self.c.step_rollback(i)?;
                for &u in &undone {
                    self.c.step_accept(u)?;
                }
                self.held.extend_from_slice(&undone);
                return Err(match e {
                    GrammarError::Refused { token } => GrammarError::RefusedAt {
                        index: common + i,
                        token,
                    },
                    e => e,
                });
            }
            self.held.push(t);
        }
        Ok(())
    }

    /// The ids allowed after `context`; `None`: every id (a lazy grammar
    /// before its trigger: nothing to mask).
    pub fn mask_after(&mut self, context: &[u32]) -> Result<Option<TokenMask>> {
        self.sync(context)?;
        self.c.step_mask()
    }

    /// Whether the grammar applies after the tokens it holds: always for
    /// an eager grammar, from its trigger on for a lazy one.
    pub fn is_active(&self) -> bool {
        match &self.c {
            Inner::Eager(_) => true,
            Inner::Lazy(l) => l.active.is_some(),
        }
    }

    /// How many leading `tokens` are allowed after `context` (the constraint
    /// is left at `context`).
    pub fn allowed_prefix(&mut self, context: &[u32], tokens: &[u32]) -> Result<usize> {
        self.sync(context)?;
        let mut n = 0;
        for &t in tokens {
            if self.c.step_accept(t).is_err() {
                break;
            }
            n += 1;
        }
        self.c.step_rollback(n)?;
        Ok(n)
    }

    /// [`masked_verdict`] on a block after `context` (the constraint is
    /// brought to it first), advancing the constraint over what the verdict
    /// commits (the accepted drafts and the next token).
    pub fn verdict(
        &mut self,
        params: &tandem_model::sampling::SamplingParams,
        context: &[u32],
        draft: &[u32],
        logits: &[f32],
    ) -> Result<(tandem_model::verify::Verdict, Vec<f32>)> {
        self.sync(context)?;
        let (v, masked) = walk_verdict(params, context, draft, logits, &mut self.c)?;
        let n = v.accepted.min(draft.len());
        self.held.extend_from_slice(&draft[..n]);
        self.held.push(v.next_token);
        Ok((v, masked))
    }

    /// Takes back the last `n` tokens [`Self::verdict`] committed (a verdict
    /// that could not be applied).
    pub fn undo(&mut self, n: usize) -> Result<()> {
        let n = n.min(self.held.len());
        self.c.step_rollback(n)?;
        self.held.truncate(self.held.len() - n);
        Ok(())
    }
}

fn model_err(e: GrammarError) -> tandem_model::ModelError {
    tandem_model::ModelError::Grammar(e.to_string())
}

impl tandem_model::engine::OutputConstraint for Guide {
    fn mask(&mut self, context: &[u32], logits: &mut [f32]) -> tandem_model::Result<()> {
        let Some(m) = self.mask_after(context).map_err(model_err)? else {
            return Ok(());
        };
        if m.count() == 0 {
            return Err(model_err(GrammarError::Engine(
                "the grammar allows no token".into(),
            )));
        }
        m.apply(logits);
        Ok(())
    }

    fn allowed_prefix(&mut self, context: &[u32], tokens: &[u32]) -> tandem_model::Result<usize> {
        Guide::allowed_prefix(self, context, tokens).map_err(model_err)
    }
}

/// A compiled request for structured output: the spec and the vocabulary it
/// masks over, checked to compile ([`Grammar::new`]). The
/// `tandem_model::engine::OutputGrammar` a `GenerateConfig` carries: its
/// wire form goes into the verifier session's Open, and each side of a
/// generation (the draft, a local target) gets its own [`Guide`].
#[derive(Clone)]
pub struct Grammar {
    spec: GrammarSpec,
    vocab: GrammarVocab,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("kind", &self.spec.to_wire().0)
            .finish()
    }
}

impl Grammar {
    /// Checks that `spec` compiles against `vocab` (and is within
    /// [`MAX_GRAMMAR_BYTES`]): a refusal here is the user's 400, before any
    /// work.
    pub fn new(vocab: &GrammarVocab, spec: GrammarSpec) -> Result<Self> {
        let (kind, text) = spec.to_wire();
        GrammarSpec::from_wire(kind, &text)?;
        Constraint::new(vocab, &spec)?;
        Ok(Self {
            spec,
            vocab: vocab.clone(),
        })
    }

    pub fn spec(&self) -> &GrammarSpec {
        &self.spec
    }

    /// This grammar as a `GenerateConfig::grammar`.
    pub fn into_config(self) -> std::sync::Arc<dyn tandem_model::engine::OutputGrammar> {
        std::sync::Arc::new(self)
    }
}

impl tandem_model::engine::OutputGrammar for Grammar {
    fn wire(&self) -> (&'static str, String) {
        self.spec.to_wire()
    }

    fn constraint(
        &self,
        output_start: usize,
    ) -> tandem_model::Result<Box<dyn tandem_model::engine::OutputConstraint>> {
        Guide::new(&self.vocab, &self.spec, output_start)
            .map(|g| Box::new(g) as Box<dyn tandem_model::engine::OutputConstraint>)
            .map_err(model_err)
    }
}
