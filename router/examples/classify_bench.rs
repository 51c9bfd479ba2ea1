//! Classification cost: `cargo run --release -p tandem-router --example classify_bench`.
//!
//! Mixed corpus: every case of tests/corpus and tests/blind (prose in seven
//! languages, code, logs, configs, secrets) plus this crate's own Rust
//! sources as plain code. Reports
//!   * µs per KB over the whole corpus cut into ~4 KB prompts (the target is
//!     ≤ 50 µs/KB), and
//!   * µs per call for the short corpus prompts one by one (fixed per-call
//!     cost dominates there).
//!
//! Uses config/policy.example.toml: all recognizers, the lexicons, one custom
//! recognizer and the allow-list.

use std::time::Instant;

/// This thread's CPU time in seconds (Linux: /proc/thread-self/schedstat),
/// so the figure is not inflated when other processes share the cores.
fn cpu_seconds() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: f64 = s.split_whitespace().next()?.parse().ok()?;
    Some(ns / 1e9)
}

/// Run `f`, return (wall seconds, CPU seconds if known).
fn timed(mut f: impl FnMut()) -> (f64, Option<f64>) {
    let c0 = cpu_seconds();
    let t = Instant::now();
    f();
    let wall = t.elapsed().as_secs_f64();
    let cpu = c0.and_then(|c0| cpu_seconds().map(|c1| c1 - c0));
    (wall, cpu)
}

fn corpus_texts() -> Vec<String> {
    let mut out = Vec::new();
    let mut files: Vec<_> = [
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/corpus"),
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/blind"),
    ]
    .iter()
    .flat_map(|dir| {
        std::fs::read_dir(dir)
            .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
            .unwrap_or_else(|_| Vec::new())
    })
    .collect();
    files.sort();
    for f in files {
        if f.extension().is_none_or(|x| x != "jsonl") {
            continue;
        }
        let Ok(s) = std::fs::read_to_string(&f) else {
            continue;
        };
        for line in s.lines() {
            if let Some(t) = serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["text"].as_str().map(String::from))
            {
                out.push(t);
            }
        }
    }
    out
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let policy = tandem_router::Policy::from_file(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../config/policy.example.toml"
    ))?;
    let ctx = tandem_router::RouteContext::default();
    let short = corpus_texts();
    let code = [
        include_str!("../src/recognizers.rs"),
        include_str!("../src/policy.rs"),
        include_str!("../src/validate.rs"),
        include_str!("../src/router.rs"),
    ];

    // Interleave prose cases and code into ~4 KB prompts.
    let mut all = String::new();
    for (i, t) in short.iter().enumerate() {
        all.push_str(t);
        all.push('\n');
        if i % 40 == 0 {
            let c = code[(i / 40) % code.len()];
            let mut cut = 1500.min(c.len());
            while !c.is_char_boundary(cut) {
                cut -= 1;
            }
            all.push_str(&c[..cut]);
        }
    }
    for c in code {
        all.push_str(c);
    }
    let mut docs = Vec::new();
    let mut start = 0;
    while start < all.len() {
        let mut end = (start + 4096).min(all.len());
        while !all.is_char_boundary(end) {
            end += 1;
        }
        docs.push(&all[start..end]);
        start = end;
    }
    let bytes: usize = docs.iter().map(|d| d.len()).sum();

    // Warm up, then time.
    let mut sink = 0usize;
    for d in &docs {
        sink += policy.decide(d, &ctx).entities.len();
    }
    let iters = 20;
    let (wall, cpu) = timed(|| {
        for _ in 0..iters {
            for d in &docs {
                sink += policy.decide(d, &ctx).entities.len();
            }
        }
    });
    let kb = (bytes * iters) as f64 / 1024.0;
    println!(
        "mixed corpus: {} prompts, {:.1} KB x {iters} iterations",
        docs.len(),
        bytes as f64 / 1024.0,
    );
    println!("  wall: {:.1} µs/KB", wall * 1e6 / kb);
    if let Some(cpu) = cpu {
        println!(
            "  cpu:  {:.1} µs/KB  ({:.1} MB/s)",
            cpu * 1e6 / kb,
            kb / 1024.0 / cpu
        );
    }

    let short_bytes: usize = short.iter().map(String::len).sum();
    let (wall, cpu) = timed(|| {
        for _ in 0..iters {
            for s in &short {
                sink += policy.decide(s, &ctx).entities.len();
            }
        }
    });
    let calls = (short.len() * iters) as f64;
    println!(
        "short prompts: {} cases, mean {:.0} B",
        short.len(),
        short_bytes as f64 / short.len() as f64,
    );
    println!("  wall: {:.1} µs per call", wall * 1e6 / calls);
    if let Some(cpu) = cpu {
        println!("  cpu:  {:.1} µs per call", cpu * 1e6 / calls);
    }
    println!("(checksum {sink})");
    Ok(())
}
