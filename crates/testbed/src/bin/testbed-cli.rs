//! `testbed-cli testbed ...` is `transit testbed ...` without the rest of transit, so
//! the testbed's own tests can drive the CLI without building the whole tool.

use clap::Parser;

#[derive(Parser)]
#[command(name = "testbed-cli", about = "Same as `transit testbed` (for the testbed's own tests)")]
enum Top {
    /// Multi-host testbeds made of network namespaces.
    #[command(subcommand)]
    Testbed(testbed::cli::TestbedCmd),
}

fn main() {
    let Top::Testbed(cmd) = Top::parse();
    if let Err(e) = testbed::cli::run(cmd) {
        eprintln!("testbed-cli: error: {e:#}");
        std::process::exit(1);
    }
}
