//! `tandem-verifier`: Tandem's cloud verifier.
//!
//! Serves many devices from one target model. Devices drive sessions over the
//! `tandem.verifier.v1.Verifier/Session` gRPC stream (see `tandem-proto`); a
//! verify is one forward over `[last, d1..dk]`, a verdict against the target's
//! own greedy or keyed-sampled tokens ([`tandem_model::verify::verdict_from_logits`]),
//! and the KV rolled back to the accepted prefix.
//!
//! Where things are (the module graph is acyclic, leaves first):
//! - [`session`]: one session's state (KV pages, context, rounds).
//! - [`store`]: the bounded session store (byte budget over pages held, LRU,
//!   per-identity quotas, idle TTL) and the checkout guard.
//! - [`split`]: split sessions (layers `[s, N)` on the device's hidden states).
//! - [`scheduler`]: one thread owns the model and packs many sessions' verify
//!   blocks, streaming steps and prefill chunks into each forward.
//! - [`admission`]: per-identity message and prefill-token rates, the
//!   in-flight prefill budget.
//! - [`state`]: the shared state struct; [`handlers`]: one per message kind;
//!   [`service`]: the stream loop; [`auth`]: the bearer-token interceptor.
//! - [`heap`]: the allocator's live and free bytes, for `/metrics`.
//! - [`admin`]: `/healthz`, `/readyz`, `/metrics` as an axum router;
//!   [`connections`]: the connection cap; [`server`]: putting it together
//!   (TLS, keepalive, stream caps, drain).
//!
//! Configured by one TOML file ([`config::VerifierConfig`], documented in
//! `docs/verifier.md`).

pub mod admin;
pub mod admission;
pub mod auth;
pub mod config;
pub mod connections;
pub mod error;
pub mod handlers;
pub mod heap;
mod lock;
pub mod metrics;
pub mod scheduler;
pub mod server;
pub mod service;
pub mod session;
pub mod split_session;
pub mod state;
pub mod store;
pub mod watch_auth;

pub use config::VerifierConfig;
pub use error::{reason_of, Refusal};
pub use server::{model_fingerprint, start, RunningVerifier, ServeError};
