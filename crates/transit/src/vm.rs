//! `transit vm ...`
#[derive(clap::Subcommand)]
pub enum VmCmd {
    /// Start a VM.
    Run,
}
pub fn run(_c: VmCmd) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
