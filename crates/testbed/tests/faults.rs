//! Faults really happen: counted with numbered UDP datagrams between two hosts.
//! Bounds are loose (many standard deviations) and nothing depends on timing.

use std::net::UdpSocket;
use std::time::Duration;
use testbed::{Testbed, TestbedOpts};

/// Sends datagrams 0..n from host `from` to host `to` over NIC `nic`; returns the
/// sequence numbers received, in arrival order.
fn udp_run(tb: &Testbed, from: usize, to: usize, nic: usize, n: u32) -> Vec<u32> {
    let dst = tb.host(to).addr(nic);
    let rx = tb.host(to).in_netns(|| UdpSocket::bind((dst, 0)).unwrap()).unwrap();
    // A big buffer keeps the receiver from dropping.
    nix::sys::socket::setsockopt(&rx, nix::sys::socket::sockopt::RcvBufForce, &(16 << 20)).expect("SO_RCVBUFFORCE (tests run as root)");
    rx.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let port = rx.local_addr().unwrap().port();
    let src = tb.host(from).addr(nic);
    let tx = tb.host(from).in_netns(|| UdpSocket::bind((src, 0)).unwrap()).unwrap();
    let receiver = std::thread::spawn(move || {
        let mut got = Vec::new();
        let mut buf = [0u8; 2048];
        while let Ok(len) = rx.recv(&mut buf) {
            assert_eq!(len, 200);
            got.push(u32::from_be_bytes(buf[..4].try_into().unwrap()));
        }
        got
    });
    let mut msg = [0u8; 200];
    for i in 0..n {
        msg[..4].copy_from_slice(&i.to_be_bytes());
        tx.send_to(&msg, (dst, port)).unwrap();
        // Pacing keeps queues short; only order and counts are checked, never time.
        std::thread::sleep(Duration::from_micros(50));
    }
    receiver.join().unwrap()
}

fn unique(got: &[u32]) -> usize {
    let mut v = got.to_vec();
    v.sort_unstable();
    v.dedup();
    v.len()
}

/// Pairs (i, j), i before j in arrival order, with seq[i] > seq[j]: "late" packets
/// counted by how far they fell behind would be timing; this only counts order.
fn overtaken(got: &[u32]) -> usize {
    let mut max_seen = None;
    let mut late = 0;
    for &s in got {
        match max_seen {
            Some(m) if s < m => late += 1,
            _ => max_seen = Some(s),
        }
    }
    late
}

#[test]
fn clean_link_delivers_everything_in_order() {
    let tb = Testbed::create(TestbedOpts::new("tb-clean", 2)).unwrap();
    let got = udp_run(&tb, 0, 1, 0, 1000);
    assert_eq!(got, (0..1000).collect::<Vec<_>>());
}

#[test]
fn loss_drops_about_the_asked_fraction() {
    let tb = Testbed::create(TestbedOpts::new("tb-loss", 2)).unwrap();
    tb.set_loss(0, 0, 20.0).unwrap();
    let n = 2000;
    let got = udp_run(&tb, 0, 1, 0, n);
    let lost = n as usize - got.len();
    // Expected 400, standard deviation ~18.
    assert!((250..=550).contains(&lost), "lost {lost} of {n} at 20%");
    assert_eq!(unique(&got), got.len(), "loss must not duplicate");
    assert_eq!(tb.fault_count(0, 0, "loss").unwrap(), lost as u64, "every missing datagram was dropped by the rule");
    // The other direction is lossy too; removing the loss heals both.
    let back = udp_run(&tb, 1, 0, 0, 1000);
    assert!(back.len() < 950, "received {} of 1000 towards the lossy host", back.len());
    tb.set_loss(0, 0, 0.0).unwrap();
    assert_eq!(udp_run(&tb, 0, 1, 0, 1000).len(), 1000);
    assert_eq!(tb.fault_count(0, 0, "loss").unwrap(), 0);
}

#[test]
fn rate_is_applied_at_both_ends_and_removed() {
    let tb = Testbed::create(TestbedOpts::new("tb-rate", 2).nics(2).rate_mbit(200)).unwrap();
    for h in 0..2 {
        for k in 0..2 {
            assert_eq!(tb.rate(h, k).unwrap(), Some(200));
        }
    }
    tb.set_rate(1, 1, Some(50)).unwrap();
    assert_eq!(tb.rate(1, 1).unwrap(), Some(50));
    assert_eq!(tb.rate(1, 0).unwrap(), Some(200), "other NICs keep their rate");
    let fab = std::process::Command::new("tc").args(["-n", &tb.fabric(), "qdisc", "show", "dev", "h1e1"]).output().unwrap();
    let fab = String::from_utf8_lossy(&fab.stdout);
    assert!(fab.contains("tbf") && fab.contains("rate 50Mbit"), "the receiving direction is shaped too: {fab}");
    // Traffic still flows through the shaper.
    assert_eq!(udp_run(&tb, 0, 1, 1, 300).len(), 300);
    tb.set_rate(1, 1, None).unwrap();
    assert_eq!(tb.rate(1, 1).unwrap(), None);
    assert!(tb.set_rate(1, 1, Some(0)).is_err());
    assert!(tb.set_rate(2, 0, Some(10)).is_err(), "no host 2");
    assert!(tb.set_rate(0, 2, Some(10)).is_err(), "no NIC 2");
}

#[test]
fn per_host_rates_at_creation() {
    let tb = Testbed::create(TestbedOpts::new("tb-hrate", 3).rate_mbit(300).host_rate(2, 40)).unwrap();
    assert_eq!(tb.rate(0, 0).unwrap(), Some(300));
    assert_eq!(tb.rate(2, 0).unwrap(), Some(40));
    let none = Testbed::create(TestbedOpts::new("tb-hrate", 2).host_rate(1, 10)).unwrap();
    assert_eq!(none.rate(0, 0).unwrap(), None);
    assert_eq!(none.rate(1, 0).unwrap(), Some(10));
}

#[test]
fn duplication_sends_about_the_asked_fraction_twice() {
    let tb = Testbed::create(TestbedOpts::new("tb-dup", 2)).unwrap();
    tb.set_dup(0, 0, 25.0).unwrap();
    let n = 2000;
    let got = udp_run(&tb, 0, 1, 0, n);
    assert_eq!(unique(&got), n as usize, "duplication loses nothing");
    let dups = got.len() - n as usize;
    // Expected 500, standard deviation ~19; a copy is never copied again.
    assert!((350..=650).contains(&dups), "{dups} duplicates of {n} at 25%");
    assert_eq!(tb.fault_count(0, 0, "dup").unwrap(), dups as u64);
    tb.set_dup(0, 0, 0.0).unwrap();
    assert_eq!(udp_run(&tb, 0, 1, 0, 500).len(), 500);
}

#[test]
fn reordering_makes_later_packets_overtake() {
    let tb = Testbed::create(TestbedOpts::new("tb-reorder", 2)).unwrap();
    tb.set_reorder(0, 0, 10.0, Duration::from_millis(200)).unwrap();
    let n = 2000;
    let got = udp_run(&tb, 0, 1, 0, n);
    assert_eq!(got.len(), n as usize, "reordering neither loses nor duplicates");
    assert_eq!(unique(&got), n as usize);
    let late = overtaken(&got);
    // Expected ~200 held back; each is overtaken unless it is among the very last.
    assert!((100..=320).contains(&late), "{late} of {n} arrived after a later one at 10%");
    assert_eq!(tb.fault_count(0, 0, "reorder").unwrap(), tb.reordered(0, 0));
    // The receiver waited 2 s past the last datagram: every held one was sent again.
    assert_eq!(tb.reordered_released(0, 0), tb.reordered(0, 0));
    tb.set_reorder(0, 0, 0.0, Duration::ZERO).unwrap();
    let got = udp_run(&tb, 0, 1, 0, 500);
    assert_eq!(overtaken(&got), 0);
    assert_eq!(got.len(), 500);
}

#[test]
fn reordering_keeps_tcp_working() {
    use std::io::{Read, Write};
    let tb = Testbed::create(TestbedOpts::new("tb-reotcp", 2)).unwrap();
    // 30 %: TCP hands the NIC large GSO packets (up to 64 KB), so there are few of them.
    tb.set_reorder(0, 0, 30.0, Duration::from_millis(5)).unwrap();
    let a = tb.host(1).addr(0);
    let l = tb.host(1).in_netns(|| std::net::TcpListener::bind((a, 7002)).unwrap()).unwrap();
    let mut s = tb.host(0).in_netns(|| std::net::TcpStream::connect((a, 7002)).unwrap()).unwrap();
    let (mut c, _) = l.accept().unwrap();
    let data: Vec<u8> = (0..4_000_000u32).map(|i| (i % 251) as u8).collect();
    let sender = {
        let d = data.clone();
        std::thread::spawn(move || {
            s.write_all(&d).unwrap();
        })
    };
    let mut got = vec![0u8; data.len()];
    c.read_exact(&mut got).unwrap();
    sender.join().unwrap();
    assert!(got == data, "TCP stream intact through reordering");
    assert!(tb.reordered(0, 0) > 0, "some segments were held back");
}

#[test]
fn held_packets_are_counted_before_their_delay_ends() {
    let tb = Testbed::create(TestbedOpts::new("tb-reoheld", 2)).unwrap();
    // Held far longer than the test looks: a count made on release would read 0.
    tb.set_reorder(0, 0, 50.0, Duration::from_secs(10)).unwrap();
    let dst = tb.host(1).addr(0);
    let tx = tb.host(0).in_netns(|| UdpSocket::bind((tb.host(0).addr(0), 0)).unwrap()).unwrap();
    for i in 0..200u32 {
        tx.send_to(&i.to_be_bytes(), (dst, 9)).unwrap();
    }
    let chosen = tb.fault_count(0, 0, "reorder").unwrap();
    assert!(chosen > 50, "{chosen} of 200 chosen at 50%");
    assert_eq!(tb.reordered(0, 0), chosen, "every chosen packet is counted at once");
    assert_eq!(tb.reordered_released(0, 0), 0, "none is due yet");
}

#[test]
fn link_down_cuts_and_link_up_restores() {
    let tb = Testbed::create(TestbedOpts::new("tb-link", 2)).unwrap();
    tb.link_down(1, 0).unwrap();
    assert!(udp_run(&tb, 0, 1, 0, 100).is_empty());
    tb.link_up(1, 0).unwrap();
    assert_eq!(udp_run(&tb, 0, 1, 0, 100).len(), 100);
    // The host kept its address through the cut.
    assert!(tb.host(1).sh("ip -4 -o addr show dev eth0").unwrap().contains(&tb.host(1).addr(0).to_string()));
}
