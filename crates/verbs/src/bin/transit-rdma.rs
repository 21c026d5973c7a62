//! `transit-rdma ...` is `transit rdma ...` without the rest of transit, so
//! benchmarks and tests need not build the whole tool.
use clap::Parser;

#[derive(Parser)]
#[command(name = "transit-rdma", about = "RDMA utilities: device info and perftest-style benchmarks")]
struct Args {
    #[command(subcommand)]
    cmd: verbs::tools::RdmaCmd,
}

fn main() {
    let a = Args::parse();
    if let Err(e) = verbs::tools::run(a.cmd) {
        eprintln!("transit-rdma: error: {e:#}");
        std::process::exit(1);
    }
}
