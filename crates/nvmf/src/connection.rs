//! One NVMe/TCP connection (one queue pair), in one task: ICReq/ICResp, Connect, then
//! commands until the host closes, the controller is torn down or a fatal error.
//!
//! The task decodes every PDU in its receive buffer, starts each command (a future kept
//! in a list, polled in place, as the NBD server does), asks for write data with one R2T
//! per command and gathers its H2CData, and writes every ready response in one socket
//! write. Reads go out as one C2HData PDU, flagged SUCCESS (no response capsule) when
//! the host disabled SQ flow control. A fatal PDU error sends a C2HTermReq and closes.
//! Once the connection ends (the host gone, the controller torn down, a fatal error),
//! commands still under way are given up unanswered (see the end of [`serve`]).

use std::collections::HashMap;
use std::future::poll_fn;
use std::io;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use basalt_common::SendBuffer;
use basalt_io::DmaBuf;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::budget::{DataBudget, DataPermit, DataWait, Parked};
use crate::command::*;
use crate::completion::{Cqe, Status};
use crate::controller::{Controller, ErrorSite, Response};
use crate::decoder::{PduError, decode, term_req_error_data};
use crate::fabrics::*;
use crate::identify::ASYNC_EVENT_REQUESTS_MAX;
use crate::io_command::{self, Prepared, ResponseFuture};
use crate::pdu::*;
use crate::subsystem::{ListenAddress, TransportOptions};
use crate::target::{BoundQueue, NvmfTarget};

/// How long a new connection may take to send its ICReq and Connect.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes read from the socket at a time, at least.
const READ_CHUNK_BYTES: usize = 256 << 10;
/// Commands under way up to which a polling connection polls for their completion. An
/// admin queue with an Asynchronous Event Request outstanding (waiting for an event, not
/// for I/O) does not poll.
const POLL_IN_FLIGHT_MAX: usize = 1;

/// Unwritten output past which the connection stops reading commands.
const OUTPUT_BYTES_MAX: usize = 16 << 20;

/// A command under way: its future, how many bytes of data the host takes back (its
/// SGL length), where it was aimed, and whether it is an Asynchronous Event Request
/// (waits for an event, no I/O: dropped when the connection ends).
struct InFlight {
    future: ResponseFuture,
    data_limit: u32,
    async_event: bool,
    /// Where the command was aimed, for the error log.
    site: ErrorSite,
    /// Its data bytes of the target's budget.
    _permit: Option<DataPermit>,
}

/// Write data being gathered after an R2T.
struct Transfer {
    sqe: Sqe,
    prepared: Prepared,
    buffer: DmaBuf,
    received: usize,
    /// A data digest failed: the data is read and dropped, the command fails.
    failed: bool,
    /// Its data bytes of the target's budget.
    permit: Option<DataPermit>,
    /// When the R2T asked for the data.
    asked: Instant,
}

struct Connection {
    target: Arc<NvmfTarget>,
    via: ListenAddress,
    options: TransportOptions,
    negotiated: Negotiated,
    queue: Option<BoundQueue>,
    closed: Option<watch::Receiver<bool>>,
    input: Vec<u8>,
    input_start: usize,
    output: SendBuffer,
    in_flight: Vec<InFlight>,
    transfers: HashMap<u16, Transfer>,
    next_transfer_tag: u16,
    sq_head: u16,
    /// Still reading commands.
    reading: bool,
    /// A fatal error or a teardown: nothing more is answered.
    terminating: bool,
    /// The data bytes that all connections' commands under way may hold.
    budget: Arc<DataBudget>,
    /// How long the write data an R2T asked for may take to come.
    transfer_timeout: Duration,
    /// The bytes taken for the command being started, which its entry keeps.
    permit: Option<DataPermit>,
    /// The first parked command's wait for bytes of the budget, in its turn.
    waiting: Option<DataWait>,
    /// The bytes that wait brought, for that command.
    granted: Option<DataPermit>,
    /// Commands read while the first of them waits for bytes of the budget, in order
    /// (their in-capsule data copied): the PDUs after them are read meanwhile, so that the
    /// write data of commands under way, which gives bytes back, is never stuck behind
    /// them.
    parked: Parked<(Sqe, Vec<u8>)>,
}

/// Serves one connection accepted on `via`.
pub async fn serve(
    target: Arc<NvmfTarget>,
    stream: TcpStream,
    via: ListenAddress,
) -> io::Result<()> {
    // The budget is made with the transport.
    let (Some(options), Some(budget)) = (target.transport(), target.data_budget()) else {
        return Ok(());
    };
    let (mut reader, mut writer) = stream.into_split();
    let transfer_timeout = target.transfer_timeout();
    let mut connection = Connection {
        target,
        via,
        options,
        negotiated: Negotiated::initial(Role::Controller),
        queue: None,
        closed: None,
        input: Vec::with_capacity(READ_CHUNK_BYTES),
        input_start: 0,
        output: SendBuffer::new(READ_CHUNK_BYTES),
        in_flight: Vec::new(),
        transfers: HashMap::new(),
        next_transfer_tag: 0,
        sq_head: 0,
        reading: true,
        terminating: false,
        parked: Parked::new(budget.clone()),
        budget,
        transfer_timeout,
        permit: None,
        waiting: None,
        granted: None,
    };
    let connect_deadline = Instant::now() + CONNECT_TIMEOUT;
    let half = (transfer_timeout / 2).max(Duration::from_millis(1));
    let mut transfers_checked = tokio::time::interval(half);
    transfers_checked.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let poll = connection.target.poll();
    let result = loop {
        connection.process_input();
        // Ending (the host closed or ended the connection, its controller was torn down):
        // the commands under way are given up at once, never polled again (see the end),
        // and nothing more is read (write data for a transfer given up would be refused).
        if connection.is_closed() && !connection.terminating {
            connection.stop_reading();
            connection.terminating = true;
        }
        if connection.terminating {
            connection.give_up_commands();
        } else if !connection.reading {
            // After a Disconnect: nothing more is read, so transfers and parked commands
            // could never go on; their bytes go back now.
            connection.give_up_unstarted();
        }
        if connection.is_finished() {
            break Ok(());
        }
        let can_read = connection.can_read();
        if can_read {
            connection.make_room_to_read();
        }
        let has_output = !connection.output.is_empty();
        let has_in_flight = !connection.in_flight.is_empty();
        let deadline = connection.deadline(connect_deadline);
        // Idle, or waiting for a lone command under way (an image bdev's reply from its
        // OSDs): look for the next command or the completion for a while before the reactor
        // sleeps, never past the next deadline. Not with several commands under way: they
        // complete often enough, and a poller there takes CPU that the bdev's OSDs on a
        // shared machine need (QD32 writes to an image fell a quarter). Not when the
        // controller is gone or a deadline has come: the select below sees to those.
        if !poll.is_zero() && can_read && !has_output && connection.may_poll() {
            let now = Instant::now();
            let poll = deadline.map_or(poll, |deadline| {
                poll.min(deadline.saturating_duration_since(now))
            });
            if !poll.is_zero() && connection.poll_for_work(&mut reader, poll).await {
                continue;
            }
        }
        let terminating = connection.terminating;
        let closed = &mut connection.closed;
        let queue = &connection.queue;
        let waiting = &mut connection.waiting;
        let waits_for_bytes = waiting.is_some();
        let transfers_checked = &mut transfers_checked;
        let has_transfers = !connection.transfers.is_empty();
        tokio::select! {
            biased;
            // The first parked command's bytes: it starts (with those after it that fit).
            // First, so that its wait takes its place in the budget's queue at once.
            permit = bytes_for(waiting), if waits_for_bytes => {
                connection.waiting = None;
                connection.granted = Some(permit);
            }
            // A command under way is not completed once the controller is torn down (a
            // host that reconnected may be writing the same blocks again), even if the
            // teardown comes from another thread while this task polls.
            responses = poll_fn(|cx| {
                if queue.as_ref().is_some_and(|queue| queue.controller.is_closed()) {
                    return Poll::Pending;
                }
                poll_ready(&mut connection.in_flight, cx)
            }), if has_in_flight => {
                connection.respond_all(responses);
            }
            written = writer.write(connection.output.unwritten()), if has_output => {
                match written {
                    Ok(0) => break Err(io::ErrorKind::WriteZero.into()),
                    Ok(written) => {
                        connection.output.written(written);
                    }
                    Err(error) => break Err(error),
                }
            }
            read = reader.read_buf(&mut connection.input), if can_read => {
                connection.on_read(read);
            }
            // Not only while reading: a queue the host disconnected may still have
            // commands under way, to be dropped when the controller goes.
            _ = wait_closed(closed), if !terminating => {
                connection.stop_reading();
                connection.terminating = true;
            }
            _ = tokio::time::sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                connection.check_deadlines(connect_deadline);
            }
            // Write data asked for long ago (a coarse check, every half timeout, so that
            // no timer is set at each turn).
            _ = transfers_checked.tick(), if has_transfers => {
                connection.check_transfers();
            }
        }
    };
    connection.give_up_commands();
    if let Some(queue) = connection.queue.take() {
        connection.target.disconnect(&queue);
    }
    // Commands still under way were given up (just above, before the queue is seen gone),
    // as the host has given them up: it sends them again on its next connection, and may
    // send later commands for the same blocks there. One kept going here (an image bdev's
    // write retrying while its PG has no leader) could land after those. What a command
    // already handed on does not land after them as a rule: a file bdev's engine keeps its
    // buffers until the kernel is done with them (a write already submitted completes
    // within the device's time), and an image's client sends nothing more for a request
    // dropped (what it sent before comes before later requests in its PG's raft log, the
    // leader's term in each request keeping an old one held in a socket from going in
    // after a newer leader's).
    let _ = writer.shutdown().await;
    result
}

async fn bytes_for(waiting: &mut Option<DataWait>) -> DataPermit {
    match waiting {
        Some(wait) => wait.await,
        None => std::future::pending().await,
    }
}

async fn wait_closed(closed: &mut Option<watch::Receiver<bool>>) {
    match closed {
        Some(closed) => {
            let _ = closed.wait_for(|closed| *closed).await;
        }
        None => std::future::pending().await,
    }
}

/// Takes every completed command out of `in_flight`; pending while none has completed.
fn poll_ready(
    in_flight: &mut Vec<InFlight>,
    cx: &mut Context<'_>,
) -> Poll<Vec<(Response, u32, ErrorSite)>> {
    let mut ready = Vec::new();
    let mut index = 0;
    while index < in_flight.len() {
        match in_flight[index].future.as_mut().poll(cx) {
            Poll::Ready(response) => {
                let command = in_flight.swap_remove(index);
                ready.push((response, command.data_limit, command.site));
            }
            Poll::Pending => index += 1,
        }
    }
    if ready.is_empty() {
        Poll::Pending
    } else {
        Poll::Ready(ready)
    }
}

fn ready(response: Response) -> ResponseFuture {
    Box::pin(std::future::ready(response))
}

impl Connection {
    /// Tries for up to `poll` to read or to complete commands under way, letting the
    /// reactor's other tasks run between tries (each yield also has the reactor look at
    /// its other sockets, among them an image bdev's connections to its OSDs) and first
    /// offering the CPU to any other runnable thread (the OSDs of `basalt dev` share the
    /// machine: without it, QD1 writes to an image took longer with polling). Whether
    /// something came (bytes read, the end or an error of the socket, completions
    /// answered).
    async fn poll_for_work(
        &mut self,
        reader: &mut tokio::net::tcp::OwnedReadHalf,
        poll: std::time::Duration,
    ) -> bool {
        let start = std::time::Instant::now();
        loop {
            match reader.try_read_buf(&mut self.input) {
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                read => {
                    self.on_read(read);
                    return true;
                }
            }
            if !self.in_flight.is_empty() && !self.is_closed() {
                let responses =
                    poll_fn(|cx| Poll::Ready(poll_ready(&mut self.in_flight, cx))).await;
                if let Poll::Ready(responses) = responses {
                    self.respond_all(responses);
                    return true;
                }
            }
            // A teardown meanwhile (a keep-alive expiry, a deleted subsystem) is the
            // select's to see.
            if start.elapsed() >= poll || self.is_closed() {
                return false;
            }
            basalt_io::process::yield_cpu();
            tokio::task::yield_now().await;
        }
    }

    /// Takes the outcome of a read into `input`: more bytes, the end, or an error.
    fn on_read(&mut self, read: io::Result<usize>) {
        match read {
            // The host closed the connection (NVMe/TCP has no half-close): the commands
            // still under way are given up, as it gave them up (see `run`'s end).
            Ok(0) => {
                self.stop_reading();
                self.terminating = true;
            }
            Ok(_) => {}
            Err(error) => {
                self.stop_reading();
                self.terminating = true;
                tracing::debug!(%error, "nvmf connection read failed");
            }
        }
    }

    /// Whether the controller this connection belongs to has been torn down.
    fn is_closed(&self) -> bool {
        self.closed.as_ref().is_some_and(|closed| *closed.borrow())
    }

    fn is_finished(&self) -> bool {
        !self.reading
            && self.output.is_empty()
            && (self.terminating || self.in_flight.iter().all(|command| command.async_event))
    }

    fn can_read(&self) -> bool {
        self.reading && !self.terminating && self.has_room()
    }

    /// Whether another command may start: fewer under way than the queue's size (and the
    /// asynchronous event requests), and the responses not yet sent under their bound. A
    /// host that sends more than its queue's size at once has the rest wait in the input
    /// buffer (and then in the socket) until commands complete, so that its commands
    /// under way, each with its buffer, stay bounded.
    fn has_room(&self) -> bool {
        let depth_max = self
            .queue
            .as_ref()
            .map_or(1, |queue| usize::from(queue.sq_size));
        self.in_flight.len() + self.transfers.len() + self.parked.len()
            <= depth_max + ASYNC_EVENT_REQUESTS_MAX
            && self.output.unwritten_len() < OUTPUT_BYTES_MAX
    }

    fn stop_reading(&mut self) {
        self.reading = false;
        // No host left to take an event.
        self.in_flight.retain(|command| !command.async_event);
    }

    fn make_room_to_read(&mut self) {
        if self.input_start > 0 && self.input_start == self.input.len() {
            self.input.clear();
            self.input_start = 0;
        }
        let want = READ_CHUNK_BYTES.max(self.negotiated.pdu_size_max());
        if self.input.capacity() - self.input.len() < READ_CHUNK_BYTES {
            self.input.drain(..self.input_start);
            self.input_start = 0;
            self.input.reserve(want);
        }
    }

    /// The next time something must be checked: the connect deadline until Connect, then
    /// the controller's keep-alive deadline on an admin queue.
    fn deadline(&self, connect_deadline: Instant) -> Option<Instant> {
        if !self.reading {
            return None;
        }
        match &self.queue {
            None => Some(connect_deadline),
            Some(queue) if queue.qid == 0 => queue
                .controller
                .keep_alive_deadline()
                .map(Instant::from_std),
            Some(_) => None,
        }
    }

    /// Closes the connection when write data an R2T asked for has not come within the
    /// transfer timeout: its bytes are the budget's, which other hosts wait for.
    fn check_transfers(&mut self) {
        let now = Instant::now();
        let late = self
            .transfers
            .values()
            .filter(|transfer| transfer.asked + self.transfer_timeout <= now)
            .count();
        if late == 0 {
            return;
        }
        // Not read, when the host is past its queue's size or does not read our output.
        let unread = !self.has_room();
        tracing::warn!(
            via = %self.via.address,
            late,
            unread,
            timeout = ?self.transfer_timeout,
            "write data asked for by R2Ts did not come in time: connection closed"
        );
        self.stop_reading();
        self.terminating = true;
    }

    fn check_deadlines(&mut self, connect_deadline: Instant) {
        let now = Instant::now();
        match &self.queue {
            None if now >= connect_deadline => {
                tracing::info!(via = %self.via.address, "nvmf connection sent no Connect in time");
                self.stop_reading();
                self.terminating = true;
            }
            Some(queue) if queue.qid == 0 => {
                let controller = &queue.controller;
                if controller
                    .keep_alive_deadline()
                    .is_some_and(|deadline| Instant::from_std(deadline) <= now)
                {
                    tracing::warn!(
                        subnqn = %controller.subsystem.nqn,
                        hostnqn = %controller.host_nqn,
                        controller = controller.id,
                        "keep alive timeout expired: controller torn down"
                    );
                    controller.close();
                    self.stop_reading();
                    self.terminating = true;
                }
            }
            _ => {}
        }
    }

    /// Decodes and handles every whole PDU in the input buffer.
    fn process_input(&mut self) {
        self.start_parked();
        let input = std::mem::take(&mut self.input);
        while self.reading && !self.terminating && self.input_start < input.len() {
            let bytes = &input[self.input_start..];
            match decode(bytes, &self.negotiated) {
                Ok(None) => break,
                // A command waits for room. (So does data queued behind it; a host within
                // its queue's size never meets this, as the room counts what it may have
                // under way and the asynchronous event requests besides.)
                Ok(Some((Pdu::CapsuleCmd(_), _))) if !self.has_room() => break,
                // A command whose data does not fit in the target's budget now, and those
                // after it, are parked until bytes come back.
                Ok(Some((Pdu::CapsuleCmd(capsule), used)))
                    if !self.parked.is_empty() || !self.take_bytes(&capsule.sqe) =>
                {
                    self.input_start += used;
                    self.parked.push_back((capsule.sqe, capsule.data.to_vec()));
                }
                Ok(Some((pdu, used))) => {
                    self.input_start += used;
                    self.handle(pdu, &bytes[..used]);
                    // A command that did not keep its bytes gives them back.
                    self.permit = None;
                }
                Err(PduError::DataDigest {
                    pdu_type,
                    command_id,
                    pdu_size_bytes,
                    ..
                }) => {
                    let raw = &bytes[..(pdu_size_bytes as usize).min(bytes.len())];
                    self.input_start += raw.len();
                    self.data_digest_failed(pdu_type, command_id, raw);
                }
                Err(error) => {
                    tracing::info!(via = %self.via.address, %error, "nvmf pdu refused, connection closed");
                    self.terminate(&error, term_req_error_data(bytes));
                }
            }
        }
        self.input = input;
    }

    /// Starts the parked commands whose bytes the budget now has, in order.
    fn start_parked(&mut self) {
        while self.reading
            && !self.terminating
            && let Some((sqe, _)) = self.parked.front()
        {
            let sqe = *sqe;
            if !self.take_bytes(&sqe) {
                return;
            }
            let (sqe, data) = self.parked.pop_front().expect("a front");
            self.command(sqe, &data);
            self.permit = None;
        }
    }

    /// Takes the data bytes of I/O command `sqe` from the target's budget (into
    /// `self.permit`, for the command's entry), or starts waiting for them in turn (the
    /// command is then parked, first) and says no. Admin commands and commands without
    /// data take none.
    fn take_bytes(&mut self, sqe: &Sqe) -> bool {
        let bytes = sqe.data_pointer.length.min(self.options.max_io_size);
        let io_queue = self.queue.as_ref().is_some_and(|queue| queue.qid != 0);
        if !io_queue || bytes == 0 {
            return true;
        }
        // The first parked command's wait ended: these bytes are its.
        if let Some(permit) = self.granted.take() {
            self.permit = Some(permit);
            return true;
        }
        if self.waiting.is_some() {
            return false;
        }
        if let Some(permit) = self.budget.try_take(bytes) {
            self.permit = Some(permit);
            return true;
        }
        self.waiting = Some(self.budget.take(bytes));
        false
    }

    /// Gives up every command under way, gathering write data or parked, and their bytes
    /// of the budget (a connection ending: its output may take long to go, if ever).
    fn give_up_commands(&mut self) {
        self.in_flight.clear();
        self.give_up_unstarted();
    }

    /// Gives up the commands not started or still gathering write data, and their bytes.
    fn give_up_unstarted(&mut self) {
        self.transfers.clear();
        self.parked.clear();
        self.waiting = None;
        self.granted = None;
        self.permit = None;
    }

    /// Sends the C2HTermReq for `error` (if one is due) and stops.
    fn terminate(&mut self, error: &PduError, error_data: &[u8]) {
        if let Some(term) = error.term_req(Role::Controller, error_data) {
            encode(&term, &self.negotiated, self.output.tail());
        }
        self.stop_reading();
        self.terminating = true;
    }

    fn handle(&mut self, pdu: Pdu<'_>, raw: &[u8]) {
        match pdu {
            Pdu::IcReq(ic_req) => {
                let maxh2cdata = self.options.io_unit_size;
                let in_capsule = IN_CAPSULE_DATA_SIZE_ADMIN.max(self.options.in_capsule_data_size);
                let (ic_resp, negotiated) =
                    Negotiated::accept_ic_req(&ic_req, maxh2cdata, in_capsule);
                encode(&Pdu::IcResp(ic_resp), &self.negotiated, self.output.tail());
                self.negotiated = negotiated;
            }
            Pdu::H2CTermReq(term) => {
                tracing::info!(
                    via = %self.via.address,
                    status = term.fatal_error_status,
                    information = term.fatal_error_information,
                    "host terminated the connection"
                );
                self.stop_reading();
                self.terminating = true;
            }
            Pdu::CapsuleCmd(capsule) => self.command(capsule.sqe, capsule.data),
            Pdu::H2CData(data) => self.h2c_data(&data, raw),
            // The decoder lets through only what a controller receives.
            Pdu::IcResp(_)
            | Pdu::C2HTermReq(_)
            | Pdu::CapsuleResp(_)
            | Pdu::C2HData(_)
            | Pdu::R2T(_) => {
                self.terminate(
                    &PduError::InvalidHeaderField {
                        pdu_type: pdu.pdu_type(),
                        offset: 0,
                        value: u32::from(pdu.pdu_type()),
                    },
                    raw,
                );
            }
        }
    }

    /// Whether the connection may poll: at most [`POLL_IN_FLIGHT_MAX`] commands under way,
    /// none of them an Asynchronous Event Request, and the controller still there.
    fn may_poll(&self) -> bool {
        self.in_flight.len() <= POLL_IN_FLIGHT_MAX
            && !self.in_flight.iter().any(|command| command.async_event)
            && !self.is_closed()
    }

    fn push(&mut self, future: ResponseFuture, data_limit: u32, site: ErrorSite) {
        self.enqueue(future, data_limit, site, false);
    }

    /// Puts a command under way; it counts as a controller's (for the error log) when the
    /// connection is bound to a queue now.
    fn enqueue(
        &mut self,
        future: ResponseFuture,
        data_limit: u32,
        site: ErrorSite,
        async_event: bool,
    ) {
        let bound = self.queue.is_some();
        self.in_flight.push(InFlight {
            future,
            data_limit,
            async_event,
            site: ErrorSite { bound, ..site },
            _permit: self.permit.take(),
        });
    }

    fn push_response(&mut self, response: Response, site: ErrorSite) {
        self.push(ready(response), 0, site);
    }

    fn command(&mut self, sqe: Sqe, data: &[u8]) {
        let id = sqe.command_id;
        let Some(queue) = &self.queue else {
            if sqe.opcode == FABRICS && sqe.fabrics_command_type() == FCTYPE_CONNECT {
                self.connect(&sqe, data);
            } else {
                self.push_response(
                    Response::status(id, Status::COMMAND_SEQUENCE_ERROR.with_dnr()),
                    ErrorSite::of(&sqe),
                );
            }
            return;
        };
        self.sq_head = (self.sq_head + 1) % queue.sq_size;
        let controller = queue.controller.clone();
        let admin = queue.qid == 0;
        if admin {
            controller.keep_alive();
        }
        if sqe.opcode == FABRICS {
            self.fabrics(sqe, admin);
            return;
        }
        let sgl = sqe.data_pointer;
        let in_capsule_max = if admin {
            IN_CAPSULE_DATA_SIZE_ADMIN
        } else {
            self.options.in_capsule_data_size
        };
        let status = if sqe.fuse() != 0 || sqe.psdt() != PSDT_SGL {
            Some(Status::INVALID_FIELD.with_dnr())
        } else if !sgl.is_in_capsule() && !sgl.is_transport() {
            Some(Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr())
        } else if sgl.is_in_capsule()
            && (sgl.length as usize != data.len() || data.len() > in_capsule_max as usize)
        {
            Some(Status::DATA_SGL_LENGTH_INVALID.with_dnr())
        } else if !controller.is_ready() {
            Some(Status::COMMAND_SEQUENCE_ERROR)
        } else {
            None
        };
        if let Some(status) = status {
            self.push_response(Response::status(id, status), ErrorSite::of(&sqe));
            return;
        }
        if admin {
            self.admin_command(sqe, &controller);
        } else {
            self.io_command(sqe, data, controller);
        }
    }

    fn admin_command(&mut self, sqe: Sqe, controller: &Arc<Controller>) {
        let id = sqe.command_id;
        if sqe.opcode == ADMIN_ASYNC_EVENT_REQUEST {
            let outstanding = self.in_flight.iter().filter(|c| c.async_event).count();
            if outstanding >= ASYNC_EVENT_REQUESTS_MAX {
                self.push_response(
                    Response::status(id, Status::ASYNC_EVENT_LIMIT_EXCEEDED),
                    ErrorSite::of(&sqe),
                );
                return;
            }
            let controller = controller.clone();
            let event = Box::pin(async move { Response::dw0(id, controller.next_event().await) });
            self.enqueue(event, 0, ErrorSite::of(&sqe), true);
            return;
        }
        let target = &self.target;
        let host_nqn = controller.host_nqn.clone();
        let response = controller.admin(&sqe, || target.discovery_records(&host_nqn));
        self.push(
            ready(response),
            sqe.data_pointer.length,
            ErrorSite::of(&sqe),
        );
    }

    fn io_command(&mut self, sqe: Sqe, data: &[u8], controller: Arc<Controller>) {
        let prepared = match io_command::prepare(&sqe, &controller) {
            Ok(prepared) => prepared,
            Err(response) => {
                self.push_response(response, ErrorSite::of(&sqe));
                return;
            }
        };
        let len = prepared.data_len_bytes as usize;
        if len == 0 || !data.is_empty() {
            let buffer = if data.is_empty() {
                DmaBuf::zeroed(0)
            } else {
                DmaBuf::from_slice(data)
            };
            let limit = sqe.data_pointer.length;
            let site = ErrorSite::of(&sqe);
            self.push(
                io_command::execute(sqe, prepared, buffer, controller),
                limit,
                site,
            );
            return;
        }
        // The data is to come in H2CData PDUs: ask for all of it with one R2T.
        let tag = self.free_transfer_tag();
        encode(
            &Pdu::R2T(R2T {
                command_id: sqe.command_id,
                transfer_tag: tag,
                offset_bytes: 0,
                len_bytes: prepared.data_len_bytes,
            }),
            &self.negotiated,
            self.output.tail(),
        );
        self.transfers.insert(
            tag,
            Transfer {
                sqe,
                prepared,
                buffer: DmaBuf::zeroed(len),
                received: 0,
                failed: false,
                permit: self.permit.take(),
                asked: Instant::now(),
            },
        );
    }

    fn free_transfer_tag(&mut self) -> u16 {
        loop {
            let tag = self.next_transfer_tag;
            self.next_transfer_tag = self.next_transfer_tag.wrapping_add(1);
            if !self.transfers.contains_key(&tag) {
                return tag;
            }
        }
    }

    fn h2c_data(&mut self, data: &H2CData<'_>, raw: &[u8]) {
        let invalid = |offset: u32, value: u32| PduError::InvalidHeaderField {
            pdu_type: PDU_TYPE_H2C_DATA,
            offset,
            value,
        };
        let Some(transfer) = self.transfers.get_mut(&data.transfer_tag) else {
            self.terminate(&invalid(10, u32::from(data.transfer_tag)), raw);
            return;
        };
        if transfer.sqe.command_id != data.command_id {
            self.terminate(&invalid(8, u32::from(data.command_id)), raw);
            return;
        }
        let offset = data.data_offset_bytes as usize;
        let end = offset + data.data.len();
        if offset != transfer.received || end > transfer.buffer.len() {
            let error = PduError::DataOutOfRange {
                pdu_type: PDU_TYPE_H2C_DATA,
                offset_bytes: data.data_offset_bytes,
                len_bytes: data.data.len() as u32,
            };
            self.terminate(&error, raw);
            return;
        }
        transfer.buffer[offset..end].copy_from_slice(data.data);
        transfer.received = end;
        if end == transfer.buffer.len() {
            self.finish_transfer(data.transfer_tag);
        }
    }

    /// A PDU whose data digest failed: its command fails with a transient transport
    /// error (the host may retry it); the connection goes on.
    fn data_digest_failed(&mut self, pdu_type: u8, command_id: u16, raw: &[u8]) {
        tracing::info!(via = %self.via.address, pdu_type, command_id, "data digest mismatch");
        if pdu_type == PDU_TYPE_CAPSULE_CMD {
            if let Some(queue) = &self.queue {
                self.sq_head = (self.sq_head + 1) % queue.sq_size;
            }
            // The capsule's command was not decoded: nothing says where it was aimed.
            self.push_response(
                Response::status(command_id, Status::TRANSIENT_TRANSPORT_ERROR),
                ErrorSite::default(),
            );
            return;
        }
        // H2CData: its header was checked (the header digest too); read where it goes.
        let field = |at: usize| {
            raw.get(at..at + 4)
                .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        let tag = raw
            .get(10..12)
            .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
        let (offset, len) = (field(12) as usize, field(16) as usize);
        match self.transfers.get_mut(&tag) {
            Some(transfer)
                if transfer.sqe.command_id == command_id
                    && offset == transfer.received
                    && offset + len <= transfer.buffer.len() =>
            {
                transfer.failed = true;
                transfer.received = offset + len;
                if transfer.received == transfer.buffer.len() {
                    self.finish_transfer(tag);
                }
            }
            _ => {
                let error = PduError::DataOutOfRange {
                    pdu_type,
                    offset_bytes: offset as u32,
                    len_bytes: len as u32,
                };
                self.terminate(&error, raw);
            }
        }
    }

    fn finish_transfer(&mut self, tag: u16) {
        let Some(transfer) = self.transfers.remove(&tag) else {
            return;
        };
        let id = transfer.sqe.command_id;
        let site = ErrorSite::of(&transfer.sqe);
        self.permit = transfer.permit;
        if transfer.failed {
            self.push_response(
                Response::status(id, Status::TRANSIENT_TRANSPORT_ERROR),
                site,
            );
            return;
        }
        let Some(queue) = &self.queue else {
            return;
        };
        let controller = queue.controller.clone();
        self.push(
            io_command::execute(transfer.sqe, transfer.prepared, transfer.buffer, controller),
            0,
            site,
        );
    }

    fn connect(&mut self, sqe: &Sqe, data: &[u8]) {
        let id = sqe.command_id;
        let command = ConnectCommand::from_sqe(sqe);
        let connect_data = match ConnectData::decode(data) {
            Ok(connect_data) => connect_data,
            Err(error) => {
                tracing::info!(via = %self.via.address, %error, "connect data refused");
                self.push_response(
                    Response {
                        dw0: connect_invalid_parameter_dw0(error.invalid_parameter_offset(), true),
                        ..Response::status(id, Status::CONNECT_INVALID_PARAMETERS.with_dnr())
                    },
                    ErrorSite::of(sqe),
                );
                return;
            }
        };
        match self
            .target
            .connect(id, &command, &connect_data, self.via, self.options)
        {
            Ok(queue) => {
                let controller_id = queue.controller.id;
                self.closed = Some(queue.controller.closed());
                self.sq_head = 1 % queue.sq_size;
                self.queue = Some(queue);
                self.push_response(
                    Response::dw0(id, connect_response_dw0(controller_id)),
                    ErrorSite::of(sqe),
                );
            }
            Err(response) => self.push_response(response, ErrorSite::of(sqe)),
        }
    }

    fn fabrics(&mut self, sqe: Sqe, admin: bool) {
        let id = sqe.command_id;
        let Some(queue) = &self.queue else {
            return;
        };
        let controller = queue.controller.clone();
        let response = match sqe.fabrics_command_type() {
            FCTYPE_CONNECT => Response::status(id, Status::COMMAND_SEQUENCE_ERROR.with_dnr()),
            FCTYPE_PROPERTY_GET if admin => {
                match controller.property_get(&PropertyCommand::from_sqe(&sqe)) {
                    Ok(value) => Response {
                        dw0: value as u32,
                        dw1: (value >> 32) as u32,
                        ..Response::status(id, Status::SUCCESS)
                    },
                    Err(status) => Response::status(id, status),
                }
            }
            FCTYPE_PROPERTY_SET if admin => {
                match controller.property_set(&PropertyCommand::from_sqe(&sqe)) {
                    Ok(()) => Response::status(id, Status::SUCCESS),
                    Err(status) => Response::status(id, status),
                }
            }
            FCTYPE_DISCONNECT => {
                // The response goes out, then the connection closes (and with an admin
                // queue, its controller).
                self.reading = false;
                Response::status(id, Status::SUCCESS)
            }
            _ => Response::status(id, Status::INVALID_OPCODE.with_dnr()),
        };
        self.push_response(response, ErrorSite::of(&sqe));
    }

    fn respond_all(&mut self, responses: Vec<(Response, u32, ErrorSite)>) {
        for (response, data_limit, site) in responses {
            self.respond(response, data_limit, &site);
        }
    }

    /// Encodes a command's end: C2HData with its data, then a response capsule unless
    /// the data PDU carries SUCCESS. A command that failed on a controller goes into its
    /// error log.
    fn respond(&mut self, response: Response, data_limit: u32, site: &ErrorSite) {
        if self.terminating {
            return;
        }
        let (qid, flow_control_disabled) = self.queue.as_ref().map_or((0, false), |queue| {
            (queue.qid, queue.sq_flow_control_disabled)
        });
        if !response.status.is_success()
            && site.bound
            && let Some(queue) = &self.queue
        {
            queue
                .controller
                .log_error(qid, response.command_id, site, response.status);
        }
        if response.status.is_success()
            && let Some(data) = &response.data
            && data_limit > 0
        {
            let len = data.len().min(data_limit as usize);
            let success = self.options.c2h_success && flow_control_disabled;
            encode(
                &Pdu::C2HData(C2HData {
                    command_id: response.command_id,
                    data_offset_bytes: 0,
                    data: &data[..len],
                    last: true,
                    success,
                }),
                &self.negotiated,
                self.output.tail(),
            );
            if success {
                return;
            }
        }
        let cqe = Cqe {
            dw0: response.dw0,
            dw1: response.dw1,
            sq_head: self.sq_head,
            sq_id: qid,
            command_id: response.command_id,
            status: response.status,
            phase: false,
        };
        encode(
            &Pdu::CapsuleResp(CapsuleResp { cqe }),
            &self.negotiated,
            self.output.tail(),
        );
    }
}
