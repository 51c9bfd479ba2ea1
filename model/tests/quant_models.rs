//! The kernels on real weights: one matrix of every format found in the draft
//! and target GGUFs, plus both output heads. Needs the models (`tandem models
//! fetch`); fails with a clear message if they are missing (CI fetches them).
#![allow(clippy::unwrap_used)] // tests: a failure should panic
#![allow(clippy::needless_range_loop)] // (i, j) output indices read best as indices

mod quant_common;

use quant_common::*;
use std::path::PathBuf;
use tandem_model::gguf::GgufFile;
use tandem_model::quant::{matmul_with_isa, Isa, QMatrix, QuantFormat};

const FILES: [&str; 2] = [
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
];

fn model_path(file: &str) -> PathBuf {
    let dir = tandem_fetch::models_dir();
    let p = dir.join(file);
    assert!(
        p.is_file(),
        "model file {} is missing: run `tandem models fetch` (or set TANDEM_MODELS_DIR)",
        p.display()
    );
    p
}

fn run(isa: Isa, w: &QMatrix, x: &[f32], m: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * w.rows];
    matmul_with_isa(isa, w, x, m, &mut out).unwrap();
    out
}

/// The first `rows` rows of a matrix.
fn head_rows<'a>(w: &QMatrix<'a>, rows: usize) -> QMatrix<'a> {
    let rows = rows.min(w.rows);
    let rb = w.format.row_bytes(w.cols).unwrap();
    QMatrix::new(w.format, rows, w.cols, &w.data[..rows * rb]).unwrap()
}

#[test]
fn real_matrices_of_every_format_are_correct_and_bit_exact() {
    let mut formats_seen = Vec::new();
    for file in FILES {
        let g = GgufFile::open(model_path(file)).unwrap();
        let mut names: Vec<&String> = g
            .tensors
            .keys()
            .filter(|n| g.tensors[*n].dims.len() == 2)
            .collect();
        names.sort();
        let mut picked: Vec<(QuantFormat, &String)> = Vec::new();
        for n in names {
            let f = g.tensors[n].format;
            if n.as_str() == "output.weight" || !picked.iter().any(|(pf, _)| *pf == f) {
                picked.push((f, n));
            }
        }
        for (f, name) in picked {
            formats_seen.push(f);
            let full = g.matrix(name).unwrap();
            let w = head_rows(&full, 300);
            let m = 3;
            let x = gauss_x(m, w.cols, 1);
            let expect = run(Isa::Scalar, &w, &x, m);
            // every ISA, bit for bit
            for isa in Isa::available() {
                assert_bits_eq(
                    &run(isa, &w, &x, m),
                    &expect,
                    &format!("{file} {name} {f:?} {isa}"),
                );
                for i in 0..m {
                    let one = run(isa, &w, &x[i * w.cols..(i + 1) * w.cols], 1);
                    assert_bits_eq(
                        &one,
                        &expect[i * w.rows..(i + 1) * w.rows],
                        &format!("{file} {name} {isa} row {i} alone"),
                    );
                }
            }
            // against the dequantized f32 product, within the activation
            // quantization bound (Σ|w|·d/2) plus float rounding
            let block = match f {
                QuantFormat::Q4K | QuantFormat::Q6K => 256,
                QuantFormat::F32 | QuantFormat::F16 => 0,
                _ => 32,
            };
            let wd = dequant(&w);
            for i in 0..m {
                let xi = &x[i * w.cols..(i + 1) * w.cols];
                for j in 0..w.rows {
                    let wj = &wd[j * w.cols..(j + 1) * w.cols];
                    let wmax = wj.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                    let r: f64 = wj.iter().zip(xi).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let mut tol: f64 = wj
                        .iter()
                        .zip(xi)
                        .map(|(&a, &b)| (a.abs() as f64 + wmax) * b.abs() as f64)
                        .sum::<f64>()
                        * 1e-5;
                    if block > 0 {
                        for (xb, wb) in xi.chunks(block).zip(wj.chunks(block)) {
                            let d = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                            tol += wb.iter().map(|v| v.abs() as f64).sum::<f64>() * d / 2.0 * 1.001;
                        }
                    }
                    let got = expect[i * w.rows + j] as f64;
                    assert!(
                        (got - r).abs() <= tol,
                        "{file} {name} {f:?}: out[{i},{j}] = {got}, f32 reference {r}, tol {tol}"
                    );
                }
            }
        }
    }
    for f in [
        QuantFormat::Q4K,
        QuantFormat::Q5_0,
        QuantFormat::Q6K,
        QuantFormat::Q8_0,
    ] {
        assert!(
            formats_seen.contains(&f),
            "no {f:?} matrix found in the models"
        );
    }
}

#[test]
fn output_heads_are_bit_exact_across_isas_and_row_counts() {
    for file in FILES {
        let g = GgufFile::open(model_path(file)).unwrap();
        let w = g.matrix("output.weight").unwrap();
        assert_eq!(w.rows, 151936);
        let x = gauss_x(2, w.cols, 2);
        let expect = run(Isa::Scalar, &w, &x, 2);
        for isa in Isa::available() {
            assert_bits_eq(
                &run(isa, &w, &x, 2),
                &expect,
                &format!("{file} head {isa} m=2"),
            );
            assert_bits_eq(
                &run(isa, &w, &x[w.cols..], 1),
                &expect[w.rows..],
                &format!("{file} head {isa} m=1"),
            );
        }
    }
}
