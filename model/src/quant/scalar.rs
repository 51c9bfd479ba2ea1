//! Portable scalar kernels: the reference every SIMD path must match bit for bit,
//! plus the weight unpacking and dequantization they share.

use super::act::Act;
use super::blocks::{
    bf16_le, cast, f16_le, q3k_scales, q4k_scale_min, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1,
    BlockQ5K, BlockQ5_0, BlockQ5_0x4, BlockQ5_1, BlockQ6K, BlockQ8_0, QK, QK_K,
};
use super::combine;
use super::types::{QuantFormat, TILE};

/// Unpack block `b` of a Q4_0/Q5_0/Q5_0x4/Q8_0 row into signed values;
/// returns its scale.
#[inline(always)]
pub fn unpack_block(format: QuantFormat, wrow: &[u8], b: usize, o: &mut [i8; QK]) -> f32 {
    match format {
        QuantFormat::Q4_0 => {
            let b = &cast::<BlockQ4_0>(wrow)[b];
            for l in 0..QK / 2 {
                o[l] = (b.qs[l] & 0xF) as i8 - 8;
                o[l + QK / 2] = (b.qs[l] >> 4) as i8 - 8;
            }
            f16_le(b.d)
        }
        QuantFormat::Q5_0 => {
            let b = &cast::<BlockQ5_0>(wrow)[b];
            let qh = u32::from_le_bytes(b.qh);
            for l in 0..QK / 2 {
                let h0 = ((qh >> l) & 1) as u8;
                let h1 = ((qh >> (l + 16)) & 1) as u8;
                o[l] = ((b.qs[l] & 0xF) | (h0 << 4)) as i8 - 16;
                o[l + QK / 2] = ((b.qs[l] >> 4) | (h1 << 4)) as i8 - 16;
            }
            f16_le(b.d)
        }
        QuantFormat::Q5_0x4 => {
            let (g, i) = (&cast::<BlockQ5_0x4>(wrow)[b / 4], b % 4);
            for (j, o) in o.iter_mut().enumerate() {
                let lo = (g.qs[32 * (i / 2) + j] >> (4 * (i % 2))) & 0xF;
                let hi = (g.qh[j % 16] >> (i + 4 * (j / 16))) & 1;
                *o = (lo | (hi << 4)) as i8 - 16;
            }
            f16_le(g.d[i])
        }
        QuantFormat::Q8_0 => {
            let b = &cast::<BlockQ8_0>(wrow)[b];
            o.copy_from_slice(&b.qs);
            f16_le(b.d)
        }
        _ => unreachable!("unpack_block called for {format:?}"),
    }
}

/// Unpack block `b` of a Q4_1/Q5_1 row into unsigned values (0..16 or
/// 0..32); returns its scale and offset `(d, m)`.
#[inline(always)]
pub fn unpack_min_block(
    format: QuantFormat,
    wrow: &[u8],
    b: usize,
    o: &mut [u8; QK],
) -> (f32, f32) {
    match format {
        QuantFormat::Q4_1 => {
            let b = &cast::<BlockQ4_1>(wrow)[b];
            for l in 0..QK / 2 {
                o[l] = b.qs[l] & 0xF;
                o[l + QK / 2] = b.qs[l] >> 4;
            }
            (f16_le(b.d), f16_le(b.m))
        }
        QuantFormat::Q5_1 => {
            let b = &cast::<BlockQ5_1>(wrow)[b];
            let qh = u32::from_le_bytes(b.qh);
            for l in 0..QK / 2 {
                let h0 = ((qh >> l) & 1) as u8;
                let h1 = ((qh >> (l + 16)) & 1) as u8;
                o[l] = (b.qs[l] & 0xF) | (h0 << 4);
                o[l + QK / 2] = (b.qs[l] >> 4) | (h1 << 4);
            }
            (f16_le(b.d), f16_le(b.m))
        }
        _ => unreachable!("unpack_min_block called for {format:?}"),
    }
}

/// Unpacked Q4_K (or Q5_K) super-block: values 0..16 (0..32), 8 scales, 8 mins.
pub struct Q4KUnpacked {
    pub q: [u8; QK_K],
    pub sc: [u8; 8],
    pub mn: [u8; 8],
    pub d: f32,
    pub dmin: f32,
}

#[inline(always)]
pub fn unpack_q4k(b: &BlockQ4K, u: &mut Q4KUnpacked) {
    for c in 0..4 {
        for l in 0..32 {
            u.q[64 * c + l] = b.qs[32 * c + l] & 0xF;
            u.q[64 * c + 32 + l] = b.qs[32 * c + l] >> 4;
        }
    }
    for j in 0..8 {
        (u.sc[j], u.mn[j]) = q4k_scale_min(j, &b.scales);
    }
    u.d = f16_le(b.d);
    u.dmin = f16_le(b.dmin);
}

/// Unpack a Q5_K super-block (into the Q4_K layout: values 0..32).
#[inline(always)]
pub fn unpack_q5k(b: &BlockQ5K, u: &mut Q4KUnpacked) {
    for c in 0..4 {
        for l in 0..32 {
            let h = b.qh[l] >> (2 * c);
            u.q[64 * c + l] = (b.qs[32 * c + l] & 0xF) | ((h & 1) << 4);
            u.q[64 * c + 32 + l] = (b.qs[32 * c + l] >> 4) | (((h >> 1) & 1) << 4);
        }
    }
    for j in 0..8 {
        (u.sc[j], u.mn[j]) = q4k_scale_min(j, &b.scales);
    }
    u.d = f16_le(b.d);
    u.dmin = f16_le(b.dmin);
}

/// Unpacked Q3_K super-block: values −4..4, 16 scales `sc − 32`.
pub struct Q3KUnpacked {
    pub q: [i8; QK_K],
    pub sc: [i8; 16],
    pub d: f32,
}

#[inline(always)]
pub fn unpack_q3k(b: &BlockQ3K, u: &mut Q3KUnpacked) {
    for h in 0..2 {
        for j in 0..4 {
            for l in 0..32 {
                let lo = ((b.qs[32 * h + l] >> (2 * j)) & 3) as i8;
                let hi = (b.hmask[l] >> (4 * h + j)) & 1;
                u.q[128 * h + 32 * j + l] = if hi == 1 { lo } else { lo - 4 };
            }
        }
    }
    u.sc = q3k_scales(&b.scales);
    u.d = f16_le(b.d);
}

/// Unpacked Q6_K super-block: values 0..64 (the `- 32` is applied in the dot).
pub struct Q6KUnpacked {
    pub q: [u8; QK_K],
    pub sc: [i8; 16],
    pub d: f32,
}

#[inline(always)]
pub fn unpack_q6k(b: &BlockQ6K, u: &mut Q6KUnpacked) {
    for h in 0..2 {
        let ql = &b.ql[64 * h..];
        let qh = &b.qh[32 * h..];
        let q = &mut u.q[128 * h..];
        for l in 0..32 {
            q[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            q[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    u.sc = b.scales;
    u.d = f16_le(b.d);
}

/// Q4_0/Q5_0/Q5_0x4/Q8_0 row × activation rows `t0..t0+tn` (Q8_0): per
/// block one exact integer `s`, stepped by [`combine::block_step`] into
/// lane `b % 16` of the row's accumulator, then [`combine::reduce16`].
pub fn row_group(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    let mut acc = [[0f32; combine::BLOCK_LANES]; TILE];
    let mut w = [0i8; QK];
    for b in 0..act.nb {
        let dw = unpack_block(format, wrow, b, &mut w);
        let lane = b % combine::BLOCK_LANES;
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let row = t0 + t;
            let xq = &act.row_qs(row)[b * QK..(b + 1) * QK];
            let s: i32 = w.iter().zip(xq).map(|(&w, &x)| w as i32 * x as i32).sum();
            acc[lane] = combine::block_step(acc[lane], dw * act.row_d(row)[b], s);
        }
    }
    for t in 0..tn {
        res[t] = combine::reduce16(&acc[t]);
    }
}

/// Q4_1/Q5_1 row × activation rows `t0..t0+tn` (Q8_1): per block one
/// exact integer `s`, stepped by [`combine::min_block_step`] into lane
/// `b % 16` of the row's accumulator, then [`combine::reduce16`].
pub fn row_group_min(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    let mut acc = [[0f32; combine::BLOCK_LANES]; TILE];
    let mut w = [0u8; QK];
    for b in 0..act.nb {
        let (dw, mw) = unpack_min_block(format, wrow, b, &mut w);
        let lane = b % combine::BLOCK_LANES;
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let row = t0 + t;
            let xq = &act.row_qs(row)[b * QK..(b + 1) * QK];
            let s: i32 = w.iter().zip(xq).map(|(&w, &x)| w as i32 * x as i32).sum();
            let dx = act.row_d(row)[b];
            acc[lane] = combine::min_block_step(acc[lane], dw * dx, s, mw, act.row_xs(row)[b]);
        }
    }
    for t in 0..tn {
        res[t] = combine::reduce16(&acc[t]);
    }
}

/// Q4_K row × activation rows `t0..t0+tn` (Q8_K): one exact integer pair
/// per super-block, stepped in order by [`combine::q4k_step`].
pub fn row_q4k(wrow: &[u8], act: &Act, t0: usize, tn: usize, res: &mut [f32; TILE]) {
    let mut acc = [0f32; TILE];
    let mut u = Q4KUnpacked {
        q: [0; QK_K],
        sc: [0; 8],
        mn: [0; 8],
        d: 0.0,
        dmin: 0.0,
    };
    for (sb, b) in cast::<BlockQ4K>(wrow).iter().enumerate() {
        unpack_q4k(b, &mut u);
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let xq = &act.row_qs(t0 + t)[sb * QK_K..(sb + 1) * QK_K];
            let bs = &act.row_bsums(t0 + t)[sb * 16..(sb + 1) * 16];
            let mut s = 0i32;
            let mut mm = 0i32;
            for c in 0..8 {
                let e: i32 = (32 * c..32 * c + 32)
                    .map(|k| u.q[k] as i32 * xq[k] as i32)
                    .sum();
                s += u.sc[c] as i32 * e;
                mm += u.mn[c] as i32 * (bs[2 * c] as i32 + bs[2 * c + 1] as i32);
            }
            let dx = act.row_d(t0 + t)[sb];
            *acc = combine::q4k_step(*acc, u.d * dx, u.dmin * dx, s, mm);
        }
    }
    res[..tn].copy_from_slice(&acc[..tn]);
}

/// Q6_K row × activation rows `t0..t0+tn` (Q8_K): one exact integer per
/// super-block, stepped in order by [`combine::q6k_step`].
pub fn row_q6k(wrow: &[u8], act: &Act, t0: usize, tn: usize, res: &mut [f32; TILE]) {
    let mut acc = [0f32; TILE];
    let mut u = Q6KUnpacked {
        q: [0; QK_K],
        sc: [0; 16],
        d: 0.0,
    };
    for (sb, b) in cast::<BlockQ6K>(wrow).iter().enumerate() {
        unpack_q6k(b, &mut u);
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let xq = &act.row_qs(t0 + t)[sb * QK_K..(sb + 1) * QK_K];
            let mut s = 0i32;
            for g in 0..16 {
                let e: i32 = (16 * g..16 * g + 16)
                    .map(|k| (u.q[k] as i32 - 32) * xq[k] as i32)
                    .sum();
                s += u.sc[g] as i32 * e;
            }
            let dx = act.row_d(t0 + t)[sb];
            *acc = combine::q6k_step(*acc, u.d * dx, s);
        }
    }
    res[..tn].copy_from_slice(&acc[..tn]);
}

/// Q5_K row × activation rows `t0..t0+tn` (Q8_K): as [`row_q4k`] with
/// 5-bit values, stepped by [`combine::q4k_step`].
pub fn row_q5k(wrow: &[u8], act: &Act, t0: usize, tn: usize, res: &mut [f32; TILE]) {
    let mut acc = [0f32; TILE];
    let mut u = Q4KUnpacked {
        q: [0; QK_K],
        sc: [0; 8],
        mn: [0; 8],
        d: 0.0,
        dmin: 0.0,
    };
    for (sb, b) in cast::<BlockQ5K>(wrow).iter().enumerate() {
        unpack_q5k(b, &mut u);
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let xq = &act.row_qs(t0 + t)[sb * QK_K..(sb + 1) * QK_K];
            let bs = &act.row_bsums(t0 + t)[sb * 16..(sb + 1) * 16];
            let mut s = 0i32;
            let mut mm = 0i32;
            for c in 0..8 {
                let e: i32 = (32 * c..32 * c + 32)
                    .map(|k| u.q[k] as i32 * xq[k] as i32)
                    .sum();
                s += u.sc[c] as i32 * e;
                mm += u.mn[c] as i32 * (bs[2 * c] as i32 + bs[2 * c + 1] as i32);
            }
            let dx = act.row_d(t0 + t)[sb];
            *acc = combine::q4k_step(*acc, u.d * dx, u.dmin * dx, s, mm);
        }
    }
    res[..tn].copy_from_slice(&acc[..tn]);
}

/// Q3_K row × activation rows `t0..t0+tn` (Q8_K): one exact integer per
/// super-block `S = Σ_g (sc_g − 32) · Σ q·x`, stepped by [`combine::q6k_step`].
pub fn row_q3k(wrow: &[u8], act: &Act, t0: usize, tn: usize, res: &mut [f32; TILE]) {
    let mut acc = [0f32; TILE];
    let mut u = Q3KUnpacked {
        q: [0; QK_K],
        sc: [0; 16],
        d: 0.0,
    };
    for (sb, b) in cast::<BlockQ3K>(wrow).iter().enumerate() {
        unpack_q3k(b, &mut u);
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let xq = &act.row_qs(t0 + t)[sb * QK_K..(sb + 1) * QK_K];
            let mut s = 0i32;
            for g in 0..16 {
                let e: i32 = (16 * g..16 * g + 16)
                    .map(|k| u.q[k] as i32 * xq[k] as i32)
                    .sum();
                s += u.sc[g] as i32 * e;
            }
            let dx = act.row_d(t0 + t)[sb];
            *acc = combine::q6k_step(*acc, u.d * dx, s);
        }
    }
    res[..tn].copy_from_slice(&acc[..tn]);
}

/// One f32/f16/bf16 weight (little-endian bytes) widened to f32 (exact).
#[inline(always)]
pub fn widen(format: QuantFormat, e: &[u8]) -> f32 {
    match format {
        QuantFormat::F32 => f32::from_le_bytes([e[0], e[1], e[2], e[3]]),
        QuantFormat::F16 => f16_le([e[0], e[1]]),
        _ => bf16_le([e[0], e[1]]),
    }
}

/// F32/F16/BF16 row × f32 activation rows: 16 lanes, separate multiply and add,
/// fixed reduction. Shared by every ISA.
pub fn row_float(
    format: QuantFormat,
    wrow: &[u8],
    act: &Act,
    t0: usize,
    tn: usize,
    res: &mut [f32; TILE],
) {
    let cols = act.cols;
    let esz = if format == QuantFormat::F32 { 4 } else { 2 };
    let mut w = [0f32; combine::F_LANES];
    let mut acc = [[0f32; combine::F_LANES]; TILE];
    for (c, wc) in wrow.chunks(combine::F_LANES * esz).enumerate() {
        let n = wc.len() / esz;
        for (k, e) in wc.chunks_exact(esz).enumerate() {
            w[k] = widen(format, e);
        }
        for (t, acc) in acc.iter_mut().enumerate().take(tn) {
            let x = &act.row_x(t0 + t)[c * combine::F_LANES..];
            for k in 0..n {
                acc[k] += w[k] * x[k];
            }
        }
    }
    let _ = cols;
    for t in 0..tn {
        res[t] = combine::reduce16(&acc[t]);
    }
}

/// Dequantize one row (`out.len()` elements) of `format`.
pub fn dequantize_row(format: QuantFormat, data: &[u8], out: &mut [f32]) {
    match format {
        QuantFormat::F32 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        QuantFormat::F16 | QuantFormat::BF16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = widen(format, c);
            }
        }
        QuantFormat::Q4_1 | QuantFormat::Q5_1 => {
            let mut buf = [0u8; QK];
            for (b, o) in out.chunks_exact_mut(QK).enumerate() {
                let (d, m) = unpack_min_block(format, data, b, &mut buf);
                for (o, &q) in o.iter_mut().zip(&buf) {
                    *o = q as f32 * d + m;
                }
            }
        }
        QuantFormat::Q5K => {
            let mut u = Q4KUnpacked {
                q: [0; QK_K],
                sc: [0; 8],
                mn: [0; 8],
                d: 0.0,
                dmin: 0.0,
            };
            for (b, o) in cast::<BlockQ5K>(data)
                .iter()
                .zip(out.chunks_exact_mut(QK_K))
            {
                unpack_q5k(b, &mut u);
                for j in 0..8 {
                    let d1 = u.d * u.sc[j] as f32;
                    let m1 = u.dmin * u.mn[j] as f32;
                    for l in 32 * j..32 * j + 32 {
                        o[l] = d1 * u.q[l] as f32 - m1;
                    }
                }
            }
        }
        QuantFormat::Q3K => {
            let mut u = Q3KUnpacked {
                q: [0; QK_K],
                sc: [0; 16],
                d: 0.0,
            };
            for (b, o) in cast::<BlockQ3K>(data)
                .iter()
                .zip(out.chunks_exact_mut(QK_K))
            {
                unpack_q3k(b, &mut u);
                for l in 0..QK_K {
                    o[l] = u.d * u.sc[l / 16] as f32 * u.q[l] as f32;
                }
            }
        }
        QuantFormat::Q4_0 | QuantFormat::Q5_0 | QuantFormat::Q5_0x4 | QuantFormat::Q8_0 => {
            let mut buf = [0i8; QK];
            for (b, o) in out.chunks_exact_mut(QK).enumerate() {
                let dw = unpack_block(format, data, b, &mut buf);
                for (o, &q) in o.iter_mut().zip(&buf) {
                    *o = q as f32 * dw;
                }
            }
        }
        QuantFormat::Q4K => {
            let mut u = Q4KUnpacked {
                q: [0; QK_K],
                sc: [0; 8],
                mn: [0; 8],
                d: 0.0,
                dmin: 0.0,
            };
            for (b, o) in cast::<BlockQ4K>(data)
                .iter()
                .zip(out.chunks_exact_mut(QK_K))
            {
                unpack_q4k(b, &mut u);
                for j in 0..8 {
                    let d1 = u.d * u.sc[j] as f32;
                    let m1 = u.dmin * u.mn[j] as f32;
                    for l in 32 * j..32 * j + 32 {
                        o[l] = d1 * u.q[l] as f32 - m1;
                    }
                }
            }
        }
        QuantFormat::Q6K => {
            let mut u = Q6KUnpacked {
                q: [0; QK_K],
                sc: [0; 16],
                d: 0.0,
            };
            for (b, o) in cast::<BlockQ6K>(data)
                .iter()
                .zip(out.chunks_exact_mut(QK_K))
            {
                unpack_q6k(b, &mut u);
                for l in 0..QK_K {
                    o[l] = u.d * u.sc[l / 16] as f32 * (u.q[l] as i32 - 32) as f32;
                }
            }
        }
    }
}
