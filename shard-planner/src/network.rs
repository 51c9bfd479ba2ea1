//! Named network profiles: the one table that the planner, the CLI sweep and
//! (later) the network simulator share. Sources are listed in
//! `docs/shard-planner.md`.

use serde::Serialize;

/// A named link condition, seen from the device (the client): `up` is
/// device→server, `down` is server→device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct NetworkProfile {
    /// Name used in configs and on the command line (`fast-4g`).
    pub name: &'static str,
    /// Round-trip time in milliseconds. One crossing costs half of it.
    pub rtt_ms: f64,
    /// Server→device bandwidth in megabits per second (10^6 bit/s).
    pub down_mbps: f64,
    /// Device→server bandwidth in megabits per second (10^6 bit/s).
    pub up_mbps: f64,
    /// Where the numbers come from.
    pub source: &'static str,
}

/// All named profiles, best link first.
pub const NETWORK_PROFILES: &[NetworkProfile] = &[
    NetworkProfile {
        name: "loopback",
        rtt_ms: 0.05,
        down_mbps: 10_000.0,
        up_mbps: 10_000.0,
        source: "order of magnitude of Linux loopback TCP (assumption, not a preset)",
    },
    NetworkProfile {
        name: "lan",
        rtt_ms: 0.5,
        down_mbps: 1_000.0,
        up_mbps: 1_000.0,
        source: "switched gigabit Ethernet (assumption, not a preset)",
    },
    NetworkProfile {
        name: "wifi",
        rtt_ms: 5.0,
        down_mbps: 100.0,
        up_mbps: 50.0,
        source: "typical home Wi-Fi 5 link to a nearby server (assumption, not a preset)",
    },
    NetworkProfile {
        name: "fast-4g",
        rtt_ms: 165.0,
        down_mbps: 8.1,
        up_mbps: 1.35,
        source: "Chrome DevTools / Puppeteer 'Fast 4G': 60 ms x 2.75, 9 Mbps x 0.9, 1.5 Mbps x 0.9",
    },
    NetworkProfile {
        name: "slow-4g",
        rtt_ms: 562.5,
        down_mbps: 1.44,
        up_mbps: 0.675,
        source: "Chrome DevTools / Puppeteer 'Slow 4G' (formerly 'Fast 3G'): 150 ms x 3.75, 1.6 Mbps x 0.9, 750 kbps x 0.9",
    },
    NetworkProfile {
        name: "3g",
        rtt_ms: 2_000.0,
        down_mbps: 0.4,
        up_mbps: 0.4,
        source: "Chrome DevTools / Puppeteer 'Slow 3G': 400 ms x 5, 500 kbps x 0.8 each way",
    },
    NetworkProfile {
        name: "satellite",
        rtt_ms: 600.0,
        down_mbps: 25.0,
        up_mbps: 3.0,
        source: "geostationary consumer satellite: ~600 ms RTT, 25/3 Mbps advertised tier (assumption)",
    },
];

impl NetworkProfile {
    /// Looks a profile up by name (case-insensitive).
    pub fn by_name(name: &str) -> Option<&'static NetworkProfile> {
        NETWORK_PROFILES
            .iter()
            .find(|p| p.name.eq_ignore_ascii_case(name))
    }

    /// The names of all profiles, for error messages and `--help`.
    pub fn names() -> Vec<&'static str> {
        NETWORK_PROFILES.iter().map(|p| p.name).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_found() {
        for p in NETWORK_PROFILES {
            assert_eq!(NetworkProfile::by_name(p.name), Some(p));
            assert!(p.rtt_ms > 0.0 && p.down_mbps > 0.0 && p.up_mbps > 0.0);
        }
        let mut names = NetworkProfile::names();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), NETWORK_PROFILES.len());
        assert_eq!(
            NetworkProfile::by_name("FAST-4G").map(|p| p.rtt_ms),
            Some(165.0)
        );
        assert!(NetworkProfile::by_name("5g").is_none());
    }
}
