//! Device and vCPU state as versioned, named sections.
//!
//! Every stateful piece of a VM (each vCPU, each device) implements [`Persist`]:
//! it turns its whole runtime state into a [`Section`] and rebuilds itself from
//! one. The migration engine and `transit vm save/restore` know devices only
//! through this interface (compare Firecracker's `Persist`). A section carries
//! its own format version so that a newer vmm can refuse, with a clear error,
//! state it does not understand.

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::io::{Read, Write};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("section {name:?}: version {found} is not supported (this build reads version {expected})")]
    Version { name: String, found: u32, expected: u32 },
    #[error("section {0:?} is missing from the saved state")]
    Missing(String),
    #[error("section {name:?}: cannot decode state: {why}")]
    Decode { name: String, why: String },
    #[error("section {name:?}: state does not fit this VM: {why}")]
    Mismatch { name: String, why: String },
    #[error("damaged state: {0}")]
    Damaged(String),
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, StateError>;

/// One named piece of saved state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Section {
    /// Stable instance name, e.g. `cpu0`, `console`, `nvme0`.
    pub name: String,
    /// Format version of `data`, owned by the device that wrote it.
    pub version: u32,
    /// Encoded state (JSON for small devices; devices may choose binary).
    pub data: Vec<u8>,
}

impl Section {
    /// Encode a serde state struct as a section.
    pub fn encode<T: Serialize>(name: &str, version: u32, state: &T) -> Section {
        Section {
            name: name.to_string(),
            version,
            // Serializing plain state structs into a Vec cannot fail.
            data: serde_json::to_vec(state).expect("state serializes"),
        }
    }

    /// Decode a serde state struct, checking the version first.
    pub fn decode<T: DeserializeOwned>(&self, expected_version: u32) -> Result<T> {
        if self.version != expected_version {
            return Err(StateError::Version { name: self.name.clone(), found: self.version, expected: expected_version });
        }
        serde_json::from_slice(&self.data).map_err(|e| StateError::Decode { name: self.name.clone(), why: e.to_string() })
    }

    /// Wire form: name length, name, version, data length, data, CRC32 of all before.
    pub fn write_to(&self, w: &mut impl Write) -> Result<()> {
        let mut buf = Vec::with_capacity(16 + self.name.len() + self.data.len());
        buf.extend_from_slice(&(self.name.len() as u16).to_le_bytes());
        buf.extend_from_slice(self.name.as_bytes());
        buf.extend_from_slice(&self.version.to_le_bytes());
        buf.extend_from_slice(&(self.data.len() as u32).to_le_bytes());
        buf.extend_from_slice(&self.data);
        let crc = crc32fast::hash(&buf);
        buf.extend_from_slice(&crc.to_le_bytes());
        w.write_all(&buf)?;
        Ok(())
    }

    /// Largest section accepted from a stream; bigger means a damaged length.
    pub const MAX_DATA: usize = 256 << 20;

    pub fn read_from(r: &mut impl Read) -> Result<Section> {
        let mut hdr = Vec::new();
        let mut two = [0u8; 2];
        r.read_exact(&mut two)?;
        hdr.extend_from_slice(&two);
        let name_len = u16::from_le_bytes(two) as usize;
        let mut name = vec![0u8; name_len];
        r.read_exact(&mut name)?;
        hdr.extend_from_slice(&name);
        let mut four = [0u8; 4];
        r.read_exact(&mut four)?;
        hdr.extend_from_slice(&four);
        let version = u32::from_le_bytes(four);
        r.read_exact(&mut four)?;
        hdr.extend_from_slice(&four);
        let len = u32::from_le_bytes(four) as usize;
        if len > Self::MAX_DATA {
            return Err(StateError::Damaged(format!("section length {len} is too large")));
        }
        let mut data = vec![0u8; len];
        r.read_exact(&mut data)?;
        r.read_exact(&mut four)?;
        let mut h = crc32fast::Hasher::new();
        h.update(&hdr);
        h.update(&data);
        if h.finalize() != u32::from_le_bytes(four) {
            return Err(StateError::Damaged("section checksum mismatch".into()));
        }
        let name = String::from_utf8(name).map_err(|_| StateError::Damaged("section name is not UTF-8".into()))?;
        Ok(Section { name, version, data })
    }
}

/// Save and restore of one piece of VM state.
///
/// `save` must be called only while the VM is stopped (no vCPU runs, device
/// work is quiesced), so the state is consistent. `restore` replaces the
/// runtime state of an already constructed device with the saved one; the
/// device's configuration (sizes, backends) comes from the VM config and is
/// checked against the state (`StateError::Mismatch`).
pub trait Persist {
    /// Stable instance name used as the section name.
    fn state_name(&self) -> String;
    fn save(&self) -> Result<Section>;
    fn restore(&mut self, section: &Section) -> Result<()>;

    /// The early section: the part of the state that changes slowly (the
    /// objects a device keeps for long, not their runtime state), taken
    /// while the VM runs. A migration sends it ahead, and the destination
    /// builds it with [`prepare`](Self::prepare) before the switch, so
    /// that `restore` has only the changes to make inside the downtime.
    /// `None`: nothing is worth building ahead.
    fn save_early(&self) -> Result<Option<Section>> {
        Ok(None)
    }

    /// The state at a migration's switch, once this migration's
    /// [`save_early`](Self::save_early) section went to a destination that
    /// builds early sections: it may carry only what changed since that
    /// section, which the destination's `restore` applies over the early
    /// section [`prepare`](Self::prepare) received. Save files and
    /// destinations without early sections get [`save`](Self::save).
    fn save_switch(&self) -> Result<Section> {
        self.save()
    }

    /// Destination: builds what an early section of this device describes.
    /// `restore` then takes the whole state and keeps what was built
    /// ahead where the state still has it; whatever the source changed
    /// since is made or dropped there. An error is logged and nothing is
    /// built ahead: `restore` then builds the whole state (and takes or
    /// refuses it at the switch).
    fn prepare(&mut self, _early: &Section) -> Result<()> {
        Ok(())
    }

    /// Destination: the migration failed before `restore`; what `prepare`
    /// built goes.
    fn discard_prepared(&mut self) {}
}

/// A set of sections keyed by name, as moved by save files and migration.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StateSet {
    pub sections: Vec<Section>,
}

impl StateSet {
    pub fn push(&mut self, s: Section) {
        self.sections.push(s);
    }

    pub fn get(&self, name: &str) -> Result<&Section> {
        self.sections.iter().find(|s| s.name == name).ok_or_else(|| StateError::Missing(name.to_string()))
    }

    /// Total encoded size, used by downtime estimates.
    pub fn encoded_len(&self) -> usize {
        self.sections.iter().map(|s| 14 + s.name.len() + s.data.len()).sum()
    }

    pub fn write_to(&self, w: &mut impl Write) -> Result<()> {
        w.write_all(&(self.sections.len() as u32).to_le_bytes())?;
        for s in &self.sections {
            s.write_to(w)?;
        }
        Ok(())
    }

    pub fn read_from(r: &mut impl Read) -> Result<StateSet> {
        let mut four = [0u8; 4];
        r.read_exact(&mut four)?;
        let n = u32::from_le_bytes(four);
        if n > 4096 {
            return Err(StateError::Damaged(format!("{n} sections is too many")));
        }
        let mut set = StateSet::default();
        for _ in 0..n {
            set.push(Section::read_from(r)?);
        }
        Ok(set)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct S {
        a: u64,
        b: Vec<u8>,
    }

    #[test]
    fn section_roundtrip_and_damage() {
        let s = Section::encode("dev0", 3, &S { a: 7, b: vec![1, 2, 3] });
        let mut set = StateSet::default();
        set.push(s.clone());
        let mut buf = Vec::new();
        set.write_to(&mut buf).unwrap();
        let back = StateSet::read_from(&mut buf.as_slice()).unwrap();
        assert_eq!(back, set);
        let d: S = back.get("dev0").unwrap().decode(3).unwrap();
        assert_eq!(d.a, 7);
        assert!(matches!(back.get("dev0").unwrap().decode::<S>(4), Err(StateError::Version { .. })));
        assert!(matches!(back.get("nope"), Err(StateError::Missing(_))));
        // Flip one byte of the payload: the checksum must catch it.
        let mut bad = buf.clone();
        let i = bad.len() - 6;
        bad[i] ^= 0x40;
        assert!(matches!(StateSet::read_from(&mut bad.as_slice()), Err(StateError::Damaged(_))));
        // Truncation is an I/O error, never a panic.
        assert!(StateSet::read_from(&mut &buf[..buf.len() - 3]).is_err());
    }
}
