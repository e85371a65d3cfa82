//! Waking an image: everything a restore does before its page server takes a connection,
//! for every front end (`snapctl lazy`'s socket and its CRIU work directory, a mount).
//!
//! [`prepare`] reaches the image's store (a layout, or a registry through three clients: the
//! metadata's, the faults' and the background's, each opening its connections at once),
//! resolves the reference to a manifest, takes the restore's [`Lease`] there, and opens the
//! image through the front end's gate (its policy) while a trace is looked for beside it.
//! It then decides when the outboards and the trace are read: before the socket (a
//! recording or CRIU restore), after it (a replay: [`Daemon::expect_replay`]), only their
//! entries (a restore serving faults by slice) or in the background. [`Prepared::serve`]
//! makes the [`Daemon`] that serves it, [`Prepared::serve_criu`] the
//! [`CriuDaemon`](crate::criu::CriuDaemon); the [`Woken`] they return holds the lease until
//! it is dropped. See spec/lazy.md "Waking".

use std::path::{Path, PathBuf};
use std::sync::Arc;

use imgfmt::reference::{Reference, Selector};
use imgfmt::{BlobSource, Image, ImageStore, OciDigest, OciLayout, OutboardsAhead, PendingOutboards};

use crate::criu::CriuDaemon;
use crate::{ChunkStore, Daemon, LayoutTraces, LazyError, LazyOptions, Lease, LoadedAhead, PrefetchMode, RegistryTraces, RetryPolicy, TraceStore};

/// Connections the faults' client opens while the image is being opened: one per vCPU of a
/// small guest, and the pacing's probe.
pub const WARM_FAULT_CONNECTIONS: usize = 3;
/// The same for the stream's and the replay's client (the pacing keeps about two requests
/// of it in flight).
pub const WARM_BACKGROUND_CONNECTIONS: usize = 2;
/// The same for the client reading the image's metadata: beside the manifest's own
/// connection (the config's next), one each for the index, the outboard's entries, the
/// trace lookup and the lease, all at once. One fewer and the last of them waits for a new
/// connection: a round trip more before the socket is bound.
pub const WARM_METADATA_CONNECTIONS: usize = 4;

/// What a front end supplies to wake an image: how it reaches stores (its transport and
/// credentials), how it names what fails, its policy's gate around the opening, and the
/// file a Firecracker restore serves. Errors are the front end's own.
pub trait Front {
    type Error: From<LazyError>;
    /// The OCI layout at `path`.
    fn layout(&self, path: &Path) -> Result<OciLayout, Self::Error>;
    /// A client for `repository` at `host`.
    fn registry(&self, host: &str, repository: &str) -> Result<regclient::RegistrySource, Self::Error>;
    /// The manifest digest `selector` names in `source`.
    fn resolve(&self, source: &Arc<dyn BlobSource>, selector: &Selector) -> Result<OciDigest, Self::Error>;
    /// Open the image, once the front end's policy accepts it (its checks may overlap the
    /// opening). The outboards, when `opening.outboards` asks for them, are still being
    /// read when this returns.
    fn open(&self, opening: &Opening<'_>) -> Result<(Image, Option<PendingOutboards>), Self::Error>;
    /// The file of `image` a Firecracker restore serves.
    fn memory_file(&self, image: &Image) -> Result<usize, Self::Error>;
    /// Say `message` to people: the outboards could not be loaded (called from any thread).
    fn warn(message: &str) {
        tracing::warn!("{message}");
    }
}

/// Where the image is kept.
pub enum Store {
    Layout { path: PathBuf, layout: Arc<OciLayout> },
    Registry(Arc<regclient::RegistrySource>),
}

impl Store {
    /// The source the image's metadata (manifest, config, index, outboards) is read from.
    pub fn metadata(&self) -> Arc<dyn BlobSource> {
        self.images()
    }

    /// The store itself, as the signatures and traces beside the image are read from it.
    pub fn images(&self) -> Arc<dyn ImageStore> {
        match self {
            Store::Layout { layout, .. } => layout.clone(),
            Store::Registry(c) => c.clone(),
        }
    }
}

/// What [`Front::open`] opens.
pub struct Opening<'a> {
    pub store: &'a Store,
    /// The manifest, resolved.
    pub digest: &'a OciDigest,
    /// How to read the outboards: `None`, not at all (nothing would use them); `Whole`,
    /// beside the config and index (`Image::open_outboards_later`); `Tables`, only their
    /// entries, a chunk's CVs when it first faults.
    pub outboards: Option<OutboardsAhead>,
}

/// An image ready to be served: opened, gated, leased, its clients connected, its
/// outboards and trace on their way as the restore needs them.
pub struct Prepared {
    pub image: Arc<Image>,
    /// The faults' source.
    pub source: Arc<dyn BlobSource>,
    /// The background's (the stream, the working-set replay), a client of its own.
    pub background: Option<Arc<dyn BlobSource>>,
    /// Where traces are found and kept (a trace read before the socket included).
    pub traces: Option<Box<dyn TraceStore>>,
    /// The outboards and the trace to read once the socket is bound, then replay.
    replay_later: Option<(PendingOutboards, Box<dyn TraceStore>)>,
    lease: Option<Lease>,
    opts: LazyOptions,
    warn: fn(&str),
}

/// A daemon made from a [`Prepared`] image; the restore's lease on the image is held
/// until this is dropped.
pub struct Woken<D> {
    pub daemon: Arc<D>,
    /// The trace is still being read (it is replayed once read and checked).
    pub replay_coming: bool,
    _lease: Option<Lease>,
}

/// Reach, resolve, lease and open the image `reference` names, as `opts` (and `criu`: a
/// CRIU restore) need it; see the module's doc.
pub fn prepare<F: Front>(front: &F, reference: &Reference, opts: LazyOptions, criu: bool) -> Result<Prepared, F::Error> {
    let Reached { store, clients, traces, selector } = reach(front, reference)?;
    let traces: Option<Box<dyn TraceStore>> = Some(traces);
    // Resolved once, here, so finding the image's trace (a registry's referrers: round
    // trips of their own) goes on beside reading the image's metadata.
    let digest = front.resolve(&store.metadata(), selector)?;
    // Held until the daemon ends (then released): the registry keeps the image through its
    // gc meanwhile, if it honours leases.
    let lease = match &store {
        Store::Registry(c) => Some(Lease::take(c.clone(), digest.clone())),
        Store::Layout { .. } => None,
    };
    // The policy decides before the socket exists: its signature reads overlap reading
    // the image's metadata, and no runtime's handshake is accepted for a refused image.
    let opening = Opening { store: &store, digest: &digest, outboards: outboards_ahead(&opts, criu) };
    let (image, pending, maybe_trace) = std::thread::scope(|s| {
        let looking = traces.as_deref().filter(|_| opts.prefetch != PrefetchMode::None).map(|t| s.spawn(|| t.prepare(&digest)));
        let opened = front.open(&opening);
        let maybe_trace = looking.is_some_and(|h| h.join().unwrap_or(true));
        opened.map(|(image, outboards)| (image, outboards, maybe_trace))
    })?;
    let image = Arc::new(image);
    let (source, background) = match clients {
        Some((faults, background)) => (faults, Some(background)),
        None => (store.metadata(), None),
    };
    let mut p = Prepared { image, source, background, traces, replay_later: None, lease, opts, warn: F::warn };
    if let Some(pending) = pending {
        p.place_outboards(front, pending, maybe_trace, criu)?;
    }
    Ok(p)
}

/// A store reached: see [`reach`].
struct Reached<'r> {
    store: Store,
    /// A registry's clients for the faults and for the background.
    clients: Option<(Arc<dyn BlobSource>, Arc<dyn BlobSource>)>,
    traces: Box<dyn TraceStore>,
    selector: &'r Selector,
}

/// The store `reference` names, the chunk clients of a registry, where its traces are
/// kept, and the manifest's selector. A registry gets clients of its own for the faults
/// and the background, and its traces are pushed as referrers; a layout keeps traces
/// under the fallback tag.
fn reach<'r, F: Front>(front: &F, reference: &'r Reference) -> Result<Reached<'r>, F::Error> {
    Ok(match reference {
        Reference::Layout { path, selector } => {
            let layout = Arc::new(front.layout(path)?);
            let traces = Box::new(LayoutTraces(front.layout(path)?));
            Reached { store: Store::Layout { path: path.clone(), layout }, clients: None, traces, selector }
        }
        Reference::Registry { host, repository, selector } => {
            let src = Arc::new(front.registry(host, repository)?);
            // The config, index and outboards are read at once after the manifest.
            warm_up(&src, WARM_METADATA_CONNECTIONS);
            let faults = chunk_client(front, host, repository, WARM_FAULT_CONNECTIONS)?;
            let clients = Some((faults, chunk_client(front, host, repository, WARM_BACKGROUND_CONNECTIONS)?));
            let traces = Box::new(RegistryTraces::new(src.clone()));
            Reached { store: Store::Registry(src), clients, traces, selector }
        }
    })
}

/// A client chunk reads go through, opening `warm` connections at once. The faults and
/// the background each have one, so a fault's small response is never read behind the
/// stream's megabytes. Neither retries on its own: the daemon retries chunk reads with
/// backoff inside its retry budget and counts every retry.
fn chunk_client<F: Front>(front: &F, host: &str, repository: &str, warm: usize) -> Result<Arc<dyn BlobSource>, F::Error> {
    let mut c = front.registry(host, repository)?;
    c.set_retry_policy(RetryPolicy::never());
    let c = Arc::new(c);
    warm_up(&c, warm);
    Ok(c)
}

/// Open `n` connections of `client` (and answer the registry's challenge, if it has one)
/// while the image's metadata is read on another client: without it the guest's first
/// faults paid a connection's set-up (a round trip, more with TLS) on top of their own
/// round trip. `GET /v2/`, each on a thread of its own so they overlap; a failure is left
/// to the first real request to report.
pub fn warm_up(client: &Arc<regclient::RegistrySource>, n: usize) {
    for _ in 0..n {
        let c = client.clone();
        let _ = std::thread::Builder::new().name("lazy-warm-up".into()).spawn(move || {
            let _ = c.check_login();
        });
    }
}

/// How the outboards are read, if at all. Outboards let a fault fetch a verified slice
/// instead of its whole chunk, a recording restore keep the guest's working set by slice,
/// and a later restore check that working set slice by slice before installing it. A
/// recording or CRIU restore wants every chunk's slice CVs at once: the whole blobs, read
/// beside the config and index. A restore serving faults reads only the outboards'
/// entries, and a chunk's CVs when it first faults (spec/lazy.md "Waking").
fn outboards_ahead(opts: &LazyOptions, criu: bool) -> Option<OutboardsAhead> {
    if !(opts.slice_faults || opts.record_trace || opts.prefetch != PrefetchMode::None) {
        return None;
    }
    Some(if opts.record_trace || criu { OutboardsAhead::Whole } else { OutboardsAhead::Tables })
}

impl Prepared {
    /// When the outboards are put in place. A replay listens at once, as a restore that
    /// only serves faults does: its outboards and trace are read after the socket is
    /// bound, and its working set replayed when they are in (the guest's first faults are
    /// served meanwhile). A recording restore keeps the working set by slice from the first
    /// fault, and a CRIU restore pushes its pages by slice: they wait for the outboards. A
    /// restore that only serves faults fetches whole chunks until the outboards are in.
    fn place_outboards<F: Front>(&mut self, front: &F, pending: PendingOutboards, maybe_trace: bool, criu: bool) -> Result<(), F::Error> {
        let record = self.opts.record_trace;
        if maybe_trace && !record && !criu && self.traces.is_some() {
            self.replay_later = Some((pending, self.traces.take().expect("checked")));
        } else if maybe_trace && !criu && self.traces.is_some() {
            // A recording restore that found a trace (its chunk order leads the stream).
            let file = front.memory_file(&self.image)?;
            let store = self.traces.take().expect("checked");
            self.traces = Some(Box::new(outboards_beside_trace(pending, &self.image, store, file, self.warn)));
        } else if record || maybe_trace || criu {
            finish_outboards(pending, &self.image, self.warn);
        } else if self.image.slices_on_demand() {
            // Every outboard's entries are in: a fault reads its chunk's CVs beside its
            // slice, and the whole blobs never cross the link.
            drop(pending);
        } else {
            let (i, warn) = (self.image.clone(), self.warn);
            std::thread::Builder::new()
                .name("lazy-outboards".into())
                .spawn(move || finish_outboards(pending, &i, warn))
                .map_err(crate::io_err("spawning a thread"))?;
        }
        Ok(())
    }

    /// Whether the trace will be read once the socket is bound (and its working set
    /// replayed when read and checked).
    pub fn replays_later(&self) -> bool {
        self.replay_later.is_some()
    }

    /// The Firecracker daemon serving file `file` with the chunk cache `store`; the trace
    /// still to read is read on a thread of its own, and replayed once read. `socket` and
    /// the rest of the options are those given to [`prepare`].
    pub fn serve(self, file: usize, store: Option<Arc<dyn ChunkStore>>) -> Result<Woken<Daemon>, LazyError> {
        let daemon = Daemon::new(self.image.clone(), file, self.source, store, self.traces, self.opts)?;
        if let Some(bg) = self.background {
            daemon.set_background_source(bg);
        }
        let replay_coming = self.replay_later.is_some();
        if let Some((pending, traces)) = self.replay_later {
            daemon.expect_replay();
            let (d, i, warn) = (daemon.clone(), self.image, self.warn);
            std::thread::Builder::new()
                .name("lazy-trace".into())
                .spawn(move || d.set_replay(&outboards_beside_trace(pending, &i, traces, file, warn)))
                .map_err(crate::io_err("spawning a thread"))?;
        }
        Ok(Woken { daemon, replay_coming, _lease: self.lease })
    }

    /// The CRIU daemon serving the restore run in `workdir` (`criu lazy-pages`).
    pub fn serve_criu(self, store: Option<Arc<dyn ChunkStore>>, workdir: PathBuf) -> Woken<CriuDaemon> {
        let daemon = CriuDaemon::new(self.image, self.source, store, workdir, self.opts);
        Woken { daemon, replay_coming: false, _lease: self.lease }
    }
}

/// Put the outboards in place once they are in, and meanwhile read file `file`'s trace from
/// `store`: the trace's own round trips (its manifest, its JSON, whether its working set is
/// there) need nothing of the outboards, so they overlap the outboards' bytes.
fn outboards_beside_trace(pending: PendingOutboards, image: &Image, store: Box<dyn TraceStore>, file: usize, warn: fn(&str)) -> LoadedAhead {
    std::thread::scope(|s| {
        let reading = s.spawn(|| finish_outboards(pending, image, warn));
        let ahead = LoadedAhead::read(store, image, file);
        let _ = reading.join();
        ahead
    })
}

/// Put the outboards in place once they are in. Without them (an old image, a blob that
/// will not load) faults fetch whole chunks and traces are chunk orders only.
fn finish_outboards(pending: PendingOutboards, image: &Image, warn: fn(&str)) {
    if let Err(e) = pending.finish(image) {
        warn(&format!("{e}; faults fetch whole chunks, and no working set is recorded or replayed"));
    }
}
