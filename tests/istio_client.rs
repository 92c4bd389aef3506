//! Istio's own Go CA client against the real `meshca serve` binary.
//!
//! The client (tools/istiod/caclient, built by scripts/istio-caclient from the istio module pinned
//! in tools/istiod) is istio-agent's citadel CA client and Istio's chain verification, so the
//! TLS name rules, per-RPC token handling and response parsing under test are Istio's, not a
//! reimplementation. Its path comes from MESHCA_ISTIO_CACLIENT, which scripts/test exports; the
//! tests fail, never skip, without it.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

const DEV_ID: &str = "spiffe://cluster.local/ns/default/sa/default";
/// The name Istio's client verifies when CA_ADDR contains `localhost` (pilot/pkg/grpc).
const ISTIO_LOCALHOST_NAME: &str = "istiod.istio-system.svc";

fn caclient() -> PathBuf {
    let p = std::env::var_os("MESHCA_ISTIO_CACLIENT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            panic!(
                "MESHCA_ISTIO_CACLIENT is not set: build Istio's Go CA client with \
             `export MESHCA_ISTIO_CACLIENT=$(scripts/istio-caclient)` (scripts/test does this)"
            )
        });
    assert!(
        p.is_file(),
        "MESHCA_ISTIO_CACLIENT={} is not a file; rebuild it with scripts/istio-caclient",
        p.display()
    );
    p
}

struct Server {
    child: tokio::process::Child,
    addr: std::net::SocketAddr,
    /// Audit lines (meshca's stdout).
    audit: tokio::sync::mpsc::UnboundedReceiver<String>,
}

/// Starts `meshca serve` with `args` on free loopback ports; returns once it listens.
/// Kubernetes is off unless `args` name a kubeconfig.
async fn serve(args: &[&str]) -> Server {
    let kube = if args.contains(&"--kubeconfig") {
        "on"
    } else {
        "off"
    };
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_meshca"))
        .arg("serve")
        .args(args)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--kubernetes",
            kube,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let (addr, _) =
        meshca::testing::await_listening(child.stderr.take().unwrap(), Duration::from_secs(30))
            .await;
    let (tx, audit) = tokio::sync::mpsc::unbounded_channel();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    tokio::spawn(async move {
        while let Ok(Some(l)) = out.next_line().await {
            let _ = tx.send(l);
        }
    });
    Server { child, addr, audit }
}

async fn serve_dev(data: &Path) -> Server {
    serve(&["--dev", "--data-dir", data.to_str().unwrap()]).await
}

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

/// Runs Istio's client against `addr` (CA_ADDR) with the dev client identity in `data`.
async fn istio_client(data: &Path, addr: &str, extra: &[&str]) -> Run {
    let d = data.join("dev-client");
    let out = tokio::process::Command::new(caclient())
        .args(["--addr", addr, "--root"])
        .arg(d.join("root-cert.pem"))
        .arg("--cert")
        .arg(d.join("cert-chain.pem"))
        .arg("--key")
        .arg(d.join("key.pem"))
        .args(["--timeout", "60s"])
        .args(extra)
        .output()
        .await
        .unwrap();
    Run {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Next audit record from the server, as JSON.
async fn next_audit(s: &mut Server) -> serde_json::Value {
    loop {
        let line = tokio::time::timeout(Duration::from_secs(10), s.audit.recv())
            .await
            .expect("an audit record")
            .expect("meshca's stdout is open");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        // Checkpoint lines commit to the chain; requests carry a decision
        // (records of meshca's own serving certificate carry issued_kind).
        if v.get("decision").is_some() && v.get("issued_kind").is_none() {
            return v;
        }
    }
}

fn leaf_serial(chain_pem: &str) -> String {
    use rustls_pki_types::pem::PemObject;
    let der = rustls_pki_types::CertificateDer::from_pem_slice(chain_pem.as_bytes()).unwrap();
    let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
    meshca::ca::serial_hex(cert.raw_serial())
}

#[tokio::test]
async fn istio_agent_client_gets_a_verified_chain_from_dev_mode_at_localhost() {
    let bin = caclient();
    let data = tempfile::tempdir().unwrap();
    let mut server = serve_dev(data.path()).await;
    let addr = format!("localhost:{}", server.addr.port());
    let root = std::fs::read_to_string(data.path().join("dev-client/root-cert.pem")).unwrap();

    // RSA 2048 is the agent's default key; ECDSA its ECC_SIGNATURE_ALGORITHM=ECDSA setting.
    for extra in [&[][..], &["--ec"][..]] {
        let run = istio_client(data.path(), &addr, extra).await;
        assert!(
            run.ok,
            "{} {extra:?} against {addr}:\n{}",
            bin.display(),
            run.stderr
        );
        let v: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
        assert_eq!(v["verified"], true);
        assert_eq!(v["identity"], DEV_ID);
        let chain: Vec<String> = v["certChain"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            v["rootCert"],
            root.as_str(),
            "the response ends in the root"
        );

        // Checked again independently of Go: the chain verifies to the dev root, leaf is DEV_ID.
        let trust = meshca::certs::Trust::from_pem(&root).unwrap();
        let rows = meshca::certs::pem_rows(
            &format!("{}{root}", chain.concat()),
            &trust,
            time::OffsetDateTime::now_utc(),
        )
        .unwrap();
        assert_eq!(rows[0].kind, "Leaf");
        assert_eq!(rows[0].certificate_name, DEV_ID);
        assert!(rows.iter().all(|r| r.valid_cert), "{rows:?}");

        // And it is the certificate meshca audited as issued.
        let rec = next_audit(&mut server).await;
        assert_eq!(rec["decision"], "allow", "{rec}");
        assert_eq!(rec["requested_identity"], DEV_ID, "{rec}");
        assert_eq!(rec["serial"], leaf_serial(&chain[0]).as_str(), "{rec}");
    }

    // The name Istio's client checks is in dev mode's serving certificate: a plain rustls
    // client verifying that name gets a certificate too.
    let d = data.path().join("dev-client");
    let read = |f: &str| std::fs::read_to_string(d.join(f)).unwrap();
    let live = meshca::certs::fetch_live(&meshca::certs::LiveCall {
        addr: server.addr.to_string(),
        server_name: ISTIO_LOCALHOST_NAME.into(),
        root_pem: read("root-cert.pem"),
        client: Some((read("cert-chain.pem"), read("key.pem"))),
        identity: Some(DEV_ID.into()),
        ..Default::default()
    })
    .await;
    assert!(live.is_ok(), "{live:?}");
    server.child.kill().await.unwrap();
}

/// Without `istiod.istio-system.svc` among the serving names (here: meshca outside dev mode,
/// with its default names, on the same CA), Istio's client cannot use meshca by `localhost`:
/// it verifies the rewritten name and the handshake fails. By IP it works, so the name is the
/// only difference.
#[tokio::test]
async fn istio_client_at_localhost_needs_the_istiod_serving_name() {
    caclient();
    let data = tempfile::tempdir().unwrap();
    // Creates the dev CA and client identity, then stops.
    let mut dev = serve_dev(data.path()).await;
    dev.child.kill().await.unwrap();
    let ca_dir = data.path().join("cacerts");
    let mut server = serve(&["--ca-dir", ca_dir.to_str().unwrap()]).await;

    let run = istio_client(
        data.path(),
        &format!("localhost:{}", server.addr.port()),
        &["--timeout", "20s"],
    )
    .await;
    assert!(!run.ok, "{}", run.stdout);
    assert!(
        run.stderr.contains(ISTIO_LOCALHOST_NAME),
        "the handshake failure names the rewritten server name: {}",
        run.stderr
    );

    let run = istio_client(
        data.path(),
        &format!("127.0.0.1:{}", server.addr.port()),
        &[],
    )
    .await;
    assert!(run.ok, "{}", run.stderr);
    assert_eq!(next_audit(&mut server).await["decision"], "allow");
    server.child.kill().await.unwrap();
}

/// The agent's bearer-token path (its JWT credential fetcher, `Bearer <token>` per RPC) reaches
/// meshca: in dev mode there is no TokenReview, so a token-only caller is refused with istiod's
/// code and message, and the audit record's reason says a token arrived (not "no credentials").
#[tokio::test]
async fn istio_client_token_caller_is_refused_without_kubernetes() {
    let bin = caclient();
    let data = tempfile::tempdir().unwrap();
    let mut server = serve_dev(data.path()).await;
    let token = data.path().join("token");
    std::fs::write(&token, "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln\n").unwrap();
    let d = data.path().join("dev-client");
    let out = tokio::process::Command::new(bin)
        .args(["--addr", &format!("localhost:{}", server.addr.port())])
        .arg("--root")
        .arg(d.join("root-cert.pem"))
        .arg("--token-file")
        .arg(&token)
        .args(["--identity", DEV_ID, "--timeout", "60s"])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("Unauthenticated") && stderr.contains("request authenticate failure"),
        "{stderr}"
    );
    let rec = next_audit(&mut server).await;
    assert_eq!(rec["decision"], "deny", "{rec}");
    assert_eq!(rec["reason"], "authn_token_disabled", "{rec}");
    // Never the token itself.
    assert!(!rec.to_string().contains("c2ln"), "{rec}");
    server.child.kill().await.unwrap();
}

/// README's Istio-client command, run as written (with the client scripts/test built standing
/// in for `$(scripts/istio-caclient)`, and the server's free port for 15012) against
/// `serve --dev` in an empty HOME.
#[tokio::test]
async fn readme_istio_client_command_works() {
    let bin = caclient();
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("Run it locally"))
        .unwrap();
    let blocks: Vec<&str> = section
        .split("```sh\n")
        .skip(1)
        .map(|b| b.split("```").next().unwrap())
        .collect();
    let d_line = blocks[1]
        .lines()
        .find(|l| l.starts_with("D="))
        .expect("README's second command sets D");
    let istio = blocks
        .iter()
        .find(|b| b.contains("$(scripts/istio-caclient)"))
        .expect("README shows Istio's client");
    assert!(istio.contains("localhost:15012"), "{istio}");

    let home = tempfile::tempdir().unwrap();
    let data = home.path().join(".local/share/meshca");
    let mut server = serve_dev(&data).await;
    let script = format!(
        "set -eu\n{d_line}\n{}",
        istio
            .replace("$(scripts/istio-caclient)", bin.to_str().unwrap())
            .replace(
                "localhost:15012",
                &format!("localhost:{}", server.addr.port())
            )
    );
    let out = tokio::process::Command::new("bash")
        .arg("-c")
        .arg(&script)
        .env("HOME", home.path())
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{script}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verified"], true);
    assert_eq!(v["identity"], DEV_ID);
    assert_eq!(next_audit(&mut server).await["decision"], "allow");
    server.child.kill().await.unwrap();
}

/// The agent's token path end to end: Istio's client sends a pod-bound ServiceAccount token
/// (audience istio-ca, minted by the real kube-apiserver's TokenRequest API) as its bearer
/// credential and no client certificate; meshca reviews it and issues the token's identity.
#[tokio::test]
async fn istio_client_token_caller_gets_its_identity_with_kubernetes() {
    let bin = caclient();
    let kte = common::kte().await;
    let ns = kte.namespace("istio-client").await;
    kte.service_account(&ns, "app").await;
    let uid = kte.pod(&ns, "app-0", "app", "node-a").await;
    let token = kte
        .token(&ns, "app", Some(("app-0", &uid)), "istio-ca")
        .await;
    let data = tempfile::tempdir().unwrap();
    let token_file = data.path().join("istio-token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let kubeconfig = kte.meshca_kubeconfig();
    let mut server = serve(&[
        "--dev",
        "--data-dir",
        data.path().to_str().unwrap(),
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
    ])
    .await;
    let id = common::spiffe(&ns, "app");
    let out = tokio::process::Command::new(bin)
        .args(["--addr", &format!("localhost:{}", server.addr.port())])
        .arg("--root")
        .arg(data.path().join("dev-client/root-cert.pem"))
        .arg("--token-file")
        .arg(&token_file)
        .args(["--identity", &id, "--timeout", "60s"])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verified"], true);
    assert_eq!(v["token"], true);
    assert_eq!(v["identity"], id.as_str());
    let rec = next_audit(&mut server).await;
    assert_eq!(rec["decision"], "allow", "{rec}");
    assert_eq!(rec["authn_method"], "token-review", "{rec}");
    assert_eq!(rec["caller_pod"], format!("{ns}/app-0").as_str(), "{rec}");
    assert_eq!(
        rec["serial"],
        leaf_serial(v["certChain"][0].as_str().unwrap()).as_str(),
        "{rec}"
    );
    server.child.kill().await.unwrap();
}
