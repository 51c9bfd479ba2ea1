//! When each chunk leaves the proxy: the pure part of the simulator.
//!
//! A [`LinkSchedule`] belongs to one direction of one connection. Given a
//! chunk's arrival time and size and the link's current conditions it returns
//! the delivery time. Times are offsets from the link's start, not clock
//! readings, so the schedule is a deterministic function of the seed and its
//! inputs and can be tested without a clock.
//!
//! Per chunk, in this order:
//! 1. the token bucket releases it once its bytes are paid for (bandwidth);
//! 2. it travels for `latency` ± jitter (never less than zero);
//! 3. with probability `loss` it is stalled by `rto` (a retransmission);
//! 4. it is never delivered before the chunk ahead of it (TCP order, so a
//!    stall holds up everything behind it — head-of-line blocking).
//!
//! Every chunk consumes exactly four draws from the RNG whatever the
//! conditions, so the k-th chunk sees the same draws under any profile.

use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::config::{Direction, Jitter, LinkConfig};

/// What happens to one chunk.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkPlan {
    /// When the chunk reaches the other side (offset from the link's start).
    pub deliver_at: Duration,
    /// This chunk was "lost" and waited for a retransmission.
    pub stalled: bool,
    /// Instead of delivering the chunk, reset the connection.
    pub reset: bool,
}

/// A token bucket in virtual time. It may go into debt: a chunk larger than
/// the tokens available is released when the debt is paid off, so chunk
/// size does not matter for throughput.
#[derive(Debug, Clone)]
struct TokenBucket {
    tokens: f64,
    at: Duration,
}

impl TokenBucket {
    /// Returns when `len` bytes arriving at `t` have passed the bucket.
    fn admit(&mut self, link: &LinkConfig, t: Duration, len: usize) -> Duration {
        let t = t.max(self.at);
        let Some(rate) = link.bytes_per_sec() else {
            self.tokens = f64::MAX;
            self.at = t;
            return t;
        };
        let burst = link.burst_bytes as f64;
        let refill = (t - self.at).as_secs_f64() * rate;
        self.tokens = (self.tokens + refill).min(burst);
        self.at = t;
        self.tokens -= len as f64;
        if self.tokens >= 0.0 {
            t
        } else {
            t + Duration::from_secs_f64(-self.tokens / rate)
        }
    }
}

/// The schedule of one direction of one connection.
#[derive(Debug, Clone)]
pub struct LinkSchedule {
    rng: ChaCha8Rng,
    bucket: TokenBucket,
    last_delivery: Duration,
}

impl LinkSchedule {
    /// A fresh schedule; the same seed gives the same draws.
    pub fn new(seed: u64) -> Self {
        LinkSchedule {
            rng: ChaCha8Rng::seed_from_u64(seed),
            bucket: TokenBucket {
                tokens: f64::MAX,
                at: Duration::ZERO,
            },
            last_delivery: Duration::ZERO,
        }
    }

    /// Plans a chunk of `len` bytes arriving at `arrival` (offsets from the
    /// link's start; arrivals must not go backwards). A zero-length chunk
    /// stands for a FIN: it is delayed like data but uses no bandwidth.
    pub fn plan(&mut self, link: &LinkConfig, arrival: Duration, len: usize) -> ChunkPlan {
        let (u1, u2, u_loss, u_reset): (f64, f64, f64, f64) = (
            self.rng.gen(),
            self.rng.gen(),
            self.rng.gen(),
            self.rng.gen(),
        );
        let sent = self.bucket.admit(link, arrival, len);
        let base = link.latency.as_secs_f64();
        let jitter = match link.jitter {
            Jitter::None => 0.0,
            Jitter::Uniform { max } => (2.0 * u1 - 1.0) * max.as_secs_f64(),
            Jitter::Normal { std_dev } => {
                // Box–Muller; 1 - u1 is in (0, 1], so the log is finite.
                let z = (-2.0 * (1.0 - u1).ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                z * std_dev.as_secs_f64()
            }
        };
        let mut delay = Duration::from_secs_f64((base + jitter).max(0.0));
        let stalled = u_loss < link.loss;
        if stalled {
            delay += link.rto;
        }
        let deliver_at = (sent + delay).max(self.last_delivery);
        self.last_delivery = deliver_at;
        ChunkPlan {
            deliver_at,
            stalled,
            reset: u_reset < link.reset_prob,
        }
    }

    /// Records that a chunk held back by an outage was delivered at `at`,
    /// so later chunks stay behind it.
    pub fn delivered_late(&mut self, at: Duration) {
        self.last_delivery = self.last_delivery.max(at);
    }
}

/// The seed of one direction of one connection, derived from the proxy's
/// seed and the connection's index (0 for the first accepted connection).
pub fn link_seed(seed: u64, connection: u64, dir: Direction) -> u64 {
    let d = match dir {
        Direction::Up => 0x5555_5555_5555_5555,
        Direction::Down => 0xAAAA_AAAA_AAAA_AAAA,
    };
    splitmix64(splitmix64(seed ^ d).wrapping_add(connection))
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(x: u64) -> Duration {
        Duration::from_millis(x)
    }

    fn delays(seed: u64, link: &LinkConfig, n: usize) -> Vec<Duration> {
        let mut s = LinkSchedule::new(seed);
        // Arrivals 1 s apart so that ordering never binds.
        (0..n)
            .map(|i| {
                let t = Duration::from_secs(i as u64);
                s.plan(link, t, 100).deliver_at - t
            })
            .collect()
    }

    #[test]
    fn same_seed_same_delays_other_seed_other_delays() {
        let link = LinkConfig {
            latency: ms(50),
            jitter: Jitter::Normal { std_dev: ms(10) },
            loss: 0.1,
            ..LinkConfig::default()
        };
        let a = delays(7, &link, 200);
        assert_eq!(a, delays(7, &link, 200));
        assert_ne!(a, delays(8, &link, 200));
        // The draws vary: not all delays are equal.
        assert!(a.iter().any(|d| *d != a[0]));
    }

    #[test]
    fn uniform_jitter_stays_in_range_and_spreads() {
        let link = LinkConfig {
            latency: ms(50),
            jitter: Jitter::Uniform { max: ms(20) },
            ..LinkConfig::default()
        };
        let d = delays(1, &link, 2000);
        assert!(d.iter().all(|d| *d >= ms(30) && *d <= ms(70)));
        let mean = d.iter().map(|d| d.as_secs_f64()).sum::<f64>() / d.len() as f64;
        assert!((mean - 0.050).abs() < 0.002, "mean {mean}");
        assert!(d.iter().any(|d| *d < ms(35)) && d.iter().any(|d| *d > ms(65)));
    }

    #[test]
    fn normal_jitter_has_the_configured_spread_and_never_goes_negative() {
        let link = LinkConfig {
            latency: ms(100),
            jitter: Jitter::Normal { std_dev: ms(10) },
            ..LinkConfig::default()
        };
        let d: Vec<f64> = delays(3, &link, 5000)
            .iter()
            .map(|d| d.as_secs_f64())
            .collect();
        let mean = d.iter().sum::<f64>() / d.len() as f64;
        let var = d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / d.len() as f64;
        assert!((mean - 0.100).abs() < 0.001, "mean {mean}");
        assert!((var.sqrt() - 0.010).abs() < 0.001, "sd {}", var.sqrt());
        let wide = LinkConfig {
            latency: ms(1),
            jitter: Jitter::Normal { std_dev: ms(50) },
            ..LinkConfig::default()
        };
        assert!(delays(3, &wide, 1000).iter().any(|d| d.is_zero()));
    }

    #[test]
    fn loss_stalls_the_expected_fraction_by_rto() {
        let link = LinkConfig {
            latency: ms(10),
            loss: 0.2,
            rto: ms(300),
            ..LinkConfig::default()
        };
        let d = delays(11, &link, 5000);
        let stalled = d.iter().filter(|d| **d == ms(310)).count();
        assert!(d.iter().all(|d| *d == ms(10) || *d == ms(310)));
        let frac = stalled as f64 / d.len() as f64;
        assert!((frac - 0.2).abs() < 0.02, "fraction {frac}");
    }

    #[test]
    fn order_is_preserved_and_a_stall_blocks_what_follows() {
        let link = LinkConfig {
            latency: ms(10),
            jitter: Jitter::Uniform { max: ms(9) },
            loss: 0.05,
            rto: ms(200),
            ..LinkConfig::default()
        };
        let mut s = LinkSchedule::new(5);
        let mut prev = Duration::ZERO;
        let mut saw_blocked = false;
        for i in 0..2000u64 {
            let t = ms(i); // 1 ms apart: jitter and stalls overlap later chunks
            let p = s.plan(&link, t, 10);
            assert!(p.deliver_at >= prev);
            assert!(p.deliver_at >= t + ms(1));
            if !p.stalled && p.deliver_at > t + ms(19) {
                saw_blocked = true;
            }
            prev = p.deliver_at;
        }
        assert!(saw_blocked, "no chunk was held up by a stall ahead of it");
    }

    #[test]
    fn token_bucket_paces_to_the_rate_after_the_burst() {
        let link = LinkConfig {
            bandwidth_bps: Some(8_000_000), // 1 MB/s
            burst_bytes: 10_000,
            ..LinkConfig::default()
        };
        let mut s = LinkSchedule::new(0);
        // 1 MB arriving at once in 1000-byte chunks leaves over ~0.99 s.
        let mut last = Duration::ZERO;
        for _ in 0..1000 {
            last = s.plan(&link, Duration::ZERO, 1000).deliver_at;
        }
        let secs = last.as_secs_f64();
        assert!((secs - 0.990).abs() < 1e-6, "{secs}");
        // After 1 s idle the bucket is full again (but no fuller than burst).
        let t = Duration::from_secs(2);
        assert_eq!(s.plan(&link, t, 10_000).deliver_at, t);
        assert_eq!(
            s.plan(&link, t, 1000).deliver_at,
            t + Duration::from_millis(1)
        );
    }

    #[test]
    fn fin_uses_latency_not_bandwidth() {
        let link = LinkConfig {
            latency: ms(40),
            bandwidth_bps: Some(8_000),
            burst_bytes: 0,
            ..LinkConfig::default()
        };
        let mut s = LinkSchedule::new(0);
        assert_eq!(s.plan(&link, ms(0), 0).deliver_at, ms(40));
        // 1000 bytes at 1000 B/s: 1 s of serialisation, then latency.
        assert_eq!(s.plan(&link, ms(0), 1000).deliver_at, ms(1040));
    }

    #[test]
    fn reset_draws_follow_the_probability() {
        let link = LinkConfig {
            reset_prob: 0.5,
            ..LinkConfig::default()
        };
        let mut s = LinkSchedule::new(9);
        let n = (0..1000).filter(|i| s.plan(&link, ms(*i), 1).reset).count();
        assert!((400..600).contains(&n), "{n}");
        let mut s = LinkSchedule::new(9);
        assert!(!(0..1000).any(|i| s.plan(&LinkConfig::default(), ms(i), 1).reset));
    }

    #[test]
    fn link_seeds_differ_by_connection_and_direction() {
        let a = link_seed(1, 0, Direction::Up);
        assert_eq!(a, link_seed(1, 0, Direction::Up));
        assert_ne!(a, link_seed(1, 0, Direction::Down));
        assert_ne!(a, link_seed(1, 1, Direction::Up));
        assert_ne!(a, link_seed(2, 0, Direction::Up));
    }
}
