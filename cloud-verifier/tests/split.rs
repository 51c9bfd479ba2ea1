//! Split sessions at the wire level against a real verifier on 127.0.0.1 (tiny
//! target, 2 layers): a hand-driven head-here session at s = 1 gives the same
//! verdicts as an unsplit one; a U-shape session returns final hidden states
//! equal to the unsplit model's; malformed split requests are refused with
//! BAD_REQUEST naming the problem.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use tandem_model::sampling::argmax;
use tandem_proto::hidden;
use tandem_proto::v1::{client_message, server_message, Draft, HiddenFormat, Reason, Split};
use tandem_verifier::model_fingerprint;

const PROMPT: &[u32] = &[5, 17, 42, 99, 3];

fn split(layer: u32, pin_head: bool) -> Option<Split> {
    Some(Split {
        layer,
        pin_head,
        format: HiddenFormat::HiddenF32 as i32,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_sessions_match_the_unsplit_model_and_refuse_bad_requests() {
    let m = tiny_models();
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let v = start_plain(&m, "").await;
    let mut c = client(&v).await;
    let d = target.config().d_model;
    let n = target.config().n_layer;
    assert_eq!(n, 2);

    // Device side of s = 1: embedding + layer 0 over the prompt minus its last token.
    let mut dev_cache = target.new_cache();
    let mut h = target.embed(&PROMPT[..PROMPT.len() - 1]).unwrap();
    target
        .forward_layers(0..1, &mut h, 0, &mut dev_cache)
        .unwrap();
    let mut open = open_msg(&fp, PROMPT);
    open.split = split(1, false);
    open.prompt_hidden = Some(hidden::encode(
        &h,
        PROMPT.len() - 1,
        HiddenFormat::HiddenF32,
    ));
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let o = s.open(open).await.unwrap();
    assert_eq!(
        (o.context_len, o.n_layer as usize, o.d_model as usize),
        (5, n, d)
    );

    // k = 2 block [last, d1, d2] where d1 is the target's own next token.
    let mut ref_cache = target.new_cache();
    let logits = target.forward(PROMPT, 0, &mut ref_cache).unwrap();
    let vocab = target.config().vocab;
    let t1 = argmax(&logits[(PROMPT.len() - 1) * vocab..]);
    let block = [*PROMPT.last().unwrap(), t1, 7];
    let mut hb = target.embed(&block).unwrap();
    target
        .forward_layers(0..1, &mut hb, 4, &mut dev_cache)
        .unwrap();
    let draft = Draft {
        round: 0,
        tokens: vec![t1, 7],
        hidden: Some(hidden::encode(&hb, 3, HiddenFormat::HiddenF32)),
        start_pos: 4,
    };
    let verdict = match s.call(client_message::Msg::Draft(draft)).await.unwrap() {
        server_message::Msg::Verdict(v) => v,
        m => panic!("{m:?}"),
    };
    // The same block through an unsplit session.
    let mut u = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    u.open(open_msg(&fp, PROMPT)).await.unwrap();
    let plain = match u
        .call(client_message::Msg::Draft(Draft {
            round: 0,
            tokens: vec![t1, 7],
            ..Draft::default()
        }))
        .await
        .unwrap()
    {
        server_message::Msg::Verdict(v) => v,
        m => panic!("{m:?}"),
    };
    assert_eq!(verdict, plain);
    assert!(verdict.accepted >= 1);

    // Resume is refused in split sessions.
    let e = s
        .call(client_message::Msg::Resume(tandem_proto::v1::Resume {
            context_tokens: PROMPT.to_vec(),
            next_round: 1,
        }))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::BadRequest);
    assert!(e.message().contains("split"), "{e:?}");

    // U-shape at s = 1: no tokens; the verifier returns layer-1 output rows that
    // equal the unsplit model's final hidden states (before the norm).
    let mut dev = target.new_cache();
    let mut hp = target.embed(&PROMPT[..4]).unwrap();
    target.forward_layers(0..1, &mut hp, 0, &mut dev).unwrap();
    let mut open = open_msg(&fp, &[]);
    open.split = split(1, true);
    open.prompt_hidden = Some(hidden::encode(&hp, 4, HiddenFormat::HiddenF32));
    let mut w = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    assert_eq!(w.open(open).await.unwrap().context_len, 5);
    let mut hb = target.embed(&block).unwrap();
    target.forward_layers(0..1, &mut hb, 4, &mut dev).unwrap();
    let answer = match w
        .call(client_message::Msg::Draft(Draft {
            round: 0,
            hidden: Some(hidden::encode(&hb, 3, HiddenFormat::HiddenF32)),
            start_pos: 4,
            ..Draft::default()
        }))
        .await
        .unwrap()
    {
        server_message::Msg::Verdict(v) => v,
        m => panic!("{m:?}"),
    };
    assert_eq!(
        (answer.accepted, answer.next_token, answer.context_len),
        (0, 0, 7)
    );
    let got = hidden::decode(
        answer.hidden.as_ref().unwrap(),
        3,
        d,
        HiddenFormat::HiddenF32,
    )
    .unwrap();
    let mut full = target.embed(&PROMPT[..4]).unwrap();
    let mut fc = target.new_cache();
    target.forward_layers(0..n, &mut full, 0, &mut fc).unwrap();
    let mut want = target.embed(&block).unwrap();
    target.forward_layers(0..n, &mut want, 4, &mut fc).unwrap();
    assert_eq!(got, want, "final hidden states must be bit-identical");
    // The device keeps 1 accepted token: the next block starts at 4 + 1 + 1 = 6.
    // A start_pos beyond what the verifier holds is refused.
    let e = w
        .call(client_message::Msg::Draft(Draft {
            round: 1,
            hidden: Some(hidden::encode(&hb[..d], 1, HiddenFormat::HiddenF32)),
            start_pos: 8,
            ..Draft::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::BadRequest);
    assert!(e.message().contains("start_pos"), "{e:?}");

    // Malformed opens.
    for (layer, pin, tokens, rows, what) in [
        (3, false, PROMPT, 4, "beyond"),
        (1, true, PROMPT, 4, "prompt_tokens must be empty"),
        (1, false, PROMPT, 3, "prompt_hidden has 3 rows"),
    ] {
        let mut open = open_msg(&fp, tokens);
        open.split = split(layer, pin);
        open.prompt_hidden = Some(hidden::encode(
            &hp[..rows * d],
            rows,
            HiddenFormat::HiddenF32,
        ));
        let mut x = connect(&mut c, Some(TOKEN_A)).await.unwrap();
        let e = x.open(open).await.unwrap_err();
        assert_eq!(reason(&e), Reason::BadRequest, "{what}");
        assert!(e.message().contains(what), "{what}: {e:?}");
    }
    // Wrong byte count for the rows.
    let mut open = open_msg(&fp, PROMPT);
    open.split = split(1, false);
    let mut bad = hidden::encode(&hp, 4, HiddenFormat::HiddenF32);
    bad.data.pop();
    open.prompt_hidden = Some(bad);
    let mut x = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let e = x.open(open).await.unwrap_err();
    assert_eq!(reason(&e), Reason::BadRequest);
    assert!(e.message().contains("bytes"), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_draft_reserves_only_what_it_carries_and_gives_back_what_a_refusal_took() {
    let m = tiny_models();
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let v = start_plain(&m, "").await;
    let mut c = client(&v).await;
    let d = target.config().d_model;
    let n = target.config().n_layer as u32;
    let used = || v.state.pool.pages_used();
    let draft_msg = |round: u64, rows: usize, start_pos: u64| {
        client_message::Msg::Draft(Draft {
            round,
            hidden: Some(hidden::encode(
                &vec![0.25f32; rows * d],
                rows,
                HiddenFormat::HiddenF32,
            )),
            start_pos,
            ..Draft::default()
        })
    };

    // U-shape at s = N with no hidden rows: this verifier runs no layer and
    // holds no KV, whatever start_pos the device names.
    let mut open = open_msg(&fp, &[]);
    open.split = split(n, true);
    let mut w = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    w.open(open).await.unwrap();
    let before = used();
    match w.call(draft_msg(0, 1, 480)).await.unwrap() {
        server_message::Msg::Verdict(v) => assert_eq!(v.context_len, 481),
        m => panic!("{m:?}"),
    }
    assert!(used() <= before, "pages in use {} > {before}", used());
    // Past the KV capacity: refused, nothing reserved.
    let e = w.call(draft_msg(1, 1, 4070)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::ContextFull, "{e:?}");
    assert!(used() <= before, "pages in use {} > {before}", used());

    // U-shape at s = 1 holding 5 positions: a start_pos beyond them is
    // refused before any page is reserved, and the session keeps what it
    // held (it used to keep the pages up to start_pos until the idle TTL).
    let mut dev = target.new_cache();
    let mut hp = target.embed(&PROMPT[..4]).unwrap();
    target.forward_layers(0..1, &mut hp, 0, &mut dev).unwrap();
    let mut open = open_msg(&fp, &[]);
    open.split = split(1, true);
    open.prompt_hidden = Some(hidden::encode(&hp, 4, HiddenFormat::HiddenF32));
    let mut u = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    u.open(open).await.unwrap();
    let held = used();
    let e = u.call(draft_msg(0, 3, 400)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::BadRequest, "{e:?}");
    assert_eq!(used(), held, "a refused Draft left pages reserved");
    // (A refusal ends the stream; the session stays for a re-open.)
    drop((u, w, c));
    v.shutdown().await.unwrap();
}
