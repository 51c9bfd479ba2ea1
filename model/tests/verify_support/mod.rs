//! Statistics for the sampling and verification tests: Pearson's chi-square
//! goodness-of-fit test with its p-value from the regularised incomplete gamma
//! function (no stats crate needed).
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report
#![allow(dead_code)] // each test file uses a different subset

/// ln Γ(x) for x > 0 (Lanczos approximation, g = 7, n = 9; ~1e-15 relative).
pub fn ln_gamma(x: f64) -> f64 {
    const G: f64 = 7.0;
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection formula.
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + G + 0.5;
    for (i, &c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// Regularised upper incomplete gamma Q(a, x) = Γ(a, x) / Γ(a).
pub fn gamma_q(a: f64, x: f64) -> f64 {
    assert!(a > 0.0 && x >= 0.0, "gamma_q({a}, {x}) out of domain");
    if x == 0.0 {
        return 1.0;
    }
    let ln_prefix = a * x.ln() - x - ln_gamma(a);
    if x < a + 1.0 {
        // Series for P(a, x).
        let mut ap = a;
        let mut term = 1.0 / a;
        let mut sum = term;
        for _ in 0..10_000 {
            ap += 1.0;
            term *= x / ap;
            sum += term;
            if term.abs() < sum.abs() * 1e-16 {
                break;
            }
        }
        1.0 - sum * ln_prefix.exp()
    } else {
        // Continued fraction for Q(a, x) (modified Lentz).
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let delta = d * c;
            h *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        ln_prefix.exp() * h
    }
}

/// Upper tail probability of the chi-square distribution with `df` degrees of freedom.
pub fn chi2_sf(stat: f64, df: usize) -> f64 {
    if stat.is_infinite() {
        return 0.0;
    }
    gamma_q(df as f64 / 2.0, stat / 2.0)
}

/// Result of a goodness-of-fit test.
#[derive(Debug, Clone, Copy)]
pub struct Chi2 {
    pub stat: f64,
    pub df: usize,
    pub p_value: f64,
}

/// Pearson's chi-square test of `observed` counts against `expected` probabilities
/// (same length, probabilities summing to 1). Cells whose expected count is below 5
/// are pooled into one cell so the chi-square approximation holds. A count in a cell
/// of probability 0 makes the statistic infinite (p = 0).
pub fn chi_square(observed: &[u64], expected: &[f64]) -> Chi2 {
    assert_eq!(observed.len(), expected.len());
    let n: u64 = observed.iter().sum();
    let n = n as f64;
    let mut cells: Vec<(f64, f64)> = Vec::new(); // (observed, expected count)
    let mut pooled = (0.0, 0.0);
    for (&o, &p) in observed.iter().zip(expected) {
        if p <= 0.0 {
            if o > 0 {
                return Chi2 {
                    stat: f64::INFINITY,
                    df: observed.len().saturating_sub(1),
                    p_value: 0.0,
                };
            }
            continue;
        }
        let e = p * n;
        if e < 5.0 {
            pooled.0 += o as f64;
            pooled.1 += e;
        } else {
            cells.push((o as f64, e));
        }
    }
    if pooled.1 > 0.0 {
        cells.push(pooled);
    }
    let stat: f64 = cells.iter().map(|&(o, e)| (o - e) * (o - e) / e).sum();
    let df = cells.len().saturating_sub(1).max(1);
    Chi2 {
        stat,
        df,
        p_value: chi2_sf(stat, df),
    }
}
