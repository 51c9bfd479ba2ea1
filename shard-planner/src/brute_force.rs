//! Exhaustive reference planner for small problems: tries every assignment of
//! layers to nodes (`nodes^layers` of them) and keeps the best one that
//! [`PlanProblem::evaluate`] allows. Used by the tests to check the DP.

use crate::problem::{Objective, PlanProblem};

/// The least objective value over all allowed assignments, with one
/// assignment that attains it; `None` if none is allowed. Refuses (returns
/// `None`) above a million assignments.
pub fn solve(p: &PlanProblem, objective: Objective) -> Option<(f64, Vec<usize>)> {
    let n = p.n_layers();
    let m = p.nodes.len();
    let total = (m as u64).checked_pow(n as u32)?;
    if total > 1_000_000 || n == 0 {
        return None;
    }
    let mut a = vec![0usize; n];
    let mut best: Option<(f64, Vec<usize>)> = None;
    for code in 0..total {
        let mut c = code;
        for slot in a.iter_mut() {
            *slot = (c % m as u64) as usize;
            c /= m as u64;
        }
        if let Ok(e) = p.evaluate(&a) {
            let v = e.objective_s(objective);
            if best.as_ref().is_none_or(|(b, _)| v < *b) {
                best = Some((v, a.clone()));
            }
        }
    }
    best
}
