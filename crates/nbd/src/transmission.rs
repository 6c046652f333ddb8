//! The transmission phase of one connection, in one task.
//!
//! The task reads requests in batches into an input buffer, starts each one on the bdev
//! (a future it keeps in a list rather than a spawned task), polls those futures in place,
//! and writes every ready reply with one socket write. A request on a RAM bdev completes
//! on its first poll, so a whole batch is answered without a thread switch; slower requests
//! complete in any order and are answered as they do.
//!
//! Bytes held for requests in flight plus replies not yet written are bounded by
//! [`IN_FLIGHT_BYTES_MAX`]: past it the task stops reading requests, so a client that does
//! not read its replies cannot make the server buffer without limit.
//!
//! Every await point is cancel-safe (`read_buf`, `write`, polling the futures), which is
//! what lets one `select!` serve reading, completing and writing together.

use std::future::{Future, poll_fn};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use basalt_bdev::BdevError;
use basalt_bdev::bdev::libc_errno;
use basalt_common::SendBuffer;
use basalt_io::DmaBuf;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

use crate::protocol::*;
use crate::server::Export;

/// Bytes of requests in flight plus unwritten replies per connection at most.
pub const IN_FLIGHT_BYTES_MAX: u64 = 64 << 20;
/// What a request without data (flush, trim, write zeroes) counts against the budget, at
/// least.
const COST_MIN_BYTES: u64 = 4096;
/// A trim or write zeroes counts this fraction of its range against the budget: it moves
/// no data over the socket, but a bdev may take work in proportion to its range (an image
/// splits it into a request per MiB, a file without `fallocate` writes zeroes).
const RANGE_COST_DIVISOR: u64 = 64;
/// Requests in flight per connection at most, whatever their cost.
const IN_FLIGHT_REQUESTS_MAX: usize = 1024;
/// Bytes read from the socket at a time, at least.
const READ_CHUNK_BYTES: usize = 256 << 10;
/// Error messages in structured replies are cut to this length.
const MESSAGE_SIZE_MAX: usize = 1024;
/// Flags we accept: FUA, NO_HOLE and DF (we send reads as one chunk, never fragmented).
const KNOWN_FLAGS: u16 = CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | (1 << 2);

/// A completed request.
struct Reply {
    handle: u64,
    offset_bytes: u64,
    cost_bytes: u64,
    result: Result<Option<DmaBuf>, Failure>,
}

/// An NBD error for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Failure {
    errno: u32,
    message: String,
}

impl Failure {
    fn new(errno: u32, message: impl Into<String>) -> Self {
        Self {
            errno,
            message: message.into(),
        }
    }
}

type Pending<'a> = Pin<Box<dyn Future<Output = Reply> + Send + 'a>>;

/// A write whose payload is too large to accept: its bytes are read and dropped.
struct Discard {
    request: Request,
    remaining_bytes: u64,
}

/// The connection's buffers and requests in flight.
struct Connection<'a> {
    export: &'a Export,
    structured: bool,
    input: Vec<u8>,
    input_start: usize,
    output: SendBuffer,
    in_flight: Vec<Pending<'a>>,
    in_flight_cost: u64,
    discard: Option<Discard>,
    reading: bool,
    /// The export was removed: the requests already received are answered with
    /// ESHUTDOWN, none is read after them.
    shutting_down: bool,
}

/// Serves requests on an export until the client disconnects or the export is removed;
/// fails with `TimedOut` when replies wait for `stall_timeout` without the client reading
/// any of them.
pub async fn transmit<R, W>(
    mut reader: R,
    mut writer: W,
    export: &Export,
    structured: bool,
    stall_timeout: Option<Duration>,
) -> io::Result<()>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    let mut closed = export.closed();
    let mut connection = Connection {
        export,
        structured,
        input: Vec::with_capacity(READ_CHUNK_BYTES),
        input_start: 0,
        output: SendBuffer::new(READ_CHUNK_BYTES),
        in_flight: Vec::new(),
        in_flight_cost: 0,
        discard: None,
        reading: true,
        shutting_down: false,
    };
    // Since when replies wait unread: the last write, or when replies came to an empty
    // output (stamped there, not on every turn of the loop).
    let mut written_at = Instant::now();
    loop {
        // A removed export starts no new request: those already in the input buffer are
        // answered with ESHUTDOWN, as the protocol asks.
        if *closed.borrow() {
            connection.shutting_down = true;
        }
        connection.parse_requests()?;
        if connection.is_finished() {
            break;
        }
        let can_read = connection.can_read();
        let has_output = !connection.output.is_empty();
        let has_in_flight = !connection.in_flight.is_empty();
        if can_read {
            connection.make_room_to_read();
        }
        let watching = connection.reading && !connection.shutting_down;
        tokio::select! {
            biased;
            replies = poll_fn(|cx| poll_ready(&mut connection.in_flight, cx)), if has_in_flight => {
                if !has_output {
                    // The replies start waiting now.
                    written_at = Instant::now();
                }
                for reply in replies {
                    connection.encode(reply);
                }
            }
            written = writer.write(connection.output.unwritten()), if has_output => {
                let written = written?;
                if written == 0 {
                    return Err(io::ErrorKind::WriteZero.into());
                }
                connection.output.written(written);
                written_at = Instant::now();
            }
            read = reader.read_buf(&mut connection.input), if can_read => {
                if read? == 0 {
                    connection.reading = false;
                }
            }
            _ = closed.wait_for(|closed| *closed), if watching => {
                connection.shutting_down = true;
            }
            () = tokio::time::sleep_until(written_at + stall_timeout.unwrap_or_default()),
                if has_output && stall_timeout.is_some() =>
            {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the client read no reply for {stall_timeout:?}"),
                ));
            }
            // Nothing under way, nothing to write, nothing to read or wait for: done (a
            // state `is_finished` should have caught; never a panic of the reactor).
            else => {
                tracing::warn!("nbd connection with nothing left to do ended");
                break;
            }
        }
    }
    writer.shutdown().await
}

/// Takes every completed request out of `in_flight`; pending while none has completed.
fn poll_ready(in_flight: &mut Vec<Pending<'_>>, cx: &mut Context<'_>) -> Poll<Vec<Reply>> {
    let mut ready = Vec::new();
    let mut index = 0;
    while index < in_flight.len() {
        match in_flight[index].as_mut().poll(cx) {
            Poll::Ready(reply) => {
                ready.push(reply);
                drop(in_flight.swap_remove(index));
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

impl<'a> Connection<'a> {
    fn unwritten_bytes(&self) -> u64 {
        self.output.unwritten_len() as u64
    }

    fn has_budget(&self) -> bool {
        self.in_flight_cost + self.unwritten_bytes() < IN_FLIGHT_BYTES_MAX
            && self.in_flight.len() < IN_FLIGHT_REQUESTS_MAX
    }

    /// Reading goes on while the client sends and the budget allows; a payload being
    /// discarded is always read, since it costs nothing.
    fn can_read(&self) -> bool {
        self.reading && !self.shutting_down && (self.has_budget() || self.discard.is_some())
    }

    fn is_finished(&self) -> bool {
        !self.reading && self.in_flight.is_empty() && self.unwritten_bytes() == 0
    }

    fn make_room_to_read(&mut self) {
        if self.input_start > 0 && self.input_start == self.input.len() {
            self.input.clear();
            self.input_start = 0;
            // A very large write's room (up to 32 MiB) is not kept once it is taken; that
            // of writes of a few MiB is, as they tend to come in streams.
            if self.input.capacity() > 16 * READ_CHUNK_BYTES {
                self.input.shrink_to(READ_CHUNK_BYTES);
            }
        }
        if self.input.capacity() - self.input.len() < READ_CHUNK_BYTES {
            self.input.drain(..self.input_start);
            self.input_start = 0;
            self.input.reserve(READ_CHUNK_BYTES);
        }
    }

    /// Starts every complete request in the input buffer, as far as the budget allows.
    fn parse_requests(&mut self) -> io::Result<()> {
        while self.reading {
            if let Some(discard) = &mut self.discard {
                let available = (self.input.len() - self.input_start) as u64;
                let dropped = available.min(discard.remaining_bytes);
                self.input_start += dropped as usize;
                discard.remaining_bytes -= dropped;
                if discard.remaining_bytes > 0 {
                    // Shutting down, the rest of its payload is not read: its answer now.
                    if self.shutting_down {
                        let request = discard.request;
                        self.discard = None;
                        self.reading = false;
                        self.shut_out(&request);
                    }
                    return Ok(());
                }
                let request = discard.request;
                self.discard = None;
                let message = format!(
                    "payload of {} bytes exceeds the {PAYLOAD_SIZE_MAX}-byte maximum",
                    request.len_bytes
                );
                self.encode(Reply {
                    handle: request.handle,
                    offset_bytes: request.offset_bytes,
                    cost_bytes: 0,
                    result: Err(Failure::new(EINVAL, message)),
                });
            }
            if !self.has_budget() {
                return Ok(());
            }
            let available = &self.input[self.input_start..];
            let Some(header) = available.first_chunk::<REQUEST_SIZE>() else {
                // Shutting down, nothing more is read: what is left is no whole request.
                self.reading &= !self.shutting_down;
                return Ok(());
            };
            let request = Request::decode(header)
                .map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error))?;
            if request.command == CMD_DISC {
                self.reading = false;
                return Ok(());
            }
            let payload = if request.has_payload() {
                if request.len_bytes > PAYLOAD_SIZE_MAX {
                    self.input_start += REQUEST_SIZE;
                    self.discard = Some(Discard {
                        request,
                        remaining_bytes: u64::from(request.len_bytes),
                    });
                    continue;
                }
                let frame_end = REQUEST_SIZE + request.len_bytes as usize;
                let Some(frame) = available.get(..frame_end) else {
                    self.reading &= !self.shutting_down;
                    // Wait for the rest of the payload; make room for it, dropping what
                    // was consumed first.
                    self.input.drain(..self.input_start);
                    self.input_start = 0;
                    self.input
                        .reserve(frame_end.saturating_sub(self.input.len()));
                    return Ok(());
                };
                let payload = DmaBuf::from_slice(&frame[REQUEST_SIZE..]);
                self.input_start += frame_end;
                Some(payload)
            } else {
                self.input_start += REQUEST_SIZE;
                None
            };
            if self.shutting_down {
                self.shut_out(&request);
                continue;
            }
            self.start(request, payload);
        }
        Ok(())
    }

    /// Answers `request`, received but not started, with ESHUTDOWN: its export was removed.
    fn shut_out(&mut self, request: &Request) {
        self.encode(Reply {
            handle: request.handle,
            offset_bytes: request.offset_bytes,
            cost_bytes: 0,
            result: Err(Failure::new(ESHUTDOWN, "the export was removed")),
        });
    }

    fn start(&mut self, request: Request, payload: Option<DmaBuf>) {
        let cost_bytes = match request.command {
            CMD_READ | CMD_WRITE => u64::from(request.len_bytes),
            CMD_TRIM | CMD_WRITE_ZEROES => u64::from(request.len_bytes) / RANGE_COST_DIVISOR,
            _ => 0,
        }
        .max(COST_MIN_BYTES);
        self.in_flight_cost += cost_bytes;
        let export = self.export;
        self.in_flight.push(Box::pin(async move {
            let result = execute(export, &request, payload).await;
            Reply {
                handle: request.handle,
                offset_bytes: request.offset_bytes,
                cost_bytes,
                result,
            }
        }));
    }

    /// Appends a reply to the output buffer and returns its cost to the budget.
    fn encode(&mut self, reply: Reply) {
        self.in_flight_cost -= reply.cost_bytes;
        let out = self.output.tail();
        match (reply.result, self.structured) {
            (Ok(data), false) => {
                out.extend_from_slice(&encode_simple_reply(0, reply.handle));
                if let Some(data) = data {
                    out.extend_from_slice(&data);
                }
            }
            (Err(failure), false) => {
                out.extend_from_slice(&encode_simple_reply(failure.errno, reply.handle))
            }
            (Ok(Some(data)), true) => {
                let len = u32::try_from(data.len() + 8)
                    .expect("reads are at most PAYLOAD_SIZE_MAX bytes");
                out.extend_from_slice(&encode_structured_reply(
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_OFFSET_DATA,
                    reply.handle,
                    len,
                ));
                out.extend_from_slice(&reply.offset_bytes.to_be_bytes());
                out.extend_from_slice(&data);
            }
            (Ok(None), true) => {
                out.extend_from_slice(&encode_structured_reply(
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_NONE,
                    reply.handle,
                    0,
                ));
            }
            (Err(failure), true) => {
                let message = truncate_utf8(&failure.message, MESSAGE_SIZE_MAX);
                let len = u32::try_from(6 + message.len()).expect("message is short");
                out.extend_from_slice(&encode_structured_reply(
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_ERROR,
                    reply.handle,
                    len,
                ));
                out.extend_from_slice(&failure.errno.to_be_bytes());
                out.extend_from_slice(&(message.len() as u16).to_be_bytes());
                out.extend_from_slice(message.as_bytes());
            }
        }
    }
}

async fn execute(
    export: &Export,
    request: &Request,
    payload: Option<DmaBuf>,
) -> Result<Option<DmaBuf>, Failure> {
    if request.flags & !KNOWN_FLAGS != 0 {
        return Err(Failure::new(
            EINVAL,
            format!("unsupported command flags {:#x}", request.flags),
        ));
    }
    let bdev = &export.bdev;
    let info = bdev.info();
    let offset = request.offset_bytes;
    let len = u64::from(request.len_bytes);
    let fua = request.flags & CMD_FLAG_FUA != 0;
    let fail =
        |error: BdevError| Failure::new(errno_for(request.command, &error), error.to_string());
    let is_write = matches!(request.command, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if is_write && export.readonly {
        return Err(Failure::new(
            EPERM,
            format!("export {} is read-only", export.name),
        ));
    }
    match request.command {
        CMD_READ => {
            if request.len_bytes > PAYLOAD_SIZE_MAX {
                let message =
                    format!("read of {len} bytes exceeds the {PAYLOAD_SIZE_MAX}-byte maximum");
                return Err(Failure::new(EINVAL, message));
            }
            let extent = info.data_extent(offset, len).map_err(fail)?;
            bdev.read(extent).await.map(Some).map_err(fail)
        }
        CMD_WRITE => {
            let data = payload.expect("writes carry a payload");
            let extent = info.data_extent(offset, len).map_err(fail)?;
            bdev.write(extent, data, fua)
                .await
                .map(|()| None)
                .map_err(fail)
        }
        CMD_FLUSH => bdev.flush().await.map(|()| None).map_err(fail),
        CMD_TRIM | CMD_WRITE_ZEROES => {
            let extent = info.extent(offset, len).map_err(fail)?;
            if request.command == CMD_TRIM {
                bdev.discard(extent).await.map_err(fail)?;
            } else {
                let deallocate = request.flags & CMD_FLAG_NO_HOLE == 0;
                bdev.write_zeroes(extent, deallocate).await.map_err(fail)?;
            }
            if fua {
                bdev.flush().await.map_err(fail)?;
            }
            Ok(None)
        }
        command => Err(Failure::new(EINVAL, format!("unknown command {command}"))),
    }
}

/// The NBD error for a bdev error: a range past the end is ENOSPC for writes (as qemu-nbd
/// answers) and EINVAL otherwise.
fn errno_for(command: u16, error: &BdevError) -> u32 {
    match error {
        BdevError::OutOfRange { .. } if matches!(command, CMD_WRITE | CMD_WRITE_ZEROES) => ENOSPC,
        // NBD reserves ENOTSUP for fast zeroing, which we do not offer; a device that cannot
        // do something is an I/O error to the client.
        _ => match error.errno() {
            libc_errno::EINVAL => EINVAL,
            libc_errno::ENOSPC => ENOSPC,
            libc_errno::EPERM => EPERM,
            _ => EIO,
        },
    }
}

fn truncate_utf8(text: &str, len_max: usize) -> &str {
    let mut end = text.len().min(len_max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io_error(errno: i32) -> BdevError {
        BdevError::Io {
            bdev: "b".into(),
            source: io::Error::from_raw_os_error(errno),
        }
    }

    #[test]
    fn bdev_errors_map_to_nbd_errors() {
        let out_of_range = BdevError::OutOfRange {
            bdev: "b".into(),
            offset_bytes: 0,
            len_bytes: 1,
            size_bytes: 0,
        };
        let misaligned = BdevError::Misaligned {
            bdev: "b".into(),
            offset_bytes: 1,
            len_bytes: 1,
            block_size: 512,
        };
        assert_eq!(errno_for(CMD_WRITE, &out_of_range), ENOSPC);
        assert_eq!(errno_for(CMD_WRITE_ZEROES, &out_of_range), ENOSPC);
        assert_eq!(errno_for(CMD_READ, &out_of_range), EINVAL);
        assert_eq!(errno_for(CMD_TRIM, &out_of_range), EINVAL);
        assert_eq!(errno_for(CMD_READ, &misaligned), EINVAL);
        assert_eq!(errno_for(CMD_WRITE, &io_error(28)), ENOSPC, "ENOSPC");
        assert_eq!(errno_for(CMD_WRITE, &io_error(122)), ENOSPC, "EDQUOT");
        assert_eq!(
            errno_for(CMD_WRITE_ZEROES, &io_error(95)),
            EIO,
            "EOPNOTSUPP"
        );
        assert_eq!(errno_for(CMD_READ, &io_error(5)), EIO, "EIO");
    }

    #[test]
    fn truncation_keeps_utf8_whole() {
        assert_eq!(truncate_utf8("héllo", 2), "h");
        assert_eq!(truncate_utf8("abc", 10), "abc");
    }
}
