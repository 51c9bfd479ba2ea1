//! AMX-INT8 kernels for Q4_K/Q6_K weights × blocks of activation rows
//! (x86-64 Sapphire Rapids and later, detected at run time).
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
//!   whole call; padded rows are
//!   computed and dropped).
//! - **B** (16 rows × 64 bytes) = the weights in AMX's "VNNI" layout (row
//!   `r` holds values `4r..4r+4` of each of the 16 weight rows side by side),
//!   **with each sub-block's scale folded in**: `sc·q` (Q4_K, ≤ 945) or
//!   `sc·(q − 32)` (Q6_K, |·| ≤ 4096) split into a lo plane (u8) and a hi
//!   plane (u8 for Q4_K, i8 for Q6_K), `value = lo + 256·hi`. Unpacked per
//!   super-block of a group of 16 weight rows: a 16 × 8 dword transpose in
//!   registers ([`transpose16x8`]) of the packed bytes, nibble/bit
//!   extraction on the transposed vectors (byte-wise operations commute with
//!   moving whole dwords), then the products by `vpmaddubsw` on even and
//!   odd bytes ([`times_scale`]). Nothing of the weights is kept beyond the
//!   call.
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
//! The unpacked super-block (8.5 KB) stays in L1 for all row tiles, and the
//! next one is unpacked before this one's tile steps (two buffers). Row tiles
//! alternate their accumulator tiles (tmm0/1, tmm2/3) so one's `tilestored`
//! overlaps the next one's products. Why, with the costs measured on a
//! Sapphire Rapids VM: docs/model-core.md, "AMX, round two".
//!
//! Before any tile instruction the process must ask the kernel for the AMX
//! state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), or the first
//! tile instruction faults; [`available`] does it once. The tile configuration
//! is per thread: each call of [`q4k_groups`] / [`q6k_groups`] loads it and
//! releases the tiles at its end.

use std::arch::asm;
use std::arch::x86_64::*;

use super::act::Act;
use super::blocks::{f16_le, q4k_scales_mins, BlockQ4K, BlockQ6K};
use super::{prefetch_ahead, OutPtr};

/// Weight rows per tile step (the columns of B and C).
pub(super) const GROUP: usize = 16;
/// Activation rows per tile step at most (the rows of A and C).
const TN: usize = 16;

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

/// Palette-1 tile configuration: tmm0..3 = C (`tn` × 64 B), tmm4..5 = A
/// (`tn` rows × `a_colsb`), tmm6..7 = B (`b_rows` × 64 B).
#[repr(C, align(64))]
struct TileCfg([u8; 64]);

impl TileCfg {
    fn new(tn: u8, a_colsb: u16, b_rows: u8) -> Self {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            let (colsb, rows) = match t {
                0..=3 => (64u16, tn),
                4 | 5 => (a_colsb, tn),
                _ => (64, b_rows),
            };
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            c[48 + t] = rows;
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
pub(super) struct AmxAct {
    a_tiles: Vec<i8>,
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
    pub(super) fn new(act: &Act, format: super::QuantFormat) -> Self {
        let a_tiles = tiles_of(act);
        if format != super::QuantFormat::Q4K {
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
}

/// 64-byte aligned scratch.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Aligned<T>(T);

/// 16 rows of 8 dwords → 8 vectors of 16 dwords: `out[r]` lane `j` =
/// dword `r` of row `j`.
#[inline]
#[target_feature(enable = "avx2,avx512f")]
fn transpose16x8(rows: &[__m256i; 16]) -> [__m512i; 8] {
    // z[i] = row i | row i + 8: two independent 8 × 8 transposes, one per
    // 256-bit half, within 128-bit lanes first.
    let z: [__m512i; 8] = std::array::from_fn(|i| {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(rows[i]), rows[i + 8])
    });
    let t: [__m512i; 8] = std::array::from_fn(|i| {
        let (a, b) = (z[i & !1], z[i | 1]);
        if i & 1 == 0 {
            _mm512_unpacklo_epi32(a, b)
        } else {
            _mm512_unpackhi_epi32(a, b)
        }
    });
    // u[q + 4h]: per 128-bit lane, dword q (lane 0) / q + 4 (lane 1) of rows
    // 4h..4h+4 (first half) and 8 + 4h.. (second half).
    let u: [__m512i; 8] = std::array::from_fn(|i| {
        let (h, q) = (i / 4, i % 4);
        let (a, b) = (t[4 * h + (q >> 1)], t[4 * h + 2 + (q >> 1)]);
        if q & 1 == 0 {
            _mm512_unpacklo_epi64(a, b)
        } else {
            _mm512_unpackhi_epi64(a, b)
        }
    });
    let lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
    let hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    std::array::from_fn(|r| {
        let (a, b) = (u[r % 4], u[4 + r % 4]);
        if r < 4 {
            _mm512_permutex2var_epi64(a, lo, b)
        } else {
            _mm512_permutex2var_epi64(a, hi, b)
        }
    })
}

/// 32 bytes at `base + j·stride` for the 16 rows `j`, transposed.
///
/// # Safety
/// 32 readable bytes at each address.
#[inline]
#[target_feature(enable = "avx2,avx512f")]
unsafe fn load_t(base: *const u8, stride: usize) -> [__m512i; 8] {
    // SAFETY: caller.
    let rows = std::array::from_fn(|j| unsafe { _mm256_loadu_si256(base.add(j * stride).cast()) });
    transpose16x8(&rows)
}

/// Tile products over one super-block (K = 256 in four steps of 64):
/// `C_lo = A · B_lo` stored to `c`, `C_hi = A · B_hi` to `c + 1024` bytes.
/// A at `a` + 1024 bytes per step ([`tiles_of`]), `B_lo` at `b`, `B_hi` at `b + 4096` (16 rows of
/// 64 bytes per step, stride 64). `HI_SIGNED`: `B_hi` is signed
/// (`tdpbssd`), else unsigned (`tdpbsud`); `B_lo` is always unsigned.
/// `ODD`: accumulate in tmm2/tmm3 instead of tmm0/tmm1, so that consecutive
/// super-blocks alternate and one's stores overlap the next one's products
/// (a `tilestored` costs about two tile products here, and must wait for
/// its accumulator's last product).
///
/// # Safety
/// Tiles configured for A = `tn` × 64 B, B = 16 × 64 B, C = `tn` × 64 B;
/// every tile inside its buffer.
#[inline(always)]
unsafe fn planes<const HI_SIGNED: bool, const ODD: bool>(a: *const i8, b: *const u8, c: *mut i32) {
    macro_rules! body {
        ($hi:literal, $lo_acc:literal, $hi_acc:literal) => {
            // SAFETY: caller.
            unsafe {
                asm!(
                    concat!("tilezero ", $lo_acc),
                    concat!("tilezero ", $hi_acc),
                    "tileloadd tmm4, [{a}+{s64}*1]",
                    "tileloadd tmm6, [{b}+{s64}*1]",
                    concat!("tdpbsud ", $lo_acc, ", tmm4, tmm6"),
                    "tileloadd tmm7, [{b}+{s64}*1+4096]",
                    concat!($hi, " ", $hi_acc, ", tmm4, tmm7"),
                    "tileloadd tmm5, [{a}+{s64}*1+1024]",
                    "tileloadd tmm6, [{b}+{s64}*1+1024]",
                    concat!("tdpbsud ", $lo_acc, ", tmm5, tmm6"),
                    "tileloadd tmm7, [{b}+{s64}*1+5120]",
                    concat!($hi, " ", $hi_acc, ", tmm5, tmm7"),
                    "tileloadd tmm4, [{a}+{s64}*1+2048]",
                    "tileloadd tmm6, [{b}+{s64}*1+2048]",
                    concat!("tdpbsud ", $lo_acc, ", tmm4, tmm6"),
                    "tileloadd tmm7, [{b}+{s64}*1+6144]",
                    concat!($hi, " ", $hi_acc, ", tmm4, tmm7"),
                    "tileloadd tmm5, [{a}+{s64}*1+3072]",
                    "tileloadd tmm6, [{b}+{s64}*1+3072]",
                    concat!("tdpbsud ", $lo_acc, ", tmm5, tmm6"),
                    "tileloadd tmm7, [{b}+{s64}*1+7168]",
                    concat!($hi, " ", $hi_acc, ", tmm5, tmm7"),
                    concat!("tilestored [{c}+{s64}*1], ", $lo_acc),
                    concat!("tilestored [{c}+{s64}*1+1024], ", $hi_acc),
                    a = in(reg) a,
                    b = in(reg) b,
                    c = in(reg) c,
                    s64 = in(reg) 64usize,
                    options(nostack),
                )
            }
        };
    }
    match (HI_SIGNED, ODD) {
        (false, false) => body!("tdpbsud", "tmm0", "tmm1"),
        (false, true) => body!("tdpbsud", "tmm2", "tmm3"),
        (true, false) => body!("tdpbssd", "tmm0", "tmm1"),
        (true, true) => body!("tdpbssd", "tmm2", "tmm3"),
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

/// One super-block of 16 Q4_K weight rows (`blk`: row `j` at
/// `blk + j·row_bytes`) unpacked into `o` ([`Q4K_UNPACKED`] bytes): the lo
/// and hi planes of `sc·q` in the tile layout (4096 bytes each: 64 rows of
/// 4 values × 16 weight rows), then the min pairs (4 × 16 i32), d and dmin
/// (16 f32 each).
///
/// # Safety
/// AVX-512 (F/BW); 16 readable blocks at `blk + j·row_bytes`; `o` 64-byte
/// aligned with [`Q4K_UNPACKED`] writable bytes.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn unpack_q4k(blk: *const u8, row_bytes: usize, o: *mut u8) {
    let lo4 = _mm512_set1_epi8(0xF);
    let zero = _mm512_setzero_si512();
    // SAFETY: every read is inside block sb of rows jg..jg+16 (qs at offset
    // 16, 128 bytes); every write inside `o` (caller).
    unsafe {
        for j in 0..GROUP {
            prefetch_ahead::<3>(blk.add(j * row_bytes));
        }
        let mut scr = [_mm256_setzero_si256(); 16];
        let mut mnr = [_mm256_setzero_si256(); 16];
        let mut d = [0f32; 32];
        for j in 0..GROUP {
            let b = &*blk.add(j * row_bytes).cast::<BlockQ4K>();
            let (sc, mn) = q4k_scales_mins(&b.scales);
            scr[j] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.as_ptr().cast()));
            // [m0 | m1 << 16, m2 | m3 << 16, ...] as 4 dwords
            mnr[j] = _mm256_zextsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(mn.as_ptr().cast())));
            d[j] = f16_le(b.d);
            d[16 + j] = f16_le(b.dmin);
        }
        let sct = transpose16x8(&scr);
        let mnt = transpose16x8(&mnr);
        for cc in 0..4 {
            let (sel, sol) = scale_bytes(sct[2 * cc]);
            let (seh, soh) = scale_bytes(sct[2 * cc + 1]);
            let v = load_t(blk.add(16 + 32 * cc), row_bytes);
            for (r, v) in v.iter().enumerate() {
                let l = _mm512_and_si512(*v, lo4);
                let h = _mm512_and_si512(_mm512_srli_epi16::<4>(*v), lo4);
                for (half, q, se, so) in [(0, l, sel, sol), (1, h, seh, soh)] {
                    let (plo, phi) = times_scale::<false>(q, se, so, zero);
                    let at = (2 * cc + half) * 512 + 64 * r;
                    _mm512_store_si512(o.add(at).cast(), plo);
                    _mm512_store_si512(o.add(4096 + at).cast(), phi);
                }
            }
        }
        for p in 0..4 {
            _mm512_store_si512(o.add(PLANES + 64 * p).cast(), mnt[p]);
        }
        _mm512_store_ps(o.add(PLANES + 256).cast(), _mm512_loadu_ps(d.as_ptr()));
        _mm512_store_ps(
            o.add(PLANES + 320).cast(),
            _mm512_loadu_ps(d.as_ptr().add(16)),
        );
    }
}

/// Bytes of the two planes of one unpacked super-block.
const PLANES: usize = 8192;
/// Bytes of one unpacked Q4_K super-block ([`unpack_q4k`]).
const Q4K_UNPACKED: usize = PLANES + 4 * 64 + 2 * 64;

/// Q4_K: weight rows `j0..j0 + 16·ng` (groups of 16) × all activation rows.
///
/// Each sub-block's scale is folded into the weights when they are unpacked
/// (`sc·q ≤ 945 = lo + 256·hi`, two u8 planes), so a super-block is two
/// tile products over all 256 values and `S = C_lo + 256·C_hi` exactly, the
/// same integer the scalar path forms as `Σ_c sc_c · dot_c`.
///
/// Loop order: per group of 16 weight rows, per super-block, every tile of
/// 16 activation rows. So an unpacked super-block (8.5 KB) is read from L1
/// by every row tile: streamed from L2 per row tile instead, loading the
/// planes bound the tile steps. The next super-block is unpacked before the
/// tile steps of this one (two buffers), so no tile load reads data just
/// stored.
///
/// # Safety
/// [`available`] and AVX-512 (F/BW/VL/VNNI); `wdata` is the matrix
/// (`rows` rows of `act.nb` blocks), `j0 + 16·ng ≤ rows`; `out` as in
/// `matmul`, columns `j0..j0 + 16·ng` owned by this task.
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q4k_groups(
    wdata: &[u8],
    rows: usize,
    j0: usize,
    ng: usize,
    act: &Act,
    amx: &AmxAct,
    out: OutPtr,
) {
    let nb = act.nb;
    let unpack = |blk: *const u8, row_bytes: usize, o: *mut u8| {
        // SAFETY: `tile_groups` passes 16 blocks inside `wdata` and a
        // buffer of `Q4K_UNPACKED` bytes.
        unsafe { unpack_q4k(blk, row_bytes, o) }
    };
    let post = |w: *const u8, cb: *const i32, sb: usize, t0: usize, acc: &mut [__m512]| {
        // SAFETY: min pairs and d/dmin inside `w`; C rows t < 16 inside
        // `cb`; rows t0 + t < m (`acc` holds only those).
        unsafe {
            let mp: [__m512i; 4] =
                std::array::from_fn(|p| _mm512_load_si512(w.add(PLANES + 64 * p).cast()));
            let dv = _mm512_load_ps(w.add(PLANES + 256).cast());
            let dmv = _mm512_load_ps(w.add(PLANES + 320).cast());
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
        tile_groups::<false, Q4K_UNPACKED>(
            wdata,
            rows,
            j0,
            ng,
            act,
            amx,
            out,
            std::mem::size_of::<BlockQ4K>(),
            unpack,
            post,
        )
    }
}

/// The loop shared by [`q4k_groups`] and [`q6k_groups`] (see the first's
/// doc for the order): per group of 16 weight rows, per super-block
/// (`unpack` writes the next one into the other `UNPACKED`-byte buffer
/// first), every tile of 16 activation rows: the plane products
/// ([`planes`], hi plane signed when `SIGNED`) of row tile `rt + 1` issued
/// before `post(w, C, sb, t0, acc rows)` of row tile `rt`; then the group's
/// 16 columns written to `out`. `bsz`: bytes of one block.
///
/// # Safety
/// As [`q4k_groups`]; `unpack` and `post` as those two pass them.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_groups<const SIGNED: bool, const UNPACKED: usize>(
    wdata: &[u8],
    rows: usize,
    j0: usize,
    ng: usize,
    act: &Act,
    amx: &AmxAct,
    out: OutPtr,
    bsz: usize,
    unpack: impl Fn(*const u8, usize, *mut u8),
    post: impl Fn(*const u8, *const i32, usize, usize, &mut [__m512]),
) {
    let (m, nb, cols) = (act.m, act.nb, act.cols);
    let tiles = m.div_ceil(TN);
    let row_bytes = nb * bsz;
    let mut wbuf = [Aligned([0u8; UNPACKED]); 2];
    let mut cbuf = Aligned([0i32; 2 * 2 * 256]);
    let mut acc = vec![_mm512_setzero_ps(); m];
    let _release = Release;
    // SAFETY: the caller checked `available`.
    unsafe { TileCfg::new(TN as u8, 64, 16).load() };
    for g in 0..ng {
        let jg = j0 + g * GROUP;
        let wg = wdata[jg * row_bytes..(jg + GROUP) * row_bytes].as_ptr();
        acc.fill(_mm512_setzero_ps());
        unpack(wg, row_bytes, wbuf[0].0.as_mut_ptr());
        for sb in 0..nb {
            if sb + 1 < nb {
                // Block sb + 1 of rows jg..jg+16 is inside `wdata`.
                unpack(
                    wg.wrapping_add((sb + 1) * bsz),
                    row_bytes,
                    wbuf[(sb + 1) & 1].0.as_mut_ptr(),
                );
            }
            let w = wbuf[sb & 1].0.as_ptr();
            // Row tile rt + 1's products are issued before row tile rt's
            // vector work (two C buffers, alternate accumulator tiles).
            // SAFETY: A: the four 1 KB tiles (rt, 4·sb + i) inside `a_tiles`
            // (`tiles_of`); B: 16 rows of 64 bytes at 1024·i (+ 4096)
            // inside `w`; C: 2 KB inside `cbuf`.
            let issue = |rt: usize, c: *mut i32| unsafe {
                let a = amx.a_tiles.as_ptr().add((rt * (cols / 64) + sb * 4) * 1024);
                if rt & 1 == 0 {
                    planes::<SIGNED, false>(a, w, c);
                } else {
                    planes::<SIGNED, true>(a, w, c);
                }
            };
            issue(0, cbuf.0.as_mut_ptr());
            for rt in 0..tiles {
                if rt + 1 < tiles {
                    issue(
                        rt + 1,
                        cbuf.0.as_mut_ptr().wrapping_add(512 * ((rt + 1) & 1)),
                    );
                }
                let cb = cbuf.0.as_ptr().wrapping_add(512 * (rt & 1));
                let t0 = rt * TN;
                let end = (t0 + TN).min(m);
                post(w, cb, sb, t0, &mut acc[t0..end]);
            }
        }
        for (row, a) in acc.iter().enumerate() {
            // SAFETY: columns jg..jg+16 are this task's; row < m.
            unsafe { _mm512_storeu_ps(out.get().add(row * rows + jg), *a) };
        }
    }
}

/// One super-block of 16 Q6_K weight rows unpacked into `o`
/// ([`Q6K_UNPACKED`] bytes): the lo and hi planes of `sc·(q − 32)` (the lo
/// plane u8, the hi plane i8) in the tile layout, then d (16 f32).
///
/// # Safety
/// AVX-512 (F/BW); 16 readable blocks at `blk + j·row_bytes`; `o` 64-byte
/// aligned with [`Q6K_UNPACKED`] writable bytes.
#[inline]
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn unpack_q6k(blk: *const u8, row_bytes: usize, o: *mut u8) {
    let lo4 = _mm512_set1_epi8(0xF);
    let m3 = _mm512_set1_epi8(3);
    let m30 = _mm512_set1_epi8(0x30);
    // SAFETY: every read is inside the block of rows j (ql at 0, qh at 128,
    // scales at 192, d at 208); every write inside `o` (caller).
    unsafe {
        for j in 0..GROUP {
            prefetch_ahead::<4>(blk.add(j * row_bytes));
        }
        let mut lo = [_mm256_setzero_si256(); 16];
        let mut hi = [_mm256_setzero_si256(); 16];
        let mut d = [0f32; 16];
        for j in 0..GROUP {
            let b = &*blk.add(j * row_bytes).cast::<BlockQ6K>();
            let v = _mm512_cvtepi8_epi32(_mm_loadu_si128(b.scales.as_ptr().cast()));
            lo[j] = _mm512_castsi512_si256(v);
            hi[j] = _mm512_extracti64x4_epi64::<1>(v);
            d[j] = f16_le(b.d);
        }
        // Scale group c (16 values) as i32 lanes: c < 8 in `lt`, else `ht`.
        let (lt, ht) = (transpose16x8(&lo), transpose16x8(&hi));
        // Per scale group c (16 values, 4 B rows): `times_scale`'s se, so
        // and 32·sc in both 16-bit halves (|32·sc| ≤ 4096).
        let scales: [(__m512i, __m512i, __m512i); 16] = std::array::from_fn(|c| {
            let sc = if c < 8 { lt[c] } else { ht[c - 8] };
            let (se, so) = scale_bytes(sc);
            let t = _mm512_slli_epi32::<5>(sc);
            let sub = _mm512_or_si512(
                _mm512_and_si512(t, _mm512_set1_epi32(0xFFFF)),
                _mm512_slli_epi32::<16>(t),
            );
            (se, so, sub)
        });
        for h in 0..2 {
            let ql0 = load_t(blk.add(64 * h), row_bytes);
            let ql1 = load_t(blk.add(64 * h + 32), row_bytes);
            let qh = load_t(blk.add(128 + 32 * h), row_bytes);
            for r in 0..8 {
                let (l0, l1, q) = (ql0[r], ql1[r], qh[r]);
                let e = [
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
                ];
                for (qq, e) in e.iter().enumerate() {
                    let row = 32 * h + 8 * qq + r;
                    let (se, so, sub) = scales[row / 4];
                    let (plo, phi) = times_scale::<true>(*e, se, so, sub);
                    _mm512_store_si512(o.add(64 * row).cast(), plo);
                    _mm512_store_si512(o.add(4096 + 64 * row).cast(), phi);
                }
            }
        }
        _mm512_store_ps(o.add(PLANES).cast(), _mm512_loadu_ps(d.as_ptr()));
    }
}

/// Bytes of one unpacked Q6_K super-block ([`unpack_q6k`]).
const Q6K_UNPACKED: usize = PLANES + 64;

/// Q6_K: as [`q4k_groups`] (the scale of each 16-value group folded into
/// `q − 32`, `|sc·(q − 32)| ≤ 4096 = lo + 256·hi` with a signed hi plane:
/// `tdpbssd`).
///
/// # Safety
/// As [`q4k_groups`].
#[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn q6k_groups(
    wdata: &[u8],
    rows: usize,
    j0: usize,
    ng: usize,
    act: &Act,
    amx: &AmxAct,
    out: OutPtr,
) {
    let nb = act.nb;
    let unpack = |blk: *const u8, row_bytes: usize, o: *mut u8| {
        // SAFETY: `tile_groups` passes 16 blocks inside `wdata` and a
        // buffer of `Q6K_UNPACKED` bytes.
        unsafe { unpack_q6k(blk, row_bytes, o) }
    };
    let post = |w: *const u8, cb: *const i32, sb: usize, t0: usize, acc: &mut [__m512]| {
        // SAFETY: d inside `w`; C rows t < 16 inside `cb`; rows t0 + t < m.
        unsafe {
            let dv = _mm512_load_ps(w.add(PLANES).cast());
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
        tile_groups::<true, Q6K_UNPACKED>(
            wdata,
            rows,
            j0,
            ng,
            act,
            amx,
            out,
            std::mem::size_of::<BlockQ6K>(),
            unpack,
            post,
        )
    }
}
