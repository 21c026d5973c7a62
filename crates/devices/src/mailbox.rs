//! The mailbox: an out-of-band channel between the guest and whoever holds
//! the VM's control socket, as a guest agent channel would be. The guest has
//! no TCP/IP stack, yet its RDMA peer must learn its GID, QPNs, rkeys and
//! buffer addresses, and the guest must learn the peer's: each side writes
//! one message, the other reads it (`mailbox-read` / `mailbox-write`).
//!
//! One MMIO page (`layout::MAILBOX_ADDR`), 32-bit little-endian registers:
//!
//! | offset | access | meaning |
//! |--------|--------|---------|
//! | 0x000  | R      | magic `MBX1` (0x3158_424d) |
//! | 0x004  | R      | largest message, bytes ([`MSG_MAX`]) |
//! | 0x008  | RW     | guest message length |
//! | 0x00c  | RW     | guest message sequence: writing it publishes the message |
//! | 0x010  | R      | host message length |
//! | 0x014  | R      | host message sequence: bumped by every host write |
//! | 0x100  | RW     | guest message bytes, [`MSG_MAX`] of them |
//! | 0x800  | R      | host message bytes, [`MSG_MAX`] of them |
//!
//! The guest writes its bytes and length, then the sequence register; only
//! then does the host see the new message, whole (it reads a copy made at
//! that moment, so half-written bytes are never seen). The host's message
//! changes in one step under the device lock; the guest reads the host
//! sequence before and after the bytes and retries if it moved. A guest
//! length above [`MSG_MAX`] is clamped; reads outside the registers return
//! all ones, writes there are ignored.

use crate::bus::BusDevice;
use serde::{Deserialize, Serialize};
use snapshot::{Persist, Result, Section};

pub const MAGIC: u32 = 0x3158_424d; // "MBX1"
pub const MSG_MAX: usize = 0x700;

pub const REG_MAGIC: u64 = 0x000;
pub const REG_MSG_MAX: u64 = 0x004;
pub const REG_G2H_LEN: u64 = 0x008;
pub const REG_G2H_SEQ: u64 = 0x00c;
pub const REG_H2G_LEN: u64 = 0x010;
pub const REG_H2G_SEQ: u64 = 0x014;
pub const G2H_DATA: u64 = 0x100;
pub const H2G_DATA: u64 = 0x800;
pub const SIZE: u64 = 0x1000;

/// One published message.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// 0 while nothing was ever published.
    pub seq: u32,
    pub data: Vec<u8>,
}

#[derive(Default, Serialize, Deserialize)]
pub struct Mailbox {
    /// What the guest is writing, not yet published.
    staging: Vec<u8>,
    staging_len: u32,
    /// The guest's last published message.
    guest: Message,
    /// The host's message.
    host: Message,
}

impl Mailbox {
    pub fn new() -> Self {
        Mailbox { staging: vec![0; MSG_MAX], ..Default::default() }
    }

    /// The guest's last published message.
    pub fn guest_message(&self) -> Message {
        self.guest.clone()
    }

    /// Replaces the host's message; returns its sequence number.
    pub fn write_host(&mut self, data: &[u8]) -> std::result::Result<u32, String> {
        if data.len() > MSG_MAX {
            return Err(format!("a mailbox message holds at most {MSG_MAX} bytes (got {})", data.len()));
        }
        self.host.data = data.to_vec();
        self.host.seq = self.host.seq.wrapping_add(1).max(1);
        Ok(self.host.seq)
    }

    pub fn host_message(&self) -> Message {
        self.host.clone()
    }
}

fn put(data: &mut [u8], v: u32) {
    let b = v.to_le_bytes();
    let n = data.len().min(4);
    data[..n].copy_from_slice(&b[..n]);
    data[n..].fill(0);
}

fn get(data: &[u8]) -> u32 {
    let mut b = [0u8; 4];
    let n = data.len().min(4);
    b[..n].copy_from_slice(&data[..n]);
    u32::from_le_bytes(b)
}

/// The bytes of `buf` at `off`, as many as `data` wants and `buf` has.
fn read_bytes(buf: &[u8], off: usize, data: &mut [u8]) {
    data.fill(0);
    if off < buf.len() {
        let n = data.len().min(buf.len() - off);
        data[..n].copy_from_slice(&buf[off..off + n]);
    }
}

impl BusDevice for Mailbox {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match offset {
            REG_MAGIC => put(data, MAGIC),
            REG_MSG_MAX => put(data, MSG_MAX as u32),
            REG_G2H_LEN => put(data, self.staging_len),
            REG_G2H_SEQ => put(data, self.guest.seq),
            REG_H2G_LEN => put(data, self.host.data.len() as u32),
            REG_H2G_SEQ => put(data, self.host.seq),
            o if (G2H_DATA..G2H_DATA + MSG_MAX as u64).contains(&o) => read_bytes(&self.staging, (o - G2H_DATA) as usize, data),
            o if (H2G_DATA..H2G_DATA + MSG_MAX as u64).contains(&o) => read_bytes(&self.host.data, (o - H2G_DATA) as usize, data),
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match offset {
            REG_G2H_LEN => self.staging_len = get(data).min(MSG_MAX as u32),
            REG_G2H_SEQ => {
                self.guest = Message { seq: get(data), data: self.staging[..self.staging_len as usize].to_vec() };
            }
            o if (G2H_DATA..G2H_DATA + MSG_MAX as u64).contains(&o) => {
                let off = (o - G2H_DATA) as usize;
                let n = data.len().min(MSG_MAX - off);
                self.staging[off..off + n].copy_from_slice(&data[..n]);
            }
            _ => {}
        }
    }
}

impl Persist for Mailbox {
    fn state_name(&self) -> String {
        "mailbox".into()
    }
    fn save(&self) -> Result<Section> {
        Ok(Section::encode("mailbox", 1, self))
    }
    fn restore(&mut self, s: &Section) -> Result<()> {
        let mut m: Mailbox = s.decode(1)?;
        // A damaged or foreign state must not give the registers bad sizes.
        m.staging.resize(MSG_MAX, 0);
        m.staging_len = m.staging_len.min(MSG_MAX as u32);
        m.guest.data.truncate(MSG_MAX);
        m.host.data.truncate(MSG_MAX);
        *self = m;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rd(m: &mut Mailbox, off: u64) -> u32 {
        let mut b = [0u8; 4];
        m.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    /// How the guest writes: 4-byte stores (the unicorn vCPU splits wider ones).
    fn guest_publish(m: &mut Mailbox, msg: &[u8], seq: u32) {
        for (i, c) in msg.chunks(4).enumerate() {
            m.write(G2H_DATA + 4 * i as u64, c);
        }
        m.write(REG_G2H_LEN, &(msg.len() as u32).to_le_bytes());
        m.write(REG_G2H_SEQ, &seq.to_le_bytes());
    }

    fn guest_read(m: &mut Mailbox) -> (u32, Vec<u8>) {
        let seq = rd(m, REG_H2G_SEQ);
        let len = rd(m, REG_H2G_LEN) as usize;
        let mut v = vec![0u8; len.div_ceil(4) * 4];
        for (i, c) in v.chunks_mut(4).enumerate() {
            m.read(H2G_DATA + 4 * i as u64, c);
        }
        v.truncate(len);
        (seq, v)
    }

    #[test]
    fn both_directions_and_state() {
        let mut m = Mailbox::new();
        assert_eq!(rd(&mut m, REG_MAGIC), MAGIC);
        assert_eq!(m.guest_message(), Message::default());
        // Bytes written but not published stay invisible to the host.
        m.write(G2H_DATA, b"half");
        m.write(REG_G2H_LEN, &4u32.to_le_bytes());
        assert_eq!(m.guest_message().seq, 0);
        guest_publish(&mut m, b"gid=10.0.0.5 qpn=17", 1);
        assert_eq!(m.guest_message(), Message { seq: 1, data: b"gid=10.0.0.5 qpn=17".to_vec() });

        assert_eq!(m.write_host(b"peer qpn=99").unwrap(), 1);
        assert_eq!(guest_read(&mut m), (1, b"peer qpn=99".to_vec()));
        assert!(m.write_host(&vec![b'x'; MSG_MAX + 1]).is_err());
        assert_eq!(m.host_message().seq, 1);

        let saved = m.save().unwrap();
        let mut n = Mailbox::new();
        n.restore(&saved).unwrap();
        assert_eq!(n.guest_message(), m.guest_message());
        assert_eq!(guest_read(&mut n), (1, b"peer qpn=99".to_vec()));
        assert_eq!(n.write_host(b"again").unwrap(), 2);
    }

    #[test]
    fn bad_guest_accesses_harm_nothing() {
        let mut m = Mailbox::new();
        m.write(REG_G2H_LEN, &u32::MAX.to_le_bytes());
        assert_eq!(rd(&mut m, REG_G2H_LEN), MSG_MAX as u32);
        // A store straddling the end of the guest area is cut at the end.
        m.write(G2H_DATA + MSG_MAX as u64 - 2, &[1, 2, 3, 4]);
        m.write(REG_G2H_SEQ, &7u32.to_le_bytes());
        let g = m.guest_message();
        assert_eq!((g.seq, g.data.len(), &g.data[MSG_MAX - 2..]), (7, MSG_MAX, &[1u8, 2][..]));
        m.write(0xffc, &[9; 4]);
        m.write(REG_MAGIC, &[0; 4]);
        assert_eq!(rd(&mut m, REG_MAGIC), MAGIC);
        assert_eq!(rd(&mut m, 0xffc), u32::MAX);
        let mut b = [0u8; 4];
        m.read(H2G_DATA + MSG_MAX as u64 - 1, &mut b);
        assert_eq!(b, [0; 4]);
    }
}
