//! Quantized weight formats and the matrix × activation-rows kernels.
//!
//! Contract (every caller relies on it):
//! - `matmul(w, x, m, out)` computes `out[i * w.rows + j] = dot(x[i], w[j])` for
//!   `m` activation rows of `w.cols` floats.
//! - The value of each output element depends only on `x[i]` and `w[j]`: not on
//!   `m`, not on the thread count, not on the row split across threads, and not
//!   on the instruction set chosen at run time. This is what makes a block
//!   verify bit-identical to one-token decoding.
//!
//! How the contract is kept:
//! - each activation row is quantized once per call by code shared by all
//!   paths (scalar, or AVX2 with the same bits)
//!   ([`act`]: Q8_0 for Q4_0/Q5_0/Q5_0x4/Q8_0 weights, Q8_1 — Q8_0 plus
//!   a per-block offset term — for Q4_1/Q5_1, Q8_K for
//!   Q3_K/Q4_K/Q5_K/Q6_K), row by row, so its quantization does not depend
//!   on the other rows;
//! - SIMD and AMX kernels only compute integer sums, which are exact; every
//!   float operation follows the shared functions of `combine` in one fixed
//!   order:
//!   - Q4_K/Q6_K (and Q5_K/Q3_K): the unit is the **whole super-block**: per
//!     (activation row, weight row, super-block) one exact i32
//!     `S = Σ_c sc_c · dot_c` (and for Q4_K/Q5_K `M = Σ_c m_c · bsum_c`),
//!     then one float step (`combine::q4k_step` for Q4_K/Q5_K, `q6k_step`
//!     for Q6_K/Q3_K) into a single accumulator, in super-block order. No
//!     partial lane sums leak into the floats, so a kernel may form `S` any
//!     way it likes (AMX tiles, VNNI lanes, scalar);
//!   - Q4_0/Q5_0/Q5_0x4/Q8_0 (`d·q`, q signed): the unit is the **whole
//!     block**: per (activation row, weight row, block of 32) one exact
//!     i32 `s = Σ_{k<32} q·x`, then one float step (`combine::block_step`:
//!     `acc[b % 16] += (dw·dx)·s`, exactly `acc + (dw * dx) * (s as f32)`
//!     in f32, a multiply, a multiply, an add) into lane `b % 16` of a
//!     16-lane accumulator, summed by `combine::reduce16`;
//!   - Q4_1/Q5_1 (`d·q + m`, q unsigned): the same whole-block unit, with
//!     `combine::min_block_step`: `acc[b % 16] += (dw·dx)·s + m·xs` with
//!     the activation's per-block `xs = dx·Σ32 x`;
//!   - for both, a kernel may form `s` any way it likes (unsigned weights
//!     `q + off` and the activation's `−off·Σ32 x`; the SIMD ones reduce
//!     their lanes per 8 or 16 blocks with a transposition tree; the GEMM
//!     path regroups so that one lane is one block) and steps 16 (AVX-512)
//!     or 8 (AVX2) consecutive blocks as the lanes of one vector;
//! - F32/F16/BF16 weights use one portable 16-lane f32 dot (separate
//!   multiply and add per lane, `combine::reduce16`): F32 through the
//!   scalar code on every ISA, F16 and BF16 also as AVX2 and AVX-512 code
//!   with the same lanes (the widening is exact: F16C's `vcvtph2ps`, a
//!   shift for BF16).
//!
//! Which ISA has kernels for which format (the others run the scalar
//! reference, same bits): AVX2 and AVX-512 VNNI — every format but F32
//! (Q5_0x4 on AVX-512 takes the AVX2 kernel, and so does a one-row call of
//! a whole-block format: faster there, docs/model-core.md); AVX-512 VNNI also has a
//! large-m "GEMM" path for Q4_0/Q5_0/Q8_0 (from [`GEMM_MIN_ROWS`] rows) and
//! Q4_1/Q5_1 (from [`GEMM_MIN_ROWS_OFFSET`]): a panel of weight rows
//! unpacked once and used for every activation row of the call, the same
//! exact block sums and the same float steps
//! (`x86_avx512_gemm`, docs/model-core.md "GEMM path"); AMX — tiles for
//! Q4_K/Q5_K/Q6_K from [`AMX_MIN_ROWS_Q4K`] (Q4_K, Q5_K) / [`AMX_MIN_ROWS_Q6K`] rows, every
//! other format and row count delegates to the AVX-512 VNNI kernels (GEMM
//! path included), for Q4_K/Q5_K/Q6_K matrices in the tile layout
//! ([`build_tile_layout`], built at load on AMX) VNNI sums over its units; NEON and NEON dotprod — every quantized format and
//! F16/BF16 (F32 on the scalar dot).
//!
//! Formats are GGUF's, plus two in-memory layouts: [`QuantFormat::Q5_0x4`],
//! Q5_0 regrouped at load time ([`repack_q5_0x4`]) where [`repack_pays`];
//! and the tile layout of Q4_K/Q5_K/Q6_K ([`build_tile_layout`], held beside a
//! matrix as [`QMatrix::tiles`]) where [`tiles_pay`].
//!
//! Layout: `types` (what every kernel file shares: [`QuantFormat`],
//! [`QMatrix`], [`Isa`] and its names, [`TILE`], the row-kernel signature,
//! the output pointer; re-exported here) and `common` (the pass splitter,
//! the prefetch hint, the AMX and GEMM row thresholds), `blocks` (ggml
//! block structs), `act` (activation quantization), `combine` (shared
//! float math), `scalar` (reference kernels, always available),
//! `tile_layout` (the Q4_K/Q5_K/Q6_K tile layout's bytes, portable),
//! `x86_avx2` / `x86_avx512` / `x86_amx` (runtime-detected; AMX tiles for
//! Q4_K/Q5_K/Q6_K × blocks of rows, see docs/model-core.md "AMX"),
//! `aarch64_neon` (baseline NEON and SDOT, runtime-detected; same bits as
//! scalar and x86, docs/model-core.md "aarch64"). `x86_avx2_formats` /
//! `x86_avx512_formats` hold the whole-block kernels (Q4_0/Q5_0/Q5_0x4/
//! Q8_0, Q4_1/Q5_1) and the F16/BF16 ones (issue 28, docs/model-core.md
//! "Formats", "Whole blocks"); `x86_avx512_gemm` the large-m path. This
//! module keeps the dispatch (`row_fn`, the GEMM and AMX jobs), detecting
//! the paths ([`Isa::is_available`], [`Isa::selected`]) and the loaders'
//! functions (repacking, the tile layout). The graph points one way
//! (scripts/check-modules): the kernel files use `types`, `common`,
//! `blocks`, `act`, `combine` and each other (`x86_avx2` and
//! `x86_avx512` dispatch to their `_formats` files, never back), never
//! this module.
//!
//! Threading: output rows are split into chunks on rayon's global (persistent)
//! pool; within a chunk each weight row is unpacked block by block and every
//! block is used for up to [`TILE`] activation rows while it is in L1, so a
//! verify block of k ≤ 24 tokens reads the weights from memory once (the
//! AVX-512 kernels take the tile in passes of up to 8 rows, 4 for the
//! whole-block formats, with register accumulators; the weight row is in
//! L1 for the later passes). On the GEMM
//! path a chunk is taken 4 weight rows at a time, unpacked once, times all
//! `m` activation rows (2 at a time), so the weights are read once whatever
//! `m` is.

// Index loops mirror ggml's block layouts (offsets like 32c + 4l + k) and are
// clearer than iterator chains here.
#![allow(clippy::needless_range_loop)]

use crate::{ModelError, Result};

// QMatrix's methods that use the tile layout and the scalar kernels (here,
// not in `types`, which the kernels use).
impl<'a> QMatrix<'a> {
    /// This matrix with its tile layout ([`build_tile_layout`] of it):
    /// refused when `tiles` is not that layout's size, or the format has
    /// none.
    pub fn with_tiles(self, tiles: &'a [u8]) -> Result<Self> {
        let want = tile_layout_bytes(self.format, self.rows, self.cols);
        if want != Some(tiles.len()) {
            return Err(ModelError::InvalidArgument(format!(
                "tile layout of a {:?} {}x{} matrix: {want:?} bytes expected, got {}",
                self.format,
                self.rows,
                self.cols,
                tiles.len()
            )));
        }
        Ok(Self {
            tiles: Some(tiles),
            ..self
        })
    }

    /// Dequantize row `r` into `out` (`out.len() == cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        scalar::dequantize_row(self.format, self.row_data(r), &mut out[..self.cols])
    }
}

/// Whether [`repack_q5_0x4`] makes `isa` faster: on AVX2 the regrouped
/// layout unpacks with shifts and masks instead of a bit-to-byte expansion
/// and a sign trick per block (the draft's Q5_0 matrices went from compute-
/// to memory-bound; docs/model-core.md, "Session 8"). AVX-512 machines keep the
/// GGUF layout for their VNNI kernels (not measured there).
pub fn repack_pays(isa: Isa) -> bool {
    isa == Isa::Avx2
}

/// The tile layout's format kind for `format` (`None`: no tile layout).
fn tile_kind(format: QuantFormat) -> Option<tile_layout::Kind> {
    match format {
        QuantFormat::Q4K => Some(tile_layout::Kind::Q4K),
        QuantFormat::Q5K => Some(tile_layout::Kind::Q5K),
        QuantFormat::Q6K => Some(tile_layout::Kind::Q6K),
        _ => None,
    }
}

/// `w` in the tile layout for the AMX kernels ([`QMatrix::with_tiles`];
/// `None`: its format has none). Q4_K and Q6_K: per group of 16 weight rows
/// and super-block a unit of the packed quants transposed into AMX's order
/// and the scales as bytes, about the file's size (docs/model-core.md,
/// "AMX, round three"). Rows past the last whole group of 16 have none.
pub fn build_tile_layout(w: &QMatrix) -> Option<Vec<u8>> {
    let kind = tile_kind(w.format)?;
    Some(tile_layout::build(kind, w.rows, w.cols, w.data))
}

/// Bytes of [`build_tile_layout`] of a `rows × cols` matrix of `format`
/// (`None`: no tile layout).
pub fn tile_layout_bytes(format: QuantFormat, rows: usize, cols: usize) -> Option<usize> {
    Some(tile_layout::layout_bytes(tile_kind(format)?, rows, cols))
}

/// Whether holding Q4_K/Q5_K/Q6_K matrices in the tile layout as well
/// ([`build_tile_layout`], [`QMatrix::with_tiles`]) makes `isa` faster: only the
/// AMX kernels read it (docs/model-core.md, "AMX, round three").
pub fn tiles_pay(isa: Isa) -> bool {
    isa == Isa::Amx
}

/// Whether a matrix of this format and width can be regrouped by
/// [`repack_q5_0x4`]: Q5_0 whose rows are whole groups of four blocks.
pub fn can_regroup(format: QuantFormat, cols: usize) -> bool {
    format == QuantFormat::Q5_0 && cols.is_multiple_of(QuantFormat::Q5_0x4.block_elems())
}

/// Regroup a Q5_0 matrix (`rows` × `cols`, GGUF layout) into
/// [`QuantFormat::Q5_0x4`]: same size, same values and scales, so every
/// matmul result is bit-identical. `cols` must be a multiple of 128 (four
/// blocks).
pub fn repack_q5_0x4(data: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    let mut out = data.to_vec();
    repack_q5_0x4_in_place(&mut out, rows, cols)?;
    Ok(out)
}

/// [`repack_q5_0x4`] in place (the model loader's form: no second copy),
/// split across the rayon pool.
pub fn repack_q5_0x4_in_place(data: &mut [u8], rows: usize, cols: usize) -> Result<()> {
    QMatrix::new(QuantFormat::Q5_0, rows, cols, data)?;
    if !can_regroup(QuantFormat::Q5_0, cols) {
        return Err(ModelError::InvalidArgument(format!(
            "{cols} columns cannot be regrouped into Q5_0x4 (needs a multiple of {})",
            QuantFormat::Q5_0x4.block_elems()
        )));
    }
    let gb = QuantFormat::Q5_0x4.block_bytes();
    use rayon::prelude::*;
    data.par_chunks_mut(gb * 1024).for_each(|part| {
        for g in part.chunks_exact_mut(gb) {
            regroup_q5_0(g);
        }
    });
    Ok(())
}

/// Four Q5_0 blocks (88 bytes) → one [`blocks::BlockQ5_0x4`], in place, with
/// whole-word operations (a per-element loop made the draft's load ~0.5 s
/// slower).
fn regroup_q5_0(g: &mut [u8]) {
    const LO: u128 = u128::from_le_bytes([0x0F; 16]);
    let src: [blocks::BlockQ5_0; 4] = std::array::from_fn(|i| blocks::cast(g)[i]);
    let (mut qh, mut qs) = (0u128, [0u128; 4]);
    for (i, b) in src.iter().enumerate() {
        let q = u128::from_le_bytes(b.qs);
        let (base, shift) = (2 * (i / 2), 4 * (i % 2));
        qs[base] |= (q & LO) << shift;
        qs[base + 1] |= ((q >> 4) & LO) << shift;
        let h = u32::from_le_bytes(b.qh);
        qh |= (spread_bits(h as u16) << i) | (spread_bits((h >> 16) as u16) << (4 + i));
    }
    for (i, b) in src.iter().enumerate() {
        g[2 * i..2 * i + 2].copy_from_slice(&b.d);
    }
    g[8..24].copy_from_slice(&qh.to_le_bytes());
    for (k, q) in qs.iter().enumerate() {
        g[24 + 16 * k..40 + 16 * k].copy_from_slice(&q.to_le_bytes());
    }
}

/// Byte j of the result = bit j of `b` (0 or 1).
fn spread_bits(b: u16) -> u128 {
    // Replicate the byte, keep bit k in byte k, then turn a non-zero byte into
    // 0x80 (adding 0x7F never carries out of a byte) and shift it down.
    let spread8 = |x: u8| -> u64 {
        let v = (x as u64).wrapping_mul(0x0101_0101_0101_0101) & 0x8040_2010_0804_0201;
        ((v + 0x7F7F_7F7F_7F7F_7F7F) >> 7) & 0x0101_0101_0101_0101
    };
    spread8(b as u8) as u128 | (spread8((b >> 8) as u8) as u128) << 64
}

/// Run `kernel::<R>` over a tile's `tn` rows in passes of at most `max` rows
/// (near-equal sizes: 9 rows in passes of 8 are 5 + 4, not 8 + 1). The
/// literals name the instantiated pass sizes; the one after `;` takes the
/// rest (it must be `max`).
#[cfg(target_arch = "x86_64")]
macro_rules! passes {
    ($max:expr, $kernel:ident, $format:expr, $wrow:expr, $act:expr, $t0:expr, $tn:expr, $res:expr;
     $($n:literal)* ; $last:literal) => {{
        for (t, r) in $crate::quant::common::pass_sizes($tn, $max) {
            let out = &mut $res[t..];
            let t1 = $t0 + t;
            // SAFETY: the caller's contract (CPU features, rows inside `act`).
            unsafe {
                match r {
                    $($n => $kernel::<$n>($format, $wrow, $act, t1, out),)*
                    _ => $kernel::<$last>($format, $wrow, $act, t1, out),
                }
            }
        }
    }};
}

/// `$kernel::<R, F>(args)` with `F` the index of `$format` in
/// `types::WHOLE_BLOCK` (any other format: the last).
#[cfg(target_arch = "x86_64")]
macro_rules! whole_block {
    ($format:expr, $kernel:ident::<$r:ident>($($arg:expr),*)) => {
        match $format {
            QuantFormat::Q4_0 => $kernel::<$r, 0>($($arg),*),
            QuantFormat::Q5_0 => $kernel::<$r, 1>($($arg),*),
            QuantFormat::Q8_0 => $kernel::<$r, 2>($($arg),*),
            QuantFormat::Q4_1 => $kernel::<$r, 3>($($arg),*),
            QuantFormat::Q5_1 => $kernel::<$r, 4>($($arg),*),
            _ => $kernel::<$r, 5>($($arg),*),
        }
    };
}

#[cfg(target_arch = "aarch64")]
mod aarch64_neon;
mod act;
mod blocks;
mod combine;
mod common;
mod scalar;
mod tile_layout;
mod types;
#[cfg(target_arch = "x86_64")]
mod x86_amx;
#[cfg(target_arch = "x86_64")]
mod x86_avx2;
#[cfg(target_arch = "x86_64")]
mod x86_avx2_formats;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;
#[cfg(target_arch = "x86_64")]
mod x86_avx512_formats;
#[cfg(target_arch = "x86_64")]
mod x86_avx512_gemm;

pub use common::{AMX_MIN_ROWS_Q4K, AMX_MIN_ROWS_Q6K, GEMM_MIN_ROWS, GEMM_MIN_ROWS_OFFSET};
pub use types::{Isa, QMatrix, QuantFormat, TILE};

use act::{Act, ActKind};
#[cfg(target_arch = "x86_64")]
use common::amx_min_rows;
use types::{OutPtr, RowFn};

// Detecting the paths (the enum and its names are in `types`).
impl Isa {
    /// Whether this CPU can run the path.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Amx => Isa::Avx512Vnni.is_available() && x86_amx::available(),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDotprod => {
                Isa::Neon.is_available() && std::arch::is_aarch64_feature_detected!("dotprod")
            }
            // The other architecture's paths.
            _ => false,
        }
    }

    /// All paths this CPU can run, scalar first.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    /// The fastest available path.
    pub fn best() -> Isa {
        Isa::ALL
            .into_iter()
            .rev()
            .find(|i| i.is_available())
            .unwrap_or(Isa::Scalar)
    }

    /// The path [`matmul`] uses: `TANDEM_ISA` if set to an available path,
    /// else [`Isa::best`]. Read once per process.
    pub fn selected() -> Isa {
        static SELECTED: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *SELECTED.get_or_init(|| match std::env::var("TANDEM_ISA") {
            Ok(v) => match Isa::from_name(&v) {
                Some(isa) if isa.is_available() => isa,
                _ => {
                    let best = Isa::best();
                    tracing::warn!(
                        requested = %v,
                        using = best.name(),
                        "TANDEM_ISA names no path available on this CPU"
                    );
                    best
                }
            },
            Err(_) => Isa::best(),
        })
    }
}

fn act_kind(f: QuantFormat) -> ActKind {
    match f {
        QuantFormat::F32 | QuantFormat::F16 | QuantFormat::BF16 => ActKind::F32,
        QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q5_0x4 | QuantFormat::Q8_0 => {
            ActKind::Q8_0
        }
        QuantFormat::Q4_1 | QuantFormat::Q5_1 => ActKind::Q8_1,
        QuantFormat::Q3K | QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K => ActKind::Q8K,
    }
}

fn row_fn(isa: Isa, f: QuantFormat) -> RowFn {
    fn q4k(_: QuantFormat, w: &[u8], a: &Act, t0: usize, tn: usize, r: &mut [f32; TILE]) {
        scalar::row_q4k(w, a, t0, tn, r)
    }
    fn q6k(_: QuantFormat, w: &[u8], a: &Act, t0: usize, tn: usize, r: &mut [f32; TILE]) {
        scalar::row_q6k(w, a, t0, tn, r)
    }
    fn q5k(_: QuantFormat, w: &[u8], a: &Act, t0: usize, tn: usize, r: &mut [f32; TILE]) {
        scalar::row_q5k(w, a, t0, tn, r)
    }
    fn q3k(_: QuantFormat, w: &[u8], a: &Act, t0: usize, tn: usize, r: &mut [f32; TILE]) {
        scalar::row_q3k(w, a, t0, tn, r)
    }
    let scalar: RowFn = match f {
        QuantFormat::F32 | QuantFormat::F16 | QuantFormat::BF16 => scalar::row_float,
        QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q5_0x4 | QuantFormat::Q8_0 => {
            scalar::row_group
        }
        QuantFormat::Q4_1 | QuantFormat::Q5_1 => scalar::row_group_min,
        QuantFormat::Q3K => q3k,
        QuantFormat::Q4K => q4k,
        QuantFormat::Q5K => q5k,
        QuantFormat::Q6K => q6k,
    };
    match isa {
        Isa::Scalar => scalar,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86_avx2::row_fn(f).unwrap_or(scalar),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni | Isa::Amx => x86_avx512::row_fn(f)
            .or_else(|| x86_avx2::row_fn(f))
            .unwrap_or(scalar),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => aarch64_neon::row_fn(false, f).unwrap_or(scalar),
        #[cfg(target_arch = "aarch64")]
        Isa::NeonDotprod => aarch64_neon::row_fn(true, f).unwrap_or(scalar),
        // The other architecture's paths (never available here).
        _ => scalar,
    }
}

/// What a Q4_K/Q5_K/Q6_K job runs on the `x86_amx` kernels, if anything: the
/// tile steps on [`Isa::Amx`] from its threshold ([`amx_min_rows`]); and
/// for a matrix in the tile layout ([`QMatrix::tiles`]) on AVX-512 VNNI or
/// AMX, every other row count as VNNI sums over the same units (so the
/// file's bytes are never read; same bits either way).
#[cfg(target_arch = "x86_64")]
fn x86_amx_job(isa: Isa, w: &QMatrix, act: &act::Act, m: usize) -> Option<x86_amx::AmxAct> {
    let min = amx_min_rows(w.format)?;
    let tiles = isa == Isa::Amx && m >= min;
    let units = w.tiles.is_some() && matches!(isa, Isa::Amx | Isa::Avx512Vnni);
    (tiles || units).then(|| x86_amx::AmxAct::new(act, w.format, tiles))
}

/// Below this many weight bytes × rows, a call runs on the calling thread.
const SERIAL_WORK: usize = 64 * 1024;
/// Target weight bytes per parallel chunk (fits in L2 with the activations).
const CHUNK_BYTES: usize = 128 * 1024;

/// `out[i * w.rows + j] = dot(x[i * w.cols ..][..w.cols], row j of w)` for `i < m`,
/// on the path chosen by [`Isa::selected`].
///
/// # Panics
/// If `x.len() != m * w.cols` or `out.len() != m * w.rows` (a caller bug).
pub fn matmul(w: &QMatrix, x: &[f32], m: usize, out: &mut [f32]) {
    if let Err(e) = matmul_with_isa(Isa::selected(), w, x, m, out) {
        panic!("quant::matmul: {e}");
    }
}

/// [`matmul`] on an explicit instruction-set path (tests and benchmarks).
/// Errors if the path is not available on this CPU or the shapes disagree.
pub fn matmul_with_isa(isa: Isa, w: &QMatrix, x: &[f32], m: usize, out: &mut [f32]) -> Result<()> {
    matmul_shared_with_isa(isa, &mut [(w, out)], x, m)
}

/// Several matrices over the same input rows (Q, K and V; gate and up):
/// `outs[i] = x · ws[i]ᵀ` as [`matmul`] each, with the input quantized once per
/// activation format instead of once per matrix. Results are those of separate
/// [`matmul`] calls, bit for bit.
///
/// # Panics
/// On shapes that disagree (a caller bug), as [`matmul`].
pub fn matmul_shared(ws: &mut [(&QMatrix, &mut [f32])], x: &[f32], m: usize) {
    if let Err(e) = matmul_shared_with_isa(Isa::selected(), ws, x, m) {
        panic!("quant::matmul_shared: {e}");
    }
}

/// What a matrix of this format needs of its input on `isa`: the activation
/// format and, for the kernels that multiply unsigned weights `w + off`
/// (x86: Q4_0/Q5_0/Q5_0x4 on AVX2 and AVX-512 VNNI, Q8_0 on AVX-512 VNNI),
/// the weight offset (`Act::prepare_unsigned`).
fn act_key(isa: Isa, format: QuantFormat) -> (ActKind, Option<i32>) {
    let kind = act_kind(format);
    let off = match format {
        QuantFormat::Q4_0 => 8,
        QuantFormat::Q5_0 | QuantFormat::Q5_0x4 => 16,
        _ => 128,
    };
    let avx512 = matches!(isa, Isa::Avx512Vnni | Isa::Amx);
    let unsigned = match format {
        QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q5_0x4 => avx512 || isa == Isa::Avx2,
        QuantFormat::Q8_0 => avx512,
        _ => false,
    };
    (kind, unsigned.then_some(off))
}

/// [`matmul_shared`] on an explicit instruction-set path.
pub fn matmul_shared_with_isa(
    isa: Isa,
    ws: &mut [(&QMatrix, &mut [f32])],
    x: &[f32],
    m: usize,
) -> Result<()> {
    if !isa.is_available() {
        return Err(ModelError::InvalidArgument(format!(
            "instruction set {isa} is not available on this CPU"
        )));
    }
    for (w, out) in ws.iter() {
        if x.len() != m * w.cols || out.len() != m * w.rows {
            return Err(ModelError::InvalidArgument(format!(
                "matmul of a {}x{} matrix with {m} rows needs {} inputs and {} outputs, got {} and {}",
                w.rows,
                w.cols,
                m * w.cols,
                m * w.rows,
                x.len(),
                out.len()
            )));
        }
        // Validate the matrix so the kernels can index blocks freely.
        QMatrix::new(w.format, w.rows, w.cols, w.data)?;
    }
    if m == 0 {
        return Ok(());
    }
    let mut acts: Vec<((ActKind, Option<i32>), Act)> = Vec::new();
    for (w, _) in ws.iter() {
        let key = act_key(isa, w.format);
        if w.rows > 0 && !acts.iter().any(|(k, _)| *k == key) {
            let mut act = Act::new(key.0, x, m, w.cols);
            if let Some(off) = key.1 {
                act.prepare_unsigned(off);
            }
            #[cfg(target_arch = "x86_64")]
            if x86_avx2::needs_bsum4(isa, key.0, m) {
                act.prepare_bsum4();
            }
            // The GEMM path's regrouped values, if any matrix of this
            // input runs there.
            #[cfg(target_arch = "x86_64")]
            if ws.iter().any(|(w, _)| {
                w.rows > 0
                    && act_key(isa, w.format) == key
                    && x86_avx512_gemm::applies(isa, w.format, m)
            }) {
                act.qt = x86_avx512_gemm::regroup_act(&act);
            }
            acts.push((key, act));
        }
    }
    let threads = rayon::current_num_threads();
    let jobs: Vec<Job> = ws
        .iter_mut()
        .filter(|(w, _)| w.rows > 0)
        .filter_map(|(w, out)| {
            let key = act_key(isa, w.format);
            let (_, act) = acts.iter().find(|(k, _)| *k == key)?;
            Some(Job::new(isa, w, act, m, out, threads))
        })
        .collect();
    run_jobs(&jobs, threads);
    Ok(())
}

/// One validated matrix × its quantized input (`m` rows) into `out`, run in
/// chunks of weight rows.
struct Job<'a> {
    w: &'a QMatrix<'a>,
    act: &'a Act<'a>,
    m: usize,
    out: OutPtr,
    f: RowFn,
    #[cfg(target_arch = "x86_64")]
    amx: Option<x86_amx::AmxAct>,
    /// Whether the columns run on the GEMM path (`x86_avx512_gemm`).
    #[cfg(target_arch = "x86_64")]
    gemm: bool,
    /// Weight rows per parallel chunk.
    chunk: usize,
}

impl<'a> Job<'a> {
    fn new(
        isa: Isa,
        w: &'a QMatrix<'a>,
        act: &'a Act<'a>,
        m: usize,
        out: &mut [f32],
        threads: usize,
    ) -> Self {
        #[cfg(target_arch = "x86_64")]
        let amx = x86_amx_job(isa, w, act, m);
        // Rows per parallel chunk are a multiple of this (AMX takes 16 weight
        // rows per tile step; the rest of a chunk goes through `f`).
        #[cfg(target_arch = "x86_64")]
        let align = if amx.is_some() { 16 } else { 1 };
        #[cfg(not(target_arch = "x86_64"))]
        let align = 1;
        let rows = w.rows;
        let row_bytes = (w.data.len() / rows.max(1)).max(1);
        let chunk = (CHUNK_BYTES / row_bytes).clamp(1, rows.div_ceil(threads * 2).max(1));
        Self {
            w,
            act,
            m,
            out: OutPtr(out.as_mut_ptr()),
            f: row_fn(isa, w.format),
            #[cfg(target_arch = "x86_64")]
            gemm: amx.is_none() && x86_avx512_gemm::applies(isa, w.format, m),
            #[cfg(target_arch = "x86_64")]
            amx,
            chunk: chunk.next_multiple_of(align),
        }
    }

    fn work(&self) -> usize {
        self.w.data.len().saturating_mul(self.m)
    }

    fn chunks(&self) -> usize {
        self.w.rows.div_ceil(self.chunk)
    }

    /// Output columns (weight rows) `j0..j1`.
    fn run(&self, j0: usize, j1: usize) {
        let (w, act, m, out, rows) = (self.w, self.act, self.m, self.out, self.w.rows);
        #[cfg(target_arch = "x86_64")]
        if self.gemm {
            // SAFETY: `applies` checked the ISA (available: the caller) and
            // the format; the act was built for it (Q8_1: `qt` regrouped by
            // the same `applies`); j0..j1 are this task's columns.
            unsafe { x86_avx512_gemm::run(w, act, j0, j1, out) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        let j0 = match &self.amx {
            Some(amx) => {
                let ng = (j1 - j0) / tile_layout::GROUP;
                // SAFETY: `x86_amx_job` built `amx` for an available ISA
                // (tile steps only on `Isa::Amx`, VNNI sums on AVX-512
                // VNNI or AMX); rows j0..j0 + 16·ng ≤ j1 ≤ rows are this
                // task's columns.
                unsafe {
                    match w.format {
                        QuantFormat::Q4K => x86_amx::q4k_groups::<false>(w, j0, ng, act, amx, out),
                        QuantFormat::Q5K => x86_amx::q4k_groups::<true>(w, j0, ng, act, amx, out),
                        _ => x86_amx::q6k_groups(w, j0, ng, act, amx, out),
                    }
                };
                j0 + ng * tile_layout::GROUP
            }
            None => j0,
        };
        let mut res = [0f32; TILE];
        for t0 in (0..m).step_by(TILE) {
            let tn = TILE.min(m - t0);
            for j in j0..j1 {
                // SAFETY: `f` was chosen for an ISA that `is_available`.
                unsafe { (self.f)(w.format, w.row_data(j), act, t0, tn, &mut res) };
                for (t, &r) in res[..tn].iter().enumerate() {
                    // SAFETY: (t0 + t) < m and j < rows, so the index is inside
                    // `out`; no other task writes column j.
                    unsafe { *out.get().add((t0 + t) * rows + j) = r };
                }
            }
        }
    }

    fn run_chunk(&self, c: usize) {
        self.run(c * self.chunk, self.w.rows.min((c + 1) * self.chunk));
    }
}

/// Run the jobs of one call: on the calling thread when they are small, else
/// as one parallel loop over the chunks of all of them (Q, K and V, or gate
/// and up, cost one fork-join, not one each).
fn run_jobs(jobs: &[Job], threads: usize) {
    if threads <= 1 || jobs.iter().map(Job::work).sum::<usize>() < SERIAL_WORK {
        for j in jobs {
            j.run(0, j.w.rows);
        }
        return;
    }
    use rayon::prelude::*;
    let tasks: Vec<(usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(i, j)| (0..j.chunks()).map(move |c| (i, c)))
        .collect();
    tasks
        .into_par_iter()
        .for_each(|(i, c)| jobs[i].run_chunk(c));
}
