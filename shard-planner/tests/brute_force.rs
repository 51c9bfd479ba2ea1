//! The DP against exhaustive search on random small problems, with memory
//! budgets drawn so that they bind, for both objectives and both pin options.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use proptest::prelude::*;
use tandem_shard::{
    brute_force, solve, LayerCost, LinkCost, NodeCost, Objective, PlanError, PlanProblem,
};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

/// A random problem: 1..=6 layers, 1..=4 nodes, per-node compute, memory
/// budgets between "one layer" and "the whole model", sparse random links.
fn problem() -> impl Strategy<Value = PlanProblem> {
    sized_problem(1..=6, 1..=4)
}

/// Fewer layers, more nodes: exercises larger node subsets.
fn wide_problem() -> impl Strategy<Value = PlanProblem> {
    sized_problem(1..=5, 5..=5)
}

fn sized_problem(
    layers: std::ops::RangeInclusive<usize>,
    nodes: std::ops::RangeInclusive<usize>,
) -> impl Strategy<Value = PlanProblem> {
    (layers, nodes).prop_flat_map(|(n, m)| {
        (
            prop::collection::vec((1u64..=10, 0u32..=40), n),
            prop::collection::vec((0u64..=40, prop::collection::vec(0u32..=50, n)), m),
            prop::collection::vec(prop::option::weighted(0.8, (0u32..=20, 1u32..=20)), m * m),
            0..m,
            any::<bool>(),
        )
            .prop_map(move |(layers, nodes, links, device, pin_head)| {
                let layers: Vec<LayerCost> = layers
                    .into_iter()
                    .enumerate()
                    .map(|(i, (mem, cut))| LayerCost {
                        name: format!("l{i}"),
                        memory_bytes: mem,
                        cut_bytes: f64::from(cut),
                    })
                    .collect();
                let nodes = nodes
                    .into_iter()
                    .enumerate()
                    .map(|(j, (budget, comp))| NodeCost {
                        name: format!("n{j}"),
                        memory_budget_bytes: budget,
                        compute_s: comp.into_iter().map(|c| f64::from(c) / 10.0).collect(),
                    })
                    .collect();
                let links = (0..m)
                    .map(|a| {
                        (0..m)
                            .map(|b| {
                                links[a * m + b].map(|(lat, bw)| LinkCost {
                                    one_way_latency_s: f64::from(lat) / 10.0,
                                    bytes_per_s: f64::from(bw),
                                })
                            })
                            .collect()
                    })
                    .collect();
                PlanProblem {
                    layers,
                    nodes,
                    links,
                    device,
                    pin_head,
                }
            })
    })
}

fn check(p: &PlanProblem, objective: Objective) -> Result<(), TestCaseError> {
    let brute = brute_force::solve(p, objective);
    match (solve(p, objective), brute) {
        (Ok(plan), Some((best, _))) => {
            prop_assert!(
                close(plan.objective_s, best),
                "dp {} vs brute {} for {:?}",
                plan.objective_s,
                best,
                plan.assignment
            );
            let e = p.evaluate(&plan.assignment);
            prop_assert!(e.is_ok(), "dp plan not allowed: {:?}", e);
            if let Ok(e) = e {
                prop_assert!(close(e.objective_s(objective), plan.objective_s));
                prop_assert_eq!(&e, &plan.evaluation);
            }
        }
        (Err(PlanError::Infeasible(_)), None) => {}
        (dp, brute) => prop_assert!(false, "dp {:?} but brute {:?}", dp, brute),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn latency_matches_brute_force(p in problem()) {
        check(&p, Objective::Latency)?;
    }

    #[test]
    fn throughput_matches_brute_force(p in problem()) {
        check(&p, Objective::Throughput)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn five_nodes_match_brute_force(p in wide_problem()) {
        check(&p, Objective::Latency)?;
        check(&p, Objective::Throughput)?;
    }
}

/// The random budgets must actually bind: many instances where the
/// unconstrained optimum is not allowed, and some that are infeasible.
#[test]
fn memory_limits_bind_in_the_generated_instances() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut binding, mut infeasible, mut total) = (0, 0, 0);
    for _ in 0..2000 {
        let mut p = problem().new_tree(&mut runner).unwrap().current();
        total += 1;
        let constrained = brute_force::solve(&p, Objective::Latency);
        for node in &mut p.nodes {
            node.memory_budget_bytes = u64::MAX;
        }
        let free = brute_force::solve(&p, Objective::Latency);
        match (constrained, free) {
            (None, _) => infeasible += 1,
            (Some((c, _)), Some((f, _))) if c > f + 1e-9 => binding += 1,
            _ => {}
        }
    }
    assert!(
        binding * 10 > total,
        "only {binding}/{total} instances bind"
    );
    assert!(
        infeasible * 20 > total,
        "only {infeasible}/{total} infeasible"
    );
    assert!(infeasible * 2 < total, "{infeasible}/{total} infeasible");
}
