//! Link shaping and faults: rate (tc tbf), loss and duplication (nftables in the
//! netdev family), link down/up (the fabric-side end of the veth, like a pulled cable).
//!
//! Each fault on each NIC is its own nft table in the host namespace, so setting one
//! never disturbs another, and setting it to 0 deletes the table.

use crate::{sys, Testbed};
use anyhow::{bail, Context, Result};

/// Marks a duplicated packet so the copy, which passes the egress hook again, is not
/// duplicated once more.
const DUP_MARK: u32 = 0x7e57_0001;

/// Probabilities are applied as `numgen random mod SCALE < pct * SCALE / 100`.
const SCALE: u64 = 1_000_000;

fn threshold(pct: f64) -> Result<u64> {
    if !(0.0..=100.0).contains(&pct) || pct.is_nan() {
        bail!("a percentage is between 0 and 100, not {pct}");
    }
    Ok((pct * (SCALE as f64) / 100.0).round() as u64)
}

fn replace_table(netns: &str, table: &str, body: Option<String>) -> Result<()> {
    // "add" then "delete" makes the delete succeed whether or not the table existed.
    let mut script = format!("add table netdev {table}\ndelete table netdev {table}\n");
    if let Some(body) = body {
        script += &format!("table netdev {table} {{\n{body}}}\n");
    }
    sys::nft(netns, &script)
}

impl Testbed {
    /// Limits NIC `nic` of `host` to `mbit` Mbit/s in both directions (tbf on the host
    /// end for what it sends, on the fabric end for what it receives); None removes the limit.
    pub fn set_rate(&self, host: usize, nic: usize, mbit: Option<u32>) -> Result<()> {
        let h = self.check(host, nic)?;
        let fab = self.fabric();
        let ends = [(h.netns.clone(), format!("eth{nic}")), (fab, format!("h{host}e{nic}"))];
        for (ns, dev) in &ends {
            match mbit {
                Some(0) => bail!("a rate of 0 Mbit/s would cut the link; use link_down"),
                Some(rate) => {
                    let bytes_per_s = rate as u64 * 1_000_000 / 8;
                    // The bucket holds 10 ms of traffic (at least a few full frames) so the
                    // rate holds at any timer resolution; the queue holds 100 ms.
                    let burst = (bytes_per_s / 100).max(32 * 1024);
                    sys::tc(
                        ns,
                        &[
                            "qdisc",
                            "replace",
                            "dev",
                            dev,
                            "root",
                            "tbf",
                            "rate",
                            &format!("{rate}mbit"),
                            "burst",
                            &burst.to_string(),
                            "latency",
                            "100ms",
                        ],
                    )?;
                }
                None => {
                    // Deleting an absent root qdisc fails; that is fine.
                    let _ = sys::tc(ns, &["qdisc", "del", "dev", dev, "root"]);
                }
            }
        }
        Ok(())
    }

    /// The rate limit in force on NIC `nic` of `host`, as tc reports it (Mbit/s).
    pub fn rate(&self, host: usize, nic: usize) -> Result<Option<u32>> {
        let h = self.check(host, nic)?;
        let out = sys::tc(&h.netns, &["qdisc", "show", "dev", &format!("eth{nic}"), "root"])?;
        let Some(pos) = out.find(" rate ") else { return Ok(None) };
        let word = out[pos + 6..].split_whitespace().next().unwrap_or("");
        let (num, unit) = word.split_at(word.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(word.len()));
        let num: f64 = num.parse().with_context(|| format!("cannot read tc rate {word:?}"))?;
        let mbit = match unit {
            "Gbit" => num * 1000.0,
            "Mbit" => num,
            "Kbit" => num / 1000.0,
            "bit" => num / 1e6,
            _ => bail!("unknown tc rate unit in {word:?}"),
        };
        Ok(Some(mbit.round() as u32))
    }

    /// Drops each IPv4 packet crossing NIC `nic` of `host`, in either direction, with
    /// probability `pct`% (nftables `numgen random`). ARP is spared so that addresses
    /// keep resolving. 0 removes the loss.
    pub fn set_loss(&self, host: usize, nic: usize, pct: f64) -> Result<()> {
        let h = self.check(host, nic)?;
        let t = threshold(pct)?;
        let dev = format!("eth{nic}");
        let body = (t > 0).then(|| {
            let rule = format!("meta protocol ip numgen random mod {SCALE} < {t} counter drop");
            format!(
                "  chain rx {{ type filter hook ingress device \"{dev}\" priority -100; {rule}; }}\n\
                 \x20 chain tx {{ type filter hook egress device \"{dev}\" priority -100; {rule}; }}\n"
            )
        });
        replace_table(&h.netns, &format!("tb_loss_{dev}"), body)
    }

    /// Sends each IPv4 packet that `host` sends on NIC `nic` twice with probability
    /// `pct`% (nftables `dup` in the netdev egress hook). 0 removes it.
    pub fn set_dup(&self, host: usize, nic: usize, pct: f64) -> Result<()> {
        let h = self.check(host, nic)?;
        let t = threshold(pct)?;
        let dev = format!("eth{nic}");
        let body = (t > 0).then(|| {
            format!(
                "  chain tx {{ type filter hook egress device \"{dev}\" priority -200; \
                 meta protocol ip meta mark != {DUP_MARK:#x} numgen random mod {SCALE} < {t} \
                 counter meta mark set {DUP_MARK:#x} dup to \"{dev}\"; }}\n"
            )
        });
        replace_table(&h.netns, &format!("tb_dup_{dev}"), body)
    }

    /// Cuts NIC `nic` of `host` (its fabric-side end goes down: the host keeps its
    /// address and routes and sees NO-CARRIER, like a pulled cable).
    pub fn link_down(&self, host: usize, nic: usize) -> Result<()> {
        self.check(host, nic)?;
        sys::ip(Some(&self.fabric()), &["link", "set", &format!("h{host}e{nic}"), "down"]).map(|_| ())
    }

    /// Reconnects a NIC cut by [`Testbed::link_down`]; returns once it passes traffic.
    /// Address resolutions that failed or are still pending because of the cut are
    /// forgotten on every host of that network, so the next packet resolves afresh
    /// instead of waiting out (or dying with) the old attempt.
    pub fn link_up(&self, host: usize, nic: usize) -> Result<()> {
        self.check(host, nic)?;
        sys::ip(Some(&self.fabric()), &["link", "set", &format!("h{host}e{nic}"), "up"])?;
        self.wait_links_ready(Some((host, nic)))?;
        let dev = format!("eth{nic}");
        for h in self.hosts() {
            for nud in ["incomplete", "failed"] {
                // Nothing to flush is not an error worth reporting.
                let _ = sys::ip(Some(&h.netns), &["neigh", "flush", "dev", &dev, "nud", nud]);
            }
        }
        Ok(())
    }

    /// Packets counted by a fault's nft rules on NIC `nic` of `host` (`kind`: "loss",
    /// "dup" or "reorder"); 0 when the fault is off.
    pub fn fault_count(&self, host: usize, nic: usize, kind: &str) -> Result<u64> {
        let h = self.check(host, nic)?;
        let family = if kind == "reorder" { "ip" } else { "netdev" };
        let Ok(out) = sys::nft_cmd(&h.netns, &["list", "table", family, &format!("tb_{kind}_eth{nic}")]) else {
            return Ok(0);
        };
        let mut total = 0;
        let mut words = out.split_whitespace();
        while let Some(w) = words.next() {
            if w == "packets" {
                total += words.next().and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
            }
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn thresholds() {
        assert_eq!(super::threshold(10.0).unwrap(), 100_000);
        assert_eq!(super::threshold(0.0).unwrap(), 0);
        assert!(super::threshold(101.0).is_err());
        assert!(super::threshold(f64::NAN).is_err());
    }
}
