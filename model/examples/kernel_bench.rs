//! Quantized matmul micro-benchmark on the real model matrices.
//!
//! `cargo run --release -p tandem-model --example kernel_bench [-- --isa NAME|all] [--quick]`
//!
//! For one matrix of each format of the draft and target GGUFs, plus both output
//! heads, prints for m = 1, 2, 3, 5, 9, 17 activation rows: time per call,
//! effective weight-read bandwidth, cost(m)/cost(1), and candle's `QMatMul` on
//! the same weights (loaded with candle's own GGUF reader) side by side.
//! `TANDEM_ISA` or `--isa` picks the kernel path; threads: rayon's global pool
//! (`RAYON_NUM_THREADS`).
//!
//! `--cpu` times process CPU time instead of wall time (with
//! `RAYON_NUM_THREADS=1` the call runs on the calling thread, so this compares
//! kernels on a loaded machine: time spent descheduled does not count);
//! `--no-candle` skips the candle column; `--only SUBSTR` keeps the tensors
//! whose name or format contains SUBSTR; `--ms 1,24,40,64` sets the row
//! counts (large m: a batched verifier forward). `G/s` is multiply-adds per
//! second (rows × cols × m / time).
//!
//! `--synthetic ROWSxCOLS` (e.g. `8960x1536`, the 1.5B's `ffn_up`) needs no
//! model file: one Gaussian f32 matrix is quantized by candle (ggml's
//! quantizers) into every GGUF format the kernels run, and each is timed on
//! the same shape, with its weight bytes per second against Q4_K's in the
//! same run (`vs Q4_K`: the per-format speed target is ≥ 0.90 at
//! m = 1); `--only` keeps the formats whose name contains SUBSTR (and Q4_K). docs/model-core.md, "Formats", has a run.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use tandem_model::gguf::GgufFile;
use tandem_model::quant::{
    build_tile_layout, matmul_with_isa, tiles_pay, Isa, QMatrix, QuantFormat,
};

const MS: [usize; 6] = [1, 2, 3, 5, 9, 17];

fn models_dir() -> PathBuf {
    tandem_fetch::models_dir()
}

#[path = "support/cputime.rs"]
mod cputime;
use cputime::cpu_seconds;

/// Median seconds per call of `f` (wall, or process CPU with `cpu`), over at
/// least `min_time` and 5 calls.
fn time_it(min_time: Duration, cpu: bool, mut f: impl FnMut()) -> f64 {
    f(); // warm-up
    let mut v = Vec::new();
    let start = Instant::now();
    while v.len() < 5 || (start.elapsed() < min_time && v.len() < 2000) {
        let (t, c) = (Instant::now(), if cpu { cpu_seconds() } else { 0.0 });
        f();
        v.push(if cpu {
            cpu_seconds() - c
        } else {
            t.elapsed().as_secs_f64()
        });
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let cpu = args.iter().any(|a| a == "--cpu");
    let candle = !args.iter().any(|a| a == "--no-candle");
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|p| args.get(p + 1))
        .cloned();
    let ms: Vec<usize> = match args.iter().position(|a| a == "--ms") {
        Some(p) => args
            .get(p + 1)
            .ok_or("--ms needs a value")?
            .split(',')
            .map(|v| v.trim().parse::<usize>())
            .collect::<Result<_, _>>()?,
        None => MS.to_vec(),
    };
    let min_time = Duration::from_millis(if quick { 100 } else { 400 });
    let isas: Vec<Isa> = match args.iter().position(|a| a == "--isa") {
        Some(p) => match args.get(p + 1).map(String::as_str) {
            Some("all") => Isa::available(),
            Some(n) => vec![Isa::from_name(n).ok_or(format!("unknown ISA {n}"))?],
            None => return Err("--isa needs a value".into()),
        },
        None => vec![Isa::selected()],
    };
    println!(
        "threads {}  ISAs available {:?}",
        rayon::current_num_threads(),
        Isa::available()
    );
    if let Some(p) = args.iter().position(|a| a == "--synthetic") {
        let spec = args.get(p + 1).ok_or("--synthetic needs ROWSxCOLS")?;
        let (r, c) = spec.split_once('x').ok_or("--synthetic needs ROWSxCOLS")?;
        let shape = (r.trim().parse()?, c.trim().parse()?);
        return synthetic(shape, &isas, &ms, min_time, cpu, candle, only.as_deref());
    }
    let dir = models_dir();
    let plan: [(&str, &[&str]); 2] = [
        (
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            &[
                "blk.0.attn_q.weight",
                "blk.0.attn_v.weight",
                "blk.0.ffn_down.weight",
                "blk.1.ffn_down.weight",
                "output.weight",
            ],
        ),
        (
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            &[
                "blk.0.ffn_up.weight",
                "blk.0.ffn_down.weight",
                "blk.0.attn_v.weight",
                "output.weight",
            ],
        ),
    ];
    println!(
        "{:<10} {:<22} {:>6} {:>11} {:>3} | {:<10} {:>10} {:>8} {:>7} {:>6} | {:>10} {:>6} {:>7}",
        "model",
        "tensor",
        "format",
        "rows x cols",
        "m",
        "isa",
        "us/call",
        "GB/s",
        "G/s",
        "c(m)/c1",
        "candle us",
        "c(m)/c1",
        "speedup"
    );
    for (file, names) in plan {
        let path = dir.join(file);
        let g = GgufFile::open(&path)?;
        let mut f = std::fs::File::open(&path)?;
        let content = gguf_file::Content::read(&mut f)?;
        let mut seen = Vec::new();
        for &name in names {
            let w: QMatrix = g.matrix(name)?;
            if name != "output.weight" && seen.contains(&w.format) {
                continue;
            }
            seen.push(w.format);
            if w.format == QuantFormat::F32 || w.format == QuantFormat::F16 {
                continue;
            }
            if let Some(o) = &only {
                if !name.contains(o.as_str()) && !format!("{:?}", w.format).contains(o.as_str()) {
                    continue;
                }
            }
            let qt = content.tensor(&mut f, name, &Device::Cpu)?;
            let qmm = QMatMul::from_qtensor(qt)?;
            let short = file.split('-').nth(2).unwrap_or(file);
            for isa in &isas {
                // As the model loader does: the tile layout where it pays.
                let tiles = tiles_pay(*isa).then(|| build_tile_layout(&w)).flatten();
                let w = match &tiles {
                    Some(t) => w.with_tiles(t)?,
                    None => w,
                };
                let mut base = (0f64, 0f64);
                for &m in &ms {
                    let x: Vec<f32> = (0..m * w.cols)
                        .map(|k| ((k * 7919 % 1000) as f32 - 500.0) / 300.0)
                        .collect();
                    let mut out = vec![0f32; m * w.rows];
                    let t = time_it(min_time, cpu, || {
                        matmul_with_isa(*isa, &w, &x, m, &mut out).expect("matmul");
                    });
                    let xt = Tensor::from_vec(x.clone(), (m, w.cols), &Device::Cpu)?;
                    let tc = if candle {
                        time_it(min_time, cpu, || {
                            let y = qmm.forward(&xt).expect("candle forward");
                            std::hint::black_box(y);
                        })
                    } else {
                        f64::NAN
                    };
                    if base.0 == 0.0 {
                        base = (t, tc);
                    }
                    println!(
                        "{:<10} {:<22} {:>6} {:>11} {:>3} | {:<10} {:>10.1} {:>8.1} {:>7.1} {:>6.2} | {:>10.1} {:>6.2} {:>6.2}x",
                        short,
                        name,
                        format!("{:?}", w.format),
                        format!("{}x{}", w.rows, w.cols),
                        m,
                        isa.name(),
                        t * 1e6,
                        w.data.len() as f64 / t / 1e9,
                        (w.rows * w.cols * m) as f64 / t / 1e9,
                        t / base.0,
                        tc * 1e6,
                        tc / base.1,
                        tc / t
                    );
                }
            }
        }
    }
    Ok(())
}

/// Every GGUF format on one random `rows × cols` matrix (see the module
/// doc), Q4_K first: its bytes per second at each (ISA, m) are the baseline
/// of the `vs Q4_K` column.
fn synthetic(
    (rows, cols): (usize, usize),
    isas: &[Isa],
    ms: &[usize],
    min_time: Duration,
    cpu: bool,
    candle: bool,
    only: Option<&str>,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    // A sum of uniforms: bell-shaped, like trained weights.
    let data: Vec<f32> = (0..rows * cols)
        .map(|_| (0..4).map(|_| uniform()).sum::<f32>() * 0.05)
        .collect();
    let t = Tensor::from_vec(data, (rows, cols), &Device::Cpu)?;
    let mut formats = vec![QuantFormat::Q4K];
    formats.extend(QuantFormat::GGUF.into_iter().filter(|f| {
        !matches!(f, QuantFormat::Q4K | QuantFormat::F32)
            && only.is_none_or(|o| format!("{f:?}").contains(o))
    }));
    // A width that is not whole blocks of a format (576: not K-quants) skips it.
    formats.retain(|f| f.row_bytes(cols).is_ok());
    println!(
        "{:<6} {:>11} {:>10} {:>3} | {:<10} {:>10} {:>8} {:>7} {:>8} | {:>10} {:>7}",
        "format",
        "rows x cols",
        "MB",
        "m",
        "isa",
        "us/call",
        "GB/s",
        "G/s",
        "vs Q4_K",
        "candle us",
        "speedup"
    );
    let mut base: Vec<((Isa, usize), f64)> = Vec::new();
    for f in formats {
        let ggml = f.to_ggml().ok_or("not a GGUF format")?;
        let qt = QTensor::quantize(&t, ggml)?;
        let bytes = qt.data()?.into_owned();
        let w = QMatrix::new(f, rows, cols, &bytes)?;
        let qmm = QMatMul::from_qtensor(qt)?;
        for &isa in isas {
            let tiles = tiles_pay(isa).then(|| build_tile_layout(&w)).flatten();
            let w = match &tiles {
                Some(t) => w.with_tiles(t)?,
                None => w,
            };
            for &m in ms {
                let x: Vec<f32> = (0..m * cols)
                    .map(|k| ((k * 7919 % 1000) as f32 - 500.0) / 300.0)
                    .collect();
                let mut out = vec![0f32; m * rows];
                let secs = time_it(min_time, cpu, || {
                    matmul_with_isa(isa, &w, &x, m, &mut out).expect("matmul");
                });
                let gbs = w.data.len() as f64 / secs / 1e9;
                if f == QuantFormat::Q4K {
                    base.push(((isa, m), gbs));
                }
                let q4k = base
                    .iter()
                    .find(|(k, _)| *k == (isa, m))
                    .map_or(f64::NAN, |(_, v)| *v);
                let tc = if candle {
                    let xt = Tensor::from_vec(x.clone(), (m, cols), &Device::Cpu)?;
                    time_it(min_time, cpu, || {
                        let y = qmm.forward(&xt).expect("candle forward");
                        std::hint::black_box(y);
                    })
                } else {
                    f64::NAN
                };
                println!(
                    "{:<6} {:>11} {:>10.2} {:>3} | {:<10} {:>10.1} {:>8.2} {:>7.1} {:>8.2} | {:>10.1} {:>6.2}x",
                    format!("{f:?}"),
                    format!("{rows}x{cols}"),
                    w.data.len() as f64 / 1e6,
                    m,
                    isa.name(),
                    secs * 1e6,
                    gbs,
                    (rows * cols * m) as f64 / secs / 1e9,
                    gbs / q4k,
                    tc * 1e6,
                    tc / secs
                );
            }
        }
    }
    Ok(())
}
