//! cosign's key files: what `cosign generate-key-pair` writes and `cosign sign --key`
//! reads, so one key pair serves cosign, skopeo and snapctl.
//!
//! ```text
//! cosign.pub   PEM "PUBLIC KEY": DER SubjectPublicKeyInfo (RFC 5480), here only
//!              id-ecPublicKey / prime256v1 with an uncompressed point (91 bytes of DER)
//! cosign.key   PEM "ENCRYPTED SIGSTORE PRIVATE KEY" ("ENCRYPTED COSIGN PRIVATE KEY" from
//!              cosign before 2.0; both read, the first written), whose body is JSON:
//!              {"kdf":{"name":"scrypt","params":{"N":65536,"r":8,"p":1},"salt":B64},
//!               "cipher":{"name":"nacl/secretbox","nonce":B64},
//!               "ciphertext":B64}
//!              key        = scrypt(password, salt, N, r, p, 32 bytes)
//!              ciphertext = secretbox(PKCS#8 DER of the EC private key, nonce, key)
//!                           (XSalsa20-Poly1305, 16-byte tag first, as NaCl writes it)
//! ```
//!
//! B64 is standard base64 with padding (Go's encoding of `[]byte` in JSON). Only the
//! three scrypt parameter sets go-securesystemslib writes are accepted (N = 2^15, 2^16,
//! 2^17; r = 8; p = 1), as it does itself: a key file that asked for more would make
//! reading it allocate and compute without bound (N = 2^17 already takes 128 MiB).
//! Signatures are ECDSA P-256 over SHA-256, ASN.1 DER encoded, as cosign makes them.

use base64::Engine as _;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair as _, UnparsedPublicKey, ECDSA_P256_SHA256_ASN1, ECDSA_P256_SHA256_ASN1_SIGNING};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use zeroize::Zeroizing;

/// PEM label of a public key file.
pub const PUBLIC_KEY_PEM: &str = "PUBLIC KEY";
/// PEM label cosign 2.x writes for its private key.
pub const SIGSTORE_PRIVATE_KEY_PEM: &str = "ENCRYPTED SIGSTORE PRIVATE KEY";
/// PEM label of cosign 1.x's private key (read, never written).
pub const COSIGN_PRIVATE_KEY_PEM: &str = "ENCRYPTED COSIGN PRIVATE KEY";
/// Largest key file read: a P-256 key file is under 1 KiB; this bounds what a wrong path
/// (a disk image named by mistake) makes us read.
pub const MAX_KEY_FILE_BYTES: u64 = 64 << 10;

/// DER prefix of a P-256 SubjectPublicKeyInfo: SEQUENCE { SEQUENCE { id-ecPublicKey,
/// prime256v1 }, BIT STRING (0 unused bits) }, followed by the 65-byte uncompressed point.
const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];
/// id-ecPublicKey (1.2.840.10045.2.1), as DER, to tell "another curve" from "not EC".
const EC_PUBLIC_KEY_OID: [u8; 9] = [0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];

const SALT_BYTES: usize = 32;
const NONCE_BYTES: usize = 24;
/// scrypt's N=2^16, r=8, p=1: what cosign 2.x writes (go-securesystemslib's "standard").
const WRITE_LOG_N: u8 = 16;

#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum KeyError {
    /// not a PEM file: no "-----BEGIN {0}-----" block
    NoPem(String),
    /// PEM block {label:?} is not base64: {message}
    PemBase64 { label: String, message: String },
    /// key file of {got} bytes is larger than {limit}: not a key
    TooLarge { got: u64, limit: u64 },
    /// unsupported public key: {0} (snapctl verifies ECDSA P-256 keys, what cosign generates)
    Unsupported(String),
    /// not a cosign private key: {0}
    BadPrivateKey(String),
    /// wrong password for this key (or the key file was changed: the secretbox does not open)
    WrongPassword,
    /// generating a key: {0}
    Generate(String),
}

/// A P-256 public key: verifies signatures, names a signer by fingerprint.
#[derive(Clone, PartialEq, Eq)]
pub struct PublicKey {
    /// SEC1 uncompressed point: 0x04 || x || y.
    point: [u8; 65],
}

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PublicKey({})", self.fingerprint())
    }
}

impl PublicKey {
    /// From a `PUBLIC KEY` PEM file's text (cosign.pub, or a policy's `keyData`).
    pub fn from_pem(text: &[u8]) -> Result<Self, KeyError> {
        if text.len() as u64 > MAX_KEY_FILE_BYTES {
            return Err(KeyError::TooLarge { got: text.len() as u64, limit: MAX_KEY_FILE_BYTES });
        }
        let der = pem_decode(text, &[PUBLIC_KEY_PEM])?.1;
        Self::from_spki_der(&der)
    }

    /// From DER SubjectPublicKeyInfo.
    pub fn from_spki_der(der: &[u8]) -> Result<Self, KeyError> {
        if der.len() == P256_SPKI_PREFIX.len() + 65 && der.starts_with(&P256_SPKI_PREFIX) && der[26] == 0x04 {
            let mut point = [0u8; 65];
            point.copy_from_slice(&der[26..]);
            // A point off the curve is not refused here (ring has no parse-only call):
            // ring checks it on every verification, so such a key verifies nothing.
            return Ok(PublicKey { point });
        }
        let what = if der.windows(EC_PUBLIC_KEY_OID.len()).any(|w| w == EC_PUBLIC_KEY_OID) {
            "an EC key on another curve, or a compressed point"
        } else {
            "not an EC key (RSA, Ed25519 or not a SubjectPublicKeyInfo)"
        };
        Err(KeyError::Unsupported(what.into()))
    }

    /// DER SubjectPublicKeyInfo (91 bytes).
    pub fn to_spki_der(&self) -> Vec<u8> {
        let mut v = P256_SPKI_PREFIX.to_vec();
        v.extend_from_slice(&self.point);
        v
    }

    /// The PEM text of cosign.pub.
    pub fn to_pem(&self) -> String {
        pem_encode(PUBLIC_KEY_PEM, &self.to_spki_der())
    }

    /// Who signed: `sha256:` and the hex SHA-256 of the DER SubjectPublicKeyInfo (what
    /// `openssl pkey -pubin -outform DER | sha256sum` prints for cosign.pub).
    pub fn fingerprint(&self) -> String {
        format!("sha256:{}", hex::encode(Sha256::digest(self.to_spki_der())))
    }

    /// Whether `signature` (ASN.1 DER ECDSA) signs `message` under this key.
    pub fn verify(&self, message: &[u8], signature: &[u8]) -> bool {
        UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, &self.point[..]).verify(message, signature).is_ok()
    }
}

/// The encrypted private key file's JSON body.
#[derive(Debug, Serialize, Deserialize)]
struct Encrypted {
    kdf: Kdf,
    cipher: Cipher,
    ciphertext: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Kdf {
    name: String,
    params: KdfParams,
    salt: String,
}

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq, Clone, Copy)]
struct KdfParams {
    #[serde(rename = "N")]
    n: u64,
    r: u32,
    p: u32,
}

#[derive(Debug, Serialize, Deserialize)]
struct Cipher {
    name: String,
    nonce: String,
}

/// A P-256 private key that signs.
pub struct PrivateKey {
    pair: EcdsaKeyPair,
    /// PKCS#8 DER, kept to write the key file; wiped on drop.
    pkcs8: Zeroizing<Vec<u8>>,
}

impl std::fmt::Debug for PrivateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PrivateKey({})", self.public_key().fingerprint())
    }
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

/// scrypt's key for `params`, refusing every set go-securesystemslib does not write.
fn derive(password: &[u8], salt: &[u8], params: KdfParams) -> Result<Zeroizing<[u8; 32]>, KeyError> {
    let log_n = match (params.n, params.r, params.p) {
        (32768, 8, 1) => 15,
        (65536, 8, 1) => 16,
        (131072, 8, 1) => 17,
        _ => return Err(KeyError::BadPrivateKey(format!("unsupported scrypt parameters N={} r={} p={}", params.n, params.r, params.p))),
    };
    let p = scrypt::Params::new(log_n, params.r, params.p, 32).map_err(|e| KeyError::BadPrivateKey(format!("scrypt parameters: {e}")))?;
    let mut key = Zeroizing::new([0u8; 32]);
    scrypt::scrypt(password, salt, &p, &mut key[..]).map_err(|e| KeyError::BadPrivateKey(format!("scrypt: {e}")))?;
    Ok(key)
}

impl PrivateKey {
    /// A new random key.
    pub fn generate() -> Result<Self, KeyError> {
        let rng = SystemRandom::new();
        let doc = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng).map_err(|e| KeyError::Generate(e.to_string()))?;
        Self::from_pkcs8(doc.as_ref())
    }

    /// From PKCS#8 DER (what cosign encrypts: Go's `x509.MarshalPKCS8PrivateKey`).
    pub fn from_pkcs8(der: &[u8]) -> Result<Self, KeyError> {
        let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, der, &SystemRandom::new())
            .map_err(|e| KeyError::BadPrivateKey(format!("not an ECDSA P-256 PKCS#8 key ({e})")))?;
        Ok(PrivateKey { pair, pkcs8: Zeroizing::new(der.to_vec()) })
    }

    /// From the text of cosign.key and its password.
    pub fn from_encrypted_pem(text: &[u8], password: &[u8]) -> Result<Self, KeyError> {
        if text.len() as u64 > MAX_KEY_FILE_BYTES {
            return Err(KeyError::TooLarge { got: text.len() as u64, limit: MAX_KEY_FILE_BYTES });
        }
        let (_, body) = pem_decode(text, &[SIGSTORE_PRIVATE_KEY_PEM, COSIGN_PRIVATE_KEY_PEM])?;
        let enc: Encrypted = serde_json::from_slice(&body).map_err(|e| KeyError::BadPrivateKey(format!("the PEM body is not cosign's JSON: {e}")))?;
        if enc.kdf.name != "scrypt" {
            return Err(KeyError::BadPrivateKey(format!("unknown kdf {:?}", enc.kdf.name)));
        }
        if enc.cipher.name != "nacl/secretbox" {
            return Err(KeyError::BadPrivateKey(format!("unknown cipher {:?}", enc.cipher.name)));
        }
        let bad = |what: &str| KeyError::BadPrivateKey(format!("{what} is not base64"));
        let salt = b64().decode(&enc.kdf.salt).map_err(|_| bad("salt"))?;
        let nonce = b64().decode(&enc.cipher.nonce).map_err(|_| bad("nonce"))?;
        let ct = b64().decode(&enc.ciphertext).map_err(|_| bad("ciphertext"))?;
        if nonce.len() != NONCE_BYTES {
            return Err(KeyError::BadPrivateKey(format!("nonce of {} bytes (24 expected)", nonce.len())));
        }
        let key = derive(password, &salt, enc.kdf.params)?;
        use crypto_secretbox::aead::{Aead, KeyInit};
        let cipher = crypto_secretbox::XSalsa20Poly1305::new(crypto_secretbox::Key::from_slice(&key[..]));
        let plain = Zeroizing::new(cipher.decrypt(crypto_secretbox::Nonce::from_slice(&nonce), ct.as_slice()).map_err(|_| KeyError::WrongPassword)?);
        Self::from_pkcs8(&plain)
    }

    /// The text of cosign.key: the PKCS#8 key encrypted under `password` with a fresh salt
    /// and nonce (scrypt N=2^16, r=8, p=1, as cosign 2.x writes).
    pub fn to_encrypted_pem(&self, password: &[u8]) -> Result<String, KeyError> {
        let rng = SystemRandom::new();
        use ring::rand::SecureRandom as _;
        let (mut salt, mut nonce) = ([0u8; SALT_BYTES], [0u8; NONCE_BYTES]);
        rng.fill(&mut salt).and_then(|()| rng.fill(&mut nonce)).map_err(|e| KeyError::Generate(e.to_string()))?;
        let params = KdfParams { n: 1 << WRITE_LOG_N, r: 8, p: 1 };
        let key = derive(password, &salt, params)?;
        use crypto_secretbox::aead::{Aead, KeyInit};
        let cipher = crypto_secretbox::XSalsa20Poly1305::new(crypto_secretbox::Key::from_slice(&key[..]));
        let ct = cipher.encrypt(crypto_secretbox::Nonce::from_slice(&nonce), self.pkcs8.as_slice()).map_err(|e| KeyError::Generate(e.to_string()))?;
        let enc = Encrypted {
            kdf: Kdf { name: "scrypt".into(), params, salt: b64().encode(salt) },
            cipher: Cipher { name: "nacl/secretbox".into(), nonce: b64().encode(nonce) },
            ciphertext: b64().encode(ct),
        };
        Ok(pem_encode(SIGSTORE_PRIVATE_KEY_PEM, &serde_json::to_vec(&enc).expect("serializes")))
    }

    pub fn public_key(&self) -> PublicKey {
        let mut point = [0u8; 65];
        point.copy_from_slice(self.pair.public_key().as_ref());
        PublicKey { point }
    }

    /// ECDSA P-256 / SHA-256 signature of `message`, ASN.1 DER.
    pub fn sign(&self, message: &[u8]) -> Result<Vec<u8>, KeyError> {
        self.pair.sign(&SystemRandom::new(), message).map(|s| s.as_ref().to_vec()).map_err(|e| KeyError::Generate(format!("signing: {e}")))
    }
}

/// PEM text: `-----BEGIN label-----`, base64 in lines of 64, `-----END label-----`.
pub fn pem_encode(label: &str, der: &[u8]) -> String {
    let body = b64().encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in body.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// The first PEM block whose label is one of `labels`: (label, decoded body). Text before
/// and after the block is ignored, as Go's `pem.Decode` does; header lines (`Key: value`)
/// inside it are skipped.
pub fn pem_decode(text: &[u8], labels: &[&str]) -> Result<(String, Vec<u8>), KeyError> {
    let text = String::from_utf8_lossy(text);
    for label in labels {
        let begin = format!("-----BEGIN {label}-----");
        let end = format!("-----END {label}-----");
        let Some(start) = text.find(&begin) else { continue };
        let rest = &text[start + begin.len()..];
        let Some(stop) = rest.find(&end) else {
            return Err(KeyError::PemBase64 { label: label.to_string(), message: "no END line".into() });
        };
        let body: String = rest[..stop].lines().filter(|l| !l.contains(':')).flat_map(|l| l.chars().filter(|c| !c.is_whitespace())).collect();
        let der = b64().decode(body.as_bytes()).map_err(|e| KeyError::PemBase64 { label: label.to_string(), message: e.to_string() })?;
        return Ok((label.to_string(), der));
    }
    Err(KeyError::NoPem(labels.join("\" or \"")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_key_round_trips_through_its_files_and_signs() {
        let k = PrivateKey::generate().unwrap();
        let pem = k.to_encrypted_pem(b"pw").unwrap();
        assert!(pem.starts_with("-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\n"));
        let back = PrivateKey::from_encrypted_pem(pem.as_bytes(), b"pw").unwrap();
        assert_eq!(back.public_key(), k.public_key());
        assert!(matches!(PrivateKey::from_encrypted_pem(pem.as_bytes(), b"wrong"), Err(KeyError::WrongPassword)));
        let pubkey = PublicKey::from_pem(k.public_key().to_pem().as_bytes()).unwrap();
        let sig = back.sign(b"payload").unwrap();
        assert!(pubkey.verify(b"payload", &sig));
        assert!(!pubkey.verify(b"payloaD", &sig));
        let other = PrivateKey::generate().unwrap().public_key();
        assert!(!other.verify(b"payload", &sig));
        assert_eq!(pubkey.fingerprint().len(), 7 + 64);
    }

    #[test]
    fn scrypt_parameters_outside_cosigns_three_are_refused() {
        let k = PrivateKey::generate().unwrap();
        let pem = k.to_encrypted_pem(b"").unwrap();
        let (_, body) = pem_decode(pem.as_bytes(), &[SIGSTORE_PRIVATE_KEY_PEM]).unwrap();
        let text = String::from_utf8(body).unwrap().replace("\"N\":65536", "\"N\":1073741824");
        let bad = pem_encode(SIGSTORE_PRIVATE_KEY_PEM, text.as_bytes());
        let e = PrivateKey::from_encrypted_pem(bad.as_bytes(), b"").unwrap_err();
        assert!(e.to_string().contains("unsupported scrypt parameters"), "{e}");
        // The old label reads too.
        let old = pem.replace("SIGSTORE", "COSIGN");
        PrivateKey::from_encrypted_pem(old.as_bytes(), b"").unwrap();
    }

    #[test]
    fn other_key_types_are_named() {
        // An RSA SubjectPublicKeyInfo header (truncated): not EC.
        let rsa = pem_encode(PUBLIC_KEY_PEM, &[0x30, 0x0d, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01]);
        assert!(PublicKey::from_pem(rsa.as_bytes()).unwrap_err().to_string().contains("not an EC key"));
        assert!(matches!(PublicKey::from_pem(b"hello"), Err(KeyError::NoPem(_))));
    }
}
