//! `tandem_edge::assemble` as an embedder meets it: each refusal names the
//! file and the model's role, and the assembled runtime's one turn entry
//! point (`RoutedRuntime::turn`) routes, calls its started hook, generates,
//! and forgets an ephemeral id.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tandem_edge::assembly::ModelRole;
use tandem_edge::device_layers::{SplitConfig, SplitLayer};
use tandem_edge::{
    assemble, AssemblyConfig, AssemblyError, EdgeConfig, EdgeError, ModelSource, Routing, Turn,
};
use tandem_model::speculative::{GenerateConfig, StopReason};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::tokenizer::ChatMessage;
use tandem_model::transformer::{LoadOptions, Model};
use tandem_router::{Action, PolicyError};

/// A chinese resident ID number: the built-in policy keeps it local.
const ID: &str = "11010519491231002X";

fn tiny(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.gguf");
    let cfg = TinyConfig {
        tokenizer: true,
        ..TinyConfig::default()
    };
    write_tiny_qwen2(&p, &cfg).unwrap();
    p
}

fn with_split() -> EdgeConfig {
    EdgeConfig {
        verifier_url: Some("http://127.0.0.1:1".into()),
        split: Some(SplitConfig {
            layer: SplitLayer::Fixed(1),
            ..SplitConfig::default()
        }),
        ..EdgeConfig::default()
    }
}

fn refusal(cfg: AssemblyConfig) -> AssemblyError {
    match assemble(cfg) {
        Ok(_) => panic!("assembled"),
        Err(e) => e,
    }
}

#[test]
fn refusals_name_the_file_and_the_role() {
    let dir = tempfile::tempdir().unwrap();
    let draft = tiny(dir.path());

    // The draft file is not there.
    let missing = dir.path().join("no/such.gguf");
    let e = refusal(AssemblyConfig::new(missing.clone()));
    assert!(
        matches!(&e, AssemblyError::MissingModel { role: ModelRole::Draft, path } if *path == missing),
        "{e:?}"
    );
    assert!(e.to_string().contains("draft model") && e.to_string().contains("no/such.gguf"));

    // It is there but no GGUF.
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, "this is not a GGUF file").unwrap();
    let e = refusal(AssemblyConfig::new(junk));
    assert!(
        matches!(
            e,
            AssemblyError::LoadModel {
                role: ModelRole::Draft,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().starts_with("loading the draft model"), "{e}");

    // The policy: missing (an I/O error), then not a policy.
    let policy = dir.path().join("policy.toml");
    let e = refusal(AssemblyConfig {
        policy: Some(policy.clone()),
        ..AssemblyConfig::new(draft.clone())
    });
    assert!(
        matches!(&e, AssemblyError::Policy { source: PolicyError::Io { .. }, path } if *path == policy),
        "{e:?}"
    );
    std::fs::write(&policy, "default = \"speculative\"\nmin_score = \"high\"\n").unwrap();
    let e = refusal(AssemblyConfig {
        policy: Some(policy.clone()),
        ..AssemblyConfig::new(draft.clone())
    });
    let text = e.to_string();
    assert!(
        matches!(&e, AssemblyError::Policy { source, .. } if !matches!(source, PolicyError::Io { .. })),
        "{e:?}"
    );
    assert!(
        text.starts_with("privacy policy")
            && text.contains("policy.toml")
            && text.contains("min_score"),
        "{text}"
    );

    // Split execution: the target file is not there.
    let target = dir.path().join("target.gguf");
    let e = refusal(AssemblyConfig {
        split_target: Some(target.clone()),
        edge: with_split(),
        ..AssemblyConfig::new(draft.clone())
    });
    assert!(
        matches!(&e, AssemblyError::MissingModel { role: ModelRole::Target, path } if *path == target),
        "{e:?}"
    );
    assert!(e.to_string().starts_with("target model"), "{e}");

    // [split] without a target, and a target without [split]: the runtime's
    // refusal, naming the field.
    let e = refusal(AssemblyConfig {
        edge: with_split(),
        ..AssemblyConfig::new(draft.clone())
    });
    assert!(
        matches!(&e, AssemblyError::Runtime(EdgeError::Config(m)) if m.contains("split_target")),
        "{e:?}"
    );
    let e = refusal(AssemblyConfig {
        split_target: Some(draft.clone()),
        ..AssemblyConfig::new(draft.clone())
    });
    assert!(
        matches!(&e, AssemblyError::Runtime(EdgeError::Config(m)) if m.contains("no [split]")),
        "{e:?}"
    );
}

#[test]
fn an_assembly_gives_what_callers_need_and_its_turn_routes_then_generates() {
    let dir = tempfile::tempdir().unwrap();
    let draft = tiny(dir.path());
    let a = assemble(AssemblyConfig::new(draft.clone())).unwrap();
    assert_eq!(a.stop_tokens, a.tokenizer.chat_stop_tokens());
    assert!(!a.stop_tokens.is_empty());
    // No verifier: nothing can leave the device, nothing to decide.
    assert!(!a.routes);
    assert!(a.draft_load_ms > 0.0);
    let with_verifier = EdgeConfig {
        verifier_url: Some("http://127.0.0.1:1".into()),
        ..EdgeConfig::default()
    };
    let b = assemble(AssemblyConfig {
        edge: with_verifier.clone(),
        ..AssemblyConfig::new(draft.clone())
    })
    .unwrap();
    assert!(b.routes);
    let model = Arc::new(Model::load(&draft, LoadOptions::with_max_seq_len(64)).unwrap());
    let c = assemble(AssemblyConfig {
        privacy_router: false,
        edge: with_verifier,
        ..AssemblyConfig::new(ModelSource::Loaded(model))
    })
    .unwrap();
    assert!(!c.routes);
    assert_eq!(c.draft_load_ms, 0.0);

    let mut rt = a.routed;
    let messages = [ChatMessage::user(format!("my id is {ID}"))];
    let prompt = [1u32, 2, 3];
    let gen = GenerateConfig {
        max_tokens: 3,
        ..GenerateConfig::default()
    };

    // The started hook sees the decision; declining ends the turn before
    // anything is generated.
    let mut seen = None;
    let mut tokens = 0;
    let declined = rt
        .turn(
            Turn::new("c1", &messages, &prompt, &gen),
            &mut |d| {
                seen = d.map(|d| d.action());
                false
            },
            &mut |_| {
                tokens += 1;
                true
            },
        )
        .unwrap();
    assert!(declined.is_none());
    assert_eq!(seen, Some(Action::Local));
    assert_eq!(tokens, 0);
    // Its content pinned the conversation.
    assert!(rt.pinned_by("c1").is_some());

    // An ephemeral id is not remembered after its turn.
    let t = rt
        .turn(
            Turn {
                ephemeral: true,
                ..Turn::new("anon", &messages, &prompt, &gen)
            },
            &mut |_| true,
            &mut |_| true,
        )
        .unwrap()
        .unwrap();
    assert_eq!(t.route.unwrap().action(), Action::Local);
    assert_eq!(t.generation.tokens.len(), 3);
    assert_eq!(t.generation.stop, StopReason::MaxTokens);
    assert!(rt.pinned_by("anon").is_none());
    assert_eq!(rt.pinned_count(), 1);

    // Without the router: no decision, the started hook is still called.
    let mut started = false;
    let t = rt
        .turn(
            Turn {
                routing: Routing::Speculative,
                state: None,
                ..Turn::new("c2", &messages, &prompt, &gen)
            },
            &mut |d| {
                started = d.is_none();
                true
            },
            &mut |_| true,
        )
        .unwrap()
        .unwrap();
    assert!(started && t.route.is_none());
    assert_eq!(t.generation.tokens.len(), 3);
    assert!(rt.pinned_by("c2").is_none());
}
