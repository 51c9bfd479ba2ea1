//! `tandem-verifier`: Tandem's cloud verifier.
//!
//! Holds the target model and, per device session, the target's KV cache in a
//! bounded [`store::SessionStore`] (byte budget, LRU eviction, idle TTL, session
//! cap). Devices drive sessions over the `tandem.verifier.v1.Verifier/Session` gRPC
//! stream (see `tandem-proto`): a verify is one forward over `[last, d1..dk]` on a
//! blocking thread, a greedy or lossless rejection-sampling verdict from
//! `tandem-model`, and the KV cache rolled back to the accepted prefix.
//!
//! Around it: TLS with rustls (optional mutual TLS), per-device bearer tokens (a
//! session is bound to the identity that opened it), limits with machine-readable
//! refusal reasons, `grpc.health.v1` and reflection, an admin HTTP port (`/healthz`,
//! `/readyz`, `/metrics`), and graceful shutdown. Split sessions ([`split`]) run
//! only the target's layers `[s, N)` on hidden states the device computed.
//! Configured by one TOML file ([`config::VerifierConfig`], documented in
//! `docs/verifier.md`).

pub mod config;
pub mod error;
pub mod metrics;
pub mod server;
pub mod service;
pub mod split;
pub mod store;

pub use config::VerifierConfig;
pub use error::{reason_of, Refusal};
pub use server::{model_fingerprint, start, RunningVerifier, ServeError};
