//! `transit`: the one command-line tool of Transit.

use clap::{Parser, Subcommand};

mod demo;
mod vm;

#[derive(Parser)]
#[command(name = "transit", version, about = "Live migration of VMs with RDMA and NVMe devices, and the software RDMA NIC it needs")]
struct Cli {
    /// Log filter (also RUST_LOG), e.g. info, debug, vmm=trace.
    #[arg(long, global = true, default_value = "info")]
    log: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run and control VMs (the vmm and its control-socket client).
    #[command(subcommand)]
    Vm(vm::VmCmd),
    /// Multi-host testbeds made of network namespaces.
    #[command(subcommand)]
    Testbed(testbed::cli::TestbedCmd),
    /// The software RDMA NIC daemon of one host.
    Rnicd(rnic::cli::RnicdArgs),
    /// RDMA utilities: device info and perftest-style benchmarks.
    #[command(subcommand)]
    Rdma(verbs::tools::RdmaCmd),
    /// The main demo: a VM talking RDMA to a bare-metal peer moves A -> B -> A
    /// (`--no-rdma`: a VM running the memory dirtier).
    Demo(demo::DemoArgs),
}

fn main() {
    let cli = Cli::parse();
    let filter = std::env::var("RUST_LOG").unwrap_or(cli.log.clone());
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::new(filter)).with_writer(std::io::stderr).init();
    let r = match cli.cmd {
        Cmd::Vm(c) => vm::run(c),
        Cmd::Testbed(c) => testbed::cli::run(c),
        Cmd::Rnicd(a) => rnic::cli::rnicd(a),
        Cmd::Rdma(c) => verbs::tools::run(c),
        Cmd::Demo(a) => demo::run(a),
    };
    if let Err(e) = r {
        if let Some(p) = e.downcast_ref::<vm::migrate::PostcopyPaused>() {
            eprintln!("transit: {p}");
            std::process::exit(vm::migrate::EXIT_POSTCOPY_PAUSED);
        }
        eprintln!("transit: error: {e:#}");
        std::process::exit(1);
    }
}
