//! The restore's lease on its image at the registry: while the daemon runs, the registry
//! keeps the manifest it serves (and everything that manifest needs) through gc, whatever
//! happened to the tag it was restored from. Taken right after the tag is resolved,
//! renewed every [`LEASE_SECONDS`]` / 3` on a thread of its own, released when the daemon
//! ends cleanly; a daemon killed outright leaves a lease that ends at most [`LEASE_SECONDS`]
//! later. A registry that does not honour leases (it does not echo `Snapctl-Lease`) is said
//! once: the restore then depends on the registry until the fill has put the whole image in
//! the chunk cache (spec/lazy.md "How long a restore depends on its registry"). Failures are
//! logged and tried again at the next renewal, never fatal.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use imgfmt::OciDigest;

/// How long each lease is asked for, in seconds; renewed every third of it.
pub const LEASE_SECONDS: u64 = 900;
/// How long a clean exit waits for the release to be answered.
const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// Where a lease is taken (the registry client; tests use a fake).
pub trait Leaser: Send + Sync {
    /// Take or renew (`seconds > 0`) or release (`0`) the lease: the seconds granted, or
    /// `None` when the registry does not honour leases.
    fn lease(&self, seconds: u64) -> Result<Option<u64>, String>;
    /// The image, for messages.
    fn describe(&self) -> String;
}

/// A registry repository's manifest by digest.
struct RegistryLease {
    client: Arc<regclient::RegistrySource>,
    digest: OciDigest,
}

impl Leaser for RegistryLease {
    fn lease(&self, seconds: u64) -> Result<Option<u64>, String> {
        self.client.lease(&self.digest, seconds).map_err(|e| e.to_string())
    }
    fn describe(&self) -> String {
        use imgfmt::BlobSource;
        format!("{}@{}", self.client.describe(), self.digest)
    }
}

/// A lease held while this lives: renewed on a thread, released when dropped.
pub struct Lease {
    stop: Option<mpsc::Sender<()>>,
    released: mpsc::Receiver<()>,
}

impl Lease {
    /// Take a lease of [`LEASE_SECONDS`] on manifest `digest` of `client`'s repository.
    pub fn take(client: Arc<regclient::RegistrySource>, digest: OciDigest) -> Lease {
        Lease::hold(Arc::new(RegistryLease { client, digest }), LEASE_SECONDS)
    }

    /// Take a lease of `seconds` through `leaser` now (on the thread, so the caller does
    /// not wait for the round trip), renew it every `seconds / 3`, release it on drop.
    pub fn hold(leaser: Arc<dyn Leaser>, seconds: u64) -> Lease {
        let (stop, stopped) = mpsc::channel::<()>();
        let (done, released) = mpsc::channel::<()>();
        let every = Duration::from_secs(seconds.max(3) / 3);
        let spawned = std::thread::Builder::new().name("lazy-lease".into()).spawn(move || {
            let mut said = Said::default();
            loop {
                said.renewed(leaser.as_ref(), seconds, leaser.lease(seconds));
                match stopped.recv_timeout(every) {
                    Err(RecvTimeoutError::Timeout) => continue,
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            if said.granted {
                match leaser.lease(0) {
                    Ok(_) => tracing::debug!("released the lease on {}", leaser.describe()),
                    Err(e) => tracing::warn!("releasing the lease on {}: {e} (it ends by itself within {seconds} s)", leaser.describe()),
                }
            }
            let _ = done.send(());
        });
        if let Err(e) = spawned {
            tracing::warn!("no lease on the image at the registry (no thread: {e}): gc may delete it while it is served");
        }
        Lease { stop: Some(stop), released }
    }
}

impl Drop for Lease {
    /// Release the lease (a clean exit), waiting at most a few seconds for the answer.
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = self.released.recv_timeout(RELEASE_WAIT);
    }
}

/// What the lease thread has said, so each kind of news is said once.
#[derive(Default)]
struct Said {
    granted: bool,
    refused: bool,
    failing: bool,
}

impl Said {
    fn renewed(&mut self, leaser: &dyn Leaser, seconds: u64, r: Result<Option<u64>, String>) {
        match r {
            Ok(Some(g)) => {
                if !self.granted || self.failing {
                    tracing::info!("lease on {} at the registry: {g} s, renewed every {} s", leaser.describe(), seconds.max(3) / 3);
                }
                self.granted = true;
                self.failing = false;
            }
            Ok(None) => {
                if !self.refused {
                    tracing::info!(
                        "the registry of {} does not honour restore leases: this restore is safe from its gc only once the image is whole in the chunk cache",
                        leaser.describe()
                    );
                }
                self.refused = true;
                self.failing = false;
            }
            Err(e) => {
                if !self.failing {
                    tracing::warn!("lease on {}: {e}; tried again in {} s", leaser.describe(), seconds.max(3) / 3);
                }
                self.failing = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Instant;

    /// A registry that grants (or not) and records what it was asked, when.
    struct Fake {
        honour: bool,
        fail_first: bool,
        asked: Mutex<Vec<(Instant, u64)>>,
    }

    impl Leaser for Fake {
        fn lease(&self, seconds: u64) -> Result<Option<u64>, String> {
            let mut a = self.asked.lock().unwrap();
            a.push((Instant::now(), seconds));
            if self.fail_first && a.len() == 1 {
                return Err("connection refused".into());
            }
            Ok(self.honour.then_some(seconds))
        }
        fn describe(&self) -> String {
            "fake".into()
        }
    }

    #[test]
    fn a_lease_is_taken_at_once_renewed_every_third_and_released_on_drop() {
        let f = Arc::new(Fake { honour: true, fail_first: true, asked: Mutex::default() });
        let t0 = Instant::now();
        let l = Lease::hold(f.clone(), 3);
        std::thread::sleep(Duration::from_millis(2500));
        drop(l);
        let asked = f.asked.lock().unwrap().clone();
        let secs: Vec<u64> = asked.iter().map(|a| a.1).collect();
        assert_eq!(secs, [3, 3, 3, 0], "taken (failed: not fatal), renewed twice in 2.5 s, released: {asked:?}");
        assert!(asked[0].0 - t0 < Duration::from_millis(500), "taken at once");
        assert!(asked[1].0 - asked[0].0 >= Duration::from_millis(900), "renewed every second: {asked:?}");
    }

    #[test]
    fn a_registry_that_does_not_honour_leases_gets_no_release() {
        let f = Arc::new(Fake { honour: false, fail_first: false, asked: Mutex::default() });
        let l = Lease::hold(f.clone(), 30);
        std::thread::sleep(Duration::from_millis(200));
        drop(l);
        let secs: Vec<u64> = f.asked.lock().unwrap().iter().map(|a| a.1).collect();
        assert_eq!(secs, [30], "asked once, nothing to release");
    }
}
