//! The NVM command set on an I/O queue: Read, Write (FUA), Flush, Write Zeroes (with
//! deallocate) and Dataset Management (deallocate), each turned into a request on the
//! namespace's bdev. A command is checked in two steps: [`prepare`] before its data moves
//! (namespace, range, lengths), [`execute`] once the data is in.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use basalt_bdev::bdev::libc_errno;
use basalt_bdev::{Bdev, BdevError, Extent};
use basalt_io::DmaBuf;

use crate::command::*;
use crate::completion::Status;
use crate::controller::{Controller, Payload, Response};
use crate::subsystem::Namespace;

/// A command under way on a bdev.
pub type ResponseFuture = Pin<Box<dyn Future<Output = Response> + Send + 'static>>;

/// NSID meaning every namespace (Flush).
const NSID_ALL: u32 = 0xffff_ffff;
/// Bytes of one Dataset Management range.
const DSM_RANGE_SIZE: usize = 16;
/// Bytes of the most ranges one Dataset Management command holds (256).
const DSM_BUFFER_MAX: u64 = 256 * DSM_RANGE_SIZE as u64;
/// Write (and Read) CDW12 bit 30: Force Unit Access.
const FUA: u32 = 1 << 30;
/// Write Zeroes CDW12 bit 25: deallocate.
const DEALLOCATE: u32 = 1 << 25;
/// Dataset Management CDW11 bit 2: attribute deallocate.
const ATTRIBUTE_DEALLOCATE: u32 = 1 << 2;

/// A command that passed its first checks.
pub struct Prepared {
    namespaces: Vec<Arc<Namespace>>,
    /// The range of a read, write or write zeroes.
    extent: Option<Extent>,
    /// Bytes the host must send before the command can run (0: none).
    pub data_len_bytes: u32,
}

/// The ranges a Dataset Management command names (CDW10 bits 7:0, 0's based).
fn dsm_ranges(sqe: &Sqe) -> usize {
    (sqe.cdw10 & 0xff) as usize + 1
}

fn failed(sqe: &Sqe, status: Status) -> Response {
    Response::status(sqe.command_id, status)
}

/// The byte extent of SLBA (CDW10-11) and NLB (CDW12 bits 15:0, 0's based) on a
/// namespace, or the status to fail with.
fn extent(sqe: &Sqe, namespace: &Namespace, data: bool) -> Result<Extent, Status> {
    let info = namespace.bdev.info();
    let start_block = u64::from(sqe.cdw10) | (u64::from(sqe.cdw11) << 32);
    let blocks = u64::from(sqe.cdw12 & 0xffff) + 1;
    let block_size = u64::from(info.block_size);
    match start_block.checked_add(blocks) {
        Some(end) if end <= info.block_count => {}
        _ => return Err(Status::LBA_OUT_OF_RANGE.with_dnr()),
    }
    let (offset, len) = (start_block * block_size, blocks * block_size);
    let checked = if data {
        info.data_extent(offset, len)
    } else {
        info.extent(offset, len)
    };
    checked.map_err(|_| Status::INVALID_FIELD.with_dnr())
}

/// First checks of an I/O command: the namespace exists, the range is inside it, the
/// data the SGL describes is the data the command moves and at most `max_io_size`.
pub fn prepare(sqe: &Sqe, controller: &Controller) -> Result<Prepared, Response> {
    let subsystem = &controller.subsystem;
    let namespaces = if sqe.opcode == IO_FLUSH && sqe.namespace_id == NSID_ALL {
        subsystem.lock().namespaces.values().cloned().collect()
    } else {
        match subsystem.namespace(sqe.namespace_id) {
            Some(namespace) => vec![namespace],
            None => {
                return Err(failed(sqe, Status::INVALID_NAMESPACE_OR_FORMAT.with_dnr()));
            }
        }
    };
    let sgl_len = sqe.data_pointer.length;
    let mut range = None;
    let expected: u64 = match sqe.opcode {
        IO_READ | IO_WRITE => {
            let blocks = u64::from(sqe.cdw12 & 0xffff) + 1;
            let len = blocks * u64::from(namespaces[0].bdev.info().block_size);
            if len > u64::from(controller.options.max_io_size) {
                return Err(failed(sqe, Status::INVALID_FIELD.with_dnr()));
            }
            range = Some(extent(sqe, &namespaces[0], true).map_err(|status| failed(sqe, status))?);
            len
        }
        IO_DATASET_MANAGEMENT => dsm_ranges(sqe) as u64 * DSM_RANGE_SIZE as u64,
        IO_WRITE_ZEROES => {
            range = Some(extent(sqe, &namespaces[0], false).map_err(|status| failed(sqe, status))?);
            0
        }
        IO_FLUSH => 0,
        _ => return Err(failed(sqe, Status::INVALID_OPCODE.with_dnr())),
    };
    // Linux sends the buffer of every Dataset Management command whole, room for all 256
    // ranges, whatever NR says (as some devices read that much): more than NR ranges is
    // taken, up to that room, and the ranges past NR are not read.
    let length_fits = if sqe.opcode == IO_DATASET_MANAGEMENT {
        (expected..=DSM_BUFFER_MAX).contains(&u64::from(sgl_len))
    } else {
        u64::from(sgl_len) == expected
    };
    if !length_fits {
        return Err(failed(sqe, Status::DATA_SGL_LENGTH_INVALID.with_dnr()));
    }
    let host_sends = matches!(sqe.opcode, IO_WRITE | IO_DATASET_MANAGEMENT);
    Ok(Prepared {
        namespaces,
        extent: range,
        data_len_bytes: if host_sends { sgl_len } else { 0 },
    })
}

/// The status for a bdev failure.
fn bdev_status(error: &BdevError) -> Status {
    match error {
        BdevError::OutOfRange { .. } => Status::LBA_OUT_OF_RANGE.with_dnr(),
        BdevError::Misaligned { .. } | BdevError::Empty { .. } | BdevError::TooLarge { .. } => {
            Status::INVALID_FIELD.with_dnr()
        }
        _ if error.errno() == libc_errno::ENOSPC => Status::CAPACITY_EXCEEDED.with_dnr(),
        // A bdev that refuses writes.
        _ if error.errno() == libc_errno::EPERM => Status::WRITE_TO_READ_ONLY_RANGE.with_dnr(),
        // What the bdev cannot do at all (a discard on a file system without holes).
        _ if error.errno() == libc_errno::EOPNOTSUPP => Status::INVALID_OPCODE.with_dnr(),
        // An image's cluster that did not answer in time: the host may try again.
        _ if error.is_timeout() => Status::NAMESPACE_NOT_READY,
        _ => Status::INTERNAL_ERROR,
    }
}

/// Runs a prepared command with the data the host sent (empty when none).
pub fn execute(
    sqe: Sqe,
    prepared: Prepared,
    data: DmaBuf,
    controller: Arc<Controller>,
) -> ResponseFuture {
    Box::pin(async move {
        let id = sqe.command_id;
        let result = run(&sqe, &prepared, data, &controller).await;
        match result {
            Ok(response) => response,
            Err(error) => {
                controller.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(command_id = id, opcode = sqe.opcode, %error, "nvme command failed");
                Response::status(id, bdev_status(&error))
            }
        }
    })
}

async fn run(
    sqe: &Sqe,
    prepared: &Prepared,
    data: DmaBuf,
    controller: &Controller,
) -> Result<Response, BdevError> {
    let id = sqe.command_id;
    let counters = &controller.counters;
    let namespaces = &prepared.namespaces;
    let Some(namespace) = namespaces.first() else {
        // Flush of every namespace with none attached.
        return Ok(Response::status(id, Status::SUCCESS));
    };
    let bdev: &dyn Bdev = namespace.bdev.as_ref();
    match sqe.opcode {
        IO_READ => {
            let extent = prepared.extent.expect("prepare sets a read's extent");
            let buffer = bdev.read(extent).await?;
            counters.read_commands.fetch_add(1, Ordering::Relaxed);
            counters
                .bytes_read
                .fetch_add(extent.len_bytes(), Ordering::Relaxed);
            Ok(Response {
                command_id: id,
                data: Some(Payload::Buffer(buffer)),
                ..Response::default()
            })
        }
        IO_WRITE => {
            let extent = prepared.extent.expect("prepare sets a write's extent");
            // The controller reports no volatile write cache (VWC 0), so the host sends no
            // flushes: over a bdev that has one, every write is a FUA write.
            let fua = sqe.cdw12 & FUA != 0 || bdev.volatile_cache();
            bdev.write(extent, data, fua).await?;
            counters.write_commands.fetch_add(1, Ordering::Relaxed);
            counters
                .bytes_written
                .fetch_add(extent.len_bytes(), Ordering::Relaxed);
            Ok(Response::status(id, Status::SUCCESS))
        }
        IO_FLUSH => {
            for namespace in namespaces {
                namespace.bdev.flush().await?;
            }
            Ok(Response::status(id, Status::SUCCESS))
        }
        IO_WRITE_ZEROES => {
            let extent = prepared.extent.expect("prepare sets write zeroes' extent");
            bdev.write_zeroes(extent, sqe.cdw12 & DEALLOCATE != 0)
                .await?;
            if bdev.volatile_cache() {
                bdev.flush().await?;
            }
            counters.write_commands.fetch_add(1, Ordering::Relaxed);
            Ok(Response::status(id, Status::SUCCESS))
        }
        IO_DATASET_MANAGEMENT => {
            if sqe.cdw11 & ATTRIBUTE_DEALLOCATE == 0 {
                // Only hints (integral read, write): nothing to do.
                return Ok(Response::status(id, Status::SUCCESS));
            }
            let info = bdev.info();
            let mut extents = Vec::new();
            for range in data.chunks_exact(DSM_RANGE_SIZE).take(dsm_ranges(sqe)) {
                let blocks =
                    u64::from(u32::from_le_bytes(range[4..8].try_into().expect("4 bytes")));
                let start = u64::from_le_bytes(range[8..16].try_into().expect("8 bytes"));
                if blocks == 0 {
                    continue;
                }
                match start.checked_add(blocks) {
                    Some(end) if end <= info.block_count => {}
                    _ => return Ok(Response::status(id, Status::LBA_OUT_OF_RANGE.with_dnr())),
                }
                let block_size = u64::from(info.block_size);
                extents.push(info.extent(start * block_size, blocks * block_size)?);
            }
            for extent in &extents {
                bdev.discard(*extent).await?;
            }
            if !extents.is_empty() && bdev.volatile_cache() {
                bdev.flush().await?;
            }
            Ok(Response::status(id, Status::SUCCESS))
        }
        _ => Ok(Response::status(id, Status::INVALID_OPCODE.with_dnr())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bdev_failures_map_to_their_nvme_status() {
        let info = basalt_bdev::bdev::BdevInfo {
            name: "b".into(),
            uuid: String::new(),
            product_name: "test",
            block_size: 512,
            block_count: 8,
            optimal_io_boundary_blocks: 0,
        };
        let io = |error: std::io::Error| bdev_status(&info.io_error(error));
        let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "no leader");
        assert_eq!(io(timed_out), Status::NAMESPACE_NOT_READY);
        let unsupported = std::io::Error::from_raw_os_error(libc_errno::EOPNOTSUPP);
        assert_eq!(io(unsupported), Status::INVALID_OPCODE.with_dnr());
        let full = std::io::Error::from_raw_os_error(libc_errno::ENOSPC);
        assert_eq!(io(full), Status::CAPACITY_EXCEEDED.with_dnr());
        assert_eq!(io(std::io::Error::other("eio")), Status::INTERNAL_ERROR);
        let past = info.extent(8 * 512, 512).expect_err("past the end");
        assert_eq!(bdev_status(&past), Status::LBA_OUT_OF_RANGE.with_dnr());
    }
}
