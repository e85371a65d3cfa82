//! Durations and sizes as the configuration file writes them: `"90s"`, `"1h30m"`, `"7d"`
//! or a number of seconds; `"4MiB"` or a number of bytes (the grammar of
//! `imgfmt::size`, shared with every flag).

use std::time::Duration;

use serde::{Deserialize, Deserializer};

#[derive(Deserialize)]
#[serde(untagged)]
enum Raw {
    Number(u64),
    Text(String),
}

/// An optional duration: text in `imgfmt::size::parse_duration`'s grammar, or seconds.
pub fn opt_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    match Option::<Raw>::deserialize(d)? {
        None => Ok(None),
        Some(Raw::Number(s)) => Ok(Some(Duration::from_secs(s))),
        Some(Raw::Text(t)) => imgfmt::size::parse_duration(&t).map(Some).map_err(serde::de::Error::custom),
    }
}

/// An optional size: text in `imgfmt::size::parse_size`'s grammar, or bytes.
pub fn opt_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match Option::<Raw>::deserialize(d)? {
        None => Ok(None),
        Some(Raw::Number(n)) => Ok(Some(n)),
        Some(Raw::Text(t)) => imgfmt::size::parse_size(&t).map(Some).map_err(serde::de::Error::custom),
    }
}

/// A duration a key may not exceed, with the key's name and the bound as people write it.
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    /// The key (`header_timeout`, `[gc] interval`, …).
    pub key: &'static str,
    /// The longest value accepted.
    pub max: Duration,
    /// `max` as written in the configuration (`1h`, `365d`).
    pub max_text: &'static str,
}

// A duration longer than its key allows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, displaydoc::Display)]
/// {key} = {seconds}s: longer than {max}, the most it may be
pub struct TooLong {
    /// The key.
    pub key: String,
    /// The value given, in seconds.
    pub seconds: u64,
    /// The bound, as people write it.
    pub max: &'static str,
}

impl Bound {
    /// Check `value` (when given) against the bound; `key` overrides the bound's own name.
    pub fn check_as(&self, key: impl Into<String>, value: Option<Duration>) -> Result<(), TooLong> {
        match value {
            Some(v) if v > self.max => Err(TooLong { key: key.into(), seconds: v.as_secs(), max: self.max_text }),
            _ => Ok(()),
        }
    }

    /// Check `value` (when given) against the bound.
    pub fn check(&self, value: Option<Duration>) -> Result<(), TooLong> {
        self.check_as(self.key, value)
    }
}
