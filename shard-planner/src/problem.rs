//! The numeric planning problem and the cost model.
//!
//! [`PlanProblem::evaluate`] *is* the model: it says which assignments of
//! layers to nodes are allowed and what each one costs. The dynamic program in
//! [`crate::dp`] finds the best allowed assignment fast; the brute force in
//! [`crate::brute_force`] finds it by trying all of them with this function.

use serde::Serialize;

use crate::PlanError;

/// What the planner minimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// Time of one forward pass: all compute plus every transfer
    /// (half an RTT plus bytes / bandwidth per crossing), plus returning the
    /// result to the device when the head is elsewhere.
    Latency,
    /// Steady-state pipelined rate: the slowest resource per forward, i.e.
    /// the largest per-node compute sum or per-crossing serialisation time
    /// (bytes / bandwidth; propagation delay overlaps in a full pipeline).
    Throughput,
}

impl std::fmt::Display for Objective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Objective::Latency => "latency",
            Objective::Throughput => "throughput",
        })
    }
}

/// One layer as the planner sees it (already multiplied out for the chosen
/// block size and context length).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerCost {
    /// Display name (`embedding`, `blk.3`, `head`).
    pub name: String,
    /// Weights plus KV cache for the configured context, in bytes.
    pub memory_bytes: u64,
    /// Bytes that cross the network if the next layer runs on another node;
    /// for the last layer (the head): the result returned to the device.
    pub cut_bytes: f64,
}

/// One node as the planner sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeCost {
    /// Display name.
    pub name: String,
    /// Memory available for weights and KV cache, in bytes.
    pub memory_budget_bytes: u64,
    /// Seconds to run each layer on this node for the chosen block.
    pub compute_s: Vec<f64>,
}

/// One direction of a link.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LinkCost {
    /// Half the round-trip time, in seconds.
    pub one_way_latency_s: f64,
    /// Bandwidth in this direction, in bytes per second.
    pub bytes_per_s: f64,
}

impl LinkCost {
    /// Time for one crossing of `bytes`, as the latency objective counts it.
    pub fn crossing_s(&self, bytes: f64) -> f64 {
        self.one_way_latency_s + bytes / self.bytes_per_s
    }

    /// Time the link is busy with `bytes`, as the throughput objective counts it.
    pub fn serialization_s(&self, bytes: f64) -> f64 {
        bytes / self.bytes_per_s
    }

    /// The cost of one crossing under `objective`.
    pub fn cost_s(&self, objective: Objective, bytes: f64) -> f64 {
        match objective {
            Objective::Latency => self.crossing_s(bytes),
            Objective::Throughput => self.serialization_s(bytes),
        }
    }
}

/// A fully numeric planning problem.
///
/// Layer 0 is the embedding and is always on the device; the last layer is
/// the head. Placement rule: every node other than the device runs at most one
/// contiguous range of layers; the device runs a prefix `[0, s)` and may also
/// run a suffix `[t, n)` (the U-shape). With `pin_head` the suffix is
/// mandatory (it holds at least the head).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanProblem {
    /// Layers in execution order.
    pub layers: Vec<LayerCost>,
    /// Nodes; `compute_s` of each has one entry per layer.
    pub nodes: Vec<NodeCost>,
    /// `links[from][to]`: the directed link, `None` if absent.
    pub links: Vec<Vec<Option<LinkCost>>>,
    /// Index of the device (holds the raw tokens and wants the result).
    pub device: usize,
    /// Whether the head must run on the device.
    pub pin_head: bool,
}

/// Why an assignment is not allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// Not one node per layer, or a node index out of range.
    Malformed,
    /// The embedding is not on the device.
    EmbeddingOffDevice,
    /// `pin_head` is set and the head is not on the device.
    HeadOffDevice,
    /// A node other than the device runs two separate ranges, or the device
    /// runs a range that is neither the prefix nor the final suffix.
    NotContiguous(usize),
    /// A node's layers do not fit its memory budget.
    OverBudget(usize),
    /// Consecutive layers on two nodes that have no link in that direction.
    NoLink(usize, usize),
}

/// One crossing of the network in a plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Transfer {
    /// Sending node.
    pub from: usize,
    /// Receiving node.
    pub to: usize,
    /// The layer whose output crosses (the head: the result to the device).
    pub after_layer: usize,
    /// Bytes sent.
    pub bytes: f64,
    /// Half RTT + bytes / bandwidth.
    pub crossing_s: f64,
    /// Bytes / bandwidth.
    pub serialization_s: f64,
}

/// The cost of one allowed assignment, itemised.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Evaluation {
    /// Seconds of compute per node.
    pub compute_s: Vec<f64>,
    /// Bytes of weights + KV cache per node.
    pub memory_bytes: Vec<u64>,
    /// Every crossing, in execution order.
    pub transfers: Vec<Transfer>,
    /// One forward: all compute plus all crossings.
    pub latency_s: f64,
    /// The slowest pipeline resource: max per-node compute or per-crossing
    /// serialisation.
    pub bottleneck_s: f64,
}

impl Evaluation {
    /// The value the given objective minimises.
    pub fn objective_s(&self, objective: Objective) -> f64 {
        match objective {
            Objective::Latency => self.latency_s,
            Objective::Throughput => self.bottleneck_s,
        }
    }
}

/// Maximal runs of equal nodes: `(node, start, end)` with `end` exclusive.
pub fn segments(assignment: &[usize]) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for (i, &node) in assignment.iter().enumerate() {
        match out.last_mut() {
            Some(last) if last.0 == node => last.2 = i + 1,
            _ => out.push((node, i, i + 1)),
        }
    }
    out
}

impl PlanProblem {
    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Checks shapes and that every number is finite and non-negative and
    /// every bandwidth positive.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |m: String| Err(PlanError::InvalidProblem(m));
        let n = self.layers.len();
        let m = self.nodes.len();
        if n == 0 {
            return bad("no layers".into());
        }
        if m == 0 {
            return bad("no nodes".into());
        }
        if self.device >= m {
            return bad(format!("device index {} out of range", self.device));
        }
        for l in &self.layers {
            if !l.cut_bytes.is_finite() || l.cut_bytes < 0.0 {
                return bad(format!("layer '{}': cut bytes {}", l.name, l.cut_bytes));
            }
        }
        for node in &self.nodes {
            if node.compute_s.len() != n {
                return bad(format!(
                    "node '{}': {} compute times for {} layers",
                    node.name,
                    node.compute_s.len(),
                    n
                ));
            }
            if let Some(c) = node.compute_s.iter().find(|c| !c.is_finite() || **c < 0.0) {
                return bad(format!("node '{}': compute time {c}", node.name));
            }
        }
        if self.links.len() != m || self.links.iter().any(|row| row.len() != m) {
            return bad(format!("link matrix is not {m} x {m}"));
        }
        for (a, row) in self.links.iter().enumerate() {
            for (b, link) in row.iter().enumerate() {
                if let Some(l) = link {
                    if !(l.bytes_per_s.is_finite() && l.bytes_per_s > 0.0) {
                        return bad(format!(
                            "link {} -> {}: bandwidth must be positive, got {} B/s",
                            self.nodes[a].name, self.nodes[b].name, l.bytes_per_s
                        ));
                    }
                    if !(l.one_way_latency_s.is_finite() && l.one_way_latency_s >= 0.0) {
                        return bad(format!(
                            "link {} -> {}: latency {} s",
                            self.nodes[a].name, self.nodes[b].name, l.one_way_latency_s
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The directed link `from -> to`, if any.
    pub fn link(&self, from: usize, to: usize) -> Option<&LinkCost> {
        self.links.get(from)?.get(to)?.as_ref()
    }

    /// Checks the placement rule and memory, and itemises the cost of
    /// `assignment` (node index per layer).
    pub fn evaluate(&self, assignment: &[usize]) -> Result<Evaluation, Violation> {
        let n = self.layers.len();
        let m = self.nodes.len();
        if assignment.len() != n || n == 0 || assignment.iter().any(|&a| a >= m) {
            return Err(Violation::Malformed);
        }
        let dev = self.device;
        if assignment[0] != dev {
            return Err(Violation::EmbeddingOffDevice);
        }
        if self.pin_head && assignment[n - 1] != dev {
            return Err(Violation::HeadOffDevice);
        }
        let segs = segments(assignment);
        let mut seen = vec![0usize; m];
        for (k, &(node, _, _)) in segs.iter().enumerate() {
            seen[node] += 1;
            let allowed = if node == dev {
                // first segment, or the last one as the second device range
                k == 0 || (k == segs.len() - 1 && seen[node] == 2)
            } else {
                seen[node] == 1
            };
            if !allowed {
                return Err(Violation::NotContiguous(node));
            }
        }
        let mut memory = vec![0u64; m];
        let mut compute = vec![0.0f64; m];
        for (i, &a) in assignment.iter().enumerate() {
            memory[a] = memory[a].saturating_add(self.layers[i].memory_bytes);
            compute[a] += self.nodes[a].compute_s[i];
        }
        if let Some(j) = (0..m).find(|&j| memory[j] > self.nodes[j].memory_budget_bytes) {
            return Err(Violation::OverBudget(j));
        }
        let mut transfers = Vec::new();
        let mut crossing = |from: usize, to: usize, after: usize| -> Result<(), Violation> {
            let link = self.link(from, to).ok_or(Violation::NoLink(from, to))?;
            let bytes = self.layers[after].cut_bytes;
            transfers.push(Transfer {
                from,
                to,
                after_layer: after,
                bytes,
                crossing_s: link.crossing_s(bytes),
                serialization_s: link.serialization_s(bytes),
            });
            Ok(())
        };
        for i in 1..n {
            if assignment[i] != assignment[i - 1] {
                crossing(assignment[i - 1], assignment[i], i - 1)?;
            }
        }
        if assignment[n - 1] != dev {
            crossing(assignment[n - 1], dev, n - 1)?;
        }
        // fold from +0.0: f64's `Sum` starts at -0.0
        let latency_s = compute.iter().fold(0.0, |acc, c| acc + c)
            + transfers.iter().fold(0.0, |acc, t| acc + t.crossing_s);
        let bottleneck_s = compute
            .iter()
            .copied()
            .chain(transfers.iter().map(|t| t.serialization_s))
            .fold(0.0, f64::max);
        Ok(Evaluation {
            compute_s: compute,
            memory_bytes: memory,
            transfers,
            latency_s,
            bottleneck_s,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_nodes() -> PlanProblem {
        let layers = (0..4)
            .map(|i| LayerCost {
                name: format!("l{i}"),
                memory_bytes: 10,
                cut_bytes: 100.0,
            })
            .collect();
        let link = LinkCost {
            one_way_latency_s: 0.5,
            bytes_per_s: 100.0,
        };
        PlanProblem {
            layers,
            nodes: vec![
                NodeCost {
                    name: "dev".into(),
                    memory_budget_bytes: 30,
                    compute_s: vec![4.0; 4],
                },
                NodeCost {
                    name: "srv".into(),
                    memory_budget_bytes: 100,
                    compute_s: vec![1.0; 4],
                },
            ],
            links: vec![vec![None, Some(link)], vec![Some(link), None]],
            device: 0,
            pin_head: false,
        }
    }

    #[test]
    fn evaluate_itemises_a_split() {
        let p = two_nodes();
        let e = p.evaluate(&[0, 1, 1, 1]).unwrap();
        assert_eq!(e.compute_s, vec![4.0, 3.0]);
        assert_eq!(e.memory_bytes, vec![10, 30]);
        assert_eq!(e.transfers.len(), 2);
        // 7 compute + 2 crossings of (0.5 + 1.0)
        assert!((e.latency_s - 10.0).abs() < 1e-12);
        assert!((e.bottleneck_s - 4.0).abs() < 1e-12);
    }

    #[test]
    fn evaluate_enforces_the_rules() {
        let mut p = two_nodes();
        assert_eq!(
            p.evaluate(&[1, 1, 1, 1]),
            Err(Violation::EmbeddingOffDevice)
        );
        assert_eq!(p.evaluate(&[0, 0, 0, 0]), Err(Violation::OverBudget(0)));
        assert_eq!(p.evaluate(&[0, 1, 0, 1]), Err(Violation::NotContiguous(0)));
        assert_eq!(p.evaluate(&[0]), Err(Violation::Malformed));
        // U-shape is allowed: device prefix + suffix
        assert!(p.evaluate(&[0, 1, 1, 0]).is_ok());
        p.pin_head = true;
        assert_eq!(p.evaluate(&[0, 1, 1, 1]), Err(Violation::HeadOffDevice));
        p.links[1][0] = None;
        assert_eq!(p.evaluate(&[0, 1, 1, 0]), Err(Violation::NoLink(1, 0)));
    }

    #[test]
    fn validate_rejects_zero_bandwidth() {
        let mut p = two_nodes();
        assert!(p.validate().is_ok());
        p.links[0][1] = Some(LinkCost {
            one_way_latency_s: 0.0,
            bytes_per_s: 0.0,
        });
        let msg = p.validate().unwrap_err().to_string();
        assert!(
            msg.contains("dev -> srv") && msg.contains("bandwidth"),
            "{msg}"
        );
    }
}
