//! What a benchmark measures: an in-process bdev, or an NBD export through one connection
//! per worker (so the server sees `workers` connections, as fio's nbd engine makes).

use std::io;
use std::sync::Arc;

use basalt_bdev::Bdev;
use basalt_io::DmaBuf;
use basalt_nbd::{NbdClient, NbdUri};

/// A device under test.
pub enum Device {
    /// A bdev in this process.
    Bdev(Arc<dyn Bdev>),
    /// NBD connections, one per worker.
    Nbd(Vec<Arc<NbdClient>>),
}

impl Device {
    /// Opens `workers` connections to an NBD export.
    pub async fn connect_nbd(uri: &NbdUri, workers: usize) -> io::Result<Self> {
        let mut clients = Vec::with_capacity(workers);
        for _ in 0..workers.max(1) {
            clients.push(Arc::new(NbdClient::connect(uri).await?));
        }
        Ok(Device::Nbd(clients))
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        match self {
            Device::Bdev(bdev) => bdev.info().size_bytes(),
            Device::Nbd(clients) => clients[0].size_bytes(),
        }
    }

    /// The smallest request size the device accepts.
    pub fn block_size_min(&self) -> u64 {
        match self {
            Device::Bdev(bdev) => u64::from(bdev.info().block_size),
            Device::Nbd(clients) => u64::from(clients[0].block_size_min()),
        }
    }

    /// A handle for one worker.
    pub fn for_worker(&self, worker: usize) -> WorkerDevice {
        match self {
            Device::Bdev(bdev) => WorkerDevice::Bdev(bdev.clone()),
            Device::Nbd(clients) => WorkerDevice::Nbd(clients[worker % clients.len()].clone()),
        }
    }
}

/// One worker's way to the device.
#[derive(Clone)]
pub enum WorkerDevice {
    /// A bdev in this process.
    Bdev(Arc<dyn Bdev>),
    /// One NBD connection.
    Nbd(Arc<NbdClient>),
}

/// Bytes read, in whichever buffer the device returned.
pub enum ReadData {
    /// From a bdev.
    Dma(DmaBuf),
    /// From NBD.
    Vec(Vec<u8>),
}

impl std::ops::Deref for ReadData {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            ReadData::Dma(data) => data,
            ReadData::Vec(data) => data,
        }
    }
}

impl WorkerDevice {
    /// Reads `len_bytes` at `offset_bytes`.
    pub async fn read(&self, offset_bytes: u64, len_bytes: u64) -> io::Result<ReadData> {
        match self {
            WorkerDevice::Bdev(bdev) => {
                let extent = bdev
                    .info()
                    .data_extent(offset_bytes, len_bytes)
                    .map_err(io::Error::other)?;
                bdev.read(extent)
                    .await
                    .map(ReadData::Dma)
                    .map_err(io::Error::other)
            }
            WorkerDevice::Nbd(client) => {
                let len = u32::try_from(len_bytes).map_err(io::Error::other)?;
                client.read(offset_bytes, len).await.map(ReadData::Vec)
            }
        }
    }

    /// Writes `data` at `offset_bytes`.
    pub async fn write(&self, offset_bytes: u64, data: DmaBuf) -> io::Result<()> {
        match self {
            WorkerDevice::Bdev(bdev) => {
                let extent = bdev
                    .info()
                    .data_extent(offset_bytes, data.len() as u64)
                    .map_err(io::Error::other)?;
                bdev.write(extent, data, false)
                    .await
                    .map_err(io::Error::other)
            }
            WorkerDevice::Nbd(client) => client.write(offset_bytes, &data, false).await,
        }
    }
}
