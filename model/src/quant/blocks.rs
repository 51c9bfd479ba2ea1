//! ggml's block layouts, as `#[repr(C)]` plain-old-data structs of alignment 1.
//!
//! The scale fields are kept as raw little-endian bytes (`[u8; 2]` for an f16)
//! so every struct has alignment 1 and any byte slice of the right length can
//! be viewed as a slice of blocks, whatever its address.

use half::f16;

pub const QK: usize = 32;
pub const QK_K: usize = 256;

#[inline(always)]
pub fn f16_le(b: [u8; 2]) -> f32 {
    f16::from_le_bytes(b).to_f32()
}

/// Q4_0: 32 weights `d * (q - 8)`, q in 0..16.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4_0 {
    pub d: [u8; 2],
    /// low nibble: element l, high nibble: element l + 16
    pub qs: [u8; QK / 2],
}

/// Q5_0: 32 weights `d * (q - 16)`, q in 0..32 (fifth bit in `qh`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ5_0 {
    pub d: [u8; 2],
    /// bit l: fifth bit of element l
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// Q4_1: 32 weights `d * q + m`, q in 0..16.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4_1 {
    pub d: [u8; 2],
    pub m: [u8; 2],
    /// low nibble: element l, high nibble: element l + 16
    pub qs: [u8; QK / 2],
}

/// Q5_1: 32 weights `d * q + m`, q in 0..32 (fifth bit in `qh`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ5_1 {
    pub d: [u8; 2],
    pub m: [u8; 2],
    /// bit l: fifth bit of element l
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// Q8_0: 32 weights `d * q`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ8_0 {
    pub d: [u8; 2],
    pub qs: [i8; QK],
}

/// Q4_K: 256 weights in 8 sub-blocks of 32: `d * sc_j * q - dmin * m_j`,
/// with 6-bit `sc_j`, `m_j` packed in `scales`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

/// Q5_K: 256 weights in 8 sub-blocks of 32: `d * sc_j * q - dmin * m_j`,
/// q in 0..32, with the scales and mins packed as Q4_K's. Element
/// `64c + l` (l < 32) is the low nibble of `qs[32c + l]`, element
/// `64c + 32 + l` its high nibble; their fifth bits are bits `2c` and
/// `2c + 1` of `qh[l]`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ5K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// Q3_K: 256 weights in 16 groups of 16: `d * (sc_g - 32) * q`, q in -4..4,
/// with 6-bit `sc_g` packed in `scales` ([`q3k_scales`]). Element
/// `128h + 32j + l` (h < 2, j < 4, l < 32) is bits `2j..2j+2` of
/// `qs[32h + l]`, minus 4 unless bit `4h + j` of `hmask[l]` is set; it is in
/// group `8h + 2j + l / 16`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: [u8; 2],
}

/// Q6_K: 256 weights in 16 sub-blocks of 16: `d * sc_j * (q - 32)`, q in 0..64.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: [u8; 2],
}

/// Q5_0 regrouped at load time (not a GGUF type; `quant::repack_q5_0x4`):
/// four consecutive Q5_0 blocks (128 weights `d_i * (q - 16)`), the same
/// 88 bytes laid out so that AVX2 unpacks them with shifts and masks only.
/// Element j (0..32) of block i (0..4):
/// - low 4 bits: `qs[32 * (i / 2) + j] >> (4 * (i % 2)) & 0xF`;
/// - fifth bit: bit `i` of `qh[j]` for j < 16, bit `4 + i` of `qh[j - 16]`
///   for j ≥ 16.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ5_0x4 {
    pub d: [[u8; 2]; 4],
    pub qh: [u8; 16],
    pub qs: [u8; 64],
}

const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ5_0x4>() == 4 * 22);
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);

/// Marker for the block structs above: `repr(C)`, alignment 1, every bit
/// pattern valid.
///
/// # Safety
/// Only implement for such types.
pub unsafe trait Pod: Copy {}
unsafe impl Pod for BlockQ4_0 {}
unsafe impl Pod for BlockQ5_0 {}
unsafe impl Pod for BlockQ5_0x4 {}
unsafe impl Pod for BlockQ8_0 {}
unsafe impl Pod for BlockQ4_1 {}
unsafe impl Pod for BlockQ5_1 {}
unsafe impl Pod for BlockQ5K {}
unsafe impl Pod for BlockQ3K {}
unsafe impl Pod for BlockQ4K {}
unsafe impl Pod for BlockQ6K {}

/// View bytes as blocks (trailing bytes that do not fill a block are ignored).
#[inline(always)]
pub fn cast<T: Pod>(data: &[u8]) -> &[T] {
    const { assert!(std::mem::align_of::<T>() == 1) };
    let n = data.len() / std::mem::size_of::<T>();
    // SAFETY: T is Pod with alignment 1 (checked above), so any address and
    // any bit pattern is a valid T; `n` blocks fit in `data`.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<T>(), n) }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block.
#[inline(always)]
pub fn q4k_scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// All 8 scales and 8 mins of a Q4_K block (llama.cpp's bit shuffle;
/// equal to [`q4k_scale_min`] for j = 0..8).
#[inline(always)]
pub fn q4k_scales_mins(q: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    const KMASK1: u32 = 0x3f3f3f3f;
    const KMASK2: u32 = 0x0f0f0f0f;
    const KMASK3: u32 = 0x03030303;
    let u0 = u32::from_le_bytes([q[0], q[1], q[2], q[3]]);
    let u1 = u32::from_le_bytes([q[4], q[5], q[6], q[7]]);
    let u2 = u32::from_le_bytes([q[8], q[9], q[10], q[11]]);
    let m1 = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let m0 = u1 & KMASK1;
    let s1 = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let s0 = u0 & KMASK1;
    // Built as whole u64s: writing the halves separately and reading them back
    // as one 8-byte value stalls store forwarding in the hot loop.
    let sc = (s0 as u64 | (s1 as u64) << 32).to_le_bytes();
    let mn = (m0 as u64 | (m1 as u64) << 32).to_le_bytes();
    (sc, mn)
}

/// The 16 scales of a Q3_K block, `sc_g - 32` in -32..32 (ggml's
/// `dequantize_row_q3_K`: low 4 bits from `scales[0..8]`, high 2 bits from
/// `scales[8..12]`).
#[inline(always)]
pub fn q3k_scales(q: &[u8; 12]) -> [i8; 16] {
    let aux = q3k_scale_words(q);
    let mut out = [0i8; 16];
    for (i, a) in aux.iter().enumerate() {
        for (k, b) in a.to_le_bytes().iter().enumerate() {
            out[4 * i + k] = *b as i8 - 32;
        }
    }
    out
}

/// The 16 unsigned 6-bit scales `sc_g` of a Q3_K block as four
/// little-endian words (byte `4i + k` of the result = `sc_{4i+k}`), ggml's
/// bit shuffle; [`q3k_scales`] subtracts the 32.
#[inline(always)]
pub fn q3k_scale_words(q: &[u8; 12]) -> [u32; 4] {
    const KMASK1: u32 = 0x03030303;
    const KMASK2: u32 = 0x0f0f0f0f;
    let a0 = u32::from_le_bytes([q[0], q[1], q[2], q[3]]);
    let a1 = u32::from_le_bytes([q[4], q[5], q[6], q[7]]);
    let tmp = u32::from_le_bytes([q[8], q[9], q[10], q[11]]);
    [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ]
}

/// bf16 (little-endian bytes) → f32: the upper half of the f32's bits (exact).
#[inline(always)]
pub fn bf16_le(b: [u8; 2]) -> f32 {
    f32::from_bits((u16::from_le_bytes(b) as u32) << 16)
}
