//! The hosted verifier with many devices, over real gRPC on loopback with tiny
//! models: cross-session batching keeps every session's output the target's
//! own, and the admission-control audit cases (wrapping round numbers, a
//! panicking forward, per-identity eviction, page accounting after a resume,
//! a flood of long Opens, idle streams, oversized messages, stale Close).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tandem_proto::v1::{client_message, server_message, Close, Reason, Resume};
use tandem_verifier::model_fingerprint;

/// The value of an unlabelled metric line.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sessions_share_forwards_and_each_gets_the_targets_output() {
    let m = tiny_models();
    // A gather window long enough that concurrent rounds meet in one forward.
    let v = start_plain_with(&m, "", "gather_window_us = 20000\nprefill_chunk = 8").await;
    let target = load(&m.target);
    let draft = Arc::new(load(&m.draft));
    let fp = model_fingerprint(&target);
    let c = client(&v).await;
    let mut tasks = Vec::new();
    for i in 0..6usize {
        let (mut c, fp, draft) = (c.clone(), fp.clone(), draft.clone());
        let p: Vec<u32> = (0..(5 + 7 * i) as u32)
            .map(|j| (j * 13 + i as u32 * 29) % 384)
            .collect();
        let token = if i % 2 == 0 { TOKEN_A } else { TOKEN_B };
        tasks.push(tokio::spawn(async move {
            let (got, _) = generate_as(token, &mut c, &fp, &draft, &p, 20, |_, _| {}).await;
            (p, got)
        }));
    }
    let mut rounds = 0.0;
    for t in tasks {
        let (p, got) = t.await.unwrap();
        assert_eq!(got, target_greedy(&target, &p, 20), "prompt of {}", p.len());
    }
    let text = v.state.render_metrics();
    rounds += metric(&text, "tandem_verifier_verify_seconds_count");
    let forwards = metric(&text, "tandem_verifier_forwards_total");
    // Every round and prefill chunk would be a forward of its own without
    // batching; shared forwards make fewer.
    assert!(
        forwards < rounds,
        "{forwards} forwards for {rounds} rounds: nothing was batched\n{text}"
    );
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unbatched_path_gives_the_same_output() {
    let m = tiny_models();
    let v = start_plain_with(&m, "", "enabled = false").await;
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let mut c = client(&v).await;
    let p = prompt(9);
    let (got, _) = generate(&mut c, &fp, &load(&m.draft), &p, 16, |_, _| {}).await;
    assert_eq!(got, target_greedy(&target, &p, 16));
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_numbers_never_wrap_and_the_session_survives_the_refusal() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let fp = model_fingerprint(&load(&m.target));
    let mut c = client(&v).await;
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &prompt(5));
    o.first_round = u64::MAX - 1;
    let opened = s.open(o).await.unwrap();
    s.draft(u64::MAX - 1, &[3]).await.unwrap();
    let e = s.draft(u64::MAX, &[3]).await.unwrap_err();
    assert_eq!(reason(&e), Reason::BadRequest, "{e:?}");
    assert!(e.message().contains("2^64"), "{e:?}");
    assert_eq!(v.state.store().len(), 1, "the session is kept, not leaked");
    // It can be continued on a new stream with a fresh numbering.
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &prompt(5));
    o.resume_session_id = Some(opened.session_id);
    assert!(s.open(o).await.unwrap().resumed);
    s.draft(0, &[1]).await.unwrap();
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_forward_frees_its_sessions_and_the_verifier_goes_on() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let target = load(&m.target);
    let fp = model_fingerprint(&target);
    let mut c = client(&v).await;
    let p = prompt(7);
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let opened = s.open(open_msg(&fp, &p)).await.unwrap();
    assert!(v.state.pool.pages_used() > 0);
    v.state.scheduler.panic_next_forward();
    let e = s.draft(0, &[1, 2]).await.unwrap_err();
    assert_eq!(reason(&e), Reason::InternalError, "{e:?}");
    assert_eq!(v.state.store().len(), 0, "the slot is freed");
    assert_eq!(
        v.state.pool.pages_used(),
        0,
        "its pages are back in the pool"
    );
    // The device re-sends its context; the output is still the target's.
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &p);
    o.resume_session_id = Some(opened.session_id);
    assert!(
        !s.open(o).await.unwrap().resumed,
        "recomputed under a new id"
    );
    let want = target_greedy(&target, &p, 1);
    assert_eq!(s.draft(0, &[]).await.unwrap().next_token, want[0]);
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_identitys_churn_evicts_only_its_own_sessions() {
    let m = tiny_models();
    let v = start_plain(&m, "max_sessions = 8\nmax_sessions_per_identity = 3").await;
    let fp = model_fingerprint(&load(&m.target));
    let mut c = client(&v).await;
    let mut a = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    a.open(open_msg(&fp, &prompt(6))).await.unwrap();
    a.draft(0, &[1]).await.unwrap();
    // B opens 12 sessions and walks away from each (no Close).
    for i in 0..12 {
        let mut b = connect(&mut c, Some(TOKEN_B)).await.unwrap();
        b.open(open_msg(&fp, &prompt(2 + i % 3))).await.unwrap();
    }
    let text = v.state.render_metrics();
    assert!(
        text.contains("tandem_verifier_identity_sessions{identity=\"b\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("tandem_verifier_identity_sessions{identity=\"a\"} 1"),
        "{text}"
    );
    // A's session is alive.
    a.draft(1, &[1]).await.unwrap();
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_follow_use_through_growth_and_a_resume_to_one_token() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let fp = model_fingerprint(&load(&m.target));
    let page = v.state.pool.page_bytes() as u64;
    let mut c = client(&v).await;
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    // 120 tokens: KV of 119 plus room for a block of 16: 135 positions, 9 pages.
    s.open(open_msg(&fp, &prompt(120))).await.unwrap();
    assert_eq!(v.state.pool.pages_used(), 9);
    let bytes = v.state.store().bytes();
    assert_eq!(bytes, 9 * page + 120 * 4, "the budget counts pages held");
    // Resume to a context of one token: the pages go back.
    let m2 = s
        .call(client_message::Msg::Resume(Resume {
            context_tokens: prompt(1),
            next_round: 0,
        }))
        .await
        .unwrap();
    assert!(matches!(m2, server_message::Msg::Resumed(_)), "{m2:?}");
    assert_eq!(v.state.pool.pages_used(), 2, "1 + 16 positions: 2 pages");
    assert_eq!(v.state.store().bytes(), 2 * page + 4);
    // Close gives back the rest.
    s.call(client_message::Msg::Close(Close::default()))
        .await
        .unwrap();
    assert_eq!(v.state.pool.pages_used(), 0);
    assert_eq!(v.state.store().bytes(), 0);
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_honest_open_is_not_queued_behind_another_identitys_flood_of_long_opens() {
    let m = tiny_models();
    let v = start_plain_with(
        &m,
        "max_inflight_prefill_tokens_per_identity = 2000\nmax_inflight_prefill_tokens = 3000",
        "max_batch_rows = 17\nprefill_chunk = 4",
    )
    .await;
    let fp = model_fingerprint(&load(&m.target));
    let c = client(&v).await;
    let done_b = Arc::new(AtomicUsize::new(0));
    let mut flood = Vec::new();
    for i in 0..8u32 {
        let (mut c, fp, done_b) = (c.clone(), fp.clone(), done_b.clone());
        flood.push(tokio::spawn(async move {
            let mut b = connect(&mut c, Some(TOKEN_B)).await.unwrap();
            let p: Vec<u32> = (0..250).map(|j| (j * 7 + i) % 384).collect();
            b.open(open_msg(&fp, &p)).await.unwrap();
            done_b.fetch_add(1, Ordering::SeqCst);
        }));
    }
    // Once the flood is being prefilled, an honest short Open.
    while metric(
        &v.state.render_metrics(),
        "tandem_verifier_prefill_tokens_total",
    ) == 0.0
    {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let mut a = connect(&mut c.clone(), Some(TOKEN_A)).await.unwrap();
    a.open(open_msg(&fp, &prompt(12))).await.unwrap();
    assert!(
        done_b.load(Ordering::SeqCst) < 8,
        "A's 12-token Open waited for all of B's 8 x 250-token Opens"
    );
    for t in flood {
        t.await.unwrap();
    }
    v.shutdown().await.unwrap();
}

/// Polls `done` every 2 ms for up to 20 s.
async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !done() {
        assert!(
            std::time::Instant::now() < until,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_the_device_gives_up_on_is_never_prefilled_and_frees_its_pages() {
    // The fault soak's finding: a device that abandons a re-open under load
    // left its whole-context prefill queued in front of everyone else's work.
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let fp = model_fingerprint(&load(&m.target));
    let mut c = client(&v).await;
    // A busy scheduler, made deterministic: the Open queues but cannot run.
    v.state.scheduler.set_paused(true);
    let s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let open = client_message::Msg::Open(open_msg(&fp, &prompt(60)));
    s.tx.send(tandem_proto::v1::ClientMessage { msg: Some(open) })
        .await
        .unwrap();
    wait_for("the Open's prefill to be admitted", || {
        v.state.admission.prefill_tokens_in_flight() > 0
    })
    .await;
    assert!(v.state.pool.pages_used() > 0, "its pages are reserved");
    drop(s); // the device gives up on it (its stream is reset)
    wait_for("the abandoned Open's handler to be dropped", || {
        v.state.admission.prefill_tokens_in_flight() == 0
    })
    .await;
    v.state.scheduler.set_paused(false);
    wait_for("the abandoned job's pages to go back", || {
        v.state.pool.pages_used() == 0
    })
    .await;
    let text = v.state.render_metrics();
    assert_eq!(metric(&text, "tandem_verifier_abandoned_jobs_total"), 1.0);
    assert_eq!(metric(&text, "tandem_verifier_prefill_tokens_total"), 0.0);
    assert_eq!(metric(&text, "tandem_verifier_sessions_opened_total"), 0.0);
    assert_eq!(v.state.store().len(), 0, "no session was made for nobody");
    // The verifier goes on: the next Open is answered.
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    s.open(open_msg(&fp, &prompt(8))).await.unwrap();
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_stream_is_ended_and_its_session_kept_for_a_resume() {
    let m = tiny_models();
    let v = start_plain(&m, "stream_idle_secs = 1").await;
    let fp = model_fingerprint(&load(&m.target));
    let mut c = client(&v).await;
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let opened = s.open(open_msg(&fp, &prompt(5))).await.unwrap();
    let e = s.rx.message().await.unwrap_err();
    assert_eq!(
        (e.code(), reason(&e)),
        (tonic::Code::DeadlineExceeded, Reason::StreamIdle),
        "{e:?}"
    );
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &prompt(5));
    o.resume_session_id = Some(opened.session_id);
    assert!(s.open(o).await.unwrap().resumed);
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_message_gets_resource_exhausted_with_its_reason() {
    let m = tiny_models();
    let v = start_plain(&m, "max_message_bytes = 1024").await;
    let fp = model_fingerprint(&load(&m.target));
    let mut c = client(&v).await;
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    // 250 ids of two varint bytes and more: past 1 KiB.
    let p: Vec<u32> = (0..250).map(|i| 200 + i % 180).collect();
    let mut o = open_msg(&fp, &p);
    o.tokenizer_fingerprint.push_str(&"x".repeat(600));
    let e = s.open(o).await.unwrap_err();
    assert_eq!(
        (e.code(), reason(&e)),
        (tonic::Code::ResourceExhausted, Reason::MessageTooLarge),
        "{e:?}"
    );
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_streams_close_does_not_remove_the_session() {
    let m = tiny_models();
    let v = start_plain(&m, "").await;
    let fp = model_fingerprint(&load(&m.target));
    let mut c = client(&v).await;
    let mut old = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let opened = old.open(open_msg(&fp, &prompt(5))).await.unwrap();
    let mut new = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&fp, &prompt(5));
    o.resume_session_id = Some(opened.session_id);
    assert!(new.open(o).await.unwrap().resumed);
    old.call(client_message::Msg::Close(Close::default()))
        .await
        .unwrap();
    assert_eq!(v.state.store().len(), 1);
    new.draft(0, &[1]).await.unwrap();
    v.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_ends_at_its_deadline_even_if_a_peer_never_closes() {
    use tokio::io::AsyncWriteExt;
    let m = tiny_models();
    let v = start_plain(&m, "drain_timeout_secs = 1").await;
    // An HTTP/2 peer that never answers the server's closing handshake.
    let mut hold = tokio::net::TcpStream::connect(v.grpc_addr).await.unwrap();
    hold.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    // Without the deadline this would wait for the peer forever.
    tokio::time::timeout(std::time::Duration::from_secs(20), v.shutdown())
        .await
        .expect("the drain passed its deadline")
        .unwrap();
    drop(hold);
}
