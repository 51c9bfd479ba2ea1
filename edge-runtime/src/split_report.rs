//! [`SplitReport`]: what a generation reports about its split execution (in
//! `EdgeStats::split`). Plain data in a leaf module, so that the block codec
//! (`crate::codec`) and split execution (`crate::split`, which implements
//! the codec) both name it without importing each other.

use serde::{Deserialize, Serialize};

/// What a generation reports about its split (in `EdgeStats::split`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SplitReport {
    /// s of the last session.
    pub layer: usize,
    pub n_layer: usize,
    pub pin_head: bool,
    /// "f32" or "f16".
    pub hidden_format: String,
    /// True with f16 hidden states: output may differ from the target's.
    pub lossy: bool,
    pub auto: bool,
    /// Times `auto` chose a different s mid-run.
    pub replans: u32,
    /// Rounds that ran entirely on the device (U-shape at s = N: no exchange).
    pub local_rounds: u64,
    /// Device-side time of each verify round: target layers `[0, s)`, the
    /// exchange, and (U-shape) the head + verdict; ms.
    pub round_ms: Vec<f64>,
    /// The device's own compute in each round (layers `[0, s)`, and the head
    /// when pinned), ms.
    pub device_ms: Vec<f64>,
    /// The cost model's prediction of one round of the last session's s (when a
    /// profile is configured) on the configured link (`initial_rtt_ms`,
    /// `up_mbps`, `down_mbps`, `server_speed`), and its parts, ms: device compute,
    /// server compute, network (half RTT + bytes / bandwidth per crossing, and
    /// `round_overhead_ms` when the round crosses the link).
    pub predicted_round_ms: Option<f64>,
    pub predicted_device_ms: Option<f64>,
    pub predicted_server_ms: Option<f64>,
    pub predicted_network_ms: Option<f64>,
    /// Network RTT estimate (round time minus the model's compute and
    /// serialisation), smoothed when `auto`; ms.
    pub rtt_estimate_ms: Option<f64>,
}
