//! vhost-user-blk controllers: each serves one bdev on a Unix socket named after it in
//! the target's socket directory, from its own thread, one frontend (QEMU) at a time; when
//! the frontend goes (guest reboot, QEMU restart), the controller listens again.

use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use basalt_io::Reactors;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};

use crate::backend::{BlkBackend, BlkOptions};
use crate::relay::{Session, relay};

/// Longest controller name (it names a socket file).
pub const NAME_SIZE_MAX: usize = 64;

/// One controller.
pub struct Controller {
    /// Its name (`ctrlr`).
    pub name: String,
    /// The bdev's name.
    pub bdev_name: String,
    /// Writes refused.
    pub readonly: bool,
    /// Request queues offered.
    pub queues: u16,
    /// The Unix socket.
    pub socket: PathBuf,
    /// The CPU mask its requests' reactors were chosen by, as given.
    pub cpumask: Option<String>,
    backend: Arc<BlkBackend>,
    stop: Arc<AtomicBool>,
    /// The listener its thread accepts on (another handle to it), to wake that thread.
    listener: UnixListener,
    thread: Option<JoinHandle<()>>,
    /// The private directory of the relay's socket to vhost-user-backend.
    relay_dir: PathBuf,
}

impl Controller {
    /// Whether a frontend is connected.
    pub fn attached(&self) -> bool {
        self.backend.attached.load(Ordering::Acquire)
    }
}

/// What `vhost_get_controllers` shows of a controller.
#[derive(Debug, Clone)]
pub struct ControllerInfo {
    /// Its name.
    pub name: String,
    /// The bdev's name.
    pub bdev_name: String,
    /// Writes refused.
    pub readonly: bool,
    /// Request queues offered.
    pub queues: u16,
    /// The Unix socket.
    pub socket: PathBuf,
    /// A frontend is connected.
    pub attached: bool,
    /// The CPU mask given at creation.
    pub cpumask: Option<String>,
    /// Reads and writes that went straight between guest memory and the bdev's file.
    pub in_place_requests: u64,
}

/// CPUs a list may name: 0 to 1023.
const CPUS_MAX: usize = 1024;

/// The CPUs of a mask in SPDK's forms: hexadecimal (`0x3`, `3`) or a list (`[0,2-3]`).
pub fn parse_cpumask(text: &str) -> Result<Vec<usize>, String> {
    let text = text.trim();
    if let Some(list) = text.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
        // Each CPU once, however often the list names it.
        let mut chosen = [false; CPUS_MAX];
        for part in list.split(',').map(str::trim) {
            let (first, last) = match part.split_once('-') {
                Some((a, b)) => (a.trim(), b.trim()),
                None => (part, part),
            };
            let (first, last): (usize, usize) = match (first.parse(), last.parse()) {
                (Ok(a), Ok(b)) if a <= b && b < CPUS_MAX => (a, b),
                _ => return Err(format!("{part:?} is not a CPU or a range of CPUs")),
            };
            chosen[first..=last].fill(true);
        }
        return Ok((0..CPUS_MAX).filter(|cpu| chosen[*cpu]).collect());
    }
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    let mask = u128::from_str_radix(digits, 16)
        .map_err(|_| "not a hexadecimal mask or a [list] of CPUs".to_string())?;
    if mask == 0 {
        return Err("empty mask".into());
    }
    Ok((0..128).filter(|cpu| mask & (1u128 << cpu) != 0).collect())
}

/// The vhost-user-blk controllers of a target.
pub struct VhostServer {
    reactors: Arc<Reactors>,
    socket_dir: PathBuf,
    controllers: Mutex<BTreeMap<String, Controller>>,
}

/// Why a controller could not be created or deleted.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// The name is taken.
    #[error("vhost controller {0} already exists")]
    Exists(String),
    /// No such controller.
    #[error("vhost controller {0} not found")]
    NotFound(String),
    /// A VM is attached.
    #[error("vhost controller {0} has a VM attached; stop or detach the VM first")]
    Busy(String),
    /// A bad parameter.
    #[error("{0}")]
    Invalid(String),
    /// The socket or thread could not be made.
    #[error("vhost controller {name}: {source}")]
    Io {
        /// The controller.
        name: String,
        /// The error.
        source: std::io::Error,
    },
}

impl VhostServer {
    /// A server whose sockets go in `socket_dir` and whose requests run on `reactors`.
    pub fn new(reactors: Arc<Reactors>, socket_dir: PathBuf) -> Self {
        Self {
            reactors,
            socket_dir,
            controllers: Mutex::new(BTreeMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Controller>> {
        self.controllers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Where the sockets go.
    pub fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }

    /// The reactors (indices) pinned to a CPU of `cpumask`: SPDK's forms, a hexadecimal
    /// mask (`0x3`) or a list of CPUs and ranges (`[0,2-3]`).
    pub fn reactors_for_cpumask(&self, cpumask: &str) -> Result<Vec<usize>, ControllerError> {
        let invalid = |why: &str| ControllerError::Invalid(format!("cpumask {cpumask:?}: {why}"));
        let cpus = parse_cpumask(cpumask).map_err(|why| invalid(&why))?;
        let chosen: Vec<usize> = self
            .reactors
            .cpus()
            .iter()
            .enumerate()
            .filter(|(_, cpu)| cpu.is_some_and(|cpu| cpus.contains(&cpu)))
            .map(|(index, _)| index)
            .collect();
        if chosen.is_empty() {
            let on: Vec<String> = self
                .reactors
                .cpus()
                .iter()
                .map(|cpu| cpu.map_or("unpinned".to_string(), |c| c.to_string()))
                .collect();
            return Err(invalid(&format!(
                "selects no reactor (the reactors run on CPUs {})",
                on.join(", ")
            )));
        }
        Ok(chosen)
    }

    /// Creates a controller named `name` serving `options.bdev`; `cpumask` is kept to be
    /// listed (the reactors it chose are in `options`).
    pub fn create(
        &self,
        name: &str,
        bdev_name: &str,
        cpumask: Option<String>,
        options: BlkOptions,
    ) -> Result<PathBuf, ControllerError> {
        let valid = !name.is_empty()
            && name.len() <= NAME_SIZE_MAX
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
            && !name.starts_with('.');
        if !valid {
            return Err(ControllerError::Invalid(format!(
                "ctrlr {name:?} must be 1 to {NAME_SIZE_MAX} letters, digits, '.', '_' or '-' (it names a socket)"
            )));
        }
        let mut controllers = self.lock();
        if controllers.contains_key(name) {
            return Err(ControllerError::Exists(name.to_string()));
        }
        let socket = self.socket_dir.join(name);
        let io_error = |source| ControllerError::Io {
            name: name.to_string(),
            source,
        };
        let (readonly, queues) = (options.readonly, options.queues);
        let backend = Arc::new(BlkBackend::new(options, self.reactors.clone()).map_err(io_error)?);
        // The socket exists when this returns, and a path that cannot be one is an error
        // for the caller.
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).map_err(|error| {
            io_error(std::io::Error::other(format!(
                "{}: {error}",
                socket.display()
            )))
        })?;
        // A second handle, kept to wake the controller's thread when it is stopped.
        let waker = listener.try_clone().map_err(|error| {
            let _ = std::fs::remove_file(&socket);
            io_error(error)
        })?;
        // vhost-user-backend's end of the relay: it connects to a socket in a directory
        // only this user may enter, so that no other process can pose as it.
        static RELAY_DIRS: AtomicU64 = AtomicU64::new(0);
        let number = RELAY_DIRS.fetch_add(1, Ordering::Relaxed);
        if number == 0 {
            remove_dead_relay_dirs(&std::env::temp_dir());
        }
        let relay_dir =
            std::env::temp_dir().join(format!("{RELAY_DIR_PREFIX}{}-{number}", std::process::id()));
        let _ = std::fs::remove_dir_all(&relay_dir);
        if let Err(error) = std::fs::DirBuilder::new().mode(0o700).create(&relay_dir) {
            let _ = std::fs::remove_file(&socket);
            return Err(io_error(error));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (name, backend, stop) = (name.to_string(), backend.clone(), stop.clone());
            let relay_socket = relay_dir.join("relay.sock");
            let spawned = std::thread::Builder::new()
                .name(format!("vhost-{name}"))
                .spawn(move || serve(&name, &listener, &relay_socket, backend, &stop));
            match spawned {
                Ok(thread) => thread,
                Err(error) => {
                    let _ = std::fs::remove_file(&socket);
                    let _ = std::fs::remove_dir_all(&relay_dir);
                    return Err(io_error(error));
                }
            }
        };
        controllers.insert(
            name.to_string(),
            Controller {
                name: name.to_string(),
                bdev_name: bdev_name.to_string(),
                readonly,
                queues,
                socket: socket.clone(),
                relay_dir,
                cpumask,
                backend,
                stop,
                listener: waker,
                thread: Some(thread),
            },
        );
        tracing::info!(ctrlr = name, socket = %socket.display(), "vhost-user-blk controller listening");
        Ok(socket)
    }

    /// Deletes a controller; refused while a VM is attached. Returns its bdev's name.
    pub fn delete(&self, name: &str) -> Result<String, ControllerError> {
        let mut controller = {
            let mut controllers = self.lock();
            let controller = controllers
                .get(name)
                .ok_or_else(|| ControllerError::NotFound(name.to_string()))?;
            if controller.attached() {
                return Err(ControllerError::Busy(name.to_string()));
            }
            controllers.remove(name).expect("present")
        };
        stop(&mut controller);
        Ok(controller.bdev_name)
    }

    /// Every controller, by name.
    pub fn list(&self) -> Vec<ControllerInfo> {
        self.lock()
            .values()
            .map(|c| ControllerInfo {
                name: c.name.clone(),
                bdev_name: c.bdev_name.clone(),
                readonly: c.readonly,
                queues: c.queues,
                socket: c.socket.clone(),
                attached: c.attached(),
                cpumask: c.cpumask.clone(),
                in_place_requests: c.backend.in_place_requests.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// Stops every controller (the target is stopping), attached or not.
    pub fn shutdown(&self) {
        let controllers = std::mem::take(&mut *self.lock());
        for (_, mut controller) in controllers {
            stop(&mut controller);
        }
    }
}

/// How relay directories are named: this prefix, the target's process id, a number.
const RELAY_DIR_PREFIX: &str = "basalt-vhost-";

/// Removes the relay directories in `dir` left by targets no longer running (killed
/// before they could remove their own).
fn remove_dead_relay_dirs(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix(RELAY_DIR_PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new("/proc").join(pid.to_string()).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Stops a controller's thread: shuts its listener down, which wakes the `accept` it waits
/// in (whether or not the socket file is still there to connect to).
fn stop(controller: &mut Controller) {
    controller.stop.store(true, Ordering::Release);
    if let Err(error) = basalt_io::unix_fds::shut_down_listener(&controller.listener) {
        tracing::warn!(ctrlr = controller.name, %error, "could not wake the controller's listener");
    }
    if let Some(thread) = controller.thread.take()
        && !controller.attached()
    {
        let _ = thread.join();
    }
    let _ = std::fs::remove_file(&controller.socket);
    let _ = std::fs::remove_dir_all(&controller.relay_dir);
}

/// A controller's thread: accept one frontend, relay it to a new vhost-user-backend
/// daemon until either goes, then accept the next, until stopped.
fn serve(
    name: &str,
    listener: &UnixListener,
    relay_socket: &Path,
    backend: Arc<BlkBackend>,
    stop: &AtomicBool,
) {
    while !stop.load(Ordering::Acquire) {
        let frontend = match listener.accept() {
            Ok((frontend, _)) => frontend,
            // Woken to stop (see `stop`).
            Err(_) if stop.load(Ordering::Acquire) => break,
            Err(error) => {
                tracing::warn!(ctrlr = name, %error, "vhost accept failed");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if stop.load(Ordering::Acquire) {
            break;
        }
        // Attached from the connection on, not from the memory table only: QEMU connects
        // and negotiates long before its guest's driver starts the device, and a delete
        // in between would wait in `stop` for as long as the VM runs.
        backend.attached.store(true, Ordering::Release);
        let memory = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let mut daemon = match VhostUserDaemon::new(name.to_string(), backend.clone(), memory) {
            Ok(daemon) => daemon,
            Err(error) => {
                tracing::error!(ctrlr = name, ?error, "vhost daemon could not start");
                backend.attached.store(false, Ordering::Release);
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        // A listener for this session only: the daemon connects to it and its one
        // connection is accepted; a connection left over from a failed session dies with
        // the previous listener instead of pairing with this frontend.
        let _ = std::fs::remove_file(relay_socket);
        let to_daemon = UnixListener::bind(relay_socket).and_then(|inner| {
            let path = relay_socket.to_str().ok_or_else(|| {
                std::io::Error::other(format!("{}: not UTF-8", relay_socket.display()))
            })?;
            daemon
                .start_client(path)
                .map_err(|error| std::io::Error::other(format!("{error:?}")))?;
            Ok(inner.accept()?.0)
        });
        let _ = std::fs::remove_file(relay_socket);
        let session = Arc::new(Session::default());
        backend.set_session(Some(session.clone()));
        let pumps = match to_daemon.and_then(|to_daemon| relay(frontend, to_daemon, &session)) {
            Ok(pumps) => pumps,
            Err(error) => {
                // The frontend and the daemon's connection are closed: both see the end.
                tracing::error!(ctrlr = name, %error, "vhost relay could not start");
                let _ = daemon.wait();
                backend.attached.store(false, Ordering::Release);
                continue;
            }
        };
        backend.open_rings(&daemon.get_epoll_handlers());
        let watcher = watch_size(name, &backend, &session);
        let result = daemon.wait();
        // The session's worker threads end with it: dropping the daemon (its handler, whose
        // drop joins them) waits until they have, so that none takes a request of this
        // session after `end_session` saw none in flight (a kick from a completion that
        // gave copy budget back could start one).
        for handler in daemon.get_epoll_handlers() {
            handler.send_exit_event();
        }
        drop(daemon);
        backend.close_rings();
        backend.end_session();
        backend.attached.store(false, Ordering::Release);
        for pump in pumps {
            let _ = pump.join();
        }
        if let Ok(watcher) = watcher {
            let _ = watcher.join();
        }
        match result {
            Ok(())
            | Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
            )) => tracing::info!(ctrlr = name, "vhost frontend disconnected"),
            Err(error) => {
                tracing::warn!(
                    ctrlr = name,
                    ?error,
                    "vhost frontend session ended with an error"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// How often a session looks at its bdev's size.
const SIZE_WATCH_INTERVAL: Duration = Duration::from_millis(500);

/// Watches the bdev's size for the session and sends the frontend a configuration change
/// notice when it grows (a rescan), until the session ends.
fn watch_size(
    name: &str,
    backend: &Arc<BlkBackend>,
    session: &Arc<Session>,
) -> std::io::Result<JoinHandle<()>> {
    let (name, backend, session) = (name.to_string(), backend.clone(), session.clone());
    std::thread::Builder::new()
        .name(format!("vhost-size-{name}"))
        .spawn(move || {
            // What the frontend was last told is the controller's, not the session's: a
            // size that grew while QEMU was away is announced when it comes back.
            while !session.ended() {
                std::thread::sleep(SIZE_WATCH_INTERVAL);
                let now = backend.block_count();
                if now == backend.announced_blocks.load(Ordering::Acquire) {
                    continue;
                }
                match session.notify_config_change() {
                    Ok(true) => {
                        tracing::info!(
                            ctrlr = name,
                            blocks = now,
                            "told the frontend of a new size"
                        );
                        backend.announced_blocks.store(now, Ordering::Release);
                    }
                    // No backend channel (not negotiated yet, or never): nobody to tell.
                    Ok(false) => {}
                    Err(error) => {
                        tracing::warn!(ctrlr = name, %error, "size change notice failed");
                        backend.announced_blocks.store(now, Ordering::Release);
                    }
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpumasks_in_spdk_forms() {
        assert_eq!(parse_cpumask("0x5"), Ok(vec![0, 2]));
        assert_eq!(parse_cpumask("3"), Ok(vec![0, 1]));
        assert_eq!(parse_cpumask("[0,2-4]"), Ok(vec![0, 2, 3, 4]));
        assert_eq!(parse_cpumask("[3,0-1,1]"), Ok(vec![0, 1, 3]));
        // A list that names every CPU again and again holds each once.
        let repeated = format!("[{}]", vec!["0-1023"; 4096].join(","));
        assert_eq!(parse_cpumask(&repeated).map(|cpus| cpus.len()), Ok(1024));
        for bad in ["0x0", "zz", "[1-]", "[3-1]", ""] {
            assert!(parse_cpumask(bad).is_err(), "{bad}");
        }
    }

    /// The relay directories of targets killed before they removed their own go; those of
    /// running ones, and anything else, stay.
    #[test]
    fn relay_directories_of_dead_targets_are_removed() {
        let dir = std::env::temp_dir().join(format!("relay-dirs-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let dead = child.id();
        child.wait().expect("wait");
        let alive = std::process::id();
        let names = [
            format!("{RELAY_DIR_PREFIX}{dead}-3"),
            format!("{RELAY_DIR_PREFIX}{alive}-0"),
            format!("{RELAY_DIR_PREFIX}inflight"),
            "other-123-4".to_string(),
        ];
        for name in &names {
            std::fs::create_dir_all(dir.join(name)).expect("mkdir");
        }
        remove_dead_relay_dirs(&dir);
        let left: Vec<bool> = names.iter().map(|name| dir.join(name).exists()).collect();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(left, [false, true, true, true]);
    }
}
