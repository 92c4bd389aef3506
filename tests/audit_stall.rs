//! A stalled audit stream: meshca writes its audit log to stdout and the
//! reader stops reading, so the pipe fills and the writer thread blocks in
//! write(2). /healthz must keep answering, requests must be shed with
//! UNAVAILABLE (reason audit_queue_full) instead of piling up on the runtime,
//! and no certificate may leave without its record: once the reader resumes,
//! every certificate a client received is in the log.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn healthz(admin: std::net::SocketAddr) -> bool {
    let probe = async {
        let mut s = tokio::net::TcpStream::connect(admin).await.ok()?;
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: meshca\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        Some(buf.starts_with(b"HTTP/1.1 200"))
    };
    tokio::time::timeout(Duration::from_secs(2), probe)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

fn leaf_serial(chain: &[String]) -> String {
    let (_, pem) = x509_parser::pem::parse_x509_pem(chain[0].as_bytes()).unwrap();
    meshca::ca::serial_hex(pem.parse_x509().unwrap().raw_serial())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_stdout_reader_sheds_requests_and_health_still_answers() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut cmd = meshca::testing::serve_dev_command(env!("CARGO_BIN_EXE_meshca").as_ref(), &data);
    cmd.args(["--audit-sink", "stdout", "--audit-queue", "4"])
        // Nobody reads this pipe until the end of the stall.
        .stdout(std::process::Stdio::piped());
    let (mut child, addr, admin) = meshca::testing::spawn_listening(cmd).await;
    let stdout = child.stdout.take().unwrap();

    let read = |f: &str| std::fs::read_to_string(data.join("dev-client").join(f)).unwrap();
    let (root, chain, key) = (
        read("root-cert.pem"),
        read("cert-chain.pem"),
        read("key.pem"),
    );
    let received = Arc::new(Mutex::new(Vec::<String>::new()));
    let shed = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = vec![];
    for _ in 0..8 {
        let (root, chain, key) = (root.clone(), chain.clone(), key.clone());
        let (received, shed, stop) = (received.clone(), shed.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = meshca::testing::client(addr, &root, Some((&chain, &key)))
                .await
                .unwrap();
            let k = rcgen::KeyPair::generate().unwrap();
            let csr = meshca::testing::csr_for(&k, "spiffe://cluster.local/ns/default/sa/default");
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let call = c.create_certificate(meshca::testing::request(csr.clone(), 0, &[]));
                // A request that waits for a stalled writer is given up on
                // (its record, if written later, says abandoned).
                match tokio::time::timeout(Duration::from_secs(1), call).await {
                    Ok(Ok(r)) => received
                        .lock()
                        .unwrap()
                        .push(leaf_serial(&r.into_inner().cert_chain)),
                    Ok(Err(s)) if s.code() == tonic::Code::Unavailable => {
                        shed.lock().unwrap().push(s.message().to_string());
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Ok(Err(s)) => panic!("unexpected refusal: {s:?}"),
                    Err(_) => {}
                }
            }
        }));
    }
    // The pipe (64 KiB) fills after some hundred records; then requests are shed.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while shed.lock().unwrap().len() < 50 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no request was shed: {} issued",
            received.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Stalled: health still answers, several times.
    for _ in 0..5 {
        assert!(
            healthz(admin).await,
            "/healthz must answer while the audit stream is blocked"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let issued_before_drain = received.lock().unwrap().len();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .unwrap()
            .unwrap();
    }
    assert!(
        shed.lock()
            .unwrap()
            .iter()
            .all(|m| m.contains("audit log busy")),
        "opaque message for the shed requests"
    );

    // Resume reading, then stop meshca: the whole stream is the log.
    let lines = meshca::testing::stop_and_read_stdout(child, stdout).await;
    let rep = meshca::audit::verify::verify_lines(&lines, None).unwrap();
    assert_eq!(rep.last_checkpoint_reason.as_deref(), Some("shutdown"));
    assert!(
        rep.shed >= 50,
        "the checkpoints count the shed requests: {}",
        rep.shed
    );
    let logged: HashSet<String> = lines
        .iter()
        .filter_map(|(_, l)| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["type"] == "audit" && v["decision"] == "allow")
        .filter_map(|v| v["serial"].as_str().map(str::to_string))
        .collect();
    let received = received.lock().unwrap().clone();
    assert!(issued_before_drain > 0);
    for s in &received {
        assert!(
            logged.contains(s),
            "certificate {s} was issued without a record"
        );
    }
}
