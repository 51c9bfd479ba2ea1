//! Errors of the edge runtime.

use std::path::PathBuf;

/// Why a generation (or the runtime) failed. Outages are not errors: they turn
/// into provisional tokens. These are the conditions the device cannot work around.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("edge config: {0}")]
    Config(String),
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("draft model: {0}")]
    Model(#[from] tandem_model::ModelError),
    /// The verifier's certificate was not trusted (or the TLS setup is wrong).
    #[error("TLS with the verifier failed: {0}")]
    Tls(String),
    /// The verifier refused the session for a reason retrying cannot fix
    /// (`reason` is a `tandem.verifier.v1.Reason` name).
    #[error("verifier refused: {reason}: {message}")]
    Refused { reason: String, message: String },
    /// The verifier broke the protocol (e.g. a verdict for the wrong round).
    #[error("verifier protocol violation: {0}")]
    Protocol(String),
    #[error("async runtime: {0}")]
    Runtime(String),
}
