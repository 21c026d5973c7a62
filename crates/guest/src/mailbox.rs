//! The guest side of the mailbox page (crates/devices/src/mailbox.rs): one
//! message out to whoever holds the VM's control socket, one message in.

use crate::hw::{mmio_read32, mmio_write32};

const MAGIC: u32 = 0x3158_424d;
const REG_MAGIC: u64 = 0x000;
const REG_MSG_MAX: u64 = 0x004;
const REG_G2H_LEN: u64 = 0x008;
const REG_G2H_SEQ: u64 = 0x00c;
const REG_H2G_LEN: u64 = 0x010;
const REG_H2G_SEQ: u64 = 0x014;
const G2H_DATA: u64 = 0x100;
const H2G_DATA: u64 = 0x800;
/// Offset of the mailbox page from the start of the MMIO window.
const PAGE_OFFSET: u64 = 0x1000;

#[derive(Clone, Copy)]
pub struct Mailbox {
    base: u64,
    seq: u32,
}

impl Mailbox {
    pub fn find(mmio_base: u64) -> Option<Mailbox> {
        let base = mmio_base + PAGE_OFFSET;
        (mmio_read32(base + REG_MAGIC) == MAGIC).then_some(Mailbox { base, seq: 0 })
    }

    /// Publishes `msg` (cut at the device's limit) as the next guest message.
    pub fn publish(&mut self, msg: &[u8]) {
        let max = mmio_read32(self.base + REG_MSG_MAX) as usize;
        let msg = &msg[..msg.len().min(max)];
        for (i, c) in msg.chunks(4).enumerate() {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            mmio_write32(self.base + G2H_DATA + 4 * i as u64, u32::from_le_bytes(w));
        }
        mmio_write32(self.base + REG_G2H_LEN, msg.len() as u32);
        self.seq = self.seq.wrapping_add(1).max(1);
        mmio_write32(self.base + REG_G2H_SEQ, self.seq);
    }

    /// The host's message if its sequence number is above `after`: copied
    /// into `buf`, returned with its sequence number. The sequence is read
    /// before and after the bytes, so a message the host replaced meanwhile
    /// is read again.
    pub fn host_message(&self, after: u32, buf: &mut [u8]) -> Option<(u32, usize)> {
        loop {
            let seq = mmio_read32(self.base + REG_H2G_SEQ);
            if seq <= after {
                return None;
            }
            let len = (mmio_read32(self.base + REG_H2G_LEN) as usize).min(buf.len());
            for i in (0..len).step_by(4) {
                let w = mmio_read32(self.base + H2G_DATA + i as u64).to_le_bytes();
                let n = (len - i).min(4);
                buf[i..i + n].copy_from_slice(&w[..n]);
            }
            if mmio_read32(self.base + REG_H2G_SEQ) == seq {
                return Some((seq, len));
            }
        }
    }

    /// Waits (polling) for a host message newer than `after`.
    pub fn wait_host(&self, after: u32, buf: &mut [u8]) -> (u32, usize) {
        loop {
            if let Some(r) = self.host_message(after, buf) {
                return r;
            }
            core::hint::spin_loop();
        }
    }
}

/// A `core::fmt::Write` into a fixed buffer (messages are formatted text).
pub struct TextBuf<const N: usize> {
    pub buf: [u8; N],
    pub len: usize,
}

impl<const N: usize> TextBuf<N> {
    pub const fn new() -> Self {
        TextBuf { buf: [0; N], len: 0 }
    }
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl<const N: usize> core::fmt::Write for TextBuf<N> {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        let b = s.as_bytes();
        if self.len + b.len() > N {
            return Err(core::fmt::Error);
        }
        self.buf[self.len..self.len + b.len()].copy_from_slice(b);
        self.len += b.len();
        Ok(())
    }
}

/// `workload=mailbox`: publishes `hello`, then answers every host message
/// with `echo <n> <message>`, and counts answers as progress.
pub fn echo(plat: crate::hw::Platform, mmio_base: u64) -> ! {
    use core::fmt::Write;
    let Some(mut mb) = Mailbox::find(mmio_base) else {
        println!("mailbox: no mailbox page");
        plat.exit(1)
    };
    mb.publish(b"hello");
    println!("mailbox: published hello");
    let mut seen = 0;
    let mut n = 0u64;
    let mut buf = [0u8; 0x700];
    loop {
        let (seq, len) = mb.wait_host(seen, &mut buf);
        let msg = &buf[..len];
        seen = seq;
        n += 1;
        let mut out = TextBuf::<0x780>::new();
        let _ = write!(out, "echo {n} {}", core::str::from_utf8(msg).unwrap_or("<not utf-8>"));
        mb.publish(out.as_bytes());
        plat.progress(n);
    }
}
