//! The image kind: a Basalt image through the client library.
//!
//! Every acknowledged write is already durable on a majority of replicas, so a flush has
//! nothing to wait for beyond the writes in flight (which the frontend already waits for);
//! write zeroes and discard both discard, since discarded ranges read as zeroes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use basalt_client::{ClientError, Image};
use basalt_io::DmaBuf;

use crate::bdev::{
    Bdev, BdevError, BdevFuture, BdevInfo, Extent, ResizableInfo, Shrink, libc_errno,
};

/// The product name of image bdevs.
pub const PRODUCT_NAME: &str = "Basalt image";

/// Objects one discard or write zeroes should cover at most ([`Bdev::unmap_blocks_max`]).
/// The client discards 42-47 thousand objects a second one request at a time on this
/// project's test machine (`bench/image-discard.sh`, `docs/benchmarks.md`): 2,048 take
/// about 50 ms, so even 256 such commands queued at once (Linux's `blkdiscard` of a whole
/// device over two NVMe queues of 128) end within about 12 s, inside its 30 s I/O timeout,
/// should the cluster go no faster for the concurrency.
pub const UNMAP_OBJECTS_MAX: u64 = 2_048;

/// A bdev over a Basalt image. It follows the image's size: when the cluster map says the
/// image grew or shrank (`image resize --allow-shrink`, whose cut-off data is discarded),
/// so does the bdev, and the frontends that watch sizes tell their hosts (NVMe/TCP by a
/// namespace attribute notice, vhost-user-blk by a config change; an NBD connection's
/// size is fixed at its handshake, and its requests past the new end are refused).
pub struct ImageBdev {
    shared: Arc<Shared>,
}

struct Shared {
    info: ResizableInfo,
    /// Holds the cluster connection alive as well.
    image: Image,
    /// Who this bdev is to the monitors, as a watcher of the image.
    watcher: String,
}

impl Drop for Shared {
    /// The bdev is gone: the image has one watcher less (if a runtime is at hand to say
    /// so; else the monitors forget it after `WATCH_TTL`).
    fn drop(&mut self) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let unwatch = self.image.watch(std::mem::take(&mut self.watcher), false);
            runtime.spawn(unwatch);
        }
    }
}

impl Shared {
    /// Takes on the image's size in the map now.
    fn follow_size(&self) -> Result<u64, BdevError> {
        self.info
            .resize(self.image.name(), Shrink::Allowed, |current| {
                let size_bytes = self
                    .image
                    .size_bytes()
                    .map_err(|error| io_error(current, error))?;
                Ok(size_bytes / u64::from(current.block_size))
            })
    }
}

impl ImageBdev {
    /// A bdev of `info` over `image`; within a tokio runtime, it follows the image's size
    /// from then on.
    pub fn new(info: BdevInfo, image: Image) -> Self {
        // Unique to this bdev: one of the same name made later in this process is another
        // watcher (its watch and this one's end do not mix).
        static MADE: AtomicU64 = AtomicU64::new(0);
        let watcher = format!(
            "bdev {} of pid {} on {} (#{})",
            info.name,
            std::process::id(),
            basalt_io::process::hostname().unwrap_or_else(|| "?".to_string()),
            MADE.fetch_add(1, Ordering::Relaxed)
        );
        let shared = Arc::new(Shared {
            info: ResizableInfo::new(info),
            image,
            watcher,
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            // The image is in use while the bdev lives: the monitors hear so every
            // WATCH_RENEW.
            let bdev = Arc::downgrade(&shared);
            runtime.spawn(async move {
                let every = basalt_client::WATCH_RENEW;
                let mut renew =
                    tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    renew.tick().await;
                    let Some(shared) = bdev.upgrade() else {
                        return;
                    };
                    let watch = shared.image.watch(shared.watcher.clone(), true);
                    drop(shared);
                    if let Err(error) = watch.await {
                        tracing::debug!(%error, "the image's watch was not renewed");
                    }
                }
            });
            let mut changes = shared.image.map_changes();
            let bdev = Arc::downgrade(&shared);
            runtime.spawn(async move {
                let mut refused = None;
                while changes.changed().await.is_ok() {
                    let Some(shared) = bdev.upgrade() else {
                        return;
                    };
                    let before = shared.info.get().block_count;
                    match shared.follow_size() {
                        Ok(blocks) if blocks != before => {
                            tracing::info!(bdev = %shared.info.get().name, blocks, before, "image resized");
                        }
                        Ok(_) => {}
                        Err(error) => {
                            // Once per refusal, not at every map.
                            let message = error.to_string();
                            if refused.as_ref() != Some(&message) {
                                tracing::warn!(%message, "the bdev keeps its size");
                                refused = Some(message);
                            }
                        }
                    }
                }
            });
        }
        Self { shared }
    }

    /// Tells the monitors now that this bdev uses its image (`new` has it renewed from
    /// then on); a refusal is logged, not fatal (monitors of an older version).
    pub async fn watch(&self) {
        let shared = &self.shared;
        if let Err(error) = shared.image.watch(shared.watcher.clone(), true).await {
            tracing::warn!(%error, image = shared.image.name(), "the monitors were not told the image is in use");
        }
    }
}

fn io_error(info: &BdevInfo, error: ClientError) -> BdevError {
    if let ClientError::NoSpace(message) = &error {
        // The frontend reports ENOSPC; the reason goes to the log.
        tracing::warn!(bdev = %info.name, %message, "write refused: no space");
        return info.io_error(std::io::Error::from_raw_os_error(libc_errno::ENOSPC));
    }
    let kind = match error {
        ClientError::Timeout { .. } => std::io::ErrorKind::TimedOut,
        _ => std::io::ErrorKind::Other,
    };
    info.io_error(std::io::Error::new(kind, error.to_string()))
}

impl ImageBdev {
    /// The error for `extent`'s request that the client refused with `error`. A range past
    /// the image's end (it shrank under a request the frontend checked against the size
    /// before) is out of range, which hosts do not retry, not an I/O error.
    fn refused(&self, extent: &Extent, error: ClientError) -> BdevError {
        match (&error, self.shared.image.size_bytes()) {
            (ClientError::Invalid(_), Ok(size_bytes)) if extent.end_bytes() > size_bytes => {
                BdevError::OutOfRange {
                    bdev: self.info().name.clone(),
                    offset_bytes: extent.offset_bytes(),
                    len_bytes: extent.len_bytes(),
                    size_bytes,
                }
            }
            _ => io_error(self.info(), error),
        }
    }
}

impl Bdev for ImageBdev {
    fn info(&self) -> &BdevInfo {
        self.shared.info.get()
    }

    fn volatile_cache(&self) -> bool {
        false
    }

    /// [`UNMAP_OBJECTS_MAX`] objects' worth: a discard (and a write zeroes, which
    /// discards here) is a replicated write per object.
    fn unmap_blocks_max(&self) -> Option<u64> {
        let objects = self.shared.image.object_size_bytes() * UNMAP_OBJECTS_MAX;
        Some((objects / u64::from(self.info().block_size)).max(1))
    }

    /// Takes on the image's size in the cluster map now (the bdev does so by itself when a
    /// new map arrives).
    fn rescan(&self) -> Result<u64, BdevError> {
        self.shared.follow_size()
    }

    fn read(&self, extent: Extent) -> BdevFuture<'_, DmaBuf> {
        Box::pin(async move {
            let data = self
                .shared
                .image
                .read(extent.offset_bytes(), extent.len_bytes())
                .await
                .map_err(|error| self.refused(&extent, error))?;
            Ok(DmaBuf::from_slice(&data))
        })
    }

    fn write(&self, extent: Extent, data: DmaBuf, _fua: bool) -> BdevFuture<'_, ()> {
        Box::pin(async move {
            self.shared
                .image
                .write(extent.offset_bytes(), &data[..extent.len_bytes() as usize])
                .await
                .map_err(|error| self.refused(&extent, error))
        })
    }

    fn flush(&self) -> BdevFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }

    fn write_zeroes(&self, extent: Extent, _deallocate: bool) -> BdevFuture<'_, ()> {
        self.discard(extent)
    }

    fn discard(&self, extent: Extent) -> BdevFuture<'_, ()> {
        Box::pin(async move {
            self.shared
                .image
                .discard(extent.offset_bytes(), extent.len_bytes())
                .await
                .map_err(|error| self.refused(&extent, error))
        })
    }
}
