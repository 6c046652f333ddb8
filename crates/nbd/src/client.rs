//! An NBD client with many requests in flight, for `basalt bench --nbd` and tests.
//!
//! Fixed newstyle, NBD_OPT_GO, simple replies. Requests are written under a lock, each as
//! one socket write; a reader task matches replies to requests by handle, in any order.

use std::collections::HashMap;
use std::io;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::protocol::*;

/// The NBD port by IANA assignment.
pub const DEFAULT_PORT: u16 = 10809;

/// `nbd://HOST[:PORT][/EXPORT]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    /// Host name or address.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// Export name ("" is the server's default export).
    pub export: String,
}

impl FromStr for NbdUri {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let rest = text.strip_prefix("nbd://").ok_or_else(|| {
            format!("{text:?} is not an nbd:// URI (expected nbd://HOST[:PORT]/EXPORT)")
        })?;
        let (authority, export) = rest.split_once('/').unwrap_or((rest, ""));
        // An IPv6 host is bracketed, `[::1]`, so that its colons are not taken for a port.
        let (host, port) = match authority.strip_prefix('[') {
            Some(bracketed) => {
                let (host, after) = bracketed
                    .split_once(']')
                    .ok_or_else(|| format!("{text:?}: '[' without ']'"))?;
                (host, after.strip_prefix(':'))
            }
            None => match authority.split_once(':') {
                Some((host, port)) if !port.contains(':') => (host, Some(port)),
                Some(_) => {
                    return Err(format!("{text:?}: an IPv6 host goes in brackets, [::1]"));
                }
                None => (authority, None),
            },
        };
        let port = match port {
            Some(port) => port
                .parse()
                .map_err(|_| format!("{text:?}: port {port:?} is not a number"))?,
            None => DEFAULT_PORT,
        };
        if host.is_empty() {
            return Err(format!("{text:?} has no host"));
        }
        Ok(Self {
            host: host.to_string(),
            port,
            export: export.to_string(),
        })
    }
}

struct Pending {
    read_len: u32,
    reply: oneshot::Sender<io::Result<Vec<u8>>>,
}

/// Requests awaiting replies, and why the connection closed once it has.
#[derive(Default)]
struct PendingState {
    requests: HashMap<u64, Pending>,
    closed: Option<String>,
}

type PendingMap = Arc<Mutex<PendingState>>;

/// A connected client, in transmission.
pub struct NbdClient {
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: PendingMap,
    next_handle: AtomicU64,
    size_bytes: u64,
    transmission_flags: u16,
    block_size_min: u32,
    reader_task: JoinHandle<()>,
}

impl NbdClient {
    /// Connects and negotiates the export of `uri`.
    pub async fn connect(uri: &NbdUri) -> io::Result<Self> {
        let stream = TcpStream::connect((uri.host.as_str(), uri.port)).await?;
        stream.set_nodelay(true)?;
        let (mut reader, mut writer) = stream.into_split();
        let (size_bytes, transmission_flags, block_size_min) =
            negotiate(&mut reader, &mut writer, &uri.export).await?;
        let pending: PendingMap = Arc::default();
        let reader_task = tokio::spawn(read_replies(reader, pending.clone()));
        Ok(Self {
            writer: tokio::sync::Mutex::new(writer),
            pending,
            next_handle: AtomicU64::new(1),
            size_bytes,
            transmission_flags,
            block_size_min,
            reader_task,
        })
    }

    /// Export size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Transmission flags the server sent.
    pub fn transmission_flags(&self) -> u16 {
        self.transmission_flags
    }

    /// The server's minimum block size (1 if it sent none).
    pub fn block_size_min(&self) -> u32 {
        self.block_size_min
    }

    /// Reads `len_bytes` at `offset_bytes`.
    pub async fn read(&self, offset_bytes: u64, len_bytes: u32) -> io::Result<Vec<u8>> {
        self.request(CMD_READ, 0, offset_bytes, len_bytes, &[])
            .await
    }

    /// Writes `data` at `offset_bytes`.
    pub async fn write(&self, offset_bytes: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let len =
            u32::try_from(data.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        self.request(CMD_WRITE, flags, offset_bytes, len, data)
            .await
            .map(drop)
    }

    /// Flushes.
    pub async fn flush(&self) -> io::Result<()> {
        self.request(CMD_FLUSH, 0, 0, 0, &[]).await.map(drop)
    }

    /// Discards a range.
    pub async fn trim(&self, offset_bytes: u64, len_bytes: u32) -> io::Result<()> {
        self.request(CMD_TRIM, 0, offset_bytes, len_bytes, &[])
            .await
            .map(drop)
    }

    /// Zeroes a range (`no_hole`: keep it allocated).
    pub async fn write_zeroes(
        &self,
        offset_bytes: u64,
        len_bytes: u32,
        no_hole: bool,
    ) -> io::Result<()> {
        let flags = if no_hole { CMD_FLAG_NO_HOLE } else { 0 };
        self.request(CMD_WRITE_ZEROES, flags, offset_bytes, len_bytes, &[])
            .await
            .map(drop)
    }

    /// Sends any command, raw (tests of bad requests use this).
    pub async fn request(
        &self,
        command: u16,
        flags: u16,
        offset_bytes: u64,
        len_bytes: u32,
        payload: &[u8],
    ) -> io::Result<Vec<u8>> {
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        let read_len = if command == CMD_READ { len_bytes } else { 0 };
        {
            let mut pending = lock(&self.pending);
            if let Some(reason) = &pending.closed {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    reason.clone(),
                ));
            }
            pending.requests.insert(handle, Pending { read_len, reply });
        }
        let header = Request {
            flags,
            command,
            handle,
            offset_bytes,
            len_bytes,
        }
        .encode();
        let sent = {
            let mut writer = self.writer.lock().await;
            if payload.is_empty() {
                writer.write_all(&header).await
            } else {
                let mut frame = Vec::with_capacity(REQUEST_SIZE + payload.len());
                frame.extend_from_slice(&header);
                frame.extend_from_slice(payload);
                writer.write_all(&frame).await
            }
        };
        if let Err(error) = sent {
            lock(&self.pending).requests.remove(&handle);
            return Err(error);
        }
        answer.await.unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "nbd connection closed",
            ))
        })
    }

    /// Sends NBD_CMD_DISC and closes.
    pub async fn disconnect(self) -> io::Result<()> {
        let header = Request {
            flags: 0,
            command: CMD_DISC,
            handle: 0,
            offset_bytes: 0,
            len_bytes: 0,
        }
        .encode();
        let mut writer = self.writer.lock().await;
        writer.write_all(&header).await?;
        writer.shutdown().await
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        self.reader_task.abort();
    }
}

fn lock(pending: &PendingMap) -> std::sync::MutexGuard<'_, PendingState> {
    pending
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn read_replies(reader: OwnedReadHalf, pending: PendingMap) {
    // Replies arrive back to back at depth: one receive takes many of them.
    let mut reader = tokio::io::BufReader::with_capacity(256 << 10, reader);
    let error = loop {
        let mut header = [0u8; SIMPLE_REPLY_SIZE];
        if let Err(error) = reader.read_exact(&mut header).await {
            break error;
        }
        let Some(reply) = SimpleReply::decode(&header) else {
            break io::Error::new(io::ErrorKind::InvalidData, "bad reply magic");
        };
        let Some(request) = lock(&pending).requests.remove(&reply.handle) else {
            break io::Error::new(
                io::ErrorKind::InvalidData,
                format!("reply to unknown handle {}", reply.handle),
            );
        };
        if reply.error != 0 {
            let _ = request
                .reply
                .send(Err(io::Error::from_raw_os_error(reply.error as i32)));
            continue;
        }
        let mut data = vec![0u8; request.read_len as usize];
        if let Err(error) = reader.read_exact(&mut data).await {
            let _ = request
                .reply
                .send(Err(io::Error::new(error.kind(), error.to_string())));
            break error;
        }
        let _ = request.reply.send(Ok(data));
    };
    let reason = format!("nbd connection closed: {error}");
    let mut state = lock(&pending);
    state.closed = Some(reason.clone());
    for (_, request) in state.requests.drain() {
        let error = io::Error::new(io::ErrorKind::ConnectionAborted, reason.clone());
        let _ = request.reply.send(Err(error));
    }
}

async fn negotiate(
    reader: &mut OwnedReadHalf,
    writer: &mut OwnedWriteHalf,
    export: &str,
) -> io::Result<(u64, u16, u32)> {
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    if reader.read_u64().await? != INIT_MAGIC || reader.read_u64().await? != OPTION_MAGIC {
        return Err(bad("not a fixed-newstyle NBD server".into()));
    }
    let server_flags = reader.read_u16().await?;
    if server_flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(bad("server does not speak fixed newstyle".into()));
    }
    let mut client_flags = CLIENT_FLAG_FIXED_NEWSTYLE;
    if server_flags & FLAG_NO_ZEROES != 0 {
        client_flags |= CLIENT_FLAG_NO_ZEROES;
    }
    let data = InfoRequest {
        name: export.to_string(),
        requests: vec![INFO_BLOCK_SIZE],
    }
    .encode();
    let mut message = Vec::new();
    message.extend_from_slice(&client_flags.to_be_bytes());
    message.extend_from_slice(&OPTION_MAGIC.to_be_bytes());
    message.extend_from_slice(&OPT_GO.to_be_bytes());
    message.extend_from_slice(&(data.len() as u32).to_be_bytes());
    message.extend_from_slice(&data);
    writer.write_all(&message).await?;
    let (mut size_bytes, mut flags, mut block_size_min) = (None, 0, 1);
    loop {
        if reader.read_u64().await? != OPTION_REPLY_MAGIC {
            return Err(bad("bad option reply magic".into()));
        }
        let _option = reader.read_u32().await?;
        let kind = reader.read_u32().await?;
        let len = reader.read_u32().await?;
        if len > OPTION_SIZE_MAX {
            return Err(bad(format!("option reply of {len} bytes")));
        }
        let mut data = vec![0u8; len as usize];
        reader.read_exact(&mut data).await?;
        match kind {
            REP_ACK => break,
            REP_INFO if data.len() >= 12 && be_u16(&data) == INFO_EXPORT => {
                size_bytes = Some(be_u64(&data[2..10]));
                flags = be_u16(&data[10..12]);
            }
            REP_INFO if data.len() >= 14 && be_u16(&data) == INFO_BLOCK_SIZE => {
                block_size_min = be_u32(&data[2..6]);
            }
            REP_INFO => {}
            error if error & (1 << 31) != 0 => {
                let text = String::from_utf8_lossy(&data);
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("export {export:?} refused: {text} (reply {error:#x})"),
                ));
            }
            other => return Err(bad(format!("unexpected option reply {other}"))),
        }
    }
    let size_bytes = size_bytes.ok_or_else(|| bad("server sent no export size".into()))?;
    Ok((size_bytes, flags, block_size_min))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse() {
        let uri: NbdUri = "nbd://127.0.0.1:10900/disk0".parse().expect("uri");
        assert_eq!(
            uri,
            NbdUri {
                host: "127.0.0.1".into(),
                port: 10900,
                export: "disk0".into()
            }
        );
        let uri: NbdUri = "nbd://localhost".parse().expect("uri");
        assert_eq!((uri.port, uri.export.as_str()), (DEFAULT_PORT, ""));
        let uri: NbdUri = "nbd://[::1]:99/x".parse().expect("uri");
        assert_eq!((uri.host.as_str(), uri.port), ("::1", 99));
        let uri: NbdUri = "nbd://[::1]/x".parse().expect("uri");
        assert_eq!((uri.host.as_str(), uri.port), ("::1", DEFAULT_PORT));
        let uri: NbdUri = "nbd://[fe80::1]".parse().expect("uri");
        assert_eq!((uri.host.as_str(), uri.port), ("fe80::1", DEFAULT_PORT));
        assert!("nbd://::1/x".parse::<NbdUri>().is_err(), "unbracketed IPv6");
        assert!("nbd://[::1/x".parse::<NbdUri>().is_err());
        assert!("http://x".parse::<NbdUri>().is_err());
        assert!("nbd://:1/x".parse::<NbdUri>().is_err());
        assert!("nbd://h:port/x".parse::<NbdUri>().is_err());
    }
}
