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
use super::signer::uri::{KeyName, Pkcs11Uri};
use super::signer::{Signer, SignerError, SignerKey};
use crate::flags::ConfigError;

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
    ///
    /// A PKCS#11 URI may name `token`, `object` and `id`; the CA directory must then hold no key
    /// file. `pin-value` is refused. A wrong module, token, PIN or key stops startup naming which.
    /// A CA directory's `ca-key.uri` (`pkcs11:object=..`, written by `meshca init --pkcs11`) names
    /// its own key in the same token; a generation staged for rotation must have one. See
    /// docs/KEY-CUSTODY.md.
    #[arg(long, env = "MESHCA_SIGNER", default_value = "file")]
    pub signer: String,
    /// Accept a CA key file that others, or a group this process is not in, can read.
    ///
    /// Refused otherwise: `signer_key_file_mode`.
    #[arg(long, env = "MESHCA_SIGNER_ALLOW_SHARED_KEY_FILE", default_value_t = false, action = clap::ArgAction::Set)]
    pub signer_allow_shared_key_file: bool,
    /// PKCS#11 sessions kept open for concurrent signatures.
    ///
    /// A lost session or module is reconnected and the signature retried once.
    #[arg(long, env = "MESHCA_PKCS11_SESSIONS", default_value_t = 4)]
    pub pkcs11_sessions: usize,
    /// Two-tier issuing: the custody key signs a short-lived issuing CA held
    /// only in memory, and that key signs leaves. `auto`: on with a pkcs11 signer.
    ///
    /// The issuing CA also signs the serving certificate. `auto` is off with a file signer.
    #[arg(long, env = "MESHCA_ISSUING_CA", value_enum, default_value_t = IssuingMode::Auto)]
    pub issuing_ca: IssuingMode,
    /// Lifetime of each issuing CA; the next one is made at half-life. Leaves
    /// never outlive the issuing CA that signed them.
    ///
    /// 4s to 720h. Each new issuing CA is audited (`issuing_ca_issued`) before use.
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

/// The file in a CA generation directory naming its key in the token
/// (`pkcs11:object=<label>` or `pkcs11:id=<hex>`; no module or PIN).
pub const KEY_URI_FILE: &str = "ca-key.uri";

/// Which directory is read: the CA directory, or a generation staged for
/// rotation (which must name its own key in a token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirRole {
    Current,
    Staged,
}

/// Which key signs a directory's certificates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyChoice {
    /// The directory's key file.
    File,
    /// The token key `MESHCA_SIGNER` names.
    Configured,
    /// The token key the directory's `ca-key.uri` names.
    Named(KeyName),
}

/// Decides which key signs a directory, from what the directory holds.
/// `key_file` and `key_uri_file` are the paths of what is present (for
/// messages); `key_uri` is the `ca-key.uri` text. Errors name the fix.
pub fn choose_key(
    external: Option<&str>,
    key_file: Option<&Path>,
    key_uri: Option<(&Path, &str)>,
    role: DirRole,
    dir: &Path,
) -> Result<KeyChoice, SignerError> {
    match (external, key_file, key_uri) {
        (None, _, Some((uri_file, _))) => Err(SignerError::KeyUriWithoutToken(
            uri_file.display().to_string(),
        )),
        (None, _, None) => Ok(KeyChoice::File),
        (Some(kind), Some(file), _) => Err(SignerError::KeyFile(format!(
            "{} is in the CA directory while the key is held by {kind}; remove the key file",
            file.display()
        ))),
        (Some(_), None, Some((_, text))) => Ok(KeyChoice::Named(text.parse()?)),
        (Some(_), None, None) => match role {
            DirRole::Current => Ok(KeyChoice::Configured),
            // The configured key signs the current generation; a new
            // generation under the same key is not a rotation meshca can
            // tell apart from the current one.
            DirRole::Staged => Err(SignerError::NextKeyUnnamed(dir.display().to_string())),
        },
    }
}

/// A directory's files and the key that signs with them (`None`: the key
/// text in the files).
pub struct DirMaterial {
    pub files: BundleFiles,
    pub signer: Option<Arc<dyn Signer>>,
}

/// How many token keys stay open (current, staged, and a few just rotated out).
const OPEN_KEYS: usize = 4;

type KeyOpener = dyn Fn(&KeyName) -> Result<Arc<dyn Signer>, SignerError> + Send + Sync;

/// Keys held outside the CA directories (a PKCS#11 token), opened by name
/// on first use and kept open: a rotation signs with two keys of one token.
pub struct ExternalKeys {
    kind: &'static str,
    configured: KeyName,
    open: Box<KeyOpener>,
    /// Most recently used first.
    cache: std::sync::Mutex<Vec<(KeyName, Arc<dyn Signer>)>>,
}

impl std::fmt::Debug for ExternalKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalKeys")
            .field("kind", &self.kind)
            .field("configured", &self.configured.to_string())
            .finish_non_exhaustive()
    }
}

impl ExternalKeys {
    /// Keys of one holder: `open` finds a key by name (logging in as needed).
    pub fn new(
        kind: &'static str,
        configured: KeyName,
        open: impl Fn(&KeyName) -> Result<Arc<dyn Signer>, SignerError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            kind,
            configured,
            open: Box::new(open),
            cache: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// The token `uri` names (module, token, PIN); its key is the configured one.
    pub fn pkcs11(uri: Pkcs11Uri, sessions: usize) -> Self {
        let configured = uri.key_name();
        Self::new("pkcs11", configured, move |name| {
            Ok(Arc::new(Pkcs11Signer::open(&uri.with_key(name), sessions)?) as Arc<dyn Signer>)
        })
    }

    /// The key `name` names, opened once. Opening holds the lock: it is rare
    /// (a new generation) and must not race a second login for the same key.
    pub fn get(&self, name: &KeyName) -> Result<Arc<dyn Signer>, SignerError> {
        let mut cache = self
            .cache
            .lock()
            .map_err(|_| SignerError::Unavailable("key cache lock poisoned".into()))?;
        if let Some(i) = cache.iter().position(|(n, _)| n == name) {
            let hit = cache.remove(i);
            let signer = hit.1.clone();
            cache.insert(0, hit);
            return Ok(signer);
        }
        let signer = (self.open)(name)?;
        cache.insert(0, (name.clone(), signer.clone()));
        cache.truncate(OPEN_KEYS);
        Ok(signer)
    }

    pub fn configured(&self) -> Result<Arc<dyn Signer>, SignerError> {
        self.get(&self.configured)
    }
}

/// How the CA directory's signing key is held.
#[derive(Debug, Clone)]
pub enum KeySource {
    /// `ca-key.pem` / `tls.key` in the directory, owner-only unless allowed.
    File { allow_shared: bool },
    /// Outside the directory (a PKCS#11 token); the directory holds no key
    /// file, and may name its key with `ca-key.uri`.
    External(Arc<ExternalKeys>),
}

impl Default for KeySource {
    fn default() -> Self {
        Self::File {
            allow_shared: false,
        }
    }
}

impl KeySource {
    /// The configured key holder. A token is opened when a directory first
    /// needs one of its keys (at startup, the CA directory's); every
    /// failure then names what is wrong (module, token, PIN, key).
    pub fn open(settings: &CustodySettings) -> Result<Self, SignerError> {
        match &settings.signer {
            SignerSpec::File => Ok(Self::File {
                allow_shared: settings.allow_shared_key_file,
            }),
            SignerSpec::Pkcs11(uri) => Ok(Self::External(Arc::new(ExternalKeys::pkcs11(
                uri.clone(),
                settings.pkcs11_sessions,
            )))),
        }
    }

    /// Reads the CA directory as this key source needs it.
    pub fn read(&self, dir: &Path) -> Result<DirMaterial, MaterialError> {
        self.read_as(dir, DirRole::Current)
    }

    /// Reads a directory and finds the key that signs with it.
    pub fn read_as(&self, dir: &Path, role: DirRole) -> Result<DirMaterial, MaterialError> {
        let base = std::fs::canonicalize(dir.join("..data")).unwrap_or_else(|_| dir.to_path_buf());
        let key_file = base.join(if base.join("tls.crt").exists() {
            "tls.key"
        } else {
            "ca-key.pem"
        });
        let uri_file = base.join(KEY_URI_FILE);
        let uri_text = match std::fs::read_to_string(&uri_file) {
            Ok(t) => Some(t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(MaterialError::Io {
                    path: uri_file,
                    source,
                })
            }
        };
        let external = match self {
            Self::File { .. } => None,
            Self::External(keys) => Some(keys.kind),
        };
        let choice = choose_key(
            external,
            key_file.exists().then_some(key_file.as_path()),
            uri_text.as_deref().map(|t| (uri_file.as_path(), t)),
            role,
            dir,
        )?;
        match (self, choice) {
            (Self::File { allow_shared }, _) => {
                if key_file.exists() {
                    super::signer::file::check_mode(&key_file, *allow_shared)?;
                }
                Ok(DirMaterial {
                    files: BundleFiles::read_dir(dir)?,
                    signer: None,
                })
            }
            (Self::External(keys), choice) => {
                // Certificates first: a directory that is not CA material
                // says so before any token is opened.
                let files = BundleFiles::read_dir_without_key(dir)?;
                let signer = match choice {
                    KeyChoice::Named(name) => keys.get(&name)?,
                    _ => keys.configured()?,
                };
                Ok(DirMaterial {
                    files,
                    signer: Some(signer),
                })
            }
        }
    }

    pub fn load(&self, dir: &Path, now: OffsetDateTime) -> Result<CaBundle, MaterialError> {
        self.load_as(dir, DirRole::Current, now)
    }

    pub fn load_as(
        &self,
        dir: &Path,
        role: DirRole,
        now: OffsetDateTime,
    ) -> Result<CaBundle, MaterialError> {
        let m = self.read_as(dir, role)?;
        CaBundle::from_files_with(m.files, m.signer, now)
    }
}

/// `meshca init --pkcs11`: generates the intermediate key in the token
/// (never extractable), then either writes a CSR for an offline root, or
/// signs the intermediate with the root in `root_from` and writes the
/// `cacerts` layout without a key file. Either way `ca-key.uri` names the
/// key, so the directory can be staged for a rotation and promoted as is.
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
        Some(_) => &[
            "ca-cert.pem",
            "cert-chain.pem",
            "root-cert.pem",
            KEY_URI_FILE,
        ],
        None => &["ca-csr.pem", KEY_URI_FILE],
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
    write_file(
        &out.join(KEY_URI_FILE),
        format!("{}\n", uri.key_name()).as_bytes(),
        false,
    )?;
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
            println!("generated the intermediate key in {} and wrote ca-cert.pem, cert-chain.pem and root-cert.pem to {} (no key file; {KEY_URI_FILE} names the key in the token: run with --signer '{uri}')", uri.key_description(), out.display());
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

    /// File signers over keys a test holds, opened by label ("k1", "k2").
    fn memory_keys(keys: Vec<(&'static str, String)>, configured: &str) -> Arc<ExternalKeys> {
        let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        Arc::new(ExternalKeys::new(
            "test-token",
            KeyName {
                object: Some(configured.into()),
                id: None,
            },
            move |name| {
                opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let label = name.object.clone().unwrap_or_default();
                let (_, pem) = keys.iter().find(|(l, _)| *l == label).ok_or_else(|| {
                    SignerError::KeyNotFound {
                        token: "test-token".into(),
                        what: label.clone(),
                    }
                })?;
                Ok(Arc::new(
                    crate::ca::signer::file::from_pem(
                        pem,
                        crate::ca::signer::KeyAlgorithm::EcdsaP256,
                        &label,
                    )
                    .unwrap(),
                ) as Arc<dyn Signer>)
            },
        ))
    }

    #[test]
    fn an_external_key_refuses_a_key_file_in_the_directory() {
        let now = OffsetDateTime::now_utc();
        let ca = crate::ca::generate::generate(&Default::default(), now).unwrap();
        let dir = tempfile::tempdir().unwrap();
        crate::ca::generate::write_cacerts(dir.path(), &ca, false).unwrap();
        let src = KeySource::External(memory_keys(vec![("k1", ca.ca_key.clone())], "k1"));
        let err = src.load(dir.path(), now).unwrap_err();
        assert_eq!(err.reason(), "signer_key_file");
        std::fs::remove_file(dir.path().join("ca-key.pem")).unwrap();
        let b = src.load(dir.path(), now).unwrap();
        assert_eq!(b.signer().kind(), "file");
    }

    struct KeyRow {
        name: &'static str,
        external: bool,
        key_file: bool,
        key_uri: Option<&'static str>,
        role: DirRole,
        want: Result<KeyChoice, &'static str>,
    }

    #[test]
    fn which_key_signs_a_directory() {
        let named = |o: &str| {
            KeyChoice::Named(KeyName {
                object: Some(o.into()),
                id: None,
            })
        };
        let rows = [
            KeyRow {
                name: "file signer, key file",
                external: false,
                key_file: true,
                key_uri: None,
                role: DirRole::Current,
                want: Ok(KeyChoice::File),
            },
            KeyRow {
                name: "file signer, staged key file",
                external: false,
                key_file: true,
                key_uri: None,
                role: DirRole::Staged,
                want: Ok(KeyChoice::File),
            },
            KeyRow {
                name: "file signer, no key file (read reports it missing)",
                external: false,
                key_file: false,
                key_uri: None,
                role: DirRole::Current,
                want: Ok(KeyChoice::File),
            },
            KeyRow {
                name: "file signer, a token key named",
                external: false,
                key_file: false,
                key_uri: Some("pkcs11:object=k2"),
                role: DirRole::Staged,
                want: Err("signer_key_uri_without_token"),
            },
            KeyRow {
                name: "file signer, key file and a token key named",
                external: false,
                key_file: true,
                key_uri: Some("pkcs11:object=k2"),
                role: DirRole::Current,
                want: Err("signer_key_uri_without_token"),
            },
            KeyRow {
                name: "token, CA directory without a name",
                external: true,
                key_file: false,
                key_uri: None,
                role: DirRole::Current,
                want: Ok(KeyChoice::Configured),
            },
            KeyRow {
                name: "token, CA directory names its key (promoted)",
                external: true,
                key_file: false,
                key_uri: Some("pkcs11:object=k2"),
                role: DirRole::Current,
                want: Ok(named("k2")),
            },
            KeyRow {
                name: "token, staged generation names its key",
                external: true,
                key_file: false,
                key_uri: Some("pkcs11:object=k2\n"),
                role: DirRole::Staged,
                want: Ok(named("k2")),
            },
            KeyRow {
                name: "token, staged generation without a name",
                external: true,
                key_file: false,
                key_uri: None,
                role: DirRole::Staged,
                want: Err("signer_next_key_unnamed"),
            },
            KeyRow {
                name: "token, key file in the directory",
                external: true,
                key_file: true,
                key_uri: None,
                role: DirRole::Current,
                want: Err("signer_key_file"),
            },
            KeyRow {
                name: "token, staged key file despite a name",
                external: true,
                key_file: true,
                key_uri: Some("pkcs11:object=k2"),
                role: DirRole::Staged,
                want: Err("signer_key_file"),
            },
            KeyRow {
                name: "token, unparsable name",
                external: true,
                key_file: false,
                key_uri: Some("pkcs11:object=k2?module-path=/x.so"),
                role: DirRole::Staged,
                want: Err("signer_uri"),
            },
        ];
        let dir = Path::new("/ca");
        for r in rows {
            let got = choose_key(
                r.external.then_some("pkcs11"),
                r.key_file.then_some(Path::new("/ca/ca-key.pem")),
                r.key_uri.map(|t| (Path::new("/ca/ca-key.uri"), t)),
                r.role,
                dir,
            )
            .map_err(|e| e.reason());
            assert_eq!(got, r.want, "{}", r.name);
        }
    }

    #[test]
    fn each_generation_signs_with_the_key_its_directory_names() {
        let now = OffsetDateTime::now_utc();
        let g1 = crate::ca::generate::generate(&Default::default(), now).unwrap();
        let g2 = crate::ca::generate::generate(&Default::default(), now).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let (cur, next) = (tmp.path().join("cur"), tmp.path().join("next"));
        for (d, g) in [(&cur, &g1), (&next, &g2)] {
            crate::ca::generate::write_cacerts(d, g, false).unwrap();
            std::fs::remove_file(d.join("ca-key.pem")).unwrap();
        }
        let keys = memory_keys(
            vec![("k1", g1.ca_key.clone()), ("k2", g2.ca_key.clone())],
            "k1",
        );
        let src = KeySource::External(keys.clone());
        let b1 = src.load(&cur, now).unwrap();
        assert_eq!(b1.signer().describe(), "k1");
        // Staged without a name: refused, naming the fix.
        let err = src.load_as(&next, DirRole::Staged, now).unwrap_err();
        assert_eq!(err.reason(), "signer_next_key_unnamed");
        assert!(err.to_string().contains("ca-key.uri"), "{err}");
        // Named, but the wrong key (the current one): the certificate decides.
        std::fs::write(next.join(KEY_URI_FILE), "pkcs11:object=k1\n").unwrap();
        let err = src.load_as(&next, DirRole::Staged, now).unwrap_err();
        assert_eq!(err.reason(), "ca_key_mismatch");
        // Named, but not in the token.
        std::fs::write(next.join(KEY_URI_FILE), "pkcs11:object=k3\n").unwrap();
        let err = src.load_as(&next, DirRole::Staged, now).unwrap_err();
        assert_eq!(err.reason(), "signer_key_not_found");
        std::fs::write(next.join(KEY_URI_FILE), "pkcs11:object=k2\n").unwrap();
        let b2 = src.load_as(&next, DirRole::Staged, now).unwrap();
        assert_eq!(b2.signer().describe(), "k2");
        // Promoted (the whole directory copied): the CA directory's own name
        // wins over MESHCA_SIGNER's, and the open key is reused.
        std::fs::copy(next.join(KEY_URI_FILE), cur.join(KEY_URI_FILE)).unwrap();
        for f in ["ca-cert.pem", "cert-chain.pem", "root-cert.pem"] {
            std::fs::copy(next.join(f), cur.join(f)).unwrap();
        }
        let b = src.load(&cur, now).unwrap();
        assert_eq!(b.key_id(), b2.key_id());
        assert!(Arc::ptr_eq(b.signer(), b2.signer()));
    }
}
