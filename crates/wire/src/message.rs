//! The messages frames carry.
//!
//! Client to OSD: [`Message::Write`], [`Message::Read`], [`Message::Discard`], each for one
//! object of one PG at the client's map epoch; the OSD answers with [`Message::Reply`]
//! under the same request id. OSD to OSD: [`Message::Raft`], a raft-rs message for a PG,
//! carried as the bytes raft-rs encodes.

use basalt_common::{Beat, Epoch, ImageId, ObjectKey, OsdId, PgId, PoolId};

use crate::frame::{self, Frame};

/// Message kinds (the frame's `kind`); part of the wire format.
pub mod kind {
    /// A write of one object range.
    pub const WRITE: u16 = 1;
    /// A read of one object range.
    pub const READ: u16 = 2;
    /// A discard of one object range.
    pub const DISCARD: u16 = 3;
    /// The answer to a request.
    pub const REPLY: u16 = 4;
    /// A raft message for a PG.
    pub const RAFT: u16 = 5;
    /// A control-plane message (monitor requests and replies), opaque to this crate.
    pub const CONTROL: u16 = 6;
    /// Raft messages of many PGs for one peer, sent together (7 was the layout without
    /// beats; it is not reused, so that peers of the two layouts refuse each other's).
    pub const RAFT_BATCH: u16 = 9;
    /// A follower installing a snapshot asks for the next objects of a PG.
    pub const SNAPSHOT_READ: u16 = 8;
    /// A discard of one object range that the map keeps for discards only (cut off by a
    /// shrink, or of an image being removed).
    pub const DISCARD_CUT: u16 = 10;
}

/// The most bytes one write or read carries (a client splits larger requests): a frame,
/// an OSD log batch and a raft message each hold one with room to spare.
pub const OBJECT_REQUEST_BYTES_MAX: u64 = 1 << 20;

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// Done.
    Ok,
    /// This OSD does not lead the PG; `leader` is the one it knows of. Retry there.
    NotLeader {
        /// The leader, if known.
        leader: Option<OsdId>,
    },
    /// The client's map is older than this OSD's; fetch `current` and retry.
    StaleEpoch {
        /// The OSD's epoch.
        current: Epoch,
    },
    /// This OSD leads the PG, in another term than the write names (none, or one it led
    /// before); retry naming `current`.
    StaleTerm {
        /// The leader's term.
        current: u64,
    },
    /// The request is malformed or out of range.
    Invalid {
        /// Why.
        message: String,
    },
    /// The OSD failed.
    Io {
        /// Why.
        message: String,
    },
    /// The OSD has no space left for the write.
    NoSpace {
        /// Why.
        message: String,
    },
    /// The OSD cannot take the write yet (its log is being cleaned): retry after a pause.
    Busy {
        /// Why.
        message: String,
    },
}

/// A message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Write `data` at `offset_bytes` of `object`.
    Write {
        /// The PG.
        pg: PgId,
        /// The client's map epoch.
        epoch: Epoch,
        /// The leader's raft term the client knows for the PG, 0 if none.
        term: u64,
        /// The object.
        object: ObjectKey,
        /// Offset in the object.
        offset_bytes: u32,
        /// The bytes.
        data: Vec<u8>,
    },
    /// Read `len_bytes` at `offset_bytes` of `object`.
    Read {
        /// The PG.
        pg: PgId,
        /// The client's map epoch.
        epoch: Epoch,
        /// The leader's raft term the client knows for the PG, 0 if none.
        term: u64,
        /// The object.
        object: ObjectKey,
        /// Offset in the object.
        offset_bytes: u32,
        /// Length.
        len_bytes: u32,
    },
    /// Zero and free `len_bytes` at `offset_bytes` of `object`.
    Discard {
        /// Only where the map keeps the image's bytes for discards alone (what a shrink
        /// cut off, an image being removed); otherwise only inside the image.
        cut: bool,
        /// The PG.
        pg: PgId,
        /// The client's map epoch.
        epoch: Epoch,
        /// The leader's raft term the client knows for the PG, 0 if none.
        term: u64,
        /// The object.
        object: ObjectKey,
        /// Offset in the object.
        offset_bytes: u32,
        /// Length.
        len_bytes: u32,
    },
    /// The answer to a request: a status, and the data of a read.
    Reply {
        /// How it ended.
        status: Status,
        /// Read data (empty otherwise).
        data: Vec<u8>,
    },
    /// A raft message for a PG, as raft-rs encodes it.
    Raft {
        /// The PG.
        pg: PgId,
        /// The raft-rs message bytes.
        message: Vec<u8>,
    },
    /// Raft messages of many PGs for one OSD, in one frame: what one turn of the sender's
    /// raft loop produced for that peer. Heartbeats and their answers are coalesced into
    /// `beats`, a few bytes per PG; the other messages go whole.
    RaftBatch {
        /// The sending OSD.
        from: OsdId,
        /// The receiving OSD.
        to: OsdId,
        /// Whether the sender holds itself full (as it would tell the monitors): the
        /// leaders of its PGs stop taking writes when they read it, without waiting for the
        /// map.
        full: bool,
        /// Heartbeats and their answers, of any PGs.
        beats: Vec<Beat>,
        /// Each PG and its raft-rs message bytes.
        messages: Vec<(PgId, Vec<u8>)>,
    },
    /// A control-plane message; its body is the monitor protocol's business.
    Control {
        /// The encoded request or reply.
        body: Vec<u8>,
    },
    /// A replica installing a snapshot of `pg` at raft index `index` asks for the PG's
    /// object data from an object and offset on (from the start if `None`), at most
    /// `max_bytes` of it. The answer is a `Reply` whose data the OSD crate encodes.
    SnapshotRead {
        /// The PG.
        pg: PgId,
        /// The snapshot's raft index: the objects must be at least that recent.
        index: u64,
        /// The replica installing it (the leader counts a follower that stops fetching its
        /// snapshot failed in time, even when another fetches the same one).
        follower: OsdId,
        /// Where to go on: an object, and an offset in it.
        from: Option<(ObjectKey, u32)>,
        /// The most bytes of object data to send.
        max_bytes: u32,
    },
}

/// Why a frame's body is not the message its kind says.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// A kind we do not know.
    #[error("unknown message kind {kind}")]
    Kind {
        /// The kind.
        kind: u16,
    },
    /// The body is cut short or has bytes left over.
    #[error("message kind {kind} has a malformed body of {len} bytes")]
    Body {
        /// The kind.
        kind: u16,
        /// The body's length.
        len: usize,
    },
}

/// Reads fields off a body; `None` when the body is too short.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.bytes.split_at_checked(len)?;
        self.bytes = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    /// A byte that must be 0 (false) or 1 (true).
    fn flag(&mut self) -> Option<bool> {
        match self.u8()? {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
    /// An unsigned LEB128 integer: seven bits a byte, the low ones first.
    fn varint(&mut self) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.u8()?;
            let bits = u64::from(byte & 0x7f);
            if shift == 63 && bits > 1 {
                return None;
            }
            value |= bits << shift;
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }
    fn pg(&mut self) -> Option<PgId> {
        Some(PgId {
            pool: PoolId(self.u32()?),
            index: self.u32()?,
        })
    }
    fn object(&mut self) -> Option<ObjectKey> {
        Some(ObjectKey {
            image: ImageId(self.u64()?),
            number: self.u64()?,
        })
    }
    fn bytes(&mut self) -> Option<Vec<u8>> {
        let len = self.u32()? as usize;
        self.take(len).map(<[u8]>::to_vec)
    }
    fn string(&mut self) -> Option<String> {
        self.bytes()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
    }
    fn finished(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// `value` as an unsigned LEB128 integer (see `Reader::varint`).
fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_pg(out: &mut Vec<u8>, pg: PgId) {
    out.extend_from_slice(&pg.pool.0.to_le_bytes());
    out.extend_from_slice(&pg.index.to_le_bytes());
}

fn put_object(out: &mut Vec<u8>, object: ObjectKey) {
    out.extend_from_slice(&object.image.0.to_le_bytes());
    out.extend_from_slice(&object.number.to_le_bytes());
}

/// The fields every object request starts with: PG, epoch, object, offset.
fn put_object_request(out: &mut Vec<u8>, range: ObjectRange) {
    put_pg(out, range.pg);
    out.extend_from_slice(&range.epoch.0.to_le_bytes());
    out.extend_from_slice(&range.term.to_le_bytes());
    put_object(out, range.object);
    out.extend_from_slice(&range.offset_bytes.to_le_bytes());
}

/// What a write, read or discard addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectRange {
    /// The PG.
    pub pg: PgId,
    /// The client's map epoch.
    pub epoch: Epoch,
    /// The leader's term the client knows, 0 if none.
    pub term: u64,
    /// The object.
    pub object: ObjectKey,
    /// Offset in the object.
    pub offset_bytes: u32,
    /// Length (a write's data length).
    pub len_bytes: u64,
}

/// What a request for a range of an object, without data, does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangeOp {
    /// [`Message::Read`].
    Read,
    /// [`Message::Discard`] inside the image.
    Discard,
    /// [`Message::Discard`] of what the map keeps for discards only.
    DiscardCut,
}

/// The request `op` for `len_bytes` at a place given as PG, epoch, term, object and offset
/// in it.
pub fn range_message(
    op: RangeOp,
    (pg, epoch, term, object, offset_bytes): (PgId, Epoch, u64, ObjectKey, u32),
    len_bytes: u32,
) -> Message {
    if op == RangeOp::Read {
        Message::Read {
            pg,
            epoch,
            term,
            object,
            offset_bytes,
            len_bytes,
        }
    } else {
        Message::Discard {
            cut: op == RangeOp::DiscardCut,
            pg,
            epoch,
            term,
            object,
            offset_bytes,
            len_bytes,
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(
        &u32::try_from(bytes.len())
            .expect("frame bodies are small")
            .to_le_bytes(),
    );
    out.extend_from_slice(bytes);
}

impl Message {
    /// What an object request (write, read, discard) addresses; `None` for other messages.
    pub fn object_range(&self) -> Option<ObjectRange> {
        let (pg, epoch, term, object, offset_bytes, len_bytes) = match self {
            Message::Write {
                pg,
                epoch,
                term,
                object,
                offset_bytes,
                data,
            } => (pg, epoch, term, object, offset_bytes, data.len() as u64),
            Message::Read {
                pg,
                epoch,
                term,
                object,
                offset_bytes,
                len_bytes,
            }
            | Message::Discard {
                pg,
                epoch,
                term,
                object,
                offset_bytes,
                len_bytes,
                ..
            } => (pg, epoch, term, object, offset_bytes, u64::from(*len_bytes)),
            _ => return None,
        };
        Some(ObjectRange {
            pg: *pg,
            epoch: *epoch,
            term: *term,
            object: *object,
            offset_bytes: *offset_bytes,
            len_bytes,
        })
    }

    /// What a request without data does ([`range_message`] made it); `None` for a write
    /// and other messages.
    pub fn range_op(&self) -> Option<RangeOp> {
        match self {
            Message::Read { .. } => Some(RangeOp::Read),
            Message::Discard { cut: false, .. } => Some(RangeOp::Discard),
            Message::Discard { cut: true, .. } => Some(RangeOp::DiscardCut),
            _ => None,
        }
    }

    /// Addresses an object request to `pg` under map `epoch`, naming the leader's term
    /// `to_term` (0 if not known): a client routing an attempt. Other messages are left as
    /// they are.
    pub fn route(&mut self, to_pg: PgId, to_epoch: Epoch, to_term: u64) {
        if let Message::Write {
            pg, epoch, term, ..
        }
        | Message::Read {
            pg, epoch, term, ..
        }
        | Message::Discard {
            pg, epoch, term, ..
        } = self
        {
            *pg = to_pg;
            *epoch = to_epoch;
            *term = to_term;
        }
    }

    /// The frame kind.
    pub fn kind(&self) -> u16 {
        match self {
            Message::Write { .. } => kind::WRITE,
            Message::Read { .. } => kind::READ,
            Message::Discard { cut: false, .. } => kind::DISCARD,
            Message::Discard { cut: true, .. } => kind::DISCARD_CUT,
            Message::Reply { .. } => kind::REPLY,
            Message::Raft { .. } => kind::RAFT,
            Message::Control { .. } => kind::CONTROL,
            Message::RaftBatch { .. } => kind::RAFT_BATCH,
            Message::SnapshotRead { .. } => kind::SNAPSHOT_READ,
        }
    }

    /// The whole frame for this message.
    pub fn encode(&self, request_id: u64) -> Vec<u8> {
        let mut body = Vec::new();
        if let Some(range) = self.object_range() {
            put_object_request(&mut body, range);
        }
        match self {
            Message::Write { data, .. } => put_bytes(&mut body, data),
            Message::Read { len_bytes, .. } | Message::Discard { len_bytes, .. } => {
                body.extend_from_slice(&len_bytes.to_le_bytes());
            }
            Message::Reply { status, data } => {
                match status {
                    Status::Ok => body.push(0),
                    Status::NotLeader { leader } => {
                        body.push(1);
                        body.extend_from_slice(
                            &leader
                                .map_or(u64::MAX, |osd| u64::from(osd.0))
                                .to_le_bytes(),
                        );
                    }
                    Status::StaleEpoch { current } => {
                        body.push(2);
                        body.extend_from_slice(&current.0.to_le_bytes());
                    }
                    Status::StaleTerm { current } => {
                        body.push(7);
                        body.extend_from_slice(&current.to_le_bytes());
                    }
                    Status::Invalid { message } => {
                        body.push(3);
                        put_bytes(&mut body, message.as_bytes());
                    }
                    Status::Io { message } => {
                        body.push(4);
                        put_bytes(&mut body, message.as_bytes());
                    }
                    Status::NoSpace { message } => {
                        body.push(5);
                        put_bytes(&mut body, message.as_bytes());
                    }
                    Status::Busy { message } => {
                        body.push(6);
                        put_bytes(&mut body, message.as_bytes());
                    }
                }
                put_bytes(&mut body, data);
            }
            Message::Raft { pg, message } => {
                put_pg(&mut body, *pg);
                put_bytes(&mut body, message);
            }
            Message::Control { body: control } => body.extend_from_slice(control),
            Message::RaftBatch {
                from,
                to,
                full,
                beats,
                messages,
            } => {
                body.extend_from_slice(&from.0.to_le_bytes());
                body.extend_from_slice(&to.0.to_le_bytes());
                body.push(u8::from(*full));
                // Beats are many and their numbers small: variable-length integers.
                put_varint(
                    &mut body,
                    u64::try_from(beats.len()).expect("batches are small"),
                );
                for beat in beats {
                    put_varint(&mut body, u64::from(beat.pg.pool.0));
                    put_varint(&mut body, u64::from(beat.pg.index));
                    body.push(u8::from(beat.answer));
                    put_varint(&mut body, beat.term);
                    put_varint(&mut body, beat.commit);
                }
                body.extend_from_slice(
                    &u32::try_from(messages.len())
                        .expect("batches are small")
                        .to_le_bytes(),
                );
                for (pg, message) in messages {
                    put_pg(&mut body, *pg);
                    put_bytes(&mut body, message);
                }
            }
            Message::SnapshotRead {
                pg,
                index,
                follower,
                from,
                max_bytes,
            } => {
                put_pg(&mut body, *pg);
                body.extend_from_slice(&index.to_le_bytes());
                body.extend_from_slice(&follower.0.to_le_bytes());
                body.extend_from_slice(&max_bytes.to_le_bytes());
                if let Some((object, offset)) = from {
                    put_object(&mut body, *object);
                    body.extend_from_slice(&offset.to_le_bytes());
                }
            }
        }
        frame::encode(self.kind(), request_id, &body)
    }

    /// Decodes a frame's body as the message its kind says.
    pub fn decode(frame: &Frame<'_>) -> Result<Self, MessageError> {
        let malformed = MessageError::Body {
            kind: frame.kind,
            len: frame.body.len(),
        };
        let mut r = Reader { bytes: frame.body };
        let message = match frame.kind {
            kind::WRITE => (|| {
                Some(Message::Write {
                    pg: r.pg()?,
                    epoch: Epoch(r.u64()?),
                    term: r.u64()?,
                    object: r.object()?,
                    offset_bytes: r.u32()?,
                    data: r.bytes()?,
                })
            })(),
            kind::READ | kind::DISCARD | kind::DISCARD_CUT => (|| {
                let (pg, epoch, term, object, offset_bytes, len_bytes) = (
                    r.pg()?,
                    Epoch(r.u64()?),
                    r.u64()?,
                    r.object()?,
                    r.u32()?,
                    r.u32()?,
                );
                let range = (pg, epoch, term, object, offset_bytes);
                let op = match frame.kind {
                    kind::READ => RangeOp::Read,
                    kind::DISCARD => RangeOp::Discard,
                    _ => RangeOp::DiscardCut,
                };
                Some(range_message(op, range, len_bytes))
            })(),
            kind::REPLY => (|| {
                let status = match r.u8()? {
                    0 => Status::Ok,
                    1 => {
                        let leader = r.u64()?;
                        let leader = (leader != u64::MAX)
                            .then(|| u32::try_from(leader).ok().map(OsdId))
                            .flatten();
                        Status::NotLeader { leader }
                    }
                    2 => Status::StaleEpoch {
                        current: Epoch(r.u64()?),
                    },
                    3 => Status::Invalid {
                        message: r.string()?,
                    },
                    4 => Status::Io {
                        message: r.string()?,
                    },
                    5 => Status::NoSpace {
                        message: r.string()?,
                    },
                    6 => Status::Busy {
                        message: r.string()?,
                    },
                    7 => Status::StaleTerm { current: r.u64()? },
                    _ => return None,
                };
                Some(Message::Reply {
                    status,
                    data: r.bytes()?,
                })
            })(),
            kind::RAFT => (|| {
                Some(Message::Raft {
                    pg: r.pg()?,
                    message: r.bytes()?,
                })
            })(),
            kind::RAFT_BATCH => (|| {
                let (from, to) = (OsdId(r.u32()?), OsdId(r.u32()?));
                let full = r.flag()?;
                let count = usize::try_from(r.varint()?).ok()?;
                // Each beat takes at least 5 bytes: refuse counts the body cannot hold.
                if count > r.bytes.len() / 5 {
                    return None;
                }
                // (Reserved up to a bound: a beat takes 5 bytes on the wire, 32 in memory.)
                let mut beats = Vec::with_capacity(count.min(4096));
                for _ in 0..count {
                    let pg = PgId {
                        pool: PoolId(u32::try_from(r.varint()?).ok()?),
                        index: u32::try_from(r.varint()?).ok()?,
                    };
                    let answer = r.flag()?;
                    beats.push(Beat {
                        pg,
                        answer,
                        term: r.varint()?,
                        commit: r.varint()?,
                    });
                }
                let count = r.u32()? as usize;
                // Each item takes at least 12 bytes: refuse counts the body cannot hold.
                if count > r.bytes.len() / 12 {
                    return None;
                }
                let mut messages = Vec::with_capacity(count);
                for _ in 0..count {
                    messages.push((r.pg()?, r.bytes()?));
                }
                Some(Message::RaftBatch {
                    from,
                    to,
                    full,
                    beats,
                    messages,
                })
            })(),
            kind::SNAPSHOT_READ => (|| {
                let (pg, index, follower, max_bytes) = (r.pg()?, r.u64()?, r.u32()?, r.u32()?);
                let from = if r.finished() {
                    None
                } else {
                    Some((r.object()?, r.u32()?))
                };
                Some(Message::SnapshotRead {
                    pg,
                    index,
                    follower: OsdId(follower),
                    from,
                    max_bytes,
                })
            })(),
            kind::CONTROL => {
                let body = r.bytes.to_vec();
                r.bytes = &[];
                Some(Message::Control { body })
            }
            kind => return Err(MessageError::Kind { kind }),
        };
        match message {
            Some(message) if r.finished() => Ok(message),
            _ => Err(malformed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arbitrary_message() -> impl Strategy<Value = Message> {
        let pg = (any::<u32>(), any::<u32>()).prop_map(|(pool, index)| PgId {
            pool: PoolId(pool),
            index,
        });
        let object = (any::<u64>(), any::<u64>()).prop_map(|(image, number)| ObjectKey {
            image: ImageId(image),
            number,
        });
        let data = proptest::collection::vec(any::<u8>(), 0..600);
        let status = prop_oneof![
            Just(Status::Ok),
            proptest::option::of(any::<u32>()).prop_map(|leader| Status::NotLeader {
                leader: leader.map(OsdId)
            }),
            any::<u64>().prop_map(|e| Status::StaleEpoch { current: Epoch(e) }),
            any::<u64>().prop_map(|current| Status::StaleTerm { current }),
            "[a-z ]{0,20}".prop_map(|message| Status::Invalid { message }),
            "[a-z ]{0,20}".prop_map(|message| Status::Io { message }),
            "[a-z ]{0,20}".prop_map(|message| Status::NoSpace { message }),
            "[a-z ]{0,20}".prop_map(|message| Status::Busy { message }),
        ];
        prop_oneof![
            (
                pg.clone(),
                (any::<u64>(), any::<u64>()),
                object.clone(),
                any::<u32>(),
                data.clone()
            )
                .prop_map(|(pg, (e, term), object, offset_bytes, data)| {
                    Message::Write {
                        pg,
                        epoch: Epoch(e),
                        term,
                        object,
                        offset_bytes,
                        data,
                    }
                }),
            (
                pg.clone(),
                (any::<u64>(), any::<u64>()),
                object.clone(),
                (any::<u32>(), any::<u32>()),
                prop_oneof![
                    Just(RangeOp::Read),
                    Just(RangeOp::Discard),
                    Just(RangeOp::DiscardCut)
                ]
            )
                .prop_map(|(pg, (e, term), object, (offset_bytes, len_bytes), op)| {
                    range_message(op, (pg, Epoch(e), term, object, offset_bytes), len_bytes)
                }),
            (status, data.clone()).prop_map(|(status, data)| Message::Reply { status, data }),
            (pg.clone(), data.clone()).prop_map(|(pg, message)| Message::Raft { pg, message }),
            data.clone().prop_map(|body| Message::Control { body }),
            (
                any::<u32>(),
                any::<u32>(),
                any::<bool>(),
                proptest::collection::vec(
                    (pg.clone(), any::<bool>(), any::<u64>(), any::<u64>()),
                    0..4
                ),
                proptest::collection::vec((pg.clone(), data), 0..4)
            )
                .prop_map(|(from, to, full, beats, messages)| Message::RaftBatch {
                    from: OsdId(from),
                    to: OsdId(to),
                    full,
                    beats: beats
                        .into_iter()
                        .map(|(pg, answer, term, commit)| Beat {
                            pg,
                            answer,
                            term,
                            commit
                        })
                        .collect(),
                    messages
                }),
            (
                pg,
                any::<u64>(),
                any::<u32>(),
                proptest::option::of((object, any::<u32>())),
                any::<u32>()
            )
                .prop_map(|(pg, index, follower, from, max_bytes)| {
                    Message::SnapshotRead {
                        pg,
                        index,
                        follower: OsdId(follower),
                        from,
                        max_bytes,
                    }
                }),
        ]
    }

    /// A PG's heartbeat costs a few bytes of its peer's frame (at a commit index of
    /// 90,000 here); the largest numbers still round-trip.
    #[test]
    fn beats_take_a_few_bytes_each() {
        let beat = |index: u32, term: u64, commit: u64| Beat {
            pg: PgId {
                pool: PoolId(1),
                index,
            },
            answer: index % 2 == 1,
            term,
            commit,
        };
        let batch = |beats: Vec<Beat>| Message::RaftBatch {
            from: OsdId(1),
            to: OsdId(2),
            full: false,
            beats,
            messages: Vec::new(),
        };
        let empty = batch(Vec::new()).encode(0).len();
        let many = batch((0..256).map(|index| beat(index, 7, 90_000)).collect());
        let bytes = many.encode(0);
        let each = (bytes.len() - empty) as f64 / 256.0;
        assert!(each <= 8.0, "{each} bytes per beat");
        let largest = batch(vec![beat(u32::MAX, u64::MAX, u64::MAX), beat(0, 0, 0)]);
        for message in [many, largest] {
            let bytes = message.encode(9);
            let (frame, _) = frame::decode(&bytes).expect("valid").expect("complete");
            assert_eq!(Message::decode(&frame), Ok(message));
        }
    }

    /// A request made by `range_message` says what it does; a write says nothing.
    #[test]
    fn range_ops_are_told_back() {
        let object = ObjectKey {
            image: ImageId(1),
            number: 2,
        };
        let place = (
            PgId {
                pool: PoolId(0),
                index: 1,
            },
            Epoch(3),
            4,
            object,
            5,
        );
        for op in [RangeOp::Read, RangeOp::Discard, RangeOp::DiscardCut] {
            assert_eq!(range_message(op, place, 6).range_op(), Some(op));
        }
        let write = Message::Write {
            pg: place.0,
            epoch: place.1,
            term: 4,
            object,
            offset_bytes: 5,
            data: vec![1],
        };
        assert_eq!(write.range_op(), None);
    }

    proptest! {
        #[test]
        fn messages_round_trip(message in arbitrary_message(), request_id: u64) {
            let bytes = message.encode(request_id);
            let (frame, _) = frame::decode(&bytes).expect("valid").expect("complete");
            prop_assert_eq!(frame.request_id, request_id);
            prop_assert_eq!(Message::decode(&frame), Ok(message));
        }

        #[test]
        fn any_body_never_panics(kind in 0u16..10, body in proptest::collection::vec(any::<u8>(), 0..100)) {
            let _ = Message::decode(&Frame { kind, request_id: 0, body: &body });
        }
    }

    #[test]
    fn trailing_bytes_and_unknown_kinds_are_refused() {
        let frame_bytes = Message::Raft {
            pg: PgId {
                pool: PoolId(1),
                index: 2,
            },
            message: vec![1, 2],
        }
        .encode(5);
        let (frame, _) = frame::decode(&frame_bytes)
            .expect("valid")
            .expect("complete");
        let mut longer = frame.body.to_vec();
        longer.push(0);
        let padded = Frame {
            body: &longer,
            ..frame
        };
        assert_eq!(
            Message::decode(&padded),
            Err(MessageError::Body {
                kind: kind::RAFT,
                len: longer.len()
            })
        );
        assert_eq!(
            Message::decode(&Frame { kind: 77, ..frame }),
            Err(MessageError::Kind { kind: 77 })
        );
    }
}
