//! Build the guest firmware (crates/guest) with the installed toolchain.
//!
//! The firmware is a freestanding x86-64 program, so it needs its own profile
//! (panic = "abort") and link flags (static, no PIE, our linker script); that
//! is why it is a separate cargo project, built here into target/guest.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let guest = manifest.parent().unwrap().join("guest");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    // OUT_DIR is target/<profile>/build/guest-image-*/out: put the guest
    // beside the workspace's target dir so every build shares one copy.
    let target_dir = out.ancestors().nth(4).unwrap().join("guest");
    println!("cargo:rerun-if-changed={}", guest.join("src").display());
    println!("cargo:rerun-if-changed={}", guest.join("Cargo.toml").display());
    // The PVRDMA driver's interface crate, used by path.
    println!("cargo:rerun-if-changed={}", manifest.parent().unwrap().join("pvrdma-abi/src").display());
    println!("cargo:rerun-if-changed={}", guest.join("link.ld").display());
    println!("cargo:rerun-if-changed={}", guest.join(".cargo/config.toml").display());
    // Crates of this workspace that the guest depends on.
    println!("cargo:rerun-if-changed={}", manifest.parent().unwrap().join("units/src").display());

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&guest).args(["build", "--release", "--target-dir"]).arg(&target_dir);
    // The outer build's flags, jobserver and wrappers (clippy's driver under
    // `cargo clippy`) are not meant for this one.
    for (k, _) in std::env::vars() {
        if k.starts_with("CARGO_") && k != "CARGO_HOME" || k == "RUSTFLAGS" || k == "RUSTC_WRAPPER" || k == "RUSTC_WORKSPACE_WRAPPER" {
            cmd.env_remove(&k);
        }
    }
    let status = cmd.status().expect("run cargo for the guest firmware");
    assert!(status.success(), "building the guest firmware (crates/guest) failed");
    let elf = target_dir.join("release/transit-guest");
    println!("cargo:rustc-env=TRANSIT_GUEST_ELF={}", elf.display());
}
