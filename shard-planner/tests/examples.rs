//! The shipped example configs load, plan under every network profile, and
//! describe the real target model.

// Helpers outside #[test] fns load fixed files; a panic is the right failure.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use tandem_shard::{
    solve, ClusterConfig, ModelProfile, Objective, PlanOptions, PlanReport, NETWORK_PROFILES,
};

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

fn load() -> (ModelProfile, ClusterConfig) {
    let profile = ModelProfile::load(&root().join("config/profile.example.json")).unwrap();
    let cluster = ClusterConfig::load(&root().join("config/nodes.example.toml")).unwrap();
    (profile, cluster)
}

#[test]
fn example_profile_matches_the_target_gguf_layout() {
    let (profile, _) = load();
    assert!(
        !profile.measured,
        "example timings must be marked as not measured"
    );
    assert_eq!(profile.layers.len(), 28 + 2);
    // Tensor bytes of the real file (1,117,320,768 B including header and
    // tokenizer metadata) must account for almost all of it.
    let total = profile.total_weight_bytes();
    assert!(total < 1_117_320_768 && total > 1_100_000_000, "{total}");
    for l in &profile.layers[1..29] {
        assert_eq!(l.kv_bytes_per_token, 2 * 2 * 128 * 4, "{}", l.name);
        assert_eq!(l.activation_bytes_per_token, 1536 * 4, "{}", l.name);
    }
}

#[test]
fn example_plans_under_every_network_and_option() {
    let (profile, cluster) = load();
    for net in NETWORK_PROFILES {
        let c = cluster.with_device_network(net.name).unwrap();
        for pin_head in [false, true] {
            for block_tokens in [1, 4, 8] {
                let opts = PlanOptions {
                    block_tokens,
                    context_tokens: None,
                    pin_head,
                };
                let problem = c.to_problem(&profile, &opts).unwrap();
                for objective in [Objective::Latency, Objective::Throughput] {
                    let plan = solve(&problem, objective).unwrap();
                    let report = PlanReport::new(&problem, &plan);
                    assert_eq!(report.assignment[0], "laptop");
                    if pin_head {
                        assert_eq!(report.assignment[29], "laptop");
                    }
                    for m in &report.memory {
                        assert!(m.bytes <= m.budget_bytes);
                    }
                }
            }
        }
    }
}

#[test]
fn latency_plan_leaves_the_device_when_the_link_is_good_and_not_when_bad() {
    let (profile, cluster) = load();
    let opts = PlanOptions {
        block_tokens: 1,
        context_tokens: None,
        pin_head: false,
    };
    let on_device = |net: &str| {
        let c = cluster.with_device_network(net).unwrap();
        let p = c.to_problem(&profile, &opts).unwrap();
        let plan = solve(&p, Objective::Latency).unwrap();
        plan.assignment.iter().filter(|&&a| a == p.device).count()
    };
    // The server is 6x faster: on a LAN it should run everything it can; on
    // 3G (1 s per crossing) nothing is worth sending.
    assert_eq!(on_device("lan"), 1);
    assert_eq!(on_device("3g"), 30);
}
