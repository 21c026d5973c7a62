//! `--pvrdma SPEC`: `gid=10.200.0.50[,rnicd=/path/to/rnicd.sock][,name=pvrdma0]`.

use std::net::Ipv4Addr;
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PvrdmaConfig {
    pub name: String,
    /// The VM's RDMA address: its namespace on the host's rnicd.
    pub gid: Ipv4Addr,
    /// rnicd's control socket; `None` finds the one of this network namespace.
    pub rnicd: Option<PathBuf>,
}

impl PvrdmaConfig {
    pub fn parse(spec: &str) -> Result<PvrdmaConfig, String> {
        let (mut name, mut gid, mut rnicd) = ("pvrdma0".to_string(), None, None);
        for part in spec.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| format!("{part:?}: expected key=value"))?;
            match k {
                "gid" => gid = Some(v.parse::<Ipv4Addr>().map_err(|_| format!("gid {v:?} is not an IPv4 address"))?),
                "rnicd" if !v.is_empty() => rnicd = Some(PathBuf::from(v)),
                "name" if !v.is_empty() && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') => name = v.to_string(),
                _ => return Err(format!("{part:?} is not understood (gid=, rnicd=, name=)")),
            }
        }
        let gid = gid.ok_or("gid= is required (the VM's RDMA address)")?;
        if gid.is_unspecified() || gid.is_broadcast() || gid.is_multicast() || gid.is_loopback() {
            return Err(format!("gid {gid} cannot be an RDMA address"));
        }
        Ok(PvrdmaConfig { name, gid, rnicd })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        let c = PvrdmaConfig::parse("gid=10.200.0.50,rnicd=/run/x.sock").unwrap();
        assert_eq!(c.gid, Ipv4Addr::new(10, 200, 0, 50));
        assert_eq!(c.rnicd, Some(PathBuf::from("/run/x.sock")));
        assert_eq!(c.name, "pvrdma0");
        assert!(PvrdmaConfig::parse("rnicd=/x").unwrap_err().contains("gid= is required"));
        assert!(PvrdmaConfig::parse("gid=300.1.1.1").is_err());
        assert!(PvrdmaConfig::parse("gid=0.0.0.0").is_err());
        assert!(PvrdmaConfig::parse("gid=10.0.0.1,foo=1").is_err());
        assert!(PvrdmaConfig::parse("gid=10.0.0.1,name=a/b").is_err());
    }
}
