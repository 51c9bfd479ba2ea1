//! What the `tandem` binary and its command crates (`tandem-lab`,
//! `tandem-bench`) share: finding, fetching and loading the real models, the
//! chat prompt's tokens, a process's memory from `/proc`, the CPU's name (`host`),
//! where two generations' tokens first differ (`compare`), what a GGUF file is
//! and whether two pair (`inspect`), and the netsim link-condition flags.
//!
//! Like the command crates it serves, it reports errors as `anyhow::Error`:
//! its callers are command implementations that only print them.

pub mod compare;
pub mod host;
pub mod inspect;
pub mod link_overrides;
pub mod models;
