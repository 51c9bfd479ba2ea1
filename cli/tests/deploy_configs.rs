//! The operator files in deploy/ are what they claim: every YAML file parses
//! (Kubernetes multi-document files included) and carries the facts the scale-out
//! design relies on; the Grafana dashboard parses and queries only verifier
//! metrics; the nginx site passes a real `nginx -t`.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

mod common;

use common::deploy::{
    deploy_dir, grafana_metric_names, nginx_main_conf, nginx_test, read_deploy, render_nginx_site,
    SiteTls,
};
use serde_norway::Value;
use std::path::{Path, PathBuf};

/// Every document of a (multi-document) YAML file.
fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut docs = Vec::new();
    for d in serde_norway::Deserializer::from_str(&text) {
        let v: Value = serde::Deserialize::deserialize(d)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if !v.is_null() {
            docs.push(v);
        }
    }
    assert!(!docs.is_empty(), "{}: no document", path.display());
    docs
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if matches!(p.extension().and_then(|x| x.to_str()), Some("yaml" | "yml")) {
            out.push(p);
        }
    }
}

/// `v[a][b]...` with string keys and numeric indexes, or Null.
fn at<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    static NULL: Value = Value::Null;
    let mut cur = v;
    for k in path {
        cur = match k.parse::<usize>() {
            Ok(i) => cur.get(i),
            Err(_) => cur.get(*k),
        }
        .unwrap_or(&NULL);
    }
    cur
}

fn s<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    at(v, path)
        .as_str()
        .unwrap_or_else(|| panic!("{path:?} is not a string in {v:?}"))
}

/// All Kubernetes objects of deploy/k8s.
fn k8s_objects() -> Vec<Value> {
    let mut files = Vec::new();
    yaml_files(&deploy_dir().join("k8s"), &mut files);
    files
        .iter()
        .flat_map(|f| yaml_docs(f))
        .filter(|d| d.get("kind").is_some() && d.get("apiVersion").is_some())
        .collect()
}

fn one<'a>(objs: &'a [Value], kind: &str, pred: impl Fn(&Value) -> bool) -> &'a Value {
    let found: Vec<&Value> = objs
        .iter()
        .filter(|o| s(o, &["kind"]) == kind && pred(o))
        .collect();
    assert_eq!(found.len(), 1, "exactly one {kind} expected: {found:?}");
    found[0]
}

#[test]
fn every_yaml_file_in_deploy_parses() {
    let mut files = Vec::new();
    yaml_files(&deploy_dir(), &mut files);
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in [
        "envoy.yaml",
        "deployment.yaml",
        "services.yaml",
        "pdb.yaml",
        "configmap.yaml",
        "kustomization.yaml",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} missing: {names:?}");
    }
    for f in &files {
        yaml_docs(f);
    }
    // kustomization.yaml lists every manifest of the directory.
    let k = &yaml_docs(&deploy_dir().join("k8s/kustomization.yaml"))[0];
    let listed: Vec<&str> = at(k, &["resources"])
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    for n in names.iter().filter(|n| n.as_str() != "envoy.yaml") {
        if n != "kustomization.yaml" {
            assert!(listed.contains(&n.as_str()), "{n} not in kustomization");
        }
    }
}

#[test]
fn kubernetes_manifests_have_probes_headless_service_pdb_and_secrets() {
    let objs = k8s_objects();
    let dep = one(&objs, "Deployment", |_| true);
    assert_eq!(at(dep, &["spec", "replicas"]).as_u64(), Some(3));
    let pod = at(dep, &["spec", "template", "spec"]);
    let grace = at(pod, &["terminationGracePeriodSeconds"])
        .as_u64()
        .unwrap();
    assert!(grace >= 30, "room to drain: {grace}");
    let c = at(pod, &["containers", "0"]);
    let ports = at(c, &["ports"]).as_sequence().unwrap();
    let port_no = |name: &str| {
        ports
            .iter()
            .find(|p| s(p, &["name"]) == name)
            .and_then(|p| at(p, &["containerPort"]).as_u64())
            .unwrap_or_else(|| panic!("no {name} port"))
    };
    let (grpc, admin) = (port_no("grpc"), port_no("admin"));
    assert_eq!(s(c, &["readinessProbe", "httpGet", "path"]), "/readyz");
    assert_eq!(s(c, &["readinessProbe", "httpGet", "port"]), "admin");
    assert_eq!(s(c, &["livenessProbe", "httpGet", "path"]), "/healthz");
    assert_eq!(s(c, &["livenessProbe", "httpGet", "port"]), "admin");
    assert!(at(c, &["resources", "requests", "cpu"]).as_str().is_some());
    assert!(at(c, &["resources", "limits", "memory"]).as_str().is_some());
    let args: Vec<&str> = at(c, &["command"])
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(&args[..2], &["tandem", "serve-verifier"]);

    // Device tokens come from a Secret; TLS files from a Secret volume.
    let env = at(c, &["env"]).as_sequence().unwrap();
    let token_envs: Vec<&str> = env
        .iter()
        .filter(|e| !at(e, &["valueFrom", "secretKeyRef", "name"]).is_null())
        .map(|e| s(e, &["name"]))
        .collect();
    assert!(!token_envs.is_empty(), "no token from a Secret");
    let vols = at(pod, &["volumes"]).as_sequence().unwrap();
    assert!(vols
        .iter()
        .any(|v| !at(v, &["secret", "secretName"]).is_null()));

    // The ConfigMap's verifier.toml is a valid verifier config whose ports and
    // token variables match the Deployment.
    let cm = one(&objs, "ConfigMap", |_| true);
    let toml_text = s(cm, &["data", "verifier.toml"]);
    let cfg: tandem_verifier::VerifierConfig = toml::from_str(toml_text).unwrap();
    assert_eq!(u64::from(cfg.listen.port()), grpc);
    assert_eq!(u64::from(cfg.admin_listen.port()), admin);
    assert!(
        cfg.tls.is_some(),
        "TLS: the verifier refuses plain text off loopback"
    );
    let table: toml::Table = toml::from_str(toml_text).unwrap();
    for d in table["devices"].as_array().unwrap() {
        let var = d["token_env"].as_str().unwrap();
        assert!(token_envs.contains(&var), "{var} not set from the Secret");
    }
    // Safer shipped defaults: no reflection, /metrics behind a token from a
    // Secret, the per-peer cap as wide as the balancer in front needs.
    assert!(
        !cfg.reflection,
        "reflection must be off in the shipped config"
    );
    let metrics_var = cfg.metrics_token_env.as_deref().expect("metrics_token_env");
    assert!(
        token_envs.contains(&metrics_var),
        "{metrics_var} not set from a Secret"
    );
    assert_eq!(
        cfg.limits.max_connections_per_peer, cfg.limits.max_connections,
        "behind the balancer one peer carries every device"
    );

    // Headless gRPC Service + admin Service.
    let headless = one(&objs, "Service", |o| {
        at(o, &["spec", "clusterIP"]).as_str() == Some("None")
    });
    let hp = at(headless, &["spec", "ports", "0"]);
    assert_eq!(at(hp, &["port"]).as_u64(), Some(grpc));
    let admin_svc = one(&objs, "Service", |o| {
        at(o, &["spec", "clusterIP"]).as_str() != Some("None")
    });
    assert_eq!(
        at(admin_svc, &["spec", "ports", "0", "port"]).as_u64(),
        Some(admin)
    );
    // Both select the Deployment's pods.
    let labels = at(dep, &["spec", "template", "metadata", "labels"]);
    for svc in [headless, admin_svc] {
        let sel = at(svc, &["spec", "selector"]).as_mapping().unwrap();
        for (k, v) in sel {
            assert_eq!(labels.get(k.as_str().unwrap()), Some(v));
        }
    }

    let pdb = one(&objs, "PodDisruptionBudget", |_| true);
    assert!(
        !at(pdb, &["spec", "maxUnavailable"]).is_null()
            || !at(pdb, &["spec", "minAvailable"]).is_null()
    );
    let sel = at(pdb, &["spec", "selector", "matchLabels"])
        .as_mapping()
        .unwrap();
    for (k, v) in sel {
        assert_eq!(labels.get(k.as_str().unwrap()), Some(v));
    }
}

#[test]
fn envoy_hashes_the_affinity_header_over_a_ring_and_health_checks_grpc() {
    let docs = yaml_docs(&deploy_dir().join("envoy/envoy.yaml"));
    let e = &docs[0];
    let cluster = at(e, &["static_resources", "clusters", "0"]);
    assert_eq!(s(cluster, &["lb_policy"]), "RING_HASH");
    assert!(!at(
        cluster,
        &[
            "typed_extension_protocol_options",
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config",
            "http2_protocol_options"
        ]
    )
    .is_null());
    let hc = at(cluster, &["health_checks", "0", "grpc_health_check"]);
    assert_eq!(
        s(hc, &["service_name"]),
        tandem_proto::VERIFIER_SERVICE_NAME
    );
    let name = s(cluster, &["name"]);
    // Every route to the cluster hashes on the affinity header.
    let hcm = at(
        e,
        &[
            "static_resources",
            "listeners",
            "0",
            "filter_chains",
            "0",
            "filters",
            "0",
            "typed_config",
        ],
    );
    let routes = at(hcm, &["route_config", "virtual_hosts", "0", "routes"])
        .as_sequence()
        .unwrap();
    assert!(!routes.is_empty());
    for r in routes {
        assert_eq!(s(r, &["route", "cluster"]), name);
        assert_eq!(
            s(r, &["route", "hash_policy", "0", "header", "header_name"]),
            tandem_proto::SESSION_AFFINITY_HEADER
        );
        assert_eq!(s(r, &["route", "timeout"]), "0s", "long-lived streams");
    }
}

#[test]
fn grafana_dashboard_parses_and_reads_verifier_metrics() {
    let text = read_deploy("grafana/tandem-verifier.json");
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(j["uid"].is_string() && j["title"].is_string());
    let panels = j["panels"].as_array().unwrap();
    let mut ids = std::collections::BTreeSet::new();
    for p in panels {
        assert!(ids.insert(p["id"].as_u64().unwrap()), "duplicate panel id");
        for t in p["targets"].as_array().into_iter().flatten() {
            let e = t["expr"].as_str().unwrap();
            assert!(
                e.matches('(').count() == e.matches(')').count(),
                "unbalanced: {e}"
            );
        }
    }
    let names = grafana_metric_names();
    // Every metric docs/verifier.md lists, plus the scheduler's (being added).
    for m in [
        "tandem_verifier_sessions",
        "tandem_verifier_session_bytes",
        "tandem_verifier_sessions_opened_total",
        "tandem_verifier_evictions_total",
        "tandem_verifier_verify_seconds",
        "tandem_verifier_drafted_tokens_total",
        "tandem_verifier_accepted_tokens_total",
        "tandem_verifier_emitted_tokens_total",
        "tandem_verifier_acceptance_rate",
        "tandem_verifier_errors_total",
        "tandem_verifier_batch_rows",
        "tandem_verifier_queue_wait_seconds",
        "tandem_verifier_prefill_tokens_total",
        "tandem_verifier_kv_pages_used",
        "tandem_verifier_kv_pages_free",
        "tandem_verifier_identity_sessions",
    ] {
        assert!(names.contains(m), "{m} not on the dashboard: {names:?}");
    }
    assert_eq!(names.len(), 16, "{names:?}");
}

#[test]
fn nginx_site_passes_nginx_t() {
    let dir = tempfile::tempdir().unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["verifier.internal".to_string()]).unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    let tpl = read_deploy("nginx/tandem-verifier.conf");
    // The shipped facts, before any substitution.
    for needle in [
        "hash $http_x_tandem_session consistent;",
        "grpc_next_upstream error timeout",
        "grpc_read_timeout",
        "grpc_send_timeout",
        "client_max_body_size",
        "http2",
    ] {
        assert!(tpl.contains(needle), "{needle} missing");
    }
    let ups = vec!["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tls = SiteTls {
        cert: &cert,
        key: &key,
        upstream_ca: &cert,
    };
    for (name, tls) in [("tls", Some(&tls)), ("plain", None)] {
        let site = dir.path().join(format!("site-{name}.conf"));
        let text = render_nginx_site(&tpl, &format!("127.0.0.1:{port}"), &ups, tls);
        assert!(text.contains("server 127.0.0.1:1 max_fails=1"), "{text}");
        std::fs::write(&site, &text).unwrap();
        let conf = dir.path().join(format!("nginx-{name}.conf"));
        std::fs::write(&conf, nginx_main_conf(dir.path(), &site)).unwrap();
        let (ok, out) = nginx_test(&conf, dir.path());
        assert!(ok, "nginx -t ({name}) failed:\n{out}\n{text}");
    }
    // nginx -t can fail: a directive nginx does not know is refused.
    let bad = dir.path().join("site-bad.conf");
    let text = render_nginx_site(&tpl, &format!("127.0.0.1:{port}"), &ups, None).replace(
        "grpc_next_upstream error",
        "grpc_next_upstream unavailable error",
    );
    std::fs::write(&bad, text).unwrap();
    let conf = dir.path().join("nginx-bad.conf");
    std::fs::write(&conf, nginx_main_conf(dir.path(), &bad)).unwrap();
    let (ok, out) = nginx_test(&conf, dir.path());
    assert!(!ok && out.contains("unavailable"), "{out}");
}
