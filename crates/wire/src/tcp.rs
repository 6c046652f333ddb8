//! Frames over TCP: a client that pipelines requests and matches replies by request id, and
//! a server that answers each request with a handler, in any order.
//!
//! A frame goes onto the socket at once, from the task that sends it, when it is alone (a
//! one-way message, or a request or reply with no other request in flight on the
//! connection), nothing is queued ahead of it and the socket takes it whole: a raft append
//! then leaves before the sender's next task (its own log write, say) runs, and a lone
//! request pays no task switch. Otherwise it waits for the connection's writer task, which
//! first lets the tasks already woken run, so the requests that a burst of replies sets off
//! (or the replies that a burst of completions makes) leave together in one write, as do
//! frames queued while it writes. `TCP_NODELAY` is set: a frame is never held back
//! waiting for more data from the network.
//!
//! An idle connection to a peer that died without closing (a host powered off, cut off by
//! the network) fails once its keep-alive probes go unanswered
//! ([`basalt_io::tcp_options`]); one with data in flight, after TCP's retransmissions.
//! When a connection's write fails, the bytes waiting for it are dropped.
//!
//! This is the only module of `wire` that does I/O; the codecs stay pure.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;

use basalt_io::tcp_options::tune;

use crate::frame;
use crate::message::{Message, MessageError};

/// Bytes read from a socket at a time, at least.
const READ_CHUNK_BYTES: usize = 256 << 10;
/// Request id of one-way messages (no reply expected).
pub const ONE_WAY: u64 = 0;
/// Requests of one connection under way at most: past it, a server reads no more of the
/// connection until some are answered, so a peer that sends without reading its replies
/// is held back by TCP rather than by the server's memory.
const UNANSWERED_MAX: u64 = if cfg!(test) { 64 } else { 4096 };
/// Reply bytes waiting for a connection's socket past which a server reads no more
/// requests from it.
const BACKLOG_BYTES_MAX: usize = if cfg!(test) { 4 << 20 } else { 64 << 20 };
/// Bytes a client connection may have waiting for its socket, rather than growing in
/// memory with every retry sent to a peer that reads none (a stopped process, a stuck
/// host): a call waits for room (its attempt's timeout gives up on it before it is sent,
/// so that nothing of it can arrive late), a one-way message (raft, which tolerates loss)
/// fails the connection. Well above what a client's requests or a leader's raft appends
/// keep under way to a live peer.
const SEND_BACKLOG_BYTES_MAX: usize = if cfg!(test) { 128 << 20 } else { 256 << 20 };

/// A writer's buffers keep at most this much room once empty (a burst's room goes).
const KEPT_ROOM_BYTES: usize = 4 * READ_CHUNK_BYTES;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The connection failed or closed; the request may or may not have been executed.
    #[error("connection to {peer} closed: {reason}")]
    Closed {
        /// The peer.
        peer: SocketAddr,
        /// Why.
        reason: String,
    },
    /// Connecting failed.
    #[error("cannot connect to {peer}: {source}")]
    Connect {
        /// The peer.
        peer: SocketAddr,
        /// Why.
        source: io::Error,
    },
}

/// What a server does with a request: `Some(reply)`, or `None` for a one-way message.
pub type Handler =
    Arc<dyn Fn(Message) -> Pin<Box<dyn Future<Output = Option<Message>> + Send>> + Send + Sync>;

/// Reads frames off a stream and hands each decoded message to `deliver` with its id, each
/// once `room` is ready (a buffer of small requests may ask for much more than it holds).
/// Returns when the peer closes; a malformed frame or message ends the connection.
async fn read_frames<R: AsyncRead + Unpin, Room: Future<Output = ()>>(
    mut reader: R,
    mut deliver: impl FnMut(u64, Message),
    mut room: impl FnMut() -> Room,
) -> io::Result<()> {
    let mut buffer: Vec<u8> = Vec::with_capacity(READ_CHUNK_BYTES);
    let mut start = 0;
    loop {
        loop {
            match frame::decode(&buffer[start..]) {
                Ok(Some((frame, used))) => {
                    let message = Message::decode(&frame).map_err(|error: MessageError| {
                        io::Error::new(io::ErrorKind::InvalidData, error)
                    })?;
                    room().await;
                    deliver(frame.request_id, message);
                    start += used;
                }
                Ok(None) => break,
                Err(error) => return Err(io::Error::new(io::ErrorKind::InvalidData, error)),
            }
        }
        if start == buffer.len() {
            buffer.clear();
            start = 0;
        } else if start > 0 {
            buffer.drain(..start);
            start = 0;
        }
        buffer.reserve(READ_CHUNK_BYTES);
        if reader.read_buf(&mut buffer).await? == 0 {
            return Ok(());
        }
    }
}

/// The sending side of one connection; clones share it. The connection's writer task ends,
/// after writing what is queued, when the last clone is dropped.
struct Outgoing {
    shared: Arc<OutgoingShared>,
}

struct OutgoingShared {
    socket: OwnedWriteHalf,
    state: Mutex<OutgoingState>,
    wake: Notify,
    /// Told each time the writer task has written what it took.
    written: Notify,
}

#[derive(Default)]
struct OutgoingState {
    /// Bytes waiting for the writer task, in stream order.
    queued: Vec<u8>,
    /// Bytes the writer task took from `queued` and has not all written yet (0: it is not
    /// writing).
    writing_bytes: usize,
    /// A write failed: nothing more is sent.
    failed: bool,
    /// Live [`Outgoing`] handles.
    senders: usize,
}

impl Outgoing {
    /// The sending side of `socket`, and its writer task.
    fn new(socket: OwnedWriteHalf) -> (Self, JoinHandle<()>) {
        let shared = Arc::new(OutgoingShared {
            socket,
            state: Mutex::new(OutgoingState {
                senders: 1,
                ..OutgoingState::default()
            }),
            wake: Notify::new(),
            written: Notify::new(),
        });
        let writer = shared.clone();
        let task = tokio::spawn(async move {
            if let Err(error) = writer.write_queued().await {
                tracing::debug!(%error, "connection write failed");
                let mut state = writer.state();
                state.failed = true;
                // Nothing waiting will ever go.
                state.queued = Vec::new();
            }
            // Whoever waits for room learns that none will come.
            writer.written.notify_waiters();
        });
        (Self { shared }, task)
    }

    /// Sends `frame` after every frame sent before it; `Err` once a write has failed, or
    /// (the connection failing then) once more than `fail_past` bytes would wait.
    /// `alone`: nothing else is in flight on the connection, so there is nothing to
    /// gather it with.
    fn send(&self, frame: &[u8], alone: bool, fail_past: Option<usize>) -> Result<(), String> {
        let mut state = self.shared.state();
        if state.failed {
            return Err("a write to it failed".to_string());
        }
        let waiting = state.queued.len() + state.writing_bytes;
        if fail_past.is_some_and(|max| waiting > 0 && waiting + frame.len() > max) {
            tracing::warn!(
                waiting_bytes = waiting,
                "the peer has not read what was sent to it: the connection fails"
            );
            state.failed = true;
            state.queued = Vec::new();
            drop(state);
            self.shared.wake.notify_one();
            self.shared.written.notify_waiters();
            return Err(format!(
                "the peer has not read the {waiting} bytes sent to it"
            ));
        }
        let mut rest = frame;
        if state.queued.is_empty() && state.writing_bytes == 0 && alone {
            match self.shared.socket.try_write(frame) {
                Ok(written) if written == frame.len() => return Ok(()),
                Ok(written) => rest = &frame[written..],
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) => {
                    tracing::debug!(%error, "connection write failed");
                    state.failed = true;
                    return Err(format!("a write to it failed: {error}"));
                }
            }
        }
        state.queued.extend_from_slice(rest);
        drop(state);
        self.shared.wake.notify_one();
        Ok(())
    }

    /// Waits until fewer than `max_bytes` are waiting for the socket.
    async fn backlog_below(&self, max_bytes: usize) {
        let below = || {
            let state = self.shared.state();
            state.failed || state.queued.len() + state.writing_bytes < max_bytes
        };
        while !below() {
            let written = self.shared.written.notified();
            tokio::pin!(written);
            written.as_mut().enable();
            if below() {
                return;
            }
            written.await;
        }
    }
}

impl Clone for Outgoing {
    fn clone(&self) -> Self {
        self.shared.state().senders += 1;
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        self.shared.state().senders -= 1;
        self.shared.wake.notify_one();
    }
}

impl OutgoingShared {
    fn state(&self) -> std::sync::MutexGuard<'_, OutgoingState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The writer task: writes whatever is queued, all of it in one write when it can,
    /// until the last sender is gone and nothing is left.
    async fn write_queued(&self) -> io::Result<()> {
        let mut batch = Vec::new();
        loop {
            let wrote = !batch.is_empty();
            batch.clear();
            {
                let mut state = self.state();
                state.writing_bytes = 0;
                if state.queued.is_empty() {
                    // Nothing waits: after a burst, both give its room back (not within one,
                    // where the batch's room goes on serving as the queue's).
                    state.queued.shrink_to(KEPT_ROOM_BYTES);
                    batch.shrink_to(KEPT_ROOM_BYTES);
                    if state.senders == 0 || state.failed {
                        return Ok(());
                    }
                } else {
                    std::mem::swap(&mut batch, &mut state.queued);
                    state.writing_bytes = batch.len();
                }
            }
            if wrote {
                self.written.notify_waiters();
            }
            if batch.is_empty() {
                self.wake.notified().await;
                // The tasks woken with this one queue their frames first.
                tokio::task::yield_now().await;
                continue;
            }
            let mut at = 0;
            while at < batch.len() {
                self.socket.writable().await?;
                match self.socket.try_write(&batch[at..]) {
                    Ok(written) => at += written,
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                    Err(error) => return Err(error),
                }
            }
        }
    }
}

type Pending = Arc<Mutex<PendingCalls>>;

#[derive(Default)]
struct PendingCalls {
    calls: HashMap<u64, oneshot::Sender<Message>>,
    closed: Option<String>,
}

/// Removes a call from the pending set when dropped (once answered, it is already gone).
struct Forget<'a> {
    pending: &'a Pending,
    id: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        lock(self.pending).calls.remove(&self.id);
    }
}

/// Counts a request as unanswered until it is answered or its task ends otherwise (a
/// handler that panics or never replies does not leave the count high).
struct Unanswered(Option<Arc<UnansweredCount>>);

/// How many requests of a connection are unanswered, up to `max` (the reader takes one
/// more only below it), and a bell rung when an answer brings the count below `max`.
struct UnansweredCount {
    count: AtomicU64,
    max: u64,
    answered: Notify,
}

impl UnansweredCount {
    fn new(max: u64) -> Self {
        Self {
            count: AtomicU64::new(0),
            max,
            answered: Notify::new(),
        }
    }

    /// Counts one answered; whether it was the only one unanswered.
    fn answer(&self) -> bool {
        let before = self.count.fetch_sub(1, Ordering::Relaxed);
        // Only a reader at the limit waits: no bell (and no lock) for the others.
        if before >= self.max {
            self.answered.notify_waiters();
        }
        before == 1
    }

    /// Waits until fewer than `max` are unanswered.
    async fn below(&self) {
        let below = || self.count.load(Ordering::Relaxed) < self.max;
        while !below() {
            let answered = self.answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            if below() {
                return;
            }
            answered.await;
        }
    }
}

impl Unanswered {
    fn new(count: &Arc<UnansweredCount>) -> Self {
        count.count.fetch_add(1, Ordering::Relaxed);
        Self(Some(count.clone()))
    }

    /// Counts it answered; whether it was the only one unanswered.
    fn answered(mut self) -> bool {
        self.0.take().is_some_and(|count| count.answer())
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(count) = self.0.take() {
            count.answer();
        }
    }
}

/// A client connection: calls with replies, and one-way messages.
pub struct Client {
    peer: SocketAddr,
    outgoing: Outgoing,
    pending: Pending,
    next_id: AtomicU64,
    tasks: [JoinHandle<()>; 2],
}

fn lock(pending: &Pending) -> std::sync::MutexGuard<'_, PendingCalls> {
    pending
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Client {
    /// Connects to `peer`.
    pub async fn connect(peer: SocketAddr) -> Result<Self, TransportError> {
        let stream = TcpStream::connect(peer)
            .await
            .map_err(|source| TransportError::Connect { peer, source })?;
        tune(&stream).map_err(|source| TransportError::Connect { peer, source })?;
        let (reader, writer) = stream.into_split();
        let (outgoing, writer_task) = Outgoing::new(writer);
        let pending: Pending = Arc::default();
        let replies = pending.clone();
        let reader_task = tokio::spawn(async move {
            let result = read_frames(
                reader,
                |id, message| {
                    if let Some(call) = lock(&replies).calls.remove(&id) {
                        let _ = call.send(message);
                    }
                },
                || std::future::ready(()),
            )
            .await;
            let reason = match result {
                Ok(()) => "closed by the peer".to_string(),
                Err(error) => error.to_string(),
            };
            // Dropping the senders fails every call still waiting.
            let mut state = lock(&replies);
            state.closed = Some(reason);
            state.calls.clear();
        });
        Ok(Self {
            peer,
            outgoing,
            pending,
            next_id: AtomicU64::new(1),
            tasks: [reader_task, writer_task],
        })
    }

    fn closed(&self, reason: Option<String>) -> TransportError {
        TransportError::Closed {
            peer: self.peer,
            reason: reason.unwrap_or_else(|| "closed".to_string()),
        }
    }

    /// Sends a request and waits for its reply; many calls may be in flight at once.
    pub async fn call(&self, message: &Message) -> Result<Message, TransportError> {
        // Room first: a call given up while it waits was never sent.
        self.outgoing.backlog_below(SEND_BACKLOG_BYTES_MAX).await;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        let alone = {
            let mut state = lock(&self.pending);
            if let Some(reason) = &state.closed {
                return Err(self.closed(Some(reason.clone())));
            }
            state.calls.insert(id, reply);
            state.calls.len() == 1
        };
        // A call given up (its future dropped by a timeout) leaves the pending set, or it
        // would count as in flight for good and keep later calls from going out at once.
        let _forget = Forget {
            pending: &self.pending,
            id,
        };
        if let Err(reason) = self.outgoing.send(&message.encode(id), alone, None) {
            return Err(self.closed(Some(reason)));
        }
        answer
            .await
            .map_err(|_| self.closed(lock(&self.pending).closed.clone()))
    }

    /// Sends a message that has no reply (a raft message); `Ok` holds the frame's length.
    pub fn send(&self, message: &Message) -> Result<usize, TransportError> {
        if let Some(reason) = lock(&self.pending).closed.clone() {
            return Err(self.closed(Some(reason)));
        }
        let frame = message.encode(ONE_WAY);
        self.outgoing
            .send(&frame, true, Some(SEND_BACKLOG_BYTES_MAX))
            .map_err(|reason| self.closed(Some(reason)))?;
        Ok(frame.len())
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// A listening server; dropping it stops accepting (open connections go on).
pub struct Server {
    address: SocketAddr,
    task: JoinHandle<()>,
}

impl Server {
    /// Listens on `address` and answers every request with `handler`.
    pub async fn bind(address: SocketAddr, handler: Handler) -> io::Result<Self> {
        let listener = TcpListener::bind(address).await?;
        let address = listener.local_addr()?;
        let task = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, peer)) => {
                        if let Err(error) = tune(&stream) {
                            tracing::warn!(%error, %peer, "cannot set the connection's options");
                        }
                        tokio::spawn(serve_connection(stream, peer, handler.clone()));
                    }
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                }
            }
        });
        Ok(Self { address, task })
    }

    /// Where it listens.
    pub fn address(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_connection(stream: TcpStream, peer: SocketAddr, handler: Handler) {
    let (reader, writer) = stream.into_split();
    let (outgoing, writer_task) = Outgoing::new(writer);
    // Requests of this connection not answered yet.
    let unanswered = Arc::new(UnansweredCount::new(UNANSWERED_MAX));
    let result = read_frames(
        reader,
        |id, message| {
            let reply = handler(message);
            let outgoing = outgoing.clone();
            let counted = (id != ONE_WAY).then(|| Unanswered::new(&unanswered));
            tokio::spawn(async move {
                let reply = reply.await;
                let Some(counted) = counted else {
                    return;
                };
                let alone = counted.answered();
                if let Some(reply) = reply {
                    let _ = outgoing.send(&reply.encode(id), alone, None);
                }
            });
        },
        || async {
            unanswered.below().await;
            outgoing.backlog_below(BACKLOG_BYTES_MAX).await;
        },
    )
    .await;
    if let Err(error) = result {
        tracing::debug!(%peer, %error, "connection closed on a bad frame");
    }
    drop(outgoing);
    let _ = writer_task.await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Status;
    use basalt_common::{PgId, PoolId};
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;

    /// A request the echo handler answers after `delay_ms` with `tag` as the reply's data.
    fn echo_request(delay_ms: u8, tag: &[u8]) -> Message {
        Message::Raft {
            pg: pg(0),
            message: [&[delay_ms][..], tag].concat(),
        }
    }

    fn echo_reply(tag: &[u8]) -> Message {
        Message::Reply {
            status: Status::Ok,
            data: tag.to_vec(),
        }
    }

    fn pg(index: u32) -> PgId {
        PgId {
            pool: PoolId(1),
            index,
        }
    }

    /// Answers a raft message carrying `[delay_ms, tag]` after the delay with a reply whose
    /// data is the tag; counts one-way messages.
    fn echo(one_way: Arc<AtomicU64>) -> Handler {
        Arc::new(move |message| {
            let one_way = one_way.clone();
            Box::pin(async move {
                let Message::Raft { message: bytes, .. } = message else {
                    one_way.fetch_add(1, Ordering::Relaxed);
                    return None;
                };
                tokio::time::sleep(Duration::from_millis(u64::from(bytes[0]))).await;
                Some(Message::Reply {
                    status: Status::Ok,
                    data: bytes[1..].to_vec(),
                })
            })
        })
    }

    /// A server answering with [`echo`], and how many requests it has taken.
    async fn counting_echo_server() -> (Server, Arc<AtomicU64>) {
        let handled = Arc::new(AtomicU64::new(0));
        let counted = handled.clone();
        let echo = echo(Arc::default());
        let handler: Handler = Arc::new(move |message| {
            counted.fetch_add(1, Ordering::Relaxed);
            echo(message)
        });
        let server = Server::bind("127.0.0.1:0".parse().expect("addr"), handler)
            .await
            .expect("bind");
        (server, handled)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pipelined_calls_get_their_own_replies_in_any_order() {
        let server = Server::bind("127.0.0.1:0".parse().expect("addr"), echo(Arc::default()))
            .await
            .expect("bind");
        let client = Arc::new(Client::connect(server.address()).await.expect("connect"));
        let mut calls = Vec::new();
        for n in 0..200u8 {
            let client = client.clone();
            calls.push(tokio::spawn(async move {
                // Later requests finish earlier: replies come back out of order.
                let delay = 20 - (n % 20);
                let reply = client
                    .call(&echo_request(delay, &[n, n]))
                    .await
                    .expect("reply");
                assert_eq!(reply, echo_reply(&[n, n]));
            }));
        }
        for call in calls {
            call.await.expect("call task");
        }
    }

    #[tokio::test]
    async fn a_call_given_up_leaves_nothing_pending_and_gathered_calls_get_replies() {
        let server = Server::bind("127.0.0.1:0".parse().expect("addr"), echo(Arc::default()))
            .await
            .expect("bind");
        let client = Arc::new(Client::connect(server.address()).await.expect("connect"));
        // The echo answers after 200 ms; the caller gives up after 10.
        let given_up = tokio::time::timeout(
            Duration::from_millis(10),
            client.call(&echo_request(200, b"x")),
        )
        .await;
        assert!(given_up.is_err(), "the call should have timed out");
        assert!(
            lock(&client.pending).calls.is_empty(),
            "a call given up stays pending"
        );
        // Many calls at once (they gather), then a lone one.
        let mut calls = Vec::new();
        for n in 0..50u8 {
            let client = client.clone();
            calls.push(tokio::spawn(async move {
                client
                    .call(&echo_request(n % 5, &[n]))
                    .await
                    .expect("reply")
            }));
        }
        for (n, call) in (0..50u8).zip(calls) {
            assert_eq!(call.await.expect("call task"), echo_reply(&[n]));
        }
        let reply = client.call(&echo_request(0, b"lone")).await.expect("reply");
        assert_eq!(reply, echo_reply(b"lone"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frames_beyond_what_the_socket_takes_at_once_arrive_whole_and_in_order() {
        // A peer that reads slowly, on a thread of its own: the socket takes part of a
        // frame, the rest queues behind it for the writer task, and frames sent when the
        // socket has room again must not overtake it.
        let frames = 96u32;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let reader = std::thread::spawn(move || {
            use std::io::Read;
            let (mut stream, _) = listener.accept().expect("accept");
            let (mut bytes, mut at, mut seen) = (Vec::new(), 0, Vec::new());
            let mut chunk = vec![0u8; 32 << 10];
            while seen.len() < frames as usize {
                let n = stream.read(&mut chunk).expect("read");
                assert!(n > 0, "the connection closed early");
                bytes.extend_from_slice(&chunk[..n]);
                while let Some((frame, used)) = frame::decode(&bytes[at..]).expect("a frame") {
                    at += used;
                    let Message::Raft { message, .. } = Message::decode(&frame).expect("message")
                    else {
                        panic!("not a frame that was sent");
                    };
                    let number = u32::from_le_bytes(message[..4].try_into().expect("4 bytes"));
                    assert!(
                        message[4..].iter().all(|&b| b == number as u8),
                        "frame {number} is whole"
                    );
                    seen.push(number);
                }
                std::thread::sleep(Duration::from_micros(50));
            }
            seen
        });
        let client = Client::connect(address).await.expect("connect");
        for number in 0..frames {
            let mut bytes = vec![number as u8; 1 << 20];
            bytes[..4].copy_from_slice(&number.to_le_bytes());
            client
                .send(&Message::Raft {
                    pg: pg(0),
                    message: bytes,
                })
                .expect("send");
            tokio::task::yield_now().await;
        }
        let seen = tokio::task::spawn_blocking(move || reader.join())
            .await
            .expect("task")
            .expect("the reader saw whole frames");
        assert_eq!(seen, (0..frames).collect::<Vec<_>>(), "in the order sent");
    }

    /// A peer that sends requests without reading the replies: the server stops reading
    /// its requests once the replies waiting for the socket pass the backlog, rather than
    /// keep them all in memory, and every reply arrives once the peer reads.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_reads_no_replies_is_held_back() {
        let (server, handled) = counting_echo_server().await;
        const REQUESTS: u64 = 200;
        const TAG_BYTES: usize = 256 << 10;
        let address = server.address();
        let (start_reading, read) = std::sync::mpsc::channel::<()>();
        let peer = std::thread::spawn(move || {
            use std::io::{Read, Write};
            let mut stream = std::net::TcpStream::connect(address).expect("connect");
            let mut writer = stream.try_clone().expect("clone");
            let sender = std::thread::spawn(move || {
                for id in 1..=REQUESTS {
                    let frame = echo_request(0, &vec![id as u8; TAG_BYTES]).encode(id);
                    writer.write_all(&frame).expect("send");
                }
            });
            read.recv().expect("told to read");
            let (mut bytes, mut replies) = (Vec::new(), 0);
            let mut chunk = vec![0u8; 1 << 20];
            while replies < REQUESTS {
                let n = stream.read(&mut chunk).expect("read");
                assert!(n > 0, "the server closed");
                bytes.extend_from_slice(&chunk[..n]);
                while let Some((_, used)) = frame::decode(&bytes).expect("a frame") {
                    bytes.drain(..used);
                    replies += 1;
                }
            }
            sender.join().expect("sender");
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        let held = handled.load(Ordering::Relaxed);
        start_reading.send(()).expect("peer");
        tokio::task::spawn_blocking(move || peer.join())
            .await
            .expect("task")
            .expect("every reply arrived");
        assert!(
            held < REQUESTS / 2,
            "{held} of {REQUESTS} requests of 256 KiB taken with no reply read"
        );
        assert_eq!(handled.load(Ordering::Relaxed), REQUESTS);
    }

    /// Requests that take their time: a server takes at most [`UNANSWERED_MAX`] of a
    /// connection's at once, even when one read brings many more, and answers them all.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unanswered_requests_per_connection_are_bounded() {
        let (server, handled) = counting_echo_server().await;
        const REQUESTS: u64 = 500;
        let requests: Vec<u8> = (1..=REQUESTS)
            .flat_map(|id| echo_request(100, &[id as u8]).encode(id))
            .collect();
        let mut stream = TcpStream::connect(server.address()).await.expect("connect");
        stream.write_all(&requests).await.expect("send");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let held = handled.load(Ordering::Relaxed);
        assert!(
            (1..=UNANSWERED_MAX).contains(&held),
            "{held} of {REQUESTS} requests taken at once (at most {UNANSWERED_MAX})"
        );
        let (mut bytes, mut replies) = (Vec::new(), 0);
        let mut chunk = vec![0u8; 64 << 10];
        while replies < REQUESTS {
            let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk))
                .await
                .expect("replies in time")
                .expect("read");
            assert!(read > 0, "the server closed");
            bytes.extend_from_slice(&chunk[..read]);
            while let Some((_, used)) = frame::decode(&bytes).expect("a frame") {
                bytes.drain(..used);
                replies += 1;
            }
        }
    }

    /// A peer that never reads: the client's calls wait for room once the bytes waiting
    /// for it reach the bound (given up by their timeouts, they were never sent), and a
    /// one-way send then fails the connection, with that said, rather than queueing
    /// without end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sends_to_a_peer_that_never_reads_stop_at_the_backlog_bound() {
        let (client, _stream) = connected_to_a_peer_that_reads_nothing().await;
        let waiting = || {
            let state = client.outgoing.shared.state();
            state.queued.len() + state.writing_bytes
        };
        give_up_calls(&client, SEND_BACKLOG_BYTES_MAX / (1 << 20) + 16).await;
        let frame = mib_frame();
        assert!(
            waiting() >= SEND_BACKLOG_BYTES_MAX - (8 << 20),
            "the calls were queued: {} bytes",
            waiting()
        );
        assert!(
            waiting() <= SEND_BACKLOG_BYTES_MAX + (2 << 20),
            "{} bytes waiting past the bound",
            waiting()
        );
        // A call waiting for room learns at once when the connection fails.
        let waiting_call = client.call(&frame);
        let failing_send = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            client.send(&frame)
        };
        let both = async { tokio::join!(waiting_call, failing_send) };
        let (called, sent) = tokio::time::timeout(Duration::from_secs(5), both)
            .await
            .expect("the waiting call woke once the connection failed");
        assert!(called.is_err(), "an answer from a peer that reads none");
        let error = sent.expect_err("a one-way send past the bound");
        assert!(error.to_string().contains("has not read"), "{error}");
        let after = client.call(&echo_request(0, &[1])).await;
        assert!(after.is_err(), "the connection failed for good");
    }

    /// A connection whose peer is gone (here it resets the connection with bytes still
    /// waiting for it) fails the call waiting on it, and the bytes queued for it are
    /// dropped rather than kept for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_connection_drops_what_was_queued() {
        let (client, stream) = connected_to_a_peer_that_reads_nothing().await;
        // Enough to fill both sockets' buffers, then some waiting in the writer.
        give_up_calls(&client, 64).await;
        let queued = client.outgoing.shared.state().queued.len();
        assert!(queued > 0, "nothing waits in the writer");
        // A reset: closed with bytes unread and no lingering.
        stream.set_zero_linger().expect("linger");
        drop(stream);
        let call =
            tokio::time::timeout(Duration::from_secs(10), client.call(&echo_request(0, &[1])))
                .await
                .expect("the call failed rather than waiting on a peer that is gone");
        let error = call.expect_err("an answer from a peer that is gone");
        assert!(matches!(error, TransportError::Closed { .. }), "{error}");
        wait_until(|| client.outgoing.shared.state().failed);
        let state = client.outgoing.shared.state();
        assert_eq!(
            (state.queued.len(), state.queued.capacity()),
            (0, 0),
            "queued bytes dropped"
        );
    }

    /// A client connected to a peer that reads nothing, and the peer's end.
    async fn connected_to_a_peer_that_reads_nothing() -> (Client, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address");
        let held = tokio::spawn(async move { listener.accept().await.map(|(stream, _)| stream) });
        let client = Client::connect(address).await.expect("connect");
        let stream = held.await.expect("accept task").expect("accept");
        (client, stream)
    }

    /// A message of 1 MiB.
    fn mib_frame() -> Message {
        Message::Raft {
            pg: pg(0),
            message: vec![7; 1 << 20],
        }
    }

    /// Makes `calls` calls of 1 MiB that the peer never answers, each given up after 5 ms.
    async fn give_up_calls(client: &Client, calls: usize) {
        let frame = mib_frame();
        for _ in 0..calls {
            let call = tokio::time::timeout(Duration::from_millis(5), client.call(&frame));
            assert!(call.await.is_err(), "an answer from a peer that reads none");
        }
    }

    /// Waits (up to 10 s) for `done`.
    fn wait_until(done: impl Fn() -> bool) {
        let started = std::time::Instant::now();
        while !done() {
            assert!(started.elapsed() < Duration::from_secs(10), "not in time");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_way_messages_arrive_and_open_connections_outlive_the_listener() {
        let counted = Arc::new(AtomicU64::new(0));
        let server = Server::bind("127.0.0.1:0".parse().expect("addr"), echo(counted.clone()))
            .await
            .expect("bind");
        let client = Client::connect(server.address()).await.expect("connect");
        let discard = Message::Discard {
            cut: false,
            pg: pg(1),
            epoch: basalt_common::Epoch(1),
            term: 0,
            object: basalt_common::ObjectKey {
                image: basalt_common::ImageId(1),
                number: 0,
            },
            offset_bytes: 0,
            len_bytes: 4096,
        };
        for _ in 0..10 {
            client.send(&discard).expect("send");
        }
        let reply = client.call(&echo_request(0, &[1])).await.expect("reply");
        assert_eq!(reply, echo_reply(&[1]));
        assert_eq!(
            counted.load(Ordering::Relaxed),
            10,
            "one-way messages came before the call's reply"
        );

        // Dropping the listener while a call is in flight: the call still completes.
        let slow = tokio::spawn({
            let message = echo_request(200, &[1]);
            async move { client.call(&message).await.map(|_| client) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(server);
        // Dropping the server stops accepting; its open connection still answers.
        let client = slow.await.expect("task").expect("open connections go on");
        let unreachable = Client::connect(client.peer).await;
        assert!(
            matches!(unreachable, Err(TransportError::Connect { .. })),
            "nothing listens any more"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_closes_fails_the_call_in_flight_and_later_ones() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("addr");
        let peer = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accept");
            let mut header = [0u8; frame::HEADER_SIZE];
            stream
                .read_exact(&mut header)
                .await
                .expect("a request arrives");
            // Close without answering.
        });
        let client = Client::connect(address).await.expect("connect");
        let call = client.call(&echo_request(0, &[1])).await;
        assert!(
            matches!(call, Err(TransportError::Closed { .. })),
            "{call:?}"
        );
        peer.await.expect("peer");
        let later = client.call(&echo_request(0, &[1])).await;
        assert!(
            matches!(later, Err(TransportError::Closed { .. })),
            "{later:?}"
        );
        assert!(
            client
                .send(&Message::Raft {
                    pg: pg(0),
                    message: vec![]
                })
                .is_err()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn garbage_closes_only_that_connection() {
        let server = Server::bind("127.0.0.1:0".parse().expect("addr"), echo(Arc::default()))
            .await
            .expect("bind");
        let good = Client::connect(server.address()).await.expect("connect");
        let mut bad = TcpStream::connect(server.address()).await.expect("connect");
        bad.write_all(b"GET / HTTP/1.1\r\n\r\nand some more bytes to fill a header")
            .await
            .expect("write");
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), bad.read_to_end(&mut rest)).await;
        assert!(
            matches!(closed, Ok(Ok(0))),
            "the server closed the bad connection: {closed:?}"
        );
        let reply = good
            .call(&echo_request(0, &[9]))
            .await
            .expect("good connection unaffected");
        assert_eq!(reply, echo_reply(&[9]));
    }
}
