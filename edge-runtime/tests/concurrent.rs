//! 16 devices generate at the same time against one in-process verifier whose
//! session byte budget holds only a few sessions: sessions are evicted under
//! each other's feet, devices resend their context, and every output is still
//! the target's own greedy output (tiny random models; the real pair would take
//! minutes for 16 sessions on two cores).

#![allow(clippy::unwrap_used)]
use std::path::Path;
use std::sync::Arc;
use tandem_edge::{EdgeConfig, EdgeRuntime, TokenStatus};
use tandem_model::kv_pages::PAGE_TOKENS;
use tandem_model::speculative::{generate_single, GenerateConfig};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::transformer::{LoadOptions, Model};

const FP: &str = "tiny-test-fingerprint";
const DEVICES: usize = 16;
const MAX_TOKENS: usize = 24;

fn load(p: &Path) -> Arc<Model> {
    Arc::new(Model::load(p, LoadOptions::with_max_seq_len(512)).unwrap())
}

fn token(i: usize) -> String {
    format!("device-{i:02}-token-0123456789")
}

fn prompt(i: usize) -> Vec<u32> {
    vec![5, 17, 42, 99, 3 + i as u32, 250, 7, 11 * i as u32 % 384]
}

fn gen_cfg() -> GenerateConfig {
    GenerateConfig {
        k: 4,
        max_tokens: MAX_TOKENS,
        ..GenerateConfig::default()
    }
}

#[test]
fn sixteen_concurrent_sessions_with_a_small_budget_all_equal_target_only() {
    let dir = tempfile::tempdir().unwrap();
    let (tp, dp) = (
        dir.path().join("target.gguf"),
        dir.path().join("draft.gguf"),
    );
    write_tiny_qwen2(&tp, &TinyConfig::default()).unwrap();
    write_tiny_qwen2(&dp, &TinyConfig::draft_like()).unwrap();
    let target = load(&tp);
    let draft = load(&dp);
    // Room for about 4 of the 16 sessions: each ends at ~32 tokens and holds
    // pages for its context plus one block (max_block 16), 3 pages of 16
    // positions. (Sized for 2, the sessions evict each other so often that
    // the devices' breakers open and tokens turn provisional.)
    let page = target.new_cache().bytes_per_token() as u64 * PAGE_TOKENS as u64;
    let budget = page * 3 * 4;
    let mut devices = String::new();
    for i in 0..DEVICES {
        devices.push_str(&format!(
            "[[devices]]\nid = \"d{i}\"\ntoken = \"{}\"\n",
            token(i)
        ));
    }
    let toml_text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {tp:?}\n\
         tokenizer_fingerprint = \"{FP}\"\nmax_seq_len = 512\ninsecure_loopback = true\n\
         {devices}\n[limits]\nsession_budget_bytes = {budget}\nmax_prompt_tokens = 256\n"
    );
    let cfg: tandem_verifier::VerifierConfig = toml::from_str(&toml_text).unwrap();
    let vrt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let v = vrt.block_on(tandem_verifier::start(cfg)).unwrap();
    let url = format!("http://{}", v.grpc_addr);

    let want: Vec<Vec<u32>> = (0..DEVICES)
        .map(|i| {
            generate_single(&target, &prompt(i), &gen_cfg(), &mut |_| true)
                .unwrap()
                .tokens
        })
        .collect();
    let handles: Vec<_> = (0..DEVICES)
        .map(|i| {
            let cfg = EdgeConfig {
                verifier_url: Some(url.clone()),
                token: Some(token(i)),
                tokenizer_fingerprint: Some(FP.into()),
                // Evictions are not outages, and neither is a verifier that
                // refuses an Open while every session it holds is mid-round
                // (TOO_MANY_SESSIONS: pages are reserved before a prefill).
                // Under a loaded machine 16 devices over room for 4 see
                // hundreds of those; this test is about exact output through
                // evictions and resends, so the breaker must not open here
                // (tokens would turn provisional, which is correct but not
                // what is tested; the breaker has its own tests).
                breaker_failures: 1_000_000,
                backoff_base_ms: 5,
                backoff_max_ms: 20,
                ..EdgeConfig::default()
            };
            let draft = draft.clone();
            std::thread::spawn(move || {
                let mut edge = EdgeRuntime::builder(draft, cfg).build().unwrap();
                edge.generate(&prompt(i), &gen_cfg(), &mut |_| true)
                    .unwrap()
            })
        })
        .collect();
    let mut resends = 0;
    for (i, h) in handles.into_iter().enumerate() {
        let g = h.join().unwrap();
        assert!(
            g.statuses.iter().all(|s| *s == TokenStatus::Verified),
            "device {i}: {:?} {:?}",
            g.statuses,
            g.stats
        );
        assert_eq!(g.tokens, want[i], "device {i}");
        resends += g.stats.resends;
    }
    let evictions = v.state.store().evictions();
    assert!(evictions >= 1, "the budget must have forced evictions");
    assert!(resends >= 1, "evicted devices resent their context");
    eprintln!("{DEVICES} sessions: {evictions} evictions, {resends} resends");
    vrt.block_on(v.shutdown()).unwrap();
}
