//! The sampled speculative output is the target's own seeded output, and that output
//! is distributed as the target's sampling distribution: the two halves of
//! "lossless" for keyed verification ([`tandem_model::verify`]).
//!
//! Setup: a tiny vocabulary (8 tokens) and context-dependent target and draft models
//! (logits are a fixed function of the prefix). The target samples with temperature
//! 0.9 and top-p 0.95, the draft with temperature 1, both keyed by the same seed. For
//! each of `DRAWS` seeds, two-token generations run speculatively (k = 1, 2, 3, with
//! draft-model, prompt-lookup and adversarial proposals) and with the target alone:
//! - **drafter invariance** (exact): every speculative generation equals the target's
//!   own for its seed;
//! - **the target's distribution** (statistical): over the seeds, the first token is
//!   chi-square-tested against p(· | empty) and the pair against p(e1) · p(e2 | e1).
//!
//! - **under a grammar** (structured output): proposals masked as the engine masks
//!   them and verdicts by `engine::masked_verdict` give the target's own seeded
//!   draws from its masked distribution, distributed as that distribution.
//!
//! The seeds are fixed, so the outcome is deterministic and cannot flake; the
//! threshold is p > 1e-4. Negative controls show each check has the power to fail: a
//! rule that accepts every drafted token breaks invariance, and a biased race
//! (`-ln(u) / p²`) fails the chi-square.

#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod verify_support;

use tandem_model::sampling::{
    distribution, keyed_uniform, next_token, Distribution, SamplingParams,
};
use tandem_model::verify::{verdict_from_logits, Verdict};
use verify_support::{chi2_sf, chi_square, gamma_q, Chi2};

const V: usize = 8;
const DRAWS: u64 = 100_000;
const ALPHA: f64 = 1e-4;

/// Deterministic hash of a prefix, used to make the toy models context-dependent.
fn prefix_hash(prefix: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in prefix {
        h ^= t as u64 + 1;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn target_logits(prefix: &[u32]) -> Vec<f32> {
    let h = prefix_hash(prefix);
    (0..V)
        .map(|i| {
            let base = [1.2f32, 0.4, 0.9, -0.3, 0.1, 0.7, -0.8, 0.0][i];
            let wiggle = ((h >> (i * 5)) & 0x1f) as f32 / 31.0 - 0.5; // [-0.5, 0.5]
            base + wiggle
        })
        .collect()
}

/// The draft disagrees with the target in a context-dependent way.
fn draft_logits(prefix: &[u32]) -> Vec<f32> {
    let h = prefix_hash(prefix).rotate_left(17);
    target_logits(prefix)
        .iter()
        .enumerate()
        .map(|(i, &l)| l + ((h >> (i * 6)) & 0x3f) as f32 / 63.0 * 1.6 - 0.8)
        .collect()
}

fn target_params(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_p: 0.95, // exercises tokens the draft proposes but the target forbids
        seed,
        ..SamplingParams::default()
    }
}

fn draft_params(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed,
        ..SamplingParams::default()
    }
}

fn p_of(prefix: &[u32]) -> Distribution {
    distribution(&target_params(0), &target_logits(prefix), &[])
}

fn q_of(prefix: &[u32]) -> Distribution {
    distribution(&draft_params(0), &draft_logits(prefix), &[])
}

/// What drafts the toy rounds.
#[derive(Clone, Copy, Debug)]
enum Proposal {
    /// The draft model, keyed like the target.
    DraftModel,
    /// Prompt lookup: a token fixed by the context (some the target forbids).
    Lookup,
    /// A token unrelated to both models (an old or hostile client).
    Adversarial,
}

/// The toy lookup's token after `ctx`.
fn lookup_token(ctx: &[u32]) -> u32 {
    (prefix_hash(ctx) % V as u64) as u32
}

fn propose(proposal: Proposal, seed: u64, ctx: &[u32]) -> u32 {
    match proposal {
        Proposal::DraftModel => next_token(&draft_params(seed), &draft_logits(ctx), ctx),
        Proposal::Lookup => lookup_token(ctx),
        Proposal::Adversarial => (prefix_hash(ctx).rotate_left(29) ^ seed) as u32 % V as u32,
    }
}

type Rule = fn(&SamplingParams, &[u32], &[u32], &[f32]) -> Verdict;

/// The rule under test.
fn keyed_rule(params: &SamplingParams, history: &[u32], d: &[u32], logits: &[f32]) -> Verdict {
    verdict_from_logits(params, history, d, logits).expect("well-formed block")
}

/// Wrong: accept every drafted token, then the target's next token.
fn always_accept_rule(
    params: &SamplingParams,
    history: &[u32],
    d: &[u32],
    logits: &[f32],
) -> Verdict {
    let mut hist = history.to_vec();
    hist.extend_from_slice(d);
    Verdict {
        accepted: d.len(),
        next_token: next_token(params, &logits[d.len() * V..], &hist),
    }
}

/// The target alone: `n` tokens for `seed`.
fn target_alone(seed: u64, n: usize) -> Vec<u32> {
    let params = target_params(seed);
    let mut out = Vec::new();
    while out.len() < n {
        let t = next_token(&params, &target_logits(&out), &out);
        out.push(t);
    }
    out
}

/// Two tokens for `seed`, in rounds of `k` proposals verified by `rule`;
/// returns them with (rounds, accepted drafted tokens).
fn speculative(k: usize, proposal: Proposal, rule: Rule, seed: u64) -> (Vec<u32>, usize, usize) {
    let params = target_params(seed);
    let mut out: Vec<u32> = Vec::new();
    let (mut rounds, mut accepted) = (0, 0);
    while out.len() < 2 {
        let mut ctx = out.clone();
        let mut d = Vec::with_capacity(k);
        for _ in 0..k {
            let t = propose(proposal, seed, &ctx);
            d.push(t);
            ctx.push(t);
        }
        // One row per position: after out, after out + d1, ...
        let logits: Vec<f32> = (0..=k)
            .flat_map(|i| {
                let mut pre = out.clone();
                pre.extend_from_slice(&d[..i]);
                target_logits(&pre)
            })
            .collect();
        let v = rule(&params, &out, &d, &logits);
        rounds += 1;
        accepted += v.accepted;
        out.extend(v.emitted(&d));
    }
    out.truncate(2);
    (out, rounds, accepted)
}

struct Outcome {
    first: Vec<u64>,
    pair: Vec<u64>,
    /// Seeds whose speculative output differs from the target's own.
    differ: u64,
    rounds: usize,
    accepted: usize,
}

fn simulate(k: usize, proposal: Proposal, rule: Rule) -> Outcome {
    let mut o = Outcome {
        first: vec![0; V],
        pair: vec![0; V * V],
        differ: 0,
        rounds: 0,
        accepted: 0,
    };
    for seed in 0..DRAWS {
        let (out, rounds, accepted) = speculative(k, proposal, rule, seed);
        if out != target_alone(seed, 2) {
            o.differ += 1;
        }
        o.rounds += rounds;
        o.accepted += accepted;
        o.first[out[0] as usize] += 1;
        o.pair[out[0] as usize * V + out[1] as usize] += 1;
    }
    o
}

fn expected_first() -> Vec<f64> {
    let p = p_of(&[]);
    (0..V as u32).map(|t| p.prob(t) as f64).collect()
}

fn expected_pair() -> Vec<f64> {
    let p1 = p_of(&[]);
    let mut e = vec![0.0; V * V];
    for a in 0..V as u32 {
        let p2 = p_of(&[a]);
        for b in 0..V as u32 {
            e[a as usize * V + b as usize] = p1.prob(a) as f64 * p2.prob(b) as f64;
        }
    }
    let total: f64 = e.iter().sum();
    e.iter().map(|x| x / total).collect()
}

fn tests_for(first: &[u64], pair: &[u64]) -> (Chi2, Chi2) {
    (
        chi_square(first, &expected_first()),
        chi_square(pair, &expected_pair()),
    )
}

fn total_variation(p: &Distribution, q: &Distribution) -> f64 {
    (0..V as u32)
        .map(|t| (p.prob(t) as f64 - q.prob(t) as f64).abs())
        .sum::<f64>()
        / 2.0
}

#[test]
fn toy_models_make_the_test_meaningful() {
    // The draft must really differ from the target, or "lossless" would be
    // trivial, and the target's top-p must forbid some token the draft can propose.
    let (p, q) = (p_of(&[]), q_of(&[]));
    let tv = total_variation(&p, &q);
    assert!(tv > 0.1, "total variation between p and q is only {tv}");
    assert_eq!(q.len(), V);
    assert!(p.len() < V, "top-p should cut the target's tail");
    // Context dependence: p(.|a) differs between some a.
    assert_ne!(p_of(&[0]), p_of(&[1]));
    // The toy lookup is right sometimes and wrong sometimes.
    let hits = (0..V as u32)
        .map(|a| p_of(&[a]).prob(lookup_token(&[a])))
        .filter(|&pr| pr > 0.0)
        .count();
    assert!(hits > 0 && hits < V, "lookup hits {hits} of {V}");
}

#[test]
fn every_proposal_gives_the_targets_own_seeded_output_distributed_as_p() {
    for proposal in [
        Proposal::DraftModel,
        Proposal::Lookup,
        Proposal::Adversarial,
    ] {
        for k in 1..=3 {
            let o = simulate(k, proposal, keyed_rule);
            let (c1, c2) = tests_for(&o.first, &o.pair);
            let acceptance = o.accepted as f64 / (o.rounds * k) as f64;
            println!(
                "{proposal:?} k={k}: rounds={} acceptance={acceptance:.3} first: chi2={:.2} \
                 df={} p={:.4}; pair: chi2={:.2} df={} p={:.4}",
                o.rounds, c1.stat, c1.df, c1.p_value, c2.stat, c2.df, c2.p_value
            );
            assert_eq!(
                o.differ, 0,
                "{proposal:?} k={k}: outputs differ from the target's"
            );
            // Acceptance and rejection must both happen (the adversary is mostly wrong).
            assert!(
                acceptance > 0.02 && acceptance < 0.98,
                "{proposal:?} k={k}: acceptance {acceptance}"
            );
            assert!(
                c1.p_value > ALPHA,
                "{proposal:?} k={k}: first token not ~ p: {c1:?}"
            );
            assert!(
                c2.p_value > ALPHA,
                "{proposal:?} k={k}: pair not ~ p: {c2:?}"
            );
        }
    }
}

#[test]
fn the_keyed_draft_is_accepted_at_least_at_the_coupling_bound() {
    // Gumbel-max coupling: P(draft's draw = target's draw) >= (1 - tv) / (1 + tv).
    let (p, q) = (p_of(&[]), q_of(&[]));
    let tv = total_variation(&p, &q);
    let same = (0..DRAWS)
        .filter(|&seed| {
            next_token(&draft_params(seed), &draft_logits(&[]), &[])
                == next_token(&target_params(seed), &target_logits(&[]), &[])
        })
        .count() as f64
        / DRAWS as f64;
    let bound = (1.0 - tv) / (1.0 + tv);
    println!(
        "first position: tv={tv:.3} coupled={same:.4} bound={bound:.4} rejection rule={:.4}",
        1.0 - tv
    );
    // Four standard errors below the bound would be a real shortfall.
    let se = (bound * (1.0 - bound) / DRAWS as f64).sqrt();
    assert!(
        same >= bound - 4.0 * se,
        "coupled acceptance {same} below the bound {bound}"
    );
    assert!(
        same <= 1.0 - tv + 4.0 * se,
        "no coupling beats the optimal {}",
        1.0 - tv
    );
}

#[test]
fn negative_control_accepting_every_draft_token_breaks_invariance() {
    let o = simulate(2, Proposal::DraftModel, always_accept_rule);
    let (c1, c2) = tests_for(&o.first, &o.pair);
    println!(
        "always-accept: differ={} first p={:e} pair p={:e}",
        o.differ, c1.p_value, c2.p_value
    );
    assert!(o.differ > DRAWS / 10, "only {} of {DRAWS} differ", o.differ);
    assert!(c1.p_value < ALPHA || c2.p_value < ALPHA, "{c1:?} {c2:?}");
}

#[test]
fn negative_control_a_biased_race_fails_the_chi_square() {
    // -ln(u) / p^2 favours likely tokens: the chi-square must see it.
    let p = p_of(&[]);
    let mut first = vec![0u64; V];
    for seed in 0..DRAWS {
        let t = p
            .entries()
            .iter()
            .map(|&(t, pt)| (t, -keyed_uniform(seed, 0, t).ln() / f64::from(pt).powi(2)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(0, |(t, _)| t);
        first[t as usize] += 1;
    }
    let c = chi_square(&first, &expected_first());
    assert!(c.p_value < ALPHA, "{c:?}");
}

// ---- under a grammar (structured output, docs/grammar.md) ----

/// A toy grammar: after each prefix a context-dependent half of the
/// vocabulary is allowed (always token 0 and at least one other). Stateless,
/// so it also checks that the engine asks it about the right contexts.
struct ToyGrammar;

impl ToyGrammar {
    fn allows(prefix: &[u32], t: u32) -> bool {
        let h = prefix_hash(prefix).rotate_left(7);
        t == 0 || t == 1 + (h % (V as u64 - 1)) as u32 || (h >> (t * 3)) & 1 == 1
    }
}

impl tandem_model::engine::OutputConstraint for ToyGrammar {
    fn mask(&mut self, context: &[u32], logits: &mut [f32]) -> tandem_model::Result<()> {
        for (t, l) in logits.iter_mut().enumerate() {
            if !Self::allows(context, t as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    fn allowed_prefix(&mut self, context: &[u32], tokens: &[u32]) -> tandem_model::Result<usize> {
        let mut ctx = context.to_vec();
        let mut n = 0;
        for &t in tokens {
            if !Self::allows(&ctx, t) {
                break;
            }
            ctx.push(t);
            n += 1;
        }
        Ok(n)
    }
}

fn masked(mut logits: Vec<f32>, prefix: &[u32]) -> Vec<f32> {
    use tandem_model::engine::OutputConstraint;
    ToyGrammar.mask(prefix, &mut logits).unwrap();
    logits
}

/// The target's distribution under the toy grammar.
fn p_masked(prefix: &[u32]) -> Distribution {
    distribution(
        &target_params(0),
        &masked(target_logits(prefix), prefix),
        &[],
    )
}

/// The target alone under the grammar: `n` tokens for `seed`.
fn target_alone_masked(seed: u64, n: usize) -> Vec<u32> {
    let params = target_params(seed);
    let mut out = Vec::new();
    while out.len() < n {
        let mut l = target_logits(&out);
        let t = tandem_model::engine::choose(&params, &mut l, &out, Some(&mut ToyGrammar)).unwrap();
        out.push(t);
    }
    out
}

/// Two tokens for `seed` under the grammar: proposals masked as the
/// engine masks them (the draft's draw from its masked logits, lookup cut at
/// the first refused token; an adversary's not at all), verdicts by
/// `tandem_model::engine::masked_verdict`.
fn speculative_masked(k: usize, proposal: Proposal, seed: u64) -> Vec<u32> {
    use tandem_model::engine::OutputConstraint;
    let params = target_params(seed);
    let mut out: Vec<u32> = Vec::new();
    while out.len() < 2 {
        let mut ctx = out.clone();
        let mut d = Vec::with_capacity(k);
        for _ in 0..k {
            let t = match proposal {
                Proposal::DraftModel => {
                    let mut l = draft_logits(&ctx);
                    tandem_model::engine::choose(
                        &draft_params(seed),
                        &mut l,
                        &ctx,
                        Some(&mut ToyGrammar),
                    )
                    .unwrap()
                }
                other => propose(other, seed, &ctx),
            };
            d.push(t);
            ctx.push(t);
        }
        if let Proposal::Lookup = proposal {
            let n = ToyGrammar.allowed_prefix(&out, &d).unwrap();
            d.truncate(n);
        }
        let logits: Vec<f32> = (0..=d.len())
            .flat_map(|i| {
                let mut pre = out.clone();
                pre.extend_from_slice(&d[..i]);
                target_logits(&pre)
            })
            .collect();
        let v = tandem_model::engine::masked_verdict(&params, &out, &d, &logits, &mut ToyGrammar)
            .unwrap();
        out.extend(v.emitted(&d));
    }
    out.truncate(2);
    out
}

#[test]
fn under_a_grammar_every_proposal_gives_the_targets_own_masked_draws_distributed_as_masked_p() {
    // The grammar matters: it forbids tokens the target would draw.
    let p = p_of(&[]);
    assert!((0..V as u32).any(|t| p.prob(t) > 0.0 && !ToyGrammar::allows(&[], t)));
    let e1: Vec<f64> = {
        let p = p_masked(&[]);
        (0..V as u32).map(|t| p.prob(t) as f64).collect()
    };
    let e2: Vec<f64> = {
        let p1 = p_masked(&[]);
        let mut e = vec![0.0; V * V];
        for a in 0..V as u32 {
            let p2 = p_masked(&[a]);
            for b in 0..V as u32 {
                e[a as usize * V + b as usize] = p1.prob(a) as f64 * p2.prob(b) as f64;
            }
        }
        let total: f64 = e.iter().sum();
        e.iter().map(|x| x / total).collect()
    };
    for proposal in [
        Proposal::DraftModel,
        Proposal::Lookup,
        Proposal::Adversarial,
    ] {
        for k in [1, 3] {
            let (mut first, mut pair, mut differ) = (vec![0u64; V], vec![0u64; V * V], 0);
            for seed in 0..DRAWS / 2 {
                let out = speculative_masked(k, proposal, seed);
                if out != target_alone_masked(seed, 2) {
                    differ += 1;
                }
                assert!(ToyGrammar::allows(&[], out[0]) && ToyGrammar::allows(&out[..1], out[1]));
                first[out[0] as usize] += 1;
                pair[out[0] as usize * V + out[1] as usize] += 1;
            }
            let (c1, c2) = (chi_square(&first, &e1), chi_square(&pair, &e2));
            println!(
                "masked {proposal:?} k={k}: first p={:.4}, pair p={:.4}",
                c1.p_value, c2.p_value
            );
            assert_eq!(
                differ, 0,
                "{proposal:?} k={k}: outputs differ from the target's own"
            );
            assert!(
                c1.p_value > ALPHA,
                "{proposal:?} k={k}: first not ~ masked p: {c1:?}"
            );
            assert!(
                c2.p_value > ALPHA,
                "{proposal:?} k={k}: pair not ~ masked p: {c2:?}"
            );
        }
    }
}

// ---- the statistics themselves ----

fn poisson_tail_even_df(stat: f64, df: usize) -> f64 {
    // For even df = 2n: Q(n, y) = e^{-y} Σ_{i<n} y^i / i!, with y = stat / 2.
    let y = stat / 2.0;
    let mut term = (-y).exp();
    let mut sum = 0.0;
    for i in 0..df / 2 {
        if i > 0 {
            term *= y / i as f64;
        }
        sum += term;
    }
    sum
}

#[test]
fn chi_square_tail_matches_closed_form_for_even_df() {
    for df in (2..=120).step_by(2) {
        for &mult in &[0.3, 0.8, 1.0, 1.3, 2.0, 3.0] {
            let stat = df as f64 * mult;
            let got = chi2_sf(stat, df);
            let want = poisson_tail_even_df(stat, df);
            assert!(
                (got - want).abs() <= 1e-10 + 1e-8 * want,
                "df={df} stat={stat}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn chi_square_tail_matches_published_critical_values() {
    // Standard table values (upper tail probability at the critical value).
    let cases = [
        (3.841_459, 1, 0.05),
        (6.634_897, 1, 0.01),
        (10.827_566, 1, 0.001),
        (11.070_498, 5, 0.05),
        (18.307_038, 10, 0.05),
        (23.209_251, 10, 0.01),
        (31.410_433, 20, 0.05),
    ];
    for (stat, df, p) in cases {
        let got = chi2_sf(stat, df);
        assert!((got - p).abs() < 1e-6, "df={df} stat={stat}: {got} vs {p}");
    }
    assert!((gamma_q(1.0, 2.0) - (-2.0f64).exp()).abs() < 1e-14);
}

#[test]
fn chi_square_rejects_zero_probability_cells_and_accepts_exact_counts() {
    let c = chi_square(&[10, 0, 1], &[0.5, 0.5, 0.0]);
    assert_eq!(c.p_value, 0.0);
    let c = chi_square(&[500, 300, 200], &[0.5, 0.3, 0.2]);
    assert!(c.stat < 1e-12 && c.p_value > 0.999);
}
