//! Issue 31 item 2: a flood of split-session Opens from one identity does not
//! stall another identity's verifies. Identity B loops concurrent split Opens
//! (layer 0 and 1, long prompts of hidden states) while identity A runs
//! verify rounds; A's p95 round latency during the flood must stay within
//! 2x of its p95 measured quietly in the same run (quiet and flooded phases
//! alternate, so a shared machine's drifting load falls on both). Before split prefill was
//! chunked, each split Open ran its whole prompt as one forward alone and A
//! waited behind it (seconds with the real target).
//!
//! Tiny random-weight target (2 layers); the batching knobs are small so an
//! iteration's prefill share stays small beside A's block. On the tiny model
//! a round is well under a millisecond, so scheduling noise on a shared
//! machine would decide a 2x comparison of bare forwards: the gather window
//! is 1 ms, a quiet verifier's real floor (it waits that long for company
//! when idle; during the flood the queue is never empty and it does not
//! wait). A stall behind a whole split prompt (tens to hundreds of
//! milliseconds here) still fails it many times over. A's tokens are also
//! checked against the target's own greedy output.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tandem_model::transformer::{LoadOptions, Model};
use tandem_proto::hidden;
use tandem_proto::v1::{client_message, Close, HiddenFormat, HiddenStates, Split};
use tandem_verifier::model_fingerprint;

/// Hidden rows per split Open (the prompt is one token longer).
const FLOOD_ROWS: usize = 1200;
/// B's concurrent Open loops.
const FLOODERS: usize = 3;
/// Quiet and flooded phases alternate this many times (so both see the
/// same machine: the load of a shared CI box drifts within seconds)...
const CYCLES: usize = 4;
/// ...with this many measured rounds of A each (after a few unmeasured ones).
const ROUNDS: usize = 20;
const WARM_UP: usize = 3;
const ATTEMPTS: usize = 3;
const K: usize = 4;

fn flood_config(m: &Models) -> tandem_verifier::VerifierConfig {
    let toml = format!(
        r#"
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
model_path = "{}"
model_id = "{MODEL_ID}"
max_seq_len = 2048
insecure_loopback = true

[[devices]]
id = "a"
token = "{TOKEN_A}"

[[devices]]
id = "b"
token = "{TOKEN_B}"

[limits]
max_prompt_tokens = 1600
max_block = {K}
max_message_bytes = 8388608
rate_per_sec = 100000
rate_burst = 100000
prefill_tokens_per_sec = 1000000
prefill_burst_tokens = 1000000
max_inflight_prefill_tokens = 1000000
max_inflight_prefill_tokens_per_identity = 1000000

[batching]
max_batch_rows = 8
prefill_chunk = 4
gather_window_us = 1000
"#,
        m.target.display()
    );
    parse(m.dir.path(), &toml)
}

fn p95(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    // Nearest rank.
    let i = ((xs.len() as f64) * 0.95).ceil() as usize;
    xs[i.clamp(1, xs.len()) - 1]
}

/// `n` verify rounds of A (a block of K tokens the target mostly rejects);
/// the latency of each after the warm-up ones.
async fn rounds(
    a: &mut Conn,
    ctx: &mut Vec<u32>,
    round: &mut u64,
    warm_up: usize,
    n: usize,
) -> Vec<Duration> {
    let mut out = Vec::new();
    for i in 0..warm_up + n {
        let block: Vec<u32> = (0..K as u32)
            .map(|j| (*round as u32 * 7 + j) % 384)
            .collect();
        let t = Instant::now();
        let v = a.draft(*round, &block).await.unwrap();
        let took = t.elapsed();
        ctx.extend_from_slice(&block[..v.accepted as usize]);
        ctx.push(v.next_token);
        assert_eq!(v.context_len as usize, ctx.len());
        *round += 1;
        if i >= warm_up {
            out.push(took);
        }
    }
    out
}

/// What the test tells B's loops, and what they report.
#[derive(Default)]
struct Flood {
    stop: AtomicBool,
    paused: AtomicBool,
    in_flight: AtomicUsize,
    opened: AtomicUsize,
}

/// B's loop: split Opens at layer `layer` until `stop` (none started while
/// `paused`), each closed once open.
async fn flood(
    mut c: tandem_proto::v1::verifier_client::VerifierClient<tonic::transport::Channel>,
    fp: String,
    layer: u32,
    prompt_hidden: HiddenStates,
    f: Arc<Flood>,
) {
    let tokens = prompt(FLOOD_ROWS + 1);
    while !f.stop.load(Ordering::SeqCst) {
        if f.paused.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        f.in_flight.fetch_add(1, Ordering::SeqCst);
        let mut b = connect(&mut c, Some(TOKEN_B)).await.unwrap();
        let mut o = open_msg(&fp, &tokens);
        o.split = Some(Split {
            layer,
            pin_head: false,
            format: HiddenFormat::HiddenF32 as i32,
        });
        o.prompt_hidden = Some(prompt_hidden.clone());
        b.open(o).await.unwrap();
        f.opened.fetch_add(1, Ordering::SeqCst);
        b.call(client_message::Msg::Close(Close { keep: false }))
            .await
            .unwrap();
        f.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Waits (at most `secs`) until `done`.
async fn until(secs: u64, what: &str, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(secs), "{what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn prefill_rows(v: &tandem_verifier::RunningVerifier) -> f64 {
    let text = v.state.render_metrics();
    text.lines()
        .find_map(|l| l.strip_prefix("tandem_verifier_prefill_tokens_total "))
        .and_then(|x| x.trim().parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_split_opens_leaves_another_identitys_verifies_flowing() {
    let m = tiny_models();
    let target = Model::load(&m.target, LoadOptions::with_max_seq_len(2048)).unwrap();
    let fp = model_fingerprint(&target);
    let v = tandem_verifier::start(flood_config(&m)).await.unwrap();
    let mut c = client(&v).await;

    // The flood's hidden states: the prompt's embeddings (layer 0's input;
    // any finite rows do for layer 1).
    let flood_tokens = prompt(FLOOD_ROWS + 1);
    let h = target.embed(&flood_tokens[..FLOOD_ROWS]).unwrap();
    let prompt_hidden = hidden::encode(&h, FLOOD_ROWS, HiddenFormat::HiddenF32);

    let a_prompt = prompt(12);
    let mut a = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    a.open(open_msg(&fp, &a_prompt)).await.unwrap();
    let mut ctx = a_prompt.clone();
    let mut round = 0u64;
    let f = Arc::new(Flood::default());
    f.paused.store(true, Ordering::SeqCst);
    let flooders: Vec<_> = (0..FLOODERS)
        .map(|i| {
            tokio::spawn(flood(
                c.clone(),
                fp.clone(),
                (i % 2) as u32,
                prompt_hidden.clone(),
                f.clone(),
            ))
        })
        .collect();
    // Up to three attempts: one passing attempt shows the scheduler keeps A
    // flowing (a stall behind whole split prompts fails every attempt; a
    // shared machine's scheduling hiccup fails one).
    let mut results = Vec::new();
    for _ in 0..ATTEMPTS {
        let (mut quiet, mut flooded) = (Vec::new(), Vec::new());
        let mut flood_rows = 0.0;
        for _ in 0..CYCLES {
            // Quiet: no split Open in flight.
            f.paused.store(true, Ordering::SeqCst);
            until(120, "B's split Opens never finished", || {
                f.in_flight.load(Ordering::SeqCst) == 0
            })
            .await;
            quiet.extend(rounds(&mut a, &mut ctx, &mut round, WARM_UP, ROUNDS).await);
            // Flooded: B's split prefill rows are being run.
            f.paused.store(false, Ordering::SeqCst);
            let before = prefill_rows(&v);
            until(30, "the flood never started", || {
                prefill_rows(&v) >= before + 64.0
            })
            .await;
            let start = prefill_rows(&v);
            flooded.extend(rounds(&mut a, &mut ctx, &mut round, WARM_UP, ROUNDS).await);
            flood_rows += prefill_rows(&v) - start;
            assert!(
                f.in_flight.load(Ordering::SeqCst) > 0,
                "the flood ended during A's rounds"
            );
        }
        assert!(
            flood_rows >= (CYCLES * ROUNDS) as f64,
            "the flood ran only {flood_rows} prefill rows beside A's rounds"
        );
        let (q, fl) = (p95(quiet), p95(flooded));
        eprintln!(
            "A's verify p95: quiet {:.2} ms, during B's split-Open flood {:.2} ms ({:.2}x); \
             {flood_rows:.0} split prefill rows ran during A's flooded rounds",
            q.as_secs_f64() * 1e3,
            fl.as_secs_f64() * 1e3,
            fl.as_secs_f64() / q.as_secs_f64(),
        );
        results.push((q, fl));
        if fl <= q * 2 {
            break;
        }
    }
    // B is slowed, not starved: its Opens go through.
    until(120, "B's split Opens never finished", || {
        f.opened.load(Ordering::SeqCst) >= FLOODERS
    })
    .await;
    f.stop.store(true, Ordering::SeqCst);
    for t in flooders {
        t.await.unwrap();
    }

    assert!(
        results.iter().any(|&(q, fl)| fl <= q * 2),
        "A's verify p95 during the flood is more than 2x its quiet p95 in every attempt \
         (quiet, flooded): {results:?}"
    );
    assert!(f.opened.load(Ordering::SeqCst) >= FLOODERS);

    // The invariant: A's tokens are the target's own greedy output.
    let generated = &ctx[a_prompt.len()..];
    assert_eq!(
        generated,
        target_greedy(&target, &a_prompt, generated.len()).as_slice()
    );
}
