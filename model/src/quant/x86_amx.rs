//! AMX-INT8 kernels for Q4_K/Q5_K/Q6_K weights × blocks of activation rows
//! (x86-64 Sapphire Rapids and later, detected at run time), and their
//! AVX-512 VNNI side for the row counts below the AMX thresholds over the
//! same tile layout ([`unit_groups`]: a matrix in the layout never reads
//! the file's bytes).
//!
//! AMX intrinsics are not stable in Rust, so the tile instructions are
//! written as inline assembly (`ldtilecfg`, `tilezero`, `tileloadd`,
//! `tdpbsud`/`tdpbssd`, `tilestored`, `tilerelease`); everything around them
//! is AVX-512.
//!
//! One tile step = 16 weight rows × 16 activation rows × one super-block
//! (256 values, four tile products of K = 64 per plane):
//! - **A** (16 rows × 64 bytes) = the quantized activations, signed, loaded
//!   from [`AmxAct`]'s copy of `Act::qs` as contiguous 1 KB tiles, padded
//!   with zero rows to a multiple of 16 (one tile configuration for the
//!   whole call: a call of fewer than 16 rows configures exactly its rows,
//!   [`TileCfg::with_rows`]; with more, the last tile's padded rows are
//!   computed and dropped).
//! - **B** (16 rows × 64 bytes) = the weights in AMX's "VNNI" layout (row
//!   `r` holds values `4r..4r+4` of each of the 16 weight rows side by side),
//!   **with each sub-block's scale folded in**: `sc·q` (Q4_K, ≤ 945) or
//!   `sc·(q − 32)` (Q6_K, |·| ≤ 4096) split into a lo plane (u8) and a hi
//!   plane (u8 for Q4_K, i8 for Q6_K), `value = lo + 256·hi`. Unpacked per
//!   super-block of a group of 16 weight rows from its unit of the tile
//!   layout ([`tile_layout`]: the packed bytes already transposed into that
//!   order, the scales as bytes, at load time), so the unpack is nibble/bit
//!   extraction and the products by `vpmaddubsw` on even and odd bytes
//!   ([`times_scale`]). A matrix without a tile layout gets each unit
//!   written as it goes ([`tile_layout::write_unit`]), same bits.
//! - **C** (16 × 16 i32), two accumulators: `C_lo = A·B_lo`, `C_hi = A·B_hi`,
//!   so `S = C_lo + 256·C_hi = Σ_c sc_c · dot_c` exactly.
//!
//! Then, per activation row, with the 16 weight rows as the lanes of one
//! vector: `S` from the two tiles, for Q4_K `M = Σ_c m_c · bsum_c`
//! (`vpdpwssd` on pairs of 16-bit values), and the shared float step of
//! `combine::q4k_step` / `q6k_step`. Results are therefore bit-identical to
//! every other path.
//!
//! Loop order: per group of 16 weight rows, per super-block, every row tile.
//! The unpacked super-block (8 KB) stays in L1 for all row tiles, and the
//! next one is unpacked before this one's tile steps (two buffers). The
//! steps (super-block, row tile) alternate their C buffers, and step
//! `i + 1`'s products are issued before step `i`'s vector
//! work, so the tile unit and the vector units overlap even with one row
//! tile. Why, with the costs measured on a Sapphire Rapids VM:
//! docs/model-core.md, "AMX, round two" and "round three".
//!
//! Before any tile instruction the process must ask the kernel for the AMX
//! state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), or the first
//! tile instruction faults; [`available`] does it once. The tile configuration
//! is per thread: each call of [`q4k_groups`] / [`q6k_groups`] loads it and
//! releases the tiles at its end.

use std::arch::asm;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::act::Act;
use super::tile_layout::{self, GROUP};
use super::types::{OutPtr, QMatrix, QuantFormat};

/// Activation rows per tile step at most (the rows of A and C).
const TN: usize = 16;
/// How many units ahead of the one being unpacked the unpack prefetches
/// (a line per line it loads: a burst of a whole unit's prefetches stalls
/// on the line fill buffers).
const UNIT_AHEAD: usize = 1;

/// Prefetch line `l` of the unit at `ahead` (a hint: never faults).
#[inline(always)]
fn prefetch_line(ahead: *const u8, l: usize) {
    // SAFETY: a prefetch does not access memory architecturally.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * l).cast()) };
}

/// Whether the CPU has AMX-TILE and AMX-INT8, the OS enables the tile state
/// (XCR0 bits 17, 18), and the kernel granted this process the tile data
/// (`arch_prctl`). Checked, and permission requested, once per process.
pub(super) fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        let l1 = __cpuid_count(1, 0);
        let osxsave = l1.ecx & (1 << 27) != 0;
        let l7 = __cpuid_count(7, 0);
        let amx = l7.edx & (1 << 24) != 0 && l7.edx & (1 << 25) != 0;
        if !osxsave || !amx {
            return false;
        }
        let (lo, _hi): (u32, u32);
        // SAFETY: xgetbv is available when CPUID reports OSXSAVE.
        unsafe {
            asm!("xgetbv", in("ecx") 0u32, out("eax") lo, out("edx") _hi,
                 options(nomem, nostack, preserves_flags));
        }
        if lo & (3 << 17) != 3 << 17 {
            return false;
        }
        const SYS_ARCH_PRCTL: i64 = 158;
        const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
        const XFEATURE_XTILEDATA: i64 = 18;
        let rc: i64;
        // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) only changes the process's
        // permission to use the tile state; it reads and writes no memory.
        unsafe {
            asm!("syscall",
                 inlateout("rax") SYS_ARCH_PRCTL => rc,
                 in("rdi") ARCH_REQ_XCOMP_PERM, in("rsi") XFEATURE_XTILEDATA,
                 lateout("rcx") _, lateout("r11") _, options(nostack));
        }
        rc == 0
    })
}

/// Palette-1 tile configuration: all eight tiles 64 bytes wide; the B
/// tiles (tmm4–tmm7, [`planes`]) 16 rows, the A and C tiles (tmm0–tmm3)
/// `rows` rows.
#[repr(C, align(64))]
struct TileCfg([u8; 64]);

impl TileCfg {
    /// `rows` (1..=16): the activation rows of every tile step. A tile
    /// product costs about its A rows (AMX VM, 8 products: 106 TSC cycles
    /// at 16 rows, 86 at 9, 60–66 at 8 and fewer), so a call of fewer than
    /// 16 rows configures exactly its rows instead of computing padding.
    fn with_rows(rows: usize) -> Self {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
            c[48 + t] = if t < 4 {
                rows.clamp(1, TN) as u8
            } else {
                TN as u8
            };
        }
        TileCfg(c)
    }

    /// Load this configuration on the current thread.
    ///
    /// # Safety
    /// [`available`] returned true.
    unsafe fn load(&self) {
        // SAFETY: a valid palette-1 configuration; AMX is enabled (caller).
        unsafe { asm!("ldtilecfg [{}]", in(reg) self.0.as_ptr(), options(nostack, readonly)) };
    }
}

/// Releases the tiles of the current thread on drop.
struct Release;

impl Drop for Release {
    fn drop(&mut self) {
        // SAFETY: only constructed after a successful `TileCfg::load` on
        // this thread; `tilerelease` with no configuration is also harmless.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// What the tile kernels need of the activations, built once per matmul:
/// the quantized rows as contiguous tiles ([`tiles_of`]), padded with zero
/// rows to a multiple of 16, so every
/// tile step runs with the same 16-row configuration (rows past `m` are
/// computed and dropped), and for Q4_K weights the min sums in pairs:
/// `bsp[(t·nb + sb)·4 + p]` = 32-element sums of chunks `2p` (low 16 bits)
/// and `2p + 1` (high 16 bits); |sum| ≤ 32·128 = 4096 fits i16.
/// Without tile steps (the VNNI side of the tile layout, [`unit_groups`])
/// only the min sums.
pub(super) struct AmxAct {
    /// `None`: `S` by VNNI ([`unit_groups`]), not by tile steps.
    a_tiles: Option<Vec<i8>>,
    bsp: Vec<i32>,
}

/// The activations as A tiles, each contiguous: tile `(rt, kc)` (rows
/// `16·rt..16·rt + 16`, columns `64·kc..64·kc + 64`, rows past `m` zero) at
/// `(rt · cols/64 + kc) · 1024`, its rows 64 bytes apart. A tile step then
/// loads 1 KB in a row instead of 16 rows `cols` apart.
fn tiles_of(act: &Act) -> Vec<i8> {
    let (m, cols) = (act.m, act.cols);
    let steps = cols / 64;
    let mut t = vec![0i8; m.div_ceil(TN) * TN * cols];
    for (row, x) in act.qs.chunks_exact(cols).enumerate().take(m) {
        let (rt, r) = (row / TN, row % TN);
        for (kc, v) in x.chunks_exact(64).enumerate() {
            let at = (rt * steps + kc) * 1024 + r * 64;
            t[at..at + 64].copy_from_slice(v);
        }
    }
    t
}

impl AmxAct {
    /// `tiles`: run the tile steps ([`available`] must hold), else the
    /// VNNI sums over the same units.
    pub(super) fn new(act: &Act, format: QuantFormat, tiles: bool) -> Self {
        let a_tiles = tiles.then(|| tiles_of(act));
        if !matches!(format, QuantFormat::Q4K | QuantFormat::Q5K) {
            return AmxAct {
                a_tiles,
                bsp: Vec::new(),
            };
        }
        let nb = act.nb;
        let mut bsp = vec![0i32; act.m * nb * 4];
        for t in 0..act.m {
            let bs = act.row_bsums(t);
            for sb in 0..nb {
                let s = |c: usize| bs[sb * 16 + 2 * c] as i32 + bs[sb * 16 + 2 * c + 1] as i32;
                for p in 0..4 {
                    let lo = s(2 * p) as u16 as u32;
                    let hi = s(2 * p + 1) as u16 as u32;
                    bsp[(t * nb + sb) * 4 + p] = (lo | hi << 16) as i32;
                }
            }
        }
        AmxAct { a_tiles, bsp }
    }

    /// Whether this call runs the tile steps.
    pub(super) fn tiles(&self) -> bool {
        self.a_tiles.is_some()
    }
}

/// 64-byte aligned scratch.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Aligned<T>(T);

/// Tile products over one super-block (K = 256 in four steps of 64):
/// `C_lo = A · B_lo` stored to `c`, `C_hi = A · B_hi` to `c + 1024` bytes.
/// A at `a` + 1024 bytes per step ([`tiles_of`]), `B_lo` at `b`, `B_hi` at `b + 4096` (16 rows of
/// 64 bytes per step, stride 64). `HI_SIGNED`: `B_hi` is signed
/// (`tdpbssd`), else unsigned (`tdpbsud`); `B_lo` is always unsigned.
/// Accumulators tmm0/tmm1; the operands of chunks 0 and 2 in tmm2 (A),
/// tmm4 (B_lo), tmm6 (B_hi), of chunks 1 and 3 in tmm3/5/7, so each load
/// waits only for the products two chunks back (tile registers are not
/// renamed). Measured against alternating accumulator pairs between steps
/// with four operand tiles: 1–3 % faster at 3–16 rows.
///
/// # Safety
/// Tiles configured by [`TileCfg::with_rows`];
/// every tile inside its buffer.
#[inline(always)]
unsafe fn planes<const HI_SIGNED: bool>(a: *const i8, b: *const u8, c: *mut i32) {
    macro_rules! body {
        ($hi:literal) => {
            // SAFETY: caller.
            unsafe {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tileloadd tmm2, [{a}+{s64}*1]",
                    "tileloadd tmm4, [{b}+{s64}*1]",
                    "tileloadd tmm6, [{b}+{s64}*1+4096]",
                    "tileloadd tmm3, [{a}+{s64}*1+1024]",
                    "tileloadd tmm5, [{b}+{s64}*1+1024]",
                    "tileloadd tmm7, [{b}+{s64}*1+5120]",
                    "tdpbsud tmm0, tmm2, tmm4",
                    concat!($hi, " tmm1, tmm2, tmm6"),
                    "tileloadd tmm2, [{a}+{s64}*1+2048]",
                    "tileloadd tmm4, [{b}+{s64}*1+2048]",
                    "tileloadd tmm6, [{b}+{s64}*1+6144]",
                    "tdpbsud tmm0, tmm3, tmm5",
                    concat!($hi, " tmm1, tmm3, tmm7"),
                    "tileloadd tmm3, [{a}+{s64}*1+3072]",
                    "tileloadd tmm5, [{b}+{s64}*1+3072]",
                    "tileloadd tmm7, [{b}+{s64}*1+7168]",
                    "tdpbsud tmm0, tmm2, tmm4",
                    concat!($hi, " tmm1, tmm2, tmm6"),
                    "tdpbsud tmm0, tmm3, tmm5",
                    concat!($hi, " tmm1, tmm3, tmm7"),
                    "tilestored [{c}+{s64}*1], tmm0",
                    "tilestored [{c}+{s64}*1+1024], tmm1",
                    a = in(reg) a,
                    b = in(reg) b,
                    c = in(reg) c,
                    s64 = in(reg) 64usize,
                    options(nostack),
                )
            }
        };
    }
    match HI_SIGNED {
        false => body!("tdpbsud"),
        true => body!("tdpbssd"),
    }
}

/// `S` of activation row `t` (16 weight rows as lanes) from the two C tiles
/// [`planes`] stored at `cb`: `C_lo + 256·C_hi` (exact).
///
/// # Safety
/// `cb` holds the two tiles (2 × 256 i32), `t < 16`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn plane_sum(cb: *const i32, t: usize) -> __m512i {
    // SAFETY: caller.
    let (lo, hi) = unsafe {
        (
            _mm512_load_si512(cb.add(16 * t).cast()),
            _mm512_load_si512(cb.add(256 + 16 * t).cast()),
        )
    };
    _mm512_add_epi32(lo, _mm512_slli_epi32::<8>(hi))
}

/// The two planes of `q · sc` per byte: `q` (16 weight rows side by side,
/// dword lane `j` = 4 bytes of row `j`, each 0..63 as u8) times that row's
/// scale, given as `se` (dword lane `j` = bytes `[sc, 0, sc, 0]`, `sc` an
/// i8) and `so = se << 8` (`[0, sc, 0, sc]`), minus `sub` (16-bit lanes,
/// subtracted from each product) when `SIGNED`. Returns `(lo, hi)` with
/// `q·sc − sub = lo + 256·hi`: `lo` the low byte (u8), `hi` the high byte
/// (`SIGNED`: i8, by an arithmetic shift; else the product is known
/// non-negative and below 2^15, and `hi` is u8). Exact: |q·sc| ≤ 63·128
/// fits the 16-bit lanes of `vpmaddubsw` without saturating.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn times_scale<const SIGNED: bool>(
    q: __m512i,
    se: __m512i,
    so: __m512i,
    sub: __m512i,
) -> (__m512i, __m512i) {
    let (mut even, mut odd) = (_mm512_maddubs_epi16(q, se), _mm512_maddubs_epi16(q, so));
    if SIGNED {
        even = _mm512_sub_epi16(even, sub);
        odd = _mm512_sub_epi16(odd, sub);
    }
    let low_bytes = _mm512_set1_epi16(0x00FF);
    // lo: even's low byte, odd's low byte above it.
    let lo = _mm512_ternarylogic_epi32::<0xEA>(even, low_bytes, _mm512_slli_epi16::<8>(odd));
    // hi: even's high byte (SIGNED: with its sign), odd's high byte.
    let even_hi = if SIGNED {
        _mm512_and_si512(_mm512_srai_epi16::<8>(even), low_bytes)
    } else {
        _mm512_srli_epi16::<8>(even)
    };
    let hi = _mm512_ternarylogic_epi32::<0xEA>(odd, _mm512_set1_epi16(0xFF00u16 as i16), even_hi);
    (lo, hi)
}

/// `se` and `so` of [`times_scale`] from scales as i32 lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn scale_bytes(sc: __m512i) -> (__m512i, __m512i) {
    let b = _mm512_and_si512(sc, _mm512_set1_epi32(0xFF));
    let se = _mm512_or_si512(b, _mm512_slli_epi32::<16>(b));
    (se, _mm512_slli_epi32::<8>(se))
}

/// The lo and hi planes of one Q4_K unit (`Q5`: Q5_K; [`tile_layout`])
/// into `o` ([`PLANES`] bytes, the B tiles of [`planes`]): per transposed
/// `qs` vector, its two nibbles (with Q5_K's fifth bits) times their
/// sub-blocks' scales (`sc·q ≤ 63·31`: the hi plane u8).
///
/// # Safety
/// AVX-512 (F/BW); a whole unit readable at `unit`; `o` 64-byte aligned
/// with [`PLANES`] writable bytes.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
unsafe fn unpack_q4k<const Q5: bool>(unit: *const u8, o: *mut u8, ahead: *const u8) {
    let lo4 = _mm512_set1_epi8(0xF);
    let zero = _mm512_setzero_si512();
    let off = tile_layout::k4_offsets(Q5);
    let lines = off.lines;
    // SAFETY: reads inside the unit (qs, qh, scales), writes inside `o`
    // (caller).
    unsafe {
        let scale = |c: usize| {
            scale_bytes(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                unit.add(off.sc + 16 * c).cast(),
            )))
        };
        for cc in 0..4 {
            let (sel, sol) = scale(2 * cc);
            let (seh, soh) = scale(2 * cc + 1);
            for r in 0..8 {
                // The unit's lines at `ahead`, spread over the 32 loads.
                let i = 8 * cc + r;
                for l in i * lines / 32..(i + 1) * lines / 32 {
                    prefetch_line(ahead, l);
                }
                let (l, h) = q4k_nibbles::<Q5>(unit, cc, r, lo4);
                for (half, q, se, so) in [(0, l, sel, sol), (1, h, seh, soh)] {
                    let (plo, phi) = times_scale::<false>(q, se, so, zero);
                    let at = (2 * cc + half) * 512 + 64 * r;
                    _mm512_store_si512(o.add(at).cast(), plo);
                    _mm512_store_si512(o.add(4096 + at).cast(), phi);
                }
            }
        }
    }
}

/// The values of `qs` vector `(cc, r)` of a Q4_K unit (`Q5`: Q5_K, the
/// fifth bits from its `qh` vector `r`): the low nibbles (sub-block
/// `2cc`) and the high ones (`2cc + 1`), u8 bytes.
///
/// # Safety
/// AVX-512 (F/BW); a whole unit readable at `unit`; `cc < 4`, `r < 8`.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
unsafe fn q4k_nibbles<const Q5: bool>(
    unit: *const u8,
    cc: usize,
    r: usize,
    lo4: __m512i,
) -> (__m512i, __m512i) {
    // SAFETY: inside the unit (caller).
    let v = unsafe { _mm512_loadu_si512(unit.add(64 * (8 * cc + r)).cast()) };
    let l = _mm512_and_si512(v, lo4);
    let h = _mm512_and_si512(_mm512_srli_epi16::<4>(v), lo4);
    if !Q5 {
        return (l, h);
    }
    // SAFETY: the qh chunk at 2048..2560 of a Q5_K unit (caller).
    let qh = unsafe { _mm512_loadu_si512(unit.add(2048 + 64 * r).cast()) };
    let sixteen = _mm512_set1_epi8(16);
    let bit = |b: usize| {
        let m = _mm512_test_epi8_mask(qh, _mm512_set1_epi8(1i8 << b));
        _mm512_maskz_mov_epi8(m, sixteen)
    };
    (
        _mm512_or_si512(l, bit(2 * cc)),
        _mm512_or_si512(h, bit(2 * cc + 1)),
    )
}

/// Bytes of the two planes of one unpacked super-block.
const PLANES: usize = 8192;
/// Bytes of the largest unit (scratch for matrices without a layout).
const MAX_UNIT: usize = tile_layout::Q6K_UNIT;

/// Q4_K: weight rows `j0..j0 + 16·ng` (groups of 16) × all activation rows.
///
/// Each sub-block's scale is folded into the weights when they are unpacked
/// (`sc·q ≤ 945 = lo + 256·hi`, two u8 planes), so a super-block is two
/// tile products over all 256 values and `S = C_lo + 256·C_hi` exactly, the
/// same integer the scalar path forms as `Σ_c sc_c · dot_c`. The mins,
/// `d` and `dmin` are read from the unit as they are.
///
/// # Safety
/// [`available`] and AVX-512 (F/BW/VL/VNNI); `w` a Q4_K matrix of
/// `act.nb` blocks per row, `j0` a multiple of 16, `j0 + 16·ng ≤ w.rows`;
/// `out` as in `matmul`, columns `j0..j0 + 16·ng` owned by this task.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q4k_groups<const Q5: bool>(
    w: &QMatrix,
    j0: usize,
    ng: usize,
    act: &Act,
    amx: &AmxAct,
    out: OutPtr,
) {
    let nb = act.nb;
    let kind = if Q5 {
        tile_layout::Kind::Q5K
    } else {
        tile_layout::Kind::Q4K
    };
    let unpack = |unit: *const u8, o: *mut u8, ahead: *const u8| {
        // SAFETY: `tile_groups` passes a whole unit and a plane buffer.
        unsafe { unpack_q4k::<Q5>(unit, o, ahead) }
    };
    let post = |u: *const u8, cb: *const i32, sb: usize, t0: usize, acc: &mut [__m512]| {
        // SAFETY: min pairs and d/dmin inside the unit `u`; C rows t < 16
        // inside `cb`; rows t0 + t < m (`acc` holds only those).
        unsafe {
            // Lane j of pair p: m_2p | m_(2p+1) << 16 of row j.
            let off = tile_layout::k4_offsets(Q5);
            let mins =
                |c: usize| _mm512_cvtepu8_epi32(_mm_loadu_si128(u.add(off.mn + 16 * c).cast()));
            let mp: [__m512i; 4] = std::array::from_fn(|p| {
                _mm512_or_si512(mins(2 * p), _mm512_slli_epi32::<16>(mins(2 * p + 1)))
            });
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(u.add(off.d).cast()));
            let dmv = _mm512_cvtph_ps(_mm256_loadu_si256(u.add(off.dmin).cast()));
            for (t, acc) in acc.iter_mut().enumerate() {
                let row = t0 + t;
                let s = plane_sum(cb, t);
                let bp = amx.bsp.as_ptr().add((row * nb + sb) * 4);
                let mut mm = _mm512_setzero_si512();
                for (p, mp) in mp.iter().enumerate() {
                    mm = _mm512_dpwssd_epi32(mm, *mp, _mm512_set1_epi32(*bp.add(p)));
                }
                let dx = _mm512_set1_ps(*act.d.as_ptr().add(row * nb + sb));
                // combine::q4k_step, lanes = weight rows.
                let dd = _mm512_mul_ps(dv, dx);
                let dm = _mm512_mul_ps(dmv, dx);
                let p = _mm512_sub_ps(
                    _mm512_mul_ps(dd, _mm512_cvtepi32_ps(s)),
                    _mm512_mul_ps(dm, _mm512_cvtepi32_ps(mm)),
                );
                *acc = _mm512_add_ps(*acc, p);
            }
        }
    };
    // SAFETY: the caller's contract.
    unsafe {
        if amx.tiles() {
            tile_groups::<false>(w, kind, j0, ng, act, amx, out, unpack, post)
        } else {
            unit_groups(w, kind, j0, ng, act, out, Q4kSums::<Q5>, post)
        }
    }
}

/// The loop shared by [`q4k_groups`] and [`q6k_groups`]: per group of 16
/// weight rows, per super-block, every tile of 16 activation rows, as one
/// pipeline of steps across the call's groups (the order is explained in
/// the loop).
///
/// - The super-block's unit comes from the matrix's tile layout
///   (`w.tiles`), or is written into one of three scratch units
///   ([`tile_layout::write_unit`]) when the matrix has none.
/// - `unpack` turns a unit into the B planes, two units ahead into the
///   third of three buffers, so no tile load reads planes just stored; the
///   unpacked super-block (8 KB) stays in L1 for every row tile.
/// - The plane products ([`planes`], hi plane signed when `SIGNED`) of
///   step `i + 1` are issued before `post(unit, C, sb, t0, acc rows)` of
///   step `i`; after a group's last step its 16 columns are written to
///   `out`.
///
/// # Safety
/// As [`q4k_groups`]; `unpack` and `post` as those two pass them; `kind`
/// is `w.format`'s.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_groups<const SIGNED: bool>(
    w: &QMatrix,
    kind: tile_layout::Kind,
    j0: usize,
    ng: usize,
    act: &Act,
    amx: &AmxAct,
    out: OutPtr,
    unpack: impl Fn(*const u8, *mut u8, *const u8),
    post: impl Fn(*const u8, *const i32, usize, usize, &mut [__m512]),
) {
    let (m, nb, cols, rows) = (act.m, act.nb, act.cols, w.rows);
    let tiles = m.div_ceil(TN);
    let Some(a_tiles) = &amx.a_tiles else {
        return;
    };
    // The plane buffers are written by `unpack` before any tile load reads
    // them, and a C buffer's rows by the tile stores before `post` reads
    // them: never read uninitialized, so not zeroed (38 KB a call, ~200
    // calls a layer).
    let mut wbuf: [MaybeUninit<Aligned<[u8; PLANES]>>; 3] = [const { MaybeUninit::uninit() }; 3];
    let unit_len = kind.unit_bytes();
    // Only for a matrix without a tile layout.
    let mut scratch = match w.tiles {
        Some(_) => Vec::new(),
        None => vec![Aligned([0u8; MAX_UNIT]); 3],
    };
    let mut cbuf = MaybeUninit::<Aligned<[i32; 2 * 2 * 256]>>::uninit();
    // Written by the tile stores, read by `post`: one raw pointer for both.
    let cbp = cbuf.as_mut_ptr().cast::<i32>();
    let mut acc = vec![_mm512_setzero_ps(); m];
    // This call's units in order: u = (g − g0)·nb + sb.
    let (g0, units_n) = (j0 / GROUP, ng * nb);
    // Unit u, and where to prefetch from while unpacking it (the unit
    // `UNIT_AHEAD` further in the layout); in scratch slot u % 3 when the
    // matrix has no tile layout.
    let mut unit = |u: usize| -> (*const u8, *const u8) {
        let (g, sb) = (g0 + u / nb, u % nb);
        match w.tiles {
            // Inside the layout: g < rows / 16, sb < nb (`with_tiles`
            // checked its size).
            Some(t) => {
                let p = t[(g * nb + sb) * unit_len..(g * nb + sb + 1) * unit_len].as_ptr();
                (p, p.wrapping_add(UNIT_AHEAD * unit_len))
            }
            None => {
                let s = &mut scratch[u % 3].0[..unit_len];
                tile_layout::write_unit(kind, nb, w.data, g, sb, s);
                (s.as_ptr(), s.as_ptr())
            }
        }
    };
    let _release = Release;
    // SAFETY: the caller checked `available`.
    // One row tile: exactly its rows (the padding rows are neither loaded
    // nor computed); more: every tile 16 rows, the last one's padding
    // computed and dropped.
    unsafe { TileCfg::with_rows(if tiles == 1 { m } else { TN }).load() };
    // Steps (unit u, row tile rt) in order i = u·tiles + rt, across the
    // groups of the call. The products of step i + 1 are issued before the
    // vector work of step i (alternate C buffers by the parity of i), so
    // the tile unit works while the vector units do,
    // also with one row tile. Unit u + 2 is unpacked at step (u, 0) into
    // the third buffer: no tile load reads planes stored in the same step
    // (they would wait for the stores to drain).
    let steps = units_n * tiles;
    let mut units = [std::ptr::null(); 3];
    for u in 0..units_n.min(2) {
        let (p, ahead) = unit(u);
        units[u] = p;
        unpack(p, wbuf[u].as_mut_ptr().cast(), ahead);
    }
    let issue = |i: usize, wbuf: &[MaybeUninit<Aligned<[u8; PLANES]>>; 3]| {
        let (u, rt) = (i / tiles, i % tiles);
        let wp = wbuf[u % 3].as_ptr().cast::<u8>();
        let c = cbp.wrapping_add(512 * (i & 1));
        // SAFETY: A: the four 1 KB tiles (rt, 4·sb + k) inside `a_tiles`
        // (`tiles_of`); B: 16 rows of 64 bytes at 1024·k (+ 4096) inside
        // `wp`; C: 2 KB inside `cbuf`.
        unsafe {
            let a = a_tiles
                .as_ptr()
                .add((rt * (cols / 64) + (u % nb) * 4) * 1024);
            planes::<SIGNED>(a, wp, c);
        }
    };
    if steps > 0 {
        issue(0, &wbuf);
    }
    for i in 0..steps {
        let (u, rt) = (i / tiles, i % tiles);
        if rt == 0 && u + 2 < units_n {
            // Its buffer's last reader, step (u − 1, tiles − 1), was issued
            // before this step.
            let (p, ahead) = unit(u + 2);
            units[(u + 2) % 3] = p;
            unpack(p, wbuf[(u + 2) % 3].as_mut_ptr().cast(), ahead);
        }
        if i + 1 < steps {
            issue(i + 1, &wbuf);
        }
        let cb = cbp.wrapping_add(512 * (i & 1)).cast_const();
        let t0 = rt * TN;
        let end = (t0 + TN).min(m);
        let sb = u % nb;
        post(units[u % 3], cb, sb, t0, &mut acc[t0..end]);
        if rt + 1 == tiles && sb + 1 == nb {
            let jg = (g0 + u / nb) * GROUP;
            for (row, a) in acc.iter_mut().enumerate() {
                // SAFETY: columns jg..jg+16 are this task's; row < m.
                unsafe { _mm512_storeu_ps(out.get().add(row * rows + jg), *a) };
                *a = _mm512_setzero_ps();
            }
        }
    }
}

/// The 6-bit values (u8, 0..63) of B rows `32h + 8qq + r` (`qq` = 0..4,
/// the array index) of a Q6_K unit: K positions `4·(32h + 8qq + r)..+4`
/// of each of the 16 weight rows, from its transposed `ql`/`qh` vectors.
///
/// # Safety
/// AVX-512 (F/BW); [`tile_layout::Q6K_UNIT`] readable bytes at `unit`;
/// `h < 2`, `r < 8`.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
unsafe fn q6_values(unit: *const u8, h: usize, r: usize) -> [__m512i; 4] {
    let lo4 = _mm512_set1_epi8(0xF);
    let m3 = _mm512_set1_epi8(3);
    let m30 = _mm512_set1_epi8(0x30);
    // SAFETY: inside the unit's ql/qh part (caller).
    let at = |part: usize| unsafe {
        _mm512_loadu_si512(unit.add(1536 * h + 512 * part + 64 * r).cast())
    };
    let (l0, l1, q) = (at(0), at(1), at(2));
    [
        _mm512_or_si512(
            _mm512_and_si512(l0, lo4),
            _mm512_slli_epi16::<4>(_mm512_and_si512(q, m3)),
        ),
        _mm512_or_si512(
            _mm512_and_si512(l1, lo4),
            _mm512_and_si512(_mm512_slli_epi16::<2>(q), m30),
        ),
        _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(l0), lo4),
            _mm512_and_si512(q, m30),
        ),
        _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(l1), lo4),
            _mm512_and_si512(_mm512_srli_epi16::<2>(q), m30),
        ),
    ]
}

/// The lo and hi planes of one Q6_K unit ([`tile_layout`]) into `o`
/// ([`PLANES`] bytes): per value `sc·(q − 32)`, the lo plane u8, the hi
/// plane i8.
///
/// # Safety
/// AVX-512 (F/BW); [`tile_layout::Q6K_UNIT`] readable bytes at `unit`; `o`
/// 64-byte aligned with [`PLANES`] writable bytes.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
unsafe fn unpack_q6k(unit: *const u8, o: *mut u8, ahead: *const u8) {
    // SAFETY: reads inside the unit (ql/qh 0..3072, scales 3072..3328),
    // writes inside `o` (caller).
    unsafe {
        // Per scale group c (16 values, 4 B rows): `times_scale`'s se, so
        // and 32·sc in both 16-bit halves (|32·sc| ≤ 4096).
        let scales: [(__m512i, __m512i, __m512i); 16] = std::array::from_fn(|c| {
            let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(unit.add(3072 + 16 * c).cast()));
            let (se, so) = scale_bytes(sc);
            let t = _mm512_slli_epi32::<5>(sc);
            let sub = _mm512_or_si512(
                _mm512_and_si512(t, _mm512_set1_epi32(0xFFFF)),
                _mm512_slli_epi32::<16>(t),
            );
            (se, so, sub)
        });
        for h in 0..2 {
            for r in 0..8 {
                // The unit's 53 lines at `ahead`, one per load here.
                for part in 0..3 {
                    prefetch_line(ahead, 24 * h + 8 * part + r);
                }
                if h == 0 && r < 5 {
                    prefetch_line(ahead, 48 + r);
                }
                let e = q6_values(unit, h, r);
                for (qq, e) in e.iter().enumerate() {
                    let row = 32 * h + 8 * qq + r;
                    let (se, so, sub) = scales[row / 4];
                    let (plo, phi) = times_scale::<true>(*e, se, so, sub);
                    _mm512_store_si512(o.add(64 * row).cast(), plo);
                    _mm512_store_si512(o.add(4096 + 64 * row).cast(), phi);
                }
            }
        }
    }
}

/// Q6_K: as [`q4k_groups`] (the scale of each 16-value group folded into
/// `q − 32`, `|sc·(q − 32)| ≤ 4096 = lo + 256·hi` with a signed hi plane:
/// `tdpbssd`).
///
/// # Safety
/// As [`q4k_groups`], for a Q6_K matrix.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q6k_groups(
    w: &QMatrix,
    j0: usize,
    ng: usize,
    act: &Act,
    amx: &AmxAct,
    out: OutPtr,
) {
    let nb = act.nb;
    let unpack = |unit: *const u8, o: *mut u8, ahead: *const u8| {
        // SAFETY: `tile_groups` passes a whole unit and a plane buffer.
        unsafe { unpack_q6k(unit, o, ahead) }
    };
    let post = |u: *const u8, cb: *const i32, sb: usize, t0: usize, acc: &mut [__m512]| {
        // SAFETY: d inside the unit `u`; C rows t < 16 inside `cb`; rows
        // t0 + t < m.
        unsafe {
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(u.add(3328).cast()));
            for (t, acc) in acc.iter_mut().enumerate() {
                let s = plane_sum(cb, t);
                let dx = _mm512_set1_ps(*act.d.as_ptr().add((t0 + t) * nb + sb));
                // combine::q6k_step, lanes = weight rows.
                let dd = _mm512_mul_ps(dv, dx);
                *acc = _mm512_add_ps(*acc, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(s)));
            }
        }
    };
    // SAFETY: the caller's contract.
    unsafe {
        if amx.tiles() {
            tile_groups::<true>(
                w,
                tile_layout::Kind::Q6K,
                j0,
                ng,
                act,
                amx,
                out,
                unpack,
                post,
            )
        } else {
            unit_groups(w, tile_layout::Kind::Q6K, j0, ng, act, out, Q6kSums, post)
        }
    }
}

/// The VNNI side of the tile layout: below the AMX thresholds, the same
/// units give `S` by `vpdpbusd` (16 weight rows as lanes, four activation
/// bytes broadcast), one activation row at a time, into the `C_lo` rows of
/// a C buffer whose `C_hi` stays zero; then the same `post` as the tile
/// steps. So a matrix held in the tile layout never reads the file's
/// bytes (rows past the last whole group of 16 aside), and the two paths
/// share every float step.
///
/// `sums` gives the `S` of up to [`UnitSums::MAX_ROWS`] rows for the unit's 16
/// weight rows ([`UnitSums`]), stored as rows of `C_lo`.
///
/// # Safety
/// As [`q4k_groups`]; `sums` and `post` as those of [`q4k_groups`] /
/// [`q6k_groups`]; `kind` is `w.format`'s.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn unit_groups<S: UnitSums>(
    w: &QMatrix,
    kind: tile_layout::Kind,
    j0: usize,
    ng: usize,
    act: &Act,
    out: OutPtr,
    sums: S,
    post: impl Fn(*const u8, *const i32, usize, usize, &mut [__m512]),
) {
    let (m, nb, rows) = (act.m, act.nb, w.rows);
    let mut scratch = Aligned([0u8; MAX_UNIT]);
    let unit_len = kind.unit_bytes();
    // C_lo rows hold S; C_hi stays zero (`plane_sum` = S).
    let mut cbuf = Aligned([0i32; 2 * 256]);
    let cbp = cbuf.0.as_mut_ptr();
    let mut acc = vec![_mm512_setzero_ps(); m];
    for g in j0 / GROUP..j0 / GROUP + ng {
        for sb in 0..nb {
            let (u, ahead) = match w.tiles {
                // Inside the layout (`with_tiles` checked its size).
                Some(t) => {
                    let p = t[(g * nb + sb) * unit_len..(g * nb + sb + 1) * unit_len].as_ptr();
                    (p, p.wrapping_add(UNIT_AHEAD * unit_len))
                }
                None => {
                    tile_layout::write_unit(kind, nb, w.data, g, sb, &mut scratch.0[..unit_len]);
                    (scratch.0.as_ptr(), scratch.0.as_ptr())
                }
            };
            for t0 in (0..m).step_by(TN) {
                let tn = TN.min(m - t0);
                for t in (0..tn).step_by(S::MAX_ROWS) {
                    // Prefetch with the first rows only.
                    let ahead = if t == 0 { ahead } else { u };
                    let (t1, c) = (t0 + t, cbp.wrapping_add(16 * t));
                    // Rows t..t + n < 16 of C_lo, inside `cbuf`.
                    let store = |v: &[__m512i]| {
                        for (i, v) in v.iter().enumerate() {
                            // SAFETY: as above.
                            unsafe { _mm512_store_si512(c.add(16 * i).cast(), *v) };
                        }
                    };
                    // SAFETY: a whole unit at `u`; rows t1..t1 + n < m.
                    unsafe {
                        match (tn - t).min(S::MAX_ROWS) {
                            1 => store(&sums.sums::<1>(u, ahead, act, sb, t1)),
                            2 => store(&sums.sums::<2>(u, ahead, act, sb, t1)),
                            3 => store(&sums.sums::<3>(u, ahead, act, sb, t1)),
                            4 => store(&sums.sums::<4>(u, ahead, act, sb, t1)),
                            5 => store(&sums.sums::<5>(u, ahead, act, sb, t1)),
                            6 => store(&sums.sums::<6>(u, ahead, act, sb, t1)),
                            7 => store(&sums.sums::<7>(u, ahead, act, sb, t1)),
                            _ => store(&sums.sums::<8>(u, ahead, act, sb, t1)),
                        }
                    }
                }
                post(u, cbp.cast_const(), sb, t0, &mut acc[t0..t0 + tn]);
            }
        }
        let jg = g * GROUP;
        for (row, a) in acc.iter_mut().enumerate() {
            // SAFETY: columns jg..jg+16 are this task's; row < m.
            unsafe { _mm512_storeu_ps(out.get().add(row * rows + jg), *a) };
            *a = _mm512_setzero_ps();
        }
    }
}

/// Four activation bytes at `p` broadcast to every dword lane.
///
/// # Safety
/// Four readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bcast4(p: *const i8) -> __m512i {
    // SAFETY: caller.
    _mm512_set1_epi32(unsafe { p.cast::<i32>().read_unaligned() })
}

/// The VNNI sums of one format for [`unit_groups`]: `S` of activation rows
/// `t0..t0 + N` × one unit (lanes = its 16 weight rows).
trait UnitSums {
    /// Activation rows per [`UnitSums::sums`] call at most (1..=8): each
    /// weight vector is unpacked once for them, so as many as the
    /// registers hold without spilling.
    const MAX_ROWS: usize;

    /// # Safety
    /// As [`sums_q4k`], for a unit of this format.
    unsafe fn sums<const N: usize>(
        &self,
        unit: *const u8,
        ahead: *const u8,
        act: &Act,
        sb: usize,
        t0: usize,
    ) -> [__m512i; N];
}

/// [`sums_q4k`] (`Q5`: of Q5_K units).
struct Q4kSums<const Q5: bool>;

impl<const Q5: bool> UnitSums for Q4kSums<Q5> {
    const MAX_ROWS: usize = Q4K_SUM_ROWS;

    unsafe fn sums<const N: usize>(
        &self,
        unit: *const u8,
        ahead: *const u8,
        act: &Act,
        sb: usize,
        t0: usize,
    ) -> [__m512i; N] {
        // SAFETY: the caller's; `unit_groups` runs on AVX-512 VNNI.
        unsafe { sums_q4k::<N, Q5>(unit, ahead, act, sb, t0) }
    }
}

/// [`sums_q6k`].
struct Q6kSums;

impl UnitSums for Q6kSums {
    const MAX_ROWS: usize = Q6K_SUM_ROWS;

    unsafe fn sums<const N: usize>(
        &self,
        unit: *const u8,
        ahead: *const u8,
        act: &Act,
        sb: usize,
        t0: usize,
    ) -> [__m512i; N] {
        // SAFETY: the caller's; `unit_groups` runs on AVX-512 VNNI.
        unsafe { sums_q6k::<N>(unit, ahead, act, sb, t0) }
    }
}

/// Activation rows per [`sums_q4k`] / [`sums_q6k`] call: each weight
/// vector is unpacked once for them (two accumulators a row for Q4_K, four
/// for Q6_K). Measured on the 2-thread forward of the 1.5B (AMX VM, issue
/// 33): 4 rows a pass → 8 (Q4_K) and 6 (Q6_K) took a 5-row forward from
/// 76.5 to 68.4 ms and moved the AMX thresholds from 7 to 9 rows.
const Q4K_SUM_ROWS: usize = 8;
const Q6K_SUM_ROWS: usize = 6;

/// `S = Σ_c sc_c · dot_c` of activation rows `t0..t0 + N` × a Q4_K unit
/// (`Q5`: Q5_K) (lanes = its 16 weight rows), by `vpdpbusd` on the values
/// (u8 weights × i8 activations, exact: |dot_c| ≤ 32·31·128, |S| < 2^26).
///
/// # Safety
/// AVX-512 (F/BW/VNNI); a whole unit at `unit`; `t0 + N ≤ act.m`,
/// `sb < act.nb` (Q8_K activations).
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn sums_q4k<const N: usize, const Q5: bool>(
    unit: *const u8,
    ahead: *const u8,
    act: &Act,
    sb: usize,
    t0: usize,
) -> [__m512i; N] {
    let lo4 = _mm512_set1_epi8(0xF);
    let off = tile_layout::k4_offsets(Q5);
    let lines = off.lines;
    let mut s = [_mm512_setzero_si512(); N];
    // SAFETY: the unit's qs, qh and scales; activation bytes
    // t·cols + 256·sb + 0..256 of rows t < t0 + N inside `act.qs`.
    unsafe {
        let a: [*const i8; N] =
            std::array::from_fn(|i| act.qs.as_ptr().add((t0 + i) * act.cols + 256 * sb));
        let scale =
            |c: usize| _mm512_cvtepu8_epi32(_mm_loadu_si128(unit.add(off.sc + 16 * c).cast()));
        for cc in 0..4 {
            let mut dl = [_mm512_setzero_si512(); N];
            let mut dh = [_mm512_setzero_si512(); N];
            for r in 0..8 {
                let i = 8 * cc + r;
                for l in i * lines / 32..(i + 1) * lines / 32 {
                    prefetch_line(ahead, l);
                }
                let (l, h) = q4k_nibbles::<Q5>(unit, cc, r, lo4);
                for i in 0..N {
                    dl[i] = _mm512_dpbusd_epi32(dl[i], l, bcast4(a[i].add(64 * cc + 4 * r)));
                    dh[i] = _mm512_dpbusd_epi32(dh[i], h, bcast4(a[i].add(64 * cc + 32 + 4 * r)));
                }
            }
            let (sl, sh) = (scale(2 * cc), scale(2 * cc + 1));
            for i in 0..N {
                s[i] = _mm512_add_epi32(s[i], _mm512_mullo_epi32(sl, dl[i]));
                s[i] = _mm512_add_epi32(s[i], _mm512_mullo_epi32(sh, dh[i]));
            }
        }
    }
    s
}

/// `S = Σ_c sc_c · Σ (q − 32)·a` of activation rows `t0..t0 + N` × a Q6_K
/// unit (lanes = its 16 weight rows): per 16-value group `vpdpbusd` on the
/// 6-bit values, minus 32 × the group's activation sum (Q8_K's `bsums`),
/// times the scale (exact: a group's sum is below 2^18, `S` below 2^29).
///
/// # Safety
/// As [`sums_q4k`], for a Q6_K unit.
#[inline]
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn sums_q6k<const N: usize>(
    unit: *const u8,
    ahead: *const u8,
    act: &Act,
    sb: usize,
    t0: usize,
) -> [__m512i; N] {
    let mut s = [_mm512_setzero_si512(); N];
    let bs: [&[i16]; N] = std::array::from_fn(|i| &act.row_bsums(t0 + i)[16 * sb..16 * sb + 16]);
    // SAFETY: the unit's ql/qh and scales; activation bytes
    // t·cols + 256·sb + 0..256 of rows t < t0 + N inside `act.qs`.
    unsafe {
        let a: [*const i8; N] =
            std::array::from_fn(|i| act.qs.as_ptr().add((t0 + i) * act.cols + 256 * sb));
        // B row rr = 32h + 8qq + r (K = 4·rr) is in group c = rr / 4 =
        // 8h + 2qq + r / 4: per (h, half of r), the four groups of qq = 0..4
        // accumulate side by side, each row's values built once.
        for h in 0..2 {
            for half in 0..2 {
                let mut dot = [[_mm512_setzero_si512(); N]; 4];
                for r in 4 * half..4 * half + 4 {
                    for part in 0..3 {
                        prefetch_line(ahead, 24 * h + 8 * part + r);
                    }
                    if h == 0 && half == 0 {
                        prefetch_line(ahead, 48 + r);
                    }
                    let e = q6_values(unit, h, r);
                    for qq in 0..4 {
                        let rr = 32 * h + 8 * qq + r;
                        for i in 0..N {
                            dot[qq][i] =
                                _mm512_dpbusd_epi32(dot[qq][i], e[qq], bcast4(a[i].add(4 * rr)));
                        }
                    }
                }
                for (qq, dot) in dot.iter().enumerate() {
                    let c = 8 * h + 2 * qq + half;
                    let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(unit.add(3072 + 16 * c).cast()));
                    for i in 0..N {
                        let centred =
                            _mm512_sub_epi32(dot[i], _mm512_set1_epi32(32 * bs[i][c] as i32));
                        s[i] = _mm512_add_epi32(s[i], _mm512_mullo_epi32(sc, centred));
                    }
                }
            }
        }
        prefetch_line(ahead, 52);
    }
    s
}
