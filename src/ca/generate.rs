//! Generating a root and an intermediate in Istio's `cacerts` layout
//! (`meshca init`, and the `serve --dev` embedded default).

use std::path::Path;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, RsaKeySize, SerialNumber,
};
use time::OffsetDateTime;

/// Signing key types `meshca init` can generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KeyType {
    #[default]
    EcdsaP256,
    EcdsaP384,
    Rsa2048,
    Rsa3072,
    Rsa4096,
}

impl KeyType {
    pub fn generate(self) -> Result<KeyPair, rcgen::Error> {
        match self {
            Self::EcdsaP256 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256),
            Self::EcdsaP384 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384),
            Self::Rsa2048 => KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, RsaKeySize::_2048),
            Self::Rsa3072 => KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, RsaKeySize::_3072),
            Self::Rsa4096 => KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, RsaKeySize::_4096),
        }
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct InitOptions {
    pub key_type: KeyType,
    pub root_ttl: Duration,
    pub intermediate_ttl: Duration,
    /// Organization of both certificates (istiod uses the trust domain).
    pub organization: String,
}

impl Default for InitOptions {
    fn default() -> Self {
        Self {
            key_type: KeyType::EcdsaP256,
            root_ttl: Duration::from_secs(10 * 365 * 24 * 3600),
            intermediate_ttl: Duration::from_secs(365 * 24 * 3600),
            organization: "cluster.local".into(),
        }
    }
}

/// A freshly generated root and intermediate, as PEM.
#[derive(Debug, Clone)]
pub struct GeneratedCa {
    pub root_cert: String,
    pub root_key: String,
    pub ca_cert: String,
    pub ca_key: String,
}

impl GeneratedCa {
    /// `cert-chain.pem` as Istio's tools write it: intermediate then root.
    pub fn cert_chain(&self) -> String {
        format!("{}{}", self.ca_cert, self.root_cert)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("generating certificates: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("writing {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} already exists; pass --force to overwrite")]
    Exists(String),
}

pub fn ca_params(
    cn: &str,
    org: &str,
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
    path_len: Option<u8>,
) -> Result<CertificateParams, rcgen::Error> {
    let mut p = CertificateParams::default();
    let mut serial = [0u8; 16];
    aws_lc_rs::rand::fill(&mut serial).map_err(|_| rcgen::Error::RingUnspecified)?;
    p.serial_number = Some(SerialNumber::from_slice(&serial));
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name.push(DnType::OrganizationName, org);
    p.distinguished_name.push(DnType::CommonName, cn);
    p.is_ca = IsCa::Ca(match path_len {
        Some(n) => BasicConstraints::Constrained(n),
        None => BasicConstraints::Unconstrained,
    });
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p.not_before = not_before;
    p.not_after = not_after;
    Ok(p)
}

/// Generates a self-signed root and an intermediate signed by it.
pub fn generate(opts: &InitOptions, now: OffsetDateTime) -> Result<GeneratedCa, GenerateError> {
    let root_key = opts.key_type.generate()?;
    let root_end = now + opts.root_ttl;
    let root_params = ca_params("meshca root CA", &opts.organization, now, root_end, None)?;
    let root_cert = root_params.self_signed(&root_key)?;
    let root_issuer = Issuer::new(root_params, root_key);

    let ca_key = opts.key_type.generate()?;
    let ca_end = (now + opts.intermediate_ttl).min(root_end);
    // Path length 1: room for the short-lived issuing CA of two-tier
    // issuing (MESHCA_ISSUING_CA) below this intermediate.
    let mut ca_params = ca_params(
        "meshca intermediate CA",
        &opts.organization,
        now,
        ca_end,
        Some(1),
    )?;
    ca_params.use_authority_key_identifier_extension = true;
    let ca_cert = ca_params.signed_by(&ca_key, &root_issuer)?;
    Ok(GeneratedCa {
        root_cert: root_cert.pem(),
        root_key: root_issuer.key().serialize_pem(),
        ca_cert: ca_cert.pem(),
        ca_key: ca_key.serialize_pem(),
    })
}

/// Writes `ca-cert.pem`, `ca-key.pem`, `cert-chain.pem`, `root-cert.pem` and
/// `root-key.pem` into `dir`. Keys are written owner-read-only.
pub fn write_cacerts(dir: &Path, ca: &GeneratedCa, force: bool) -> Result<(), GenerateError> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| GenerateError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let files = [
        ("ca-cert.pem", ca.ca_cert.clone(), false),
        ("ca-key.pem", ca.ca_key.clone(), true),
        ("cert-chain.pem", ca.cert_chain(), false),
        ("root-cert.pem", ca.root_cert.clone(), false),
        ("root-key.pem", ca.root_key.clone(), true),
    ];
    if !force {
        if let Some((name, _, _)) = files.iter().find(|(n, _, _)| dir.join(n).exists()) {
            return Err(GenerateError::Exists(dir.join(name).display().to_string()));
        }
    }
    for (name, body, secret) in files {
        let path = dir.join(name);
        write_file(&path, body.as_bytes(), secret).map_err(io(&path))?;
    }
    Ok(())
}

/// Writes a file atomically (temp file + rename), mode 0600 for secrets.
/// Writes a workload identity as istio-agent lays it out: `cert-chain.pem`
/// (leaf and intermediates), `key.pem` (owner-only) and `root-cert.pem`.
pub fn write_identity_files(
    dir: &Path,
    chain_pem: &str,
    key_pem: &str,
    root_pem: &str,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    write_file(&dir.join("cert-chain.pem"), chain_pem.as_bytes(), false)?;
    write_file(&dir.join("key.pem"), key_pem.as_bytes(), true)?;
    write_file(&dir.join("root-cert.pem"), root_pem.as_bytes(), false)
}

pub fn write_file(path: &Path, body: &[u8], secret: bool) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    {
        let mut opts = std::fs::OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(if secret { 0o600 } else { 0o644 });
        }
        let mut f = opts.open(&tmp)?;
        f.write_all(body)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::bundle::{BundleFiles, CaBundle};
    use test_case::test_case;

    #[test_case(KeyType::EcdsaP256, "ecdsa-p256")]
    #[test_case(KeyType::EcdsaP384, "ecdsa-p384")]
    #[test_case(KeyType::Rsa2048, "rsa")]
    fn generated_ca_loads_and_verifies(key_type: KeyType, alg: &str) {
        let now = OffsetDateTime::now_utc();
        let ca = generate(
            &InitOptions {
                key_type,
                ..Default::default()
            },
            now,
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        write_cacerts(dir.path(), &ca, false).unwrap();
        let bundle = CaBundle::load_dir(dir.path(), now).unwrap();
        assert_eq!(bundle.key_algorithm(), alg);
        assert!(matches!(
            write_cacerts(dir.path(), &ca, false),
            Err(GenerateError::Exists(_))
        ));
        let files = BundleFiles::read_dir(dir.path()).unwrap();
        assert_eq!(files.root_bundle, ca.root_cert);
    }
}
