//! AMX-INT8 kernels for Q4_K/Q6_K weights × blocks of activation rows
//! (x86-64 Sapphire Rapids and later, detected at run time).
//!
//! AMX intrinsics are not stable in Rust, so the tile instructions are
//! written as inline assembly (`ldtilecfg`, `tilezero`, `tileloadd`,
//! `tdpbsud`/`tdpbssd`, `tilestored`, `tilerelease`); everything around them
//! is AVX-512.
//!
//! One tile step = 16 weight rows × `tn` ≤ 16 activation rows × one
//! sub-block (Q4_K: 32 values, Q6_K: 16):
//! - **A** (`tn` rows × K bytes) = the quantized activations, loaded straight
//!   from `Act::qs` with the row stride `cols` (signed).
//! - **B** (K/4 rows × 64 bytes) = the weights in AMX's "VNNI" layout: row
//!   `r` holds bytes `4r..4r+4` of the sub-block for each of the 16 weight
//!   rows side by side. Each group of 16 weight rows is unpacked once per
//!   call into that layout by a 16 × 8 dword transpose in registers
//!   ([`transpose16x8`]) of the packed bytes, then nibble/bit extraction on
//!   the transposed vectors (byte-wise operations commute with moving whole
//!   dwords). Nothing of the weights is kept beyond the call.
//! - **C** (`tn` × 16 i32) row `t` = the exact dot products of activation
//!   row `t` with the 16 weight rows for that sub-block.
//!
//! Then, per activation row and super-block, with the 16 weight rows as the
//! lanes of one vector: `S = Σ_c sc_c · C_c` (exact `vpmulld`), for Q4_K
//! `M = Σ_c m_c · bsum_c` (`vpdpwssd` on pairs of 16-bit values), and the
//! shared float step of `combine::q4k_step` / `q6k_step`. Results are
//! therefore bit-identical to every other path, and the work after the tiles
//! grows with `tn`, not with the tile width.
//!
//! Before any tile instruction the process must ask the kernel for the AMX
//! state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), or the first
//! tile instruction faults; [`available`] does it once. The tile configuration
//! is per thread: each call of [`q4k_groups`] / [`q6k_groups`] loads it and
//! releases the tiles at its end.

use std::arch::asm;
use std::arch::x86_64::*;

use super::act::Act;
use super::blocks::{f16_le, q4k_scales_mins, BlockQ4K, BlockQ6K, QK_K};
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

/// Per activation row and super-block, the Q4_K min sums in pairs:
/// `bsp[(t·nb + sb)·4 + p]` = 32-element sums of chunks `2p` (low 16 bits)
/// and `2p + 1` (high 16 bits); |sum| ≤ 32·128 = 4096 fits i16.
pub(super) struct AmxAct {
    bsp: Vec<i32>,
}

impl AmxAct {
    /// The pairs for Q4_K weights; nothing for other formats.
    pub(super) fn new(act: &Act, format: super::QuantFormat) -> Self {
        if format != super::QuantFormat::Q4K {
            return AmxAct { bsp: Vec::new() };
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
        AmxAct { bsp }
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

/// Write `acc[t]` (16 weight rows) to `out[(t0 + t)·rows + j0 ..][..16]`.
///
/// # Safety
/// Those elements are inside the output and written by this task only.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn write_out(acc: &[__m512; TN], out: OutPtr, rows: usize, j0: usize, t0: usize, tn: usize) {
    for (t, a) in acc.iter().enumerate().take(tn) {
        // SAFETY: the caller's contract.
        unsafe { _mm512_storeu_ps(out.get().add((t0 + t) * rows + j0), *a) };
    }
}

/// Four tile products `C_i = A_i · B_i` (i < 4) stored to `c + 1024·i`:
/// A_i at `a + a_step·i` (stride `cols`), B_i at `b + b_step·i` (stride 64).
/// `SIGNED_B`: `tdpbssd` (signed weights), else `tdpbsud` (unsigned).
///
/// # Safety
/// Tiles configured; every tile inside its buffer.
#[inline(always)]
unsafe fn tiles4<const A_STEP: usize, const B_STEP: usize, const SIGNED_B: bool>(
    a: *const i8,
    cols: usize,
    b: *const u8,
    c: *mut i32,
) {
    macro_rules! body {
        ($op:literal) => {
            // SAFETY: caller.
            unsafe {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    "tileloadd tmm4, [{a}+{sa}*1]",
                    "tileloadd tmm6, [{b}+{s64}*1]",
                    concat!($op, " tmm0, tmm4, tmm6"),
                    "tileloadd tmm5, [{a}+{sa}*1+{a1}]",
                    "tileloadd tmm7, [{b}+{s64}*1+{b1}]",
                    concat!($op, " tmm1, tmm5, tmm7"),
                    "tileloadd tmm4, [{a}+{sa}*1+{a2}]",
                    "tileloadd tmm6, [{b}+{s64}*1+{b2}]",
                    concat!($op, " tmm2, tmm4, tmm6"),
                    "tileloadd tmm5, [{a}+{sa}*1+{a3}]",
                    "tileloadd tmm7, [{b}+{s64}*1+{b3}]",
                    concat!($op, " tmm3, tmm5, tmm7"),
                    "tilestored [{c}+{s64}*1], tmm0",
                    "tilestored [{c}+{s64}*1+1024], tmm1",
                    "tilestored [{c}+{s64}*1+2048], tmm2",
                    "tilestored [{c}+{s64}*1+3072], tmm3",
                    a = in(reg) a,
                    b = in(reg) b,
                    c = in(reg) c,
                    sa = in(reg) cols,
                    s64 = in(reg) 64usize,
                    a1 = const A_STEP,
                    a2 = const 2 * A_STEP,
                    a3 = const 3 * A_STEP,
                    b1 = const B_STEP,
                    b2 = const 2 * B_STEP,
                    b3 = const 3 * B_STEP,
                    options(nostack),
                )
            }
        };
    }
    if SIGNED_B {
        body!("tdpbssd")
    } else {
        body!("tdpbsud")
    }
}

/// Run `tiles` over the activation rows in groups of at most 16 with the
/// tile configuration for that group's size.
macro_rules! row_groups {
    ($m:expr, $a_colsb:expr, $b_rows:expr, |$t0:ident, $tn:ident| $body:block) => {{
        let _release = Release;
        let mut $t0 = 0;
        while $t0 < $m {
            let $tn = TN.min($m - $t0);
            // SAFETY: the caller of the kernel checked `available`.
            unsafe { TileCfg::new($tn as u8, $a_colsb, $b_rows).load() };
            $body
            $t0 += $tn;
        }
    }};
}

/// Q4_K: weight rows `j0..j0 + 16·ng` (groups of 16) × all activation rows.
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
    let (m, nb, cols) = (act.m, act.nb, act.cols);
    let bsz = std::mem::size_of::<BlockQ4K>();
    let row_bytes = nb * bsz;
    // Per super-block: B tiles (8 sub-blocks × 8 rows × 64 B), then the
    // scales (8 × 16 i32), min pairs (4 × 16 i32), d and dmin (16 f32 each).
    const SB: usize = 4096 + 8 * 64 + 4 * 64 + 2 * 64;
    let mut wbuf = vec![Aligned([0u8; SB]); nb];
    let mut cbuf = Aligned([0i32; 2 * 8 * 256]);
    let lo4 = _mm512_set1_epi8(0xF);
    for g in 0..ng {
        let jg = j0 + g * GROUP;
        let wg = wdata[jg * row_bytes..(jg + GROUP) * row_bytes].as_ptr();
        for (sb, wb) in wbuf.iter_mut().enumerate() {
            let blk = wg.wrapping_add(sb * bsz);
            let o = wb.0.as_mut_ptr();
            // SAFETY: every read is inside block sb of rows jg..jg+16
            // (qs at offset 16, 128 bytes); every write inside `wb`.
            unsafe {
                for j in 0..GROUP {
                    prefetch_ahead::<3>(blk.add(j * row_bytes));
                }
                for cc in 0..4 {
                    let v = load_t(blk.add(16 + 32 * cc), row_bytes);
                    for (r, v) in v.iter().enumerate() {
                        let l = _mm512_and_si512(*v, lo4);
                        let h = _mm512_and_si512(_mm512_srli_epi16::<4>(*v), lo4);
                        _mm512_store_si512(o.add((2 * cc) * 512 + 64 * r).cast(), l);
                        _mm512_store_si512(o.add((2 * cc + 1) * 512 + 64 * r).cast(), h);
                    }
                }
                let mut scr = [_mm256_setzero_si256(); 16];
                let mut mnr = [_mm256_setzero_si256(); 16];
                let mut d = [0f32; 32];
                for j in 0..GROUP {
                    let b = &*blk.add(j * row_bytes).cast::<BlockQ4K>();
                    let (sc, mn) = q4k_scales_mins(&b.scales);
                    scr[j] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.as_ptr().cast()));
                    // [m0 | m1 << 16, m2 | m3 << 16, ...] as 4 dwords
                    mnr[j] = _mm256_zextsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64(
                        mn.as_ptr().cast(),
                    )));
                    d[j] = f16_le(b.d);
                    d[16 + j] = f16_le(b.dmin);
                }
                let sct = transpose16x8(&scr);
                let mnt = transpose16x8(&mnr);
                for c in 0..8 {
                    _mm512_store_si512(o.add(4096 + 64 * c).cast(), sct[c]);
                }
                for p in 0..4 {
                    _mm512_store_si512(o.add(4096 + 512 + 64 * p).cast(), mnt[p]);
                }
                _mm512_store_ps(o.add(4096 + 768).cast(), _mm512_loadu_ps(d.as_ptr()));
                _mm512_store_ps(
                    o.add(4096 + 832).cast(),
                    _mm512_loadu_ps(d.as_ptr().add(16)),
                );
            }
        }
        row_groups!(m, 32, 8, |t0, tn| {
            let mut acc = [_mm512_setzero_ps(); TN];
            // The tile products of super-block sb + 1 are issued before the
            // vector work of sb (two C buffers), so the two overlap.
            // SAFETY: A: `tn` rows of 32 bytes at stride `cols` from row t0,
            // column 256·sb + 128h + 32i, inside `act.qs`; B: 8 rows of 64
            // bytes at 512·(4h + i) inside `wbuf[sb]`; C: 8 KB inside `cbuf`.
            let issue = |sb: usize, c: *mut i32| unsafe {
                let a = act.qs.as_ptr().add(t0 * cols + sb * QK_K);
                let b = wbuf[sb].0.as_ptr();
                tiles4::<32, 512, false>(a, cols, b, c);
                tiles4::<32, 512, false>(a.add(128), cols, b.add(2048), c.add(1024));
            };
            issue(0, cbuf.0.as_mut_ptr());
            for (sb, wb) in wbuf.iter().enumerate() {
                let w = wb.0.as_ptr();
                if sb + 1 < nb {
                    issue(
                        sb + 1,
                        cbuf.0.as_mut_ptr().wrapping_add(2048 * ((sb + 1) & 1)),
                    );
                }
                let cb = cbuf.0.as_ptr().wrapping_add(2048 * (sb & 1));
                // SAFETY: scales, min pairs and d/dmin inside `wb`; C rows
                // t < tn inside `cbuf`; row t0 + t < m.
                unsafe {
                    let sc: [__m512i; 8] =
                        std::array::from_fn(|c| _mm512_load_si512(w.add(4096 + 64 * c).cast()));
                    let mp: [__m512i; 4] = std::array::from_fn(|p| {
                        _mm512_load_si512(w.add(4096 + 512 + 64 * p).cast())
                    });
                    let dv = _mm512_load_ps(w.add(4096 + 768).cast());
                    let dmv = _mm512_load_ps(w.add(4096 + 832).cast());
                    for (t, acc) in acc.iter_mut().enumerate().take(tn) {
                        let cp = cb.add(16 * t);
                        let mut s = _mm512_setzero_si512();
                        for (c, sc) in sc.iter().enumerate() {
                            let cv = _mm512_load_si512(cp.add(256 * c).cast());
                            s = _mm512_add_epi32(s, _mm512_mullo_epi32(cv, *sc));
                        }
                        let row = t0 + t;
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
            }
            // SAFETY: columns jg..jg+16 are this task's; rows t0..t0+tn < m.
            unsafe { write_out(&acc, out, rows, jg, t0, tn) };
        });
    }
}

/// Q6_K: as [`q4k_groups`] (16-element groups, signed `q − 32`, `tdpbssd`).
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
    out: OutPtr,
) {
    let (m, nb, cols) = (act.m, act.nb, act.cols);
    let bsz = std::mem::size_of::<BlockQ6K>();
    let row_bytes = nb * bsz;
    // Per super-block: B tiles (64 dword rows × 64 B), the 16 group scales
    // (16 × 16 i32), d (16 f32).
    const SB: usize = 4096 + 1024 + 64;
    let mut wbuf = vec![Aligned([0u8; SB]); nb];
    let mut cbuf = Aligned([0i32; 2 * 16 * 256]);
    let lo4 = _mm512_set1_epi8(0xF);
    let m3 = _mm512_set1_epi8(3);
    let m30 = _mm512_set1_epi8(0x30);
    let m32 = _mm512_set1_epi8(32);
    for g in 0..ng {
        let jg = j0 + g * GROUP;
        let wg = wdata[jg * row_bytes..(jg + GROUP) * row_bytes].as_ptr();
        for (sb, wb) in wbuf.iter_mut().enumerate() {
            let blk = wg.wrapping_add(sb * bsz);
            let o = wb.0.as_mut_ptr();
            // SAFETY: every read is inside block sb of rows jg..jg+16 (ql at
            // 0, qh at 128, scales at 192, d at 208); every write inside `wb`.
            unsafe {
                for j in 0..GROUP {
                    prefetch_ahead::<4>(blk.add(j * row_bytes));
                }
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
                            _mm512_store_si512(o.add(64 * row).cast(), _mm512_sub_epi8(*e, m32));
                        }
                    }
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
                let (lt, ht) = (transpose16x8(&lo), transpose16x8(&hi));
                for k in 0..8 {
                    _mm512_store_si512(o.add(4096 + 64 * k).cast(), lt[k]);
                    _mm512_store_si512(o.add(4096 + 512 + 64 * k).cast(), ht[k]);
                }
                _mm512_store_ps(o.add(4096 + 1024).cast(), _mm512_loadu_ps(d.as_ptr()));
            }
        }
        row_groups!(m, 16, 4, |t0, tn| {
            let mut acc = [_mm512_setzero_ps(); TN];
            // As in `q4k_groups`, one super-block ahead.
            // SAFETY: A: `tn` rows of 16 bytes at stride `cols` from row t0,
            // column 256·sb + 16g, inside `act.qs`; B: 4 rows of 64 bytes at
            // 256g inside `wbuf[sb]`; C: 16 KB inside `cbuf`.
            let issue = |sb: usize, c: *mut i32| unsafe {
                let a = act.qs.as_ptr().add(t0 * cols + sb * QK_K);
                let b = wbuf[sb].0.as_ptr();
                for i in 0..4 {
                    tiles4::<16, 256, true>(a.add(64 * i), cols, b.add(1024 * i), c.add(1024 * i));
                }
            };
            issue(0, cbuf.0.as_mut_ptr());
            for (sb, wb) in wbuf.iter().enumerate() {
                let w = wb.0.as_ptr();
                if sb + 1 < nb {
                    issue(
                        sb + 1,
                        cbuf.0.as_mut_ptr().wrapping_add(4096 * ((sb + 1) & 1)),
                    );
                }
                let cb = cbuf.0.as_ptr().wrapping_add(4096 * (sb & 1));
                // SAFETY: scales and d inside `wb`; C rows t < tn inside
                // `cbuf`; row t0 + t < m.
                unsafe {
                    let sc: [__m512i; 16] =
                        std::array::from_fn(|k| _mm512_load_si512(w.add(4096 + 64 * k).cast()));
                    let dv = _mm512_load_ps(w.add(4096 + 1024).cast());
                    for (t, acc) in acc.iter_mut().enumerate().take(tn) {
                        let cp = cb.add(16 * t);
                        let mut s = _mm512_setzero_si512();
                        for (k, sc) in sc.iter().enumerate() {
                            let cv = _mm512_load_si512(cp.add(256 * k).cast());
                            s = _mm512_add_epi32(s, _mm512_mullo_epi32(cv, *sc));
                        }
                        let dx = _mm512_set1_ps(*act.d.as_ptr().add((t0 + t) * nb + sb));
                        // combine::q6k_step, lanes = weight rows.
                        let dd = _mm512_mul_ps(dv, dx);
                        *acc = _mm512_add_ps(*acc, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(s)));
                    }
                }
            }
            // SAFETY: as in `q4k_groups`.
            unsafe { write_out(&acc, out, rows, jg, t0, tn) };
        });
    }
}
