//! Our initiator against our target over loopback TCP: every command, several queues,
//! digests on and off, R2T for large writes, hosts refused, keep-alive expiry,
//! namespace change notices, discovery, and bad PDUs.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use basalt_bdev::{Bdev, BdevFuture, Extent};
use basalt_io::DmaBuf;
use basalt_io::Reactors;
use basalt_nvmf::command::*;
use basalt_nvmf::completion::Status;
use basalt_nvmf::host::{Host, HostOptions};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod support;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_with_and_without_digests() {
    let fixture = fixture(json!({"trtype": "TCP", "in_capsule_data_size": 4096})).await;
    for digests in [false, true] {
        let options = HostOptions {
            header_digest: digests,
            data_digest: digests,
            io_queues: 2,
            ..HostOptions::default()
        };
        let host = Host::connect(fixture.address, NQN, options)
            .await
            .expect("connect");
        assert_eq!(host.io.len(), 2);
        let id = &host.identify;
        assert_eq!(&id[4..14], b"BASALT0001");
        assert_eq!(u16::from_le_bytes([id[78], id[79]]), host.controller_id);
        assert_eq!(&id[768..768 + NQN.len()], NQN.as_bytes());
        assert_eq!(host.namespaces().await.expect("namespaces"), vec![1]);
        assert_eq!(
            host.namespace_geometry(1).await.expect("geometry"),
            (BLOCK, BLOCKS)
        );
        let descriptors = host
            .identify(CNS_NAMESPACE_DESCRIPTORS, 1)
            .await
            .expect("descriptors");
        assert_eq!(descriptors[0], 2, "NGUID first");

        // In-capsule (4 KiB), then R2T (128 KiB, 32 KiB) writes, on both queues.
        read_write_cycle(&host, 0, 0, 4096, 1).await;
        read_write_cycle(&host, 1, 100, 128 << 10, 2).await;
        read_write_cycle(&host, 0, BLOCKS - 64, 32 << 10, 3).await;
        host.write(0, 1, 8, pattern(4, 4096), BLOCK, true)
            .await
            .expect("fua write");
        host.flush(1, 1).await.expect("flush");

        // Write zeroes and deallocate read back as zeroes.
        host.write_zeroes(0, 1, 100, 8, false)
            .await
            .expect("write zeroes");
        let zeroed = host.read(0, 1, 96, 16, BLOCK).await.expect("read");
        assert!(zeroed[4 * 512..12 * 512].iter().all(|b| *b == 0));
        assert_eq!(
            zeroed[12 * 512..],
            pattern(2, 128 << 10)[8 * 512..12 * 512],
            "right of the zeroes"
        );
        host.deallocate(1, 1, &[(120, 8), (200, 16)])
            .await
            .expect("deallocate");
        let freed = host.read(1, 1, 120, 8, BLOCK).await.expect("read");
        assert!(freed.iter().all(|b| *b == 0));

        // Errors carry the right status.
        let past_end = host
            .read(0, 1, BLOCKS - 1, 2, BLOCK)
            .await
            .expect_err("past the end");
        assert_eq!(
            past_end.status().map(|s| (s.sct(), s.sc())),
            Some((0, 0x80)),
            "{past_end}"
        );
        let no_namespace = host
            .read(0, 7, 0, 1, BLOCK)
            .await
            .expect_err("no namespace 7");
        assert_eq!(
            no_namespace.status().map(|s| s.sc()),
            Some(0x0b),
            "{no_namespace}"
        );
        let unknown_opcode = |queue: usize| {
            let sqe = Sqe {
                opcode: 0x7e,
                namespace_id: 1,
                ..Sqe::default()
            };
            host.io(queue, sqe, Vec::new(), 0)
        };
        let bad_opcode = unknown_opcode(0).await.expect_err("opcode");
        assert_eq!(bad_opcode.status(), Some(Status::INVALID_OPCODE.with_dnr()));
        // A command above MDTS is refused; the host's read and write split at MDTS.
        let too_large = host
            .io(
                0,
                basalt_nvmf::host::rw_sqe(IO_READ, 1, 0, 512, false),
                Vec::new(),
                512 * BLOCK,
            )
            .await
            .expect_err("above MDTS");
        assert_eq!(
            too_large.status().map(|s| s.sc()),
            Some(0x02),
            "{too_large}"
        );
        assert_eq!(host.transfer_size_max(), 128 << 10);
        read_write_cycle(&host, 1, 2048, 1 << 20, 6).await;

        // Log pages and features.
        let health = host
            .log_page(LOG_HEALTH, 0, 512, false)
            .await
            .expect("health");
        assert_eq!(health[3], 100, "available spare");
        assert!(
            u64::from_le_bytes(health[80..88].try_into().expect("in range")) >= 4,
            "write commands counted"
        );
        assert_eq!((id[260], id[261]), (0b011, 0b110), "FRMW and LPA");
        let effects = host
            .log_page(LOG_COMMAND_EFFECTS, 0, 4096, false)
            .await
            .expect("effects");
        assert_eq!(effects[1024 + 4] & 3, 3, "write changes content");
        let firmware = host
            .log_page(LOG_FIRMWARE_SLOT, 0, 512, false)
            .await
            .expect("firmware");
        assert_eq!(
            (firmware[0], &firmware[8..16]),
            (1, &b"basalt01"[..]),
            "slot 1 active"
        );
        // The error log: the four failed commands above, newest first, on I/O queue 1;
        // then nothing. The health page counts them.
        assert_eq!(id[262], 63, "ELPE: 64 entries");
        assert_eq!(
            u64::from_le_bytes(health[176..184].try_into().expect("in range")),
            4,
            "error log entries in the health page"
        );
        let errors = host
            .log_page(LOG_ERROR, 0, 5 * 64, false)
            .await
            .expect("error log");
        let entry = |index: usize| {
            let e = &errors[index * 64..(index + 1) * 64];
            let u16_at = |at: usize| u16::from_le_bytes([e[at], e[at + 1]]);
            (
                u64::from_le_bytes(e[0..8].try_into().expect("in range")),
                u16_at(8),
                u16_at(10),
                u16_at(12),
                u16_at(14),
                u64::from_le_bytes(e[16..24].try_into().expect("in range")),
                u32::from_le_bytes(e[24..28].try_into().expect("in range")),
            )
        };
        let qid = host.queue(0).qid;
        let seen = |count: u64, error: &basalt_nvmf::host::HostError, lba: u64, nsid: u32| {
            let status = error.status().expect("status").field();
            let command_id = error.command_id().expect("command id");
            (count, qid, command_id, status, 0xffff, lba, nsid)
        };
        assert_eq!(
            [entry(0), entry(1), entry(2), entry(3)],
            [
                seen(4, &too_large, 0, 1),
                seen(3, &bad_opcode, 0, 1),
                seen(2, &no_namespace, 0, 7),
                seen(1, &past_end, BLOCKS - 1, 1),
            ],
            "(count, sqid, cid, status, parameter location, lba, nsid), newest first"
        );
        assert_eq!(&errors[4 * 64..], &[0u8; 64][..], "no fifth entry");
        let abort = Sqe {
            opcode: ADMIN_ABORT,
            cdw10: 1 << 16,
            ..Sqe::default()
        };
        assert_eq!(
            host.admin(abort, Vec::new(), 0)
                .await
                .expect("abort")
                .cqe
                .dw0
                & 1,
            1,
            "not aborted"
        );
        let unknown = host
            .log_page(0x42, 0, 512, false)
            .await
            .expect_err("unknown log");
        assert_eq!(unknown.status().map(|s| (s.sct(), s.sc())), Some((1, 0x09)));
        // An admin command's error goes into the same log, on queue 0.
        let newest = host
            .log_page(LOG_ERROR, 0, 64, false)
            .await
            .expect("error log");
        assert_eq!(
            (
                u64::from_le_bytes(newest[0..8].try_into().expect("in range")),
                u16::from_le_bytes([newest[8], newest[9]]),
                u16::from_le_bytes([newest[12], newest[13]]),
            ),
            (5, 0, unknown.status().expect("status").field())
        );
        // The log keeps the last 64: after 65 more errors, entries 70 down to 7.
        for _ in 0..65 {
            unknown_opcode(1).await.expect_err("opcode");
        }
        let full = host
            .log_page(LOG_ERROR, 0, 64 * 64, false)
            .await
            .expect("error log");
        let counts: Vec<u64> = full
            .chunks_exact(64)
            .map(|e| u64::from_le_bytes(e[0..8].try_into().expect("in range")))
            .collect();
        assert_eq!(counts, (7..=70).rev().collect::<Vec<u64>>());
        let feature = |id: u8, cdw11: u32, len: u32| host.get_feature(id, cdw11, len);
        let kato = feature(FEATURE_KEEP_ALIVE_TIMER, 0, 0)
            .await
            .expect("get kato");
        assert_eq!(kato.cqe.dw0, 10_000);
        let queues = feature(FEATURE_NUMBER_OF_QUEUES, 0, 0)
            .await
            .expect("get queues");
        assert_eq!(queues.cqe.dw0, 0x0001_0001);
        // The 128-bit host identifier Connect carried.
        let id = feature(FEATURE_HOST_IDENTIFIER, 1, 16)
            .await
            .expect("host id");
        assert_eq!(id.data, HostOptions::default().host_id.to_vec());
        // Disconnect on an I/O queue: answered, then that queue's connection closes.
        let disconnect = Sqe {
            opcode: FABRICS,
            namespace_id: u32::from(basalt_nvmf::fabrics::FCTYPE_DISCONNECT),
            ..Sqe::default()
        };
        host.io(1, disconnect, Vec::new(), 0)
            .await
            .expect("disconnect");
        host.read(1, 1, 0, 8, BLOCK)
            .await
            .expect_err("the queue is closed");
        read_write_cycle(&host, 0, 16, 4096, 7).await;

        let controllers = controllers(&fixture).await;
        assert_eq!(controllers.as_array().map(Vec::len), Some(1));
        assert_eq!(
            controllers[0]["num_io_qpairs"],
            json!(1),
            "two I/O queues, one disconnected"
        );
        drop(host);
    }
}

/// A discard as Linux sends it: NR names one range, the buffer has room for 256 (4 KiB,
/// in the capsule or through R2T). The ranges past NR are not read (the second here lies
/// past the end); a buffer shorter than NR's ranges, or longer than 256 ranges, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataset_management_buffer_longer_than_its_ranges() {
    for in_capsule in [4096, 0] {
        let fixture = fixture(json!({"trtype": "TCP", "in_capsule_data_size": in_capsule})).await;
        let host = Host::connect(fixture.address, NQN, HostOptions::default())
            .await
            .expect("connect");
        host.write(0, 1, 300, pattern(5, 4096), BLOCK, false)
            .await
            .expect("write");
        let dsm = |ranges: u32| Sqe {
            opcode: IO_DATASET_MANAGEMENT,
            namespace_id: 1,
            cdw10: ranges - 1,
            cdw11: 1 << 2,
            ..Sqe::default()
        };
        let mut buffer = vec![0u8; 4096];
        buffer[4..8].copy_from_slice(&4u32.to_le_bytes());
        buffer[8..16].copy_from_slice(&302u64.to_le_bytes());
        buffer[20..24].copy_from_slice(&8u32.to_le_bytes());
        buffer[24..32].copy_from_slice(&BLOCKS.to_le_bytes());
        host.io(0, dsm(1), buffer, 0)
            .await
            .expect("one range in a buffer of 256");
        let data = host.read(0, 1, 300, 8, BLOCK).await.expect("read");
        assert_eq!(data[..1024], pattern(5, 4096)[..1024], "left of the range");
        assert!(data[1024..3072].iter().all(|b| *b == 0), "the range");
        assert_eq!(data[3072..], pattern(5, 4096)[3072..], "right of the range");
        // Every one of 256 ranges (every other block of 512) is read.
        let written = pattern(6, 512 * 512);
        for half in 0..2u64 {
            let at = (half * 256 * 512) as usize;
            host.write(
                0,
                1,
                400 + half * 256,
                written[at..at + 256 * 512].to_vec(),
                BLOCK,
                false,
            )
            .await
            .expect("write");
        }
        let mut ranges = vec![0u8; 4096];
        for (n, range) in ranges.chunks_exact_mut(16).enumerate() {
            range[4..8].copy_from_slice(&1u32.to_le_bytes());
            range[8..16].copy_from_slice(&(400 + 2 * n as u64).to_le_bytes());
        }
        host.io(0, dsm(256), ranges, 0).await.expect("256 ranges");
        for half in 0..2u64 {
            let data = host
                .read(0, 1, 400 + half * 256, 256, BLOCK)
                .await
                .expect("read");
            for (n, block) in data.chunks_exact(512).enumerate() {
                let at = (half as usize * 256 + n) * 512;
                if n % 2 == 0 {
                    assert!(block.iter().all(|b| *b == 0), "block {at} discarded");
                } else {
                    assert_eq!(block, &written[at..at + 512], "block {at} kept");
                }
            }
        }
        for (ranges, len) in [(2, 16), (1, 4112)] {
            let refused = host
                .io(0, dsm(ranges), vec![0; len], 0)
                .await
                .expect_err("a buffer that does not fit NR");
            assert_eq!(
                refused.status().map(|s| (s.sct(), s.sc(), s.dnr())),
                Some((0, 0x0f, true)),
                "{ranges} ranges in {len} bytes: {refused}"
            );
        }
    }
}

/// A malloc bdev that says whether its completed writes may sit in a volatile cache (as a
/// file bdev's do), counts the writes (with and without FUA) and flushes that reach it,
/// and may take its time over reads (as an image bdev waits for its OSDs).
struct Counting {
    inner: basalt_bdev::malloc::MallocBdev,
    volatile_cache: bool,
    counts: Arc<[AtomicU64; 3]>,
    read_delay: Option<Duration>,
}

const FUA_WRITES: usize = 0;
const PLAIN_WRITES: usize = 1;
const FLUSHES: usize = 2;

impl Counting {
    /// Registers one named `name` with the fixture's bdevs; its counters.
    fn register(fixture: &Fixture, name: &str, volatile_cache: bool) -> Arc<[AtomicU64; 3]> {
        Self::register_with(fixture, name, volatile_cache, None)
    }

    fn register_with(
        fixture: &Fixture,
        name: &str,
        volatile_cache: bool,
        read_delay: Option<Duration>,
    ) -> Arc<[AtomicU64; 3]> {
        let counts: Arc<[AtomicU64; 3]> = Arc::default();
        let bdev = Counting {
            inner: basalt_bdev::malloc::MallocBdev::new_named(name, BLOCK, BLOCKS),
            volatile_cache,
            counts: counts.clone(),
            read_delay,
        };
        register_bdev(fixture, Box::new(bdev));
        counts
    }
}

/// Registers a bdev of a test's own with the fixture's bdevs.
impl Bdev for Counting {
    fn info(&self) -> &basalt_bdev::BdevInfo {
        self.inner.info()
    }
    fn read(&self, extent: Extent) -> BdevFuture<'_, DmaBuf> {
        match self.read_delay {
            Some(delay) => Box::pin(async move {
                tokio::time::sleep(delay).await;
                self.inner.read(extent).await
            }),
            None => self.inner.read(extent),
        }
    }
    fn write(&self, extent: Extent, data: DmaBuf, fua: bool) -> BdevFuture<'_, ()> {
        let which = if fua { FUA_WRITES } else { PLAIN_WRITES };
        self.counts[which].fetch_add(1, Ordering::Relaxed);
        self.inner.write(extent, data, fua)
    }
    fn flush(&self) -> BdevFuture<'_, ()> {
        self.counts[FLUSHES].fetch_add(1, Ordering::Relaxed);
        self.inner.flush()
    }
    fn volatile_cache(&self) -> bool {
        self.volatile_cache
    }
    fn write_zeroes(&self, extent: Extent, deallocate: bool) -> BdevFuture<'_, ()> {
        self.inner.write_zeroes(extent, deallocate)
    }
    fn discard(&self, extent: Extent) -> BdevFuture<'_, ()> {
        self.inner.discard(extent)
    }
}

/// The controller reports no volatile write cache, so hosts send no flushes: over a bdev
/// whose writes may sit in one, every write goes down with FUA and zeroing is flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_are_durable_at_completion_over_a_bdev_with_a_write_cache() {
    let fixture = fixture(json!({"trtype": "TCP"})).await;
    let cached = Counting::register(&fixture, "Cached0", true);
    let plain = Counting::register(&fixture, "Plain0", false);
    assert_eq!(add_namespace(&fixture, "Cached0").await, json!(2));
    assert_eq!(add_namespace(&fixture, "Plain0").await, json!(3));
    let host = Host::connect(fixture.address, NQN, HostOptions::default())
        .await
        .expect("connect");
    let count = |counts: &[AtomicU64; 3], which: usize| counts[which].load(Ordering::Relaxed);

    let data = pattern(9, 8192);
    host.write(0, 2, 64, data.clone(), BLOCK, false)
        .await
        .expect("write");
    assert_eq!(
        (count(&cached, FUA_WRITES), count(&cached, PLAIN_WRITES)),
        (1, 0)
    );
    assert_eq!(host.read(0, 2, 64, 16, BLOCK).await.expect("read"), data);

    host.write_zeroes(0, 2, 64, 8, false)
        .await
        .expect("write zeroes");
    assert_eq!(count(&cached, FLUSHES), 1, "write zeroes flushed");
    host.deallocate(0, 2, &[(72, 8)]).await.expect("deallocate");
    assert_eq!(count(&cached, FLUSHES), 2, "deallocate flushed");
    let zeroes = host.read(0, 2, 64, 16, BLOCK).await.expect("read");
    assert!(zeroes.iter().all(|b| *b == 0));

    // A bdev without a cache gets the writes as the host sent them, and no extra flush.
    host.write(0, 3, 64, data, BLOCK, false)
        .await
        .expect("write");
    host.write_zeroes(0, 3, 64, 8, false)
        .await
        .expect("write zeroes");
    let plain_counts = [FUA_WRITES, PLAIN_WRITES, FLUSHES].map(|which| count(&plain, which));
    assert_eq!(plain_counts, [0, 1, 0], "FUA writes, plain writes, flushes");
}

/// A host whose connection closes has given up the commands under way on it (it sends them
/// again on its next connection, and may send later ones for the same blocks): the target
/// gives them up too, so that none lands after what the host sends next. Here a write
/// waits behind a closed gate when the host goes; once the gate opens, it never lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_under_way_are_given_up_when_their_connection_closes() {
    let fixture = fixture(json!({"trtype": "TCP"})).await;
    let held = basalt_bdev::gated::Held {
        writes: true,
        ..Default::default()
    };
    let gate = gated_namespace(&fixture, held).await;
    let host = Arc::new(
        Host::connect(fixture.address, NQN, HostOptions::default())
            .await
            .expect("connect"),
    );
    let writer = host.clone();
    let write =
        tokio::spawn(async move { writer.write(0, 2, 8, pattern(5, 4096), BLOCK, false).await });
    while gate.started() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    write.abort();
    let _ = write.await;
    drop(host);
    // The target sees the connections close: the controller goes.
    while controllers(&fixture)
        .await
        .as_array()
        .is_some_and(|c| !c.is_empty())
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    gate.open();
    let host = Host::connect(fixture.address, NQN, HostOptions::default())
        .await
        .expect("connect again");
    for _ in 0..20 {
        let data = host.read(0, 2, 8, 8, BLOCK).await.expect("read");
        assert!(data.iter().all(|b| *b == 0), "the write given up landed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The gate is open: a write now goes through.
    let data = pattern(6, 4096);
    host.write(0, 2, 8, data.clone(), BLOCK, false)
        .await
        .expect("write");
    assert_eq!(host.read(0, 2, 8, 8, BLOCK).await.expect("read"), data);
}

/// A fixture whose transport's data budget holds two 8 KiB commands (8 KiB is its
/// largest I/O, asked for with an R2T).
async fn two_command_budget() -> Fixture {
    let transport = json!({"trtype": "TCP", "max_io_size": 8192, "io_unit_size": 8192,
        "num_shared_buffers": 2});
    fixture(transport).await
}

/// `count` 8 KiB writes to namespace `nsid` at once, 16 blocks apart from block 0, the
/// `n`th of pattern `seed + n`.
fn spawn_writes(
    host: &Arc<Host>,
    nsid: u32,
    count: u64,
    seed: u8,
) -> Vec<tokio::task::JoinHandle<Result<(), basalt_nvmf::host::HostError>>> {
    (0..count)
        .map(|n| {
            let host = host.clone();
            let data = pattern(seed + n as u8, 8192);
            tokio::spawn(async move { host.write(0, nsid, n * 16, data, BLOCK, false).await })
        })
        .collect()
}

/// The data bytes of the commands under way on all connections stay within the
/// transport's `num_shared_buffers` × `io_unit_size`: with room for two 8 KiB commands, a
/// third (another host's read) waits while two writes are held by their device, and ends
/// once they do. A queue whose next command waits for bytes still takes the write data of
/// its commands under way, which give bytes back: three 8 KiB writes sent at once on one
/// queue, each asking its data with an R2T, all end (they would wait for good if the
/// data stayed unread behind the third command).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_wait_for_the_transports_data_budget() {
    let fixture = two_command_budget().await;
    let held = basalt_bdev::gated::Held {
        writes: true,
        ..Default::default()
    };
    let gate = gated_namespace(&fixture, held).await;
    let connect = || Host::connect(fixture.address, NQN, HostOptions::default());
    let first = Arc::new(connect().await.expect("connect"));
    let second = connect().await.expect("connect");
    let writes = spawn_writes(&first, 2, 2, 1);
    wait_until(
        "the writes reach the device",
        Duration::from_secs(5),
        || gate.started() >= 2,
    )
    .await;
    let budget = fixture
        .target
        .data_budget()
        .expect("the transport's budget");
    assert_eq!(budget.in_use(), 16384, "the held writes hold the budget");
    let read = tokio::spawn(async move { second.read(0, 2, 64, 16, BLOCK).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !read.is_finished(),
        "the read waits for bytes of the budget"
    );
    assert_eq!(budget.parked(), 1, "the read is parked");
    let stats = rpc(&fixture, "nvmf_get_stats", Value::Null)
        .await
        .expect("stats");
    assert_eq!(
        stats["poll_groups"][0]["transports"][0]["pending_data_buffer"],
        json!(1),
        "{stats}"
    );
    gate.open();
    for write in writes {
        write.await.expect("task").expect("write");
    }
    let data = tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("the read ends once the writes give their bytes back")
        .expect("task")
        .expect("read");
    assert_eq!(data, vec![0; 8192]);

    let writes = spawn_writes(&first, 1, 3, 7);
    for write in writes {
        tokio::time::timeout(Duration::from_secs(5), write)
            .await
            .expect("every write ends")
            .expect("task")
            .expect("write");
    }
    for n in 0..3u64 {
        let back = first.read(0, 1, n * 16, 16, BLOCK).await.expect("read");
        assert_eq!(back, pattern(n as u8 + 7, 8192));
    }
    assert_eq!(budget.in_use(), 0, "every command gave its bytes back");
    assert_eq!(budget.parked(), 0, "none is parked");
}

/// A host that never sends the write data its R2Ts asked for loses its connection after
/// the transfer timeout, and the bytes of the data budget its writes held come back: the
/// write of another host, which waits for them meanwhile, then goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_withholding_write_data_loses_its_connection() {
    let fixture = two_command_budget().await;
    // The timeout is read as a connection starts: the broken host's is short, the other
    // host's the default.
    let target = &fixture.target;
    target.set_transfer_timeout(Duration::from_secs(1));
    let options = HostOptions {
        withhold_write_data: true,
        ..HostOptions::default()
    };
    let broken = Arc::new(
        Host::connect(fixture.address, NQN, options)
            .await
            .expect("connect"),
    );
    target.set_transfer_timeout(basalt_nvmf::target::TRANSFER_TIMEOUT);
    let good = Host::connect(fixture.address, NQN, HostOptions::default())
        .await
        .expect("connect");
    let writes = spawn_writes(&broken, 1, 2, 1);
    let budget = target.data_budget().expect("the transport's budget");
    wait_until("the R2Ts hold the budget", Duration::from_secs(1), || {
        budget.in_use() >= 16384
    })
    .await;
    let data = pattern(9, 8192);
    let write = {
        let data = data.clone();
        tokio::spawn(async move {
            good.write(0, 1, 64, data, BLOCK, false).await?;
            good.read(0, 1, 64, 16, BLOCK).await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !write.is_finished(),
        "the write waits for the broken host's bytes"
    );
    let back = tokio::time::timeout(Duration::from_secs(5), write)
        .await
        .expect("the write goes once the broken host's bytes come back")
        .expect("task")
        .expect("write and read");
    assert_eq!(back, data);
    for write in writes {
        let result = tokio::time::timeout(Duration::from_secs(5), write)
            .await
            .expect("the withheld writes end")
            .expect("task");
        assert!(result.is_err(), "a write whose data never came: {result:?}");
    }
    assert_eq!(budget.in_use(), 0, "every byte came back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_commands_in_flight_on_several_queues() {
    let fixture = fixture(json!({"trtype": "TCP"})).await;
    let options = HostOptions {
        io_queues: 4,
        queue_depth: 32,
        ..HostOptions::default()
    };
    let host = Arc::new(
        Host::connect(fixture.address, NQN, options)
            .await
            .expect("connect"),
    );
    let mut tasks = Vec::new();
    for worker in 0..64u64 {
        let host = host.clone();
        tasks.push(tokio::spawn(async move {
            let lba = worker * 64;
            let data = pattern(worker as u8, 8192);
            host.write(worker as usize, 1, lba, data.clone(), BLOCK, false)
                .await
                .expect("write");
            let back = host
                .read(worker as usize + 1, 1, lba, 16, BLOCK)
                .await
                .expect("read");
            assert_eq!(back, data);
        }));
    }
    for task in tasks {
        task.await.expect("worker");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r2t_only_writes_and_small_h2c_pdus() {
    // A 4 KiB MAXH2CDATA splits a 128 KiB write into 32 H2CData PDUs.
    let fixture =
        fixture(json!({"trtype": "TCP", "io_unit_size": 4096, "in_capsule_data_size": 0})).await;
    let options = HostOptions {
        no_in_capsule_data: true,
        data_digest: true,
        ..HostOptions::default()
    };
    let host = Host::connect(fixture.address, NQN, options)
        .await
        .expect("connect");
    read_write_cycle(&host, 0, 0, 128 << 10, 9).await;
    read_write_cycle(&host, 0, 1000, 512, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_not_allowed_are_refused() {
    let fixture = fixture(json!({"trtype": "TCP"})).await;
    rpc(
        &fixture,
        "nvmf_subsystem_allow_any_host",
        json!({"nqn": NQN, "allow_any_host": false}),
    )
    .await
    .expect("deny");
    let options = HostOptions::default();
    let refused = Host::connect(fixture.address, NQN, options.clone())
        .await
        .err()
        .expect("refused");
    let status = refused.status().expect("an nvme status");
    assert_eq!(
        (status.sct(), status.sc()),
        (1, 0x84),
        "connect invalid host: {refused}"
    );
    let host_rpc = |method: &'static str| {
        let params = json!({"nqn": NQN, "host": options.host_nqn});
        let fixture = &fixture;
        async move { rpc(fixture, method, params).await.expect(method) }
    };
    host_rpc("nvmf_subsystem_add_host").await;
    let allowed = Host::connect(fixture.address, NQN, options.clone())
        .await
        .expect("allowed now");
    read_write_cycle(&allowed, 0, 0, 4096, 3).await;
    // Removed, the host loses its controller at once: its queues close, and it is
    // refused when it connects again.
    host_rpc("nvmf_subsystem_remove_host").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while controllers(&fixture).await != json!([]) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the controller stays"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    allowed
        .read(0, 1, 0, 8, BLOCK)
        .await
        .expect_err("its queues are closed");
    Host::connect(fixture.address, NQN, options)
        .await
        .err()
        .expect("refused again");
    let unknown = Host::connect(
        fixture.address,
        "nqn.2016-06.io.basalt:nothing",
        HostOptions::default(),
    )
    .await
    .err()
    .expect("unknown subsystem");
    assert_eq!(unknown.status().map(|s| s.sc()), Some(0x82), "{unknown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_host_loses_its_controller() {
    let fixture = fixture(json!({"trtype": "TCP"})).await;
    let options = HostOptions {
        keep_alive_timeout_ms: 300,
        send_keep_alive: false,
        ..HostOptions::default()
    };
    let host = Host::connect(fixture.address, NQN, options)
        .await
        .expect("connect");
    read_write_cycle(&host, 0, 0, 4096, 1).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        controllers(&fixture).await,
        json!([]),
        "the controller is gone"
    );
    host.read(0, 1, 0, 8, BLOCK)
        .await
        .expect_err("its queues are closed");

    // A host that sends Keep Alive keeps its controller.
    let options = HostOptions {
        keep_alive_timeout_ms: 300,
        ..HostOptions::default()
    };
    let host = Host::connect(fixture.address, NQN, options)
        .await
        .expect("connect");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    read_write_cycle(&host, 0, 0, 4096, 2).await;
}

type Notice =
    tokio::task::JoinHandle<Result<basalt_nvmf::host::Completion, basalt_nvmf::host::HostError>>;

/// Enables namespace attribute notices and leaves an Asynchronous Event Request waiting.
async fn await_notice(host: &Arc<Host>) -> Notice {
    let config = Sqe {
        opcode: ADMIN_SET_FEATURES,
        cdw10: u32::from(FEATURE_ASYNC_EVENT_CONFIGURATION),
        cdw11: 1 << 8,
        ..Sqe::default()
    };
    host.admin(config, Vec::new(), 0)
        .await
        .expect("enable notices");
    let host = host.clone();
    tokio::spawn(async move {
        let request = Sqe {
            opcode: ADMIN_ASYNC_EVENT_REQUEST,
            ..Sqe::default()
        };
        host.admin(request, Vec::new(), 0).await
    })
}

/// The request `waiting` completes with a namespace attribute notice, and the changed
/// namespace list names `nsid` (alone).
async fn expect_notice(host: &Host, waiting: Notice, nsid: u8) {
    let event = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("event in time")
        .expect("task")
        .expect("aer");
    assert_eq!(
        event.cqe.dw0, 0x0004_0002,
        "notice: namespace attribute changed, log page 04h"
    );
    let changed = host
        .log_page(LOG_CHANGED_NAMESPACES, 0, 4096, false)
        .await
        .expect("changed list");
    assert_eq!(&changed[..8], &[nsid, 0, 0, 0, 0, 0, 0, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_that_grows_raises_an_event_and_reads_at_its_new_size() {
    let fixture = fixture(json!({"trtype": "TCP"})).await;
    let path = std::env::temp_dir().join(format!("basalt-nvmf-grow-{}", std::process::id()));
    std::fs::File::create(&path)
        .and_then(|file| file.set_len(4 << 20))
        .expect("file");
    basalt_bdev::rpc::call(
        &fixture.registry,
        "bdev_uring_create",
        json!({"name": "Grow0", "filename": path, "buffered": true}),
    )
    .expect("a bdev method")
    .expect("file bdev");
    rpc(
        &fixture,
        "nvmf_subsystem_add_ns",
        json!({"nqn": NQN, "namespace": {"bdev_name": "Grow0", "nsid": 2}}),
    )
    .await
    .expect("add");
    let host = Arc::new(
        Host::connect(fixture.address, NQN, HostOptions::default())
            .await
            .expect("connect"),
    );
    assert_eq!(
        host.namespace_geometry(2).await.expect("identify"),
        (512, 8192)
    );
    let waiting = await_notice(&host).await;
    // Past the end: refused until the bdev grows.
    assert!(
        host.read(0, 2, 12_000, 1, BLOCK).await.is_err(),
        "beyond the end"
    );
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|file| file.set_len(8 << 20))
        .expect("grow the file");
    basalt_bdev::rpc::call(
        &fixture.registry,
        "bdev_uring_rescan",
        json!({"name": "Grow0"}),
    )
    .expect("a bdev method")
    .expect("rescan");
    expect_notice(&host, waiting, 2).await;
    assert_eq!(
        host.namespace_geometry(2).await.expect("identify"),
        (512, 16384)
    );
    let data = vec![0x5au8; 512];
    host.write(0, 2, 16_383, data.clone(), BLOCK, false)
        .await
        .expect("write in the new blocks");
    assert_eq!(
        host.read(0, 2, 16_383, 1, BLOCK).await.expect("read back"),
        data
    );
    drop(host);
    std::fs::remove_file(path).expect("remove");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_changes_raise_an_event_and_discovery_lists_subsystems() {
    let fixture = fixture(json!({"trtype": "TCP"})).await;
    let host = Arc::new(
        Host::connect(fixture.address, NQN, HostOptions::default())
            .await
            .expect("connect"),
    );
    let waiting = await_notice(&host).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished(), "no event yet");
    add_malloc(&fixture.registry, "Malloc1");
    let nsid = rpc(
        &fixture,
        "nvmf_subsystem_add_ns",
        json!({"nqn": NQN, "namespace": {"bdev_name": "Malloc1", "nsid": 5}}),
    )
    .await
    .expect("add");
    assert_eq!(nsid, json!(5));
    expect_notice(&host, waiting, 5).await;
    assert_eq!(host.namespaces().await.expect("namespaces"), vec![1, 5]);
    // The bdev is claimed: it cannot be deleted while exported.
    rpc(
        &fixture,
        "nvmf_subsystem_remove_ns",
        json!({"nqn": NQN, "nsid": 5}),
    )
    .await
    .expect("remove");
    assert_eq!(host.namespaces().await.expect("namespaces"), vec![1]);

    // Discovery: the subsystem on its listener.
    let discovery = Host::connect(
        fixture.address,
        basalt_nvmf::fabrics::DISCOVERY_NQN,
        HostOptions {
            io_queues: 0,
            ..HostOptions::default()
        },
    )
    .await
    .expect("discovery connect");
    assert_eq!(discovery.identify[111], 2, "a discovery controller");
    // Its error log is served as its ELPE says, empty: nothing failed on it.
    let errors = discovery
        .log_page(LOG_ERROR, 0, 64, false)
        .await
        .expect("error log");
    assert_eq!(
        (discovery.identify[262], errors),
        (63, vec![0; 64]),
        "ELPE and the discovery controller's error log"
    );
    // It names no log page it does not serve: no commands supported and effects log (LPA
    // bit 1), no firmware slots (FRMW).
    assert_eq!(
        (discovery.identify[260], discovery.identify[261]),
        (0, 1 << 2),
        "FRMW and LPA of a discovery controller"
    );
    for refused in [LOG_COMMAND_EFFECTS, LOG_FIRMWARE_SLOT, LOG_HEALTH] {
        let error = discovery
            .log_page(refused, 0, 512, false)
            .await
            .expect_err("a page the discovery controller does not serve");
        assert_eq!(error.status(), Some(Status::INVALID_LOG_PAGE.with_dnr()));
    }
    let header = discovery
        .log_page(LOG_DISCOVERY, 0, 1024, false)
        .await
        .expect("header");
    let records = u64::from_le_bytes(header[8..16].try_into().expect("in range"));
    assert_eq!(records, 2, "the discovery subsystem and ours");
    let page = discovery
        .log_page(LOG_DISCOVERY, 0, 3 * 1024, false)
        .await
        .expect("page");
    let entry = &page[2048..3072];
    assert_eq!(entry[2], 2, "an NVM subsystem");
    assert_eq!(&entry[256..256 + NQN.len()], NQN.as_bytes());
    assert_eq!(
        std::str::from_utf8(&entry[32..64])
            .expect("ascii")
            .trim_end(),
        fixture.address.port().to_string()
    );
}

/// Reads until the peer closes; returns what arrived.
async fn read_to_close(stream: &mut tokio::net::TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut received)).await;
    received
}

fn ic_req() -> Vec<u8> {
    let mut pdu = vec![0u8; 128];
    pdu[2] = 128;
    pdu[4] = 128;
    pdu
}

/// A raw connection past ICReq (asking for the DGST bits `digests`) and ICResp; the stream
/// and the ICResp.
async fn established(address: SocketAddr, digests: u8) -> (tokio::net::TcpStream, [u8; 128]) {
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect");
    let mut request = ic_req();
    request[11] = digests;
    stream.write_all(&request).await.expect("icreq");
    let mut resp = [0u8; 128];
    stream.read_exact(&mut resp).await.expect("icresp");
    assert_eq!(resp[0], 0x01, "an ICResp");
    (stream, resp)
}

/// Reads until the target closes; it must have sent a C2HTermReq with `status` (FES).
async fn expect_term_req(stream: &mut tokio::net::TcpStream, status: u16, what: &str) {
    let reply = read_to_close(stream).await;
    assert_eq!(reply.first(), Some(&0x03), "a C2HTermReq for {what}");
    assert_eq!(u16::from_le_bytes([reply[8], reply[9]]), status, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pdus_get_a_term_req_and_spare_other_connections() {
    let fixture = fixture(json!({"trtype": "TCP"})).await;
    let host = Host::connect(fixture.address, NQN, HostOptions::default())
        .await
        .expect("connect");

    // A CapsuleCmd before ICReq: a PDU sequence error.
    let mut stream = tokio::net::TcpStream::connect(fixture.address)
        .await
        .expect("connect");
    let mut capsule = vec![0u8; 72];
    capsule[0] = 0x04;
    capsule[2] = 72;
    capsule[4] = 72;
    stream.write_all(&capsule).await.expect("send");
    expect_term_req(&mut stream, 0x02, "PDU sequence error").await;

    // An unknown PDU type after ICReq: invalid header field at byte 0.
    let (mut stream, _) = established(fixture.address, 0).await;
    stream
        .write_all(&[0x0f, 0, 8, 0, 8, 0, 0, 0])
        .await
        .expect("send");
    expect_term_req(&mut stream, 0x01, "invalid header field").await;

    // A PLEN far beyond what was negotiated: data transfer limit exceeded.
    let (mut stream, _) = established(fixture.address, 0).await;
    let mut huge = capsule.clone();
    huge[3] = 72;
    huge[4..8].copy_from_slice(&(64u32 << 20).to_le_bytes());
    stream.write_all(&huge).await.expect("send");
    expect_term_req(&mut stream, 0x05, "data transfer limit exceeded").await;

    // Random bytes, many times: never a panic, always a close.
    for seed in 0..20u64 {
        let mut stream = tokio::net::TcpStream::connect(fixture.address)
            .await
            .expect("connect");
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let noise: Vec<u8> = (0..512)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        let mut bytes = if seed % 2 == 0 { ic_req() } else { Vec::new() };
        bytes.extend_from_slice(&noise);
        let _ = stream.write_all(&bytes).await;
        let _ = read_to_close(&mut stream).await;
    }

    // A command before Connect: command sequence error, connection kept.
    let (mut stream, _) = established(fixture.address, 0).await;
    let mut identify = capsule.clone();
    identify[8] = ADMIN_IDENTIFY;
    identify[10] = 7; // command id
    stream.write_all(&identify).await.expect("send");
    let mut response = [0u8; 24];
    stream.read_exact(&mut response).await.expect("response");
    assert_eq!(response[0], 0x05, "a response capsule");
    assert_eq!(u16::from_le_bytes([response[20], response[21]]), 7);
    let status = Status::from_field(u16::from_le_bytes([response[22], response[23]]));
    assert_eq!(status.sc(), 0x0c, "command sequence error");

    // The well-behaved host never noticed.
    read_write_cycle(&host, 0, 0, 8192, 5).await;
}

/// Queue pairs go to reactors as the placement says, and `nvmf_subsystem_get_qpairs`
/// names the reactor thread serving each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_pairs_are_placed_by_weight() {
    use basalt_io::Placement;
    let reactors =
        Reactors::start_with(2, "weighted", Placement::WeightedRoundRobin).expect("reactors");
    reactors.set_weights(&[0, 1]).expect("weights");
    let fixture = fixture_on(reactors, json!({"trtype": "TCP"})).await;
    let options = HostOptions {
        io_queues: 3,
        ..HostOptions::default()
    };
    let host = Host::connect(fixture.address, NQN, options)
        .await
        .expect("connect");
    read_write_cycle(&host, 2, 0, 4096, 1).await;
    let qpairs = rpc(&fixture, "nvmf_subsystem_get_qpairs", json!({"nqn": NQN}))
        .await
        .expect("qpairs");
    let threads: Vec<&str> = qpairs
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|q| q["thread"].as_str())
        .collect();
    assert_eq!(
        threads, ["weighted-1"; 4],
        "all on the reactor of weight 1: {qpairs}"
    );
    let stats = rpc(&fixture, "nvmf_get_stats", Value::Null)
        .await
        .expect("stats");
    assert_eq!(
        stats["poll_groups"][0]["current_io_qpairs"],
        json!(3),
        "{stats}"
    );
    assert_eq!(
        stats["poll_groups"][0]["current_admin_qpairs"],
        json!(1),
        "{stats}"
    );
    drop(host);

    let reactors =
        Reactors::start_with(2, "even", Placement::WeightedRoundRobin).expect("reactors");
    let fixture = fixture_on(reactors, json!({"trtype": "TCP"})).await;
    let host = Host::connect(
        fixture.address,
        NQN,
        HostOptions {
            io_queues: 3,
            ..HostOptions::default()
        },
    )
    .await
    .expect("connect");
    let qpairs = rpc(&fixture, "nvmf_subsystem_get_qpairs", json!({"nqn": NQN}))
        .await
        .expect("qpairs");
    let threads: Vec<&str> = qpairs
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|q| q["thread"].as_str())
        .collect();
    assert_eq!(
        threads,
        ["even-0", "even-1", "even-0", "even-1"],
        "equal weights alternate: {qpairs}"
    );
    drop(host);
}

/// Digests: a bad data digest fails its command with a transient transport error and the
/// connection goes on; a bad header digest ends it with a TermReq. H2CData beyond
/// MAXH2CDATA is refused before its data is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_digests_and_oversized_data_pdus() {
    use basalt_nvmf::pdu::{CapsuleCmd, Negotiated, Pdu, Role, encode};
    use basalt_nvmf::{SglDescriptor, Status};
    let fixture = fixture(json!({"trtype": "TCP", "io_unit_size": 4096})).await;
    let host_side = Negotiated {
        role: Role::Host,
        established: true,
        header_digest: true,
        data_digest: true,
        receive_pda: 0,
        send_pda: 0,
        data_size_max: 1 << 20,
        in_capsule_data_size_max: 0,
    };
    let (mut stream, resp) = established(fixture.address, 0b11).await; // header and data digests
    assert_eq!(resp[11], 0b11, "digests granted");

    let capsule = |command_id: u16| {
        let sqe = Sqe {
            opcode: FABRICS,
            command_id,
            namespace_id: u32::from(basalt_nvmf::fabrics::FCTYPE_PROPERTY_GET),
            data_pointer: SglDescriptor::in_capsule(16),
            ..Sqe::default()
        };
        let mut bytes = Vec::new();
        encode(
            &Pdu::CapsuleCmd(CapsuleCmd {
                sqe,
                data: &[7; 16],
            }),
            &host_side,
            &mut bytes,
        );
        bytes
    };
    let mut bad_data = capsule(41);
    let last = bad_data.len() - 1;
    bad_data[last] ^= 0xff;
    stream.write_all(&bad_data).await.expect("send");
    let mut response = [0u8; 28]; // CapsuleResp with its header digest
    stream.read_exact(&mut response).await.expect("response");
    assert_eq!(response[0], 0x05, "a response capsule");
    assert_eq!(u16::from_le_bytes([response[20], response[21]]), 41);
    let status = Status::from_field(u16::from_le_bytes([response[22], response[23]]));
    assert_eq!(
        status,
        Status::TRANSIENT_TRANSPORT_ERROR,
        "the command failed, retryably"
    );
    assert_eq!(
        crc32c::crc32c(&response[..24]).to_le_bytes(),
        response[24..28],
        "the response carries a header digest"
    );

    let mut bad_header = capsule(42);
    bad_header[72] ^= 0xff; // the header digest follows the 72-byte header
    stream.write_all(&bad_header).await.expect("send");
    expect_term_req(&mut stream, 0x03, "header digest error").await;

    // H2CData with 8 KiB of data when MAXH2CDATA is 4 KiB.
    let (mut stream, resp) = established(fixture.address, 0).await;
    assert_eq!(
        u32::from_le_bytes([resp[12], resp[13], resp[14], resp[15]]),
        4096,
        "MAXH2CDATA"
    );
    let mut data = vec![0u8; 24];
    data[0] = 0x06;
    data[2] = 24;
    data[3] = 24;
    data[4..8].copy_from_slice(&(24u32 + 8192).to_le_bytes());
    data[16..20].copy_from_slice(&8192u32.to_le_bytes());
    stream.write_all(&data).await.expect("send");
    expect_term_req(&mut stream, 0x05, "data transfer limit exceeded").await;
}

/// A queue pair that polls while its commands are under way answers each as soon as it
/// completes, not when the poll runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_queue_pair_answers_commands_as_they_complete() {
    let fixture = fixture(json!({"trtype": "TCP"})).await;
    fixture.reactors.set_poll(Duration::from_secs(1));
    Counting::register_with(&fixture, "Slow0", false, Some(Duration::from_millis(2)));
    assert_eq!(add_namespace(&fixture, "Slow0").await, json!(2));
    let host = Host::connect(fixture.address, NQN, HostOptions::default())
        .await
        .expect("connect");
    let start = std::time::Instant::now();
    for lba in 0..10 {
        host.read(0, 2, lba, 1, BLOCK).await.expect("read");
    }
    let took = start.elapsed();
    // Answered only once the poll ran out, ten reads would take ten seconds.
    assert!(
        took < Duration::from_secs(2),
        "ten 2 ms reads took {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_queue_pair_leaves_its_reactor_to_the_others() {
    // One reactor, and idle queue pairs poll for up to a second before it sleeps.
    let fixture = fixture(json!({"trtype": "TCP"})).await;
    fixture.reactors.set_poll(Duration::from_secs(1));
    let connect = || async {
        let options = HostOptions {
            io_queues: 1,
            ..HostOptions::default()
        };
        Host::connect(fixture.address, NQN, options)
            .await
            .expect("connect")
    };
    let (sparse, busy) = (connect().await, connect().await);
    // One host reads every 20 ms, so its queue pair polls between its commands; the other
    // runs write-read cycles back to back on the same reactor meanwhile.
    let window = Duration::from_secs(2);
    let sparse_task = async {
        let start = std::time::Instant::now();
        let mut commands = 0;
        while start.elapsed() < window {
            sparse.read(1, 1, 0, 1, BLOCK).await.expect("read");
            commands += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        commands
    };
    let busy_task = async {
        let start = std::time::Instant::now();
        let mut cycles = 0u64;
        while start.elapsed() < window {
            read_write_cycle(&busy, 1, 64 + cycles % 64 * 8, 4096, cycles as u8).await;
            cycles += 1;
        }
        cycles
    };
    let (commands, cycles) = tokio::join!(sparse_task, busy_task);
    assert!(commands >= 10, "{commands} sparse commands");
    // Were the reactor held while a queue pair polls, the busy host would get a command
    // in between the sparse host's only.
    assert!(
        cycles >= 200,
        "{cycles} cycles in {window:?} beside a polling queue pair"
    );

    // A queue pair whose next command always comes within the poll still notices that
    // its controller is gone: reads back to back, then the subsystem is deleted.
    let reads = async {
        let start = std::time::Instant::now();
        while busy.read(1, 1, 0, 1, BLOCK).await.is_ok() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "still served long after the subsystem was deleted"
            );
        }
        start.elapsed()
    };
    let delete = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        rpc(&fixture, "nvmf_delete_subsystem", json!({"nqn": NQN}))
            .await
            .expect("delete");
    };
    let (served_for, ()) = tokio::join!(reads, delete);
    assert!(served_for < Duration::from_secs(5), "{served_for:?}");
}
