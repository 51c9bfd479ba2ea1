//! `tandem serve-edge --policy F --admin-token-env V`: a `PUT
//! /admin/v1/policy` is durable. The test kills the real binary (SIGKILL) at
//! varied points of a PUT, in a loop, restarts it and checks that:
//!
//! * the policy file always holds one of the two complete versions, never a
//!   truncated (possibly weaker) one;
//! * the restarted server serves exactly what the file holds;
//! * a PUT that was acknowledged (200) survived the kill;
//! * no temporary file of a killed write is left after the restart.
//!
//! Kill points vary by round: after a delay from the PUT's start (0 to 81
//! ms), as soon as the write's temporary file appears (mid-write: between
//! its creation and the rename, or just after), or after the answer. Both
//! versions carry ~1 MB of comment so that the write (and its fsync) takes a
//! while. Where exactly a kill lands is not asserted (each outcome is checked
//! against the invariant; the counts are printed).
#![allow(clippy::unwrap_used)]

mod common;

use common::{first_stdout_line, tandem};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

const ADMIN: &str = "serve-edge-admin-0123456789";

/// The built-in policy, or it plus a rule keeping ticket numbers local;
/// padded with a comment to `pad` bytes.
fn version(with_tickets: bool, pad: usize) -> String {
    let mut s = tandem_router::DEFAULT_POLICY_TOML.to_string();
    if with_tickets {
        s.push_str(
            "\n[[recognizers]]\nname = \"TICKET\"\npattern = 'TCK-[0-9]{5}'\nscore = 0.9\n\n\
             [[rules]]\nname = \"tickets\"\naction = \"local\"\nentities = [\"TICKET\"]\n",
        );
    }
    let line = "# padding so that the write takes a while ....................................\n";
    while s.len() < pad {
        s.push_str(line);
    }
    s
}

struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(policy: &Path) -> Server {
    let mut child = tandem()
        .args(["serve-edge", "--listen", "127.0.0.1:0", "--policy"])
        .arg(policy)
        .args(["--admin-token-env", "TANDEM_TEST_ADMIN"])
        .env("TANDEM_TEST_ADMIN", ADMIN)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let line = first_stdout_line(&mut child);
    let addr = line
        .strip_prefix("serving http://")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    Server { child, addr }
}

/// One admin request; (status, body), or `None` when the server died first.
fn admin(addr: &str, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    let req = format!(
        "{method} /admin{path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Authorization: Bearer {ADMIN}\r\nContent-Type: application/toml\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, rest) = raw.split_once("\r\n\r\n")?;
    Some((head.split(' ').nth(1)?.parse().ok()?, rest.to_string()))
}

fn temp_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tandem-tmp"))
        .collect()
}

#[test]
fn a_policy_put_killed_at_any_point_leaves_one_complete_version_serving() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.toml");
    let (a, b) = (version(false, 1 << 20), version(true, 1 << 20));
    std::fs::write(&file, &a).unwrap();
    let mut server = start(&file);
    let (mut acked, mut lost, mut mid_write) = (0, 0, 0);
    for round in 0..12u64 {
        let current = std::fs::read_to_string(&file).unwrap();
        let next = if current == a { b.clone() } else { a.clone() };
        let addr = server.addr.clone();
        let body = next.clone();
        let put = std::thread::spawn(move || admin(&addr, "PUT", "/v1/policy", &body));
        match round % 3 {
            0 => std::thread::sleep(Duration::from_millis(round * round)),
            1 => {
                while !put.is_finished() && temp_files(dir.path()).is_empty() {
                    std::thread::yield_now();
                }
                if !put.is_finished() {
                    mid_write += 1;
                }
            }
            _ => {
                while !put.is_finished() {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        server.child.kill().unwrap();
        server.child.wait().unwrap();
        let answer = put.join().unwrap();

        let on_disk = std::fs::read_to_string(&file).unwrap();
        assert!(
            on_disk == a || on_disk == b,
            "round {round}: the policy file holds {} bytes, neither version",
            on_disk.len()
        );
        if let Some((status, body)) = &answer {
            assert_eq!(*status, 200, "round {round}: {body}");
            assert_eq!(on_disk, next, "round {round}: an acknowledged PUT was lost");
            acked += 1;
        } else if on_disk != next {
            lost += 1;
        }

        server = start(&file);
        let (status, body) = admin(&server.addr, "GET", "/v1/policy", "").unwrap();
        assert_eq!(status, 200, "{body}");
        let served: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            served["source"].as_str(),
            Some(on_disk.as_str()),
            "round {round}: the restarted server does not serve the file"
        );
        assert_eq!(
            temp_files(dir.path()),
            Vec::<String>::new(),
            "round {round}"
        );
    }
    eprintln!(
        "12 killed PUTs: {mid_write} killed once the temporary file existed, {acked} acknowledged \
         and kept, {lost} unacknowledged and not applied, the rest applied but not acknowledged"
    );
}
