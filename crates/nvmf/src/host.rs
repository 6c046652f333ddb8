//! A userspace NVMe/TCP host (initiator), for `basalt bench --nvmf` and the tests: it
//! connects an admin queue and any number of I/O queues to a subsystem, enables the
//! controller, and runs admin and NVM commands, many in flight per queue.
//!
//! Each queue is one TCP connection driven by one task: commands arrive on a channel,
//! go out as capsules (data in the capsule when it fits, else in H2CData PDUs when the
//! controller sends R2T), and complete when their response capsule, or their last
//! C2HData flagged SUCCESS, arrives.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use basalt_common::SendBuffer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::command::*;
use crate::completion::{Cqe, Status};
use crate::decoder::decode;
use crate::fabrics::*;
use crate::pdu::*;

/// Why a host operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HostError {
    /// The socket failed.
    #[error("nvme/tcp: {0}")]
    Io(#[from] io::Error),
    /// The controller completed the command with an error status.
    #[error("nvme status sct {sct:#x} sc {sc:#04x}{dnr} (dw0 {dw0:#x})", sct = .status.sct(), sc = .status.sc(), dnr = if .status.dnr() { ", do not retry" } else { "" })]
    Status {
        /// The status.
        status: Status,
        /// Completion dword 0.
        dw0: u32,
        /// The command's identifier.
        command_id: u16,
    },
    /// The controller broke the protocol, or terminated the connection.
    #[error("nvme/tcp protocol: {0}")]
    Protocol(String),
    /// The queue is closed.
    #[error("nvme/tcp queue closed")]
    Closed,
}

impl HostError {
    /// The NVMe status, when the controller returned one.
    pub fn status(&self) -> Option<Status> {
        match self {
            HostError::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The identifier of the command that failed with a status.
    pub fn command_id(&self) -> Option<u16> {
        match self {
            HostError::Status { command_id, .. } => Some(*command_id),
            _ => None,
        }
    }
}

/// How to connect.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// The host NQN.
    pub host_nqn: String,
    /// The host identifier.
    pub host_id: [u8; 16],
    /// Ask for header digests.
    pub header_digest: bool,
    /// Ask for data digests.
    pub data_digest: bool,
    /// I/O queues to connect.
    pub io_queues: u16,
    /// Entries per I/O queue.
    pub queue_depth: u16,
    /// Keep-alive timeout in milliseconds sent in Connect (0: none).
    pub keep_alive_timeout_ms: u32,
    /// Send a Keep Alive every half timeout.
    pub send_keep_alive: bool,
    /// Write data always in H2CData PDUs after an R2T, never in the capsule.
    pub no_in_capsule_data: bool,
    /// Disable SQ flow control in Connect (lets reads complete with C2HData SUCCESS).
    pub disable_sq_flow_control: bool,
    /// Never answer an R2T with the data it asks for: a broken host, for tests of what a
    /// target does with one.
    pub withhold_write_data: bool,
}

impl Default for HostOptions {
    fn default() -> Self {
        Self {
            host_nqn: "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000001".into(),
            host_id: [0x42; 16],
            header_digest: false,
            data_digest: false,
            io_queues: 1,
            queue_depth: 128,
            keep_alive_timeout_ms: 10_000,
            send_keep_alive: true,
            no_in_capsule_data: false,
            disable_sq_flow_control: true,
            withhold_write_data: false,
        }
    }
}

/// A completed command: its CQE and the data the controller sent.
#[derive(Debug)]
pub struct Completion {
    /// The completion.
    pub cqe: Cqe,
    /// Data from the controller.
    pub data: Vec<u8>,
}

struct Request {
    sqe: Sqe,
    data_out: Vec<u8>,
    data_in_len: u32,
    reply: oneshot::Sender<Result<Completion, HostError>>,
}

/// One queue pair: a TCP connection to the controller.
pub struct QueuePair {
    requests: mpsc::Sender<Request>,
    task: JoinHandle<()>,
    /// The queue id.
    pub qid: u16,
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a queue's task keeps per command in flight.
struct Pending {
    reply: oneshot::Sender<Result<Completion, HostError>>,
    data_out: Vec<u8>,
    data_in: Vec<u8>,
}

/// Sends ICReq and reads the ICResp: the connection's negotiated state and the
/// controller's MAXH2CDATA.
async fn initialize(
    stream: &mut TcpStream,
    options: &HostOptions,
) -> Result<(Negotiated, u32), HostError> {
    let mut out = Vec::new();
    let initial = Negotiated::initial(Role::Host);
    encode(
        &Pdu::IcReq(IcReq {
            format_version: PFV_1_0,
            host_pda: 0,
            header_digest: options.header_digest,
            data_digest: options.data_digest,
            maxr2t: 0,
        }),
        &initial,
        &mut out,
    );
    stream.write_all(&out).await?;
    let mut input = Vec::with_capacity(256);
    loop {
        match decode(&input, &initial) {
            Ok(Some((Pdu::IcResp(resp), _))) => {
                let negotiated = Negotiated {
                    role: Role::Host,
                    established: true,
                    header_digest: resp.header_digest,
                    data_digest: resp.data_digest,
                    receive_pda: 0,
                    send_pda: resp.controller_pda,
                    data_size_max: PDU_DATA_SIZE_MAX,
                    in_capsule_data_size_max: 0,
                };
                return Ok((negotiated, resp.maxh2cdata));
            }
            Ok(Some((Pdu::C2HTermReq(term), _))) => {
                return Err(HostError::Protocol(format!(
                    "controller terminated the connection: status {:#x}",
                    term.fatal_error_status
                )));
            }
            Ok(Some((pdu, _))) => {
                return Err(HostError::Protocol(format!(
                    "expected ICResp, got pdu type {:#x}",
                    pdu.pdu_type()
                )));
            }
            Ok(None) => {
                if stream.read_buf(&mut input).await? == 0 {
                    return Err(HostError::Closed);
                }
            }
            Err(error) => return Err(HostError::Protocol(error.to_string())),
        }
    }
}

impl QueuePair {
    /// Connects queue `qid` of controller `controller_id` (ignored for the admin queue)
    /// to `subsystem_nqn` at `address`; returns the queue and the controller id.
    pub async fn connect(
        address: SocketAddr,
        subsystem_nqn: &str,
        qid: u16,
        controller_id: u16,
        depth: u16,
        in_capsule_max: u32,
        options: &HostOptions,
    ) -> Result<(QueuePair, u16), HostError> {
        let mut stream = TcpStream::connect(address).await?;
        stream.set_nodelay(true)?;
        let (negotiated, maxh2cdata) = initialize(&mut stream, options).await?;
        let (requests, receiver) = mpsc::channel(usize::from(depth).max(1));
        let task = tokio::spawn(run_queue(
            stream,
            receiver,
            negotiated,
            maxh2cdata,
            in_capsule_max,
            depth,
            options.withhold_write_data,
        ));
        let queue = QueuePair {
            requests,
            task,
            qid,
        };
        let connect = ConnectCommand {
            record_format: 0,
            queue_id: qid,
            sq_size: depth - 1,
            attributes: if options.disable_sq_flow_control {
                CONNECT_ATTRIBUTE_DISABLE_SQ_FLOW_CONTROL
            } else {
                0
            },
            keep_alive_timeout_ms: if qid == 0 {
                options.keep_alive_timeout_ms
            } else {
                0
            },
        };
        let data = ConnectData {
            host_id: options.host_id,
            controller_id: if qid == 0 {
                CONTROLLER_ID_DYNAMIC
            } else {
                controller_id
            },
            subsystem_nqn: subsystem_nqn.to_string(),
            host_nqn: options.host_nqn.clone(),
        };
        let completion = queue
            .submit(connect.to_sqe(0), data.encode().to_vec(), 0)
            .await?;
        let completion = check(completion)?;
        Ok((queue, completion.cqe.dw0 as u16))
    }

    /// Runs a command: `data_out` goes to the controller, `data_in_len` bytes are
    /// expected back. The command id is the queue's to choose. Completes with the CQE
    /// whatever its status.
    pub async fn submit(
        &self,
        sqe: Sqe,
        data_out: Vec<u8>,
        data_in_len: u32,
    ) -> Result<Completion, HostError> {
        let (reply, completion) = oneshot::channel();
        self.requests
            .send(Request {
                sqe,
                data_out,
                data_in_len,
                reply,
            })
            .await
            .map_err(|_| HostError::Closed)?;
        completion.await.map_err(|_| HostError::Closed)?
    }
}

/// The completion if it succeeded, else its status as an error.
pub fn check(completion: Completion) -> Result<Completion, HostError> {
    if completion.cqe.status.is_success() {
        Ok(completion)
    } else {
        Err(HostError::Status {
            status: completion.cqe.status,
            dw0: completion.cqe.dw0,
            command_id: completion.cqe.command_id,
        })
    }
}

fn fail_all(pending: &mut HashMap<u16, Pending>, error: impl Fn() -> HostError) {
    for (_, command) in pending.drain() {
        let _ = command.reply.send(Err(error()));
    }
}

async fn run_queue(
    stream: TcpStream,
    mut requests: mpsc::Receiver<Request>,
    negotiated: Negotiated,
    maxh2cdata: u32,
    in_capsule_max: u32,
    depth: u16,
    withhold_write_data: bool,
) {
    let (mut reader, mut writer) = stream.into_split();
    let mut pending: HashMap<u16, Pending> = HashMap::new();
    let mut next_id: u16 = 0;
    let mut input: Vec<u8> = Vec::with_capacity(256 << 10);
    let mut input_start = 0usize;
    let mut output = SendBuffer::new(256 << 10);
    let mut accepting = true;
    loop {
        // Decode every whole PDU received.
        let mut failure = None;
        while input_start < input.len() {
            match decode(&input[input_start..], &negotiated) {
                Ok(None) => break,
                Ok(Some((Pdu::R2T(_), used))) if withhold_write_data => input_start += used,
                Ok(Some((pdu, used))) => {
                    input_start += used;
                    if let Err(error) =
                        handle_pdu(pdu, &mut pending, &negotiated, maxh2cdata, output.tail())
                    {
                        failure = Some(error);
                        break;
                    }
                }
                Err(error) => {
                    failure = Some(format!("bad pdu from the controller: {error}"));
                    break;
                }
            }
        }
        if let Some(message) = failure {
            fail_all(&mut pending, || HostError::Protocol(message.clone()));
            return;
        }
        if input_start == input.len() {
            input.clear();
            input_start = 0;
        } else if input.capacity() - input.len() < (64 << 10) {
            input.drain(..input_start);
            input_start = 0;
            input.reserve(negotiated.pdu_size_max().max(256 << 10));
        }
        if !accepting && pending.is_empty() && output.is_empty() {
            return;
        }
        let has_output = !output.is_empty();
        let can_accept = accepting && pending.len() < usize::from(depth);
        tokio::select! {
            written = writer.write(output.unwritten()), if has_output => {
                match written {
                    Ok(0) | Err(_) => {
                        fail_all(&mut pending, || HostError::Closed);
                        return;
                    }
                    Ok(written) => output.written(written),
                }
            }
            read = reader.read_buf(&mut input) => {
                match read {
                    Ok(0) | Err(_) => {
                        fail_all(&mut pending, || HostError::Closed);
                        return;
                    }
                    Ok(_) => {}
                }
            }
            request = requests.recv(), if can_accept => {
                let Some(request) = request else {
                    accepting = false;
                    continue;
                };
                // Take every request queued (up to the depth) before writing, so one
                // socket write carries many capsules. The tasks that completions just
                // woke run first: a yield lets them queue their next requests, where
                // waking this task at the first one would make one write per request.
                let mut first = Some(request);
                // Whether there is room for more once the queued requests are taken.
                let mut take_queued = || {
                    while pending.len() < usize::from(depth)
                        && let Some(request) = first.take().or_else(|| requests.try_recv().ok())
                    {
                        send_command(
                            request,
                            &mut pending,
                            &mut next_id,
                            &negotiated,
                            in_capsule_max,
                            output.tail(),
                        );
                    }
                    pending.len() < usize::from(depth)
                };
                if take_queued() {
                    tokio::task::yield_now().await;
                    take_queued();
                }
            }
        }
    }
}

/// Encodes `request`'s command capsule into `output` under a free command id and keeps
/// it as pending.
fn send_command(
    request: Request,
    pending: &mut HashMap<u16, Pending>,
    next_id: &mut u16,
    negotiated: &Negotiated,
    in_capsule_max: u32,
    output: &mut Vec<u8>,
) {
    while pending.contains_key(next_id) {
        *next_id = next_id.wrapping_add(1);
    }
    let id = *next_id;
    *next_id = next_id.wrapping_add(1);
    let mut sqe = request.sqe;
    sqe.command_id = id;
    sqe.flags = (sqe.flags & !(0b11 << FLAGS_PSDT_SHIFT)) | (PSDT_SGL << FLAGS_PSDT_SHIFT);
    let out_len = u32::try_from(request.data_out.len()).unwrap_or(u32::MAX);
    // Connect's data always travels in the capsule.
    let in_capsule =
        !request.data_out.is_empty() && (out_len <= in_capsule_max || sqe.opcode == FABRICS);
    sqe.data_pointer = if in_capsule {
        SglDescriptor::in_capsule(out_len)
    } else {
        SglDescriptor::transport(out_len.max(request.data_in_len))
    };
    let data: &[u8] = if in_capsule { &request.data_out } else { &[] };
    encode(
        &Pdu::CapsuleCmd(CapsuleCmd { sqe, data }),
        negotiated,
        output,
    );
    pending.insert(
        id,
        Pending {
            reply: request.reply,
            data_out: if in_capsule {
                Vec::new()
            } else {
                request.data_out
            },
            data_in: Vec::new(),
        },
    );
}

fn handle_pdu(
    pdu: Pdu<'_>,
    pending: &mut HashMap<u16, Pending>,
    negotiated: &Negotiated,
    maxh2cdata: u32,
    output: &mut Vec<u8>,
) -> Result<(), String> {
    match pdu {
        Pdu::CapsuleResp(resp) => {
            let cqe = resp.cqe;
            let Some(command) = pending.remove(&cqe.command_id) else {
                return Err(format!("response to unknown command {}", cqe.command_id));
            };
            let _ = command.reply.send(Ok(Completion {
                cqe,
                data: command.data_in,
            }));
        }
        Pdu::C2HData(data) => {
            let Some(command) = pending.get_mut(&data.command_id) else {
                return Err(format!("data for unknown command {}", data.command_id));
            };
            let offset = data.data_offset_bytes as usize;
            if offset != command.data_in.len() {
                return Err(format!(
                    "c2h data at {offset}, expected {}",
                    command.data_in.len()
                ));
            }
            command.data_in.extend_from_slice(data.data);
            if data.success
                && let Some(command) = pending.remove(&data.command_id)
            {
                let cqe = Cqe {
                    command_id: data.command_id,
                    ..Cqe::default()
                };
                let _ = command.reply.send(Ok(Completion {
                    cqe,
                    data: command.data_in,
                }));
            }
        }
        Pdu::R2T(r2t) => {
            let Some(command) = pending.get(&r2t.command_id) else {
                return Err(format!("r2t for unknown command {}", r2t.command_id));
            };
            let start = r2t.offset_bytes as usize;
            let end = start + r2t.len_bytes as usize;
            if end > command.data_out.len() {
                return Err(format!(
                    "r2t for {start}..{end} beyond {} bytes",
                    command.data_out.len()
                ));
            }
            let mut at = start;
            while at < end {
                let chunk_end = (at + maxh2cdata as usize).min(end);
                encode(
                    &Pdu::H2CData(H2CData {
                        command_id: r2t.command_id,
                        transfer_tag: r2t.transfer_tag,
                        data_offset_bytes: at as u32,
                        data: &command.data_out[at..chunk_end],
                        last: chunk_end == end,
                    }),
                    negotiated,
                    output,
                );
                at = chunk_end;
            }
        }
        Pdu::C2HTermReq(term) => {
            return Err(format!(
                "controller terminated the connection: status {:#x}, information {}",
                term.fatal_error_status, term.fatal_error_information
            ));
        }
        other => return Err(format!("unexpected pdu type {:#x}", other.pdu_type())),
    }
    Ok(())
}

/// A connected controller: its admin queue, its I/O queues, and what Identify said.
pub struct Host {
    /// The admin queue.
    pub admin: QueuePair,
    /// The I/O queues, qid 1 first.
    pub io: Vec<QueuePair>,
    /// The controller id.
    pub controller_id: u16,
    /// Identify Controller.
    pub identify: Vec<u8>,
    keep_alive: Option<JoinHandle<()>>,
}

impl Drop for Host {
    fn drop(&mut self) {
        if let Some(task) = self.keep_alive.take() {
            task.abort();
        }
    }
}

/// CC with EN, 64-byte SQ entries and 16-byte CQ entries.
const CC_ENABLED: u64 = 1 | (6 << 16) | (4 << 20);

impl Host {
    /// Connects to `subsystem_nqn` at `address`: admin queue, enable, Identify, number of
    /// queues, then the I/O queues.
    pub async fn connect(
        address: SocketAddr,
        subsystem_nqn: &str,
        options: HostOptions,
    ) -> Result<Host, HostError> {
        let (admin, controller_id) = QueuePair::connect(
            address,
            subsystem_nqn,
            0,
            0,
            32,
            IN_CAPSULE_DATA_SIZE_ADMIN,
            &options,
        )
        .await?;
        let admin = Arc::new(admin);
        let property = PropertyCommand {
            wide: false,
            offset: PROPERTY_CC,
            value: CC_ENABLED,
        };
        check(admin.submit(property.to_set_sqe(0), Vec::new(), 0).await?)?;
        let ready = PropertyCommand {
            wide: false,
            offset: PROPERTY_CSTS,
            value: 0,
        };
        let csts = check(admin.submit(ready.to_get_sqe(0), Vec::new(), 0).await?)?;
        if csts.cqe.dw0 & 1 == 0 {
            return Err(HostError::Protocol(
                "controller not ready after enable".into(),
            ));
        }
        let identify = check(
            admin
                .submit(identify_sqe(CNS_CONTROLLER, 0), Vec::new(), 4096)
                .await?,
        )?
        .data;
        let ioccsz = u32::from_le_bytes(identify[1792..1796].try_into().expect("4 bytes"));
        let in_capsule_max = if options.no_in_capsule_data {
            0
        } else {
            (ioccsz * 16).saturating_sub(64)
        };
        let mut io = Vec::new();
        let is_discovery = subsystem_nqn == DISCOVERY_NQN;
        if options.io_queues > 0 && !is_discovery {
            let asked = u32::from(options.io_queues - 1);
            let sqe = Sqe {
                opcode: ADMIN_SET_FEATURES,
                cdw10: u32::from(FEATURE_NUMBER_OF_QUEUES),
                cdw11: asked | (asked << 16),
                ..Sqe::default()
            };
            let granted = check(admin.submit(sqe, Vec::new(), 0).await?)?.cqe.dw0 & 0xffff;
            let count = (granted + 1).min(u32::from(options.io_queues)) as u16;
            for qid in 1..=count {
                let (queue, _) = QueuePair::connect(
                    address,
                    subsystem_nqn,
                    qid,
                    controller_id,
                    options.queue_depth,
                    in_capsule_max,
                    &options,
                )
                .await?;
                io.push(queue);
            }
        }
        let admin = Arc::into_inner(admin).expect("no other user of the admin queue yet");
        let mut host = Host {
            admin,
            io,
            controller_id,
            identify,
            keep_alive: None,
        };
        if options.send_keep_alive && options.keep_alive_timeout_ms > 0 {
            host.keep_alive = Some(host.spawn_keep_alive(Duration::from_millis(u64::from(
                options.keep_alive_timeout_ms / 2,
            ))));
        }
        Ok(host)
    }

    fn spawn_keep_alive(&self, period: Duration) -> JoinHandle<()> {
        let requests = self.admin.requests.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let (reply, completion) = oneshot::channel();
                let request = Request {
                    sqe: Sqe {
                        opcode: ADMIN_KEEP_ALIVE,
                        ..Sqe::default()
                    },
                    data_out: Vec::new(),
                    data_in_len: 0,
                    reply,
                };
                if requests.send(request).await.is_err() || completion.await.is_err() {
                    return;
                }
            }
        })
    }

    /// Runs an admin command; an error status is an error.
    pub async fn admin(
        &self,
        sqe: Sqe,
        data_out: Vec<u8>,
        data_in_len: u32,
    ) -> Result<Completion, HostError> {
        check(self.admin.submit(sqe, data_out, data_in_len).await?)
    }

    /// Identify with `cns` for `nsid`.
    pub async fn identify(&self, cns: u8, nsid: u32) -> Result<Vec<u8>, HostError> {
        Ok(self
            .admin(identify_sqe(cns, nsid), Vec::new(), 4096)
            .await?
            .data)
    }

    /// Get Features `feature` with CDW11 `cdw11`, taking `data_in_len` bytes of data.
    pub async fn get_feature(
        &self,
        feature: u8,
        cdw11: u32,
        data_in_len: u32,
    ) -> Result<Completion, HostError> {
        let sqe = Sqe {
            opcode: ADMIN_GET_FEATURES,
            cdw10: u32::from(feature),
            cdw11,
            ..Sqe::default()
        };
        self.admin(sqe, Vec::new(), data_in_len).await
    }

    /// The active namespace ids.
    pub async fn namespaces(&self) -> Result<Vec<u32>, HostError> {
        let list = self.identify(CNS_ACTIVE_NAMESPACES, 0).await?;
        Ok(list
            .chunks_exact(4)
            .map(|id| u32::from_le_bytes([id[0], id[1], id[2], id[3]]))
            .take_while(|id| *id != 0)
            .collect())
    }

    /// A namespace's block size and block count (from Identify Namespace).
    pub async fn namespace_geometry(&self, nsid: u32) -> Result<(u32, u64), HostError> {
        let page = self.identify(CNS_NAMESPACE, nsid).await?;
        let blocks = u64::from_le_bytes(page[0..8].try_into().expect("8 bytes"));
        let format = usize::from(page[26] & 0xf);
        let block_size = 1u32 << page[128 + format * 4 + 2];
        Ok((block_size, blocks))
    }

    /// `len` bytes of log page `log_id` from `offset`.
    pub async fn log_page(
        &self,
        log_id: u8,
        offset: u64,
        len: u32,
        retain_event: bool,
    ) -> Result<Vec<u8>, HostError> {
        let dwords = len / 4 - 1;
        let sqe = Sqe {
            opcode: ADMIN_GET_LOG_PAGE,
            namespace_id: 0xffff_ffff,
            cdw10: u32::from(log_id) | (u32::from(retain_event) << 15) | ((dwords & 0xffff) << 16),
            cdw11: dwords >> 16,
            cdw12: offset as u32,
            cdw13: (offset >> 32) as u32,
            ..Sqe::default()
        };
        Ok(self.admin(sqe, Vec::new(), len).await?.data)
    }

    /// The I/O queue for `index` (wrapping).
    pub fn queue(&self, index: usize) -> &QueuePair {
        &self.io[index % self.io.len()]
    }

    /// Runs an NVM command on I/O queue `queue`; an error status is an error.
    pub async fn io(
        &self,
        queue: usize,
        sqe: Sqe,
        data_out: Vec<u8>,
        data_in_len: u32,
    ) -> Result<Completion, HostError> {
        check(self.queue(queue).submit(sqe, data_out, data_in_len).await?)
    }

    /// The largest read or write one command may move (MDTS of 4 KiB pages; 0 means no
    /// limit, taken here as 4 MiB, the most one PDU carries).
    pub fn transfer_size_max(&self) -> u32 {
        match self.identify[77] {
            0 => PDU_DATA_SIZE_MAX,
            mdts => (4096u64 << mdts).min(u64::from(PDU_DATA_SIZE_MAX)) as u32,
        }
    }

    /// Blocks per command at most, for `block_size`.
    fn blocks_per_command(&self, block_size: u32) -> u32 {
        (self.transfer_size_max() / block_size).clamp(1, 65536)
    }

    /// Reads `blocks` blocks of `block_size` at `lba`, in as many commands as MDTS needs.
    pub async fn read(
        &self,
        queue: usize,
        nsid: u32,
        lba: u64,
        blocks: u32,
        block_size: u32,
    ) -> Result<Vec<u8>, HostError> {
        let step = self.blocks_per_command(block_size);
        let mut data = Vec::with_capacity(blocks as usize * block_size as usize);
        let mut done = 0u32;
        while done < blocks {
            let count = step.min(blocks - done);
            let sqe = rw_sqe(IO_READ, nsid, lba + u64::from(done), count, false);
            data.extend(
                self.io(queue, sqe, Vec::new(), count * block_size)
                    .await?
                    .data,
            );
            done += count;
        }
        Ok(data)
    }

    /// Writes `data` (whole blocks of `block_size`) at `lba`, in as many commands as MDTS
    /// needs.
    pub async fn write(
        &self,
        queue: usize,
        nsid: u32,
        lba: u64,
        data: Vec<u8>,
        block_size: u32,
        fua: bool,
    ) -> Result<(), HostError> {
        let step = self.blocks_per_command(block_size) as usize * block_size as usize;
        if data.len() <= step {
            let blocks = (data.len() / block_size as usize) as u32;
            let sqe = rw_sqe(IO_WRITE, nsid, lba, blocks, fua);
            return self.io(queue, sqe, data, 0).await.map(|_| ());
        }
        for (index, chunk) in data.chunks(step).enumerate() {
            let blocks = (chunk.len() / block_size as usize) as u32;
            let at = lba + (index * step / block_size as usize) as u64;
            let sqe = rw_sqe(IO_WRITE, nsid, at, blocks, fua);
            self.io(queue, sqe, chunk.to_vec(), 0).await?;
        }
        Ok(())
    }

    /// Flushes namespace `nsid`.
    pub async fn flush(&self, queue: usize, nsid: u32) -> Result<(), HostError> {
        let sqe = Sqe {
            opcode: IO_FLUSH,
            namespace_id: nsid,
            ..Sqe::default()
        };
        self.io(queue, sqe, Vec::new(), 0).await.map(|_| ())
    }

    /// Write Zeroes of `blocks` at `lba`, deallocating if asked.
    pub async fn write_zeroes(
        &self,
        queue: usize,
        nsid: u32,
        lba: u64,
        blocks: u32,
        deallocate: bool,
    ) -> Result<(), HostError> {
        let mut sqe = rw_sqe(IO_WRITE_ZEROES, nsid, lba, blocks, false);
        if deallocate {
            sqe.cdw12 |= 1 << 25;
        }
        self.io(queue, sqe, Vec::new(), 0).await.map(|_| ())
    }

    /// Dataset Management deallocate of `(lba, blocks)` ranges.
    pub async fn deallocate(
        &self,
        queue: usize,
        nsid: u32,
        ranges: &[(u64, u32)],
    ) -> Result<(), HostError> {
        let mut data = Vec::with_capacity(ranges.len() * 16);
        for (lba, blocks) in ranges {
            data.extend_from_slice(&0u32.to_le_bytes());
            data.extend_from_slice(&blocks.to_le_bytes());
            data.extend_from_slice(&lba.to_le_bytes());
        }
        let sqe = Sqe {
            opcode: IO_DATASET_MANAGEMENT,
            namespace_id: nsid,
            cdw10: (ranges.len() as u32).saturating_sub(1),
            cdw11: 1 << 2,
            ..Sqe::default()
        };
        self.io(queue, sqe, data, 0).await.map(|_| ())
    }
}

/// An Identify SQE.
pub fn identify_sqe(cns: u8, nsid: u32) -> Sqe {
    Sqe {
        opcode: ADMIN_IDENTIFY,
        namespace_id: nsid,
        cdw10: u32::from(cns),
        ..Sqe::default()
    }
}

/// A Read, Write or Write Zeroes SQE (`blocks` from 1 to 65536).
pub fn rw_sqe(opcode: u8, nsid: u32, lba: u64, blocks: u32, fua: bool) -> Sqe {
    Sqe {
        opcode,
        namespace_id: nsid,
        cdw10: lba as u32,
        cdw11: (lba >> 32) as u32,
        cdw12: (blocks - 1) | if fua { 1 << 30 } else { 0 },
        ..Sqe::default()
    }
}

/// Where a subsystem is: `nvme+tcp://ADDRESS:PORT/NQN` (the port defaults to 4420).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmfUri {
    /// The controller's address.
    pub address: SocketAddr,
    /// The subsystem NQN.
    pub nqn: String,
}

/// The NVMe/TCP port registered with IANA.
pub const DEFAULT_PORT: u16 = 4420;

impl std::str::FromStr for NvmfUri {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let rest = text
            .strip_prefix("nvme+tcp://")
            .ok_or_else(|| format!("{text:?} does not start with nvme+tcp://"))?;
        let (authority, nqn) = rest
            .split_once('/')
            .ok_or_else(|| format!("{text:?} has no /NQN after the address"))?;
        crate::subsystem::validate_nqn(nqn)?;
        let address = match authority.parse::<SocketAddr>() {
            Ok(address) => address,
            Err(_) => {
                let ip: std::net::IpAddr = authority
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .parse()
                    .map_err(|_| {
                        format!("{authority:?} is not an IP address with an optional port")
                    })?;
                SocketAddr::new(ip, DEFAULT_PORT)
            }
        };
        Ok(Self {
            address,
            nqn: nqn.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        let uri: NvmfUri = "nvme+tcp://127.0.0.1:4421/nqn.2016-06.io.basalt:disk0"
            .parse()
            .expect("uri");
        assert_eq!(uri.address, "127.0.0.1:4421".parse().expect("address"));
        assert_eq!(uri.nqn, "nqn.2016-06.io.basalt:disk0");
        let default_port: NvmfUri = "nvme+tcp://[::1]/nqn.2016-06.io.basalt:a"
            .parse()
            .expect("uri");
        assert_eq!(default_port.address.port(), DEFAULT_PORT);
        for bad in [
            "nbd://127.0.0.1/x",
            "nvme+tcp://127.0.0.1:4420",
            "nvme+tcp://host:4420/nqn.2016-06.io.basalt:a",
            "nvme+tcp://127.0.0.1:4420/not-an-nqn",
        ] {
            assert!(bad.parse::<NvmfUri>().is_err(), "{bad}");
        }
    }
}
