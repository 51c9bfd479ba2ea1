//! Multi-turn conversations over real gRPC on loopback with tiny models
//! (issue 18, the cloud context cache): `Close { keep }` holds the session
//! idle; the next turn's `Open.continuation` sends only the new tokens once the
//! prefix digest proves the verifier holds the same prefix, and its verdicts
//! are those of a fresh session of the whole context. Anything the verifier
//! cannot prove is `CONTEXT_NOT_HELD` (the device then opens with the whole
//! context).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use tandem_model::transformer::Model;
use tandem_proto::v1::verifier_client::VerifierClient;
use tandem_proto::v1::{
    client_message, server_message, Close, Continuation, Open, Opened, Reason, SamplingParams,
    Verdict,
};
use tandem_verifier::model_fingerprint;
use tonic::transport::Channel;

/// The value of a metric line (`name` may carry labels).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
}

fn continuation(sid: &str, prefix: &[u32]) -> Continuation {
    Continuation {
        session_id: sid.to_owned(),
        prefix_len: prefix.len() as u64,
        prefix_sha256: tandem_proto::context_digest(prefix).to_vec(),
    }
}

/// An Open continuing `c` with the `new` tokens.
fn continue_msg(fp: &str, c: Continuation, new: &[u32]) -> Open {
    let mut o = open_msg(fp, new);
    o.continuation = Some(c);
    o
}

async fn close(conn: &mut Conn, keep: bool) -> u64 {
    match conn
        .call(client_message::Msg::Close(Close { keep }))
        .await
        .unwrap()
    {
        server_message::Msg::Closed(c) => c.rounds,
        m => panic!("expected Closed, got {m:?}"),
    }
}

/// A refused Open on a fresh stream as device A: the status.
async fn refused(c: &mut VerifierClient<Channel>, o: Open) -> tonic::Status {
    let mut s = connect(c, Some(TOKEN_A)).await.unwrap();
    s.open(o).await.unwrap_err()
}

/// `rounds` rounds of drafts from `draft` (k cycling 1, 2, 3, 0) on `conn`,
/// `ctx` following the verdicts. Returns the drafts and the verdicts.
async fn run_rounds(
    conn: &mut Conn,
    draft: &Model,
    ctx: &mut Vec<u32>,
    rounds: u64,
) -> Vec<(Vec<u32>, Verdict)> {
    let mut out = Vec::new();
    for r in 0..rounds {
        let d = draft_greedy(draft, ctx, ((r + 1) % 4) as usize);
        let v = conn.draft(r, &d).await.unwrap();
        ctx.extend_from_slice(&d[..v.accepted as usize]);
        ctx.push(v.next_token);
        assert_eq!(v.context_len as usize, ctx.len());
        out.push((d, v));
    }
    out
}

/// Turn 1 of a conversation as device A: open `prompt`, `rounds` rounds,
/// Close { keep }. Returns the session id and the context.
async fn kept_turn(
    c: &mut VerifierClient<Channel>,
    fp: &str,
    draft: &Model,
    prompt: &[u32],
    rounds: u64,
) -> (String, Vec<u32>) {
    let mut s = connect(c, Some(TOKEN_A)).await.unwrap();
    let opened = s.open(open_msg(fp, prompt)).await.unwrap();
    assert_eq!(opened.reused_tokens, 0, "a new session reuses nothing");
    let mut ctx = prompt.to_vec();
    run_rounds(&mut s, draft, &mut ctx, rounds).await;
    assert_eq!(close(&mut s, true).await, rounds);
    (opened.session_id, ctx)
}

fn user_turn(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 53 + salt) % 384).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continued_turn_prefills_only_the_new_tokens_and_verifies_as_a_fresh_session() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let draft = load(&m.draft);
    let fp = model_fingerprint(&target);
    let mut c = client(&v).await;

    let (sid, ctx1) = kept_turn(&mut c, &fp, &draft, &prompt(12), 4).await;
    // Kept: held idle, with only the pages its KV fills (the next block's room
    // went back), counted in the store's bytes.
    assert_eq!(v.state.store().len(), 1);
    let pages = (ctx1.len() - 1).div_ceil(16);
    assert_eq!(v.state.pool.pages_used(), pages);
    let page = v.state.pool.page_bytes() as u64;
    assert_eq!(
        v.state.store().bytes(),
        pages as u64 * page + 4 * ctx1.len() as u64
    );

    // Turn 2 sends only the new tokens.
    let user = user_turn(7, 5);
    let mut ctx2 = ctx1.clone();
    ctx2.extend_from_slice(&user);
    let prefilled = |v: &tandem_verifier::RunningVerifier| {
        metric(
            &v.state.render_metrics(),
            "tandem_verifier_prefill_tokens_total",
        )
    };
    let before = prefilled(&v);
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let opened: Opened = s
        .open(continue_msg(&fp, continuation(&sid, &ctx1), &user))
        .await
        .unwrap();
    assert!(opened.resumed);
    assert_eq!(opened.session_id, sid, "the kept session goes on");
    assert_eq!(opened.reused_tokens as usize, ctx1.len() - 1);
    assert_eq!(opened.context_len as usize, ctx2.len());
    assert_eq!(
        prefilled(&v) - before,
        user.len() as f64,
        "context_len - 1 - reused_tokens positions prefilled"
    );
    let mut ctx = ctx2.clone();
    let continued = run_rounds(&mut s, &draft, &mut ctx, 6).await;
    assert_eq!(
        ctx[ctx2.len()..],
        target_greedy(&target, &ctx2, ctx.len() - ctx2.len())[..],
        "the target's own greedy output"
    );

    // A fresh session of the whole context, the same drafts: the same verdicts.
    let mut f = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let fresh = f.open(open_msg(&fp, &ctx2)).await.unwrap();
    assert!(!fresh.resumed);
    assert_eq!(fresh.reused_tokens, 0);
    for (r, (d, want)) in continued.iter().enumerate() {
        let got = f.draft(r as u64, d).await.unwrap();
        assert_eq!(&got, want, "round {r}");
    }

    let text = v.state.render_metrics();
    assert_eq!(metric(&text, "tandem_verifier_sessions_kept_total"), 1.0);
    assert_eq!(
        metric(
            &text,
            "tandem_verifier_continuations_total{outcome=\"continued\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(&text, "tandem_verifier_reused_tokens_total"),
        (ctx1.len() - 1) as f64
    );
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampled_continued_turn_draws_what_a_fresh_session_with_its_seed_draws() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let mut c = client(&v).await;
    let sampling = Some(SamplingParams {
        temperature: 0.9,
        seed: 7,
        ..SamplingParams::default()
    });
    // Turn 1 samples with another seed; turn 2 brings its own.
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &prompt(9));
    o.sampling = Some(SamplingParams {
        temperature: 0.9,
        seed: 1234,
        ..SamplingParams::default()
    });
    let sid = s.open(o).await.unwrap().session_id;
    let mut ctx1 = prompt(9);
    for r in 0..3 {
        ctx1.push(s.draft(r, &[]).await.unwrap().next_token);
    }
    close(&mut s, true).await;

    let mut ctx2 = ctx1.clone();
    ctx2.extend_from_slice(&user_turn(4, 9));
    // Streaming steps (k = 0): each verdict is a draw from the target.
    let mut o = continue_msg(&fp, continuation(&sid, &ctx1), &ctx2[ctx1.len()..]);
    o.sampling = sampling.clone();
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    assert!(s.open(o).await.unwrap().resumed);
    let mut o = open_msg(&fp, &ctx2);
    o.sampling = sampling;
    let mut f = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    f.open(o).await.unwrap();
    for r in 0..8 {
        assert_eq!(
            s.draft(r, &[]).await.unwrap(),
            f.draft(r, &[]).await.unwrap(),
            "round {r}"
        );
    }
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_the_verifier_does_not_hold_is_refused_and_the_kept_session_survives() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let draft = load(&m.draft);
    let fp = model_fingerprint(&target);
    let mut c = client(&v).await;
    let (sid, ctx1) = kept_turn(&mut c, &fp, &draft, &prompt(10), 2).await;
    let user = user_turn(5, 1);
    let not_held = |e: &tonic::Status| {
        assert_eq!(
            (e.code(), reason(e)),
            (tonic::Code::FailedPrecondition, Reason::ContextNotHeld),
            "{e:?}"
        );
    };

    // An edited earlier turn: the digest differs.
    let mut edited = ctx1.clone();
    edited[3] = (edited[3] + 1) % 384;
    let e = refused(
        &mut c,
        continue_msg(&fp, continuation(&sid, &edited), &user),
    )
    .await;
    not_held(&e);
    assert!(e.message().contains("digest"), "{e:?}");
    // prefix_len 0, and longer than the context held.
    let mut zero = continuation(&sid, &ctx1);
    zero.prefix_len = 0;
    not_held(&refused(&mut c, continue_msg(&fp, zero, &user)).await);
    let mut longer = ctx1.clone();
    longer.push(1);
    let e = refused(
        &mut c,
        continue_msg(&fp, continuation(&sid, &longer), &user),
    )
    .await;
    not_held(&e);
    assert!(e.message().contains("prefix_len"), "{e:?}");
    let mut huge = continuation(&sid, &ctx1);
    huge.prefix_len = u64::MAX;
    not_held(&refused(&mut c, continue_msg(&fp, huge, &user)).await);
    // A digest of the wrong length (31 of its 32 bytes).
    let mut short = continuation(&sid, &ctx1);
    short.prefix_sha256.pop();
    not_held(&refused(&mut c, continue_msg(&fp, short, &user)).await);
    // A session id the verifier never had.
    let unknown = continuation("0123456789abcdef0123456789abcdef", &ctx1);
    not_held(&refused(&mut c, continue_msg(&fp, unknown, &user)).await);

    // The kept session was left as it was: the right digest continues it.
    let mut ctx2 = ctx1.clone();
    ctx2.extend_from_slice(&user);
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let o = s
        .open(continue_msg(&fp, continuation(&sid, &ctx1), &user))
        .await
        .unwrap();
    assert_eq!(o.reused_tokens as usize, ctx1.len() - 1);
    let mut ctx = ctx2.clone();
    run_rounds(&mut s, &draft, &mut ctx, 3).await;
    assert_eq!(
        ctx[ctx2.len()..],
        target_greedy(&target, &ctx2, ctx.len() - ctx2.len())[..]
    );
    close(&mut s, true).await;

    // The device may continue from a shorter prefix than the verifier holds
    // (it kept fewer tokens): the KV past it is dropped.
    let prefix = &ctx[..ctx1.len() + 2];
    let mut user3 = user_turn(3, 2);
    if user3[0] == ctx[prefix.len()] {
        user3[0] = (user3[0] + 1) % 384;
    }
    let mut ctx3 = prefix.to_vec();
    ctx3.extend_from_slice(&user3);
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let o = s
        .open(continue_msg(&fp, continuation(&sid, prefix), &user3))
        .await
        .unwrap();
    assert_eq!(
        (o.reused_tokens as usize, o.context_len as usize),
        (prefix.len(), ctx3.len())
    );
    let want = target_greedy(&target, &ctx3, 1);
    assert_eq!(s.draft(0, &[]).await.unwrap().next_token, want[0]);

    let text = v.state.render_metrics();
    assert_eq!(
        metric(
            &text,
            "tandem_verifier_continuations_total{outcome=\"not_held\"}"
        ),
        6.0
    );
    assert_eq!(
        metric(
            &text,
            "tandem_verifier_continuations_total{outcome=\"continued\"}"
        ),
        2.0
    );
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_eviction_or_a_close_without_keep_the_context_is_not_held() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let draft = load(&m.draft);
    let fp = model_fingerprint(&target);
    let mut c = client(&v).await;

    // Evicted between turns: CONTEXT_NOT_HELD, then the whole context works.
    let (sid, ctx1) = kept_turn(&mut c, &fp, &draft, &prompt(8), 2).await;
    assert!(v.state.store().evict(&sid));
    let user = user_turn(4, 3);
    let e = refused(&mut c, continue_msg(&fp, continuation(&sid, &ctx1), &user)).await;
    assert_eq!(reason(&e), Reason::ContextNotHeld, "{e:?}");
    assert!(e.message().contains("evicted"), "{e:?}");
    let mut ctx2 = ctx1.clone();
    ctx2.extend_from_slice(&user);
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let o = s.open(open_msg(&fp, &ctx2)).await.unwrap();
    assert_eq!((o.resumed, o.reused_tokens), (false, 0));
    let mut ctx = ctx2.clone();
    run_rounds(&mut s, &draft, &mut ctx, 3).await;
    assert_eq!(
        ctx[ctx2.len()..],
        target_greedy(&target, &ctx2, ctx.len() - ctx2.len())[..]
    );

    // Closed without keep: freed, not held.
    close(&mut s, false).await;
    assert_eq!(v.state.store().len(), 0);
    assert_eq!(v.state.pool.pages_used(), 0);
    let e = refused(
        &mut c,
        continue_msg(&fp, continuation(&o.session_id, &ctx), &[1]),
    )
    .await;
    assert_eq!(reason(&e), Reason::ContextNotHeld, "{e:?}");
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_session_counts_in_the_budget_and_is_evicted_least_recently_used() {
    let m = tiny_models();
    let target = load(&m.target);
    let draft = load(&m.draft);
    // Room for 6 pages of 16 positions. A kept 40-token session holds 3 (its
    // KV of 39); a new 40-token Open needs 4 (39 + a block of 16).
    let bpt = target.new_cache().bytes_per_token() as u64;
    let v = start_plain(&m, &format!("session_budget_bytes = {}", bpt * 16 * 6)).await;
    let fp = model_fingerprint(&target);
    let mut c = client(&v).await;
    let (sid, ctx1) = kept_turn(&mut c, &fp, &draft, &prompt(40), 0).await;
    assert_eq!(v.state.pool.pages_used(), 3);
    let mut b = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    b.open(open_msg(&fp, &prompt(40))).await.unwrap();
    assert_eq!(v.state.store().len(), 1, "the kept session made room");
    let e = refused(&mut c, continue_msg(&fp, continuation(&sid, &ctx1), &[2])).await;
    assert_eq!(reason(&e), Reason::ContextNotHeld, "{e:?}");
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuations_refused_for_another_identity_split_bad_tokens_and_too_long_contexts() {
    let m = tiny_models();
    let v = start_plain(&m, "").await; // max_prompt_tokens = 256
    let target = load(&m.target);
    let draft = load(&m.draft);
    let fp = model_fingerprint(&target);
    let mut c = client(&v).await;
    let (sid, ctx1) = kept_turn(&mut c, &fp, &draft, &prompt(20), 1).await;
    let cont = || continuation(&sid, &ctx1);

    // Another identity: SESSION_FORBIDDEN, as for a resume.
    let mut b = connect(&mut c, Some(TOKEN_B)).await.unwrap();
    let e = b.open(continue_msg(&fp, cont(), &[1])).await.unwrap_err();
    assert_eq!(
        (e.code(), reason(&e)),
        (tonic::Code::PermissionDenied, Reason::SessionForbidden),
        "{e:?}"
    );
    // With split: BAD_REQUEST.
    let mut o = continue_msg(&fp, cont(), &[1]);
    o.split = Some(tandem_proto::v1::Split {
        layer: 1,
        ..Default::default()
    });
    assert_eq!(reason(&refused(&mut c, o).await), Reason::BadRequest);
    // No new token: BAD_REQUEST.
    let e = refused(&mut c, continue_msg(&fp, cont(), &[])).await;
    assert_eq!(reason(&e), Reason::BadRequest, "{e:?}");
    // A new token outside the vocabulary.
    let e = refused(&mut c, continue_msg(&fp, cont(), &[1, 384])).await;
    assert_eq!(reason(&e), Reason::TokenOutOfVocab, "{e:?}");
    // Held prefix + new tokens past max_prompt_tokens.
    let long = user_turn(257 - ctx1.len(), 4);
    let e = refused(&mut c, continue_msg(&fp, cont(), &long)).await;
    assert_eq!(
        (e.code(), reason(&e)),
        (tonic::Code::InvalidArgument, Reason::PromptTooLong),
        "{e:?}"
    );
    assert!(e.message().contains("max_prompt_tokens = 256"), "{e:?}");
    // The model checks apply as to any Open.
    let mut o = continue_msg(&fp, cont(), &[1]);
    o.model_id = "other".into();
    assert_eq!(reason(&refused(&mut c, o).await), Reason::ModelMismatch);

    // Exactly at the limit is fine, and the session was untouched by the refusals.
    let fits = user_turn(256 - ctx1.len(), 4);
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let o = s.open(continue_msg(&fp, cont(), &fits)).await.unwrap();
    assert_eq!(
        (o.reused_tokens as usize, o.context_len),
        (ctx1.len() - 1, 256)
    );
    let mut ctx = ctx1.clone();
    ctx.extend_from_slice(&fits);
    let want = target_greedy(&target, &ctx, 1);
    assert_eq!(s.draft(0, &[]).await.unwrap().next_token, want[0]);

    let text = v.state.render_metrics();
    assert_eq!(
        metric(
            &text,
            "tandem_verifier_continuations_total{outcome=\"refused\"}"
        ),
        6.0
    );
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_sessions_are_neither_kept_nor_continued() {
    use tandem_proto::hidden;
    use tandem_proto::v1::{HiddenFormat, Split};
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let mut c = client(&v).await;
    let p = prompt(6);
    // Device side of s = 1: embedding + layer 0 over the prompt but its last token.
    let mut h = target.embed(&p[..p.len() - 1]).unwrap();
    target
        .forward_layers(0..1, &mut h, 0, &mut target.new_cache())
        .unwrap();
    let split_open = || {
        let mut o = open_msg(&fp, &p);
        o.split = Some(Split {
            layer: 1,
            pin_head: false,
            format: HiddenFormat::HiddenF32 as i32,
        });
        o.prompt_hidden = Some(hidden::encode(&h, p.len() - 1, HiddenFormat::HiddenF32));
        o
    };
    // Close { keep } frees a split session: nothing could continue it.
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    s.open(split_open()).await.unwrap();
    close(&mut s, true).await;
    assert_eq!(v.state.store().len(), 0);
    assert_eq!(v.state.pool.pages_used(), 0);
    // A continuation naming a split session (here one still open) is not held.
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let sid = s.open(split_open()).await.unwrap().session_id;
    let e = refused(&mut c, continue_msg(&fp, continuation(&sid, &p), &[1])).await;
    assert_eq!(reason(&e), Reason::ContextNotHeld, "{e:?}");
    assert_eq!(v.state.store().len(), 1, "checked back in");
    v.shutdown().await.unwrap();
}
