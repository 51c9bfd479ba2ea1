//! Attention of the query heads of one KV head over their own sequence's
//! cached keys and values: the one place the per-row attention arithmetic lives (every
//! architecture, every KV format), in a fixed loop order so that a row's
//! result never depends on the other rows of a forward.

use crate::expf::exp_in_place;
use crate::kv_cache::{widen_f16, widen_i8, KvRow, KvStore};
use crate::vecops::{axpy, axpy4, dot, dot4};
use std::ops::Range;

/// Causal attention of the query heads that share one KV head (`q`:
/// `heads × hd`, `out` the same shape) over positions `span` of `layer` in
/// `cache` (the first `span.end` positions, or a sliding window of them; the
/// KV head at `off..off + hd` of each row). Each query head's result is
/// computed exactly as if alone: its scores one `dot` per key, its output
/// one `axpy` per key in position order. The heads share the loop over the
/// keys only so that each K/V row is read from memory once for all of
/// them (`dot4`/`axpy4` take four keys at a time with the bits of four
/// single calls). An f32 row is read in place; an f16 row's head is widened
/// to f32 (exactly); an INT8 row's head is widened to f32 and its scale
/// applied to the dot product (keys) or the weight (values).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend<C: KvStore>(
    q: &[f32],
    cache: &C,
    layer: usize,
    span: Range<usize>,
    off: usize,
    hd: usize,
    scale: f32,
    out: &mut [f32],
) {
    let head = off / hd;
    let (heads, len, first) = (q.len() / hd, span.len(), span.start);
    if len == 0 {
        out.fill(0.0);
        return;
    }
    // f16 or INT8 heads widened (unused for f32 rows), one per key of a
    // group of four.
    let mut wide: [Vec<f32>; 4] = Default::default();
    // Scores of query head h at `h·len..`.
    let mut scores = vec![0f32; heads * len];
    let quads = len / 4;
    for g in 0..quads {
        let t = first + 4 * g;
        let rows = head_rows4(|t| cache.key(layer, t), t, off, hd, head, &mut wide);
        for (qh, sh) in q.chunks_exact(hd).zip(scores.chunks_exact_mut(len)) {
            let d = dot4(qh, rows.map(|r| r.0));
            for i in 0..4 {
                sh[4 * g + i] = scaled(d[i], rows[i].1) * scale;
            }
        }
    }
    for t in first + 4 * quads..span.end {
        let (r, s) = head_row(cache.key(layer, t), off, hd, head, &mut wide[0]);
        for (qh, sh) in q.chunks_exact(hd).zip(scores.chunks_exact_mut(len)) {
            sh[t - first] = scaled(dot(qh, r), s) * scale;
        }
    }
    // Per head: softmax weights (`exp(s − max) / Σ` as `· (1 / Σ)`).
    let inv: Vec<f32> = scores
        .chunks_exact_mut(len)
        .map(|sh| {
            let max = sh.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            for s in sh.iter_mut() {
                *s -= max;
            }
            exp_in_place(sh);
            1.0 / sh.iter().fold(0f32, |sum, &e| sum + e)
        })
        .collect();
    out.fill(0.0);
    for g in 0..quads {
        let t = first + 4 * g;
        let rows = head_rows4(|t| cache.value(layer, t), t, off, hd, head, &mut wide);
        for ((oh, sh), inv) in out
            .chunks_exact_mut(hd)
            .zip(scores.chunks_exact(len))
            .zip(&inv)
        {
            let w = std::array::from_fn(|i| scaled(sh[4 * g + i] * inv, rows[i].1));
            axpy4(oh, w, rows.map(|r| r.0));
        }
    }
    for t in first + 4 * quads..span.end {
        let (r, s) = head_row(cache.value(layer, t), off, hd, head, &mut wide[0]);
        for ((oh, sh), inv) in out
            .chunks_exact_mut(hd)
            .zip(scores.chunks_exact(len))
            .zip(&inv)
        {
            axpy(oh, scaled(sh[t - first] * inv, s), r);
        }
    }
}

/// [`head_row`] of rows `t..t + 4` (`row(t)`: a K or a V row), each
/// widened into its own buffer of `wide`.
fn head_rows4<'a>(
    row: impl Fn(usize) -> KvRow<'a>,
    t: usize,
    off: usize,
    hd: usize,
    head: usize,
    wide: &'a mut [Vec<f32>; 4],
) -> [(&'a [f32], f32); 4] {
    let [w0, w1, w2, w3] = wide;
    [
        head_row(row(t), off, hd, head, w0),
        head_row(row(t + 1), off, hd, head, w1),
        head_row(row(t + 2), off, hd, head, w2),
        head_row(row(t + 3), off, hd, head, w3),
    ]
}

/// One head of a K or V row as f32: an f32 row's slice in place, an f16 or
/// INT8 row's widened (exactly) into `wide`; with the INT8 row's scale
/// for that head (1 for the others), which [`scaled`] applies.
#[inline]
fn head_row<'a>(
    row: KvRow<'a>,
    off: usize,
    hd: usize,
    head: usize,
    wide: &'a mut Vec<f32>,
) -> (&'a [f32], f32) {
    match row {
        KvRow::F32(r) => (&r[off..off + hd], 1.0),
        KvRow::F16(r) => {
            widen_f16(&r[off..off + hd], wide);
            (wide, 1.0)
        }
        KvRow::Int8 { q, scales } => {
            widen_i8(&q[off..off + hd], wide);
            (wide, scales[head])
        }
    }
}

/// `v` times a row's scale: an INT8 row's (one rounding), or 1 (exact:
/// `v` itself, bit for bit). Always a plain multiply: a branch-free
/// `Option` here was compiled to a multiply by an undefined payload, a
/// denormal at times, and its microcode assist took half of `attend`'s
/// time (perf, 128-row forward).
#[inline]
fn scaled(v: f32, row_scale: f32) -> f32 {
    v * row_scale
}
