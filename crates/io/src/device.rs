//! Facts about a path: whether it is a block device, and its size; and a process's claim
//! on a data directory or a device.
#![allow(unsafe_code)]

use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// A process's exclusive claim on a path, held until dropped (or the process ends, even
/// by SIGKILL): an advisory `flock` that every Basalt daemon takes before it uses its
/// data directory or device, so that a second one started on the same data fails at
/// once instead of writing over the first's.
#[derive(Debug)]
pub struct Claim {
    _file: File,
}

/// Claims data directory `dir` by its lock file `dir/lock`, created if missing, which
/// then holds this process's id (named in the refusal another process gets).
pub fn claim_dir(dir: &Path) -> io::Result<Claim> {
    let path = dir.join("lock");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)?;
    if let Err(error) = try_flock(&file) {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        let holder = match holder.trim() {
            "" => String::new(),
            pid => format!(" (pid {pid})"),
        };
        return Err(io::Error::new(
            error.kind(),
            format!(
                "{} is in use by another process{holder}: {error}",
                dir.display()
            ),
        ));
    }
    file.set_len(0)?;
    file.rewind()?;
    writeln!(file, "{}", std::process::id())?;
    Ok(Claim { _file: file })
}

/// Claims the device or file at `path`. A block device is also opened with `O_EXCL`,
/// which the kernel refuses while it is mounted or claimed so by any other process.
pub fn claim_device(path: &Path) -> io::Result<Claim> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    if is_block_device(path)? {
        options.custom_flags(libc::O_EXCL);
    }
    let in_use = |error: io::Error| {
        io::Error::new(
            error.kind(),
            format!(
                "{} is in use (mounted, or another process has it): {error}",
                path.display()
            ),
        )
    };
    let file = options
        .open(path)
        .map_err(|error| match error.raw_os_error() {
            Some(libc::EBUSY) => in_use(error),
            _ => error,
        })?;
    try_flock(&file).map_err(in_use)?;
    Ok(Claim { _file: file })
}

/// Whether `path` is a block device.
pub fn is_block_device(path: &Path) -> io::Result<bool> {
    Ok(std::fs::metadata(path)?.file_type().is_block_device())
}

fn try_flock(file: &File) -> io::Result<()> {
    // SAFETY: flock on a descriptor this function borrows; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The size of a regular file or a block device, in bytes.
pub fn size_bytes(file: &File) -> io::Result<u64> {
    let metadata = file.metadata()?;
    if !metadata.file_type().is_block_device() {
        return Ok(metadata.len());
    }
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid and aligned.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// `_IOR(0x12, 114, size_t)`: the size of a block device in bytes.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regular_file_size_is_its_length() {
        let path = std::env::temp_dir().join(format!("basalt-io-size-{}", std::process::id()));
        let file = File::create(&path).expect("create temp file");
        file.set_len(12345).expect("set_len");
        assert_eq!(size_bytes(&file).expect("size"), 12345);
        std::fs::remove_file(path).expect("remove temp file");
    }

    #[test]
    fn a_claim_excludes_another_until_dropped() {
        let dir = std::env::temp_dir().join(format!("basalt-io-claim-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let claim = claim_dir(&dir).expect("claimed");
        // flock excludes another open file description, in this process too.
        let error = claim_dir(&dir).expect_err("claimed twice");
        let said = format!("is in use by another process (pid {})", std::process::id());
        assert!(error.to_string().contains(&said), "{error}");
        drop(claim);
        let again = claim_dir(&dir).expect("free once dropped");

        let device = dir.join("device");
        File::create(&device).expect("device file");
        let held = claim_device(&device).expect("claimed");
        let error = claim_device(&device).expect_err("claimed twice");
        assert!(error.to_string().contains("is in use"), "{error}");
        drop((held, again));
        claim_device(&device).expect("free once dropped");
        std::fs::remove_dir_all(dir).expect("remove");
    }
}
