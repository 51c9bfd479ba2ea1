//! The device state (thermal, battery, power save) as the runtime acts on it,
//! with injected states against a real in-process verifier (tiny random
//! models): a hot device drafts on fewer threads, a low battery / power save
//! caps k (round records show it, fixed and adaptive k), greedy output stays
//! the target's whatever the state, a state set from another thread while a
//! generation runs applies from the next one, and the router sees the state.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use tandem_edge::adaptive::SpeculationConfig;
use tandem_edge::{DeviceState, EdgeConfig, EdgeRuntime, ThermalState, TokenStatus};
use tandem_model::forward_threads;
use tandem_model::speculative::{generate_single, GenerateConfig};
use tandem_model::testing::{write_tiny_qwen2, TinyConfig};
use tandem_model::tokenizer::ChatMessage;
use tandem_model::transformer::{LoadOptions, Model};
use tandem_router::{Action, Router};

const TOKEN: &str = "device-state-test-token-0123456789";
const FP: &str = "tiny-test-fingerprint";
const PROMPT: &[u32] = &[5, 17, 42, 99, 3, 250, 7];

fn load(p: &Path) -> Arc<Model> {
    Arc::new(Model::load(p, LoadOptions::with_max_seq_len(512)).unwrap())
}

fn gen_cfg(k: usize, max_tokens: usize) -> GenerateConfig {
    GenerateConfig {
        k,
        max_tokens,
        ..GenerateConfig::default()
    }
}

fn hot(thermal: ThermalState) -> DeviceState {
    DeviceState {
        thermal: Some(thermal),
        ..DeviceState::default()
    }
}

/// Forwards of this thread run on a 4-thread pool, so "all threads" is 4
/// whatever the machine has.
fn four_threads() -> forward_threads::ForwardPoolGuard {
    forward_threads::use_pool(Arc::new(
        rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap(),
    ))
}

struct Models {
    _dir: tempfile::TempDir,
    target_path: std::path::PathBuf,
    draft: Arc<Model>,
    expected: Vec<u32>,
}

fn models(max_tokens: usize) -> Models {
    let dir = tempfile::tempdir().unwrap();
    let target_path = dir.path().join("target.gguf");
    let draft_path = dir.path().join("draft.gguf");
    // Both carry the tokenizer: the target's vocabulary (tokens without the
    // padding rows) must be the draft's.
    let target_cfg = TinyConfig {
        tokenizer: true,
        ..TinyConfig::default()
    };
    write_tiny_qwen2(&target_path, &target_cfg).unwrap();
    // (With tokenizer metadata: the routing test builds the chat prompt.)
    let draft_cfg = TinyConfig {
        tokenizer: true,
        ..TinyConfig::draft_like()
    };
    write_tiny_qwen2(&draft_path, &draft_cfg).unwrap();
    let target = load(&target_path);
    let expected = generate_single(&target, PROMPT, &gen_cfg(1, max_tokens), &mut |_| true)
        .unwrap()
        .tokens;
    Models {
        _dir: dir,
        target_path,
        draft: load(&draft_path),
        expected,
    }
}

fn start_verifier(rt: &tokio::runtime::Runtime, target: &Path) -> tandem_verifier::RunningVerifier {
    let text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nmodel_path = {target:?}\n\
         tokenizer_fingerprint = \"{FP}\"\nmax_seq_len = 4096\ninsecure_loopback = true\n\
         [[devices]]\nid = \"dev\"\ntoken = \"{TOKEN}\"\n"
    );
    rt.block_on(tandem_verifier::start(toml::from_str(&text).unwrap()))
        .unwrap()
}

fn edge_cfg(addr: std::net::SocketAddr, speculation: SpeculationConfig) -> EdgeConfig {
    EdgeConfig {
        verifier_url: Some(format!("http://{addr}")),
        token: Some(TOKEN.into()),
        tokenizer_fingerprint: Some(FP.into()),
        speculation,
        ..EdgeConfig::default()
    }
}

#[test]
fn a_hot_device_drafts_on_fewer_threads_from_the_next_generation() {
    let m = models(12);
    let _pool = four_threads();
    let mut e = EdgeRuntime::builder(m.draft.clone(), EdgeConfig::default())
        .build()
        .unwrap();
    let local = |e: &mut EdgeRuntime| {
        let g = e.generate(PROMPT, &gen_cfg(4, 12), &mut |_| true).unwrap();
        assert!(g.statuses.iter().all(|s| *s == TokenStatus::Local));
        g
    };
    let cool = local(&mut e);
    let d = cool.stats.device.clone().unwrap();
    assert_eq!((d.draft_threads, d.base_threads, d.k_cap), (4, 4, None));
    for (state, threads) in [
        (ThermalState::Nominal, 4),
        (ThermalState::Fair, 3),
        (ThermalState::Serious, 2),
        (ThermalState::Critical, 1),
    ] {
        e.set_device_state(hot(state)).unwrap();
        // This thread's forward pool is the base.
        assert_eq!(e.device_adjustments().base_threads, 4);
        let g = local(&mut e);
        let d = g.stats.device.unwrap();
        assert_eq!(d.draft_threads, threads, "{state:?}: {:?}", d.reasons);
        // Fewer threads change speed, never tokens.
        assert_eq!(g.tokens, cool.tokens, "{state:?}");
    }
    // After the generation the thread's own pool is back.
    assert_eq!(forward_threads::current(), 4);

    // Set from another thread while a generation runs: that generation keeps
    // what it started with, the next one uses the new state.
    e.set_device_state(DeviceState::default()).unwrap();
    let handle = e.device_handle();
    let mut setter = None;
    let g = e
        .generate(PROMPT, &gen_cfg(4, 12), &mut |ev| {
            if let tandem_edge::EdgeEvent::Token { index: 2, .. } = ev {
                let h = handle.clone();
                setter = Some(std::thread::spawn(move || {
                    h.set(hot(ThermalState::Critical)).unwrap()
                }));
            }
            true
        })
        .unwrap();
    setter.unwrap().join().unwrap();
    assert_eq!(g.stats.device.unwrap().draft_threads, 4);
    assert_eq!(local(&mut e).stats.device.unwrap().draft_threads, 1);
    // A bad state is refused and changes nothing.
    let err = e
        .set_device_state(DeviceState {
            battery_pct: Some(150),
            ..DeviceState::default()
        })
        .unwrap_err();
    assert!(err.to_string().contains("battery_pct"), "{err}");
    assert_eq!(e.device_state().thermal, Some(ThermalState::Critical));
}

#[test]
fn low_battery_and_heat_cap_k_and_greedy_output_stays_the_targets() {
    let m = models(32);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let v = start_verifier(&rt, &m.target_path);
    for adaptive in [false, true] {
        let spec = SpeculationConfig {
            adaptive_k: adaptive,
            k_min: 1,
            k_max: 12,
            record_rounds: true,
            ..SpeculationConfig::default()
        };
        let mut e = EdgeRuntime::builder(m.draft.clone(), edge_cfg(v.grpc_addr, spec))
            .build()
            .unwrap();
        let battery = |pct| DeviceState {
            battery_pct: Some(pct),
            ..DeviceState::default()
        };
        for (state, cap) in [
            (DeviceState::default(), None),
            (battery(15), Some(2)),
            (battery(5), Some(1)),
            (
                DeviceState {
                    battery_pct: Some(5),
                    charging: true,
                    ..DeviceState::default()
                },
                None,
            ),
            (
                DeviceState {
                    power_save: true,
                    ..DeviceState::default()
                },
                Some(2),
            ),
            (hot(ThermalState::Serious), Some(4)),
            (hot(ThermalState::Critical), Some(2)),
        ] {
            e.set_device_state(state.clone()).unwrap();
            let g = e.generate(PROMPT, &gen_cfg(8, 32), &mut |_| true).unwrap();
            assert_eq!(g.tokens, m.expected, "adaptive {adaptive}, {state:?}");
            assert!(g.statuses.iter().all(|s| *s == TokenStatus::Verified));
            assert_eq!(g.stats.device.as_ref().unwrap().k_cap, cap);
            let rounds = e.last_rounds();
            assert!(!rounds.is_empty());
            let most = rounds.iter().map(|r| r.k).max().unwrap();
            match cap {
                Some(c) => assert!(most <= c, "{state:?}: k {most} > cap {c}"),
                // Fixed k = 8 is played when nothing caps it.
                None if !adaptive => assert_eq!(most, 8, "{rounds:?}"),
                None => {}
            }
        }
    }
    // The plain round loop (no round records) is capped the same way: with
    // k = 1 every token costs a round (accepted + the verifier's own).
    let mut e = EdgeRuntime::builder(
        m.draft.clone(),
        edge_cfg(v.grpc_addr, SpeculationConfig::default()),
    )
    .build()
    .unwrap();
    let plain = e.generate(PROMPT, &gen_cfg(8, 32), &mut |_| true).unwrap();
    e.set_device_state(DeviceState {
        battery_pct: Some(3),
        ..DeviceState::default()
    })
    .unwrap();
    let low = e.generate(PROMPT, &gen_cfg(8, 32), &mut |_| true).unwrap();
    assert_eq!(plain.tokens, m.expected);
    assert_eq!(low.tokens, m.expected);
    assert!(low.stats.drafted <= low.stats.rounds, "{:?}", low.stats);
    assert!(
        plain.stats.drafted > plain.stats.rounds,
        "{:?}",
        plain.stats
    );
    rt.block_on(v.shutdown()).unwrap();
}

#[test]
fn operators_route_non_sensitive_requests_to_the_verifier_when_the_device_is_hot() {
    let m = models(8);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let v = start_verifier(&rt, &m.target_path);
    // This operator answers on the device by default, offloads to the
    // verifier when the phone is hot, and keeps sensitive text local always.
    let policy = r#"
version = 1
default = "local"
[[rules]]
name = "sensitive"
action = "local"
entities = ["*"]
[[rules]]
name = "sensitive-topics"
action = "local"
categories = ["*"]
[[rules]]
name = "hot-offload"
action = "speculative"
thermal_at_least = 2
[[rules]]
name = "saver"
action = "speculative"
power_save = true
charging = false
"#;
    let router = Arc::new(Router::from_toml_str(policy).unwrap());
    let tok = tandem_model::tokenizer::Tokenizer::from_gguf(m.draft.gguf()).unwrap();
    let mut routed = EdgeRuntime::builder(
        m.draft.clone(),
        edge_cfg(v.grpc_addr, SpeculationConfig::default()),
    )
    .router(router, tok)
    .build()
    .unwrap();
    let benign = [ChatMessage::user("how do I sort a list in rust")];
    let sensitive = [ChatMessage::user(
        "my email is jane.doe@fastmail.fm, reply there",
    )];
    let g = gen_cfg(4, 8);
    let cool = routed.chat("a", &benign, &g, &mut |_| true).unwrap();
    assert_eq!(cool.route.action(), Action::Local);
    routed.set_device_state(hot(ThermalState::Serious)).unwrap();
    let hot_benign = routed.chat("b", &benign, &g, &mut |_| true).unwrap();
    assert_eq!(
        (
            hot_benign.route.action(),
            hot_benign.route.decision.rule.as_str()
        ),
        (Action::Speculative, "hot-offload")
    );
    assert_eq!(hot_benign.route.context.thermal_level, Some(2));
    assert!(hot_benign
        .generation
        .statuses
        .iter()
        .all(|s| *s == TokenStatus::Verified));
    let hot_sensitive = routed.chat("c", &sensitive, &g, &mut |_| true).unwrap();
    assert_eq!(
        (
            hot_sensitive.route.action(),
            hot_sensitive.route.decision.rule.as_str()
        ),
        (Action::Local, "sensitive")
    );
    assert!(hot_sensitive
        .generation
        .statuses
        .iter()
        .all(|s| *s == TokenStatus::Local));
    routed
        .set_device_state(DeviceState {
            power_save: true,
            charging: false,
            ..DeviceState::default()
        })
        .unwrap();
    let saver = routed.chat("d", &benign, &g, &mut |_| true).unwrap();
    assert_eq!(saver.route.decision.rule, "saver");
    assert!(saver.route.context.power_save);
    routed
        .set_device_state(DeviceState {
            power_save: true,
            charging: true,
            ..DeviceState::default()
        })
        .unwrap();
    let charging = routed.chat("e", &benign, &g, &mut |_| true).unwrap();
    assert_eq!(charging.route.decision.rule, "default");
    drop(routed);
    rt.block_on(v.shutdown()).unwrap();
}

#[test]
fn a_policy_that_would_send_sensitive_text_out_when_hot_is_refused() {
    let bad = r#"
version = 1
default = "speculative"
[[rules]]
name = "hot-offload"
action = "speculative"
thermal_at_least = 2
[[rules]]
name = "sensitive"
action = "local"
entities = ["*"]
"#;
    let err = Router::from_toml_str(bad).err().unwrap().to_string();
    assert!(
        err.contains("rules[0].action") && err.contains("\"sensitive\""),
        "{err}"
    );
    let out_of_scale = "version = 1\ndefault = \"local\"\n[[rules]]\nname = \"x\"\naction = \"local\"\nthermal_at_least = 4\n";
    let err = Router::from_toml_str(out_of_scale)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("thermal_at_least"), "{err}");
}

#[test]
fn warm_up_at_load_runs_a_forward_and_changes_no_token() {
    let m = models(12);
    let mut cold = EdgeRuntime::builder(m.draft.clone(), EdgeConfig::default())
        .build()
        .unwrap();
    assert_eq!(cold.warmup_ms(), None);
    let mut warm = EdgeRuntime::builder(m.draft.clone(), EdgeConfig::default())
        .warmup(true)
        .build()
        .unwrap();
    assert!(warm.warmup_ms().is_some_and(|ms| ms > 0.0));
    let from_toml = EdgeConfig::from_toml("warmup = true").unwrap();
    assert!(from_toml.warmup);
    let a = cold
        .generate(PROMPT, &gen_cfg(4, 12), &mut |_| true)
        .unwrap();
    let b = warm
        .generate(PROMPT, &gen_cfg(4, 12), &mut |_| true)
        .unwrap();
    assert_eq!(a.tokens, b.tokens);
}
