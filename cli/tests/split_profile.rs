//! `tandem profile` on a tiny random model (fast): writes a valid
//! `tandem.profile.v1` JSON with one entry per layer, sizes that match the model,
//! and median times for every requested block size; `tandem plan` reads it.
#![allow(clippy::unwrap_used)]

mod common;

use common::tandem;
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_shard::profile::LayerKind;
use tandem_shard::ModelProfile;

#[test]
fn profile_of_a_tiny_model_is_valid_and_plannable() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny.gguf");
    let cfg = TinyConfig {
        n_layer: 3,
        ..TinyConfig::default()
    };
    write_tiny_qwen2(&model, &cfg).unwrap();
    let out = dir.path().join("p.json");
    let o = tandem()
        .args(["profile", "--threads", "1", "--context", "16"])
        .args(["--blocks", "1,3", "--repeats", "3", "--warmup", "1"])
        .arg("--model-path")
        .arg(&model)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("wrote"));
    let p = ModelProfile::load(&out).unwrap();
    assert!(p.measured);
    assert_eq!(p.threads, Some(1));
    assert_eq!(p.context_tokens, 16);
    assert_eq!(p.block_sizes, vec![1, 3]);
    assert_eq!(p.layers.len(), cfg.n_layer + 2);
    assert_eq!(p.layers[0].kind, LayerKind::Embedding);
    assert_eq!(p.layers[cfg.n_layer + 1].kind, LayerKind::Head);
    let hd = cfg.d_model / cfg.n_head;
    for (i, l) in p.layers.iter().enumerate() {
        assert!(l.weight_bytes > 0, "{}", l.name);
        let kv = if l.kind == LayerKind::Block {
            (2 * cfg.n_kv_head * hd * 4) as u64
        } else {
            0
        };
        assert_eq!(l.kv_bytes_per_token, kv, "{}", l.name);
        if i <= cfg.n_layer {
            assert_eq!(l.activation_bytes_per_token, (cfg.d_model * 4) as u64);
        }
        assert!(l.compute_seconds[&1] > 0.0 || l.kind == LayerKind::Embedding);
        assert!(l.compute_seconds[&3].is_finite());
    }
    // The layers are scaled to add up to the median whole pass the command
    // reports ("block K: X ms per forward (median pass; ...").
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    for k in [1u32, 3] {
        let line = err
            .lines()
            .find(|l| {
                let w: Vec<&str> = l.split_whitespace().take(2).collect();
                w == ["block", &format!("{k}:")]
            })
            .unwrap_or_else(|| panic!("no line for block {k} in {err}"));
        let pass_ms: f64 = line
            .split(':')
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap()
            .parse()
            .unwrap();
        let sum_ms: f64 = p.layers.iter().map(|l| l.compute_seconds[&k]).sum::<f64>() * 1e3;
        // Printed with 2 decimals.
        assert!(
            (sum_ms - pass_ms).abs() <= 0.005 + 1e-9,
            "{sum_ms} vs {line}"
        );
        assert!(
            line.contains("median pass") && line.contains("scaled x"),
            "{line}"
        );
    }
    // Blocks hold every blk.* tensor: weights add up to (nearly) the whole file.
    let weights: u64 = p.layers.iter().map(|l| l.weight_bytes).sum();
    let file = std::fs::metadata(&model).unwrap().len();
    assert!(
        weights <= file && weights as f64 > 0.8 * file as f64,
        "{weights} of {file}"
    );

    // The planner takes it.
    let nodes = dir.path().join("nodes.toml");
    std::fs::write(
        &nodes,
        "device = \"phone\"\n[[node]]\nname = \"phone\"\nmemory_mb = 100\n\
         [[node]]\nname = \"server\"\nmemory_mb = 1000\nspeed_factor = 4.0\n\
         [[link]]\na = \"phone\"\nb = \"server\"\nnetwork = \"lan\"\n",
    )
    .unwrap();
    let o = tandem()
        .args(["plan", "--block", "3", "--json", "--profile"])
        .arg(&out)
        .arg("--nodes")
        .arg(&nodes)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["block_tokens"], 3);

    // Bad arguments are refused with a message.
    let o = tandem()
        .args(["profile", "--blocks", "0", "--out"])
        .arg(dir.path().join("x.json"))
        .arg("--model-path")
        .arg(&model)
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--blocks"));
}
