//! What the kernel files of `quant` share besides its types (`types`): the
//! split of a tile into passes, the prefetch hint of the x86 kernels, and
//! the row thresholds of the AMX and GEMM paths (speed choices only: none
//! can change a result). A leaf below the kernels, beside `types`; `quant`
//! re-exports the public thresholds.

#[cfg(target_arch = "x86_64")]
use super::types::QuantFormat;

/// A tile of `tn` rows as passes of at most `max` rows, `(first row, rows)`
/// each, in near-equal sizes (9 rows in passes of 8 are 5 + 4, not 8 + 1).
/// Every kernel that takes a tile in passes splits it here.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(super) fn pass_sizes(tn: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    let passes = tn.div_ceil(max);
    (0..passes).scan(0, move |t, p| {
        let r = (tn - *t).div_ceil(passes - p);
        let first = *t;
        *t += r;
        Some((first, r))
    })
}

/// How far ahead of the weight block being multiplied the SIMD kernels
/// prefetch (bytes). A decode step streams ~1 GB of weights once; a single
/// core keeps too few loads in flight to reach the memory bandwidth from the
/// hardware prefetcher alone. Prefetching 2 KB ahead cut the CPU time of a
/// decode step by ~25 % on both models (docs/model-core.md, "Prefetch");
/// 384–3072 measured alike.
#[cfg(target_arch = "x86_64")]
pub(crate) const PREFETCH_BYTES: usize = 2048;

/// Prefetch `LINES` cache lines starting [`PREFETCH_BYTES`] ahead of `p`.
/// A hint only: it never faults and never changes a result, whatever the
/// address (past the end of the weights included).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_ahead<const LINES: usize>(p: *const u8) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let p = p.wrapping_add(PREFETCH_BYTES);
    for l in 0..LINES {
        // SAFETY: prefetch does not access memory architecturally and does not fault.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * l).cast()) };
    }
}

/// From this many activation rows on, [`Isa::Amx`](super::Isa::Amx) runs
/// Q4_K weights on AMX tiles (below, AVX-512 VNNI: over the tile layout
/// when the matrix has one, else the row kernels; results are identical
/// either way, so the thresholds are a speed choice only). Measured on the
/// 2-thread forward in docs/model-core.md ("AMX, round four": 7 and 8 rows
/// are faster on the VNNI side since it takes 8 rows a pass).
pub const AMX_MIN_ROWS_Q4K: usize = 9;
/// As [`AMX_MIN_ROWS_Q4K`], for Q6_K weights (6 rows a VNNI pass).
pub const AMX_MIN_ROWS_Q6K: usize = 9;

/// The AMX threshold for `format` (`None`: no AMX kernel), or
/// `TANDEM_AMX_MIN_ROWS` if set (a tuning knob for benchmarks; it cannot
/// change a result).
#[cfg(target_arch = "x86_64")]
pub(super) fn amx_min_rows(format: QuantFormat) -> Option<usize> {
    static V: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let env = *V.get_or_init(|| {
        std::env::var("TANDEM_AMX_MIN_ROWS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
    });
    let default = match format {
        QuantFormat::Q4K | QuantFormat::Q5K => AMX_MIN_ROWS_Q4K,
        QuantFormat::Q6K => AMX_MIN_ROWS_Q6K,
        _ => return None,
    };
    Some(env.unwrap_or(default))
}

/// From this many activation rows on,
/// [`Isa::Avx512Vnni`](super::Isa::Avx512Vnni) (and
/// [`Isa::Amx`](super::Isa::Amx), which delegates these formats) runs
/// Q4_0/Q5_0/Q8_0 weights on the GEMM path (each panel of weight rows
/// unpacked once for all rows; docs/model-core.md "GEMM path"). Results
/// are identical either way; the threshold is a speed choice, measured
/// there.
pub const GEMM_MIN_ROWS: usize = 12;
/// As [`GEMM_MIN_ROWS`], for Q4_1/Q5_1 weights. Both thresholds are where
/// the path wins on a matrix streamed from memory (8960×1536: the panel
/// builder does not prefetch, the row kernels do); on matrices that stay
/// in L2 it wins from 2 (Q4_0/Q5_0/Q8_0) and 5 (Q4_1/Q5_1) rows.
pub const GEMM_MIN_ROWS_OFFSET: usize = 8;

/// The GEMM threshold for `format` ([`GEMM_MIN_ROWS`] or
/// [`GEMM_MIN_ROWS_OFFSET`]), or `TANDEM_GEMM_MIN_ROWS` if set (a tuning
/// knob for benchmarks; it cannot change a result).
#[cfg(target_arch = "x86_64")]
pub(super) fn gemm_min_rows(format: QuantFormat) -> usize {
    static V: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let env = *V.get_or_init(|| {
        std::env::var("TANDEM_GEMM_MIN_ROWS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
    });
    env.unwrap_or(match format {
        QuantFormat::Q4_1 | QuantFormat::Q5_1 => GEMM_MIN_ROWS_OFFSET,
        _ => GEMM_MIN_ROWS,
    })
}
