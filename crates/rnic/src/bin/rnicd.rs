//! Stand-alone rnicd (same as `transit rnicd`), small enough for tests to start quickly.
use clap::Parser;

#[derive(Parser)]
#[command(name = "rnicd", about = "The software RoCEv2 RDMA NIC daemon of one host")]
struct Args {
    #[command(flatten)]
    a: rnic::cli::RnicdArgs,
}

fn main() {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into())))
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = rnic::cli::rnicd(args.a) {
        eprintln!("rnicd: error: {e:#}");
        std::process::exit(1);
    }
}
