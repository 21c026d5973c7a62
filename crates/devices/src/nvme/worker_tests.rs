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
