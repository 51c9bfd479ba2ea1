//! aarch64 kernels (detected at run time): baseline NEON, which every ARMv8-A
//! CPU has, and the dot-product extension (`SDOT`, ARMv8.2+; most phones
//! since 2018).
//!
//! Both paths are the same code over one integer primitive, [`Dot::dot4`]:
//! lane `i` of the result is `acc[i] + Σ_{k<4} a[4i+k]·b[4i+k]`, exact.
//! [`Sdot`] is one `sdot` instruction (through `asm!`: the `vdotq_s32`
//! intrinsic is not stable Rust); [`Neon`] forms the same lanes with widening
//! multiplies and pairwise adds. Integer sums are exact, so how they are
//! formed cannot change a result; every float operation is the scalar
//! reference's, through the shared `combine` functions in the same order:
//! - Q4_0/Q5_0/Q5_0x4/Q8_0 and Q4_1/Q5_1 (whole blocks): the 8 lanes of a
//!   block are two `dot4` vectors (signed values, or Q4_1/Q5_1's unsigned
//!   ones), summed to one exact `s` per block (`addv`), then
//!   [`combine::block_step`] (`acc[b % 16] += (dw·dx)·s`) or
//!   [`combine::min_block_step`] (`acc[b % 16] += (dw·dx)·s + mw·xs`), and
//!   [`combine::reduce16`];
//! - Q4_K/Q5_K/Q6_K/Q3_K: one exact i32 `S` (and `M`) per (activation row,
//!   weight row, super-block), then [`combine::q4k_step`] (Q4_K, Q5_K) /
//!   [`combine::q6k_step`] (Q6_K, Q3_K).
//!
//! Hence the same bits as the scalar reference and as every x86 path
//! (tests `quant_kernels`, `cross_arch_identity`; docs/model-core.md,
//! "aarch64").
//!
//! Each weight block (or super-block) is unpacked once per pass over the
//! activation rows of the tile: Q4_K/Q6_K take all `tn ≤ TILE` rows in one
//! pass (one float accumulator per row); Q4_0/Q5_0/Q8_0/Q4_1/Q5_1 take passes
//! of up to [`GROUP_PASS`] rows (16 float lanes per row), the weight row staying in L1
//! for the later passes. So a verify block reads the weights from memory
//! once. F32 weights use the portable path shared by every ISA; F16/BF16
//! weights its 16 lanes as four `float32x4_t` ([`row_half_neon`]).

use std::arch::aarch64::*;
use std::arch::asm;

use super::act::Act;
use super::blocks::{
    cast, f16_le, q3k_scales, q4k_scales_mins, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K,
    BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8_0, QK, QK_K,
};
use super::combine;
use super::scalar;
use super::types::{QuantFormat, RowFn, TILE};

/// The kernels of a format for the dotprod path (`dotprod`) or the baseline
/// NEON path; `None` for the formats every ISA runs through the scalar code.
pub(super) fn row_fn(dotprod: bool, f: QuantFormat) -> Option<RowFn> {
    Some(match (f, dotprod) {
        // The portable f32 dot shared by every ISA.
        (QuantFormat::F32, _) => return None,
        // The same 16 lanes, widened in vector registers.
        (QuantFormat::F16 | QuantFormat::BF16, _) => row_half_neon,
        (QuantFormat::Q4K, false) => row_q4k_neon,
        (QuantFormat::Q4K, true) => row_q4k_sdot,
        (QuantFormat::Q5K, false) => row_q5k_neon,
        (QuantFormat::Q5K, true) => row_q5k_sdot,
        (QuantFormat::Q3K, false) => row_q3k_neon,
        (QuantFormat::Q3K, true) => row_q3k_sdot,
        (QuantFormat::Q6K, false) => row_q6k_neon,
        (QuantFormat::Q6K, true) => row_q6k_sdot,
        // Q4_0/Q5_0/Q5_0x4/Q8_0, Q4_1/Q5_1: whole blocks.
        (_, false) => row_block_neon,
        (_, true) => row_block_sdot,
    })
}

/// The one integer primitive of the kernels.
trait Dot {
    /// Lane `i`: `acc[i] + Σ_{k<4} a[4i+k]·b[4i+k]` (exact).
    ///
    /// # Safety
    /// The CPU must have the implementation's feature.
    unsafe fn dot4(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t;
}

/// Baseline NEON (every ARMv8-A CPU).
struct Neon;

impl Dot for Neon {
    #[inline(always)]
    unsafe fn dot4(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        // i8·i8 fits an i16 (|p| ≤ 16384); pairs, then pairs of pairs.
        // SAFETY: NEON (baseline).
        unsafe {
            let lo = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
            let hi = vpaddlq_s16(vmull_high_s8(a, b));
            vaddq_s32(acc, vpaddq_s32(lo, hi))
        }
    }
}

/// The dot-product extension: one `sdot`.
struct Sdot;

impl Dot for Sdot {
    #[inline(always)]
    unsafe fn dot4(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let mut acc = acc;
        // SAFETY: only instantiated in `#[target_feature(enable = "dotprod")]`
        // functions, which the dispatcher calls only when the CPU has it; the
        // instruction touches registers only.
        unsafe {
            asm!(
                "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
                acc = inout(vreg) acc,
                a = in(vreg) a,
                b = in(vreg) b,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        acc
    }
}

/// 16 signed bytes from the start of `s` (panics if shorter: a caller bug).
#[inline(always)]
fn load_i8(s: &[i8]) -> int8x16_t {
    let s: &[i8; 16] = s[..16].try_into().unwrap_or_else(|_| unreachable!());
    // SAFETY: 16 readable bytes.
    unsafe { vld1q_s8(s.as_ptr()) }
}

/// 16 unsigned bytes from the start of `s` (panics if shorter: a caller bug).
#[inline(always)]
fn load_u8(s: &[u8]) -> uint8x16_t {
    let s: &[u8; 16] = s[..16].try_into().unwrap_or_else(|_| unreachable!());
    // SAFETY: 16 readable bytes.
    unsafe { vld1q_u8(s.as_ptr()) }
}

/// Block `b` of a Q4_0/Q5_0/Q5_0x4/Q8_0 row as 32 signed values (elements
/// 0..16, 16..32) and its scale: the values of [`scalar::unpack_block`].
#[inline(always)]
fn unpack_block(format: QuantFormat, wrow: &[u8], b: usize) -> ([int8x16_t; 2], f32) {
    // SAFETY: NEON (baseline); the loads read inside their slices.
    unsafe {
        let lo4 = vdupq_n_u8(0xF);
        match format {
            QuantFormat::Q4_0 => {
                let blk = &cast::<BlockQ4_0>(wrow)[b];
                let q = load_u8(&blk.qs);
                let off = vdupq_n_s8(8);
                let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, lo4)), off);
                let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(q)), off);
                ([lo, hi], f16_le(blk.d))
            }
            QuantFormat::Q5_0 => {
                let blk = &cast::<BlockQ5_0>(wrow)[b];
                let q = load_u8(&blk.qs);
                // Fifth bit of element j: bit j of qh; byte j/8 of qh tested
                // against bit j%8, then moved to 0x10.
                let bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201));
                let h = |b0: u8, b1: u8| {
                    let bytes = vcombine_u8(vdup_n_u8(b0), vdup_n_u8(b1));
                    vandq_u8(vtstq_u8(bytes, bit), vdupq_n_u8(0x10))
                };
                let [h0, h1, h2, h3] = blk.qh;
                let off = vdupq_n_s8(16);
                let lo = vorrq_u8(vandq_u8(q, lo4), h(h0, h1));
                let hi = vorrq_u8(vshrq_n_u8::<4>(q), h(h2, h3));
                let lo = vsubq_s8(vreinterpretq_s8_u8(lo), off);
                let hi = vsubq_s8(vreinterpretq_s8_u8(hi), off);
                ([lo, hi], f16_le(blk.d))
            }
            QuantFormat::Q8_0 => {
                let blk = &cast::<BlockQ8_0>(wrow)[b];
                ([load_i8(&blk.qs), load_i8(&blk.qs[16..])], f16_le(blk.d))
            }
            // The regrouped layout pays on AVX2 only (`repack_pays`), so aarch64
            // never loads it; kept correct through the shared unpacking.
            _ => {
                let mut o = [0i8; QK];
                let d = scalar::unpack_block(format, wrow, b, &mut o);
                ([load_i8(&o), load_i8(&o[16..])], d)
            }
        }
    }
}

/// Rows per pass of the whole-block kernel (each row holds 16 float lanes).
const GROUP_PASS: usize = 8;

/// Block `b` of a Q4_1/Q5_1 row as 32 unsigned values (as i8: 0..32;
/// elements 0..16, 16..32), its scale and offset: the values of
/// [`scalar::unpack_min_block`].
#[inline(always)]
fn unpack_min(format: QuantFormat, wrow: &[u8], b: usize) -> ([int8x16_t; 2], f32, f32) {
    // SAFETY: NEON (baseline); the loads read inside their slices.
    unsafe {
        let lo4 = vdupq_n_u8(0xF);
        if format == QuantFormat::Q4_1 {
            let blk = &cast::<BlockQ4_1>(wrow)[b];
            let q = load_u8(&blk.qs);
            let lo = vreinterpretq_s8_u8(vandq_u8(q, lo4));
            let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(q));
            ([lo, hi], f16_le(blk.d), f16_le(blk.m))
        } else {
            let blk = &cast::<BlockQ5_1>(wrow)[b];
            let q = load_u8(&blk.qs);
            // As Q5_0 in `unpack_block`, without the offset.
            let bit = vreinterpretq_u8_u64(vdupq_n_u64(0x8040_2010_0804_0201));
            let h = |b0: u8, b1: u8| {
                let bytes = vcombine_u8(vdup_n_u8(b0), vdup_n_u8(b1));
                vandq_u8(vtstq_u8(bytes, bit), vdupq_n_u8(0x10))
            };
            let [h0, h1, h2, h3] = blk.qh;
            let lo = vorrq_u8(vandq_u8(q, lo4), h(h0, h1));
            let hi = vorrq_u8(vshrq_n_u8::<4>(q), h(h2, h3));
            (
                [vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi)],
                f16_le(blk.d),
                f16_le(blk.m),
            )
        }
    }
}

/// Block `b` of a row of any whole-block format as the two `dot4` operands
/// of its 32 values, its scale and (Q4_1/Q5_1) its offset.
#[inline(always)]
fn unpack_whole_block(
    format: QuantFormat,
    wrow: &[u8],
    b: usize,
) -> ([int8x16_t; 2], f32, Option<f32>) {
    match format {
        QuantFormat::Q4_1 | QuantFormat::Q5_1 => {
            let (w, dw, mw) = unpack_min(format, wrow, b);
            (w, dw, Some(mw))
        }
        _ => {
            let (w, dw) = unpack_block(format, wrow, b);
            (w, dw, None)
        }
    }
}

/// Q4_0/Q5_0/Q5_0x4/Q8_0 (Q8_0 activations) or Q4_1/Q5_1 (Q8_1) row ×
/// activation rows `t0..t0+tn`, in near-equal passes of at most
/// [`GROUP_PASS`] rows.
#[inline(always)]
unsafe fn row_block<D: Dot>(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    for (t, r) in super::common::pass_sizes(tn, GROUP_PASS) {
        let out = &mut res[t..t + r];
        let t1 = t0 + t;
        // SAFETY: the caller's contract (CPU features).
        unsafe {
            match r {
                1 => block_pass::<D, 1>(format, wrow, act, t1, out),
                2 => block_pass::<D, 2>(format, wrow, act, t1, out),
                3 => block_pass::<D, 3>(format, wrow, act, t1, out),
                4 => block_pass::<D, 4>(format, wrow, act, t1, out),
                5 => block_pass::<D, 5>(format, wrow, act, t1, out),
                6 => block_pass::<D, 6>(format, wrow, act, t1, out),
                7 => block_pass::<D, 7>(format, wrow, act, t1, out),
                _ => block_pass::<D, GROUP_PASS>(format, wrow, act, t1, out),
            }
        }
    }
}

/// One pass of [`row_block`]: rows `t0..t0+R` into `out[..R]`.
#[inline(always)]
unsafe fn block_pass<D: Dot, const R: usize>(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    out: &mut [f32],
) {
    // SAFETY: NEON (baseline), `D`'s feature (the caller's contract); the
    // loads stay inside their slices.
    unsafe {
        let mut acc = [[0f32; combine::BLOCK_LANES]; R];
        for b in 0..act.nb {
            let ([w0, w1], dw, mw) = unpack_whole_block(format, wrow, b);
            let lane = b % combine::BLOCK_LANES;
            for (i, acc) in acc.iter_mut().enumerate() {
                let row = t0 + i;
                let xq = &act.row_qs(row)[b * QK..(b + 1) * QK];
                let z = vdupq_n_s32(0);
                let lanes = D::dot4(D::dot4(z, w0, load_i8(xq)), w1, load_i8(&xq[16..]));
                // The block's exact sum, then the shared float step.
                let s = vaddvq_s32(lanes);
                let dwdx = dw * act.row_d(row)[b];
                acc[lane] = match mw {
                    Some(mw) => combine::min_block_step(acc[lane], dwdx, s, mw, act.row_xs(row)[b]),
                    None => combine::block_step(acc[lane], dwdx, s),
                };
            }
        }
        for (o, acc) in out.iter_mut().zip(&acc) {
            *o = combine::reduce16(acc);
        }
    }
}

/// Q4_K row × activation rows `t0..t0+tn` (Q8_K): each super-block unpacked
/// once, one exact `S` and `M` per row, then [`combine::q4k_step`].
#[inline(always)]
unsafe fn row_q4k<D: Dot>(wrow: &[u8], act: &Act, t0: usize, tn: usize, res: &mut [f32; TILE]) {
    // SAFETY: the caller's contract.
    unsafe { row_k45::<D, false>(wrow, act, t0, tn, res) }
}

/// [`row_q4k`] (`FIVE`: Q5_K, whose fifth bits are or'ed in, else Q4_K).
#[inline(always)]
unsafe fn row_k45<D: Dot, const FIVE: bool>(
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    // SAFETY: as in `block_pass`.
    unsafe {
        let mut acc = [0f32; TILE];
        let lo4 = vdupq_n_u8(0xF);
        let b16 = vdupq_n_u8(0x10);
        for sb in 0..act.nb {
            let (d, dmin, scales, qs, qh) = if FIVE {
                let b = &cast::<BlockQ5K>(wrow)[sb];
                (b.d, b.dmin, &b.scales, &b.qs, Some(&b.qh))
            } else {
                let b = &cast::<BlockQ4K>(wrow)[sb];
                (b.d, b.dmin, &b.scales, &b.qs, None)
            };
            // q[j]: elements 16j..16j+16 (values 0..16, Q5_K 0..32);
            // sub-block c is q[2c], q[2c+1].
            let mut q = [vdupq_n_s8(0); 16];
            for c in 0..4 {
                for h in 0..2 {
                    let v = load_u8(&qs[32 * c + 16 * h..]);
                    let (mut lo, mut hi) = (vandq_u8(v, lo4), vshrq_n_u8::<4>(v));
                    if let Some(qh) = qh {
                        // Bits 2c and 2c + 1 of qh[16h + l]: the fifth bits of
                        // elements 64c + 16h + l and 64c + 32 + 16h + l.
                        let hb = load_u8(&qh[16 * h..]);
                        let m0 = vdupq_n_u8(1 << (2 * c));
                        let m1 = vdupq_n_u8(2 << (2 * c));
                        lo = vorrq_u8(lo, vandq_u8(vtstq_u8(hb, m0), b16));
                        hi = vorrq_u8(hi, vandq_u8(vtstq_u8(hb, m1), b16));
                    }
                    q[4 * c + h] = vreinterpretq_s8_u8(lo);
                    q[4 * c + 2 + h] = vreinterpretq_s8_u8(hi);
                }
            }
            let (sc, mn) = q4k_scales_mins(scales);
            let mn = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(mn.as_ptr())));
            let (d, dmin) = (f16_le(d), f16_le(dmin));
            for (i, acc) in acc.iter_mut().enumerate().take(tn) {
                let t = t0 + i;
                let xq = &act.row_qs(t)[sb * QK_K..(sb + 1) * QK_K];
                let mut s = vdupq_n_s32(0);
                for c in 0..8 {
                    let e = D::dot4(vdupq_n_s32(0), q[2 * c], load_i8(&xq[32 * c..]));
                    let e = D::dot4(e, q[2 * c + 1], load_i8(&xq[32 * c + 16..]));
                    s = vmlaq_n_s32(s, e, sc[c] as i32);
                }
                // M = Σ_c m_c · (bsum16[2c] + bsum16[2c+1]); a pair fits an i16.
                let bs = &act.row_bsums(t)[sb * 16..(sb + 1) * 16];
                let pairs = vpaddq_s16(vld1q_s16(bs.as_ptr()), vld1q_s16(bs[8..].as_ptr()));
                let mm = vaddq_s32(
                    vmull_s16(vget_low_s16(pairs), vget_low_s16(mn)),
                    vmull_high_s16(pairs, mn),
                );
                let dx = act.row_d(t)[sb];
                *acc = combine::q4k_step(*acc, d * dx, dmin * dx, vaddvq_s32(s), vaddvq_s32(mm));
            }
        }
        res[..tn].copy_from_slice(&acc[..tn]);
    }
}

/// Q6_K row × activation rows `t0..t0+tn` (Q8_K): each super-block unpacked
/// once, one exact `S` per row, then [`combine::q6k_step`].
#[inline(always)]
unsafe fn row_q6k<D: Dot>(wrow: &[u8], act: &Act, t0: usize, tn: usize, res: &mut [f32; TILE]) {
    // SAFETY: as in `block_pass`.
    unsafe {
        let mut acc = [0f32; TILE];
        let (lo4, hi2) = (vdupq_n_u8(0xF), vdupq_n_u8(0x30));
        let off = vdupq_n_s8(32);
        for (sb, b) in cast::<BlockQ6K>(wrow).iter().enumerate() {
            // q[g]: group g (elements 16g..16g+16) minus 32, as
            // scalar::unpack_q6k.
            let mut q = [vdupq_n_s8(0); 16];
            for h in 0..2 {
                for c in 0..2 {
                    let ql0 = load_u8(&b.ql[64 * h + 16 * c..]);
                    let ql1 = load_u8(&b.ql[64 * h + 32 + 16 * c..]);
                    let qh = load_u8(&b.qh[32 * h + 16 * c..]);
                    let v = [
                        vorrq_u8(vandq_u8(ql0, lo4), vandq_u8(vshlq_n_u8::<4>(qh), hi2)),
                        vorrq_u8(vandq_u8(ql1, lo4), vandq_u8(vshlq_n_u8::<2>(qh), hi2)),
                        vorrq_u8(vshrq_n_u8::<4>(ql0), vandq_u8(qh, hi2)),
                        vorrq_u8(vshrq_n_u8::<4>(ql1), vandq_u8(vshrq_n_u8::<2>(qh), hi2)),
                    ];
                    for (k, v) in v.into_iter().enumerate() {
                        q[8 * h + 2 * k + c] = vsubq_s8(vreinterpretq_s8_u8(v), off);
                    }
                }
            }
            let d = f16_le(b.d);
            for (i, acc) in acc.iter_mut().enumerate().take(tn) {
                let t = t0 + i;
                let xq = &act.row_qs(t)[sb * QK_K..(sb + 1) * QK_K];
                let mut s = vdupq_n_s32(0);
                for g in 0..16 {
                    let e = D::dot4(vdupq_n_s32(0), q[g], load_i8(&xq[16 * g..]));
                    s = vmlaq_n_s32(s, e, b.scales[g] as i32);
                }
                let dx = act.row_d(t)[sb];
                *acc = combine::q6k_step(*acc, d * dx, vaddvq_s32(s));
            }
        }
        res[..tn].copy_from_slice(&acc[..tn]);
    }
}

/// Q3_K row × activation rows `t0..t0+tn` (Q8_K): each super-block unpacked
/// once (values −4..4 per group of 16, as [`scalar::unpack_q3k`]), one exact
/// `S` per row, then [`combine::q6k_step`].
#[inline(always)]
unsafe fn row_q3k<D: Dot>(wrow: &[u8], act: &Act, t0: usize, tn: usize, res: &mut [f32; TILE]) {
    // SAFETY: as in `block_pass`.
    unsafe {
        let mut acc = [0f32; TILE];
        let (m3, four) = (vdupq_n_u8(3), vdupq_n_u8(4));
        for (sb, b) in cast::<BlockQ3K>(wrow).iter().enumerate() {
            // q[g]: group g = 8h + 2j + k (elements 128h + 32j + 16k ..+16).
            let mut q = [vdupq_n_s8(0); 16];
            for k in 0..2 {
                let hm = load_u8(&b.hmask[16 * k..]);
                for h in 0..2 {
                    let v = load_u8(&b.qs[32 * h + 16 * k..]);
                    for j in 0..4 {
                        let lo = vandq_u8(vshlq_u8(v, vdupq_n_s8(-2 * j as i8)), m3);
                        let set = vtstq_u8(hm, vdupq_n_u8(1 << (4 * h + j)));
                        // lo − 4, plus 4 where the high bit is set.
                        let u = vorrq_u8(lo, vandq_u8(set, four));
                        q[8 * h + 2 * j + k] =
                            vsubq_s8(vreinterpretq_s8_u8(u), vreinterpretq_s8_u8(four));
                    }
                }
            }
            let sc = q3k_scales(&b.scales);
            let d = f16_le(b.d);
            for (i, acc) in acc.iter_mut().enumerate().take(tn) {
                let t = t0 + i;
                let xq = &act.row_qs(t)[sb * QK_K..(sb + 1) * QK_K];
                let mut s = vdupq_n_s32(0);
                for g in 0..16 {
                    let e = D::dot4(vdupq_n_s32(0), q[g], load_i8(&xq[16 * g..]));
                    s = vmlaq_n_s32(s, e, sc[g] as i32);
                }
                let dx = act.row_d(t)[sb];
                *acc = combine::q6k_step(*acc, d * dx, vaddvq_s32(s));
            }
        }
        res[..tn].copy_from_slice(&acc[..tn]);
    }
}

// The entry points: each kernel once for baseline NEON and once compiled
// with the dot-product extension.

fn row_q5k_neon(_: QuantFormat, w: &[u8], a: &Act, t0: usize, tn: usize, r: &mut [f32; TILE]) {
    // SAFETY: as `row_block_neon`.
    unsafe { row_k45::<Neon, true>(w, a, t0, tn, r) }
}

#[target_feature(enable = "dotprod")]
unsafe fn row_q5k_sdot(
    _: QuantFormat,
    w: &[u8],
    a: &Act,
    t0: usize,
    tn: usize,
    r: &mut [f32; TILE],
) {
    // SAFETY: as `row_block_sdot`.
    unsafe { row_k45::<Sdot, true>(w, a, t0, tn, r) }
}

fn row_q3k_neon(_: QuantFormat, w: &[u8], a: &Act, t0: usize, tn: usize, r: &mut [f32; TILE]) {
    // SAFETY: as `row_block_neon`.
    unsafe { row_q3k::<Neon>(w, a, t0, tn, r) }
}

#[target_feature(enable = "dotprod")]
unsafe fn row_q3k_sdot(
    _: QuantFormat,
    w: &[u8],
    a: &Act,
    t0: usize,
    tn: usize,
    r: &mut [f32; TILE],
) {
    // SAFETY: as `row_block_sdot`.
    unsafe { row_q3k::<Sdot>(w, a, t0, tn, r) }
}

/// Rows per pass of [`row_half_neon`]: 4 rows × 4 accumulators + 4 weight
/// vectors stay in the 32 vector registers.
const HALF_PASS: usize = 4;

/// 4 half-precision values widened to f32, exactly: F16 by `fcvtl` (every
/// f16, subnormals included, is an f32; base ARMv8 NEON, through `asm!`
/// because the f16 vector types are not stable Rust), BF16 by a 16-bit
/// shift.
#[inline(always)]
fn widen4(f16: bool, h: uint16x4_t) -> float32x4_t {
    if f16 {
        let out: float32x4_t;
        // SAFETY: `fcvtl` is baseline ARMv8 Advanced SIMD; registers only.
        unsafe {
            asm!(
                "fcvtl {o:v}.4s, {i:v}.4h",
                o = lateout(vreg) out,
                i = in(vreg) h,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        out
    } else {
        // SAFETY: baseline NEON.
        unsafe { vreinterpretq_f32_u32(vshll_n_u16::<16>(h)) }
    }
}

/// F16 or BF16 weight row × f32 rows `t0..t0 + tn`, in passes of up to
/// [`HALF_PASS`] rows: `scalar::row_float`'s 16 lanes as four `float32x4_t`
/// per row, each step a multiply and then an add (a fused multiply-add
/// rounds once and would change the bits), the last partial chunk lane by
/// lane as the scalar code does, then [`combine::reduce16`]. Same bits as
/// the scalar reference and the x86 kernels.
fn row_half_neon(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    let f16 = format == QuantFormat::F16;
    let cols = act.cols;
    let full = cols / combine::F_LANES;
    let mut r0 = 0;
    while r0 < tn {
        let rn = (tn - r0).min(HALF_PASS);
        // SAFETY (every block below): baseline NEON; each load reads 16
        // elements of a chunk inside the row (`c < full`), bounds-checked
        // by the slicing.
        let mut acc = [[unsafe { vdupq_n_f32(0.0) }; 4]; HALF_PASS];
        for c in 0..full {
            let e = c * combine::F_LANES;
            let wb = &wrow[2 * e..2 * e + 2 * combine::F_LANES];
            let w: [float32x4_t; 4] = unsafe {
                let lo = vld1q_u16(wb.as_ptr().cast());
                let hi = vld1q_u16(wb.as_ptr().add(16).cast());
                [
                    widen4(f16, vget_low_u16(lo)),
                    widen4(f16, vget_high_u16(lo)),
                    widen4(f16, vget_low_u16(hi)),
                    widen4(f16, vget_high_u16(hi)),
                ]
            };
            for (r, acc) in acc.iter_mut().enumerate().take(rn) {
                let x = &act.row_x(t0 + r0 + r)[e..e + combine::F_LANES];
                for (j, a) in acc.iter_mut().enumerate() {
                    unsafe {
                        let xv = vld1q_f32(x.as_ptr().add(4 * j));
                        *a = vaddq_f32(*a, vmulq_f32(w[j], xv));
                    }
                }
            }
        }
        let e = full * combine::F_LANES;
        for (r, acc) in acc.iter().enumerate().take(rn) {
            let mut a = [0f32; combine::F_LANES];
            for (j, v) in acc.iter().enumerate() {
                unsafe { vst1q_f32(a.as_mut_ptr().add(4 * j), *v) };
            }
            let x = &act.row_x(t0 + r0 + r)[e..];
            for (k, (w, x)) in wrow[2 * e..].chunks_exact(2).zip(x).enumerate() {
                a[k] += scalar::widen(format, w) * x;
            }
            res[r0 + r] = combine::reduce16(&a);
        }
        r0 += rn;
    }
}

fn row_block_neon(f: QuantFormat, w: &[u8], a: &Act, t0: usize, tn: usize, r: &mut [f32; TILE]) {
    // SAFETY: `Neon` needs only NEON, which every aarch64 CPU has.
    unsafe { row_block::<Neon>(f, w, a, t0, tn, r) }
}

#[target_feature(enable = "dotprod")]
unsafe fn row_block_sdot(
    f: QuantFormat,
    w: &[u8],
    a: &Act,
    t0: usize,
    tn: usize,
    r: &mut [f32; TILE],
) {
    // SAFETY: compiled with dotprod; the caller checked the CPU has it.
    unsafe { row_block::<Sdot>(f, w, a, t0, tn, r) }
}

fn row_q4k_neon(_: QuantFormat, w: &[u8], a: &Act, t0: usize, tn: usize, r: &mut [f32; TILE]) {
    // SAFETY: as `row_block_neon`.
    unsafe { row_q4k::<Neon>(w, a, t0, tn, r) }
}

#[target_feature(enable = "dotprod")]
unsafe fn row_q4k_sdot(
    _: QuantFormat,
    w: &[u8],
    a: &Act,
    t0: usize,
    tn: usize,
    r: &mut [f32; TILE],
) {
    // SAFETY: as `row_block_sdot`.
    unsafe { row_q4k::<Sdot>(w, a, t0, tn, r) }
}

fn row_q6k_neon(_: QuantFormat, w: &[u8], a: &Act, t0: usize, tn: usize, r: &mut [f32; TILE]) {
    // SAFETY: as `row_block_neon`.
    unsafe { row_q6k::<Neon>(w, a, t0, tn, r) }
}

#[target_feature(enable = "dotprod")]
unsafe fn row_q6k_sdot(
    _: QuantFormat,
    w: &[u8],
    a: &Act,
    t0: usize,
    tn: usize,
    r: &mut [f32; TILE],
) {
    // SAFETY: as `row_block_sdot`.
    unsafe { row_q6k::<Sdot>(w, a, t0, tn, r) }
}
