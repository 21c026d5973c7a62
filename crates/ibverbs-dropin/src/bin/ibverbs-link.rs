// SPDX-License-Identifier: GPL-2.0-or-later
//! Links target/<profile>/ibverbs/libibverbs.so.1 from the crate's
//! staticlib (run by scripts/test after `cargo build`). The profile
//! directory is this binary's own.

fn main() -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().expect("binary in a directory");
    let out = ibverbs_dropin::link::link(dir)?;
    println!("{}", out.display());
    Ok(())
}
