//! What a restore tells the registry, the one home of both headers:
//!
//! - `Snapctl-Purpose: restore | read` on every request a client sends its registry
//!   ([`Purpose`], set by [`crate::Transport::purpose`]): a manifest read with `restore` is
//!   a pull (a registry's "last pulled", which retention's `pulled_within` rules read);
//!   `read` (inspect, verify, a push looking up its parent) is not. A plain client reads
//!   for `read`; the commands that restore an image (pull, unpack, lazy, mount, and copy's
//!   source) opt in.
//! - Restore leases: a running restore asks the registry to keep the manifest it serves
//!   (and everything that manifest needs) through garbage collection, for a while, by
//!   sending `Snapctl-Lease: <seconds>` on a `HEAD` of the manifest by digest. A registry
//!   that records the lease echoes the header with the seconds it granted; one that does
//!   not (distribution, Harbor, ...) answers the `HEAD` as usual and keeps nothing.
//!   `seconds == 0` releases the lease. A lease is a restore, so it counts as a pull too.
//!
//! The wire contract is in `spec/transfer.md` §9 and `spec/registry.md` ("Pulls").

use imgfmt::{BlobSource, OciDigest};

use super::{ClientError, RegistrySource};

/// The request header saying what a client's reads are for ([`Purpose`]).
pub const PURPOSE_HEADER: &str = "Snapctl-Purpose";

/// What a client's reads are for, sent as [`PURPOSE_HEADER`]. A registry records a pull
/// when a manifest is read for [`Purpose::Restore`] (or by a client that sends no such
/// header: another tool pulling an image is restoring it), never for [`Purpose::Read`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Purpose {
    /// Looking, not restoring: inspect, verify, a push resolving its parent. The default.
    #[default]
    Read,
    /// Restoring the image: pull, unpack, lazy, mount, copy's source.
    Restore,
}

impl Purpose {
    /// The header's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Purpose::Read => "read",
            Purpose::Restore => "restore",
        }
    }
}

/// The request and response header of a restore lease.
pub const LEASE_HEADER: &str = "Snapctl-Lease";
/// The longest lease a client may ask for, in seconds (a registry caps it lower as it
/// likes; a larger value is refused with 400).
pub const MAX_LEASE_SECONDS: u64 = 86_400;

impl RegistrySource {
    /// Take, renew (`seconds > 0`) or release (`seconds == 0`) the lease on manifest
    /// `digest` of this repository: `HEAD /v2/<name>/manifests/<digest>` with
    /// `Snapctl-Lease: <seconds>`. `Ok(Some(granted))` when the registry recorded it (it
    /// echoed the header; `granted` is what it granted, which may be less than asked),
    /// `Ok(None)` when it answered without the header (it does not honour leases). An
    /// answer other than 200 is an error; transient failures are retried as every request
    /// of this client is. `seconds` above [`MAX_LEASE_SECONDS`] is asked as that.
    pub fn lease(&self, digest: &OciDigest, seconds: u64) -> Result<Option<u64>, ClientError> {
        let seconds = seconds.min(MAX_LEASE_SECONDS);
        let url = self.url("manifests", digest.as_str());
        let what = format!("lease of {digest} on {} ({seconds} s)", self.describe());
        let resp = self.send(&what, &|c| c.head(&url).header(reqwest::header::ACCEPT, Self::accept()).header(LEASE_HEADER, seconds.to_string()))?;
        if !resp.status().is_success() {
            return Err(Self::refusal(&what, resp));
        }
        // An echo that is not a number is no grant: nothing says what was recorded.
        Ok(resp.headers().get(LEASE_HEADER).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;
    use std::sync::{Arc, Mutex};

    /// A one-thread HTTP server answering every request with `answer(request head)`; the
    /// request heads it saw.
    fn server(answer: fn(&str) -> String) -> (String, Arc<Mutex<Vec<String>>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut conn) = conn else { return };
                let mut r = BufReader::new(conn.try_clone().unwrap());
                loop {
                    let mut head = String::new();
                    loop {
                        let mut line = String::new();
                        if r.read_line(&mut line).unwrap_or(0) == 0 {
                            break;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        head.push_str(&line);
                    }
                    if head.is_empty() {
                        break;
                    }
                    let resp = answer(&head);
                    s2.lock().unwrap().push(head);
                    if conn.write_all(resp.as_bytes()).is_err() {
                        break;
                    }
                }
            }
        });
        (addr, seen)
    }

    fn digest() -> OciDigest {
        OciDigest::of(b"a manifest")
    }

    #[test]
    fn a_lease_is_a_head_by_digest_with_the_header_and_the_echo_is_the_grant() {
        let (addr, seen) = server(|head| {
            let asked = head.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix("snapctl-lease:").map(|v| v.trim().to_string())).unwrap_or_default();
            let granted = asked.parse::<u64>().unwrap_or(0).min(600);
            format!("HTTP/1.1 200 OK\r\nContent-Length: 10\r\nSnapctl-Lease: {granted}\r\n\r\n")
        });
        let c = RegistrySource::new(&addr, "sbx/vm", true, None).unwrap();
        assert_eq!(c.lease(&digest(), 900).unwrap(), Some(600), "the server's grant, not the ask");
        assert_eq!(c.lease(&digest(), 0).unwrap(), Some(0), "a release");
        assert_eq!(c.lease(&digest(), 10 * MAX_LEASE_SECONDS).unwrap(), Some(600));
        let seen = seen.lock().unwrap();
        assert!(seen[0].starts_with(&format!("HEAD /v2/sbx/vm/manifests/{} HTTP/1.1", digest())), "{seen:?}");
        assert!(seen[0].to_ascii_lowercase().contains("snapctl-lease: 900\r\n"), "{seen:?}");
        assert!(seen[1].to_ascii_lowercase().contains("snapctl-lease: 0\r\n"), "{seen:?}");
        assert!(seen[2].to_ascii_lowercase().contains(&format!("snapctl-lease: {MAX_LEASE_SECONDS}\r\n")), "asked at most the bound: {seen:?}");
    }

    #[test]
    fn regression_issue_39_reads_say_what_they_are_for_and_only_restores_opt_in() {
        let (addr, seen) = server(|_| "HTTP/1.1 200 OK\r\nContent-Length: 10\r\nSnapctl-Lease: 60\r\n\r\n".to_string());
        let plain = RegistrySource::new(&addr, "sbx/vm", true, None).unwrap();
        plain.lease(&digest(), 60).unwrap();
        // The one-thread server reads one connection until it closes.
        drop(plain);
        let t = crate::Transport { purpose: Purpose::Restore, ..Default::default() };
        let restoring = RegistrySource::connect(&addr, "sbx/vm", &t, None).unwrap();
        restoring.lease(&digest(), 60).unwrap();
        let seen = seen.lock().unwrap();
        assert!(seen[0].to_ascii_lowercase().contains("snapctl-purpose: read\r\n"), "a plain client is not restoring: {seen:?}");
        assert!(seen[1].to_ascii_lowercase().contains("snapctl-purpose: restore\r\n"), "{seen:?}");
    }

    #[test]
    fn a_registry_that_does_not_echo_the_header_grants_nothing() {
        let (addr, _) = server(|_| "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n".to_string());
        let c = RegistrySource::new(&addr, "sbx/vm", true, None).unwrap();
        assert_eq!(c.lease(&digest(), 900).unwrap(), None);
        let (addr, _) = server(|_| "HTTP/1.1 200 OK\r\nContent-Length: 10\r\nSnapctl-Lease: soon\r\n\r\n".to_string());
        let c = RegistrySource::new(&addr, "sbx/vm", true, None).unwrap();
        assert_eq!(c.lease(&digest(), 900).unwrap(), None, "an echo that is no number is no grant");
    }

    #[test]
    fn a_refused_lease_is_an_error() {
        let (addr, _) = server(|_| "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_string());
        let c = RegistrySource::new(&addr, "sbx/vm", true, None).unwrap();
        let e = c.lease(&digest(), 900).unwrap_err();
        assert_eq!(e.status(), Some(404), "{e}");
    }
}
