//! The NBD server: exports of bdevs, the listener, and each connection from negotiation to
//! close (the transmission phase itself is in [`crate::transmission`]).

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use basalt_bdev::Bdev;
use basalt_io::Reactors;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::handshake::{self, Outcome};
use crate::protocol::*;
use crate::transmission;

/// How long a client may take to negotiate (qemu-nbd's default limit): a connection in
/// negotiation holds one of the server's connection slots.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the server allows its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once, negotiating or not; one more is closed at once.
    pub max_connections: usize,
    /// A connection whose client has read none of the replies waiting for it for this long
    /// is closed (its requests in flight are dropped). `None`: never.
    pub stall_timeout: Option<Duration>,
}

impl Limits {
    /// 1,024 connections; a client that reads no reply for 60 s is dropped.
    pub const DEFAULT: Self = Self {
        max_connections: 1024,
        stall_timeout: Some(Duration::from_secs(60)),
    };

    /// The stall timeout in whole seconds, 0 for none (as `nbd_server_start` takes it).
    pub fn stall_timeout_s(&self) -> u64 {
        self.stall_timeout.map_or(0, |timeout| timeout.as_secs())
    }
}

/// One exported bdev.
pub struct Export {
    /// Export name clients ask for.
    pub name: String,
    /// Name of the bdev behind it.
    pub bdev_name: String,
    /// The bdev.
    pub bdev: Arc<dyn Bdev>,
    /// Writes, trims and write zeroes are refused with EPERM.
    pub readonly: bool,
    description: Option<String>,
    closed: watch::Sender<bool>,
    connections: AtomicUsize,
}

impl Export {
    /// A receiver that turns true when the export is removed.
    pub(crate) fn closed(&self) -> watch::Receiver<bool> {
        self.closed.subscribe()
    }
}

impl Export {
    /// A new export of `bdev`.
    pub fn new(
        name: String,
        bdev_name: String,
        bdev: Arc<dyn Bdev>,
        readonly: bool,
        description: Option<String>,
    ) -> Self {
        let (closed, _) = watch::channel(false);
        Self {
            name,
            bdev_name,
            bdev,
            readonly,
            description,
            closed,
            connections: AtomicUsize::new(0),
        }
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.bdev.info().size_bytes()
    }

    /// Transmission flags sent to clients; `structured`: the client negotiated structured
    /// replies (whose reads are never fragmented: one data chunk each, so DF holds).
    pub fn transmission_flags(&self, structured: bool) -> u16 {
        let mut common =
            TRANSMISSION_HAS_FLAGS | TRANSMISSION_SEND_FLUSH | TRANSMISSION_CAN_MULTI_CONN;
        if structured {
            common |= TRANSMISSION_SEND_DF;
        }
        if self.readonly {
            common | TRANSMISSION_READ_ONLY
        } else {
            common | TRANSMISSION_SEND_FUA | TRANSMISSION_SEND_TRIM | TRANSMISSION_SEND_WRITE_ZEROES
        }
    }

    /// The description sent with NBD_INFO_DESCRIPTION.
    pub fn description(&self) -> String {
        self.description
            .clone()
            .unwrap_or_else(|| format!("basalt bdev {}", self.bdev_name))
    }

    /// The configured description, if any.
    pub fn configured_description(&self) -> Option<&str> {
        self.description.as_deref()
    }

    /// Connections in transmission now.
    pub fn connection_count(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// Ends every connection to this export (after their requests in flight complete).
    pub fn close(&self) {
        self.closed.send_replace(true);
    }
}

/// The exports of a server, by name.
#[derive(Default)]
pub struct Exports {
    map: RwLock<BTreeMap<String, Arc<Export>>>,
}

impl Exports {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Arc<Export>>> {
        self.map
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Arc<Export>>> {
        self.map
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The export a client names; the empty name (NBD's default export) is the only export
    /// when there is exactly one.
    pub fn find(&self, name: &str) -> Option<Arc<Export>> {
        let map = self.read();
        if name.is_empty() && map.len() == 1 {
            return map.values().next().cloned();
        }
        map.get(name).cloned()
    }

    /// Export names in order.
    pub fn names(&self) -> Vec<String> {
        self.read().keys().cloned().collect()
    }

    /// Every export.
    pub fn list(&self) -> Vec<Arc<Export>> {
        self.read().values().cloned().collect()
    }

    /// Adds an export; `false` if the name is taken.
    pub fn insert(&self, export: Arc<Export>) -> bool {
        let mut map = self.write();
        if map.contains_key(&export.name) {
            return false;
        }
        map.insert(export.name.clone(), export);
        true
    }

    /// Removes an export and closes its connections.
    pub fn remove(&self, name: &str) -> Option<Arc<Export>> {
        let export = self.write().remove(name)?;
        export.close();
        Some(export)
    }
}

struct Listening {
    address: SocketAddr,
    task: JoinHandle<()>,
}

/// The NBD server of a target.
pub struct NbdServer {
    exports: Exports,
    listening: Mutex<Option<Listening>>,
    reactors: Arc<Reactors>,
    limits: Mutex<Limits>,
    /// Connections open now (accepted by the listener, not yet closed).
    open: Arc<AtomicUsize>,
}

/// Counts a connection open until dropped.
struct OpenConnection(Arc<AtomicUsize>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl NbdServer {
    /// A server with no exports, not listening, whose connections run on `reactors`.
    pub fn new(reactors: Arc<Reactors>) -> Arc<Self> {
        Arc::new(Self {
            exports: Exports::default(),
            listening: Mutex::new(None),
            reactors,
            limits: Mutex::new(Limits::DEFAULT),
            open: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// What the server allows its clients (those of its last start).
    pub fn limits(&self) -> Limits {
        *self
            .limits
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The exports.
    pub fn exports(&self) -> &Exports {
        &self.exports
    }

    /// Where the server listens, if it does.
    pub fn address(&self) -> Option<SocketAddr> {
        self.lock_listening()
            .as_ref()
            .map(|listening| listening.address)
    }

    fn lock_listening(&self) -> std::sync::MutexGuard<'_, Option<Listening>> {
        self.listening
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts listening on `host:port` (port 0 picks a free port) with the default limits.
    pub async fn start(self: &Arc<Self>, host: &str, port: u16) -> io::Result<SocketAddr> {
        self.start_with(host, port, Limits::DEFAULT).await
    }

    /// Starts listening on `host:port` (port 0 picks a free port) with these limits.
    pub async fn start_with(
        self: &Arc<Self>,
        host: &str,
        port: u16,
        limits: Limits,
    ) -> io::Result<SocketAddr> {
        if let Some(address) = self.address() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("already listening on {address}"),
            ));
        }
        let listener = TcpListener::bind((host, port)).await?;
        let address = listener.local_addr()?;
        let server = self.clone();
        let task = tokio::spawn(async move { server.accept_loop(listener).await });
        let mut listening = self.lock_listening();
        if listening.is_some() {
            task.abort();
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "started concurrently",
            ));
        }
        *listening = Some(Listening { address, task });
        *self
            .limits
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = limits;
        tracing::info!(%address, "nbd server listening");
        Ok(address)
    }

    /// Stops accepting connections; connections already open go on. `false` if not listening.
    pub fn stop(&self) -> bool {
        match self.lock_listening().take() {
            Some(listening) => {
                listening.task.abort();
                true
            }
            None => false,
        }
    }

    async fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        let reactors = self.reactors.clone();
        basalt_io::reactor::serve_connections(reactors, listener, "nbd", move |stream, peer| {
            let server = self.clone();
            async move {
                let open = OpenConnection(server.open.clone());
                let max = server.limits().max_connections;
                if open.0.fetch_add(1, Ordering::Relaxed) >= max {
                    tracing::warn!(%peer, max, "nbd connection refused: the server's connection limit is reached");
                    return Ok(());
                }
                let (reader, writer) = stream.into_split();
                server.serve(reader, writer).await
            }
        })
        .await;
    }

    /// Serves one connection from negotiation to close.
    pub async fn serve<R, W>(self: Arc<Self>, mut reader: R, mut writer: W) -> io::Result<()>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let negotiation = handshake::negotiate(&mut reader, &mut writer, &self.exports);
        let outcome = tokio::time::timeout(HANDSHAKE_TIMEOUT, negotiation)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "handshake timed out"))??;
        let Outcome::Transmission { export, structured } = outcome else {
            return Ok(());
        };
        export.connections.fetch_add(1, Ordering::Relaxed);
        // Counted out however the connection ends (its task may be dropped or panic).
        let _counted = Counted(&export.connections);
        let stall_timeout = self.limits().stall_timeout;
        transmission::transmit(reader, writer, &export, structured, stall_timeout).await
    }
}

/// Takes one off a connection count when dropped.
struct Counted<'a>(&'a AtomicUsize);

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_name_is_the_only_export() {
        let exports = Exports::default();
        let bdev: Arc<dyn Bdev> = Arc::new(basalt_bdev::malloc::MallocBdev::new_named("m", 512, 8));
        assert!(exports.insert(Arc::new(Export::new(
            "a".into(),
            "m".into(),
            bdev.clone(),
            false,
            None
        ))));
        assert_eq!(
            exports.find("").map(|e| e.name.clone()),
            Some("a".to_string())
        );
        assert!(
            !exports.insert(Arc::new(Export::new(
                "a".into(),
                "m".into(),
                bdev.clone(),
                false,
                None
            ))),
            "name taken"
        );
        assert!(exports.insert(Arc::new(Export::new(
            "b".into(),
            "m".into(),
            bdev,
            true,
            None
        ))));
        assert!(exports.find("").is_none(), "ambiguous default");
        assert_eq!(
            exports
                .find("b")
                .map(|e| e.transmission_flags(false) & TRANSMISSION_READ_ONLY),
            Some(TRANSMISSION_READ_ONLY)
        );
    }
}
