//! `tandem netsim`: the network simulator as a standalone TCP proxy. Point a
//! client at the printed address instead of the server; the link between
//! them then behaves like the chosen profile or timeline. Runs until ctrl-c.

use std::io::Write as _;
use std::net::{SocketAddr, ToSocketAddrs as _};

use anyhow::Context as _;
use tandem_cli_common::link_overrides::LinkOverrides;
use tandem_netsim::{NetConfig, Proxy, Timeline, PROFILES};

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("conditions").required(true).args(["profile", "timeline", "list"])))]
pub struct Args {
    /// Address to listen on (port 0 picks a free one; the bound address is
    /// printed on stdout).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Server to forward to (host:port).
    #[arg(long, required_unless_present = "list")]
    upstream: Option<String>,
    /// Named profile: loopback, lan, wifi, fast-4g, slow-4g, 3g, satellite,
    /// offline.
    #[arg(long)]
    profile: Option<String>,
    /// Profiles over time, e.g. "wifi 5s, offline 10s, fast-4g" (the last
    /// segment lasts forever; `reset` resets every connection).
    #[arg(long)]
    timeline: Option<String>,
    /// Print the profile table and exit.
    #[arg(long)]
    list: bool,
    /// Seed of the jitter, loss and reset draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    link: LinkOverrides,
    /// Connections open at once; one more is reset on arrival.
    #[arg(long, default_value_t = tandem_netsim::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
}

fn print_profiles() {
    println!(
        "{:<10} {:>9} {:>10} {:>10}  source",
        "profile", "rtt_ms", "down_mbps", "up_mbps"
    );
    for p in PROFILES {
        println!(
            "{:<10} {:>9} {:>10} {:>10}  {}",
            p.name, p.rtt_ms, p.down_mbps, p.up_mbps, p.source
        );
    }
    println!(
        "{:<10} {:>9} {:>10} {:>10}  blackhole both ways",
        "offline", "-", "0", "0"
    );
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.list {
        print_profiles();
        return Ok(());
    }
    let upstream_text = args.upstream.as_deref().unwrap_or_default();
    let upstream = upstream_text
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve --upstream {upstream_text}"))?
        .next()
        .with_context(|| format!("--upstream {upstream_text} resolves to no address"))?;
    let apply = args.link.apply()?;
    let timeline = match (&args.profile, &args.timeline) {
        (Some(p), _) => Timeline::constant(apply(NetConfig::profile(p)?)),
        (None, Some(t)) => Timeline::parse(t)?.map_conditions(apply),
        (None, None) => anyhow::bail!("give --profile or --timeline"),
    };
    timeline.validate()?;
    let first = timeline.initial().clone();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        anyhow::ensure!(args.max_connections >= 1, "--max-connections must be at least 1");
        let proxy = Proxy::start_seeded(args.listen, upstream, first, args.seed).await?;
        proxy.set_max_connections(args.max_connections);
        let what = match (&args.profile, &args.timeline) {
            (Some(p), _) => format!("profile {p}"),
            (_, Some(t)) => format!("timeline \"{t}\""),
            _ => String::new(),
        };
        // The first line of stdout is the contract: scripts read the address.
        println!("listening on {}", proxy.local_addr());
        std::io::stdout().flush().ok();
        eprintln!(
            "netsim: {} -> {upstream}, {what}, seed {} (ctrl-c to stop)",
            proxy.local_addr(),
            args.seed
        );
        proxy.set_timeline(timeline);
        tokio::signal::ctrl_c()
            .await
            .context("waiting for ctrl-c")?;
        let stats = proxy.stats();
        proxy.shutdown().await;
        eprintln!(
            "netsim: stopped; {} connections, {} B up, {} B down, {} stalls, {} resets, {} refused over the cap",
            stats.connections, stats.bytes_up, stats.bytes_down, stats.stalls, stats.resets, stats.refused
        );
        Ok(())
    })
}
