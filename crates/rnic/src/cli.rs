//! `transit rnicd`
#[derive(clap::Args)]
pub struct RnicdArgs {}
pub fn rnicd(_a: RnicdArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
