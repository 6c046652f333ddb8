//! The NBD server under bad input: bad requests get their NBD error and the connection goes
//! on; malformed handshakes end only their own connection; random bytes never crash it.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use basalt_bdev::Bdev;
use basalt_bdev::gated::{Gated, Held};
use basalt_bdev::malloc::MallocBdev;
use basalt_nbd::protocol::*;
use basalt_nbd::server::Export;
use basalt_nbd::{NbdClient, NbdServer, NbdUri};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Larger than the 32 MiB request maximum, so oversized requests are in range (malloc is thin).
const SIZE_BYTES: u64 = 64 << 20;

fn reactors() -> Arc<basalt_io::Reactors> {
    Arc::new(basalt_io::Reactors::start(2, "test-reactor").expect("reactors"))
}

fn malloc(name: &str) -> Arc<dyn Bdev> {
    Arc::new(MallocBdev::new_named(name, 512, SIZE_BYTES / 512))
}

/// A server, not listening, with `bdev` exported as "disk".
fn server_of(bdev: Arc<dyn Bdev>) -> Arc<NbdServer> {
    let server = NbdServer::new(reactors());
    let export = Export::new("disk".into(), "m".into(), bdev, false, None);
    server.exports().insert(Arc::new(export));
    server
}

async fn server() -> (Arc<NbdServer>, u16) {
    let server = NbdServer::new(reactors());
    let bdev = malloc("m");
    server.exports().insert(Arc::new(Export::new(
        "disk".into(),
        "m".into(),
        bdev.clone(),
        false,
        None,
    )));
    server.exports().insert(Arc::new(Export::new(
        "ro".into(),
        "m".into(),
        bdev,
        true,
        None,
    )));
    let address = server.start("127.0.0.1", 0).await.expect("listen");
    (server, address.port())
}

async fn client(port: u16, export: &str) -> NbdClient {
    let uri = NbdUri {
        host: "127.0.0.1".into(),
        port,
        export: export.into(),
    };
    NbdClient::connect(&uri).await.expect("connect")
}

fn errno(result: io::Result<Vec<u8>>) -> Option<i32> {
    result.err().and_then(|error| error.raw_os_error())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_work_and_bad_requests_get_their_error() {
    let (_server, port) = server().await;
    let nbd = client(port, "disk").await;
    assert_eq!(nbd.size_bytes(), SIZE_BYTES);
    assert_eq!(nbd.block_size_min(), 512);

    nbd.write(4096, &[0x5a; 8192], false).await.expect("write");
    nbd.write(16384, &[0x33; 512], true)
        .await
        .expect("fua write");
    nbd.flush().await.expect("flush");
    assert_eq!(nbd.read(4096, 8192).await.expect("read"), vec![0x5a; 8192]);
    nbd.trim(4096, 4096).await.expect("trim");
    nbd.write_zeroes(8192, 4096, true)
        .await
        .expect("write zeroes");
    assert_eq!(nbd.read(4096, 8192).await.expect("read"), vec![0; 8192]);
    assert_eq!(nbd.read(16384, 512).await.expect("read"), vec![0x33; 512]);

    let einval = Some(EINVAL as i32);
    assert_eq!(
        errno(nbd.read(SIZE_BYTES, 512).await),
        einval,
        "read past the end"
    );
    assert_eq!(
        errno(nbd.read(u64::MAX - 511, 512).await),
        einval,
        "offset overflow"
    );
    assert_eq!(
        errno(
            nbd.request(CMD_WRITE, 0, SIZE_BYTES - 512, 1024, &[1; 1024])
                .await
        ),
        Some(ENOSPC as i32),
        "write past the end"
    );
    assert_eq!(errno(nbd.read(100, 512).await), einval, "misaligned");
    assert_eq!(errno(nbd.read(0, 0).await), einval, "empty read");
    assert_eq!(
        errno(nbd.request(99, 0, 0, 512, &[]).await),
        einval,
        "unknown command"
    );
    assert_eq!(
        errno(nbd.request(CMD_READ, 1 << 9, 0, 512, &[]).await),
        einval,
        "unknown flag"
    );
    assert_eq!(
        errno(nbd.request(CMD_TRIM, 0, SIZE_BYTES, 512, &[]).await),
        einval,
        "trim past the end"
    );
    let oversized = vec![7u8; PAYLOAD_SIZE_MAX as usize + 4096];
    assert_eq!(
        errno(
            nbd.request(CMD_WRITE, 0, 0, oversized.len() as u32, &oversized)
                .await
        ),
        einval,
        "oversized payload"
    );
    assert_eq!(
        errno(
            nbd.request(CMD_READ, 0, 0, PAYLOAD_SIZE_MAX + 512, &[])
                .await
        ),
        einval,
        "oversized read"
    );

    // After all that, the same connection still works, and nothing was written.
    assert_eq!(nbd.read(0, 4096).await.expect("read"), vec![0; 4096]);
    assert_eq!(
        nbd.read(SIZE_BYTES - 512, 512).await.expect("read"),
        vec![0; 512]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_export_refuses_changes() {
    let (_server, port) = server().await;
    let nbd = client(port, "ro").await;
    assert_ne!(nbd.transmission_flags() & TRANSMISSION_READ_ONLY, 0);
    assert_eq!(
        nbd.transmission_flags()
            & (TRANSMISSION_SEND_TRIM | TRANSMISSION_SEND_WRITE_ZEROES | TRANSMISSION_SEND_FUA),
        0
    );
    let eperm = Some(EPERM as i32);
    assert_eq!(
        errno(nbd.request(CMD_WRITE, 0, 0, 512, &[1; 512]).await),
        eperm
    );
    assert_eq!(errno(nbd.request(CMD_TRIM, 0, 0, 512, &[]).await), eperm);
    assert_eq!(
        errno(nbd.request(CMD_WRITE_ZEROES, 0, 0, 512, &[]).await),
        eperm
    );
    assert_eq!(nbd.read(0, 512).await.expect("reads work"), vec![0; 512]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_flight_complete_out_of_order() {
    let (_server, port) = server().await;
    let nbd = Arc::new(client(port, "disk").await);
    let mut tasks = Vec::new();
    for index in 0..512u64 {
        let nbd = nbd.clone();
        tasks.push(tokio::spawn(async move {
            let offset = (index % 2048) * 4096;
            let byte = (index % 251) as u8;
            nbd.write(offset, &vec![byte; 4096], false)
                .await
                .expect("write");
            assert_eq!(
                nbd.read(offset, 4096).await.expect("read"),
                vec![byte; 4096]
            );
        }));
    }
    for task in tasks {
        task.await.expect("request task");
    }
}

/// Sends `bytes` as a whole client session and returns what the server sent back.
async fn raw_session(port: u16, bytes: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let _ = stream.write_all(bytes).await;
    let _ = stream.shutdown().await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
    answer
}

fn option(kind: u32, data: &[u8]) -> Vec<u8> {
    let mut bytes = OPTION_MAGIC.to_be_bytes().to_vec();
    bytes.extend_from_slice(&kind.to_be_bytes());
    bytes.extend_from_slice(&(data.len() as u32).to_be_bytes());
    bytes.extend_from_slice(data);
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_handshakes_end_only_their_connection() {
    let (server, port) = server().await;
    let survivor = client(port, "disk").await;
    survivor.write(0, &[9; 512], false).await.expect("write");
    let flags = (CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES).to_be_bytes();
    let with_flags = |rest: &[u8]| [flags.as_slice(), rest].concat();
    let mut huge = OPTION_MAGIC.to_be_bytes().to_vec();
    huge.extend_from_slice(&OPT_GO.to_be_bytes());
    huge.extend_from_slice(&u32::MAX.to_be_bytes());
    // An export name too long to read gets no option reply (its client waits for the
    // export's size): the connection closes (with a reset, the name unread; the greeting
    // was read before it).
    let huge_name = option(OPT_EXPORT_NAME, &[b'a'; OPTION_SIZE_MAX as usize + 1]);
    let sessions: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"GET / HTTP/1.1\r\n\r\n".to_vec()),
        (
            "unknown client flags",
            0xffff_ffffu32.to_be_bytes().to_vec(),
        ),
        ("bad option magic", with_flags(&[0u8; 16])),
        (
            "truncated option",
            with_flags(&OPTION_MAGIC.to_be_bytes()[..5]),
        ),
        ("huge option length", with_flags(&huge)),
        ("huge export name", with_flags(&huge_name)),
        (
            "unknown export by name",
            with_flags(&option(OPT_EXPORT_NAME, b"nope")),
        ),
        (
            "malformed info",
            with_flags(&option(OPT_GO, &[0, 0, 0, 9, b'a'])),
        ),
        ("unknown option", with_flags(&option(12345, b"x"))),
        ("list with data", with_flags(&option(OPT_LIST, b"x"))),
    ];
    for (name, bytes) in sessions {
        let answer = raw_session(port, &bytes).await;
        assert!(
            answer.starts_with(&INIT_MAGIC.to_be_bytes()),
            "{name}: greeting"
        );
        let replied = |code: u32| answer.windows(4).any(|w| w == code.to_be_bytes());
        match name {
            "malformed info" | "list with data" => {
                assert!(replied(REP_ERR_INVALID), "{name}: {answer:?}")
            }
            "unknown option" => assert!(replied(REP_ERR_UNSUP), "{name}: {answer:?}"),
            "huge export name" => assert!(
                !replied(REP_ERR_TOO_BIG) && answer.len() == 18,
                "{name}: {answer:?}"
            ),
            "huge option length" => {
                assert!(replied(REP_ERR_TOO_BIG) || answer.len() == 18, "{name}")
            }
            _ => assert_eq!(answer.len(), 18, "{name}: only the greeting, then close"),
        }
    }
    // The connection that was open all along still works.
    assert_eq!(survivor.read(0, 512).await.expect("survivor"), vec![9; 512]);
    assert_eq!(
        server
            .exports()
            .list()
            .iter()
            .map(|e| e.connection_count())
            .sum::<usize>(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_request_magic_closes_that_connection_only() {
    let (_server, port) = server().await;
    let survivor = client(port, "disk").await;
    let mut session = (CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    session.extend(option(OPT_EXPORT_NAME, b"disk"));
    session.extend_from_slice(&[0xee; REQUEST_SIZE]);
    let answer = raw_session(port, &session).await;
    assert_eq!(answer.len(), 18 + 10, "greeting, export info, then close");
    assert_eq!(survivor.read(0, 512).await.expect("survivor"), vec![0; 512]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_an_export_closes_its_connections() {
    let (server, port) = server().await;
    let nbd = client(port, "disk").await;
    nbd.read(0, 512).await.expect("read");
    server.exports().remove("disk").expect("remove");
    let after = tokio::time::timeout(Duration::from_secs(5), nbd.read(0, 512))
        .await
        .expect("answered or closed");
    assert!(after.is_err(), "the connection is closed");
}

/// A session with `server` over an in-memory pipe of 64 KiB: the task serving it, the
/// client's halves, and the bytes that open export "disk" (for the client to send).
fn piped_session(
    server: &Arc<NbdServer>,
) -> (
    tokio::task::JoinHandle<io::Result<()>>,
    tokio::io::ReadHalf<tokio::io::DuplexStream>,
    tokio::io::WriteHalf<tokio::io::DuplexStream>,
    Vec<u8>,
) {
    let (client_side, server_side) = tokio::io::duplex(64 << 10);
    let (reader, writer) = tokio::io::split(server_side);
    let serve = tokio::spawn(server.clone().serve(reader, writer));
    let (client_reader, client_writer) = tokio::io::split(client_side);
    let mut session = (CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    session.extend(option(OPT_EXPORT_NAME, b"disk"));
    (serve, client_reader, client_writer, session)
}

/// Opens the piped session (sends `session`, takes the greeting) and sends `reads` reads
/// of the first MiB (handles from 0).
async fn open_and_read_mibs(
    client_reader: &mut tokio::io::ReadHalf<tokio::io::DuplexStream>,
    client_writer: &mut tokio::io::WriteHalf<tokio::io::DuplexStream>,
    session: &[u8],
    reads: u64,
) {
    client_writer.write_all(session).await.expect("negotiate");
    let mut greeting = [0u8; 18 + 10];
    client_reader
        .read_exact(&mut greeting)
        .await
        .expect("greeting");
    for handle in 0..reads {
        client_writer
            .write_all(&read_mib(handle))
            .await
            .expect("read");
    }
}

/// A read of the first MiB.
fn read_mib(handle: u64) -> [u8; 28] {
    Request {
        flags: 0,
        command: CMD_READ,
        handle,
        offset_bytes: 0,
        len_bytes: 1 << 20,
    }
    .encode()
}

/// A client that sends reads and never reads the replies must not make the server buffer
/// more than its in-flight budget: the server stops reading requests instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_replies_stop_the_server_at_its_budget() {
    let malloc = MallocBdev::new_named("m", 512, SIZE_BYTES / 512);
    let counted: Arc<dyn Bdev> = Arc::new(basalt_bdev::io_stats::Counted::new(Box::new(malloc)));
    let server = server_of(counted.clone());
    let (_serve, mut client_reader, mut client_writer, session) = piped_session(&server);
    let mut greeting = [0u8; 18 + 10];
    let sender = tokio::spawn(async move {
        client_writer.write_all(&session).await.expect("negotiate");
        for handle in 0..1000u64 {
            if client_writer.write_all(&read_mib(handle)).await.is_err() {
                return;
            }
        }
    });
    client_reader
        .read_exact(&mut greeting)
        .await
        .expect("greeting");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let reads = counted.io_stats().expect("counted").num_read_ops;
    let budget_reads = basalt_nbd::transmission::IN_FLIGHT_BYTES_MAX >> 20;
    assert!(reads >= 1, "the server served some reads");
    assert!(
        // One reply may drain partly into the transport, which returns its budget.
        reads <= budget_reads + 1,
        "{reads} reads of 1 MiB executed with replies unread; budget is {budget_reads}"
    );
    sender.abort();
}

/// A client that keeps many large reads in flight and takes its replies more slowly than
/// the server makes them never lets the server's reply buffer empty; the replies written
/// must still be given back, or the buffer grows by every byte served (4.4 GB after 20 s
/// of such a client on `basalt target`, before the fix). The test process's resident
/// memory must grow by much less than the 1.5 GiB served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steady_reader_does_not_grow_the_reply_buffer() {
    const DEPTH: u64 = 64;
    const SERVED_MIB: u64 = 1536;
    let server = server_of(malloc("m"));
    let (_serve, mut client_reader, mut client_writer, session) = piped_session(&server);
    let resident = || {
        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|kib| kib.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmRSS")
            << 10
    };
    let before = resident();
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(before));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                peak.fetch_max(resident(), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    open_and_read_mibs(&mut client_reader, &mut client_writer, &session, DEPTH).await;
    let mut chunk = vec![0u8; 64 << 10];
    for handle in DEPTH..SERVED_MIB + DEPTH {
        let mut reply = [0u8; 16];
        client_reader.read_exact(&mut reply).await.expect("reply");
        assert_eq!(&reply[4..8], &[0; 4], "no error");
        let mut left = 1 << 20;
        while left > 0 {
            let take = left.min(chunk.len());
            let got = client_reader.read(&mut chunk[..take]).await.expect("data");
            assert!(got > 0, "the server closed");
            left -= got;
        }
        // Slower than the server: its replies wait on a full pipe.
        tokio::time::sleep(Duration::from_millis(1)).await;
        if handle < SERVED_MIB {
            client_writer
                .write_all(&read_mib(handle))
                .await
                .expect("read");
        }
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    sampler.join().expect("sampler");
    let grown = peak
        .load(std::sync::atomic::Ordering::Relaxed)
        .saturating_sub(before);
    assert!(
        grown < 512 << 20,
        "resident memory grew by {} MiB while {SERVED_MIB} MiB were served",
        grown >> 20
    );
}

/// A client that leaves every reply unread is dropped after the stall timeout: the
/// connection's task ends with `TimedOut` (without the limit it would wait for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reading_no_reply_is_dropped_after_the_stall_timeout() {
    let server = server_of(malloc("m"));
    let limits = basalt_nbd::server::Limits {
        max_connections: 8,
        stall_timeout: Some(Duration::from_millis(300)),
    };
    // Started only for its limits: the session below runs over an in-memory pipe.
    server
        .start_with("127.0.0.1", 0, limits)
        .await
        .expect("listen");
    let (serve, mut client_reader, mut client_writer, session) = piped_session(&server);
    open_and_read_mibs(&mut client_reader, &mut client_writer, &session, 4).await;
    let started = std::time::Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(10), serve)
        .await
        .expect("the stalled connection was closed")
        .expect("serve task");
    let waited = started.elapsed();
    assert_eq!(
        ended.as_ref().map_err(io::Error::kind).err(),
        Some(io::ErrorKind::TimedOut),
        "{ended:?}"
    );
    assert!(
        waited >= Duration::from_millis(250),
        "closed after {waited:?}, before the timeout"
    );
    drop(client_reader);
}

/// Connections past the limit are closed at once; a slot freed serves the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_are_closed() {
    let server = NbdServer::new(reactors());
    let limits = basalt_nbd::server::Limits {
        max_connections: 2,
        stall_timeout: None,
    };
    let port = server
        .start_with("127.0.0.1", 0, limits)
        .await
        .expect("listen")
        .port();
    // The server greets each connection it serves first (16 bytes of magic and flags).
    async fn greeted(port: u16) -> Option<TcpStream> {
        let mut stream = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        let mut greeting = [0u8; 18];
        match tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut greeting)).await {
            Ok(Ok(_)) => Some(stream),
            Ok(Err(error)) if error.kind() == io::ErrorKind::UnexpectedEof => None,
            other => panic!("neither greeted nor closed: {other:?}"),
        }
    }
    let first = greeted(port).await.expect("first connection served");
    let _second = greeted(port).await.expect("second connection served");
    assert!(
        greeted(port).await.is_none(),
        "a third connection is closed"
    );
    drop(first);
    let mut served = None;
    for _ in 0..50 {
        served = greeted(port).await;
        if served.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served.is_some(), "a freed slot serves a new connection");
}

/// A session of `server` over an in-memory pipe to which a client sends `sent` and then
/// nothing: what the server answered (5 s at most), and how its task ended (5 s at most).
async fn exchange(
    server: &Arc<NbdServer>,
    sent: &[u8],
) -> (
    Vec<u8>,
    Result<Result<io::Result<()>, tokio::task::JoinError>, tokio::time::error::Elapsed>,
) {
    let (client_side, server_side) = tokio::io::duplex(1 << 16);
    let (reader, writer) = tokio::io::split(server_side);
    let serve = tokio::spawn(server.clone().serve(reader, writer));
    let (mut client_reader, mut client_writer) = tokio::io::split(client_side);
    client_writer.write_all(sent).await.expect("send");
    client_writer.shutdown().await.expect("shutdown");
    let mut received = Vec::new();
    let within = Duration::from_secs(5);
    let _ = tokio::time::timeout(within, client_reader.read_to_end(&mut received)).await;
    (received, tokio::time::timeout(within, serve).await)
}

/// The option replies (type, data) `server` gives a client that sends `options` after
/// its flags and then nothing.
async fn option_replies(server: &Arc<NbdServer>, options: &[u8]) -> Vec<(u32, Vec<u8>)> {
    let mut sent = (CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    sent.extend_from_slice(options);
    let (received, _) = exchange(server, &sent).await;
    // The greeting (magic, IHAVEOPT, handshake flags), then the option replies.
    let mut replies = Vec::new();
    let mut at = 18;
    while let Some(head) = received.get(at..at + 20) {
        let kind = u32::from_be_bytes(head[12..16].try_into().expect("4 bytes"));
        let len = u32::from_be_bytes(head[16..20].try_into().expect("4 bytes")) as usize;
        replies.push((kind, received[at + 20..at + 20 + len].to_vec()));
        at += 20 + len;
    }
    replies
}

/// NBD_OPT_GO of "disk", asking for the information items `requests`.
fn go(requests: Vec<u16>) -> Vec<u8> {
    let go = InfoRequest {
        name: "disk".into(),
        requests,
    };
    option(OPT_GO, &go.encode())
}

/// The transmission flags NBD_OPT_GO answers with (its NBD_INFO_EXPORT), after
/// NBD_OPT_STRUCTURED_REPLY when `structured`.
async fn flags_given(structured: bool) -> u16 {
    let server = server_of(malloc("m"));
    let mut options = Vec::new();
    if structured {
        options.extend(option(OPT_STRUCTURED_REPLY, &[]));
    }
    options.extend(go(Vec::new()));
    let replies = option_replies(&server, &options).await;
    let export = replies
        .iter()
        .find(|(kind, data)| *kind == REP_INFO && data[..2] == INFO_EXPORT.to_be_bytes());
    let Some((_, data)) = export else {
        panic!("no NBD_INFO_EXPORT in {replies:?}");
    };
    u16::from_be_bytes([data[10], data[11]])
}

/// A client that did not ask for block sizes (NBD_INFO_BLOCK_SIZE) is told them anyway,
/// then let in: it may know them out of band (`nbd-client -b 4096` sends NBD_OPT_GO
/// asking for nothing), so it is not refused with NBD_REP_ERR_BLOCK_SIZE_REQD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_sizes_go_to_clients_that_did_not_ask() {
    let large = server_of(Arc::new(MallocBdev::new_named("m", 4096, 64)));
    let replies = option_replies(&large, &go(Vec::new())).await;
    let sizes = replies
        .iter()
        .find(|(kind, data)| *kind == REP_INFO && data[..2] == INFO_BLOCK_SIZE.to_be_bytes());
    assert_eq!(
        sizes.map(|(_, data)| data[2..6].to_vec()),
        Some(4096u32.to_be_bytes().to_vec()),
        "the minimum block size, unasked: {replies:?}"
    );
    assert_eq!(replies.last().map(|(kind, _)| *kind), Some(REP_ACK));
}

/// NBD_FLAG_SEND_DF goes to clients that negotiated structured replies, and only to
/// them (the protocol forbids it otherwise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_df_flag_is_offered_with_structured_replies_only() {
    assert_ne!(flags_given(true).await & TRANSMISSION_SEND_DF, 0);
    assert_eq!(flags_given(false).await & TRANSMISSION_SEND_DF, 0);
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random client bytes after a valid start (flags, then option haggling or transmission)
    /// never panic the server, and a good connection keeps working alongside.
    #[test]
    fn random_sessions_never_break_the_server(tail in proptest::collection::vec(any::<u8>(), 0..512), go in any::<bool>()) {
        runtime().block_on(async {
            let server = server_of(malloc("m"));
            let mut prefix = (CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES).to_be_bytes().to_vec();
            if go {
                prefix.extend(option(OPT_STRUCTURED_REPLY, &[]));
                prefix.extend(option(OPT_GO, &InfoRequest { name: "disk".into(), requests: vec![INFO_BLOCK_SIZE] }.encode()));
            }
            prefix.extend_from_slice(&tail);
            let (_, outcome) = exchange(&server, &prefix).await;
            prop_assert!(matches!(outcome, Ok(Ok(_))), "server task panicked or hung: {:?}", outcome);
            Ok(())
        })?;
    }

    /// Random 28-byte request headers after a valid negotiation are answered or end the
    /// connection; a second connection is unaffected.
    #[test]
    fn random_requests_never_break_the_server(requests in proptest::collection::vec((any::<u16>(), 0u16..8, any::<u64>(), 0u32..70_000), 1..8)) {
        runtime().block_on(async {
            let (_server, port) = server().await;
            let good = client(port, "disk").await;
            let uri = NbdUri { host: "127.0.0.1".into(), port, export: "disk".into() };
            let fuzz = NbdClient::connect(&uri).await.expect("connect");
            for (flags, command, offset, len) in requests {
                let payload = if command == CMD_WRITE { vec![0xaa; len as usize] } else { Vec::new() };
                if command == CMD_DISC { continue; }
                let _ = tokio::time::timeout(Duration::from_secs(5), fuzz.request(command, flags, offset, len, &payload)).await;
            }
            let read = good.read(0, 512).await;
            prop_assert!(read.as_ref().is_ok_and(|data| data.len() == 512), "good connection: {:?}", read.map(|d| d.len()));
            Ok(())
        })?;
    }
}

/// NBD_CMD_DISC from a client ends its connection on the server: the export counts it
/// while it is open and not after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_ends_the_connection_on_the_server() {
    let (server, port) = server().await;
    let nbd = client(port, "disk").await;
    nbd.write(0, &[3; 512], false).await.expect("write");
    let connections = || {
        server
            .exports()
            .find("disk")
            .map_or(0, |export| export.connection_count())
    };
    assert_eq!(connections(), 1);
    nbd.disconnect().await.expect("disconnect");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while connections() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the server still counts the connection"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let again = client(port, "disk").await;
    assert_eq!(
        again.read(0, 512).await.expect("read"),
        vec![3; 512],
        "the write before DISC is there"
    );
}

/// A connection to the server on `port` in transmission with export "disk" (no
/// structured replies).
async fn in_transmission(port: u16) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).await.expect("greeting");
    let mut session = (CLIENT_FLAG_FIXED_NEWSTYLE | CLIENT_FLAG_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    session.extend(option(OPT_EXPORT_NAME, b"disk"));
    stream.write_all(&session).await.expect("negotiate");
    let mut export_info = [0u8; 10];
    stream.read_exact(&mut export_info).await.expect("export");
    stream
}

/// Requests that move no data still count: a trim counts a share of its range (an image
/// turns a trim into a request per MiB), and a connection has 1,024 requests in flight at
/// most, so a client cannot pile up work on the bdev at 28 bytes a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trims_and_flushes_in_flight_are_bounded() {
    for (command, len_bytes, bound) in [(CMD_TRIM, SIZE_BYTES as u32, 65), (CMD_FLUSH, 0, 1024)] {
        let held = Held {
            flushes: true,
            discards: true,
            ..Held::default()
        };
        let malloc = MallocBdev::new_named("g", 512, SIZE_BYTES / 512);
        let gated = Arc::new(Gated::new(Box::new(malloc), held));
        let bdev: Arc<dyn Bdev> = gated.clone();
        let server = NbdServer::new(reactors());
        let export = Export::new("disk".into(), "g".into(), bdev, false, None);
        server.exports().insert(Arc::new(export));
        let port = server.start("127.0.0.1", 0).await.expect("listen").port();
        let mut stream = in_transmission(port).await;
        let requests: Vec<u8> = (0..2000u64)
            .flat_map(|handle| {
                Request {
                    flags: 0,
                    command,
                    handle,
                    offset_bytes: 0,
                    len_bytes,
                }
                .encode()
            })
            .collect();
        stream.write_all(&requests).await.expect("requests");
        tokio::time::sleep(Duration::from_millis(500)).await;
        let taken = gated.started();
        assert!(taken >= 1, "command {command}: none started");
        assert!(
            taken <= bound,
            "command {command}: {taken} of 2000 started at once (at most {bound})"
        );
        // Once the bdev goes on, every request is answered.
        gated.open();
        let mut replies = vec![0u8; 2000 * 16];
        tokio::time::timeout(Duration::from_secs(20), stream.read_exact(&mut replies))
            .await
            .expect("every reply in time")
            .expect("replies");
        server.stop();
    }
}

/// An export removed while requests wait in a connection's input buffer (the bdev holds
/// those under way) answers the waiting ones with ESHUTDOWN, as the protocol asks, after
/// those under way complete, then ends the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_when_the_export_goes_get_eshutdown() {
    let held = Held {
        flushes: true,
        ..Held::default()
    };
    let malloc = MallocBdev::new_named("g", 512, SIZE_BYTES / 512);
    let gated = Arc::new(Gated::new(Box::new(malloc), held));
    let server = server_of(gated.clone());
    let port = server.start("127.0.0.1", 0).await.expect("listen").port();
    let mut stream = in_transmission(port).await;
    // 1,100 flushes: 1,024 start (the most in flight), the rest wait in the buffer.
    let requests: Vec<u8> = (0..1100u64)
        .flat_map(|handle| {
            Request {
                flags: 0,
                command: CMD_FLUSH,
                handle,
                offset_bytes: 0,
                len_bytes: 0,
            }
            .encode()
        })
        .collect();
    stream.write_all(&requests).await.expect("requests");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while gated.started() < 1024 {
        assert!(std::time::Instant::now() < deadline, "flushes not started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = gated.started();
    assert_eq!(started, 1024, "flushes started");
    assert!(server.exports().remove("disk").is_some());
    gated.open();
    let mut replies = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut replies))
        .await
        .expect("the connection ends")
        .expect("replies");
    let errors: Vec<u32> = replies
        .chunks(SIMPLE_REPLY_SIZE)
        .map(|reply| u32::from_be_bytes(reply[4..8].try_into().expect("4 bytes")))
        .collect();
    let mut handles: Vec<u64> = replies
        .chunks(SIMPLE_REPLY_SIZE)
        .map(|reply| u64::from_be_bytes(reply[8..16].try_into().expect("8 bytes")))
        .collect();
    handles.sort_unstable();
    handles.dedup();
    assert_eq!(handles.len(), errors.len(), "a request answered twice");
    let ok = errors.iter().filter(|&&errno| errno == 0).count() as u64;
    let shut = errors.iter().filter(|&&errno| errno == ESHUTDOWN).count() as u64;
    assert_eq!(ok, started, "the flushes under way complete");
    // Those read into the buffer (all of them, unless the socket gave the last bytes
    // after the budget was full) get ESHUTDOWN, and no other error.
    assert!(shut >= 1, "no ESHUTDOWN: {errors:?}");
    assert_eq!(ok + shut, errors.len() as u64, "other errors: {errors:?}");
}

/// An export removed while a connection drops the payload of a write over the maximum
/// answers that write with ESHUTDOWN and ends the connection (it stopped reading, so the
/// rest of the payload will not come in).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_being_dropped_when_the_export_goes_ends_the_connection() {
    let server = server_of(malloc("m"));
    let port = server.start("127.0.0.1", 0).await.expect("listen").port();
    let mut stream = in_transmission(port).await;
    let write = Request {
        flags: 0,
        command: CMD_WRITE,
        handle: 7,
        offset_bytes: 0,
        len_bytes: 64 << 20,
    };
    stream.write_all(&write.encode()).await.expect("header");
    stream.write_all(&[0u8; 4096]).await.expect("some payload");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(server.exports().remove("disk").is_some());
    let mut replies = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut replies))
        .await
        .expect("the connection ends")
        .expect("reply");
    assert_eq!(replies.len(), SIMPLE_REPLY_SIZE, "{replies:?}");
    assert_eq!(replies[4..8], ESHUTDOWN.to_be_bytes());
    assert_eq!(replies[8..16], 7u64.to_be_bytes());
}

/// A client that connects and says nothing is dropped once the negotiation's time is up
/// (`HANDSHAKE_TIMEOUT`), freeing its connection slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_client_is_dropped_after_the_handshake_timeout() {
    let server = server_of(malloc("m"));
    let port = server.start("127.0.0.1", 0).await.expect("listen").port();
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let started = std::time::Instant::now();
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).await.expect("greeting");
    let limit = basalt_nbd::server::HANDSHAKE_TIMEOUT;
    let mut rest = Vec::new();
    tokio::time::timeout(
        limit + Duration::from_secs(5),
        stream.read_to_end(&mut rest),
    )
    .await
    .expect("dropped within the limit")
    .expect("closed");
    let waited = started.elapsed();
    assert!(rest.is_empty(), "{rest:?}");
    assert!(
        waited >= limit,
        "dropped after {waited:?}, before {limit:?}"
    );
}
