//! Verification: chunk digests, Merkle roots, verified chunk reads and whole-image audits.
//!
//! The rule this crate enforces: no chunk byte leaves it unless it matched its digest.
//! The only way to get chunk bytes is a [`VerifiedChunk`], and the only way to make one
//! is to check stored bytes against the digest the (itself verified) index records. Part
//! of a chunk comes as a [`VerifiedSlice`], made only by checking it against an outboard
//! entry that was itself checked to merge to that digest.

mod audit;
mod chunk;
pub mod hash;
pub mod merkle;
mod slice;

pub use audit::{audit, audit_against, file_holds, AuditOptions, AuditReport, Failure, FailureKind};
pub use chunk::{
    check_stored_chunk, check_zero_record, read_chunk, read_reference, ref_header, reference_of, verify_stored, verify_stored_ref, RefError, VerifiedChunk,
    VerifyError,
};
pub use hash::{chunk_digest, zero_digest};
pub use merkle::{file_root, image_root, resolved_root};
pub use slice::{check_slice, read_slices, VerifiedSlice};
