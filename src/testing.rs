//! Helpers shared by unit and integration tests: throwaway PKI, CSRs, clients.

use std::path::{Path, PathBuf};

use rcgen::{CertificateParams, CustomExtension, DistinguishedName, KeyPair, SanType};
use time::OffsetDateTime;

use crate::ca::generate::{self, InitOptions, KeyType};

pub use crate::primitives::pem_encode;

/// A CSR signed by `key` with the given SANs, optionally asking for CA:true.
pub fn csr_pem(key: &KeyPair, sans: &[SanType], ca: bool) -> String {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.subject_alt_names = sans.to_vec();
    if ca {
        // basicConstraints CA:TRUE requested through the extension request.
        let mut bc =
            CustomExtension::from_oid_content(&[2, 5, 29, 19], vec![0x30, 0x03, 0x01, 0x01, 0xff]);
        bc.set_criticality(true);
        params.custom_extensions.push(bc);
    }
    params
        .serialize_request(key)
        .expect("csr")
        .pem()
        .expect("pem")
}

/// A CSR for a SPIFFE id, as ztunnel and istio-agent send.
pub fn csr_for(key: &KeyPair, id: &str) -> String {
    csr_pem(
        key,
        &[SanType::URI(id.to_string().try_into().expect("uri"))],
        false,
    )
}

/// A CA directory in the cacerts layout, generated now.
#[derive(Debug)]
pub struct TestPki {
    pub dir: tempfile::TempDir,
    pub ca: generate::GeneratedCa,
}

impl TestPki {
    pub fn new(key_type: KeyType) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = generate::generate(
            &InitOptions {
                key_type,
                ..Default::default()
            },
            OffsetDateTime::now_utc(),
        )
        .expect("generate");
        generate::write_cacerts(dir.path(), &ca, false).expect("write");
        Self { dir, ca }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn path_buf(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}

/// A new intermediate under the same root as `ca` (for reload tests).
pub fn new_intermediate(ca: &generate::GeneratedCa, now: OffsetDateTime) -> generate::GeneratedCa {
    let root_key = KeyPair::from_pem(&ca.root_key).expect("root key");
    let root = rcgen::Issuer::from_ca_cert_pem(&ca.root_cert, root_key).expect("root issuer");
    let key = KeyPair::generate().expect("key");
    let mut params = generate::ca_params(
        "meshca intermediate CA",
        "cluster.local",
        now,
        now + time::Duration::days(30),
        // As `meshca init` makes them: room for a two-tier issuing CA.
        Some(1),
    )
    .expect("params");
    params.use_authority_key_identifier_extension = true;
    let cert = params.signed_by(&key, &root).expect("sign");
    generate::GeneratedCa {
        root_cert: ca.root_cert.clone(),
        root_key: ca.root_key.clone(),
        ca_cert: cert.pem(),
        ca_key: key.serialize_pem(),
    }
}

/// Signs arbitrary leaf parameters with the bundle's signing key (for
/// malformed client certificates that meshca itself would never issue).
pub fn sign_custom(
    bundle: &crate::ca::CaBundle,
    params: &CertificateParams,
    key: &KeyPair,
) -> String {
    params.signed_by(key, bundle.issuer()).expect("sign").pem()
}

/// A client certificate (chain PEM without the root, key PEM) for `id`,
/// valid over `validity`.
pub fn client_identity(
    bundle: &crate::ca::CaBundle,
    id: &str,
    validity: &crate::ca::Validity,
) -> (String, String) {
    bundle
        .client_identity(&id.parse().expect("spiffe id"), validity)
        .expect("client identity")
}

/// Issues a 24h client certificate for `id` and writes `cert-chain.pem`,
/// `key.pem` and `root-cert.pem` into `dir`.
pub fn write_client_identity(
    dir: &Path,
    bundle: &crate::ca::CaBundle,
    id: &crate::identity::SpiffeId,
) -> anyhow::Result<()> {
    let validity = crate::ca::ttl::validity(
        OffsetDateTime::now_utc(),
        0,
        &Default::default(),
        bundle.signing_not_after(),
    )?;
    let (chain, key) = bundle.client_identity(id, &validity)?;
    generate::write_identity_files(dir, &chain, &key, bundle.root_bundle())?;
    Ok(())
}

/// The credentials of a connection that presented `chain` (PEM, leaf
/// first), as the TLS layer hands them on once it verified the chain.
pub fn mtls_credentials(chain: &str) -> crate::authn::Credentials {
    use rustls_pki_types::pem::PemObject;
    let peer_chain: Vec<rustls_pki_types::CertificateDer<'static>> =
        rustls_pki_types::CertificateDer::pem_slice_iter(chain.as_bytes())
            .collect::<Result<_, _>>()
            .expect("a PEM chain");
    crate::authn::Credentials {
        peer_chain: Some(peer_chain.into()),
        ..Default::default()
    }
}

/// A leaf for `id` with a fresh key, signed by `bundle`, valid from two
/// minutes before `now` to half an hour after.
pub fn leaf(bundle: &crate::ca::CaBundle, id: &str, now: OffsetDateTime) -> crate::ca::IssuedLeaf {
    let key = KeyPair::generate().expect("key");
    let validity = crate::ca::Validity {
        not_before: now - time::Duration::minutes(2),
        not_after: now + time::Duration::minutes(30),
        clamped: false,
    };
    bundle
        .sign_leaf(
            &rcgen::PublicKeyData::subject_public_key_info(&key),
            &id.parse().expect("spiffe id"),
            false,
            &validity,
        )
        .expect("leaf")
}

/// The serial of the first certificate in `pem`, as the audit log writes it.
pub fn leaf_serial(pem: &str) -> String {
    use rustls_pki_types::pem::PemObject;
    let der = rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).expect("PEM");
    let (_, cert) = x509_parser::parse_x509_certificate(&der).expect("X.509");
    crate::ca::serial_hex(cert.raw_serial())
}

/// A validity window of `hours` from now (negative for already expired).
pub fn validity_hours(from_hours: i64, to_hours: i64) -> crate::ca::Validity {
    let now = OffsetDateTime::now_utc();
    crate::ca::Validity {
        not_before: now + time::Duration::hours(from_hours),
        not_after: now + time::Duration::hours(to_hours),
        clamped: false,
    }
}

/// A gRPC client over TLS to a local meshca, trusting `root_pem`, optionally
/// presenting a client certificate.
pub async fn client(
    addr: std::net::SocketAddr,
    root_pem: &str,
    identity: Option<(&str, &str)>,
) -> Result<
    crate::proto::istio_certificate_service_client::IstioCertificateServiceClient<
        tonic::transport::Channel,
    >,
    tonic::transport::Error,
> {
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(root_pem))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let channel = Channel::from_shared(format!("https://127.0.0.1:{}", addr.port()))
        .expect("uri")
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(crate::proto::istio_certificate_service_client::IstioCertificateServiceClient::new(channel))
}

/// A client of the `serve --dev` server at `addr` presenting the dev client
/// identity that server wrote to `data/dev-client`.
pub async fn dev_client(
    addr: std::net::SocketAddr,
    data: &Path,
) -> crate::proto::istio_certificate_service_client::IstioCertificateServiceClient<
    tonic::transport::Channel,
> {
    let read = |f: &str| {
        std::fs::read_to_string(data.join("dev-client").join(f)).expect("dev-client file")
    };
    client(
        addr,
        &read("root-cert.pem"),
        Some((&read("cert-chain.pem"), &read("key.pem"))),
    )
    .await
    .expect("dev client connects")
}

/// A request message with string metadata.
pub fn request(
    csr: String,
    ttl: i64,
    metadata: &[(&str, prost_types::Value)],
) -> crate::proto::IstioCertificateRequest {
    let metadata = (!metadata.is_empty()).then(|| prost_types::Struct {
        fields: metadata
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    });
    crate::proto::IstioCertificateRequest {
        csr,
        validity_duration: ttl,
        metadata,
    }
}

/// A protobuf string value.
pub fn string_value(s: &str) -> prost_types::Value {
    prost_types::Value {
        kind: Some(prost_types::value::Kind::StringValue(s.to_string())),
    }
}

/// A server config for tests: 127.0.0.1:0, istiod defaults, fast reload polling.
pub fn test_config(ca_dir: PathBuf) -> crate::config::Config {
    crate::config::Config {
        listen: "127.0.0.1:0".parse().expect("addr"),
        ca_dir,
        trust_domain: crate::identity::TrustDomain::new("cluster.local").expect("td"),
        trust_domain_aliases: Vec::new(),
        ttl: Default::default(),
        csr_policy: Default::default(),
        serving_names: vec!["localhost".into(), "127.0.0.1".into()],
        trusted_node_accounts: Vec::new(),
        token_audiences: vec!["istio-ca".into()],
        cluster_id: "Kubernetes".into(),
        allow_root_change: false,
        reload_poll: std::time::Duration::from_millis(500),
        admin_listen: "127.0.0.1:0".parse().expect("addr"),
        kube: None,
        mtls_impersonation: false,
        audit: crate::config::AuditSettings {
            sink: crate::config::AuditSinkKind::Stdout,
            file: PathBuf::from("audit.log"),
            max_bytes: 1 << 20,
            max_files: 3,
            retain_issued: std::time::Duration::from_secs(24 * 3600),
            max_line_bytes: crate::audit::chain::DEFAULT_MAX_LINE_BYTES,
            checkpoint_key: None,
            checkpoint_key_secret: None,
            checkpoint_every: 1000,
            checkpoint_interval: std::time::Duration::from_secs(60),
            writer: crate::audit::writer::WriterSettings {
                queue: 4096,
                fsync: crate::audit::writer::FsyncPolicy::Batch,
                batch_interval: std::time::Duration::from_millis(2),
                checkpoint_interval: std::time::Duration::from_secs(60),
                aggregate_interval: std::time::Duration::from_secs(1),
                unauthenticated_rate: crate::audit::writer::DEFAULT_UNAUTHENTICATED_RATE,
            },
            aggregate_max_keys: crate::audit::aggregate::DEFAULT_MAX_KEYS,
            anchor: None,
            handshakes: Default::default(),
        },
        root_publisher: None,
        transport: Default::default(),
        input: Default::default(),
        admin: Default::default(),
        admission: Default::default(),
        kill_switch: Default::default(),
        multicluster: Default::default(),
        rotation: None,
        custody: Default::default(),
        pod_certificates: None,
        cluster_trust_bundle: None,
    }
}

/// Starts a server with an in-memory audit sink.
pub async fn start_server(
    cfg: &crate::config::Config,
    mut deps: crate::app::Deps,
) -> (crate::app::App, std::sync::Arc<crate::audit::MemorySink>) {
    let sink = std::sync::Arc::new(crate::audit::MemorySink::default());
    deps.audit = Some(sink.clone());
    let app = crate::app::App::start(cfg, deps)
        .await
        .expect("server starts");
    (app, sink)
}

/// A plain HTTP/1.1 GET against the admin port: (status, body).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: meshca\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Reads a `meshca serve` process's stderr until its `listening on A (gRPC),
/// B (health)` line and returns both addresses; the rest of the stream is
/// drained in the background so the process never blocks on a full pipe.
/// Panics, with the lines seen, if the process exits first or takes longer
/// than `within`.
pub async fn await_listening<R>(
    stderr: R,
    within: std::time::Duration,
) -> (std::net::SocketAddr, std::net::SocketAddr)
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    let mut seen = Vec::new();
    let addrs = tokio::time::timeout(within, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(rest) = line.strip_prefix("listening on ") {
                let mut words = rest.split(' ');
                let grpc = words.next().and_then(|a| a.parse().ok());
                let admin = words.nth(1).and_then(|a| a.parse().ok());
                if let (Some(grpc), Some(admin)) = (grpc, admin) {
                    return (grpc, admin);
                }
            }
            seen.push(line);
        }
        panic!("meshca exited before listening:\n{}", seen.join("\n"));
    })
    .await
    .unwrap_or_else(|_| panic!("meshca did not listen within {within:?}"));
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    addrs
}

/// Runs `cmd` to completion: (exit code, or -1 on a signal; stdout then
/// stderr).
pub fn output_text(cmd: &mut std::process::Command) -> (i32, String) {
    let out = cmd.output().expect("run the command");
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// [`output_text`] of `bin args`.
pub fn run_cli(bin: &Path, args: &[&str]) -> (i32, String) {
    output_text(std::process::Command::new(bin).args(args))
}

/// `bin serve --dev` on ephemeral 127.0.0.1 ports with its data in `data`,
/// stdio left as the caller sets it (`output()` captures both streams).
pub fn serve_dev_std_command(bin: &Path, data: &Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(bin);
    cmd.args([
        "serve",
        "--dev",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ])
    .arg("--data-dir")
    .arg(data);
    cmd
}

/// [`serve_dev_std_command`] for tokio, stdout discarded and stderr piped
/// for [`spawn_listening`]. The process tests add their own flags, env and
/// stdout on top.
pub fn serve_dev_command(bin: &Path, data: &Path) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::from(serve_dev_std_command(bin, data));
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// Spawns `cmd` (stderr piped) and waits until it listens, as
/// [`await_listening`]: (child, gRPC address, admin address).
pub async fn spawn_listening(
    mut cmd: tokio::process::Command,
) -> (
    tokio::process::Child,
    std::net::SocketAddr,
    std::net::SocketAddr,
) {
    let mut child = cmd.spawn().expect("spawn meshca");
    let stderr = child.stderr.take().expect("stderr piped");
    let (grpc, admin) = await_listening(stderr, std::time::Duration::from_secs(30)).await;
    (child, grpc, admin)
}

/// Stops `child` with SIGTERM and waits, at most `within`, for its exit
/// status.
pub async fn terminate(
    mut child: tokio::process::Child,
    within: std::time::Duration,
) -> std::process::ExitStatus {
    let pid = child.id().expect("running").to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    tokio::time::timeout(within, child.wait())
        .await
        .unwrap_or_else(|_| panic!("stopped within {within:?}"))
        .expect("wait")
}

/// Reads `stdout` (an audit stream) to its end while the server is stopped
/// with SIGTERM a moment after reading starts; returns its lines numbered as
/// `stdout:N`, ready for [`crate::audit::verify::verify_lines`].
pub async fn stop_and_read_stdout(
    child: tokio::process::Child,
    mut stdout: tokio::process::ChildStdout,
) -> Vec<(String, String)> {
    use tokio::io::AsyncReadExt;
    let reader = tokio::spawn(async move {
        let mut buf = Vec::new();
        stdout.read_to_end(&mut buf).await.expect("read stdout");
        buf
    });
    // Let the writer drain what it held before it is asked to stop.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    terminate(child, std::time::Duration::from_secs(20)).await;
    let out = reader.await.expect("reader");
    String::from_utf8_lossy(&out)
        .lines()
        .enumerate()
        .map(|(i, l)| (format!("stdout:{}", i + 1), l.to_string()))
        .collect()
}
