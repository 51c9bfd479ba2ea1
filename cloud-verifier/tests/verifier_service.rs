//! The verify service over a real gRPC connection on loopback, with tiny models.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use common::*;
use tandem_proto::v1::{client_message, server_message, Close, Reason, Resume};
use tandem_verifier::model_fingerprint;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_rounds_reproduce_the_target_with_same_and_different_drafts() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let p = prompt(12);
    let want = target_greedy(&target, &p, 30);
    let mut c = client(&v).await;
    // Perfect draft (the target itself): everything accepted.
    let (got, _) = generate(&mut c, &fp, &target, &p, 30, |_, _| {}).await;
    assert_eq!(got, want);
    // A different tiny model: rejections and corrections.
    let other = load(&m.draft);
    let (got, _) = generate(&mut c, &fp, &other, &p, 30, |_, _| {}).await;
    assert_eq!(got, want);
    let metrics = v.state.render_metrics();
    assert!(
        metrics.contains("tandem_verifier_accepted_tokens_total"),
        "{metrics}"
    );
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_makes_the_device_resend_context_and_output_stays_identical() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let p = prompt(10);
    let want = target_greedy(&target, &p, 24);
    let mut c = client(&v).await;
    let state = v.state.clone();
    let mut evicted_at = Vec::new();
    let (got, resumes) = generate(&mut c, &fp, &target, &p, 24, |round, sid| {
        // Evict once before rounds 3 and 6 (the retried round must then succeed).
        if (round == 3 || round == 6) && !evicted_at.contains(&round) {
            evicted_at.push(round);
            assert!(state.store().evict(sid));
        }
    })
    .await;
    assert_eq!(got, want);
    assert_eq!(resumes, 2);
    assert!(v
        .state
        .render_metrics()
        .contains("tandem_verifier_evictions_total 2"));
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn byte_budget_evicts_the_least_recently_used_session() {
    let m = tiny_models();
    let target = load(&m.target);
    // A session of 40 tokens reserves pages for 40 + max_block (16) = 56
    // positions: 4 pages of 16. Allow 6 pages: one session and a half.
    let bpt = target.new_cache().bytes_per_token() as u64;
    let v = start_plain(&m, &format!("session_budget_bytes = {}", bpt * 16 * 6)).await;
    let fp = model_fingerprint(&target);
    let mut c = client(&v).await;
    let mut a = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    a.open(open_msg(&fp, &prompt(40))).await.unwrap();
    let mut b = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    b.open(open_msg(&fp, &prompt(40))).await.unwrap();
    let err = a.draft(0, &[1]).await.unwrap_err();
    assert_eq!(reason(&err), Reason::SessionEvicted, "{err:?}");
    assert_eq!(err.code(), tonic::Code::NotFound);
    // The survivor still works.
    b.draft(0, &[1, 2]).await.unwrap();
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_carry_clear_reasons_and_the_server_keeps_serving() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let mut c = client(&v).await;

    // No token / wrong token.
    let e = connect(&mut c, None).await.err().unwrap();
    assert_eq!(
        (e.code(), reason(&e)),
        (tonic::Code::Unauthenticated, Reason::Unauthenticated)
    );
    let e = connect(&mut c, Some("not-a-valid-token-at-all"))
        .await
        .err()
        .unwrap();
    assert_eq!(reason(&e), Reason::Unauthenticated);

    // Fingerprint / model mismatch.
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let e = s
        .open(open_msg("sha256-of-another-tokenizer", &prompt(4)))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::FingerprintMismatch);
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &prompt(4));
    o.model_id = "other".into();
    assert_eq!(reason(&s.open(o).await.unwrap_err()), Reason::ModelMismatch);

    // Oversized / empty prompt, out-of-vocab prompt.
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    assert_eq!(
        reason(&s.open(open_msg(&fp, &prompt(257))).await.unwrap_err()),
        Reason::PromptTooLong
    );
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    assert_eq!(
        reason(&s.open(open_msg(&fp, &[])).await.unwrap_err()),
        Reason::PromptTooLong
    );
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    assert_eq!(
        reason(&s.open(open_msg(&fp, &[1, 384])).await.unwrap_err()),
        Reason::TokenOutOfVocab
    );

    // First message must be Open.
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    assert_eq!(
        reason(&s.draft(0, &[1]).await.unwrap_err()),
        Reason::BadRequest
    );

    // k = 17, out-of-vocab draft, round out of order: each on its own session.
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    s.open(open_msg(&fp, &prompt(4))).await.unwrap();
    let e = s.draft(0, &[1; 17]).await.unwrap_err();
    assert_eq!(
        (e.code(), reason(&e)),
        (tonic::Code::InvalidArgument, Reason::BlockTooLarge)
    );
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    s.open(open_msg(&fp, &prompt(4))).await.unwrap();
    s.draft(0, &[1; 16]).await.unwrap(); // k = 16 is fine
    assert_eq!(
        reason(&s.draft(1, &[1, 999]).await.unwrap_err()),
        Reason::TokenOutOfVocab
    );
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    s.open(open_msg(&fp, &prompt(4))).await.unwrap();
    s.draft(0, &[1]).await.unwrap();
    let e = s.draft(2, &[1]).await.unwrap_err();
    assert_eq!(reason(&e), Reason::RoundOutOfOrder);

    // Another identity cannot take a session over.
    let mut a = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let opened = a.open(open_msg(&fp, &prompt(4))).await.unwrap();
    let mut b = connect(&mut c, Some(TOKEN_B)).await.unwrap();
    let mut o = open_msg(&fp, &prompt(4));
    o.resume_session_id = Some(opened.session_id.clone());
    let e = b.open(o).await.unwrap_err();
    assert_eq!(
        (e.code(), reason(&e)),
        (tonic::Code::PermissionDenied, Reason::SessionForbidden)
    );

    // The owner's session is untouched and the server still serves.
    let want = target_greedy(&target, &prompt(4), 1);
    let v0 = a.draft(0, &[]).await.unwrap();
    assert_eq!(v0.next_token, want[0]);
    match a
        .call(client_message::Msg::Close(Close::default()))
        .await
        .unwrap()
    {
        server_message::Msg::Closed(c) => assert_eq!(c.rounds, 1),
        m => panic!("{m:?}"),
    }
    let metrics = v.state.render_metrics();
    for r in [
        "BLOCK_TOO_LARGE",
        "TOKEN_OUT_OF_VOCAB",
        "SESSION_FORBIDDEN",
        "UNAUTHENTICATED",
    ] {
        assert!(
            metrics.contains(&format!("tandem_verifier_errors_total{{reason=\"{r}\"}}")),
            "{r}: {metrics}"
        );
    }
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_in_stream_reuses_the_common_prefix() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let p = prompt(8);
    let want = target_greedy(&target, &p, 6);
    let mut c = client(&v).await;
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    s.open(open_msg(&fp, &p)).await.unwrap();
    // The device went offline and produced 3 provisional tokens of its own.
    let mut ctx = p.clone();
    ctx.extend_from_slice(&want[..3]);
    let r = s
        .call(client_message::Msg::Resume(Resume {
            context_tokens: ctx.clone(),
            next_round: 5,
        }))
        .await
        .unwrap();
    match r {
        server_message::Msg::Resumed(r) => {
            assert_eq!(r.context_len as usize, ctx.len());
            assert_eq!(r.reused_tokens as usize, p.len() - 1);
        }
        m => panic!("{m:?}"),
    }
    let v5 = s.draft(5, &want[3..5]).await.unwrap();
    assert_eq!((v5.accepted, v5.next_token), (2, want[5]));
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_per_identity() {
    let m = tiny_models();
    let v = start_plain(&m, "rate_per_sec = 0.5\nrate_burst = 3").await;
    let fp = model_fingerprint(&load(&m.target));
    let mut c = client(&v).await;
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    s.open(open_msg(&fp, &prompt(4))).await.unwrap();
    s.draft(0, &[1]).await.unwrap();
    s.draft(1, &[1]).await.unwrap();
    let e = s.draft(2, &[1]).await.unwrap_err();
    assert_eq!(
        (e.code(), reason(&e)),
        (tonic::Code::ResourceExhausted, Reason::RateLimited)
    );
    // Another identity has its own bucket.
    let mut b = connect(&mut c, Some(TOKEN_B)).await.unwrap();
    b.open(open_msg(&fp, &prompt(4))).await.unwrap();
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_tells_open_sessions_to_go_elsewhere() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let fp = model_fingerprint(&load(&m.target));
    let mut c = client(&v).await;
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    s.open(open_msg(&fp, &prompt(4))).await.unwrap();
    s.draft(0, &[1, 2]).await.unwrap();
    let stop = tokio::spawn(v.shutdown());
    let e = s.rx.message().await.unwrap_err();
    assert_eq!(
        (e.code(), reason(&e)),
        (tonic::Code::Unavailable, Reason::ShuttingDown)
    );
    stop.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_and_logit_bias_are_announced_applied_and_range_checked() {
    use tandem_model::penalties::LogitBias;
    use tandem_model::speculative::{generate_single, GenerateConfig};
    use tandem_proto::v1::{LogitBias as WireBias, SamplingParams as WireSampling};
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let p = prompt(10);
    let plain = target_greedy(&target, &p, 12);
    let (banned, favoured) = (plain[0], (plain[0] + 5) % 384);
    let wire = WireSampling {
        presence_penalty: 0.5,
        frequency_penalty: 1.25,
        logit_bias: vec![
            WireBias {
                token: favoured,
                bias: 2.5,
            },
            WireBias {
                token: banned,
                bias: -100.0,
            },
        ],
        completion_start: p.len() as u64,
        ..WireSampling::default()
    };
    let params = tandem_model::sampling::SamplingParams {
        presence_penalty: 0.5,
        frequency_penalty: 1.25,
        logit_bias: LogitBias::new([(banned, -100.0), (favoured, 2.5)]).unwrap(),
        ..Default::default()
    };
    // The target alone under the same penalties (generate_single counts the
    // completion from the prompt's end).
    let cfg = GenerateConfig {
        max_tokens: 12,
        sampling: params,
        ..GenerateConfig::default()
    };
    let want = generate_single(&target, &p, &cfg, &mut |_| true)
        .unwrap()
        .tokens;
    assert_ne!(want, plain, "the penalties change the output");

    let mut c = client(&v).await;
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &p);
    o.sampling = Some(wire.clone());
    let opened = s.open(o).await.unwrap();
    assert!(
        opened
            .features
            .iter()
            .any(|f| f == tandem_proto::FEATURE_PENALTIES),
        "{opened:?}"
    );
    // Steps, an accepted block, a rejected one: every verdict the target's.
    let mut got = Vec::new();
    for r in 0..3 {
        got.push(s.draft(r, &[]).await.unwrap().next_token);
    }
    let v3 = s.draft(3, &want[3..6]).await.unwrap();
    assert_eq!(v3.accepted, 3);
    got.extend_from_slice(&want[3..6]);
    got.push(v3.next_token);
    let wrong = [want[7], want[7]];
    let v4 = s.draft(4, &wrong).await.unwrap();
    got.extend_from_slice(&wrong[..v4.accepted as usize]);
    got.push(v4.next_token);
    assert_eq!(got, want[..got.len()]);
    // A fresh session of the whole context (a restarted verifier): the counts
    // come from the context and completion_start, the next tokens agree.
    let mut ctx = p.clone();
    ctx.extend_from_slice(&got);
    let mut f = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &ctx);
    o.sampling = Some(wire.clone());
    f.open(o).await.unwrap();
    let next = f.draft(0, &[]).await.unwrap().next_token;
    assert_eq!(next, want[got.len()]);

    assert!(v3.logprobs.is_empty(), "logprobs are opt-in");

    // Logprobs (Open.top_logprobs): one entry per emitted token, the target's
    // after the penalties, as the target alone computes them.
    let mut l = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &p);
    o.sampling = Some(wire.clone());
    o.top_logprobs = Some(2);
    let opened = l.open(o).await.unwrap();
    assert!(opened
        .features
        .iter()
        .any(|f| f == tandem_proto::FEATURE_LOGPROBS));
    let lv = l.draft(0, &want[..2]).await.unwrap();
    assert_eq!((lv.accepted, lv.next_token), (2, want[2]));
    let local = {
        let params = params.for_prompt(p.len());
        let mut cache = target.new_cache();
        let mut logits = target.forward_last(&p, 0, &mut cache).unwrap();
        let mut hist = p.clone();
        let mut out = Vec::new();
        for &t in &want[..3] {
            out.push(tandem_model::logprobs::chosen_logprobs(
                &params, &logits, &hist, t, 2,
            ));
            hist.push(t);
            logits = target.forward(&[t], cache.len(), &mut cache).unwrap();
        }
        out
    };
    assert_eq!(lv.logprobs.len(), 3);
    for (got, w) in lv.logprobs.iter().zip(&local) {
        assert_eq!(got.logprob, w.logprob);
        let top: Vec<(u32, f32)> = got.top.iter().map(|t| (t.token, t.logprob)).collect();
        assert_eq!(top, w.top);
    }
    // (A U-shape session's device computes its own; split sessions with the
    // head here get them: edge-http/tests/openai_server.rs, split_sessions_….)
    let u_shape = tandem_proto::v1::Split {
        pin_head: true,
        ..tandem_proto::v1::Split::default()
    };
    for (top, split) in [(21, None), (2, Some(u_shape))] {
        let mut o = open_msg(&fp, &p);
        o.top_logprobs = Some(top);
        o.split = split;
        let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
        let e = s.open(o).await.unwrap_err();
        assert_eq!(reason(&e), Reason::BadRequest, "{e:?}");
        assert!(e.message().contains("top_logprobs"), "{e:?}");
    }

    // Refusals, each with its reason.
    let bad = |w: WireSampling| {
        let mut o = open_msg(&fp, &p);
        o.sampling = Some(w);
        o
    };
    for (w, why) in [
        (
            WireSampling {
                presence_penalty: 2.5,
                ..wire.clone()
            },
            Reason::BadRequest,
        ),
        (
            WireSampling {
                frequency_penalty: f32::NAN,
                ..wire.clone()
            },
            Reason::BadRequest,
        ),
        (
            WireSampling {
                logit_bias: vec![WireBias {
                    token: 1,
                    bias: 100.5,
                }],
                ..wire.clone()
            },
            Reason::BadRequest,
        ),
        (
            WireSampling {
                logit_bias: vec![
                    WireBias {
                        token: 1,
                        bias: 1.0,
                    },
                    WireBias {
                        token: 1,
                        bias: 2.0,
                    },
                ],
                ..wire.clone()
            },
            Reason::BadRequest,
        ),
        (
            WireSampling {
                logit_bias: (0..301)
                    .map(|t| WireBias {
                        token: t,
                        bias: 1.0,
                    })
                    .collect(),
                ..wire.clone()
            },
            Reason::BadRequest,
        ),
        (
            WireSampling {
                logit_bias: vec![WireBias {
                    token: 384,
                    bias: 1.0,
                }],
                ..wire.clone()
            },
            Reason::TokenOutOfVocab,
        ),
    ] {
        let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
        let e = s.open(bad(w)).await.unwrap_err();
        assert_eq!(reason(&e), why, "{e:?}");
        assert!(e.message().contains("sampling"), "{e:?}");
    }
    v.shutdown().await.unwrap();
}
