//! `meshca certs`: istioctl's ztunnel-config certificates table for a
//! ztunnel config dump, a PEM chain and a live call, verified against a root.
#![allow(clippy::unwrap_used)]

use std::process::Command;

use meshca::app::Deps;
use meshca::ca::generate::KeyType;
use meshca::ca::CaBundle;
use meshca::testing::{self, client_identity, validity_hours, TestPki};
use rustls_pki_types::pem::PemObject;
use time::OffsetDateTime;

fn meshca(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A CreateCertificate response from `pki`: leaf, intermediate, the root cert-chain.pem
/// carries, root bundle.
fn chain(pki: &TestPki, id: &str) -> Vec<String> {
    let b = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
    let (leaf_and_chain, _) = client_identity(&b, id, &validity_hours(-1, 23));
    let mut out = meshca::ca::chain::split_elements(&leaf_and_chain);
    out.push(pki.ca.root_cert.clone());
    out
}

/// ztunnel's own serialization of its certificates, written from its source (istio/ztunnel
/// `src/admin.rs`, `src/tls/certificate.rs`, `src/identity/manager.rs` at 62d82653), not from
/// meshca's reading of it:
/// - `/config_dump` is a pretty-printed JSON object; `certificates` holds one entry per identity,
///   sorted by identity: `{identity, state, certChain, rootCerts}` (camelCase);
/// - `state` is `Initializing`, `Available` or `Unavailable: <error>` (the error's Display);
///   only `Available` entries carry certificates;
/// - a CreateCertificate response `[leaf, intermediates..., root bundle]` is held as ztunnel's
///   WorkloadCertificate holds it: the last element is split into `rootCerts` (a bundle may hold
///   several roots), everything before it is `certChain`;
/// - each certificate is `{pem, serialNumber, validFrom, expirationTime}`: `pem` is the standard
///   base64 of the PEM text, whose body ztunnel wraps at 60 columns; `serialNumber` is the
///   decimal serial; times are RFC 3339 in whole seconds with `Z`.
mod ztunnel {
    use base64::Engine;
    use rustls_pki_types::pem::PemObject;
    use serde_json::{json, Value};

    pub enum State {
        Initializing,
        /// The CreateCertificate response chain.
        Available(Vec<String>),
        Unavailable(String),
    }

    /// How the `pem` field is written: ztunnel's base64 of PEM text, or raw PEM (the form
    /// meshca's first fixture used, and hand-edited dumps may have).
    #[derive(Clone, Copy)]
    pub enum PemField {
        Base64,
        Raw,
    }

    fn ders(pem: &str) -> Vec<Vec<u8>> {
        rustls_pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
            .map(|c| c.unwrap().to_vec())
            .collect()
    }

    fn pem_text(der: &[u8]) -> String {
        let b64 = base64::engine::general_purpose::STANDARD.encode(der);
        let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
        for line in b64.as_bytes().chunks(60) {
            out.push_str(std::str::from_utf8(line).unwrap());
            out.push('\n');
        }
        out.push_str("-----END CERTIFICATE-----\n");
        out
    }

    fn rfc3339(t: x509_parser::time::ASN1Time) -> String {
        t.to_datetime()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap()
    }

    fn cert_dump(der: &[u8], form: PemField) -> Value {
        let (_, cert) = x509_parser::parse_x509_certificate(der).unwrap();
        let text = pem_text(der);
        json!({
            "pem": match form {
                PemField::Base64 => base64::engine::general_purpose::STANDARD.encode(&text),
                PemField::Raw => text,
            },
            "serialNumber": cert.serial.to_string(),
            "validFrom": rfc3339(cert.validity().not_before),
            "expirationTime": rfc3339(cert.validity().not_after),
        })
    }

    /// The `certificates` array (also what `istioctl ztunnel-config certificates -o json` prints).
    pub fn certificates(entries: &[(&str, State)], form: PemField) -> Value {
        let mut out: Vec<Value> = entries
            .iter()
            .map(|(id, state)| {
                let (state, chain, roots) = match state {
                    State::Initializing => ("Initializing".to_string(), vec![], vec![]),
                    State::Unavailable(e) => (format!("Unavailable: {e}"), vec![], vec![]),
                    State::Available(resp) => {
                        let (bundle, chain) = resp.split_last().unwrap();
                        (
                            "Available".to_string(),
                            chain.iter().flat_map(|c| ders(c)).collect(),
                            ders(bundle),
                        )
                    }
                };
                json!({
                    "identity": id,
                    "state": state,
                    "certChain": chain.iter().map(|d| cert_dump(d, form)).collect::<Vec<_>>(),
                    "rootCerts": roots.iter().map(|d| cert_dump(d, form)).collect::<Vec<_>>(),
                })
            })
            .collect();
        out.sort_by(|a, b| a["identity"].as_str().cmp(&b["identity"].as_str()));
        Value::Array(out)
    }

    /// A whole `/config_dump` body, as `curl localhost:15000/config_dump` prints it.
    pub fn config_dump(entries: &[(&str, State)], form: PemField) -> String {
        serde_json::to_string_pretty(&json!({
            "workloads": [{"uid": "Kubernetes//Pod/app/reviews-1", "name": "reviews-1", "namespace": "app"}],
            "services": [],
            "policies": [],
            "staticConfig": {"workloads": [], "services": [], "policies": []},
            "version": {"version": "1.30.3", "rustVersion": "1.90.0", "buildProfile": "release"},
            "config": {"caAddress": "https://meshca.istio-system.svc:15012", "clusterId": "Kubernetes"},
            "certificates": certificates(entries, form),
        }))
        .unwrap()
    }
}

fn parse_rows(out: &str) -> Vec<Vec<String>> {
    out.lines()
        .skip(1)
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// A node's ztunnel as it would be dumped: two identities fetched from a live meshca, one from
/// another CA, one whose certificate expired (held with a two-root bundle), one still
/// initializing and one whose fetch failed.
struct NodeDump {
    pki: TestPki,
    ours: &'static str,
    other: &'static str,
    foreign: &'static str,
    expired: &'static str,
    pending: &'static str,
    failed: &'static str,
    failure: String,
    responses: Vec<(&'static str, Vec<String>)>,
}

impl NodeDump {
    async fn new() -> Self {
        let pki = TestPki::new(KeyType::EcdsaP256);
        let foreign_pki = TestPki::new(KeyType::EcdsaP256);
        let ours = "spiffe://cluster.local/ns/app/sa/reviews";
        let other = "spiffe://cluster.local/ns/app/sa/details";
        let b = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
        let (app, _audit) =
            testing::start_server(&testing::test_config(pki.path_buf()), Deps::default()).await;
        let mut responses = Vec::new();
        for id in [ours, other] {
            // A real CreateCertificate response, as ztunnel receives it.
            let (cert, key) = client_identity(&b, id, &validity_hours(-1, 1));
            let live = meshca::certs::fetch_live(&meshca::certs::LiveCall {
                addr: app.addr.to_string(),
                server_name: "localhost".into(),
                root_pem: pki.ca.root_cert.clone(),
                client: Some((cert, key)),
                identity: Some(id.into()),
                ..Default::default()
            })
            .await
            .unwrap();
            responses.push((id, live.chain));
        }
        app.shutdown().await.unwrap();
        let foreign = "spiffe://cluster.local/ns/app/sa/ratings";
        responses.push((foreign, chain(&foreign_pki, foreign)));
        let expired = "spiffe://cluster.local/ns/app/sa/old";
        let (leaf_and_chain, _) = client_identity(&b, expired, &validity_hours(-48, -24));
        let mut expired_resp = meshca::ca::chain::split_elements(&leaf_and_chain);
        expired_resp.push(format!("{}{}", pki.ca.root_cert, foreign_pki.ca.root_cert));
        responses.push((expired, expired_resp));
        Self {
            pki,
            ours,
            other,
            foreign,
            expired,
            pending: "spiffe://cluster.local/ns/app/sa/pending",
            failed: "spiffe://cluster.local/ns/app/sa/denied",
            // ztunnel's identity::Error::SigningRequest display of a gRPC status.
            failure: format!(
                "signing gRPC error ({}): request authenticate failure",
                tonic::Code::Unauthenticated
            ),
            responses,
        }
    }

    fn entries(&self) -> Vec<(&str, ztunnel::State)> {
        let mut e: Vec<_> = self
            .responses
            .iter()
            .map(|(id, r)| (*id, ztunnel::State::Available(r.clone())))
            .collect();
        e.push((self.pending, ztunnel::State::Initializing));
        e.push((
            self.failed,
            ztunnel::State::Unavailable(self.failure.clone()),
        ));
        e
    }

    fn root(&self) -> String {
        self.pki.path().join("root-cert.pem").display().to_string()
    }
}

/// What `meshca certs` must print for [`NodeDump`], whatever form the dump arrives in.
fn assert_node_rows(d: &NodeDump, out: &str) {
    let rows = parse_rows(out);
    let of = |id: &str| -> Vec<&Vec<String>> { rows.iter().filter(|r| r[0] == id).collect() };
    // One row per certificate: certChain (leaf, intermediate, the root cert-chain.pem carries)
    // and rootCerts, typed by position as istioctl types them.
    for id in [d.ours, d.other] {
        let r = of(id);
        assert_eq!(
            r.iter().map(|r| r[1].as_str()).collect::<Vec<_>>(),
            ["Leaf", "Intermediate", "Intermediate", "Root"],
            "{id}:\n{out}"
        );
        assert!(
            r.iter().all(|r| r[2] == "Available" && r[3] == "true"),
            "{out}"
        );
    }
    let foreign = of(d.foreign);
    assert_eq!(foreign.len(), 4, "{out}");
    assert!(
        foreign.iter().all(|r| r[3] == "false"),
        "foreign CA:\n{out}"
    );
    // Expired: still rows, VALID CERT false; this leaf ended before its intermediate began, so
    // the chain never verified and the intermediate is not valid for it either; the root copy
    // is one of ROOT's; the bundle's second root is not ours.
    let expired = of(d.expired);
    assert_eq!(
        expired
            .iter()
            .map(|r| (r[1].as_str(), r[3].as_str()))
            .collect::<Vec<_>>(),
        [
            ("Leaf", "false"),
            ("Intermediate", "false"),
            ("Intermediate", "true"),
            ("Root", "true"),
            ("Root", "false")
        ],
        "{out}"
    );
    // No chain: istioctl's NA in TYPE, SERIAL NUMBER, NOT AFTER and NOT BEFORE.
    for (id, state) in [(d.pending, "Initializing"), (d.failed, "Unavailable")] {
        let r = of(id);
        assert_eq!(r.len(), 1, "{out}");
        assert_eq!(
            &r[0][1..],
            ["NA", state, "false", "NA", "NA", "NA"],
            "{out}"
        );
    }
    // Serial numbers are the PEM's, in istioctl's hex.
    let leaf = &of(d.ours)[0];
    let pem = &d.responses[0].1[0];
    let der = rustls_pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
    let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
    assert_eq!(leaf[4], meshca::ca::serial_hex(cert.raw_serial()));
    assert_eq!(rows.len(), 4 + 4 + 4 + 5 + 1 + 1, "{out}");
}

#[tokio::test]
async fn ztunnel_config_dump_as_ztunnel_writes_it() {
    let d = NodeDump::new().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config_dump.json");
    std::fs::write(
        &path,
        ztunnel::config_dump(&d.entries(), ztunnel::PemField::Base64),
    )
    .unwrap();
    let root = d.root();
    let dump = path.to_str().unwrap();
    let (code, out, err) = meshca(&["certs", "--root", &root, "--ztunnel-dump", dump]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out.lines()
            .next()
            .unwrap()
            .split_whitespace()
            .collect::<Vec<_>>(),
        [
            "CERTIFICATE",
            "NAME",
            "TYPE",
            "STATUS",
            "VALID",
            "CERT",
            "SERIAL",
            "NUMBER",
            "NOT",
            "AFTER",
            "NOT",
            "BEFORE"
        ]
    );
    assert_node_rows(&d, &out);
    // The failure is not lost: on stderr beside the table, in the row for JSON.
    assert!(err.contains(&d.failure), "{err}");

    let (code, json, err) = meshca(&[
        "certs",
        "--root",
        &root,
        "--ztunnel-dump",
        dump,
        "-o",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let rows = v.as_array().unwrap();
    let failed = rows
        .iter()
        .find(|r| r["certificateName"] == d.failed)
        .unwrap();
    assert_eq!(failed["status"], "Unavailable");
    assert_eq!(failed["error"], d.failure.as_str());
    let leaf = rows
        .iter()
        .find(|r| r["certificateName"] == d.ours && r["type"] == "Leaf")
        .unwrap();
    assert_eq!(leaf["validCert"], true);
    assert!(leaf.get("error").is_none(), "{leaf}");
}

/// `kubectl exec ds/ztunnel -- curl -s localhost:15000/config_dump | meshca certs --ztunnel-dump -`
#[tokio::test]
async fn ztunnel_config_dump_piped_on_stdin() {
    let d = NodeDump::new().await;
    let dump = ztunnel::config_dump(&d.entries(), ztunnel::PemField::Base64);
    let mut certs = Command::new(env!("CARGO_BIN_EXE_meshca"));
    certs.args(["certs", "--root", &d.root(), "--ztunnel-dump", "-"]);
    assert_node_rows(&d, &with_stdin(certs, &dump));
}

/// The stdout of `cmd` fed `input` on stdin; it must succeed.
fn with_stdin(mut cmd: Command, input: &str) -> String {
    use std::io::Write;
    let mut child = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Raw PEM in `pem` (hand-edited dumps) and istioctl's `ztunnel-config certificates -o json`
/// (the bare `certificates` array) read the same as ztunnel's own dump.
#[tokio::test]
async fn raw_pem_and_istioctl_json_forms() {
    let d = NodeDump::new().await;
    let dir = tempfile::tempdir().unwrap();
    let forms = [
        (
            "raw.json",
            ztunnel::config_dump(&d.entries(), ztunnel::PemField::Raw),
        ),
        (
            "istioctl.json",
            serde_json::to_string_pretty(&ztunnel::certificates(
                &d.entries(),
                ztunnel::PemField::Base64,
            ))
            .unwrap(),
        ),
    ];
    for (name, text) in forms {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        let root = d.root();
        let (code, out, err) = meshca(&[
            "certs",
            "--root",
            &root,
            "--ztunnel-dump",
            path.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{name}: {err}");
        assert_node_rows(&d, &out);
    }
}

#[test]
fn unreadable_certificate_in_a_dump_is_a_clear_error() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let dir = tempfile::tempdir().unwrap();
    let id = "spiffe://cluster.local/ns/app/sa/reviews";
    let mut v: serde_json::Value = serde_json::from_str(&ztunnel::config_dump(
        &[(id, ztunnel::State::Available(chain(&pki, id)))],
        ztunnel::PemField::Base64,
    ))
    .unwrap();
    // Base64 of "not a certificate".
    v["certificates"][0]["certChain"][1]["pem"] = "bm90IGEgY2VydGlmaWNhdGU=".into();
    let path = dir.path().join("dump.json");
    std::fs::write(&path, v.to_string()).unwrap();
    let root = pki.path().join("root-cert.pem");
    let (code, out, err) = meshca(&[
        "certs",
        "--root",
        root.to_str().unwrap(),
        "--ztunnel-dump",
        path.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(
        err.contains(id) && err.contains("certChain[1]"),
        "the error names the identity and the certificate: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[tokio::test]
async fn pem_file_and_live_call() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let b = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let id = "spiffe://cluster.local/ns/default/sa/client";
    let pem_path = dir.path().join("chain.pem");
    std::fs::write(&pem_path, chain(&pki, id).concat()).unwrap();
    let root = pki.path().join("root-cert.pem");
    let (code, out, err) = meshca(&[
        "certs",
        "--root",
        root.to_str().unwrap(),
        "--pem",
        pem_path.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines().nth(1).unwrap().starts_with(id)
            && out.lines().nth(1).unwrap().contains(" Leaf "),
        "{out}"
    );

    let (app, audit) =
        testing::start_server(&testing::test_config(pki.path_buf()), Deps::default()).await;
    let (cert, key) = client_identity(&b, id, &validity_hours(-1, 1));
    std::fs::write(dir.path().join("c.pem"), &cert).unwrap();
    std::fs::write(dir.path().join("k.pem"), &key).unwrap();
    let addr = app.addr.to_string();
    let args: Vec<String> = vec![
        "certs".into(),
        "--root".into(),
        root.display().to_string(),
        "--addr".into(),
        addr,
        "--cert".into(),
        dir.path().join("c.pem").display().to_string(),
        "--key".into(),
        dir.path().join("k.pem").display().to_string(),
    ];
    let (code, out, err) = tokio::task::spawn_blocking(move || {
        meshca(&args.iter().map(String::as_str).collect::<Vec<_>>())
    })
    .await
    .unwrap();
    assert_eq!(code, 0, "{err}");
    let leaf_row: Vec<&str> = out.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(&leaf_row[..4], [id, "Leaf", "Available", "true"], "{out}");
    assert_eq!(audit.requests().len(), 1);
    assert_eq!(audit.requests()[0].serial.as_deref(), Some(leaf_row[4]));
    app.shutdown().await.unwrap();
}

/// istioctl's own writer of the `ztunnel-config certificates` table
/// (tools/istiod/certsummary, built by `scripts/istio-caclient certsummary`).
fn istioctl_certsummary() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("MESHCA_ISTIO_CERTSUMMARY") {
        return p.into();
    }
    let out = Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/istio-caclient"
    ))
    .arg("certsummary")
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "scripts/istio-caclient certsummary failed (needs Go): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().into()
}

fn istioctl_table(dump: &str) -> String {
    with_stdin(Command::new(istioctl_certsummary()), dump)
}

/// A fixed dump in ztunnel's format (tests/fixtures/ztunnel-certs, made by its generate.sh: an
/// Available identity, a legacy one without rootCerts, an expired leaf, an Initializing and an
/// Unavailable identity) prints byte for byte what istioctl's writer printed for it.
#[test]
fn golden_ztunnel_dump_prints_what_istioctl_prints() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/ztunnel-certs");
    let (code, out, err) = meshca(&[
        "certs",
        "--root",
        &format!("{dir}/root-cert.pem"),
        "--ztunnel-dump",
        &format!("{dir}/config_dump.json"),
    ]);
    assert_eq!(code, 0, "{err}");
    let golden = std::fs::read_to_string(format!("{dir}/golden.txt")).unwrap();
    assert_eq!(out, golden, "meshca:\n{out}\nistioctl:\n{golden}");
    assert!(out.contains("     NA     "), "{out}");
    // The Unavailable identity's error, which istioctl drops, goes to stderr.
    assert!(err.contains("request authenticate failure"), "{err}");
}

/// The same comparison on a dump of a live meshca's responses, with istioctl's writer run now.
/// One difference is deliberate: istioctl's VALID CERT is the certificate's own validity period,
/// meshca also requires the chain to lead to --root, so a chain from another CA is `false` (as
/// are a root of the bundle that is not ROOT's, and the intermediate of a leaf that ended before
/// the intermediate began: NodeDump's expired identity has both, and is compared apart).
#[tokio::test]
async fn live_dump_prints_what_istioctl_prints() {
    let d = NodeDump::new().await;
    let same: Vec<_> = d
        .entries()
        .into_iter()
        .filter(|(id, _)| *id != d.foreign && *id != d.expired)
        .collect();
    let dump = ztunnel::config_dump(&same, ztunnel::PemField::Base64);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config_dump.json");
    // `meshca certs` of `dump` as a file.
    let ours = |dump: &str| {
        std::fs::write(&path, dump).unwrap();
        let (code, out, err) = meshca(&[
            "certs",
            "--root",
            &d.root(),
            "--ztunnel-dump",
            path.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        out
    };
    assert_eq!(ours(&dump), istioctl_table(&dump));

    for (id, diverging) in [(d.foreign, vec![0, 1, 2, 3]), (d.expired, vec![1, 4])] {
        let dump = ztunnel::config_dump(
            &d.entries()
                .into_iter()
                .filter(|(i, _)| *i == id)
                .collect::<Vec<_>>(),
            ztunnel::PemField::Base64,
        );
        let out = ours(&dump);
        let theirs = istioctl_table(&dump);
        let (ours, theirs_rows) = (parse_rows(&out), parse_rows(&theirs));
        assert_eq!(ours.len(), theirs_rows.len());
        for (i, (o, t)) in ours.iter().zip(&theirs_rows).enumerate() {
            if diverging.contains(&i) {
                assert_eq!(
                    (o[3].as_str(), t[3].as_str()),
                    ("false", "true"),
                    "{id} row {i}:\n{out}\n{theirs}"
                );
                assert_eq!(o[..3], t[..3]);
                assert_eq!(o[4..], t[4..]);
            } else {
                assert_eq!(o, t, "{id} row {i}");
            }
        }
    }
}
