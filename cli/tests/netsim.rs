//! `tandem netsim` as a user runs it: the built binary in front of an echo
//! server on 127.0.0.1; plus the check that the simulator's profile table
//! and the shard planner's are the same numbers.

#![allow(clippy::unwrap_used)] // test helpers; a panic is a test failure

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn tandem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
}

/// A blocking echo server on a free loopback port.
fn echo_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 || s.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// Kills the child when the test ends, pass or fail.
struct Running(Child);
impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `tandem netsim` and returns it with the address it printed.
fn start(args: &[&str]) -> (Running, SocketAddr) {
    let child = tandem()
        .arg("netsim")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut running = Running(child);
    let stdout = running.0.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap();
    (running, addr)
}

fn roundtrip(s: &mut TcpStream, msg: &[u8]) -> Duration {
    let t = Instant::now();
    s.write_all(msg).unwrap();
    let mut back = vec![0u8; msg.len()];
    s.read_exact(&mut back).unwrap();
    assert_eq!(back, msg);
    t.elapsed()
}

#[test]
fn proxies_an_echo_server_with_the_profiles_latency() {
    let echo = echo_server();
    let (_proxy, addr) = start(&[
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        &echo.to_string(),
        "--profile",
        "fast-4g",
        "--seed",
        "3",
    ]);
    assert!(addr.ip().is_loopback() && addr.port() != 0);
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for msg in [&b"hello"[..], &[0u8, 255, 10, 13][..], &[7u8; 3000][..]] {
        let rtt = roundtrip(&mut s, msg);
        // fast-4g: 165 ms RTT, never less.
        assert!(rtt >= Duration::from_millis(165), "{rtt:?}");
        assert!(rtt < Duration::from_secs(3), "{rtt:?}");
    }
}

#[test]
fn timeline_outage_holds_data_until_the_link_returns() {
    let echo = echo_server();
    let (_proxy, addr) = start(&[
        "--upstream",
        &echo.to_string(),
        "--timeline",
        "loopback 1s, offline 1s, lan",
        "--jitter-ms",
        "0.2",
        "--loss",
        "0.01",
    ]);
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let started = Instant::now();
    let fast = roundtrip(&mut s, b"up");
    assert!(fast < Duration::from_millis(900), "{fast:?}");
    // Wait into the outage, then send: the echo comes back only after it.
    std::thread::sleep(Duration::from_millis(1200).saturating_sub(started.elapsed()));
    roundtrip(&mut s, b"held");
    let back = started.elapsed();
    assert!(back >= Duration::from_secs(2), "came back at {back:?}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let echo = echo_server().to_string();
    let cases: &[(&[&str], &str)] = &[
        (
            &["--upstream", &echo, "--profile", "5g"],
            "unknown network profile `5g`",
        ),
        (
            &["--upstream", &echo, "--timeline", "wifi 5s"],
            "lasts forever",
        ),
        (
            &["--upstream", &echo, "--profile", "lan", "--loss", "1.5"],
            "probability",
        ),
        (&["--upstream", &echo], "required"),
        (&["--profile", "lan"], "--upstream"),
        (
            &["--upstream", "no-such-host.invalid:1", "--profile", "lan"],
            "cannot resolve",
        ),
    ];
    for (args, want) in cases {
        let out = tandem().arg("netsim").args(*args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(want),
            "{args:?}: stderr {err:?} lacks {want:?}"
        );
    }
}

#[test]
fn list_prints_every_profile_with_the_planners_numbers() {
    let out = tandem().args(["netsim", "--list"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for p in tandem_shard::NETWORK_PROFILES {
        let row = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(p.name))
            .unwrap_or_else(|| panic!("{} missing from:\n{text}", p.name));
        let nums: Vec<f64> = row
            .split_whitespace()
            .skip(1)
            .take(3)
            .map(|x| x.parse().unwrap())
            .collect();
        assert_eq!(nums, [p.rtt_ms, p.down_mbps, p.up_mbps], "{row}");
    }
    assert!(text.lines().any(|l| l.starts_with("offline")));
}

#[test]
fn profile_tables_of_simulator_and_planner_agree() {
    let sim = tandem_netsim::PROFILES;
    let plan = tandem_shard::NETWORK_PROFILES;
    assert_eq!(sim.len(), plan.len());
    for (s, p) in sim.iter().zip(plan) {
        assert_eq!(
            (s.name, s.rtt_ms, s.down_mbps, s.up_mbps),
            (p.name, p.rtt_ms, p.down_mbps, p.up_mbps)
        );
        // And the simulator's links are built from those numbers.
        let c = tandem_netsim::NetConfig::profile(p.name).unwrap();
        let rtt = (c.up.latency + c.down.latency).as_secs_f64() * 1000.0;
        assert!((rtt - p.rtt_ms).abs() < 1e-6, "{}: {rtt}", p.name);
        assert_eq!(c.up.bandwidth_bps, Some((p.up_mbps * 1e6).round() as u64));
        assert_eq!(
            c.down.bandwidth_bps,
            Some((p.down_mbps * 1e6).round() as u64)
        );
    }
}
