//! Assembling a device runtime: [`assemble`], the one function every
//! embedding calls (the C ABI and through it JNI, `tandem generate
//! --verifier`, `serve-edge`, `demo`, the lab's device, the bench).
//!
//! From an [`AssemblyConfig`] (the draft GGUF, an optional split target,
//! the KV capacity, the privacy policy file or the built-in one, the
//! [`EdgeConfig`] knobs) it does, in this order:
//!
//! 1. the privacy policy (the file, else the built-in one);
//! 2. the draft model, and its tokenizer (from the GGUF);
//! 3. the split target, when the config has `[split]`;
//! 4. [`EdgeRuntime::builder`] with the split target and the router in
//!    front ([`crate::RoutedRuntimeBuilder::build`]: the config is checked
//!    there).
//!
//! It returns the [`RoutedRuntime`] with what every caller needs beside it
//! ([`Assembled`]: the tokenizer, the chat stop tokens, whether turns ask
//! the router). A failure is an [`AssemblyError`] naming the file and the
//! model's role. What the callers need differently is an option here, not a
//! second copy: a draft already loaded ([`ModelSource::Loaded`]: the lab's
//! device builds runtimes of several configs over one load), the warm-up
//! (`EdgeConfig::warmup`). Generation slots beside a runtime are its
//! siblings ([`RoutedRuntime::sibling`]), not new assemblies.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tandem_model::tokenizer::Tokenizer;
use tandem_model::transformer::{LoadOptions, Model};
use tandem_model::ModelError;
use tandem_router::{PolicyError, Router};

use crate::config::EdgeConfig;
use crate::error::EdgeError;
use crate::privacy::RoutedRuntime;
use crate::runtime::EdgeRuntime;

/// Which of the device's models a file is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelRole {
    /// The small model the device drafts with.
    Draft,
    /// The target whose first layers the device runs (split execution).
    Target,
}

impl fmt::Display for ModelRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Draft => "draft",
            Self::Target => "target",
        })
    }
}

/// Where the draft comes from.
#[derive(Clone)]
pub enum ModelSource {
    /// A GGUF file, loaded with the config's `max_seq_len`.
    File(PathBuf),
    /// A model loaded before (its tokenizer is read from it again): several
    /// runtimes of different configs over one load.
    Loaded(Arc<Model>),
}

impl From<PathBuf> for ModelSource {
    fn from(p: PathBuf) -> Self {
        Self::File(p)
    }
}

impl From<Arc<Model>> for ModelSource {
    fn from(m: Arc<Model>) -> Self {
        Self::Loaded(m)
    }
}

/// What [`assemble`] builds a device runtime from.
#[derive(Clone)]
pub struct AssemblyConfig {
    /// The draft model.
    pub draft: ModelSource,
    /// The target GGUF whose first layers the device runs: required by
    /// `edge.split`, refused without it.
    pub split_target: Option<PathBuf>,
    /// KV cache capacity, in tokens, of the models loaded from files.
    pub max_seq_len: usize,
    /// The privacy policy TOML (`docs/privacy.md`); `None`: the built-in one.
    pub policy: Option<PathBuf>,
    /// Turns ask the privacy router before anything is sent (it only
    /// matters with a verifier: [`Assembled::routes`]).
    pub privacy_router: bool,
    /// The runtime's knobs (`docs/edge.md`).
    pub edge: EdgeConfig,
}

impl AssemblyConfig {
    /// The draft with the default knobs: no split, a 2048-token KV cache,
    /// the built-in policy, the router on.
    pub fn new(draft: impl Into<ModelSource>) -> Self {
        Self {
            draft: draft.into(),
            split_target: None,
            max_seq_len: 2048,
            policy: None,
            privacy_router: true,
            edge: EdgeConfig::default(),
        }
    }
}

/// A device runtime and what its callers need beside it.
pub struct Assembled {
    pub routed: RoutedRuntime,
    /// The draft's tokenizer (the chat template, decoding).
    pub tokenizer: Tokenizer,
    /// The tokens that end a chat turn ([`Tokenizer::chat_stop_tokens`]).
    pub stop_tokens: Vec<u32>,
    /// Whether turns ask the router ([`crate::privacy::Routing::Router`]):
    /// the config's `privacy_router` and a verifier to send to. Without a
    /// verifier nothing can leave the device: there is nothing to decide.
    pub routes: bool,
    /// How long loading the draft took (0 for [`ModelSource::Loaded`]).
    pub draft_load_ms: f64,
}

/// Why [`assemble`] failed; each says which file and which model.
#[derive(Debug, thiserror::Error)]
pub enum AssemblyError {
    /// A model file is not there.
    #[error("{role} model {} does not exist", path.display())]
    MissingModel { role: ModelRole, path: PathBuf },
    /// A model file is there but does not load (not a GGUF, unsupported ...).
    #[error("loading the {role} model {}: {source}", path.display())]
    LoadModel {
        role: ModelRole,
        path: PathBuf,
        source: ModelError,
    },
    /// The draft GGUF carries no tokenizer the runtime can use.
    #[error("the draft model has no usable tokenizer: {0}")]
    Tokenizer(ModelError),
    /// The privacy policy file cannot be read ([`PolicyError::Io`]) or is
    /// not a valid policy.
    #[error("privacy policy {}: {source}", path.display())]
    Policy { path: PathBuf, source: PolicyError },
    /// The runtime refused the config ([`crate::RoutedRuntimeBuilder::build`]).
    #[error(transparent)]
    Runtime(#[from] EdgeError),
}

fn load(role: ModelRole, path: &Path, max_seq_len: usize) -> Result<Model, AssemblyError> {
    if !path.exists() {
        return Err(AssemblyError::MissingModel {
            role,
            path: path.to_path_buf(),
        });
    }
    Model::load(path, LoadOptions::with_max_seq_len(max_seq_len)).map_err(|source| {
        AssemblyError::LoadModel {
            role,
            path: path.to_path_buf(),
            source,
        }
    })
}

/// Builds the routed device runtime `cfg` describes (see the module docs).
pub fn assemble(cfg: AssemblyConfig) -> Result<Assembled, AssemblyError> {
    let router = match &cfg.policy {
        Some(p) => Router::from_file(p).map_err(|source| AssemblyError::Policy {
            path: p.clone(),
            source,
        })?,
        None => Router::with_default_policy(),
    };
    let t = Instant::now();
    let (draft, draft_load_ms) = match cfg.draft {
        ModelSource::File(p) => (
            Arc::new(load(ModelRole::Draft, &p, cfg.max_seq_len)?),
            t.elapsed().as_secs_f64() * 1000.0,
        ),
        ModelSource::Loaded(m) => (m, 0.0),
    };
    let tokenizer = Tokenizer::from_gguf(draft.gguf()).map_err(AssemblyError::Tokenizer)?;
    let stop_tokens = tokenizer.chat_stop_tokens();
    let routes = cfg.privacy_router && cfg.edge.verifier_url.is_some();
    let mut edge = EdgeRuntime::builder(draft, cfg.edge);
    if let Some(p) = &cfg.split_target {
        edge = edge.split_target(Arc::new(load(ModelRole::Target, p, cfg.max_seq_len)?));
    }
    let routed = edge.router(Arc::new(router), tokenizer.clone()).build()?;
    Ok(Assembled {
        routed,
        tokenizer,
        stop_tokens,
        routes,
        draft_load_ms,
    })
}
