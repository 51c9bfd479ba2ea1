//! The second opinion's KV reused by the local generation (issue 32, item 4),
//! as an app meets it through `RoutedRuntime::turn`: when the rules are
//! unsure and the draft judged the text, a turn decided local starts from the
//! draft KV of the classification prompt (the template's system turn and the
//! text) instead of prefilling it again. Tiny random-weight models, no
//! verifier (a speculative turn then runs on the device too, so a KV offered
//! by mistake would show in its stats).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::Path;
use std::sync::Arc;

use tandem_edge::{DraftOpinion, EdgeConfig, EdgeRuntime, RoutedRuntime, RoutedTurn, Turn};
use tandem_model::gguf::GgufFile;
use tandem_model::speculative::GenerateConfig;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::transformer::{LoadOptions, Model};
use tandem_router::{Action, Router};

/// A category term without a disclosure cue: the rules keep it local but are
/// unsure, so the `categories` mode asks the second opinion.
const UNSURE: &str = "metformin dosing";

struct Fixture {
    _dir: tempfile::TempDir,
    draft: Arc<Model>,
    tok: Tokenizer,
    router: Arc<Router>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("draft.gguf");
    let cfg = TinyConfig {
        tokenizer: true,
        ..TinyConfig::draft_like()
    };
    write_tiny_qwen2(&path, &cfg).unwrap();
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let draft = Arc::new(Model::load(&path, LoadOptions::with_max_seq_len(2048)).unwrap());
    Fixture {
        _dir: dir,
        draft,
        tok,
        router: router_with_opinion("categories"),
    }
}

fn router_with_opinion(mode: &str) -> Arc<Router> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/policy.example.toml");
    let src = std::fs::read_to_string(path).unwrap();
    let src = src.replace("mode = \"off\"", &format!("mode = \"{mode}\""));
    Arc::new(Router::from_toml_str(&src).unwrap())
}

impl Fixture {
    /// A routed runtime without a verifier whose second opinion is the
    /// draft answering `sensitive` (or `benign`) whatever its margin, or
    /// none at all.
    fn routed(&self, opinion: Option<bool>) -> RoutedRuntime {
        let mut rt = EdgeRuntime::builder(self.draft.clone(), EdgeConfig::default())
            .router(self.router.clone(), self.tok.clone())
            .build()
            .unwrap();
        let opinion = opinion.map(|sensitive| {
            // `Sensitive` when the margin is above the threshold.
            let threshold = if sensitive {
                f32::NEG_INFINITY
            } else {
                f32::INFINITY
            };
            let o = DraftOpinion::new(self.draft.clone(), self.tok.clone())
                .unwrap()
                .with_threshold(threshold);
            Arc::new(o) as Arc<dyn tandem_router::SecondOpinion>
        });
        rt.set_second_opinion(opinion);
        rt
    }

    fn prompt(&self, messages: &[ChatMessage]) -> Vec<u32> {
        self.tok.encode_chat(messages, true).unwrap()
    }

    /// The generation prompt's positions the second opinion's prompt for
    /// `text` holds (what a reuse must skip: all but the prompt's last).
    fn shared_with_judge(&self, text: &str, prompt: &[u32]) -> usize {
        let judge = DraftOpinion::new(self.draft.clone(), self.tok.clone())
            .unwrap()
            .prompt(text)
            .unwrap();
        let shared = judge.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        shared.min(prompt.len() - 1)
    }
}

fn gen() -> GenerateConfig {
    GenerateConfig {
        max_tokens: 12,
        ..GenerateConfig::default()
    }
}

fn run(rt: &mut RoutedRuntime, turn: Turn<'_>) -> RoutedTurn {
    rt.turn(turn, &mut |_| true, &mut |_| true)
        .unwrap()
        .unwrap()
}

/// Decided local after the draft judged the text: the generation skips the
/// prompt prefix the judgement computed and emits exactly the tokens of a
/// runtime that prefilled the whole prompt.
#[test]
fn a_local_turn_reuses_the_judged_prompt_and_emits_the_same_tokens() {
    let f = fixture();
    let messages = [ChatMessage::user(UNSURE)];
    let prompt = f.prompt(&messages);
    let gen = gen();
    let shared = f.shared_with_judge(UNSURE, &prompt);
    assert!(shared > 0);

    let mut reusing = f.routed(Some(true));
    let t = run(&mut reusing, Turn::new("c1", &messages, &prompt, &gen));
    let route = t.route.unwrap();
    // The rules' own local decision, which the opinion confirmed.
    assert_eq!(route.action(), Action::Local);
    assert_ne!(route.decision.rule, "second-opinion");
    let s = &t.generation.stats;
    assert_eq!(s.draft_reused_tokens, shared);
    assert_eq!(s.draft_prefill_tokens, prompt.len() - shared);

    // The rules alone decide the same, and nothing was judged to reuse.
    let mut fresh = f.routed(None);
    let u = run(&mut fresh, Turn::new("c1", &messages, &prompt, &gen));
    assert_eq!(u.route.unwrap().action(), Action::Local);
    assert_eq!(u.generation.stats.draft_reused_tokens, 0);
    assert_eq!(u.generation.stats.draft_prefill_tokens, prompt.len());
    assert_eq!(t.generation.tokens.len(), gen.max_tokens);
    assert_eq!(t.generation.tokens, u.generation.tokens);
    // And the runtime's plain local generation (no router) agrees.
    let mut plain = EdgeRuntime::builder(f.draft.clone(), EdgeConfig::default())
        .build()
        .unwrap();
    let p = plain.generate_local(&prompt, &gen, &mut |_| true).unwrap();
    assert_eq!(p.tokens, t.generation.tokens);
}

/// Judged benign, the turn runs speculative: the judged KV is dropped, not
/// offered (without a verifier the speculative turn runs on the device, so
/// an offered KV would have been reused).
#[test]
fn a_turn_decided_speculative_is_offered_nothing() {
    let f = fixture();
    let messages = [ChatMessage::user(UNSURE)];
    let prompt = f.prompt(&messages);
    let gen = gen();
    let mut rt = f.routed(Some(false));
    let t = run(&mut rt, Turn::new("c1", &messages, &prompt, &gen));
    let route = t.route.unwrap();
    assert_eq!(
        (route.action(), route.decision.rule.as_str()),
        (Action::Speculative, "second-opinion")
    );
    assert_eq!(t.generation.stats.draft_reused_tokens, 0);
    assert_eq!(rt.runtime().conversation_stats().hits, 0);
}

/// A named conversation takes the judged KV on its first turn only: on the
/// next turn its own kept state (the whole earlier context) is continued and
/// a judgement of the new message does not replace it.
#[test]
fn a_named_conversation_keeps_its_own_state_after_the_first_turn() {
    let f = fixture();
    let gen = gen();
    let mut rt = f.routed(Some(true));
    let first = [ChatMessage::user(UNSURE)];
    let prompt = f.prompt(&first);
    let t = run(&mut rt, Turn::new("c1", &first, &prompt, &gen));
    assert_eq!(
        t.generation.stats.draft_reused_tokens,
        f.shared_with_judge(UNSURE, &prompt)
    );
    let answer = f.tok.decode(&t.generation.tokens, true).unwrap();
    let second = [
        ChatMessage::user(UNSURE),
        ChatMessage::assistant(answer),
        // Judged too (a category without a cue): its KV shares only the
        // system turn with this prompt.
        ChatMessage::user("ibuprofen dosing"),
    ];
    let prompt2 = f.prompt(&second);
    let t2 = run(&mut rt, Turn::new("c1", &second, &prompt2, &gen));
    assert_eq!(t2.route.unwrap().action(), Action::Local);
    // More than either judged prompt shares with it: the first turn's state.
    let reused = t2.generation.stats.draft_reused_tokens;
    assert!(reused >= prompt.len() - 1, "{reused} of {}", prompt.len());
    assert!(reused > f.shared_with_judge("ibuprofen dosing", &prompt2));
    // Same tokens as a fresh runtime prefilling the whole second prompt.
    let mut fresh = f.routed(None);
    let u = run(&mut fresh, Turn::new("c1", &second, &prompt2, &gen));
    assert_eq!(u.generation.stats.draft_reused_tokens, 0);
    assert_eq!(u.generation.tokens, t2.generation.tokens);
}

/// An anonymous request (state found by its prompt within its client scope)
/// reuses the judged KV too; a request whose client has no scope keeps no
/// state, so nothing is offered; a scope's matching entry is continued, not
/// replaced.
#[test]
fn anonymous_requests_reuse_it_within_their_scope_only() {
    let f = fixture();
    let gen = gen();
    let messages = [ChatMessage::user(UNSURE)];
    let prompt = f.prompt(&messages);
    let shared = f.shared_with_judge(UNSURE, &prompt);
    let anonymous = |scope: Option<&str>| Turn {
        state: None,
        ephemeral: true,
        anonymous_scope: scope.map(str::to_string),
        ..Turn::new("anon-1", &messages, &prompt, &gen)
    };

    let mut rt = f.routed(Some(true));
    let t = run(&mut rt, anonymous(Some("app")));
    assert_eq!(t.route.unwrap().action(), Action::Local);
    assert_eq!(t.generation.stats.draft_reused_tokens, shared);
    let reference = t.generation.tokens;

    // No scope: nothing kept, nothing offered (a fresh runtime, so the
    // opinion's memo does not skip the judgement).
    let mut rt = f.routed(Some(true));
    let t = run(&mut rt, anonymous(None));
    assert_eq!(t.generation.stats.draft_reused_tokens, 0);
    assert_eq!(rt.runtime().conversation_stats().entries, 0);
    assert_eq!(t.generation.tokens, reference);

    // A scope whose kept state continues the prompt: that state is taken
    // (the earlier request's whole context), the judged KV is not offered.
    let mut rt = f.routed(Some(true));
    run(&mut rt, anonymous(Some("app")));
    // A different text in a new runtime's opinion memo would be judged
    // again; the same text is remembered, so force a judgement with a
    // fresh opinion on the same runtime.
    let again = DraftOpinion::new(f.draft.clone(), f.tok.clone())
        .unwrap()
        .with_threshold(f32::NEG_INFINITY);
    rt.set_second_opinion(Some(Arc::new(again)));
    let t = run(&mut rt, anonymous(Some("app")));
    assert_eq!(t.generation.stats.draft_reused_tokens, prompt.len() - 1);
    assert_eq!(t.generation.tokens, reference);
    assert_eq!(rt.runtime().conversation_stats().entries, 1);
}
