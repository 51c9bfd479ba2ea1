//! GELU with the tanh approximation, computed as llama.cpp's CPU backend does
//! (issue 28): through a table of its values at every f16.
//!
//! For an f32 `x`:
//! - `x <= -10` gives `0.0`, `x >= 10` gives `x` (so `-inf` → 0, `+inf` → `+inf`);
//! - otherwise `x` is rounded to f16 (IEEE round to nearest, ties to even) and
//!   the result is the table entry at that f16's bits: the f32 value of
//!   `f16(gelu(v))`, `v` the f16 as f32 and `gelu` the f32 formula
//!   [`gelu_formula`] (libm `tanhf`), itself rounded to nearest-even f16.
//! - NaN (any payload, either sign) gives `f32::NAN`: every NaN slot of the
//!   table holds that one quiet NaN, whatever the formula or the conversion
//!   does with payloads.
//! - `-0.0` gives `-0.0` (the formula's own result at f16 `-0`).
//!
//! This is ggml's `ggml_vec_gelu_f32` / `ggml_vec_geglu_f32` with
//! `GGML_GELU_FP16` (ggml-cpu `vec.h`), which is what llama.cpp runs for
//! Gemma's GEGLU on a CPU; it replaces one `tanhf` per FFN element (15 % of a
//! Gemma prefill) by a conversion and a load.
//!
//! Why it keeps the kernel contract (`quant`, a row's bits independent of the
//! ISA and of the other rows): it is per element, and both conversions are
//! the portable integer code of `half` (`from_f32_const` / `to_f32_const`:
//! no F16C, no FP16 instructions), so the bits are the same on every target.
//! The table is built once per process from the formula; the formula's
//! `tanhf` is the platform's libm, as the per-element call before was, but
//! its result now only matters through an f16 rounding.

use half::f16;
use std::sync::OnceLock;

/// Entries of the table: one per f16 bit pattern.
const ENTRIES: usize = 1 << 16;

/// Inputs at or below `-LIMIT` give 0, at or above `LIMIT` themselves.
const LIMIT: f32 = 10.0;

/// The f32 formula: `0.5·x·(1 + tanh(√(2/π)·x·(1 + 0.044715·x²)))`, in this
/// order of operations (ggml's `ggml_gelu_f32`).
pub(crate) fn gelu_formula(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh())
}

/// The f16 bits of `x` rounded to nearest, ties to even (portable code).
#[inline]
fn f16_bits(x: f32) -> u16 {
    f16::from_f32_const(x).to_bits()
}

/// The table: for every f16 bit pattern `b`, `f16(gelu_formula(f16(b)))` as
/// f32 (NaN slots: `f32::NAN`). Kept as f32 (256 KiB) so a lookup needs no
/// second conversion; the values are exactly the f16 table's.
fn table() -> &'static [f32; ENTRIES] {
    static TABLE: OnceLock<Box<[f32; ENTRIES]>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = vec![0f32; ENTRIES];
        for (bits, slot) in t.iter_mut().enumerate() {
            // `bits` < 2^16: the cast is exact.
            let v = f16::from_bits(bits as u16).to_f32_const();
            *slot = if v.is_nan() {
                f32::NAN
            } else {
                f16::from_f32_const(gelu_formula(v)).to_f32_const()
            };
        }
        t.into_boxed_slice()
            .try_into()
            .unwrap_or_else(|_| unreachable!("the table has ENTRIES values"))
    })
}

/// GELU of one value by the table (see the module's documentation).
#[inline]
fn gelu_in(t: &[f32; ENTRIES], x: f32) -> f32 {
    if x <= -LIMIT {
        0.0
    } else if x >= LIMIT {
        x
    } else {
        t[usize::from(f16_bits(x))]
    }
}

/// GELU of one value (the module's rule).
#[cfg(test)]
pub(crate) fn gelu(x: f32) -> f32 {
    gelu_in(table(), x)
}

/// `gate[i] = gelu(gate[i]) · up[i]` (ggml's GEGLU), element by element.
pub(crate) fn geglu_in_place(gate: &mut [f32], up: &[f32]) {
    let t = table();
    for (g, u) in gate.iter_mut().zip(up) {
        *g = gelu_in(t, *g) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table path equals the formula at the f16-rounded input, rounded
    /// to f16, at every f16 in (-10, 10), and at the f32 neighbours of each
    /// (which round to it or to the next f16).
    #[test]
    fn table_is_the_formula_at_every_f16_in_range() {
        let mut checked = 0usize;
        for bits in 0..=u16::MAX {
            let v = f16::from_bits(bits).to_f32();
            if v.is_nan() || v <= -LIMIT || v >= LIMIT {
                continue;
            }
            let want = f16::from_f32(gelu_formula(v)).to_f32();
            let got = gelu(v);
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "gelu({v}) (f16 bits {bits:#06x})"
            );
            for near in [v.next_down(), v.next_up()] {
                if near <= -LIMIT || near >= LIMIT {
                    continue;
                }
                let r = f16::from_f32(near).to_f32();
                let want = f16::from_f32(gelu_formula(r)).to_f32();
                assert_eq!(gelu(near).to_bits(), want.to_bits(), "gelu({near:e})");
            }
            checked += 1;
        }
        // 0x4900 is f16 10.0: the patterns below it, either sign (±0 both).
        assert_eq!(checked, 2 * 0x4900);
    }

    /// An input between two f16s takes the table entry of the nearest one
    /// (ties to even), not of the one below.
    #[test]
    fn inputs_round_to_the_nearest_f16() {
        // f16 spacing in [1, 2) is 2^-10: 1 + 2^-11 is a tie, to 1.0 (even);
        // 1 + 3·2^-11 a tie, to 1 + 2^-9 (even); just above a tie rounds up.
        let one = 1.0f32;
        let tie_down = one + 2f32.powi(-11);
        let tie_up = one + 3.0 * 2f32.powi(-11);
        let above = tie_down.next_up();
        assert_eq!(gelu(tie_down).to_bits(), gelu(one).to_bits());
        assert_eq!(gelu(tie_up).to_bits(), gelu(one + 2f32.powi(-9)).to_bits());
        assert_eq!(gelu(above).to_bits(), gelu(one + 2f32.powi(-10)).to_bits());
        // f16 subnormals: the smallest is 2^-24; 2^-26 rounds to 0.
        let tiny = 2f32.powi(-24);
        assert_eq!(gelu(2f32.powi(-26)).to_bits(), 0);
        assert_eq!(
            gelu(tiny).to_bits(),
            f16::from_f32(gelu_formula(tiny)).to_f32().to_bits()
        );
    }

    /// The documented edges: ±10, ±inf, NaN, ±0.
    #[test]
    fn edges_are_as_documented() {
        assert_eq!(gelu(-10.0).to_bits(), 0f32.to_bits());
        assert_eq!(gelu((-10.0f32).next_down()).to_bits(), 0f32.to_bits());
        assert_eq!(gelu(f32::NEG_INFINITY).to_bits(), 0f32.to_bits());
        assert_eq!(gelu(f32::MIN).to_bits(), 0f32.to_bits());
        assert_eq!(gelu(10.0), 10.0);
        assert_eq!(gelu(12.5), 12.5);
        assert_eq!(gelu(f32::INFINITY), f32::INFINITY);
        assert_eq!(gelu(f32::MAX), f32::MAX);
        // Just inside the limits: the table at f16 ±10.0, where they round.
        let at = |v: f32| f16::from_f32(gelu_formula(v)).to_f32().to_bits();
        assert_eq!(gelu(10.0f32.next_down()).to_bits(), at(10.0));
        assert_eq!(gelu(10.0f32.next_down()), 10.0);
        assert_eq!(gelu((-10.0f32).next_up()).to_bits(), at(-10.0));
        assert!(gelu((-10.0f32).next_up()).abs() < 1e-6);
        // Zeros keep their sign.
        assert_eq!(gelu(0.0).to_bits(), 0f32.to_bits());
        assert_eq!(gelu(-0.0).to_bits(), (-0.0f32).to_bits());
        // Every NaN, quiet or signalling, either sign, gives f32::NAN.
        for nan in [
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xff80_0001),
            f32::from_bits(0x7fc0_1234),
            f32::from_bits(0x7fff_ffff),
        ] {
            assert_eq!(
                gelu(nan).to_bits(),
                f32::NAN.to_bits(),
                "{:#x}",
                nan.to_bits()
            );
        }
        // Every NaN slot of the table is that NaN.
        let t = table();
        for bits in 0..=u16::MAX {
            if f16::from_bits(bits).is_nan() {
                assert_eq!(t[usize::from(bits)].to_bits(), f32::NAN.to_bits());
            }
        }
    }

    /// The portable conversion gives `half`'s run-time-dispatched one's bits
    /// (F16C on x86, FP16 on aarch64, where present) on a sweep of f32 bit
    /// patterns: every 97th pattern of all 2^32, and every pattern within
    /// ±64 of each f16's neighbourhood boundaries (the rounding ties).
    #[test]
    fn portable_conversion_equals_the_dispatched_one() {
        let check = |x: f32| {
            if x.is_nan() {
                // Payload bits may differ; both must be an f16 NaN.
                assert!(f16::from_bits(f16_bits(x)).is_nan());
                assert!(f16::from_f32(x).is_nan());
            } else {
                assert_eq!(
                    f16_bits(x),
                    f16::from_f32(x).to_bits(),
                    "{:#010x}",
                    x.to_bits()
                );
            }
        };
        let mut b = 0u64;
        while b < 1 << 32 {
            check(f32::from_bits(b as u32));
            b += 97;
        }
        for h in 0..=u16::MAX {
            let v = f16::from_bits(h).to_f32();
            if !v.is_finite() {
                continue;
            }
            // The f32s around the midpoint to the next f16 (a tie at the
            // centre) and around the f16 itself.
            let next = f16::from_bits(h.wrapping_add(1)).to_f32();
            let mid = if next.is_finite() {
                (v + next) * 0.5
            } else {
                v
            };
            for centre in [v, mid] {
                let c = centre.to_bits();
                for d in 0..=128u32 {
                    check(f32::from_bits(c.wrapping_add(d).wrapping_sub(64)));
                }
            }
        }
    }

    /// The in-place GEGLU is the scalar rule times `up`, element by element.
    #[test]
    fn geglu_is_gelu_times_up() {
        let gate: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.027).collect();
        let up: Vec<f32> = (0..1000).map(|i| 1.0 - i as f32 * 0.0031).collect();
        let mut g = gate.clone();
        geglu_in_place(&mut g, &up);
        for i in 0..gate.len() {
            assert_eq!(g[i].to_bits(), (gelu(gate[i]) * up[i]).to_bits());
        }
    }
}
