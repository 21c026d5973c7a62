//! The completion worker's hand-offs on a buffered file: writes that
//! io_uring finishes asynchronously (on file systems without non-blocking
//! buffered writes) alternating with reads that finish inline, so the worker
//! moves between waiting on the ring and sleeping on its condition variable.

use super::harness::setup;

#[test]
fn writes_and_reads_alternate_without_losing_a_completion() {
    // Next to the test binary: a real file system (tmpfs may finish every
    // write inline and never wake the worker).
    let dir = std::env::current_exe().unwrap().parent().unwrap().join(format!("nvme-worker-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("disk.img");
    std::fs::File::create(&path).unwrap().set_len(4 << 20).unwrap();
    {
        let mut d = setup(&format!("ns=file:{},queues=2", path.display()), 64 << 20);
        d.create_io_queues(1, 64).unwrap();
        let bufs: Vec<u64> = (0..8).map(|_| d.alloc(4096)).collect();
        let blocks = (4u64 << 20) / 4096;
        let mut seq = 0u64;
        for phase in 0..6u64 {
            let qd = if phase < 3 { 1 } else { 8 };
            // Writes: a block-and-sequence pattern in every 8-byte word.
            let mut written = Vec::new();
            for round in 0..40u64 {
                for (i, &b) in bufs.iter().take(qd).enumerate() {
                    seq += 1;
                    let lba = (phase * 997 + round * 31 + i as u64 * 7) % blocks;
                    let data: Vec<u8> = (0..512u64).flat_map(|w| (lba << 40 | seq << 8 | w).to_le_bytes()).collect();
                    d.write_mem(b, &data);
                    let mut c = d.rw_cmd(true, 1, lba * 8, 8, b, 4096, None);
                    c.cid = i as u16 + 1;
                    d.push(1, &c);
                    written.retain(|(l, _): &(u64, Vec<u8>)| *l != lba);
                    written.push((lba, data));
                }
                d.ring(1);
                for _ in 0..qd {
                    let c = d.wait(1).expect("write completes");
                    assert!(c.status.is_success(), "write failed: {:?}", c.status);
                }
            }
            // Reads (page-cache hits, finished inline) of what was written.
            for (lba, data) in &written {
                let c = d.rw_cmd(false, 1, lba * 8, 8, bufs[0], 4096, None);
                assert!(d.io_cmd(1, c).status.is_success());
                assert_eq!(&d.read_mem(bufs[0], 4096), data, "block {lba} after phase {phase}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pause_mid_buffered_writes_finishes_each_exactly_once() {
    use crate::Lifecycle;
    let dir = std::env::current_exe().unwrap().parent().unwrap().join(format!("nvme-worker-pause-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("disk.img");
    std::fs::File::create(&path).unwrap().set_len(8 << 20).unwrap();
    {
        let mut d = setup(&format!("ns=file:{},queues=4", path.display()), 64 << 20);
        d.create_io_queues(4, 64).unwrap();
        let per_q = 48u64;
        let buf = d.alloc(4 * per_q * 4096);
        for round in 0..5u64 {
            for q in 1..=4usize {
                for i in 0..per_q {
                    let slot = (q as u64 - 1) * per_q + i;
                    let data: Vec<u8> = (0..512u64).flat_map(|w| (round << 48 | slot << 16 | w).to_le_bytes()).collect();
                    d.write_mem(buf + slot * 4096, &data);
                    let mut c = d.rw_cmd(true, 1, slot * 8, 8, buf + slot * 4096, 4096, None);
                    c.cid = i as u16;
                    d.push(q, &c);
                }
                d.ring(q);
            }
            // Writes are queued for the worker and one may be under way
            // without the lock: pause must finish every one of them.
            {
                let mut dev = d.dev.lock().unwrap();
                eprintln!("in flight at pause: {}", dev.stats()["inflight"]);
                dev.pause();
                assert_eq!(dev.stats()["inflight"], 0, "pause leaves nothing in flight");
                dev.resume();
            }
            for q in 1..=4usize {
                let mut seen = vec![0u32; per_q as usize];
                for _ in 0..per_q {
                    let c = d.wait(q).expect("write completes");
                    assert!(c.status.is_success(), "{:?}", c.status);
                    seen[c.cid as usize] += 1;
                }
                assert!(seen.iter().all(|&n| n == 1), "queue {q}: each write completes once: {seen:?}");
                assert!(d.poll(q).is_none(), "no extra completion on queue {q}");
            }
            let read_buf = d.alloc(4096);
            for slot in (0..4 * per_q).step_by(7) {
                let c = d.rw_cmd(false, 1, slot * 8, 8, read_buf, 4096, None);
                assert!(d.io_cmd(1, c).status.is_success());
                let want: Vec<u8> = (0..512u64).flat_map(|w| (round << 48 | slot << 16 | w).to_le_bytes()).collect();
                assert_eq!(d.read_mem(read_buf, 4096), want, "block {slot} round {round}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
