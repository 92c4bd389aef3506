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

/// The audit files of `log`, oldest first: `log.N` ... `log.1`, `log`.
fn audit_files(log: &std::path::Path) -> Vec<std::path::PathBuf> {
    let dir = log.parent().unwrap();
    let name = log.file_name().unwrap().to_str().unwrap().to_string();
    let mut rotated: Vec<(u32, std::path::PathBuf)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let e = e.unwrap();
            let n: u32 = e
                .file_name()
                .to_str()?
                .strip_prefix(&format!("{name}."))?
                .parse()
                .ok()?;
            Some((n, e.path()))
        })
        .collect();
    rotated.sort_by_key(|r| std::cmp::Reverse(r.0));
    let mut files: Vec<std::path::PathBuf> = rotated.into_iter().map(|(_, p)| p).collect();
    files.push(log.to_path_buf());
    files
}

/// Every audit record in `files`, as JSON.
fn records(files: &[std::path::PathBuf]) -> Vec<serde_json::Value> {
    files
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .unwrap()
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .collect::<Vec<_>>()
        })
        .filter(|v| v["type"] == "audit")
        .collect()
}

/// Serials of the workload certificates the log says were issued.
fn issued_serials(files: &[std::path::PathBuf]) -> std::collections::BTreeSet<String> {
    records(files)
        .into_iter()
        .filter(|v| v["decision"] == "allow" && v["reason"] == "issued")
        .map(|v| v["serial"].as_str().unwrap().to_string())
        .collect()
}

/// What a flood of unauthenticated refusals left of the log.
struct Flooded {
    files: Vec<std::path::PathBuf>,
    calls: u64,
    seconds: f64,
    /// Refusals of the flood written as full records, and folded.
    full: u64,
    folded: u64,
    metrics: String,
}

/// Issues `ISSUED` certificates, then floods unauthenticated refusals (TLS
/// without a client certificate, no token) against a file sink of three
/// 64 KiB files, `env` set for the server. Checks that every issuance record
/// from before the flood is still in the files and that `meshca audit
/// verify --strict` accepts them, oldest first, and that every refusal of
/// the flood is in the log exactly once: a full record, or counted in an
/// aggregate.
async fn unauthenticated_flood(env: &[(&str, &str)]) -> Flooded {
    const ISSUED: usize = 20;
    const FLOOD: u64 = 12_000;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let log = dir.path().join("audit").join("audit.log");
    let bin = env!("CARGO_BIN_EXE_meshca");
    let mut cmd = meshca::testing::serve_dev_command(bin.as_ref(), &data);
    cmd.args(["--audit-sink", "file", "--audit-file"])
        .arg(&log)
        .args(["--audit-max-bytes", "65536", "--audit-max-files", "3"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let (child, addr, admin) = meshca::testing::spawn_listening(cmd).await;

    let mut c = meshca::testing::dev_client(addr, &data).await;
    let k = rcgen::KeyPair::generate().unwrap();
    let csr = meshca::testing::csr_for(&k, FLOOD_ID);
    for _ in 0..ISSUED {
        c.create_certificate(meshca::testing::request(csr.clone(), 0, &[]))
            .await
            .unwrap();
    }
    // Each was acknowledged only once its record was written.
    let before = issued_serials(&audit_files(&log));
    assert_eq!(before.len(), ISSUED);

    let root = std::fs::read_to_string(data.join("dev-client/root-cert.pem")).unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let started = std::time::Instant::now();
    let mut tasks = vec![];
    for _ in 0..4 {
        let (root, csr, calls) = (root.clone(), csr.clone(), calls.clone());
        tasks.push(tokio::spawn(async move {
            let mut anon = meshca::testing::client(addr, &root, None).await.unwrap();
            while calls.fetch_add(1, Ordering::Relaxed) < FLOOD {
                let s = anon
                    .create_certificate(meshca::testing::request(csr.clone(), 0, &[]))
                    .await
                    .unwrap_err();
                assert_eq!(s.code(), tonic::Code::Unauthenticated, "{s:?}");
            }
            calls.fetch_sub(1, Ordering::Relaxed);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let seconds = started.elapsed().as_secs_f64();
    let calls = calls.load(Ordering::Relaxed);
    let metrics = std::process::Command::new("curl")
        .args(["-sf", &format!("http://{admin}/metrics")])
        .output()
        .unwrap();
    let status = meshca::testing::terminate(child, Duration::from_secs(20)).await;
    assert!(status.success(), "{status}");

    let files = audit_files(&log);
    let after = issued_serials(&files);
    let lost: Vec<&String> = before.difference(&after).collect();
    assert!(
        lost.is_empty(),
        "{} of {ISSUED} issuance records rotated out by the flood ({} files left): {lost:?}",
        lost.len(),
        files.len()
    );
    let mut args = vec!["audit".to_string(), "verify".into(), "--strict".into()];
    args.extend(files.iter().map(|f| f.display().to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out) = meshca::testing::run_cli(bin.as_ref(), &args);
    assert_eq!(code, 0, "{out}");

    let (mut full, mut folded) = (0, 0);
    for v in records(&files)
        .iter()
        .filter(|v| v["reason"] == "authn_no_credentials")
    {
        match v["count"].as_u64() {
            Some(n) => folded += n,
            None => full += 1,
        }
    }
    assert_eq!(
        full + folded,
        calls,
        "every refusal of the flood, exactly once"
    );
    Flooded {
        files,
        calls,
        seconds,
        full,
        folded,
        metrics: String::from_utf8_lossy(&metrics.stdout).into_owned(),
    }
}

const FLOOD_ID: &str = "spiffe://cluster.local/ns/default/sa/default";

/// Rotation alone (every refusal written in full): the files holding the
/// issuance records stay past `--audit-max-files`, however much the flood
/// writes after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_flood_does_not_rotate_issuance_records_out() {
    let f = unauthenticated_flood(&[("MESHCA_AUDIT_UNAUTHENTICATED_RATE", "1000000")]).await;
    eprintln!(
        "{} refusals in {:.1}s, {} full records, {} folded, {} files",
        f.calls,
        f.seconds,
        f.full,
        f.folded,
        f.files.len()
    );
    assert_eq!(f.folded, 0, "every refusal written in full");
    assert!(
        f.files.len() > 3,
        "files kept past the count: {}",
        f.files.len()
    );
    let retained = f
        .metrics
        .lines()
        .find_map(|l| l.strip_prefix("meshca_audit_files_retained "))
        .and_then(|v| v.trim().parse::<u64>().ok());
    assert!(retained.is_some_and(|n| n > 0), "{retained:?}");
}

/// The defaults: past `--audit-unauthenticated-rate` (20/s) the flood is
/// folded into aggregate records, so it writes a bounded number of lines,
/// counts exact, and the issuance records stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_flood_is_folded_past_the_rate() {
    let f = unauthenticated_flood(&[]).await;
    eprintln!(
        "{} refusals in {:.1}s, {} full records, {} folded, {} files",
        f.calls,
        f.seconds,
        f.full,
        f.folded,
        f.files.len()
    );
    // The burst and the rate over the flood's duration (shutdown included).
    let most = 20 + (20.0 * (f.seconds + 2.0)).ceil() as u64;
    assert!(f.full <= most, "{} full records, at most {most}", f.full);
    assert!(f.folded >= f.calls - most);
    let counted = f
        .metrics
        .lines()
        .find_map(|l| l.strip_prefix("meshca_audit_unauthenticated_folded_total "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    assert!(
        counted > 0 && counted <= f.folded,
        "{counted} of {}",
        f.folded
    );
}
