//! `--pvrdma SPEC`: `gid=10.200.0.50[,rnicd=/path/to/rnicd.sock][,name=pvrdma0]`.
//! `testing=no-traces` and `testing=shift-ids` turn a migration mechanism
//! off, for the tests that show what it is for; `testing=corrupt-state`
//! damages the next saved state, for the test that shows a destination
//! refuses it (never for real use).

use std::net::Ipv4Addr;
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PvrdmaConfig {
    pub name: String,
    /// The VM's RDMA address: its namespace on the host's rnicd.
    pub gid: Ipv4Addr,
    /// rnicd's control socket; `None` finds the one of this network namespace.
    pub rnicd: Option<PathBuf>,
    pub testing: Testing,
}

/// Switches that break a migration mechanism on purpose: the negative
/// controls of the migration tests show that the peers notice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Testing {
    /// rnicd's writes are not traced while migrating: pages a peer writes
    /// during the rounds are not sent again. The pause then also waits,
    /// with the vCPUs stopped, until a peer has used up a QP's posted
    /// receives, so that the loss is certain (negative.rs).
    pub no_traces: bool,
    /// A restore recreates QPs and MRs with other QPNs and keys than the
    /// saved ones (as without an identity namespace).
    pub shift_ids: bool,
    /// The next saved state has damaged bytes (then the switch is spent:
    /// the migration after the refused one carries a sound state).
    pub corrupt_state: bool,
    /// The device changes its objects right after a migration took its
    /// early section (churn.rs): a spare MR and QP made just before it are
    /// destroyed and others made (with the same handles, other keys and
    /// QPNs), so that what the destination built ahead is partly stale.
    pub churn_early: bool,
}

impl PvrdmaConfig {
    pub fn parse(spec: &str) -> Result<PvrdmaConfig, String> {
        let (mut name, mut gid, mut rnicd) = ("pvrdma0".to_string(), None, None);
        let mut testing = Testing::default();
        for part in spec.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| format!("{part:?}: expected key=value"))?;
            match k {
                "gid" => gid = Some(v.parse::<Ipv4Addr>().map_err(|_| format!("gid {v:?} is not an IPv4 address"))?),
                "rnicd" if !v.is_empty() => rnicd = Some(PathBuf::from(v)),
                "testing" if v == "no-traces" => testing.no_traces = true,
                "testing" if v == "shift-ids" => testing.shift_ids = true,
                "testing" if v == "corrupt-state" => testing.corrupt_state = true,
                "testing" if v == "churn-early" => testing.churn_early = true,
                "name" if !v.is_empty() && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') => name = v.to_string(),
                _ => return Err(format!("{part:?} is not understood (gid=, rnicd=, name=)")),
            }
        }
        let gid = gid.ok_or("gid= is required (the VM's RDMA address)")?;
        if gid.is_unspecified() || gid.is_broadcast() || gid.is_multicast() || gid.is_loopback() {
            return Err(format!("gid {gid} cannot be an RDMA address"));
        }
        Ok(PvrdmaConfig { name, gid, rnicd, testing })
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
        let t = PvrdmaConfig::parse("gid=10.0.0.1,testing=no-traces,testing=shift-ids").unwrap().testing;
        assert!(t.no_traces && t.shift_ids && !t.corrupt_state);
        assert!(PvrdmaConfig::parse("gid=10.0.0.1,testing=corrupt-state").unwrap().testing.corrupt_state);
        assert!(PvrdmaConfig::parse("gid=10.0.0.1,testing=churn-early").unwrap().testing.churn_early);
        assert!(PvrdmaConfig::parse("gid=10.0.0.1,testing=other").is_err());
    }
}
