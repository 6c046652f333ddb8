//! What a benchmark measures: an in-process bdev, an NBD export through one connection
//! per worker, an NVMe/TCP namespace through one I/O queue per worker (so the server sees `workers` connections, as fio's nbd engine makes), or an
//! OSD log device (each write is one durable append; it shows what group commit buys).

use std::io;
use std::sync::Arc;

use basalt_bdev::Bdev;
use basalt_client::Image;
use basalt_common::{PgId, PoolId};
use basalt_io::DmaBuf;
use basalt_nbd::{NbdClient, NbdUri};
use basalt_nvmf::host::{Host, HostOptions, NvmfUri};
use basalt_osd::log_device::LogDevice;
use basalt_store::batch::{BLOCK_SIZE, Entry, META_SIZE};

/// A device under test.
pub enum Device {
    /// A bdev in this process.
    Bdev(Arc<dyn Bdev>),
    /// NBD connections, one per worker.
    Nbd(Vec<Arc<NbdClient>>),
    /// An OSD log device: writes only.
    Log(Arc<LogDevice>),
    /// A Basalt image through the native client.
    Image(Arc<Image>),
    /// A namespace over NVMe/TCP, one I/O queue per worker.
    Nvmf(Arc<NvmfNamespace>),
}

/// A namespace of a connected NVMe/TCP controller.
pub struct NvmfNamespace {
    host: Host,
    nsid: u32,
    block_size: u32,
    block_count: u64,
}

/// The span of offsets a log device is driven over (appends have no address; the offset
/// only names the PG and object an entry would belong to).
pub const LOG_SPAN_BYTES: u64 = 1 << 30;

impl Device {
    /// Opens `workers` connections to an NBD export.
    pub async fn connect_nbd(uri: &NbdUri, workers: usize) -> io::Result<Self> {
        let mut clients = Vec::with_capacity(workers);
        for _ in 0..workers.max(1) {
            clients.push(Arc::new(NbdClient::connect(uri).await?));
        }
        Ok(Device::Nbd(clients))
    }

    /// Connects one I/O queue per worker, each `iodepth` deep, to the first namespace of
    /// the subsystem at `uri`.
    pub async fn connect_nvmf(uri: &NvmfUri, workers: usize, iodepth: usize) -> io::Result<Self> {
        let options = HostOptions {
            io_queues: u16::try_from(workers.max(1)).map_err(io::Error::other)?,
            queue_depth: u16::try_from(iodepth + 1).unwrap_or(u16::MAX).clamp(2, 128),
            ..HostOptions::default()
        };
        let host = Host::connect(uri.address, &uri.nqn, options)
            .await
            .map_err(io::Error::other)?;
        let nsid = *host
            .namespaces()
            .await
            .map_err(io::Error::other)?
            .first()
            .ok_or_else(|| io::Error::other(format!("subsystem {} has no namespace", uri.nqn)))?;
        let (block_size, block_count) = host
            .namespace_geometry(nsid)
            .await
            .map_err(io::Error::other)?;
        Ok(Device::Nvmf(Arc::new(NvmfNamespace {
            host,
            nsid,
            block_size,
            block_count,
        })))
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        match self {
            Device::Bdev(bdev) => bdev.info().size_bytes(),
            Device::Nbd(clients) => clients[0].size_bytes(),
            Device::Log(_) => LOG_SPAN_BYTES,
            Device::Image(image) => image.size_bytes().unwrap_or(0),
            Device::Nvmf(namespace) => namespace.block_count * u64::from(namespace.block_size),
        }
    }

    /// The smallest request size the device accepts.
    pub fn block_size_min(&self) -> u64 {
        match self {
            Device::Bdev(bdev) => u64::from(bdev.info().block_size),
            Device::Nbd(clients) => u64::from(clients[0].block_size_min()),
            Device::Log(_) => BLOCK_SIZE as u64,
            Device::Image(_) => 512,
            Device::Nvmf(namespace) => u64::from(namespace.block_size),
        }
    }

    /// A handle for one worker.
    pub fn for_worker(&self, worker: usize) -> WorkerDevice {
        match self {
            Device::Bdev(bdev) => WorkerDevice::Bdev(bdev.clone()),
            Device::Nbd(clients) => WorkerDevice::Nbd(clients[worker % clients.len()].clone()),
            Device::Log(log) => WorkerDevice::Log(log.clone()),
            Device::Image(image) => WorkerDevice::Image(image.clone()),
            Device::Nvmf(namespace) => WorkerDevice::Nvmf(namespace.clone(), worker),
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
    /// An OSD log device.
    Log(Arc<LogDevice>),
    /// A Basalt image through the native client.
    Image(Arc<Image>),
    /// A namespace over NVMe/TCP, and the worker's I/O queue.
    Nvmf(Arc<NvmfNamespace>, usize),
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
            WorkerDevice::Image(image) => image
                .read(offset_bytes, len_bytes)
                .await
                .map(ReadData::Vec)
                .map_err(io::Error::other),
            WorkerDevice::Nvmf(namespace, queue) => {
                let blocks = u32::try_from(len_bytes / u64::from(namespace.block_size))
                    .map_err(io::Error::other)?;
                let lba = offset_bytes / u64::from(namespace.block_size);
                namespace
                    .host
                    .read(*queue, namespace.nsid, lba, blocks, namespace.block_size)
                    .await
                    .map(ReadData::Vec)
                    .map_err(io::Error::other)
            }
            WorkerDevice::Log(_) => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "an osd log device is only written",
            )),
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
            WorkerDevice::Image(image) => image
                .write(offset_bytes, &data)
                .await
                .map_err(io::Error::other),
            WorkerDevice::Nvmf(namespace, queue) => {
                let lba = offset_bytes / u64::from(namespace.block_size);
                namespace
                    .host
                    .write(
                        *queue,
                        namespace.nsid,
                        lba,
                        data.to_vec(),
                        namespace.block_size,
                        false,
                    )
                    .await
                    .map_err(io::Error::other)
            }
            WorkerDevice::Log(log) => {
                let block = offset_bytes / BLOCK_SIZE as u64;
                let mut meta = [0u8; META_SIZE];
                meta[..8].copy_from_slice(&offset_bytes.to_le_bytes());
                let entry = Entry {
                    kind: 1,
                    pg: PgId {
                        pool: PoolId(0),
                        index: (block % 128) as u32,
                    },
                    term: 1,
                    index: block,
                    meta,
                    data: data.to_vec(),
                };
                log.submit(vec![entry])
                    .await
                    .map(drop)
                    .map_err(io::Error::other)
            }
        }
    }
}
