//! The one error type of the crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading inputs or planning.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file is not valid JSON/TOML of the expected shape.
    #[error("cannot parse {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// The layer profile is well-formed but inconsistent.
    #[error("invalid profile: {0}")]
    InvalidProfile(String),
    /// The nodes/links config is well-formed but inconsistent.
    #[error("invalid nodes config: {0}")]
    InvalidNodes(String),
    /// A numeric planning problem violates its own invariants.
    #[error("invalid planning problem: {0}")]
    InvalidProblem(String),
    /// Inputs are valid but no assignment satisfies the constraints.
    #[error("infeasible: {0}")]
    Infeasible(String),
}
