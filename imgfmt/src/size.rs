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

/// Parse a duration: numbers with units `ms`, `s`, `m`, `h`, `d` (also `us`, `w` and the
/// long names), combined as in `1h30m` or `2m 30s` (humantime's grammar), or a plain number
/// of seconds (`120`, `0`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        return t.parse().map(Duration::from_secs).map_err(|_| format!("{t}: too many seconds"));
    }
    humantime::parse_duration(t).map_err(|e| format!("{e} (examples: 500ms, 90s, 15m, 1h30m, 7d)"))
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
}
