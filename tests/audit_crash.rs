//! The audit log under a crash: the real server under load is SIGKILLed
//! (file sink, `--audit-fsync always` and `batch`). Every certificate a
//! client received must have its record in the log, the log must verify,
//! and the next run must continue the same chain.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use meshca::audit::verify::{self, VerifyOptions};

async fn serve(
    data: &Path,
    log: &Path,
    fsync: &str,
) -> (tokio::process::Child, std::net::SocketAddr) {
    let mut cmd = meshca::testing::serve_dev_command(env!("CARGO_BIN_EXE_meshca").as_ref(), data);
    cmd.args([
        "--audit-sink",
        "file",
        "--audit-checkpoint-every",
        "50",
        "--audit-fsync",
        fsync,
        "--audit-file",
    ])
    .arg(log);
    let (child, addr, _) = meshca::testing::spawn_listening(cmd).await;
    (child, addr)
}

fn leaf_serial(chain: &[String]) -> String {
    let (_, pem) = x509_parser::pem::parse_x509_pem(chain[0].as_bytes()).unwrap();
    let cert = pem.parse_x509().unwrap();
    meshca::ca::serial_hex(cert.raw_serial())
}

async fn crash_under_load(fsync: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (data, log) = (dir.path().join("data"), dir.path().join("audit.log"));
    let (mut child, addr) = serve(&data, &log, fsync).await;
    let read = |f: &str| std::fs::read_to_string(data.join("dev-client").join(f)).unwrap();
    let (root, chain, key) = (
        read("root-cert.pem"),
        read("cert-chain.pem"),
        read("key.pem"),
    );
    let received = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut tasks = vec![];
    for _ in 0..8 {
        let (root, chain, key, received) =
            (root.clone(), chain.clone(), key.clone(), received.clone());
        tasks.push(tokio::spawn(async move {
            let Ok(mut c) = meshca::testing::client(addr, &root, Some((&chain, &key))).await else {
                return;
            };
            let csr_key = rcgen::KeyPair::generate().unwrap();
            let csr =
                meshca::testing::csr_for(&csr_key, "spiffe://cluster.local/ns/default/sa/default");
            loop {
                match c
                    .create_certificate(meshca::testing::request(csr.clone(), 0, &[]))
                    .await
                {
                    Ok(r) => received
                        .lock()
                        .unwrap()
                        .push(leaf_serial(&r.into_inner().cert_chain)),
                    // The server is gone.
                    Err(_) => return,
                }
            }
        }));
    }
    // Kill mid-load, once enough certificates went out.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while received.lock().unwrap().len() < 300 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    let received: Vec<String> = received.lock().unwrap().clone();
    assert!(received.len() >= 300, "load ran: {}", received.len());

    let lines = verify::read_lines(&[&log]).unwrap();
    let report = verify::verify_lines_with(&lines, &VerifyOptions::default())
        .unwrap_or_else(|f| panic!("{fsync}: the crashed log must verify: {f}"));
    assert_ne!(
        report.last_checkpoint_reason.as_deref(),
        Some("shutdown"),
        "killed, not shut down"
    );
    let logged: HashSet<String> = lines
        .iter()
        .filter_map(|(_, l)| serde_json::from_slice::<serde_json::Value>(l).ok())
        .filter(|v| v["type"] == "audit" && v["decision"] == "allow")
        .filter_map(|v| v["serial"].as_str().map(str::to_string))
        .collect();
    let missing: Vec<&String> = received.iter().filter(|s| !logged.contains(*s)).collect();
    assert!(
        missing.is_empty(),
        "{fsync}: {} of {} received certificates have no record: {:?}",
        missing.len(),
        received.len(),
        &missing[..missing.len().min(5)]
    );

    // The next run continues the chain from the crashed run's last line.
    // (Its start checkpoint may be followed at once by the record of its
    // serving certificate.)
    let crashed = std::fs::read_to_string(&log).unwrap().lines().count();
    let (mut child, _) = serve(&data, &log, fsync).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .skip(crashed)
        .any(|l| l.contains("\"reason\":\"start\""))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no start checkpoint"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let lines = verify::read_lines(&[&log]).unwrap();
    let report = verify::verify_lines(&lines, None).unwrap();
    assert_eq!(report.chain_starts, 1, "one chain across the crash");
    assert_eq!(report.runs.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_with_fsync_always_loses_no_issued_record() {
    crash_under_load("always").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_load_with_fsync_batch_loses_no_issued_record() {
    crash_under_load("batch").await;
}
