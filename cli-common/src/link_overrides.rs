//! The netsim link-condition flags (`--jitter-ms`, `--loss`, ...) that
//! `tandem netsim` and `tandem bench soak` both take.

use std::time::Duration;
use tandem_netsim::{Jitter, NetConfig};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum JitterDist {
    #[default]
    /// Uniform in [-J, +J].
    Uniform,
    /// Normal with standard deviation J.
    Normal,
}

/// Link conditions set on every profile of a profile or timeline, both ways
/// (`tandem netsim`, `tandem bench soak`).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct LinkOverrides {
    /// Latency jitter in milliseconds, added to every profile, both ways.
    #[arg(long)]
    pub jitter_ms: Option<f64>,
    /// Distribution of the jitter.
    #[arg(long, value_enum, default_value = "uniform")]
    pub jitter_dist: JitterDist,
    /// Probability per chunk of a retransmission stall, both ways.
    #[arg(long)]
    pub loss: Option<f64>,
    /// Length of a retransmission stall in milliseconds (default: 200 ms +
    /// the profile's RTT).
    #[arg(long)]
    pub rto_ms: Option<f64>,
    /// Probability per chunk that the connection is reset, both ways.
    #[arg(long)]
    pub reset_prob: Option<f64>,
    /// Delay before a FIN is passed on, in milliseconds.
    #[arg(long)]
    pub close_delay_ms: Option<f64>,
}

fn millis(name: &str, ms: f64) -> anyhow::Result<Duration> {
    if !(ms.is_finite() && ms >= 0.0) {
        anyhow::bail!("--{name} must be a non-negative number of milliseconds, got {ms}");
    }
    Ok(Duration::from_secs_f64(ms / 1000.0))
}

impl LinkOverrides {
    /// The overrides as a function applied to every profile (a timeline's
    /// `map_conditions`); errors name the flag.
    pub fn apply(&self) -> anyhow::Result<impl Fn(NetConfig) -> NetConfig> {
        let args = self;
        let jitter = args
            .jitter_ms
            .map(|j| millis("jitter-ms", j))
            .transpose()?
            .map(|d| match args.jitter_dist {
                JitterDist::Uniform => Jitter::Uniform { max: d },
                JitterDist::Normal => Jitter::Normal { std_dev: d },
            });
        let rto = args.rto_ms.map(|r| millis("rto-ms", r)).transpose()?;
        let close = args
            .close_delay_ms
            .map(|c| millis("close-delay-ms", c))
            .transpose()?;
        let (loss, reset) = (args.loss, args.reset_prob);
        Ok(move |c: NetConfig| {
            c.map_links(|l| {
                if let Some(j) = jitter {
                    l.jitter = j;
                }
                if let Some(p) = loss {
                    l.loss = p;
                }
                if let Some(r) = rto {
                    l.rto = r;
                }
                if let Some(p) = reset {
                    l.reset_prob = p;
                }
                if let Some(d) = close {
                    l.close_delay = d;
                }
            })
        })
    }
}
