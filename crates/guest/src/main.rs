//! Transit guest firmware: a freestanding x86-64 program the vmm loads at
//! 1 MiB and enters in long mode. The command line picks the workload:
//!
//! - `workload=dirtier [start=4M] [end=<ram end>] [rate=<pages/s>]`
//! - `workload=fill [start=4M] [end=<ram end>]`
//! - `workload=idle` (halt)
//! - `workload=clock` (publishes each clock read as progress)
//! - `workload=selftest` (prints, checks the clock, exits 0)
//! - `workload=mailbox` (answers each host mailbox message with `echo N MSG`)
//! - `workload=pvrdma gid=A.B.C.D ...` (RDMA workloads against `transit rdma peer`)
//! - `workload=pvrdma-bench gid=A.B.C.D` (WRITE bandwidth and SEND latency, run by `bench/pvrdma/run`)
//!
//! vCPUs other than 0 halt.

#![no_std]
#![no_main]

mod args;
#[allow(dead_code)]
mod boot;
mod clockcheck;
mod dirtier;
mod fill;
mod irq;
mod mem;
#[macro_use]
#[allow(dead_code)]
mod hw;
mod mailbox;
#[allow(dead_code)]
mod nvme;
#[allow(dead_code)]
mod pci;
#[allow(dead_code)]
mod pvrdma;

use boot::BootInfo;
use hw::Platform;

core::arch::global_asm!(
    ".section .text._start,\"ax\"",
    ".global _start",
    "_start:",
    // rdi = &BootInfo, rsi = vCPU index; stack = __stacks_start + (idx+1)*64K
    "lea rax, [rip + __stacks_start]",
    "mov rcx, rsi",
    "add rcx, 1",
    "shl rcx, 16",
    "add rax, rcx",
    "mov rsp, rax",
    "xor rbp, rbp",
    "call {main}",
    "2: hlt",
    "jmp 2b",
    main = sym guest_main,
);

extern "C" fn guest_main(boot: &'static BootInfo, cpu: u64) -> ! {
    if boot.magic != boot::BOOT_MAGIC {
        hw::halt_forever();
    }
    if cpu != 0 {
        hw::halt_forever();
    }
    let plat = Platform { base: boot.mmio_base };
    let args = args::Args(boot.cmdline());
    println!("transit-guest: ram={} MiB vcpus={} cmdline=\"{}\"", boot.ram_size >> 20, boot.num_vcpus, args.0);
    let start = args.num("start", 4 << 20).max(boot.firmware_end);
    let end = args.num("end", boot.ram_size).min(boot.ram_size);
    match args.get("workload").unwrap_or("idle") {
        "dirtier" => dirtier::run(plat, start, end, args.num("rate", 0)),
        "fill" => fill::run(plat, start, end),
        "clock" => clockcheck::run(plat),
        "mailbox" => mailbox::echo(plat, boot.mmio_base),
        "pvrdma" => pvrdma::workloads::run(plat, &args, boot),
        "pvrdma-bench" => pvrdma::bench::run(plat, &args, boot),
        "nvme-verify" => nvme::verify::run(plat, &args, nvme::region(&args, boot)),
        "nvme-perf" => nvme::perf::run(plat, &args, nvme::region(&args, boot)),
        "selftest" => {
            let a = plat.now_ns();
            let mut s = 0u64;
            for i in 0..100_000u64 {
                s = s.wrapping_add(i * i);
            }
            let b = plat.now_ns();
            println!("selftest: sum={} clock advanced {} ns", s, b - a);
            plat.exit(if b > a { 0 } else { 1 })
        }
        "idle" => {
            println!("idle");
            hw::halt_forever()
        }
        other => {
            println!("unknown workload {:?}", other);
            plat.exit(2)
        }
    }
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    println!("guest panic: {}", info);
    hw::halt_forever()
}
