//! Human sizes (`1MiB`, `64KiB`, `4M`, `1048576`) and durations (`90s`, `1h30m`, `7d`): the
//! one grammar of each for every flag and configuration file.

use std::time::Duration;

/// Parse a size with an optional binary (`KiB`, `MiB`, `GiB`, or `K`/`M`/`G`) or decimal
/// (`KB`, `MB`, `GB`) suffix.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("size {s:?}: expected a number with an optional unit"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        other => return Err(format!("size {s:?}: unknown unit {other:?} (use KiB, MiB, GiB)")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("size {s:?} is too large"))
}

/// A byte count as a flag is written: in the largest binary unit it is a whole number of
/// (`10GiB`, `8MiB`, `1536KiB`, `1000`), so help can show a library's constant as the default
/// a user would type. [`parse_size`] reads it back to `n`.
pub fn flag(n: u64) -> String {
    const UNITS: [(u32, &str); 4] = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
    match UNITS.iter().find(|(shift, _)| n != 0 && n.trailing_zeros() >= *shift) {
        Some((shift, unit)) => format!("{}{unit}", n >> shift),
        None => n.to_string(),
    }
}

/// Units a duration may use: `ms`, `s`, `m`, `h`, `d`, also `ns`, `us`, `w` and the long
/// names. Not months or years (humantime's `M` and `y`): their length is a convention,
/// and `1M` reads as a minute to many.
const DURATION_UNITS: [&str; 27] = [
    "ns", "nsec", "us", "usec", "ms", "msec", "s", "sec", "secs", "second", "seconds", "m", "min", "mins", "minute", "minutes", "h", "hr", "hrs", "hour",
    "hours", "d", "day", "days", "w", "week", "weeks",
];

/// Parse a duration: numbers with units `ms`, `s`, `m`, `h`, `d` (also `us`, `w` and the
/// long names: [`DURATION_UNITS`]), combined as in `1h30m` or `2m 30s` (humantime's
/// grammar), or a plain number of seconds (`120`, `0`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        return t.parse().map(Duration::from_secs).map_err(|_| format!("{t}: too many seconds"));
    }
    let bad = || format!("duration {t:?}: expected numbers with units ms, s, m, h, d or w (examples: 500ms, 90s, 15m, 1h30m, 7d)");
    if t.split(|c: char| !c.is_ascii_alphabetic()).any(|unit| !unit.is_empty() && !DURATION_UNITS.contains(&unit)) {
        return Err(bad());
    }
    humantime::parse_duration(t).map_err(|e| match e {
        humantime::DurationError::NumberOverflow => format!("duration {t:?} is too long"),
        _ => bad(),
    })
}

/// Format a byte count for people: `1.5 GiB`.
pub fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn sizes() {
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("4M").unwrap(), 4 << 20);
        assert_eq!(parse_size("1048576").unwrap(), 1 << 20);
        assert!(parse_size("1XB").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("99999999999999GiB").is_err());
        assert_eq!(human(1536 << 20), "1.5 GiB");
    }

    #[test]
    fn a_size_written_as_a_flag_reads_back_the_same() {
        assert_eq!(flag(10 << 30), "10GiB");
        assert_eq!(flag(8 << 20), "8MiB");
        assert_eq!(flag(1536 << 10), "1536KiB");
        assert_eq!(flag(1000), "1000");
        assert_eq!(flag(0), "0");
        for n in [0, 1, 1023, 1024, 10 << 30, 3 << 40, 5 << 50, u64::MAX, (1 << 20) + 1] {
            assert_eq!(parse_size(&flag(n)), Ok(n), "{n}");
        }
    }

    /// Issue 39: the error listed months and years, units no flag should take.
    #[test]
    fn regression_issue_39_duration_errors_name_only_the_units_taken() {
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("2weeks"), Ok(Duration::from_secs(14 * 86_400)));
        for bad in ["1y", "2months", "1M", "3x", "soon", ""] {
            let e = parse_duration(bad).unwrap_err();
            let said = e.replace(&format!("{bad:?}"), "");
            assert!(!said.contains("month") && !said.contains("year"), "{bad}: {e}");
            assert!(e.contains("ms, s, m, h, d"), "{bad}: {e}");
        }
        assert!(parse_duration("99999999999999999999d").unwrap_err().contains("too long"));
    }
}
