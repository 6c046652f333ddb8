//! A bdev on a regular file or a block device, through [`FileEngine`] (io_uring, O_DIRECT).

use std::path::Path;

use basalt_io::{AllocateMode, DmaBuf, FileEngine, OpenError, OpenOptions};

use crate::bdev::{Bdev, BdevFuture, BdevInfo, Extent, InPlace, ResizableInfo, Shrink};

/// How to open a file bdev.
#[derive(Debug, Clone)]
pub struct FileBdevOptions {
    /// Bytes per block; O_DIRECT needs a multiple of the device's logical block size.
    pub block_size: u32,
    /// Go through the page cache instead of O_DIRECT (for tmpfs and other filesystems that
    /// refuse O_DIRECT). Durability still comes from flush and FUA.
    pub buffered: bool,
    /// Requests in flight at most.
    pub queue_depth: u32,
}

/// Why a file bdev could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileBdevError {
    /// The file could not be opened.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// The file holds less than one block.
    #[error("{path}: {size_bytes} bytes is less than one {block_size}-byte block")]
    TooSmall {
        /// The file.
        path: String,
        /// Its size.
        size_bytes: u64,
        /// The block size asked for.
        block_size: u32,
    },
}

/// A bdev backed by a file or block device.
pub struct FileBdev {
    info: ResizableInfo,
    engine: FileEngine,
}

impl FileBdev {
    /// Opens `path`; `info` gets its block count from the file's size.
    pub fn open(
        path: &Path,
        name: String,
        uuid: String,
        options: &FileBdevOptions,
    ) -> Result<Self, FileBdevError> {
        let open_options = OpenOptions {
            direct: !options.buffered,
            queue_depth: options.queue_depth,
            ..OpenOptions::default()
        };
        let engine = FileEngine::open(path, &open_options)?;
        let block_count = engine.size_bytes() / u64::from(options.block_size);
        if block_count == 0 {
            return Err(FileBdevError::TooSmall {
                path: path.display().to_string(),
                size_bytes: engine.size_bytes(),
                block_size: options.block_size,
            });
        }
        let info = BdevInfo {
            name,
            uuid,
            product_name: "URING bdev",
            block_size: options.block_size,
            block_count,
            optimal_io_boundary_blocks: 0,
        };
        Ok(Self {
            info: ResizableInfo::new(info),
            engine,
        })
    }

    /// The file or device path.
    pub fn path(&self) -> &Path {
        self.engine.path()
    }
}

/// `EOPNOTSUPP` from Linux (stable ABI number).
const EOPNOTSUPP: i32 = 95;
/// Bytes per write when zeroing by writing.
const ZERO_CHUNK_BYTES: u64 = 1 << 20;

impl FileBdev {
    /// Writes zeroes over `extent`, a chunk at a time, reusing one buffer.
    async fn zero_by_writing(&self, extent: Extent) -> Result<(), crate::BdevError> {
        let mut offset = extent.offset_bytes();
        let mut buffer = DmaBuf::zeroed(ZERO_CHUNK_BYTES.min(extent.len_bytes()) as usize);
        while offset < extent.end_bytes() {
            let len = ZERO_CHUNK_BYTES.min(extent.end_bytes() - offset);
            buffer.truncate(len as usize);
            buffer = self
                .engine
                .write(offset, buffer, false)
                .await
                .map_err(|error| self.info().io_error(error))?;
            offset += len;
        }
        Ok(())
    }
}

impl Bdev for FileBdev {
    fn info(&self) -> &BdevInfo {
        self.info.get()
    }

    fn volatile_cache(&self) -> bool {
        true
    }

    fn in_place(&self) -> Option<InPlace<'_>> {
        Some(InPlace {
            file: self.engine.file(),
            alignment: if self.engine.is_direct() {
                self.info().block_size
            } else {
                1
            },
        })
    }

    fn rescan(&self) -> Result<u64, crate::BdevError> {
        let what = self.path().display().to_string();
        self.info.resize(&what, Shrink::Refused, |current| {
            let size_bytes = std::fs::File::open(self.path())
                .and_then(|file| basalt_io::device::size_bytes(&file))
                .map_err(|error| current.io_error(error))?;
            Ok(size_bytes / u64::from(current.block_size))
        })
    }

    fn read(&self, extent: Extent) -> BdevFuture<'_, DmaBuf> {
        Box::pin(async move {
            let buf = DmaBuf::zeroed(extent.len_bytes() as usize);
            self.engine
                .read(extent.offset_bytes(), buf)
                .await
                .map_err(|error| self.info().io_error(error))
        })
    }

    fn write(&self, extent: Extent, data: DmaBuf, fua: bool) -> BdevFuture<'_, ()> {
        assert_eq!(data.len() as u64, extent.len_bytes(), "write buffer length");
        Box::pin(async move {
            self.engine
                .write(extent.offset_bytes(), data, fua)
                .await
                .map(drop)
                .map_err(|error| self.info().io_error(error))
        })
    }

    fn flush(&self) -> BdevFuture<'_, ()> {
        Box::pin(async move {
            self.engine
                .sync()
                .await
                .map_err(|error| self.info().io_error(error))
        })
    }

    fn write_zeroes(&self, extent: Extent, deallocate: bool) -> BdevFuture<'_, ()> {
        let mode = if deallocate {
            AllocateMode::PunchHole
        } else {
            AllocateMode::ZeroRange
        };
        Box::pin(async move {
            let allocated = self
                .engine
                .allocate(mode, extent.offset_bytes(), extent.len_bytes())
                .await;
            match allocated {
                // Filesystems without this fallocate mode (and some block devices) still
                // get zeroes, by writing them.
                Err(error) if error.raw_os_error() == Some(EOPNOTSUPP) => {
                    self.zero_by_writing(extent).await
                }
                other => other.map_err(|error| self.info().io_error(error)),
            }
        })
    }

    fn discard(&self, extent: Extent) -> BdevFuture<'_, ()> {
        self.write_zeroes(extent, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn file_bdev_round_trips_and_zeroes() {
        let path = std::env::temp_dir().join(format!("basalt-file-bdev-{}", std::process::id()));
        std::fs::File::create(&path)
            .expect("create")
            .set_len(1 << 20)
            .expect("set_len");
        let options = FileBdevOptions {
            block_size: 4096,
            buffered: false,
            queue_depth: 16,
        };
        let bdev = FileBdev::open(&path, "f".into(), String::new(), &options);
        // /tmp may be tmpfs here; then the buffered mode is the documented way in.
        let bdev = match bdev {
            Err(FileBdevError::Open(OpenError::DirectRefused { .. })) => {
                let options = FileBdevOptions {
                    buffered: true,
                    ..options
                };
                FileBdev::open(&path, "f".into(), String::new(), &options).expect("buffered open")
            }
            other => other.expect("open"),
        };
        assert_eq!(bdev.info().block_count, 256);
        let extent = bdev.info().extent(8192, 8192).expect("extent");
        bdev.write(extent, DmaBuf::from_slice(&[9u8; 8192]), true)
            .await
            .expect("write");
        assert!(
            bdev.read(extent)
                .await
                .expect("read")
                .iter()
                .all(|b| *b == 9)
        );
        bdev.write_zeroes(extent, false).await.expect("zeroes");
        assert!(
            bdev.read(extent)
                .await
                .expect("read")
                .iter()
                .all(|b| *b == 0)
        );
        bdev.flush().await.expect("flush");
        drop(bdev);
        std::fs::remove_file(path).expect("remove");
    }

    /// A 4 KiB-block bdev through the page cache (wherever /tmp is).
    fn open_buffered(path: &Path, name: &str) -> FileBdev {
        let options = FileBdevOptions {
            block_size: 4096,
            buffered: true,
            queue_depth: 4,
        };
        FileBdev::open(path, name.into(), String::new(), &options).expect("open")
    }

    #[tokio::test]
    async fn a_rescan_takes_on_a_grown_file_and_refuses_a_shrunk_one() {
        let path = std::env::temp_dir().join(format!("basalt-file-grow-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 1 << 20]).expect("create");
        let bdev = open_buffered(&path, "g");
        assert!(bdev.info().extent(1 << 20, 4096).is_err(), "past the end");
        assert_eq!(bdev.rescan().expect("same size"), 256);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open the file");
        file.set_len(2 << 20).expect("grow");
        assert_eq!(bdev.rescan().expect("grown"), 512);
        assert_eq!(bdev.info().block_count, 512);
        let extent = bdev.info().extent(1 << 20, 4096).expect("inside now");
        bdev.write(extent, DmaBuf::from_slice(&[7u8; 4096]), true)
            .await
            .expect("write past the old end");
        assert!(
            bdev.read(extent)
                .await
                .expect("read")
                .iter()
                .all(|b| *b == 7)
        );
        file.set_len(1 << 20).expect("shrink");
        let error = bdev.rescan().expect_err("a bdev only grows");
        assert!(error.to_string().contains("only grows"), "{error}");
        assert_eq!(bdev.info().block_count, 512, "unchanged");
        drop(bdev);
        std::fs::remove_file(path).expect("remove");
    }

    #[tokio::test]
    async fn zeroing_by_writing_covers_the_extent_only() {
        let path = std::env::temp_dir().join(format!("basalt-file-zero-{}", std::process::id()));
        std::fs::write(&path, vec![0xeeu8; 3 << 20]).expect("create");
        let bdev = open_buffered(&path, "f");
        let extent = bdev.info().extent(4096, (2 << 20) + 8192).expect("extent");
        bdev.zero_by_writing(extent).await.expect("zero");
        let all = bdev.info().extent(0, 3 << 20).expect("extent");
        let data = bdev.read(all).await.expect("read");
        assert!(data[..4096].iter().all(|b| *b == 0xee), "before the extent");
        assert!(
            data[4096..(2 << 20) + 12288].iter().all(|b| *b == 0),
            "the extent"
        );
        assert!(
            data[(2 << 20) + 12288..].iter().all(|b| *b == 0xee),
            "after the extent"
        );
        drop(bdev);
        std::fs::remove_file(path).expect("remove");
    }

    #[test]
    fn too_small_file_is_refused() {
        let path = std::env::temp_dir().join(format!("basalt-file-small-{}", std::process::id()));
        std::fs::File::create(&path)
            .expect("create")
            .set_len(100)
            .expect("set_len");
        let options = FileBdevOptions {
            block_size: 512,
            buffered: true,
            queue_depth: 4,
        };
        let result = FileBdev::open(&path, "f".into(), String::new(), &options);
        assert!(matches!(
            result,
            Err(FileBdevError::TooSmall {
                size_bytes: 100,
                ..
            })
        ));
        std::fs::remove_file(path).expect("remove");
    }
}
