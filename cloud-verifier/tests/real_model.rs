//! A few verify rounds on the real target model. Fails (does not skip) when the model
//! has not been fetched: run `tandem models fetch` first.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

mod common;

use common::*;
use tandem_fetch::{model_path, ModelRole};
use tandem_model::tokenizer::Tokenizer;
use tandem_model::transformer::{LoadOptions, Model};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_target_verifies_a_few_rounds() {
    let path = model_path(ModelRole::Target);
    assert!(
        path.exists(),
        "the real target model is missing at {}: run `tandem models fetch` first",
        path.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let toml = config_toml(&path, "", "insecure_loopback = true")
        .replace("model_id = \"tiny-target\"", "model_id = \"qwen\"");
    let v = tandem_verifier::start(parse(dir.path(), &toml))
        .await
        .unwrap();
    let target = Model::load(&path, LoadOptions::with_max_seq_len(512)).unwrap();
    let tok = Tokenizer::from_gguf(target.gguf()).unwrap();
    let p = tok.encode("fn fibonacci(n: u64) -> u64 {", false).unwrap();
    let want = target_greedy(&target, &p, 8);
    let mut c = client(&v).await;
    let mut s = connect(&mut c, Some(TOKEN_A)).await.unwrap();
    let mut o = open_msg(&tok.fingerprint(), &p);
    o.model_id = "qwen".into();
    s.open(o).await.unwrap();
    // Round 0: a perfect block of 3.
    let r0 = s.draft(0, &want[..3]).await.unwrap();
    assert_eq!((r0.accepted, r0.next_token), (3, want[3]));
    // Round 1: one right, one wrong token.
    let wrong = (want[5] + 1) % 151_000;
    let r1 = s.draft(1, &[want[4], wrong]).await.unwrap();
    assert_eq!((r1.accepted, r1.next_token), (1, want[5]));
    // Round 2: empty block.
    let r2 = s.draft(2, &[]).await.unwrap();
    assert_eq!(r2.next_token, want[6]);
    v.shutdown().await.unwrap();
}
