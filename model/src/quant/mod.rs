//! Quantized weight formats and the matrix × activation-rows kernels.
//!
//! Contract (every caller relies on it):
//! - `matmul(w, x, m, out)` computes `out[i * w.rows + j] = dot(x[i], w[j])` for
//!   `m` activation rows of `w.cols` floats.
//! - The value of each output element depends only on `x[i]` and `w[j]`: not on
//!   `m`, not on the thread count, not on the row split across threads, and not
//!   on the instruction set chosen at run time. This is what makes a block
//!   verify bit-identical to one-token decoding.

use crate::{ModelError, Result};
use candle_core::quantized::GgmlDType;

/// The weight formats the kernels support.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantFormat {
    F32,
    F16,
    Q4_0,
    Q5_0,
    Q8_0,
    Q4K,
    Q6K,
}

impl QuantFormat {
    pub fn from_ggml(d: GgmlDType) -> Result<Self> {
        Ok(match d {
            GgmlDType::F32 => Self::F32,
            GgmlDType::F16 => Self::F16,
            GgmlDType::Q4_0 => Self::Q4_0,
            GgmlDType::Q5_0 => Self::Q5_0,
            GgmlDType::Q8_0 => Self::Q8_0,
            GgmlDType::Q4K => Self::Q4K,
            GgmlDType::Q6K => Self::Q6K,
            other => return Err(ModelError::UnsupportedFormat(format!("{other:?}"))),
        })
    }

    pub fn to_ggml(self) -> GgmlDType {
        match self {
            Self::F32 => GgmlDType::F32,
            Self::F16 => GgmlDType::F16,
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q5_0 => GgmlDType::Q5_0,
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q6K => GgmlDType::Q6K,
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        self.to_ggml().block_size()
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.to_ggml().type_size()
    }

    /// Bytes of one row of `cols` elements, or an error if `cols` is not a
    /// multiple of the block size.
    pub fn row_bytes(self, cols: usize) -> Result<usize> {
        let be = self.block_elems();
        if cols % be != 0 {
            return Err(ModelError::InvalidArgument(format!(
                "{cols} columns is not a multiple of the {self:?} block size {be}"
            )));
        }
        Ok(cols / be * self.block_bytes())
    }
}

/// A borrowed, row-major quantized matrix of `rows` × `cols` (GGUF layout: each
/// row is `cols / block_elems` consecutive blocks).
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub format: QuantFormat,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> QMatrix<'a> {
    pub fn new(format: QuantFormat, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self> {
        let rb = format.row_bytes(cols)?;
        if data.len() != rb * rows {
            return Err(ModelError::InvalidArgument(format!(
                "{format:?} matrix {rows}x{cols} needs {} bytes, got {}",
                rb * rows,
                data.len()
            )));
        }
        Ok(Self { format, rows, cols, data })
    }

    pub fn row_data(&self, r: usize) -> &'a [u8] {
        let rb = self.data.len() / self.rows.max(1);
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Dequantize row `r` into `out` (`out.len() == cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        reference::dequantize_row(self.format, self.row_data(r), out)
    }
}

mod reference;

/// `out[i * w.rows + j] = dot(x[i * w.cols ..][..w.cols], row j of w)` for `i < m`.
pub fn matmul(w: &QMatrix, x: &[f32], m: usize, out: &mut [f32]) {
    reference::matmul(w, x, m, out)
}
