//! Verification rules at the level the speculative loop and the verifier call them:
//! the prefix match, and `verdict_from_logits` in greedy and sampled (keyed) mode.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use tandem_model::sampling::{keyed_token, next_token, Sampler, SamplingParams};
use tandem_model::verify::{verdict_from_logits, verify_prefix, Verdict};
use tandem_model::ModelError;

fn is_invalid(e: &ModelError) -> bool {
    matches!(e, ModelError::InvalidArgument(_))
}

// ---------- greedy ----------

#[test]
fn greedy_all_accepted_gives_bonus_token() {
    let v = verify_prefix(&[5, 6, 7], &[5, 6, 7, 42]).unwrap();
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
    let v = verify_prefix(&[9, 6, 7], &[5, 6, 7, 42]).unwrap();
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
    let v = verify_prefix(&[1, 2, 3, 4], &[1, 2, 8, 4, 0]).unwrap();
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
        verify_prefix(&[3], &[3, 11]).unwrap(),
        Verdict {
            accepted: 1,
            next_token: 11
        }
    );
    assert_eq!(
        verify_prefix(&[3], &[4, 11]).unwrap(),
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
        let err = verify_prefix(draft, target).unwrap_err();
        assert!(is_invalid(&err), "{draft:?} {target:?}: {err}");
    }
    let msg = verify_prefix(&[1, 2], &[1, 2]).unwrap_err().to_string();
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
            let v = verify_prefix(&draft, &argmax).unwrap();
            for tok in v.emitted(&draft) {
                out.push(tok);
                last = tok;
            }
        }
        assert_eq!(&out[..want.len()], &want[..], "k={k}");
    }
}

// ---------- verdict_from_logits ----------

const V: usize = 6;

/// Rows of logits for positions `0..rows` of a toy target (a fixed function
/// of the position).
fn rows(start: usize, n: usize) -> Vec<f32> {
    (start..start + n)
        .flat_map(|pos| (0..V).map(move |t| ((pos * 7 + t * 13) % 10) as f32 * 0.3))
        .collect()
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed,
        ..SamplingParams::default()
    }
}

#[test]
fn a_sampled_verdict_accepts_exactly_the_targets_keyed_draws() {
    let history = vec![3u32; 10];
    for seed in 0..200 {
        let p = sampled(seed);
        let logits = rows(history.len(), 4);
        // The target's own tokens at positions 10, 11, 12, 13.
        let mut hist = history.clone();
        let mut own = Vec::new();
        for i in 0..4 {
            let t = next_token(&p, &logits[i * V..(i + 1) * V], &hist);
            own.push(t);
            hist.push(t);
        }
        // All three right: the bonus is the fourth.
        let v = verdict_from_logits(&p, &history, &own[..3], &logits).unwrap();
        assert_eq!((v.accepted, v.next_token), (3, own[3]), "seed {seed}");
        // The second one wrong: one accepted, then the target's own second.
        let wrong = [own[0], (own[1] + 1) % V as u32, own[2]];
        let v = verdict_from_logits(&p, &history, &wrong, &logits).unwrap();
        assert_eq!((v.accepted, v.next_token), (1, own[1]), "seed {seed}");
        // No proposal: the target's next token.
        let v = verdict_from_logits(&p, &history, &[], &logits[..V]).unwrap();
        assert_eq!((v.accepted, v.next_token), (0, own[0]));
    }
}

#[test]
fn a_sampled_draw_is_keyed_by_its_position_in_the_context() {
    // The same row of logits at another position is another draw; the same
    // position under another history length is not the same key.
    let p = sampled(5);
    let row = rows(0, 1);
    let d = tandem_model::sampling::distribution(&p, &row, &[]);
    let at = |len: usize| {
        verdict_from_logits(&p, &vec![0u32; len], &[], &row)
            .unwrap()
            .next_token
    };
    for len in 1..50 {
        assert_eq!(at(len), keyed_token(&d, 5, len));
    }
    assert!(
        (1..50)
            .map(at)
            .collect::<std::collections::HashSet<_>>()
            .len()
            > 1
    );
}

#[test]
fn verdicts_refuse_mismatched_logits() {
    let p = sampled(1);
    // 12 floats cannot be 5 rows (a block of 4) of one vocabulary.
    let e = verdict_from_logits(&p, &[1], &[1, 2, 3, 4], &rows(1, 2)).unwrap_err();
    assert!(is_invalid(&e), "{e}");
    let e = verdict_from_logits(&p, &[1], &[1], &[]).unwrap_err();
    assert!(is_invalid(&e), "{e}");
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
