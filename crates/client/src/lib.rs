//! The Basalt client: reads and writes images.
//!
//! A [`Cluster`] follows the monitors' map (one long-polling subscription), keeps one
//! pipelined connection per OSD and remembers each PG's leader. An [`Image`] splits a
//! request at object boundaries (and into pieces of at most [`PIECE_BYTES_MAX`]), sends
//! each piece to its PG's leader, and retries under a deadline: on `NotLeader` at the
//! leader named (or the next member), on `StaleEpoch` once the newer map is in, on a lost
//! connection at the next member after a short backoff.
//!
//! A retried write is safe: a write that timed out either never commits or commits before
//! its retry in the PG's log, so an older write never lands after a newer one.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use basalt_common::{Epoch, ImageId, ObjectKey, OsdId, PgId, PoolId};
use basalt_mon::map::ClusterMap;
use basalt_mon::{MonClient, MonClientError};
use basalt_wire::message::RangeOp;
use basalt_wire::tcp::Client;
use basalt_wire::{Message, Status};
use tokio::sync::watch;
use tokio::time::Instant;

/// How often an image's watcher renews its watch ([`Image::watch`]), and how long the
/// monitors remember one not renewed.
pub use basalt_mon::protocol::{WATCH_RENEW, WATCH_TTL};

/// The largest piece of a request sent to an OSD at once.
pub const PIECE_BYTES_MAX: u64 = basalt_wire::message::OBJECT_REQUEST_BYTES_MAX;
/// How long a request may take, retries included, by default.
pub const DEADLINE_DEFAULT: Duration = Duration::from_secs(60);
/// How long one attempt may wait for an OSD's answer.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// Pieces of one request under way at once at most.
const PIECES_IN_FLIGHT_MAX: usize = 32;
/// How long a map subscription request waits.
const MAP_WAIT: Duration = Duration::from_secs(20);

/// Why a request failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The monitors.
    #[error(transparent)]
    Mon(#[from] MonClientError),
    /// No such pool or image.
    #[error("{0}")]
    NotFound(String),
    /// The request is out of range or malformed.
    #[error("{0}")]
    Invalid(String),
    /// An OSD failed the request.
    #[error("{0}")]
    Io(String),
    /// An OSD has no space left for the write.
    #[error("{0}")]
    NoSpace(String),
    /// No answer within the deadline.
    #[error("{what}: no answer within {seconds} s (last: {last})")]
    Timeout {
        /// The request.
        what: String,
        /// The deadline.
        seconds: u64,
        /// The last failure seen.
        last: String,
    },
}

/// A connection to a cluster.
pub struct Cluster {
    mon: Arc<MonClient>,
    map: watch::Receiver<Arc<ClusterMap>>,
    connections: Mutex<HashMap<SocketAddr, Arc<Client>>>,
    /// Each PG's leader as last seen, and its raft term if known (0 if not): writes name
    /// it, and a leader refuses those that name another (`Status::StaleTerm`).
    leaders: Mutex<HashMap<PgId, (OsdId, u64)>>,
    deadline: Duration,
    subscription: tokio::task::JoinHandle<()>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.subscription.abort();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Cluster {
    /// Connects to the monitors, fetches the map and follows it.
    pub async fn connect(mons: Vec<SocketAddr>) -> Result<Arc<Self>, ClientError> {
        let mon = Arc::new(MonClient::new(mons));
        let map = mon.map().await?;
        let (sender, receiver) = watch::channel(Arc::new(map));
        let subscriber = mon.clone();
        let subscription = tokio::spawn(async move {
            loop {
                let epoch = sender.borrow().epoch;
                match subscriber.map_after(epoch, MAP_WAIT).await {
                    Ok(Some(map)) => {
                        sender.send_if_modified(|current| {
                            let newer = map.epoch > current.epoch;
                            if newer {
                                *current = Arc::new(map);
                            }
                            newer
                        });
                    }
                    Ok(None) => {}
                    Err(error) => {
                        tracing::warn!(%error, "map subscription failed");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
                if sender.is_closed() {
                    return;
                }
            }
        });
        Ok(Arc::new(Self {
            mon,
            map: receiver,
            connections: Mutex::new(HashMap::new()),
            leaders: Mutex::new(HashMap::new()),
            deadline: DEADLINE_DEFAULT,
            subscription,
        }))
    }

    /// The monitors' client.
    pub fn mon(&self) -> &MonClient {
        &self.mon
    }

    /// The newest map this client has.
    pub fn map(&self) -> Arc<ClusterMap> {
        self.map.borrow().clone()
    }

    /// Opens an image by pool and name.
    pub fn open_image(self: &Arc<Self>, pool: &str, name: &str) -> Result<Image, ClientError> {
        let map = self.map();
        if map.pool_by_name(pool).is_none() {
            return Err(ClientError::NotFound(format!(
                "pool {pool:?} does not exist"
            )));
        }
        let image = map
            .image_by_name(pool, name)
            .ok_or_else(|| ClientError::NotFound(format!("image {pool}/{name} does not exist")))?;
        Ok(Image {
            cluster: self.clone(),
            id: image.id,
            pool: image.pool,
            name: format!("{pool}/{name}"),
            object_size_bytes: image.object_size_bytes,
        })
    }

    /// Discards the byte ranges `ranges` of image `id` where only discards reach: what a
    /// shrink cut off, or an image being removed (`basalt image resize` and `image rm`
    /// discard it after the map's change, so that no write lands there after the
    /// discard). `since` is the epoch of a map that has the change: this client waits for
    /// it, so that its requests carry it and OSDs with older maps ask for them again
    /// rather than take writes of old maps after them. OSDs refuse the discards outside
    /// what their map keeps for them (the image grown back over the bytes). The ranges'
    /// requests go [`PIECES_IN_FLIGHT_MAX`] at a time, as one request's do.
    pub async fn discard_cut(
        self: &Arc<Self>,
        id: ImageId,
        ranges: &[Range<u64>],
        since: Epoch,
    ) -> Result<(), ClientError> {
        if !self.await_epoch(since, self.deadline).await {
            return Err(ClientError::Timeout {
                what: format!("map epoch {}", since.0),
                seconds: self.deadline.as_secs(),
                last: format!("epoch {}", self.map().epoch.0),
            });
        }
        let map = self.map();
        let (image, kept) = map.image_range(id, true).ok_or_else(|| {
            ClientError::NotFound(format!(
                "image {} is neither in the map nor being removed",
                id.0
            ))
        })?;
        if let Some(range) = ranges.iter().find(|range| {
            range.start > range.end || range.start < kept.start || range.end > kept.end
        }) {
            return Err(ClientError::Invalid(format!(
                "range {range:?} of image {} is not kept for discards alone ({kept:?} is)",
                id.0
            )));
        }
        let image = Image {
            cluster: self.clone(),
            id,
            pool: image.pool,
            name: format!("image {}", id.0),
            object_size_bytes: image.object_size_bytes,
        };
        image.discard_ranges(ranges, RangeOp::DiscardCut).await
    }

    /// The connection to `address`, made within a second (or `within`, if shorter).
    async fn connection(
        &self,
        address: SocketAddr,
        within: Duration,
    ) -> Result<Arc<Client>, String> {
        if let Some(client) = lock(&self.connections).get(&address) {
            return Ok(client.clone());
        }
        let connect = Client::connect(address);
        let within = Duration::from_secs(1).min(within);
        let client = match tokio::time::timeout(within, connect).await {
            Ok(Ok(client)) => Arc::new(client),
            Ok(Err(error)) => return Err(error.to_string()),
            Err(_) => return Err(format!("connecting to {address} timed out")),
        };
        let mut connections = lock(&self.connections);
        keep_mapped(&mut connections, address, &self.map());
        Ok(connections.entry(address).or_insert(client).clone())
    }

    fn forget_connection(&self, address: SocketAddr, client: &Arc<Client>) {
        let mut connections = lock(&self.connections);
        if connections
            .get(&address)
            .is_some_and(|current| Arc::ptr_eq(current, client))
        {
            connections.remove(&address);
        }
    }

    fn remember_leader(&self, pg: PgId, leader: OsdId, term: u64) {
        remember(&mut lock(&self.leaders), pg, leader, term);
    }

    /// Waits up to `within` for a map at least as new as `epoch`; whether it came.
    async fn await_epoch(&self, epoch: Epoch, within: Duration) -> bool {
        let mut map = self.map.clone();
        let waited = tokio::time::timeout(within, map.wait_for(|map| map.epoch >= epoch));
        matches!(waited.await, Ok(Ok(_)))
    }

    /// Sends one object request to its PG's leader until it is answered.
    /// `request` is a write, read or discard; each attempt addresses it to the PG under the
    /// map of the moment.
    async fn object_call(
        &self,
        what: &str,
        pool: PoolId,
        mut request: Message,
    ) -> Result<Vec<u8>, ClientError> {
        let Some(range) = request.object_range() else {
            return Err(ClientError::Invalid(format!(
                "message kind {} is not an object request",
                request.kind()
            )));
        };
        let object = range.object;
        let deadline = Instant::now() + self.deadline;
        let mut last = String::from("nothing tried");
        let mut next_member = 0usize;
        let mut backoff = Duration::from_millis(5);
        let mut pause = false;
        let mut redirected: Option<OsdId> = None;
        let mut told_term: Option<u64> = None;
        // Every wait is cut to the time left, so that the request ends at its deadline.
        let left = || deadline.saturating_duration_since(Instant::now());
        loop {
            if pause {
                tokio::time::sleep(backoff.min(left())).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
            pause = true;
            if Instant::now() >= deadline {
                return Err(ClientError::Timeout {
                    what: what.to_string(),
                    seconds: self.deadline.as_secs(),
                    last,
                });
            }
            let map = self.map();
            let Some(pool_entry) = map.pools.get(&pool) else {
                return Err(ClientError::NotFound(format!("pool {pool} does not exist")));
            };
            let pg = pool_entry.pg_of(object);
            let members = &pool_entry.pgs[pg.index as usize].members;
            if members.is_empty() {
                last = format!("pg {pg} has no members yet");
                continue;
            }
            let cached = lock(&self.leaders).get(&pg).copied();
            // A cached leader may be outside the members: while a PG moves, its leader can be
            // an OSD it is leaving (the OSDs' redirects say so).
            let (target, term) = cached.unwrap_or((members[next_member % members.len()], 0));
            let Some(address) = map
                .osds
                .get(&target)
                .and_then(|osd| osd.address.parse::<SocketAddr>().ok())
            else {
                // A cached leader gone from the map (removed by `basalt osd rm`) is forgotten,
                // or every attempt would go to it until the deadline.
                last = format!("{target} has no address");
                lock(&self.leaders).remove(&pg);
                next_member += 1;
                continue;
            };
            let client = match self.connection(address, left()).await {
                Ok(client) => client,
                Err(error) => {
                    last = format!("{target}: {error}");
                    lock(&self.leaders).remove(&pg);
                    next_member += 1;
                    continue;
                }
            };
            request.route(pg, map.epoch, term);
            let within = ATTEMPT_TIMEOUT.min(left());
            let answer = tokio::time::timeout(within, client.call(&request)).await;
            match answer {
                Ok(Ok(Message::Reply { status, data })) => match status {
                    Status::Ok => {
                        self.remember_leader(pg, target, term);
                        return Ok(data);
                    }
                    Status::NotLeader { leader } => {
                        last = format!("{target} does not lead pg {pg}");
                        match leader.filter(|leader| *leader != target) {
                            Some(leader) => {
                                // Follow a redirect at once, but only the first one: OSDs that
                                // name each other during an election get the backoff (two
                                // naming each other in turn too).
                                pause = redirected.is_some();
                                redirected = Some(leader);
                                if !members.contains(&leader) {
                                    next_member += 1;
                                }
                                self.remember_leader(pg, leader, 0);
                            }
                            None => {
                                lock(&self.leaders).remove(&pg);
                                next_member += 1;
                            }
                        }
                    }
                    Status::StaleTerm { current } => {
                        // At once with the leader's term, but after the backoff if told the
                        // same term twice.
                        last = format!("{target} leads pg {pg} in term {current}, not {term}");
                        pause = told_term == Some(current);
                        told_term = Some(current);
                        self.remember_leader(pg, target, current);
                    }
                    Status::StaleEpoch { current } => {
                        last = format!("map epoch {} is older than {}", map.epoch.0, current.0);
                        self.await_epoch(current, Duration::from_secs(2).min(left()))
                            .await;
                        pause = false;
                    }
                    Status::Invalid { message } => return Err(ClientError::Invalid(message)),
                    Status::Io { message } => {
                        return Err(ClientError::Io(format!("{target}: {message}")));
                    }
                    Status::NoSpace { message } => return Err(ClientError::NoSpace(message)),
                    Status::Busy { message } => {
                        // The same OSD, after the backoff: its cleaner is freeing space.
                        last = format!("{target}: {message}");
                        backoff = backoff.max(Duration::from_millis(20));
                    }
                },
                Ok(Ok(other)) => {
                    last = format!("{target} answered kind {}", other.kind());
                    self.forget_connection(address, &client);
                }
                Ok(Err(error)) => {
                    last = error.to_string();
                    self.forget_connection(address, &client);
                    lock(&self.leaders).remove(&pg);
                    next_member += 1;
                }
                Err(_) => {
                    last = format!("{target} did not answer within {within:?}");
                    lock(&self.leaders).remove(&pg);
                    next_member += 1;
                }
            }
        }
    }
}

/// Drops the connections to addresses `map` no longer has (an OSD removed, or moved to
/// another address) but `address`: nothing would call them again to find them closed.
fn keep_mapped<T>(connections: &mut HashMap<SocketAddr, T>, address: SocketAddr, map: &ClusterMap) {
    let mapped: HashSet<SocketAddr> = map
        .osds
        .values()
        .filter_map(|osd| osd.address.parse().ok())
        .collect();
    connections.retain(|known, _| *known == address || mapped.contains(known));
}

/// Caches `leader` as `pg`'s leader with `term`, never lowering a term already learned for
/// the same leader: a read (which the leader does not check) answered after a concurrent
/// write learned the term would otherwise put back the one it named, and the next write
/// would be refused once more.
fn remember(leaders: &mut HashMap<PgId, (OsdId, u64)>, pg: PgId, leader: OsdId, term: u64) {
    let known = match leaders.get(&pg) {
        Some((cached, known)) if *cached == leader => *known,
        _ => 0,
    };
    leaders.insert(pg, (leader, term.max(known)));
}

/// An open image.
pub struct Image {
    cluster: Arc<Cluster>,
    id: ImageId,
    pool: PoolId,
    name: String,
    object_size_bytes: u64,
}

/// One object's part of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    object: ObjectKey,
    offset_in_object: u32,
    len_bytes: u32,
    /// Where it starts in the request.
    at: usize,
}

/// The pieces of `len` bytes at `offset` of `image`: one per object, of at most
/// `piece_max` bytes each.
fn split(image: ImageId, object_size: u64, offset: u64, len: u64, piece_max: u64) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let mut position = offset;
    let end = offset + len;
    while position < end {
        let number = position / object_size;
        let in_object = position % object_size;
        let piece = (object_size - in_object).min(end - position).min(piece_max);
        pieces.push(Piece {
            object: ObjectKey { image, number },
            offset_in_object: in_object as u32,
            len_bytes: piece as u32,
            at: (position - offset) as usize,
        });
        position += piece;
    }
    pieces
}

impl Image {
    /// `pool/name`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes per object.
    pub fn object_size_bytes(&self) -> u64 {
        self.object_size_bytes
    }

    /// Its id.
    pub fn id(&self) -> ImageId {
        self.id
    }

    /// Follows the cluster map: `changed()` returns when a newer map arrives, and fails once
    /// the cluster connection is gone.
    pub fn map_changes(&self) -> watch::Receiver<Arc<ClusterMap>> {
        self.cluster.map.clone()
    }

    /// Tells the monitors that `watcher` uses this image (`present`), or no longer does
    /// (`basalt image rm` refuses while an image has watchers); the future holds what it
    /// needs, so that it may outlive the image.
    pub fn watch(
        &self,
        watcher: String,
        present: bool,
    ) -> impl std::future::Future<Output = Result<(), ClientError>> + Send + 'static {
        let (cluster, image) = (self.cluster.clone(), self.id);
        async move {
            let request = basalt_mon::protocol::MonRequest::Watch {
                image,
                watcher,
                present,
            };
            match cluster.mon.request(&request).await? {
                basalt_mon::protocol::MonReply::Ok => Ok(()),
                basalt_mon::protocol::MonReply::Error(refused) => {
                    Err(MonClientError::Refused(refused).into())
                }
                other => Err(MonClientError::Protocol(format!("{other:?}")).into()),
            }
        }
    }

    /// Its size now (it follows resizes).
    pub fn size_bytes(&self) -> Result<u64, ClientError> {
        self.cluster
            .map()
            .images
            .get(&self.id)
            .map(|image| image.size_bytes)
            .ok_or_else(|| ClientError::NotFound(format!("image {} was removed", self.name)))
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), ClientError> {
        let size = self.size_bytes()?;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(ClientError::Invalid(format!(
                "range {offset}+{len} is past the end of {} ({size} bytes)",
                self.name
            )));
        }
        Ok(())
    }

    /// Sends each piece's request and returns the answers in order. One piece (the common
    /// case) runs here; several run as tasks, side by side ([`run_all`]).
    async fn run_pieces(
        &self,
        what: &'static str,
        requests: Vec<(Piece, Message)>,
    ) -> Result<Vec<(Piece, Vec<u8>)>, ClientError> {
        let pool = self.pool;
        if requests.len() == 1 {
            let (piece, request) = requests.into_iter().next().expect("one request");
            let data = self.cluster.object_call(what, pool, request).await?;
            return Ok(vec![(piece, data)]);
        }
        let cluster = self.cluster.clone();
        run_all(requests, move |request| {
            let cluster = cluster.clone();
            async move { cluster.object_call(what, pool, request).await }
        })
        .await
    }

    /// Where a request goes before it is routed: the object's PG is found per attempt.
    fn unrouted(&self) -> (PgId, Epoch) {
        (
            PgId {
                pool: self.pool,
                index: 0,
            },
            Epoch(0),
        )
    }

    /// The pieces of `len` bytes at `offset`, after a range check, each with its request.
    fn requests(
        &self,
        offset: u64,
        len: u64,
        request: impl Fn(PgId, Epoch, &Piece) -> Message,
    ) -> Result<Vec<(Piece, Message)>, ClientError> {
        self.check(offset, len)?;
        Ok(self.unchecked_requests(offset, len, PIECE_BYTES_MAX, request))
    }

    /// The pieces of `len` bytes at `offset`, of at most `piece_max` bytes, each with its
    /// request.
    fn unchecked_requests(
        &self,
        offset: u64,
        len: u64,
        piece_max: u64,
        request: impl Fn(PgId, Epoch, &Piece) -> Message,
    ) -> Vec<(Piece, Message)> {
        let (pg, epoch) = self.unrouted();
        split(self.id, self.object_size_bytes, offset, len, piece_max)
            .into_iter()
            .map(|piece| {
                let message = request(pg, epoch, &piece);
                (piece, message)
            })
            .collect()
    }

    /// Reads `len` bytes at `offset`; never-written bytes read as zeroes.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ClientError> {
        let requests = self.requests(offset, len, range_request(RangeOp::Read))?;
        let mut out = vec![0u8; len as usize];
        for (piece, data) in self.run_pieces("read", requests).await? {
            if data.len() != piece.len_bytes as usize {
                return Err(ClientError::Io(format!(
                    "osd answered {} bytes for a {}-byte read",
                    data.len(),
                    piece.len_bytes
                )));
            }
            out[piece.at..piece.at + data.len()].copy_from_slice(&data);
        }
        Ok(out)
    }

    /// Writes `data` at `offset`; durable on a majority of replicas when it returns.
    pub async fn write(&self, offset: u64, data: &[u8]) -> Result<(), ClientError> {
        let requests = self.requests(offset, data.len() as u64, |pg, epoch, piece| {
            Message::Write {
                pg,
                epoch,
                term: 0,
                object: piece.object,
                offset_bytes: piece.offset_in_object,
                data: data[piece.at..piece.at + piece.len_bytes as usize].to_vec(),
            }
        })?;
        self.run_pieces("write", requests).await?;
        Ok(())
    }

    /// Discards `len` bytes at `offset`: they read as zeroes and their space is freed.
    /// A discard carries no data: one request covers as much of an object as it asks for
    /// (a removal of a large image is a request per object, not per MiB).
    pub async fn discard(&self, offset: u64, len: u64) -> Result<(), ClientError> {
        self.check(offset, len)?;
        let whole = offset..offset + len;
        self.discard_ranges(std::slice::from_ref(&whole), RangeOp::Discard)
            .await
    }

    /// The discard `op` of `ranges`, one request per object each, without a check against
    /// the image's size. The requests are made [`PIECES_IN_FLIGHT_MAX`] objects at a time:
    /// a discard of terabytes (a host's `blkdiscard`) is millions of them.
    async fn discard_ranges(&self, ranges: &[Range<u64>], op: RangeOp) -> Result<(), ClientError> {
        for range in ranges {
            for part in parts_of(range, self.object_size_bytes, PIECES_IN_FLIGHT_MAX as u64) {
                let (offset, len) = (part.start, part.end - part.start);
                let requests = self.unchecked_requests(offset, len, u64::MAX, range_request(op));
                self.run_pieces("discard", requests).await?;
            }
        }
        Ok(())
    }
}

/// `range` cut into consecutive parts that each touch at most `objects` objects of
/// `object_size` bytes.
fn parts_of(
    range: &Range<u64>,
    object_size: u64,
    objects: u64,
) -> impl Iterator<Item = Range<u64>> {
    let object_size = object_size.max(1);
    let step = object_size.saturating_mul(objects.max(1));
    let end = range.end;
    let mut at = range.start;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let to = (at - at % object_size).saturating_add(step).min(end);
        let part = at..to;
        at = to;
        Some(part)
    })
}

/// The request `op` for a piece, as [`Image::requests`] takes it.
fn range_request(op: RangeOp) -> impl Fn(PgId, Epoch, &Piece) -> Message {
    move |pg, epoch, piece| {
        let place = (pg, epoch, 0, piece.object, piece.offset_in_object);
        basalt_wire::message::range_message(op, place, piece.len_bytes)
    }
}

/// Runs `call` on each request as a task, at most [`PIECES_IN_FLIGHT_MAX`] at once, and
/// returns the answers in order. When one fails, none is started after it, and those under
/// way are waited for before the error is returned: a piece still retrying when the host
/// hears of the failure could land after the host's next request to the same blocks (a
/// discard after a failed write would read back the old data, a write after a failed
/// discard zeroes). Dropped, it stops the pieces' tasks: a host that gave up on a request
/// (a frontend whose connection closed) may send the same blocks again, and a piece still
/// retrying would land after them.
async fn run_all<P, R, T, F, Fut>(
    requests: Vec<(P, R)>,
    call: F,
) -> Result<Vec<(P, T)>, ClientError>
where
    F: Fn(R) -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>> + Send + 'static,
    T: Send + 'static,
{
    let mut results = Vec::with_capacity(requests.len());
    let mut requests = requests.into_iter();
    loop {
        let handles: Vec<_> = requests
            .by_ref()
            .take(PIECES_IN_FLIGHT_MAX)
            .map(|(piece, request)| (piece, AbortOnDrop(tokio::spawn(call(request)))))
            .collect();
        if handles.is_empty() {
            return Ok(results);
        }
        let mut failed = None;
        for (piece, mut handle) in handles {
            match (&mut handle.0).await {
                Ok(Ok(data)) => results.push((piece, data)),
                Ok(Err(error)) => {
                    failed.get_or_insert(error);
                }
                Err(error) => {
                    failed.get_or_insert(ClientError::Io(error.to_string()));
                }
            }
        }
        if let Some(error) = failed {
            return Err(error);
        }
    }
}

/// A task aborted when its handle is dropped ([`run_all`]).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Making a connection drops those to addresses the map no longer has.
    #[test]
    fn connections_to_osds_gone_from_the_map_are_dropped() {
        let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let osd = |id: u32, port: u16| basalt_mon::map::OsdEntry {
            id: OsdId(id),
            uuid: format!("u{id}"),
            host: "h".into(),
            address: at(port).to_string(),
            weight: 1.0,
            up: true,
            is_in: true,
            auto_out: false,
            full: false,
        };
        let mut map = ClusterMap::default();
        for (id, port) in [(0, 7000), (1, 7001)] {
            map.osds.insert(OsdId(id), osd(id, port));
        }
        let mut connections: HashMap<SocketAddr, ()> =
            [7000, 7001, 7002, 7003].map(|port| (at(port), ())).into();
        keep_mapped(&mut connections, at(7003), &map);
        let mut left: Vec<u16> = connections.keys().map(SocketAddr::port).collect();
        left.sort_unstable();
        assert_eq!(left, vec![7000, 7001, 7003]);
    }

    /// A discard's parts cover its range end to end, each within `objects` objects.
    #[test]
    fn parts_cover_the_range_a_few_objects_each() {
        for (range, object, objects) in [
            (0..100u64, 10u64, 3u64),
            (5..96, 10, 3),
            (5..6, 10, 3),
            (0..(1 << 41), 4 << 20, 32),
            (u64::MAX - 100..u64::MAX, 64, 1),
        ] {
            let parts: Vec<_> = parts_of(&range, object, objects).take(1 << 20).collect();
            assert_eq!(parts.first().map(|p| p.start), Some(range.start));
            assert_eq!(parts.last().map(|p| p.end), Some(range.end), "{range:?}");
            for pair in parts.windows(2) {
                assert_eq!(pair[0].end, pair[1].start);
            }
            for part in &parts {
                let touched = (part.end - 1) / object - part.start / object + 1;
                assert!(
                    !part.is_empty() && touched <= objects,
                    "{part:?} of {range:?}"
                );
            }
        }
    }

    /// A request given up by its caller stops its pieces: none goes on to retry (here, to
    /// finish after a pause) once the caller dropped it.
    #[tokio::test]
    async fn pieces_stop_when_their_request_is_dropped() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let finished = Arc::new(AtomicUsize::new(0));
        let counter = finished.clone();
        let requests: Vec<(usize, usize)> = (0..4).map(|n| (n, n)).collect();
        let all = run_all(requests, move |_| {
            let counter = counter.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                counter.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        });
        assert!(
            tokio::time::timeout(Duration::from_millis(20), all)
                .await
                .is_err()
        );
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(finished.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_failed_piece_is_answered_once_the_others_are_done() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let finished = Arc::new(AtomicUsize::new(0));
        // Piece 0 fails at once; the others take a while, as a piece retrying after
        // `Busy` would; the ones after the first group are never started.
        let requests: Vec<(usize, usize)> = (0..PIECES_IN_FLIGHT_MAX + 8).map(|n| (n, n)).collect();
        let counter = finished.clone();
        let result = run_all(requests, move |n| {
            let counter = counter.clone();
            async move {
                if n == 0 {
                    return Err(ClientError::NoSpace("full".into()));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                counter.fetch_add(1, Ordering::SeqCst);
                Ok(n)
            }
        })
        .await;
        assert!(matches!(result, Err(ClientError::NoSpace(_))), "{result:?}");
        assert_eq!(
            finished.load(Ordering::SeqCst),
            PIECES_IN_FLIGHT_MAX - 1,
            "the error waits for the pieces under way, and starts no more"
        );
        let all: Vec<(usize, usize)> = (0..40).map(|n| (n, n)).collect();
        let answers = run_all(all, |n| async move { Ok::<_, ClientError>(n * 2) })
            .await
            .expect("all succeed");
        assert_eq!(
            answers,
            (0..40).map(|n| (n, n * 2)).collect::<Vec<_>>(),
            "answers in order"
        );
    }

    #[test]
    fn a_learned_leader_term_is_not_lowered() {
        let pg = PgId {
            pool: basalt_common::PoolId(1),
            index: 0,
        };
        let mut leaders = HashMap::new();
        remember(&mut leaders, pg, OsdId(1), 7);
        // A read that named no term, answered after the write learned 7.
        remember(&mut leaders, pg, OsdId(1), 0);
        assert_eq!(leaders[&pg], (OsdId(1), 7));
        remember(&mut leaders, pg, OsdId(1), 9);
        assert_eq!(leaders[&pg], (OsdId(1), 9));
        // Another leader: its own term, from nothing.
        remember(&mut leaders, pg, OsdId(2), 0);
        assert_eq!(leaders[&pg], (OsdId(2), 0));
    }

    #[test]
    fn requests_split_at_object_boundaries_and_piece_size() {
        let image = ImageId(7);
        let pieces = split(image, 4 << 20, (4 << 20) - 4096, 8192, PIECE_BYTES_MAX);
        assert_eq!(pieces.len(), 2);
        assert_eq!(
            (
                pieces[0].object.number,
                pieces[0].offset_in_object,
                pieces[0].len_bytes,
                pieces[0].at
            ),
            (0, (4 << 20) - 4096, 4096, 0)
        );
        assert_eq!(
            (
                pieces[1].object.number,
                pieces[1].offset_in_object,
                pieces[1].len_bytes,
                pieces[1].at
            ),
            (1, 0, 4096, 4096)
        );
        let big = split(image, 4 << 20, 0, 3 << 20, PIECE_BYTES_MAX);
        assert_eq!(big.len(), 3);
        assert!(
            big.iter()
                .all(|p| u64::from(p.len_bytes) == PIECE_BYTES_MAX)
        );
        let whole = split(image, 4 << 20, 1 << 20, 8 << 20, u64::MAX);
        let lens: Vec<u32> = whole.iter().map(|p| p.len_bytes).collect();
        assert_eq!(lens, [3 << 20, 4 << 20, 1 << 20], "whole objects at most");
        let total: u64 = split(image, 65536, 1000, 300_000, PIECE_BYTES_MAX)
            .iter()
            .map(|p| u64::from(p.len_bytes))
            .sum();
        assert_eq!(total, 300_000);
    }
}
