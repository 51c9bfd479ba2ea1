//! The two-node case the runtime executes: the device runs the embedding and
//! blocks `[0, s)`, the server runs blocks `[s, N)` and the head, or (U-shape,
//! `pin_head`) the head runs back on the device. This is one family of the
//! assignments [`PlanProblem::evaluate`] allows; here every split point is
//! evaluated with that same cost model, so a prediction for a given `s` is exactly
//! what `tandem plan` would charge for that assignment.
//!
//! Calibration (as EdgeShard does it: every node gets a *measured* profile): the
//! server's compute comes from a profile measured on the server when one is
//! given, else from the device's profile divided by `server_speed`; and a
//! measured fixed cost per exchange (`round_overhead_ms`: gRPC framing, hidden
//! state encode/decode, the verifier's session bookkeeping) is charged like extra
//! round-trip time, half on each crossing, whenever a round crosses the link.

use crate::problem::{Evaluation, LayerCost, LinkCost, NodeCost, Objective, PlanProblem};
use crate::profile::ModelProfile;
use crate::PlanError;

/// Index of the device node in [`two_node_problem`]'s problem.
pub const DEVICE: usize = 0;
/// Index of the server node.
pub const SERVER: usize = 1;

/// The link and the server as the device sees them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TwoNodeLink {
    /// Round-trip time in ms (one crossing costs half).
    pub rtt_ms: f64,
    /// Device -> server Mbit/s.
    pub up_mbps: f64,
    /// Server -> device Mbit/s.
    pub down_mbps: f64,
    /// Server speed relative to the profile it uses (the server's own profile
    /// when given, else the device's; 1 = as profiled).
    pub server_speed: f64,
    /// Fixed cost of one exchange (request + answer) on top of the RTT, ms:
    /// charged half per crossing, so a round with a split pays it once and an
    /// all-local round not at all.
    pub round_overhead_ms: f64,
}

/// The profile's compute times for `block_tokens`, or for the nearest block size
/// it has (ties: the larger), with the size used.
pub fn nearest_block(profile: &ModelProfile, block_tokens: u32) -> Result<u32, PlanError> {
    profile
        .block_sizes
        .iter()
        .copied()
        .min_by_key(|b| (b.abs_diff(block_tokens), u32::MAX - b))
        .ok_or_else(|| PlanError::InvalidProfile("profile has no block sizes".into()))
}

/// A device + server problem (memory unbounded: the runtime's device holds the
/// whole target file mapped anyway) for one forward of `block_tokens` tokens.
/// `profile` is measured on the device; `server`, if given, on the server (same
/// layers), else the server runs the device's profile `server_speed` times faster.
pub fn two_node_problem(
    profile: &ModelProfile,
    server: Option<&ModelProfile>,
    link: &TwoNodeLink,
    block_tokens: u32,
    pin_head: bool,
) -> Result<PlanProblem, PlanError> {
    profile.validate()?;
    let bad = |m: String| Err(PlanError::InvalidNodes(m));
    if let Some(sp) = server {
        sp.validate()?;
        if !profile.same_layers(sp) {
            return Err(PlanError::InvalidProfile(format!(
                "server profile '{}' does not have the device profile's layers ({} vs {})",
                sp.model,
                sp.layers.len(),
                profile.layers.len()
            )));
        }
    }
    if !(link.up_mbps > 0.0
        && link.down_mbps > 0.0
        && link.up_mbps.is_finite()
        && link.down_mbps.is_finite())
    {
        return bad(format!(
            "bandwidth must be positive: up {} down {} Mbit/s",
            link.up_mbps, link.down_mbps
        ));
    }
    if !(link.rtt_ms.is_finite() && link.rtt_ms >= 0.0) {
        return bad(format!("rtt_ms must be >= 0, got {}", link.rtt_ms));
    }
    if !(link.round_overhead_ms.is_finite() && link.round_overhead_ms >= 0.0) {
        return bad(format!(
            "round_overhead_ms must be >= 0, got {}",
            link.round_overhead_ms
        ));
    }
    if !(link.server_speed.is_finite() && link.server_speed > 0.0) {
        return bad(format!(
            "server_speed must be positive, got {}",
            link.server_speed
        ));
    }
    let compute = profile.compute_for_block(nearest_block(profile, block_tokens)?)?;
    let server_compute = match server {
        Some(sp) => sp.compute_for_block(nearest_block(sp, block_tokens)?)?,
        None => compute.clone(),
    };
    let layers = profile
        .layers
        .iter()
        .map(|l| LayerCost {
            name: l.name.clone(),
            memory_bytes: l.weight_bytes,
            cut_bytes: l.activation_bytes_per_token as f64 * f64::from(block_tokens),
        })
        .collect();
    let node = |name: &str, times: &[f64], f: f64| NodeCost {
        name: name.into(),
        memory_budget_bytes: u64::MAX,
        compute_s: times.iter().map(|c| c / f).collect(),
    };
    let half = (link.rtt_ms + link.round_overhead_ms) / 2.0 / 1e3;
    let up = LinkCost {
        one_way_latency_s: half,
        bytes_per_s: link.up_mbps * 1e6 / 8.0,
    };
    let down = LinkCost {
        one_way_latency_s: half,
        bytes_per_s: link.down_mbps * 1e6 / 8.0,
    };
    Ok(PlanProblem {
        layers,
        nodes: vec![
            node("device", &compute, 1.0),
            node("server", &server_compute, link.server_speed),
        ],
        links: vec![vec![None, Some(up)], vec![Some(down), None]],
        device: DEVICE,
        pin_head,
    })
}

/// The assignment of split point `s` over `embedding, blk.0..blk.N-1, head`.
pub fn split_assignment(n_blocks: usize, s: usize, pin_head: bool) -> Vec<usize> {
    let mut a = Vec::with_capacity(n_blocks + 2);
    a.push(DEVICE);
    for i in 0..n_blocks {
        a.push(if i < s { DEVICE } else { SERVER });
    }
    a.push(if pin_head { DEVICE } else { SERVER });
    a
}

/// The cost model's itemised time of split point `s` (`0 <= s <= N`).
pub fn evaluate_split(p: &PlanProblem, s: usize) -> Result<Evaluation, PlanError> {
    let n_blocks = p.layers.len().saturating_sub(2);
    if s > n_blocks {
        return Err(PlanError::InvalidProfile(format!(
            "split {s} is beyond the model's {n_blocks} blocks"
        )));
    }
    p.evaluate(&split_assignment(n_blocks, s, p.pin_head))
        .map_err(|v| PlanError::InvalidNodes(format!("split {s} is not allowed: {v:?}")))
}

/// The split point with the smallest latency (ties: the smaller `s`, i.e. more
/// on the server) and its evaluation.
pub fn best_split(p: &PlanProblem) -> Result<(usize, Evaluation), PlanError> {
    let n_blocks = p.layers.len().saturating_sub(2);
    let mut best: Option<(usize, Evaluation)> = None;
    for s in 0..=n_blocks {
        let e = evaluate_split(p, s)?;
        let better = match &best {
            Some((_, b)) => e.objective_s(Objective::Latency) < b.objective_s(Objective::Latency),
            None => true,
        };
        if better {
            best = Some((s, e));
        }
    }
    best.ok_or_else(|| PlanError::InvalidProfile("no split point".into()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::profile::{LayerKind, LayerProfile};

    fn profile(n: usize) -> ModelProfile {
        let layer = |name: String, kind, act: u64, t: f64| LayerProfile {
            name,
            kind,
            weight_bytes: 1000,
            kv_bytes_per_token: 0,
            activation_bytes_per_token: act,
            compute_seconds: [(1, t), (5, 2.0 * t)].into_iter().collect(),
        };
        let mut layers = vec![layer("embedding".into(), LayerKind::Embedding, 4096, 0.0)];
        for i in 0..n {
            layers.push(layer(format!("blk.{i}"), LayerKind::Block, 4096, 0.01));
        }
        layers.push(layer("head".into(), LayerKind::Head, 4, 0.02));
        ModelProfile {
            schema: ModelProfile::SCHEMA.into(),
            model: "t".into(),
            measured: false,
            note: String::new(),
            machine: String::new(),
            threads: None,
            context_tokens: 64,
            block_sizes: vec![1, 5],
            layers,
        }
    }

    #[test]
    fn split_costs_add_up_and_best_moves_with_the_server_speed() {
        let p = profile(4);
        let link = TwoNodeLink {
            rtt_ms: 10.0,
            up_mbps: 100.0,
            down_mbps: 100.0,
            server_speed: 1.0,
            round_overhead_ms: 0.0,
        };
        let prob = two_node_problem(&p, None, &link, 5, false).unwrap();
        // s = 2: device emb + 2 blocks, server 2 blocks + head; one crossing each way.
        let e = evaluate_split(&prob, 2).unwrap();
        let up = 0.005 + 4096.0 * 5.0 / 12.5e6;
        let down = 0.005 + 4.0 * 5.0 / 12.5e6;
        assert!((e.latency_s - (0.02 * 4.0 + 0.04 + up + down)).abs() < 1e-12);
        // s = N and head pinned: nothing crosses.
        let prob = two_node_problem(&p, None, &link, 5, true).unwrap();
        let e = evaluate_split(&prob, 4).unwrap();
        assert!(e.transfers.is_empty());
        // A much faster server pulls everything to it; a same-speed one keeps it local.
        let fast = TwoNodeLink {
            server_speed: 100.0,
            ..link
        };
        assert_eq!(
            best_split(&two_node_problem(&p, None, &fast, 5, false).unwrap())
                .unwrap()
                .0,
            0
        );
        assert_eq!(
            best_split(&two_node_problem(&p, None, &link, 5, true).unwrap())
                .unwrap()
                .0,
            4
        );
        assert!(evaluate_split(&prob, 5).is_err());
        assert_eq!(nearest_block(&p, 4).unwrap(), 5);
        assert_eq!(nearest_block(&p, 2).unwrap(), 1);
    }

    #[test]
    fn a_measured_server_profile_and_the_round_overhead_are_charged() {
        let p = profile(4);
        // The server measured 1.5x slower than the device per layer.
        let mut slow = p.clone();
        for l in &mut slow.layers {
            for t in l.compute_seconds.values_mut() {
                *t *= 1.5;
            }
        }
        let link = TwoNodeLink {
            rtt_ms: 10.0,
            up_mbps: 100.0,
            down_mbps: 100.0,
            server_speed: 1.0,
            round_overhead_ms: 6.0,
        };
        let prob = two_node_problem(&p, Some(&slow), &link, 5, false).unwrap();
        let e = evaluate_split(&prob, 2).unwrap();
        // Device: emb + 2 blocks at 0.02; server: 2 blocks + head at 1.5x.
        assert!((e.compute_s[DEVICE] - 0.04).abs() < 1e-12);
        assert!((e.compute_s[SERVER] - 1.5 * (0.04 + 0.04)).abs() < 1e-12);
        // The overhead: 3 ms on each of the two crossings.
        let net: f64 = e.transfers.iter().map(|t| t.crossing_s).sum();
        let bytes = (4096.0 + 4.0) * 5.0 / 12.5e6;
        assert!((net - (0.010 + 0.006 + bytes)).abs() < 1e-12, "{net}");
        // All-local U-shape: no crossing, so no overhead either.
        let prob = two_node_problem(&p, Some(&slow), &link, 5, true).unwrap();
        let e = evaluate_split(&prob, 4).unwrap();
        assert!((e.latency_s - (0.02 * 4.0 + 0.04)).abs() < 1e-12);
        // A slow server pulls the best split to the device.
        let prob = two_node_problem(&p, Some(&slow), &link, 5, false).unwrap();
        assert_eq!(best_split(&prob).unwrap().0, 4);
        // Bad inputs are named.
        let other = profile(5);
        let e = two_node_problem(&p, Some(&other), &link, 5, false).unwrap_err();
        assert!(e.to_string().contains("server profile"), "{e}");
        let neg = TwoNodeLink {
            round_overhead_ms: -1.0,
            ..link
        };
        let e = two_node_problem(&p, None, &neg, 5, false).unwrap_err();
        assert!(e.to_string().contains("round_overhead_ms"), "{e}");
    }
}
