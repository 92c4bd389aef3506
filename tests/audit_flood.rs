//! A flood of cheap refusals must not hide a probe. meshca writes its audit
//! log to a stdout pipe nobody reads, so the writer stalls and its queue
//! fills; meanwhile one caller floods refused requests, another caller
//! probes a few times, and oversized messages are refused at the transport
//! gate before any request record exists. Every refusal must still be in
//! the chain once the reader resumes, either as its own record or folded
//! into an aggregate record (count, first and last time) that names its
//! caller or source address, and the log must verify.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const FLOOD: &str = "spiffe://cluster.local/ns/default/sa/default";
const PROBE: &str = "spiffe://cluster.local/ns/probe/sa/probe";
/// Not the caller's identity: every request is refused (csr_san_not_authorized).
const FOREIGN: &str = "spiffe://cluster.local/ns/victim/sa/victim";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_is_named_in_the_log_when_the_writer_cannot_keep_up() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut cmd = meshca::testing::serve_dev_command(env!("CARGO_BIN_EXE_meshca").as_ref(), &data);
    cmd.args([
        "--audit-sink",
        "stdout",
        "--audit-queue",
        "4",
        "--audit-aggregate-interval",
        "200ms",
    ])
    .stdout(std::process::Stdio::piped());
    let (mut child, addr, _admin) = meshca::testing::spawn_listening(cmd).await;
    let stdout = child.stdout.take().unwrap();

    let read = |f: &str| std::fs::read_to_string(data.join("dev-client").join(f)).unwrap();
    let root = read("root-cert.pem");
    let flood_id = (read("cert-chain.pem"), read("key.pem"));
    let bundle =
        meshca::ca::CaBundle::load_dir(&data.join("cacerts"), time::OffsetDateTime::now_utc())
            .unwrap();
    let now = time::OffsetDateTime::now_utc();
    let probe_id = meshca::testing::client_identity(
        &bundle,
        PROBE,
        &meshca::ca::Validity {
            not_before: now - time::Duration::minutes(5),
            not_after: now + time::Duration::hours(1),
            clamped: false,
        },
    );

    // The flood: refused requests as fast as they are answered, until the
    // pipe (64 KiB) is full and requests find the writer's queue full.
    let stop = Arc::new(AtomicBool::new(false));
    let flood_calls = Arc::new(AtomicU64::new(0));
    let mut tasks = vec![];
    for _ in 0..4 {
        let (root, id) = (root.clone(), flood_id.clone());
        let (stop, calls) = (stop.clone(), flood_calls.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = meshca::testing::client(addr, &root, Some((&id.0, &id.1)))
                .await
                .unwrap();
            let k = rcgen::KeyPair::generate().unwrap();
            let csr = meshca::testing::csr_for(&k, FOREIGN);
            while !stop.load(Ordering::Relaxed) {
                let r = c
                    .create_certificate(meshca::testing::request(csr.clone(), 0, &[]))
                    .await;
                calls.fetch_add(1, Ordering::Relaxed);
                // Refused at once when its record is folded; a refusal whose
                // record found room in the queue waits for the stalled writer
                // until the request deadline (its record is written later).
                let s = r.unwrap_err();
                assert!(
                    matches!(
                        s.code(),
                        tonic::Code::InvalidArgument | tonic::Code::DeadlineExceeded
                    ),
                    "{s:?}"
                );
            }
        }));
    }
    // Wait until the writer is surely stalled: the pipe holds a few hundred
    // records, and thousands of refusals have been answered.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while flood_calls.load(Ordering::Relaxed) < 5000 {
        assert!(tokio::time::Instant::now() < deadline, "flood too slow");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The probe, hidden in the flood.
    let mut probe = meshca::testing::client(addr, &root, Some((&probe_id.0, &probe_id.1)))
        .await
        .unwrap();
    let k = rcgen::KeyPair::generate().unwrap();
    const PROBES: u64 = 3;
    for _ in 0..PROBES {
        let r = probe
            .create_certificate(meshca::testing::request(
                meshca::testing::csr_for(&k, FOREIGN),
                0,
                &[],
            ))
            .await;
        let code = r.unwrap_err().code();
        assert!(
            matches!(
                code,
                tonic::Code::InvalidArgument | tonic::Code::DeadlineExceeded
            ),
            "{code:?}"
        );
    }
    // Oversized messages: refused at the gate, before any request record.
    const OVERSIZED: u64 = 5;
    for _ in 0..OVERSIZED {
        let r = probe
            .create_certificate(meshca::testing::request("x".repeat(200 * 1024), 0, &[]))
            .await;
        assert_eq!(r.unwrap_err().code(), tonic::Code::ResourceExhausted);
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let flood_calls = flood_calls.load(Ordering::Relaxed);

    // Resume reading, then stop meshca: the whole stream is the log.
    let lines = meshca::testing::stop_and_read_stdout(child, stdout).await;
    let rep = meshca::audit::verify::verify_lines(&lines, None).unwrap();
    assert_eq!(rep.last_checkpoint_reason.as_deref(), Some("shutdown"));
    assert!(rep.shed > 0, "the writer's queue was full: {}", rep.shed);

    // Every refusal accounted for, per caller: a record counts 1, an
    // aggregate its `count`.
    let mut per_caller: HashMap<(String, String), u64> = HashMap::new();
    let mut aggregates = 0;
    for v in lines
        .iter()
        .filter_map(|(_, l)| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["type"] == "audit" && v["decision"] == "deny")
    {
        let who = v["caller_identity"]
            .as_str()
            .map(str::to_string)
            .or_else(|| {
                v["peer"]
                    .as_str()
                    .map(|p| p.split(':').next().unwrap().to_string())
            })
            .unwrap_or_default();
        let n = match v["count"].as_u64() {
            Some(n) => {
                aggregates += 1;
                assert!(v["aggregate"]["first"].is_string(), "{v}");
                assert!(v["aggregate"]["last"].is_string(), "{v}");
                n
            }
            None => 1,
        };
        *per_caller
            .entry((who, v["reason"].as_str().unwrap().to_string()))
            .or_default() += n;
    }
    let got = |who: &str, reason: &str| {
        per_caller
            .get(&(who.to_string(), reason.to_string()))
            .copied()
            .unwrap_or(0)
    };
    eprintln!(
        "flood {flood_calls} calls, {aggregates} aggregate records, {} shed from the queue; per caller: {per_caller:?}",
        rep.shed
    );
    assert!(aggregates > 0, "some refusals were folded");
    assert_eq!(
        got(FLOOD, "csr_san_not_authorized"),
        flood_calls,
        "the flood, exactly"
    );
    assert_eq!(
        got(PROBE, "csr_san_not_authorized"),
        PROBES,
        "the probe is named"
    );
    assert_eq!(
        got("127.0.0.1", "message_too_large"),
        OVERSIZED,
        "gate refusals"
    );
}
