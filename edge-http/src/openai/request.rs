//! Parsing and validating OpenAI request bodies into a [`GenRequest`].
//!
//! Works on the JSON object directly (not serde derive) so every refusal can
//! name its parameter (`param` of the error body). Fields this server does
//! not know are ignored and listed in [`GenRequest::ignored`] (as vLLM and
//! llama.cpp ignore them; the server names them in the
//! `x-tandem-ignored-fields` header), or refused like OpenAI does with
//! [`Limits::strict`]. Parameters this server knows but does not implement
//! are refused either way when they ask for something other than their
//! default (`tools: []`, `response_format: {"type": "text"}`, … pass).

use serde_json::{Map, Value};
use tandem_model::penalties::{LogitBias, LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, PENALTY_LIMIT};
use tandem_model::sampling::SamplingParams;
use tandem_model::tokenizer::{ChatMessage, Role};

use super::error::ApiError;
use super::format::{self, OutputFormat};
use super::tools::{self, Tools};

/// What to generate from.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// `/v1/chat/completions`: the conversation, rendered with the chat template.
    Chat(Vec<ChatMessage>),
    /// `/v1/completions`: raw text, no template.
    Text(String),
    /// `/v1/completions` with a `suffix`: fill in the middle between the
    /// prompt and the suffix (the model's FIM tokens; no template).
    Fim { prefix: String, suffix: String },
    /// llama.cpp's `/infill`: prefix, suffix, the text that starts the middle
    /// (`prompt`) and other files of the project (`input_extra`, as
    /// `(filename, text)`), in llama.cpp's repo-level layout.
    Infill {
        prefix: String,
        suffix: String,
        prompt: String,
        extra: Vec<(String, String)>,
    },
}

impl Input {
    /// Whether the prompt is a fill-in-the-middle one (needs FIM tokens).
    pub fn is_fim(&self) -> bool {
        matches!(self, Input::Fim { .. } | Input::Infill { .. })
    }

    /// Every text the request would send, in order: what the privacy router
    /// must see (file names of `input_extra` included).
    pub fn texts(&self) -> Vec<String> {
        match self {
            Input::Chat(m) => m.iter().map(|m| m.content.clone()).collect(),
            Input::Text(t) => vec![t.clone()],
            Input::Fim { prefix, suffix } => vec![prefix.clone(), suffix.clone()],
            Input::Infill {
                prefix,
                suffix,
                prompt,
                extra,
            } => extra
                .iter()
                .flat_map(|(f, t)| [f.clone(), t.clone()])
                .chain([prefix.clone(), prompt.clone(), suffix.clone()])
                .collect(),
        }
    }
}

/// A validated generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct GenRequest {
    pub input: Input,
    pub max_tokens: usize,
    /// Choices to generate (`n`, 1..=[`MAX_CHOICES`]), one after the other;
    /// choice `i` samples with [`choice_seed`]`(seed, i)`.
    pub n: usize,
    /// Logprobs asked for, with this many alternatives per token (chat:
    /// `logprobs: true` + `top_logprobs`; completions: `logprobs: N`).
    /// `None`: no logprobs.
    pub logprobs: Option<usize>,
    pub sampling: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
    /// Extension (as in vLLM): do not stop at end-of-turn tokens.
    pub ignore_eos: bool,
    /// Extension: the privacy router's conversation id (stickiness across
    /// requests). Absent: every request is its own conversation.
    pub conversation_id: Option<String>,
    /// Not from the body: the client's scope for anonymous conversation-cache
    /// reuse (`super::peer`), set by the server from the connection.
    pub anonymous_scope: Option<String>,
    /// Stop sequences (text); the output ends before the first match.
    pub stop: Vec<String>,
    /// Chat: the declared tools and how they may be called (`None`: no
    /// tools).
    pub tools: Option<Tools>,
    /// Structured output (`response_format`; docs/api.md): what the output
    /// is constrained to. A forced tool call's arguments get theirs in the
    /// worker (`format::forced_call`).
    pub format: Option<OutputFormat>,
    /// Fields the server did not know and ignored (top level by name, in a
    /// message as `messages[i].name`), sorted per object; empty with
    /// [`Limits::strict`], which refuses them.
    pub ignored: Vec<String>,
}

/// Limits the parser enforces.
#[derive(Clone, Debug)]
pub struct Limits<'a> {
    pub model_id: &'a str,
    pub max_tokens_limit: usize,
    pub default_max_tokens: usize,
    /// Unknown fields are a 400 naming them (OpenAI's behaviour;
    /// `--strict-api`) instead of being ignored.
    pub strict: bool,
    /// The model's vocabulary size: `logit_bias` names tokens below it.
    pub vocab: usize,
}

/// Most choices (`n`) one request may ask for.
pub const MAX_CHOICES: usize = 8;

/// The seed of choice `index` of a request seeded with `seed`: choice 0 keeps
/// it (so `n: 1` and the first of `n: 3` are the same generation), the others
/// derive theirs from it, so a seeded request with `n > 1` reproduces.
pub fn choice_seed(seed: u64, index: usize) -> u64 {
    seed.wrapping_add((index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "store",
    "metadata",
    "service_tier",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
];

const COMPLETION_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "logprobs",
    "echo",
    "best_of",
    "suffix",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    // An extension here (as in vLLM): structured output.
    "response_format",
];

/// llama.cpp's `/infill` fields (its names, plus the OpenAI ones `common`
/// reads).
const INFILL_FIELDS: &[&str] = &[
    "model",
    "input_prefix",
    "input_suffix",
    "input_extra",
    "prompt",
    "n_predict",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
];

/// Extensions accepted on both endpoints.
const EXTENSION_FIELDS: &[&str] = &[
    "top_k",
    "repetition_penalty",
    "ignore_eos",
    "conversation_id",
];

fn is_null(v: Option<&Value>) -> bool {
    matches!(v, None | Some(Value::Null))
}

fn type_error(param: &str, expected: &str) -> ApiError {
    ApiError::invalid(format!("`{param}` must be {expected}"), Some(param))
}

fn get_f64(o: &Map<String, Value>, k: &str) -> Result<Option<f64>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| type_error(k, "a number")),
    }
}

fn get_u64(o: &Map<String, Value>, k: &str) -> Result<Option<u64>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| type_error(k, "a non-negative integer")),
    }
}

fn get_bool(o: &Map<String, Value>, k: &str) -> Result<Option<bool>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(type_error(k, "a boolean")),
    }
}

/// Refuses a parameter unless it is absent, null or `allowed(value)`.
fn only_default(
    o: &Map<String, Value>,
    k: &str,
    what: &str,
    allowed: impl Fn(&Value) -> bool,
) -> Result<(), ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(()),
        Some(v) if allowed(v) => Ok(()),
        Some(_) => Err(ApiError::unsupported(k, what)),
    }
}

fn empty(v: &Value) -> bool {
    match v {
        Value::Array(a) => a.is_empty(),
        Value::Object(m) => m.is_empty(),
        _ => false,
    }
}

/// `n`: absent or null is 1; else an integer in 1..=[`MAX_CHOICES`].
fn choices(o: &Map<String, Value>) -> Result<usize, ApiError> {
    match get_u64(o, "n")? {
        None => Ok(1),
        Some(n) if (1..=MAX_CHOICES as u64).contains(&n) => Ok(n as usize),
        Some(n) => Err(ApiError::invalid(
            format!("`n` must be in 1..={MAX_CHOICES} (got {n})"),
            Some("n"),
        )),
    }
}

/// `presence_penalty` / `frequency_penalty`: a number in [-2, 2] (absent: 0).
fn penalty(o: &Map<String, Value>, k: &str) -> Result<f32, ApiError> {
    let v = get_f64(o, k)?.unwrap_or(0.0);
    if v.is_nan() || v.abs() > f64::from(PENALTY_LIMIT) {
        return Err(ApiError::invalid(
            format!("`{k}` must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}] (got {v})"),
            Some(k),
        ));
    }
    Ok(v as f32)
}

/// `logit_bias`: an object mapping token ids (as strings, as OpenAI's) to a
/// bias in [-100, 100], at most [`MAX_LOGIT_BIAS`] entries, each id below
/// `vocab`.
fn logit_bias(o: &Map<String, Value>, vocab: usize) -> Result<LogitBias, ApiError> {
    const P: &str = "logit_bias";
    let m = match o.get(P) {
        None | Some(Value::Null) => return Ok(LogitBias::default()),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(type_error(P, "an object mapping token ids to numbers")),
    };
    if m.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            format!(
                "`{P}` takes at most {MAX_LOGIT_BIAS} tokens (got {})",
                m.len()
            ),
            Some(P),
        ));
    }
    let mut pairs = Vec::with_capacity(m.len());
    for (k, v) in m {
        let token = k
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|&t| (t as usize) < vocab)
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("`{P}`: {k:?} is not a token id of this model (0..{vocab})"),
                    Some(P),
                )
            })?;
        let bias = v
            .as_f64()
            .filter(|b| b.abs() <= f64::from(LOGIT_BIAS_LIMIT))
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("`{P}`: the bias of token {k} must be a number in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}]"),
                    Some(P),
                )
            })?;
        pairs.push((token, bias as f32));
    }
    LogitBias::new(pairs).map_err(|e| ApiError::invalid(format!("`{P}`: {e}"), Some(P)))
}

/// Most alternatives chat's `top_logprobs` asks for (OpenAI's limit).
pub const MAX_CHAT_TOP_LOGPROBS: u64 = 20;

/// Most alternatives the legacy completions' `logprobs` asks for (OpenAI's
/// limit).
pub const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// Chat's `logprobs` (a boolean) and `top_logprobs` (0..=20, only with
/// `logprobs: true`).
fn chat_logprobs(o: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    let on = get_bool(o, "logprobs")?.unwrap_or(false);
    match (on, get_u64(o, "top_logprobs")?) {
        (_, Some(n)) if n > MAX_CHAT_TOP_LOGPROBS => Err(ApiError::invalid(
            format!("`top_logprobs` must be in 0..={MAX_CHAT_TOP_LOGPROBS} (got {n})"),
            Some("top_logprobs"),
        )),
        (false, Some(_)) => Err(ApiError::invalid(
            "`top_logprobs` needs `logprobs: true`",
            Some("top_logprobs"),
        )),
        (true, n) => Ok(Some(n.unwrap_or(0) as usize)),
        (false, None) => Ok(None),
    }
}

/// The legacy completions' `logprobs`: an integer in 0..=5, the
/// alternatives per token (absent or null: none).
fn completion_logprobs(o: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    match get_u64(o, "logprobs")? {
        Some(n) if n > MAX_COMPLETION_LOGPROBS => Err(ApiError::invalid(
            format!("`logprobs` must be in 0..={MAX_COMPLETION_LOGPROBS} (got {n})"),
            Some("logprobs"),
        )),
        n => Ok(n.map(|n| n as usize)),
    }
}

/// `max_completion_tokens` (chat's newer name) or `max_tokens`; both given
/// and different is a 400.
fn max_completion_tokens(o: &Map<String, Value>) -> Result<Option<u64>, ApiError> {
    let newer = get_u64(o, "max_completion_tokens")?;
    let older = get_u64(o, "max_tokens")?;
    match (newer, older) {
        (Some(a), Some(b)) if a != b => Err(ApiError::invalid(
            format!("`max_completion_tokens` ({a}) and `max_tokens` ({b}) differ: send one"),
            Some("max_completion_tokens"),
        )),
        (Some(a), _) => Ok(Some(a)),
        (None, b) => Ok(b),
    }
}

/// Parses the body into a JSON object (400 for anything else).
fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            format!("We could not parse the JSON body of your request: {e}"),
            None,
        )
    })?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        )),
    }
}

/// `o`'s entries by key: what is ignored or refused first does not depend on
/// the map's order (serde_json keeps insertion order in builds where a
/// dependency turns on `preserve_order`, as llguidance does).
fn by_key(o: &Map<String, Value>) -> Vec<(&String, &Value)> {
    let mut v: Vec<(&String, &Value)> = o.iter().collect();
    v.sort_by(|a, b| a.0.cmp(b.0));
    v
}

/// The unknown field `name` (its full path, e.g. `messages[2].foo`): a 400
/// naming it when strict, else added to `ignored`.
fn unknown_field(name: String, strict: bool, ignored: &mut Vec<String>) -> Result<(), ApiError> {
    if strict {
        return Err(ApiError::invalid(
            format!("Unrecognized request argument supplied: {name}"),
            Some(&name),
        ));
    }
    ignored.push(name);
    Ok(())
}

/// The top-level fields of `o` that are neither in `known` nor extensions:
/// refused when strict, else returned.
fn check_fields(
    o: &Map<String, Value>,
    known: &[&str],
    strict: bool,
) -> Result<Vec<String>, ApiError> {
    let mut ignored = Vec::new();
    for (k, _) in by_key(o) {
        if !known.contains(&k.as_str()) && !EXTENSION_FIELDS.contains(&k.as_str()) {
            unknown_field(k.clone(), strict, &mut ignored)?;
        }
    }
    Ok(ignored)
}

fn check_model(o: &Map<String, Value>, lim: &Limits) -> Result<(), ApiError> {
    match o.get("model") {
        Some(Value::String(m)) if m == lim.model_id => Ok(()),
        Some(Value::String(m)) => Err(ApiError::model_not_found(m)),
        None | Some(Value::Null) => Err(ApiError::invalid(
            "you must provide a model parameter",
            Some("model"),
        )),
        Some(_) => Err(type_error("model", "a string")),
    }
}

/// Sampling, limits, streaming and extensions shared by both endpoints.
fn common(
    o: &Map<String, Value>,
    lim: &Limits,
    input: Input,
    max_tokens: Option<u64>,
    mut ignored: Vec<String>,
) -> Result<GenRequest, ApiError> {
    let max_param = if o.contains_key("max_completion_tokens") {
        "max_completion_tokens"
    } else if o.contains_key("n_predict") {
        "n_predict"
    } else {
        "max_tokens"
    };
    let max_tokens = match max_tokens {
        None => lim.default_max_tokens.min(lim.max_tokens_limit),
        Some(n) if n == 0 || n > lim.max_tokens_limit as u64 => {
            return Err(ApiError::invalid(
                format!(
                    "`{max_param}` must be in 1..={} (got {n})",
                    lim.max_tokens_limit
                ),
                Some(max_param),
            ))
        }
        Some(n) => n as usize,
    };
    let n = choices(o)?;
    let presence_penalty = penalty(o, "presence_penalty")?;
    let frequency_penalty = penalty(o, "frequency_penalty")?;
    let logit_bias = logit_bias(o, lim.vocab)?;

    let temperature = get_f64(o, "temperature")?.unwrap_or(0.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            format!("`temperature` must be in [0, 2] (got {temperature})"),
            Some("temperature"),
        ));
    }
    let top_p = get_f64(o, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            format!("`top_p` must be in (0, 1] (got {top_p})"),
            Some("top_p"),
        ));
    }
    let top_k = get_u64(o, "top_k")?.unwrap_or(0);
    let repetition_penalty = get_f64(o, "repetition_penalty")?.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty.is_finite()) {
        return Err(ApiError::invalid(
            format!("`repetition_penalty` must be > 0 (got {repetition_penalty})"),
            Some("repetition_penalty"),
        ));
    }
    let seed = match o.get("seed") {
        None | Some(Value::Null) => None,
        // OpenAI seeds are signed 64-bit integers; keep their bits.
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|i| i as u64))
                .ok_or_else(|| type_error("seed", "an integer"))?,
        ),
    };
    let seed = seed.unwrap_or_else(|| {
        // Sampled mode without a seed: a fresh one per request, as OpenAI.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_k: usize::try_from(top_k).unwrap_or(usize::MAX),
        top_p: top_p as f32,
        repetition_penalty: repetition_penalty as f32,
        seed,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        ..SamplingParams::default()
    };

    let stream = get_bool(o, "stream")?.unwrap_or(false);
    let include_usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(_) if !stream => {
            return Err(ApiError::invalid(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                Some("stream_options"),
            ))
        }
        Some(Value::Object(so)) => {
            for (k, _) in by_key(so) {
                if k != "include_usage" {
                    unknown_field(format!("stream_options.{k}"), lim.strict, &mut ignored)?;
                }
            }
            get_bool(so, "include_usage")
                .map_err(|_| type_error("stream_options.include_usage", "a boolean"))?
                .unwrap_or(false)
        }
        Some(_) => return Err(type_error("stream_options", "an object")),
    };
    let stop = match o.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| type_error("stop", "a string or an array of strings"))?,
        Some(_) => return Err(type_error("stop", "a string or an array of strings")),
    };
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "`stop` takes up to 4 non-empty sequences",
            Some("stop"),
        ));
    }
    let conversation_id = match o.get("conversation_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 256 => Some(s.clone()),
        Some(_) => {
            return Err(type_error(
                "conversation_id",
                "a non-empty string of at most 256 bytes",
            ))
        }
    };
    Ok(GenRequest {
        input,
        max_tokens,
        n,
        logprobs: None,
        sampling,
        stream,
        include_usage,
        ignore_eos: get_bool(o, "ignore_eos")?.unwrap_or(false),
        conversation_id,
        anonymous_scope: None,
        stop,
        tools: None,
        format: None,
        ignored,
    })
}

fn message_content(i: usize, v: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    (Some(t), _) => {
                        return Err(ApiError::unsupported(
                            &format!("{param}[{j}]"),
                            &format!("content of type `{t}` (only text)"),
                        ))
                    }
                    _ => return Err(type_error(&format!("{param}[{j}]"), "a text part")),
                }
            }
            Ok(text)
        }
        Some(_) => Err(type_error(&param, "a string or an array of text parts")),
    }
}

/// Most messages one chat request may carry (413 above): the context
/// policy renders the history a few times per request, so its length is
/// bounded before the worker sees it.
pub const MAX_MESSAGES: usize = 1024;

/// Fields of a message this server knows but does not implement: refused
/// unless null (or an empty array).
const MESSAGE_UNSUPPORTED: &[(&str, &str)] = &[
    (
        "function_call",
        "function calls in the history (use tool_calls)",
    ),
    ("audio", "audio in the history"),
];

/// Checks the keys of message `i`: unknown ones go to `ignored` (or are a
/// 400 when strict), known unsupported ones are refused.
fn message_fields(
    i: usize,
    m: &Map<String, Value>,
    strict: bool,
    ignored: &mut Vec<String>,
) -> Result<(), ApiError> {
    for (k, v) in by_key(m) {
        if matches!(
            k.as_str(),
            "role" | "content" | "name" | "refusal" | "tool_calls" | "tool_call_id"
        ) {
            continue;
        }
        match MESSAGE_UNSUPPORTED.iter().find(|(f, _)| f == k) {
            Some(_) if v.is_null() || empty(v) => {}
            Some((_, what)) => {
                return Err(ApiError::unsupported(&format!("messages[{i}].{k}"), what))
            }
            None => unknown_field(format!("messages[{i}].{k}"), strict, ignored)?,
        }
    }
    Ok(())
}

fn messages(
    o: &Map<String, Value>,
    strict: bool,
    ignored: &mut Vec<String>,
) -> Result<Vec<ChatMessage>, ApiError> {
    let arr = match o.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "`messages` must not be empty",
                Some("messages"),
            ))
        }
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "Missing required parameter: 'messages'.",
                Some("messages"),
            ))
        }
        Some(_) => return Err(type_error("messages", "an array")),
    };
    if arr.len() > MAX_MESSAGES {
        return Err(ApiError::too_large(
            format!(
                "`messages` has {} entries; this server accepts at most {MAX_MESSAGES} per request",
                arr.len()
            ),
            Some("messages"),
        ));
    }
    let mut out = Vec::with_capacity(arr.len());
    for (i, m) in arr.iter().enumerate() {
        let Some(m) = m.as_object() else {
            return Err(type_error(&format!("messages[{i}]"), "an object"));
        };
        message_fields(i, m, strict, ignored)?;
        let role = match m.get("role").and_then(Value::as_str) {
            Some("system") | Some("developer") => Role::System,
            Some("user") => Role::User,
            Some("assistant") => Role::Assistant,
            Some("tool") => Role::Tool,
            Some(r) => {
                return Err(ApiError::unsupported(
                    &format!("messages[{i}].role"),
                    &format!("the role `{r}`"),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    format!("messages[{i}] needs a role"),
                    Some(&format!("messages[{i}].role")),
                ))
            }
        };
        let mut message = ChatMessage::new(role, message_content(i, m.get("content"))?);
        message.tool_calls = tools::history_calls(i, m, role == Role::Assistant)?;
        message.tool_call_id = tools::tool_call_id(i, m, role == Role::Tool)?;
        out.push(message);
    }
    Ok(out)
}

/// `POST /v1/chat/completions`.
pub fn parse_chat(body: &[u8], lim: &Limits) -> Result<GenRequest, ApiError> {
    let o = object(body)?;
    let mut ignored = check_fields(&o, CHAT_FIELDS, lim.strict)?;
    check_model(&o, lim)?;
    let msgs = messages(&o, lim.strict, &mut ignored)?;
    let tools = tools::parse_tools(&o)?;
    only_default(&o, "functions", "functions (function calling)", empty)?;
    only_default(&o, "function_call", "function_call", |v| v == "none")?;
    let format = format::response_format(&o)?;
    if format.is_some()
        && tools.as_ref().is_some_and(|t| {
            matches!(
                t.choice,
                tools::ToolChoice::Required | tools::ToolChoice::Function(_)
            )
        })
    {
        return Err(ApiError::invalid(
            "`response_format` cannot be combined with a forced tool call (`tool_choice` \
             \"required\" or a named function): the call's arguments follow the function's \
             parameter schema",
            Some("response_format"),
        ));
    }
    only_default(&o, "modalities", "modalities other than text", |v| {
        v.as_array().is_some_and(|a| a.iter().all(|m| m == "text"))
    })?;
    for k in [
        "audio",
        "prediction",
        "reasoning_effort",
        "web_search_options",
    ] {
        only_default(&o, k, k, |_| false)?;
    }
    let max = max_completion_tokens(&o)?;
    let logprobs = chat_logprobs(&o)?;
    let mut r = common(&o, lim, Input::Chat(msgs), max, ignored)?;
    r.logprobs = logprobs;
    r.tools = tools;
    r.format = format;
    Ok(r)
}

/// `POST /v1/completions`.
pub fn parse_completion(body: &[u8], lim: &Limits) -> Result<GenRequest, ApiError> {
    let o = object(body)?;
    let ignored = check_fields(&o, COMPLETION_FIELDS, lim.strict)?;
    check_model(&o, lim)?;
    let prompt = match o.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_string()
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::unsupported(
                "prompt",
                "a batch of prompts or token-id prompts (send one string)",
            ))
        }
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "Missing required parameter: 'prompt'.",
                Some("prompt"),
            ))
        }
        Some(_) => return Err(type_error("prompt", "a string")),
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            "`prompt` must not be empty",
            Some("prompt"),
        ));
    }
    let logprobs = completion_logprobs(&o)?;
    if get_bool(&o, "echo")?.unwrap_or(false) {
        return Err(ApiError::unsupported("echo", "echo"));
    }
    only_default(&o, "best_of", "best_of > 1", |v| v.as_u64() == Some(1))?;
    let input = match o.get("suffix") {
        None | Some(Value::Null) => Input::Text(prompt),
        // An empty suffix asks for nothing after the insertion: a plain
        // completion (as OpenAI's legacy endpoint).
        Some(Value::String(sfx)) if sfx.is_empty() => Input::Text(prompt),
        Some(Value::String(sfx)) => Input::Fim {
            prefix: prompt,
            suffix: sfx.clone(),
        },
        Some(_) => return Err(type_error("suffix", "a string")),
    };
    let max = get_u64(&o, "max_tokens")?;
    let format = format::response_format(&o)?;
    let mut r = common(&o, lim, input, max, ignored)?;
    r.logprobs = logprobs;
    r.format = format;
    Ok(r)
}

/// A string field of `/infill` (absent or null: empty).
fn infill_text(o: &Map<String, Value>, k: &str) -> Result<String, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(type_error(k, "a string")),
    }
}

/// Most `input_extra` files one `/infill` request may carry (413 above).
pub const MAX_INFILL_FILES: usize = 256;

/// `input_extra`: `[{"filename": string = "tmp", "text": string}, …]`.
fn infill_extra(o: &Map<String, Value>) -> Result<Vec<(String, String)>, ApiError> {
    let arr = match o.get("input_extra") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(type_error("input_extra", "an array of {filename, text}")),
    };
    if arr.len() > MAX_INFILL_FILES {
        return Err(ApiError::too_large(
            format!(
                "`input_extra` has {} files; this server accepts at most {MAX_INFILL_FILES}",
                arr.len()
            ),
            Some("input_extra"),
        ));
    }
    let mut out = Vec::with_capacity(arr.len());
    for (i, c) in arr.iter().enumerate() {
        let param = format!("input_extra[{i}]");
        let Some(c) = c.as_object() else {
            return Err(type_error(&param, "an object {filename, text}"));
        };
        let field = |k: &str, default: &str| match c.get(k) {
            None | Some(Value::Null) => Ok(default.to_string()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(type_error(&format!("{param}.{k}"), "a string")),
        };
        out.push((field("filename", "tmp")?, field("text", "")?));
    }
    Ok(out)
}

/// `POST /infill` (llama.cpp's server): `input_prefix`, `input_suffix`,
/// `input_extra`, `prompt`, `n_predict` (or `max_tokens`; negative: the
/// default), and the sampling fields of the completions endpoint. `model`
/// is optional here (llama.cpp does not read it) but must be the served one
/// when given.
pub fn parse_infill(body: &[u8], lim: &Limits) -> Result<GenRequest, ApiError> {
    let o = object(body)?;
    let ignored = check_fields(&o, INFILL_FIELDS, lim.strict)?;
    if !is_null(o.get("model")) {
        check_model(&o, lim)?;
    }
    let input = Input::Infill {
        prefix: infill_text(&o, "input_prefix")?,
        suffix: infill_text(&o, "input_suffix")?,
        prompt: infill_text(&o, "prompt")?,
        extra: infill_extra(&o)?,
    };
    if choices(&o)? != 1 {
        return Err(ApiError::unsupported("n", "n > 1 on /infill"));
    }
    let max = match o.get("n_predict") {
        Some(v) if v.as_i64().is_some_and(|n| n < 0) => None,
        Some(_) => get_u64(&o, "n_predict")?,
        None => get_u64(&o, "max_tokens")?,
    };
    common(&o, lim, input, max, ignored)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const LIM: Limits = Limits {
        model_id: "tandem",
        max_tokens_limit: 100,
        default_max_tokens: 16,
        strict: true,
        vocab: 1000,
    };

    fn chat(v: serde_json::Value) -> Result<GenRequest, ApiError> {
        parse_chat(v.to_string().as_bytes(), &LIM)
    }

    #[test]
    fn defaults_are_greedy_and_bounded() {
        let r =
            chat(serde_json::json!({"model":"tandem","messages":[{"role":"user","content":"hi"}]}))
                .unwrap();
        assert_eq!(r.max_tokens, 16);
        assert!(r.sampling.is_greedy());
        assert!(!r.stream);
        assert_eq!(r.input, Input::Chat(vec![ChatMessage::user("hi")]));
    }

    #[test]
    fn text_parts_are_concatenated() {
        let r = chat(
            serde_json::json!({"model":"tandem","messages":[{"role":"user",
            "content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}),
        )
        .unwrap();
        assert_eq!(r.input, Input::Chat(vec![ChatMessage::user("ab")]));
        let e = chat(
            serde_json::json!({"model":"tandem","messages":[{"role":"user",
            "content":[{"type":"image_url","image_url":{"url":"x"}}]}]}),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0]"));
    }

    #[test]
    fn refusals_name_the_parameter() {
        let base =
            || serde_json::json!({"model":"tandem","messages":[{"role":"user","content":"hi"}]});
        let cases: Vec<(&str, serde_json::Value)> = vec![
            ("n", serde_json::json!(9)),
            ("n", serde_json::json!(0)),
            ("top_logprobs", serde_json::json!(21)),
            ("top_logprobs", serde_json::json!(2)),
            ("logprobs", serde_json::json!(3)),
            ("tools", serde_json::json!({"type":"function"})),
            ("max_tokens", serde_json::json!(0)),
            ("max_tokens", serde_json::json!(101)),
            ("temperature", serde_json::json!(3)),
            ("top_p", serde_json::json!(0)),
            ("bogus", serde_json::json!(1)),
            ("stream_options", serde_json::json!({"include_usage": true})),
            ("presence_penalty", serde_json::json!(2.5)),
            ("frequency_penalty", serde_json::json!(-3)),
            ("logit_bias", serde_json::json!({"1000": 1})),
            ("logit_bias", serde_json::json!({"abc": 1})),
            ("logit_bias", serde_json::json!({"5": 101})),
            ("logit_bias", serde_json::json!([1])),
            ("max_completion_tokens", serde_json::json!(0)),
        ];
        for (k, v) in cases {
            let mut b = base();
            b[k] = v;
            let e = chat(b).unwrap_err();
            assert_eq!(e.status, 400, "{k}: {e:?}");
            assert_eq!(e.param.as_deref(), Some(k), "{e:?}");
            assert!(e.message.contains(k), "{e:?}");
        }
        // Defaults of unsupported parameters pass.
        let mut b = base();
        b["n"] = serde_json::json!(1);
        b["logprobs"] = serde_json::json!(false);
        b["presence_penalty"] = serde_json::json!(0);
        b["tools"] = serde_json::json!([]);
        chat(b).unwrap();
    }

    #[test]
    fn penalties_bias_choices_and_max_completion_tokens() {
        let r = chat(
            serde_json::json!({"model":"tandem","messages":[{"role":"user","content":"hi"}],
            "n": 3, "presence_penalty": 0.5, "frequency_penalty": -1.25,
            "logit_bias": {"7": -100, " 3": 2.5}, "max_completion_tokens": 9, "max_tokens": 9}),
        )
        .unwrap();
        assert_eq!((r.n, r.max_tokens), (3, 9));
        assert_eq!(r.sampling.presence_penalty, 0.5);
        assert_eq!(r.sampling.frequency_penalty, -1.25);
        assert_eq!(r.sampling.logit_bias.entries(), &[(3, 2.5), (7, -100.0)]);
        let e = chat(
            serde_json::json!({"model":"tandem","messages":[{"role":"user","content":"hi"}],
            "max_completion_tokens": 9, "max_tokens": 8}),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_completion_tokens"), "{e:?}");
        assert_eq!(choice_seed(42, 0), 42);
        let r = chat(
            serde_json::json!({"model":"tandem","messages":[{"role":"user","content":"hi"}],
            "logprobs": true, "top_logprobs": 3}),
        )
        .unwrap();
        assert_eq!(r.logprobs, Some(3));
        let c = parse_completion(
            serde_json::json!({"model":"tandem","prompt":"x","logprobs":2})
                .to_string()
                .as_bytes(),
            &LIM,
        )
        .unwrap();
        assert_eq!(c.logprobs, Some(2));
        let e = parse_completion(
            serde_json::json!({"model":"tandem","prompt":"x","logprobs":6})
                .to_string()
                .as_bytes(),
            &LIM,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        assert_ne!(choice_seed(42, 1), choice_seed(42, 2));
    }

    #[test]
    fn unknown_fields_are_ignored_and_named_unless_strict() {
        let lenient = Limits {
            strict: false,
            ..LIM
        };
        let body = serde_json::json!({"model":"tandem","cache_prompt":true,"bogus":{"x":1},
            "stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true},
            "messages":[{"role":"user","content":"hi","foo":1,"tool_calls":[],"refusal":null}]});
        let r = parse_chat(body.to_string().as_bytes(), &lenient).unwrap();
        assert_eq!(
            r.ignored,
            [
                "bogus",
                "cache_prompt",
                "messages[0].foo",
                "stream_options.continuous_usage_stats"
            ]
        );
        assert!(r.include_usage);
        // Strict: the first unknown field is a 400 naming it.
        let e = parse_chat(body.to_string().as_bytes(), &LIM).unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.param.as_deref(), Some("bogus"), "{e:?}");
        // Known but unsupported stays a 400 in lenient mode.
        let mut b =
            serde_json::json!({"model":"tandem","messages":[{"role":"user","content":"hi"}]});
        b["response_format"] = serde_json::json!({"type": "xml"});
        let e = parse_chat(b.to_string().as_bytes(), &lenient).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format.type"), "{e:?}");
        assert_eq!(e.code, Some("unsupported_parameter"));
        b["response_format"] = serde_json::json!({"type": "json_object"});
        let r = parse_chat(b.to_string().as_bytes(), &lenient).unwrap();
        assert_eq!(
            r.format.map(|f| f.spec),
            Some(tandem_grammar::GrammarSpec::JsonObject)
        );
        let b = serde_json::json!({"model":"tandem","messages":[{"role":"assistant","content":"",
            "tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]}]});
        let r = parse_chat(b.to_string().as_bytes(), &lenient).unwrap();
        let Input::Chat(m) = &r.input else {
            panic!("{r:?}")
        };
        assert_eq!(m[0].tool_calls[0].arguments, serde_json::json!({}));
        let b = serde_json::json!({"model":"tandem","messages":[{"role":"user","content":"",
            "function_call":{"name":"f","arguments":"{}"}}]});
        let e = parse_chat(b.to_string().as_bytes(), &lenient).unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].function_call"),
            "{e:?}"
        );
        let c = serde_json::json!({"model":"tandem","prompt":"x","n_predict":4});
        let r = parse_completion(c.to_string().as_bytes(), &lenient).unwrap();
        assert_eq!(r.ignored, ["n_predict"]);
    }

    #[test]
    fn unknown_model_is_404() {
        let e =
            chat(serde_json::json!({"model":"gpt-4","messages":[{"role":"user","content":"hi"}]}))
                .unwrap_err();
        assert_eq!(e.status, 404);
        assert_eq!(e.code, Some("model_not_found"));
    }
}
