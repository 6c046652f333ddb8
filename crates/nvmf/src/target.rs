//! The NVMe/TCP target of a `basalt target`: the transport, the subsystems (the discovery
//! subsystem among them), the TCP listeners they share, and Connect, which binds a new
//! connection to a controller.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use basalt_io::Reactors;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::completion::Status;
use crate::controller::{Controller, Response};
use crate::fabrics::{
    CONNECT_DATA_CONTROLLER_ID_OFFSET, CONNECT_DATA_HOST_NQN_OFFSET,
    CONNECT_DATA_SUBSYSTEM_NQN_OFFSET, CONTROLLER_ID_DYNAMIC, ConnectCommand, ConnectData,
    DISCOVERY_NQN, connect_invalid_parameter_dw0,
};
use crate::identify::{DiscoveryRecord, SUBTYPE_CURRENT_DISCOVERY, SUBTYPE_NVME};
use crate::subsystem::{
    ADMIN_QUEUE_DEPTH_MAX, CONTROLLER_ID_MAX, DEFAULT_MODEL_NUMBER, DEFAULT_SERIAL_NUMBER,
    ListenAddress, Namespace, Subsystem, TransportOptions,
};

/// Byte offset of SQSIZE in a Connect SQE (reported when it is refused).
const CONNECT_SQSIZE_OFFSET: u16 = 44;
/// Byte offset of RECFMT in a Connect SQE.
const CONNECT_RECFMT_OFFSET: u16 = 40;

struct Listener {
    task: JoinHandle<()>,
    port_id: u16,
    /// Subsystems listening here.
    users: usize,
}

/// Counters of queue pairs, as `nvmf_get_stats` reports them.
#[derive(Debug, Default)]
pub struct QueueCounters {
    /// Admin queues connected since start.
    pub admin_qpairs: AtomicU64,
    /// I/O queues connected since start.
    pub io_qpairs: AtomicU64,
    /// Admin queues connected now.
    pub current_admin_qpairs: AtomicU64,
    /// I/O queues connected now.
    pub current_io_qpairs: AtomicU64,
}

/// A queue a Connect bound a connection to.
pub struct BoundQueue {
    /// The controller.
    pub controller: Arc<Controller>,
    /// The queue id (0: admin).
    pub qid: u16,
    /// Entries in its submission queue.
    pub sq_size: u16,
    /// The host disabled SQ flow control.
    pub sq_flow_control_disabled: bool,
}

/// How long a queue waits for the write data an R2T asked for: a host that sends none
/// holds its bytes of the data budget (`crate::budget`), which other hosts wait for. Linux
/// gives up on a command after 30 s (its I/O timeout) and resets the controller anyway.
pub const TRANSFER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How often the target looks at its namespaces' sizes.
const SIZE_WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_millis(500);

/// The NVMe/TCP target.
pub struct NvmfTarget {
    reactors: Arc<Reactors>,
    transport: Mutex<Option<TransportOptions>>,
    /// The data bytes of the commands under way, once the transport exists.
    budget: std::sync::OnceLock<Arc<crate::budget::DataBudget>>,
    /// How long a queue waits for the write data an R2T asked for, in milliseconds.
    transfer_timeout_ms: AtomicU64,
    subsystems: RwLock<BTreeMap<String, Arc<Subsystem>>>,
    discovery: Arc<Subsystem>,
    listeners: Mutex<BTreeMap<ListenAddress, Listener>>,
    next_port_id: AtomicU16,
    generation: AtomicU64,
    /// Queue pair counts.
    pub counters: QueueCounters,
}

impl NvmfTarget {
    /// A target with no transport and only the discovery subsystem, whose connections
    /// will run on `reactors`.
    pub fn new(reactors: Arc<Reactors>) -> Arc<Self> {
        let discovery = Arc::new(Subsystem::new(
            DISCOVERY_NQN.to_string(),
            DEFAULT_SERIAL_NUMBER.to_string(),
            DEFAULT_MODEL_NUMBER.to_string(),
            0,
            true,
            (1, CONTROLLER_ID_MAX),
        ));
        let target = Arc::new(Self {
            reactors,
            transport: Mutex::new(None),
            budget: std::sync::OnceLock::new(),
            transfer_timeout_ms: AtomicU64::new(TRANSFER_TIMEOUT.as_millis() as u64),
            subsystems: RwLock::new(BTreeMap::new()),
            discovery,
            listeners: Mutex::new(BTreeMap::new()),
            next_port_id: AtomicU16::new(1),
            generation: AtomicU64::new(1),
            counters: QueueCounters::default(),
        });
        let watched = Arc::downgrade(&target);
        let spawned = std::thread::Builder::new()
            .name("nvmf-sizes".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(SIZE_WATCH_INTERVAL);
                    let Some(target) = watched.upgrade() else {
                        return;
                    };
                    target.announce_sizes();
                }
            });
        if let Err(error) = spawned {
            tracing::warn!(%error, "namespace sizes will not be watched");
        }
        target
    }

    /// Tells the controllers of each namespace whose bdev changed size since they last
    /// heard of it (a rescan, a Basalt image that grew): a namespace attribute notice, after
    /// which the host reads the namespace again.
    fn announce_sizes(&self) {
        for subsystem in self.subsystems() {
            // Sizes compared with the controllers listed, under the subsystem's lock: one
            // that connects later reads the new size itself.
            let (resized, controllers): (Vec<u32>, Vec<_>) = {
                let state = subsystem.lock();
                (
                    state
                        .namespaces
                        .values()
                        .filter(|namespace| {
                            let blocks = namespace.bdev.info().block_count;
                            namespace.announced_blocks.swap(blocks, Ordering::AcqRel) != blocks
                        })
                        .map(|namespace| namespace.nsid)
                        .collect(),
                    state.controllers.values().cloned().collect(),
                )
            };
            for nsid in resized {
                tracing::info!(nqn = %subsystem.nqn, nsid, "namespace resized");
                for controller in &controllers {
                    controller.namespace_changed(nsid);
                }
            }
        }
    }

    fn lock_listeners(&self) -> MutexGuard<'_, BTreeMap<ListenAddress, Listener>> {
        self.listeners
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// How long an idle connection polls its socket before sleeping (`basalt target
    /// --poll-us`).
    pub(crate) fn poll(&self) -> std::time::Duration {
        self.reactors.poll()
    }

    /// The TCP transport's options, once created.
    pub fn transport(&self) -> Option<TransportOptions> {
        *self
            .transport
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Creates the TCP transport; an error if it exists or an option is invalid.
    pub fn create_transport(&self, options: TransportOptions) -> Result<(), String> {
        options.validate()?;
        let mut transport = self
            .transport
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if transport.is_some() {
            return Err("the TCP transport already exists".into());
        }
        let bytes = u64::from(options.num_shared_buffers) * u64::from(options.io_unit_size);
        // Made once: the transport is never deleted.
        let _ = self.budget.set(crate::budget::DataBudget::new(bytes));
        *transport = Some(options);
        Ok(())
    }

    /// How long a queue waits for the write data an R2T asked for before it closes its
    /// connection ([`TRANSFER_TIMEOUT`] unless set).
    pub fn transfer_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.transfer_timeout_ms.load(Ordering::Relaxed))
    }

    /// Sets [`NvmfTarget::transfer_timeout`] for connections made from now on (tests; a
    /// connection checks its transfers every half timeout, and at least every 1 ms).
    pub fn set_transfer_timeout(&self, timeout: std::time::Duration) {
        self.transfer_timeout_ms
            .store(timeout.as_millis() as u64, Ordering::Relaxed);
    }

    /// The data bytes all connections' commands under way may hold, once the transport
    /// exists.
    pub fn data_budget(&self) -> Option<Arc<crate::budget::DataBudget>> {
        self.budget.get().cloned()
    }

    /// The discovery subsystem.
    pub fn discovery(&self) -> &Arc<Subsystem> {
        &self.discovery
    }

    /// A subsystem by NQN, the discovery subsystem included.
    pub fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        if nqn == DISCOVERY_NQN {
            return Some(self.discovery.clone());
        }
        self.read_subsystems().get(nqn).cloned()
    }

    fn read_subsystems(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Arc<Subsystem>>> {
        self.subsystems
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write_subsystems(
        &self,
    ) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Arc<Subsystem>>> {
        self.subsystems
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The NVM subsystems in NQN order (not the discovery subsystem).
    pub fn subsystems(&self) -> Vec<Arc<Subsystem>> {
        self.read_subsystems().values().cloned().collect()
    }

    /// Adds a subsystem; an error if its NQN is taken.
    pub fn add_subsystem(&self, subsystem: Arc<Subsystem>) -> Result<(), String> {
        if subsystem.nqn == DISCOVERY_NQN {
            return Err(format!("{DISCOVERY_NQN} is the discovery subsystem's NQN"));
        }
        let mut subsystems = self.write_subsystems();
        if subsystems.contains_key(&subsystem.nqn) {
            return Err(format!("subsystem {} already exists", subsystem.nqn));
        }
        subsystems.insert(subsystem.nqn.clone(), subsystem);
        drop(subsystems);
        self.discovery_changed();
        Ok(())
    }

    /// Removes a subsystem: its controllers are torn down and its listeners released.
    /// Returns it, for the caller to release its bdevs.
    pub fn remove_subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        let subsystem = self.write_subsystems().remove(nqn)?;
        let (controllers, listeners) = {
            let mut state = subsystem.lock();
            let controllers: Vec<_> = std::mem::take(&mut state.controllers)
                .into_values()
                .collect();
            let listeners: Vec<_> = std::mem::take(&mut state.listeners).into_iter().collect();
            (controllers, listeners)
        };
        for controller in controllers {
            controller.close();
        }
        for address in listeners {
            self.release_listener(address);
        }
        self.discovery_changed();
        Some(subsystem)
    }

    /// Attaches a namespace and tells the subsystem's controllers.
    pub fn add_namespace(&self, subsystem: &Subsystem, namespace: Arc<Namespace>) {
        let nsid = namespace.nsid;
        let controllers: Vec<_> = {
            let mut state = subsystem.lock();
            state.namespaces.insert(nsid, namespace);
            state.controllers.values().cloned().collect()
        };
        for controller in controllers {
            controller.namespace_changed(nsid);
        }
    }

    /// Detaches a namespace and tells the subsystem's controllers.
    pub fn remove_namespace(&self, subsystem: &Subsystem, nsid: u32) -> Option<Arc<Namespace>> {
        let (namespace, controllers) = {
            let mut state = subsystem.lock();
            let namespace = state.namespaces.remove(&nsid)?;
            (
                namespace,
                state.controllers.values().cloned().collect::<Vec<_>>(),
            )
        };
        for controller in controllers {
            controller.namespace_changed(nsid);
        }
        Some(namespace)
    }

    /// Makes `subsystem` reachable at `address`, listening there if no subsystem does yet
    /// (port 0 picks a free port). Returns the address listened on.
    pub async fn add_listener(
        self: &Arc<Self>,
        subsystem: &Subsystem,
        address: ListenAddress,
    ) -> Result<ListenAddress, String> {
        if self.transport().is_none() {
            return Err("create the TCP transport first (nvmf_create_transport)".into());
        }
        if subsystem.lock().listeners.contains(&address) {
            return Err(format!(
                "subsystem {} already listens on {}",
                subsystem.nqn, address.address
            ));
        }
        let bound = if address.address.port() != 0 && self.lock_listeners().contains_key(&address) {
            address
        } else {
            let listener = TcpListener::bind(address.address)
                .await
                .map_err(|error| format!("cannot listen on {}: {error}", address.address))?;
            let local = listener
                .local_addr()
                .map_err(|error| format!("cannot listen on {}: {error}", address.address))?;
            let bound = ListenAddress { address: local };
            let mut listeners = self.lock_listeners();
            if !listeners.contains_key(&bound) {
                // Port ids start at 1 and, past 65535, wrap (0 is skipped).
                let port_id = self.next_port_id.fetch_add(1, Ordering::Relaxed).max(1);
                let target = self.clone();
                let task = tokio::spawn(async move { target.accept_loop(listener, bound).await });
                tracing::info!(address = %bound.address, "nvmf listening");
                listeners.insert(
                    bound,
                    Listener {
                        task,
                        port_id,
                        users: 0,
                    },
                );
            }
            bound
        };
        let mut listeners = self.lock_listeners();
        let Some(listener) = listeners.get_mut(&bound) else {
            return Err(format!("listener on {} went away", bound.address));
        };
        if !subsystem.lock().listeners.insert(bound) {
            return Err(format!(
                "subsystem {} already listens on {}",
                subsystem.nqn, bound.address
            ));
        }
        listener.users += 1;
        drop(listeners);
        self.discovery_changed();
        Ok(bound)
    }

    /// Stops `subsystem` listening at `address`; the socket closes when no subsystem
    /// listens there. Connections already made go on.
    pub fn remove_listener(
        &self,
        subsystem: &Subsystem,
        address: ListenAddress,
    ) -> Result<(), String> {
        if !subsystem.lock().listeners.remove(&address) {
            return Err(format!(
                "subsystem {} does not listen on {}",
                subsystem.nqn, address.address
            ));
        }
        self.release_listener(address);
        self.discovery_changed();
        Ok(())
    }

    fn release_listener(&self, address: ListenAddress) {
        let mut listeners = self.lock_listeners();
        if let Some(listener) = listeners.get_mut(&address) {
            listener.users = listener.users.saturating_sub(1);
            if listener.users == 0
                && let Some(listener) = listeners.remove(&address)
            {
                listener.task.abort();
                tracing::info!(address = %address.address, "nvmf stopped listening");
            }
        }
    }

    /// Every address listened on.
    pub fn listen_addresses(&self) -> Vec<ListenAddress> {
        self.lock_listeners().keys().copied().collect()
    }

    /// Stops every listener and tears down every controller (the target is stopping).
    pub fn shutdown(&self) {
        for (_, listener) in std::mem::take(&mut *self.lock_listeners()) {
            listener.task.abort();
        }
        for subsystem in self.subsystems().iter().chain([&self.discovery]) {
            for controller in subsystem.lock().controllers.values() {
                controller.close();
            }
        }
    }

    /// Notes a change hosts see in the discovery log (its generation counter).
    pub fn discovery_changed(&self) {
        self.generation.fetch_add(1, Ordering::Relaxed);
    }

    /// The discovery log for `host_nqn`: every listener of every subsystem the host may
    /// connect to, and the discovery subsystem on every listener.
    pub fn discovery_records(&self, host_nqn: &str) -> (u64, Vec<DiscoveryRecord>) {
        let generation = self.generation.load(Ordering::Relaxed);
        let port_ids: BTreeMap<ListenAddress, u16> = self
            .lock_listeners()
            .iter()
            .map(|(address, listener)| (*address, listener.port_id))
            .collect();
        let mut records = Vec::new();
        for (address, port_id) in &port_ids {
            records.push(DiscoveryRecord {
                address: *address,
                subsystem_nqn: DISCOVERY_NQN.to_string(),
                subsystem_type: SUBTYPE_CURRENT_DISCOVERY,
                port_id: *port_id,
            });
        }
        for subsystem in self.subsystems() {
            if !subsystem.allows_host(host_nqn) {
                continue;
            }
            let listeners: Vec<ListenAddress> =
                subsystem.lock().listeners.iter().copied().collect();
            for address in listeners {
                records.push(DiscoveryRecord {
                    address,
                    subsystem_nqn: subsystem.nqn.clone(),
                    subsystem_type: SUBTYPE_NVME,
                    port_id: port_ids.get(&address).copied().unwrap_or(0),
                });
            }
        }
        (generation, records)
    }

    async fn accept_loop(self: Arc<Self>, listener: TcpListener, via: ListenAddress) {
        let reactors = self.reactors.clone();
        basalt_io::reactor::serve_connections(reactors, listener, "nvmf", move |stream, _| {
            crate::connection::serve(self.clone(), stream, via)
        })
        .await;
    }

    /// Runs Connect: binds the connection to a new controller (admin queue) or to an
    /// existing one (I/O queue), or returns the response refusing it.
    pub fn connect(
        &self,
        command_id: u16,
        connect: &ConnectCommand,
        data: &ConnectData,
        via: ListenAddress,
        options: TransportOptions,
    ) -> Result<BoundQueue, Response> {
        let invalid = |offset: u16, in_data: bool| Response {
            command_id,
            status: Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
            dw0: connect_invalid_parameter_dw0(offset, in_data),
            ..Response::default()
        };
        if connect.record_format != 0 {
            return Err(Response {
                dw0: connect_invalid_parameter_dw0(CONNECT_RECFMT_OFFSET, false),
                ..Response::status(command_id, Status::FABRICS_INCOMPATIBLE_FORMAT.with_dnr())
            });
        }
        let subnqn_offset = CONNECT_DATA_SUBSYSTEM_NQN_OFFSET as u16;
        let Some(subsystem) = self.subsystem(&data.subsystem_nqn) else {
            tracing::info!(subnqn = %data.subsystem_nqn, hostnqn = %data.host_nqn, "connect to an unknown subsystem");
            return Err(invalid(subnqn_offset, true));
        };
        if !subsystem.is_discovery() && !subsystem.lock().listeners.contains(&via) {
            tracing::info!(subnqn = %data.subsystem_nqn, via = %via.address, "connect on an address the subsystem does not listen on");
            return Err(invalid(subnqn_offset, true));
        }
        let host_refused = || {
            tracing::info!(subnqn = %data.subsystem_nqn, hostnqn = %data.host_nqn, "host not allowed");
            Response {
                dw0: connect_invalid_parameter_dw0(CONNECT_DATA_HOST_NQN_OFFSET as u16, true),
                ..Response::status(command_id, Status::CONNECT_INVALID_HOST.with_dnr())
            }
        };
        if !subsystem.allows_host(&data.host_nqn) {
            return Err(host_refused());
        }
        let sq_entries = u32::from(connect.sq_size) + 1;
        let sq_flow_control_disabled =
            connect.attributes & crate::fabrics::CONNECT_ATTRIBUTE_DISABLE_SQ_FLOW_CONTROL != 0;
        if connect.queue_id == 0 {
            let depth_max = options.max_aq_depth.min(ADMIN_QUEUE_DEPTH_MAX);
            if connect.sq_size == 0 || sq_entries > u32::from(depth_max) {
                return Err(invalid(CONNECT_SQSIZE_OFFSET, false));
            }
            if data.controller_id != CONTROLLER_ID_DYNAMIC {
                return Err(invalid(CONNECT_DATA_CONTROLLER_ID_OFFSET as u16, true));
            }
            let mut state = subsystem.lock();
            // Again under the lock the controller goes in with: a host removed since the
            // check above (whose controllers were torn down then) gets none.
            if !state.allows_host(&data.host_nqn) {
                return Err(host_refused());
            }
            let Some(id) = Subsystem::allocate_controller_id(
                &mut state,
                subsystem.min_cntlid,
                subsystem.max_cntlid,
            ) else {
                return Err(Response::status(
                    command_id,
                    Status::FABRICS_CONTROLLER_BUSY,
                ));
            };
            let controller = Arc::new(Controller::new(
                id,
                subsystem.clone(),
                data.host_nqn.clone(),
                data.host_id,
                connect.keep_alive_timeout_ms,
                options,
            ));
            state.controllers.insert(id, controller.clone());
            drop(state);
            tracing::info!(subnqn = %subsystem.nqn, hostnqn = %data.host_nqn, controller = id, "controller created");
            self.counters.admin_qpairs.fetch_add(1, Ordering::Relaxed);
            self.counters
                .current_admin_qpairs
                .fetch_add(1, Ordering::Relaxed);
            return Ok(BoundQueue {
                controller,
                qid: 0,
                sq_size: sq_entries as u16,
                sq_flow_control_disabled,
            });
        }
        if subsystem.is_discovery() {
            return Err(invalid(CONNECT_DATA_SUBSYSTEM_NQN_OFFSET as u16, true));
        }
        if connect.sq_size == 0 || sq_entries > u32::from(options.max_queue_depth) {
            return Err(invalid(CONNECT_SQSIZE_OFFSET, false));
        }
        let controller = subsystem
            .lock()
            .controllers
            .get(&data.controller_id)
            .cloned();
        let Some(controller) = controller.filter(|c| c.host_nqn == data.host_nqn && !c.is_closed())
        else {
            return Err(invalid(CONNECT_DATA_CONTROLLER_ID_OFFSET as u16, true));
        };
        if let Err(status) = controller.add_io_queue(connect.queue_id) {
            let dw0 = if status == Status::CONNECT_INVALID_PARAMETERS {
                connect_invalid_parameter_dw0(42, false) // QID
            } else {
                0
            };
            return Err(Response {
                dw0,
                ..Response::status(command_id, status.with_dnr())
            });
        }
        self.counters.io_qpairs.fetch_add(1, Ordering::Relaxed);
        self.counters
            .current_io_qpairs
            .fetch_add(1, Ordering::Relaxed);
        Ok(BoundQueue {
            controller,
            qid: connect.queue_id,
            sq_size: sq_entries as u16,
            sq_flow_control_disabled,
        })
    }

    /// Undoes what Connect did when the queue's connection ends: an admin queue takes its
    /// controller down with it.
    pub fn disconnect(&self, queue: &BoundQueue) {
        let controller = &queue.controller;
        if queue.qid == 0 {
            controller.close();
            let mut state = controller.subsystem.lock();
            if state
                .controllers
                .get(&controller.id)
                .is_some_and(|c| Arc::ptr_eq(c, controller))
            {
                state.controllers.remove(&controller.id);
            }
            drop(state);
            tracing::info!(subnqn = %controller.subsystem.nqn, controller = controller.id, "controller removed");
            self.counters
                .current_admin_qpairs
                .fetch_sub(1, Ordering::Relaxed);
        } else {
            controller.remove_io_queue(queue.qid);
            self.counters
                .current_io_qpairs
                .fetch_sub(1, Ordering::Relaxed);
        }
    }
}
