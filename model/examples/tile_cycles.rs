//! Kernel A/B on a noisy shared machine: one quantized matrix small enough to
//! stay in L2 (weights and activations hot; default 384 × 1536), `m`
//! activation rows, many calls. Prints the time per call and a checksum of the
//! output, so two builds can be compared for speed and for bits. Whole-model
//! timings on a shared VM moved by up to ±40 % between runs; this one is
//! steadier (three alternations of two builds agreed within 3 % for Q4_K,
//! though one Q6_K run in three still moved by 1.5×; docs/model-core.md,
//! "Session 7"). Alternate the builds and repeat. With hardware
//! counters (not in every VM), run it under `perf stat -e cycles:u`.
//!
//! `RAYON_NUM_THREADS=1 taskset -c 1 \
//!   target/release/examples/tile_cycles q4k|q6k|q8_0|q5_0|q5_0x4 M [CALLS [ROWS]]`
//! (with 8 rows the time is mostly activation quantization.)

use tandem_model::quant::{self, matmul, repack_q5_0x4, QMatrix, QuantFormat};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let format = match args.first().map(String::as_str) {
        Some("q4k") => QuantFormat::Q4K,
        Some("q6k") => QuantFormat::Q6K,
        Some("q8_0") => QuantFormat::Q8_0,
        Some("q5_0") | Some("q5_0x4") => QuantFormat::Q5_0,
        _ => return Err("usage: tile_cycles q4k|q6k|q8_0|q5_0|q5_0x4 M [CALLS [ROWS]]".into()),
    };
    let m: usize = args.get(1).map_or(Ok(17), |s| s.parse())?;
    let calls: usize = args.get(2).map_or(Ok(2000), |s| s.parse())?;
    let rows: usize = args.get(3).map_or(Ok(384), |s| s.parse())?;
    let cols = 1536;
    // Deterministic bytes; every f16 scale is forced to a small normal value.
    let rb = format.row_bytes(cols)?;
    let mut data: Vec<u8> = (0..rb * rows)
        .map(|i| ((i * 2654435761usize) >> 13) as u8)
        .collect();
    let (block, scale_offsets): (usize, &[usize]) = match format {
        QuantFormat::Q4K => (144, &[0, 2]),
        QuantFormat::Q6K => (210, &[208]),
        QuantFormat::Q8_0 => (34, &[0]),
        _ => (22, &[0]),
    };
    for b in data.chunks_mut(block) {
        for &o in scale_offsets {
            b[o..o + 2].copy_from_slice(&0x2c00u16.to_le_bytes()); // 0.0625
        }
    }
    let (format, data) = if args.first().map(String::as_str) == Some("q5_0x4") {
        (QuantFormat::Q5_0x4, repack_q5_0x4(&data, rows, cols)?)
    } else {
        (format, data)
    };
    let w = QMatrix::new(format, rows, cols, &data)?;
    // The tile layout, as the loader builds it where it pays (AMX).
    let layout = quant::tiles_pay(quant::Isa::selected())
        .then(|| quant::build_tile_layout(&w))
        .flatten();
    let w = match &layout {
        Some(t) => w.with_tiles(t)?,
        None => w,
    };
    let x: Vec<f32> = (0..m * cols)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 300.0)
        .collect();
    let mut out = vec![0f32; m * rows];
    let t = std::time::Instant::now();
    for _ in 0..calls {
        matmul(&w, &x, m, &mut out);
        std::hint::black_box(&mut out);
    }
    let s = t.elapsed().as_secs_f64();
    let sum: f64 = out.iter().map(|&v| v as f64).sum();
    println!(
        "{format:?} {rows}x{cols} m={m}: {:.2} µs per call ({calls} calls), checksum {sum:.6e}",
        s / calls as f64 * 1e6
    );
    Ok(())
}
