//! `snapctl inspect`: what an image holds and what it costs.

use std::collections::HashSet;
use std::process::ExitCode;

use imgfmt::size::human;
use imgfmt::{media, Image, StoredAt};
use serde::Serialize;

use super::common::{self, open_image_at, outln};

/// Show an image: kind, files, sizes, chunk counts (zero / stored / referenced /
/// inherited), compression ratio, roots, the base/parent chain, what is attached to it
/// (referrers: signatures, SBOMs, recorded traces; cosign's sha256-<hex>.sig tags), and its
/// cosign signatures (tag sha256-<hex>.sig and referrers): the name each claims and who
/// signed it, by the fingerprint of the --key or policy key that verifies it.
///
/// Any other OCI manifest or index (a signature, an SBOM, an image of another tool) is
/// described as it is: media type, artifact type, subject, config, layers, annotations;
/// exit 0 (exit 1 is for a snapshot whose content fails its checks).
#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// Image: oci:PATH[:TAG|@DIGEST] or HOST[:PORT]/REPO[:TAG|@DIGEST] (plain HTTP for loopback
    /// hosts or with SNAPCTL_PLAIN_HTTP=1; credentials from ~/.docker/config.json).
    pub image: String,
    #[command(flatten)]
    pub registry: super::common::RegistryFlags,
    /// Print JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// A public key (cosign.pub) to tell signers by (repeatable); the keys of the policy
    /// rule for this image are tried too.
    #[arg(long, value_name = "FILE")]
    pub key: Vec<std::path::PathBuf>,
    #[command(flatten)]
    pub policy: super::policy::PolicyFlags,
}

#[derive(Debug, Default, Serialize)]
pub struct Counts {
    /// Chunk positions (the `--json` vocabulary: `<what>_chunks` counts, README).
    pub chunks: u64,
    pub zero_chunks: u64,
    /// In this image's own packs.
    pub stored_chunks: u64,
    /// Recorded by this image but pointing into a base's or ancestor's packs.
    pub referenced_chunks: u64,
    /// Not recorded by this image: inherited from the parent chain.
    pub inherited_chunks: u64,
    /// Uncompressed bytes of non-zero chunks.
    pub data_bytes: u64,
    /// Stored (possibly compressed) bytes of those chunks wherever they live: this
    /// image's packs, its base's and its parent chain's (what a pull of it fetches).
    pub chain_stored_bytes: u64,
    /// Stored bytes of the chunks in this image's own packs (what pushing this layer
    /// added; `stored_chunks` of them).
    pub own_stored_bytes: u64,
}

#[derive(Debug, Serialize)]
struct FileOut {
    name: String,
    role: String,
    size: u64,
    mode: String,
    root: String,
    #[serde(flatten)]
    counts: Counts,
}

#[derive(Debug, Serialize)]
struct Out {
    manifest: String,
    kind: String,
    created: String,
    root: String,
    chunk_size: u64,
    hash: String,
    compression: String,
    size: u64,
    files: Vec<FileOut>,
    totals: Counts,
    compression_ratio: f64,
    own_pack_bytes: u64,
    metadata_bytes: u64,
    packs: usize,
    chain: Vec<serde_json::Value>,
    /// A rebased image: the manifest of the layer it would have been a layer over
    /// (provenance only; its chunks are its own records).
    #[serde(skip_serializing_if = "Option::is_none")]
    rebased_from: Option<String>,
    base: Option<serde_json::Value>,
    /// Referrers and subject-named tags (and theirs), as `copy` carries them.
    referrers: Vec<pusher::referrers::Attached>,
    signatures: Vec<SignatureOut>,
}

/// One signature found for the image, as it claims to be and who (of the keys known)
/// signed it.
#[derive(Debug, Serialize)]
struct SignatureOut {
    place: String,
    layer: String,
    /// The payload's docker-reference (as signed: trust it only with `signer`).
    identity: Option<String>,
    manifest_digest: Option<String>,
    /// The payload names this image's manifest.
    matches_image: bool,
    creator: Option<String>,
    timestamp: Option<i64>,
    /// Fingerprint of the key that verifies it, if one of the keys known does.
    signer: Option<String>,
    /// Why it cannot be read (missing payload, not a payload).
    error: Option<String>,
}

/// The image's signatures, each with the known key that verifies it.
fn signatures(store: &dyn imgfmt::ImageStore, image: &Image, keys: &[sign::PublicKey]) -> anyhow::Result<Vec<SignatureOut>> {
    use base64::Engine as _;
    let sigs = sign::check::all_signatures(store, &image.manifest_digest)?;
    let mut out: Vec<SignatureOut> = sigs
        .found
        .iter()
        .map(|f| {
            let mut s = SignatureOut {
                place: f.place.clone(),
                layer: f.layer.digest.to_string(),
                identity: None,
                manifest_digest: None,
                matches_image: false,
                creator: None,
                timestamp: None,
                signer: None,
                error: None,
            };
            match &f.payload {
                Err(e) => s.error = Some(e.clone()),
                Ok(p) => {
                    match sign::Payload::decode(p) {
                        Ok(d) => {
                            s.matches_image = d.manifest_digest == image.manifest_digest.as_str();
                            (s.identity, s.manifest_digest, s.creator, s.timestamp) =
                                (Some(d.docker_reference), Some(d.manifest_digest), d.creator, d.timestamp);
                        }
                        Err(e) => s.error = Some(e.to_string()),
                    }
                    let sig = f
                        .layer
                        .annotations
                        .get(sign::manifest::SIGNATURE_ANNOTATION)
                        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b.trim()).ok());
                    s.signer = sig.and_then(|sig| keys.iter().find(|k| k.verify(p, &sig)).map(sign::PublicKey::fingerprint));
                }
            }
            s
        })
        .collect();
    out.extend(sigs.problems.into_iter().map(|p| SignatureOut {
        place: String::new(),
        layer: String::new(),
        identity: None,
        manifest_digest: None,
        matches_image: false,
        creator: None,
        timestamp: None,
        signer: None,
        error: Some(p),
    }));
    Ok(out)
}

/// The keys to tell signers by: --key files and the keys of the policy rule for `r`.
fn known_keys(a: &InspectArgs, r: &imgfmt::reference::Reference) -> anyhow::Result<Vec<sign::PublicKey>> {
    let mut keys = Vec::new();
    for k in &a.key {
        let text = std::fs::read(k).map_err(|e| anyhow::anyhow!("reading {}: {e}", k.display()))?;
        keys.push(sign::PublicKey::from_pem(&text).map_err(|e| anyhow::anyhow!("{}: {e}", k.display()))?);
    }
    if let (Some(policy), Ok(id)) = (a.policy.load()?, sign::ImageIdentity::of(r)) {
        for req in policy.requirements_for(&id).1 {
            if let sign::Requirement::SigstoreSigned(rule) = req {
                keys.extend(sign::check::load_keys(rule).unwrap_or_default());
            }
        }
    }
    Ok(keys)
}

/// Pack blobs this image wrote itself (as opposed to ones it inherits or references).
fn own_packs(image: &Image) -> impl Iterator<Item = &imgfmt::Descriptor> {
    image.manifest.layers.iter().filter(|d| d.media_type == media::PACK && d.annotations.get(media::ANN_OWNER).is_some_and(|o| o == "self"))
}

pub fn counts(image: &Image) -> (Vec<Counts>, Counts) {
    let own: HashSet<&imgfmt::OciDigest> = own_packs(image).map(|d| &d.digest).collect();
    let mut total = Counts::default();
    let mut per = Vec::new();
    for f in &image.files {
        let mut c = Counts::default();
        for ch in &f.chunks {
            c.chunks += 1;
            match ch.at {
                StoredAt::Zero if ch.depth == 0 => c.zero_chunks += 1,
                StoredAt::Zero => c.inherited_chunks += 1,
                StoredAt::Pack { pack, stored_len, .. } => {
                    c.data_bytes += ch.len as u64;
                    c.chain_stored_bytes += stored_len as u64;
                    if ch.depth > 0 {
                        c.inherited_chunks += 1;
                    } else if own.contains(&image.packs[pack as usize].digest) {
                        c.stored_chunks += 1;
                        c.own_stored_bytes += stored_len as u64;
                    } else {
                        c.referenced_chunks += 1;
                    }
                }
            }
        }
        total.chunks += c.chunks;
        total.zero_chunks += c.zero_chunks;
        total.stored_chunks += c.stored_chunks;
        total.referenced_chunks += c.referenced_chunks;
        total.inherited_chunks += c.inherited_chunks;
        total.data_bytes += c.data_bytes;
        total.chain_stored_bytes += c.chain_stored_bytes;
        total.own_stored_bytes += c.own_stored_bytes;
        per.push(c);
    }
    (per, total)
}

pub fn run(a: InspectArgs) -> anyhow::Result<ExitCode> {
    let r: imgfmt::reference::Reference = a.image.parse()?;
    let o = common::open_parsed(&r, &a.image)?;
    let digest = common::resolve(&o)?;
    if let Some(other) = artifact(&o, &digest)? {
        return print_artifact(&other, a.json);
    }
    let image = open_image_at(&o, &digest)?;
    let signatures = signatures(o.source.as_ref(), &image, &known_keys(&a, &r)?)?;
    let referrers = match pusher::referrers::attached_tree(o.source.as_ref(), &image.manifest_digest) {
        Ok(r) => r,
        Err(e) => {
            // The image is shown all the same; its attachments are a listing apart.
            tracing::warn!("could not list what is attached to {}: {e}", a.image);
            Vec::new()
        }
    };
    let out = describe(&image, signatures, referrers);
    if a.json {
        common::print_json(&out)?;
        return Ok(common::code(common::EXIT_OK));
    }
    print_text(&out, &image.manifest_digest)?;
    Ok(common::code(common::EXIT_OK))
}

/// What `inspect` shows of snapshot `image`, with its signatures and attachments.
fn describe(image: &Image, signatures: Vec<SignatureOut>, referrers: Vec<pusher::referrers::Attached>) -> Out {
    let cfg = image.config();
    let (per, totals) = counts(image);
    let own_pack_bytes: u64 = own_packs(image).map(|d| d.size).sum();
    let metadata_bytes = image.manifest_bytes.len() as u64 + image.manifest.config.size + cfg.index.size;
    let chain: Vec<serde_json::Value> = image
        .chain
        .iter()
        .skip(1)
        .zip(image.chain.iter())
        .map(|(link, child)| {
            let p = child.config.parent.as_ref().expect("has parent");
            serde_json::json!({"manifest": p.manifest, "root": p.root, "reference": p.reference, "created": link.config.created})
        })
        .collect();
    Out {
        manifest: image.manifest_digest.to_string(),
        kind: cfg.kind.to_string(),
        created: cfg.created.clone(),
        root: cfg.root.clone(),
        chunk_size: cfg.chunk_size,
        hash: cfg.hash.to_string(),
        compression: cfg.compression.clone(),
        size: image.files.iter().map(|f| f.size).sum(),
        files: image
            .files
            .iter()
            .zip(per)
            .zip(&cfg.files)
            .map(|((f, counts), cf)| FileOut {
                name: f.name.clone(),
                role: f.role.to_string(),
                size: f.size,
                mode: format!("{:04o}", f.mode),
                root: cf.root.clone(),
                counts,
            })
            .collect(),
        compression_ratio: if totals.chain_stored_bytes == 0 { 1.0 } else { totals.data_bytes as f64 / totals.chain_stored_bytes as f64 },
        totals,
        own_pack_bytes,
        metadata_bytes,
        packs: image.packs.len(),
        chain,
        rebased_from: image.manifest.annotations.get(media::ANN_REBASED_FROM).cloned(),
        base: cfg.base.as_ref().map(|b| serde_json::json!({"manifest": b.manifest, "root": b.root, "reference": b.reference})),
        referrers,
        signatures,
    }
}

/// Print `out` for people: the summary, parents, base and signatures, then the table of
/// files and the attachments (those of attachments indented under `image`'s own).
fn print_text(out: &Out, image: &imgfmt::OciDigest) -> anyhow::Result<()> {
    // Strings from the image's config are escaped (the JSON above is, by serde_json).
    let p = common::printable;
    outln!("image        {}", out.manifest)?;
    outln!("kind         {}", out.kind)?;
    outln!("created      {}", p(&out.created))?;
    outln!("root         {}", p(&out.root))?;
    outln!("chunks       {} of {}, {}, compression {}", out.totals.chunks, human(out.chunk_size), out.hash, p(&out.compression))?;
    outln!("size         {} logical, {} non-zero data", human(out.size), human(out.totals.data_bytes))?;
    outln!(
        "storage      {} in own packs, {} metadata, {} pack(s) referenced, compression ratio {:.2}",
        human(out.own_pack_bytes),
        human(out.metadata_bytes),
        out.packs,
        out.compression_ratio
    )?;
    for (i, c) in out.chain.iter().enumerate() {
        outln!("parent[{}]    {} {}", i + 1, c["manifest"].as_str().unwrap_or(""), p(c["reference"].as_str().unwrap_or("")))?;
    }
    if let Some(r) = &out.rebased_from {
        outln!("rebased from {} (a full index into that chain's packs)", p(r))?;
    }
    if let Some(b) = &out.base {
        outln!("base         {} {}", b["manifest"].as_str().unwrap_or(""), p(b["reference"].as_str().unwrap_or("")))?;
    }
    if out.signatures.is_empty() {
        outln!("signatures   none")?;
    }
    for s in &out.signatures {
        let who = match (&s.signer, &s.error) {
            (_, Some(e)) => format!("unreadable: {}", p(e)),
            (Some(k), None) => format!("signed by key {k}"),
            (None, None) => "by a key not given (--key, or the policy's rule for this image)".into(),
        };
        let claims = s.identity.as_deref().map(|i| format!(" as {}", p(i))).unwrap_or_default();
        let other = if s.identity.is_some() && !s.matches_image {
            format!(" FOR ANOTHER MANIFEST {}", p(s.manifest_digest.as_deref().unwrap_or("")))
        } else {
            String::new()
        };
        outln!("signature    {}: {who}{claims}{other}", if s.place.is_empty() { "storage" } else { &s.place })?;
    }
    print_tables(out, image)
}

/// The per-file chunk table with its total, and the attachments of `image`.
fn print_tables(out: &Out, image: &imgfmt::OciDigest) -> anyhow::Result<()> {
    let p = common::printable;
    outln!()?;
    outln!("{:<24} {:<9} {:>10} {:>7} {:>7} {:>7} {:>7} {:>7}", "FILE", "ROLE", "SIZE", "CHUNKS", "ZERO", "STORED", "REFD", "INHER")?;
    for f in &out.files {
        outln!(
            "{:<24} {:<9} {:>10} {:>7} {:>7} {:>7} {:>7} {:>7}",
            p(&f.name),
            f.role,
            human(f.size),
            f.counts.chunks,
            f.counts.zero_chunks,
            f.counts.stored_chunks,
            f.counts.referenced_chunks,
            f.counts.inherited_chunks
        )?;
    }
    let t = &out.totals;
    outln!(
        "{:<24} {:<9} {:>10} {:>7} {:>7} {:>7} {:>7} {:>7}",
        "total",
        "",
        human(out.size),
        t.chunks,
        t.zero_chunks,
        t.stored_chunks,
        t.referenced_chunks,
        t.inherited_chunks
    )?;
    if !out.referrers.is_empty() {
        outln!()?;
        outln!("{:<48} {:<73} {:>10}  TAG", "REFERRER (ARTIFACT TYPE)", "DIGEST", "SIZE")?;
        for r in &out.referrers {
            let nested = if r.subject == *image { "" } else { "  " };
            outln!(
                "{nested}{:<48} {:<73} {:>10}  {}",
                p(r.artifact_type.as_deref().unwrap_or(&r.media_type)),
                r.digest,
                human(r.size),
                p(r.tag.as_deref().unwrap_or(""))
            )?;
        }
    }
    Ok(())
}

/// A manifest or index that is not a snapctl snapshot, as `inspect` shows it.
#[derive(Debug, Serialize)]
struct ArtifactOut {
    manifest: String,
    /// Always false here: this is not a snapctl snapshot.
    snapshot: bool,
    media_type: String,
    /// The manifest's `artifactType`, else its config's media type (OCI 1.1's reading).
    artifact_type: Option<String>,
    config: Option<DescriptorOut>,
    subject: Option<DescriptorOut>,
    /// Sum of the layers' sizes (an index: of the manifests' sizes).
    size_bytes: u64,
    layers: Vec<DescriptorOut>,
    /// An index's manifests.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    manifests: Vec<DescriptorOut>,
    annotations: std::collections::BTreeMap<String, String>,
}

/// A descriptor in `inspect`'s words.
#[derive(Debug, Serialize)]
struct DescriptorOut {
    media_type: String,
    digest: String,
    size_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    artifact_type: Option<String>,
    /// `org.opencontainers.image.title` (what oras names a file by).
    #[serde(skip_serializing_if = "Option::is_none")]
    title: Option<String>,
}

impl From<&imgfmt::Descriptor> for DescriptorOut {
    fn from(d: &imgfmt::Descriptor) -> Self {
        DescriptorOut {
            media_type: d.media_type.clone(),
            digest: d.digest.to_string(),
            size_bytes: d.size,
            artifact_type: d.artifact_type.clone(),
            title: d.annotations.get("org.opencontainers.image.title").cloned(),
        }
    }
}

/// The manifest `digest` described, when it is not a snapctl snapshot (`None`: it is one,
/// or it claims to be, and the snapshot reader says what is wrong with it).
fn artifact(o: &common::Opened, digest: &imgfmt::OciDigest) -> anyhow::Result<Option<ArtifactOut>> {
    use anyhow::Context;
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Any {
        media_type: Option<String>,
        artifact_type: Option<String>,
        config: Option<imgfmt::Descriptor>,
        #[serde(default)]
        layers: Vec<imgfmt::Descriptor>,
        #[serde(default)]
        manifests: Vec<imgfmt::Descriptor>,
        subject: Option<imgfmt::Descriptor>,
        #[serde(default)]
        annotations: std::collections::BTreeMap<String, String>,
    }
    let bytes = imgfmt::source::read_verified_blob(o.source.as_ref(), digest, imgfmt::manifest::MAX_MANIFEST_BYTES)
        .with_context(|| format!("{}: manifest {digest}", o.reference))?;
    let Ok(m) = serde_json::from_slice::<Any>(&bytes) else { return Ok(None) };
    if m.config.as_ref().is_some_and(|c| c.media_type == media::CONFIG) || (m.config.is_none() && m.manifests.is_empty()) {
        return Ok(None);
    }
    let media_type = m.media_type.unwrap_or_else(|| if m.config.is_some() { media::OCI_MANIFEST } else { media::OCI_INDEX }.to_string());
    let size_bytes = m.layers.iter().chain(&m.manifests).map(|d| d.size).sum();
    Ok(Some(ArtifactOut {
        manifest: digest.to_string(),
        snapshot: false,
        media_type,
        artifact_type: m.artifact_type.or_else(|| m.config.as_ref().map(|c| c.media_type.clone())),
        config: m.config.as_ref().map(DescriptorOut::from),
        subject: m.subject.as_ref().map(DescriptorOut::from),
        size_bytes,
        layers: m.layers.iter().map(DescriptorOut::from).collect(),
        manifests: m.manifests.iter().map(DescriptorOut::from).collect(),
        annotations: m.annotations,
    }))
}

fn print_artifact(a: &ArtifactOut, json: bool) -> anyhow::Result<ExitCode> {
    if json {
        common::print_json(a)?;
        return Ok(common::code(common::EXIT_OK));
    }
    // Every string here is another tool's: escaped.
    let p = common::printable;
    outln!("manifest      {}", a.manifest)?;
    outln!("media type    {}", p(&a.media_type))?;
    outln!("artifact type {}", p(a.artifact_type.as_deref().unwrap_or("-")))?;
    outln!("snapshot      no: an OCI artifact of another kind (snapctl reads no files from it)")?;
    if let Some(s) = &a.subject {
        outln!("subject       {} ({}, {})", s.digest, p(&s.media_type), human(s.size_bytes))?;
    }
    if let Some(c) = &a.config {
        outln!("config        {} ({}, {})", c.digest, p(&c.media_type), human(c.size_bytes))?;
    }
    for (k, v) in &a.annotations {
        outln!("annotation    {}={}", p(k), p(v))?;
    }
    let list = if a.manifests.is_empty() { ("LAYER", &a.layers) } else { ("MANIFEST", &a.manifests) };
    outln!()?;
    outln!("{:<40} {:>10} {:<71} {}", format!("{} MEDIA TYPE", list.0), "SIZE", "DIGEST", "TITLE")?;
    for d in list.1 {
        outln!("{:<40} {:>10} {:<71} {}", p(&d.media_type), human(d.size_bytes), d.digest, p(d.title.as_deref().or(d.artifact_type.as_deref()).unwrap_or("")))?;
    }
    outln!("{:<40} {:>10}", "total", human(a.size_bytes))?;
    Ok(common::code(common::EXIT_OK))
}
