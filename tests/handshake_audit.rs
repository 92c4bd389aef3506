//! Rejected TLS handshakes reach the audit log as aggregated records: the
//! real server (`meshca serve --dev`, file sink), real rustls clients on
//! 127.0.0.x presenting certificates the handshake refuses.

#![allow(clippy::unwrap_used)]

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use meshca::ca::generate::{self, InitOptions};
use meshca::ca::CaBundle;
use meshca::identity::SpiffeId;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use time::OffsetDateTime;
use tokio::io::AsyncReadExt;

async fn serve_dev(data: &Path, log: &Path) -> (tokio::process::Child, SocketAddr) {
    let mut cmd = meshca::testing::serve_dev_command(env!("CARGO_BIN_EXE_meshca").as_ref(), data);
    cmd.env("MESHCA_AUDIT_HANDSHAKE_INTERVAL", "2s")
        .args(["--audit-sink", "file", "--audit-file"])
        .arg(log);
    let (child, addr, _) = meshca::testing::spawn_listening(cmd).await;
    (child, addr)
}

/// A client certificate for `id` from `bundle`, written to and read back from `dir`.
fn identity(
    dir: &Path,
    bundle: &CaBundle,
    id: &str,
) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
    let id: SpiffeId = id.parse().unwrap();
    meshca::testing::write_client_identity(dir, bundle, &id).unwrap();
    let chain = std::fs::read(dir.join("cert-chain.pem")).unwrap();
    let key = std::fs::read(dir.join("key.pem")).unwrap();
    (
        CertificateDer::pem_slice_iter(&chain)
            .collect::<Result<_, _>>()
            .unwrap(),
        PrivateKeyDer::from_pem_slice(&key).unwrap(),
    )
}

fn client_config(
    root_pem: &[u8],
    (chain, key): (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>),
) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(root_pem) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(cfg)
}

/// One handshake from `src`; true if the server refused it (with TLS 1.3
/// the client finishes first, so the refusal arrives on the first read).
async fn refused(src: IpAddr, dst: SocketAddr, cfg: &Arc<rustls::ClientConfig>) -> bool {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(SocketAddr::new(src, 0)).unwrap();
    let tcp = sock.connect(dst).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(cfg.clone());
    let name = ServerName::try_from("localhost").unwrap();
    let attempt = async {
        let mut s = tls.connect(name, tcp).await?;
        let mut buf = [0u8; 64];
        loop {
            if s.read(&mut buf).await? == 0 {
                return Ok::<_, std::io::Error>(());
            }
        }
    };
    match tokio::time::timeout(Duration::from_secs(10), attempt).await {
        Ok(Ok(())) => true, // closed by the server
        Ok(Err(e)) => {
            eprintln!("refused: {e}");
            true
        }
        Err(_) => false,
    }
}

fn records(log: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| {
            v["reason"]
                .as_str()
                .is_some_and(|r| r.starts_with("tls_handshake_rejected:"))
        })
        .collect()
}

/// (peer, reason, count) of every aggregated record, summed per key.
fn totals(log: &Path) -> std::collections::BTreeMap<(String, String), u64> {
    let mut out = std::collections::BTreeMap::new();
    for r in records(log) {
        assert_eq!(r["decision"], "deny", "{r}");
        let key = (
            r["peer"].as_str().unwrap().to_string(),
            r["reason"].as_str().unwrap().to_string(),
        );
        *out.entry(key).or_default() += r["count"].as_u64().unwrap();
    }
    out
}

#[tokio::test]
async fn rejected_handshakes_are_audited_per_source_and_reason_with_counts() {
    let data = tempfile::tempdir().unwrap();
    let log = data.path().join("audit.log");
    let (mut child, addr) = serve_dev(data.path(), &log).await;
    let root = std::fs::read(data.path().join("dev-client/root-cert.pem")).unwrap();
    let now = OffsetDateTime::now_utc();

    // The mesh CA, but a foreign trust domain.
    let mesh = CaBundle::load_dir(&data.path().join("cacerts"), now).unwrap();
    let foreign_td = client_config(
        &root,
        identity(
            &data.path().join("foreign-td"),
            &mesh,
            "spiffe://evil.example/ns/default/sa/default",
        ),
    );
    // The mesh trust domain, from a CA nobody trusts.
    let other_dir = data.path().join("other-ca");
    // (A distinct name: a CA named like the mesh's fails as a bad signature.)
    let opts = InitOptions {
        organization: "foreign.example".into(),
        ..Default::default()
    };
    let other = generate::generate(&opts, now).unwrap();
    generate::write_cacerts(&other_dir, &other, false).unwrap();
    let other = CaBundle::load_dir(&other_dir, now).unwrap();
    let foreign_ca = client_config(
        &root,
        identity(
            &data.path().join("foreign-ca"),
            &other,
            "spiffe://cluster.local/ns/default/sa/default",
        ),
    );

    let (a, b): (IpAddr, IpAddr) = ("127.0.0.1".parse().unwrap(), "127.0.0.2".parse().unwrap());
    let plan = [
        (a, &foreign_ca, 3),
        (a, &foreign_td, 2),
        (b, &foreign_td, 4),
    ];
    for (src, cfg, n) in plan {
        for _ in 0..n {
            assert!(
                refused(src, addr, cfg).await,
                "handshake from {src} was not refused"
            );
        }
    }
    let want: std::collections::BTreeMap<(String, String), u64> = [
        ((a, "tls_unknown_ca"), 3),
        ((a, "mtls_foreign_trust_domain"), 2),
        ((b, "mtls_foreign_trust_domain"), 4),
    ]
    .into_iter()
    .map(|((ip, r), n)| ((ip.to_string(), format!("tls_handshake_rejected:{r}")), n))
    .collect();

    // Within a few intervals the counts are in the log.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while totals(&log) != want && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(totals(&log), want);
    // Aggregated, not one record per handshake: a record stands for several.
    let rs = records(&log);
    assert!(rs.iter().any(|r| r["count"].as_u64() > Some(1)), "{rs:?}");
    child.kill().await.unwrap();

    let (code, text) = meshca::testing::run_cli(
        env!("CARGO_BIN_EXE_meshca").as_ref(),
        &["audit", "verify", log.to_str().unwrap()],
    );
    assert_eq!(code, 0, "audit verify failed:\n{text}");
}

#[tokio::test]
async fn the_last_interval_is_written_at_shutdown_and_expired_certificates_are_named() {
    let pki = meshca::testing::TestPki::new(Default::default());
    // The default interval (10s) does not come round within this test:
    // the records below can only come from the shutdown flush.
    let cfg = meshca::testing::test_config(pki.path_buf());
    let (app, audit) = meshca::testing::start_server(&cfg, Default::default()).await;
    let bundle = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
    let (chain, key) = meshca::testing::client_identity(
        &bundle,
        "spiffe://cluster.local/ns/default/sa/default",
        &meshca::testing::validity_hours(-3, -1),
    );
    let root = std::fs::read(pki.path().join("root-cert.pem")).unwrap();
    let cfg = client_config(
        &root,
        (
            CertificateDer::pem_slice_iter(chain.as_bytes())
                .collect::<Result<_, _>>()
                .unwrap(),
            PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
        ),
    );
    for _ in 0..2 {
        assert!(refused("127.0.0.1".parse().unwrap(), app.addr, &cfg).await);
    }
    assert!(
        audit
            .requests()
            .iter()
            .all(|r| !r.reason.starts_with("tls_handshake_rejected:")),
        "nothing is written before the interval ends"
    );
    app.shutdown().await.unwrap();
    let got: Vec<_> = audit
        .requests()
        .into_iter()
        .filter(|r| r.reason.starts_with("tls_handshake_rejected:"))
        .map(|r| (r.peer, r.reason, r.count))
        .collect();
    assert_eq!(
        got,
        vec![(
            Some("127.0.0.1".to_string()),
            "tls_handshake_rejected:tls_cert_expired".to_string(),
            Some(2)
        )]
    );
}
