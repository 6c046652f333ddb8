//! The bytes a connection has encoded and not yet written to its socket.
//!
//! Replies are appended at the end while earlier ones are still being written, so under a
//! steady client the buffer may never empty. The part already written is therefore dropped
//! not only when everything is written but also once it is as large as what is left: the
//! buffer holds at most about twice its unwritten bytes (which the connection bounds), and
//! each byte is moved at most once on average. Its allocation follows: room beyond four
//! times what is held is given back, so a burst's room does not stay while a steady client
//! keeps a little waiting.

/// Encoded bytes waiting for the socket.
#[derive(Debug)]
pub struct SendBuffer {
    bytes: Vec<u8>,
    /// Where the unwritten bytes start.
    start: usize,
    /// The capacity kept when the buffer empties, and the least written part worth moving
    /// the rest for.
    chunk: usize,
}

impl SendBuffer {
    /// An empty buffer with room for `chunk` bytes, the room it goes back to after a
    /// burst.
    pub fn new(chunk: usize) -> Self {
        Self {
            bytes: Vec::with_capacity(chunk),
            start: 0,
            chunk,
        }
    }

    /// The bytes not yet written, in order.
    pub fn unwritten(&self) -> &[u8] {
        &self.bytes[self.start..]
    }

    /// How many bytes are not yet written.
    pub fn unwritten_len(&self) -> usize {
        self.bytes.len() - self.start
    }

    /// Whether every byte was written.
    pub fn is_empty(&self) -> bool {
        self.start == self.bytes.len()
    }

    /// Where encoders append.
    pub fn tail(&mut self) -> &mut Vec<u8> {
        &mut self.bytes
    }

    /// Records that the first `written` unwritten bytes went to the socket.
    ///
    /// # Panics
    ///
    /// If more bytes are said to be written than were unwritten.
    pub fn written(&mut self, written: usize) {
        assert!(
            written <= self.unwritten_len(),
            "more written than buffered"
        );
        self.start += written;
        if self.is_empty() {
            self.bytes.clear();
            self.start = 0;
            if self.bytes.capacity() > 4 * self.chunk {
                self.bytes.shrink_to(self.chunk);
            }
        } else if self.start >= self.chunk && self.start >= self.unwritten_len() {
            self.bytes.drain(..self.start);
            self.start = 0;
            let kept = (2 * self.bytes.len()).max(self.chunk);
            if self.bytes.capacity() > 4 * kept {
                self.bytes.shrink_to(kept);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that always leaves some bytes behind while more keep coming: the buffer
    /// holds about twice the unwritten bytes, never what went through it, and hands the
    /// bytes out in order.
    #[test]
    fn a_buffer_that_never_empties_stays_bounded() {
        let mut buffer = SendBuffer::new(64 << 10);
        let mut sent = Vec::new();
        let mut next = 0u8;
        for round in 0..20_000usize {
            let reply: Vec<u8> = (0..4096)
                .map(|_| {
                    next = next.wrapping_add(1);
                    next
                })
                .collect();
            buffer.tail().extend_from_slice(&reply);
            // Write a little less than came in (and at times more), keeping 1-2 MiB back.
            let keep = (1 << 20) + (round % 7) * (128 << 10);
            let written = buffer.unwritten_len().saturating_sub(keep);
            sent.extend_from_slice(&buffer.unwritten()[..written]);
            buffer.written(written);
            assert!(!buffer.is_empty());
            assert!(
                buffer.bytes.capacity() <= 8 * buffer.unwritten_len().max(64 << 10),
                "round {round}: {} bytes allocated for {} unwritten",
                buffer.bytes.capacity(),
                buffer.unwritten_len()
            );
        }
        sent.extend_from_slice(buffer.unwritten());
        let left = buffer.unwritten_len();
        buffer.written(left);
        assert!(buffer.is_empty());
        assert!(buffer.bytes.capacity() <= 4 * (64 << 10), "room given back");
        let mut expected = 0u8;
        assert_eq!(sent.len(), 20_000 * 4096);
        assert!(sent.iter().all(|&byte| {
            expected = expected.wrapping_add(1);
            byte == expected
        }));
    }

    /// After a burst, a client that keeps only a little waiting does not keep the burst's
    /// room allocated.
    #[test]
    fn a_burst_s_room_goes_while_a_little_stays_waiting() {
        let chunk = 64 << 10;
        let mut buffer = SendBuffer::new(chunk);
        buffer.tail().extend_from_slice(&vec![1; 32 << 20]);
        buffer.written(1 << 20);
        assert!(buffer.bytes.capacity() >= 32 << 20);
        for _ in 0..64 {
            buffer.tail().extend_from_slice(&[2; 4096]);
            let written = buffer.unwritten_len() - 8192;
            buffer.written(written.min(4 << 20));
        }
        assert_eq!(buffer.unwritten_len(), 8192);
        assert!(
            buffer.bytes.capacity() <= 8 * chunk,
            "{} bytes allocated for {} unwritten",
            buffer.bytes.capacity(),
            buffer.unwritten_len()
        );
    }

    #[test]
    #[should_panic(expected = "more written than buffered")]
    fn writing_more_than_buffered_is_a_bug() {
        let mut buffer = SendBuffer::new(16);
        buffer.tail().extend_from_slice(b"abc");
        buffer.written(4);
    }
}
