//! `--nvme SPEC`: the controller's configuration.
//!
//! `name=nvme0,queues=16,depth=4096,block=512,ns=mem:64M,ns=file:/path/disk.img,direct=on`
//!
//! `ns=` may repeat (namespace IDs are given in order from 1); `direct=on`
//! applies to the file namespace just before it. A file both hosts of a
//! migration can open is the shared storage of the testbed.

use serde::{Deserialize, Serialize};

pub const MAX_IO_QUEUES: u16 = 1024;
pub const MAX_DEPTH: u32 = 65536;
pub const MAX_NAMESPACES: u32 = 256;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BackendSpec {
    /// Host memory of this many bytes, zero filled; its contents travel in
    /// the device state on migration.
    Memory { size: u64 },
    /// A file or block device; `direct` opens it with O_DIRECT.
    File { path: String, direct: bool },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceSpec {
    pub backend: BackendSpec,
}

impl NamespaceSpec {
    /// `mem:64M`, `file:/path` or `file:/path,direct=on`.
    pub fn parse(spec: &str) -> Result<NamespaceSpec, String> {
        let mut parts = spec.split(',');
        let first = parts.next().unwrap_or("");
        let mut ns = if let Some(size) = first.strip_prefix("mem:") {
            let size = units::parse_size(size).map_err(|e| format!("bad namespace size {size:?}: {e}"))?;
            if size == 0 {
                return Err("a memory namespace needs a size above zero".into());
            }
            NamespaceSpec { backend: BackendSpec::Memory { size } }
        } else if let Some(path) = first.strip_prefix("file:") {
            if path.is_empty() {
                return Err("file namespace needs a path".into());
            }
            NamespaceSpec { backend: BackendSpec::File { path: path.to_string(), direct: false } }
        } else {
            return Err(format!("namespace {first:?}: expected mem:SIZE or file:PATH"));
        };
        for opt in parts {
            ns.apply_option(opt)?;
        }
        Ok(ns)
    }

    fn apply_option(&mut self, opt: &str) -> Result<(), String> {
        match (opt, &mut self.backend) {
            ("direct=on", BackendSpec::File { direct, .. }) => *direct = true,
            ("direct=off", BackendSpec::File { direct, .. }) => *direct = false,
            (o, _) => return Err(format!("namespace option {o:?} is not understood here")),
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmeConfig {
    pub name: String,
    /// I/O queue pairs offered to the guest.
    pub queues: u16,
    /// Largest queue the guest may create (entries; CAP.MQES + 1).
    pub depth: u32,
    /// Logical block size in bytes (512 or 4096).
    pub block_size: u32,
    pub namespaces: Vec<NamespaceSpec>,
}

impl Default for NvmeConfig {
    fn default() -> Self {
        NvmeConfig { name: "nvme0".into(), queues: 16, depth: 4096, block_size: 512, namespaces: Vec::new() }
    }
}

impl NvmeConfig {
    pub fn parse(spec: &str) -> Result<NvmeConfig, String> {
        let mut cfg = NvmeConfig::default();
        for item in spec.split(',').filter(|s| !s.is_empty()) {
            let (k, v) = item.split_once('=').ok_or_else(|| format!("{item:?}: expected key=value"))?;
            match k {
                "name" => {
                    if v.is_empty() || !v.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
                        return Err(format!("name {v:?}: use letters, digits, - and _"));
                    }
                    cfg.name = v.to_string();
                }
                "queues" => {
                    let q: u16 = v.parse().map_err(|_| format!("queues={v}: not a number"))?;
                    if q == 0 || q > MAX_IO_QUEUES {
                        return Err(format!("queues={q}: must be 1..={MAX_IO_QUEUES}"));
                    }
                    cfg.queues = q;
                }
                "depth" => {
                    let d: u32 = v.parse().map_err(|_| format!("depth={v}: not a number"))?;
                    if !(2..=MAX_DEPTH).contains(&d) {
                        return Err(format!("depth={d}: must be 2..={MAX_DEPTH}"));
                    }
                    cfg.depth = d;
                }
                "block" => {
                    let b: u32 = v.parse().map_err(|_| format!("block={v}: not a number"))?;
                    if b != 512 && b != 4096 {
                        return Err(format!("block={b}: must be 512 or 4096"));
                    }
                    cfg.block_size = b;
                }
                "ns" => cfg.namespaces.push(NamespaceSpec::parse(v)?),
                "direct" => match cfg.namespaces.last_mut() {
                    Some(ns) => ns.apply_option(item)?,
                    None => return Err("direct= must follow a file namespace".into()),
                },
                _ => return Err(format!("unknown nvme option {k:?}")),
            }
        }
        if cfg.namespaces.len() > MAX_NAMESPACES as usize {
            return Err(format!("at most {MAX_NAMESPACES} namespaces"));
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_cli_form() {
        let c = NvmeConfig::parse("name=nvme0,queues=16,depth=4096,ns=mem:64M,ns=file:/tmp/d.img,direct=on").unwrap();
        assert_eq!(c.name, "nvme0");
        assert_eq!(c.queues, 16);
        assert_eq!(c.depth, 4096);
        assert_eq!(c.namespaces[0].backend, BackendSpec::Memory { size: 64 << 20 });
        assert_eq!(c.namespaces[1].backend, BackendSpec::File { path: "/tmp/d.img".into(), direct: true });
    }

    #[test]
    fn refuses_bad_specs() {
        for bad in [
            "queues=0",
            "queues=5000",
            "depth=1",
            "depth=x",
            "ns=mem:0",
            "ns=disk:1",
            "ns=mem:64M,direct=on",
            "direct=on",
            "bogus=1",
            "name=a b",
            "block=1000",
            "novalue",
        ] {
            assert!(NvmeConfig::parse(bad).is_err(), "{bad} should be refused");
        }
    }
}
