//! Catching the draft up between turns (`EdgeRuntime::catch_up`; docs/edge.md
//! "Catching the draft up between turns"): a turn that prompt lookup served
//! leaves the draft's KV behind by its reply; an idle period runs those rows
//! through the draft, so the next turn's device prefill is its new tokens
//! only. The catch-up yields to a request after at most one chunk, and it
//! changes nothing a turn proposes or outputs: every turn is the target's
//! greedy output, with the same rounds, drafts and acceptances as without it.

#![allow(clippy::unwrap_used)]
mod common;
use common::{io_runtime, load, start_tiny_verifier, target_greedy, tiny_edge, tiny_models};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;
use tandem_edge::{EdgeGeneration, EdgeRuntime, CATCH_UP_CHUNK};
use tandem_model::proposer::ProposerKind;
use tandem_model::speculative::GenerateConfig;

const TOKEN: &str = "catch-up-test-token-0123456789";

fn gen(max_tokens: usize, proposer: ProposerKind) -> GenerateConfig {
    GenerateConfig {
        max_tokens,
        k: 4,
        proposer,
        ..GenerateConfig::default()
    }
}

fn turn(
    rt: &mut EdgeRuntime,
    prompt: &[u32],
    max_tokens: usize,
    proposer: ProposerKind,
) -> EdgeGeneration {
    rt.generate_in(
        Some("chat"),
        prompt,
        &gen(max_tokens, proposer),
        &mut |_| true,
    )
    .unwrap()
}

fn next_prompt(prev: &[u32], reply: &[u32], new: &[u32]) -> Vec<u32> {
    let mut p = prev.to_vec();
    p.extend_from_slice(reply);
    p.extend_from_slice(new);
    p
}

#[test]
fn an_idle_catch_up_leaves_the_next_turn_only_its_new_tokens_and_changes_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let (target, draft) = tiny_models(dir.path());
    let io = io_runtime();
    let v = start_tiny_verifier(&io, &target, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    let tmodel = load(&target);
    // Two devices running the same conversation: one catches up between
    // turns, the other does not.
    let mut with = tiny_edge(&draft, &url, TOKEN, |_| {});
    let mut without = tiny_edge(&draft, &url, TOKEN, |_| {});

    // Turn 1: prompt lookup answers it, so the draft never runs (its KV holds
    // nothing of the context).
    let p1: Vec<u32> = (0..60).map(|i| 3 + (i * 7) % 250).collect();
    let g1 = turn(&mut with, &p1, 12, ProposerKind::Lookup);
    let h1 = turn(&mut without, &p1, 12, ProposerKind::Lookup);
    assert_eq!(g1.tokens, target_greedy(&tmodel, &p1, 12));
    assert_eq!(g1.tokens, h1.tokens);
    let ctx1 = p1.len() + g1.tokens.len();

    // The idle period: the whole context of turn 1 goes through the draft.
    let c = with.catch_up(&|| false).unwrap();
    assert_eq!((c.rows, c.entries, c.yielded), (ctx1, 1, false), "{c:?}");
    assert_eq!(with.conversation_stats().caught_up_rows, ctx1 as u64);
    // Nothing is left to do.
    assert_eq!(with.catch_up(&|| false).unwrap().rows, 0);

    // Turn 2 runs the draft: with the catch-up it prefills the new tokens
    // only; without, the whole context.
    let new = [60, 61, 62, 63, 64, 65, 66];
    let p2 = next_prompt(&p1, &g1.tokens, &new);
    let g2 = turn(&mut with, &p2, 12, ProposerKind::Draft);
    let h2 = turn(&mut without, &p2, 12, ProposerKind::Draft);
    assert_eq!(g2.stats.draft_reused_tokens, ctx1, "{:?}", g2.stats);
    assert_eq!(g2.stats.draft_caught_up_tokens, ctx1, "{:?}", g2.stats);
    assert_eq!(g2.stats.draft_prefill_tokens, new.len());
    assert_eq!(h2.stats.draft_reused_tokens, 0);
    assert_eq!(h2.stats.draft_caught_up_tokens, 0);
    assert_eq!(h2.stats.draft_prefill_tokens, p2.len());
    // The same output, the target's, and the same proposals: the rows the
    // catch-up computed are those the lazy draft computes in turn 2.
    let want = target_greedy(&tmodel, &p2, 12);
    assert_eq!(g2.tokens, want);
    assert_eq!(h2.tokens, want);
    let props = |g: &EdgeGeneration| (g.stats.rounds, g.stats.drafted, g.stats.accepted);
    assert_eq!(props(&g2), props(&h2));
    assert!(g2.stats.drafted > 0);

    // Turn 3 after a draft-run turn: the draft lags by at most the token its
    // next step runs; catching that up changes nothing either.
    let p3 = next_prompt(&p2, &g2.tokens, &[70, 71, 72]);
    let c = with.catch_up(&|| false).unwrap();
    assert!(c.rows <= 5, "{c:?}");
    let g3 = turn(&mut with, &p3, 12, ProposerKind::Draft);
    let h3 = turn(&mut without, &p3, 12, ProposerKind::Draft);
    assert_eq!(g3.tokens, target_greedy(&tmodel, &p3, 12));
    assert_eq!(g3.tokens, h3.tokens);
    assert_eq!(props(&g3), props(&h3));
    io.block_on(v.shutdown()).unwrap();
}

#[test]
fn a_request_waits_for_at_most_one_chunk_of_the_catch_up() {
    let dir = tempfile::tempdir().unwrap();
    let (target, draft) = tiny_models(dir.path());
    let io = io_runtime();
    let v = start_tiny_verifier(&io, &target, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    let tmodel = load(&target);
    let mut a = tiny_edge(&draft, &url, TOKEN, |_| {});
    // A sibling slot: the same kept conversations.
    let mut b = a.sibling().unwrap();

    let p1: Vec<u32> = (0..300).map(|i| 5 + (i * 11) % 240).collect();
    let g1 = turn(&mut a, &p1, 8, ProposerKind::Lookup);
    let ctx1 = p1.len() + g1.tokens.len();
    assert!(ctx1 > 4 * CATCH_UP_CHUNK);

    // 1. The host's stop: a request for this slot arrives after two chunks.
    let asked = AtomicUsize::new(0);
    // (Asked once before anything runs, then before every chunk.)
    let c = a
        .catch_up(&|| asked.fetch_add(1, Ordering::SeqCst) >= 3)
        .unwrap();
    assert_eq!((c.rows, c.yielded), (2 * CATCH_UP_CHUNK, true), "{c:?}");
    let s = a.conversation_stats();
    assert_eq!(
        (s.caught_up_rows, s.catch_up_yields),
        (2 * CATCH_UP_CHUNK as u64, 1)
    );

    // 2. A generation on a sibling: it waits for the chunk in progress, then
    // the catch-up yields and hands the conversation over.
    let p2 = next_prompt(&p1, &g1.tokens, &[90, 91, 92]);
    let (go, started) = mpsc::channel::<()>();
    let (g2, c) = std::thread::scope(|sc| {
        let (b, p2) = (&mut b, &p2);
        let request = sc.spawn(move || {
            started.recv().unwrap();
            turn(b, p2, 8, ProposerKind::Draft)
        });
        let asked = AtomicUsize::new(0);
        let c = a
            .catch_up(&|| {
                // Before the second chunk: the request starts now, and has
                // long counted as running when this returns.
                if asked.fetch_add(1, Ordering::SeqCst) == 2 {
                    go.send(()).unwrap();
                    std::thread::sleep(Duration::from_millis(500));
                }
                false
            })
            .unwrap();
        (request.join().unwrap(), c)
    });
    assert_eq!((c.rows, c.yielded), (CATCH_UP_CHUNK, true), "{c:?}");
    // The request continued from what the two catch-ups computed, and is the
    // target's output.
    let done = 3 * CATCH_UP_CHUNK;
    assert_eq!(g2.stats.draft_reused_tokens, done, "{:?}", g2.stats);
    assert_eq!(g2.stats.draft_caught_up_tokens, done);
    assert_eq!(g2.stats.draft_prefill_tokens, p2.len() - done);
    assert_eq!(g2.tokens, target_greedy(&tmodel, &p2, 8));
    io.block_on(v.shutdown()).unwrap();
}

#[test]
fn the_catch_up_stays_within_the_budget_and_can_be_turned_off() {
    let dir = tempfile::tempdir().unwrap();
    let (target, draft) = tiny_models(dir.path());
    let io = io_runtime();
    let v = start_tiny_verifier(&io, &target, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    let p1: Vec<u32> = (0..40).map(|i| 3 + (i * 7) % 250).collect();

    let mut off = tiny_edge(&draft, &url, TOKEN, |c| c.conversations.catch_up = false);
    turn(&mut off, &p1, 6, ProposerKind::Lookup);
    assert_eq!(off.catch_up(&|| false).unwrap().rows, 0);

    // A budget of 0 MiB: the lookup turn's entry holds no draft rows, so it
    // is kept, but the rows it lacks would not fit: the catch-up leaves it
    // as it is (it never grows an entry past the budget nor evicts another).
    let mut tight = tiny_edge(&draft, &url, TOKEN, |c| c.conversations.budget_mib = 0);
    turn(&mut tight, &p1, 6, ProposerKind::Lookup);
    assert_eq!(tight.catch_up(&|| false).unwrap().rows, 0);
    io.block_on(v.shutdown()).unwrap();
}
