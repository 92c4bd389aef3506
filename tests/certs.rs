//! `meshca certs`: istioctl's ztunnel-config certificates table for a
//! ztunnel config dump, a PEM chain and a live call, verified against a root.
#![allow(clippy::unwrap_used)]

use std::process::Command;

use meshca::app::Deps;
use meshca::ca::generate::KeyType;
use meshca::ca::CaBundle;
use meshca::testing::{self, client_identity, validity_hours, TestPki};
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

/// A chain as ztunnel holds it: leaf, intermediates, root.
fn chain(pki: &TestPki, id: &str) -> Vec<String> {
    let b = CaBundle::load_dir(pki.path(), OffsetDateTime::now_utc()).unwrap();
    let (leaf_and_chain, _) = client_identity(&b, id, &validity_hours(-1, 23));
    let mut out = meshca::ca::chain::split_elements(&leaf_and_chain);
    out.push(pki.ca.root_cert.clone());
    out
}

/// The `certificates` section of ztunnel's /config_dump, written from its format.
fn ztunnel_dump(entries: &[(&str, &str, Vec<String>)]) -> String {
    let certs: Vec<_> = entries
        .iter()
        .map(|(id, state, chain)| {
            serde_json::json!({
                "identity": id,
                "state": state,
                "certChain": chain.iter().map(|pem| serde_json::json!({
                    "pem": pem,
                    "serialNumber": "ignored-we-read-the-pem",
                    "validFrom": "2026-01-01T00:00:00Z",
                    "expirationTime": "2026-01-02T00:00:00Z"
                })).collect::<Vec<_>>()
            })
        })
        .collect();
    serde_json::json!({"workloads": [], "services": [], "policies": [], "certificates": certs})
        .to_string()
}

#[test]
fn ztunnel_dump_table_marks_foreign_chains_invalid() {
    let pki = TestPki::new(KeyType::EcdsaP256);
    let foreign = TestPki::new(KeyType::EcdsaP256);
    let dir = tempfile::tempdir().unwrap();
    let ours = "spiffe://cluster.local/ns/app/sa/reviews";
    let theirs = "spiffe://cluster.local/ns/app/sa/ratings";
    let dump = ztunnel_dump(&[
        (ours, "Available", chain(&pki, ours)),
        (theirs, "Available", chain(&foreign, theirs)),
        (
            "spiffe://cluster.local/ns/app/sa/pending",
            "Initializing",
            vec![],
        ),
    ]);
    let dump_path = dir.path().join("config_dump.json");
    std::fs::write(&dump_path, dump).unwrap();
    let root = pki.path().join("root-cert.pem");

    let (code, out, err) = meshca(&[
        "certs",
        "--root",
        root.to_str().unwrap(),
        "--ztunnel-dump",
        dump_path.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let rows: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        rows[0],
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
    let ours_rows: Vec<_> = rows.iter().filter(|r| r[0] == ours).collect();
    let theirs_rows: Vec<_> = rows.iter().filter(|r| r[0] == theirs).collect();
    // leaf, intermediate, root (from cert-chain.pem), root
    assert_eq!(
        ours_rows.iter().map(|r| r[1]).collect::<Vec<_>>(),
        ["Leaf", "Intermediate", "Intermediate", "Root"]
    );
    assert!(
        ours_rows
            .iter()
            .all(|r| r[2] == "Available" && r[3] == "true"),
        "{out}"
    );
    assert_eq!(theirs_rows.len(), 4);
    assert!(
        theirs_rows.iter().all(|r| r[3] == "false"),
        "foreign CA is not valid here:\n{out}"
    );
    let pending: Vec<_> = rows.iter().filter(|r| r[0].ends_with("/pending")).collect();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0][2], "Initializing");

    let (code, json, _) = meshca(&[
        "certs",
        "--root",
        root.to_str().unwrap(),
        "--ztunnel-dump",
        dump_path.to_str().unwrap(),
        "-o",
        "json",
    ]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let leaf = v
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["certificateName"] == ours && r["type"] == "Leaf")
        .unwrap();
    assert_eq!(leaf["validCert"], true);
    assert_eq!(leaf["status"], "Available");
    assert_eq!(leaf["serialNumber"].as_str().unwrap().len() % 2, 0);
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
    assert_eq!(audit.records().len(), 1);
    assert_eq!(audit.records()[0].serial.as_deref(), Some(leaf_row[4]));
    app.shutdown().await.unwrap();
}
