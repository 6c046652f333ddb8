//! A controller's socket sits between QEMU and vhost-user-backend: each message passes
//! through unchanged, with its descriptors, in both directions, except for what the relay
//! adds:
//! - the backend channel QEMU hands over (`SET_BACKEND_REQ_FD`): vhost-user-backend keeps
//!   its own copy but cannot send the configuration change notice on it, so the relay
//!   keeps a second one and sends the notice itself when the bdev grows;
//! - the in-flight region (`INFLIGHT_SHMFD`, see [`crate::inflight`]), which
//!   vhost-user-backend does not handle: the relay offers the protocol feature, answers
//!   `GET_INFLIGHT_FD` and `SET_INFLIGHT_FD` itself (the daemon never sees them nor the
//!   feature). The requests to replay start when a vring is enabled, for which
//!   vhost-user-backend raises the vring's event without waiting for a kick;
//! - a signal on each new call eventfd (`SET_VRING_CALL`), as libvhost-user does, so that
//!   a guest reconnected to a restarted target looks at its used ring once.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

use basalt_io::unix_fds::{recv_with_fds, send_with_fds};

use crate::backend::QUEUE_SIZE_MAX;
use crate::inflight::{self, InflightRegion};

/// A vhost-user message header: request, flags, payload size (little-endian u32s).
const HEADER_BYTES: usize = 12;
/// Largest payload relayed (vhost-user's largest, a memory table or a configuration
/// space, is a few hundred bytes); a larger one ends the session.
const PAYLOAD_BYTES_MAX: usize = 64 << 10;
/// Frontend requests the relay looks at.
const SET_VRING_CALL: u32 = 13;
const GET_PROTOCOL_FEATURES: u32 = 15;
const SET_PROTOCOL_FEATURES: u32 = 16;
const SET_BACKEND_REQ_FD: u32 = 21;
const GET_INFLIGHT_FD: u32 = 31;
const SET_INFLIGHT_FD: u32 = 32;
/// `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG`, to the frontend on the backend channel.
const BACKEND_CONFIG_CHANGE_MSG: u32 = 2;
/// Header flags: protocol version 1; a reply; the sender asks for a reply.
const VERSION_1: u32 = 1;
const REPLY: u32 = 1 << 2;
const NEED_REPLY: u32 = 1 << 3;
/// `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`.
const INFLIGHT_SHMFD: u64 = 1 << 12;
/// SET_VRING_CALL's payload bit saying that no descriptor came (the vring is polled).
const VRING_NO_FD: u64 = 1 << 8;
/// The in-flight messages' payload: mmap_size u64, mmap_offset u64, num_queues u16,
/// queue_size u16, padded to 24 bytes (struct VhostUserInflight).
const INFLIGHT_PAYLOAD_BYTES: usize = 24;

/// One frontend's session through the relay.
#[derive(Default)]
pub struct Session {
    /// The backend channel, once the frontend has sent it.
    backend_channel: Mutex<Option<UnixStream>>,
    /// Either side has gone.
    ended: AtomicBool,
    /// The in-flight region the frontend handed over, if it did.
    inflight: RwLock<Option<Arc<InflightRegion>>>,
    /// Held while a message goes to the frontend (both pumps answer it).
    to_frontend: Mutex<()>,
    /// The backend has given up on this session's requests still in flight: one that
    /// finishes now is not put on the used ring (see [`Session::close`]).
    closed: Arc<AtomicBool>,
}

impl Session {
    /// Closes the session once its requests have finished or been waited for long enough:
    /// from now on a request of it that finishes touches neither the used ring nor the
    /// in-flight region (the next session's, by then), and the next session takes it again
    /// (replayed from the region, where its mark stays, or taken again from the available
    /// ring).
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// The flag [`Session::close`] sets, for the requests of this session.
    pub(crate) fn closed_flag(&self) -> Arc<AtomicBool> {
        self.closed.clone()
    }

    /// Whether either side has gone.
    pub fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// The in-flight region of this session, once the frontend has handed it over.
    pub fn inflight(&self) -> Option<Arc<InflightRegion>> {
        self.inflight
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Tells the frontend that the configuration space changed (it reads it again; QEMU
    /// then shows a new capacity to the guest). `Ok(false)`: no backend channel yet.
    pub fn notify_config_change(&self) -> io::Result<bool> {
        // A copy, so that a slow send does not hold the lock a pump may need.
        let channel = self
            .backend_channel
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(UnixStream::try_clone)
            .transpose()?;
        let Some(channel) = channel else {
            return Ok(false);
        };
        let mut header = [0u8; HEADER_BYTES];
        header[0..4].copy_from_slice(&BACKEND_CONFIG_CHANGE_MSG.to_le_bytes());
        header[4..8].copy_from_slice(&VERSION_1.to_le_bytes());
        send_with_fds(&channel, &header, &[])?;
        Ok(true)
    }
}

/// Relays between `frontend` (QEMU) and `daemon` (vhost-user-backend's end) until either
/// goes; both threads end then.
pub fn relay(
    frontend: UnixStream,
    daemon: UnixStream,
    session: &Arc<Session>,
) -> io::Result<[JoinHandle<()>; 2]> {
    let (frontend2, daemon2) = (frontend.try_clone()?, daemon.try_clone()?);
    let (frontend3, daemon3) = (frontend.try_clone()?, daemon.try_clone()?);
    let spawn = |from: UnixStream, to: UnixStream, from_frontend: bool| {
        let session = session.clone();
        std::thread::Builder::new()
            .name("vhost-relay".into())
            .spawn(move || pump(&from, &to, &session, from_frontend))
    };
    let requests = spawn(frontend, daemon, true)?;
    match spawn(daemon2, frontend2, false) {
        Ok(replies) => Ok([requests, replies]),
        Err(error) => {
            // Both directions or neither: the first pump ends on the shutdown.
            let _ = frontend3.shutdown(Shutdown::Both);
            let _ = daemon3.shutdown(Shutdown::Both);
            let _ = requests.join();
            Err(error)
        }
    }
}

/// Moves messages from `from` to `to` until one side fails or ends, then shuts both down
/// (which ends the other direction's pump too).
fn pump(from: &UnixStream, to: &UnixStream, session: &Session, from_frontend: bool) {
    loop {
        let Ok(Some((mut message, fds))) = read_message(from) else {
            break;
        };
        let passed = if from_frontend {
            from_the_frontend(&mut message, &fds, from, to, session)
        } else {
            if request(&message) == GET_PROTOCOL_FEATURES && flags(&message) & REPLY != 0 {
                // The daemon's answer, and the in-flight region the relay handles.
                update_u64_payload(&mut message, |features| features | INFLIGHT_SHMFD);
            }
            let _sending = session
                .to_frontend
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            forward(to, &message, &fds)
        };
        if passed.is_err() {
            break;
        }
    }
    session.ended.store(true, Ordering::Release);
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// Passes a frontend's message on to the daemon, or answers it here (the in-flight
/// region's).
fn from_the_frontend(
    message: &mut [u8],
    fds: &[OwnedFd],
    frontend: &UnixStream,
    daemon: &UnixStream,
    session: &Session,
) -> io::Result<()> {
    match request(message) {
        SET_BACKEND_REQ_FD => {
            if let [fd] = fds
                && let Ok(copy) = fd.try_clone()
            {
                *session
                    .backend_channel
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(UnixStream::from(copy));
            }
            forward(daemon, message, fds)
        }
        SET_VRING_CALL => {
            forward(daemon, message, fds)?;
            // As libvhost-user does: a signal on the new call eventfd, so that the guest
            // looks at the used ring once. A backend killed after putting requests on the
            // used ring but before signalling them leaves the guest unaware of them; with
            // EVENT_IDX its used_event then stays behind the ring and no later completion
            // would signal it either: its I/O would hang. A spare signal costs nothing.
            if payload_u64(message).is_some_and(|value| value & VRING_NO_FD == 0)
                && let [fd] = fds
                && let Ok(copy) = fd.try_clone()
                && let Err(error) = File::from(copy).write_all(&1u64.to_ne_bytes())
            {
                tracing::debug!(%error, "new call eventfd not signalled");
            }
            Ok(())
        }
        SET_PROTOCOL_FEATURES => {
            // The daemon is not told of a feature it does not have.
            update_u64_payload(message, |features| features & !INFLIGHT_SHMFD);
            forward(daemon, message, fds)
        }
        GET_INFLIGHT_FD => {
            let (payload, file) =
                match inflight_payload(message).and_then(|(_, _, queues, size)| {
                    let (file, len) = inflight::create(queues, size, QUEUE_SIZE_MAX)?;
                    tracing::info!(queues, queue_size = size, "in-flight region created");
                    Ok((encode_inflight(len, 0, queues, size), Some(file)))
                }) {
                    Ok(answer) => answer,
                    Err(error) => {
                        // A zero size: the frontend goes on without a region.
                        tracing::warn!(%error, "no in-flight region");
                        (encode_inflight(0, 0, 0, 0), None)
                    }
                };
            let files: Vec<BorrowedFd<'_>> = file.iter().map(AsFd::as_fd).collect();
            answer(frontend, session, message, &payload, &files)
        }
        SET_INFLIGHT_FD => {
            let status: u64 = match open_region(message, fds) {
                Ok(region) => {
                    tracing::info!(
                        queues = region.queue_count(),
                        queue_size = region.queue_size(),
                        "in-flight region handed over"
                    );
                    *session.inflight.write().unwrap_or_else(|p| p.into_inner()) =
                        Some(Arc::new(region));
                    0
                }
                Err(error) => {
                    tracing::warn!(%error, "in-flight region refused; requests in flight at a crash will not be replayed");
                    // Not the previous region either (QEMU may have freed it).
                    *session.inflight.write().unwrap_or_else(|p| p.into_inner()) = None;
                    1
                }
            };
            if flags(message) & NEED_REPLY != 0 {
                answer(frontend, session, message, &status.to_le_bytes(), &[])?;
            }
            Ok(())
        }
        _ => forward(daemon, message, fds),
    }
}

/// Maps the region a `SET_INFLIGHT_FD` message hands over with its one descriptor.
fn open_region(message: &[u8], fds: &[OwnedFd]) -> io::Result<InflightRegion> {
    let (size, offset, queues, queue_size) = inflight_payload(message)?;
    let [fd] = fds else {
        return Err(io::Error::other("SET_INFLIGHT_FD without one descriptor"));
    };
    let file = File::from(fd.try_clone()?);
    InflightRegion::open(file, offset, size, queues, queue_size, QUEUE_SIZE_MAX)
}

/// Sends `message` with `fds` to `to`.
fn forward(to: &UnixStream, message: &[u8], fds: &[OwnedFd]) -> io::Result<()> {
    let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
    send_with_fds(to, message, &borrowed)
}

/// Answers the frontend's `request` with `payload` and `fds`.
fn answer(
    frontend: &UnixStream,
    session: &Session,
    request: &[u8],
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    let mut reply = Vec::with_capacity(HEADER_BYTES + payload.len());
    reply.extend_from_slice(&request[0..4]);
    reply.extend_from_slice(&(VERSION_1 | REPLY).to_le_bytes());
    reply.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    reply.extend_from_slice(payload);
    let _sending = session
        .to_frontend
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    send_with_fds(frontend, &reply, fds)
}

/// An in-flight message's fields: mmap_size, mmap_offset, num_queues, queue_size.
fn inflight_payload(message: &[u8]) -> io::Result<(u64, u64, u16, u16)> {
    let payload = &message[HEADER_BYTES..];
    if payload.len() < 20 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("an in-flight message of {} bytes", payload.len()),
        ));
    }
    Ok((
        u64::from_le_bytes(payload[0..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(payload[8..16].try_into().expect("8 bytes")),
        u16::from_le_bytes(payload[16..18].try_into().expect("2 bytes")),
        u16::from_le_bytes(payload[18..20].try_into().expect("2 bytes")),
    ))
}

fn encode_inflight(
    size: u64,
    offset: u64,
    queues: u16,
    queue_size: u16,
) -> [u8; INFLIGHT_PAYLOAD_BYTES] {
    let mut payload = [0u8; INFLIGHT_PAYLOAD_BYTES];
    payload[0..8].copy_from_slice(&size.to_le_bytes());
    payload[8..16].copy_from_slice(&offset.to_le_bytes());
    payload[16..18].copy_from_slice(&queues.to_le_bytes());
    payload[18..20].copy_from_slice(&queue_size.to_le_bytes());
    payload
}

/// A message's u64 payload, if it has one.
fn payload_u64(message: &[u8]) -> Option<u64> {
    let bytes = message.get(HEADER_BYTES..HEADER_BYTES + 8)?;
    Some(u64::from_le_bytes(bytes.try_into().expect("8 bytes")))
}

/// Replaces a message's u64 payload, if it has one, with `change` of it.
fn update_u64_payload(message: &mut [u8], change: impl FnOnce(u64) -> u64) {
    if let Some(value) = payload_u64(message) {
        message[HEADER_BYTES..HEADER_BYTES + 8].copy_from_slice(&change(value).to_le_bytes());
    }
}

/// The header flags of a message.
fn flags(message: &[u8]) -> u32 {
    u32::from_le_bytes(message[4..8].try_into().expect("a header"))
}

/// The request code of a message.
fn request(message: &[u8]) -> u32 {
    u32::from_le_bytes(message[0..4].try_into().expect("a header"))
}

/// One whole message (header and payload) and the descriptors sent with it; `None` at the
/// end of the stream.
fn read_message(stream: &UnixStream) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
    let mut header = [0u8; HEADER_BYTES];
    let (mut got, mut fds) = recv_with_fds(stream, &mut header)?;
    if got == 0 {
        return Ok(None);
    }
    while got < HEADER_BYTES {
        let (more, more_fds) = recv_with_fds(stream, &mut header[got..])?;
        if more == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += more;
        fds.extend(more_fds);
    }
    let size = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")) as usize;
    if size > PAYLOAD_BYTES_MAX {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a {size}-byte vhost-user payload"),
        ));
    }
    let mut message = header.to_vec();
    message.resize(HEADER_BYTES + size, 0);
    (&*stream).read_exact(&mut message[HEADER_BYTES..])?;
    Ok(Some((message, fds)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(request: u32, payload: &[u8]) -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&request.to_le_bytes());
        bytes.extend_from_slice(&VERSION_1.to_le_bytes());
        bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        bytes.extend_from_slice(payload);
        bytes
    }

    /// A relay between two socket pairs: QEMU's end, the daemon's end, the session and the
    /// pump threads.
    fn relayed() -> (
        UnixStream,
        UnixStream,
        Arc<Session>,
        [std::thread::JoinHandle<()>; 2],
    ) {
        let (qemu, frontend) = UnixStream::pair().expect("pair");
        let (daemon, backend) = UnixStream::pair().expect("pair");
        let session = Arc::new(Session::default());
        let threads = relay(frontend, daemon, &session).expect("relay");
        (qemu, backend, session, threads)
    }

    #[test]
    fn messages_pass_both_ways_and_the_backend_channel_is_kept() {
        let (qemu, backend, session, threads) = relayed();
        assert!(!session.notify_config_change().expect("no channel yet"));

        // A request with a payload and no descriptor, and its reply.
        send_with_fds(&qemu, &message(1, &[]), &[]).expect("send");
        let (bytes, fds) = read_message(&backend).expect("read").expect("a message");
        assert_eq!((bytes, fds.len()), (message(1, &[]), 0));
        send_with_fds(&backend, &message(1, &7u64.to_le_bytes()), &[]).expect("reply");
        let (bytes, _) = read_message(&qemu).expect("read").expect("a message");
        assert_eq!(bytes, message(1, &7u64.to_le_bytes()));

        // The backend channel: passed on, and kept for the notice.
        let (channel_ours, channel_theirs) = UnixStream::pair().expect("pair");
        send_with_fds(
            &qemu,
            &message(SET_BACKEND_REQ_FD, &[]),
            &[channel_theirs.as_fd()],
        )
        .expect("send the channel");
        let (_, fds) = read_message(&backend).expect("read").expect("a message");
        assert_eq!(fds.len(), 1, "the daemon gets the channel too");
        assert!(session.notify_config_change().expect("notice"));
        let (bytes, _) = read_message(&channel_ours).expect("read").expect("notice");
        assert_eq!(bytes, message(BACKEND_CONFIG_CHANGE_MSG, &[]));

        // A payload too large for any vhost-user message ends the session both ways.
        let mut huge = message(3, &[]);
        huge[8..12].copy_from_slice(&(1u32 << 20).to_le_bytes());
        send_with_fds(&qemu, &huge, &[]).expect("send");
        for thread in threads {
            thread.join().expect("pump");
        }
        assert!(session.ended());
        assert!(read_message(&backend).expect("end").is_none());
    }

    #[test]
    fn the_relay_handles_the_in_flight_region_and_the_daemon_never_sees_it() {
        let (qemu, backend, session, threads) = relayed();
        let with_flags = |mut bytes: Vec<u8>, flags: u32| {
            bytes[4..8].copy_from_slice(&flags.to_le_bytes());
            bytes
        };

        // The daemon's protocol features gain INFLIGHT_SHMFD on the way to QEMU...
        send_with_fds(&qemu, &message(GET_PROTOCOL_FEATURES, &[]), &[]).expect("send");
        read_message(&backend).expect("read").expect("passed on");
        let reply = with_flags(
            message(GET_PROTOCOL_FEATURES, &0x22u64.to_le_bytes()),
            VERSION_1 | REPLY,
        );
        send_with_fds(&backend, &reply, &[]).expect("reply");
        let (bytes, _) = read_message(&qemu).expect("read").expect("reply");
        assert_eq!(payload_u64(&bytes), Some(0x22 | INFLIGHT_SHMFD));
        // ...and lose it on the way back.
        let acked = message(SET_PROTOCOL_FEATURES, &(0x2 | INFLIGHT_SHMFD).to_le_bytes());
        send_with_fds(&qemu, &acked, &[]).expect("send");
        let (bytes, _) = read_message(&backend).expect("read").expect("passed on");
        assert_eq!(payload_u64(&bytes), Some(0x2));

        // GET_INFLIGHT_FD is answered here, with a region for 2 queues of 8 and its file.
        send_with_fds(
            &qemu,
            &message(GET_INFLIGHT_FD, &encode_inflight(0, 0, 2, 8)),
            &[],
        )
        .expect("send");
        let (bytes, fds) = read_message(&qemu).expect("read").expect("answer");
        assert_eq!(flags(&bytes), VERSION_1 | REPLY);
        let (size, offset, queues, queue_size) = inflight_payload(&bytes).expect("payload");
        assert_eq!((size, offset, queues, queue_size), (2 * 192, 0, 2, 8));
        assert_eq!(bytes.len(), HEADER_BYTES + INFLIGHT_PAYLOAD_BYTES);
        let [region] = <[OwnedFd; 1]>::try_from(fds).expect("one descriptor");
        assert_eq!(
            File::from(region.try_clone().expect("dup"))
                .metadata()
                .expect("stat")
                .len(),
            size
        );
        assert!(session.inflight().is_none(), "in use only once handed back");

        // SET_INFLIGHT_FD maps it (asked for a reply: 0); a malformed one drops it (1).
        let set = with_flags(
            message(SET_INFLIGHT_FD, &encode_inflight(size, 0, 2, 8)),
            VERSION_1 | NEED_REPLY,
        );
        send_with_fds(&qemu, &set, &[region.as_fd()]).expect("send");
        let (bytes, _) = read_message(&qemu).expect("read").expect("answer");
        assert_eq!(payload_u64(&bytes), Some(0));
        assert!(session.inflight().is_some());
        let too_small = with_flags(
            message(SET_INFLIGHT_FD, &encode_inflight(64, 0, 2, 8)),
            VERSION_1 | NEED_REPLY,
        );
        send_with_fds(&qemu, &too_small, &[region.as_fd()]).expect("send");
        let (bytes, _) = read_message(&qemu).expect("read").expect("answer");
        assert_eq!(payload_u64(&bytes), Some(1));
        assert!(session.inflight().is_none(), "the previous region dropped");

        // A new call eventfd is passed on, then signalled.
        // (A socket stands in for the eventfd: the relay writes the counter's 8 bytes.)
        let (call_ours, call_theirs) = UnixStream::pair().expect("pair");
        send_with_fds(
            &qemu,
            &message(SET_VRING_CALL, &0u64.to_le_bytes()),
            &[call_theirs.as_fd()],
        )
        .expect("send");
        let (bytes, fds) = read_message(&backend).expect("read").expect("passed on");
        assert_eq!((request(&bytes), fds.len()), (SET_VRING_CALL, 1));
        let mut signal = [0u8; 8];
        (&call_ours).read_exact(&mut signal).expect("signalled");
        assert_eq!(u64::from_ne_bytes(signal), 1);

        // None of the three reached the daemon: the next message it gets is this one.
        send_with_fds(&qemu, &message(1, &[]), &[]).expect("send");
        let (bytes, _) = read_message(&backend).expect("read").expect("a message");
        assert_eq!(bytes, message(1, &[]));
        drop((qemu, backend));
        for thread in threads {
            thread.join().expect("pump");
        }
    }
}
