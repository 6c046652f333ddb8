//! The NBD server: exports of bdevs, the listener, and the transmission phase.
//!
//! Each connection has a reader (this task) that decodes requests and spawns one task per
//! request, and a writer task that sends replies as requests complete, in completion order,
//! batching whatever is ready into one socket write. Requests in flight are bounded by a
//! byte budget, so a client cannot make the server buffer without limit.

use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use basalt_bdev::{Bdev, BdevError};
use basalt_io::DmaBuf;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::JoinHandle;

use crate::handshake::{self, Outcome};
use crate::protocol::*;

/// Bytes of payload in flight per connection at most (in units of [`BUDGET_UNIT`]).
pub const IN_FLIGHT_BYTES_MAX: u32 = 64 << 20;
const BUDGET_UNIT: u32 = 4096;
/// How long a client may take to negotiate.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

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

    /// Transmission flags sent to clients.
    pub fn transmission_flags(&self) -> u16 {
        let common = TRANSMISSION_HAS_FLAGS | TRANSMISSION_SEND_FLUSH | TRANSMISSION_CAN_MULTI_CONN;
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
#[derive(Default)]
pub struct NbdServer {
    exports: Exports,
    listening: Mutex<Option<Listening>>,
}

impl NbdServer {
    /// A server with no exports, not listening.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
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

    /// Starts listening on `host:port` (port 0 picks a free port).
    pub async fn start(self: &Arc<Self>, host: &str, port: u16) -> io::Result<SocketAddr> {
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
        loop {
            match listener.accept().await {
                Ok((stream, peer)) => {
                    // Latency matters more than packet count for block I/O.
                    let _ = stream.set_nodelay(true);
                    let server = self.clone();
                    tokio::spawn(async move {
                        let (reader, writer) = stream.into_split();
                        if let Err(error) = server.serve(reader, writer).await {
                            tracing::debug!(%peer, %error, "nbd connection ended with an error");
                        }
                    });
                }
                Err(error) => {
                    // Out of descriptors or similar: back off rather than spin.
                    tracing::warn!(%error, "nbd accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
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
        let result = transmit(reader, writer, &export, structured).await;
        export.connections.fetch_sub(1, Ordering::Relaxed);
        result
    }
}

/// A completed request, waiting for the writer. It holds its share of the connection's
/// byte budget until it has been written, so unread replies cannot pile up without bound.
struct Reply {
    handle: u64,
    offset_bytes: u64,
    result: Result<Option<DmaBuf>, Failure>,
    _budget: OwnedSemaphorePermit,
}

/// An NBD error for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Failure {
    errno: u32,
    message: String,
}

impl Failure {
    fn new(errno: u32, message: impl Into<String>) -> Self {
        Self {
            errno,
            message: message.into(),
        }
    }
}

async fn transmit<R, W>(
    mut reader: R,
    writer: W,
    export: &Arc<Export>,
    structured: bool,
) -> io::Result<()>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (replies, pending) = mpsc::unbounded_channel::<Reply>();
    let writer_task = tokio::spawn(write_replies(writer, pending, structured));
    let budget = Arc::new(Semaphore::new((IN_FLIGHT_BYTES_MAX / BUDGET_UNIT) as usize));
    let mut closed = export.closed.subscribe();
    let read_result: io::Result<()> = async {
        loop {
            let mut header = [0u8; REQUEST_SIZE];
            tokio::select! {
                read = reader.read_exact(&mut header) => match read {
                    Ok(_) => {}
                    Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                    Err(error) => return Err(error),
                },
                _ = closed.wait_for(|closed| *closed) => return Ok(()),
            }
            let request = Request::decode(&header)
                .map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error))?;
            if request.command == CMD_DISC {
                return Ok(());
            }
            // Only reads and writes hold data; a large trim or zeroing costs one unit.
            let units = if matches!(request.command, CMD_READ | CMD_WRITE) {
                request
                    .len_bytes
                    .div_ceil(BUDGET_UNIT)
                    .clamp(1, IN_FLIGHT_BYTES_MAX / BUDGET_UNIT)
            } else {
                1
            };
            let permit = budget
                .clone()
                .acquire_many_owned(units)
                .await
                .expect("budget never closes");
            let payload = if request.has_payload() {
                if request.len_bytes > PAYLOAD_SIZE_MAX {
                    handshake::discard(&mut reader, u64::from(request.len_bytes)).await?;
                    let message = format!(
                        "payload of {} bytes exceeds the {PAYLOAD_SIZE_MAX}-byte maximum",
                        request.len_bytes
                    );
                    let _ = replies.send(Reply {
                        handle: request.handle,
                        offset_bytes: request.offset_bytes,
                        result: Err(Failure::new(EINVAL, message)),
                        _budget: permit,
                    });
                    continue;
                }
                let mut data = DmaBuf::zeroed(request.len_bytes as usize);
                reader.read_exact(&mut data).await?;
                Some(data)
            } else {
                None
            };
            let export = export.clone();
            let replies = replies.clone();
            tokio::spawn(async move {
                let result = execute(&export, &request, payload).await;
                // The writer is gone only when the connection is; the reply has no reader.
                let _ = replies.send(Reply {
                    handle: request.handle,
                    offset_bytes: request.offset_bytes,
                    result,
                    _budget: permit,
                });
            });
        }
    }
    .await;
    drop(replies);
    let write_result = writer_task
        .await
        .unwrap_or_else(|error| Err(io::Error::other(format!("nbd writer task failed: {error}"))));
    read_result.and(write_result)
}

const KNOWN_FLAGS: u16 = CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | (1 << 2); // NBD_CMD_FLAG_DF

async fn execute(
    export: &Export,
    request: &Request,
    payload: Option<DmaBuf>,
) -> Result<Option<DmaBuf>, Failure> {
    if request.flags & !KNOWN_FLAGS != 0 {
        return Err(Failure::new(
            EINVAL,
            format!("unsupported command flags {:#x}", request.flags),
        ));
    }
    let bdev = &export.bdev;
    let info = bdev.info();
    let offset = request.offset_bytes;
    let len = u64::from(request.len_bytes);
    let fua = request.flags & CMD_FLAG_FUA != 0;
    let fail =
        |error: BdevError| Failure::new(errno_for(request.command, &error), error.to_string());
    let is_write = matches!(request.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if is_write && export.readonly {
        return Err(Failure::new(
            EPERM,
            format!("export {} is read-only", export.name),
        ));
    }
    match request.command {
        CMD_READ => {
            if request.len_bytes > PAYLOAD_SIZE_MAX {
                let message =
                    format!("read of {len} bytes exceeds the {PAYLOAD_SIZE_MAX}-byte maximum");
                return Err(Failure::new(EINVAL, message));
            }
            let extent = info.data_extent(offset, len).map_err(fail)?;
            bdev.read(extent).await.map(Some).map_err(fail)
        }
        CMD_WRITE => {
            let data = payload.expect("writes carry a payload");
            let extent = info.data_extent(offset, len).map_err(fail)?;
            bdev.write(extent, data, fua)
                .await
                .map(|()| None)
                .map_err(fail)
        }
        CMD_FLUSH => bdev.flush().await.map(|()| None).map_err(fail),
        CMD_TRIM | CMD_WRITE_ZEROES => {
            let extent = info.extent(offset, len).map_err(fail)?;
            if request.command == CMD_TRIM {
                bdev.discard(extent).await.map_err(fail)?;
            } else {
                let deallocate = request.flags & CMD_FLAG_NO_HOLE == 0;
                bdev.write_zeroes(extent, deallocate).await.map_err(fail)?;
            }
            if fua {
                bdev.flush().await.map_err(fail)?;
            }
            Ok(None)
        }
        command => Err(Failure::new(EINVAL, format!("unknown command {command}"))),
    }
}

/// The NBD error for a bdev error: a range past the end is ENOSPC for writes (as qemu-nbd
/// answers) and EINVAL otherwise.
fn errno_for(command: u16, error: &BdevError) -> u32 {
    match error {
        BdevError::OutOfRange { .. } if matches!(command, CMD_WRITE | CMD_WRITE_ZEROES) => ENOSPC,
        // NBD reserves ENOTSUP for fast zeroing, which we do not offer; a device that cannot
        // do something is an I/O error to the client.
        _ => match error.errno() {
            22 => EINVAL,
            28 => ENOSPC,
            _ => EIO,
        },
    }
}

async fn write_replies<W: AsyncWrite + Unpin>(
    writer: W,
    mut pending: mpsc::UnboundedReceiver<Reply>,
    structured: bool,
) -> io::Result<()> {
    let mut writer = BufWriter::with_capacity(256 << 10, writer);
    while let Some(reply) = pending.recv().await {
        encode_reply(&mut writer, reply, structured).await?;
        while let Ok(reply) = pending.try_recv() {
            encode_reply(&mut writer, reply, structured).await?;
        }
        writer.flush().await?;
    }
    writer.shutdown().await
}

/// Error messages in structured replies are cut to this length.
const MESSAGE_SIZE_MAX: usize = 1024;

async fn encode_reply<W: AsyncWrite + Unpin>(
    writer: &mut BufWriter<W>,
    reply: Reply,
    structured: bool,
) -> io::Result<()> {
    match (reply.result, structured) {
        (Ok(data), false) => {
            writer
                .write_all(&encode_simple_reply(0, reply.handle))
                .await?;
            if let Some(data) = data {
                writer.write_all(&data).await?;
            }
        }
        (Err(failure), false) => {
            writer
                .write_all(&encode_simple_reply(failure.errno, reply.handle))
                .await?;
        }
        (Ok(Some(data)), true) => {
            let len = u32::try_from(data.len() + 8).expect("reads are at most 32 MiB");
            let header =
                encode_structured_reply(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, reply.handle, len);
            writer.write_all(&header).await?;
            writer.write_all(&reply.offset_bytes.to_be_bytes()).await?;
            writer.write_all(&data).await?;
        }
        (Ok(None), true) => {
            writer
                .write_all(&encode_structured_reply(
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_NONE,
                    reply.handle,
                    0,
                ))
                .await?;
        }
        (Err(failure), true) => {
            let message = truncate_utf8(&failure.message, MESSAGE_SIZE_MAX);
            let len = u32::try_from(6 + message.len()).expect("message is short");
            writer
                .write_all(&encode_structured_reply(
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_ERROR,
                    reply.handle,
                    len,
                ))
                .await?;
            writer.write_all(&failure.errno.to_be_bytes()).await?;
            writer
                .write_all(&(message.len() as u16).to_be_bytes())
                .await?;
            writer.write_all(message.as_bytes()).await?;
        }
    }
    Ok(())
}

fn truncate_utf8(text: &str, len_max: usize) -> &str {
    let mut end = text.len().min(len_max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use basalt_bdev::BdevInfo;

    fn bdev_error(kind: u8) -> BdevError {
        match kind {
            0 => BdevError::OutOfRange {
                bdev: "b".into(),
                offset_bytes: 0,
                len_bytes: 1,
                size_bytes: 0,
            },
            1 => BdevError::Misaligned {
                bdev: "b".into(),
                offset_bytes: 1,
                len_bytes: 1,
                block_size: 512,
            },
            2 => BdevError::Io {
                bdev: "b".into(),
                source: io::Error::from_raw_os_error(28),
            },
            4 => BdevError::Io {
                bdev: "b".into(),
                source: io::Error::from_raw_os_error(95),
            },
            5 => BdevError::Io {
                bdev: "b".into(),
                source: io::Error::from_raw_os_error(122),
            },
            _ => BdevError::Io {
                bdev: "b".into(),
                source: io::Error::from_raw_os_error(5),
            },
        }
    }

    #[test]
    fn bdev_errors_map_to_nbd_errors() {
        assert_eq!(errno_for(CMD_WRITE, &bdev_error(0)), ENOSPC);
        assert_eq!(errno_for(CMD_WRITE_ZEROES, &bdev_error(0)), ENOSPC);
        assert_eq!(errno_for(CMD_READ, &bdev_error(0)), EINVAL);
        assert_eq!(errno_for(CMD_TRIM, &bdev_error(0)), EINVAL);
        assert_eq!(errno_for(CMD_READ, &bdev_error(1)), EINVAL);
        assert_eq!(errno_for(CMD_WRITE, &bdev_error(2)), ENOSPC);
        assert_eq!(errno_for(CMD_READ, &bdev_error(3)), EIO);
        assert_eq!(
            errno_for(CMD_WRITE_ZEROES, &bdev_error(4)),
            EIO,
            "EOPNOTSUPP"
        );
        assert_eq!(errno_for(CMD_WRITE, &bdev_error(5)), ENOSPC, "EDQUOT");
    }

    #[test]
    fn empty_name_is_the_only_export() {
        let exports = Exports::default();
        let info = BdevInfo {
            name: "m".into(),
            uuid: String::new(),
            product_name: "Malloc disk",
            block_size: 512,
            block_count: 8,
            optimal_io_boundary_blocks: 0,
        };
        let bdev: Arc<dyn Bdev> = Arc::new(basalt_bdev::malloc::MallocBdev::new(info));
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
                .map(|e| e.transmission_flags() & TRANSMISSION_READ_ONLY),
            Some(TRANSMISSION_READ_ONLY)
        );
    }

    #[test]
    fn truncation_keeps_utf8_whole() {
        assert_eq!(truncate_utf8("héllo", 2), "h");
        assert_eq!(truncate_utf8("abc", 10), "abc");
    }
}
