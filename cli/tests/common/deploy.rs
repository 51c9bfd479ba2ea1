//! The shipped deploy/ files as tests use them: the nginx site rendered for a
//! test (loopback replicas, a temp prefix), a real nginx child, and the metric
//! names the Grafana dashboard reads.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The repository's deploy/ directory.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("deploy")
}

pub fn read_deploy(rel: &str) -> String {
    let p = deploy_dir().join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Every `tandem_verifier_*` metric the Grafana dashboard
/// (deploy/grafana/tandem-verifier.json) queries, with histogram series
/// (`_bucket`, `_sum`, `_count`) folded to the histogram's name: the names to
/// find in a verifier's `/metrics` (`# TYPE <name> ...`).
pub fn grafana_metric_names() -> BTreeSet<String> {
    let j: serde_json::Value =
        serde_json::from_str(&read_deploy("grafana/tandem-verifier.json")).unwrap();
    let mut exprs = Vec::new();
    collect_exprs(&j, &mut exprs);
    assert!(!exprs.is_empty(), "the dashboard has no query");
    let mut names = BTreeSet::new();
    for e in exprs {
        let mut rest = e.as_str();
        while let Some(i) = rest.find("tandem_verifier_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            let name = &tail[..end];
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            names.insert(base.to_string());
            rest = &tail[end..];
        }
    }
    names
}

/// The `expr` of every query target anywhere in a dashboard (panels, rows).
pub fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            if let (Some(serde_json::Value::String(e)), Some(_)) = (m.get("expr"), m.get("refId")) {
                out.push(e.clone());
            }
            for x in m.values() {
                collect_exprs(x, out);
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_exprs(x, out)),
        _ => {}
    }
}

/// The metric names a Prometheus text exposition declares (`# TYPE name kind`).
pub fn exposed_metric_names(metrics_text: &str) -> BTreeSet<String> {
    metrics_text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// TLS files for the TLS rendering of the nginx site (`nginx -t` only).
pub struct SiteTls<'a> {
    pub cert: &'a Path,
    pub key: &'a Path,
    pub upstream_ca: &'a Path,
}

/// deploy/nginx/tandem-verifier.conf with its marked EDIT places filled in:
/// the upstream `server` lines become `upstreams` (keeping the template's
/// parameters, e.g. `max_fails`), the first `listen` becomes `listen` (others
/// dropped). With `tls`, the certificate paths are replaced; without it the
/// device side and the replica side are plain text (loopback tests: the
/// verifier serves plain text only on loopback): `ssl` listen parameter,
/// `ssl_*` and `grpc_ssl_*` lines dropped, `grpcs://` → `grpc://`. Panics when
/// the template no longer has what is replaced, so a changed template is
/// noticed here.
pub fn render_nginx_site(
    template: &str,
    listen: &str,
    upstreams: &[String],
    tls: Option<&SiteTls>,
) -> String {
    let mut out = String::new();
    let (mut in_upstream, mut servers_done, mut listen_done) = (false, false, false);
    let (mut saw_server, mut saw_grpcs) = (false, false);
    for line in template.lines() {
        let t = line.trim_start();
        if t.starts_with("upstream tandem_verifier") {
            in_upstream = true;
        } else if in_upstream && t.starts_with('}') {
            in_upstream = false;
        }
        if in_upstream && t.starts_with("server ") {
            saw_server = true;
            if !servers_done {
                let params: Vec<&str> =
                    t.trim_end_matches(';').split_whitespace().skip(2).collect();
                for u in upstreams {
                    out.push_str(&format!("    server {u} {};\n", params.join(" ")));
                }
                servers_done = true;
            }
            continue;
        }
        if t.starts_with("listen ") {
            if !listen_done {
                let params = if tls.is_some() { "ssl http2" } else { "http2" };
                out.push_str(&format!("    listen {listen} {params};\n"));
                listen_done = true;
            }
            continue;
        }
        let directive = t.split_whitespace().next().unwrap_or("");
        match (tls, directive) {
            (None, d) if d.starts_with("ssl_") || d.starts_with("grpc_ssl_") => continue,
            (Some(f), "ssl_certificate") => {
                out.push_str(&format!("    ssl_certificate {};\n", f.cert.display()));
                continue;
            }
            (Some(f), "ssl_certificate_key") => {
                out.push_str(&format!("    ssl_certificate_key {};\n", f.key.display()));
                continue;
            }
            (Some(f), "grpc_ssl_trusted_certificate") => {
                out.push_str(&format!(
                    "        grpc_ssl_trusted_certificate {};\n",
                    f.upstream_ca.display()
                ));
                continue;
            }
            _ => {}
        }
        if t.starts_with("grpc_pass grpcs://") {
            saw_grpcs = true;
            if tls.is_none() {
                out.push_str(&line.replace("grpcs://", "grpc://"));
                out.push('\n');
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    assert!(saw_server, "no `server` line in the upstream block");
    assert!(listen_done, "no `listen` line");
    assert!(saw_grpcs, "no `grpc_pass grpcs://` line");
    out
}

/// The nginx binary (`nginx` on PATH, else Debian's /usr/sbin/nginx). Panics
/// with the install hint when there is none: these tests need a real nginx.
pub fn nginx_bin() -> PathBuf {
    for cand in ["nginx", "/usr/sbin/nginx"] {
        if Command::new(cand)
            .arg("-v")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
        {
            return PathBuf::from(cand);
        }
    }
    panic!("nginx not found: install it (apt-get install nginx-light; .ci/run does)");
}

/// A main nginx.conf for a test instance under `prefix` (pid, logs, temp
/// paths there; foreground, one process) that includes `site` in `http {}`.
/// The access log records, per request, the affinity key, the upstream(s)
/// tried and the statuses (`upstream=A, B` when nginx moved on to B).
pub fn nginx_main_conf(prefix: &Path, site: &Path) -> String {
    let p = prefix.display();
    format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {p}/nginx.pid;\n\
         error_log {p}/error.log info;\nevents {{ worker_connections 512; }}\nhttp {{\n\
         log_format tandem 'key=$http_x_tandem_session upstream=\"$upstream_addr\" \
         ustatus=\"$upstream_status\" status=$status grpc=$sent_trailer_grpc_status';\n\
         access_log {p}/access.log tandem;\n\
         client_body_temp_path {p}/client_body;\nproxy_temp_path {p}/proxy;\n\
         fastcgi_temp_path {p}/fastcgi;\nuwsgi_temp_path {p}/uwsgi;\nscgi_temp_path {p}/scgi;\n\
         include {};\n}}\n",
        site.display()
    )
}

/// `nginx -t` on `conf`: (success, nginx's output).
pub fn nginx_test(conf: &Path, prefix: &Path) -> (bool, String) {
    let out = Command::new(nginx_bin())
        .arg("-t")
        .arg("-p")
        .arg(prefix)
        .arg("-c")
        .arg(conf)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A running test nginx; killed on drop.
pub struct Nginx {
    pub child: Child,
    pub prefix: PathBuf,
    pub addr: String,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Nginx {
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.prefix.join("access.log")).unwrap_or_default()
    }
    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.prefix.join("error.log")).unwrap_or_default()
    }
}

/// Renders the shipped site for plain-text loopback `upstreams`, checks it with
/// `nginx -t`, starts nginx on `127.0.0.1:<free port>` under `prefix` and waits
/// until it accepts connections.
pub fn start_nginx(prefix: &Path, upstreams: &[String]) -> Nginx {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let site = prefix.join("tandem-verifier.conf");
    let tpl = read_deploy("nginx/tandem-verifier.conf");
    std::fs::write(&site, render_nginx_site(&tpl, &addr, upstreams, None)).unwrap();
    let conf = prefix.join("nginx.conf");
    std::fs::write(&conf, nginx_main_conf(prefix, &site)).unwrap();
    let (ok, text) = nginx_test(&conf, prefix);
    assert!(ok, "nginx -t failed:\n{text}");
    let child = Command::new(nginx_bin())
        .arg("-p")
        .arg(prefix)
        .arg("-c")
        .arg(&conf)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut n = Nginx {
        child,
        prefix: prefix.to_path_buf(),
        addr,
    };
    let start = Instant::now();
    while std::net::TcpStream::connect(&n.addr).is_err() {
        if let Some(st) = n.child.try_wait().unwrap() {
            panic!("nginx exited ({st}):\n{}", n.error_log());
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "nginx did not listen in 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    n
}
