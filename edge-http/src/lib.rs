//! `tandem-edge-http`: the device's local HTTP APIs around a
//! [`tandem_edge::RoutedRuntime`], for hosts that run a server on the device
//! (`tandem serve-edge`). Kept out of `tandem-edge` so that the library an app
//! embeds (and the C ABI over it) links no HTTP server.
//!
//! - [`openai`]: the OpenAI-compatible server (`/v1/chat/completions` with SSE
//!   streaming, `/v1/completions`, `/v1/models`; reference `docs/api.md`), with
//!   the admin API mounted under `/admin`;
//! - [`admin`]: the admin API (policy get/replace, explain, route stats) and the
//!   policy file hot reload (`docs/privacy.md`), also servable on its own;
//! - [`bearer`]: reading and comparing the bearer tokens both APIs take.

pub mod admin;
pub mod bearer;
pub mod openai;
