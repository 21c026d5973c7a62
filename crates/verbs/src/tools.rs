//! `transit rdma ...`
#[derive(clap::Subcommand)]
pub enum RdmaCmd {
    /// Show devices.
    Devinfo,
}
pub fn run(_c: RdmaCmd) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
