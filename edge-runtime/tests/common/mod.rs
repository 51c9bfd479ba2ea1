//! Helpers shared by the speculation and outage tests: tiny random models, an
//! in-process verifier for them, and a delaying TCP proxy whose link can go silent.

#![allow(clippy::unwrap_used, dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tandem_model::sampling::{next_token, SamplingParams};
use tandem_model::speculative::{generate_single, GenerateConfig};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::transformer::{LoadOptions, Model};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The tokenizer fingerprint the tiny verifiers are configured with.
pub const FP: &str = "tiny-test-fingerprint";

pub fn load(p: &Path) -> Arc<Model> {
    Arc::new(Model::load(p, LoadOptions::with_max_seq_len(512)).unwrap())
}

/// The model's own greedy output for `prompt` (one token per forward).
pub fn target_greedy(model: &Model, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    target_own(model, prompt, max_tokens, SamplingParams::default())
}

/// The model's own output for `prompt` under `sampling` (one token per
/// forward): what a generation through the verifier must equal.
pub fn target_own(
    model: &Model,
    prompt: &[u32],
    max_tokens: usize,
    sampling: SamplingParams,
) -> Vec<u32> {
    let cfg = GenerateConfig {
        k: 1,
        max_tokens,
        sampling,
        ..GenerateConfig::default()
    };
    generate_single(model, prompt, &cfg, &mut |_| true)
        .unwrap()
        .tokens
}

/// Greedy prediction of `model` for every output position of `prompt + out`
/// (row i = the model's argmax for out[i] given everything before it).
pub fn greedy_predictions(model: &Model, prompt: &[u32], out: &[u32]) -> Vec<u32> {
    predictions(model, prompt, out, &SamplingParams::default())
}

/// `model`'s token under `sampling` for every output position of `prompt +
/// out` (row i: its argmax, or its keyed draw, for out[i] given everything
/// before it).
pub fn predictions(
    model: &Model,
    prompt: &[u32],
    out: &[u32],
    sampling: &SamplingParams,
) -> Vec<u32> {
    let mut all = prompt.to_vec();
    all.extend_from_slice(out);
    let mut cache = model.new_cache();
    let logits = model.forward(&all, 0, &mut cache).unwrap();
    let v = model.config().vocab;
    (0..out.len())
        .map(|i| {
            let row = prompt.len() - 1 + i;
            next_token(sampling, &logits[row * v..(row + 1) * v], &all[..=row])
        })
        .collect()
}

/// An edge runtime with `draft` talking to the tiny verifier at `url` (plain
/// HTTP on loopback) with `token`; `tweak` sets the rest of the config.
pub fn tiny_edge(
    draft: &Path,
    url: &str,
    token: &str,
    tweak: impl FnOnce(&mut tandem_edge::EdgeConfig),
) -> tandem_edge::EdgeRuntime {
    let mut cfg = tandem_edge::EdgeConfig {
        verifier_url: Some(url.into()),
        token: Some(token.into()),
        tokenizer_fingerprint: Some(FP.into()),
        connect_timeout_ms: 2000,
        ..tandem_edge::EdgeConfig::default()
    };
    tweak(&mut cfg);
    tandem_edge::EdgeRuntime::builder(load(draft), cfg)
        .build()
        .unwrap()
}

/// A small I/O runtime for the in-process verifier.
/// A JSON-object grammar over the vocabulary of a tiny model with a
/// tokenizer (written to `dir`): the structured output that the refusal tests
/// (a verifier without the `grammar` feature) ask for.
pub fn tiny_json_object_grammar(dir: &Path) -> Arc<dyn tandem_model::engine::OutputGrammar> {
    let with_tok = dir.join("tok.gguf");
    let tiny = TinyConfig {
        tokenizer: true,
        ..TinyConfig::draft_like()
    };
    write_tiny_qwen2(&with_tok, &tiny).unwrap();
    let tok = tandem_model::tokenizer::Tokenizer::from_gguf(load(&with_tok).gguf()).unwrap();
    let vocab = tandem_grammar::GrammarVocab::new(&tok).unwrap();
    tandem_grammar::Grammar::new(&vocab, tandem_grammar::GrammarSpec::JsonObject)
        .unwrap()
        .into_config()
}

/// An edge config for outage tests through [`start_switchable_proxy`] at
/// `addr`: short connect timeout and backoff, the breaker open after two
/// failures, a fast health probe.
pub fn outage_edge_config(addr: SocketAddr, token: &str) -> tandem_edge::EdgeConfig {
    tandem_edge::EdgeConfig {
        verifier_url: Some(format!("http://{addr}")),
        token: Some(token.into()),
        tokenizer_fingerprint: Some(FP.into()),
        connect_timeout_ms: 500,
        backoff_base_ms: 5,
        backoff_max_ms: 20,
        breaker_failures: 2,
        probe_interval_ms: 20,
        probe_timeout_ms: 300,
        ..tandem_edge::EdgeConfig::default()
    }
}

pub fn io_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Writes a tiny random target and a draft-like model into `dir`: (target, draft).
pub fn tiny_models(dir: &Path) -> (PathBuf, PathBuf) {
    let target = dir.join("target.gguf");
    let draft = dir.join("draft.gguf");
    write_tiny_qwen2(&target, &TinyConfig::default()).unwrap();
    write_tiny_qwen2(&draft, &TinyConfig::draft_like()).unwrap();
    (target, draft)
}

/// An in-process verifier on loopback serving `target` to one device with `token`.
pub fn start_tiny_verifier(
    rt: &tokio::runtime::Runtime,
    target: &Path,
    token: &str,
) -> tandem_verifier::RunningVerifier {
    let text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {target:?}\n\
         tokenizer_fingerprint = \"{FP}\"\nmax_seq_len = 4096\ninsecure_loopback = true\n\
         [[devices]]\nid = \"dev\"\ntoken = \"{token}\"\n"
    );
    let cfg: tandem_verifier::VerifierConfig = toml::from_str(&text).unwrap();
    rt.block_on(tandem_verifier::start(cfg)).unwrap()
}

/// A TCP proxy that delays every chunk by `delay` in each direction.
pub fn start_delay_proxy(
    rt: &tokio::runtime::Runtime,
    upstream: SocketAddr,
    delay: Duration,
) -> SocketAddr {
    start_switchable_proxy(rt, upstream, delay).0
}

/// Like [`start_delay_proxy`], plus a switch: while it is true the link is
/// **silent** — connections are still accepted, every byte (both directions, on
/// old and new connections) is read and dropped, nothing is refused or reset.
/// A connection accepted while silent stays a black hole after the link is back;
/// connections opened afterwards are proxied again.
pub fn start_switchable_proxy(
    rt: &tokio::runtime::Runtime,
    upstream: SocketAddr,
    delay: Duration,
) -> (SocketAddr, Arc<AtomicBool>) {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let silent = Arc::new(AtomicBool::new(false));
    let s = silent.clone();
    rt.spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            if s.load(Ordering::SeqCst) {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    while matches!(client.read(&mut buf).await, Ok(n) if n > 0) {}
                });
                continue;
            }
            let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                continue;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::spawn(pump(cr, sw, delay, s.clone()));
            tokio::spawn(pump(sr, cw, delay, s.clone()));
        }
    });
    (addr, silent)
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
    silent: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if silent.load(Ordering::SeqCst) {
            continue;
        }
        tokio::time::sleep(delay).await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A fake verifier service `v` on a loopback port, served by its own
/// one-thread runtime (dropping it stops the server): (runtime, its URL).
pub fn serve_fake<V: tandem_proto::v1::verifier_server::Verifier>(
    v: V,
) -> (tokio::runtime::Runtime, String) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(tandem_proto::v1::verifier_server::VerifierServer::new(v))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (rt, format!("http://{addr}"))
}
