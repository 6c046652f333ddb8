//! virtio-blk requests, parsed from a descriptor chain of guest memory (virtio 1.1, 5.2.6):
//! a 16-byte header the device reads (type u32, reserved u32, sector u64), then the data
//! (device-readable for writes, discard and write zeroes; device-writable for reads and
//! GET_ID), then one device-writable status byte. With VIRTIO_F_VERSION_1 the split
//! between descriptors is free, so the parser works on the chain's readable and writable
//! byte runs, not on descriptor boundaries.

use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions};

use virtio_bindings::virtio_blk as blk;

/// Request type: read.
pub const TYPE_IN: u32 = blk::VIRTIO_BLK_T_IN;
/// Request type: write.
pub const TYPE_OUT: u32 = blk::VIRTIO_BLK_T_OUT;
/// Request type: flush.
pub const TYPE_FLUSH: u32 = blk::VIRTIO_BLK_T_FLUSH;
/// Request type: the device's serial.
pub const TYPE_GET_ID: u32 = blk::VIRTIO_BLK_T_GET_ID;
/// Request type: discard.
pub const TYPE_DISCARD: u32 = blk::VIRTIO_BLK_T_DISCARD;
/// Request type: write zeroes.
pub const TYPE_WRITE_ZEROES: u32 = blk::VIRTIO_BLK_T_WRITE_ZEROES;

// The status byte holds the spec's status values, which fit it.
/// Status: success.
pub const STATUS_OK: u8 = blk::VIRTIO_BLK_S_OK as u8;
/// Status: the request failed.
pub const STATUS_IOERR: u8 = blk::VIRTIO_BLK_S_IOERR as u8;
/// Status: the request type is not supported.
pub const STATUS_UNSUPP: u8 = blk::VIRTIO_BLK_S_UNSUPP as u8;

/// Bytes of the request header.
pub const HEADER_SIZE: usize = 16;
/// Bytes of a discard / write zeroes segment.
pub const SEGMENT_SIZE: usize = 16;
/// Bytes of the GET_ID answer.
pub const ID_SIZE: usize = 20;
/// Sectors are 512 bytes whatever the block size.
pub const SECTOR_SIZE: u64 = 512;
/// Write zeroes segment flag: the device may unmap.
pub const WRITE_ZEROES_UNMAP: u32 = blk::VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP;

/// A run of guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Where it starts.
    pub address: GuestAddress,
    /// Its length in bytes.
    pub len: u32,
}

/// A request whose shape was checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The request type.
    pub kind: u32,
    /// The first sector.
    pub sector: u64,
    /// The data after the header the device reads (writes, discard, write zeroes).
    pub readable: Vec<Run>,
    /// The data the device writes, status byte excluded (reads, GET_ID).
    pub writable: Vec<Run>,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

impl Request {
    /// Bytes the device reads after the header.
    pub fn readable_len(&self) -> u64 {
        self.readable.iter().map(|run| u64::from(run.len)).sum()
    }

    /// Bytes the device may write before the status byte.
    pub fn writable_len(&self) -> u64 {
        self.writable.iter().map(|run| u64::from(run.len)).sum()
    }
}

/// Why a chain is not a request. With a status byte the request fails with
/// `STATUS_IOERR`; without one it is returned unused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// The device-readable part is shorter than the header.
    #[error("header of {0} bytes")]
    ShortHeader(u64),
    /// A readable descriptor follows a writable one.
    #[error("readable descriptor after a writable one")]
    ReadableAfterWritable,
    /// No writable byte for the status.
    #[error("no status byte")]
    NoStatus,
    /// Guest memory outside what the guest shared.
    #[error("descriptor outside guest memory")]
    OutsideMemory,
}

/// The descriptors of a chain in order: (address, length, device-writable).
pub type Descriptors = Vec<(GuestAddress, u32, bool)>;

/// Parses a request from its descriptors, reading the header from `memory`. On error,
/// returns the status byte's address when there is one.
pub fn parse<M: GuestMemory>(
    descriptors: &Descriptors,
    memory: &M,
) -> Result<Request, (ShapeError, Option<GuestAddress>)> {
    let mut readable = Vec::new();
    let mut writable: Vec<Run> = Vec::new();
    for &(address, len, write_only) in descriptors {
        if len == 0 {
            continue;
        }
        let access = if write_only {
            Permissions::Write
        } else {
            Permissions::Read
        };
        if !memory.check_range(address, len as usize, access) {
            return Err((
                ShapeError::OutsideMemory,
                last_status_byte(descriptors, memory),
            ));
        }
        let run = Run { address, len };
        if write_only {
            writable.push(run);
        } else if !writable.is_empty() {
            return Err((
                ShapeError::ReadableAfterWritable,
                status_of(&mut writable.clone()),
            ));
        } else {
            readable.push(run);
        }
    }
    let status = status_of(&mut writable);
    let Some(status) = status else {
        return Err((ShapeError::NoStatus, None));
    };
    let available: u64 = readable.iter().map(|run| u64::from(run.len)).sum();
    if available < HEADER_SIZE as u64 {
        return Err((ShapeError::ShortHeader(available), Some(status)));
    }
    let mut header = [0u8; HEADER_SIZE];
    let rest = read_runs(memory, &readable, &mut header).map_err(|error| (error, Some(status)))?;
    Ok(Request {
        kind: u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")),
        sector: u64::from_le_bytes(header[8..16].try_into().expect("8 bytes")),
        readable: rest,
        writable,
        status,
    })
}

/// The chain's status byte for a chain that failed before its runs were sorted out: the
/// last byte of its last descriptor, if that is device-writable and in guest memory (a
/// buffer outside it elsewhere in the chain still gets its `STATUS_IOERR`).
fn last_status_byte<M: GuestMemory>(descriptors: &Descriptors, memory: &M) -> Option<GuestAddress> {
    let &(address, len, write_only) = descriptors.iter().rev().find(|(_, len, _)| *len > 0)?;
    let status = address.checked_add(u64::from(len) - 1)?;
    (write_only && memory.check_range(status, 1, Permissions::Write)).then_some(status)
}

/// Takes the last writable byte off `writable` as the status byte.
fn status_of(writable: &mut Vec<Run>) -> Option<GuestAddress> {
    let last = writable.last_mut()?;
    let status = last.address.unchecked_add(u64::from(last.len) - 1);
    last.len -= 1;
    if last.len == 0 {
        writable.pop();
    }
    Some(status)
}

/// Fills `out` from the start of `runs`; returns the runs after it.
pub fn read_runs<M: GuestMemory>(
    memory: &M,
    runs: &[Run],
    out: &mut [u8],
) -> Result<Vec<Run>, ShapeError> {
    let mut filled = 0usize;
    let mut rest = Vec::new();
    for run in runs {
        let len = run.len as usize;
        if filled < out.len() {
            let take = len.min(out.len() - filled);
            memory
                .read_slice(&mut out[filled..filled + take], run.address)
                .map_err(|_| ShapeError::OutsideMemory)?;
            filled += take;
            if take < len {
                rest.push(Run {
                    address: run.address.unchecked_add(take as u64),
                    len: (len - take) as u32,
                });
            }
        } else {
            rest.push(*run);
        }
    }
    Ok(rest)
}

/// Writes `data` across `runs`, as far as they go; returns the bytes written.
pub fn write_runs<M: GuestMemory>(
    memory: &M,
    runs: &[Run],
    data: &[u8],
) -> Result<usize, ShapeError> {
    let mut written = 0usize;
    for run in runs {
        if written == data.len() {
            break;
        }
        let take = (run.len as usize).min(data.len() - written);
        memory
            .write_slice(&data[written..written + take], run.address)
            .map_err(|_| ShapeError::OutsideMemory)?;
        written += take;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn memory() -> GuestMemoryMmap<()> {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 16)]).expect("memory")
    }

    fn header(memory: &GuestMemoryMmap<()>, at: u64, kind: u32, sector: u64) {
        let mut bytes = [0u8; 16];
        bytes[0..4].copy_from_slice(&kind.to_le_bytes());
        bytes[8..16].copy_from_slice(&sector.to_le_bytes());
        memory.write_slice(&bytes, GuestAddress(at)).expect("write");
    }

    #[test]
    fn a_read_with_the_header_split_over_two_descriptors() {
        let memory = memory();
        header(&memory, 0x100, TYPE_IN, 7);
        let descriptors = vec![
            (GuestAddress(0x100), 10, false),
            (GuestAddress(0x10a), 6, false),
            (GuestAddress(0x1000), 4096, true),
            (GuestAddress(0x3000), 1, true),
        ];
        let request = parse(&descriptors, &memory).expect("a request");
        assert_eq!((request.kind, request.sector), (TYPE_IN, 7));
        assert_eq!(request.writable_len(), 4096);
        assert_eq!(request.status, GuestAddress(0x3000));
        assert!(request.readable.is_empty());
    }

    #[test]
    fn a_write_whose_data_shares_the_header_descriptor_and_status_shares_the_last() {
        let memory = memory();
        header(&memory, 0x100, TYPE_OUT, 3);
        memory
            .write_slice(&[9u8; 512], GuestAddress(0x110))
            .expect("data");
        let descriptors = vec![
            (GuestAddress(0x100), 16 + 512, false),
            (GuestAddress(0x2000), 1, true),
        ];
        let request = parse(&descriptors, &memory).expect("a request");
        assert_eq!(
            request.readable,
            vec![Run {
                address: GuestAddress(0x110),
                len: 512
            }]
        );
        let mut data = [0u8; 512];
        read_runs(&memory, &request.readable, &mut data).expect("read");
        assert_eq!(data, [9u8; 512]);
        // A read whose status byte ends its data descriptor.
        header(&memory, 0x100, TYPE_IN, 0);
        let descriptors = vec![
            (GuestAddress(0x100), 16, false),
            (GuestAddress(0x1000), 513, true),
        ];
        let request = parse(&descriptors, &memory).expect("a request");
        assert_eq!(request.writable_len(), 512);
        assert_eq!(request.status, GuestAddress(0x1200));
    }

    #[test]
    fn chains_of_the_wrong_shape_are_refused() {
        let memory = memory();
        header(&memory, 0x100, TYPE_IN, 0);
        let short = vec![
            (GuestAddress(0x100), 8, false),
            (GuestAddress(0x2000), 1, true),
        ];
        assert_eq!(
            parse(&short, &memory).map_err(|e| e.0),
            Err(ShapeError::ShortHeader(8))
        );
        let no_status = vec![(GuestAddress(0x100), 16, false)];
        assert_eq!(
            parse(&no_status, &memory),
            Err((ShapeError::NoStatus, None))
        );
        let outside = vec![
            (GuestAddress(0x100), 16, false),
            (GuestAddress(1 << 20), 1, true),
        ];
        assert_eq!(
            parse(&outside, &memory),
            Err((ShapeError::OutsideMemory, None))
        );
        // A data buffer outside, the status byte inside: the request fails with a status.
        let outside_data = vec![
            (GuestAddress(0x100), 16, false),
            (GuestAddress(1 << 20), 512, true),
            (GuestAddress(0x2000), 1, true),
        ];
        assert_eq!(
            parse(&outside_data, &memory),
            Err((ShapeError::OutsideMemory, Some(GuestAddress(0x2000))))
        );
        let backwards = vec![
            (GuestAddress(0x100), 16, false),
            (GuestAddress(0x2000), 1, true),
            (GuestAddress(0x3000), 512, false),
        ];
        assert_eq!(
            parse(&backwards, &memory).map_err(|e| e.0),
            Err(ShapeError::ReadableAfterWritable)
        );
    }
}
