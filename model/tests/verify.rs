//! Verification rules at the level the speculative loop and the verifier call them:
//! greedy prefix matching, and the edge cases and errors of sampled verification.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use tandem_model::sampling::{Distribution, Sampler};
use tandem_model::verify::{verify_greedy, verify_sampled, Verdict};
use tandem_model::ModelError;

fn is_invalid(e: &ModelError) -> bool {
    matches!(e, ModelError::InvalidArgument(_))
}

// ---------- greedy ----------

#[test]
fn greedy_all_accepted_gives_bonus_token() {
    let v = verify_greedy(&[5, 6, 7], &[5, 6, 7, 42]).unwrap();
    assert_eq!(
        v,
        Verdict {
            accepted: 3,
            next_token: 42
        }
    );
    assert!(v.all_accepted(3));
    assert_eq!(v.emitted(&[5, 6, 7]), vec![5, 6, 7, 42]);
}

#[test]
fn greedy_first_rejected_gives_target_correction() {
    let v = verify_greedy(&[9, 6, 7], &[5, 6, 7, 42]).unwrap();
    assert_eq!(
        v,
        Verdict {
            accepted: 0,
            next_token: 5
        }
    );
    assert!(!v.all_accepted(3));
    assert_eq!(v.emitted(&[9, 6, 7]), vec![5]);
}

#[test]
fn greedy_mid_rejection_stops_at_first_mismatch() {
    // Position 2 mismatches; position 3 matching again must not count.
    let v = verify_greedy(&[1, 2, 3, 4], &[1, 2, 8, 4, 0]).unwrap();
    assert_eq!(
        v,
        Verdict {
            accepted: 2,
            next_token: 8
        }
    );
    assert_eq!(v.emitted(&[1, 2, 3, 4]), vec![1, 2, 8]);
}

#[test]
fn greedy_k1_accept_and_reject() {
    assert_eq!(
        verify_greedy(&[3], &[3, 11]).unwrap(),
        Verdict {
            accepted: 1,
            next_token: 11
        }
    );
    assert_eq!(
        verify_greedy(&[3], &[4, 11]).unwrap(),
        Verdict {
            accepted: 0,
            next_token: 4
        }
    );
}

#[test]
fn greedy_rejects_empty_draft_and_length_mismatch() {
    for (draft, target) in [
        (&[][..], &[1u32][..]),
        (&[][..], &[][..]),
        (&[1, 2][..], &[1, 2][..]),
        (&[1, 2][..], &[1, 2, 3, 4][..]),
        (&[1][..], &[][..]),
    ] {
        let err = verify_greedy(draft, target).unwrap_err();
        assert!(is_invalid(&err), "{draft:?} {target:?}: {err}");
    }
    let msg = verify_greedy(&[1, 2], &[1, 2]).unwrap_err().to_string();
    assert!(msg.contains("3") && msg.contains("2"), "{msg}");
}

/// Reference: greedy speculative decoding reproduces the target's greedy sequence.
#[test]
fn greedy_rounds_reproduce_target_sequence() {
    // Target "model": next token is a fixed function of the previous token.
    let target_next = |t: u32| (t * 7 + 3) % 11;
    let mut rng = Sampler::new(9);
    let want: Vec<u32> = std::iter::successors(Some(target_next(0)), |&t| Some(target_next(t)))
        .take(200)
        .collect();
    for k in [1usize, 2, 4, 8, 16] {
        let mut out: Vec<u32> = Vec::new();
        let mut last = 0u32;
        while out.len() < want.len() {
            // Draft: right 70% of the time, otherwise a wrong token.
            let mut draft = Vec::new();
            let mut t = last;
            for _ in 0..k {
                let right = target_next(t);
                let d = if rng.uniform() < 0.7 {
                    right
                } else {
                    (right + 1) % 11
                };
                draft.push(d);
                t = d;
            }
            let mut argmax = vec![target_next(last)];
            argmax.extend(draft.iter().map(|&d| target_next(d)));
            let v = verify_greedy(&draft, &argmax).unwrap();
            for tok in v.emitted(&draft) {
                out.push(tok);
                last = tok;
            }
        }
        assert_eq!(&out[..want.len()], &want[..], "k={k}");
    }
}

// ---------- sampled ----------

fn dist(pairs: &[(u32, f32)]) -> Distribution {
    Distribution::from_pairs(pairs.iter().copied()).expect("test distribution is valid")
}

#[test]
fn sampled_with_point_masses_equals_greedy() {
    // Temperature 0 on both sides: q = δ(d_i), p = δ(argmax_i). The sampled rule must
    // then make exactly the greedy decision, for any draft.
    let mut gen = Sampler::new(4);
    let mut rng = Sampler::new(5);
    for _ in 0..2000 {
        let k = 1 + (gen.next_u64() % 6) as usize;
        let draft: Vec<u32> = (0..k).map(|_| (gen.next_u64() % 3) as u32).collect();
        let argmax: Vec<u32> = (0..=k).map(|_| (gen.next_u64() % 3) as u32).collect();
        let q: Vec<Distribution> = draft.iter().map(|&d| Distribution::point(d)).collect();
        let p: Vec<Distribution> = argmax.iter().map(|&a| Distribution::point(a)).collect();
        assert_eq!(
            verify_sampled(&draft, &q, &p, &mut rng).unwrap(),
            verify_greedy(&draft, &argmax).unwrap(),
            "draft {draft:?} argmax {argmax:?}"
        );
    }
}

#[test]
fn sampled_accepts_when_target_is_at_least_as_likely() {
    // p(d) >= q(d) at every position: always accepted, bonus from p_{k+1}.
    let q = vec![dist(&[(1, 0.5), (2, 0.5)]), dist(&[(3, 0.4), (4, 0.6)])];
    let p = vec![
        dist(&[(1, 0.9), (2, 0.1)]),
        dist(&[(3, 0.4), (4, 0.6)]),
        Distribution::point(77),
    ];
    let mut rng = Sampler::new(1);
    for _ in 0..500 {
        let v = verify_sampled(&[1, 3], &q, &p, &mut rng).unwrap();
        assert_eq!(
            v,
            Verdict {
                accepted: 2,
                next_token: 77
            }
        );
    }
}

#[test]
fn sampled_rejects_tokens_the_target_forbids_and_samples_residual() {
    // p(d1) = 0: always rejected at position 0; the residual max(0, p - q) has all its
    // mass on token 2 (p = {1: .3, 2: .7}, q = {1: .5, 9: .5}: residual {2: .7}).
    let q = vec![dist(&[(1, 0.5), (9, 0.5)])];
    let p = vec![dist(&[(1, 0.3), (2, 0.7)]), Distribution::point(0)];
    let mut rng = Sampler::new(2);
    for _ in 0..500 {
        let v = verify_sampled(&[9], &q, &p, &mut rng).unwrap();
        assert_eq!(
            v,
            Verdict {
                accepted: 0,
                next_token: 2
            }
        );
    }
}

#[test]
fn sampled_acceptance_rate_is_p_over_q() {
    // q(d) = 0.8, p(d) = 0.2: accepted with probability 0.25.
    let q = vec![dist(&[(0, 0.8), (1, 0.2)])];
    let p = vec![dist(&[(0, 0.2), (1, 0.8)]), Distribution::point(5)];
    let mut rng = Sampler::new(3);
    let n = 40_000;
    let mut accepted = 0;
    for _ in 0..n {
        let v = verify_sampled(&[0], &q, &p, &mut rng).unwrap();
        if v.accepted == 1 {
            assert_eq!(v.next_token, 5);
            accepted += 1;
        } else {
            // Residual: {1: 0.6} only.
            assert_eq!(v.next_token, 1);
        }
    }
    let rate = accepted as f64 / n as f64;
    // Binomial sd = sqrt(.25 * .75 / 40000) ≈ 0.0022; 5 sd.
    assert!((rate - 0.25).abs() < 0.011, "rate {rate}");
}

#[test]
fn sampled_falls_back_to_target_when_residual_is_empty() {
    // q puts a sliver of mass on token 1 which p forbids, and q(0) rounds to 1.0 = p(0):
    // the rejection happens but max(0, p - q) is zero everywhere; the verdict must
    // then come from p itself.
    let q = vec![dist(&[(0, 1.0), (1, 1e-30)])];
    assert!(q[0].prob(1) > 0.0 && q[0].prob(0) == 1.0);
    let p = vec![Distribution::point(0), Distribution::point(3)];
    let mut rng = Sampler::new(6);
    let v = verify_sampled(&[1], &q, &p, &mut rng).unwrap();
    assert_eq!(
        v,
        Verdict {
            accepted: 0,
            next_token: 0
        }
    );
}

#[test]
fn sampled_rejects_caller_bugs() {
    let q1 = dist(&[(1, 0.5), (2, 0.5)]);
    let p1 = dist(&[(1, 0.5), (2, 0.5)]);
    let mut rng = Sampler::new(0);
    // Empty draft.
    let e = verify_sampled(&[], &[], std::slice::from_ref(&p1), &mut rng).unwrap_err();
    assert!(is_invalid(&e), "{e}");
    // Wrong number of draft distributions.
    let e = verify_sampled(&[1], &[], &[p1.clone(), p1.clone()], &mut rng).unwrap_err();
    assert!(is_invalid(&e), "{e}");
    // Wrong number of target distributions (needs k + 1).
    let e = verify_sampled(
        &[1],
        std::slice::from_ref(&q1),
        std::slice::from_ref(&p1),
        &mut rng,
    )
    .unwrap_err();
    assert!(is_invalid(&e) && e.to_string().contains("2 target"), "{e}");
    // Draft token with q = 0: the draft could not have sampled it.
    let before = rng.clone();
    let e = verify_sampled(
        &[1, 7],
        &[q1.clone(), q1.clone()],
        &[p1.clone(), p1.clone(), p1.clone()],
        &mut rng,
    )
    .unwrap_err();
    assert!(is_invalid(&e) && e.to_string().contains("token 7"), "{e}");
    // The whole block is checked before any randomness is used.
    assert_eq!(rng, before);
}

#[test]
fn sampled_is_reproducible_with_a_seed() {
    let q = vec![dist(&[(0, 0.6), (1, 0.4)]); 3];
    let p = vec![dist(&[(0, 0.3), (1, 0.3), (2, 0.4)]); 4];
    let run = |seed| {
        let mut rng = Sampler::new(seed);
        (0..200)
            .map(|_| verify_sampled(&[0, 1, 0], &q, &p, &mut rng).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(run(11), run(11));
    assert_ne!(run(11), run(12));
}

#[test]
fn verdict_serde_round_trip() {
    let v = Verdict {
        accepted: 3,
        next_token: 151_643,
    };
    let json = serde_json::to_string(&v).unwrap();
    assert_eq!(json, r#"{"accepted":3,"next_token":151643}"#);
    assert_eq!(serde_json::from_str::<Verdict>(&json).unwrap(), v);
}
