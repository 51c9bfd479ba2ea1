//! The crate's one error type.

use std::net::SocketAddr;

/// What can go wrong configuring or starting the simulator.
#[derive(Debug, thiserror::Error)]
pub enum NetsimError {
    /// A profile name that is not in the table.
    #[error("unknown network profile `{name}` (known: {known})")]
    UnknownProfile {
        /// The name given.
        name: String,
        /// The names accepted.
        known: String,
    },
    /// A timeline that does not parse.
    #[error("invalid timeline `{timeline}`: {reason}")]
    InvalidTimeline {
        /// The text given.
        timeline: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Link conditions out of range.
    #[error("invalid network config: {0}")]
    InvalidConfig(String),
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// `Proxy::start` was called outside a tokio runtime.
    #[error("the proxy must be started inside a tokio runtime")]
    NoRuntime,
}
