//! Mutated sessions against the NVMe/TCP target: the byte streams of a well-behaved host
//! (recorded through a proxy) with bits flipped, fields set to edge values, PDUs dropped,
//! repeated, swapped or cut short, replayed on fresh connections. The target must never
//! panic (a panic on a reactor thread would only end that connection's task, so a hook
//! counts them) and must go on serving a well-behaved host. `BASALT_FUZZ_ROUNDS` sets the
//! number of mutated sessions (default 300); a failure names its round, whose mutation is
//! a function of the round alone.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use basalt_io::Reactors;
use basalt_nvmf::command::*;
use basalt_nvmf::host::{Host, HostOptions};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

mod support;
use support::*;

/// Panics seen on the fuzzed target's reactor threads.
static REACTOR_PANICS: AtomicUsize = AtomicUsize::new(0);
const REACTOR_NAME: &str = "fuzzed";

/// The host-to-target bytes of each connection made through a recording proxy, in the
/// order the connections were accepted.
type Recorded = Arc<Mutex<Vec<Arc<Mutex<Vec<u8>>>>>>;

/// A proxy in front of `target` that records what each connection sends to it.
async fn recording_proxy(target: SocketAddr) -> (SocketAddr, Recorded) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let recorded: Recorded = Arc::default();
    let streams = recorded.clone();
    tokio::spawn(async move {
        while let Ok((host_side, _)) = listener.accept().await {
            let record = Arc::new(Mutex::new(Vec::new()));
            streams.lock().expect("lock").push(record.clone());
            let target_side = TcpStream::connect(target).await.expect("connect");
            let _ = host_side.set_nodelay(true);
            let _ = target_side.set_nodelay(true);
            let (mut host_read, mut host_write) = host_side.into_split();
            let (mut target_read, mut target_write) = target_side.into_split();
            tokio::spawn(async move {
                let mut buffer = vec![0u8; 1 << 20];
                while let Ok(n @ 1..) = host_read.read(&mut buffer).await {
                    record.lock().expect("lock").extend_from_slice(&buffer[..n]);
                    if target_write.write_all(&buffer[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = target_write.shutdown().await;
            });
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut target_read, &mut host_write).await;
                let _ = host_write.shutdown().await;
            });
        }
    });
    (address, recorded)
}

/// Splits a stream into its PDUs by their PLEN.
fn split_pdus(stream: &[u8]) -> Vec<Vec<u8>> {
    let mut pdus = Vec::new();
    let mut at = 0;
    while at + 8 <= stream.len() {
        let plen = u32::from_le_bytes(stream[at + 4..at + 8].try_into().expect("4 bytes"));
        let end = (at + plen as usize).min(stream.len());
        pdus.push(stream[at..end].to_vec());
        at = end;
    }
    pdus
}

/// What a well-behaved host sends, with header and data digests or without: an admin
/// queue's and an I/O queue's streams, as PDUs. The session touches every command the
/// target serves, with writes both in the capsule and after an R2T.
async fn record_session(target: SocketAddr, digests: bool) -> Session {
    let (proxy, recorded) = recording_proxy(target).await;
    let options = HostOptions {
        io_queues: 1,
        header_digest: digests,
        data_digest: digests,
        ..HostOptions::default()
    };
    let host = Host::connect(proxy, NQN, options).await.expect("connect");
    for cns in [
        CNS_NAMESPACE,
        CNS_CONTROLLER,
        CNS_ACTIVE_NAMESPACES,
        CNS_NAMESPACE_DESCRIPTORS,
    ] {
        host.identify(cns, 1).await.expect("identify");
    }
    for log in [
        LOG_ERROR,
        LOG_HEALTH,
        LOG_FIRMWARE_SLOT,
        LOG_CHANGED_NAMESPACES,
        LOG_COMMAND_EFFECTS,
    ] {
        host.log_page(log, 0, 512, false).await.expect("log page");
    }
    for feature in [0x06, 0x07, 0x0b, 0x0f] {
        let _ = host.get_feature(feature, 0, 0).await;
    }
    let keep_alive = Sqe {
        opcode: ADMIN_KEEP_ALIVE,
        ..Sqe::default()
    };
    host.admin(keep_alive, Vec::new(), 0)
        .await
        .expect("keep alive");
    // A read of a never-written block, then one of this session's writes, so that the
    // mutations meet reads that carry data.
    host.read(0, 1, 100, 1, BLOCK).await.expect("read");
    read_write_cycle(&host, 0, 8, 2048, 1).await;
    read_write_cycle(&host, 0, 64, 64 << 10, 2).await;
    host.write(0, 1, 200, pattern(3, 4096), BLOCK, true)
        .await
        .expect("fua write");
    host.flush(0, 1).await.expect("flush");
    host.write_zeroes(0, 1, 300, 16, false)
        .await
        .expect("write zeroes");
    host.deallocate(0, 1, &[(400, 32)])
        .await
        .expect("deallocate");
    drop(host);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let streams = recorded.lock().expect("lock").clone();
    assert_eq!(streams.len(), 2, "an admin and an I/O connection");
    let admin = split_pdus(&streams[0].lock().expect("lock"));
    let io = split_pdus(&streams[1].lock().expect("lock"));
    assert!(
        admin.len() >= 16 && io.len() >= 10,
        "a whole session recorded: {} admin and {} I/O PDUs",
        admin.len(),
        io.len()
    );
    Session { admin, io, digests }
}

/// A recorded session.
struct Session {
    admin: Vec<Vec<u8>>,
    io: Vec<Vec<u8>>,
    digests: bool,
}

/// xorshift64*: the mutations of a round are a function of the round alone.
struct Rng(u64);

impl Rng {
    fn new(round: u64) -> Self {
        Self(round.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Values that cross the limits a decoder checks.
const EDGES: [u32; 10] = [
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0xffff,
    0x1_0000,
    0x7fff_ffff,
    0x8000_0000,
    u32::MAX,
];

/// A byte of `pdu` to change: mostly in its header (HLEN, byte 2), where the fields a
/// target checks sit; now and then anywhere.
fn position(pdu: &[u8], rng: &mut Rng) -> usize {
    let header = pdu.get(2).map_or(pdu.len(), |hlen| usize::from(*hlen));
    let header = header.clamp(1, pdu.len());
    if rng.below(4) == 0 {
        rng.below(pdu.len())
    } else {
        rng.below(header)
    }
}

/// Mutates the PDUs from index `keep` on (those before stay as recorded).
fn mutate(pdus: &mut Vec<Vec<u8>>, keep: usize, rng: &mut Rng) {
    for _ in 0..1 + rng.below(4) {
        if pdus.len() <= keep {
            return;
        }
        let index = keep + rng.below(pdus.len() - keep);
        let pdu = &mut pdus[index];
        if pdu.is_empty() {
            continue;
        }
        match rng.below(9) {
            0 | 1 => {
                let at = position(pdu, rng);
                pdu[at] ^= 1 << rng.below(8);
            }
            2 => {
                let at = position(pdu, rng);
                pdu[at] = EDGES[rng.below(EDGES.len())] as u8;
            }
            3 | 4 => {
                // A 16- or 32-bit field: an edge value, or its value one or a block off.
                let width = if rng.below(2) == 0 { 2 } else { 4 };
                if pdu.len() < width {
                    continue;
                }
                let at = position(pdu, rng).min(pdu.len() - width) & !(width - 1);
                let mut field = [0u8; 4];
                field[..width].copy_from_slice(&pdu[at..at + width]);
                let old = u32::from_le_bytes(field);
                let value = match rng.below(4) {
                    0 => old.wrapping_add(1),
                    1 => old.wrapping_sub(1),
                    2 => old.wrapping_add(512),
                    _ => EDGES[rng.below(EDGES.len())],
                };
                pdu[at..at + width].copy_from_slice(&value.to_le_bytes()[..width]);
            }
            5 => {
                pdus.remove(index);
            }
            6 => {
                let copy = pdu.clone();
                pdus.insert(index, copy);
            }
            7 => {
                let other = keep + rng.below(pdus.len() - keep);
                pdus.swap(index, other);
            }
            _ => {
                let len = rng.below(pdu.len());
                pdu.truncate(len);
            }
        }
    }
}

/// Sends `bytes`, then reads until the target closes or is quiet for a while.
async fn send_and_drain(stream: &mut TcpStream, bytes: &[u8]) {
    let (mut reader, mut writer) = stream.split();
    let send = async {
        let _ = writer.write_all(bytes).await;
    };
    let drain = async {
        let mut buffer = vec![0u8; 256 << 10];
        loop {
            match tokio::time::timeout(Duration::from_millis(50), reader.read(&mut buffer)).await {
                Ok(Ok(1..)) => {}
                _ => return,
            }
        }
    };
    tokio::join!(send, drain);
}

/// An enabled controller on a new admin connection, from the recorded admin stream; the
/// connection (kept open: the controller lives with it) and its controller id.
async fn live_controller(target: SocketAddr, admin: &[Vec<u8>]) -> (TcpStream, u16) {
    let (mut stream, response) = connected(target, &admin[0], &admin[1]).await;
    let controller_id = u16::from_le_bytes([response[8], response[9]]);
    let rest: Vec<u8> = admin[2..].concat();
    send_and_drain(&mut stream, &rest).await;
    (stream, controller_id)
}

/// A new connection to `target` that sent `ic_req` and then the Connect capsule
/// `connect`; the connection and the Connect's response capsule.
async fn connected(target: SocketAddr, ic_req: &[u8], connect: &[u8]) -> (TcpStream, [u8; 24]) {
    let mut stream = TcpStream::connect(target).await.expect("connect");
    stream.write_all(ic_req).await.expect("icreq");
    let mut ic_resp = [0u8; 128];
    stream.read_exact(&mut ic_resp).await.expect("icresp");
    stream.write_all(connect).await.expect("connect");
    let mut response = [0u8; 24];
    stream
        .read_exact(&mut response)
        .await
        .expect("connect response");
    assert_eq!(response[0], 0x05, "a response capsule");
    (stream, response)
}

/// Names controller `controller_id` in an I/O queue's Connect capsule: 16 bytes into the
/// Connect data, which starts at the data offset (PDO); with data digests, its CRC32C
/// follows the data and is computed again.
fn join_controller(connect: &mut [u8], controller_id: u16, digests: bool) {
    let data = usize::from(connect[3]);
    let at = data + 16;
    connect[at..at + 2].copy_from_slice(&controller_id.to_le_bytes());
    if digests {
        let end = connect.len() - 4;
        let digest = crc32c::crc32c(&connect[data..end]);
        connect[end..].copy_from_slice(&digest.to_le_bytes());
    }
}

/// A host that sends more commands than its queue holds, all at once (a recorded Flush
/// capsule, many times over, to a namespace whose flushes wait behind a gate): the target
/// starts no more than the queue's size (each command under way holds a buffer; a burst
/// of reads of 128 KiB each would hold hundreds of MiB), takes the rest as commands
/// complete, and answers every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_past_its_queue_size_waits_for_room() {
    let fixture = fixture(json!({"trtype": "TCP"})).await;
    let held = basalt_bdev::gated::Held {
        flushes: true,
        ..Default::default()
    };
    let gate = gated_namespace(&fixture, held).await;
    let session = record_session(fixture.address, false).await;
    let (_admin, controller_id) = live_controller(fixture.address, &session.admin).await;
    let mut connect = session.io[1].clone();
    join_controller(&mut connect, controller_id, false);
    // The Connect command's SQSIZE (0's based), 44 bytes into its SQE.
    let sq_size = u64::from(u16::from_le_bytes([connect[8 + 44], connect[8 + 45]])) + 1;
    let flush = session
        .io
        .iter()
        .find(|pdu| pdu[0] == 0x04 && pdu[8] == 0x00)
        .expect("a recorded flush capsule");
    let commands = 4 * sq_size;
    let mut burst = Vec::new();
    for cid in 0..commands {
        let mut capsule = flush.clone();
        capsule[8 + 2..8 + 4].copy_from_slice(&(cid as u16).to_le_bytes());
        capsule[8 + 4..8 + 8].copy_from_slice(&2u32.to_le_bytes());
        burst.extend_from_slice(&capsule);
    }
    let (mut stream, mut response) = connected(fixture.address, &session.io[0], &connect).await;
    stream.write_all(&burst).await.expect("the burst");
    // The target starts what the queue holds (and a few asynchronous event requests'
    // worth), then waits.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = gate.started();
    assert!(
        started >= sq_size.min(8) && started <= sq_size + 5,
        "{started} flushes started of {commands} sent on a queue of {sq_size}"
    );
    gate.open();
    let mut answered = 0;
    while answered < commands {
        let read =
            tokio::time::timeout(Duration::from_secs(10), stream.read_exact(&mut response)).await;
        read.unwrap_or_else(|_| panic!("{answered} of {commands} answered"))
            .expect("a response");
        assert_eq!(response[0], 0x05, "a response capsule");
        let status = u16::from_le_bytes([response[8 + 14], response[8 + 15]]) >> 1;
        assert_eq!(status, 0, "flush {answered} failed");
        answered += 1;
    }
    assert_eq!(gate.started(), commands);
}

#[test]
fn mutated_sessions_never_panic_the_target_nor_upset_other_hosts() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let fuzzed = std::thread::current()
            .name()
            .is_some_and(|name| name.starts_with(REACTOR_NAME));
        if fuzzed {
            REACTOR_PANICS.fetch_add(1, Ordering::SeqCst);
        }
        previous(info);
    }));
    let rounds: u64 = std::env::var("BASALT_FUZZ_ROUNDS")
        .ok()
        .and_then(|rounds| rounds.parse().ok())
        .unwrap_or(300);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let reactors = Reactors::start(1, REACTOR_NAME).expect("reactors");
        let fixture = fixture_on(
            reactors,
            json!({"trtype": "TCP", "in_capsule_data_size": 4096}),
        )
        .await;
        let sessions = [
            record_session(fixture.address, false).await,
            record_session(fixture.address, true).await,
        ];
        let host = Host::connect(fixture.address, NQN, HostOptions::default())
            .await
            .expect("a well-behaved host");
        for round in 0..rounds {
            let mut rng = Rng::new(round);
            // Digests on in every other pair of rounds.
            let session = &sessions[(round / 2 % 2) as usize];
            if round % 2 == 0 {
                // The admin queue, its ICReq and Connect included half the time.
                let mut pdus = session.admin.clone();
                mutate(&mut pdus, if rng.below(2) == 0 { 0 } else { 2 }, &mut rng);
                let mut stream = TcpStream::connect(fixture.address).await.expect("connect");
                send_and_drain(&mut stream, &pdus.concat()).await;
            } else {
                // An I/O queue joined to a live controller; its Connect mutated now and then.
                let (_admin_stream, controller_id) =
                    live_controller(fixture.address, &session.admin).await;
                let mut pdus = session.io.clone();
                join_controller(&mut pdus[1], controller_id, session.digests);
                mutate(&mut pdus, if rng.below(4) == 0 { 1 } else { 2 }, &mut rng);
                let mut stream = TcpStream::connect(fixture.address).await.expect("connect");
                send_and_drain(&mut stream, &pdus.concat()).await;
            }
            assert_eq!(
                REACTOR_PANICS.load(Ordering::SeqCst),
                0,
                "round {round} panicked the target (see the panic above)"
            );
            if round % 16 == 15 {
                read_write_cycle(&host, 0, round % 1024, 4096, round as u8).await;
            }
        }
        read_write_cycle(&host, 0, 0, 64 << 10, 9).await;
    });
}
