//! Attention of the query heads of one KV head over their own sequence's
//! cached keys and values: the one place the per-row attention arithmetic lives (every
//! architecture, every KV format), in a fixed loop order so that a row's
//! result never depends on the other rows of a forward, although a tile of
//! rows shares each K/V row's read.

use crate::expf::exp_in_place;
use crate::kv_cache::{widen_f16, widen_i8, KvRow, KvStore};
use crate::vecops::{axpy, axpy4, dot, dot4};
use std::ops::Range;

/// Causal attention of a tile of query rows of one sequence, for the
/// query heads that share one KV head: row `i`'s heads are
/// `q[i·q_stride..][..heads·hd]`, it attends over positions `spans[i]` of
/// `layer` in `cache` (the first positions up to its own, or a sliding
/// window of them; the KV head at `off..off + hd` of each row), and its
/// result goes to `out[i·heads·hd..][..heads·hd]`.
///
/// Each query head of each row is computed exactly as if alone: its scores
/// one `dot` per key, its output one `axpy` per key in position order. The
/// rows and heads share the loop over the keys only so that each K/V row is
/// read (and, for f16 or INT8 rows, widened) once for all of them
/// (`dot4`/`axpy4` take four keys at a time with the bits of four single
/// calls, so where a group of four starts does not change a bit). An f32
/// row is read in place; an f16 row's head is widened to f32 (exactly); an
/// INT8 row's head is widened to f32 and its scale applied to the dot
/// product (keys) or the weight (values). A row with an empty span gets
/// zeros.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend<C: KvStore>(
    q: &[f32],
    q_stride: usize,
    spans: &[Range<usize>],
    cache: &C,
    layer: usize,
    off: usize,
    hd: usize,
    heads: usize,
    scale: f32,
    out: &mut [f32],
) {
    let head = off / hd;
    let width = heads * hd;
    out.fill(0.0);
    let (Some(lo), Some(hi)) = (
        spans
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| s.start)
            .min(),
        spans.iter().map(|s| s.end).max(),
    ) else {
        return;
    };
    // Row i's query heads, `heads × hd`.
    let qrow = |i: usize| &q[i * q_stride..i * q_stride + width];
    // Scores of row i's query head h at `base[i] + h·len_i..`.
    let mut base = Vec::with_capacity(spans.len());
    let mut total = 0usize;
    for s in spans {
        base.push(total);
        total += heads * s.len();
    }
    let mut scores = vec![0f32; total];
    // f16 or INT8 heads widened (unused for f32 rows), one per key of a
    // group of four.
    let mut wide: [Vec<f32>; 4] = Default::default();
    let mut t = lo;
    while t < hi {
        if t + 4 <= hi {
            let rows = head_rows4(|t| cache.key(layer, t), t, off, hd, head, &mut wide);
            // (Arrays written out: `array::map` is not inlined here.)
            let keys = [rows[0].0, rows[1].0, rows[2].0, rows[3].0];
            for (i, s) in spans.iter().enumerate() {
                let len = s.len();
                let sc = &mut scores[base[i]..base[i] + heads * len];
                if s.start <= t && t + 4 <= s.end {
                    let at = t - s.start;
                    for (qh, sh) in qrow(i).chunks_exact(hd).zip(sc.chunks_exact_mut(len)) {
                        let d = dot4(qh, keys);
                        for j in 0..4 {
                            sh[at + j] = scaled(d[j], rows[j].1) * scale;
                        }
                    }
                } else {
                    for (j, &key) in rows.iter().enumerate() {
                        if s.contains(&(t + j)) {
                            score_key(qrow(i), sc, len, t + j - s.start, key, scale);
                        }
                    }
                }
            }
            t += 4;
        } else {
            let (r, rs) = head_row(cache.key(layer, t), off, hd, head, &mut wide[0]);
            for (i, s) in spans.iter().enumerate() {
                if s.contains(&t) {
                    let len = s.len();
                    let sc = &mut scores[base[i]..base[i] + heads * len];
                    score_key(qrow(i), sc, len, t - s.start, (r, rs), scale);
                }
            }
            t += 1;
        }
    }
    // Per row and head: softmax weights (`exp(s − max) / Σ` as `· (1 / Σ)`).
    let mut inv = vec![0f32; spans.len() * heads];
    for (i, s) in spans.iter().enumerate() {
        let len = s.len();
        if len == 0 {
            continue;
        }
        let sc = &mut scores[base[i]..base[i] + heads * len];
        for (sh, inv) in sc.chunks_exact_mut(len).zip(&mut inv[i * heads..]) {
            let max = sh.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            for s in sh.iter_mut() {
                *s -= max;
            }
            exp_in_place(sh);
            *inv = 1.0 / sh.iter().fold(0f32, |sum, &e| sum + e);
        }
    }
    let mut t = lo;
    while t < hi {
        if t + 4 <= hi {
            let rows = head_rows4(|t| cache.value(layer, t), t, off, hd, head, &mut wide);
            let values = [rows[0].0, rows[1].0, rows[2].0, rows[3].0];
            for (i, s) in spans.iter().enumerate() {
                let len = s.len();
                let sc = &scores[base[i]..base[i] + heads * len];
                let o = &mut out[i * width..(i + 1) * width];
                let inv = &inv[i * heads..(i + 1) * heads];
                if s.start <= t && t + 4 <= s.end {
                    let at = t - s.start;
                    for ((oh, sh), &inv) in
                        o.chunks_exact_mut(hd).zip(sc.chunks_exact(len)).zip(inv)
                    {
                        let w = [
                            scaled(sh[at] * inv, rows[0].1),
                            scaled(sh[at + 1] * inv, rows[1].1),
                            scaled(sh[at + 2] * inv, rows[2].1),
                            scaled(sh[at + 3] * inv, rows[3].1),
                        ];
                        axpy4(oh, w, values);
                    }
                } else {
                    for (j, &value) in rows.iter().enumerate() {
                        if s.contains(&(t + j)) {
                            add_value(o, sc, len, inv, t + j - s.start, value);
                        }
                    }
                }
            }
            t += 4;
        } else {
            let (r, rs) = head_row(cache.value(layer, t), off, hd, head, &mut wide[0]);
            for (i, s) in spans.iter().enumerate() {
                if s.contains(&t) {
                    let len = s.len();
                    let sc = &scores[base[i]..base[i] + heads * len];
                    let o = &mut out[i * width..(i + 1) * width];
                    let inv = &inv[i * heads..(i + 1) * heads];
                    add_value(o, sc, len, inv, t - s.start, (r, rs));
                }
            }
            t += 1;
        }
    }
}

/// One key's scores for one row: for each of its query heads (`q`, `hd`
/// each), the `dot` with the key's head `key.0` times the row scale
/// `key.1` and `scale`, at offset `at` of that head's scores (`len` each).
fn score_key(q: &[f32], scores: &mut [f32], len: usize, at: usize, key: (&[f32], f32), scale: f32) {
    let (r, rs) = key;
    for (qh, sh) in q.chunks_exact(r.len()).zip(scores.chunks_exact_mut(len)) {
        sh[at] = scaled(dot(qh, r), rs) * scale;
    }
}

/// One value's share of one row's output: for each query head's output
/// (`out`, the value head's length each), an `axpy` of the value head
/// `value.0` with its softmax weight (score at offset `at` of the head's
/// `len`, times the head's `1 / Σ` in `inv`, times the row scale `value.1`).
fn add_value(
    out: &mut [f32],
    scores: &[f32],
    len: usize,
    inv: &[f32],
    at: usize,
    value: (&[f32], f32),
) {
    let (r, rs) = value;
    for ((oh, sh), &inv) in out
        .chunks_exact_mut(r.len())
        .zip(scores.chunks_exact(len))
        .zip(inv)
    {
        axpy(oh, scaled(sh[at] * inv, rs), r);
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
