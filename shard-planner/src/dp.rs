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

// The recurrences index several arrays by the same boundary; index loops
// read closer to the maths than zipped iterators.
#![allow(clippy::needless_range_loop)]

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

/// Precomputed sums and the node numbering used by the tables.
struct Ctx<'a> {
    p: &'a PlanProblem,
    n: usize,
    /// Number of non-device nodes.
    k: usize,
    /// Global index of each non-device node.
    nd: Vec<usize>,
    /// `mem_prefix[i]` = memory of layers `[0, i)`.
    mem_prefix: Vec<u64>,
    /// `comp_prefix[g][i]` = compute of layers `[0, i)` on global node `g`.
    comp_prefix: Vec<Vec<f64>>,
    /// `lo[j][i]`: smallest start `a >= 1` with `[a, i)` within the memory
    /// budget of non-device node `j` (`i` itself if not even one layer fits).
    lo: Vec<Vec<usize>>,
    /// Last boundary a non-device range may end at.
    limit: usize,
    /// `xfer[(after * (k + 1) + from) * (k + 1) + to]`: cost of sending layer
    /// `after`'s output between local nodes (`k` = the device); infinite
    /// without a link.
    xfer: Vec<f64>,
}

impl Ctx<'_> {
    fn mem(&self, a: usize, b: usize) -> u64 {
        self.mem_prefix[b] - self.mem_prefix[a]
    }
    fn dev_comp(&self, a: usize, b: usize) -> f64 {
        let c = &self.comp_prefix[self.p.device];
        c[b] - c[a]
    }
    fn dev_budget(&self) -> u64 {
        self.p.nodes[self.p.device].memory_budget_bytes
    }
    /// Transfer cost between local node indices (`k` = the device).
    fn x(&self, after_layer: usize, from: usize, to: usize) -> f64 {
        self.xfer[(after_layer * (self.k + 1) + from) * (self.k + 1) + to]
    }
}

/// A monotone deque per `(S, j')` (sliding-window minimum / min label),
/// stored flat: each window owns `cap` slots.
struct Windows {
    cap: usize,
    head: Vec<usize>,
    tail: Vec<usize>,
    pos: Vec<usize>,
    key: Vec<f64>,
    label: Vec<u32>,
}

impl Windows {
    fn new(count: usize, cap: usize) -> Self {
        Windows {
            cap,
            head: vec![0; count],
            tail: vec![0; count],
            pos: vec![0; count * cap],
            key: vec![0.0; count * cap],
            label: vec![0; count * cap],
        }
    }
    fn clear(&mut self) {
        self.head.fill(0);
        self.tail.fill(0);
    }
    /// Drops front entries whose `pos` is below `min_pos` (latency) or whose
    /// reach `key` is below `min_reach` (throughput).
    fn front(&mut self, w: usize, keep: impl Fn(usize, f64) -> bool) -> Option<usize> {
        while self.head[w] < self.tail[w] {
            let slot = w * self.cap + self.head[w];
            if keep(self.pos[slot], self.key[slot]) {
                return Some(slot);
            }
            self.head[w] += 1;
        }
        None
    }
    /// Appends, first dropping back entries that `dominated(old_slot)` says
    /// the new entry makes useless.
    fn push(
        &mut self,
        w: usize,
        pos: usize,
        key: f64,
        label: u32,
        dominated: impl Fn(f64, u32) -> bool,
    ) {
        while self.tail[w] > self.head[w] {
            let slot = w * self.cap + self.tail[w] - 1;
            if !dominated(self.key[slot], self.label[slot]) {
                break;
            }
            self.tail[w] -= 1;
        }
        let slot = w * self.cap + self.tail[w];
        self.pos[slot] = pos;
        self.key[slot] = key;
        self.label[slot] = label;
        self.tail[w] += 1;
    }
}

struct Table {
    subsets: usize,
    k: usize,
    vals: Vec<f64>,
    /// Min source label per state (throughput feasibility).
    labels: Vec<u32>,
    back: Vec<u32>,
    /// Best predecessor node entering `j'` at boundary `i` from set `S`.
    efrom: Vec<u32>,
    /// `live[i * subsets + s]`: some state `(i, s, _)` is reachable.
    live: Vec<bool>,
    windows: Windows,
}

const NO_LABEL: u32 = u32::MAX;

impl Table {
    fn new(n: usize, k: usize) -> Self {
        let subsets = 1usize << k;
        let len = (n + 1) * subsets * k.max(1);
        Table {
            subsets,
            k,
            vals: vec![f64::INFINITY; len],
            labels: vec![NO_LABEL; len],
            back: vec![0; len],
            efrom: vec![DEVICE_FROM; len],
            live: vec![false; (n + 1) * subsets],
            windows: Windows::new(subsets * k.max(1), n + 1),
        }
    }
    fn idx(&self, i: usize, s: usize, j: usize) -> usize {
        (i * self.subsets + s) * self.k + j
    }
    fn win(&self, s: usize, j: usize) -> usize {
        s * self.k + j
    }
    fn reset(&mut self) {
        self.vals.fill(f64::INFINITY);
        self.reset_labels();
    }
    fn reset_labels(&mut self) {
        self.labels.fill(NO_LABEL);
        self.live.fill(false);
        self.windows.clear();
    }
}

/// Latency tables. `D(i', S', j') = C_j'(i') + min over a in [lo_j'(i'), i')
/// of (E(a, S'\j', j') - C_j'(a))`, where `E(a, S, j')` is the best value of
/// entering `j'` at boundary `a` and `C_j'` is `j'`'s prefix compute: a
/// sliding-window minimum per `(S, j')`, because `lo` only moves right.
/// Device prefix values come from `dev_val[s]` (infinite where `s` is not a
/// source); ranges start at boundaries `>= start`.
///
/// Every state at a boundary `> start` is written (infinite if unreachable),
/// so a table can be refilled without [`Table::reset`]; rows up to `start`
/// keep stale values and must not be read. With `pruning`, states that cannot
/// lead to a plan within its cutoff are left unreachable.
fn fill_latency(
    ctx: &Ctx,
    t: &mut Table,
    dev_val: &[f64],
    start: usize,
    pruning: Option<&Pruning>,
) {
    let start = start.max(1);
    t.windows.clear();
    for i in start..=ctx.limit {
        t.live[i * t.subsets..(i + 1) * t.subsets].fill(false);
        // 1. Finalise states whose last range ends at i.
        if i > start {
            for s2 in 1..t.subsets {
                for jp in bits(s2) {
                    let s = s2 & !(1 << jp);
                    let w = t.win(s, jp);
                    let lo = ctx.lo[jp][i];
                    let id = t.idx(i, s2, jp);
                    t.vals[id] = f64::INFINITY;
                    if let Some(slot) = t.windows.front(w, |pos, _| pos >= lo) {
                        let a = t.windows.pos[slot];
                        let value = ctx.comp_prefix[ctx.nd[jp]][i] + t.windows.key[slot];
                        if pruning.is_some_and(|p| p.hopeless_after_range(i, jp, value)) {
                            continue;
                        }
                        t.vals[id] = value;
                        t.back[id] = ((a as u32) << 8) | t.efrom[t.idx(a, s, jp)];
                        t.live[i * t.subsets + s2] = true;
                    }
                }
            }
        }
        if i >= ctx.limit {
            break;
        }
        // 2. Enter each unused node j' at boundary i.
        for s in 0..t.subsets {
            if s != 0 && !t.live[i * t.subsets + s] {
                continue;
            }
            for jp in bits(!s & (t.subsets - 1)) {
                let g = ctx.nd[jp];
                let mut best = f64::INFINITY;
                let mut from = DEVICE_FROM;
                if s == 0 {
                    best = dev_val[i] + ctx.x(i - 1, ctx.k, jp);
                } else {
                    for j in bits(s) {
                        let c = t.vals[t.idx(i, s, j)] + ctx.x(i - 1, j, jp);
                        if c < best {
                            best = c;
                            from = j as u32;
                        }
                    }
                }
                if !best.is_finite() || pruning.is_some_and(|p| p.hopeless_entering(i, jp, best)) {
                    continue;
                }
                let e = t.idx(i, s, jp);
                t.efrom[e] = from;
                let key = best - ctx.comp_prefix[g][i];
                let w = t.win(s, jp);
                t.windows.push(w, i, key, 0, |old, _| old >= key);
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
        for j in bits(s) {
            let v = t.vals[t.idx(n, s, j)] + ctx.x(n - 1, j, ctx.k);
            best.offer(v, || reconstruct(ctx, t, n, s, j));
        }
    }
}

/// Chain ends at `end < n`; the device runs the suffix `[end, n)`.
/// `source` is the prefix end when the table was filled from that one source
/// (then the shared device budget is checked here); `None` when the device
/// can hold every layer at once.
fn offer_u_ends(ctx: &Ctx, t: &Table, source: Option<usize>, best: &mut Best) {
    let n = ctx.n;
    for end in 2..n {
        let suffix_comp = ctx.dev_comp(end, n);
        let fits = match source {
            Some(src) => {
                end > src && ctx.mem(0, src).saturating_add(ctx.mem(end, n)) <= ctx.dev_budget()
            }
            None => ctx.mem(end, n) <= ctx.dev_budget(),
        };
        if !fits {
            continue;
        }
        for s in 1..t.subsets {
            for j in bits(s) {
                let v = t.vals[t.idx(end, s, j)] + ctx.x(end - 1, j, ctx.k) + suffix_comp;
                best.offer(v, || reconstruct(ctx, t, end, s, j));
            }
        }
    }
}

fn solve_latency(ctx: &Ctx, fallback: FallbackSearch, best: &mut Best) {
    let (n, p) = (ctx.n, ctx.p);
    let budget = ctx.dev_budget();
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
    if ctx.mem(0, n) <= budget {
        // Prefix and suffix can never compete for device memory, and the sum
        // does not care which of them a device layer is in: one table.
        fill_latency(ctx, &mut table, &dev_val, 1, None);
        if !p.pin_head {
            offer_chain_ends(ctx, &table, best);
        }
        offer_u_ends(ctx, &table, None, best);
        return;
    }
    // The table from all sources is exact for the chain family and, with the
    // device's prefix and suffix each checked only on their own, a
    // relaxation (a lower bound) for the U family.
    fill_latency(ctx, &mut table, &dev_val, 1, None);
    if !p.pin_head {
        offer_chain_ends(ctx, &table, best);
    }
    let mut relaxed = Best::default();
    offer_u_ends(ctx, &table, None, &mut relaxed);
    let Some(candidate) = relaxed.assignment else {
        return; // not even the relaxation has a U plan
    };
    if best.assignment.is_some() && relaxed.value >= best.value {
        return; // no U plan can beat the chain plan
    }
    if p.evaluate(&candidate).is_ok() {
        // The relaxed optimum respects the shared budget: it is optimal.
        best.offer(relaxed.value, || candidate);
        return;
    }
    // U-shape with a binding device budget: one table per prefix end.
    #[cfg(test)]
    FALLBACK_RUNS.with(|runs| runs.set(runs.get() + 1));
    match fallback {
        FallbackSearch::BoundedBestFirst => every_prefix_bounded(ctx, &mut table, &dev_val, best),
        FallbackSearch::EveryPrefix => every_prefix_exhaustive(ctx, &mut table, &dev_val, best),
    }
}

#[cfg(test)]
thread_local! {
    /// How often the per-prefix fallback ran on this thread: the tests check
    /// that their instances reach it.
    static FALLBACK_RUNS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The prefix ends (sources) the per-prefix fallback considers, in
/// increasing order: at least one layer, and room left for the head.
fn fallback_sources<'a>(ctx: &'a Ctx<'a>) -> impl Iterator<Item = usize> + 'a {
    let n = ctx.n;
    let head_mem = ctx.p.layers[n - 1].memory_bytes;
    (1..n.saturating_sub(1))
        .take_while(move |&src| ctx.mem(0, src).saturating_add(head_mem) <= ctx.dev_budget())
}

/// The fallback as first written: one full table per prefix end, in order.
/// Kept as the reference the bounded search is tested and benchmarked against.
fn every_prefix_exhaustive(ctx: &Ctx, table: &mut Table, dev_val: &[f64], best: &mut Best) {
    let mut single = vec![f64::INFINITY; ctx.n + 1];
    for src in fallback_sources(ctx) {
        single[src] = dev_val[src];
        table.reset();
        fill_latency(ctx, table, &single, src, None);
        offer_u_ends(ctx, table, Some(src), best);
        single[src] = f64::INFINITY;
    }
}

/// The same per-prefix tables, solved best first and pruned, with the same
/// answer as [`every_prefix_exhaustive`] (ties included):
///
/// * each prefix end `src` gets a [`CompletionBound`] for its own allowed
///   U ends, hence a lower bound on its best plan; the prefix end with the
///   least bound is solved next, and the search stops when the least bound
///   exceeds the best plan so far;
/// * a table is filled for a limit: a state whose value plus its completion
///   bound exceeds the limit (plus a rounding margin) is dropped. Every plan
///   within the limit is still built exactly as the exhaustive search builds
///   it (a state on its path has value plus bound at most the plan's value,
///   and its predecessors too), so a best plan within the limit is that
///   prefix end's optimum. The limit is the best plan so far, or, when that
///   is far above the bound, a trial a little above the bound: if the table
///   has no plan within it, the trial is a better bound for that prefix end,
///   which goes back into the queue;
/// * among equal plans, the exhaustive search keeps the chain plan, then the
///   smallest prefix end, then the first end in its table; so does this.
fn every_prefix_bounded(ctx: &Ctx, table: &mut Table, dev_val: &[f64], best: &mut Best) {
    let mut bound = CompletionBound::new(ctx);
    let mut queue: Vec<QueuedPrefix> = Vec::new();
    for src in fallback_sources(ctx) {
        let Some(first_end) = first_u_end(ctx, src) else {
            continue;
        };
        bound.compute(ctx, first_end);
        let lower = bound.source_lower_bound(ctx, src, dev_val[src]);
        if lower.is_finite() {
            queue.push(QueuedPrefix {
                lower,
                src,
                first_end,
                trials: 0,
            });
        }
    }
    let mut single = vec![f64::INFINITY; ctx.n + 1];
    // The prefix end of the best plan when it came from this search.
    let mut best_src: Option<usize> = None;
    while let Some(next) = take_least_bound(&mut queue) {
        let best_value = if best.assignment.is_some() {
            best.value
        } else {
            f64::INFINITY
        };
        if next.lower > with_rounding_margin(best_value) {
            break; // the least bound: no prefix end left can win or tie
        }
        let trial = next.trial_limit();
        let limit = best_value.min(trial);
        bound.compute(ctx, next.first_end);
        single[next.src] = dev_val[next.src];
        let pruning = Pruning {
            bound: &bound,
            cutoff: with_rounding_margin(limit),
        };
        fill_latency(ctx, table, &single, next.src, Some(&pruning));
        single[next.src] = f64::INFINITY;
        let mut from_src = Best::default();
        offer_u_ends(ctx, table, Some(next.src), &mut from_src);
        match from_src.assignment {
            // Every plan within `limit` survived: this is the prefix end's
            // optimum, built as the exhaustive search builds it.
            Some(assignment) if from_src.value <= limit => {
                let wins = best.assignment.is_none()
                    || from_src.value < best.value
                    || (from_src.value == best.value && best_src.is_some_and(|b| next.src < b));
                if wins {
                    best.value = from_src.value;
                    best.assignment = Some(assignment);
                    best_src = Some(next.src);
                }
            }
            // Nothing within the trial: that prefix end's optimum is above
            // it. (Nothing within the best plan: it cannot win.)
            _ if trial < best_value => queue.push(QueuedPrefix {
                lower: trial,
                trials: next.trials + 1,
                ..next
            }),
            _ => {}
        }
    }
}

/// A prefix end waiting in [`every_prefix_bounded`]'s queue.
#[derive(Debug, Clone, Copy)]
struct QueuedPrefix {
    /// No plan with this prefix end costs less.
    lower: f64,
    src: usize,
    /// Its first allowed U end ([`first_u_end`]).
    first_end: usize,
    /// Tables already filled for it with a trial cutoff that held no plan.
    trials: u32,
}

impl QueuedPrefix {
    /// A limit 1 %, then 4 %, then 16 % above the bound, then none: the
    /// bound is usually within a fraction of a percent of the optimum, and a
    /// missed trial costs one more (pruned) table.
    fn trial_limit(&self) -> f64 {
        if self.trials >= 3 {
            return f64::INFINITY;
        }
        let step = 0.01 * f64::from(1u32 << (2 * self.trials));
        self.lower + (self.lower.abs() + 1e-12) * step
    }
}

/// Removes and returns the entry with the least bound (the smaller prefix
/// end among equal bounds).
fn take_least_bound(queue: &mut Vec<QueuedPrefix>) -> Option<QueuedPrefix> {
    let at = (0..queue.len()).min_by(|&a, &b| {
        let (a, b) = (&queue[a], &queue[b]);
        a.lower.total_cmp(&b.lower).then(a.src.cmp(&b.src))
    })?;
    Some(queue.swap_remove(at))
}

/// `limit` plus a margin far above the rounding error of summing a state's
/// value and its bound in another order than the plan's own value: pruning
/// above it never drops a plan whose value is within `limit`.
fn with_rounding_margin(limit: f64) -> f64 {
    limit + limit.abs() * 1e-9 + 1e-15
}

/// The first boundary a chain from prefix end `src` may hand back to the
/// device at: the device's suffix `[end, n)` must fit next to `[0, src)`.
/// U ends are `end in (src, n)`, and a later end only frees memory, so the
/// allowed ends are `[first, n)`. `None` if there is none.
fn first_u_end(ctx: &Ctx, src: usize) -> Option<usize> {
    let n = ctx.n;
    let room = ctx.dev_budget().checked_sub(ctx.mem(0, src))?;
    (src.saturating_add(1).max(2)..n).find(|&end| ctx.mem(end, n) <= room)
}

/// Lower bounds, for one prefix end's table, on what a state still has to
/// pay before a U terminal at an end in `[first_end, n)`. The relaxation
/// lets the rest of the chain use any node but the one it just left (the
/// set `S` drops out), so a bound costs O(n·K²) instead of a table's
/// O(n·2^K·K²). Memory budgets and the allowed ends are kept exactly.
struct CompletionBound {
    k: usize,
    /// `after_range[i * k + j]`: from "node `j`'s range ended at boundary
    /// `i`" to the end of the plan.
    after_range: Vec<f64>,
    /// `entering[i * k + j]`: from "node `j` starts its range at boundary
    /// `i`" (crossing into it already paid).
    entering: Vec<f64>,
    /// One window per node over range ends `b`, keyed `C_j(b) + after_range`.
    windows: Windows,
}

impl CompletionBound {
    fn new(ctx: &Ctx) -> Self {
        let len = (ctx.n + 1) * ctx.k;
        CompletionBound {
            k: ctx.k,
            after_range: vec![f64::INFINITY; len],
            entering: vec![f64::INFINITY; len],
            windows: Windows::new(ctx.k, ctx.n + 1),
        }
    }

    /// Fills both bounds for U ends `[first_end, n)`, from the last
    /// boundary down.
    fn compute(&mut self, ctx: &Ctx, first_end: usize) {
        let (n, k) = (ctx.n, self.k);
        self.after_range.fill(f64::INFINITY);
        self.entering.fill(f64::INFINITY);
        self.windows.clear();
        for i in (1..=ctx.limit).rev() {
            if i < ctx.limit {
                self.fill_entering(ctx, i);
            }
            for j in 0..k {
                let mut v = f64::INFINITY;
                if i >= first_end && i < n {
                    v = ctx.x(i - 1, j, k) + ctx.dev_comp(i, n);
                }
                if i < ctx.limit {
                    for next in (0..k).filter(|&next| next != j) {
                        v = v.min(ctx.x(i - 1, j, next) + self.entering[i * k + next]);
                    }
                }
                self.after_range[i * k + j] = v;
            }
        }
    }

    /// `entering(i, j) = min over b in (i, limit] with [i, b) within j's
    /// budget of C_j(b) - C_j(i) + after_range(b, j)`: a sliding window over
    /// `b` that moves left with `i` (`lo` is monotone in `b`).
    fn fill_entering(&mut self, ctx: &Ctx, i: usize) {
        let k = self.k;
        let b = i + 1;
        for j in 0..k {
            let cp = &ctx.comp_prefix[ctx.nd[j]];
            let lo = &ctx.lo[j];
            // `[i, i + 1)` must fit, or no range can start at `i` (nor
            // would `b` ever be usable by an earlier start).
            if lo[b] <= i {
                let key = cp[b] + self.after_range[b * k + j];
                if key.is_finite() {
                    self.windows.push(j, b, key, 0, |old, _| old >= key);
                }
            }
            if let Some(slot) = self.windows.front(j, |pos, _| lo[pos] <= i) {
                self.entering[i * k + j] = self.windows.key[slot] - cp[i];
            }
        }
    }

    /// The best any plan with device prefix `[0, src)` can do: its prefix,
    /// the crossing into the first node, and that node's bound.
    fn source_lower_bound(&self, ctx: &Ctx, src: usize, prefix_value: f64) -> f64 {
        (0..self.k)
            .map(|j| prefix_value + ctx.x(src - 1, ctx.k, j) + self.entering[src * self.k + j])
            .fold(f64::INFINITY, f64::min)
    }
}

/// Drops table states that cannot lead to a plan at or below `cutoff`
/// ([`CompletionBound`] says what they still have to pay at least).
struct Pruning<'a> {
    bound: &'a CompletionBound,
    cutoff: f64,
}

impl Pruning<'_> {
    /// `value` is that of node `j`'s range ending at boundary `i`.
    fn hopeless_after_range(&self, i: usize, j: usize, value: f64) -> bool {
        self.hopeless(value + self.bound.after_range[i * self.bound.k + j])
    }
    /// `value` is that of entering node `j` at boundary `i`.
    fn hopeless_entering(&self, i: usize, j: usize, value: f64) -> bool {
        self.hopeless(value + self.bound.entering[i * self.bound.k + j])
    }
    /// Infinite: no allowed end can be reached at all.
    fn hopeless(&self, total: f64) -> bool {
        total.is_infinite() || total > self.cutoff
    }
}

/// Is there an allowed plan whose every stage (per-node compute, per-crossing
/// serialisation) is at most `lambda`? Labels each state with the smallest
/// device prefix end it can be reached from (smaller is better for the
/// device's shared suffix budget, so the minimum is the only label that
/// matters). Returns a witness assignment.
fn throughput_feasible(ctx: &Ctx, t: &mut Table, lambda: f64) -> Option<Vec<usize>> {
    let (n, p, dev) = (ctx.n, ctx.p, ctx.p.device);
    let budget = ctx.dev_budget();
    if ctx.mem(0, n) <= budget && ctx.dev_comp(0, n) <= lambda {
        return Some(vec![dev; n]);
    }
    if ctx.k == 0 || n < 2 {
        return None;
    }
    t.reset_labels();
    // ok[after * (k + 1) + from]: the nodes `from` may send layer `after`'s
    // output to within lambda.
    let mut ok = vec![0usize; n * (ctx.k + 1)];
    for after in 0..n {
        for from in 0..=ctx.k {
            ok[after * (ctx.k + 1) + from] = (0..ctx.k)
                .filter(|&to| ctx.x(after, from, to) <= lambda)
                .map(|to| 1 << to)
                .sum();
        }
    }
    // reach[j][a]: last boundary node j can extend a range starting at a to.
    let reach: Vec<Vec<usize>> = (0..ctx.k)
        .map(|j| {
            let g = ctx.nd[j];
            let cp = &ctx.comp_prefix[g];
            let b = p.nodes[g].memory_budget_bytes;
            let mut r = vec![0usize; n + 1];
            let mut end = 1;
            for a in 1..=n {
                end = end.max(a);
                while end < ctx.limit && ctx.mem(a, end + 1) <= b && cp[end + 1] - cp[a] <= lambda {
                    end += 1;
                }
                r[a] = end;
            }
            r
        })
        .collect();
    for i in 1..=ctx.limit {
        let reach_floor = i as f64;
        if i > 1 {
            for s2 in 1..t.subsets {
                for jp in bits(s2) {
                    let s = s2 & !(1 << jp);
                    let w = t.win(s, jp);
                    if let Some(slot) = t.windows.front(w, |_, r| r >= reach_floor) {
                        let a = t.windows.pos[slot];
                        let id = t.idx(i, s2, jp);
                        t.labels[id] = t.windows.label[slot];
                        t.back[id] = ((a as u32) << 8) | t.efrom[t.idx(a, s, jp)];
                        t.live[i * t.subsets + s2] = true;
                    }
                }
            }
        }
        if i >= ctx.limit {
            break;
        }
        // Nodes that can take at least one layer starting at i.
        let open: usize = (0..ctx.k)
            .filter(|&j| reach[j][i] > i)
            .map(|j| 1 << j)
            .sum();
        let row = (i - 1) * (ctx.k + 1);
        let mut label = [NO_LABEL; MAX_NODES];
        let mut from = [DEVICE_FROM; MAX_NODES];
        for s in 0..t.subsets {
            let targets = open & !s;
            if targets == 0 {
                continue;
            }
            if s == 0 {
                if !(ctx.mem(0, i) <= budget && ctx.dev_comp(0, i) <= lambda) {
                    continue;
                }
                for jp in bits(targets & ok[row + ctx.k]) {
                    label[jp] = i as u32;
                    from[jp] = DEVICE_FROM;
                }
            } else {
                if !t.live[i * t.subsets + s] {
                    continue;
                }
                for j in bits(s) {
                    let l = t.labels[t.idx(i, s, j)];
                    if l == NO_LABEL {
                        continue;
                    }
                    for jp in bits(targets & ok[row + j]) {
                        if l < label[jp] {
                            label[jp] = l;
                            from[jp] = j as u32;
                        }
                    }
                }
            }
            for jp in bits(targets) {
                let l = std::mem::replace(&mut label[jp], NO_LABEL);
                if l == NO_LABEL {
                    continue;
                }
                let e = t.idx(i, s, jp);
                t.efrom[e] = from[jp];
                let w = t.win(s, jp);
                t.windows
                    .push(w, i, reach[jp][i] as f64, l, |_, old| old >= l);
            }
        }
    }
    // Terminals: the head on the last chain node, the result returns.
    if !p.pin_head {
        for s in 1..t.subsets {
            for j in bits(s) {
                let l = t.labels[t.idx(n, s, j)];
                if l != NO_LABEL && ctx.x(n - 1, j, ctx.k) <= lambda {
                    return Some(reconstruct(ctx, t, n, s, j));
                }
            }
        }
    }
    // U-shape: the device runs [end, n); only suffixes it can run within
    // lambda on its own are worth looking at.
    let mut end = n - 1;
    while end >= 2 && ctx.dev_comp(end, n) <= lambda && ctx.mem(end, n) <= budget {
        for s in 1..t.subsets {
            if !t.live[end * t.subsets + s] {
                continue;
            }
            for j in bits(s) {
                let l = t.labels[t.idx(end, s, j)];
                if l == NO_LABEL {
                    continue;
                }
                let src = l as usize;
                if ctx.mem(0, src).saturating_add(ctx.mem(end, n)) <= budget
                    && ctx.dev_comp(0, src) + ctx.dev_comp(end, n) <= lambda
                    && ctx.x(end - 1, j, ctx.k) <= lambda
                {
                    return Some(reconstruct(ctx, t, end, s, j));
                }
            }
        }
        end -= 1;
    }
    None
}

/// The indices of the set bits of `mask`, lowest first.
fn bits(mut mask: usize) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        if mask == 0 {
            return None;
        }
        let b = mask.trailing_zeros() as usize;
        mask &= mask - 1;
        Some(b)
    })
}

/// Throughput: the optimum is one of finitely many stage values, so search
/// them: bisection by median selection over the candidate list, each step a
/// linear-time feasibility sweep.
fn solve_throughput(ctx: &Ctx, best: &mut Best) {
    let (n, p, dev) = (ctx.n, ctx.p, ctx.p.device);
    let mut cand: Vec<f64> = Vec::new();
    for g in 0..p.nodes.len() {
        let cp = &ctx.comp_prefix[g];
        if g == dev {
            for s in 1..=n {
                cand.push(cp[s]);
                for e in s + 1..n {
                    cand.push(cp[s] + (cp[n] - cp[e]));
                }
            }
        } else {
            for a in 1..n {
                for b in a + 1..=n {
                    cand.push(cp[b] - cp[a]);
                }
            }
        }
        for h in 0..p.nodes.len() {
            if let Some(link) = p.link(g, h) {
                cand.extend(p.layers.iter().map(|l| link.serialization_s(l.cut_bytes)));
            }
        }
    }
    // Every layer runs somewhere, and the device runs the embedding (and,
    // pinned, the head): nothing below this bound can be feasible.
    let mut lower = (0..n)
        .map(|l| {
            p.nodes
                .iter()
                .map(|x| x.compute_s[l])
                .fold(f64::INFINITY, f64::min)
        })
        .fold(0.0, f64::max);
    lower = lower.max(p.nodes[dev].compute_s[0]);
    if p.pin_head && n > 1 {
        lower = lower.max(p.nodes[dev].compute_s[0] + p.nodes[dev].compute_s[n - 1]);
    }
    let mut table = Table::new(n, ctx.k);
    // The witness's own bottleneck is an upper bound, often far below the
    // probed value.
    let actual = |a: &[usize]| p.evaluate(a).map_or(f64::INFINITY, |e| e.bottleneck_s);
    let mut witness: Option<Vec<usize>> = None;
    // Invariant: `witness` (if any) has bottleneck `<= bound`; every
    // candidate below `bound` not yet found infeasible is in `cand`; the
    // optimum is a candidate. If no probe is feasible, nothing is.
    cand.retain(|&c| c >= lower * (1.0 - 1e-12));
    while !cand.is_empty() {
        let mid = cand.len() / 2;
        cand.select_nth_unstable_by(mid, f64::total_cmp);
        let v = cand[mid];
        match throughput_feasible(ctx, &mut table, v) {
            Some(a) => {
                let bound = actual(&a).min(v);
                witness = Some(a);
                cand.truncate(mid);
                cand.retain(|&c| c < bound);
            }
            None => {
                cand.drain(..=mid);
                cand.retain(|&c| c > v);
            }
        }
    }
    let Some(witness) = witness else {
        return;
    };
    let value = actual(&witness);
    best.offer(value, || witness);
}

/// How the latency planner searches when the device's prefix and suffix
/// compete for its memory (the per-prefix fallback; see
/// `docs/shard-planner.md`). Both give the same plan; only speed differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackSearch {
    /// Lower-bounded, best first, with pruned tables ([`solve`] uses this).
    BoundedBestFirst,
    /// One full table per prefix end: the reference the tests and
    /// `plan_bench` compare the bounded search with.
    EveryPrefix,
}

/// Finds the assignment of least cost under `objective` (see
/// [`PlanProblem::evaluate`] for the model), or says which constraint makes
/// the problem infeasible.
pub fn solve(p: &PlanProblem, objective: Objective) -> Result<Plan, PlanError> {
    solve_with_fallback(p, objective, FallbackSearch::BoundedBestFirst)
}

/// [`solve`] with a chosen [`FallbackSearch`] (for tests and benchmarks).
pub fn solve_with_fallback(
    p: &PlanProblem,
    objective: Objective,
    fallback: FallbackSearch,
) -> Result<Plan, PlanError> {
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
    for i in 0..n {
        mem_prefix[i + 1] = mem_prefix[i].saturating_add(p.layers[i].memory_bytes);
    }
    let comp_prefix: Vec<Vec<f64>> = p
        .nodes
        .iter()
        .map(|node| {
            let mut c = vec![0.0; n + 1];
            for i in 0..n {
                c[i + 1] = c[i] + node.compute_s[i];
            }
            c
        })
        .collect();
    let lo: Vec<Vec<usize>> = nd
        .iter()
        .map(|&g| {
            let b = p.nodes[g].memory_budget_bytes;
            let mut lo = vec![0usize; n + 1];
            let mut a = 1;
            for (i, slot) in lo.iter_mut().enumerate().skip(1) {
                while a < i && mem_prefix[i] - mem_prefix[a] > b {
                    a += 1;
                }
                *slot = a;
            }
            lo
        })
        .collect();
    let k = nd.len();
    let local = |l: usize| if l == k { dev } else { nd[l] };
    let mut xfer = vec![f64::INFINITY; n * (k + 1) * (k + 1)];
    for (after, layer) in p.layers.iter().enumerate() {
        for a in 0..=k {
            for b in 0..=k {
                if let Some(link) = p.link(local(a), local(b)) {
                    xfer[(after * (k + 1) + a) * (k + 1) + b] =
                        link.cost_s(objective, layer.cut_bytes);
                }
            }
        }
    }
    let ctx = Ctx {
        xfer,
        p,
        n,
        k: nd.len(),
        nd,
        mem_prefix,
        comp_prefix,
        lo,
        limit: if p.pin_head { n.saturating_sub(1) } else { n },
    };
    let mut best = Best::default();
    match objective {
        Objective::Latency => {
            if ctx.mem(0, n) <= ctx.dev_budget() {
                best.offer(ctx.dev_comp(0, n), || vec![dev; n]);
            }
            if ctx.k > 0 && n >= 2 {
                solve_latency(&ctx, fallback, &mut best);
            }
        }
        Objective::Throughput => solve_throughput(&ctx, &mut best),
    }
    match best.assignment {
        Some(assignment) => {
            let evaluation = p.evaluate(&assignment).map_err(|v| {
                PlanError::InvalidProblem(format!(
                    "internal: planner produced a disallowed plan ({v:?})"
                ))
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
        let need = embed
            .memory_bytes
            .saturating_add(p.layers[n - 1].memory_bytes);
        if need > dbudget {
            return format!(
                "device '{dname}' memory budget {} is less than the {} the embedding and the head '{}' need together, and --pin-head keeps both on the device",
                mb(dbudget),
                mb(need),
                p.layers[n - 1].name
            );
        }
    }
    let largest = p
        .nodes
        .iter()
        .map(|x| x.memory_budget_bytes)
        .max()
        .unwrap_or(0);
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
    let reachable: u64 = (0..m)
        .filter(|&j| reach[j])
        .map(|j| p.nodes[j].memory_budget_bytes)
        .sum();
    let unreachable: Vec<&str> = (0..m)
        .filter(|&j| !reach[j])
        .map(|j| p.nodes[j].name.as_str())
        .collect();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LayerCost, LinkCost, NodeCost};

    fn problem(budgets: [u64; 3], links: &[(usize, usize)]) -> PlanProblem {
        let mut l = vec![vec![None; 3]; 3];
        for &(a, b) in links {
            l[a][b] = Some(LinkCost {
                one_way_latency_s: 0.01,
                bytes_per_s: 1e6,
            });
        }
        PlanProblem {
            layers: ["embedding", "blk.0", "blk.1", "head"]
                .iter()
                .map(|n| LayerCost {
                    name: n.to_string(),
                    memory_bytes: 10_000_000,
                    cut_bytes: 100.0,
                })
                .collect(),
            nodes: ["phone", "edge", "cloud"]
                .iter()
                .zip(budgets)
                .map(|(n, b)| NodeCost {
                    name: n.to_string(),
                    memory_budget_bytes: b,
                    compute_s: vec![0.01; 4],
                })
                .collect(),
            links: l,
            device: 0,
            pin_head: false,
        }
    }

    fn infeasible(p: &PlanProblem) -> String {
        match solve(p, Objective::Latency) {
            Err(PlanError::Infeasible(m)) => m,
            other => panic!("expected infeasible, got {other:?}"),
        }
    }

    #[test]
    fn a_three_node_chain_is_used_when_memory_forces_it() {
        // 40 MB model, 10 MB on each node except 20 MB on the last: the
        // only plans run phone -> edge -> cloud (or the reverse order).
        let all = [(0, 1), (1, 0), (1, 2), (2, 1), (0, 2), (2, 0)];
        let p = problem([10_000_000, 10_000_000, 20_000_000], &all);
        let plan = solve(&p, Objective::Latency).unwrap();
        let mut used = plan.assignment.clone();
        used.sort_unstable();
        assert_eq!(used, vec![0, 1, 2, 2]);
        assert_eq!(plan.evaluation.transfers.len(), 3);
    }

    #[test]
    fn diagnoses_name_the_failing_constraint() {
        let all = [(0, 1), (1, 0), (1, 2), (2, 1), (0, 2), (2, 0)];
        let m = infeasible(&problem([5_000_000, 100_000_000, 100_000_000], &all));
        assert!(m.contains("'phone'") && m.contains("embedding"), "{m}");

        let mut p = problem([15_000_000, 100_000_000, 100_000_000], &all);
        p.pin_head = true;
        let m = infeasible(&p);
        assert!(m.contains("--pin-head"), "{m}");

        let mut p = problem([10_000_000, 100_000_000, 100_000_000], &all);
        p.layers[2].memory_bytes = 200_000_000;
        let m = infeasible(&p);
        assert!(m.contains("'blk.1'") && m.contains("any node"), "{m}");

        // The cloud is only reachable through nothing: phone <-> edge only.
        let m = infeasible(&problem(
            [10_000_000, 10_000_000, 100_000_000],
            &[(0, 1), (1, 0)],
        ));
        assert!(m.contains("not reachable") && m.contains("cloud"), "{m}");

        // Data can reach the cloud but nothing comes back to the phone.
        let m = infeasible(&problem([10_000_000, 10_000_000, 100_000_000], &[(0, 2)]));
        assert!(m.contains("link back to the device"), "{m}");
    }

    #[test]
    fn too_many_nodes_is_an_error_not_a_hang() {
        let mut p = problem([100_000_000; 3], &[]);
        let node = p.nodes[1].clone();
        p.nodes.resize(MAX_NODES + 1, node);
        p.links = vec![vec![None; MAX_NODES + 1]; MAX_NODES + 1];
        let e = solve(&p, Objective::Latency).unwrap_err().to_string();
        assert!(e.contains("at most"), "{e}");
    }
}

/// The per-prefix fallback: the bounded search against brute force on small
/// instances built to reach it, and against the exhaustive per-prefix search
/// on instances of the benchmark's size.
#[cfg(test)]
mod fallback_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::{brute_force, LayerCost, LinkCost, NodeCost};

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
    }

    /// Solves with both fallback searches and says whether the fallback ran.
    fn both(p: &PlanProblem) -> (Result<Plan, PlanError>, Result<Plan, PlanError>, bool) {
        let before = FALLBACK_RUNS.with(|r| r.get());
        let bounded = solve_with_fallback(p, Objective::Latency, FallbackSearch::BoundedBestFirst);
        let ran = FALLBACK_RUNS.with(|r| r.get()) > before;
        let every = solve_with_fallback(p, Objective::Latency, FallbackSearch::EveryPrefix);
        (bounded, every, ran)
    }

    /// Small problems where the device is cheap to compute on and crossings
    /// are dear, so plans want a long device prefix *and* suffix, and the
    /// device's budget (below the model's size) makes them compete.
    fn fallback_problem() -> impl Strategy<Value = PlanProblem> {
        (3usize..=7, 2usize..=4).prop_flat_map(|(n, m)| {
            (
                prop::collection::vec((1u64..=10, 0u32..=40), n),
                prop::collection::vec(0u32..=4, n),
                prop::collection::vec((0u64..=60, prop::collection::vec(2u32..=30, n)), m - 1),
                prop::collection::vec(prop::option::weighted(0.9, (0u32..=30, 1u32..=20)), m * m),
                0u64..=100,
                any::<bool>(),
            )
                .prop_map(
                    move |(layers, device_comp, servers, links, budget_pct, pin_head)| {
                        let total: u64 = layers.iter().map(|l| l.0).sum();
                        let layers: Vec<LayerCost> = layers
                            .into_iter()
                            .enumerate()
                            .map(|(i, (mem, cut))| LayerCost {
                                name: format!("l{i}"),
                                memory_bytes: mem,
                                cut_bytes: f64::from(cut),
                            })
                            .collect();
                        let mut nodes = vec![NodeCost {
                            name: "device".into(),
                            // between the embedding alone and one byte short of the model
                            memory_budget_bytes: layers[0].memory_bytes
                                + (total - 1 - layers[0].memory_bytes.min(total - 1)) * budget_pct
                                    / 100,
                            compute_s: device_comp
                                .into_iter()
                                .map(|c| f64::from(c) / 10.0)
                                .collect(),
                        }];
                        nodes.extend(servers.into_iter().enumerate().map(|(j, (budget, comp))| {
                            NodeCost {
                                name: format!("n{}", j + 1),
                                memory_budget_bytes: budget,
                                compute_s: comp.into_iter().map(|c| f64::from(c) / 10.0).collect(),
                            }
                        }));
                        let links = (0..m)
                            .map(|a| {
                                (0..m)
                                    .map(|b| {
                                        links[a * m + b].filter(|_| a != b).map(|(lat, bw)| {
                                            LinkCost {
                                                one_way_latency_s: f64::from(lat) / 10.0,
                                                bytes_per_s: f64::from(bw),
                                            }
                                        })
                                    })
                                    .collect()
                            })
                            .collect();
                        PlanProblem {
                            layers,
                            nodes,
                            links,
                            device: 0,
                            pin_head,
                        }
                    },
                )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        #[test]
        fn fallback_matches_brute_force_and_the_exhaustive_search(p in fallback_problem()) {
            let (bounded, every, _) = both(&p);
            match (&bounded, brute_force::solve(&p, Objective::Latency)) {
                (Ok(plan), Some((optimum, _))) => {
                    prop_assert!(close(plan.objective_s, optimum), "{} vs brute {}", plan.objective_s, optimum);
                    prop_assert!(p.evaluate(&plan.assignment).is_ok());
                }
                (Err(PlanError::Infeasible(_)), None) => {}
                (dp, brute) => prop_assert!(false, "dp {:?} but brute {:?}", dp, brute),
            }
            prop_assert_eq!(format!("{bounded:?}"), format!("{every:?}"));
        }
    }

    /// The generator above must reach the fallback often, or the property
    /// says little about it.
    #[test]
    fn small_instances_reach_the_fallback() {
        use proptest::strategy::ValueTree;
        use proptest::test_runner::TestRunner;
        let mut runner = TestRunner::deterministic();
        let (mut ran, total) = (0, 2000);
        for _ in 0..total {
            let p = fallback_problem().new_tree(&mut runner).unwrap().current();
            ran += usize::from(both(&p).2);
        }
        assert!(ran * 3 > total, "the fallback ran on only {ran}/{total}");
    }

    /// Benchmark-sized problems (80 layers x 8 nodes, servers holding a
    /// quarter to three eighths of the model, a device that holds a third
    /// of it and is anywhere from the slowest node to the fastest), with
    /// uniform blocks (many near-ties) or random costs.
    fn large_problem() -> impl Strategy<Value = PlanProblem> {
        (
            any::<u64>(),
            1.0f64..10.0,
            0.2f64..0.45,
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(seed, device_speed, device_share, uniform, pin_head)| {
                let mut state = seed | 1;
                let mut rng = move || {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 11) as f64 / (1u64 << 53) as f64
                };
                let (n, m) = (80, 8);
                let layers: Vec<LayerCost> = (0..n)
                    .map(|i| LayerCost {
                        name: format!("l{i}"),
                        memory_bytes: (40 + (rng() * 10.0) as u64) * 1_000_000,
                        cut_bytes: 6144.0,
                    })
                    .collect();
                let total: u64 = layers.iter().map(|l| l.memory_bytes).sum();
                let nodes = (0..m)
                    .map(|j| {
                        let (budget, speed) = if j == 0 {
                            ((total as f64 * device_share) as u64, device_speed)
                        } else {
                            (
                                total / 4 + (rng() * total as f64 / 8.0) as u64,
                                2.0 + 6.0 * rng(),
                            )
                        };
                        let compute_s = (0..n)
                            .map(|i| {
                                let base = match (uniform, i) {
                                    (false, _) => 0.001 + 0.0005 * rng(),
                                    (true, 0) => 0.00001,
                                    (true, i) if i == n - 1 => 0.004,
                                    (true, _) => 0.0012,
                                };
                                base / speed
                            })
                            .collect();
                        NodeCost {
                            name: format!("n{j}"),
                            memory_budget_bytes: budget,
                            compute_s,
                        }
                    })
                    .collect();
                let links = (0..m)
                    .map(|a| {
                        (0..m)
                            .map(|b| {
                                (a != b).then(|| LinkCost {
                                    one_way_latency_s: 0.001 + 0.05 * rng(),
                                    bytes_per_s: 1e6 + 1e8 * rng(),
                                })
                            })
                            .collect()
                    })
                    .collect();
                PlanProblem {
                    layers,
                    nodes,
                    links,
                    device: 0,
                    pin_head,
                }
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn large_instances_get_the_exhaustive_searchs_plan(p in large_problem()) {
            let (bounded, every, _) = both(&p);
            prop_assert_eq!(format!("{bounded:?}"), format!("{every:?}"));
        }
    }

    #[test]
    fn large_instances_reach_the_fallback() {
        use proptest::strategy::ValueTree;
        use proptest::test_runner::TestRunner;
        let mut runner = TestRunner::deterministic();
        let (mut ran, total) = (0, 24);
        for _ in 0..total {
            let p = large_problem().new_tree(&mut runner).unwrap().current();
            let before = FALLBACK_RUNS.with(|r| r.get());
            let _ = solve(&p, Objective::Latency);
            ran += usize::from(FALLBACK_RUNS.with(|r| r.get()) > before);
        }
        assert!(ran * 2 > total, "the fallback ran on only {ran}/{total}");
    }
}
