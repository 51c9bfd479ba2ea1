//! Where one decode step of a real model spends its time.
//!
//! `cargo run --release -p tandem-model --example decode_profile -- [draft|target|FILE.gguf] [--steps N] [--ctx C] [--steps-only] [--only-k K [--pass-m K]] [--prefill]`
//!
//! Loads the model once, prefills `C` tokens (default 128), then:
//! - times `N` one-token decode steps (`forward` of 1 token, cache truncated
//!   back after each) and one forward over k = 5 and k = 9 tokens (`c(k)`);
//! - times every matmul of one step on its own (`quant::matmul` with m = 1 on
//!   the layer's weights, summed over layers) and the output head, so the
//!   remainder (attention, norms, RoPE, SiLU, embedding, allocation) is the
//!   step time minus the matmuls.
//!
//! `--prefill` times only a prefill of `C` tokens (last-only logits from
//! position 0, as `tandem bench` does).
//!
//! `--only-k K` times only a forward over K tokens (for a profiler); add
//! `--pass-m K` to compare it with the matmuls of that forward (each matrix
//! × K activation rows).
//!
//! Medians of repeated runs; threads: rayon's global pool (`RAYON_NUM_THREADS`);
//! kernel path: `TANDEM_ISA`.

use std::time::Instant;
use tandem_fetch::{model_path, ModelRole};

use tandem_model::gguf::GgufFile;
use tandem_model::quant::{self, Isa, QMatrix, QuantFormat};
use tandem_model::transformer::{LoadOptions, Model};

fn median(v: Vec<f64>) -> f64 {
    tandem_stats::median(&v).unwrap_or(f64::NAN)
}

#[path = "support/cputime.rs"]
mod cputime;
use cputime::cpu_seconds;

/// Median wall seconds of `reps` calls of `f` after one warm-up; the median
/// CPU seconds per call go to `cpu`.
fn time_cpu(reps: usize, cpu: &mut f64, mut f: impl FnMut()) -> f64 {
    f();
    let mut wall = Vec::new();
    let mut cpus = Vec::new();
    for _ in 0..reps {
        let (t, c) = (Instant::now(), cpu_seconds());
        f();
        wall.push(t.elapsed().as_secs_f64());
        cpus.push(cpu_seconds() - c);
    }
    *cpu = median(cpus);
    median(wall)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let which = args
        .iter()
        .find(|a| !a.starts_with("--") && a.parse::<usize>().is_err())
        .map(String::as_str)
        .unwrap_or("draft");
    let num = |flag: &str, default: usize| -> usize {
        args.iter()
            .position(|a| a == flag)
            .and_then(|p| args.get(p + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let steps = num("--steps", 16);
    let ctx = num("--ctx", 128);
    let path = match which {
        "draft" => model_path(ModelRole::Draft),
        "target" => model_path(ModelRole::Target),
        other if other.ends_with(".gguf") => std::path::PathBuf::from(other),
        other => return Err(format!("unknown model {other} (draft|target|FILE.gguf)").into()),
    };
    let model = Model::load(&path, LoadOptions::default())?;
    let cfg = model.config().clone();
    println!(
        "{which}: {} layers d={} ff={} vocab={}  threads {}  isa {}  load {:?}",
        cfg.n_layer,
        cfg.d_model,
        cfg.d_ff,
        cfg.vocab,
        rayon::current_num_threads(),
        Isa::selected(),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );

    // Whole steps.
    let prompt: Vec<u32> = (0..ctx as u32).map(|i| 1000 + i * 37 % 5000).collect();
    let mut cache = model.new_cache();
    if args.iter().any(|a| a == "--prefill") {
        // A prefill only (`tandem bench`'s: last-only logits from position 0).
        let mut cpu = 0.0;
        let wall = time_cpu(steps, &mut cpu, || {
            cache.truncate(0);
            let l = model.forward_last(&prompt, 0, &mut cache).expect("forward");
            std::hint::black_box(l);
        });
        println!(
            "prefill {ctx} tokens: {:.2} ms wall ({:.1} tok/s), {:.2} ms cpu",
            wall * 1e3,
            ctx as f64 / wall,
            cpu * 1e3
        );
        return Ok(());
    }
    model.forward_last(&prompt, 0, &mut cache)?;
    let mut step_k = |k: usize, reps: usize| -> (f64, f64) {
        let toks: Vec<u32> = (0..k as u32).map(|i| 2000 + i).collect();
        let mut cpu = 0.0;
        let wall = time_cpu(reps, &mut cpu, || {
            cache.truncate(ctx);
            let l = model.forward(&toks, ctx, &mut cache).expect("forward");
            std::hint::black_box(l);
        });
        (wall, cpu)
    };
    let num_arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|p| args.get(p + 1))
            .and_then(|v| v.parse::<usize>().ok())
    };
    // Activation rows of the matmul pass below (`--pass-m M`, default 1).
    let pass_m = num_arg("--pass-m").unwrap_or(1).max(1);
    let t1 = if let Some(k) = num_arg("--only-k") {
        // One block size only (for a profiler; with `--pass-m`, the matmul
        // pass below is compared with this forward).
        let (t, c) = step_k(k, steps);
        println!(
            "forward k={k}: {:.2} ms wall, {:.2} ms cpu",
            t * 1e3,
            c * 1e3
        );
        if num_arg("--pass-m").is_none() {
            return Ok(());
        }
        t
    } else {
        let (t1, c1) = step_k(1, steps);
        let (t5, c5) = step_k(5, steps.div_ceil(2));
        let (t9, c9) = step_k(9, steps.div_ceil(2));
        println!(
            "cpu time: step {:.2} ms  k=5 {:.2} ms c(5)={:.2}  k=9 {:.2} ms c(9)={:.2}",
            c1 * 1e3,
            c5 * 1e3,
            c5 / c1,
            c9 * 1e3,
            c9 / c1
        );
        println!(
            "decode step {:.2} ms ({:.1} tok/s)   forward k=5 {:.2} ms c(5)={:.2}   k=9 {:.2} ms c(9)={:.2}",
            t1 * 1e3,
            1.0 / t1,
            t5 * 1e3,
            t5 / t1,
            t9 * 1e3,
            t9 / t1
        );
        t1
    };
    if args.iter().any(|a| a == "--steps-only") {
        return Ok(());
    }
    // Matmuls of one step in the order a step runs them (each weight read once
    // per pass, as in a real step: the weights do not stay in cache), timed
    // one by one and summed per kind.
    let g = GgufFile::open(&path)?;
    let names = [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ];
    let head_name = if g.entry("output.weight").is_ok() {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    let mut mapped: Vec<(usize, QMatrix)> = Vec::new();
    for l in 0..cfg.n_layer {
        for (i, n) in names.iter().enumerate() {
            mapped.push((i, g.matrix(&format!("blk.{l}.{n}.weight"))?));
        }
    }
    mapped.push((names.len(), g.matrix(head_name)?));
    // The layers' Q5_0 matrices as the loader regroups them (LoadOptions::repack).
    let repack = LoadOptions::default().repack;
    let packed = mapped
        .iter()
        .map(|(kind, w)| {
            let regroup = repack && *kind < names.len() && quant::can_regroup(w.format, w.cols);
            regroup
                .then(|| quant::repack_q5_0x4(w.data, w.rows, w.cols))
                .transpose()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mats: Vec<(usize, QMatrix)> = mapped
        .iter()
        .zip(&packed)
        .map(|(&(kind, w), p)| match p {
            Some(p) => (
                kind,
                QMatrix {
                    format: QuantFormat::Q5_0x4,
                    data: p,
                    ..w
                },
            ),
            None => (kind, w),
        })
        .collect();
    // And in the tile layout, as the loader holds them (LoadOptions::tiles).
    let tiles: Vec<Option<Vec<u8>>> = mats
        .iter()
        .map(|(_, w)| {
            LoadOptions::default()
                .tiles
                .then(|| quant::build_tile_layout(w))
                .flatten()
        })
        .collect();
    let mats: Vec<(usize, QMatrix)> = mats
        .into_iter()
        .zip(&tiles)
        .map(|((kind, w), t)| match t {
            Some(t) => w.with_tiles(t).map(|w| (kind, w)),
            None => Ok((kind, w)),
        })
        .collect::<Result<_, _>>()?;
    let xs: Vec<Vec<f32>> = mats
        .iter()
        .map(|(_, w)| {
            (0..w.cols)
                .cycle()
                .take(w.cols * pass_m)
                .enumerate()
                .map(|(i, k)| ((k * 7919 % 1000 + i / w.cols) as f32 - 500.0) / 300.0)
                .collect()
        })
        .collect();
    let mut outs: Vec<Vec<f32>> = mats
        .iter()
        .map(|(_, w)| vec![0f32; w.rows * pass_m])
        .collect();
    let kinds = names.len() + 1;
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); kinds];
    let mut cpu_samples: Vec<Vec<f64>> = vec![Vec::new(); kinds];
    let mut pass_times = Vec::new();
    for pass in 0..=steps {
        let mut per = vec![0f64; kinds];
        let mut per_cpu = vec![0f64; kinds];
        let tp = Instant::now();
        for (((kind, w), x), out) in mats.iter().zip(&xs).zip(outs.iter_mut()) {
            let c = cpu_seconds();
            let t = Instant::now();
            quant::matmul(w, x, pass_m, out);
            per[*kind] += t.elapsed().as_secs_f64();
            per_cpu[*kind] += cpu_seconds() - c;
        }
        if pass > 0 {
            pass_times.push(tp.elapsed().as_secs_f64());
            for (s, p) in samples.iter_mut().zip(per) {
                s.push(p);
            }
            for (s, p) in cpu_samples.iter_mut().zip(per_cpu) {
                s.push(p);
            }
        }
    }
    println!(
        "{:<12} {:>9} {:>12} {:>9} {:>9} {:>7} {:>7} {:>9}",
        "matrix", "format", "rows x cols", "MB/step", "ms/step", "GB/s", "% step", "cpu ms"
    );
    let mut total_mm = 0.0;
    for (kind, (s, cs)) in samples.into_iter().zip(cpu_samples).enumerate() {
        let sel: Vec<&QMatrix> = mats
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, w)| w)
            .collect();
        let bytes: usize = sel.iter().map(|w| w.data.len()).sum();
        let mut fmts: Vec<String> = sel.iter().map(|w| format!("{:?}", w.format)).collect();
        fmts.sort();
        fmts.dedup();
        let t = median(s);
        total_mm += t;
        println!(
            "{:<12} {:>9} {:>12} {:>9.1} {:>9.3} {:>7.1} {:>6.1}% {:>9.3}",
            names.get(kind).copied().unwrap_or("head"),
            fmts.join("/"),
            format!("{}x{}", sel[0].rows, sel[0].cols),
            bytes as f64 / 1e6,
            t * 1e3,
            bytes as f64 / t / 1e9,
            100.0 * t / t1,
            median(cs) * 1e3
        );
    }
    let total_bytes: usize = mats.iter().map(|(_, w)| w.data.len()).sum();
    let tp = median(pass_times);
    println!(
        "matmul pass {:.2} ms ({:.1} GB/s; sum of medians {:.2} ms = {:.1}% of the step)   rest of the step {:.2} ms",
        tp * 1e3,
        total_bytes as f64 / tp / 1e9,
        total_mm * 1e3,
        100.0 * total_mm / t1,
        (t1 - tp) * 1e3
    );
    Ok(())
}
