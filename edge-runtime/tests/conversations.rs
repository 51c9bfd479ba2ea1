//! Multi-turn conversations (issue 18): the device's prefix cache (hit, miss,
//! an edited earlier turn, the byte budget), the verifier's kept session
//! continued with only the new tokens (and after an eviction), the context
//! policy, and the invariant through all of it: every turn's greedy output is
//! the target's own greedy output for that turn's whole context.

#![allow(clippy::unwrap_used)]
mod common;
use common::{io_runtime, load, start_tiny_verifier, target_greedy, tiny_edge, tiny_models};
use tandem_edge::context_policy::{
    drop_oldest, fit_messages, fit_messages_cancellable, ContextError, ContextPolicy,
};
use tandem_edge::{EdgeConfig, EdgeGeneration, EdgeRuntime};
use tandem_model::kv_cache::KvPrecision;
use tandem_model::speculative::GenerateConfig;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};

const TOKEN: &str = "conversation-test-token-0123456789";

fn gen(max_tokens: usize) -> GenerateConfig {
    GenerateConfig {
        max_tokens,
        k: 4,
        ..GenerateConfig::default()
    }
}

fn turn(
    rt: &mut EdgeRuntime,
    name: Option<&str>,
    prompt: &[u32],
    max_tokens: usize,
) -> EdgeGeneration {
    rt.generate_in(name, prompt, &gen(max_tokens), &mut |_| true)
        .unwrap()
}

/// [`turn`] with the draft's KV in f32 (sizes the budget test in f32 bytes).
fn turn_f32(
    rt: &mut EdgeRuntime,
    name: Option<&str>,
    prompt: &[u32],
    max_tokens: usize,
) -> EdgeGeneration {
    let cfg = GenerateConfig {
        draft_kv: KvPrecision::F32,
        ..gen(max_tokens)
    };
    rt.generate_in(name, prompt, &cfg, &mut |_| true).unwrap()
}

/// `prev` context + the reply + a new user message.
fn next_prompt(prev: &[u32], reply: &[u32], new: &[u32]) -> Vec<u32> {
    let mut p = prev.to_vec();
    p.extend_from_slice(reply);
    p.extend_from_slice(new);
    p
}

#[test]
fn the_device_reuses_exactly_the_common_prefix_of_a_conversation() {
    let dir = tempfile::tempdir().unwrap();
    let (_target, draft) = tiny_models(dir.path());
    // No verifier: the draft answers alone (the offline app); its output with
    // a reused prefix must equal a fresh runtime's, bit for bit.
    let mut rt = EdgeRuntime::builder(load(&draft), EdgeConfig::default())
        .build()
        .unwrap();
    let mut fresh_cfg = EdgeConfig::default();
    fresh_cfg.conversations.enabled = false;
    let mut fresh = EdgeRuntime::builder(load(&draft), fresh_cfg)
        .build()
        .unwrap();

    let p1: Vec<u32> = vec![5, 17, 42, 99, 3, 250, 7];
    let g1 = turn(&mut rt, None, &p1, 6);
    assert_eq!(g1.stats.draft_reused_tokens, 0);
    assert_eq!(g1.stats.draft_prefill_tokens, p1.len());

    // Turn 2 continues turn 1 (anonymous: found by its prefix).
    let p2 = next_prompt(&p1, &g1.tokens, &[11, 12, 13]);
    let g2 = turn(&mut rt, None, &p2, 6);
    // The draft holds the context but its last token (run with the next
    // turn's new tokens).
    let shared = p1.len() + g1.tokens.len() - 1;
    assert_eq!(g2.stats.draft_reused_tokens, shared);
    assert_eq!(g2.stats.draft_prefill_tokens, p2.len() - shared);
    let f2 = turn(&mut fresh, None, &p2, 6);
    assert_eq!(g2.tokens, f2.tokens, "a reused prefix changed the output");
    assert_eq!(f2.stats.draft_reused_tokens, 0);

    // Turn 3 edits turn 2's message: it misses exactly from the edit.
    let mut p3 = next_prompt(&p2, &g2.tokens, &[21, 22]);
    let edit = p2.len() - 2;
    p3[edit] = 100;
    let g3 = turn(&mut rt, None, &p3, 6);
    assert_eq!(g3.stats.draft_reused_tokens, edit);
    assert_eq!(g3.tokens, turn(&mut fresh, None, &p3, 6).tokens);
    // A named conversation is its own whatever changed: an edit at position 3
    // reuses exactly 3 positions.
    let n1 = turn(&mut rt, Some("named"), &p3, 4);
    let mut n2 = next_prompt(&p3, &n1.tokens, &[30]);
    n2[3] = 101;
    let g = turn(&mut rt, Some("named"), &n2, 4);
    assert_eq!(g.stats.draft_reused_tokens, 3);
    assert_eq!(g.tokens, turn(&mut fresh, None, &n2, 4).tokens);

    // An unrelated prompt misses (and does not take another's state).
    let g4 = turn(&mut rt, None, &[200, 201, 202, 203], 4);
    assert_eq!(g4.stats.draft_reused_tokens, 0);
    let s = rt.conversation_stats();
    assert_eq!((s.hits, s.misses), (3, 3));
    assert!(s.bytes > 0);
}

#[test]
fn named_conversations_and_the_byte_budget() {
    let dir = tempfile::tempdir().unwrap();
    let (_target, draft) = tiny_models(dir.path());
    let model = load(&draft);
    let per_token = model.new_cache().bytes_per_token() as u64;
    let mut cfg = EdgeConfig::default();
    // Room for ~1.5 conversations of ~20 positions (the budget is in MiB;
    // the tiny draft's positions are small, so scale the conversation up).
    let positions_per_mib = (1u64 << 20) / per_token;
    cfg.conversations.budget_mib = 1;
    let mut rt = EdgeRuntime::builder(model, cfg).build().unwrap();
    let len = usize::try_from(positions_per_mib * 6 / 10)
        .unwrap()
        .min(400);
    assert!(
        len > 20,
        "tiny positions are too big for this test: {per_token} B"
    );
    let a: Vec<u32> = (0..len as u32).map(|i| 5 + i % 200).collect();
    let b: Vec<u32> = (0..len as u32).map(|i| 7 + (i * 3) % 200).collect();
    let ga = turn_f32(&mut rt, Some("a"), &a, 2);
    // A refused request (longer than the context) loses nothing: the
    // conversation's state is still there for its next turn.
    let too_long = vec![5u32; 600];
    let e = rt.generate_in(Some("a"), &too_long, &gen(2), &mut |_| true);
    assert!(matches!(
        e,
        Err(tandem_edge::EdgeError::Model(
            tandem_model::ModelError::SequenceTooLong { .. }
        ))
    ));
    // A named conversation is taken by its name even with another prompt.
    let a2 = next_prompt(&a, &ga.tokens, &[9]);
    assert!(
        turn_f32(&mut rt, Some("a"), &a2, 2)
            .stats
            .draft_reused_tokens
            > len
    );
    assert_eq!(rt.conversation_stats().entries, 1);
    // "b" does not fit next to "a": the least recently used ("a") goes.
    turn_f32(&mut rt, Some("b"), &b, 2);
    let s = rt.conversation_stats();
    assert_eq!((s.entries, s.evictions), (1, 1));
    assert!(s.bytes <= 1 << 20);
    let a3 = next_prompt(&a2, &[], &[10]);
    assert_eq!(
        turn_f32(&mut rt, Some("a"), &a3, 2)
            .stats
            .draft_reused_tokens,
        0
    );
    assert!(rt.forget_conversation("a"));
}

#[test]
fn the_verifier_continues_a_kept_session_with_only_the_new_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let (target, draft) = tiny_models(dir.path());
    let io = io_runtime();
    let v = start_tiny_verifier(&io, &target, TOKEN);
    let url = format!("http://{}", v.grpc_addr);
    let mut rt = tiny_edge(&draft, &url, TOKEN, |_| {});
    let mut cold = tiny_edge(&draft, &url, TOKEN, |c| c.conversations.enabled = false);
    let tmodel = load(&target);

    let mut prompt: Vec<u32> = (0..200).map(|i| 3 + (i * 7) % 250).collect();
    let mut last_sent = 0;
    for t in 0..4u32 {
        let g = turn(&mut rt, Some("chat"), &prompt, 8);
        assert_eq!(
            g.tokens,
            target_greedy(&tmodel, &prompt, 8),
            "turn {t}: not the target's greedy output"
        );
        if t == 0 {
            // The draft's whole backlog (all but the prompt's last token,
            // which its first step runs) was prefilled while the verifier
            // prefilled the Open.
            assert_eq!(
                g.stats.draft_rows_beside_open,
                prompt.len() as u64 - 1,
                "{:?}",
                g.stats
            );
        }
        if t == 3 {
            // After the eviction: refused (CONTEXT_NOT_HELD), resent whole.
            assert!(!g.stats.continued_session, "turn {t}: {:?}", g.stats);
            assert_eq!(g.stats.resends, 1, "turn {t}: {:?}", g.stats);
            assert_eq!(g.stats.verifier_prefill_tokens, prompt.len() as u64 - 1);
        } else if t > 0 {
            assert!(g.stats.continued_session, "turn {t}: {:?}", g.stats);
            assert!(
                g.stats.verifier_reused_tokens > 40,
                "turn {t}: {:?}",
                g.stats
            );
            // Only the new tokens went up: less than the cold run sends.
            let c = cold.generate(&prompt, &gen(8), &mut |_| true).unwrap();
            assert_eq!(c.tokens, g.tokens);
            assert!(!c.stats.continued_session);
            assert!(
                g.stats.bytes_sent < c.stats.bytes_sent,
                "turn {t}: kept {} B vs cold {} B",
                g.stats.bytes_sent,
                c.stats.bytes_sent
            );
            assert!(g.stats.verifier_prefill_tokens < c.stats.verifier_prefill_tokens);
            last_sent = g.stats.bytes_sent;
        }
        if t == 2 {
            // The verifier evicts every idle session between turns 2 and 3:
            // the continuation is refused (CONTEXT_NOT_HELD) and the device
            // resends the whole context.
            let id = g.session_id.clone().unwrap();
            assert!(v.state.store().evict(&id), "the kept session was not held");
        }
        prompt = next_prompt(&prompt, &g.tokens, &[60 + t, 61, 62, 63, 64, 65]);
    }
    assert!(last_sent > 0);
    // And the session opened by the resend is kept and continued again.
    let g = turn(&mut rt, Some("chat"), &prompt, 8);
    assert_eq!(g.tokens, target_greedy(&tmodel, &prompt, 8));
    assert!(g.stats.continued_session, "{:?}", g.stats);
    io.block_on(v.shutdown()).unwrap();
}

fn tiny_tokenizer(dir: &std::path::Path) -> Tokenizer {
    let path = dir.join("with-tokenizer.gguf");
    let cfg = TinyConfig {
        tokenizer: true,
        ..TinyConfig::draft_like()
    };
    write_tiny_qwen2(&path, &cfg).unwrap();
    Tokenizer::from_gguf(load(&path).gguf()).unwrap()
}

#[test]
fn the_context_policy_refuses_or_drops_the_oldest_turns_never_silently() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tiny_tokenizer(dir.path());
    let long = "abcdefghij ".repeat(8);
    let mut msgs = vec![ChatMessage::system("be brief")];
    for i in 0..6 {
        msgs.push(ChatMessage::user(format!("{i} {long}")));
        msgs.push(ChatMessage::assistant(format!("ok {i}")));
    }
    msgs.push(ChatMessage::user("last question"));
    let whole = tok.encode_chat(&msgs, true).unwrap().len();

    // Fits: nothing dropped, the same prompt either way.
    for p in [ContextPolicy::Refuse, ContextPolicy::DropOldest] {
        let f = fit_messages(&tok, &msgs, whole + 100, 16, p).unwrap();
        assert_eq!(f.dropped_messages, 0);
        assert_eq!(f.prompt.len(), whole);
    }
    // Refuse names the limit and the size.
    let limit = whole / 2;
    let e = fit_messages(&tok, &msgs, limit, 16, ContextPolicy::Refuse).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, ContextError::TooLong { .. }));
    assert!(
        text.contains(&limit.to_string()) && text.contains(&whole.to_string()),
        "{text}"
    );
    // Drop the oldest: the system message and the last message stay, the
    // prompt is the template over what is kept, with room for the reply.
    let f = fit_messages(&tok, &msgs, limit, 16, ContextPolicy::DropOldest).unwrap();
    assert!(f.dropped_messages > 0);
    let kept: Vec<ChatMessage> = std::iter::once(msgs[0].clone())
        .chain(msgs[1 + f.dropped_messages..].iter().cloned())
        .collect();
    assert_eq!(f.prompt, tok.encode_chat(&kept, true).unwrap());
    // A caller keeping the history drops the same messages.
    let mut history = msgs.clone();
    drop_oldest(&mut history, f.dropped_messages);
    assert_eq!(history, kept);
    assert!(f.prompt.len() + 16 <= limit);
    // Not even the system prompt and the last message fit: refused.
    let e = fit_messages(&tok, &msgs, 8, 4, ContextPolicy::DropOldest).unwrap_err();
    assert!(e.to_string().contains("do not fit"), "{e}");
}

#[test]
fn drop_oldest_finds_the_fewest_drops_in_a_logarithmic_number_of_renders_and_can_be_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let tok = tiny_tokenizer(dir.path());
    let mut msgs = vec![ChatMessage::system("be brief")];
    for i in 0..300 {
        // Messages of different sizes, so that the drop count matters.
        msgs.push(ChatMessage::user("x".repeat(1 + i % 7)));
    }
    let n = msgs.len();
    let whole = tok.encode_chat(&msgs, true).unwrap().len();
    let kept = |d: usize| -> Vec<ChatMessage> {
        std::iter::once(msgs[0].clone())
            .chain(msgs[1 + d..].iter().cloned())
            .collect()
    };
    for limit in [whole / 8, whole / 3, whole / 2, whole - 1] {
        let renders = std::cell::Cell::new(0usize);
        let count = || {
            renders.set(renders.get() + 1);
            false
        };
        let f = fit_messages_cancellable(&tok, &msgs, limit, 16, ContextPolicy::DropOldest, &count)
            .unwrap();
        // The reference: drop one at a time until the prompt leaves room.
        let room = 16usize.min(limit / 4);
        let fewest = (0..n - 1)
            .find(|&d| tok.encode_chat(&kept(d), true).unwrap().len() + room <= limit)
            .unwrap();
        assert_eq!(f.dropped_messages, fewest, "limit {limit}");
        assert_eq!(f.prompt, tok.encode_chat(&kept(fewest), true).unwrap());
        // One render per message dropped made 60,000 messages a quadratic
        // wedge; bisection needs about log2(n) (+2: the whole history, and
        // everything dropped).
        let bound = (usize::BITS - n.leading_zeros()) as usize + 2;
        assert!(
            renders.get() <= bound,
            "{} renders for {n} messages",
            renders.get()
        );
    }
    // A caller that goes away stops the fitting.
    let e = fit_messages_cancellable(
        &tok,
        &msgs,
        whole / 2,
        16,
        ContextPolicy::DropOldest,
        &|| true,
    )
    .unwrap_err();
    assert_eq!(e, ContextError::Cancelled);
}
