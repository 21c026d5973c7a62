//! Debug console on port 0xE9: the guest writes bytes, the vmm logs lines.

use crate::bus::BusDevice;
use snapshot::{Persist, Result, Section};
use std::io::Write;
use std::sync::{Arc, Mutex};

/// Where finished console lines go (the VM log, and a copy kept for tests
/// and for `query-console`).
pub type LineSink = Box<dyn FnMut(&str) + Send>;

pub struct DebugConsole {
    partial: Vec<u8>,
    sink: LineSink,
    /// Last lines, for the control API.
    history: Arc<Mutex<Vec<String>>>,
}

const HISTORY_LINES: usize = 256;
/// A guest that never sends a newline must not grow the buffer forever.
const MAX_LINE: usize = 4096;

impl DebugConsole {
    pub fn new(sink: LineSink) -> Self {
        DebugConsole { partial: Vec::new(), sink, history: Arc::default() }
    }

    /// Writes every line to `out` (the VM's log file or stderr).
    pub fn to_writer(mut out: impl Write + Send + 'static) -> Self {
        Self::new(Box::new(move |line| {
            let _ = writeln!(out, "{line}");
            let _ = out.flush();
        }))
    }

    pub fn history(&self) -> Arc<Mutex<Vec<String>>> {
        self.history.clone()
    }

    fn flush_line(&mut self) {
        let line = String::from_utf8_lossy(&self.partial).into_owned();
        self.partial.clear();
        (self.sink)(&line);
        let mut h = self.history.lock().unwrap();
        if h.len() == HISTORY_LINES {
            h.remove(0);
        }
        h.push(line);
    }
}

impl BusDevice for DebugConsole {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // QEMU's debugcon reads back 0xE9 so guests can detect it.
        data.fill(0xE9);
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        for &b in data.iter().take(1) {
            match b {
                b'\n' => self.flush_line(),
                b'\r' => {}
                _ => {
                    self.partial.push(b);
                    if self.partial.len() >= MAX_LINE {
                        self.flush_line();
                    }
                }
            }
        }
    }
}

impl Persist for DebugConsole {
    fn state_name(&self) -> String {
        "console".into()
    }
    fn save(&self) -> Result<Section> {
        Ok(Section::encode("console", 1, &self.partial))
    }
    fn restore(&mut self, s: &Section) -> Result<()> {
        self.partial = s.decode(1)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_and_partial_state() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        let mut c = DebugConsole::new(Box::new(move |l| g.lock().unwrap().push(l.to_string())));
        for b in b"hello\nwor" {
            c.write(0, &[*b]);
        }
        let saved = c.save().unwrap();
        let g2 = got.clone();
        let mut d = DebugConsole::new(Box::new(move |l| g2.lock().unwrap().push(l.to_string())));
        d.restore(&saved).unwrap();
        for b in b"ld\n" {
            d.write(0, &[*b]);
        }
        assert_eq!(*got.lock().unwrap(), vec!["hello".to_string(), "world".to_string()]);
    }
}
