//! A process outside the vmm that maps guest RAM, as rnicd or a vhost-user
//! backend does, and takes part in postcopy through the RAM client
//! protocol (`migration::postcopy::clients`). Tests drive it on stdin:
//!
//! `read FIRST COUNT` prints `PFN HASH ZERO` per page (xxh3 of the page as
//! this process reads it through its own mapping; ZERO is 1 if all bytes
//! are zero), then `done`. EOF ends it.

use migration::postcopy::clients::RamClient;
use std::io::{BufRead, Write};
use std::os::fd::AsRawFd;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or_else(|| anyhow::anyhow!("usage: ram-client-probe SOCKET"))?;
    let client = RamClient::connect(std::path::Path::new(&path), "ram-client-probe")?;
    let len = client.ram_bytes as usize;
    // SAFETY: a shared mapping of the memfd the vmm passed, whole size.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, client.memfd.as_raw_fd(), 0) };
    anyhow::ensure!(base != libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
    let base = base as usize;
    let ranges = vec![(base as u64, 0u64, len as u64)];
    let client = std::sync::Arc::new(client);
    let c2 = client.clone();
    std::thread::spawn(move || {
        if let Err(e) = c2.serve(&ranges) {
            eprintln!("ram-client-probe: {e:#}");
        }
    });
    println!("ready {len}");
    std::io::stdout().flush()?;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let w: Vec<&str> = line.split_whitespace().collect();
        if let ["read", first, count] = w[..] {
            let (first, count): (u64, u64) = (first.parse()?, count.parse()?);
            let mut out = String::new();
            for pfn in first..first + count {
                anyhow::ensure!((pfn + 1) * 4096 <= len as u64, "page {pfn} is outside guest RAM");
                // SAFETY: inside the mapping; a page not yet migrated blocks
                // this thread until the vmm placed it.
                let page = unsafe { std::slice::from_raw_parts((base + pfn as usize * 4096) as *const u8, 4096) };
                let zero = page.iter().all(|&b| b == 0) as u8;
                out.push_str(&format!("{pfn} {} {zero}\n", migration::wire::xxh3(page)));
            }
            println!("{out}done");
            std::io::stdout().flush()?;
        } else {
            println!("error: unknown command {line:?}");
        }
    }
    Ok(())
}
