//! The quantized matmul kernels: correctness against an f32 reference and the
//! bit-exactness contract (independent of m, thread count and ISA).
#![allow(clippy::unwrap_used)] // tests: a failure should panic
#![allow(clippy::needless_range_loop)] // (i, j) output indices read best as indices

mod quant_common;

use quant_common::*;
use tandem_model::quant::{
    matmul, matmul_shared_with_isa, matmul_with_isa, Isa, QMatrix, QuantFormat, GEMM_MIN_ROWS,
    GEMM_MIN_ROWS_OFFSET,
};

fn run(isa: Isa, w: &QMatrix, x: &[f32], m: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * w.rows];
    matmul_with_isa(isa, w, x, m, &mut out).unwrap();
    out
}

/// Columns that exercise partial groups: 896 = 28 blocks of 32 (3 full groups
/// of 8 + 4), 768 = 3 super-blocks.
fn cols_for(f: QuantFormat) -> usize {
    match act_block(f) {
        256 => 768,
        0 => 904, // not a multiple of 16
        _ => 896,
    }
}

#[test]
fn dequantize_row_matches_candle_bit_for_bit() {
    for f in ALL_FORMATS {
        let (rows, cols) = (9, cols_for(f));
        for data in [
            random_bytes_matrix(f, rows, cols, 1),
            candle_matrix(f, rows, cols, 2),
        ] {
            let w = QMatrix::new(f, rows, cols, &data).unwrap();
            assert_bits_eq(
                &dequant(&w),
                &candle_dequant(f, rows, cols, &data),
                &format!("{f:?}"),
            );
        }
    }
}

/// f64 reference `Σ w·x` plus a bound on the kernel's float rounding.
fn reference(wd: &[f32], x: &[f32], cols: usize, j: usize, i: usize) -> (f64, f64) {
    let w = &wd[j * cols..(j + 1) * cols];
    let x = &x[i * cols..(i + 1) * cols];
    let wmax = w.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
    let mut dot = 0f64;
    let mut mag = 0f64;
    for (&a, &b) in w.iter().zip(x) {
        dot += a as f64 * b as f64;
        mag += (a.abs() as f64 + wmax) * b.abs() as f64;
    }
    (dot, 1e-5 * mag)
}

#[test]
fn matmul_matches_f32_reference_when_activations_are_exact() {
    // Activations the Q8 quantizers represent exactly: the only error left is
    // float rounding, so any wrong scale, offset or nibble shows up.
    let m = 3;
    for isa in Isa::available() {
        for f in ALL_FORMATS {
            let (rows, cols) = (33, cols_for(f));
            for (seed, data) in [
                (11, random_bytes_matrix(f, rows, cols, 3)),
                (12, candle_matrix(f, rows, cols, 4)),
            ] {
                let w = QMatrix::new(f, rows, cols, &data).unwrap();
                let wd = dequant(&w);
                let x = exact_x(m, cols, seed);
                let out = run(isa, &w, &x, m);
                for i in 0..m {
                    for j in 0..rows {
                        let (r, tol) = reference(&wd, &x, cols, j, i);
                        let got = out[i * rows + j] as f64;
                        assert!(
                            (got - r).abs() <= tol,
                            "{isa} {f:?} seed {seed}: out[{i},{j}] = {got}, reference {r}, tol {tol}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn matmul_matches_f32_reference_within_activation_quantization_error() {
    // Gaussian activations: the error is bounded by Σ|w| · d/2 where d is the
    // activation block's scale (amax / 127), plus float rounding.
    let m = 2;
    for isa in [Isa::Scalar, Isa::best()] {
        for f in ALL_FORMATS {
            let (rows, cols) = (17, cols_for(f));
            let data = candle_matrix(f, rows, cols, 5);
            let w = QMatrix::new(f, rows, cols, &data).unwrap();
            let wd = dequant(&w);
            let x = gauss_x(m, cols, 6);
            let out = run(isa, &w, &x, m);
            let block = act_block(f);
            for i in 0..m {
                let xi = &x[i * cols..(i + 1) * cols];
                for j in 0..rows {
                    let (r, ftol) = reference(&wd, &x, cols, j, i);
                    let mut qtol = 0f64;
                    if block > 0 {
                        for (xb, wb) in xi.chunks(block).zip(wd[j * cols..].chunks(block)) {
                            let d = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                            qtol += wb.iter().map(|v| v.abs() as f64).sum::<f64>() * d / 2.0;
                        }
                    }
                    let got = out[i * rows + j] as f64;
                    assert!(
                        (got - r).abs() <= qtol * 1.001 + ftol,
                        "{isa} {f:?}: out[{i},{j}] = {got}, reference {r}, tol {}",
                        qtol + ftol
                    );
                }
            }
        }
    }
}

#[test]
fn each_output_is_independent_of_the_number_of_rows() {
    let (rows, n) = (37, 64);
    for isa in Isa::available() {
        for f in ALL_FORMATS {
            let cols = cols_for(f);
            let data = random_bytes_matrix(f, rows, cols, 7);
            let w = QMatrix::new(f, rows, cols, &data).unwrap();
            let x = gauss_x(n, cols, 8);
            let full = run(isa, &w, &x, n);
            for m in (1..=17).chain([30, 64]) {
                let out = run(isa, &w, &x[..m * cols], m);
                assert_bits_eq(
                    &out,
                    &full[..m * rows],
                    &format!("{isa} {f:?} m={m} vs m={n}"),
                );
            }
            // every row alone, at every position of the block
            for i in 0..n {
                let out = run(isa, &w, &x[i * cols..(i + 1) * cols], 1);
                assert_bits_eq(
                    &out,
                    &full[i * rows..(i + 1) * rows],
                    &format!("{isa} {f:?} row {i} alone"),
                );
            }
        }
    }
}

#[test]
fn each_output_is_independent_of_the_thread_count() {
    // Large enough that the calls are split across threads.
    let (rows, cols) = (701, 512);
    for f in ALL_FORMATS {
        let data = random_bytes_matrix(f, rows, cols, 9);
        let w = QMatrix::new(f, rows, cols, &data).unwrap();
        for m in [1, 5, 30] {
            let x = gauss_x(m, cols, 10);
            let one = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let expect = one.install(|| run(Isa::Scalar, &w, &x, m));
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                for isa in Isa::available() {
                    let got = pool.install(|| run(isa, &w, &x, m));
                    assert_bits_eq(
                        &got,
                        &expect,
                        &format!("{isa} {f:?} m={m} threads={threads}"),
                    );
                }
            }
        }
    }
}

#[test]
fn every_isa_matches_the_scalar_reference_bit_for_bit() {
    let isas = Isa::available();
    eprintln!("ISAs on this machine: {isas:?}");
    for f in ALL_FORMATS {
        let (rows, cols) = (45, cols_for(f));
        for data in [
            random_bytes_matrix(f, rows, cols, 13),
            candle_matrix(f, rows, cols, 14),
        ] {
            let w = QMatrix::new(f, rows, cols, &data).unwrap();
            for m in [1, 3, 17, 30] {
                for x in [gauss_x(m, cols, 15), exact_x(m, cols, 16)] {
                    let expect = run(Isa::Scalar, &w, &x, m);
                    for &isa in &isas {
                        assert_bits_eq(
                            &run(isa, &w, &x, m),
                            &expect,
                            &format!("{isa} vs scalar, {f:?} m={m}"),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn block_counts_and_every_row_split_match_the_scalar_reference() {
    // Rows of 1, 3, 5 and 7 blocks (the AVX-512 Q4_0/Q5_0/Q8_0 kernels take
    // blocks in pairs; a lone last block takes the padded path), 9 and 19
    // (rows longer than the prefetch distance and than a kernel that
    // unpacks a few blocks at a time would take at once), 2, 16 and 32
    // (the one-row Q3_K/Q6_K kernels step super-blocks in pairs; the
    // Q4_1/Q5_1 kernels take whole groups of 8 or 16 blocks), and every
    // m from 1 to 19 (passes of up to 8 rows, then the remainder), with both
    // an exact-activation reference check and bit-exactness against scalar.
    for f in ALL_FORMATS {
        let unit = if is_ggml_quant(f) {
            f.block_elems()
        } else {
            16
        };
        for nblocks in [1, 2, 3, 5, 7, 9, 16, 19, 32] {
            let (rows, cols) = (11, unit * nblocks);
            let data = random_bytes_matrix(f, rows, cols, 21 + nblocks as u64);
            let w = QMatrix::new(f, rows, cols, &data).unwrap();
            let wd = dequant(&w);
            let x = exact_x(19, cols, 22);
            let full = run(Isa::Scalar, &w, &x, 19);
            for i in 0..19 {
                for j in 0..rows {
                    let (r, tol) = reference(&wd, &x, cols, j, i);
                    let got = full[i * rows + j] as f64;
                    assert!(
                        (got - r).abs() <= tol,
                        "{f:?} {nblocks} blocks: out[{i},{j}] = {got}, reference {r}"
                    );
                }
            }
            for isa in Isa::available() {
                for m in 1..=19 {
                    assert_bits_eq(
                        &run(isa, &w, &x[..m * cols], m),
                        &full[..m * rows],
                        &format!("{isa} {f:?} {nblocks} blocks m={m}"),
                    );
                }
            }
        }
    }
}

#[test]
fn extreme_activations_do_not_overflow() {
    // Every activation at ±max magnitude and weights of random bytes: the
    // widest integer sums the kernels meet (checks 16-bit saturation).
    for f in ALL_FORMATS {
        let (rows, cols) = (16, cols_for(f));
        let data = random_bytes_matrix(f, rows, cols, 17);
        let w = QMatrix::new(f, rows, cols, &data).unwrap();
        let wd = dequant(&w);
        for sign in [1f32, -1.0] {
            let x: Vec<f32> = (0..cols)
                .map(|k| if k % 3 == 0 { -sign } else { sign })
                .collect();
            let expect = run(Isa::Scalar, &w, &x, 1);
            for j in 0..rows {
                let (r, tol) = reference(&wd, &x, cols, j, 0);
                assert!(
                    (expect[j] as f64 - r).abs() <= tol,
                    "{f:?} row {j}: {} vs {r}",
                    expect[j]
                );
            }
            for isa in Isa::available() {
                assert_bits_eq(
                    &run(isa, &w, &x, 1),
                    &expect,
                    &format!("{isa} {f:?} extreme"),
                );
            }
        }
    }
}

#[test]
fn matmul_uses_the_selected_isa_and_agrees_with_it() {
    let f = QuantFormat::Q4K;
    let data = random_bytes_matrix(f, 8, 256, 18);
    let w = QMatrix::new(f, 8, 256, &data).unwrap();
    let x = gauss_x(2, 256, 19);
    let mut out = vec![0f32; 16];
    matmul(&w, &x, 2, &mut out);
    assert_bits_eq(&out, &run(Isa::selected(), &w, &x, 2), "matmul vs selected");
}

#[test]
fn one_quantized_input_for_several_matrices_gives_the_separate_results() {
    // Every format over the same 768-column input (a multiple of 32 and 256),
    // with repeats so an input is shared by matrices of one activation format.
    let cols = 768;
    let mut formats: Vec<QuantFormat> = ALL_FORMATS.to_vec();
    formats.extend(ALL_FORMATS);
    let datas: Vec<Vec<u8>> = formats
        .iter()
        .enumerate()
        .map(|(i, &f)| random_bytes_matrix(f, 11 + i, cols, 40 + i as u64))
        .collect();
    let ws: Vec<QMatrix> = formats
        .iter()
        .zip(&datas)
        .enumerate()
        .map(|(i, (&f, d))| QMatrix::new(f, 11 + i, cols, d).unwrap())
        .collect();
    for &isa in &Isa::available() {
        for m in [1, 5, 17] {
            let x = gauss_x(m, cols, 41);
            let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; m * w.rows]).collect();
            let mut pairs: Vec<(&QMatrix, &mut [f32])> = ws
                .iter()
                .zip(outs.iter_mut())
                .map(|(w, o)| (w, o.as_mut_slice()))
                .collect();
            matmul_shared_with_isa(isa, &mut pairs, &x, m).unwrap();
            for (w, got) in ws.iter().zip(&outs) {
                assert_bits_eq(
                    got,
                    &run(isa, w, &x, m),
                    &format!("{isa} {:?} m={m}", w.format),
                );
            }
        }
    }
    // A shape error in any matrix is reported before anything runs.
    let mut a = vec![0f32; ws[0].rows];
    let mut b = vec![0f32; 3];
    let err = matmul_shared_with_isa(
        Isa::Scalar,
        &mut [(&ws[0], a.as_mut_slice()), (&ws[1], b.as_mut_slice())],
        &vec![0f32; cols],
        1,
    )
    .unwrap_err();
    assert!(err.to_string().contains("outputs"), "{err}");
}

#[test]
fn shape_errors_are_reported() {
    let f = QuantFormat::Q8_0;
    let data = random_bytes_matrix(f, 4, 64, 20);
    let w = QMatrix::new(f, 4, 64, &data).unwrap();
    let mut out = vec![0f32; 8];
    let err = matmul_with_isa(Isa::Scalar, &w, &[0.0; 100], 2, &mut out).unwrap_err();
    assert!(err.to_string().contains("needs 128 inputs"), "{err}");
    assert!(QMatrix::new(f, 4, 64, &data[..100]).is_err());
    assert!(QMatrix::new(f, 4, 60, &data).is_err());
}

#[test]
fn isa_names_round_trip() {
    for isa in Isa::ALL {
        assert_eq!(Isa::from_name(isa.name()), Some(isa));
        assert_eq!(Isa::from_name(&isa.name().to_uppercase()), Some(isa));
    }
    assert_eq!(Isa::from_name("neon9000"), None);
    assert_eq!(Isa::from_name(" Neon-Dotprod "), Some(Isa::NeonDotprod));
    assert!(Isa::Scalar.is_available());
    assert!(Isa::best().is_available());
}

/// The paths this CPU must offer, so a contract test above that loops over
/// `Isa::available()` cannot pass by testing fewer paths than intended:
/// on aarch64 baseline NEON always, plus the dotprod path when the CPU has
/// it; and every name in `TANDEM_EXPECT_ISAS` (comma-separated; CI sets it
/// per QEMU CPU, e.g. `neon,neon-dotprod` for `max`, `neon` for `cortex-a53`,
/// where the dotprod path must then be absent).
#[test]
fn the_expected_simd_paths_are_available_and_tested() {
    let available = Isa::available();
    let (arm, x86) = (
        [Isa::Neon, Isa::NeonDotprod],
        [Isa::Avx2, Isa::Avx512Vnni, Isa::Amx],
    );
    if cfg!(target_arch = "aarch64") {
        assert!(available.contains(&Isa::Neon), "{available:?}");
    }
    // Never the other architecture's paths.
    let foreign: &[Isa] = if cfg!(target_arch = "aarch64") {
        &x86
    } else {
        &arm
    };
    assert!(
        !available.iter().any(|i| foreign.contains(i)),
        "{available:?}"
    );
    if let Ok(v) = std::env::var("TANDEM_EXPECT_ISAS") {
        let expected: Vec<Isa> = v
            .split(',')
            .map(|n| {
                Isa::from_name(n).unwrap_or_else(|| panic!("TANDEM_EXPECT_ISAS: unknown {n:?}"))
            })
            .collect();
        for isa in &expected {
            assert!(
                available.contains(isa),
                "{isa} expected, available: {available:?}"
            );
        }
        // Nothing beyond the expected SIMD paths either (e.g. QEMU's
        // cortex-a53 must run the baseline NEON kernels, not dotprod).
        for isa in &available {
            assert!(
                *isa == Isa::Scalar || expected.contains(isa),
                "{isa} available but not expected ({v})"
            );
        }
    }
}

/// The large-m GEMM path (AVX-512 VNNI: Q4_0/Q5_0/Q8_0 from
/// [`GEMM_MIN_ROWS`] rows, Q4_1/Q5_1 from [`GEMM_MIN_ROWS_OFFSET`]; every
/// other path and format runs its row kernels here, also checked): one row
/// below each threshold (the row kernels), the threshold, one above, odd
/// row counts (the micro-kernels take 2 rows at a time), and a prefill's 128; rows of 1 to 48
/// blocks (the regrouped layout's full groups of 16 and partial groups
/// of every size, G = 2, 4, 8, 16; odd counts leave the unpacking of
/// Q4_0/Q5_0/Q8_0 panels a lone last block); 37 weight rows (panels of 4
/// and a partial one) split by 1 and 2 threads. Bit for bit against the
/// scalar reference.
#[test]
fn the_gemm_path_matches_the_scalar_reference_at_and_past_its_threshold() {
    let (t, u) = (GEMM_MIN_ROWS, GEMM_MIN_ROWS_OFFSET);
    let ms = [t - 1, t, t + 1, u - 1, u, u + 1, 17, 37, 128];
    let rows = 37;
    let pools: Vec<rayon::ThreadPool> = [1, 2]
        .iter()
        .map(|&n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap()
        })
        .collect();
    for f in ALL_FORMATS {
        let (unit, counts): (usize, &[usize]) = if act_block(f) == 256 {
            (256, &[1, 3])
        } else if is_ggml_quant(f) {
            (
                f.block_elems(),
                &[
                    1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 18, 20, 25, 31, 32, 33, 48,
                ],
            )
        } else {
            (16, &[5])
        };
        for &nblocks in counts {
            let cols = unit * nblocks;
            let data = random_bytes_matrix(f, rows, cols, 300 + nblocks as u64);
            let w = QMatrix::new(f, rows, cols, &data).unwrap();
            let x = gauss_x(128, cols, 400 + nblocks as u64);
            let expect = pools[0].install(|| run(Isa::Scalar, &w, &x, 128));
            for isa in Isa::available() {
                for &m in &ms {
                    for (p, pool) in pools.iter().enumerate() {
                        let got = pool.install(|| run(isa, &w, &x[..m * cols], m));
                        assert_bits_eq(
                            &got,
                            &expect[..m * rows],
                            &format!("{isa} {f:?} {nblocks} blocks m={m} threads={}", p + 1),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn every_block_size_and_thread_count_matches_the_scalar_reference() {
    // k = 1..=24 activation rows (below and above the AMX threshold, one
    // and two tile groups of 16, partial groups), weight rows that are not a
    // multiple of 16 (AMX takes 16 at a time, the rest per row), and thread
    // counts that split the rows into chunks.
    for f in ALL_FORMATS {
        let cols = if is_ggml_quant(f) { 512 } else { 64 };
        for (rows, seed) in [(53, 31), (16, 32)] {
            let data = random_bytes_matrix(f, rows, cols, seed);
            let w = QMatrix::new(f, rows, cols, &data).unwrap();
            let x = gauss_x(24, cols, seed + 100);
            assert_every_k_and_thread_count(&w, &w, &x, &format!("{f:?} rows={rows}"));
        }
    }
}

/// `w` on every ISA, for k = 1..=24 rows of `x` and 1–3 threads, against
/// the scalar result of `reference` on one thread, bit for bit.
fn assert_every_k_and_thread_count(w: &QMatrix, reference: &QMatrix, x: &[f32], what: &str) {
    let (rows, cols) = (w.rows, w.cols);
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let expect = one.install(|| run(Isa::Scalar, reference, x, 24));
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for isa in Isa::available() {
            for k in 1..=24 {
                let got = pool.install(|| run(isa, w, &x[..k * cols], k));
                assert_bits_eq(
                    &got,
                    &expect[..k * rows],
                    &format!("{isa} {what} k={k} threads={threads}"),
                );
            }
        }
    }
}

/// Q5_0 matrices regrouped into Q5_0x4 (what the model loader does on AVX2):
/// the same dequantized values and, on every ISA, for k = 1..=24 activation
/// rows and 1–3 threads, the scalar Q5_0 results bit for bit.
#[test]
fn q5_0x4_regrouping_keeps_every_value_and_every_result_bit_for_bit() {
    use tandem_model::quant::repack_q5_0x4;
    let f = QuantFormat::Q5_0;
    let isas = Isa::available();
    for (rows, cols, seed) in [(53, 896, 61), (16, 128, 62), (45, 512, 63)] {
        for data in [
            random_bytes_matrix(f, rows, cols, seed),
            candle_matrix(f, rows, cols, seed + 1),
        ] {
            let w = QMatrix::new(f, rows, cols, &data).unwrap();
            let packed = repack_q5_0x4(&data, rows, cols).unwrap();
            assert_eq!(packed.len(), data.len(), "regrouping keeps the size");
            let wx = QMatrix::new(QuantFormat::Q5_0x4, rows, cols, &packed).unwrap();
            assert_bits_eq(&dequant(&wx), &dequant(&w), "dequantized values");
            for x in [gauss_x(24, cols, seed + 2), exact_x(24, cols, seed + 3)] {
                assert_every_k_and_thread_count(&wx, &w, &x, &format!("Q5_0x4 {rows}x{cols}"));
            }
            // The widest sums: every activation at ±max magnitude.
            let x: Vec<f32> = (0..cols)
                .map(|k| if k % 3 == 0 { -1.0 } else { 1.0 })
                .collect();
            let expect = run(Isa::Scalar, &w, &x, 1);
            for &isa in &isas {
                assert_bits_eq(&run(isa, &wx, &x, 1), &expect, &format!("{isa} extreme"));
            }
            // Sharing one input with matrices of other activation kinds.
            let q8 = random_bytes_matrix(QuantFormat::Q8_0, 7, cols, seed + 4);
            let q8 = QMatrix::new(QuantFormat::Q8_0, 7, cols, &q8).unwrap();
            let xs = gauss_x(5, cols, seed + 5);
            for &isa in &isas {
                let (mut a, mut b) = (vec![f32::NAN; 5 * rows], vec![f32::NAN; 5 * 7]);
                matmul_shared_with_isa(isa, &mut [(&wx, &mut a), (&q8, &mut b)], &xs, 5).unwrap();
                assert_bits_eq(&a, &run(Isa::Scalar, &w, &xs, 5), &format!("{isa} shared"));
                assert_bits_eq(&b, &run(isa, &q8, &xs, 5), &format!("{isa} shared Q8_0"));
            }
        }
    }
}

/// Q4_K/Q5_K/Q6_K matrices with their tile layout attached (what the model
/// loader does where the AMX kernels run): on every ISA, for k = 1..=24
/// rows, 1–3 threads and row counts that leave a partial group of 16, the
/// scalar results of the plain matrix bit for bit; also at the AMX
/// thresholds' neighbours up to a prefill's 128 rows, with the widest
/// sums; and a layout of the wrong size is refused.
#[test]
fn the_tile_layout_gives_the_scalar_results_bit_for_bit() {
    use tandem_model::quant::{
        build_tile_layout, tile_layout_bytes, AMX_MIN_ROWS_Q4K, AMX_MIN_ROWS_Q6K,
    };
    for f in [QuantFormat::Q4K, QuantFormat::Q5K, QuantFormat::Q6K] {
        for (rows, cols, seed) in [(53, 512, 71), (32, 768, 72)] {
            for data in [
                random_bytes_matrix(f, rows, cols, seed),
                candle_matrix(f, rows, cols, seed + 1),
            ] {
                let w = QMatrix::new(f, rows, cols, &data).unwrap();
                let tiles = build_tile_layout(&w).unwrap();
                assert_eq!(Some(tiles.len()), tile_layout_bytes(f, rows, cols));
                let wt = w.with_tiles(&tiles).unwrap();
                for x in [gauss_x(24, cols, seed + 2), exact_x(24, cols, seed + 3)] {
                    assert_every_k_and_thread_count(
                        &wt,
                        &w,
                        &x,
                        &format!("{f:?} tiles {rows}x{cols}"),
                    );
                }
                let t = if f == QuantFormat::Q6K {
                    AMX_MIN_ROWS_Q6K
                } else {
                    AMX_MIN_ROWS_Q4K
                };
                let x = gauss_x(128, cols, seed + 4);
                for m in [t - 1, t, t + 1, 33, 64, 128] {
                    let x = &x[..m * cols];
                    let expect = run(Isa::Scalar, &w, x, m);
                    for isa in Isa::available() {
                        assert_bits_eq(
                            &run(isa, &wt, x, m),
                            &expect,
                            &format!("{isa} {f:?} m={m}"),
                        );
                    }
                }
                let x: Vec<f32> = (0..16 * cols)
                    .map(|k| if k % 3 == 0 { -1.0 } else { 1.0 })
                    .collect();
                let expect = run(Isa::Scalar, &w, &x, 16);
                for isa in Isa::available() {
                    assert_bits_eq(
                        &run(isa, &wt, &x, 16),
                        &expect,
                        &format!("{isa} {f:?} extreme"),
                    );
                }
                let err = w.with_tiles(&tiles[1..]).unwrap_err().to_string();
                assert!(err.contains("tile layout"), "{err}");
            }
        }
    }
    let q8 = random_bytes_matrix(QuantFormat::Q8_0, 16, 256, 73);
    let q8 = QMatrix::new(QuantFormat::Q8_0, 16, 256, &q8).unwrap();
    assert!(build_tile_layout(&q8).is_none());
    assert!(q8.with_tiles(&[]).is_err(), "no tile layout for Q8_0");
}

#[test]
fn q5_0x4_regrouping_rejects_rows_that_are_not_whole_groups() {
    use tandem_model::quant::repack_q5_0x4;
    let data = random_bytes_matrix(QuantFormat::Q5_0, 4, 96, 70);
    let err = repack_q5_0x4(&data, 4, 96).unwrap_err().to_string();
    assert!(err.contains("multiple of 128"), "{err}");
    let err = repack_q5_0x4(&data[..10], 4, 96).unwrap_err().to_string();
    assert!(err.contains("needs"), "{err}");
    assert!(QMatrix::new(QuantFormat::Q5_0x4, 1, 96, &data[..66]).is_err());
}

#[test]
fn every_gguf_format_maps_to_its_ggml_type_and_others_are_refused_by_name() {
    use candle_core::quantized::GgmlDType;
    for f in QuantFormat::GGUF {
        let g = f.to_ggml().unwrap();
        assert_eq!(QuantFormat::from_ggml(g).unwrap(), f);
        assert_eq!(f.block_bytes(), g.type_size(), "{f:?}");
        assert_eq!(f.block_elems(), g.block_size(), "{f:?}");
    }
    let err = QuantFormat::from_ggml(GgmlDType::Q2K)
        .unwrap_err()
        .to_string();
    for name in ["Q2K", "Q4_1", "Q5_1", "Q3K", "Q5K", "BF16"] {
        assert!(err.contains(name), "{err}");
    }
}

/// A GGUF with matrices in a format the kernels do not run opens; using such
/// a tensor is an error that names its format and the supported ones.
#[test]
fn a_tensor_in_an_unsupported_format_is_refused_by_name() {
    use candle_core::quantized::GgmlDType;
    use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q2k.gguf");
    let cfg = TinyConfig {
        n_layer: 1,
        d_ff: 256,
        vocab: 16,
        matrix_format: GgmlDType::Q2K,
        embd_format: GgmlDType::Q3K,
        output_format: GgmlDType::Q5K,
        ..TinyConfig::default()
    };
    write_tiny_qwen2(&path, &cfg).unwrap();
    let g = tandem_model::gguf::GgufFile::open(&path).unwrap();
    let err = g.matrix("blk.0.attn_q.weight").unwrap_err().to_string();
    assert!(
        err.contains("blk.0.attn_q.weight") && err.contains("Q2K") && err.contains("supported"),
        "{err}"
    );
    // The supported tensors of the same file load and dequantize.
    for (name, f) in [
        ("token_embd.weight", QuantFormat::Q3K),
        ("output.weight", QuantFormat::Q5K),
    ] {
        let w = g.matrix(name).unwrap();
        assert_eq!(w.format, f);
        let v = dequant(&w);
        assert!(v.iter().all(|x| x.is_finite()) && v.iter().any(|&x| x != 0.0));
    }
}

/// The GGUF-load fuzz seeds of the new formats (written by the `fuzz_seeds`
/// example) load as models and run two tokens: Q4_1/Q5_1 matrices, and
/// Q3_K/Q5_K matrices with BF16 norms, biases and output head (1-D vectors go
/// through the same format switch as matrices).
#[test]
fn models_in_the_new_formats_load_and_run() {
    use tandem_model::gguf::GgufFile;
    use tandem_model::transformer::{LoadOptions, Model};
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/gguf_load");
    let seeds = [
        (
            "seed-q4_1-q5_1.gguf",
            [
                ("blk.0.attn_q.weight", QuantFormat::Q4_1),
                ("token_embd.weight", QuantFormat::Q5_1),
            ],
        ),
        (
            "seed-q3_k-q5_k-bf16.gguf",
            [
                ("blk.0.ffn_up.weight", QuantFormat::Q3K),
                ("output_norm.weight", QuantFormat::BF16),
            ],
        ),
    ];
    for (file, formats) in seeds {
        let g = GgufFile::open(dir.join(file)).unwrap();
        for (name, f) in formats {
            assert_eq!(g.entry(name).unwrap().format, f, "{file} {name}");
        }
        let opts = LoadOptions {
            max_seq_len: 8,
            repack: false,
            tiles: true,
        };
        let model = Model::from_gguf(g, opts).unwrap();
        let mut cache = model.new_cache();
        let logits = model.forward(&[1, 2], 0, &mut cache).unwrap();
        assert!(logits.iter().all(|v| v.is_finite()), "{file}");
        assert!(logits.iter().any(|&v| v != logits[0]), "{file}");
    }
}
