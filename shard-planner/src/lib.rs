//! tandem-shard: the shard planner. Given per-layer costs (a measured
//! [`profile::ModelProfile`]), a set of nodes with memory budgets and the links
//! between them ([`cluster::ClusterConfig`], with named [`NetworkProfile`]s),
//! it decides which node runs which layer of the model.
//!
//! It is pure computation on data: no model, no network, no async.
//!
//! - [`PlanProblem`] is the numeric problem and [`PlanProblem::evaluate`] the
//!   cost model (which placements are allowed and what they cost);
//! - [`solve`] is the exact dynamic program for the [`Objective::Latency`] and
//!   [`Objective::Throughput`] objectives, with the embedding pinned to the
//!   device and optionally the head too (U-shape);
//! - [`brute_force::solve`] is the exhaustive reference the tests compare with;
//! - [`split`] evaluates the two-node split points the runtime executes (device
//!   `[0, s)`, server `[s, N)`, head on either) with the same cost model.
//!
//! The recurrence, state and complexity are in `docs/shard-planner.md`.

pub mod brute_force;
pub mod cluster;
mod dp;
mod error;
pub mod network;
pub mod problem;
pub mod profile;
pub mod report;
pub mod two_node;

pub use cluster::ClusterConfig;
pub use cluster::PlanOptions;
pub use dp::{diagnose, solve, solve_with_fallback, FallbackSearch, Plan, MAX_NODES};
pub use error::PlanError;
pub use network::{NetworkProfile, NETWORK_PROFILES};
pub use problem::{Evaluation, LayerCost, LinkCost, NodeCost, Objective, PlanProblem, Transfer};
pub use profile::ModelProfile;
pub use report::PlanReport;
