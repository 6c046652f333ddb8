//! The vhost-user-blk device: features, configuration space, and the vrings' requests.
//!
//! The vring worker thread (vhost-user-backend's) never waits for a bdev: it parses each
//! request, copies a write's data out of guest memory, and starts the request on a
//! reactor. The request's task writes its result (read data, status byte) into guest
//! memory, puts the request on the used ring and signals the guest itself (the vring is
//! shared and locked), so a completion costs no second thread hand-off.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use basalt_bdev::Bdev;
use basalt_io::{DmaBuf, Reactors};
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringEpollHandler, VringRwLock, VringT};
use virtio_bindings::{virtio_blk, virtio_config, virtio_ring};
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    EventConsumer, EventFlag, EventNotifier, new_event_consumer_and_notifier,
};

use crate::direct::DirectRing;
use crate::inflight::{self, InflightRegion};
use crate::relay::Session;
use crate::request::*;

/// Guest memory as the backend sees it.
pub type Memory = GuestMemoryAtomic<GuestMemoryMmap<()>>;

/// Descriptors per vring at most.
pub const QUEUE_SIZE_MAX: usize = 1024;
/// Data segments per request the driver may use (SEG_MAX).
pub const SEGMENTS_MAX: u32 = 128;
/// Segments per discard or write zeroes request.
pub const DISCARD_SEGMENTS_MAX: u32 = 32;
/// Write data copied out of guest memory (for bdevs without a file to lend: images,
/// malloc) per vring for requests under way, past which the vring's thread takes no more
/// requests until some complete. A guest's chains may all point at the same memory, up to
/// 128 MiB each, so without it one guest could make the target copy gigabytes at once.
pub const COPY_BYTES_MAX: u64 = 16 << 20;
/// How long a vring thread's io_uring, dropped, waits for its requests before it leaks
/// their buffers and mappings (stopping a vring or a session has waited for them before).
pub(crate) const STOP_WAIT_MAX: Duration = Duration::from_secs(30);
/// How often a wait for requests in flight says that it still waits.
const STOP_WAIT_WARNING: Duration = Duration::from_secs(30);

/// Waits until `in_flight` says no request is in flight, however long that takes: the
/// guest's buffers belong to those requests until they complete (a read still lands in
/// them), so the vring or session is not given back before; a warning every 30 s says
/// how many are left. A request's time is bounded by its bdev (an image's by its 60 s
/// deadline).
fn wait_for_requests(what: &str, in_flight: impl Fn() -> usize) {
    let mut warned = Instant::now();
    loop {
        let left = in_flight();
        if left == 0 {
            return;
        }
        if warned.elapsed() >= STOP_WAIT_WARNING {
            tracing::warn!(left, "{what} still waits for requests in flight");
            warned = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A feature bit as a mask.
const fn feature(bit: u32) -> u64 {
    1 << bit
}

/// What a controller exports and how.
#[derive(Clone)]
pub struct BlkOptions {
    /// The bdev.
    pub bdev: Arc<dyn Bdev>,
    /// Refuse writes, discard and write zeroes.
    pub readonly: bool,
    /// Request queues offered (the guest may use fewer).
    pub queues: u16,
    /// GET_ID's answer.
    pub serial: String,
    /// The reactors (indices) that run its requests, in turn; empty: every reactor.
    pub reactors: Vec<usize>,
}

/// Ends requests of one vring: puts them on its used ring (unmarking them in the
/// session's in-flight region, if it has one), signals the guest when it asked, and
/// counts them out of the vring's requests in flight.
#[derive(Clone)]
pub(crate) struct Completer {
    vring: VringRwLock<Memory>,
    in_flight: Arc<AtomicUsize>,
    queue: u16,
    region: Option<Arc<InflightRegion>>,
    /// Set when the request's session is closed ([`Session::close`]).
    closed: Arc<AtomicBool>,
    /// The vring's write data copied for requests under way.
    copying: Arc<CopyBudget>,
}

/// Bytes of write data copied out of guest memory for a vring's requests under way, and
/// whether its thread stopped taking requests for them ([`COPY_BYTES_MAX`]).
#[derive(Default)]
pub(crate) struct CopyBudget {
    bytes: AtomicU64,
    held: AtomicBool,
}

impl CopyBudget {
    fn spent(&self) -> bool {
        self.bytes.load(Ordering::SeqCst) >= COPY_BYTES_MAX
    }

    /// Whether the vring's thread must stop taking requests: the budget is spent. It is
    /// then marked held, so that the completion that frees room kicks the vring.
    fn hold(&self) -> bool {
        if !self.spent() {
            return false;
        }
        self.held.store(true, Ordering::SeqCst);
        // A completion between the check and the mark saw no mark: look again.
        if self.spent() {
            return true;
        }
        self.held.store(false, Ordering::SeqCst);
        false
    }

    /// Gives back `bytes` of a request that completed; kicks `vring` if its thread held
    /// requests back and there is room now.
    fn release(&self, bytes: u64, vring: &VringRwLock<Memory>) {
        let before = self.bytes.fetch_sub(bytes, Ordering::SeqCst);
        if before - bytes < COPY_BYTES_MAX && self.held.swap(false, Ordering::SeqCst) {
            kick(vring);
        }
    }
}

/// Wakes `vring`'s thread as the guest's kick does, so that it takes the requests the
/// guest made available while it held them back.
fn kick(vring: &VringRwLock<Memory>) {
    // The vring's state keeps its kick eventfd open while the guard is held.
    let state = vring.get_ref();
    if let Some(kick) = state.get_kick()
        && let Err(error) = basalt_io::unix_fds::signal_eventfd(kick)
    {
        tracing::warn!(%error, "vring not kicked");
    }
}

impl Completer {
    fn complete(&self, head: u16, used_len: u32) {
        self.finish(head, used_len);
        self.signal();
        self.release();
    }

    /// Puts a request on the used ring without signalling the guest (see `signal`).
    pub(crate) fn finish(&self, head: u16, used_len: u32) {
        if self.closed.load(Ordering::Acquire) {
            // The vring may be the next session's by now: its used ring is not ours.
            tracing::warn!(
                queue = self.queue,
                head,
                "a request finished after its session was closed; not put on the used ring (the next session takes it again)"
            );
            return;
        }
        // Under the vring's lock: the region's bracket and the used ring change together.
        let mut state = self.vring.get_mut();
        let mut put = || match state.add_used(head, used_len) {
            Ok(()) => Some(state.get_queue().next_used()),
            Err(error) => {
                tracing::warn!(head, ?error, "virtio-blk request not put on the used ring");
                None
            }
        };
        match &self.region {
            Some(region) => region.finish(self.queue, head, put),
            None => {
                put();
            }
        }
    }

    /// Signals the guest if it asked to be, for what was put on the used ring.
    pub(crate) fn signal(&self) {
        if self.vring.needs_notification().unwrap_or(true)
            && let Err(error) = self.vring.signal_used_queue()
        {
            tracing::debug!(%error, "guest not signalled");
        }
    }

    /// Counts a request out of the vring's requests in flight, once it is on the used ring
    /// and the guest signalled: stopping the vring (which drops the call eventfd) waits for
    /// that.
    pub(crate) fn release(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Whether both end requests of the same vring (of the same session).
    pub(crate) fn same_vring(&self, other: &Completer) -> bool {
        // One guard at a time: a second read guard on the same lock waits behind a writer
        // queued between the two, which would wait for the first.
        let mine: *const _ = &*self.vring.get_ref();
        let theirs: *const _ = &*other.vring.get_ref();
        std::ptr::eq(mine, theirs)
    }
}

/// The device behind one controller.
pub struct BlkBackend {
    options: BlkOptions,
    memory: RwLock<Option<Memory>>,
    event_idx: AtomicBool,
    reactors: Arc<Reactors>,
    in_flight: Vec<Arc<AtomicUsize>>,
    /// Per vring: write data copied for requests under way.
    copying: Vec<Arc<CopyBudget>>,
    /// Per vring: requests replayed from the in-flight region were held back by the copy
    /// budget (the vring's completer, to start them with).
    replaying: Vec<Mutex<Option<Completer>>>,
    next_reactor: AtomicUsize,
    /// The CPUs of the chosen reactors, where the vring threads run (empty: anywhere).
    vring_cpus: Vec<usize>,
    /// The current session's io_uring per vring thread, for reads and writes in place
    /// (empty: none, the bdev has no file to lend or the session has ended).
    rings: RwLock<Vec<Arc<DirectRing>>>,
    /// Requests served in place since the controller was created.
    pub in_place_requests: AtomicU64,
    /// A frontend is connected (from its connection to the end of its session).
    pub attached: AtomicBool,
    /// The size the frontend was last told of, in blocks.
    pub announced_blocks: AtomicU64,
    /// The frontend's session now, whose in-flight region the vrings keep.
    session: RwLock<Option<Arc<Session>>>,
}

thread_local! {
    /// Whether this vring thread has been placed on its controller's CPUs.
    static PLACED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl BlkBackend {
    /// A device over `options`, whose requests run on `reactors`.
    pub fn new(options: BlkOptions, reactors: Arc<Reactors>) -> io::Result<Self> {
        let in_flight = (0..options.queues)
            .map(|_| Arc::new(AtomicUsize::new(0)))
            .collect();
        let copying = (0..options.queues).map(|_| Arc::default()).collect();
        let replaying = (0..options.queues).map(|_| Mutex::new(None)).collect();
        let block_count = options.bdev.info().block_count;
        let mut vring_cpus: Vec<usize> = options
            .reactors
            .iter()
            .filter_map(|&index| reactors.cpus().get(index).copied().flatten())
            .collect();
        vring_cpus.sort_unstable();
        vring_cpus.dedup();
        Ok(Self {
            vring_cpus,
            options,
            memory: RwLock::new(None),
            event_idx: AtomicBool::new(false),
            reactors,
            in_flight,
            copying,
            replaying,
            next_reactor: AtomicUsize::new(0),
            rings: RwLock::new(Vec::new()),
            in_place_requests: AtomicU64::new(0),
            attached: AtomicBool::new(false),
            announced_blocks: AtomicU64::new(block_count),
            session: RwLock::new(None),
        })
    }

    /// The bdev's size in blocks now (it grows with a rescan).
    pub fn block_count(&self) -> u64 {
        self.options.bdev.info().block_count
    }

    /// The configuration space (struct virtio_blk_config, 60 bytes).
    fn config(&self) -> [u8; 60] {
        let info = self.options.bdev.info();
        let mut config = [0u8; 60];
        let sectors = info.size_bytes() / SECTOR_SIZE;
        config[0..8].copy_from_slice(&sectors.to_le_bytes());
        config[12..16].copy_from_slice(&SEGMENTS_MAX.to_le_bytes()); // seg_max
        config[20..24].copy_from_slice(&info.block_size.to_le_bytes()); // blk_size
        // Topology: physical block = logical block (exponent 0), minimum I/O one block.
        config[26..28].copy_from_slice(&1u16.to_le_bytes());
        config[34..36].copy_from_slice(&self.options.queues.to_le_bytes()); // num_queues
        // A discard or write zeroes of the bdev's limit at most ([`Bdev::unmap_blocks_max`]).
        // The specification bounds each segment by it, Linux each request: with a limit,
        // one segment per request, so that both read it as a bound on the request.
        let limit = self.options.bdev.unmap_blocks_max();
        let sectors_max = limit.map_or(u32::MAX, |blocks| {
            let sectors = blocks.saturating_mul(u64::from(info.block_size)) / SECTOR_SIZE;
            sectors.clamp(1, u64::from(u32::MAX)) as u32
        });
        let segments = if limit.is_some() {
            1
        } else {
            DISCARD_SEGMENTS_MAX
        };
        config[36..40].copy_from_slice(&sectors_max.to_le_bytes()); // max_discard_sectors
        config[40..44].copy_from_slice(&segments.to_le_bytes()); // max_discard_seg
        let alignment = info.block_size / 512;
        config[44..48].copy_from_slice(&alignment.to_le_bytes()); // discard_sector_alignment
        config[48..52].copy_from_slice(&sectors_max.to_le_bytes()); // max_write_zeroes_sectors
        config[52..56].copy_from_slice(&segments.to_le_bytes()); // max_write_zeroes_seg
        config[56] = 1; // write_zeroes_may_unmap
        config
    }

    /// The epoll event of vring thread `thread`'s ring (above the queues and the exit
    /// event, which vhost-user-backend reserves).
    fn ring_event(&self, thread: usize) -> u64 {
        u64::from(self.options.queues) + 1 + thread as u64
    }

    /// The vring thread whose ring's event `event` is, if it is one (see `ring_event`).
    fn ring_thread(&self, event: u16) -> Option<usize> {
        usize::from(event).checked_sub(usize::from(self.options.queues) + 1)
    }

    /// Gives each vring thread of a new session (one per `handlers`) an io_uring on the
    /// bdev's file, when it has one to lend. Without, requests take the bdev path.
    pub fn open_rings(&self, handlers: &[Arc<VringEpollHandler<Arc<Self>>>]) {
        let mut rings = Vec::new();
        for (thread, handler) in handlers.iter().enumerate() {
            let ring = match DirectRing::new(self.options.bdev.clone()) {
                Ok(Some(ring)) => ring,
                Ok(None) => return,
                Err(error) => {
                    tracing::warn!(%error, "no io_uring for the vring thread; requests go through the bdev");
                    return;
                }
            };
            let event = self.ring_event(thread);
            if let Err(error) = handler.register_listener(
                ring.completions_fd(),
                EventSet::IN | EventSet::EDGE_TRIGGERED,
                event,
            ) {
                tracing::warn!(%error, "vring thread cannot wait for io_uring; requests go through the bdev");
                return;
            }
            rings.push(Arc::new(ring));
        }
        *self.rings.write().unwrap_or_else(|p| p.into_inner()) = rings;
    }

    /// Drops the session's rings (each waits for its requests when its last user lets go).
    pub fn close_rings(&self) {
        let rings = std::mem::take(&mut *self.rings.write().unwrap_or_else(|p| p.into_inner()));
        // Outside the lock: a ring's drop may wait for its requests.
        drop(rings);
    }

    /// The session whose vrings these are from now on (`None`: it has ended).
    pub fn set_session(&self, session: Option<Arc<Session>>) {
        *self.session.write().unwrap_or_else(|p| p.into_inner()) = session;
    }

    /// Ends the session: waits for the vrings' requests in flight ([`wait_for_requests`]),
    /// then closes it ([`Session::close`]), so that nothing of the session touches the
    /// next session's vrings and region.
    pub fn end_session(&self) {
        wait_for_requests("ending the vhost session", || {
            self.in_flight
                .iter()
                .map(|count| count.load(Ordering::Acquire))
                .sum()
        });
        if let Some(session) = self.session() {
            session.close();
        }
        self.set_session(None);
        // The guest's memory stays mapped no longer than the session (QEMU may be gone).
        *self.memory.write().unwrap_or_else(|p| p.into_inner()) = None;
    }

    fn session(&self) -> Option<Arc<Session>> {
        self.session
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn ring(&self, thread: usize) -> Option<Arc<DirectRing>> {
        let rings = self.rings.read().unwrap_or_else(|p| p.into_inner());
        rings.get(thread).cloned()
    }

    /// Starts every request the guest made available on `queue`.
    fn process_queue(
        &self,
        queue: u16,
        vring: &VringRwLock<Memory>,
        ring: Option<&DirectRing>,
    ) -> io::Result<()> {
        let Some(memory) = self
            .memory
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        else {
            return Ok(());
        };
        let (region, closed) = match self.session() {
            Some(session) => (session.inflight(), session.closed_flag()),
            None => (None, Arc::default()),
        };
        let completer = Completer {
            vring: vring.clone(),
            in_flight: self.in_flight[usize::from(queue)].clone(),
            queue,
            region: region.clone(),
            closed,
            copying: self.copying[usize::from(queue)].clone(),
        };
        if let Some(region) = &region
            && region.recovery_pending(queue)
            && let Err(error) = self.recover(&completer, region, &memory)
        {
            // Tried again at the vring's next event.
            tracing::warn!(queue, %error, "vring not recovered from the in-flight region");
        }
        let event_idx = self.event_idx.load(Ordering::Relaxed);
        loop {
            if event_idx {
                vring.disable_notification().map_err(io::Error::other)?;
            }
            // A driver has at most a queue's worth of requests out; completed ones count
            // until the guest is signalled, so twice that is never reached by a driver
            // that follows the rules. One that offers heads still in flight gets no more
            // taken until it kicks again with fewer out (else it could make the target
            // hold any number of requests and their buffers).
            // The same for the write data copied: past COPY_BYTES_MAX, no request is
            // taken until completions give room back (the last of them kicks the vring).
            if completer.copying.hold() {
                tracing::debug!(
                    queue,
                    "requests held back: their copied data's budget is spent"
                );
                if event_idx {
                    vring.enable_notification().map_err(io::Error::other)?;
                }
                break;
            }
            // Requests replayed from the region go first, within the same budget.
            if let Some(region) = &region
                && region.replaying(queue)
                && !self.start_replays(&completer, region, &memory, ring)
            {
                // Kept for `stop_vring`, should the vring stop before they all start.
                *self.replaying[usize::from(queue)]
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(completer.clone());
                continue;
            }
            let in_flight = completer.in_flight.load(Ordering::Acquire);
            let copied = completer.copying.bytes.load(Ordering::SeqCst);
            let (room, chains, budget_spent) = {
                let mut state = vring.get_mut();
                let queue = state.get_queue_mut();
                let room = (2 * usize::from(queue.size())).saturating_sub(in_flight);
                let mut available = queue.iter(memory.memory()).map_err(io::Error::other)?;
                // Taken while the data they may carry fits the budget, the one crossing it
                // included.
                let (mut chains, mut bytes) = (Vec::new(), copied);
                while chains.len() < room && bytes < COPY_BYTES_MAX {
                    let Some(chain) = available.next() else { break };
                    let head = chain.head_index();
                    let descriptors: Descriptors = chain
                        .map(|d| (d.addr(), d.len(), d.is_write_only()))
                        .collect();
                    bytes += descriptors
                        .iter()
                        .filter(|(_, _, write_only)| !write_only)
                        .map(|(_, len, _)| u64::from(*len))
                        .sum::<u64>();
                    chains.push((head, descriptors));
                }
                (room, chains, bytes >= COPY_BYTES_MAX)
            };
            if room == 0 {
                tracing::debug!(queue, "a guest offered more requests than its queue holds");
                if event_idx {
                    vring.enable_notification().map_err(io::Error::other)?;
                }
                break;
            }
            for (head, descriptors) in chains {
                // Marked in the order taken: after a crash, the next backend takes again
                // from the available ring only what no mark covers.
                if let Some(region) = &region {
                    region.begin(queue, head);
                }
                self.start(completer.clone(), head, &descriptors, &memory, ring);
            }
            if let Some(ring) = ring {
                ring.submit();
            }
            // Stopped at the budget: the top of the loop holds the rest back (and has them
            // kicked for), or takes more if requests completed meanwhile.
            if budget_spent {
                continue;
            }
            if !event_idx || !vring.enable_notification().map_err(io::Error::other)? {
                break;
            }
        }
        Ok(())
    }

    /// Recovers the requests of `completer`'s vring that a previous backend took and did
    /// not complete (it crashed), to be started again oldest first (`start_replays`), and
    /// moves the vring's next available index past every request taken: the frontend,
    /// which could not ask the dead backend where it was, resumes the vring at its used
    /// index.
    fn recover(
        &self,
        completer: &Completer,
        region: &InflightRegion,
        memory: &Memory,
    ) -> io::Result<()> {
        let guest = memory.memory();
        let (size, used) = {
            let state = completer.vring.get_ref();
            let queue = state.get_queue();
            let used = queue
                .used_idx(&*guest, Ordering::Acquire)
                .map_err(io::Error::other)?;
            (queue.size(), used.0)
        };
        if !region.take_recovery(completer.queue) {
            return Ok(());
        }
        let heads = region.recover(completer.queue, used, size);
        let taken = used.wrapping_add(heads.len() as u16);
        completer
            .vring
            .get_mut()
            .get_queue_mut()
            .set_next_avail(taken);
        tracing::info!(
            queue = completer.queue,
            used,
            requests = heads.len(),
            "vring resumed; replaying requests in flight at the previous backend's end"
        );
        region.set_replays(completer.queue, heads);
        Ok(())
    }

    /// Starts `completer`'s vring's requests to replay from `region`, oldest first, while
    /// the data they copy fits the vring's budget (the one crossing it included, as for
    /// requests taken from the available ring); whether none is left.
    fn start_replays(
        &self,
        completer: &Completer,
        region: &InflightRegion,
        memory: &Memory,
        ring: Option<&DirectRing>,
    ) -> bool {
        let (table, size) = {
            let state = completer.vring.get_ref();
            let queue = state.get_queue();
            (queue.desc_table(), queue.size())
        };
        let mut started = false;
        let left = loop {
            if completer.copying.spent() {
                break true;
            }
            let Some(head) = region.next_replay(completer.queue) else {
                break false;
            };
            // A chain that cannot be read is no request: `start` completes it as malformed.
            let guest = memory.memory();
            let descriptors = inflight::chain(&*guest, vm_memory::GuestAddress(table), size, head)
                .unwrap_or_else(|error| {
                    tracing::warn!(head, %error, "a request in flight cannot be replayed");
                    Descriptors::new()
                });
            drop(guest);
            self.start(completer.clone(), head, &descriptors, memory, ring);
            started = true;
        };
        if started && let Some(ring) = ring {
            ring.submit();
        }
        !left
    }

    /// Starts one request (or completes it at once when it is malformed).
    fn start(
        &self,
        completer: Completer,
        head: u16,
        descriptors: &Descriptors,
        memory: &Memory,
        ring: Option<&DirectRing>,
    ) {
        completer.in_flight.fetch_add(1, Ordering::AcqRel);
        let guest = memory.memory();
        let request = match parse(descriptors, &*guest) {
            Ok(request) => request,
            Err((error, status)) => {
                tracing::debug!(head, %error, "malformed virtio-blk request");
                let used_len = match status {
                    Some(status) if guest.write_obj(STATUS_IOERR, status).is_ok() => 1,
                    _ => 0,
                };
                completer.complete(head, used_len);
                return;
            }
        };
        // Reads and writes of a file go straight between guest memory and the file.
        let completer = match ring {
            Some(ring) if !(self.options.readonly && request.kind == TYPE_OUT) => {
                match ring.start(completer, head, &request, guest.clone().into_inner()) {
                    Ok(()) => {
                        self.in_place_requests.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    Err(completer) => completer,
                }
            }
            _ => completer,
        };
        // A write's data is copied out now, on this thread, into a buffer of the bdev's own;
        // only once its size is known to be one the request may carry.
        let mut data = None;
        if request.kind == TYPE_OUT
            || request.kind == TYPE_DISCARD
            || request.kind == TYPE_WRITE_ZEROES
        {
            let copied = copy_size(&request, &*self.options.bdev).and_then(|size| {
                let mut buffer = DmaBuf::zeroed(size);
                read_runs(&*guest, &request.readable, &mut buffer)
                    .ok()
                    .map(|_| buffer)
            });
            let Some(buffer) = copied else {
                let used_len = u32::from(guest.write_obj(STATUS_IOERR, request.status).is_ok());
                completer.complete(head, used_len);
                return;
            };
            completer
                .copying
                .bytes
                .fetch_add(buffer.len() as u64, Ordering::SeqCst);
            data = Some(buffer);
        }
        let copied = data.as_ref().map_or(0, |buffer| buffer.len() as u64);
        drop(guest);
        let bdev = self.options.bdev.clone();
        let readonly = self.options.readonly;
        let serial = self.options.serial.clone();
        let memory = memory.clone();
        let task = async move {
            let (status, written) = run(&*bdev, readonly, &serial, &request, data, &memory).await;
            let guest = memory.memory();
            let used_len = if guest.write_obj(status, request.status).is_ok() {
                written + 1
            } else {
                0
            };
            drop(guest);
            // Before the request counts out of the vring: a session that ends waits for
            // that, and must find the budget given back (its vring is not the next
            // session's, which the kick would miss).
            if copied > 0 {
                completer.copying.release(copied, &completer.vring);
            }
            completer.complete(head, used_len);
        };
        if self.options.reactors.is_empty() {
            self.reactors.spawn(task);
        } else {
            let turn = self.next_reactor.fetch_add(1, Ordering::Relaxed);
            let chosen = &self.options.reactors;
            self.reactors.spawn_on(chosen[turn % chosen.len()], task);
        }
    }
}

/// The bytes to copy out of guest memory for a request that carries data (a write, a
/// discard's or a write zeroes' segments), if the request may carry that many: a write
/// inside the bdev, or whole segments up to [`DISCARD_SEGMENTS_MAX`]. Checked before the
/// buffer is allocated, so that a guest cannot make the target allocate what no valid
/// request carries.
fn copy_size(request: &Request, bdev: &dyn Bdev) -> Option<usize> {
    let len = request.readable_len();
    let valid = match request.kind {
        TYPE_OUT => request
            .sector
            .checked_mul(SECTOR_SIZE)
            .is_some_and(|offset| bdev.info().data_extent(offset, len).is_ok()),
        _ => {
            len > 0
                && len.is_multiple_of(SEGMENT_SIZE as u64)
                && len / SEGMENT_SIZE as u64 <= u64::from(DISCARD_SEGMENTS_MAX)
        }
    };
    valid.then_some(len as usize)
}

/// Runs a request on the bdev; the status and the bytes written into the guest's buffers.
async fn run(
    bdev: &dyn Bdev,
    readonly: bool,
    serial: &str,
    request: &Request,
    data: Option<DmaBuf>,
    memory: &Memory,
) -> (u8, u32) {
    let info = bdev.info();
    let offset = request.sector.checked_mul(SECTOR_SIZE);
    let changes = matches!(request.kind, TYPE_OUT | TYPE_DISCARD | TYPE_WRITE_ZEROES);
    if changes && readonly {
        return (STATUS_IOERR, 0);
    }
    match request.kind {
        TYPE_IN => {
            let len = request.writable_len();
            let Some(extent) = offset.and_then(|offset| info.data_extent(offset, len).ok()) else {
                return (STATUS_IOERR, 0);
            };
            match bdev.read(extent).await {
                Ok(buffer) => match write_runs(&*memory.memory(), &request.writable, &buffer) {
                    Ok(written) => (STATUS_OK, written as u32),
                    Err(_) => (STATUS_IOERR, 0),
                },
                Err(error) => {
                    tracing::debug!(%error, "virtio-blk read failed");
                    (STATUS_IOERR, 0)
                }
            }
        }
        TYPE_OUT => {
            let data = data.unwrap_or_else(|| DmaBuf::zeroed(0));
            let Some(extent) =
                offset.and_then(|offset| info.data_extent(offset, data.len() as u64).ok())
            else {
                return (STATUS_IOERR, 0);
            };
            match bdev.write(extent, data, false).await {
                Ok(()) => (STATUS_OK, 0),
                Err(error) => {
                    tracing::debug!(%error, "virtio-blk write failed");
                    (STATUS_IOERR, 0)
                }
            }
        }
        TYPE_FLUSH => match bdev.flush().await {
            Ok(()) => (STATUS_OK, 0),
            Err(_) => (STATUS_IOERR, 0),
        },
        TYPE_GET_ID => {
            let mut id = [0u8; ID_SIZE];
            let bytes = serial.as_bytes();
            let len = bytes.len().min(ID_SIZE);
            id[..len].copy_from_slice(&bytes[..len]);
            match write_runs(&*memory.memory(), &request.writable, &id) {
                Ok(written) => (STATUS_OK, written as u32),
                Err(_) => (STATUS_IOERR, 0),
            }
        }
        TYPE_DISCARD | TYPE_WRITE_ZEROES => {
            let data = data.unwrap_or_else(|| DmaBuf::zeroed(0));
            if data.is_empty()
                || !data.len().is_multiple_of(SEGMENT_SIZE)
                || data.len() / SEGMENT_SIZE > DISCARD_SEGMENTS_MAX as usize
            {
                return (STATUS_IOERR, 0);
            }
            for segment in data.chunks_exact(SEGMENT_SIZE) {
                let sector = u64::from_le_bytes(segment[0..8].try_into().expect("8 bytes"));
                let sectors = u32::from_le_bytes(segment[8..12].try_into().expect("4 bytes"));
                let flags = u32::from_le_bytes(segment[12..16].try_into().expect("4 bytes"));
                let extent = sector
                    .checked_mul(SECTOR_SIZE)
                    .and_then(|offset| info.extent(offset, u64::from(sectors) * SECTOR_SIZE).ok());
                let Some(extent) = extent else {
                    return (STATUS_IOERR, 0);
                };
                let done = if request.kind == TYPE_DISCARD {
                    bdev.discard(extent).await
                } else {
                    bdev.write_zeroes(extent, flags & WRITE_ZEROES_UNMAP != 0)
                        .await
                };
                if done.is_err() {
                    return (STATUS_IOERR, 0);
                }
            }
            (STATUS_OK, 0)
        }
        _ => (STATUS_UNSUPP, 0),
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = VringRwLock<Memory>;

    fn num_queues(&self) -> usize {
        usize::from(self.options.queues)
    }

    fn max_queue_size(&self) -> usize {
        QUEUE_SIZE_MAX
    }

    fn features(&self) -> u64 {
        let mut features = [
            virtio_config::VIRTIO_F_VERSION_1,
            virtio_ring::VIRTIO_RING_F_INDIRECT_DESC,
            virtio_ring::VIRTIO_RING_F_EVENT_IDX,
            virtio_blk::VIRTIO_BLK_F_SEG_MAX,
            virtio_blk::VIRTIO_BLK_F_BLK_SIZE,
            virtio_blk::VIRTIO_BLK_F_TOPOLOGY,
            virtio_blk::VIRTIO_BLK_F_FLUSH,
            virtio_blk::VIRTIO_BLK_F_MQ,
        ]
        .into_iter()
        .fold(
            VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits(),
            |all, bit| all | feature(bit),
        );
        if self.options.readonly {
            features |= feature(virtio_blk::VIRTIO_BLK_F_RO);
        } else {
            features |= feature(virtio_blk::VIRTIO_BLK_F_DISCARD)
                | feature(virtio_blk::VIRTIO_BLK_F_WRITE_ZEROES);
        }
        features
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        // BACKEND_REQ: QEMU hands over the backend channel, on which the controller's
        // relay sends the configuration change notice after a resize.
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::BACKEND_REQ
    }

    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let config = self.config();
        let start = (offset as usize).min(config.len());
        let end = start.saturating_add(size as usize).min(config.len());
        let mut out = config[start..end].to_vec();
        out.resize(size as usize, 0);
        out
    }

    fn update_memory(&self, memory: Memory) -> io::Result<()> {
        *self.memory.write().unwrap_or_else(|p| p.into_inner()) = Some(memory);
        Ok(())
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        // The frontend is told an available index past the requests to replay that the
        // copy budget held back: they start now, as room comes back, and are waited for.
        let held = self
            .replaying
            .get(queue_index as usize)
            .and_then(|held| held.lock().unwrap_or_else(|p| p.into_inner()).take());
        let memory = self
            .memory
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let (Some(completer), Some(memory)) = (held, memory)
            && let Some(region) = completer.region.clone()
        {
            while !self.start_replays(&completer, &region, &memory, None) {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        if let Some(count) = self.in_flight.get(queue_index as usize) {
            wait_for_requests("stopping a vring", || count.load(Ordering::Acquire));
        }
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[Self::Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected events {evset:?}")));
        }
        // Above the queues and the exit event: a vring thread's io_uring has completions.
        if let Some(thread) = self.ring_thread(device_event) {
            if let Some(ring) = self.ring(thread) {
                ring.reap();
            }
            return Ok(());
        }
        // vhost-user-backend starts one thread for the device's vrings (again after each
        // reconnect); on its first event it moves to the CPUs of the reactors that run its
        // requests, so that handing a request over stays on those CPUs.
        if !self.vring_cpus.is_empty() && !PLACED.get() {
            PLACED.set(true);
            if let Err(error) = basalt_io::pin_current_thread(&self.vring_cpus) {
                tracing::warn!(%error, cpus = ?self.vring_cpus, "vring thread not pinned");
            }
        }
        let Some(vring) = vrings.get(usize::from(device_event)) else {
            return Err(io::Error::other(format!(
                "unknown device event {device_event}"
            )));
        };
        let ring = self.ring(thread_id);
        // A broken ring (an available index further ahead than the queue holds, a ring
        // not ready) is that queue's: the thread goes on serving the device's other queues.
        if let Err(error) = self.process_queue(device_event, vring, ring.as_deref()) {
            tracing::debug!(queue = device_event, %error, "vring not processed");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use basalt_bdev::malloc::MallocBdev;
    use vm_memory::{GuestAddress, GuestMemoryMmap};

    fn memory() -> Memory {
        GuestMemoryAtomic::new(
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("memory"),
        )
    }

    fn request(kind: u32, sector: u64, readable: Vec<Run>, writable: Vec<Run>) -> Request {
        Request {
            kind,
            sector,
            readable,
            writable,
            status: GuestAddress(0xf_0000),
        }
    }

    fn run_on(
        bdev: &dyn Bdev,
        readonly: bool,
        request: &Request,
        data: Option<&[u8]>,
        memory: &Memory,
    ) -> (u8, u32) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        runtime.block_on(run(
            bdev,
            readonly,
            "serial-0123456789abcdef",
            request,
            data.map(DmaBuf::from_slice),
            memory,
        ))
    }

    #[test]
    fn a_request_finishing_after_its_session_closed_leaves_the_used_ring_alone() {
        const USED: u64 = 0x3000;
        // Without an in-flight region, and with one (where the request stays marked).
        for with_region in [false, true] {
            let memory = memory();
            let vring = VringRwLock::new(memory.clone(), 16).expect("vring");
            vring.set_queue_size(16);
            vring
                .set_queue_info(0x1000, 0x2000, USED)
                .expect("ring addresses");
            vring.set_queue_ready(true);
            let region = with_region.then(|| {
                let (file, len) = inflight::create(1, 16, 16).expect("region file");
                Arc::new(InflightRegion::open(file, 0, len, 1, 16, 16).expect("region"))
            });
            let session = Session::default();
            let completer = Completer {
                vring,
                in_flight: Arc::default(),
                queue: 0,
                region: region.clone(),
                closed: session.closed_flag(),
                copying: Arc::default(),
            };
            let used = || {
                let memory = memory.memory();
                let index: u16 = memory.read_obj(GuestAddress(USED + 2)).expect("used idx");
                let head: u32 = memory.read_obj(GuestAddress(USED + 4)).expect("used id");
                (index, head)
            };
            if let Some(region) = &region {
                region.begin(0, 5);
                region.begin(0, 6);
            }
            completer.finish(5, 1);
            assert_eq!(
                used(),
                (1, 5),
                "put on the used ring while the session is open"
            );
            session.close();
            completer.finish(6, 1);
            assert_eq!(used(), (1, 5), "the used ring untouched once it is closed");
            if let Some(region) = &region {
                assert_eq!(
                    region.recover(0, 1, 16),
                    vec![6],
                    "still marked: replayed next"
                );
            }
        }
    }

    /// A request's data is copied out of guest memory only when the request may carry
    /// that much: a write inside the bdev, whole discard segments up to the limit.
    #[test]
    fn data_is_copied_only_for_requests_that_may_carry_it() {
        let bdev = MallocBdev::new_named("m", 512, 64); // 32 KiB
        let runs = |len: u32| {
            vec![Run {
                address: GuestAddress(0x1000),
                len,
            }]
        };
        let size = |kind: u32, sector: u64, len: u32| {
            copy_size(&request(kind, sector, runs(len), vec![]), &bdev)
        };
        assert_eq!(size(TYPE_OUT, 0, 32 << 10), Some(32 << 10));
        assert_eq!(size(TYPE_OUT, 1, 32 << 10), None, "past the end");
        assert_eq!(
            size(TYPE_OUT, u64::MAX / 256, 512),
            None,
            "offset overflows"
        );
        assert_eq!(
            size(TYPE_OUT, 0, u32::MAX),
            None,
            "far larger than the bdev"
        );
        assert_eq!(size(TYPE_OUT, 0, 100), None, "not whole blocks");
        let segments = DISCARD_SEGMENTS_MAX * SEGMENT_SIZE as u32;
        assert_eq!(size(TYPE_DISCARD, 0, segments), Some(segments as usize));
        assert_eq!(
            size(TYPE_DISCARD, 0, segments + 16),
            None,
            "a segment too many"
        );
        assert_eq!(size(TYPE_WRITE_ZEROES, 0, 17), None, "not whole segments");
        assert_eq!(size(TYPE_WRITE_ZEROES, 0, 0), None, "no segment");
    }

    #[test]
    fn requests_run_on_the_bdev_and_bad_ones_fail_alone() {
        let bdev = MallocBdev::new_named("m", 512, 64); // 32 KiB
        let memory = memory();
        let run_at = |address: u64, len: u32| {
            vec![Run {
                address: GuestAddress(address),
                len,
            }]
        };

        // A write, then a read into two runs of guest memory.
        let data: Vec<u8> = (0..1024u32).map(|i| i as u8).collect();
        let write = request(TYPE_OUT, 4, run_at(0x1000, 1024), vec![]);
        assert_eq!(
            run_on(&bdev, false, &write, Some(&data), &memory),
            (STATUS_OK, 0)
        );
        let read = request(
            TYPE_IN,
            4,
            vec![],
            vec![
                Run {
                    address: GuestAddress(0x8000),
                    len: 512,
                },
                Run {
                    address: GuestAddress(0x9000),
                    len: 512,
                },
            ],
        );
        assert_eq!(
            run_on(&bdev, false, &read, None, &memory),
            (STATUS_OK, 1024)
        );
        let guest = memory.memory();
        let mut back = vec![0u8; 1024];
        guest
            .read_slice(&mut back[..512], GuestAddress(0x8000))
            .expect("read");
        guest
            .read_slice(&mut back[512..], GuestAddress(0x9000))
            .expect("read");
        assert_eq!(back, data);

        // Past the end, misaligned to nothing (512-byte blocks), or an unknown type.
        let past_end = request(TYPE_IN, 63, vec![], run_at(0x8000, 1024));
        assert_eq!(
            run_on(&bdev, false, &past_end, None, &memory).0,
            STATUS_IOERR
        );
        let overflow = request(TYPE_IN, u64::MAX / 256, vec![], run_at(0x8000, 512));
        assert_eq!(
            run_on(&bdev, false, &overflow, None, &memory).0,
            STATUS_IOERR
        );
        let unknown = request(99, 0, vec![], vec![]);
        assert_eq!(
            run_on(&bdev, false, &unknown, None, &memory).0,
            STATUS_UNSUPP
        );
        let empty_read = request(TYPE_IN, 0, vec![], vec![]);
        assert_eq!(
            run_on(&bdev, false, &empty_read, None, &memory).0,
            STATUS_IOERR
        );

        // Read-only: writes, discard and write zeroes refused, reads served.
        assert_eq!(
            run_on(&bdev, true, &write, Some(&data), &memory).0,
            STATUS_IOERR
        );
        assert_eq!(run_on(&bdev, true, &read, None, &memory).0, STATUS_OK);

        // GET_ID: the serial, cut to 20 bytes.
        let id = request(TYPE_GET_ID, 0, vec![], run_at(0xa000, 20));
        assert_eq!(run_on(&bdev, false, &id, None, &memory), (STATUS_OK, 20));
        let mut serial = [0u8; 20];
        memory
            .memory()
            .read_slice(&mut serial, GuestAddress(0xa000))
            .expect("read");
        assert_eq!(&serial, b"serial-0123456789abc");

        // Discard and write zeroes segments: sector u64, count u32, flags u32.
        let segment = |sector: u64, count: u32, flags: u32| {
            let mut bytes = Vec::new();
            bytes.extend_from_slice(&sector.to_le_bytes());
            bytes.extend_from_slice(&count.to_le_bytes());
            bytes.extend_from_slice(&flags.to_le_bytes());
            bytes
        };
        let discard = request(TYPE_DISCARD, 0, run_at(0x1000, 16), vec![]);
        assert_eq!(
            run_on(&bdev, false, &discard, Some(&segment(4, 1, 0)), &memory).0,
            STATUS_OK
        );
        let zeroes = request(TYPE_WRITE_ZEROES, 0, run_at(0x1000, 16), vec![]);
        assert_eq!(
            run_on(
                &bdev,
                false,
                &zeroes,
                Some(&segment(5, 1, WRITE_ZEROES_UNMAP)),
                &memory
            )
            .0,
            STATUS_OK
        );
        assert_eq!(
            run_on(&bdev, false, &read, None, &memory),
            (STATUS_OK, 1024)
        );
        let mut back = vec![0u8; 512];
        memory
            .memory()
            .read_slice(&mut back, GuestAddress(0x8000))
            .expect("read");
        assert_eq!(back, vec![0u8; 512], "both blocks read as zeroes");
        let beyond = segment(60, 8, 0);
        assert_eq!(
            run_on(&bdev, false, &discard, Some(&beyond), &memory).0,
            STATUS_IOERR
        );
        assert_eq!(
            run_on(&bdev, false, &discard, Some(&[0u8; 15]), &memory).0,
            STATUS_IOERR
        );
    }
}
