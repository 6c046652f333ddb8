//! UUIDs for bdevs: random (version 4) or given by the user and checked.

use std::io::Read;

/// A random version-4 UUID, lower-case hyphenated.
pub fn random() -> String {
    let mut bytes = [0u8; 16];
    let filled = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if filled.is_err() {
        // No /dev/urandom (a strange sandbox): fall back to the std hasher's random keys.
        use std::hash::{BuildHasher, RandomState};
        let state = RandomState::new();
        bytes[..8].copy_from_slice(&state.hash_one(1u8).to_le_bytes());
        bytes[8..].copy_from_slice(&state.hash_one(2u8).to_le_bytes());
    }
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    format(&bytes)
}

/// Formats 16 bytes as `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format(bytes: &[u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// Parses a hyphenated UUID (any case) into its 16 bytes.
pub fn parse(text: &str) -> Option<[u8; 16]> {
    let groups: Vec<&str> = text.split('-').collect();
    let lengths: Vec<usize> = groups.iter().map(|g| g.len()).collect();
    if lengths != [8, 4, 4, 4, 12] {
        return None;
    }
    let hex: String = groups.concat();
    let mut bytes = [0u8; 16];
    for (index, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * index..2 * index + 2)?, 16).ok()?;
    }
    Some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_uuids_parse_and_differ() {
        let a = random();
        let b = random();
        assert_ne!(a, b);
        let bytes = parse(&a).expect("parses");
        assert_eq!(format(&bytes), a);
        assert_eq!(bytes[6] >> 4, 4, "version 4");
    }

    #[test]
    fn bad_uuids_are_refused() {
        assert!(parse("not-a-uuid").is_none());
        assert!(parse("0123456789abcdef0123456789abcdef").is_none());
        assert!(parse("0123456g-89ab-cdef-0123-456789abcdef").is_none());
        assert!(parse("01234567-89AB-cdef-0123-456789abcdef").is_some());
    }
}
