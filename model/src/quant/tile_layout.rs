//! The tile layout: Q4_K and Q6_K matrices rearranged at load time for the
//! AMX kernels (`x86_amx`), so that a tile step's unpack is nibble
//! extraction and the scale products only, with no transpose and no scale
//! decoding (docs/model-core.md, "AMX, round three").
//!
//! Portable byte rearrangement (no intrinsics), a leaf module (formats as
//! its own [`Kind`]): built once per matrix by whoever owns the weights
//! (`quant::build_tile_layout`, `QMatrix::with_tiles`), or per super-block
//! by the kernel when a matrix comes without one. The values, scales and
//! sums are the file's; only their order changes, so results are the same
//! bits with or without it.
//!
//! Unit: one super-block of a group of 16 weight rows ([`GROUP`]), `nb`
//! units per group, groups in row order; rows past the last whole group
//! have no unit (the kernels' row path runs them from the file's bytes).
//! "Lane `j`" below is the `j`-th dword of a 64-byte vector, holding weight
//! row `16g + j`; a "transposed chunk" of bytes `o..o + 32` of each row's
//! block is 8 vectors, vector `r` lane `j` = bytes `o + 4r..o + 4r + 4` of
//! row `j` (AMX's B layout: four values of each of 16 weight rows).
//!
//! Q4_K ([`Q4K_UNIT`] bytes):
//! - `0..2048`: `qs` as four transposed chunks (`cc` = 0..4, bytes
//!   `32cc..32cc + 32`), vector `(cc, r)` at `64·(8cc + r)`;
//! - `2048..2176`: the eight 6-bit scales, sub-block `c` at `2048 + 16c`,
//!   byte `j` = row `j`'s;
//! - `2176..2304`: the eight 6-bit mins, sub-block `c` at `2176 + 16c`,
//!   byte `j` = row `j`'s;
//! - `2304..2336`: `d` of the 16 rows (f16, as in the file), then
//!   `2336..2368` `dmin`.
//!
//! The same 2,304 bytes as the file's 16 blocks, plus 64: a unit streams
//! from memory as fast as the file's blocks.
//!
//! Q5_K ([`Q5K_UNIT`] bytes): as Q4_K, with `qh` (the fifth bits) as one
//! transposed chunk at `2048..2560` (vector `r` lane `j` = `qh[4r..4r + 4]`
//! of row `j`: bits `2cc` and `2cc + 1` of each byte are the fifth bits of
//! the low and high nibbles of `qs` vector `(cc, r)`), then the scales at
//! `2560`, the mins at `2688`, `d` at `2816`, `dmin` at `2848`: 2,880 bytes
//! (the file's 2,816 plus 64).
//!
//! Q6_K ([`Q6K_UNIT`] bytes):
//! - `0..3072`: per half `h` = 0..2 at `1536h`: `ql[64h..64h + 32]`,
//!   `ql[64h + 32..64h + 64]`, `qh[32h..32h + 32]`, each transposed (512
//!   bytes);
//! - `3072..3328`: the 16 scales (i8), group `c` at `3072 + 16c`, byte `j` =
//!   row `j`'s;
//! - `3328..3360`: `d` of the 16 rows (f16).
//!
//! Exactly the file's 3,360 bytes of 16 blocks.

use super::blocks::{q4k_scales_mins, BlockQ4K, BlockQ5K, BlockQ6K};
use rayon::prelude::*;

/// The formats with a tile layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Q4K,
    Q5K,
    Q6K,
}

/// Where a Q4_K / Q5_K unit keeps its scales, mins, `d` and `dmin`, and
/// how many 64-byte lines it spans (what the kernels prefetch).
pub(super) struct K4Offsets {
    // Read by the x86 kernels only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) lines: usize,
    pub(super) sc: usize,
    pub(super) mn: usize,
    pub(super) d: usize,
    pub(super) dmin: usize,
}

/// [`K4Offsets`] of Q4_K (`q5` false) or Q5_K units.
pub(super) const fn k4_offsets(q5: bool) -> K4Offsets {
    let base = if q5 { 2560 } else { 2048 };
    let unit = if q5 { Q5K_UNIT } else { Q4K_UNIT };
    K4Offsets {
        lines: unit.div_ceil(64),
        sc: base,
        mn: base + 128,
        d: base + 256,
        dmin: base + 288,
    }
}

/// Weight rows per unit.
pub(super) const GROUP: usize = 16;
/// Bytes of one Q4_K unit.
pub(super) const Q4K_UNIT: usize = 2368;
/// Bytes of one Q5_K unit.
pub(super) const Q5K_UNIT: usize = 2880;
/// Bytes of one Q6_K unit.
pub(super) const Q6K_UNIT: usize = 3360;

impl Kind {
    /// Bytes of one unit.
    pub(super) fn unit_bytes(self) -> usize {
        match self {
            Kind::Q4K => Q4K_UNIT,
            Kind::Q5K => Q5K_UNIT,
            Kind::Q6K => Q6K_UNIT,
        }
    }

    /// Bytes of one block of 256 values in the file.
    fn block_bytes(self) -> usize {
        match self {
            Kind::Q4K => std::mem::size_of::<BlockQ4K>(),
            Kind::Q5K => std::mem::size_of::<BlockQ5K>(),
            Kind::Q6K => std::mem::size_of::<BlockQ6K>(),
        }
    }
}

/// Bytes of the tile layout of a `rows × cols` matrix.
pub(super) fn layout_bytes(kind: Kind, rows: usize, cols: usize) -> usize {
    (rows / GROUP) * (cols / 256) * kind.unit_bytes()
}

/// The tile layout of the matrix `data` (`rows × cols`, the file's layout,
/// `data.len() == rows · cols / 256 · block bytes`).
pub(super) fn build(kind: Kind, rows: usize, cols: usize, data: &[u8]) -> Vec<u8> {
    let (unit, nb) = (kind.unit_bytes(), cols / 256);
    let mut out = vec![0u8; layout_bytes(kind, rows, cols)];
    // Groups in parallel: the output head (~150k rows) is built outside the
    // loader's parallel loop over layers.
    out.par_chunks_mut((nb * unit).max(1))
        .enumerate()
        .for_each(|(g, units)| {
            for (sb, u) in units.chunks_exact_mut(unit).enumerate() {
                write_unit(kind, nb, data, g, sb, u);
            }
        });
    out
}

/// Unit `(g, sb)` of the matrix `data` (`nb` blocks a row, the file's
/// layout) into `out` (`kind.unit_bytes()` bytes).
pub(super) fn write_unit(kind: Kind, nb: usize, data: &[u8], g: usize, sb: usize, out: &mut [u8]) {
    let bsz = kind.block_bytes();
    let block = |j: usize| {
        let at = ((GROUP * g + j) * nb + sb) * bsz;
        &data[at..at + bsz]
    };
    match kind {
        Kind::Q4K | Kind::Q5K => {
            let q5 = kind == Kind::Q5K;
            let o = k4_offsets(q5);
            // qs after d, dmin, 12 scale bytes (and Q5_K's 32 qh bytes).
            let qs_at = if q5 { 48 } else { 16 };
            for j in 0..GROUP {
                let b = block(j);
                let (d, dmin) = ([b[0], b[1]], [b[2], b[3]]);
                let mut scales = [0u8; 12];
                scales.copy_from_slice(&b[4..16]);
                transpose_into(&b[qs_at..qs_at + 128], j, &mut out[..2048]);
                if q5 {
                    transpose_into(&b[16..48], j, &mut out[2048..2560]);
                }
                let (sc, mn) = q4k_scales_mins(&scales);
                for c in 0..8 {
                    out[o.sc + 16 * c + j] = sc[c];
                    out[o.mn + 16 * c + j] = mn[c];
                }
                out[o.d + 2 * j..o.d + 2 * j + 2].copy_from_slice(&d);
                out[o.dmin + 2 * j..o.dmin + 2 * j + 2].copy_from_slice(&dmin);
            }
        }
        Kind::Q6K => {
            for j in 0..GROUP {
                let b = block(j);
                // ql (128), qh (64), 16 scales, d (blocks::BlockQ6K).
                let (ql, qh) = (&b[..128], &b[128..192]);
                for h in 0..2 {
                    let o = &mut out[1536 * h..1536 * (h + 1)];
                    transpose_into(&ql[64 * h..64 * h + 32], j, &mut o[..512]);
                    transpose_into(&ql[64 * h + 32..64 * h + 64], j, &mut o[512..1024]);
                    transpose_into(&qh[32 * h..32 * h + 32], j, &mut o[1024..1536]);
                }
                for c in 0..16 {
                    out[3072 + 16 * c + j] = b[192 + c];
                }
                out[3328 + 2 * j..3330 + 2 * j].copy_from_slice(&b[208..210]);
            }
        }
    }
}

/// Row `j`'s bytes `src` (a multiple of 32) as lane `j` of consecutive
/// transposed chunks in `out` (512 bytes per 32 source bytes).
fn transpose_into(src: &[u8], j: usize, out: &mut [u8]) {
    for (k, four) in src.chunks_exact(4).enumerate() {
        // Chunk k / 8, vector k % 8, lane j.
        let at = 512 * (k / 8) + 64 * (k % 8) + 4 * j;
        out[at..at + 4].copy_from_slice(four);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::blocks::f16_le;

    /// Every byte of a unit comes from the rows' blocks where the layout
    /// says: checked by building from blocks whose bytes name their row.
    #[test]
    fn q4k_unit_places_each_rows_bytes_in_its_lane() {
        let (rows, cols) = (16, 256);
        let bsz = std::mem::size_of::<BlockQ4K>();
        let mut data = vec![0u8; rows * bsz];
        for (j, b) in data.chunks_exact_mut(bsz).enumerate() {
            for (i, v) in b.iter_mut().enumerate().skip(16) {
                *v = (j * 7 + i) as u8;
            }
            // d = 1.0, dmin = 2.0 (f16), scale bytes as in ggml.
            b[..4].copy_from_slice(&[0x00, 0x3C, 0x00, 0x40]);
            b[4..16].copy_from_slice(&[j as u8 & 63, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
        }
        let t = build(Kind::Q4K, rows, cols, &data);
        assert_eq!(t.len(), Q4K_UNIT);
        for j in 0..16 {
            let qs = &data[j * bsz + 16..j * bsz + 144];
            // qs byte 32cc + 4r + k at 64(8cc + r) + 4j + k.
            for (i, &q) in qs.iter().enumerate() {
                let (cc, r, k) = (i / 32, (i % 32) / 4, i % 4);
                assert_eq!(t[64 * (8 * cc + r) + 4 * j + k], q, "row {j} byte {i}");
            }
            let mut scales = [0u8; 12];
            scales.copy_from_slice(&data[j * bsz + 4..j * bsz + 16]);
            let (sc, mn) = q4k_scales_mins(&scales);
            for c in 0..8 {
                assert_eq!(t[2048 + 16 * c + j], sc[c]);
                assert_eq!(t[2176 + 16 * c + j], mn[c]);
            }
            let f = |at: usize| f16_le([t[at], t[at + 1]]);
            assert_eq!(f(2304 + 2 * j), 1.0);
            assert_eq!(f(2336 + 2 * j), 2.0);
        }
    }

    #[test]
    fn rows_past_the_last_whole_group_have_no_unit() {
        let data = vec![0u8; 17 * 2 * std::mem::size_of::<BlockQ6K>()];
        assert_eq!(build(Kind::Q6K, 17, 512, &data).len(), 2 * Q6K_UNIT);
        assert_eq!(layout_bytes(Kind::Q6K, 17, 512), 2 * Q6K_UNIT);
    }
}
