//! Opening the place a reference names: an OCI layout, or a registry repository reached
//! as the [`Transport`] says (plain HTTP or TLS is its decision alone), with credentials
//! from the docker config and the helpers it names when the registry asks.

use std::sync::Arc;

use imgfmt::reference::{Reference, Selector};
use imgfmt::{FormatError, ImageStore, OciLayout};

use crate::{RegistrySource, Transport};

/// The store a reference names, and what it names there.
pub struct Opened {
    pub store: Arc<dyn ImageStore>,
    /// The same client as `store` when the reference names a registry (its leases,
    /// uploads and mounts are the registry's own).
    pub registry: Option<Arc<RegistrySource>>,
    pub selector: Selector,
}

/// Open the layout or connect to the registry repository `reference` names.
pub fn open(reference: &Reference, transport: &Transport) -> Result<Opened, FormatError> {
    Ok(match reference {
        Reference::Layout { path, selector } => Opened { store: Arc::new(OciLayout::open(path)?), registry: None, selector: selector.clone() },
        Reference::Registry { host, repository, selector } => {
            let c = Arc::new(RegistrySource::connect_with_docker_credentials(host, repository, transport)?);
            Opened { store: c.clone(), registry: Some(c), selector: selector.clone() }
        }
    })
}
