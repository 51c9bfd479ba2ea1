//! `tandem serve-verifier --config F.toml`: the cloud verifier (gRPC + admin HTTP).

use anyhow::Context;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Verifier config (TOML; see docs/verifier.md and config/verifier.example.toml).
    #[arg(long)]
    config: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let cfg = tandem_verifier::VerifierConfig::from_file(&args.config)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let v = tandem_verifier::start(cfg).await?;
        // One line on stdout with the bound addresses (ports may be 0 in the config).
        println!("serving grpc={} admin={}", v.grpc_addr, v.admin_addr);
        v.run_until(shutdown_signal()).await?;
        eprintln!("verifier stopped");
        Ok::<(), anyhow::Error>(())
    })
}

/// Resolves on ctrl-c or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let term = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
