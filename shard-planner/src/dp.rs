//! The exact dynamic program. See `docs/shard-planner.md` for the recurrence.
//!
//! State `(i, S, j)`: layers `[0, i)` are placed, the device ran the prefix,
//! then the nodes in the set `S` (each once, in some order) ran one contiguous
//! range each, the last of them `j`, ending at boundary `i`. The value is the
//! best objective so far (sum for latency, max for throughput). The set `S` is
//! what makes "each node at most one range" exact; memory then needs no extra
//! dimension, because a node's memory is the sum over its single range, which
//! the transition checks. The one exception is the device, which may run a
//! prefix *and* a suffix: the two share one budget (and, for throughput, one
//! processor), so where that coupling bites, the prefix end `s` is enumerated
//! and one table is filled per `s`.

use serde::Serialize;

use crate::problem::{Evaluation, Objective, PlanProblem};
use crate::PlanError;

/// Largest number of nodes (device included) the exact planner accepts; the
/// state space grows as `2^(nodes - 1)`.
pub const MAX_NODES: usize = 12;

const DEVICE_FROM: u32 = 0xff;

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// What was minimised.
    pub objective: Objective,
    /// The minimised value in seconds (forward latency, or the bottleneck
    /// stage time for throughput).
    pub objective_s: f64,
    /// Node index per layer.
    pub assignment: Vec<usize>,
    /// The itemised cost of `assignment`.
    pub evaluation: Evaluation,
}

fn combine(objective: Objective, a: f64, b: f64) -> f64 {
    match objective {
        Objective::Latency => a + b,
        Objective::Throughput => a.max(b),
    }
}

/// Precomputed sums and the node numbering used by the tables.
struct Ctx<'a> {
    p: &'a PlanProblem,
    obj: Objective,
    n: usize,
    /// Number of non-device nodes.
    k: usize,
    /// Global index of each non-device node.
    nd: Vec<usize>,
    /// `mem_prefix[i]` = memory of layers `[0, i)`.
    mem_prefix: Vec<u64>,
    /// `dev_prefix[i]` = device compute of layers `[0, i)`.
    dev_prefix: Vec<f64>,
    /// Last boundary a non-device range may end at.
    limit: usize,
}

impl Ctx<'_> {
    fn mem(&self, a: usize, b: usize) -> u64 {
        self.mem_prefix[b] - self.mem_prefix[a]
    }
    fn dev_comp(&self, a: usize, b: usize) -> f64 {
        self.dev_prefix[b] - self.dev_prefix[a]
    }
    fn dev_budget(&self) -> u64 {
        self.p.nodes[self.p.device].memory_budget_bytes
    }
    fn transfer(&self, from: usize, to: usize, after_layer: usize) -> Option<f64> {
        self.p
            .link(from, to)
            .map(|l| l.cost_s(self.obj, self.p.layers[after_layer].cut_bytes))
    }
}

struct Table {
    subsets: usize,
    k: usize,
    vals: Vec<f64>,
    back: Vec<u32>,
}

impl Table {
    fn new(n: usize, k: usize) -> Self {
        let subsets = 1usize << k;
        let len = (n + 1) * subsets * k.max(1);
        Table {
            subsets,
            k,
            vals: vec![f64::INFINITY; len],
            back: vec![0; len],
        }
    }
    fn idx(&self, i: usize, s: usize, j: usize) -> usize {
        (i * self.subsets + s) * self.k + j
    }
    fn reset(&mut self) {
        self.vals.fill(f64::INFINITY);
    }
}

/// Fills `t` from the device prefix values `dev_val[s]` (infinite where `s`
/// is not a source). Chain ranges start at boundaries `>= start`.
fn fill(ctx: &Ctx, t: &mut Table, dev_val: &[f64], start: usize) {
    let p = ctx.p;
    let dev = p.device;
    for i in start.max(1)..ctx.limit {
        for s in 0..t.subsets {
            for jp in (0..ctx.k).filter(|jp| s & (1 << jp) == 0) {
                let g = ctx.nd[jp];
                let mut best = f64::INFINITY;
                let mut from = DEVICE_FROM;
                if s == 0 {
                    if dev_val[i].is_finite() {
                        if let Some(c) = ctx.transfer(dev, g, i - 1) {
                            best = combine(ctx.obj, dev_val[i], c);
                        }
                    }
                } else {
                    for j in (0..ctx.k).filter(|j| s & (1 << j) != 0) {
                        let v = t.vals[t.idx(i, s, j)];
                        if !v.is_finite() {
                            continue;
                        }
                        if let Some(c) = ctx.transfer(ctx.nd[j], g, i - 1) {
                            let cand = combine(ctx.obj, v, c);
                            if cand < best {
                                best = cand;
                                from = j as u32;
                            }
                        }
                    }
                }
                if !best.is_finite() {
                    continue;
                }
                let s2 = s | (1 << jp);
                let budget = p.nodes[g].memory_budget_bytes;
                let compute = &p.nodes[g].compute_s;
                let mut mem = 0u64;
                let mut comp = 0.0;
                for ip in i + 1..=ctx.limit {
                    mem = mem.saturating_add(p.layers[ip - 1].memory_bytes);
                    if mem > budget {
                        break;
                    }
                    comp += compute[ip - 1];
                    let cand = combine(ctx.obj, best, comp);
                    let id = t.idx(ip, s2, jp);
                    if cand < t.vals[id] {
                        t.vals[id] = cand;
                        t.back[id] = ((i as u32) << 8) | from;
                    }
                }
            }
        }
    }
}

/// Rebuilds the assignment whose chain ends in state `(end, s, j)`; layers
/// outside the chain are on the device.
fn reconstruct(ctx: &Ctx, t: &Table, end: usize, s: usize, j: usize) -> Vec<usize> {
    let mut a = vec![ctx.p.device; ctx.n];
    let (mut i, mut s, mut j) = (end, s, j);
    loop {
        let b = t.back[t.idx(i, s, j)];
        let start = (b >> 8) as usize;
        let from = b & 0xff;
        for slot in &mut a[start..i] {
            *slot = ctx.nd[j];
        }
        if from == DEVICE_FROM {
            return a;
        }
        s &= !(1 << j);
        i = start;
        j = from as usize;
    }
}

#[derive(Default)]
struct Best {
    value: f64,
    assignment: Option<Vec<usize>>,
}

impl Best {
    fn offer(&mut self, value: f64, make: impl FnOnce() -> Vec<usize>) {
        if value.is_finite() && (self.assignment.is_none() || value < self.value) {
            self.value = value;
            self.assignment = Some(make());
        }
    }
}

/// Chain ends at the last layer: the head runs on `j`, the result returns.
fn offer_chain_ends(ctx: &Ctx, t: &Table, best: &mut Best) {
    let n = ctx.n;
    for s in 1..t.subsets {
        for j in (0..ctx.k).filter(|j| s & (1 << j) != 0) {
            let v = t.vals[t.idx(n, s, j)];
            if !v.is_finite() {
                continue;
            }
            if let Some(c) = ctx.transfer(ctx.nd[j], ctx.p.device, n - 1) {
                best.offer(combine(ctx.obj, v, c), || reconstruct(ctx, t, n, s, j));
            }
        }
    }
}

/// Chain ends at `end < n`; the device runs the suffix `[end, n)`.
/// `source` is the prefix end when the table was filled from one source (then
/// the shared device budget and, for throughput, the device's total compute
/// are checked here); `None` when the device can hold every layer at once.
fn offer_u_ends(ctx: &Ctx, t: &Table, source: Option<usize>, best: &mut Best) {
    let n = ctx.n;
    for end in 2..n {
        let suffix_mem = ctx.mem(end, n);
        let suffix_comp = ctx.dev_comp(end, n);
        if let Some(src) = source {
            if end <= src || ctx.mem(0, src).saturating_add(suffix_mem) > ctx.dev_budget() {
                continue;
            }
        }
        for s in 1..t.subsets {
            for j in (0..ctx.k).filter(|j| s & (1 << j) != 0) {
                let v = t.vals[t.idx(end, s, j)];
                if !v.is_finite() {
                    continue;
                }
                let Some(c) = ctx.transfer(ctx.nd[j], ctx.p.device, end - 1) else {
                    continue;
                };
                let value = match ctx.obj {
                    Objective::Latency => v + c + suffix_comp,
                    Objective::Throughput => {
                        let src = source.unwrap_or(0);
                        v.max(c).max(ctx.dev_comp(0, src) + suffix_comp)
                    }
                };
                best.offer(value, || reconstruct(ctx, t, end, s, j));
            }
        }
    }
}

/// Finds the assignment of least cost under `objective` (see
/// [`PlanProblem::evaluate`] for the model), or says which constraint makes
/// the problem infeasible.
pub fn solve(p: &PlanProblem, objective: Objective) -> Result<Plan, PlanError> {
    p.validate()?;
    if p.nodes.len() > MAX_NODES {
        return Err(PlanError::InvalidProblem(format!(
            "{} nodes; the exact planner handles at most {MAX_NODES}",
            p.nodes.len()
        )));
    }
    let n = p.n_layers();
    let dev = p.device;
    let nd: Vec<usize> = (0..p.nodes.len()).filter(|&g| g != dev).collect();
    let mut mem_prefix = vec![0u64; n + 1];
    let mut dev_prefix = vec![0.0; n + 1];
    for i in 0..n {
        mem_prefix[i + 1] = mem_prefix[i].saturating_add(p.layers[i].memory_bytes);
        dev_prefix[i + 1] = dev_prefix[i] + p.nodes[dev].compute_s[i];
    }
    let ctx = Ctx {
        p,
        obj: objective,
        n,
        k: nd.len(),
        nd,
        mem_prefix,
        dev_prefix,
        limit: if p.pin_head { n.saturating_sub(1) } else { n },
    };
    let budget = ctx.dev_budget();
    let mut best = Best::default();

    // Everything on the device.
    if ctx.mem(0, n) <= budget {
        best.offer(ctx.dev_comp(0, n), || vec![dev; n]);
    }
    if ctx.k > 0 && n >= 2 {
        let mut table = Table::new(n, ctx.k);
        // Device prefix values for every prefix that fits on its own.
        let dev_val: Vec<f64> = (0..=n)
            .map(|s| {
                if s >= 1 && s < n && ctx.mem(0, s) <= budget {
                    ctx.dev_comp(0, s)
                } else {
                    f64::INFINITY
                }
            })
            .collect();
        let uncoupled = objective == Objective::Latency && ctx.mem(0, n) <= budget;
        if uncoupled {
            // Prefix and suffix can never compete for device memory, and the
            // latency sum does not care which of them a device layer is in.
            fill(&ctx, &mut table, &dev_val, 1);
            if !p.pin_head {
                offer_chain_ends(&ctx, &table, &mut best);
            }
            offer_u_ends(&ctx, &table, None, &mut best);
        } else {
            if !p.pin_head {
                fill(&ctx, &mut table, &dev_val, 1);
                offer_chain_ends(&ctx, &table, &mut best);
            }
            // U-shape: one table per prefix end.
            let head_mem = p.layers[n - 1].memory_bytes;
            let mut single = vec![f64::INFINITY; n + 1];
            for src in 1..n.saturating_sub(1) {
                if ctx.mem(0, src).saturating_add(head_mem) > budget {
                    break;
                }
                single[src] = dev_val[src];
                table.reset();
                fill(&ctx, &mut table, &single, src);
                offer_u_ends(&ctx, &table, Some(src), &mut best);
                single[src] = f64::INFINITY;
            }
        }
    }
    match best.assignment {
        Some(assignment) => {
            let evaluation = p.evaluate(&assignment).map_err(|v| {
                PlanError::InvalidProblem(format!("internal: planner produced a disallowed plan ({v:?})"))
            })?;
            Ok(Plan {
                objective,
                objective_s: best.value,
                assignment,
                evaluation,
            })
        }
        None => Err(PlanError::Infeasible(diagnose(p))),
    }
}

fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// Explains, as precisely as it can, why no assignment is allowed.
pub fn diagnose(p: &PlanProblem) -> String {
    let n = p.n_layers();
    let dev = p.device;
    let dname = &p.nodes[dev].name;
    let dbudget = p.nodes[dev].memory_budget_bytes;
    let embed = &p.layers[0];
    if embed.memory_bytes > dbudget {
        return format!(
            "device '{dname}' memory budget {} is less than the {} the embedding '{}' needs, and the embedding is pinned to the device",
            mb(dbudget),
            mb(embed.memory_bytes),
            embed.name
        );
    }
    if p.pin_head && n > 1 {
        let need = embed.memory_bytes.saturating_add(p.layers[n - 1].memory_bytes);
        if need > dbudget {
            return format!(
                "device '{dname}' memory budget {} is less than the {} the embedding and the head '{}' need together, and --pin-head keeps both on the device",
                mb(dbudget),
                mb(need),
                p.layers[n - 1].name
            );
        }
    }
    let largest = p.nodes.iter().map(|x| x.memory_budget_bytes).max().unwrap_or(0);
    if let Some(l) = p.layers.iter().find(|l| l.memory_bytes > largest) {
        return format!(
            "layer '{}' needs {}, more than any node's memory budget (largest: {})",
            l.name,
            mb(l.memory_bytes),
            mb(largest)
        );
    }
    // Nodes reachable from the device along links.
    let m = p.nodes.len();
    let mut reach = vec![false; m];
    reach[dev] = true;
    let mut stack = vec![dev];
    while let Some(a) = stack.pop() {
        for b in 0..m {
            if !reach[b] && p.link(a, b).is_some() {
                reach[b] = true;
                stack.push(b);
            }
        }
    }
    let total: u64 = p.layers.iter().map(|l| l.memory_bytes).sum();
    let reachable: u64 = (0..m).filter(|&j| reach[j]).map(|j| p.nodes[j].memory_budget_bytes).sum();
    let unreachable: Vec<&str> = (0..m).filter(|&j| !reach[j]).map(|j| p.nodes[j].name.as_str()).collect();
    if reachable < total {
        let cut_off = if unreachable.is_empty() {
            String::new()
        } else {
            format!("; not reachable over any link: {}", unreachable.join(", "))
        };
        return format!(
            "the model needs {} but the device '{dname}' and the nodes reachable from it have {} of memory in total{cut_off}",
            mb(total),
            mb(reachable)
        );
    }
    let returns: Vec<&str> = (0..m)
        .filter(|&j| j != dev && reach[j] && p.link(j, dev).is_some())
        .map(|j| p.nodes[j].name.as_str())
        .collect();
    if returns.is_empty() && total > dbudget {
        return format!(
            "the device '{dname}' cannot hold the whole model ({} > {}) and no other node has a link back to the device to return the result",
            mb(total),
            mb(dbudget)
        );
    }
    format!(
        "no placement fits the memory budgets when each node runs one contiguous range of layers (the device: a prefix and optionally a final suffix), and consecutive ranges need a link between their nodes; the model needs {} in total",
        mb(total)
    )
}
