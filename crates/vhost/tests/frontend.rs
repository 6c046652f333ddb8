//! The backend driven over its Unix socket by a vhost-user frontend of our own (the
//! `vhost` crate's `Frontend`), with a split virtqueue laid out by hand in a shared guest
//! memory file: the message flow (features, protocol features, configuration space,
//! memory table, vring setup) and requests good and bad, without a guest.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use basalt_bdev::Bdev;
use basalt_bdev::file::{FileBdev, FileBdevError, FileBdevOptions};
use basalt_bdev::gated::{Gated, Held};
use basalt_bdev::io_stats::Counted;
use basalt_bdev::malloc::MallocBdev;
use basalt_io::OpenError;
use basalt_io::Reactors;
use basalt_vhost::VhostServer;
use basalt_vhost::backend::{BlkOptions, COPY_BYTES_MAX};
use basalt_vhost::inflight::queue_bytes;
use basalt_vhost::request::*;
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserInflight, VhostUserProtocolFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

const MEMORY_SIZE: usize = 1 << 20;
const QUEUE_SIZE: u16 = 16;
const DESC: u64 = 0x1000;
const AVAIL: u64 = 0x2000;
const USED: u64 = 0x3000;
const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;

/// A guest: its memory and one split virtqueue in it.
struct Guest {
    memory: GuestMemoryMmap<()>,
    kick: EventFd,
    next_avail: u16,
    next_desc: u16,
    next_used: u16,
}

impl Guest {
    /// A guest whose vring is new (nothing made available yet).
    fn new(memory: GuestMemoryMmap<()>, kick: EventFd) -> Self {
        Self {
            memory,
            kick,
            next_avail: 0,
            next_desc: 0,
            next_used: 0,
        }
    }

    /// Writes descriptor `slot` of the table.
    fn put_descriptor(&self, slot: u16, address: u64, len: u32, flags: u16, next: u16) {
        let at = GuestAddress(DESC + u64::from(slot) * 16);
        self.memory.write_obj(address, at).expect("desc addr");
        self.memory
            .write_obj(len, at.unchecked_add(8))
            .expect("desc len");
        self.memory
            .write_obj(flags, at.unchecked_add(12))
            .expect("desc flags");
        self.memory
            .write_obj(next, at.unchecked_add(14))
            .expect("desc next");
    }

    /// Makes a chain of (address, length, device-writable) buffers available and kicks;
    /// returns the used length the device reports once it is done.
    fn submit(&mut self, buffers: &[(u64, u32, bool)]) -> u32 {
        let head = self.next_desc;
        for (index, (address, len, writable)) in buffers.iter().enumerate() {
            let slot = (head + index as u16) % QUEUE_SIZE;
            let last = index + 1 == buffers.len();
            let mut flags = if *writable { DESC_F_WRITE } else { 0 };
            if !last {
                flags |= DESC_F_NEXT;
            }
            self.put_descriptor(slot, *address, *len, flags, (slot + 1) % QUEUE_SIZE);
        }
        self.next_desc = (head + buffers.len() as u16) % QUEUE_SIZE;
        let ring_at = GuestAddress(AVAIL + 4 + u64::from(self.next_avail % QUEUE_SIZE) * 2);
        self.memory.write_obj(head, ring_at).expect("avail ring");
        self.next_avail = self.next_avail.wrapping_add(1);
        self.memory
            .write_obj(self.next_avail, GuestAddress(AVAIL + 2))
            .expect("avail idx");
        self.kick.write(1).expect("kick");
        let start = Instant::now();
        loop {
            let used: u16 = self
                .memory
                .read_obj(GuestAddress(USED + 2))
                .expect("used idx");
            if used != self.next_used {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "no completion");
            std::thread::sleep(Duration::from_millis(1));
        }
        let entry = GuestAddress(USED + 4 + u64::from(self.next_used % QUEUE_SIZE) * 8);
        let id: u32 = self.memory.read_obj(entry).expect("used id");
        assert_eq!(id, u32::from(head), "the chain completed");
        self.next_used = self.next_used.wrapping_add(1);
        self.memory
            .read_obj(entry.unchecked_add(4))
            .expect("used len")
    }

    fn header(&self, at: u64, kind: u32, sector: u64) {
        let mut bytes = [0u8; 16];
        bytes[0..4].copy_from_slice(&kind.to_le_bytes());
        bytes[8..16].copy_from_slice(&sector.to_le_bytes());
        self.memory
            .write_slice(&bytes, GuestAddress(at))
            .expect("header");
    }

    /// The device's used index.
    fn used_index(&self) -> u16 {
        self.memory
            .read_obj(GuestAddress(USED + 2))
            .expect("used idx")
    }

    /// Offers the chain at head 0 `offered` times, a queue's worth per kick (the device's
    /// view of the available ring never runs more than a queue ahead), then waits 200 ms.
    fn offer_head_zero(&self, offered: u16) {
        for index in 0..offered {
            let ring_at = GuestAddress(AVAIL + 4 + u64::from(index % QUEUE_SIZE) * 2);
            self.memory.write_obj(0u16, ring_at).expect("avail ring");
            self.memory
                .write_obj(index + 1, GuestAddress(AVAIL + 2))
                .expect("avail idx");
            if index % QUEUE_SIZE == QUEUE_SIZE - 1 || index + 1 == offered {
                self.kick.write(1).expect("kick");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }

    fn status(&self, at: u64) -> u8 {
        self.memory.read_obj(GuestAddress(at)).expect("status")
    }

    /// Writes `data`, put in guest memory at `at`, to `sector` (header at 0x8000, status
    /// at 0x9000); the used length and the status.
    fn write(&mut self, sector: u64, at: u64, data: &[u8]) -> (u32, u8) {
        self.memory
            .write_slice(data, GuestAddress(at))
            .expect("data");
        self.header(0x8000, TYPE_OUT, sector);
        let used = self.submit(&[
            (0x8000, 16, false),
            (at, data.len() as u32, false),
            (0x9000, 1, true),
        ]);
        (used, self.status(0x9000))
    }

    /// Reads from `sector` into the guest buffers `runs` (address, length); the used
    /// length, the status, and the bytes the buffers hold then.
    fn read(&mut self, sector: u64, runs: &[(u64, u32)]) -> (u32, u8, Vec<u8>) {
        self.header(0x8000, TYPE_IN, sector);
        let mut chain = vec![(0x8000, 16, false)];
        chain.extend(runs.iter().map(|&(at, len)| (at, len, true)));
        chain.push((0x9000, 1, true));
        let used = self.submit(&chain);
        let mut back = Vec::new();
        for &(at, len) in runs {
            let mut run = vec![0u8; len as usize];
            self.memory
                .read_slice(&mut run, GuestAddress(at))
                .expect("read");
            back.extend(run);
        }
        (used, self.status(0x9000), back)
    }
}

use vm_memory::Address;

/// The CPUs (`Cpus_allowed_list`) of each vhost-user-backend vring thread in this process.
fn vring_thread_cpus() -> Vec<String> {
    let mut cpus = Vec::new();
    for task in std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .flatten()
    {
        let path = task.path();
        let name = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if name.trim() != "vring_worker" {
            continue;
        }
        let status = std::fs::read_to_string(path.join("status")).unwrap_or_default();
        if let Some(list) = status
            .lines()
            .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
        {
            cpus.push(list.trim().to_string());
        }
    }
    cpus
}

/// A 1 MiB file bdev of 512-byte blocks (O_DIRECT where the filesystem allows), counted.
fn file_bdev(path: &Path) -> Arc<dyn Bdev> {
    std::fs::write(path, vec![0u8; 1 << 20]).expect("bdev file");
    let options = FileBdevOptions {
        block_size: 512,
        buffered: false,
        queue_depth: 16,
    };
    let open = |options: &FileBdevOptions| FileBdev::open(path, "m".into(), String::new(), options);
    let bdev = match open(&options) {
        Err(FileBdevError::Open(OpenError::DirectRefused { .. })) => open(&FileBdevOptions {
            buffered: true,
            ..options
        }),
        other => other,
    };
    Arc::new(Counted::new(Box::new(bdev.expect("file bdev"))))
}

/// A new empty directory for a test, named `name` and this process.
fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

/// Waits up to 10 s for `done`; `what` names what did not come.
fn wait_until(what: impl Fn() -> String, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(10), "{}", what());
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The tests of this file one at a time: the first looks at every vring thread of the
/// process.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Held by a test for its whole run (see [`ONE_AT_A_TIME`]).
fn alone() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn a_frontend_of_our_own_drives_the_device() {
    let _alone = alone();
    let dir = scratch_dir("vhost-frontend");
    // RAM: every request through the bdev, on the reactor.
    drive(&dir, Arc::new(MallocBdev::new_named("m", 512, 2048)), None);
    // A file: reads and writes from the vring thread straight into and out of guest
    // memory, the others through the bdev.
    let path = dir.join("bdev");
    drive(&dir, file_bdev(&path), Some(&path));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The configuration space tells the guest the bdev's discard and write zeroes limit, in
/// 512-byte sectors whatever its block size (Linux splits larger ones), with one segment
/// per request (the specification's limit is per segment), and no limit for a bdev
/// without one.
#[test]
fn the_bdevs_discard_limit_is_in_the_configuration_space() {
    let _alone = alone();
    let dir = scratch_dir("vhost-discard-limit");
    let reactors = Arc::new(Reactors::start(1, "vhost-limit").expect("reactors"));
    let server = VhostServer::new(reactors, dir.clone());
    for (name, block_size, limit, sectors, segments) in [
        ("a", 4096, Some(100), 800, 1),
        ("b", 512, Some(1 << 40), u32::MAX, 1),
        ("c", 512, None, u32::MAX, 32),
    ] {
        let malloc = MallocBdev::new_named(name, block_size, 256);
        let bdev = Gated::new(Box::new(malloc), Held::default()).limit_unmaps(limit);
        let options = BlkOptions {
            bdev: Arc::new(bdev),
            readonly: false,
            queues: 1,
            serial: name.into(),
            reactors: vec![0],
        };
        let socket = server
            .create(name, name, None, options)
            .expect("controller");
        let mut frontend = connect(&socket, VhostUserProtocolFeatures::empty());
        let (_, config) = frontend
            .get_config(0, 60, VhostUserConfigFlags::WRITABLE, &[0u8; 60])
            .expect("config");
        let field = |at: usize| u32::from_le_bytes(config[at..at + 4].try_into().expect("4"));
        assert_eq!(field(36), sectors, "max_discard_sectors of {name}");
        assert_eq!(field(48), sectors, "max_write_zeroes_sectors of {name}");
        assert_eq!(field(40), segments, "max_discard_seg of {name}");
        assert_eq!(field(52), segments, "max_write_zeroes_seg of {name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Guest memory: a file in `dir` that both sides map; and its description for the
/// memory table.
fn guest_memory(dir: &Path) -> (GuestMemoryMmap<()>, VhostUserMemoryRegionInfo) {
    let file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join("memory"))
        .expect("memory file");
    file.set_len(MEMORY_SIZE as u64).expect("size");
    let memory = GuestMemoryMmap::<()>::from_ranges_with_files([(
        GuestAddress(0),
        MEMORY_SIZE,
        Some(FileOffset::new(file, 0)),
    )])
    .expect("guest memory");
    let region = memory.iter().next().expect("region");
    let info = VhostUserMemoryRegionInfo::from_guest_region(region).expect("region info");
    (memory, info)
}

/// A frontend connected to `socket` that has negotiated the device's features, and the
/// protocol features CONFIG, MQ and `more`.
fn connect(socket: &Path, more: VhostUserProtocolFeatures) -> Frontend {
    let mut frontend = Frontend::connect(socket, 1).expect("connect");
    frontend.set_owner().expect("owner");
    let features = frontend.get_features().expect("features");
    let version_1 = 1u64 << 32;
    let protocol = 1u64 << 30;
    assert_ne!(features & version_1, 0, "VERSION_1");
    assert_ne!(features & (1 << 9), 0, "FLUSH");
    assert_eq!(features & (1 << 5), 0, "not read-only");
    frontend
        .set_features(features & (version_1 | protocol | (1 << 9) | (1 << 13) | (1 << 14)))
        .expect("set features");
    let offered = frontend.get_protocol_features().expect("protocol features");
    let wanted = VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ | more;
    assert!(offered.contains(wanted), "{offered:?} offered");
    frontend
        .set_protocol_features(wanted)
        .expect("set protocol features");
    frontend
}

/// Sets the memory table and vring 0 (resumed at available index `base`) up and starts
/// it; its call and kick eventfds.
fn start_vring(
    frontend: &mut Frontend,
    info: &VhostUserMemoryRegionInfo,
    base: u16,
) -> (EventFd, EventFd) {
    frontend
        .set_mem_table(std::slice::from_ref(info))
        .expect("memory table");
    frontend.set_vring_num(0, QUEUE_SIZE).expect("vring num");
    // Ring addresses are the frontend's own virtual addresses (as QEMU's are), which the
    // backend translates through the memory table; buffers are guest physical addresses.
    let at = info.userspace_addr;
    let vring = VringConfigData {
        queue_max_size: QUEUE_SIZE,
        queue_size: QUEUE_SIZE,
        flags: 0,
        desc_table_addr: at + DESC,
        used_ring_addr: at + USED,
        avail_ring_addr: at + AVAIL,
        log_addr: None,
    };
    frontend.set_vring_addr(0, &vring).expect("vring addr");
    frontend.set_vring_base(0, base).expect("vring base");
    let call = EventFd::new(EFD_NONBLOCK).expect("call");
    let kick = EventFd::new(EFD_NONBLOCK).expect("kick");
    frontend.set_vring_call(0, &call).expect("call fd");
    frontend.set_vring_kick(0, &kick).expect("kick fd");
    frontend.set_vring_enable(0, true).expect("enable");
    (call, kick)
}

/// Drives a controller over `bdev` (1 MiB, 512-byte blocks), whose file is `file` if it
/// has one, through the message flow and good and bad requests.
fn drive(dir: &Path, bdev: Arc<dyn Bdev>, bdev_file: Option<&Path>) {
    let reactors = Arc::new(Reactors::start(1, "vhost-test").expect("reactors"));
    let reactor_cpu = reactors.cpus()[0];
    let server = VhostServer::new(reactors, dir.to_path_buf());
    let in_place = |server: &VhostServer| server.list()[0].in_place_requests;
    let alignment = bdev.in_place().map(|in_place| in_place.alignment);
    assert_eq!(
        alignment.is_some(),
        bdev_file.is_some(),
        "only a file is lent"
    );
    let options = BlkOptions {
        bdev,
        readonly: false,
        queues: 1,
        serial: "frontend-test-serial".into(),
        reactors: vec![0],
    };
    let socket = server
        .create("t", "m", None, options.clone())
        .expect("controller");

    let (memory, info) = guest_memory(dir);
    let mut frontend = connect(&socket, VhostUserProtocolFeatures::empty());
    assert_eq!(frontend.get_queue_num().expect("queues"), 1);
    // Connected, with no memory table yet (a guest whose driver has not started): a
    // delete is refused rather than left waiting for the frontend to go.
    assert!(
        server.delete("t").is_err(),
        "a connected frontend is attached"
    );
    let (_, config) = frontend
        .get_config(0, 60, VhostUserConfigFlags::WRITABLE, &[0u8; 60])
        .expect("config");
    assert_eq!(
        u64::from_le_bytes(config[0..8].try_into().expect("8")),
        2048,
        "capacity in sectors"
    );
    assert_eq!(
        u32::from_le_bytes(config[20..24].try_into().expect("4")),
        512,
        "blk_size"
    );
    let (call, kick) = start_vring(&mut frontend, &info, 0);
    // The call eventfd is signalled once as it arrives, before any request: a guest that
    // reconnects to a restarted target looks at its used ring (what the previous target
    // put there unsignalled), or its I/O could hang.
    wait_until(
        || "the call eventfd not signalled".into(),
        || call.read().is_ok(),
    );
    let mut guest = Guest::new(memory, kick);

    // A write, then a read of it into two buffers.
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    assert_eq!(guest.write(8, 0x10000, &data), (1, STATUS_OK));
    let (used, status, back) = guest.read(8, &[(0x20000, 1024), (0x21000, 3072)]);
    assert_eq!((used, status), (4097, STATUS_OK));
    assert_eq!(back, data);
    if let Some(path) = bdev_file {
        // Both went in place, and the data is in the file where sector 8 is.
        assert_eq!(in_place(&server), 2);
        let on_disk = std::fs::read(path).expect("bdev file");
        assert_eq!(&on_disk[4096..8192], &data[..]);
        let stats = options.bdev.io_stats().expect("counted");
        assert_eq!((stats.num_write_ops, stats.bytes_written), (1, 4096));
        assert_eq!((stats.num_read_ops, stats.bytes_read), (1, 4096));

        // A buffer not aligned as O_DIRECT asks goes through the bdev, and reads back.
        let moved: Vec<u8> = data.iter().rev().copied().collect();
        assert_eq!(guest.write(16, 0x10100, &moved[..512]), (1, STATUS_OK));
        let expected = if alignment > Some(256) { 2 } else { 3 };
        assert_eq!(in_place(&server), expected, "by the bdev when unaligned");
        let (used, status, back) = guest.read(16, &[(0x20100, 512)]);
        assert_eq!((used, status), (513, STATUS_OK));
        assert_eq!(&back[..], &moved[..512]);
        let on_disk = std::fs::read(path).expect("bdev file");
        assert_eq!(&on_disk[8192..8704], &moved[..512]);
    } else if let Some(cpu) = reactor_cpu {
        // The vring thread has moved to the CPU of the reactor that runs its requests.
        assert_eq!(vring_thread_cpus(), [cpu.to_string()]);
    }

    // GET_ID, and a flush.
    guest.header(0x8000, TYPE_GET_ID, 0);
    let used = guest.submit(&[(0x8000, 16, false), (0x22000, 20, true), (0x9000, 1, true)]);
    assert_eq!((used, guest.status(0x9000)), (21, STATUS_OK));
    let mut id = [0u8; 20];
    guest
        .memory
        .read_slice(&mut id, GuestAddress(0x22000))
        .expect("id");
    assert_eq!(&id, b"frontend-test-serial");
    guest.header(0x8000, TYPE_FLUSH, 0);
    assert_eq!(guest.submit(&[(0x8000, 16, false), (0x9000, 1, true)]), 1);
    assert_eq!(guest.status(0x9000), STATUS_OK);

    // Bad requests fail alone: past the end, an unknown type, a short header, a readable
    // buffer after a writable one, a buffer outside guest memory.
    guest.header(0x8000, TYPE_IN, 2047);
    guest.submit(&[
        (0x8000, 16, false),
        (0x20000, 1024, true),
        (0x9000, 1, true),
    ]);
    assert_eq!(guest.status(0x9000), STATUS_IOERR, "past the end");
    guest.header(0x8000, 77, 0);
    guest.submit(&[(0x8000, 16, false), (0x9000, 1, true)]);
    assert_eq!(guest.status(0x9000), STATUS_UNSUPP, "unknown type");
    guest.header(0x8000, TYPE_IN, 0);
    guest.submit(&[(0x8000, 8, false), (0x9000, 1, true)]);
    assert_eq!(guest.status(0x9000), STATUS_IOERR, "short header");
    guest.submit(&[
        (0x8000, 16, false),
        (0x9000, 1, true),
        (0x10000, 512, false),
    ]);
    assert_eq!(
        guest.status(0x9000),
        STATUS_IOERR,
        "readable after writable"
    );
    guest
        .memory
        .write_obj(0xffu8, GuestAddress(0x9000))
        .expect("status byte");
    let used = guest.submit(&[
        (0x8000, 16, false),
        (MEMORY_SIZE as u64 + 4096, 512, true),
        (0x9000, 1, true),
    ]);
    assert_eq!(used, 1, "the status byte alone written");
    assert_eq!(guest.status(0x9000), STATUS_IOERR, "outside guest memory");
    // Outside guest memory where the status byte would be: returned unused.
    let used = guest.submit(&[(0x8000, 16, false), (MEMORY_SIZE as u64 + 4096, 1, true)]);
    assert_eq!(used, 0, "returned unused: nothing written");

    // An available index further ahead than the queue holds breaks that queue only while
    // it lasts: the device's thread goes on, and serves once the index is true again.
    let broken = guest.next_avail.wrapping_add(QUEUE_SIZE + 1);
    guest
        .memory
        .write_obj(broken, GuestAddress(AVAIL + 2))
        .expect("avail idx");
    guest.kick.write(1).expect("kick");
    std::thread::sleep(Duration::from_millis(100));
    guest
        .memory
        .write_obj(guest.next_avail, GuestAddress(AVAIL + 2))
        .expect("avail idx");

    // The device still serves.
    guest.header(0x8000, TYPE_IN, 8);
    let used = guest.submit(&[
        (0x8000, 16, false),
        (0x20000, 4096, true),
        (0x9000, 1, true),
    ]);
    assert_eq!((used, guest.status(0x9000)), (4097, STATUS_OK));

    // Attached: deletion refused; once the frontend goes, it is allowed.
    assert!(server.delete("t").is_err(), "a frontend is attached");
    drop(frontend);
    let start = Instant::now();
    loop {
        match server.delete("t") {
            Ok(bdev_name) => {
                assert_eq!(bdev_name, "m");
                break;
            }
            Err(_) if start.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(error) => panic!("{error}"),
        }
    }
    assert!(!socket.exists(), "the socket is removed");
    let _ = call;
}

#[test]
fn requests_in_flight_when_the_backend_died_are_replayed_once() {
    let _alone = alone();
    let dir = scratch_dir("vhost-replay");
    replay(&dir, Arc::new(MallocBdev::new_named("m", 512, 2048)));
    replay(&dir, file_bdev(&dir.join("bdev")));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Fills `len` bytes of guest memory at `at` with `byte`.
fn fill(memory: &GuestMemoryMmap<()>, at: u64, len: usize, byte: u8) {
    memory
        .write_slice(&vec![byte; len], GuestAddress(at))
        .expect("fill");
}

/// A backend dies with two writes taken from the vring: A still running, B on the used
/// ring but not yet unmarked in the in-flight region. The next session replays A alone,
/// without a kick, and takes new requests after both.
fn replay(dir: &Path, bdev: Arc<dyn Bdev>) {
    let reactors = Arc::new(Reactors::start(1, "vhost-test").expect("reactors"));
    let server = VhostServer::new(reactors, dir.to_path_buf());
    let options = BlkOptions {
        bdev,
        readonly: false,
        queues: 1,
        serial: "replay".into(),
        reactors: vec![0],
    };
    let socket = server.create("r", "m", None, options).expect("controller");
    let (memory, info) = guest_memory(dir);

    // The first session: the frontend asks for a region and hands it back.
    let mut frontend = connect(&socket, VhostUserProtocolFeatures::INFLIGHT_SHMFD);
    let asked = VhostUserInflight {
        num_queues: 1,
        queue_size: QUEUE_SIZE,
        ..Default::default()
    };
    let (inflight, region) = frontend.get_inflight_fd(&asked).expect("GET_INFLIGHT_FD");
    assert_eq!(
        (inflight.mmap_size, inflight.num_queues, inflight.queue_size),
        (queue_bytes(QUEUE_SIZE), 1, QUEUE_SIZE)
    );
    frontend
        .set_inflight_fd(&inflight, region.as_raw_fd())
        .expect("SET_INFLIGHT_FD");
    let (_call, kick) = start_vring(&mut frontend, &info, 0);
    let mut guest = Guest::new(memory, kick);
    assert_eq!(guest.write(8, 0x10000, &[7u8; 4096]), (1, STATUS_OK));
    // Completed: unmarked (head 0), and the region's used index follows the ring's.
    let read_region = |at: u64, len: usize| {
        let mut bytes = vec![0u8; len];
        region.read_exact_at(&mut bytes, at).expect("region");
        bytes
    };
    // (The mark goes just after the used index moves: waited for.)
    wait_until(
        || {
            format!(
                "head 0 still marked, or used_idx behind: {:?}",
                read_region(0, 32)
            )
        },
        || read_region(16, 1) == [0] && read_region(14, 2) == 1u16.to_le_bytes(),
    );
    drop(frontend);
    // The first session must be over before its state is faked: a worker still running
    // could take the heads put on the ring below (it took B, once in CI).
    wait_until(
        || "the first session still attached".into(),
        || !server.list().iter().any(|c| c.name == "r" && c.attached),
    );

    // What the dead backend left: A (head 4) writes 0xaa to sector 40, B (head 7) 0xbb to
    // sector 48; both taken (available 1 and 2), B put on the used ring (used 1), both
    // still marked, B named by last_batch_head and the region's used index behind.
    let memory = &guest.memory;
    for (head, header, data, byte, sector) in [
        (4u16, 0x8100, 0x11000, 0xaa, 40u64),
        (7, 0x8200, 0x12000, 0xbb, 48),
    ] {
        guest.header(header, TYPE_OUT, sector);
        fill(memory, data, 4096, byte);
        for (slot, (address, len, flags, next)) in [
            (header, 16u32, DESC_F_NEXT, head + 1),
            (data, 4096, DESC_F_NEXT, head + 2),
            (header + 0x1000, 1, DESC_F_WRITE, 0),
        ]
        .into_iter()
        .enumerate()
        {
            guest.put_descriptor(head + slot as u16, address, len, flags, next);
        }
        let state = (u64::from(head) + 1) * 16;
        region.write_all_at(&[1], state).expect("mark");
        region
            .write_all_at(&u64::from(head).to_le_bytes(), state + 8)
            .expect("counter");
    }
    memory
        .write_obj(4u16, GuestAddress(AVAIL + 4 + 2))
        .expect("avail");
    memory
        .write_obj(7u16, GuestAddress(AVAIL + 4 + 4))
        .expect("avail");
    memory
        .write_obj(3u16, GuestAddress(AVAIL + 2))
        .expect("avail idx");
    memory
        .write_obj(7u32, GuestAddress(USED + 4 + 8))
        .expect("used id");
    memory
        .write_obj(1u32, GuestAddress(USED + 4 + 8 + 4))
        .expect("used len");
    memory
        .write_obj(2u16, GuestAddress(USED + 2))
        .expect("used idx");
    region
        .write_all_at(&7u16.to_le_bytes(), 12)
        .expect("last_batch_head");

    // The next session: QEMU resumes the vring at its used index and hands the region
    // back. A completes without a kick.
    let mut frontend = connect(&socket, VhostUserProtocolFeatures::INFLIGHT_SHMFD);
    frontend
        .set_inflight_fd(&inflight, region.as_raw_fd())
        .expect("SET_INFLIGHT_FD");
    let (_call, kick) = start_vring(&mut frontend, &info, 2);
    let used = || {
        memory
            .read_obj::<u16>(GuestAddress(USED + 2))
            .expect("used")
    };
    wait_until(|| "A not replayed".into(), || used() != 2);
    let used_id: u32 = memory
        .read_obj(GuestAddress(USED + 4 + 16))
        .expect("used id");
    assert_eq!(used_id, 4, "A replayed");
    assert_eq!(guest.status(0x9100), STATUS_OK);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(used(), 3, "B not replayed");
    wait_until(|| "A still marked".into(), || read_region(5 * 16, 1) == [0]);
    assert_eq!(read_region(8 * 16, 1), [0], "B unmarked");

    // New requests come after both: A's data is there, B's never reached the bdev.
    (
        guest.kick,
        guest.next_avail,
        guest.next_used,
        guest.next_desc,
    ) = (kick, 3, 3, 10);
    let (used, status, back) = guest.read(40, &[(0x20000, 4096)]);
    assert_eq!((used, status), (4097, STATUS_OK));
    assert!(back.iter().all(|&b| b == 0xaa), "A's data");
    let (_, status, back) = guest.read(48, &[(0x20000, 4096)]);
    assert_eq!(status, STATUS_OK);
    assert!(back.iter().all(|&b| b == 0), "B was not written again");
    drop(frontend);
}

/// A guest that offers the same chain again and again while it is still in flight (no
/// driver does: a head is reused only once the device has returned it) gets no more than
/// twice a queue's worth of requests taken, instead of making the target hold any number
/// of requests and their buffers; its requests complete once the bdev lets them.
#[test]
fn a_guest_offering_heads_still_in_flight_gets_no_more_taken() {
    let _alone = alone();
    let device = GatedDevice::new("vhost-repeated-heads", 2048);
    let (gated, guest) = (&device.gated, &device.guest);
    // One write chain at head 0, offered 100 times, a queue's worth (16) per kick.
    guest.header(0x8000, TYPE_OUT, 0);
    guest.put_descriptor(0, 0x8000, 16, DESC_F_NEXT, 1);
    guest.put_descriptor(1, 0x10000, 512, DESC_F_NEXT, 2);
    guest.put_descriptor(2, 0x9000, 1, DESC_F_WRITE, 0);
    let offered: u16 = 100;
    guest.offer_head_zero(offered);
    let taken = gated.started();
    assert_eq!(
        taken,
        2 * u64::from(QUEUE_SIZE),
        "requests taken from a guest offering {offered} with a queue of {QUEUE_SIZE}"
    );
    // Let them through: they all complete.
    gated.open();
    wait_until(
        || "the requests taken did not complete".into(),
        || u64::from(guest.used_index()) == taken,
    );
}

/// A guest whose writes carry more data than the vring may have copied at once
/// (`COPY_BYTES_MAX`): the device takes requests until their data fills it (one more
/// crosses it), holds the rest back while they do not complete, and takes them once
/// completions give room back, without the guest kicking again.
#[test]
fn large_writes_are_taken_as_their_copied_data_fits() {
    let _alone = alone();
    let device = GatedDevice::new("vhost-copy-budget", 4096);
    let (gated, guest) = (&device.gated, &device.guest);
    // One write chain at head 0 whose data is 960 KiB of guest memory, offered 32 times
    // (a queue's worth per kick), as the heads test does.
    const DATA: u64 = 0x10000;
    let len = MEMORY_SIZE as u64 - DATA;
    guest.header(0x8000, TYPE_OUT, 0);
    guest.put_descriptor(0, 0x8000, 16, DESC_F_NEXT, 1);
    guest.put_descriptor(1, DATA, len as u32, DESC_F_NEXT, 2);
    guest.put_descriptor(2, 0x9000, 1, DESC_F_WRITE, 0);
    let offered = 2 * QUEUE_SIZE;
    guest.offer_head_zero(offered);
    let taken = gated.started();
    let fit = COPY_BYTES_MAX.div_ceil(len);
    assert_eq!(
        taken, fit,
        "writes of {len} bytes taken with {COPY_BYTES_MAX} bytes to copy them into"
    );
    // Let them through: all complete, those held back taken as room comes back.
    gated.open();
    wait_until(
        || "the writes held back were not taken".into(),
        || guest.used_index() == offered,
    );
    assert_eq!(gated.started(), u64::from(offered));
}

/// Requests replayed from the in-flight region count in the same budget: of
/// [`REPLAYED`] writes a dead backend left in flight, those whose data fits start (one
/// more crosses the mark), the rest once completions give room back.
#[test]
fn replayed_writes_are_started_as_their_copied_data_fits() {
    let _alone = alone();
    let device = replays_held_back("vhost-replay-budget");
    let (gated, guest) = (&device.gated, &device.guest);
    gated.open();
    wait_until(
        || "the replayed writes held back were not started".into(),
        || guest.used_index() == REPLAYED,
    );
    assert_eq!(gated.started(), u64::from(REPLAYED));
}

/// A vring stopped (GET_VRING_BASE) while the copy budget holds replayed requests back
/// answers an available index past them, so they must run before it answers: they
/// start as room comes back, and the answer waits for them.
#[test]
fn a_vring_stopped_with_replays_held_back_runs_them_first() {
    let _alone = alone();
    let device = replays_held_back("vhost-replay-stop");
    let (gated, guest) = (&device.gated, &device.guest);
    std::thread::scope(|scope| {
        let stopping = scope.spawn(|| device.frontend.get_vring_base(0));
        std::thread::sleep(Duration::from_millis(200));
        assert!(!stopping.is_finished(), "stopped with requests in flight");
        gated.open();
        let base = stopping.join().expect("thread").expect("GET_VRING_BASE");
        assert_eq!(base, u32::from(REPLAYED), "the available index given back");
    });
    assert_eq!(gated.started(), u64::from(REPLAYED), "replays started");
    assert_eq!(guest.used_index(), REPLAYED, "replays completed");
}

/// Writes a dead backend left in flight, each of 1.875 MiB.
const REPLAYED: u16 = 13;

/// A gated device whose vring starts with [`REPLAYED`] writes to replay in its
/// in-flight region, once the writes whose data fits the copy budget have started.
fn replays_held_back(name: &str) -> GatedDevice {
    const DATA: u64 = 0x10000;
    let len = MEMORY_SIZE as u64 - DATA;
    let prepare = |frontend: &mut Frontend, memory: &GuestMemoryMmap<()>| {
        let asked = VhostUserInflight {
            num_queues: 1,
            queue_size: QUEUE_SIZE,
            ..Default::default()
        };
        let (inflight, region) = frontend.get_inflight_fd(&asked).expect("GET_INFLIGHT_FD");
        // Heads 0-12: a header each, then descriptors 13 and 14 (both the same 960 KiB
        // of data) and 15 (the status), which every chain shares.
        let guest = Guest::new(memory.clone(), EventFd::new(EFD_NONBLOCK).expect("kick"));
        guest.header(0x8000, TYPE_OUT, 0);
        for head in 0..REPLAYED {
            guest.put_descriptor(head, 0x8000, 16, DESC_F_NEXT, 13);
            let ring_at = GuestAddress(AVAIL + 4 + u64::from(head) * 2);
            memory.write_obj(head, ring_at).expect("avail ring");
            let state = (u64::from(head) + 1) * 16;
            region.write_all_at(&[1], state).expect("mark");
            region
                .write_all_at(&u64::from(head).to_le_bytes(), state + 8)
                .expect("counter");
        }
        guest.put_descriptor(13, DATA, len as u32, DESC_F_NEXT, 14);
        guest.put_descriptor(14, DATA, len as u32, DESC_F_NEXT, 15);
        guest.put_descriptor(15, 0x9000, 1, DESC_F_WRITE, 0);
        memory
            .write_obj(REPLAYED, GuestAddress(AVAIL + 2))
            .expect("avail idx");
        frontend
            .set_inflight_fd(&inflight, region.as_raw_fd())
            .expect("SET_INFLIGHT_FD");
    };
    let device = GatedDevice::prepared(
        name,
        4096,
        VhostUserProtocolFeatures::INFLIGHT_SHMFD,
        prepare,
    );
    let gated = &device.gated;
    let fit = COPY_BYTES_MAX.div_ceil(2 * len);
    wait_until(
        || format!("{} replayed writes started, not {fit}", gated.started()),
        || gated.started() >= fit,
    );
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        gated.started(),
        fit,
        "replayed writes of {} bytes started with {COPY_BYTES_MAX} bytes to copy them into",
        2 * len
    );
    device
}

/// A controller over a malloc bdev of `blocks` whose writes wait behind a gate, with one
/// queue driven by a [`Guest`]; its directory goes when it is dropped.
struct GatedDevice {
    gated: Arc<Gated>,
    guest: Guest,
    dir: std::path::PathBuf,
    _call: EventFd,
    frontend: Frontend,
    _server: VhostServer,
}

impl GatedDevice {
    fn new(name: &str, blocks: u64) -> Self {
        Self::prepared(name, blocks, VhostUserProtocolFeatures::empty(), |_, _| {})
    }

    /// The same, with the protocol features `more` and `prepare` run on the frontend and
    /// guest memory before the vring starts.
    fn prepared(
        name: &str,
        blocks: u64,
        more: VhostUserProtocolFeatures,
        prepare: impl FnOnce(&mut Frontend, &GuestMemoryMmap<()>),
    ) -> Self {
        let dir = scratch_dir(name);
        let reactors = Arc::new(Reactors::start(1, name).expect("reactors"));
        let server = VhostServer::new(reactors, dir.clone());
        let held = Held {
            writes: true,
            ..Held::default()
        };
        let gated = Arc::new(Gated::new(
            Box::new(MallocBdev::new_named("g", 512, blocks)),
            held,
        ));
        let options = BlkOptions {
            bdev: gated.clone(),
            readonly: false,
            queues: 1,
            serial: name.into(),
            reactors: vec![0],
        };
        let socket = server.create("c", "g", None, options).expect("controller");
        let (memory, info) = guest_memory(&dir);
        let mut frontend = connect(&socket, more);
        prepare(&mut frontend, &memory);
        let (call, kick) = start_vring(&mut frontend, &info, 0);
        Self {
            gated,
            guest: Guest::new(memory, kick),
            dir,
            _call: call,
            frontend,
            _server: server,
        }
    }
}

impl Drop for GatedDevice {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
