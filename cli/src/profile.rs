//! `tandem profile`: measures a model's per-layer costs on this machine and writes
//! the shard planner's profile JSON (schema `tandem.profile.v1`, see
//! docs/shard-planner.md): per layer (embedding, each block, final norm + head)
//! the weight bytes, KV bytes per token, activation bytes per token crossing a
//! cut, and the median compute time for each block size at a context length.
//!
//! How: a KV cache is prefilled with `--context` tokens; then, per block size,
//! `--warmup` passes and `--repeats` timed passes each run the embedding, every
//! block on its own (`forward_layers(l..l+1)`, appending at the context position,
//! rolled back after the pass) and the head over the block's rows; the median of
//! the timed passes is kept per layer, then all layers are scaled by one factor so
//! that they add up to the median time of a whole pass. Why: a layer takes ~8 ms,
//! shorter than a scheduler time slice, so on a busy core the per-layer medians
//! pick the passes that were not preempted and their sum undercounts what a whole
//! forward costs there (on a quiet core the factor is ~1).

use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;
use tandem_cli_common::models::{load_model, resolve_model};
use tandem_fetch::ModelRole;
use tandem_model::transformer::Model;
use tandem_shard::profile::{LayerKind, LayerProfile};
use tandem_shard::ModelProfile;

#[derive(Clone, Copy, clap::ValueEnum)]
enum RoleArg {
    Draft,
    Target,
}

#[derive(clap::Args)]
pub struct Args {
    /// Which model to profile (the fetched file; see `tandem models path`).
    #[arg(long, value_enum, default_value = "target")]
    model: RoleArg,
    /// Profile this GGUF file instead of the fetched model.
    #[arg(long)]
    model_path: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Where to write the profile JSON.
    #[arg(long)]
    out: PathBuf,
    /// Tokens already in the KV cache while timing.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Block sizes to time (1 = decoding, k + 1 = verifying k drafts).
    #[arg(long, value_delimiter = ',', default_value = "1,5,9,17")]
    blocks: Vec<u32>,
    /// Timed passes per block size (the median is kept).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Untimed passes first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
}

fn role(r: RoleArg) -> ModelRole {
    match r {
        RoleArg::Draft => ModelRole::Draft,
        RoleArg::Target => ModelRole::Target,
    }
}

/// Weight bytes: (embedding, per block, head).
fn weight_bytes(m: &Model) -> (u64, Vec<u64>, u64) {
    let t = &m.gguf().tensors;
    let size = |name: &str| t.get(name).map_or(0, |e| e.len as u64);
    let n = m.config().n_layer;
    let mut blocks = vec![0u64; n];
    for (name, e) in t {
        if let Some(rest) = name.strip_prefix("blk.") {
            if let Some(i) = rest.split('.').next().and_then(|i| i.parse::<usize>().ok()) {
                if i < n {
                    blocks[i] += e.len as u64;
                }
            }
        }
    }
    let embd = size("token_embd.weight");
    // Tied embeddings: the head needs the same table.
    let out = if t.contains_key("output.weight") {
        size("output.weight")
    } else {
        embd
    };
    (embd, blocks, out + size("output_norm.weight"))
}

/// Seconds per layer (embedding, blocks, head) of one pass over `k` tokens at
/// position `ctx`; the cache is rolled back to `ctx` afterwards.
fn one_pass(
    m: &Model,
    cache: &mut tandem_model::kv_cache::KvCache,
    tokens: &[u32],
    ctx: usize,
) -> Result<Vec<f64>> {
    let n = m.config().n_layer;
    let mut out = Vec::with_capacity(n + 2);
    let t = Instant::now();
    let mut h = m.embed(tokens)?;
    out.push(t.elapsed().as_secs_f64());
    for l in 0..n {
        let t = Instant::now();
        m.forward_layers(l..l + 1, &mut h, ctx, cache)?;
        out.push(t.elapsed().as_secs_f64());
    }
    let t = Instant::now();
    let logits = m.head(&h);
    out.push(t.elapsed().as_secs_f64());
    std::hint::black_box(logits);
    cache.truncate(ctx);
    Ok(out)
}

pub fn run(args: Args) -> Result<()> {
    anyhow::ensure!(args.repeats >= 1, "--repeats must be at least 1");
    anyhow::ensure!(args.context >= 1, "--context must be at least 1");
    anyhow::ensure!(
        !args.blocks.is_empty() && args.blocks.iter().all(|b| *b >= 1 && *b <= 64),
        "--blocks must be sizes in 1..=64"
    );
    let path = resolve_model(role(args.model), args.model_path.as_ref())?;
    let max_block = args.blocks.iter().copied().max().unwrap_or(1) as usize;
    let loaded = load_model(role(args.model), Some(&path), args.context + max_block + 1)?;
    let m = loaded.model;
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    anyhow::ensure!(threads >= 1, "--threads must be at least 1");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("building the thread pool")?;
    let cfg = m.config().clone();
    let vocab = cfg.vocab as u32;
    // Deterministic, in-vocabulary filler tokens (content does not change cost).
    let filler = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed)) % vocab.min(30_000))
            .collect()
    };
    let n = cfg.n_layer;
    let mut times: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    pool.install(|| -> Result<()> {
        let mut cache = m.new_cache();
        let prompt = filler(args.context, 7);
        let mut h = m.embed(&prompt)?;
        m.forward_layers(0..n, &mut h, 0, &mut cache)?;
        for &k in &args.blocks {
            let tokens = filler(k as usize, 11 + k);
            for _ in 0..args.warmup {
                one_pass(&m, &mut cache, &tokens, args.context)?;
            }
            let mut samples: Vec<Vec<f64>> = vec![Vec::new(); n + 2];
            let mut passes = Vec::with_capacity(args.repeats);
            for _ in 0..args.repeats {
                let p = one_pass(&m, &mut cache, &tokens, args.context)?;
                passes.push(p.iter().sum::<f64>());
                for (s, t) in samples.iter_mut().zip(p) {
                    s.push(t);
                }
            }
            // Never empty: --repeats is at least 1.
            let median = |xs: &[f64]| tandem_stats::median(xs).unwrap_or(0.0);
            let per_layer: Vec<f64> = samples.iter().map(|s| median(s)).collect();
            let sum: f64 = per_layer.iter().sum();
            let pass = median(&passes);
            let scale = if sum > 0.0 { pass / sum } else { 1.0 };
            times.insert(k, per_layer.iter().map(|t| t * scale).collect());
            eprintln!(
                "block {k:>2}: {:.3} ms per forward (median pass; per-layer medians sum to {:.3} ms, scaled x{scale:.3})",
                pass * 1e3,
                sum * 1e3
            );
        }
        Ok(())
    })?;
    let (embd_w, block_w, head_w) = weight_bytes(&m);
    let act = (cfg.d_model * 4) as u64;
    let kv = (2 * cfg.n_kv_head * cfg.head_dim * 4) as u64;
    let at = |i: usize| -> BTreeMap<u32, f64> { times.iter().map(|(k, v)| (*k, v[i])).collect() };
    let mut layers = Vec::with_capacity(n + 2);
    layers.push(LayerProfile {
        name: "embedding".into(),
        kind: LayerKind::Embedding,
        weight_bytes: embd_w,
        kv_bytes_per_token: 0,
        activation_bytes_per_token: act,
        compute_seconds: at(0),
    });
    for (l, w) in block_w.iter().enumerate() {
        layers.push(LayerProfile {
            name: format!("blk.{l}"),
            kind: LayerKind::Block,
            weight_bytes: *w,
            kv_bytes_per_token: kv,
            activation_bytes_per_token: act,
            compute_seconds: at(l + 1),
        });
    }
    layers.push(LayerProfile {
        name: "head".into(),
        kind: LayerKind::Head,
        weight_bytes: head_w,
        kv_bytes_per_token: 0,
        // What returns to the device when the head is elsewhere: the verdict,
        // about one token id per position.
        activation_bytes_per_token: 4,
        compute_seconds: at(n + 1),
    });
    let model_name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let profile = ModelProfile {
        schema: ModelProfile::SCHEMA.into(),
        model: model_name,
        measured: true,
        note: format!(
            "tandem profile: median of {} passes after {} warm-up; each block timed alone \
             (forward_layers(l..l+1)) at context {}, per-layer medians scaled to sum to the \
             median pass; f32 hidden states cross a cut \
             (d_model x 4 bytes per token); the head returns ~4 bytes per token (the verdict)",
            args.repeats, args.warmup, args.context
        ),
        machine: tandem_cli_common::host::cpu_name().unwrap_or_default(),
        threads: Some(threads as u32),
        context_tokens: args.context as u64,
        block_sizes: args.blocks.clone(),
        layers,
    };
    profile.validate()?;
    let text = serde_json::to_string_pretty(&profile)?;
    std::fs::write(&args.out, text + "\n")
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!(
        "wrote {} ({} layers, blocks {:?}, context {}, {} threads)",
        args.out.display(),
        n + 2,
        args.blocks,
        args.context,
        threads
    );
    Ok(())
}
