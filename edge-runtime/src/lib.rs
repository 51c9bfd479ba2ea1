//! `tandem-edge`: Tandem's device runtime, a library the app embeds.
//!
//! The device keeps the small **draft** model; [`EdgeRuntime::generate`] runs the
//! speculative loop with the target replaced by the remote cloud verifier
//! (`tandem.verifier.v1`, see `tandem-proto`): open a session, stream draft blocks,
//! apply verdicts, roll the draft KV cache back. Every emitted token carries a
//! [`TokenStatus`]: `Verified` (came through a verdict, so in greedy mode it is the
//! target's own token), `Provisional` (drafted alone while the verifier was
//! unreachable) or `Local` (the whole request ran on the device).
//!
//! Around the loop: per-verify deadlines derived from the measured RTT
//! ([`breaker::RttTracker`]), retries with exponential backoff, and a circuit breaker
//! ([`breaker::CircuitBreaker`]) whose half-open transition is driven by a background
//! `grpc.health.v1` probe. After an outage the session resumes on the same
//! generation by re-sending its context, the provisional span is checked by the
//! verifier (a verify-only pass) and the differences are reported. Configured by
//! one TOML-loadable [`EdgeConfig`] (documented in `docs/edge.md`).
//!
//! In front of it, [`privacy::RoutedRuntime`] asks the privacy router
//! (`tandem-router`) before any session is opened: `local` conversations are
//! answered by the draft alone and nothing leaves the device. [`split`] runs
//! the target's first layers on the device when the config has `[split]`.
//! [`assemble`] is the one way to put a device runtime together from files
//! (policy, draft, tokenizer, split target, router; [`assembly`]), over
//! [`EdgeRuntime::builder`] (loaded models); [`RoutedRuntime::turn`] is the
//! one entry point of a turn (route, then generate). [`device`] holds what the app
//! reports about the phone (thermal, battery, power save) and the pure policy
//! that turns it into fewer draft threads and a smaller k.
//!
//! This is the library an app embeds (directly or through the C ABI,
//! `tandem-capi`), so it carries no HTTP server: the local OpenAI-compatible
//! server and the admin API are `tandem-edge-http`. [`loopback`] is the one
//! rule of which hosts are this machine (plain-text verifier URLs here, the
//! OpenAI server's `Host` allow-list there).

pub mod adaptive;
pub mod assembly;
pub mod breaker;
pub mod builder;
pub mod client;
mod codec;
pub mod config;
pub mod context_policy;
pub mod conversation;
pub mod device;
pub mod device_layers;
pub mod error;
pub mod loopback;
mod mtls_probe;
pub mod open_load;
pub mod privacy;
mod report;
pub mod runtime;
pub mod second_opinion;
mod split_report;

pub use assembly::{assemble, Assembled, AssemblyConfig, AssemblyError, ModelSource};
pub use breaker::{BreakerState, CircuitBreaker, RttTracker};
pub use builder::{EdgeRuntimeBuilder, RoutedRuntimeBuilder};
pub use config::EdgeConfig;
pub use conversation::{ConversationConfig, ConversationStats};
pub use device::{DeviceAdjustments, DeviceState, SharedDeviceState, ThermalState};
pub use error::EdgeError;
pub use privacy::{RoutedDecision, RoutedGeneration, RoutedRuntime, RoutedTurn, Routing, Turn};
pub use runtime::{
    CatchUp, EdgeEvent, EdgeGeneration, EdgeRuntime, EdgeStats, ProvisionalCheck,
    ProvisionalReport, TokenStatus, CATCH_UP_CHUNK,
};
pub use second_opinion::{DraftOpinion, DraftOpinionError, JudgedPromptKv, Judgement};
