//! The types and constants every kernel file of `quant` shares: the weight
//! formats ([`QuantFormat`], and the whole-block formats' const index
//! `WHOLE_BLOCK`), the borrowed matrix ([`QMatrix`]), the instruction-set
//! paths ([`Isa`]: their names; detecting them is `quant`'s), the tile of
//! activation rows ([`TILE`]), a row kernel's signature (`RowFn`) and the
//! output pointer of a call (`OutPtr`). A leaf below the kernels: it uses
//! only `act` and `blocks`, so the per-ISA files take these from here, not
//! from their parent. `quant` re-exports the public ones.

use super::act::Act;
use super::blocks;
use crate::{ModelError, Result};
use candle_core::quantized::GgmlDType;

/// Activation rows handled per pass over a weight row (a block of up to this
/// many tokens reads each weight block once).
pub const TILE: usize = 24;

/// The weight formats the kernels support.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantFormat {
    F32,
    F16,
    /// bfloat16: the upper half of an f32, widened exactly.
    BF16,
    Q4_0,
    /// Q4_0 with a per-block offset: `d * q + m`.
    Q4_1,
    Q5_0,
    /// Q5_0 with a per-block offset: `d * q + m`.
    Q5_1,
    Q8_0,
    /// 3-bit K-quant (llama.cpp's Q3_K_S/M/L files mix it with Q4_K..Q6_K).
    Q3K,
    Q4K,
    /// 5-bit K-quant (Q5_K_S/M files).
    Q5K,
    Q6K,
    /// Q5_0 regrouped by four blocks at load time
    /// ([`repack_q5_0x4`](super::repack_q5_0x4); not a GGUF type): the same
    /// values and scales, the same size, cheaper to unpack on AVX2. Block
    /// `b` of a row is block `b % 4` of group `b / 4`.
    Q5_0x4,
}

impl QuantFormat {
    /// The GGUF tensor types the kernels run (every one but
    /// [`QuantFormat::Q5_0x4`]).
    pub const GGUF: [QuantFormat; 12] = [
        Self::F32,
        Self::F16,
        Self::BF16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q3K,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
    ];

    pub fn from_ggml(d: GgmlDType) -> Result<Self> {
        Self::GGUF
            .into_iter()
            .find(|f| f.to_ggml() == Some(d))
            .ok_or_else(|| {
                let names: Vec<String> = Self::GGUF.iter().map(|f| format!("{f:?}")).collect();
                ModelError::UnsupportedFormat(format!("{d:?} (supported: {})", names.join(", ")))
            })
    }

    /// The GGUF type with this layout (`None` for [`QuantFormat::Q5_0x4`],
    /// which exists only in memory).
    pub fn to_ggml(self) -> Option<GgmlDType> {
        Some(match self {
            Self::F32 => GgmlDType::F32,
            Self::F16 => GgmlDType::F16,
            Self::BF16 => GgmlDType::BF16,
            Self::Q4_0 => GgmlDType::Q4_0,
            Self::Q4_1 => GgmlDType::Q4_1,
            Self::Q5_0 => GgmlDType::Q5_0,
            Self::Q5_1 => GgmlDType::Q5_1,
            Self::Q8_0 => GgmlDType::Q8_0,
            Self::Q3K => GgmlDType::Q3K,
            Self::Q4K => GgmlDType::Q4K,
            Self::Q5K => GgmlDType::Q5K,
            Self::Q6K => GgmlDType::Q6K,
            Self::Q5_0x4 => return None,
        })
    }

    /// Elements per block (for [`QuantFormat::Q5_0x4`], per group of four).
    pub fn block_elems(self) -> usize {
        match self.to_ggml() {
            Some(g) => g.block_size(),
            None => 4 * blocks::QK,
        }
    }

    /// Bytes per block (for [`QuantFormat::Q5_0x4`], per group of four).
    pub fn block_bytes(self) -> usize {
        match self.to_ggml() {
            Some(g) => g.type_size(),
            None => std::mem::size_of::<blocks::BlockQ5_0x4>(),
        }
    }

    /// Bytes of one row of `cols` elements, or an error if `cols` is not a
    /// multiple of the block size.
    pub fn row_bytes(self, cols: usize) -> Result<usize> {
        let be = self.block_elems();
        if !cols.is_multiple_of(be) {
            return Err(ModelError::InvalidArgument(format!(
                "{cols} columns is not a multiple of the {self:?} block size {be}"
            )));
        }
        Ok(cols / be * self.block_bytes())
    }
}

/// The whole-block formats, by the const index `F` their SIMD kernels are
/// instantiated for (so that every `match` on the format inside folds);
/// `quant`'s `whole_block!` maps a run-time format to its index.
#[cfg(target_arch = "x86_64")]
pub(super) const WHOLE_BLOCK: [QuantFormat; 6] = [
    QuantFormat::Q4_0,
    QuantFormat::Q5_0,
    QuantFormat::Q8_0,
    QuantFormat::Q4_1,
    QuantFormat::Q5_1,
    QuantFormat::Q5_0x4,
];

/// A borrowed, row-major quantized matrix of `rows` × `cols` (GGUF layout: each
/// row is `cols / block_elems` consecutive blocks).
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    pub format: QuantFormat,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    /// The same matrix in the tile layout
    /// ([`build_tile_layout`](super::build_tile_layout)), built at load time
    /// for the AMX kernels ([`QMatrix::with_tiles`]); without it they
    /// rearrange each super-block as they go. Never changes a result.
    pub tiles: Option<&'a [u8]>,
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
        Ok(Self {
            format,
            rows,
            cols,
            data,
            tiles: None,
        })
    }

    pub fn row_data(&self, r: usize) -> &'a [u8] {
        let rb = self.data.len() / self.rows.max(1);
        &self.data[r * rb..(r + 1) * rb]
    }
}

/// An instruction-set path for the quantized kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable scalar code: the reference, always available.
    Scalar,
    /// x86-64 AVX2 (+F16C).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL with VNNI.
    Avx512Vnni,
    /// [`Isa::Avx512Vnni`] plus AMX-INT8 tiles for Q4_K/Q5_K/Q6_K weights times
    /// at least [`AMX_MIN_ROWS_Q4K`](super::AMX_MIN_ROWS_Q4K) /
    /// [`AMX_MIN_ROWS_Q6K`](super::AMX_MIN_ROWS_Q6K) activation rows.
    Amx,
    /// aarch64 baseline NEON (every ARMv8-A CPU).
    Neon,
    /// aarch64 NEON with the dot-product extension (`SDOT`, ARMv8.2+).
    NeonDotprod,
}

impl Isa {
    /// Every variant, best last.
    pub const ALL: [Isa; 6] = [
        Isa::Scalar,
        Isa::Avx2,
        Isa::Avx512Vnni,
        Isa::Amx,
        Isa::Neon,
        Isa::NeonDotprod,
    ];

    /// The name used by `TANDEM_ISA`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Amx => "amx",
            Isa::Neon => "neon",
            Isa::NeonDotprod => "neon-dotprod",
        }
    }

    /// Parse a `TANDEM_ISA` value.
    pub fn from_name(s: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(s.trim()))
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One weight row × activation rows `t0..t0+tn` → `res[..tn]`.
/// Unsafe because SIMD variants require their CPU features.
pub(super) type RowFn = unsafe fn(QuantFormat, &[u8], &Act, usize, usize, &mut [f32; TILE]);

/// Raw output pointer shared by the tasks of one call; each task writes a
/// disjoint set of columns `j0..j1` of the `m × rows` output.
#[derive(Clone, Copy)]
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: tasks write disjoint elements, and the borrow of `out` outlives them.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}
