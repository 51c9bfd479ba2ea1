//! tandem-netsim: a network simulator for testing Tandem over bad links.
//!
//! A TCP proxy sits between the device (the proxy's client) and a server
//! (the upstream) and injects, independently per direction:
//!
//! - **latency** with **jitter** (uniform or normal), drawn per chunk from a
//!   seeded RNG — the same seed gives the same delays ([`LinkSchedule`]);
//! - a **bandwidth** limit (token bucket);
//! - **packet loss**, emulated as retransmission stalls: a chunk is held by an
//!   RTO with probability `loss`, and everything behind it waits (TCP order);
//! - **outages** (blackhole): connections are still accepted and read, nothing
//!   is forwarded or closed; held data flows once the link is back;
//! - **resets**: both ends get an RST (`SO_LINGER` 0), randomly per chunk or
//!   on command;
//! - **slow close**: a FIN is passed on late.
//!
//! Order within a direction is always preserved. Conditions come from named
//! [`PROFILES`] (`loopback`, `lan`, `wifi`, `fast-4g`, `slow-4g`, `3g`,
//! `satellite`, plus `offline`; sources in `docs/network-profiles.md`) or
//! explicit [`NetConfig`]s, and can change over time with a [`Timeline`]
//! such as `"wifi 5s, offline 10s, fast-4g"`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), tandem_netsim::NetsimError> {
//! use tandem_netsim::{NetConfig, Proxy, Timeline};
//! let upstream = "127.0.0.1:50051".parse().unwrap();
//! let proxy = Proxy::start("127.0.0.1:0".parse().unwrap(), upstream,
//!                          NetConfig::profile("fast-4g")?).await?;
//! // Point the client at proxy.local_addr() instead of the upstream.
//! proxy.set_timeline(Timeline::parse("wifi 5s, offline 10s, fast-4g")?);
//! proxy.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! The standalone form is `tandem netsim --listen A --upstream B --profile P`.

mod config;
mod error;
mod proxy;
mod schedule;
mod timeline;

pub use config::{
    profile_names, Direction, Jitter, LinkConfig, NamedProfile, NetConfig, DEFAULT_BURST_BYTES,
    DEFAULT_RTO, OFFLINE, PROFILES,
};
pub use error::NetsimError;
pub use proxy::{Proxy, ProxyHandle, ProxyStats, DEFAULT_MAX_CONNECTIONS};
pub use schedule::{link_seed, ChunkPlan, LinkSchedule};
pub use timeline::{parse_duration, Segment, Step, Timeline};
