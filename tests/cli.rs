//! What a new user does first: `meshca init`, and `meshca serve --dev`
//! (README command one) started twice, called with its dev client identity.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use meshca::ca::CaBundle;
use rcgen::KeyPair;
use time::OffsetDateTime;
use tokio::io::{AsyncBufReadExt, BufReader};

#[test]
fn init_writes_a_cacerts_bundle_meshca_loads() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cacerts");
    for key_type in ["ecdsa-p256", "rsa2048"] {
        let status = Command::new(env!("CARGO_BIN_EXE_meshca"))
            .args([
                "init",
                "--force",
                "--key-type",
                key_type,
                "--intermediate-ttl",
                "720h",
                "--out",
            ])
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            status.status.success(),
            "{}",
            String::from_utf8_lossy(&status.stderr)
        );
        let b = CaBundle::load_dir(&out, OffsetDateTime::now_utc()).unwrap();
        let life = b.signing_not_after() - OffsetDateTime::now_utc();
        assert!(
            life <= time::Duration::hours(720) && life > time::Duration::hours(719),
            "{life}"
        );
        assert_eq!(
            b.key_algorithm(),
            if key_type == "rsa2048" {
                "rsa"
            } else {
                "ecdsa-p256"
            }
        );
    }
    // Without --force an existing bundle is never overwritten.
    let again = Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args(["init", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
}

/// Starts `meshca serve --dev` and returns (child, gRPC addr).
async fn serve_dev(data: &std::path::Path) -> (tokio::process::Child, std::net::SocketAddr) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args([
            "serve",
            "--dev",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(data)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(rest) = line.strip_prefix("listening on ") {
                return rest.split(' ').next().unwrap().parse().unwrap();
            }
        }
        panic!("meshca exited before listening");
    })
    .await
    .unwrap();
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, addr)
}

#[tokio::test]
async fn dev_mode_serves_and_reuses_its_ca_across_restarts() {
    let data = tempfile::tempdir().unwrap();
    let mut fingerprints = Vec::new();
    for _ in 0..2 {
        let (mut child, addr) = serve_dev(data.path()).await;
        let client_dir = data.path().join("dev-client");
        let read = |f: &str| std::fs::read_to_string(client_dir.join(f)).unwrap();
        let mut c = meshca::testing::client(
            addr,
            &read("root-cert.pem"),
            Some((&read("cert-chain.pem"), &read("key.pem"))),
        )
        .await
        .unwrap();
        let id = "spiffe://cluster.local/ns/default/sa/default";
        let key = KeyPair::generate().unwrap();
        let chain = c
            .create_certificate(meshca::testing::request(
                meshca::testing::csr_for(&key, id),
                0,
                &[],
            ))
            .await
            .unwrap()
            .into_inner()
            .cert_chain;
        assert_eq!(chain.last().unwrap(), &read("root-cert.pem"));
        fingerprints.push(
            CaBundle::load_dir(&data.path().join("cacerts"), OffsetDateTime::now_utc())
                .unwrap()
                .fingerprint(),
        );
        child.kill().await.unwrap();
    }
    assert_eq!(
        fingerprints[0], fingerprints[1],
        "the second start reuses the first start's CA"
    );
}
