//! A run that starts while the API server is away anchors its start once the
//! API server is back, before any later checkpoint, so the replica's anchor
//! history stays whole and `verify --anchors` accepts the log. Its own test
//! binary so the outage cannot disturb other tests (cargo runs test
//! binaries one by one).
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::ListParams;
use kube::Api;

/// A file-sink meshca anchoring into `ns`: (child, gRPC address, admin address).
async fn start(
    k: &common::Kte,
    ns: &str,
    data: &Path,
    key: &Path,
    log: &Path,
) -> (
    tokio::process::Child,
    std::net::SocketAddr,
    std::net::SocketAddr,
) {
    let mut cmd = meshca::testing::serve_dev_command(env!("CARGO_BIN_EXE_meshca").as_ref(), data);
    cmd.args(["--audit-sink", "file", "--audit-file"])
        .arg(log)
        .args([
            "--audit-anchor",
            "true",
            "--audit-anchor-namespace",
            ns,
            "--mtls-renewal-pod-check",
            "false",
        ])
        .arg("--kubeconfig")
        .arg(k.meshca_kubeconfig())
        .env("POD_NAME", "meshca-0")
        .env("MESHCA_AUDIT_CHECKPOINT_KEY", key)
        // Only start and shutdown checkpoints: nothing else waits for the interval.
        .env("MESHCA_AUDIT_CHECKPOINT_INTERVAL", "1h");
    meshca::testing::spawn_listening(cmd).await
}

async fn issue_one(data: &Path, addr: std::net::SocketAddr) {
    let mut c = meshca::testing::dev_client(addr, data).await;
    let csr_key = rcgen::KeyPair::generate().unwrap();
    c.create_certificate(meshca::testing::request(
        meshca::testing::csr_for(&csr_key, "spiffe://cluster.local/ns/default/sa/default"),
        0,
        &[],
    ))
    .await
    .unwrap();
}

async fn stop(child: tokio::process::Child) {
    let status = meshca::testing::terminate(child, Duration::from_secs(30)).await;
    assert!(status.success(), "{status}");
}

fn scrape(admin: std::net::SocketAddr) -> String {
    let out = std::process::Command::new("curl")
        .args(["-sf", &format!("http://{admin}/metrics")])
        .output()
        .unwrap();
    assert!(out.status.success(), "scraping {admin}");
    String::from_utf8(out.stdout).unwrap()
}

/// The value of the sample named exactly `series` (name and labels).
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

async fn anchored_lines(k: &common::Kte, ns: &str) -> Vec<String> {
    Api::<ConfigMap>::namespaced(k.admin.clone(), ns)
        .list(&ListParams::default().labels("audit.meshca.io/kind=checkpoint"))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|c| c.data.unwrap()["checkpoint"].clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_during_an_api_outage_is_anchored_when_it_returns() {
    let k = common::kte().await;
    let ns = k.namespace("audit-anchor-outage").await;
    k.meshca_role(&ns, "tests/fixtures/rbac-audit-anchor.yaml")
        .await;
    let dir = tempfile::tempdir().unwrap();
    let (data, key, log) = (
        dir.path().join("data"),
        dir.path().join("checkpoint.pem"),
        dir.path().join("audit.log"),
    );
    std::fs::write(
        &key,
        meshca::audit::keys::CheckpointKey::generate_pem().unwrap(),
    )
    .unwrap();

    // Run 1: start and shutdown anchored.
    let (child, addr, _) = start(&k, &ns, &data, &key, &log).await;
    issue_one(&data, addr).await;
    stop(child).await;
    assert_eq!(anchored_lines(&k, &ns).await.len(), 2);

    // Run 2 starts while the API server is away and keeps issuing.
    common::kte_script("stop-apiserver", &k.dir);
    let (child, addr, admin) = start(&k, &ns, &data, &key, &log).await;
    issue_one(&data, addr).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The start has waited since the run began: the lag the alert reads.
    let during = scrape(admin);
    let pending = sample(&during, "meshca_audit_anchor_pending_seconds");
    assert!(
        pending >= 2.0,
        "pending {pending} during the outage:\n{during}"
    );
    assert_eq!(
        sample(&during, "meshca_audit_anchor_interval_seconds"),
        60.0,
        "{during}"
    );
    common::kte_script("start-apiserver", &k.dir);
    let run2_start = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .find(|l| l.contains("\"reason\":\"start\"") && l.contains("\"from\":\"file\""))
        .unwrap()
        .to_string();
    let until = Instant::now() + Duration::from_secs(60);
    while !anchored_lines(&k, &ns).await.contains(&run2_start) {
        assert!(Instant::now() < until, "run 2's start was never anchored");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let failed = sample(
        &scrape(admin),
        "meshca_audit_anchor_writes_total{result=\"audit_anchor_write_failed\"}",
    );
    assert!(failed >= 1.0, "failed attempts are counted: {failed}");
    // Once the start is written nothing waits.
    let until = Instant::now() + Duration::from_secs(10);
    while sample(&scrape(admin), "meshca_audit_anchor_pending_seconds") != 0.0 {
        assert!(Instant::now() < until, "the anchor lag never returned to 0");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    issue_one(&data, addr).await;
    stop(child).await;

    let admin_kc = k.dir.join("admin.kubeconfig");
    let (code, text) = meshca::testing::output_text(
        std::process::Command::new(env!("CARGO_BIN_EXE_meshca"))
            .args(["audit", "verify", "--strict", "--key"])
            .arg(&key)
            .args(["--anchors", "--kubeconfig"])
            .arg(&admin_kc)
            .args(["--anchor-namespace", &ns])
            .arg(&log),
    );
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("4 anchor(s), 4 in the log, 2 run(s)"),
        "{text}"
    );
}
