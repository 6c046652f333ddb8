//! What the target exports: the transport's options, subsystems (NQN, serial, model, the
//! hosts allowed), their namespaces (bdevs) and the addresses they listen on, and the
//! NQN grammar every name is checked against.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};

use basalt_bdev::Bdev;

use crate::controller::Controller;
use crate::fabrics::DISCOVERY_NQN;
use crate::pdu::{MAXH2CDATA_MIN, PDU_DATA_SIZE_MAX};

/// Longest NQN (NVMe base specification: 223 bytes of UTF-8).
pub const NQN_SIZE_MAX: usize = 223;
/// Longest serial number (Identify Controller SN, ASCII).
pub const SERIAL_NUMBER_SIZE_MAX: usize = 20;
/// Longest model number (Identify Controller MN, ASCII).
pub const MODEL_NUMBER_SIZE_MAX: usize = 40;
/// Most namespaces a subsystem may be created with.
pub const NAMESPACE_COUNT_MAX: u32 = 1024;
/// Largest controller id a subsystem hands out (0xfff0 and up are reserved).
pub const CONTROLLER_ID_MAX: u16 = 0xffef;
/// The serial number of a subsystem created without one (SPDK's default).
pub const DEFAULT_SERIAL_NUMBER: &str = "00000000000000000000";
/// The model number of a subsystem created without one.
pub const DEFAULT_MODEL_NUMBER: &str = "Basalt bdev Controller";
/// Namespaces a subsystem may hold when created without `max_namespaces`.
pub const DEFAULT_MAX_NAMESPACES: u32 = 32;
/// The admin queue's deepest submission queue (entries).
pub const ADMIN_QUEUE_DEPTH_MAX: u16 = 128;
/// The fewest admin queue entries a transport may allow: Linux always asks for 32.
pub const ADMIN_QUEUE_DEPTH_MIN: u16 = 32;

/// The options of the TCP transport (`nvmf_create_transport`), SPDK's names and defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransportOptions {
    /// Deepest I/O submission queue (entries); CAP.MQES + 1.
    pub max_queue_depth: u16,
    /// I/O queues per controller at most.
    pub max_io_qpairs_per_ctrlr: u16,
    /// In-capsule data bytes an I/O command may carry.
    pub in_capsule_data_size: u32,
    /// Largest read or write in bytes (MDTS): a power of two from 4 KiB.
    pub max_io_size: u32,
    /// Most data bytes per H2CData PDU (MAXH2CDATA).
    pub io_unit_size: u32,
    /// Deepest admin submission queue (entries).
    pub max_aq_depth: u16,
    /// Reads end with a C2HData PDU flagged SUCCESS instead of a response capsule, when
    /// the host disabled SQ flow control.
    pub c2h_success: bool,
    /// With `io_unit_size`, the data bytes the I/O commands under way on all
    /// connections may hold at once: `num_shared_buffers` × `io_unit_size`, counted in
    /// bytes ([`crate::budget`]).
    pub num_shared_buffers: u32,
}

impl Default for TransportOptions {
    fn default() -> Self {
        Self {
            max_queue_depth: 128,
            max_io_qpairs_per_ctrlr: 127,
            in_capsule_data_size: 4096,
            max_io_size: 131_072,
            io_unit_size: 131_072,
            max_aq_depth: 128,
            c2h_success: true,
            num_shared_buffers: 511,
        }
    }
}

impl TransportOptions {
    /// Checks the options; the error names the parameter.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_queue_depth < 2 {
            return Err(format!(
                "max_queue_depth {} is below 2",
                self.max_queue_depth
            ));
        }
        if self.max_io_qpairs_per_ctrlr == 0 {
            return Err("max_io_qpairs_per_ctrlr must be at least 1".into());
        }
        if !self.in_capsule_data_size.is_multiple_of(16)
            || self.in_capsule_data_size > PDU_DATA_SIZE_MAX
        {
            return Err(format!(
                "in_capsule_data_size {} must be a multiple of 16 up to {PDU_DATA_SIZE_MAX}",
                self.in_capsule_data_size
            ));
        }
        if !self.max_io_size.is_power_of_two()
            || self.max_io_size < 4096
            || self.max_io_size > PDU_DATA_SIZE_MAX
        {
            return Err(format!(
                "max_io_size {} must be a power of two from 4096 to {PDU_DATA_SIZE_MAX}",
                self.max_io_size
            ));
        }
        if self.io_unit_size < MAXH2CDATA_MIN
            || !self.io_unit_size.is_multiple_of(4)
            || self.io_unit_size > PDU_DATA_SIZE_MAX
        {
            return Err(format!(
                "io_unit_size {} must be a multiple of 4 from {MAXH2CDATA_MIN} to {PDU_DATA_SIZE_MAX}",
                self.io_unit_size
            ));
        }
        let budget = u64::from(self.num_shared_buffers) * u64::from(self.io_unit_size);
        if budget < u64::from(self.max_io_size) || budget > u64::from(u32::MAX) {
            return Err(format!(
                "num_shared_buffers {} of io_unit_size {} bytes must hold one request of max_io_size {} and stay below 4 GiB",
                self.num_shared_buffers, self.io_unit_size, self.max_io_size
            ));
        }
        // Linux's host asks for an admin queue of 32 entries, whatever CAP.MQES says, and
        // gives up on the controller when Connect refuses it.
        if !(ADMIN_QUEUE_DEPTH_MIN..=ADMIN_QUEUE_DEPTH_MAX).contains(&self.max_aq_depth) {
            return Err(format!(
                "max_aq_depth {} must be from {ADMIN_QUEUE_DEPTH_MIN} (the admin queue Linux asks for) to {ADMIN_QUEUE_DEPTH_MAX}",
                self.max_aq_depth
            ));
        }
        Ok(())
    }

    /// MDTS: the largest transfer as a power of two of 4 KiB pages.
    pub fn mdts(&self) -> u8 {
        (self.max_io_size / 4096).trailing_zeros() as u8
    }
}

/// Checks an NQN against the NVMe grammar: `nqn.2014-08.org.nvmexpress:uuid:` and a UUID,
/// the discovery NQN, or `nqn.YYYY-MM.` a reverse domain name, then `:` and a string the
/// domain's owner chose (not empty); at most 223 bytes. The error says what is wrong.
pub fn validate_nqn(nqn: &str) -> Result<(), String> {
    if nqn.is_empty() {
        return Err("nqn is empty".into());
    }
    if nqn.len() > NQN_SIZE_MAX {
        return Err(format!(
            "nqn {nqn:?} is {} bytes long, more than {NQN_SIZE_MAX}",
            nqn.len()
        ));
    }
    if nqn.contains('\0') {
        return Err(format!("nqn {nqn:?} holds a nul byte"));
    }
    if let Some(uuid) = nqn.strip_prefix("nqn.2014-08.org.nvmexpress:uuid:") {
        return if basalt_bdev::uuid::parse(uuid).is_some() && uuid.len() == 36 {
            Ok(())
        } else {
            Err(format!("nqn {nqn:?}: {uuid:?} is not a UUID"))
        };
    }
    let Some(rest) = nqn.strip_prefix("nqn.") else {
        return Err(format!("nqn {nqn:?} does not start with \"nqn.\""));
    };
    let date = rest.get(..8).unwrap_or("");
    let date_ok = date.len() == 8
        && date.as_bytes()[..4].iter().all(u8::is_ascii_digit)
        && date.as_bytes()[4] == b'-'
        && date.as_bytes()[5..7].iter().all(u8::is_ascii_digit)
        && date.as_bytes()[7] == b'.'
        && matches!(
            &date[5..7],
            "01" | "02" | "03" | "04" | "05" | "06" | "07" | "08" | "09" | "10" | "11" | "12"
        );
    if !date_ok {
        return Err(format!(
            "nqn {nqn:?} lacks the date \"yyyy-mm.\" after \"nqn.\""
        ));
    }
    if nqn == crate::fabrics::DISCOVERY_NQN {
        return Ok(());
    }
    let (domain, name) = rest[8..].split_once(':').unwrap_or((&rest[8..], ""));
    if name.is_empty() {
        return Err(format!(
            "nqn {nqn:?} lacks \":\" and a name after its domain (as in \"nqn.2016-06.io.spdk:cnode1\")"
        ));
    }
    if domain.is_empty() {
        return Err(format!(
            "nqn {nqn:?} has no reverse domain name after its date"
        ));
    }
    for label in domain.split('.') {
        let bytes = label.as_bytes();
        let ok = !bytes.is_empty()
            && bytes[0].is_ascii_alphabetic()
            && bytes[bytes.len() - 1].is_ascii_alphanumeric()
            && bytes
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || *b == b'-');
        if !ok {
            return Err(format!(
                "nqn {nqn:?}: domain label {label:?} must start with a letter, end with a \
                 letter or digit and hold only letters, digits and hyphens"
            ));
        }
    }
    Ok(())
}

/// Checks a serial or model number: printable ASCII of at most `size_max` bytes.
pub fn validate_ascii_field(name: &str, value: &str, size_max: usize) -> Result<(), String> {
    if value.len() > size_max {
        return Err(format!("{name} {value:?} is longer than {size_max} bytes"));
    }
    if !value.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(format!("{name} {value:?} must be printable ASCII"));
    }
    Ok(())
}

/// Address family of a listen address, as SPDK names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AddressFamily {
    /// `IPv4`.
    Ipv4,
    /// `IPv6`.
    Ipv6,
}

impl AddressFamily {
    /// The SPDK name.
    pub fn name(self) -> &'static str {
        match self {
            AddressFamily::Ipv4 => "IPv4",
            AddressFamily::Ipv6 => "IPv6",
        }
    }

    /// ADRFAM in a discovery log entry.
    pub fn code(self) -> u8 {
        match self {
            AddressFamily::Ipv4 => 1,
            AddressFamily::Ipv6 => 2,
        }
    }
}

/// Where a subsystem may be reached: one TCP address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ListenAddress {
    /// The socket address (IP and port).
    pub address: SocketAddr,
}

impl ListenAddress {
    /// Parses SPDK's `adrfam`, `traddr` and `trsvcid`; the error names the field.
    pub fn parse(adrfam: Option<&str>, traddr: &str, trsvcid: &str) -> Result<Self, String> {
        let ip: IpAddr = traddr
            .parse()
            .map_err(|_| format!("traddr {traddr:?} is not an IP address"))?;
        let port: u16 = trsvcid
            .parse()
            .map_err(|_| format!("trsvcid {trsvcid:?} is not a port number"))?;
        let family = match adrfam.map(str::to_ascii_lowercase).as_deref() {
            None => None,
            Some("ipv4") => Some(AddressFamily::Ipv4),
            Some("ipv6") => Some(AddressFamily::Ipv6),
            Some(other) => {
                return Err(format!("adrfam {other:?} is not IPv4 or IPv6"));
            }
        };
        let address = Self {
            address: SocketAddr::new(ip, port),
        };
        if let Some(family) = family
            && family != address.family()
        {
            return Err(format!(
                "adrfam {} does not match traddr {traddr:?}",
                family.name()
            ));
        }
        Ok(address)
    }

    /// IPv4 or IPv6.
    pub fn family(&self) -> AddressFamily {
        if self.address.is_ipv4() {
            AddressFamily::Ipv4
        } else {
            AddressFamily::Ipv6
        }
    }

    /// TRADDR as text.
    pub fn traddr(&self) -> String {
        self.address.ip().to_string()
    }

    /// TRSVCID as text.
    pub fn trsvcid(&self) -> String {
        self.address.port().to_string()
    }

    /// SPDK's `listen_address` object.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "trtype": "TCP",
            "adrfam": self.family().name(),
            "traddr": self.traddr(),
            "trsvcid": self.trsvcid(),
        })
    }
}

/// A namespace: a bdev exported under a namespace id.
pub struct Namespace {
    /// The namespace id (1 and up).
    pub nsid: u32,
    /// The bdev's name.
    pub bdev_name: String,
    /// The bdev.
    pub bdev: Arc<dyn Bdev>,
    /// The namespace UUID.
    pub uuid: [u8; 16],
    /// The namespace globally unique identifier.
    pub nguid: [u8; 16],
    /// The block count its controllers were last told of (the bdev's at first); the
    /// target notices when the bdev's differs.
    pub announced_blocks: std::sync::atomic::AtomicU64,
}

/// A subsystem's changeable state.
pub struct SubsystemState {
    /// Any host may connect.
    pub allow_any_host: bool,
    /// The host NQNs allowed when `allow_any_host` is false.
    pub hosts: BTreeSet<String>,
    /// Namespaces by id.
    pub namespaces: BTreeMap<u32, Arc<Namespace>>,
    /// Where the subsystem may be reached.
    pub listeners: BTreeSet<ListenAddress>,
    /// Controllers by id.
    pub controllers: BTreeMap<u16, Arc<Controller>>,
    next_controller_id: u16,
}

impl SubsystemState {
    /// Whether `host_nqn` may connect.
    pub fn allows_host(&self, host_nqn: &str) -> bool {
        self.allow_any_host || self.hosts.contains(host_nqn)
    }
}

/// An NVM subsystem.
pub struct Subsystem {
    /// Its NQN.
    pub nqn: String,
    /// Identify Controller SN.
    pub serial_number: String,
    /// Identify Controller MN.
    pub model_number: String,
    /// Namespaces at most (Identify Controller NN).
    pub max_namespaces: u32,
    /// Lowest controller id handed out.
    pub min_cntlid: u16,
    /// Highest controller id handed out.
    pub max_cntlid: u16,
    state: Mutex<SubsystemState>,
}

impl Subsystem {
    /// A subsystem with no namespace, host or listener.
    pub fn new(
        nqn: String,
        serial_number: String,
        model_number: String,
        max_namespaces: u32,
        allow_any_host: bool,
        (min_cntlid, max_cntlid): (u16, u16),
    ) -> Self {
        Self {
            nqn,
            serial_number,
            model_number,
            max_namespaces,
            min_cntlid,
            max_cntlid,
            state: Mutex::new(SubsystemState {
                allow_any_host,
                hosts: BTreeSet::new(),
                namespaces: BTreeMap::new(),
                listeners: BTreeSet::new(),
                controllers: BTreeMap::new(),
                next_controller_id: min_cntlid,
            }),
        }
    }

    /// The state, locked.
    pub fn lock(&self) -> MutexGuard<'_, SubsystemState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Whether `host_nqn` may connect.
    pub fn allows_host(&self, host_nqn: &str) -> bool {
        self.lock().allows_host(host_nqn)
    }

    /// Tears down the controllers of hosts no longer allowed (a host removed, or any host
    /// no longer allowed), as SPDK does: their queues' connections end, and a host that
    /// connects again is refused. How many went.
    pub fn disconnect_hosts_not_allowed(&self) -> usize {
        let refused: Vec<Arc<Controller>> = {
            let state = self.lock();
            state
                .controllers
                .values()
                .filter(|controller| !state.allows_host(&controller.host_nqn))
                .cloned()
                .collect()
        };
        for controller in &refused {
            tracing::info!(
                subnqn = %self.nqn,
                hostnqn = %controller.host_nqn,
                controller = controller.id,
                "host no longer allowed: controller torn down"
            );
            controller.close();
        }
        refused.len()
    }

    /// Whether this is the discovery subsystem.
    pub fn is_discovery(&self) -> bool {
        self.nqn == DISCOVERY_NQN
    }

    /// The namespace `nsid`, if there is one.
    pub fn namespace(&self, nsid: u32) -> Option<Arc<Namespace>> {
        self.lock().namespaces.get(&nsid).cloned()
    }

    /// A free controller id, or `None` when every id in range is in use.
    pub(crate) fn allocate_controller_id(
        state: &mut SubsystemState,
        min: u16,
        max: u16,
    ) -> Option<u16> {
        let span = u32::from(max - min) + 1;
        for _ in 0..span {
            let id = state.next_controller_id;
            state.next_controller_id = if id >= max { min } else { id + 1 };
            if !state.controllers.contains_key(&id) {
                return Some(id);
            }
        }
        None
    }
}

/// The lowest namespace id not in use, up to `max`.
pub fn free_nsid(namespaces: &BTreeMap<u32, Arc<Namespace>>, max: u32) -> Option<u32> {
    (1..=max).find(|nsid| !namespaces.contains_key(nsid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nqn_grammar() {
        for good in [
            "nqn.2016-06.io.spdk:cnode1",
            "nqn.2014-08.org.nvmexpress.discovery",
            "nqn.2026-11.io.basalt:disk0",
            "nqn.2014-08.org.nvmexpress:uuid:0f8fad5b-d9cb-469f-a165-70867728950e",
            "nqn.2000-01.a:b",
        ] {
            assert_eq!(validate_nqn(good), Ok(()), "{good}");
        }
        for (bad, why) in [
            ("", "empty"),
            ("nqn2016-06.io.spdk:x", "does not start"),
            ("nqn.2016-6.io.spdk:x", "date"),
            ("nqn.2016-13.io.spdk:x", "date"),
            ("nqn.2016-06.:x", "no reverse domain"),
            ("nqn.2016-06.1io.spdk:x", "label"),
            ("nqn.2016-06.io-.spdk:x", "label"),
            ("nqn.2016-06.io..spdk:x", "label"),
            ("nqn.2016-06.io.spdk", "lacks \":\""),
            ("nqn.2016-06.io.spdk:", "lacks \":\""),
            ("nqn.2014-08.org.nvmexpress:uuid:not-a-uuid", "not a UUID"),
        ] {
            let error = validate_nqn(bad).expect_err(bad);
            assert!(error.contains(why), "{bad}: {error}");
        }
        let long = format!("nqn.2016-06.io.spdk:{}", "x".repeat(204));
        assert_eq!(long.len(), 224);
        assert!(validate_nqn(&long).expect_err("long").contains("223"));
        assert_eq!(validate_nqn(&long[..223]), Ok(()));
    }

    #[test]
    fn transport_options_name_the_bad_parameter() {
        assert_eq!(TransportOptions::default().validate(), Ok(()));
        assert_eq!(TransportOptions::default().mdts(), 5);
        let cases = [
            (
                TransportOptions {
                    max_queue_depth: 1,
                    ..Default::default()
                },
                "max_queue_depth",
            ),
            (
                TransportOptions {
                    max_io_size: 3 << 12,
                    ..Default::default()
                },
                "max_io_size",
            ),
            (
                TransportOptions {
                    in_capsule_data_size: 100,
                    ..Default::default()
                },
                "in_capsule_data_size",
            ),
            (
                TransportOptions {
                    io_unit_size: 1024,
                    ..Default::default()
                },
                "io_unit_size",
            ),
            (
                TransportOptions {
                    num_shared_buffers: 3,
                    io_unit_size: 8192,
                    ..Default::default()
                },
                "num_shared_buffers",
            ),
            (
                TransportOptions {
                    max_aq_depth: 1000,
                    ..Default::default()
                },
                "max_aq_depth",
            ),
            (
                TransportOptions {
                    max_aq_depth: 31,
                    ..Default::default()
                },
                "max_aq_depth",
            ),
            (
                TransportOptions {
                    max_io_qpairs_per_ctrlr: 0,
                    ..Default::default()
                },
                "max_io_qpairs_per_ctrlr",
            ),
        ];
        for (options, name) in cases {
            let error = options.validate().expect_err(name);
            assert!(error.starts_with(name), "{error}");
        }
    }

    #[test]
    fn listen_addresses() {
        let v4 = ListenAddress::parse(Some("IPv4"), "127.0.0.1", "4420").expect("v4");
        assert_eq!(
            (v4.traddr(), v4.trsvcid()),
            ("127.0.0.1".into(), "4420".into())
        );
        assert_eq!(v4.family(), AddressFamily::Ipv4);
        assert!(ListenAddress::parse(Some("ipv6"), "::1", "4420").is_ok());
        for (adrfam, traddr, trsvcid, field) in [
            (Some("IPv6"), "127.0.0.1", "4420", "adrfam"),
            (Some("IB"), "127.0.0.1", "4420", "adrfam"),
            (None, "localhost", "4420", "traddr"),
            (None, "127.0.0.1", "70000", "trsvcid"),
        ] {
            let error = ListenAddress::parse(adrfam, traddr, trsvcid).expect_err(field);
            assert!(error.starts_with(field), "{error}");
        }
    }
}
