//! A controller's socket sits between QEMU and vhost-user-backend: each message passes
//! through unchanged, with its descriptors, in both directions. What the relay adds is the
//! backend channel QEMU hands over (`SET_BACKEND_REQ_FD`): vhost-user-backend keeps its
//! own copy but cannot send the configuration change notice on it, so the relay keeps a
//! second one and sends the notice itself when the bdev grows.

use std::io::{self, Read};
use std::net::Shutdown;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use basalt_io::unix_fds::{recv_with_fds, send_with_fds};

/// A vhost-user message header: request, flags, payload size (little-endian u32s).
const HEADER_BYTES: usize = 12;
/// Largest payload relayed (vhost-user's largest, a memory table or a configuration
/// space, is a few hundred bytes); a larger one ends the session.
const PAYLOAD_BYTES_MAX: usize = 64 << 10;
/// `VHOST_USER_SET_BACKEND_REQ_FD`, from the frontend.
const SET_BACKEND_REQ_FD: u32 = 21;
/// `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG`, to the frontend on the backend channel.
const BACKEND_CONFIG_CHANGE_MSG: u32 = 2;
/// Header flags: protocol version 1.
const VERSION_1: u32 = 1;

/// One frontend's session through the relay.
#[derive(Default)]
pub struct Session {
    /// The backend channel, once the frontend has sent it.
    backend_channel: Mutex<Option<UnixStream>>,
    /// Either side has gone.
    ended: AtomicBool,
}

impl Session {
    /// Whether either side has gone.
    pub fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
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
    session: &std::sync::Arc<Session>,
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
        let Ok(Some((message, fds))) = read_message(from) else {
            break;
        };
        if from_frontend
            && request(&message) == SET_BACKEND_REQ_FD
            && let [fd] = fds.as_slice()
            && let Ok(copy) = fd.try_clone()
        {
            *session
                .backend_channel
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(UnixStream::from(copy));
        }
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
        if send_with_fds(to, &message, &borrowed).is_err() {
            break;
        }
    }
    session.ended.store(true, Ordering::Release);
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
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
    use std::sync::Arc;

    fn message(request: u32, payload: &[u8]) -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&request.to_le_bytes());
        bytes.extend_from_slice(&VERSION_1.to_le_bytes());
        bytes.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        bytes.extend_from_slice(payload);
        bytes
    }

    #[test]
    fn messages_pass_both_ways_and_the_backend_channel_is_kept() {
        let (qemu, frontend) = UnixStream::pair().expect("pair");
        let (daemon, backend) = UnixStream::pair().expect("pair");
        let session = Arc::new(Session::default());
        let threads = relay(frontend, daemon, &session).expect("relay");
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
}
