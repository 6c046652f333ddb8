//! The data structures the controller returns: Identify (controller, namespace, active
//! namespace list, namespace identification descriptors) and log pages (error
//! information, SMART / health, firmware slot, changed namespace list, commands supported
//! and effects, discovery). Byte offsets follow the NVMe base specification 1.4 and NVMe
//! over Fabrics 1.1; all integers little-endian, text fields ASCII padded with spaces.

use crate::command::*;
use crate::layout::{put_u16, put_u32, put_u64};
use crate::subsystem::{ListenAddress, Namespace, TransportOptions};

/// Bytes of every Identify data structure.
pub const IDENTIFY_SIZE: usize = 4096;
/// The NVMe version reported (VS and Identify Controller VER): 1.3.0.
pub const NVME_VERSION: u32 = 0x0001_0300;
/// Asynchronous event requests a controller holds at once (AERL + 1).
pub const ASYNC_EVENT_REQUESTS_MAX: usize = 4;
/// Namespace ids the changed namespace list holds before it overflows.
pub const CHANGED_NAMESPACES_MAX: usize = 1024;
/// Bytes of the discovery log page header, and of each of its entries.
pub const DISCOVERY_RECORD_SIZE: usize = 1024;
/// The firmware revision reported (Identify Controller FR and the firmware slot log).
pub const FIRMWARE_REVISION: &[u8; 8] = b"basalt01";
/// Keep Alive granularity reported in KAS, in 100 ms units.
const KEEP_ALIVE_GRANULARITY_100MS: u16 = 1;

/// Identify Controller CNTRLTYPE: an I/O controller.
pub const CONTROLLER_TYPE_IO: u8 = 1;
/// Identify Controller CNTRLTYPE: a discovery controller.
pub const CONTROLLER_TYPE_DISCOVERY: u8 = 2;

/// OAES and Asynchronous Event Configuration bit: namespace attribute notices.
pub const ASYNC_EVENT_NAMESPACE_ATTRIBUTE: u32 = 1 << 8;
/// ONCS: Dataset Management.
pub const ONCS_DATASET_MANAGEMENT: u16 = 1 << 2;
/// ONCS: Write Zeroes.
pub const ONCS_WRITE_ZEROES: u16 = 1 << 3;

/// Namespace identification descriptor types (NIDT).
pub const NIDT_NGUID: u8 = 0x2;
/// NIDT: a UUID.
pub const NIDT_UUID: u8 = 0x3;
/// NIDT: the command set identifier.
pub const NIDT_CSI: u8 = 0x4;

/// What Identify Controller reports that is not the subsystem's.
#[derive(Debug, Clone, Copy)]
pub struct ControllerFacts {
    /// The controller id.
    pub controller_id: u16,
    /// I/O controller or discovery controller.
    pub controller_type: u8,
    /// The transport's options (MDTS, MAXCMD, IOCCSZ).
    pub options: TransportOptions,
}

fn put_text(page: &mut [u8], offset: usize, size: usize, text: &str) {
    let field = &mut page[offset..offset + size];
    field.fill(b' ');
    let bytes = text.as_bytes();
    let len = bytes.len().min(size);
    field[..len].copy_from_slice(&bytes[..len]);
}

fn put_nul_terminated(page: &mut [u8], offset: usize, size: usize, text: &str) {
    let bytes = text.as_bytes();
    let len = bytes.len().min(size - 1);
    page[offset..offset + len].copy_from_slice(&bytes[..len]);
}

/// Identify Controller (CNS 01h).
pub fn controller(
    facts: &ControllerFacts,
    subsystem_nqn: &str,
    serial_number: &str,
    model_number: &str,
    max_namespaces: u32,
) -> Vec<u8> {
    let mut page = vec![0u8; IDENTIFY_SIZE];
    let options = &facts.options;
    // VID and SSVID stay 0: no PCI vendor.
    put_text(&mut page, 4, 20, serial_number);
    put_text(&mut page, 24, 40, model_number);
    page[64..72].copy_from_slice(FIRMWARE_REVISION);
    page[72] = 6; // RAB: 64 commands
    // CMIC bit 1: a subsystem may have several controllers (one per host connection).
    page[76] = 1 << 1;
    page[77] = options.mdts();
    put_u16(&mut page, 78, facts.controller_id);
    put_u32(&mut page, 80, NVME_VERSION);
    let io = facts.controller_type == CONTROLLER_TYPE_IO;
    if io {
        put_u32(&mut page, 92, ASYNC_EVENT_NAMESPACE_ATTRIBUTE); // OAES
    }
    page[111] = facts.controller_type;
    // OACS 0: no optional admin commands (no namespace management, format, firmware).
    page[258] = 3; // ACL: 4 aborts
    page[259] = (ASYNC_EVENT_REQUESTS_MAX - 1) as u8; // AERL, 0's based
    // LPA: extended Get Log Page (bit 2); an I/O controller serves the commands supported
    // and effects log too (bit 1). A discovery controller serves no other pages (the
    // discovery and error logs), and its FRMW is reserved (no firmware slot log).
    page[261] = 1 << 2;
    if io {
        page[260] = 0b011; // FRMW: slot 1 read-only, 1 slot
        page[261] |= 1 << 1;
    }
    page[262] = (ERROR_LOG_ENTRIES - 1) as u8; // ELPE: error log entries, 0's based
    put_u16(&mut page, 320, KEEP_ALIVE_GRANULARITY_100MS); // KAS
    page[512] = 0x66; // SQES: 64-byte entries
    page[513] = 0x44; // CQES: 16-byte entries
    put_u16(&mut page, 514, options.max_queue_depth); // MAXCMD
    if io {
        put_u32(&mut page, 516, max_namespaces); // NN
        put_u16(&mut page, 520, ONCS_DATASET_MANAGEMENT | ONCS_WRITE_ZEROES);
    }
    // VWC 0: no volatile write cache (a write is durable when it completes; over a bdev
    // that has one, writes are FUA writes and zeroing is flushed, see io_command).
    // SGLS: SGLs supported (bits 1:0 = 01b), offsets in SGL addresses (bit 20).
    put_u32(&mut page, 536, 1 | (1 << 20));
    put_nul_terminated(&mut page, 768, 256, subsystem_nqn);
    // Fabrics: IOCCSZ counts 16-byte units of SQE plus in-capsule data; IORCSZ one CQE.
    let ioccsz = (64 + options.in_capsule_data_size) / 16;
    put_u32(&mut page, 1792, ioccsz);
    put_u32(&mut page, 1796, 1);
    // ICDOFF 0, CTRATTR 0 (dynamic controllers), MSDBD 1.
    page[1803] = 1;
    // Power state 0: MP (centiwatts) left at 0, the state is operational.
    page
}

/// Identify Namespace (CNS 00h) for `namespace`.
pub fn namespace(namespace: &Namespace) -> Vec<u8> {
    let mut page = vec![0u8; IDENTIFY_SIZE];
    let info = namespace.bdev.info();
    let blocks = info.block_count;
    page[0..8].copy_from_slice(&blocks.to_le_bytes()); // NSZE
    page[8..16].copy_from_slice(&blocks.to_le_bytes()); // NCAP
    page[16..24].copy_from_slice(&blocks.to_le_bytes()); // NUSE
    page[24] = 1; // NSFEAT: thin provisioning
    page[25] = 0; // NLBAF: one format, 0's based
    page[26] = 0; // FLBAS: format 0, no metadata
    page[30] = 1; // NMIC: may be attached to several controllers
    // DLFEAT: deallocated blocks read as zeroes (bits 2:0 = 001b), Write Zeroes may
    // deallocate (bit 3).
    page[33] = 0b1001;
    let boundary = info.optimal_io_boundary_blocks.min(u32::from(u16::MAX)) as u16;
    put_u16(&mut page, 46, boundary); // NOIOB
    page[104..120].copy_from_slice(&namespace.nguid);
    // LBA format 0: no metadata, LBADS = log2 of the block size.
    page[130] = info.block_size.trailing_zeros() as u8;
    page
}

/// The NVM command set's Identify Controller (CNS 06h, CSI 0; NVM Command Set
/// specification, figure "I/O Command Set Specific Identify Controller"): the Dataset
/// Management limits where some namespace has one ([`Bdev::unmap_blocks_max`]), the
/// lowest of them in each namespace's own blocks (Linux reads DMRSL as that namespace's
/// limit per command); zeroes, no limit, otherwise.
///
/// [`Bdev::unmap_blocks_max`]: basalt_bdev::Bdev::unmap_blocks_max
pub fn nvm_controller<'a>(namespaces: impl IntoIterator<Item = &'a Namespace>) -> Vec<u8> {
    let mut page = vec![0u8; IDENTIFY_SIZE];
    let limit = namespaces
        .into_iter()
        .filter_map(|namespace| namespace.bdev.unmap_blocks_max())
        .min();
    if let Some(blocks) = limit {
        let blocks = blocks.clamp(1, u64::from(u32::MAX));
        put_u32(&mut page, 4, blocks as u32); // DMRSL: blocks per range
        put_u64(&mut page, 8, blocks); // DMSL: blocks per command
    }
    page
}

/// Active Namespace ID list (CNS 02h): the ids above `after`, ascending, at most 1024.
pub fn active_namespaces(nsids: impl IntoIterator<Item = u32>, after: u32) -> Vec<u8> {
    let mut page = vec![0u8; IDENTIFY_SIZE];
    for (slot, nsid) in nsids
        .into_iter()
        .filter(|nsid| *nsid > after)
        .take(IDENTIFY_SIZE / 4)
        .enumerate()
    {
        put_u32(&mut page, slot * 4, nsid);
    }
    page
}

/// Namespace Identification Descriptor list (CNS 03h): NGUID, UUID and the NVM command
/// set.
pub fn namespace_descriptors(namespace: &Namespace) -> Vec<u8> {
    let mut page = vec![0u8; IDENTIFY_SIZE];
    let mut at = 0;
    for (kind, id) in [
        (NIDT_NGUID, &namespace.nguid[..]),
        (NIDT_UUID, &namespace.uuid[..]),
        (NIDT_CSI, &[0u8][..]),
    ] {
        page[at] = kind;
        page[at + 1] = id.len() as u8;
        page[at + 4..at + 4 + id.len()].copy_from_slice(id);
        at += 4 + id.len();
    }
    page
}

/// The commands supported and effects log page (05h): CSUPP for every command this
/// target runs, LBCC (bit 1) on those that change the namespace's contents.
pub fn command_effects() -> Vec<u8> {
    let mut page = vec![0u8; 4096];
    let supported = 1u32;
    let changes_content = supported | (1 << 1);
    for opcode in [
        ADMIN_GET_LOG_PAGE,
        ADMIN_IDENTIFY,
        ADMIN_ABORT,
        ADMIN_SET_FEATURES,
        ADMIN_GET_FEATURES,
        ADMIN_ASYNC_EVENT_REQUEST,
        ADMIN_KEEP_ALIVE,
    ] {
        put_u32(&mut page, usize::from(opcode) * 4, supported);
    }
    put_u32(&mut page, 1024 + usize::from(IO_FLUSH) * 4, supported);
    put_u32(&mut page, 1024 + usize::from(IO_READ) * 4, supported);
    for opcode in [IO_WRITE, IO_WRITE_ZEROES, IO_DATASET_MANAGEMENT] {
        put_u32(&mut page, 1024 + usize::from(opcode) * 4, changes_content);
    }
    page
}

/// The SMART / health log page (02h): no warnings, spare 100%, a plausible temperature;
/// data units and commands as counted by the controller.
pub fn health(counters: &HealthCounters) -> Vec<u8> {
    let mut page = vec![0u8; 512];
    page[0] = 0; // critical warning: none
    put_u16(&mut page, 1, 273 + 25); // composite temperature, kelvin
    page[3] = 100; // available spare
    page[4] = 10; // spare threshold
    page[5] = 0; // percentage used
    // Data units are thousands of 512-byte units, rounded up.
    let units = |bytes: u64| bytes.div_ceil(512_000);
    page[32..40].copy_from_slice(&units(counters.bytes_read).to_le_bytes());
    page[48..56].copy_from_slice(&units(counters.bytes_written).to_le_bytes());
    page[64..72].copy_from_slice(&counters.read_commands.to_le_bytes());
    page[80..88].copy_from_slice(&counters.write_commands.to_le_bytes());
    page[112..120].copy_from_slice(&1u64.to_le_bytes()); // power cycles
    page[160..168].copy_from_slice(&counters.errors.to_le_bytes()); // media errors
    // Number of error information log entries over the controller's life.
    page[176..184].copy_from_slice(&counters.error_log_entries.to_le_bytes());
    page
}

/// Entries the error information log page (01h) holds.
pub const ERROR_LOG_ENTRIES: usize = 64;

/// A command that completed with an error, as the error information log page reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorEntry {
    /// Error count: this error's number on the controller, from 1.
    pub count: u64,
    /// The command's submission queue.
    pub sqid: u16,
    /// The command's identifier.
    pub command_id: u16,
    /// Its completion status (bits 15:1 of the status field).
    pub status: u16,
    /// The first LBA of a read, write or write zeroes; 0 for other commands.
    pub lba: u64,
    /// The command's namespace.
    pub nsid: u32,
}

/// The error information log page (01h), NVMe 1.3 layout: [`ERROR_LOG_ENTRIES`] entries
/// of 64 bytes, `newest_first` then zeroes (an error count of 0 marks no entry). The
/// parameter error location is not tracked (FFFFh).
pub fn error_log<'a>(newest_first: impl IntoIterator<Item = &'a ErrorEntry>) -> Vec<u8> {
    let mut page = vec![0u8; ERROR_LOG_ENTRIES * 64];
    for (slot, entry) in page.chunks_exact_mut(64).zip(newest_first) {
        put_u64(slot, 0, entry.count);
        put_u16(slot, 8, entry.sqid);
        put_u16(slot, 10, entry.command_id);
        put_u16(slot, 12, entry.status);
        put_u16(slot, 14, 0xffff);
        put_u64(slot, 16, entry.lba);
        put_u32(slot, 24, entry.nsid);
    }
    page
}

/// Counts behind the health log page.
#[derive(Debug, Clone, Copy, Default)]
pub struct HealthCounters {
    /// Bytes read by hosts.
    pub bytes_read: u64,
    /// Bytes written by hosts.
    pub bytes_written: u64,
    /// Read commands completed.
    pub read_commands: u64,
    /// Write commands completed.
    pub write_commands: u64,
    /// Commands that failed in the bdev.
    pub errors: u64,
    /// Entries the error log ever took (commands that completed with an error).
    pub error_log_entries: u64,
}

/// The firmware slot information log page (03h): slot 1 active.
pub fn firmware_slots() -> Vec<u8> {
    let mut page = vec![0u8; 512];
    page[0] = 1; // AFI: slot 1 active
    page[8..16].copy_from_slice(FIRMWARE_REVISION);
    page
}

/// The changed namespace list log page (04h): the ids, or 0xffffffff first when more
/// changed than it holds.
pub fn changed_namespaces(nsids: &[u32], overflowed: bool) -> Vec<u8> {
    let mut page = vec![0u8; CHANGED_NAMESPACES_MAX * 4];
    if overflowed {
        put_u32(&mut page, 0, u32::MAX);
    } else {
        for (slot, nsid) in nsids.iter().take(CHANGED_NAMESPACES_MAX).enumerate() {
            put_u32(&mut page, slot * 4, *nsid);
        }
    }
    page
}

/// One record of the discovery log page.
#[derive(Debug, Clone)]
pub struct DiscoveryRecord {
    /// Where the subsystem listens.
    pub address: ListenAddress,
    /// The subsystem's NQN.
    pub subsystem_nqn: String,
    /// SUBTYPE: 2 for an NVM subsystem, 3 for the discovery subsystem itself.
    pub subsystem_type: u8,
    /// PORTID.
    pub port_id: u16,
}

/// SUBTYPE of a discovery record: an NVM subsystem.
pub const SUBTYPE_NVME: u8 = 2;
/// SUBTYPE of a discovery record: the current discovery subsystem.
pub const SUBTYPE_CURRENT_DISCOVERY: u8 = 3;

/// The discovery log page (70h): header (GENCTR, NUMREC, RECFMT) and one 1024-byte
/// entry per record.
pub fn discovery(generation: u64, records: &[DiscoveryRecord]) -> Vec<u8> {
    let mut page = vec![0u8; DISCOVERY_RECORD_SIZE * (1 + records.len())];
    page[0..8].copy_from_slice(&generation.to_le_bytes());
    page[8..16].copy_from_slice(&(records.len() as u64).to_le_bytes());
    for (index, record) in records.iter().enumerate() {
        let entry = &mut page[DISCOVERY_RECORD_SIZE * (index + 1)..][..DISCOVERY_RECORD_SIZE];
        entry[0] = 3; // TRTYPE: TCP
        entry[1] = record.address.family().code();
        entry[2] = record.subsystem_type;
        entry[3] = 0b10; // TREQ: secure channel not required
        put_u16(entry, 4, record.port_id);
        put_u16(entry, 6, 0xffff); // CNTLID: dynamic
        put_u16(entry, 8, 32); // ASQSZ
        put_text(entry, 32, 32, &record.address.trsvcid());
        put_nul_terminated(entry, 256, 256, &record.subsystem_nqn);
        put_text(entry, 512, 256, &record.address.traddr());
        // TSAS for TCP: SECTYPE 0, no security.
    }
    page
}

/// The part of a log page a Get Log Page asks for: `len` bytes from `offset`, zero-filled
/// past the page's end.
pub fn log_page_slice(page: &[u8], offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    if let Ok(start) = usize::try_from(offset)
        && start < page.len()
    {
        let available = (page.len() - start).min(len);
        out[..available].copy_from_slice(&page[start..start + available]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn test_namespace() -> Namespace {
        Namespace {
            nsid: 1,
            bdev_name: "m".into(),
            bdev: Arc::new(basalt_bdev::malloc::MallocBdev::new_named("m", 4096, 256)),
            uuid: [7; 16],
            nguid: [9; 16],
            announced_blocks: 256.into(),
        }
    }

    /// DMRSL and DMSL: the lowest limit of the namespaces that have one, in blocks, within
    /// DMRSL's 32 bits; zeroes when none has one.
    #[test]
    fn dataset_management_limits_are_the_lowest_of_the_namespaces() {
        use basalt_bdev::gated::{Gated, Held};
        let namespace = |nsid: u32, limit: Option<u64>| {
            let malloc = basalt_bdev::malloc::MallocBdev::new_named("m", 512, 256);
            Namespace {
                nsid,
                bdev: Arc::new(Gated::new(Box::new(malloc), Held::default()).limit_unmaps(limit)),
                ..test_namespace()
            }
        };
        let limits = |page: Vec<u8>| {
            let dmrsl = u32::from_le_bytes(page[4..8].try_into().expect("4"));
            let dmsl = u64::from_le_bytes(page[8..16].try_into().expect("8"));
            (dmrsl, dmsl)
        };
        let none = [namespace(1, None), namespace(2, None)];
        assert_eq!(limits(nvm_controller(&none)), (0, 0));
        let some = [
            namespace(1, None),
            namespace(2, Some(9000)),
            namespace(3, Some(700)),
        ];
        assert_eq!(limits(nvm_controller(&some)), (700, 700));
        let huge = [namespace(1, Some(1 << 40))];
        assert_eq!(
            limits(nvm_controller(&huge)),
            (u32::MAX, u64::from(u32::MAX))
        );
    }

    #[test]
    fn controller_fields_sit_where_linux_reads_them() {
        let facts = ControllerFacts {
            controller_id: 0x1234,
            controller_type: CONTROLLER_TYPE_IO,
            options: TransportOptions::default(),
        };
        let page = controller(&facts, "nqn.2016-06.io.spdk:a", "SN1", "Model", 32);
        assert_eq!(page.len(), 4096);
        assert_eq!(&page[4..8], b"SN1 ");
        assert_eq!(&page[24..30], b"Model ");
        assert_eq!(page[77], 5, "MDTS of 128 KiB");
        assert_eq!(u16::from_le_bytes([page[78], page[79]]), 0x1234);
        assert_eq!(
            u32::from_le_bytes(page[80..84].try_into().expect("in range")),
            NVME_VERSION
        );
        assert_eq!(page[111], CONTROLLER_TYPE_IO);
        assert_eq!(u16::from_le_bytes([page[514], page[515]]), 128, "MAXCMD");
        assert_eq!(
            u32::from_le_bytes(page[516..520].try_into().expect("in range")),
            32,
            "NN"
        );
        assert_eq!(page[536] & 3, 1, "SGLs supported");
        assert_eq!(&page[768..789], b"nqn.2016-06.io.spdk:a");
        assert_eq!(page[789], 0);
        assert_eq!(
            u32::from_le_bytes(page[1792..1796].try_into().expect("in range")),
            (64 + 4096) / 16,
            "IOCCSZ"
        );
        assert_eq!(page[1803], 1, "MSDBD");
    }

    #[test]
    fn namespace_pages() {
        let ns = test_namespace();
        let page = namespace(&ns);
        assert_eq!(
            u64::from_le_bytes(page[0..8].try_into().expect("in range")),
            256
        );
        assert_eq!(page[130], 12, "4096-byte blocks");
        assert_eq!(&page[104..120], &[9; 16]);
        let descriptors = namespace_descriptors(&ns);
        assert_eq!(&descriptors[0..4], &[NIDT_NGUID, 16, 0, 0]);
        assert_eq!(&descriptors[20..24], &[NIDT_UUID, 16, 0, 0]);
        assert_eq!(&descriptors[24..40], &[7; 16]);
        assert_eq!(&descriptors[40..45], &[NIDT_CSI, 1, 0, 0, 0]);
        assert_eq!(descriptors[45], 0, "terminated");
        let list = active_namespaces([1, 3, 9], 1);
        assert_eq!(&list[0..12], &[3, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0]);
    }

    #[test]
    fn discovery_page_and_slices() {
        let record = DiscoveryRecord {
            address: ListenAddress::parse(None, "127.0.0.1", "4420").expect("address"),
            subsystem_nqn: "nqn.2016-06.io.spdk:a".into(),
            subsystem_type: SUBTYPE_NVME,
            port_id: 1,
        };
        let page = discovery(5, &[record]);
        assert_eq!(page.len(), 2048);
        assert_eq!(
            u64::from_le_bytes(page[8..16].try_into().expect("in range")),
            1
        );
        assert_eq!(&page[1024..1028], &[3, 1, SUBTYPE_NVME, 0b10]);
        assert_eq!(&page[1024 + 32..1024 + 37], b"4420 ");
        assert_eq!(&page[1024 + 512..1024 + 522], b"127.0.0.1 ");
        let header = log_page_slice(&page, 0, 16);
        assert_eq!(
            u64::from_le_bytes(header[0..8].try_into().expect("in range")),
            5
        );
        let beyond = log_page_slice(&page, 2040, 16);
        assert_eq!(&beyond[8..], &[0; 8], "zero past the end");
        assert_eq!(log_page_slice(&page, u64::MAX, 4), vec![0; 4]);
    }
}
