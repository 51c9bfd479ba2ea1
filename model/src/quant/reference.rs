//! Placeholder reference path (dequantize + f32 dot). Replaced by the real kernels.

use super::{QMatrix, QuantFormat};
use candle_core::quantized::k_quants::{
    BlockQ4K, BlockQ4_0, BlockQ5_0, BlockQ6K, BlockQ8_0, GgmlType,
};
use rayon::prelude::*;

fn cast<T>(data: &[u8]) -> &[T] {
    let n = data.len() / std::mem::size_of::<T>();
    assert_eq!(data.as_ptr() as usize % std::mem::align_of::<T>(), 0);
    // SAFETY: the block types are plain-old-data repr(C) structs and the slice is aligned.
    unsafe { std::slice::from_raw_parts(data.as_ptr() as *const T, n) }
}

pub fn dequantize_row(format: QuantFormat, data: &[u8], out: &mut [f32]) {
    match format {
        QuantFormat::F32 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        QuantFormat::F16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        QuantFormat::Q4_0 => BlockQ4_0::to_float(cast(data), out),
        QuantFormat::Q5_0 => BlockQ5_0::to_float(cast(data), out),
        QuantFormat::Q8_0 => BlockQ8_0::to_float(cast(data), out),
        QuantFormat::Q4K => BlockQ4K::to_float(cast(data), out),
        QuantFormat::Q6K => BlockQ6K::to_float(cast(data), out),
    }
}

pub fn matmul(w: &QMatrix, x: &[f32], m: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(x.len(), m * cols);
    assert_eq!(out.len(), m * rows);
    let mut res = vec![0f32; rows * m];
    res.par_chunks_mut(m).enumerate().for_each_init(
        || vec![0f32; cols],
        |buf, (j, o)| {
            dequantize_row(w.format, w.row_data(j), buf);
            for i in 0..m {
                let xi = &x[i * cols..(i + 1) * cols];
                o[i] = xi.iter().zip(buf.iter()).map(|(a, b)| a * b).sum();
            }
        },
    );
    for j in 0..rows {
        for i in 0..m {
            out[i * rows + j] = res[j * m + i];
        }
    }
}
