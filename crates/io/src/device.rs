//! Facts about a path: whether it is a block device, and its size.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;

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
}
