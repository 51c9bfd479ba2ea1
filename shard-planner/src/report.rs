//! A plan in the terms an operator reads: node names, layer names, time
//! split into compute per node and transfer per link, memory per node.
//! Serialisable (the CLI's `--json`) and renderable as text.

use std::fmt::Write as _;

use serde::Serialize;

use crate::problem::{segments, Objective, PlanProblem};
use crate::Plan;

/// One contiguous range of layers on one node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SegmentReport {
    /// Node name.
    pub node: String,
    /// First layer index (inclusive).
    pub first: usize,
    /// Last layer index (inclusive).
    pub last: usize,
    /// First layer name.
    pub first_name: String,
    /// Last layer name.
    pub last_name: String,
}

/// Compute time on one node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ComputeReport {
    /// Node name.
    pub node: String,
    /// Seconds per forward.
    pub seconds: f64,
}

/// One network crossing.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TransferReport {
    /// Sender.
    pub from: String,
    /// Receiver.
    pub to: String,
    /// Name of the layer whose output crosses (`head`: the result).
    pub after_layer: String,
    /// Bytes per forward.
    pub bytes: f64,
    /// Half RTT + bytes / bandwidth.
    pub seconds: f64,
    /// Bytes / bandwidth (what the throughput objective counts).
    pub serialization_seconds: f64,
}

/// Memory used on one node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryReport {
    /// Node name.
    pub node: String,
    /// Weights + KV cache of its layers.
    pub bytes: u64,
    /// Its budget.
    pub budget_bytes: u64,
}

/// A plan, named and itemised.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanReport {
    /// What was minimised.
    pub objective: Objective,
    /// The minimised value in seconds.
    pub objective_seconds: f64,
    /// One forward, end to end.
    pub latency_seconds: f64,
    /// The slowest pipeline resource.
    pub bottleneck_seconds: f64,
    /// Whether the head was pinned to the device.
    pub pin_head: bool,
    /// Node per layer, as names.
    pub assignment: Vec<String>,
    /// Contiguous ranges in execution order.
    pub segments: Vec<SegmentReport>,
    /// Compute per node (nodes with no layers omitted).
    pub compute: Vec<ComputeReport>,
    /// Every crossing, in order.
    pub transfers: Vec<TransferReport>,
    /// Memory per node (all nodes).
    pub memory: Vec<MemoryReport>,
}

impl PlanReport {
    /// Names and itemises `plan` for `problem`.
    pub fn new(problem: &PlanProblem, plan: &Plan) -> Self {
        let node = |j: usize| problem.nodes[j].name.clone();
        let layer = |i: usize| problem.layers[i].name.clone();
        let e = &plan.evaluation;
        PlanReport {
            objective: plan.objective,
            // from the itemised evaluation, so that it equals the sum of the
            // parts exactly (the DP's own value agrees to rounding)
            objective_seconds: e.objective_s(plan.objective),
            latency_seconds: e.latency_s,
            bottleneck_seconds: e.bottleneck_s,
            pin_head: problem.pin_head,
            assignment: plan.assignment.iter().map(|&j| node(j)).collect(),
            segments: segments(&plan.assignment)
                .into_iter()
                .map(|(j, a, b)| SegmentReport {
                    node: node(j),
                    first: a,
                    last: b - 1,
                    first_name: layer(a),
                    last_name: layer(b - 1),
                })
                .collect(),
            compute: (0..problem.nodes.len())
                .filter(|&j| plan.assignment.contains(&j))
                .map(|j| ComputeReport {
                    node: node(j),
                    seconds: e.compute_s[j],
                })
                .collect(),
            transfers: e
                .transfers
                .iter()
                .map(|t| TransferReport {
                    from: node(t.from),
                    to: node(t.to),
                    after_layer: layer(t.after_layer),
                    bytes: t.bytes,
                    seconds: t.crossing_s,
                    serialization_seconds: t.serialization_s,
                })
                .collect(),
            memory: (0..problem.nodes.len())
                .map(|j| MemoryReport {
                    node: node(j),
                    bytes: e.memory_bytes[j],
                    budget_bytes: problem.nodes[j].memory_budget_bytes,
                })
                .collect(),
        }
    }

    /// `laptop[embedding..blk.3] server[blk.4..head]`.
    pub fn summary(&self) -> String {
        self.segments
            .iter()
            .map(|s| {
                if s.first == s.last {
                    format!("{}[{}]", s.node, s.first_name)
                } else {
                    format!("{}[{}..{}]", s.node, s.first_name, s.last_name)
                }
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Total compute seconds.
    pub fn compute_seconds(&self) -> f64 {
        self.compute.iter().fold(0.0, |acc, c| acc + c.seconds)
    }

    /// Total transfer seconds (latency model).
    pub fn transfer_seconds(&self) -> f64 {
        self.transfers.iter().fold(0.0, |acc, t| acc + t.seconds)
    }

    /// The multi-line text the CLI prints.
    pub fn render(&self) -> String {
        let ms = |s: f64| format!("{:.3} ms", s * 1e3);
        let mut out = String::new();
        let _ = writeln!(out, "assignment:");
        for s in &self.segments {
            let _ = writeln!(
                out,
                "  {:<12} layers {:>3}..={:<3} {}..{}",
                s.node, s.first, s.last, s.first_name, s.last_name
            );
        }
        match self.objective {
            Objective::Latency => {
                let _ = writeln!(
                    out,
                    "predicted latency per forward: {}",
                    ms(self.latency_seconds)
                );
            }
            Objective::Throughput => {
                let _ = writeln!(
                    out,
                    "predicted bottleneck stage: {} ({:.1} forwards/s pipelined); one forward end to end: {}",
                    ms(self.bottleneck_seconds),
                    1.0 / self.bottleneck_seconds.max(f64::MIN_POSITIVE),
                    ms(self.latency_seconds)
                );
            }
        }
        let _ = writeln!(out, "  compute total: {}", ms(self.compute_seconds()));
        for c in &self.compute {
            let _ = writeln!(out, "    compute  {:<28} {:>12}", c.node, ms(c.seconds));
        }
        let _ = writeln!(out, "  transfer total: {}", ms(self.transfer_seconds()));
        for t in &self.transfers {
            let link = format!("{} -> {}", t.from, t.to);
            let _ = writeln!(
                out,
                "    transfer {:<28} {:>12}  ({} B after {}; serialisation {})",
                link,
                ms(t.seconds),
                t.bytes,
                t.after_layer,
                ms(t.serialization_seconds)
            );
        }
        let _ = writeln!(out, "memory:");
        for m in &self.memory {
            let _ = writeln!(
                out,
                "  {:<12} {:>10.1} MB of {:>10.1} MB",
                m.node,
                m.bytes as f64 / 1e6,
                m.budget_bytes as f64 / 1e6
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{solve, LayerCost, LinkCost, NodeCost};

    #[test]
    fn report_names_everything_and_sums_match() {
        let link = LinkCost {
            one_way_latency_s: 0.01,
            bytes_per_s: 1e6,
        };
        let p = PlanProblem {
            layers: ["embedding", "blk.0", "blk.1", "head"]
                .iter()
                .map(|n| LayerCost {
                    name: n.to_string(),
                    memory_bytes: 100,
                    cut_bytes: 1000.0,
                })
                .collect(),
            nodes: vec![
                NodeCost {
                    name: "phone".into(),
                    memory_budget_bytes: 150,
                    compute_s: vec![0.1; 4],
                },
                NodeCost {
                    name: "server".into(),
                    memory_budget_bytes: 1000,
                    compute_s: vec![0.01; 4],
                },
            ],
            links: vec![vec![None, Some(link)], vec![Some(link), None]],
            device: 0,
            pin_head: false,
        };
        let plan = solve(&p, Objective::Latency).unwrap();
        let r = PlanReport::new(&p, &plan);
        assert_eq!(r.summary(), "phone[embedding] server[blk.0..head]");
        assert_eq!(r.transfers.len(), 2);
        assert_eq!(r.transfers[1].after_layer, "head");
        assert!((r.compute_seconds() + r.transfer_seconds() - r.latency_seconds).abs() < 1e-12);
        assert_eq!(r.memory[0].bytes, 100);
        let text = r.render();
        assert!(text.contains("transfer phone -> server"), "{text}");
        assert!(text.contains("server") && text.contains("MB of"), "{text}");
    }
}
