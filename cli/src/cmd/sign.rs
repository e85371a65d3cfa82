//! `snapctl sign` and `snapctl key`: cosign-format signatures and key pairs.

use std::io::{IsTerminal as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context as _};
use imgfmt::reference::Reference;
use imgfmt::{Descriptor, OciDigest};

use super::common::{self, outln};

/// Sign an image with a cosign key, as `cosign sign --key` does.
///
/// Writes cosign's simple-signing payload ({"critical":{"identity":{"docker-reference":
/// NAME},"image":{"docker-manifest-digest":DIGEST},"type":"cosign container image
/// signature"},"optional":{...}}), signed with ECDSA P-256, as a layer appended to the
/// signature manifest tagged sha256-<hex>.sig beside the image (other signers' layers are
/// kept), and, where the registry has the OCI 1.1 referrers API, also as a referrer of the
/// image (artifactType application/vnd.dev.cosign.artifact.sig.v1+json). `cosign verify
/// --key cosign.pub`, skopeo and podman under a sigstoreSigned policy, and snapctl's own
/// --policy (pull, unpack, copy, verify, lazy) accept it. Signing again with the same key
/// and name writes nothing new. The digest signed binds the whole snapshot: its config
/// names every parent and base by digest, and every chunk by its hash.
///
/// The key is cosign's encrypted private key (`cosign generate-key-pair` or `snapctl key
/// generate`); its password comes from $COSIGN_PASSWORD, else a prompt on the terminal.
///
/// Keyless signing (Fulcio certificates and the Rekor transparency log) needs the internet
/// and is not supported: sign with a key, and verify with `cosign verify --key
/// cosign.pub --insecure-ignore-tlog`.
///
/// Examples:
///   snapctl sign 127.0.0.1:5000/vm/web:v1 --key cosign.key
///   COSIGN_PASSWORD=... snapctl sign registry.example.com/vm/web@sha256:... --key cosign.key
///   snapctl sign oci:./images:v1 --key cosign.key --identity registry.example.com/vm/web:v1
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct SignArgs {
    /// Image: HOST[:PORT]/REPO[:TAG|@DIGEST] or oci:PATH[:TAG|@DIGEST].
    pub image: String,
    /// cosign's private key file (cosign.key).
    #[arg(long, value_name = "FILE")]
    pub key: PathBuf,
    /// The name the signature certifies (the payload's docker-reference) [default: the
    /// image as named: HOST/REPO:TAG, or HOST/REPO@DIGEST; required for a layout].
    /// Policies match it with signedIdentity (the default, matchRepoDigestOrExact, wants
    /// the tag the image is pulled by).
    #[arg(long, value_name = "NAME")]
    pub identity: Option<String>,
    /// Only the tag scheme: no OCI 1.1 referrer even where the registry has the API.
    #[arg(long)]
    pub no_referrer: bool,
    #[command(flatten)]
    pub registry: super::common::RegistryFlags,
    /// Print what was written as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Manage cosign key pairs.
#[derive(Debug, clap::Args)]
pub struct KeyArgs {
    #[command(subcommand)]
    pub command: KeyCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum KeyCommand {
    Generate(GenerateArgs),
    Fingerprint(FingerprintArgs),
}

/// Write a new key pair as `cosign generate-key-pair` does: PREFIX.key (ECDSA P-256,
/// PKCS#8 encrypted with scrypt and NaCl secretbox under a password from $COSIGN_PASSWORD
/// or a prompt, PEM "ENCRYPTED SIGSTORE PRIVATE KEY", mode 0600) and PREFIX.pub (PEM
/// "PUBLIC KEY"). cosign signs with the first and verifies with the second; so do skopeo
/// and snapctl. Prints the public key's fingerprint.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Write PREFIX.key and PREFIX.pub.
    #[arg(long, default_value = "cosign", value_name = "PREFIX")]
    pub output_key_prefix: String,
    /// Replace existing files.
    #[arg(long)]
    pub force: bool,
}

/// Print the fingerprint of a public or private key file (sha256 of the public key's
/// DER SubjectPublicKeyInfo, as `inspect` and policy messages name signers).
#[derive(Debug, clap::Args)]
pub struct FingerprintArgs {
    /// cosign.pub, or cosign.key (asks its password).
    pub key: PathBuf,
}

/// The password for a private key: $COSIGN_PASSWORD (even empty, as cosign reads it),
/// else asked on the terminal (twice when `confirm`).
fn password(confirm: bool) -> anyhow::Result<zeroize::Zeroizing<String>> {
    if let Some(p) = std::env::var_os("COSIGN_PASSWORD") {
        return Ok(zeroize::Zeroizing::new(p.to_string_lossy().into_owned()));
    }
    let first = prompt("Enter password for private key: ")?;
    if confirm && *prompt("Enter password for private key again: ")? != *first {
        bail!("the passwords do not match");
    }
    Ok(first)
}

/// Read a line from the terminal without echo.
fn prompt(text: &str) -> anyhow::Result<zeroize::Zeroizing<String>> {
    use std::io::BufRead as _;
    use std::os::fd::AsRawFd as _;
    let tty = std::fs::OpenOptions::new().read(true).write(true).open("/dev/tty").context("no terminal to ask the key's password on: set COSIGN_PASSWORD")?;
    let fd = tty.as_raw_fd();
    // SAFETY: termios is plain data; tcgetattr fills it for our own open terminal fd.
    let mut old: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open for the whole block; `old` is a valid termios to fill.
    if unsafe { libc::tcgetattr(fd, &mut old) } != 0 {
        bail!("reading the terminal's settings: {}", std::io::Error::last_os_error());
    }
    let mut quiet = old;
    quiet.c_lflag &= !libc::ECHO;
    quiet.c_lflag |= libc::ECHONL;
    // SAFETY: as above; the settings are restored below whatever happens in between.
    unsafe { libc::tcsetattr(fd, libc::TCSANOW, &quiet) };
    let mut w = &tty;
    let _ = w.write_all(text.as_bytes());
    let mut line = zeroize::Zeroizing::new(String::new());
    let read = std::io::BufReader::new(&tty).read_line(&mut line);
    // SAFETY: restoring the settings read above on the same fd.
    unsafe { libc::tcsetattr(fd, libc::TCSANOW, &old) };
    read.context("reading the password")?;
    while line.ends_with(['\n', '\r']) {
        line.pop();
    }
    Ok(line)
}

/// Read a file of at most `sign::key::MAX_KEY_FILE_BYTES`.
fn read_key_file(path: &Path) -> anyhow::Result<Vec<u8>> {
    use std::io::Read as _;
    let mut b = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(sign::key::MAX_KEY_FILE_BYTES + 1).read_to_end(&mut b))
        .with_context(|| format!("reading {}", path.display()))?;
    Ok(b)
}

/// The private key in `path`, decrypted.
pub fn load_private_key(path: &Path) -> anyhow::Result<sign::PrivateKey> {
    let text = read_key_file(path)?;
    let pw = password(false)?;
    sign::PrivateKey::from_encrypted_pem(&text, pw.as_bytes()).with_context(|| format!("{}", path.display()))
}

/// Sign manifest `digest` of `store` as `identity` with `key`: `snapctl sign`, and the
/// `--sign-key` step of `push` and `copy`. The subject's media type and size are read from
/// the manifest itself (checked against its digest).
pub fn sign_image(
    store: &dyn imgfmt::ImageStore,
    digest: &OciDigest,
    identity: &str,
    key: &sign::PrivateKey,
    referrer: bool,
) -> anyhow::Result<sign::SignReport> {
    let manifest = imgfmt::source::read_verified_blob(store, digest, imgfmt::manifest::MAX_MANIFEST_BYTES).with_context(|| format!("reading {digest}"))?;
    let media_type = serde_json::from_slice::<serde_json::Value>(&manifest)
        .ok()
        .and_then(|v| v.get("mediaType").and_then(|m| m.as_str()).map(String::from))
        .unwrap_or_else(|| imgfmt::media::OCI_MANIFEST.into());
    let subject = Descriptor::new(&media_type, digest.clone(), manifest.len() as u64);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).ok();
    Ok(sign::sign(store, &subject, identity, key, referrer, now)?)
}

/// The line on stderr that says what [`sign_image`] did.
pub fn say_signed(report: &sign::SignReport, digest: &OciDigest, identity: &str) {
    eprintln!(
        "{} {} as {} with key {}: tag {} ({} signature(s)){}",
        if report.already_signed { "already signed" } else { "signed" },
        digest,
        common::printable(identity),
        report.key,
        report.tag,
        report.tag_signatures,
        report.referrer.as_ref().map(|r| format!(", referrer {r}")).unwrap_or_default()
    );
}

pub fn run_sign(a: SignArgs) -> anyhow::Result<ExitCode> {
    let r: Reference = a.image.parse()?;
    let identity = match (&a.identity, &r) {
        (Some(i), _) => {
            sign::DockerRef::parse(i).map_err(|e| anyhow::anyhow!("--identity: {e}"))?;
            i.clone()
        }
        (None, r) => match r.registry() {
            Some((host, repository)) => format!("{host}/{repository}{}", r.selector()),
            None => bail!("{}: a layout has no registry name: give the name to certify with --identity HOST/REPO[:TAG]", a.image),
        },
    };
    let key = load_private_key(&a.key)?;
    let o = super::common::open_parsed(&r, &a.image)?;
    let digest: OciDigest = super::common::resolve(&o)?;
    let report = sign_image(o.source.as_ref(), &digest, &identity, &key, !a.no_referrer).with_context(|| format!("signing {}", a.image))?;
    if a.json {
        common::print_json(&report)?;
    }
    say_signed(&report, &digest, &identity);
    Ok(common::code(common::EXIT_OK))
}

pub fn run_key(a: KeyArgs) -> anyhow::Result<ExitCode> {
    match a.command {
        KeyCommand::Generate(g) => {
            let (kp, pp) = (PathBuf::from(format!("{}.key", g.output_key_prefix)), PathBuf::from(format!("{}.pub", g.output_key_prefix)));
            for p in [&kp, &pp] {
                if p.exists() && !g.force {
                    bail!("{} exists (--force replaces it)", p.display());
                }
            }
            if std::env::var_os("COSIGN_PASSWORD").is_none() && !std::io::stdin().is_terminal() {
                tracing::debug!("stdin is not a terminal: asking on /dev/tty");
            }
            let pw = password(true)?;
            let key = sign::PrivateKey::generate()?;
            let pem = key.to_encrypted_pem(pw.as_bytes())?;
            imgfmt::layout::write_atomic_mode(&kp, pem.as_bytes(), 0o600).with_context(|| format!("writing {}", kp.display()))?;
            imgfmt::layout::write_atomic_mode(&pp, key.public_key().to_pem().as_bytes(), 0o644).with_context(|| format!("writing {}", pp.display()))?;
            eprintln!("Private key written to {}", kp.display());
            eprintln!("Public key written to {}", pp.display());
            outln!("{}", key.public_key().fingerprint())?;
        }
        KeyCommand::Fingerprint(f) => {
            let text = read_key_file(&f.key)?;
            let public = match sign::PublicKey::from_pem(&text) {
                Ok(k) => k,
                Err(sign::KeyError::NoPem(_)) => load_private_key(&f.key)?.public_key(),
                Err(e) => return Err(anyhow::Error::new(e).context(f.key.display().to_string())),
            };
            outln!("{}", public.fingerprint())?;
        }
    }
    Ok(common::code(common::EXIT_OK))
}
