//! Where the CA signing key is kept (`MESHCA_SIGNER`) and whether leaves are
//! signed by a short-lived in-memory issuing CA (`MESHCA_ISSUING_CA`).
//! Flags are parsed here once; the signer is opened at startup.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use time::OffsetDateTime;
use x509_parser::prelude::FromDer;

use super::bundle::{BundleFiles, CaBundle, MaterialError};
use super::signer::pkcs11::Pkcs11Signer;
use super::signer::uri::Pkcs11Uri;
use super::signer::{Signer, SignerError, SignerKey};
use crate::config::ConfigError;

/// Two-tier issuing: on, off, or on only with a PKCS#11 signer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum IssuingMode {
    #[default]
    Auto,
    On,
    Off,
}

/// Flags of signing-key custody.
#[derive(Debug, Clone, clap::Args)]
pub struct CustodyArgs {
    /// Where the CA signing key is: `file` (ca-key.pem or tls.key in
    /// ROOT_CA_DIR), or an RFC 7512 URI
    /// `pkcs11:token=...;object=...?module-path=...&pin-source=file:/path`
    /// (the PIN comes from pin-source or MESHCA_PKCS11_PIN, never from a flag).
    #[arg(long, env = "MESHCA_SIGNER", default_value = "file")]
    pub signer: String,
    /// Accept a CA key file that others, or a group this process is not in, can read.
    #[arg(long, env = "MESHCA_SIGNER_ALLOW_SHARED_KEY_FILE", default_value_t = false, action = clap::ArgAction::Set)]
    pub signer_allow_shared_key_file: bool,
    /// PKCS#11 sessions kept open for concurrent signatures.
    #[arg(long, env = "MESHCA_PKCS11_SESSIONS", default_value_t = 4)]
    pub pkcs11_sessions: usize,
    /// Two-tier issuing: the custody key signs a short-lived issuing CA held
    /// only in memory, and that key signs leaves. `auto`: on with a pkcs11 signer.
    #[arg(long, env = "MESHCA_ISSUING_CA", value_enum, default_value_t = IssuingMode::Auto)]
    pub issuing_ca: IssuingMode,
    /// Lifetime of each issuing CA; the next one is made at half-life. Leaves
    /// never outlive the issuing CA that signed them.
    #[arg(long, env = "MESHCA_ISSUING_CA_TTL", default_value = "24h")]
    pub issuing_ca_ttl: String,
}

/// Which key holder.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum SignerSpec {
    #[default]
    File,
    Pkcs11(Pkcs11Uri),
}

/// Parsed [`CustodyArgs`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CustodySettings {
    pub signer: SignerSpec,
    pub allow_shared_key_file: bool,
    pub pkcs11_sessions: usize,
    /// Issuing-CA lifetime when two-tier issuing is on.
    pub issuing_ttl: Option<Duration>,
}

impl Default for CustodySettings {
    fn default() -> Self {
        Self {
            signer: SignerSpec::File,
            allow_shared_key_file: false,
            pkcs11_sessions: 4,
            issuing_ttl: None,
        }
    }
}

/// Shortest issuing-CA lifetime (tests roll over every few seconds).
pub const MIN_ISSUING_TTL: Duration = Duration::from_secs(4);
/// Longest: an issuing CA is meant to die soon.
pub const MAX_ISSUING_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

impl CustodyArgs {
    pub fn parse(&self) -> Result<CustodySettings, ConfigError> {
        let cfg = |name: &'static str, value: &str, reason: String| ConfigError {
            name,
            value: value.to_string(),
            reason,
        };
        let signer = match self.signer.trim() {
            "file" => SignerSpec::File,
            s if s.starts_with("pkcs11:") => {
                SignerSpec::Pkcs11(s.parse().map_err(|e: SignerError| {
                    cfg(
                        "MESHCA_SIGNER",
                        &super::signer::uri::redact(s),
                        e.to_string(),
                    )
                })?)
            }
            s => {
                return Err(cfg(
                    "MESHCA_SIGNER",
                    s,
                    "expected `file` or a pkcs11: URI".into(),
                ))
            }
        };
        if !(1..=256).contains(&self.pkcs11_sessions) {
            return Err(cfg(
                "MESHCA_PKCS11_SESSIONS",
                &self.pkcs11_sessions.to_string(),
                "must be 1..=256".into(),
            ));
        }
        let on = match self.issuing_ca {
            IssuingMode::On => true,
            IssuingMode::Off => false,
            IssuingMode::Auto => matches!(signer, SignerSpec::Pkcs11(_)),
        };
        let ttl = super::ttl::parse_go_duration(&self.issuing_ca_ttl)
            .map_err(|e| cfg("MESHCA_ISSUING_CA_TTL", &self.issuing_ca_ttl, e.to_string()))?;
        if !(MIN_ISSUING_TTL..=MAX_ISSUING_TTL).contains(&ttl) {
            return Err(cfg(
                "MESHCA_ISSUING_CA_TTL",
                &self.issuing_ca_ttl,
                format!("must be between {MIN_ISSUING_TTL:?} and 720h"),
            ));
        }
        Ok(CustodySettings {
            signer,
            allow_shared_key_file: self.signer_allow_shared_key_file,
            pkcs11_sessions: self.pkcs11_sessions,
            issuing_ttl: on.then_some(ttl),
        })
    }
}

/// How the CA directory's signing key is held.
#[derive(Debug, Clone)]
pub enum KeySource {
    /// `ca-key.pem` / `tls.key` in the directory, owner-only unless allowed.
    File { allow_shared: bool },
    /// Outside the directory (a PKCS#11 token); the directory must hold no key.
    External(Arc<dyn Signer>),
}

impl Default for KeySource {
    fn default() -> Self {
        Self::File {
            allow_shared: false,
        }
    }
}

impl KeySource {
    /// Opens the configured key holder (connects to the token, logs in,
    /// finds the key); every failure names what is wrong.
    pub fn open(settings: &CustodySettings) -> Result<Self, SignerError> {
        match &settings.signer {
            SignerSpec::File => Ok(Self::File {
                allow_shared: settings.allow_shared_key_file,
            }),
            SignerSpec::Pkcs11(uri) => Ok(Self::External(Arc::new(Pkcs11Signer::open(
                uri,
                settings.pkcs11_sessions,
            )?))),
        }
    }

    pub fn signer(&self) -> Option<Arc<dyn Signer>> {
        match self {
            Self::File { .. } => None,
            Self::External(s) => Some(s.clone()),
        }
    }

    /// Reads the directory as this key source needs it.
    pub fn read(&self, dir: &Path) -> Result<BundleFiles, MaterialError> {
        let base = std::fs::canonicalize(dir.join("..data")).unwrap_or_else(|_| dir.to_path_buf());
        let key_file = if base.join("tls.crt").exists() {
            "tls.key"
        } else {
            "ca-key.pem"
        };
        match self {
            Self::File { allow_shared } => {
                let key = base.join(key_file);
                if key.exists() {
                    super::signer::file::check_mode(&key, *allow_shared)?;
                }
                BundleFiles::read_dir(dir)
            }
            Self::External(s) => {
                if base.join(key_file).exists() {
                    return Err(SignerError::KeyFile(format!(
                        "{} is in the CA directory while the key is held by {}; remove the key file",
                        base.join(key_file).display(),
                        s.kind()
                    ))
                    .into());
                }
                BundleFiles::read_dir_without_key(dir)
            }
        }
    }

    pub fn load(&self, dir: &Path, now: OffsetDateTime) -> Result<CaBundle, MaterialError> {
        CaBundle::from_files_with(self.read(dir)?, self.signer(), now)
    }
}

/// `meshca init --pkcs11`: generates the intermediate key in the token
/// (never extractable), then either writes a CSR for an offline root, or
/// signs the intermediate with the root in `root_from` and writes the
/// `cacerts` layout without a key file.
pub fn init_pkcs11(
    uri: &Pkcs11Uri,
    opts: &super::generate::InitOptions,
    out: &Path,
    root_from: Option<&Path>,
    force: bool,
    now: OffsetDateTime,
) -> anyhow::Result<()> {
    use super::generate::{ca_params, write_file};
    use anyhow::Context;
    let targets: &[&str] = match root_from {
        Some(_) => &["ca-cert.pem", "cert-chain.pem", "root-cert.pem"],
        None => &["ca-csr.pem"],
    };
    if !force {
        if let Some(t) = targets.iter().find(|t| out.join(t).exists()) {
            anyhow::bail!(
                "{} already exists; pass --force to overwrite",
                out.join(t).display()
            );
        }
    }
    // Read the root first: a bad root directory must not leave a stray key in the token.
    let root = match root_from {
        Some(dir) => {
            let read = |f: &str| {
                std::fs::read_to_string(dir.join(f))
                    .with_context(|| format!("reading {}", dir.join(f).display()))
            };
            Some((
                read("root-cert.pem")?,
                zeroize::Zeroizing::new(read("root-key.pem")?),
            ))
        }
        None => None,
    };
    super::signer::pkcs11::generate_key(uri, opts.key_type)
        .context("generating the key in the token")?;
    let signer = SignerKey(Arc::new(
        Pkcs11Signer::open(uri, 1).context("opening the generated key")?,
    ));
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    match root {
        None => {
            let mut params = ca_params(
                "meshca intermediate CA",
                &opts.organization,
                now,
                now,
                Some(1),
            )?;
            // The root chooses the serial; a CSR cannot carry one.
            params.serial_number = None;
            let csr = params.serialize_request(&signer)?;
            write_file(&out.join("ca-csr.pem"), csr.pem()?.as_bytes(), false)?;
            println!(
                "generated the intermediate key in {} and wrote {}",
                uri.key_description(),
                out.join("ca-csr.pem").display()
            );
            println!("have your offline root sign it as a CA (basicConstraints CA:true, pathlen >= 1; keyUsage keyCertSign, cRLSign), then place ca-cert.pem, cert-chain.pem (intermediate then root) and root-cert.pem in the CA directory");
        }
        Some((root_pem, root_key_pem)) => {
            let root_key = rcgen::KeyPair::from_pem(&root_key_pem).context("root-key.pem")?;
            let issuer =
                rcgen::Issuer::from_ca_cert_pem(&root_pem, root_key).context("root-cert.pem")?;
            let root_der: rustls_pki_types::CertificateDer<'static> =
                rustls_pki_types::pem::PemObject::from_pem_slice(root_pem.as_bytes())
                    .context("root-cert.pem")?;
            let (_, parsed) = x509_parser::prelude::X509Certificate::from_der(&root_der)
                .map_err(|e| anyhow::anyhow!("root-cert.pem: {e}"))?;
            let end = (now + opts.intermediate_ttl).min(parsed.validity().not_after.to_datetime());
            let mut params = ca_params(
                "meshca intermediate CA",
                &opts.organization,
                now,
                end,
                Some(1),
            )?;
            params.use_authority_key_identifier_extension = true;
            let cert = params.signed_by(&signer, &issuer)?;
            write_file(&out.join("ca-cert.pem"), cert.pem().as_bytes(), false)?;
            write_file(
                &out.join("cert-chain.pem"),
                format!("{}{root_pem}", cert.pem()).as_bytes(),
                false,
            )?;
            write_file(&out.join("root-cert.pem"), root_pem.as_bytes(), false)?;
            println!("generated the intermediate key in {} and wrote ca-cert.pem, cert-chain.pem and root-cert.pem to {} (no key file: run with --signer '{uri}')", uri.key_description(), out.display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    fn args(signer: &str, mode: IssuingMode, ttl: &str) -> CustodyArgs {
        CustodyArgs {
            signer: signer.into(),
            signer_allow_shared_key_file: false,
            pkcs11_sessions: 4,
            issuing_ca: mode,
            issuing_ca_ttl: ttl.into(),
        }
    }

    const URI: &str = "pkcs11:token=t;object=k?module-path=/m.so";

    #[test_case("file", IssuingMode::Auto, None ; "file auto is off")]
    #[test_case("file", IssuingMode::On, Some(86400) ; "file on")]
    #[test_case(URI, IssuingMode::Auto, Some(86400) ; "pkcs11 auto is on")]
    #[test_case(URI, IssuingMode::Off, None ; "pkcs11 off")]
    fn two_tier_defaults(signer: &str, mode: IssuingMode, want: Option<u64>) {
        let s = args(signer, mode, "24h").parse().unwrap();
        assert_eq!(s.issuing_ttl.map(|d| d.as_secs()), want);
    }

    #[test_case("kms:foo", "24h", "MESHCA_SIGNER")]
    #[test_case("pkcs11:object=k", "24h", "MESHCA_SIGNER")]
    #[test_case("file", "1s", "MESHCA_ISSUING_CA_TTL")]
    #[test_case("file", "1000h", "MESHCA_ISSUING_CA_TTL")]
    fn bad_settings_name_the_variable(signer: &str, ttl: &str, name: &str) {
        let e = args(signer, IssuingMode::On, ttl).parse().unwrap_err();
        assert_eq!(e.name, name);
    }

    #[test]
    fn an_external_key_refuses_a_key_file_in_the_directory() {
        let now = OffsetDateTime::now_utc();
        let ca = crate::ca::generate::generate(&Default::default(), now).unwrap();
        let dir = tempfile::tempdir().unwrap();
        crate::ca::generate::write_cacerts(dir.path(), &ca, false).unwrap();
        let signer: Arc<dyn Signer> = Arc::new(
            crate::ca::signer::file::from_pem(
                &ca.ca_key,
                crate::ca::signer::KeyAlgorithm::EcdsaP256,
                "test",
            )
            .unwrap(),
        );
        let src = KeySource::External(signer);
        let err = src.load(dir.path(), now).unwrap_err();
        assert_eq!(err.reason(), "signer_key_file");
        std::fs::remove_file(dir.path().join("ca-key.pem")).unwrap();
        let b = src.load(dir.path(), now).unwrap();
        assert_eq!(b.signer().kind(), "file");
    }
}
