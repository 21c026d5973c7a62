//! `transit testbed ...`
#[derive(clap::Subcommand)]
pub enum TestbedCmd {
    /// Create a testbed.
    Up { name: String },
}
pub fn run(_c: TestbedCmd) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
