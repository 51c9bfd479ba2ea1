//! Planning time for 80 layers x 8 nodes, fully connected, for both
//! objectives, with and without the head pinned, with the device able to hold
//! the whole model or not, and with the device the slowest node or as fast as
//! the fastest server. The fast device holding a third of the model is the
//! latency planner's per-prefix fallback (the device's prefix and suffix
//! compete for its memory).
//!
//! Every case runs the planner twice, interleaved batch by batch in the same
//! process: `solve` with the per-prefix fallback searched exhaustively (one
//! full table per prefix end, the baseline) and bounded best first (what
//! `solve` uses). Both must give the same plan.
//!
//! `cargo run --release -p tandem-shard --example plan_bench`

use std::time::Instant;

use tandem_shard::{
    solve_with_fallback, FallbackSearch, LayerCost, LinkCost, NodeCost, Objective, Plan, PlanError,
    PlanProblem,
};
/// Deterministic pseudo-random numbers in [0, 1) (xorshift), so runs compare.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Nanoseconds this thread has spent on a CPU (Linux schedstat), so that a
/// busy shared machine does not inflate the figure; `None` elsewhere.
fn cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// One benchmark problem.
#[derive(Clone, Copy)]
struct Case {
    objective: Objective,
    /// Identical blocks and per-node speed factors (how `tandem plan`
    /// builds problems from a profile); otherwise every (layer, node) compute
    /// time is drawn independently (the worst case for the throughput search).
    uniform: bool,
    pin_head: bool,
    /// The device's budget holds the whole model, or a third of it.
    device_holds_all: bool,
    /// The device's speed factor; servers draw theirs from [2, 8).
    device_speed: f64,
}

fn problem(n: usize, m: usize, case: Case) -> PlanProblem {
    let Case {
        uniform,
        pin_head,
        device_holds_all,
        device_speed,
        ..
    } = case;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let layer_mb = 40u64;
    let layers: Vec<LayerCost> = (0..n)
        .map(|i| LayerCost {
            name: format!("l{i}"),
            memory_bytes: (layer_mb + (rng.next() * 10.0) as u64) * 1_000_000,
            cut_bytes: 6144.0,
        })
        .collect();
    let total: u64 = layers.iter().map(|l| l.memory_bytes).sum();
    let nodes = (0..m)
        .map(|j| {
            let budget = if j == 0 {
                if device_holds_all {
                    total
                } else {
                    total / 3
                }
            } else {
                // each server holds about a quarter of the model
                total / 4 + (rng.next() * total as f64 / 8.0) as u64
            };
            let speed = if j == 0 {
                device_speed
            } else {
                2.0 + 6.0 * rng.next()
            };
            let compute_s = (0..n)
                .map(|i| {
                    let base = if !uniform {
                        0.001 + 0.0005 * rng.next()
                    } else if i == 0 {
                        0.00001
                    } else if i == n - 1 {
                        0.004
                    } else {
                        0.0012
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
                        one_way_latency_s: 0.001 + 0.05 * rng.next(),
                        bytes_per_s: 1e6 + 1e8 * rng.next(),
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
}

/// One timed batch: milliseconds per plan, wall and on-CPU.
struct Batch {
    wall_ms: f64,
    cpu_ms: f64,
}

/// Plans `p` `runs` times; the CPU time is the thread's, over the whole
/// batch (schedstat only moves at scheduler events, so a batch must last
/// many ticks).
fn time_batch(
    p: &PlanProblem,
    objective: Objective,
    fallback: FallbackSearch,
    runs: usize,
) -> Result<(Batch, Plan), PlanError> {
    let cpu_start = cpu_ns();
    let t = Instant::now();
    let mut plan = solve_with_fallback(p, objective, fallback)?;
    for _ in 1..runs {
        plan = solve_with_fallback(p, objective, fallback)?;
    }
    let wall = t.elapsed().as_secs_f64();
    let cpu_ms = match (cpu_start, cpu_ns()) {
        (Some(a), Some(b)) => b.saturating_sub(a) as f64 / 1e6,
        _ => f64::NAN,
    };
    let per_run = runs.max(1) as f64;
    let batch = Batch {
        wall_ms: wall * 1e3 / per_run,
        cpu_ms: cpu_ms / per_run,
    };
    Ok((batch, plan))
}

fn median(xs: Vec<f64>) -> f64 {
    tandem_stats::median(&xs).unwrap_or(f64::NAN)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Rounds per case; each round times one batch of each variant, alternating
/// which goes first.
const ROUNDS: usize = 15;
/// Target length of one batch, so that schedstat's tick granularity is small
/// against it.
const BATCH_TARGET_MS: f64 = 40.0;

fn main() {
    let (n, m) = (80, 8);
    println!(
        "planning {n} layers x {m} nodes; load average {}",
        load_average()
    );
    println!(
        "per plan: median over {ROUNDS} interleaved rounds of the per-plan mean of one batch (>= {BATCH_TARGET_MS} ms)"
    );
    println!(
        "{:<11} {:<8} {:<9} {:<18} {:<7} {:>16} {:>16} {:>7}  {:<10} plan value",
        "objective",
        "costs",
        "pin-head",
        "device memory",
        "device",
        "every prefix",
        "bounded",
        "ratio",
        "same plan"
    );
    println!(
        "{:<11} {:<8} {:<9} {:<18} {:<7} {:>16} {:>16} {:>7}",
        "", "", "", "", "speed", "wall / CPU ms", "wall / CPU ms", "CPU"
    );
    let mut cases = Vec::new();
    for (objective, uniform) in [
        (Objective::Latency, true),
        (Objective::Latency, false),
        (Objective::Throughput, true),
        (Objective::Throughput, false),
    ] {
        for pin_head in [false, true] {
            for device_holds_all in [true, false] {
                cases.push(Case {
                    objective,
                    uniform,
                    pin_head,
                    device_holds_all,
                    device_speed: 1.0,
                });
            }
        }
    }
    // The per-prefix fallback: a device as fast as the fastest server wants
    // both a long prefix and a long suffix, and they share its budget.
    for device_speed in [2.0, 8.0] {
        for uniform in [true, false] {
            for pin_head in [false, true] {
                cases.push(Case {
                    objective: Objective::Latency,
                    uniform,
                    pin_head,
                    device_holds_all: false,
                    device_speed,
                });
            }
        }
    }
    for case in cases {
        if let Err(e) = bench_case(n, m, case) {
            println!("error: {e}");
            return;
        }
    }
    println!("load average at the end {}", load_average());
}

fn bench_case(n: usize, m: usize, case: Case) -> Result<(), PlanError> {
    let p = problem(n, m, case);
    let variants = [
        FallbackSearch::EveryPrefix,
        FallbackSearch::BoundedBestFirst,
    ];
    // Warm-up, and the batch size that makes a batch last BATCH_TARGET_MS.
    let mut runs = [0usize; 2];
    let mut plans = Vec::new();
    for (v, &fallback) in variants.iter().enumerate() {
        let (warm, plan) = time_batch(&p, case.objective, fallback, 3)?;
        runs[v] = (BATCH_TARGET_MS / warm.wall_ms.max(1e-3))
            .ceil()
            .clamp(1.0, 10_000.0) as usize;
        plans.push(plan);
    }
    let mut wall = [Vec::new(), Vec::new()];
    let mut cpu = [Vec::new(), Vec::new()];
    for round in 0..ROUNDS {
        for step in 0..2 {
            let v = (round + step) % 2;
            let (batch, _) = time_batch(&p, case.objective, variants[v], runs[v])?;
            wall[v].push(batch.wall_ms);
            cpu[v].push(batch.cpu_ms);
        }
    }
    let [wall_every, wall_bounded] = wall.map(median);
    let [cpu_every, cpu_bounded] = cpu.map(median);
    let same = plans[0] == plans[1];
    println!(
        "{:<11} {:<8} {:<9} {:<18} {:<7} {:>7.3} / {:>6.3} {:>7.3} / {:>6.3} {:>6.1}x  {:<10} {:.4} s",
        case.objective.to_string(),
        if case.uniform { "uniform" } else { "random" },
        if case.pin_head { "yes" } else { "no" },
        if case.device_holds_all {
            "holds whole model"
        } else {
            "1/3 of the model"
        },
        case.device_speed,
        wall_every,
        cpu_every,
        wall_bounded,
        cpu_bounded,
        cpu_every / cpu_bounded,
        if same { "yes" } else { "NO" },
        plans[1].objective_s
    );
    Ok(())
}
