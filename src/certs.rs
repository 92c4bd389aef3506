//! `meshca certs`: istioctl's `ztunnel-config certificates` table for a PEM
//! chain, a ztunnel config dump, or a live CreateCertificate call, with each
//! chain verified against a given root so an auditor sees which identities a
//! node proxy holds and whether they chain to this CA.

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, UnixTime};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};

#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    #[error("no certificate in the input")]
    Empty,
    #[error("invalid certificate: {0}")]
    BadCertificate(String),
    #[error("invalid ztunnel config dump: {0}")]
    BadDump(String),
    #[error("ztunnel config dump: {identity}: {field}: {reason}")]
    BadDumpCertificate {
        identity: String,
        field: String,
        reason: String,
    },
}

impl CertsError {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Empty => "certs_empty",
            Self::BadCertificate(_) => "certs_bad_certificate",
            Self::BadDump(_) => "certs_bad_dump",
            Self::BadDumpCertificate { .. } => "certs_bad_dump_certificate",
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CertRow {
    pub certificate_name: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub status: String,
    pub valid_cert: bool,
    pub serial_number: String,
    pub not_after: String,
    pub not_before: String,
    /// Why ztunnel holds no certificate (the text after `Unavailable: `); the table shows the
    /// state alone, as istioctl does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The roots chains are checked against.
#[derive(Debug, Clone)]
pub struct Trust {
    roots: Vec<CertificateDer<'static>>,
}

impl Trust {
    pub fn from_pem(pem: &str) -> Result<Self, CertsError> {
        let roots = parse_chain(pem)?;
        Ok(Self { roots })
    }

    fn is_root(&self, der: &CertificateDer<'_>) -> bool {
        self.roots.iter().any(|r| r == der)
    }

    /// Whether `chain` (leaf first) chains to one of the roots, whatever the
    /// time: it verifies at an instant when every certificate of it is valid
    /// (none: it never did). Each certificate's own validity is checked apart.
    fn anchors(&self, chain: &[CertificateDer<'static>]) -> bool {
        let mut window = (OffsetDateTime::UNIX_EPOCH, OffsetDateTime::UNIX_EPOCH);
        for (i, der) in chain.iter().enumerate() {
            let Ok((_, cert)) = X509Certificate::from_der(der) else {
                return false;
            };
            let (nb, na) = (
                cert.validity().not_before.to_datetime(),
                cert.validity().not_after.to_datetime(),
            );
            window = if i == 0 {
                (nb, na)
            } else {
                (window.0.max(nb), window.1.min(na))
            };
        }
        window.0 <= window.1 && self.verifies(chain, window.0)
    }

    /// Whether `chain` (leaf first) verifies to one of the roots at `now`.
    fn verifies(&self, chain: &[CertificateDer<'static>], now: OffsetDateTime) -> bool {
        let anchors: Vec<_> = self
            .roots
            .iter()
            .filter_map(|r| webpki::anchor_from_trusted_cert(r).ok())
            .collect();
        let Some((leaf, rest)) = chain.split_first() else {
            return false;
        };
        let Ok(ee) = webpki::EndEntityCert::try_from(leaf) else {
            return false;
        };
        let secs = u64::try_from(now.unix_timestamp()).unwrap_or(0);
        ee.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            rest,
            UnixTime::since_unix_epoch(std::time::Duration::from_secs(secs)),
            webpki::KeyUsage::client_auth(),
            None,
            None,
        )
        .is_ok()
    }
}

fn parse_chain(pem: &str) -> Result<Vec<CertificateDer<'static>>, CertsError> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertsError::BadCertificate(e.to_string()))?;
    if certs.is_empty() {
        return Err(CertsError::Empty);
    }
    Ok(certs)
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// Rows for one identity's chain (leaf first, root last).
pub fn chain_rows(
    identity: Option<&str>,
    status: &str,
    chain: &[CertificateDer<'static>],
    kinds: Option<&[&'static str]>,
    trust: &Trust,
    now: OffsetDateTime,
) -> Result<Vec<CertRow>, CertsError> {
    let anchored = trust.anchors(chain);
    let mut rows = Vec::new();
    let mut name = identity.map(str::to_string);
    for (i, der) in chain.iter().enumerate() {
        let (_, cert) = X509Certificate::from_der(der)
            .map_err(|e| CertsError::BadCertificate(e.to_string()))?;
        if i == 0 && name.is_none() {
            name = cert
                .subject_alternative_name()
                .ok()
                .flatten()
                .and_then(|san| {
                    san.value.general_names.iter().find_map(|n| match n {
                        GeneralName::URI(u) => Some(u.to_string()),
                        _ => None,
                    })
                });
        }
        let (nb, na) = (
            cert.validity().not_before.to_datetime(),
            cert.validity().not_after.to_datetime(),
        );
        let in_time = nb <= now && now <= na;
        // A PEM chain does not say where the root bundle starts: by content, so the root
        // copy at the end of cert-chain.pem and each root of the bundle are `Root`. A
        // ztunnel dump does say it, and is typed by position as istioctl does (`kinds`).
        let kind = match kinds {
            Some(k) => k[i],
            None if i == 0 => "Leaf",
            None if is_root(&cert) => "Root",
            None => "Intermediate",
        };
        // istioctl's VALID CERT is the certificate's own validity period; meshca also
        // requires the chain to lead to ROOT, and a root to be one of ROOT's.
        let valid = in_time
            && if kind == "Root" || (i > 0 && is_root(&cert)) {
                trust.is_root(der)
            } else {
                anchored
            };
        rows.push(CertRow {
            certificate_name: name.clone().unwrap_or_else(|| NA.into()),
            kind: kind.into(),
            status: status.into(),
            valid_cert: valid,
            serial_number: crate::ca::serial_hex(cert.raw_serial()),
            not_after: rfc3339(na),
            not_before: rfc3339(nb),
            error: None,
        });
    }
    Ok(rows)
}

/// A self-issued CA certificate.
fn is_root(cert: &X509Certificate<'_>) -> bool {
    cert.is_ca() && cert.subject().as_raw() == cert.issuer().as_raw()
}

/// Rows for a PEM chain, e.g. a response's concatenated `cert_chain`.
pub fn pem_rows(pem: &str, trust: &Trust, now: OffsetDateTime) -> Result<Vec<CertRow>, CertsError> {
    chain_rows(None, "Available", &parse_chain(pem)?, None, trust, now)
}

/// What istioctl prints in a cell it has no value for (its `valueOrNA`).
pub const NA: &str = "NA";

/// istioctl's TYPE of each certificate of a dumped identity: the first of
/// `certChain` is the leaf, the rest intermediates, each of `rootCerts` a
/// root; a dump without `rootCerts` (older ztunnel) ends its chain in the root.
fn dump_kinds(chain: usize, roots: usize) -> Vec<&'static str> {
    let mut kinds: Vec<&'static str> = (0..chain)
        .map(|i| if i == 0 { "Leaf" } else { "Intermediate" })
        .collect();
    if roots == 0 && chain > 1 {
        kinds[chain - 1] = "Root";
    }
    kinds.extend(std::iter::repeat_n("Root", roots));
    kinds
}

/// One identity of ztunnel's `/config_dump` `certificates` section (ztunnel's `CertsDump`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DumpIdentity {
    identity: String,
    state: String,
    /// Leaf and intermediates: the CreateCertificate response without its last element.
    #[serde(default)]
    cert_chain: Vec<DumpCert>,
    /// The response's last element, split into its roots.
    #[serde(default)]
    root_certs: Vec<DumpCert>,
}

#[derive(Debug, Deserialize)]
struct DumpCert {
    /// ztunnel writes the standard base64 of the PEM text; raw PEM is accepted too. The
    /// neighbouring serialNumber/validFrom/expirationTime are ztunnel's reading of this
    /// certificate and are not trusted: everything shown is read from the certificate itself.
    pem: String,
}

/// The certificates of one `pem` field: PEM text, or the base64 of PEM text.
fn dump_pem(pem: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    use base64::Engine;
    let text = pem.trim();
    if text.contains("-----BEGIN") {
        return parse_chain(text).map_err(|e| e.to_string());
    }
    let compact: String = text.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(compact.as_bytes())
        .map_err(|e| format!("neither PEM nor base64 ({e})"))?;
    let decoded = String::from_utf8(decoded)
        .map_err(|_| "base64 of something other than PEM text".to_string())?;
    if !decoded.contains("-----BEGIN") {
        return Err("base64 of something other than PEM text".into());
    }
    parse_chain(&decoded).map_err(|e| e.to_string())
}

/// The `certificates` of a ztunnel config dump: the whole `/config_dump` object (as
/// `kubectl exec ... curl localhost:15000/config_dump` prints it) or the bare array
/// (`istioctl ztunnel-config certificates -o json`).
fn dump_identities(json: &str) -> Result<Vec<DumpIdentity>, CertsError> {
    let bad = |e: serde_json::Error| CertsError::BadDump(e.to_string());
    let value: serde_json::Value =
        serde_json::from_str(json.trim_start_matches('\u{feff}')).map_err(bad)?;
    let certs = match value {
        serde_json::Value::Array(_) => value,
        serde_json::Value::Object(mut o) => o.remove("certificates").ok_or_else(|| {
            CertsError::BadDump(
                "no `certificates` section (is this ztunnel's /config_dump?)".into(),
            )
        })?,
        _ => {
            return Err(CertsError::BadDump(
                "expected a JSON object or array".into(),
            ))
        }
    };
    serde_json::from_value(certs).map_err(bad)
}

/// Rows for ztunnel's certificates, one per certificate (leaf, intermediates, roots) of each
/// Available identity and one for each identity without certificates (Initializing,
/// Unavailable). Expired certificates are rows with `valid_cert` false.
pub fn ztunnel_rows(
    json: &str,
    trust: &Trust,
    now: OffsetDateTime,
) -> Result<Vec<CertRow>, CertsError> {
    let mut rows = Vec::new();
    for id in dump_identities(json)? {
        let decode = |field: &str, certs: &[DumpCert]| {
            let mut out = Vec::new();
            for (i, c) in certs.iter().enumerate() {
                out.extend(
                    dump_pem(&c.pem).map_err(|reason| CertsError::BadDumpCertificate {
                        identity: id.identity.clone(),
                        field: format!("{field}[{i}]"),
                        reason,
                    })?,
                );
            }
            Ok::<_, CertsError>(out)
        };
        let chain = decode("certChain", &id.cert_chain)?;
        let roots = decode("rootCerts", &id.root_certs)?;
        // istioctl shows `Unavailable` and drops the error; meshca keeps it in `error`.
        let (status, error) = match id.state.strip_prefix("Unavailable") {
            Some(rest) => (
                "Unavailable".to_string(),
                Some(rest.trim_start_matches(':').trim().to_string()).filter(|e| !e.is_empty()),
            ),
            None => (id.state.clone(), None),
        };
        if chain.is_empty() {
            rows.push(CertRow {
                certificate_name: id.identity.clone(),
                kind: NA.into(),
                status,
                valid_cert: false,
                serial_number: NA.into(),
                not_after: NA.into(),
                not_before: NA.into(),
                error,
            });
            continue;
        }
        let kinds = dump_kinds(chain.len(), roots.len());
        let mut all = chain;
        all.extend(roots);
        let mut id_rows = chain_rows(Some(&id.identity), &status, &all, Some(&kinds), trust, now)?;
        for r in &mut id_rows {
            r.error.clone_from(&error);
        }
        rows.extend(id_rows);
    }
    Ok(rows)
}

/// istioctl's table: its columns, and its tabwriter's layout (each column
/// as wide as its widest cell plus 5 spaces, the last one unpadded).
pub fn table(rows: &[CertRow]) -> String {
    let header = [
        "CERTIFICATE NAME",
        "TYPE",
        "STATUS",
        "VALID CERT",
        "SERIAL NUMBER",
        "NOT AFTER",
        "NOT BEFORE",
    ];
    let cells = rows.iter().map(|r| {
        vec![
            r.certificate_name.clone(),
            r.kind.clone(),
            r.status.clone(),
            r.valid_cert.to_string(),
            r.serial_number.clone(),
            r.not_after.clone(),
            r.not_before.clone(),
        ]
    });
    crate::table::render_table_padded(&header, cells, 5)
}

pub use crate::table::render_table;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::generate::KeyType;
    use crate::ca::CaBundle;
    use crate::testing::{client_identity, validity_hours, TestPki};

    fn chain_for(pki: &TestPki, id: &str) -> String {
        let b = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
        let (chain, _) = client_identity(&b, id, &validity_hours(-1, 1));
        format!("{chain}{}", pki.ca.root_cert)
    }

    #[test]
    fn own_chain_is_valid_foreign_chain_is_not() {
        let pki = TestPki::new(KeyType::EcdsaP256);
        let foreign = TestPki::new(KeyType::EcdsaP256);
        let trust = Trust::from_pem(&pki.ca.root_cert).unwrap();
        let now = OffsetDateTime::now_utc();
        let rows = pem_rows(
            &chain_for(&pki, "spiffe://cluster.local/ns/a/sa/b"),
            &trust,
            now,
        )
        .unwrap();
        // cert-chain.pem ends in the root, then the root bundle: both are roots.
        assert_eq!(
            rows.iter().map(|r| r.kind.as_str()).collect::<Vec<_>>(),
            ["Leaf", "Intermediate", "Root", "Root"]
        );
        assert!(rows.iter().all(|r| r.valid_cert), "{rows:?}");
        assert_eq!(rows[0].certificate_name, "spiffe://cluster.local/ns/a/sa/b");
        let rows = pem_rows(
            &chain_for(&foreign, "spiffe://cluster.local/ns/a/sa/b"),
            &trust,
            now,
        )
        .unwrap();
        assert!(rows.iter().all(|r| !r.valid_cert), "{rows:?}");
    }

    #[test_case::test_case(|pem| pem.to_string(), true ; "raw pem")]
    #[test_case::test_case(b64, true ; "base64 of pem as ztunnel writes it")]
    #[test_case::test_case(|pem| b64(pem).as_bytes().chunks(76).map(|c| String::from_utf8_lossy(c) + "\n").collect(), true ; "wrapped base64")]
    #[test_case::test_case(|_| b64("not a certificate"), false ; "base64 of text")]
    #[test_case::test_case(|pem| b64(&b64(pem)), false ; "double base64")]
    #[test_case::test_case(|_| "%%%".into(), false ; "garbage")]
    #[test_case::test_case(|_| String::new(), false ; "empty")]
    fn dump_pem_field_forms(form: fn(&str) -> String, ok: bool) {
        let pki = TestPki::new(KeyType::EcdsaP256);
        let got = dump_pem(&form(&pki.ca.root_cert));
        assert_eq!(got.is_ok(), ok, "{got:?}");
        if let Ok(certs) = got {
            assert_eq!(certs, parse_chain(&pki.ca.root_cert).unwrap());
        }
    }

    fn b64(s: &str) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    #[test]
    fn table_has_istioctl_columns() {
        let t = table(&[]);
        assert_eq!(t.trim_end(), "CERTIFICATE NAME     TYPE     STATUS     VALID CERT     SERIAL NUMBER     NOT AFTER     NOT BEFORE");
    }
}

/// How `meshca certs --addr` authenticates its CreateCertificate call.
#[derive(Debug, Clone, Default)]
pub struct LiveCall {
    pub addr: String,
    pub server_name: String,
    pub root_pem: String,
    /// mTLS client certificate chain and key PEM.
    pub client: Option<(String, String)>,
    pub token: Option<String>,
    /// URI SAN to request (the caller's own identity under the strict policy).
    pub identity: Option<String>,
    /// `ImpersonatedIdentity` metadata (node proxies only).
    pub impersonate: Option<String>,
    /// `clusterid` header.
    pub cluster_id: Option<String>,
    /// Requested lifetime in seconds (0: server default).
    pub ttl: i64,
}

/// What a live call returns: the chain and the fresh key it certifies.
#[derive(Debug, Clone)]
pub struct LiveResult {
    pub chain: Vec<String>,
    pub key_pem: String,
}

/// Calls CreateCertificate with a fresh key, as a workload does.
pub async fn fetch_live(call: &LiveCall) -> anyhow::Result<LiveResult> {
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&call.root_pem))
        .domain_name(&call.server_name);
    if let Some((cert, key)) = &call.client {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let channel = Channel::from_shared(format!("https://{}", call.addr))?
        .tls_config(tls)?
        .connect()
        .await?;
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    if let Some(id) = &call.identity {
        params.subject_alt_names = vec![rcgen::SanType::URI(id.clone().try_into()?)];
    }
    let csr = params.serialize_request(&key)?.pem()?;
    let metadata = call.impersonate.as_ref().map(|id| prost_types::Struct {
        fields: [(
            crate::grpc::IMPERSONATED_IDENTITY.to_string(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::StringValue(id.clone())),
            },
        )]
        .into(),
    });
    let mut req = tonic::Request::new(crate::proto::IstioCertificateRequest {
        csr,
        validity_duration: call.ttl,
        metadata,
    });
    if let Some(t) = &call.token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse()?);
    }
    if let Some(c) = &call.cluster_id {
        req.metadata_mut().insert("clusterid", c.parse()?);
    }
    let mut client =
        crate::proto::istio_certificate_service_client::IstioCertificateServiceClient::new(channel);
    let resp = client
        .create_certificate(req)
        .await
        .map_err(|s| anyhow::anyhow!("CreateCertificate: {:?}: {}", s.code(), s.message()))?;
    Ok(LiveResult {
        chain: resp.into_inner().cert_chain,
        key_pem: key.serialize_pem(),
    })
}

/// `meshca request`: asks a CA (meshca or istiod) for a certificate the way a workload does (a
/// fresh key and CSR, CreateCertificate over TLS with a client certificate or a bearer token)
/// and prints the returned chain. The README's second command; `examples/request_cert.rs` is
/// the same as a library example.
#[derive(Debug, Clone, clap::Args)]
pub struct RequestArgs {
    /// CA address (Istio's CA_ADDR).
    #[arg(long, env = "CA_ADDR", default_value = "127.0.0.1:15012")]
    pub addr: String,
    /// Name to verify the server certificate against.
    #[arg(long, default_value = "localhost")]
    pub server_name: String,
    /// PEM root bundle that signed the server certificate.
    #[arg(long)]
    pub root: std::path::PathBuf,
    /// Client certificate chain (mTLS caller).
    #[arg(long, requires = "key")]
    pub cert: Option<std::path::PathBuf>,
    /// Client private key (mTLS caller).
    #[arg(long, requires = "cert")]
    pub key: Option<std::path::PathBuf>,
    /// File holding a Kubernetes ServiceAccount token (token caller).
    #[arg(long)]
    pub token_file: Option<std::path::PathBuf>,
    /// Ask for another workload's identity (node proxies only).
    #[arg(long)]
    pub impersonate: Option<String>,
    /// Value of the `clusterid` header.
    #[arg(long)]
    pub cluster_id: Option<String>,
    /// Identity to put in the CSR (default: the impersonated identity, the client
    /// certificate's identity, or the token's service account).
    #[arg(long)]
    pub identity: Option<String>,
    /// Trust domain used to turn a token's service account into an identity.
    #[arg(long, default_value = "cluster.local")]
    pub trust_domain: String,
    /// Requested lifetime in seconds (0 = server default).
    #[arg(long, default_value_t = 0)]
    pub ttl: i64,
    /// Also write key.pem, cert-chain.pem and root-cert.pem here.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

/// Runs [`RequestArgs`]: the chain on stdout, a summary on stderr.
pub async fn request(args: &RequestArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let read = |p: &std::path::Path| {
        std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
    };
    let root = read(&args.root)?;
    let mut client = None;
    let mut cert_identity = None;
    if let (Some(cert), Some(key)) = (&args.cert, &args.key) {
        let cert_pem = read(cert)?;
        cert_identity = uri_san_of(&cert_pem);
        client = Some((cert_pem, read(key)?));
    }
    let token = match &args.token_file {
        Some(p) => Some(read(p)?.trim().to_string()),
        None => None,
    };
    if client.is_none() && token.is_none() {
        anyhow::bail!("give --cert/--key (mTLS) or --token-file (bearer token)");
    }
    let identity = args
        .identity
        .clone()
        .or_else(|| args.impersonate.clone())
        .or(cert_identity)
        .or_else(|| {
            token
                .as_deref()
                .and_then(|t| token_identity(t, &args.trust_domain))
        });
    let call = LiveCall {
        addr: args.addr.clone(),
        server_name: args.server_name.clone(),
        root_pem: root,
        client,
        token,
        identity: identity.clone(),
        impersonate: args.impersonate.clone(),
        cluster_id: args.cluster_id.clone(),
        ttl: args.ttl,
    };
    let LiveResult { chain, key_pem } = fetch_live(&call)
        .await
        .with_context(|| format!("requesting a certificate from {}", args.addr))?;
    eprintln!(
        "received {} certificates for {}",
        chain.len(),
        identity.as_deref().unwrap_or("(server-chosen identity)")
    );
    {
        use std::io::Write as _;
        // A write error (a closed pipe) is the caller's to judge, not a panic.
        write!(std::io::stdout().lock(), "{}", chain.concat())?;
    }
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out)?;
        crate::ca::generate::write_file(&out.join("key.pem"), key_pem.as_bytes(), true)?;
        let (root, rest) = chain.split_last().unzip();
        std::fs::write(
            out.join("cert-chain.pem"),
            rest.unwrap_or_default().concat(),
        )?;
        std::fs::write(out.join("root-cert.pem"), root.cloned().unwrap_or_default())?;
        eprintln!(
            "wrote key.pem, cert-chain.pem, root-cert.pem to {}",
            out.display()
        );
    }
    Ok(())
}

/// The URI SAN of the first certificate in a PEM chain.
fn uri_san_of(pem: &str) -> Option<String> {
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).ok()?;
    let (_, cert) = X509Certificate::from_der(&der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        GeneralName::URI(u) => Some(u.to_string()),
        _ => None,
    })
}

/// `spiffe://<td>/ns/<ns>/sa/<sa>` from a ServiceAccount token's `sub`, read without
/// verification (the server verifies) only to choose the CSR's SAN.
fn token_identity(token: &str, trust_domain: &str) -> Option<String> {
    use base64::Engine;
    let payload = token.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let sub = claims.get("sub")?.as_str()?;
    match sub.split(':').collect::<Vec<_>>().as_slice() {
        ["system", "serviceaccount", ns, sa] => {
            Some(format!("spiffe://{trust_domain}/ns/{ns}/sa/{sa}"))
        }
        _ => None,
    }
}
