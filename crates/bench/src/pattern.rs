//! Verifiable block contents.
//!
//! A block written by the bench carries its offset, a generation number (how many times
//! this block has been written in this run) and, with `--verify`, a pseudo-random body
//! derived from both, so a read-back detects stale data, misdirected writes and
//! corruption, and says which. Without it every block carries one body under its own
//! stamp.

/// Marks a block written by `basalt bench`.
const MAGIC: u32 = 0xba5a_17be;
/// Bytes of the stamp at the start of every block.
pub const STAMP_SIZE: usize = 16;

/// Fills `data` with the contents of the block at `offset_bytes`, generation `generation`.
pub fn fill(data: &mut [u8], offset_bytes: u64, generation: u32) {
    let seed = offset_bytes ^ (u64::from(generation) << 48) ^ 0x9e37_79b9_7f4a_7c15;
    // Word i is splitmix64's (i + 1)th output from `seed`, computed from its index so
    // that the words do not wait on each other (the loop vectorizes).
    let next_index = (data.len() / 8) as u64 + 1;
    let mut words = data.chunks_exact_mut(8);
    for (index, chunk) in (1u64..).zip(&mut words) {
        let word = mix64(seed.wrapping_add(index.wrapping_mul(GOLDEN_GAMMA)));
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    let tail = words.into_remainder();
    if !tail.is_empty() {
        let word = mix64(seed.wrapping_add(next_index.wrapping_mul(GOLDEN_GAMMA)));
        tail.copy_from_slice(&word.to_le_bytes()[..tail.len()]);
    }
    stamp(data, offset_bytes, generation);
}

/// Writes the stamp of the block at `offset_bytes`, generation `generation`, over the first
/// [`STAMP_SIZE`] bytes of `data` (nothing when the block is shorter), leaving the body.
pub fn stamp(data: &mut [u8], offset_bytes: u64, generation: u32) {
    if data.len() >= STAMP_SIZE {
        data[0..8].copy_from_slice(&offset_bytes.to_le_bytes());
        data[8..12].copy_from_slice(&generation.to_le_bytes());
        data[12..16].copy_from_slice(&MAGIC.to_le_bytes());
    }
}

/// What a read-back found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mismatch {
    /// The block carries another offset's stamp (a misdirected write or read).
    Misplaced {
        /// Offset found in the stamp.
        found_offset_bytes: u64,
    },
    /// The block is from another generation (a lost or stale write).
    Stale {
        /// Generation found.
        found_generation: u32,
    },
    /// The stamp is right but the body differs, or there is no stamp.
    Corrupt {
        /// First differing byte.
        first_byte: usize,
    },
}

/// Checks `data` read at `offset_bytes` against generation `generation`.
pub fn check(data: &[u8], offset_bytes: u64, generation: u32) -> Result<(), Mismatch> {
    let mut expected = vec![0u8; data.len()];
    fill(&mut expected, offset_bytes, generation);
    if data == expected.as_slice() {
        return Ok(());
    }
    if data.len() >= STAMP_SIZE
        && u32::from_le_bytes([data[12], data[13], data[14], data[15]]) == MAGIC
    {
        let mut offset = [0u8; 8];
        offset.copy_from_slice(&data[0..8]);
        let found_offset_bytes = u64::from_le_bytes(offset);
        if found_offset_bytes != offset_bytes {
            return Err(Mismatch::Misplaced { found_offset_bytes });
        }
        let found_generation = u32::from_le_bytes([data[8], data[9], data[10], data[11]]);
        if found_generation != generation {
            return Err(Mismatch::Stale { found_generation });
        }
    }
    let first_byte = data
        .iter()
        .zip(&expected)
        .position(|(a, b)| a != b)
        .unwrap_or(0);
    Err(Mismatch::Corrupt { first_byte })
}

/// splitmix64's increment.
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The splitmix64 generator: fast, and good enough for offsets and fill patterns.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(GOLDEN_GAMMA);
    mix64(*state)
}

/// splitmix64's output function.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn filled_blocks_check(offset in any::<u64>(), generation in any::<u32>(), len in 1usize..9000) {
            let mut data = vec![0u8; len];
            fill(&mut data, offset, generation);
            prop_assert_eq!(check(&data, offset, generation), Ok(()));
        }
    }

    proptest! {
        #[test]
        fn the_fill_is_the_splitmix_sequence(offset in any::<u64>(), generation in any::<u32>(), len in 1usize..200) {
            let mut data = vec![0u8; len];
            fill(&mut data, offset, generation);
            let mut state = offset ^ (u64::from(generation) << 48) ^ GOLDEN_GAMMA;
            let mut expected: Vec<u8> = (0..len.div_ceil(8))
                .flat_map(|_| splitmix64(&mut state).to_le_bytes())
                .take(len)
                .collect();
            if len >= STAMP_SIZE {
                expected[0..8].copy_from_slice(&offset.to_le_bytes());
                expected[8..12].copy_from_slice(&generation.to_le_bytes());
                expected[12..16].copy_from_slice(&MAGIC.to_le_bytes());
            }
            prop_assert_eq!(data, expected);
        }
    }

    #[test]
    fn mismatches_say_what_is_wrong() {
        let mut data = vec![0u8; 4096];
        fill(&mut data, 8192, 3);
        assert_eq!(
            check(&data, 4096, 3),
            Err(Mismatch::Misplaced {
                found_offset_bytes: 8192
            })
        );
        assert_eq!(
            check(&data, 8192, 4),
            Err(Mismatch::Stale {
                found_generation: 3
            })
        );
        data[100] ^= 1;
        assert_eq!(
            check(&data, 8192, 3),
            Err(Mismatch::Corrupt { first_byte: 100 })
        );
        assert!(matches!(
            check(&[0u8; 4096], 0, 1),
            Err(Mismatch::Corrupt { .. })
        ));
    }
}
