//! Helpers shared by the `quant_*` tests: random matrices in every format,
//! activations, references and bit comparison.
#![allow(dead_code)]
#![allow(clippy::unwrap_used)] // test helpers: a failure should panic

use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tandem_model::quant::{QMatrix, QuantFormat};

/// Every GGUF format the kernels run.
pub const ALL_FORMATS: [QuantFormat; 12] = QuantFormat::GGUF;

/// Byte offsets of the f16 scale fields inside one block.
fn f16_fields(f: QuantFormat) -> &'static [usize] {
    match f {
        QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q8_0 => &[0],
        QuantFormat::Q4_1 | QuantFormat::Q5_1 => &[0, 2],
        QuantFormat::Q5_0x4 => &[0, 2, 4, 6],
        QuantFormat::Q4K | QuantFormat::Q5K => &[0, 2],
        QuantFormat::Q3K => &[108],
        QuantFormat::Q6K => &[208],
        QuantFormat::F32 | QuantFormat::F16 | QuantFormat::BF16 => &[],
    }
}

/// A matrix of uniformly random bytes (every bit pattern of the quantized
/// values and sub-block scales occurs, e.g. Q8_0's -128 and Q4_K's 63 scales),
/// with finite random f16 block scales (and offsets: Q4_1/Q5_1's `m` of
/// either sign).
pub fn random_bytes_matrix(f: QuantFormat, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = f.row_bytes(cols).unwrap() * rows;
    match f {
        QuantFormat::F32 => (0..rows * cols)
            .flat_map(|_| rng.gen_range(-1f32..1.0).to_le_bytes())
            .collect(),
        QuantFormat::F16 => (0..rows * cols)
            .flat_map(|_| half::f16::from_f32(rng.gen_range(-1f32..1.0)).to_le_bytes())
            .collect(),
        QuantFormat::BF16 => (0..rows * cols)
            .flat_map(|_| half::bf16::from_f32(rng.gen_range(-1f32..1.0)).to_le_bytes())
            .collect(),
        _ => {
            let mut v: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            let bb = f.block_bytes();
            for blk in v.chunks_exact_mut(bb) {
                let offset = matches!(f, QuantFormat::Q4_1 | QuantFormat::Q5_1);
                for (i, &o) in f16_fields(f).iter().enumerate() {
                    let v = if offset && i == 1 {
                        rng.gen_range(-0.4f32..0.4)
                    } else {
                        rng.gen_range(0.001f32..0.05)
                    };
                    let s = half::f16::from_f32(v);
                    blk[o..o + 2].copy_from_slice(&s.to_le_bytes());
                }
            }
            v
        }
    }
}

/// A realistic matrix: Gaussian-like f32 data quantized by candle (ggml's
/// quantizers).
pub fn candle_matrix(f: QuantFormat, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let data: Vec<f32> = (0..rows * cols).map(|_| gauss(&mut rng) * 0.05).collect();
    let t = Tensor::from_vec(data, (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, f.to_ggml().unwrap()).unwrap();
    q.data().unwrap().into_owned()
}

pub fn gauss(rng: &mut StdRng) -> f32 {
    // sum of uniforms: cheap, bell-shaped, bounded
    (0..4).map(|_| rng.gen_range(-1f32..1.0)).sum::<f32>() * 0.87
}

/// Gaussian-like activations.
pub fn gauss_x(m: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..m * cols).map(|_| gauss(&mut rng)).collect()
}

/// Activations the Q8_0 and Q8_K quantizers represent exactly: integers in
/// [-127, 127] times a power of two, each 32-element block containing ±127.
pub fn exact_x(m: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut x: Vec<f32> = (0..m * cols)
        .map(|_| rng.gen_range(-127i32..=127) as f32)
        .collect();
    for (b, blk) in x.chunks_mut(32).enumerate() {
        let p = rng.gen_range(0..blk.len());
        blk[p] = if b % 2 == 0 { 127.0 } else { -127.0 };
    }
    let scale = 1.0 / 64.0;
    x.iter().map(|v| v * scale).collect()
}

/// Dequantized rows (f32) via the crate's `dequantize_row`.
pub fn dequant(w: &QMatrix) -> Vec<f32> {
    let mut out = vec![0f32; w.rows * w.cols];
    for (r, o) in out.chunks_exact_mut(w.cols).enumerate() {
        w.dequantize_row(r, o);
    }
    out
}

/// Dequantized by candle, for an independent check of the block layouts.
pub fn candle_dequant(f: QuantFormat, rows: usize, cols: usize, data: &[u8]) -> Vec<f32> {
    let storage = candle_core::quantized::QStorage::from_data(
        std::borrow::Cow::Borrowed(data),
        &Device::Cpu,
        f.to_ggml().unwrap(),
    )
    .unwrap();
    let q = QTensor::new(storage, (rows, cols)).unwrap();
    q.dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Assert two outputs are identical bit for bit.
#[track_caller]
pub fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.to_bits() == y.to_bits(),
            "{what}: element {k} differs: {x:e} vs {y:e} (bits {:#x} vs {:#x})",
            x.to_bits(),
            y.to_bits()
        );
    }
}

pub fn is_ggml_quant(f: QuantFormat) -> bool {
    !matches!(f, QuantFormat::F32 | QuantFormat::F16 | QuantFormat::BF16)
}

/// Elements per activation quantization block for weights of `f` (0: f32
/// activations).
pub fn act_block(f: QuantFormat) -> usize {
    match f {
        QuantFormat::Q3K | QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K => 256,
        QuantFormat::F32 | QuantFormat::F16 | QuantFormat::BF16 => 0,
        _ => 32,
    }
}
