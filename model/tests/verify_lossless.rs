//! Statistical proof that `verify_sampled` is lossless: the tokens a speculative round
//! emits are distributed exactly as the target's own sampling distribution.
//!
//! Setup: a tiny vocabulary (8 tokens) and context-dependent target and draft models
//! (logits are a fixed function of the prefix). The draft samples each token from its
//! top-4-truncated distribution; the target distributions use temperature and top-p.
//! For k = 1, 2, 3 we run ≥ 100k independent generations of two tokens (a second
//! round runs when the first round emitted only one token) and chi-square-test
//! - the first emitted token against p(· | empty), and
//! - the pair (first, second) against p(e1) · p(e2 | e1), i.e. the second token
//!   given the first.
//!
//! The same test runs with prompt-lookup proposals (point masses, q = 1).
//!
//! The seeds are fixed, so the outcome is deterministic and cannot flake; the
//! threshold is p > 1e-4. Negative controls run the same test on deliberately wrong
//! rules and require p < 1e-4, showing the test has the power to fail.

// The rule adapters below are plain fns (not #[test]) that unwrap valid blocks.
#![allow(clippy::unwrap_used)]

mod verify_support;

use tandem_model::sampling::{distribution, top_k_truncate, Distribution, Sampler, SamplingParams};
use tandem_model::verify::{verify_sampled, Verdict};
use verify_support::{chi2_sf, chi_square, gamma_q, Chi2};

const V: usize = 8;
const DRAFT_TOP_K: usize = 4;
const DRAWS: usize = 100_000;
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

fn target_params() -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_p: 0.95, // exercises tokens the draft proposes but the target forbids
        ..SamplingParams::default()
    }
}

fn draft_params() -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    }
}

fn p_of(prefix: &[u32]) -> Distribution {
    distribution(&target_params(), &target_logits(prefix), &[])
}

fn q_full_of(prefix: &[u32]) -> Distribution {
    distribution(&draft_params(), &draft_logits(prefix), &[])
}

fn q_of(prefix: &[u32]) -> Distribution {
    top_k_truncate(&q_full_of(prefix), DRAFT_TOP_K)
}

type Rule = fn(&[u32], &[Distribution], &[Distribution], &[Distribution], &mut Sampler) -> Verdict;

/// The rule under test (the `q_full` argument is unused: the verifier only sees what
/// the draft sent).
fn correct_rule(
    d: &[u32],
    q: &[Distribution],
    _q_full: &[Distribution],
    p: &[Distribution],
    rng: &mut Sampler,
) -> Verdict {
    verify_sampled(d, q, p, rng).unwrap()
}

/// Wrong: accept everything, bonus from p_{k+1}.
fn always_accept_rule(
    d: &[u32],
    _q: &[Distribution],
    _q_full: &[Distribution],
    p: &[Distribution],
    rng: &mut Sampler,
) -> Verdict {
    Verdict {
        accepted: d.len(),
        next_token: rng.sample(&p[d.len()]),
    }
}

/// Wrong: on rejection sample from p instead of the residual norm(max(0, p - q)).
fn resample_from_p_rule(
    d: &[u32],
    q: &[Distribution],
    _q_full: &[Distribution],
    p: &[Distribution],
    rng: &mut Sampler,
) -> Verdict {
    for i in 0..d.len() {
        let (qd, pd) = (q[i].prob(d[i]) as f64, p[i].prob(d[i]) as f64);
        if rng.uniform() * qd >= pd {
            return Verdict {
                accepted: i,
                next_token: rng.sample(&p[i]),
            };
        }
    }
    Verdict {
        accepted: d.len(),
        next_token: rng.sample(&p[d.len()]),
    }
}

/// Wrong: the verifier uses the draft's *untruncated* distribution although the draft
/// sampled from the truncated one (why the draft must send the pairs it sampled from).
fn untruncated_q_rule(
    d: &[u32],
    _q: &[Distribution],
    q_full: &[Distribution],
    p: &[Distribution],
    rng: &mut Sampler,
) -> Verdict {
    verify_sampled(d, q_full, p, rng).unwrap()
}

/// Wrong (an off-by-one): the bonus token is drawn from p_k instead of p_{k+1}.
fn stale_bonus_rule(
    d: &[u32],
    q: &[Distribution],
    _q_full: &[Distribution],
    p: &[Distribution],
    rng: &mut Sampler,
) -> Verdict {
    let v = verify_sampled(d, q, p, rng).unwrap();
    if v.accepted == d.len() {
        Verdict {
            accepted: v.accepted,
            next_token: rng.sample(&p[d.len() - 1]),
        }
    } else {
        v
    }
}

/// Draws from norm(max(0, p - q)), written out independently of the crate.
fn residual_sample(p: &Distribution, q: &Distribution, rng: &mut Sampler) -> u32 {
    let residual = (0..V as u32).map(|t| (t, (p.prob(t) - q.prob(t)).max(0.0)));
    rng.sample(&Distribution::from_pairs(residual).unwrap())
}

/// Wrong, subtly: accepts 2% too often (min(1, 1.02 p/q)), residual correct.
fn over_accepting_rule(
    d: &[u32],
    q: &[Distribution],
    _q_full: &[Distribution],
    p: &[Distribution],
    rng: &mut Sampler,
) -> Verdict {
    for i in 0..d.len() {
        let (qd, pd) = (q[i].prob(d[i]) as f64, p[i].prob(d[i]) as f64);
        if rng.uniform() * qd >= 1.02 * pd {
            return Verdict {
                accepted: i,
                next_token: residual_sample(&p[i], &q[i], rng),
            };
        }
    }
    Verdict {
        accepted: d.len(),
        next_token: rng.sample(&p[d.len()]),
    }
}

struct Outcome {
    first: Vec<u64>,
    pair: Vec<u64>,
    verifies: usize,
    accepted_total: usize,
}

/// Runs `DRAWS` two-token generations with draft length `k` under `rule`.
fn simulate(k: usize, rule: Rule, seed: u64) -> Outcome {
    simulate_with(k, rule, seed, Proposal::DraftModel)
}

/// What drafts the toy rounds.
#[derive(Clone, Copy)]
enum Proposal {
    /// Samples from the draft's truncated distribution q.
    DraftModel,
    /// Prompt lookup: a token fixed by the context (some the target forbids),
    /// proposed as a point mass (q = 1), as `tandem_model::proposer` does.
    Lookup,
}

/// The toy lookup's token after `ctx`.
fn lookup_token(ctx: &[u32]) -> u32 {
    (prefix_hash(ctx) % V as u64) as u32
}

fn simulate_with(k: usize, rule: Rule, seed: u64, proposal: Proposal) -> Outcome {
    let mut draft_rng = Sampler::new(seed);
    let mut verify_rng = Sampler::new(seed ^ 0x5EED_F7E5);
    let mut first = vec![0u64; V];
    let mut pair = vec![0u64; V * V];
    let (mut verifies, mut accepted_total) = (0, 0);
    for _ in 0..DRAWS {
        let mut out: Vec<u32> = Vec::new();
        while out.len() < 2 {
            let mut ctx = out.clone();
            let (mut d, mut q, mut q_full) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..k {
                let (qi, qf) = match proposal {
                    Proposal::DraftModel => (q_of(&ctx), q_full_of(&ctx)),
                    Proposal::Lookup => {
                        let t = Distribution::point(lookup_token(&ctx));
                        (t.clone(), t)
                    }
                };
                let t = draft_rng.sample(&qi);
                q_full.push(qf);
                q.push(qi);
                d.push(t);
                ctx.push(t);
            }
            let p: Vec<Distribution> = (0..=k)
                .map(|i| {
                    let mut pre = out.clone();
                    pre.extend_from_slice(&d[..i]);
                    p_of(&pre)
                })
                .collect();
            let verdict = rule(&d, &q, &q_full, &p, &mut verify_rng);
            verifies += 1;
            accepted_total += verdict.accepted;
            out.extend(verdict.emitted(&d));
        }
        first[out[0] as usize] += 1;
        pair[out[0] as usize * V + out[1] as usize] += 1;
    }
    Outcome {
        first,
        pair,
        verifies,
        accepted_total,
    }
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

fn tests_for(o: &Outcome) -> (Chi2, Chi2) {
    (
        chi_square(&o.first, &expected_first()),
        chi_square(&o.pair, &expected_pair()),
    )
}

#[test]
fn toy_models_make_the_test_meaningful() {
    // The draft must really differ from the target, or "lossless" would be trivial;
    // the target's top-p must forbid some token the draft can propose; and the
    // draft's truncation must drop mass.
    let (p, q, q_full) = (p_of(&[]), q_of(&[]), q_full_of(&[]));
    let tv: f64 = (0..V as u32)
        .map(|t| (p.prob(t) as f64 - q.prob(t) as f64).abs())
        .sum::<f64>()
        / 2.0;
    assert!(tv > 0.1, "total variation between p and q is only {tv}");
    assert_eq!(q.len(), DRAFT_TOP_K);
    assert_eq!(q_full.len(), V);
    assert!(p.len() < V, "top-p should cut the target's tail");
    // Context dependence: p(.|a) differs between some a.
    assert_ne!(p_of(&[0]), p_of(&[1]));
}

#[test]
fn sampled_verification_is_lossless_for_k_1_2_3() {
    for k in 1..=3 {
        let o = simulate(k, correct_rule, 1000 + k as u64);
        let (c1, c2) = tests_for(&o);
        let accept_rate = o.accepted_total as f64 / (o.verifies * k) as f64;
        println!(
            "k={k}: verifies={} acceptance={accept_rate:.3} first: chi2={:.2} df={} p={:.4}; \
             pair: chi2={:.2} df={} p={:.4}",
            o.verifies, c1.stat, c1.df, c1.p_value, c2.stat, c2.df, c2.p_value
        );
        assert!(o.verifies >= DRAWS);
        // Both acceptance and rejection paths must be exercised.
        assert!(
            accept_rate > 0.2 && accept_rate < 0.95,
            "acceptance {accept_rate}"
        );
        assert!(c1.p_value > ALPHA, "k={k}: first token not ~ p: {c1:?}");
        assert!(
            c2.p_value > ALPHA,
            "k={k}: second token | first not ~ p: {c2:?}"
        );
    }
}

#[test]
fn lookup_point_mass_proposals_are_lossless_for_k_1_2_3() {
    // The toy lookup must be right sometimes and wrong sometimes, and must
    // propose a token the target forbids somewhere, or the check is trivial.
    let p = p_of(&[]);
    let hits = (0..V as u32)
        .map(|a| p_of(&[a]).prob(lookup_token(&[a])))
        .filter(|&pr| pr > 0.0)
        .count();
    assert!(hits > 0 && hits < V, "lookup hits {hits} of {V}");
    assert!(p.len() < V);
    for k in 1..=3 {
        let o = simulate_with(k, correct_rule, 2000 + k as u64, Proposal::Lookup);
        let (c1, c2) = tests_for(&o);
        let accept_rate = o.accepted_total as f64 / (o.verifies * k) as f64;
        println!(
            "lookup k={k}: verifies={} acceptance={accept_rate:.3} first p={:.4} pair p={:.4}",
            o.verifies, c1.p_value, c2.p_value
        );
        assert!(
            accept_rate > 0.02 && accept_rate < 0.98,
            "acceptance {accept_rate}"
        );
        assert!(c1.p_value > ALPHA, "k={k}: first token not ~ p: {c1:?}");
        assert!(c2.p_value > ALPHA, "k={k}: pair not ~ p: {c2:?}");
    }
    // Negative control: accepting every looked-up token is detected.
    let o = simulate_with(2, always_accept_rule, 2100, Proposal::Lookup);
    let (c1, c2) = tests_for(&o);
    assert!(
        c1.p_value < ALPHA || c2.p_value < ALPHA,
        "always-accept with lookup not detected: {c1:?} {c2:?}"
    );
}

#[test]
fn negative_control_always_accept_is_rejected() {
    for k in 1..=3 {
        let (c1, c2) = tests_for(&simulate(k, always_accept_rule, 2000 + k as u64));
        println!(
            "always-accept k={k}: first p={:e}, pair p={:e}",
            c1.p_value, c2.p_value
        );
        assert!(c1.p_value < ALPHA, "k={k}: {c1:?}");
        assert!(c2.p_value < ALPHA, "k={k}: {c2:?}");
    }
}

#[test]
fn negative_control_resampling_from_p_is_rejected() {
    for k in 1..=3 {
        let (c1, c2) = tests_for(&simulate(k, resample_from_p_rule, 3000 + k as u64));
        println!(
            "resample-from-p k={k}: first p={:e}, pair p={:e}",
            c1.p_value, c2.p_value
        );
        assert!(c1.p_value < ALPHA, "k={k}: {c1:?}");
        assert!(c2.p_value < ALPHA, "k={k}: {c2:?}");
    }
}

#[test]
fn negative_control_verifying_against_untruncated_draft_is_rejected() {
    for k in 1..=3 {
        let (c1, c2) = tests_for(&simulate(k, untruncated_q_rule, 4000 + k as u64));
        println!(
            "untruncated-q k={k}: first p={:e}, pair p={:e}",
            c1.p_value, c2.p_value
        );
        assert!(
            c1.p_value < ALPHA || c2.p_value < ALPHA,
            "k={k}: {c1:?} {c2:?}"
        );
    }
}

#[test]
fn negative_control_bonus_from_wrong_position_is_rejected() {
    // Only the pair test can see this bug for k = 1 (the bonus is the second token).
    let (_, c2) = tests_for(&simulate(1, stale_bonus_rule, 5000));
    println!("stale-bonus k=1: pair p={:e}", c2.p_value);
    assert!(c2.p_value < ALPHA, "{c2:?}");
}

#[test]
fn negative_control_subtle_over_acceptance_is_rejected() {
    // A 2% error in the acceptance probability is enough to fail the test.
    for k in 1..=2 {
        let (c1, c2) = tests_for(&simulate(k, over_accepting_rule, 6000 + k as u64));
        println!(
            "over-accept k={k}: first p={:e}, pair p={:e}",
            c1.p_value, c2.p_value
        );
        assert!(
            c1.p_value < ALPHA || c2.p_value < ALPHA,
            "k={k}: {c1:?} {c2:?}"
        );
    }
}

#[test]
fn sampler_alone_matches_its_distribution() {
    // Baseline for the chi-square machinery: plain sampling from p passes, sampling
    // from q (a different distribution) fails.
    let p = p_of(&[]);
    let q = q_of(&[]);
    let mut rng = Sampler::new(77);
    let mut from_p = vec![0u64; V];
    let mut from_q = vec![0u64; V];
    for _ in 0..DRAWS {
        from_p[rng.sample(&p) as usize] += 1;
        from_q[rng.sample(&q) as usize] += 1;
    }
    let e = expected_first();
    assert!(chi_square(&from_p, &e).p_value > ALPHA);
    assert!(chi_square(&from_q, &e).p_value < ALPHA);
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
