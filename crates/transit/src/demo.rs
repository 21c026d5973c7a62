//! `transit demo`
#[derive(clap::Args)]
pub struct DemoArgs {}
pub fn run(_a: DemoArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}
