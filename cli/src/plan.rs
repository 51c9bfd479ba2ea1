//! `tandem plan`: split a model's layers across nodes with the exact shard
//! planner, print the assignment, the predicted time (compute per node,
//! transfer per link) and memory per node; `--sweep-network` shows how the
//! best plan moves across the named network profiles.

use std::path::PathBuf;

use anyhow::Context as _;
use serde::Serialize;
use tandem_shard::{
    solve, ClusterConfig, ModelProfile, NetworkProfile, Objective, PlanOptions, PlanReport,
    NETWORK_PROFILES,
};

#[derive(Clone, Copy, clap::ValueEnum)]
enum ObjectiveArg {
    /// Minimise the time of one forward pass.
    Latency,
    /// Maximise pipelined forwards per second (minimise the slowest stage).
    Throughput,
}

#[derive(clap::Args)]
pub struct Args {
    /// Layer profile (JSON, schema tandem.profile.v1; see docs/shard-planner.md).
    #[arg(long)]
    profile: PathBuf,
    /// Nodes and links (TOML; see config/nodes.example.toml).
    #[arg(long)]
    nodes: PathBuf,
    /// What to optimise.
    #[arg(long, value_enum, default_value = "latency")]
    objective: ObjectiveArg,
    /// Keep the head on the device too (U-shape: the output never leaves it).
    #[arg(long)]
    pin_head: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Re-plan with every named network profile on the device's links.
    #[arg(long)]
    sweep_network: bool,
    /// Tokens per forward (1 = decoding; k+1 to verify k drafted tokens).
    /// The profile must have compute times for this block size.
    #[arg(long, default_value_t = 1)]
    block: u32,
    /// KV-cache context in tokens (default: the nodes file, then the profile).
    #[arg(long)]
    context: Option<u64>,
}

#[derive(Serialize)]
struct SweepRow {
    network: &'static str,
    rtt_ms: f64,
    up_mbps: f64,
    down_mbps: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    plan: Option<PlanReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

#[derive(Serialize)]
struct Header<'a> {
    model: &'a str,
    profile_measured: bool,
    objective: Objective,
    block_tokens: u32,
    context_tokens: u64,
    pin_head: bool,
    device: &'a str,
    /// Links with a fixed per-exchange overhead (`overhead_ms`), included in
    /// their transfer times.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    link_overheads: Vec<LinkOverhead>,
}

#[derive(Serialize)]
struct LinkOverhead {
    a: String,
    b: String,
    overhead_ms: f64,
}

#[derive(Serialize)]
struct SingleOutput<'a> {
    #[serde(flatten)]
    header: Header<'a>,
    plan: PlanReport,
}

#[derive(Serialize)]
struct SweepOutput<'a> {
    #[serde(flatten)]
    header: Header<'a>,
    sweep: Vec<SweepRow>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let profile = ModelProfile::load(&args.profile)?;
    let cluster = ClusterConfig::load(&args.nodes)?;
    let objective = match args.objective {
        ObjectiveArg::Latency => Objective::Latency,
        ObjectiveArg::Throughput => Objective::Throughput,
    };
    let opts = PlanOptions {
        block_tokens: args.block,
        context_tokens: args.context,
        pin_head: args.pin_head,
    };
    let header = Header {
        model: &profile.model,
        profile_measured: profile.measured,
        objective,
        block_tokens: args.block,
        context_tokens: cluster.context_for(&profile, &opts),
        pin_head: args.pin_head,
        device: &cluster.device,
        link_overheads: cluster
            .links
            .iter()
            .filter_map(|l| {
                let ms = l.overhead_ms.unwrap_or(0.0);
                (ms > 0.0).then(|| LinkOverhead {
                    a: l.a.clone(),
                    b: l.b.clone(),
                    overhead_ms: ms,
                })
            })
            .collect(),
    };
    let plan_for = |c: &ClusterConfig| -> Result<PlanReport, tandem_shard::PlanError> {
        let problem = c.to_problem(&profile, &opts)?;
        let plan = solve(&problem, objective)?;
        Ok(PlanReport::new(&problem, &plan))
    };

    if !args.sweep_network {
        let report = plan_for(&cluster).context("planning failed")?;
        if args.json {
            let out = SingleOutput {
                header,
                plan: report,
            };
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else {
            print_header(&header);
            print!("{}", report.render());
        }
        return Ok(());
    }

    if cluster.device_links() == 0 {
        anyhow::bail!(
            "--sweep-network changes the links that touch the device '{}', and it has none",
            cluster.device
        );
    }
    let mut rows = Vec::new();
    for net in NETWORK_PROFILES {
        let swept = cluster.with_device_network(net.name)?;
        let (plan, error) = match plan_for(&swept) {
            Ok(r) => (Some(r), None),
            Err(e) => (None, Some(e.to_string())),
        };
        rows.push(SweepRow {
            network: net.name,
            rtt_ms: net.rtt_ms,
            up_mbps: net.up_mbps,
            down_mbps: net.down_mbps,
            plan,
            error,
        });
    }
    if args.json {
        let out = SweepOutput {
            header,
            sweep: rows,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    print_header(&header);
    println!(
        "network sweep: every link touching '{}' set to each profile (device = client side)",
        cluster.device
    );
    let predicted = match objective {
        Objective::Latency => "predicted = one forward; compute and transfer add up to it",
        Objective::Throughput => {
            "predicted = slowest pipeline stage; compute and transfer are one forward's totals"
        }
    };
    println!("({predicted})");
    println!(
        "{:<10} {:>8} {:>17} {:>12} {:>12} {:>12}  plan",
        "network", "rtt ms", "up/down Mbps", "predicted", "compute", "transfer"
    );
    for r in &rows {
        let bw = format!("{}/{}", r.up_mbps, r.down_mbps);
        match (&r.plan, &r.error) {
            (Some(p), _) => println!(
                "{:<10} {:>8} {:>17} {:>9.3} ms {:>9.3} ms {:>9.3} ms  {}",
                r.network,
                r.rtt_ms,
                bw,
                p.objective_seconds * 1e3,
                p.compute_seconds() * 1e3,
                p.transfer_seconds() * 1e3,
                p.summary()
            ),
            (None, e) => println!(
                "{:<10} {:>8} {:>17}  {}",
                r.network,
                r.rtt_ms,
                bw,
                e.as_deref().unwrap_or("no plan")
            ),
        }
    }
    if let Some(src) = NetworkProfile::by_name("fast-4g").map(|p| p.source) {
        println!("(network numbers: docs/shard-planner.md; e.g. fast-4g = {src})");
    }
    Ok(())
}

fn print_header(h: &Header) {
    let measured = if h.profile_measured {
        "measured"
    } else {
        "EXAMPLE numbers, not measured"
    };
    println!(
        "plan for {} ({measured}): objective {}, block {} token(s), KV context {}, device '{}', head pinned: {}",
        h.model,
        h.objective,
        h.block_tokens,
        h.context_tokens,
        h.device,
        if h.pin_head { "yes" } else { "no" }
    );
    for o in &h.link_overheads {
        println!(
            "link {} <-> {}: {} ms fixed overhead per exchange (half per crossing, included in transfer)",
            o.a, o.b, o.overhead_ms
        );
    }
}
