//! Little-endian integers at byte offsets of fixed layouts. Every NVMe and NVMe/TCP integer
//! on the wire is little-endian.
//!
//! Callers pass arrays (or slices they have already measured) whose length covers the
//! field: these index directly, so a wrong offset is a programmer error caught by the
//! round-trip tests, never a reaction to input.

/// Reads the u16 at `at`.
pub(crate) fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

/// Reads the u32 at `at`.
pub(crate) fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Reads the u64 at `at`.
pub(crate) fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut array = [0u8; 8];
    array.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(array)
}

/// Writes `value` at `at`.
pub(crate) fn put_u16(bytes: &mut [u8], at: usize, value: u16) {
    bytes[at..at + 2].copy_from_slice(&value.to_le_bytes());
}

/// Writes `value` at `at`.
pub(crate) fn put_u32(bytes: &mut [u8], at: usize, value: u32) {
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

/// Writes `value` at `at`.
pub(crate) fn put_u64(bytes: &mut [u8], at: usize, value: u64) {
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_little_endian_at_their_offset() {
        let mut bytes = [0u8; 16];
        put_u16(&mut bytes, 1, 0x0102);
        put_u32(&mut bytes, 3, 0x0304_0506);
        put_u64(&mut bytes, 7, 0x0708_090a_0b0c_0d0e);
        assert_eq!(
            bytes,
            [
                0, 2, 1, 6, 5, 4, 3, 0x0e, 0x0d, 0x0c, 0x0b, 0x0a, 9, 8, 7, 0
            ]
        );
        assert_eq!(u16_at(&bytes, 1), 0x0102);
        assert_eq!(u32_at(&bytes, 3), 0x0304_0506);
        assert_eq!(u64_at(&bytes, 7), 0x0708_090a_0b0c_0d0e);
    }
}
