//! A controller: what a host gets by connecting its admin queue to a subsystem. It holds
//! the properties (CC, CSTS), the features the host set, the I/O queues connected to it,
//! its asynchronous events and its keep-alive clock, and it answers admin commands.
//! The I/O commands are in `crate::io_command`; the sockets in `crate::connection`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use basalt_io::DmaBuf;
use tokio::sync::{Notify, watch};

use crate::command::*;
use crate::completion::Status;
use crate::fabrics::*;
use crate::identify::{
    self, ControllerFacts, DiscoveryRecord, ERROR_LOG_ENTRIES, ErrorEntry, HealthCounters,
};
use crate::subsystem::{Subsystem, TransportOptions};

/// What a command ends with: a status, DW0/DW1, and data for the host (commands that
/// read), of which at most `data_limit` bytes (the SGL's length) are sent.
#[derive(Debug, Default)]
pub struct Response {
    /// The command.
    pub command_id: u16,
    /// Its status.
    pub status: Status,
    /// Completion dword 0.
    pub dw0: u32,
    /// Completion dword 1.
    pub dw1: u32,
    /// Data to send to the host, when the command succeeded.
    pub data: Option<Payload>,
}

/// Data a command returns to the host.
#[derive(Debug)]
pub enum Payload {
    /// Built by the controller (Identify, log pages).
    Bytes(Vec<u8>),
    /// Read from a bdev.
    Buffer(DmaBuf),
}

impl std::ops::Deref for Payload {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Payload::Bytes(bytes) => bytes,
            Payload::Buffer(buffer) => buffer,
        }
    }
}

impl Response {
    /// A response with a status and nothing else.
    pub fn status(command_id: u16, status: Status) -> Self {
        Self {
            command_id,
            status,
            ..Self::default()
        }
    }

    /// A successful response carrying `data`.
    pub fn data(command_id: u16, data: Vec<u8>) -> Self {
        Self {
            command_id,
            data: Some(Payload::Bytes(data)),
            ..Self::default()
        }
    }

    /// A successful response with `dw0`.
    pub fn dw0(command_id: u16, dw0: u32) -> Self {
        Self {
            command_id,
            dw0,
            ..Self::default()
        }
    }
}

/// The calling thread's name (a reactor's, for a connection), for `nvmf_subsystem_get_qpairs`.
fn current_thread_name() -> String {
    std::thread::current()
        .name()
        .unwrap_or("unnamed")
        .to_string()
}

/// CC.EN.
const CC_ENABLE: u32 = 1;
/// CC.SHN (bits 15:14).
const CC_SHUTDOWN_MASK: u32 = 0b11 << 14;
/// CSTS.RDY.
const CSTS_READY: u32 = 1;
/// CSTS.SHST = shutdown processing complete (bits 3:2 = 10b).
const CSTS_SHUTDOWN_COMPLETE: u32 = 0b10 << 2;
/// CAP.TO in 500 ms units: how long the host waits for CSTS.RDY.
const CAP_TIMEOUT_500MS: u64 = 15;

/// Asynchronous event: type notice (2), information "namespace attribute changed" (0),
/// log page 04h to read.
pub const ASYNC_EVENT_NAMESPACE_CHANGED: u32 = 0x2 | (0x04 << 16);

/// The changeable part of a controller.
struct ControllerState {
    cc: u32,
    csts: u32,
    io_queues_granted: Option<u16>,
    /// Connected I/O queues and the reactor thread serving each.
    io_queues: BTreeMap<u16, String>,
    keep_alive_timeout_ms: u32,
    async_event_config: u32,
    events: VecDeque<u32>,
    namespace_event_masked: bool,
    changed_namespaces: Vec<u32>,
    changed_overflowed: bool,
    last_keep_alive: Instant,
    /// The last [`ERROR_LOG_ENTRIES`] commands that completed with an error, newest first.
    errors: VecDeque<ErrorEntry>,
    /// Errors logged so far.
    error_count: u64,
}

/// Where a command was aimed, for its entry in the error log should it fail: its opcode,
/// namespace and starting LBA field (CDW10-11), and whether its connection had a queue
/// (and so a controller) when it came.
#[derive(Debug, Clone, Copy, Default)]
pub struct ErrorSite {
    /// The command's opcode.
    pub opcode: u8,
    /// Its namespace (0 for Fabrics commands, whose bytes 4-7 are their type).
    pub nsid: u32,
    /// CDW10 and CDW11, the starting LBA of the commands that have one.
    pub slba: u64,
    /// The connection was bound to a queue when the command came: a command refused
    /// before Connect is no controller's error, even if it is answered after one.
    pub bound: bool,
}

impl ErrorSite {
    /// The site of `sqe` (not bound yet: the connection sets that).
    pub fn of(sqe: &Sqe) -> Self {
        Self {
            opcode: sqe.opcode,
            nsid: if sqe.opcode == FABRICS {
                0
            } else {
                sqe.namespace_id
            },
            slba: u64::from(sqe.cdw10) | (u64::from(sqe.cdw11) << 32),
            bound: false,
        }
    }
}

/// Bytes and commands a controller moved, for the health log page.
#[derive(Debug, Default)]
pub struct ControllerCounters {
    /// Bytes read.
    pub bytes_read: AtomicU64,
    /// Bytes written.
    pub bytes_written: AtomicU64,
    /// Read commands.
    pub read_commands: AtomicU64,
    /// Write commands.
    pub write_commands: AtomicU64,
    /// Commands the bdev failed.
    pub errors: AtomicU64,
}

/// A controller of a subsystem, shared by its admin queue and its I/O queues.
pub struct Controller {
    /// The controller id.
    pub id: u16,
    /// The subsystem.
    pub subsystem: Arc<Subsystem>,
    /// The host's NQN.
    pub host_nqn: String,
    /// The host identifier from Connect.
    pub host_id: [u8; 16],
    /// The transport's options when the controller was created.
    pub options: TransportOptions,
    /// Counts for the health log page.
    pub counters: ControllerCounters,
    /// The thread serving the admin queue.
    admin_thread: String,
    state: Mutex<ControllerState>,
    events: Notify,
    closed: watch::Sender<bool>,
}

impl Controller {
    /// A new controller (disabled, no I/O queue) for `host_nqn` on `subsystem`, created on
    /// the thread that serves its admin queue.
    pub fn new(
        id: u16,
        subsystem: Arc<Subsystem>,
        host_nqn: String,
        host_id: [u8; 16],
        keep_alive_timeout_ms: u32,
        options: TransportOptions,
    ) -> Self {
        let (closed, _) = watch::channel(false);
        Self {
            id,
            subsystem,
            host_nqn,
            host_id,
            options,
            counters: ControllerCounters::default(),
            admin_thread: current_thread_name(),
            state: Mutex::new(ControllerState {
                cc: 0,
                csts: 0,
                io_queues_granted: None,
                io_queues: BTreeMap::new(),
                keep_alive_timeout_ms,
                async_event_config: 0,
                events: VecDeque::new(),
                namespace_event_masked: false,
                changed_namespaces: Vec::new(),
                changed_overflowed: false,
                last_keep_alive: Instant::now(),
                errors: VecDeque::with_capacity(ERROR_LOG_ENTRIES),
                error_count: 0,
            }),
            events: Notify::new(),
            closed,
        }
    }

    fn lock(&self) -> MutexGuard<'_, ControllerState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A receiver that turns true when the controller is torn down.
    pub fn closed(&self) -> watch::Receiver<bool> {
        self.closed.subscribe()
    }

    /// Tears the controller down: every queue's connection ends.
    pub fn close(&self) {
        self.closed.send_replace(true);
    }

    /// Whether the controller was torn down.
    pub fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }

    /// Logs a command of queue `sqid` that completed with `status` (an error) in the error
    /// information log page.
    pub fn log_error(&self, sqid: u16, command_id: u16, site: &ErrorSite, status: Status) {
        let has_lba = sqid != 0 && matches!(site.opcode, IO_READ | IO_WRITE | IO_WRITE_ZEROES);
        let mut state = self.lock();
        state.error_count += 1;
        let entry = ErrorEntry {
            count: state.error_count,
            sqid,
            command_id,
            status: status.field(),
            lba: if has_lba { site.slba } else { 0 },
            nsid: site.nsid,
        };
        state.errors.truncate(ERROR_LOG_ENTRIES - 1);
        state.errors.push_front(entry);
    }

    /// Whether CC.EN is set and CSTS.RDY with it.
    pub fn is_ready(&self) -> bool {
        self.lock().csts & CSTS_READY != 0
    }

    /// The connected I/O queue ids.
    pub fn io_queues(&self) -> Vec<u16> {
        self.lock().io_queues.keys().copied().collect()
    }

    /// Every connected queue (the admin queue first) and the thread serving it.
    pub fn queue_threads(&self) -> Vec<(u16, String)> {
        let state = self.lock();
        std::iter::once((0, self.admin_thread.clone()))
            .chain(
                state
                    .io_queues
                    .iter()
                    .map(|(qid, thread)| (*qid, thread.clone())),
            )
            .collect()
    }

    /// I/O queues the host may connect: what Set Features granted, else the maximum.
    pub fn io_queue_count_max(&self) -> u16 {
        self.lock()
            .io_queues_granted
            .unwrap_or(self.options.max_io_qpairs_per_ctrlr)
    }

    /// Registers I/O queue `qid`; the status to answer Connect with otherwise.
    pub fn add_io_queue(&self, qid: u16) -> Result<(), Status> {
        let mut state = self.lock();
        if state.csts & CSTS_READY == 0 {
            return Err(Status::COMMAND_SEQUENCE_ERROR);
        }
        let max = state
            .io_queues_granted
            .unwrap_or(self.options.max_io_qpairs_per_ctrlr);
        if qid > max {
            return Err(Status::CONNECT_INVALID_PARAMETERS);
        }
        if state.io_queues.contains_key(&qid) {
            return Err(Status::COMMAND_SEQUENCE_ERROR);
        }
        state.io_queues.insert(qid, current_thread_name());
        Ok(())
    }

    /// Forgets I/O queue `qid` (its connection ended).
    pub fn remove_io_queue(&self, qid: u16) {
        self.lock().io_queues.remove(&qid);
    }

    /// The keep-alive timeout set by Connect or Set Features (`None`: disabled).
    pub fn keep_alive_timeout(&self) -> Option<Duration> {
        let ms = self.lock().keep_alive_timeout_ms;
        (ms > 0).then(|| Duration::from_millis(u64::from(ms)))
    }

    /// Restarts the keep-alive clock.
    pub fn keep_alive(&self) {
        self.lock().last_keep_alive = Instant::now();
    }

    /// When the controller expires unless the host shows signs of life: twice the
    /// keep-alive timeout after the last command on the admin queue, since hosts send a
    /// Keep Alive once per timeout (a margin the Linux target also leaves). `None` when
    /// keep-alive is disabled.
    pub fn keep_alive_deadline(&self) -> Option<Instant> {
        let state = self.lock();
        let ms = state.keep_alive_timeout_ms;
        (ms > 0).then(|| state.last_keep_alive + 2 * Duration::from_millis(u64::from(ms)))
    }

    /// Records that namespace `nsid` was added or removed, and raises a namespace
    /// attribute notice if the host enabled them and has read the last one.
    pub fn namespace_changed(&self, nsid: u32) {
        let mut state = self.lock();
        if !state.changed_namespaces.contains(&nsid) {
            if state.changed_namespaces.len() < identify::CHANGED_NAMESPACES_MAX {
                state.changed_namespaces.push(nsid);
            } else {
                state.changed_overflowed = true;
            }
        }
        if state.async_event_config & identify::ASYNC_EVENT_NAMESPACE_ATTRIBUTE != 0
            && !state.namespace_event_masked
        {
            state.namespace_event_masked = true;
            state.events.push_back(ASYNC_EVENT_NAMESPACE_CHANGED);
            drop(state);
            self.events.notify_one();
        }
    }

    /// Waits for the next asynchronous event; DW0 of the Asynchronous Event Request's
    /// completion.
    pub async fn next_event(self: Arc<Self>) -> u32 {
        loop {
            if let Some(event) = self.lock().events.pop_front() {
                return event;
            }
            self.events.notified().await;
        }
    }

    /// Reads a property (Property Get).
    pub fn property_get(&self, property: &PropertyCommand) -> Result<u64, Status> {
        let state = self.lock();
        let (value, wide) = match property.offset {
            PROPERTY_CAP => (self.capabilities(), true),
            PROPERTY_VS => (u64::from(identify::NVME_VERSION), false),
            PROPERTY_CC => (u64::from(state.cc), false),
            PROPERTY_CSTS => (u64::from(state.csts), false),
            _ => return Err(Status::INVALID_FIELD.with_dnr()),
        };
        if property.wide != wide {
            return Err(Status::INVALID_FIELD.with_dnr());
        }
        Ok(value)
    }

    /// Writes a property (Property Set): only CC is writable.
    pub fn property_set(&self, property: &PropertyCommand) -> Result<(), Status> {
        if property.offset != PROPERTY_CC || property.wide {
            return Err(Status::INVALID_FIELD.with_dnr());
        }
        let cc = property.value as u32; // 4-byte property: the high half is not used
        let mut state = self.lock();
        let was_enabled = state.cc & CC_ENABLE != 0;
        state.cc = cc;
        if cc & CC_ENABLE != 0 && !was_enabled {
            state.csts = CSTS_READY;
        } else if cc & CC_ENABLE == 0 {
            state.csts &= !CSTS_READY;
        }
        if cc & CC_SHUTDOWN_MASK != 0 {
            state.csts |= CSTS_SHUTDOWN_COMPLETE;
        } else {
            state.csts &= !CSTS_SHUTDOWN_COMPLETE;
        }
        Ok(())
    }

    /// CAP: MQES, CQR, TO, CSS (NVM command set), 4 KiB pages.
    fn capabilities(&self) -> u64 {
        let depth = if self.subsystem.is_discovery() {
            self.options.max_aq_depth
        } else {
            self.options.max_queue_depth
        };
        u64::from(depth - 1) | (1 << 16) | (CAP_TIMEOUT_500MS << 24) | (1 << 37)
    }

    fn facts(&self) -> ControllerFacts {
        ControllerFacts {
            controller_id: self.id,
            controller_type: if self.subsystem.is_discovery() {
                identify::CONTROLLER_TYPE_DISCOVERY
            } else {
                identify::CONTROLLER_TYPE_IO
            },
            options: self.options,
        }
    }

    /// Runs an admin command other than Asynchronous Event Request and the fabrics
    /// commands. `data` is what the host sent with it; `discovery` lists what the host may
    /// see when this is a discovery controller.
    pub fn admin(
        &self,
        sqe: &Sqe,
        discovery: impl FnOnce() -> (u64, Vec<DiscoveryRecord>),
    ) -> Response {
        let id = sqe.command_id;
        let discovery_controller = self.subsystem.is_discovery();
        match sqe.opcode {
            ADMIN_IDENTIFY => self.identify(sqe),
            ADMIN_GET_LOG_PAGE => self.get_log_page(sqe, discovery),
            ADMIN_KEEP_ALIVE => {
                self.keep_alive();
                Response::status(id, Status::SUCCESS)
            }
            ADMIN_GET_FEATURES => self.get_features(sqe),
            ADMIN_SET_FEATURES => self.set_features(sqe),
            // Commands complete in the order the bdev finishes them; none is ever
            // aborted (DW0 bit 0 set: not aborted).
            ADMIN_ABORT if !discovery_controller => Response::dw0(id, 1),
            _ => Response::status(id, Status::INVALID_OPCODE.with_dnr()),
        }
    }

    fn identify(&self, sqe: &Sqe) -> Response {
        let id = sqe.command_id;
        let cns = (sqe.cdw10 & 0xff) as u8;
        let csi = (sqe.cdw11 >> 24) as u8;
        let nsid = sqe.namespace_id;
        let subsystem = &self.subsystem;
        if subsystem.is_discovery() && cns != CNS_CONTROLLER {
            return Response::status(id, Status::INVALID_FIELD.with_dnr());
        }
        let valid_nsid = nsid != 0 && nsid <= subsystem.max_namespaces;
        match cns {
            CNS_CONTROLLER => Response::data(
                id,
                identify::controller(
                    &self.facts(),
                    &subsystem.nqn,
                    &subsystem.serial_number,
                    &subsystem.model_number,
                    subsystem.max_namespaces,
                ),
            ),
            CNS_NAMESPACE => match subsystem.namespace(nsid) {
                Some(namespace) => Response::data(id, identify::namespace(&namespace)),
                // An inactive but valid id reads as zeroes.
                None if valid_nsid => Response::data(id, vec![0; identify::IDENTIFY_SIZE]),
                None => Response::status(id, Status::INVALID_NAMESPACE_OR_FORMAT.with_dnr()),
            },
            CNS_ACTIVE_NAMESPACES if nsid < 0xffff_fffe => {
                let nsids: Vec<u32> = subsystem.lock().namespaces.keys().copied().collect();
                Response::data(id, identify::active_namespaces(nsids, nsid))
            }
            CNS_NAMESPACE_DESCRIPTORS => match subsystem.namespace(nsid) {
                Some(namespace) => Response::data(id, identify::namespace_descriptors(&namespace)),
                None => Response::status(id, Status::INVALID_NAMESPACE_OR_FORMAT.with_dnr()),
            },
            // The NVM command set's own Identify Namespace holds nothing this target sets:
            // zeroes.
            CNS_NAMESPACE_COMMAND_SET if csi == 0 => match subsystem.namespace(nsid) {
                Some(_) => Response::data(id, vec![0; identify::IDENTIFY_SIZE]),
                None => Response::status(id, Status::INVALID_NAMESPACE_OR_FORMAT.with_dnr()),
            },
            CNS_CONTROLLER_COMMAND_SET if csi == 0 => {
                let namespaces: Vec<_> = subsystem.lock().namespaces.values().cloned().collect();
                Response::data(
                    id,
                    identify::nvm_controller(namespaces.iter().map(|ns| &**ns)),
                )
            }
            _ => Response::status(id, Status::INVALID_FIELD.with_dnr()),
        }
    }

    fn get_log_page(
        &self,
        sqe: &Sqe,
        discovery: impl FnOnce() -> (u64, Vec<DiscoveryRecord>),
    ) -> Response {
        let id = sqe.command_id;
        let log_id = (sqe.cdw10 & 0xff) as u8;
        let retain_event = sqe.cdw10 & (1 << 15) != 0;
        let dwords = u64::from(sqe.cdw10 >> 16) | (u64::from(sqe.cdw11 & 0xffff) << 16);
        let len_bytes = (dwords + 1) * 4;
        let offset_bytes = u64::from(sqe.cdw12) | (u64::from(sqe.cdw13) << 32);
        if !offset_bytes.is_multiple_of(4) || len_bytes > u64::from(self.options.max_io_size) {
            return Response::status(id, Status::INVALID_FIELD.with_dnr());
        }
        let len = len_bytes as usize; // at most max_io_size
        let discovery_controller = self.subsystem.is_discovery();
        let page = match log_id {
            LOG_DISCOVERY if discovery_controller => {
                let (generation, records) = discovery();
                identify::discovery(generation, &records)
            }
            LOG_ERROR => identify::error_log(&self.lock().errors),
            _ if discovery_controller => {
                return Response::status(id, Status::INVALID_LOG_PAGE.with_dnr());
            }
            LOG_HEALTH => identify::health(&HealthCounters {
                error_log_entries: self.lock().error_count,
                bytes_read: self.counters.bytes_read.load(Ordering::Relaxed),
                bytes_written: self.counters.bytes_written.load(Ordering::Relaxed),
                read_commands: self.counters.read_commands.load(Ordering::Relaxed),
                write_commands: self.counters.write_commands.load(Ordering::Relaxed),
                errors: self.counters.errors.load(Ordering::Relaxed),
            }),
            LOG_FIRMWARE_SLOT => identify::firmware_slots(),
            LOG_CHANGED_NAMESPACES => {
                let mut state = self.lock();
                let page = identify::changed_namespaces(
                    &state.changed_namespaces,
                    state.changed_overflowed,
                );
                if !retain_event {
                    state.changed_namespaces.clear();
                    state.changed_overflowed = false;
                    state.namespace_event_masked = false;
                }
                page
            }
            LOG_COMMAND_EFFECTS => identify::command_effects(),
            _ => return Response::status(id, Status::INVALID_LOG_PAGE.with_dnr()),
        };
        Response::data(id, identify::log_page_slice(&page, offset_bytes, len))
    }

    fn get_features(&self, sqe: &Sqe) -> Response {
        let id = sqe.command_id;
        let feature = (sqe.cdw10 & 0xff) as u8;
        let state = self.lock();
        match feature {
            FEATURE_NUMBER_OF_QUEUES => {
                let count = state
                    .io_queues_granted
                    .unwrap_or(self.options.max_io_qpairs_per_ctrlr);
                let zero_based = u32::from(count - 1);
                Response::dw0(id, zero_based | (zero_based << 16))
            }
            FEATURE_KEEP_ALIVE_TIMER => Response::dw0(id, state.keep_alive_timeout_ms),
            FEATURE_ASYNC_EVENT_CONFIGURATION => Response::dw0(id, state.async_event_config),
            FEATURE_VOLATILE_WRITE_CACHE
            | FEATURE_ARBITRATION
            | FEATURE_POWER_MANAGEMENT
            | FEATURE_ERROR_RECOVERY
            | FEATURE_WRITE_ATOMICITY => Response::dw0(id, 0),
            // 70 °C, in kelvin.
            FEATURE_TEMPERATURE_THRESHOLD => Response::dw0(id, 343),
            FEATURE_HOST_IDENTIFIER => {
                let extended = sqe.cdw11 & 1 != 0;
                let bytes = if extended { 16 } else { 8 };
                Response::data(id, self.host_id[..bytes].to_vec())
            }
            _ => Response::status(id, Status::INVALID_FIELD.with_dnr()),
        }
    }

    fn set_features(&self, sqe: &Sqe) -> Response {
        let id = sqe.command_id;
        let feature = (sqe.cdw10 & 0xff) as u8;
        if sqe.cdw10 & (1 << 31) != 0 {
            return Response::status(id, Status::FEATURE_NOT_SAVEABLE.with_dnr());
        }
        let mut state = self.lock();
        match feature {
            FEATURE_NUMBER_OF_QUEUES => {
                let submission = sqe.cdw11 & 0xffff;
                let completion = sqe.cdw11 >> 16;
                if submission == 0xffff || completion == 0xffff {
                    return Response::status(id, Status::INVALID_FIELD.with_dnr());
                }
                if !state.io_queues.is_empty() {
                    return Response::status(id, Status::COMMAND_SEQUENCE_ERROR.with_dnr());
                }
                let asked = submission.max(completion) + 1;
                let granted = asked.min(u32::from(self.options.max_io_qpairs_per_ctrlr)) as u16;
                state.io_queues_granted = Some(granted);
                let zero_based = u32::from(granted - 1);
                Response::dw0(id, zero_based | (zero_based << 16))
            }
            FEATURE_KEEP_ALIVE_TIMER => {
                state.keep_alive_timeout_ms = sqe.cdw11;
                state.last_keep_alive = Instant::now();
                Response::status(id, Status::SUCCESS)
            }
            FEATURE_ASYNC_EVENT_CONFIGURATION => {
                state.async_event_config = sqe.cdw11;
                Response::status(id, Status::SUCCESS)
            }
            FEATURE_HOST_IDENTIFIER => {
                Response::status(id, Status::COMMAND_SEQUENCE_ERROR.with_dnr())
            }
            FEATURE_VOLATILE_WRITE_CACHE => Response::status(id, Status::INVALID_FIELD.with_dnr()),
            _ => Response::status(id, Status::FEATURE_NOT_CHANGEABLE.with_dnr()),
        }
    }
}
