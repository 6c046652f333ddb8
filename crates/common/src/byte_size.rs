//! A byte count written with a unit: `512`, `4k`, `4KiB`, `1M`, `100GiB`.
//!
//! Units are powers of two whether or not the `i` is written (`4k` = `4KiB` = 4096), as
//! fio, qemu-img and SPDK read them; a storage operator types `4k` and means 4096.

use std::fmt;
use std::str::FromStr;

/// A size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

/// Why a size did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ByteSizeError {
    /// No digits before the unit.
    #[error("size {text:?} has no number (expected e.g. 4096, 4KiB, 1GiB)")]
    NoNumber {
        /// The text given.
        text: String,
    },
    /// A unit we do not know.
    #[error("size {text:?} has unknown unit {unit:?} (expected B, K, KiB, M, MiB, G, GiB, T, TiB)")]
    UnknownUnit {
        /// The text given.
        text: String,
        /// The unit part.
        unit: String,
    },
    /// The value does not fit in 64 bits.
    #[error("size {text:?} is larger than 2^64 bytes")]
    Overflow {
        /// The text given.
        text: String,
    },
}

const UNITS: [(&str, u32); 5] = [("", 0), ("k", 10), ("m", 20), ("g", 30), ("t", 40)];

impl FromStr for ByteSize {
    type Err = ByteSizeError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let trimmed = text.trim();
        let digits_end = trimmed
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(trimmed.len());
        let (digits, unit) = trimmed.split_at(digits_end);
        if digits.is_empty() {
            return Err(ByteSizeError::NoNumber {
                text: text.to_string(),
            });
        }
        let value: u64 = digits.parse().map_err(|_| ByteSizeError::Overflow {
            text: text.to_string(),
        })?;
        let unit_lower = unit.trim().to_ascii_lowercase();
        let prefix = unit_lower
            .strip_suffix("ib")
            .or_else(|| unit_lower.strip_suffix('b'))
            .unwrap_or(&unit_lower);
        let shift = UNITS
            .iter()
            .find(|(name, _)| *name == prefix)
            .map(|(_, shift)| *shift)
            .ok_or_else(|| ByteSizeError::UnknownUnit {
                text: text.to_string(),
                unit: unit.to_string(),
            })?;
        value
            .checked_mul(1u64 << shift)
            .map(ByteSize)
            .ok_or_else(|| ByteSizeError::Overflow {
                text: text.to_string(),
            })
    }
}

impl ByteSize {
    /// Rounded for people: `1.5 GiB`, `512 KiB`, `0 B`.
    pub fn approx(self) -> String {
        let names = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut value = self.0 as f64;
        let mut unit = 0;
        while unit + 1 < names.len() && value >= 1024.0 {
            value /= 1024.0;
            unit += 1;
        }
        if unit == 0 || value >= 100.0 {
            format!("{value:.0} {}", names[unit])
        } else {
            format!("{value:.1} {}", names[unit])
        }
    }
}

impl fmt::Display for ByteSize {
    /// The largest binary unit that divides the size exactly: `4096` shows as `4KiB`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut value = self.0;
        let mut unit = 0;
        while unit + 1 < names.len() && value != 0 && value.is_multiple_of(1024) {
            value /= 1024;
            unit += 1;
        }
        write!(f, "{value}{}", names[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn approximate_sizes_round_to_a_unit() {
        assert_eq!(ByteSize(0).approx(), "0 B");
        assert_eq!(ByteSize(1536 << 20).approx(), "1.5 GiB");
        assert_eq!(ByteSize(512 << 10).approx(), "512 KiB");
        assert_eq!(ByteSize(1023).approx(), "1023 B");
    }

    #[test]
    fn parses_units_as_powers_of_two() {
        assert_eq!("4096".parse::<ByteSize>(), Ok(ByteSize(4096)));
        assert_eq!("4k".parse::<ByteSize>(), Ok(ByteSize(4096)));
        assert_eq!("4KiB".parse::<ByteSize>(), Ok(ByteSize(4096)));
        assert_eq!("1M".parse::<ByteSize>(), Ok(ByteSize(1 << 20)));
        assert_eq!("100GiB".parse::<ByteSize>(), Ok(ByteSize(100 << 30)));
        assert_eq!("2 TiB".parse::<ByteSize>(), Ok(ByteSize(2 << 40)));
        assert_eq!("7B".parse::<ByteSize>(), Ok(ByteSize(7)));
    }

    #[test]
    fn rejects_bad_sizes_with_the_reason() {
        assert!(matches!(
            "GiB".parse::<ByteSize>(),
            Err(ByteSizeError::NoNumber { .. })
        ));
        assert!(matches!(
            "4XB".parse::<ByteSize>(),
            Err(ByteSizeError::UnknownUnit { .. })
        ));
        assert!(matches!(
            "99999999999T".parse::<ByteSize>(),
            Err(ByteSizeError::Overflow { .. })
        ));
    }

    proptest! {
        #[test]
        fn display_parses_back(value in any::<u64>()) {
            let size = ByteSize(value);
            prop_assert_eq!(size.to_string().parse::<ByteSize>(), Ok(size));
        }
    }
}
