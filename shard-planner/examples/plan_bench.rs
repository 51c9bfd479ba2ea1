//! Planning time for 80 layers x 8 nodes, fully connected, for both
//! objectives, with and without the head pinned, with the device able to hold
//! the whole model or not.
//!
//! `cargo run --release -p tandem-shard --example plan_bench`

use std::time::{Duration, Instant};

use tandem_shard::{solve, LayerCost, LinkCost, NodeCost, Objective, PlanProblem};

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

/// `uniform`: identical blocks and per-node speed factors (how `tandem plan`
/// builds problems from a profile); otherwise every (layer, node) compute
/// time is drawn independently (the worst case for the throughput search).
fn problem(
    n: usize,
    m: usize,
    device_holds_all: bool,
    pin_head: bool,
    uniform: bool,
) -> PlanProblem {
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
            let speed = if j == 0 { 1.0 } else { 2.0 + 6.0 * rng.next() };
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

fn main() {
    let (n, m) = (80, 8);
    println!(
        "planning {n} layers x {m} nodes (wall: median of 21 runs after 3 warm-up; on-CPU: mean)"
    );
    println!(
        "{:<11} {:<8} {:<9} {:<18} {:>10} {:>10}  plan value",
        "objective", "costs", "pin-head", "device memory", "wall", "on-CPU"
    );
    for (objective, uniform) in [
        (Objective::Latency, true),
        (Objective::Latency, false),
        (Objective::Throughput, true),
        (Objective::Throughput, false),
    ] {
        for pin_head in [false, true] {
            for holds_all in [true, false] {
                let p = problem(n, m, holds_all, pin_head, uniform);
                let mut times: Vec<Duration> = Vec::new();
                let mut cpu_start = None;
                let mut value = f64::NAN;
                for run in 0..24 {
                    if run == 3 {
                        cpu_start = cpu_ns();
                    }
                    let t = Instant::now();
                    let plan = solve(&p, objective);
                    let dt = t.elapsed();
                    match plan {
                        Ok(plan) => value = plan.objective_s,
                        Err(e) => {
                            println!("error: {e}");
                            return;
                        }
                    }
                    if run >= 3 {
                        times.push(dt);
                    }
                }
                times.sort();
                let median = times[times.len() / 2];
                // schedstat is only updated at scheduler events, so average
                // the thread's CPU time over all timed runs.
                let cpu_ms = match (cpu_start, cpu_ns()) {
                    (Some(a), Some(b)) => (b - a) as f64 / 1e6 / times.len() as f64,
                    _ => f64::NAN,
                };
                println!(
                    "{:<11} {:<8} {:<9} {:<18} {:>7.3} ms {:>7.3} ms  {:.4} s",
                    objective.to_string(),
                    if uniform { "uniform" } else { "random" },
                    if pin_head { "yes" } else { "no" },
                    if holds_all {
                        "holds whole model"
                    } else {
                        "1/3 of the model"
                    },
                    median.as_secs_f64() * 1e3,
                    cpu_ms,
                    value
                );
            }
        }
    }
}
