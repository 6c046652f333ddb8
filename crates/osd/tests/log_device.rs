//! The log device on a real file: group commit, replay after reopening, and refusals.

use std::path::{Path, PathBuf};

use basalt_common::{Lsn, PgId, PoolId};
use basalt_osd::log_device::{LogDevice, LogDeviceError, Opened};
use basalt_store::batch::{ENTRY_COUNT_MAX, Entry};

fn device_file(name: &str, len: u64) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("osd-log-{name}-{}", std::process::id()));
    std::fs::File::create(&path)
        .expect("create")
        .set_len(len)
        .expect("set_len");
    path
}

/// A device file of `len` bytes, formatted (its uuid all `uuid` bytes) and opened, with
/// no empty batch written after a pause (the tests count batches).
async fn formatted_device(name: &str, len: u64, uuid: u8) -> (PathBuf, LogDevice) {
    let path = device_file(name, len);
    LogDevice::format(&path, [uuid; 16]).await.expect("format");
    let device = LogDevice::open(&path).await.expect("open").device;
    device.set_fence_after(None);
    (path, device)
}

/// What `LogDevice::write_checkpoint` builds, given ready.
fn given(
    checkpoint: &basalt_store::checkpoint::Checkpoint,
) -> impl FnOnce() -> basalt_store::checkpoint::Checkpoint + Send + 'static {
    let checkpoint = checkpoint.clone();
    move || checkpoint
}

/// Writes `checkpoint` to area 0 of `device`, closes it and opens it again.
async fn checkpoint_and_reopen(
    device: LogDevice,
    path: &Path,
    checkpoint: &basalt_store::checkpoint::Checkpoint,
) -> Result<Opened, LogDeviceError> {
    device
        .write_checkpoint(0, given(checkpoint))
        .await
        .expect("checkpoint");
    drop(device);
    LogDevice::open(path).await
}

/// Every entry replay found, in order.
fn replayed_entries(opened: &Opened) -> Vec<&Entry> {
    opened
        .replayed
        .batches
        .iter()
        .flat_map(|b| b.entries.iter().map(|(e, _)| e))
        .collect()
}

fn entry(pg: u32, index: u64, byte: u8) -> Entry {
    Entry {
        kind: 1,
        pg: PgId {
            pool: PoolId(1),
            index: pg,
        },
        term: 1,
        index,
        meta: [byte; 24],
        data: vec![byte; 4096],
    }
}

/// In a single-threaded runtime, appends submitted without yielding are all queued when the
/// writer first runs: 64 one-entry appends take exactly two batches (63 entries fit in one).
#[tokio::test(flavor = "current_thread")]
async fn queued_appends_share_batches_and_replay_in_order() {
    let path = device_file("group", 64 << 20);
    LogDevice::format(&path, [1; 16]).await.expect("format");
    let opened = LogDevice::open(&path).await.expect("open");
    assert!(opened.replayed.batches.is_empty(), "a fresh log is empty");
    let device = opened.device;
    device.set_fence_after(None);
    let pending: Vec<_> = (0..64u64)
        .map(|n| device.submit(vec![entry((n % 8) as u32, n + 1, n as u8)]))
        .collect();
    let mut lsns = Vec::new();
    for append in pending {
        lsns.push(append.await.expect("durable").lsn);
    }
    assert_eq!(
        lsns.iter().filter(|lsn| **lsn == Lsn(1)).count(),
        ENTRY_COUNT_MAX
    );
    assert_eq!(
        lsns.iter().filter(|lsn| **lsn == Lsn(2)).count(),
        64 - ENTRY_COUNT_MAX
    );
    let stats = device.stats();
    assert_eq!((stats.batches, stats.appends, stats.entries), (2, 64, 64));
    assert_eq!(stats.data_bytes, 64 * 4096);
    assert_eq!(
        stats.device_bytes,
        (1 + 63 + 1 + 1) * 4096,
        "two headers and 64 data blocks"
    );
    assert!((stats.write_amplification() - 66.0 / 64.0).abs() < 1e-9);

    // One append at a time: nothing to group with, one batch each.
    for n in 64..74u64 {
        device
            .submit(vec![entry(0, n + 1, n as u8)])
            .await
            .expect("durable");
    }
    assert_eq!(device.stats().batches, 12);
    drop(device);

    let reopened = LogDevice::open(&path).await.expect("reopen");
    let entries = replayed_entries(&reopened);
    assert_eq!(entries.len(), 74);
    for (n, found) in entries.iter().enumerate() {
        assert_eq!(
            **found,
            entry(
                if n < 64 { (n % 8) as u32 } else { 0 },
                n as u64 + 1,
                n as u8
            ),
            "entry {n}"
        );
    }
    let next = reopened
        .device
        .submit(vec![entry(0, 75, 75)])
        .await
        .expect("append after replay");
    assert_eq!(
        next.lsn,
        Lsn(13),
        "the log goes on after the replayed batches"
    );
    std::fs::remove_file(path).expect("remove");
}

#[tokio::test(flavor = "current_thread")]
async fn data_offsets_point_at_the_data() {
    use std::os::unix::fs::FileExt;
    let (path, device) = formatted_device("offsets", 32 << 20, 2).await;
    let appended = device
        .submit(vec![entry(3, 1, 0xab), entry(4, 1, 0xcd)])
        .await
        .expect("durable");
    let file = std::fs::File::open(&path).expect("open");
    for (offset, byte) in appended.data_offsets_bytes.iter().zip([0xab, 0xcd]) {
        let mut data = vec![0u8; 4096];
        file.read_exact_at(&mut data, *offset).expect("read");
        assert!(data.iter().all(|b| *b == byte), "data at {offset}");
    }
    std::fs::remove_file(path).expect("remove");
}

#[tokio::test(flavor = "current_thread")]
async fn refusals_are_clear() {
    let unformatted = device_file("unformatted", 16 << 20);
    let error = LogDevice::open(&unformatted)
        .await
        .err()
        .expect("not formatted");
    assert!(
        error.to_string().contains("not a basalt osd device"),
        "{error}"
    );

    let tiny = device_file("tiny", 1 << 20);
    let error = LogDevice::format(&tiny, [0; 16])
        .await
        .expect_err("too small");
    assert!(matches!(error, LogDeviceError::TooSmall { .. }), "{error}");

    let small = device_file("small", 32 << 20);
    LogDevice::format(&small, [3; 16]).await.expect("format");
    let device = LogDevice::open(&small).await.expect("open").device;
    let too_many: Vec<Entry> = (0..ENTRY_COUNT_MAX as u64 + 1)
        .map(|n| entry(0, n, 1))
        .collect();
    assert!(matches!(
        device.submit(too_many).await,
        Err(LogDeviceError::TooLarge { .. })
    ));
    std::fs::remove_file(&small).expect("remove");
    let small = device_file("small", 32 << 20);
    LogDevice::format(&small, [3; 16]).await.expect("format");
    let device = LogDevice::open(&small).await.expect("open").device;
    // Appends fill the ring down to the cleaner's floor, then wait for the tail to move.
    let mut last_end = 0;
    while device.free_bytes() >= basalt_osd::log_device::FLOOR_BYTES + 8192 {
        last_end = device
            .submit(vec![entry(0, 1, 1)])
            .await
            .expect("room")
            .end_position;
    }
    let waiting = tokio::spawn(device.submit(vec![entry(0, 2, 2)]));
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "an append waits while the ring is full"
    );
    // A relocation may use the floor, and overtakes the waiting append.
    let relocated = device
        .submit_relocation(vec![entry(0, 3, 3)])
        .await
        .expect("the reserve takes relocations");
    assert!(relocated.end_position > last_end);
    assert!(!waiting.is_finished());
    device.set_tail(last_end / 2);
    let appended = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
        .await
        .expect("the append goes once the tail moved")
        .expect("task")
        .expect("durable");
    assert!(appended.lsn > relocated.lsn);
    for path in [unformatted, tiny, small] {
        std::fs::remove_file(path).expect("remove");
    }
}

/// A read in flight keeps its place in the ring from reuse: with the ring full and a
/// checkpoint's tail past that place, an append that the freed space would take waits
/// until the read's pin is dropped; then the writer laps onto the place.
#[tokio::test(flavor = "current_thread")]
async fn a_read_in_flight_keeps_its_place_from_reuse() {
    use std::os::unix::fs::FileExt;
    let (path, device) = formatted_device("pin", 32 << 20, 5).await;
    let ring = device.ring();
    let first = device.submit(vec![entry(0, 1, 7)]).await.expect("room");
    let place = first.data_offsets_bytes[0];
    let file = std::fs::File::open(&path).expect("open");
    let read_place = || {
        let mut data = vec![0u8; 4096];
        file.read_exact_at(&mut data, place).expect("read");
        data
    };
    assert!(device.pin([]).is_none(), "nothing to pin");
    assert!(
        device.pin([0]).is_none(),
        "the superblock is not in the ring"
    );
    // The read starts at the batch's first block.
    let pin = device
        .pin([ring.device_offset(first.position)])
        .expect("a place in the ring");
    let mut index = 1;
    let mut last_end = first.end_position;
    while device.free_bytes() >= basalt_osd::log_device::FLOOR_BYTES + 8192 {
        index += 1;
        last_end = device
            .submit(vec![entry(0, index, 1)])
            .await
            .expect("room")
            .end_position;
    }
    let freed = last_end - (1 << 20);
    device.set_tail(freed);
    assert_eq!(device.tail_position(), freed);
    assert!(
        device.free_bytes() > 1 << 20,
        "free as far as checkpoints go"
    );
    let waiting = tokio::spawn(device.submit(vec![entry(0, index + 1, 2)]));
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "the ring is not reused under a read in flight"
    );
    drop(pin);
    let mut appended = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
        .await
        .expect("the append goes once the read is done")
        .expect("task")
        .expect("durable");
    assert_eq!(read_place(), vec![7u8; 4096], "not lapped yet");
    // Free on: the writer laps onto the place the read had.
    while appended.position < ring.len_bytes {
        index += 1;
        device.set_tail(appended.end_position - (1 << 20));
        appended = device.submit(vec![entry(0, index, 9)]).await.expect("room");
    }
    assert_eq!(
        appended.position, ring.len_bytes,
        "the next lap starts there"
    );
    assert_eq!(read_place(), vec![9u8; 4096], "the place is reused");
    std::fs::remove_file(path).expect("remove");
}

/// The ring is reused over several laps; a checkpoint says where replay starts and where the
/// tail is; a torn newer checkpoint leaves the older one in force.
#[tokio::test(flavor = "current_thread")]
async fn the_ring_is_reused_and_replay_starts_at_the_checkpoint() {
    use basalt_store::checkpoint::Checkpoint;
    let (path, device) = formatted_device("ring", 32 << 20, 4).await;
    let ring = device.ring().len_bytes;
    // Write three laps' worth, freeing all but the last few MiB behind the head.
    let mut index = 0u64;
    let mut written = 0u64;
    let mut ends = Vec::new();
    while written < 3 * ring {
        index += 1;
        let appended = device
            .submit(vec![entry(1, index, (index % 251) as u8)])
            .await
            .expect("room");
        ends.push((appended.end_position, appended.lsn.next(), index));
        written += 8192;
        device.set_tail(appended.end_position.saturating_sub(4 << 20));
    }
    // A checkpoint 100 appends back, then one newer but torn.
    let (position, lsn, from_index) = ends[ends.len() - 101];
    let checkpoint = Checkpoint {
        sequence: 7,
        replay_position: position,
        replay_lsn: lsn,
        tail_position: position - (2 << 20),
        tail_lsn: basalt_common::Lsn(1),
        pgs: Vec::new(),
        block_sums: Vec::new(),
        poisoned_blocks: Vec::new(),
    };
    device
        .write_checkpoint(1, given(&checkpoint))
        .await
        .expect("checkpoint");
    let newer = Checkpoint {
        sequence: 8,
        ..checkpoint.clone()
    };
    device
        .write_checkpoint(0, given(&newer))
        .await
        .expect("checkpoint");
    drop(device);
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open");
        // Area 0 starts after the superblock: tear its header.
        file.write_all_at(&[0xFF; 16], 4096 + 20).expect("tear");
    }
    let reopened = LogDevice::open(&path).await.expect("reopen");
    assert_eq!(reopened.checkpoint.as_ref(), Some(&checkpoint));
    let indexes: Vec<u64> = reopened
        .replayed
        .batches
        .iter()
        .flat_map(|b| b.entries.iter().map(|(e, _)| e.index))
        .collect();
    assert_eq!(indexes, ((from_index + 1)..=index).collect::<Vec<_>>());
    for batch in &reopened.replayed.batches {
        for (entry, _) in &batch.entries {
            assert_eq!(entry.data, vec![(entry.index % 251) as u8; 4096]);
        }
    }
    std::fs::remove_file(path).expect("remove");
}

/// A checkpoint of another format stops the open with a clear error: ignoring it would
/// replay from the ring's start and miss what it holds once the log has been reused.
#[tokio::test(flavor = "current_thread")]
async fn a_checkpoint_of_another_format_is_refused() {
    use basalt_store::checkpoint::{Checkpoint, FORMAT_VERSION, MAGIC};
    use std::os::unix::fs::FileExt;
    let (path, device) = formatted_device("format", 32 << 20, 5).await;
    let checkpoint = Checkpoint {
        sequence: 1,
        replay_lsn: Lsn(1),
        tail_lsn: Lsn(1),
        ..Checkpoint::default()
    };
    checkpoint_and_reopen(device, &path, &checkpoint)
        .await
        .expect("a checkpoint of this format opens");

    // Find the checkpoint by its magic and give it another version, with a valid header
    // checksum: only the version is wrong.
    let bytes = std::fs::read(&path).expect("read");
    let at = (0..bytes.len())
        .step_by(4096)
        .find(|at| bytes[*at..*at + 8] == MAGIC.to_le_bytes())
        .expect("checkpoint on the device");
    let mut header = bytes[at..at + 4096].to_vec();
    header[8..10].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    let crc = crc32c::crc32c(&header[..68]);
    header[68..72].copy_from_slice(&crc.to_le_bytes());
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open for write");
    file.write_all_at(&header, at as u64).expect("patch");
    drop(file);

    let error = LogDevice::open(&path)
        .await
        .err()
        .expect("another format is refused");
    let message = error.to_string();
    assert!(
        message.contains(&format!("checkpoint format {}", FORMAT_VERSION + 1))
            && message.contains("another version of basalt"),
        "{message}"
    );
    std::fs::remove_file(path).expect("remove");
}

/// An append with no entries takes a batch of its own (a header block), which replay
/// passes over to the batches after it: an OSD sends one to move where its cleaner may go.
#[tokio::test(flavor = "current_thread")]
async fn an_empty_append_is_a_batch_that_replay_passes_over() {
    let (path, device) = formatted_device("empty", 64 << 20, 1).await;
    device.submit(vec![entry(0, 1, 1)]).await.expect("durable");
    let head = device.head_position();
    let empty = device.submit(Vec::new()).await.expect("an empty append");
    assert_eq!(empty.lsn, Lsn(2));
    assert_eq!(empty.position, head);
    assert_eq!(device.head_position(), head + 4096, "a header block");
    device.submit(vec![entry(0, 2, 2)]).await.expect("durable");
    drop(device);

    let reopened = LogDevice::open(&path).await.expect("reopen");
    assert_eq!(reopened.replayed.batches.len(), 3);
    assert_eq!(
        replayed_entries(&reopened),
        [&entry(0, 1, 1), &entry(0, 2, 2)]
    );
    std::fs::remove_file(path).expect("remove");
}

/// Every block of data written has its checksum known, and a restart knows them again:
/// those of batches after the checkpoint from replay, those the checkpoint lists from it.
/// A block neither gives is not known (reads of it go unchecked), never wrongly known.
#[tokio::test(flavor = "current_thread")]
async fn block_checksums_are_known_again_after_a_restart() {
    use basalt_store::checkpoint::Checkpoint;
    let (path, device) = formatted_device("sums", 32 << 20, 6).await;
    let sum_of = |byte: u8| crc32c::crc32c(&[byte; 4096]);
    let mut two = entry(1, 2, 0x22);
    two.data.extend_from_slice(&[0x22; 100]);
    let first = device
        .submit(vec![entry(1, 1, 0x11), two])
        .await
        .expect("room");
    let (a, b) = (first.data_offsets_bytes[0], first.data_offsets_bytes[1]);
    let sums = device.block_sums();
    assert_eq!(sums.get(a), Some(sum_of(0x11)));
    assert_eq!(sums.get(b), Some(sum_of(0x22)));
    // The second block of entry 2 holds 100 bytes and the batch's zero padding.
    let mut tail = vec![0x22; 100];
    tail.resize(4096, 0);
    assert_eq!(sums.get(b + 4096), Some(crc32c::crc32c(&tail)));
    // A checkpoint after the first batch that lists entry 1's block only.
    let checkpoint = Checkpoint {
        sequence: 1,
        replay_position: first.end_position,
        replay_lsn: first.lsn.next(),
        tail_lsn: Lsn(1),
        block_sums: sums.runs([(a, 4096)]).0,
        ..Checkpoint::default()
    };
    device
        .write_checkpoint(0, given(&checkpoint))
        .await
        .expect("checkpoint");
    let later = device.submit(vec![entry(1, 3, 0x33)]).await.expect("room");
    let c = later.data_offsets_bytes[0];
    drop(device);
    let reopened = LogDevice::open(&path).await.expect("reopen").device;
    let sums = reopened.block_sums();
    assert_eq!(sums.get(a), Some(sum_of(0x11)), "from the checkpoint");
    assert_eq!(sums.get(b), None, "neither listed nor replayed");
    assert_eq!(sums.get(c), Some(sum_of(0x33)), "from replay");
    std::fs::remove_file(path).expect("remove");
}

/// A block a checkpoint lists as poisoned stays poisoned after a restart even when replay
/// goes through the batch there (a copy the cleaner moved just before the checkpoint, whose
/// replay start lies before it): replay's checksum of its bytes does not clear it.
#[tokio::test(flavor = "current_thread")]
async fn poisoned_blocks_stay_poisoned_through_replay() {
    use basalt_store::checkpoint::Checkpoint;
    let (path, device) = formatted_device("poison", 32 << 20, 7).await;
    let first = device.submit(vec![entry(1, 1, 0x11)]).await.expect("room");
    let moved = device.submit(vec![entry(1, 2, 0x22)]).await.expect("room");
    let at = moved.data_offsets_bytes[0];
    let sums = device.block_sums();
    sums.poison(at);
    // The checkpoint's replay starts before the moved copy's batch.
    let (block_sums, poisoned_blocks) =
        sums.runs([(first.data_offsets_bytes[0], 4096), (at, 4096)]);
    assert_eq!(poisoned_blocks, vec![(at, 1)]);
    let checkpoint = Checkpoint {
        sequence: 1,
        replay_position: first.end_position,
        replay_lsn: first.lsn.next(),
        tail_lsn: Lsn(1),
        block_sums,
        poisoned_blocks,
        ..Checkpoint::default()
    };
    let reopened = checkpoint_and_reopen(device, &path, &checkpoint)
        .await
        .expect("reopen");
    assert_eq!(
        reopened.replayed.batches.len(),
        1,
        "the moved copy's batch is replayed"
    );
    let sums = reopened.device.block_sums();
    assert!(sums.is_poisoned(at));
    assert!(sums.verify(at, &[0x22; 4096]).is_err());
    assert_eq!(
        sums.verify(first.data_offsets_bytes[0], &[0x11; 4096]),
        Ok(())
    );
    std::fs::remove_file(path).expect("remove");
}

/// Data of a client write damaged at rest in a batch that replay goes through (the batch
/// after it is intact) is spared: the device opens, replay goes on past it, and the
/// damaged entry's blocks fail every read. Damage to an entry of any other kind still
/// keeps the device from opening.
#[tokio::test(flavor = "current_thread")]
async fn replay_spares_damaged_client_data_and_nothing_else() {
    use basalt_store::object_op::kind;
    use std::os::unix::fs::FileExt;
    let flip = |path: &Path, at: u64| {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .expect("open");
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, at).expect("read");
        file.write_all_at(&[byte[0] ^ 0xff], at).expect("write");
    };
    let write = |index: u64, byte: u8| {
        let mut entry = entry(1, index, byte);
        entry.kind = kind::WRITE;
        entry.data = vec![byte; 8192];
        entry
    };
    let (path, device) = formatted_device("spared", 32 << 20, 8).await;
    device.submit(vec![write(1, 0x11)]).await.expect("room");
    let damaged = device.submit(vec![write(2, 0x22)]).await.expect("room");
    let after = device.submit(vec![write(3, 0x33)]).await.expect("room");
    let at = damaged.data_offsets_bytes[0];
    drop(device);
    flip(&path, at + 4096 + 7);
    let opened = LogDevice::open(&path).await.expect("opens");
    let batches = &opened.replayed.batches;
    assert_eq!(batches.len(), 3, "replay goes on past the damage");
    assert_eq!(batches[1].damaged_entries, vec![0]);
    let sums = opened.device.block_sums();
    // Both blocks of the entry: which one changed is not known.
    assert!(sums.is_poisoned(at) && sums.is_poisoned(at + 4096));
    assert!(sums.verify(at, &[0x22; 4096]).is_err());
    let intact = after.data_offsets_bytes[0];
    assert_eq!(sums.verify(intact, &[0x33; 8192]), Ok(()));
    drop(opened);
    std::fs::remove_file(&path).expect("remove");

    // A raft record of the replica's own (not a client's payload) damaged so: refused.
    let (path, device) = formatted_device("unspared", 32 << 20, 9).await;
    device.submit(vec![write(1, 0x11)]).await.expect("room");
    let own = device.submit(vec![entry(1, 2, 0x22)]).await.expect("room");
    device.submit(vec![write(3, 0x33)]).await.expect("room");
    drop(device);
    flip(&path, own.data_offsets_bytes[0] + 7);
    let error = LogDevice::open(&path)
        .await
        .err()
        .expect("refused")
        .to_string();
    assert!(error.contains("the log is damaged"), "{error}");
    std::fs::remove_file(&path).expect("remove");
}

/// The writer puts an empty batch after the last one once nothing else came for a while,
/// so that damage at rest to the last batch of a log idle since is told from a torn write:
/// its client data is spared, not dropped with the batch.
#[tokio::test(flavor = "current_thread")]
async fn an_idle_log_ends_in_an_empty_batch_so_its_last_batch_is_not_taken_for_torn() {
    use basalt_store::object_op::kind;
    use std::os::unix::fs::FileExt;
    let (path, device) = formatted_device("fenced", 32 << 20, 10).await;
    device.set_fence_after(Some(std::time::Duration::from_millis(100)));
    let mut write = entry(1, 1, 0x44);
    write.kind = kind::WRITE;
    let placed = device.submit(vec![write]).await.expect("room");
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    drop(device);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    let at = placed.data_offsets_bytes[0] + 11;
    file.write_all_at(&[!0x44], at).expect("write");
    drop(file);
    let opened = LogDevice::open(&path).await.expect("opens");
    let batches = &opened.replayed.batches;
    assert_eq!(batches.len(), 2, "the write's batch, then an empty one");
    assert_eq!(batches[0].damaged_entries, vec![0]);
    assert!(batches[1].entries.is_empty());
    assert!(
        opened
            .device
            .block_sums()
            .is_poisoned(placed.data_offsets_bytes[0])
    );
    drop(opened);
    std::fs::remove_file(&path).expect("remove");
}

/// A device closed for an orderly stop ends in an empty batch of its own, even with an
/// append still queued (which an empty append would share a batch with): damage to its last
/// batch of data while it is down is told from a torn write, with no pause before the stop.
#[tokio::test(flavor = "current_thread")]
async fn a_closed_log_ends_in_an_empty_batch() {
    use basalt_store::object_op::kind;
    use std::os::unix::fs::FileExt;
    let (path, device) = formatted_device("closed", 32 << 20, 11).await;
    let mut write = entry(1, 1, 0x55);
    write.kind = kind::WRITE;
    let queued = device.submit(vec![write]);
    device.close().await.expect("closed");
    let placed = queued.await.expect("room");
    drop(device);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("open");
    file.write_all_at(&[!0x55], placed.data_offsets_bytes[0] + 5)
        .expect("write");
    drop(file);
    let opened = LogDevice::open(&path).await.expect("opens");
    let damaged: Vec<Vec<usize>> = opened
        .replayed
        .batches
        .iter()
        .map(|batch| batch.damaged_entries.clone())
        .collect();
    assert_eq!(damaged, [vec![0], vec![]], "spared, not dropped as torn");
    drop(opened);
    std::fs::remove_file(&path).expect("remove");
}

/// Both fills leave nothing of a device's earlier life: over a file full of other bytes, a
/// sparse format takes back its space (the file holds little more than its superblock)
/// and one with zeroes keeps all of it allocated; either opens as an empty log that takes
/// writes and replays them.
#[tokio::test(flavor = "current_thread")]
async fn a_sparse_format_gives_the_space_back_and_a_zeroed_one_keeps_it() {
    use basalt_osd::log_device::Fill;
    use std::os::unix::fs::MetadataExt;
    const LEN: u64 = 32 << 20;
    for fill in [Fill::Sparse, Fill::Zeroes] {
        let path = device_file(&format!("{fill:?}"), 0);
        std::fs::write(&path, vec![0xab; LEN as usize]).expect("old bytes");
        LogDevice::format_as(&path, [4; 16], fill)
            .await
            .expect("format");
        let allocated = std::fs::metadata(&path).expect("metadata").blocks() * 512;
        match fill {
            Fill::Sparse => assert!(allocated < 1 << 20, "{allocated} bytes allocated"),
            Fill::Zeroes => assert!(allocated >= LEN, "{allocated} bytes allocated"),
        }
        let bytes = std::fs::read(&path).expect("read");
        assert!(
            bytes[4096..].iter().all(|&b| b == 0),
            "{fill:?}: not zeroes"
        );

        let opened = LogDevice::open(&path).await.expect("open");
        assert!(opened.replayed.batches.is_empty(), "{fill:?}");
        opened
            .device
            .submit(vec![entry(0, 1, 7)])
            .await
            .expect("durable");
        drop(opened);
        let reopened = LogDevice::open(&path).await.expect("reopen");
        assert_eq!(replayed_entries(&reopened), [&entry(0, 1, 7)], "{fill:?}");
        std::fs::remove_file(path).expect("remove");
    }
}

/// A checkpoint larger than one device write goes in several, each at its place: it reads
/// back whole (the kernel moves at most about 2 GiB per write; a checkpoint of a large
/// index is larger, and used to fail its single write).
#[tokio::test(flavor = "current_thread")]
async fn a_checkpoint_goes_to_the_device_in_several_writes() {
    use basalt_store::checkpoint::Checkpoint;
    let (path, device) = formatted_device("checkpoint-writes", 32 << 20, 5).await;
    let checkpoint = Checkpoint {
        sequence: 3,
        replay_position: 0,
        replay_lsn: Lsn(1),
        tail_position: 0,
        tail_lsn: Lsn(1),
        pgs: Vec::new(),
        // About 32 KiB: eight writes of 4 KiB.
        block_sums: vec![(
            0,
            (0..8000u32)
                .map(|n| n.wrapping_mul(2_654_435_761))
                .collect(),
        )],
        poisoned_blocks: Vec::new(),
    };
    device
        .write_checkpoint_in(1, given(&checkpoint), 4096)
        .await
        .expect("checkpoint");
    drop(device);
    let reopened = LogDevice::open(&path).await.expect("reopen");
    assert_eq!(reopened.checkpoint.as_ref(), Some(&checkpoint));
    std::fs::remove_file(path).expect("remove");
}
