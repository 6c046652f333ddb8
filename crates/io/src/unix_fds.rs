//! File descriptors passed over a Unix stream socket (`SCM_RIGHTS`), as vhost-user does;
//! waking a thread blocked in a Unix listener's `accept`, or one waiting on an eventfd it
//! was passed; and the anonymous shared memory files such descriptors carry
//! (`memfd_create`).
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};

/// Adds 1 to the eventfd `fd` (as a vhost-user frontend's kick does), waking whoever
/// waits on it. `fd` must stay open for the call (the caller borrows it).
pub fn signal_eventfd(fd: &impl AsRawFd) -> io::Result<()> {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live local buffer to a descriptor the caller keeps
    // open for the call.
    let written = unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    if written != one.len() as isize {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Descriptors one message may carry at most (vhost-user's limit).
pub const FDS_MAX: usize = 32;

/// A zero-length transfer carries no descriptors on a stream socket, and a zero-length
/// receive reads as the end of the stream: both are refused.
fn refuse_empty(buf: &[u8]) -> io::Result<()> {
    if buf.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "an empty buffer",
        ));
    }
    Ok(())
}

/// A message header over the one buffer `iov` describes, without control data.
fn header(iov: &mut libc::iovec) -> libc::msghdr {
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
    message.msg_iov = iov;
    message.msg_iovlen = 1;
    message
}

/// Room for the control message of [`FDS_MAX`] descriptors, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct ControlBuffer([u8; 256]);

/// Receives up to `buf.len()` bytes and the descriptors sent with them (close-on-exec).
/// `(0, [])` is the end of the stream. More than [`FDS_MAX`] descriptors, or descriptors
/// cut short by the kernel, are an error (and closed); so is an empty `buf`.
pub fn recv_with_fds(stream: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    refuse_empty(buf)?;
    let mut control = ControlBuffer([0; 256]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut message = header(&mut iov);
    message.msg_control = control.0.as_mut_ptr().cast();
    message.msg_controllen = control.0.len();
    let received = loop {
        // SAFETY: the header points at `iov` (over `buf`) and `control`, which outlive
        // the call and are as long as the header says.
        let received =
            unsafe { libc::recvmsg(stream.as_raw_fd(), &mut message, libc::MSG_CMSG_CLOEXEC) };
        if received >= 0 {
            break received as usize;
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the CMSG_* walk stays inside `control`, as filled in by the kernel
    // (`msg_controllen` says how much); each SCM_RIGHTS payload is an array of ints, and
    // every descriptor in it is now ours, so each is wrapped exactly once.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(&message);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(header);
                let bytes = (*header).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for index in 0..bytes / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(index));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            header = libc::CMSG_NXTHDR(&message, header);
        }
    }
    if message.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "descriptors were cut short",
        ));
    }
    if fds.len() > FDS_MAX {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} descriptors, at most {FDS_MAX}", fds.len()),
        ));
    }
    Ok((received, fds))
}

/// Sends all of `buf` (not empty), with `fds` (at most [`FDS_MAX`]) attached to its first
/// bytes.
pub fn send_with_fds(stream: &UnixStream, buf: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    refuse_empty(buf)?;
    if fds.len() > FDS_MAX {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} descriptors, at most {FDS_MAX}", fds.len()),
        ));
    }
    let mut sent = 0;
    while sent < buf.len() {
        let mut control = ControlBuffer([0; 256]);
        let mut iov = libc::iovec {
            iov_base: buf[sent..].as_ptr().cast_mut().cast(),
            iov_len: buf.len() - sent,
        };
        let mut message = header(&mut iov);
        if sent == 0 && !fds.is_empty() {
            let bytes = std::mem::size_of_val(fds) as u32;
            // SAFETY: CMSG_SPACE of at most FDS_MAX ints fits in `control` (256 bytes);
            // the header and data written are inside it.
            unsafe {
                message.msg_control = control.0.as_mut_ptr().cast();
                message.msg_controllen = libc::CMSG_SPACE(bytes) as usize;
                let header = libc::CMSG_FIRSTHDR(&message);
                (*header).cmsg_level = libc::SOL_SOCKET;
                (*header).cmsg_type = libc::SCM_RIGHTS;
                (*header).cmsg_len = libc::CMSG_LEN(bytes) as usize;
                let data = libc::CMSG_DATA(header).cast::<RawFd>();
                for (index, fd) in fds.iter().enumerate() {
                    std::ptr::write_unaligned(data.add(index), fd.as_raw_fd());
                }
            }
        }
        // SAFETY: the header points at `iov` (over `buf`) and `control`, which outlive the
        // call; the kernel only reads them.
        let written = unsafe { libc::sendmsg(stream.as_raw_fd(), &message, libc::MSG_NOSIGNAL) };
        if written < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        sent += written as usize;
    }
    Ok(())
}

/// Wakes every thread blocked in `listener`'s `accept` (it fails with `EINVAL`) and makes
/// further `accept`s fail: the way to stop a listener's thread that does not depend on its
/// socket file still being there to connect to.
pub fn shut_down_listener(listener: &UnixListener) -> io::Result<()> {
    // SAFETY: shutdown on a descriptor that `listener` owns and keeps open.
    if unsafe { libc::shutdown(listener.as_raw_fd(), libc::SHUT_RDWR) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An anonymous file of `len` zero bytes in memory (`memfd_create`, close-on-exec), to
/// share by passing its descriptor; `name` shows in `/proc/PID/fd`. Its size is sealed:
/// whoever it is shared with can map it without fearing that it shrinks under the map
/// (a SIGBUS on the next access), and [`size_is_sealed`] tells such a file from others.
pub fn memory_file(name: &str, len: u64) -> io::Result<std::fs::File> {
    let name = std::ffi::CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the name"))?;
    // SAFETY: `name` is a NUL-terminated string that outlives the call.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a new descriptor that nothing else owns.
    let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(len)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS takes an integer and changes no memory of ours.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// Whether `file` can neither shrink nor grow: a memory file sealed so (as
/// [`memory_file`] makes them), whose size checked once stays true.
pub fn size_is_sealed(file: &std::fs::File) -> io::Result<bool> {
    // SAFETY: F_GET_SEALS takes no argument and changes no memory of ours.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        let error = io::Error::last_os_error();
        // Not a file that takes seals at all.
        return if error.raw_os_error() == Some(libc::EINVAL) {
            Ok(false)
        } else {
            Err(error)
        };
    }
    let fixed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    Ok(seals & fixed == fixed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsFd;

    #[test]
    fn a_memory_file_reads_as_zeroes_and_keeps_what_is_written() {
        let mut file = memory_file("basalt-test", 8192).expect("memfd");
        assert_eq!(file.metadata().expect("stat").len(), 8192);
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).expect("read");
        assert_eq!(bytes, vec![0u8; 8192]);
        file.rewind().expect("rewind");
        file.write_all(b"kept").expect("write");
        file.rewind().expect("rewind");
        let mut head = [0u8; 4];
        file.read_exact(&mut head).expect("read");
        assert_eq!(&head, b"kept");
        assert!(memory_file("a\0b", 1).is_err());
    }

    #[test]
    fn descriptors_travel_with_their_bytes() {
        let (a, b) = UnixStream::pair().expect("pair");
        let mut file = tempfile_in_target();
        file.write_all(b"passed along").expect("write");
        let fds = [file.as_fd(), file.as_fd()];
        send_with_fds(&a, b"header+payload", &fds).expect("send");
        send_with_fds(&a, b"no fds", &[]).expect("send");
        let mut buf = [0u8; 14];
        let (n, received) = recv_with_fds(&b, &mut buf).expect("recv");
        assert_eq!((n, &buf[..n]), (14, &b"header+payload"[..]));
        assert_eq!(received.len(), 2);
        let mut passed = std::fs::File::from(received.into_iter().next().expect("fd"));
        passed.rewind().expect("rewind");
        let mut text = String::new();
        passed.read_to_string(&mut text).expect("read");
        assert_eq!(text, "passed along");
        let (n, received) = recv_with_fds(&b, &mut buf).expect("recv");
        assert_eq!((&buf[..n], received.len()), (&b"no fds"[..], 0));
        drop(a);
        let (n, received) = recv_with_fds(&b, &mut buf).expect("end");
        assert_eq!((n, received.len()), (0, 0));
        let too_many: Vec<BorrowedFd<'_>> = (0..=FDS_MAX).map(|_| file.as_fd()).collect();
        assert!(send_with_fds(&b, b"x", &too_many).is_err());
        assert!(send_with_fds(&b, b"", &[]).is_err(), "nothing to send");
        assert!(recv_with_fds(&b, &mut []).is_err(), "nowhere to receive");
    }

    fn tempfile_in_target() -> std::fs::File {
        let path = std::env::temp_dir().join(format!("basalt-unix-fds-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("file");
        std::fs::remove_file(&path).expect("unlink");
        file
    }
}
