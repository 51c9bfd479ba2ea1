//! `tandem`: the one binary. Each subcommand lives in its own module with an
//! `Args` struct (clap) and a `run(Args) -> anyhow::Result<()>` function;
//! `lab` and `bench` live in their own crates (`tandem-lab`, `tandem-bench`)
//! with the same shape, and this file only dispatches.

use clap::{Parser, Subcommand};
use std::io::IsTerminal;

mod demo;
mod generate;
mod generate_args;
mod models;
mod netsim;
mod plan;
mod profile;
mod remote;
mod route;
mod serve_edge;
mod serve_verifier;
mod tokenize;

#[derive(Parser)]
#[command(
    name = "tandem",
    version,
    about = "Edge-cloud collaborative speculative decoding"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Benchmark Tandem's model core against candle and llama.cpp.
    #[cfg(feature = "bench")]
    Bench(Box<tandem_bench::Args>),
    /// Not built in: this binary was built without the `bench` feature.
    #[cfg(not(feature = "bench"))]
    #[command(hide = true)]
    Bench(NotBuiltIn),
    /// Run the demo: speculative decoding over TLS, privacy routing and an
    /// outage with recovery, all on loopback (fetches the models first).
    Demo(demo::Args),
    /// Generate text: draft-only, target-only or speculative (locally, or with
    /// --verifier URL against a remote verifier).
    Generate(generate_args::Args),
    /// Fetch, verify and list the real GGUF models.
    Models(models::Args),
    /// Tokenize stdin (or decode a JSON id array with --decode).
    Tokenize(tokenize::Args),
    /// Privacy router: classify text, explain decisions, check policies.
    Route(route::Args),
    /// Shard planner: split a model's layers across nodes.
    Plan(plan::Args),
    /// Measure a model's per-layer costs here (the shard planner's profile JSON).
    Profile(profile::Args),
    /// Serve the cloud verifier (gRPC + admin HTTP) from a TOML config.
    ServeVerifier(serve_verifier::Args),
    /// Serve the OpenAI-compatible local API (chat/completions, SSE) on the device.
    ServeEdge(serve_edge::Args),
    /// Network simulator: a TCP proxy with a named profile or timeline.
    Netsim(netsim::Args),
    /// Latency experiments: modes x network profiles x prompts (docs/lab.md).
    #[cfg(feature = "lab")]
    Lab(tandem_lab::Args),
    /// Not built in: this binary was built without the `lab` feature.
    #[cfg(not(feature = "lab"))]
    #[command(hide = true)]
    Lab(NotBuiltIn),
}

/// The arguments of a subcommand left out of this build (`lab`, `bench`):
/// whatever they are, the command says it was not built in.
#[cfg(not(all(feature = "lab", feature = "bench")))]
#[derive(clap::Args)]
struct NotBuiltIn {
    /// Taken and ignored: the command only refuses.
    #[allow(dead_code)]
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    args: Vec<String>,
}

#[cfg(not(all(feature = "lab", feature = "bench")))]
fn not_built_in(command: &str) -> anyhow::Result<()> {
    anyhow::bail!(
        "`tandem {command}` is not built into this binary (built without the `{command}` \
         feature); build it with `cargo build -p tandem --features {command}`"
    )
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // The demo narrates its own scenes (an outage included) between streamed
    // text: a library's warning there would interleave with it, so only
    // errors are logged unless TANDEM_LOG asks for more. Colour only on a TTY.
    let default_level = match cli.command {
        Command::Demo(_) => "error",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TANDEM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
    let res = match cli.command {
        #[cfg(feature = "bench")]
        Command::Bench(a) => tandem_bench::run(*a),
        #[cfg(not(feature = "bench"))]
        Command::Bench(_) => not_built_in("bench"),
        Command::Demo(a) => demo::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Models(a) => models::run(a),
        Command::Tokenize(a) => tokenize::run(a),
        Command::Route(a) => route::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Profile(a) => profile::run(a),
        Command::ServeVerifier(a) => serve_verifier::run(a),
        Command::ServeEdge(a) => serve_edge::run(a),
        Command::Netsim(a) => netsim::run(a),
        #[cfg(feature = "lab")]
        Command::Lab(a) => tandem_lab::run(a),
        #[cfg(not(feature = "lab"))]
        Command::Lab(_) => not_built_in("lab"),
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
