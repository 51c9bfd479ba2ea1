//! Locating, fetching and loading the real models; the chat prompt's tokens; process memory.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::inspect::{check_pair, inspect, ModelInfo};
use tandem_fetch::{
    ensure_model, fetch, models_dir, resolve_name, FetchOptions, ModelRef, ModelRole, Progress,
};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};

/// The model file: an explicit argument ([`resolve_model_arg`]), else the
/// role's cached model, fetched on first use.
pub fn resolve_model(role: ModelRole, explicit: Option<&PathBuf>) -> Result<PathBuf> {
    match explicit {
        Some(p) => resolve_model_arg(p),
        None => ensure_model(role, Progress::Auto)
            .with_context(|| format!("getting the {role:?} model")),
    }
}

/// A draft and a target that pair, resolved and inspected before anything
/// starts (the demo, the lab): [`resolve_model`] for each (fetched on first
/// use), then [`crate::inspect::check_pair`]; the error names both files and
/// why they do not pair.
pub struct ResolvedPair {
    pub draft: PathBuf,
    pub draft_info: ModelInfo,
    pub target: PathBuf,
    pub target_info: ModelInfo,
}

pub fn resolve_pair(draft: Option<&PathBuf>, target: Option<&PathBuf>) -> Result<ResolvedPair> {
    let target = resolve_model(ModelRole::Target, target)?;
    let draft = resolve_model(ModelRole::Draft, draft)?;
    let (draft_info, target_info) = (inspect(&draft)?, inspect(&target)?);
    check_pair(&draft_info, &target_info).map_err(|e| {
        anyhow::anyhow!(
            "the draft {} cannot pair with the target {}: {e}",
            draft.display(),
            target.display()
        )
    })?;
    Ok(ResolvedPair {
        draft,
        draft_info,
        target,
        target_info,
    })
}

/// What a user typed where a model is taken (`--draft-model`,
/// `--target-model`, `models info`, ...): a GGUF path; a built-in name
/// (`draft`, `target`, `gemma`, `smollm2`: fetched on first use); or the name
/// of a GGUF they put in the models directory (its file stem; `tandem models
/// list` shows them). The one rule: `tandem_fetch::resolve_name`.
pub fn resolve_model_arg(given: &Path) -> Result<PathBuf> {
    if given.is_file() {
        return Ok(given.to_path_buf());
    }
    let text = given.to_string_lossy();
    let dir = models_dir();
    match resolve_name(&text, &dir) {
        Ok(ModelRef::File(p)) => Ok(p),
        Ok(ModelRef::Builtin(spec)) => {
            let opts = FetchOptions::from_env(Progress::Auto, false);
            fetch(&spec, &dir, &opts)
                .map(|o| o.path)
                .with_context(|| format!("getting the built-in model `{}`", spec.name))
        }
        Err(e) if given.components().count() > 1 || given.extension().is_some() => Err(
            anyhow::anyhow!("model file {} does not exist ({e})", given.display()),
        ),
        Err(e) => Err(e.into()),
    }
}

/// A loaded model with its load time.
pub struct Loaded {
    pub model: Model,
    pub load_ms: f64,
}

pub fn load_model(
    role: ModelRole,
    explicit: Option<&PathBuf>,
    max_seq_len: usize,
) -> Result<Loaded> {
    let path = resolve_model(role, explicit)?;
    let t = Instant::now();
    let model = Model::load(&path, LoadOptions::with_max_seq_len(max_seq_len))
        .with_context(|| format!("loading {}", path.display()))?;
    Ok(Loaded {
        model,
        load_ms: t.elapsed().as_secs_f64() * 1000.0,
    })
}

pub fn tokenizer_of(model: &Model) -> Result<Tokenizer> {
    Tokenizer::from_gguf(model.gguf()).context("building the tokenizer from the GGUF")
}

/// Prompt tokens: the ChatML conversation (optional system + user), or the raw
/// text when `raw`.
pub fn prompt_tokens(
    tok: &Tokenizer,
    prompt: &str,
    system: Option<&str>,
    raw: bool,
) -> Result<Vec<u32>> {
    if raw {
        return Ok(tok.encode_prompt(prompt)?);
    }
    let mut msgs = Vec::new();
    if let Some(s) = system {
        msgs.push(ChatMessage::system(s));
    }
    msgs.push(ChatMessage::user(prompt));
    Ok(tok.encode_chat(&msgs, true)?)
}

/// Peak resident set size of this process in bytes (Linux), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_bytes("self", "VmHWM:")
}

/// A memory line of `/proc/<pid>/status` (`pid` = "self" or a number), e.g.
/// `VmHWM:` or `VmRSS:`, in bytes (Linux); None when unreadable.
pub fn proc_status_bytes(pid: &str, key: &str) -> Option<u64> {
    let [bytes] = proc_status_bytes_of(pid, [key]);
    bytes
}

/// Several memory lines of `/proc/<pid>/status` ([`proc_status_bytes`]),
/// from one reading of the file, so they describe the same instant.
pub fn proc_status_bytes_of<const N: usize>(pid: &str, keys: [&str; N]) -> [Option<u64>; N] {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok();
    keys.map(|key| {
        let line = status.as_deref()?.lines().find(|l| l.starts_with(key))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        kb.checked_mul(1024)
    })
}
