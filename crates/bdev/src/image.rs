//! The image kind: a Basalt image through the client library.
//!
//! Every acknowledged write is already durable on a majority of replicas, so a flush has
//! nothing to wait for beyond the writes in flight (which the frontend already waits for);
//! write zeroes and discard both discard, since discarded ranges read as zeroes.

use basalt_client::{ClientError, Image};
use basalt_io::DmaBuf;

use crate::bdev::{Bdev, BdevError, BdevFuture, BdevInfo, Extent, libc_errno};

/// The product name of image bdevs.
pub const PRODUCT_NAME: &str = "Basalt image";

/// A bdev over a Basalt image.
pub struct ImageBdev {
    info: BdevInfo,
    /// Holds the cluster connection alive as well.
    image: Image,
}

impl ImageBdev {
    /// A bdev of `info` over `image`.
    pub fn new(info: BdevInfo, image: Image) -> Self {
        Self { info, image }
    }
}

fn io_error(info: &BdevInfo, error: ClientError) -> BdevError {
    if let ClientError::NoSpace(message) = &error {
        // The frontend reports ENOSPC; the reason goes to the log.
        tracing::warn!(bdev = %info.name, %message, "write refused: no space");
        return info.io_error(std::io::Error::from_raw_os_error(libc_errno::ENOSPC));
    }
    let kind = match error {
        ClientError::Invalid(_) => std::io::ErrorKind::InvalidInput,
        ClientError::Timeout { .. } => std::io::ErrorKind::TimedOut,
        _ => std::io::ErrorKind::Other,
    };
    info.io_error(std::io::Error::new(kind, error.to_string()))
}

impl Bdev for ImageBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }

    fn read(&self, extent: Extent) -> BdevFuture<'_, DmaBuf> {
        Box::pin(async move {
            let data = self
                .image
                .read(extent.offset_bytes(), extent.len_bytes())
                .await
                .map_err(|error| io_error(&self.info, error))?;
            Ok(DmaBuf::from_slice(&data))
        })
    }

    fn write(&self, extent: Extent, data: DmaBuf, _fua: bool) -> BdevFuture<'_, ()> {
        Box::pin(async move {
            self.image
                .write(extent.offset_bytes(), &data[..extent.len_bytes() as usize])
                .await
                .map_err(|error| io_error(&self.info, error))
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
            self.image
                .discard(extent.offset_bytes(), extent.len_bytes())
                .await
                .map_err(|error| io_error(&self.info, error))
        })
    }
}
