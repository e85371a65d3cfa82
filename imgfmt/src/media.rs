//! Media types and annotation keys of snapctl images.

/// `artifactType` of a snapshot image manifest.
pub const ARTIFACT_TYPE: &str = "application/vnd.snapctl.snapshot.v1";
/// The config blob (JSON, [`crate::ImageConfig`]).
pub const CONFIG: &str = "application/vnd.snapctl.snapshot.config.v1+json";
/// The chunk index blob (binary, [`crate::ChunkIndex`]).
pub const INDEX: &str = "application/vnd.snapctl.snapshot.index.v1";
/// A pack blob: stored chunks, concatenated.
pub const PACK: &str = "application/vnd.snapctl.snapshot.pack.v1";
/// An outboard blob: BLAKE3 slice chaining values of raw chunks ([`crate::outboard::Outboard`]).
/// Optional; listed with the owner of the index whose records it covers.
pub const OUTBOARD: &str = "application/vnd.snapctl.snapshot.outboard.v1";
/// OCI image manifest.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// OCI image index.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// Manifest annotation: the image's content root (`algo:hex`).
pub const ANN_ROOT: &str = "dev.snapctl.root";
/// Manifest annotation: the snapshot kind (`firecracker`, `gvisor`, `criu`, `dir`).
pub const ANN_KIND: &str = "dev.snapctl.kind";
/// Layer annotation: which image in the chain a blob belongs to: `self`, `parent`,
/// `parent.parent`, …, `base`, or [`OWNER_REBASED`].
pub const ANN_OWNER: &str = "dev.snapctl.owner";
/// [`ANN_OWNER`] of a pack that a *rebased* image points into: stored by the chain it was
/// rebased from (spec/format.md §10, "Rebasing"), no ancestor of this image.
pub const OWNER_REBASED: &str = "rebased";
/// Manifest annotation of a rebased image: the manifest digest of the layer it would
/// have been a layer over. Provenance only: readers never follow it.
pub const ANN_REBASED_FROM: &str = "dev.snapctl.rebased-from";
/// Standard OCI creation-time annotation.
pub const ANN_CREATED: &str = "org.opencontainers.image.created";
/// Standard OCI tag annotation in `index.json`.
pub const ANN_REF_NAME: &str = "org.opencontainers.image.ref.name";
