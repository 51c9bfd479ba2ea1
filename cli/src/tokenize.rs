//! `tandem tokenize` (in progress).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`tandem tokenize` is not implemented yet")
}
