//! What the proxy does to the bytes crossing it: per-direction link
//! conditions ([`LinkConfig`]), the pair of them ([`NetConfig`]) and the
//! named profiles ([`PROFILES`]; sources in `docs/network-profiles.md`).

use std::time::Duration;

use crate::error::NetsimError;

/// Random variation of a link's one-way latency, drawn once per chunk from
/// the link's seeded RNG. The total delay of a chunk is never negative.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Jitter {
    /// Every chunk gets exactly the configured latency.
    #[default]
    None,
    /// Uniform in `[-max, +max]` around the latency.
    Uniform {
        /// Half-width of the interval.
        max: Duration,
    },
    /// Normal with mean 0 and this standard deviation.
    Normal {
        /// Standard deviation.
        std_dev: Duration,
    },
}

/// Conditions of one direction of a link.
///
/// Every field is applied per chunk: a chunk is whatever one `read` on the
/// sending socket returned (at most 16 KiB; smaller on slow links so that the
/// bandwidth limit is smooth).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkConfig {
    /// One-way propagation delay (half the round-trip time).
    pub latency: Duration,
    /// Variation around `latency`.
    pub jitter: Jitter,
    /// Bandwidth limit in bits per second (10^6 bit/s = 1 Mbps); `None` is
    /// unlimited. Enforced by a token bucket of depth `burst_bytes`.
    pub bandwidth_bps: Option<u64>,
    /// Token-bucket depth: how many bytes may pass at once after the link
    /// was idle. 0 makes the limit a pure serialisation delay.
    pub burst_bytes: u64,
    /// Probability that a chunk is "lost" and retransmitted: it (and,
    /// because TCP delivers in order, everything behind it) is stalled by
    /// `rto`.
    pub loss: f64,
    /// Stall of a lost chunk (a retransmission timeout).
    pub rto: Duration,
    /// Outage: the proxy keeps accepting connections and reading, but
    /// forwards nothing until the link is back; nothing is closed. Held
    /// data is then delivered, as TCP retransmission would.
    pub blackhole: bool,
    /// Probability, per chunk, that the connection is reset (RST to both
    /// ends) instead of delivering the chunk.
    pub reset_prob: f64,
    /// Slow close: extra delay before a FIN is passed on, after all data
    /// before it has been delivered.
    pub close_delay: Duration,
}

/// Default token-bucket depth: one Ethernet frame.
pub const DEFAULT_BURST_BYTES: u64 = 1500;

/// Default retransmission stall: Linux's minimum RTO.
pub const DEFAULT_RTO: Duration = Duration::from_millis(200);

impl Default for LinkConfig {
    /// A perfect link: no delay, no limit, no faults.
    fn default() -> Self {
        LinkConfig {
            latency: Duration::ZERO,
            jitter: Jitter::None,
            bandwidth_bps: None,
            burst_bytes: DEFAULT_BURST_BYTES,
            loss: 0.0,
            rto: DEFAULT_RTO,
            blackhole: false,
            reset_prob: 0.0,
            close_delay: Duration::ZERO,
        }
    }
}

impl LinkConfig {
    /// A link with this one-way latency and bandwidth (Mbps), no faults.
    /// The retransmission stall is Linux's minimum RTO plus one round trip.
    pub fn new(latency: Duration, mbps: f64) -> Self {
        LinkConfig {
            latency,
            bandwidth_bps: Some((mbps * 1e6).round() as u64),
            rto: DEFAULT_RTO + latency * 2,
            ..LinkConfig::default()
        }
    }

    /// Bytes per second of the bandwidth limit, if any.
    pub fn bytes_per_sec(&self) -> Option<f64> {
        self.bandwidth_bps.map(|b| b as f64 / 8.0)
    }

    fn validate(&self, which: &str) -> Result<(), NetsimError> {
        let prob = |name: &str, p: f64| {
            if (0.0..=1.0).contains(&p) {
                Ok(())
            } else {
                Err(NetsimError::InvalidConfig(format!(
                    "{which}: {name} must be a probability in [0, 1], got {p}"
                )))
            }
        };
        prob("loss", self.loss)?;
        prob("reset probability", self.reset_prob)?;
        if self.bandwidth_bps == Some(0) {
            return Err(NetsimError::InvalidConfig(format!(
                "{which}: bandwidth must be positive (omit it for unlimited)"
            )));
        }
        Ok(())
    }
}

/// Conditions of both directions, seen from the proxy's client (the
/// device): `up` is client→upstream, `down` is upstream→client — the same
/// convention as the shard planner's `NetworkProfile`.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConfig {
    /// Profile name, for logs (`fast-4g`, `offline`, `custom`).
    pub name: String,
    /// Client → upstream.
    pub up: LinkConfig,
    /// Upstream → client.
    pub down: LinkConfig,
}

/// A named link condition. The numbers are identical to the shard planner's
/// table (`tandem_shard::NETWORK_PROFILES`); a test in the CLI crate checks it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NamedProfile {
    /// Name used on the command line and in timelines.
    pub name: &'static str,
    /// Round-trip time in milliseconds; each direction gets half.
    pub rtt_ms: f64,
    /// Upstream→client bandwidth, Mbps.
    pub down_mbps: f64,
    /// Client→upstream bandwidth, Mbps.
    pub up_mbps: f64,
    /// Where the numbers come from.
    pub source: &'static str,
}

/// The named profiles, best link first. `offline` (a blackhole both ways) is
/// accepted wherever a name is, but is not a row here.
pub const PROFILES: &[NamedProfile] = &[
    NamedProfile {
        name: "loopback",
        rtt_ms: 0.05,
        down_mbps: 10_000.0,
        up_mbps: 10_000.0,
        source: "order of magnitude of Linux loopback TCP (assumption, not a preset)",
    },
    NamedProfile {
        name: "lan",
        rtt_ms: 0.5,
        down_mbps: 1_000.0,
        up_mbps: 1_000.0,
        source: "switched gigabit Ethernet (assumption, not a preset)",
    },
    NamedProfile {
        name: "wifi",
        rtt_ms: 5.0,
        down_mbps: 100.0,
        up_mbps: 50.0,
        source: "typical home Wi-Fi 5 link to a nearby server (assumption, not a preset)",
    },
    NamedProfile {
        name: "fast-4g",
        rtt_ms: 165.0,
        down_mbps: 8.1,
        up_mbps: 1.35,
        source: "Chrome DevTools 'Fast 4G': 60 ms x 2.75, 9 Mbps x 0.9, 1.5 Mbps x 0.9",
    },
    NamedProfile {
        name: "slow-4g",
        rtt_ms: 562.5,
        down_mbps: 1.44,
        up_mbps: 0.675,
        source: "Chrome DevTools 'Slow 4G': 150 ms x 3.75, 1.6 Mbps x 0.9, 750 kbps x 0.9",
    },
    NamedProfile {
        name: "3g",
        rtt_ms: 2_000.0,
        down_mbps: 0.4,
        up_mbps: 0.4,
        source: "Chrome DevTools 'Slow 3G': 400 ms x 5, 500 kbps x 0.8 each way",
    },
    NamedProfile {
        name: "satellite",
        rtt_ms: 600.0,
        down_mbps: 25.0,
        up_mbps: 3.0,
        source: "geostationary consumer satellite: ~600 ms RTT, 25/3 Mbps tier (assumption)",
    },
];

/// The name of the blackhole profile.
pub const OFFLINE: &str = "offline";

impl NamedProfile {
    /// Looks a profile up by name (case-insensitive).
    pub fn by_name(name: &str) -> Option<&'static NamedProfile> {
        PROFILES.iter().find(|p| p.name.eq_ignore_ascii_case(name))
    }

    /// The link conditions of this profile: half the RTT each way, the
    /// bandwidths, no jitter, loss or resets.
    pub fn config(&self) -> NetConfig {
        let one_way = Duration::from_secs_f64(self.rtt_ms / 2.0 / 1000.0);
        NetConfig {
            name: self.name.to_string(),
            up: LinkConfig::new(one_way, self.up_mbps),
            down: LinkConfig::new(one_way, self.down_mbps),
        }
    }
}

/// All names accepted by [`NetConfig::profile`], for help and errors.
pub fn profile_names() -> Vec<&'static str> {
    let mut v: Vec<_> = PROFILES.iter().map(|p| p.name).collect();
    v.push(OFFLINE);
    v
}

impl Default for NetConfig {
    /// No impairment at all.
    fn default() -> Self {
        NetConfig::perfect()
    }
}

impl NetConfig {
    /// No impairment at all (named `perfect`).
    pub fn perfect() -> Self {
        NetConfig::symmetric("perfect", LinkConfig::default())
    }

    /// The same conditions both ways.
    pub fn symmetric(name: &str, link: LinkConfig) -> Self {
        NetConfig {
            name: name.to_string(),
            up: link,
            down: link,
        }
    }

    /// A blackhole both ways (`offline`).
    pub fn offline() -> Self {
        NetConfig::symmetric(
            OFFLINE,
            LinkConfig {
                blackhole: true,
                ..LinkConfig::default()
            },
        )
    }

    /// A named profile: one of [`PROFILES`] or `offline`.
    pub fn profile(name: &str) -> Result<Self, NetsimError> {
        if name.eq_ignore_ascii_case(OFFLINE) {
            return Ok(NetConfig::offline());
        }
        NamedProfile::by_name(name)
            .map(NamedProfile::config)
            .ok_or_else(|| NetsimError::UnknownProfile {
                name: name.to_string(),
                known: profile_names().join(", "),
            })
    }

    /// Applies `f` to both directions.
    pub fn map_links(mut self, mut f: impl FnMut(&mut LinkConfig)) -> Self {
        f(&mut self.up);
        f(&mut self.down);
        self
    }

    /// The same jitter on both directions.
    pub fn with_jitter(self, jitter: Jitter) -> Self {
        self.map_links(|l| l.jitter = jitter)
    }

    /// The same loss probability on both directions.
    pub fn with_loss(self, loss: f64) -> Self {
        self.map_links(|l| l.loss = loss)
    }

    /// Checks probabilities and bandwidths.
    pub fn validate(&self) -> Result<(), NetsimError> {
        self.up.validate("up")?;
        self.down.validate("down")
    }

    /// One direction's conditions.
    pub fn link(&self, dir: Direction) -> &LinkConfig {
        match dir {
            Direction::Up => &self.up,
            Direction::Down => &self.down,
        }
    }
}

/// One direction through the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Client → upstream (device → server).
    Up,
    /// Upstream → client (server → device).
    Down,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_resolve_case_insensitively_and_split_rtt() {
        let p = NetConfig::profile("FAST-4G").unwrap();
        assert_eq!(p.name, "fast-4g");
        assert_eq!(p.up.latency, Duration::from_micros(82_500));
        assert_eq!(p.down.latency, Duration::from_micros(82_500));
        assert_eq!(p.down.bandwidth_bps, Some(8_100_000));
        assert_eq!(p.up.bandwidth_bps, Some(1_350_000));
        assert!(!p.up.blackhole);
        assert!(NetConfig::profile("offline").unwrap().down.blackhole);
        let e = NetConfig::profile("5g").unwrap_err().to_string();
        assert!(e.contains("5g") && e.contains("slow-4g"), "{e}");
    }

    #[test]
    fn names_are_unique_and_numbers_positive() {
        let mut names = profile_names();
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n);
        for p in PROFILES {
            assert!(p.rtt_ms > 0.0 && p.up_mbps > 0.0 && p.down_mbps > 0.0);
            p.config().validate().unwrap();
        }
    }

    #[test]
    fn validate_rejects_bad_probabilities() {
        assert!(NetConfig::perfect().with_loss(1.5).validate().is_err());
        assert!(NetConfig::perfect().with_loss(f64::NAN).validate().is_err());
        let zero_bw = NetConfig::perfect().map_links(|l| l.bandwidth_bps = Some(0));
        assert!(zero_bw.validate().is_err());
        assert!(NetConfig::perfect().with_loss(0.3).validate().is_ok());
    }
}
