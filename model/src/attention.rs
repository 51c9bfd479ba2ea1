//! Attention of one query head over its own sequence's cached keys and
//! values: the one place the per-row attention arithmetic lives (every
//! architecture, every KV format), in a fixed loop order so that a row's
//! result never depends on the other rows of a forward.

use crate::kv_cache::{widen_f16, widen_i8, KvRow, KvStore};
use crate::vecops::{axpy, dot};
use std::ops::Range;

/// Causal attention of one query head over positions `span` of `layer` in
/// `cache` (the first `span.end` positions, or a sliding window of them; the
/// head's K/V at `off..off + hd` of each row). An f32 row is read in place;
/// an f16 row's head is widened to f32 (exactly); an INT8 row's head is
/// widened to f32 and its scale applied to the dot product (keys) or the
/// weight (values).
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
    let mut wide = Vec::new(); // an f16 or INT8 head widened (empty for f32)
    let first = span.start;
    let mut scores = vec![0f32; span.len()];
    let mut max = f32::NEG_INFINITY;
    for (t, s) in span.clone().zip(scores.iter_mut()) {
        *s = match cache.key(layer, t) {
            KvRow::F32(r) => dot(q, &r[off..off + hd]),
            KvRow::F16(r) => {
                widen_f16(&r[off..off + hd], &mut wide);
                dot(q, &wide)
            }
            KvRow::Int8 { q: kq, scales } => {
                widen_i8(&kq[off..off + hd], &mut wide);
                dot(q, &wide) * scales[head]
            }
        } * scale;
        max = max.max(*s);
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    out.fill(0.0);
    for (t, s) in scores.iter().enumerate() {
        let w = s * inv;
        match cache.value(layer, first + t) {
            KvRow::F32(r) => axpy(out, w, &r[off..off + hd]),
            KvRow::F16(r) => {
                widen_f16(&r[off..off + hd], &mut wide);
                axpy(out, w, &wide);
            }
            KvRow::Int8 { q: vq, scales } => {
                widen_i8(&vq[off..off + hd], &mut wide);
                axpy(out, w * scales[head], &wide);
            }
        }
    }
}
