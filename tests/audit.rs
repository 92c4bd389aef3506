//! The audit log: hash chain, signed checkpoints, rotation, and
//! `meshca audit verify|query` on tampered, reordered and truncated files.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use meshca::audit::chain::{ChainedSink, Destination, SinkOptions};
use meshca::audit::keys::{CheckpointKey, VerifyKey};
use meshca::audit::query::{self, Query};
use meshca::audit::verify;
use meshca::audit::{AuditRecord, AuditSink, Decision};
use time::OffsetDateTime;

fn record(i: u64, decision: Decision, node: &str) -> AuditRecord {
    let reason = if decision == Decision::Allow {
        "issued"
    } else {
        "impersonation_no_pod_on_node"
    };
    AuditRecord {
        peer: Some("127.0.0.1:5000".into()),
        authn_method: Some("token-review".into()),
        caller_identity: Some("spiffe://cluster.local/ns/istio-system/sa/ztunnel".into()),
        caller_pod: Some("istio-system/ztunnel-a".into()),
        caller_pod_uid: Some("uid-1".into()),
        node: Some(node.into()),
        requested_identity: Some(format!("spiffe://cluster.local/ns/app/sa/sa-{i}")),
        impersonated: true,
        serial: Some(format!("{i:032x}")),
        latency_ms: 1.0,
        ..AuditRecord::new(
            OffsetDateTime::now_utc(),
            format!("req-{i}"),
            decision,
            reason.into(),
        )
    }
}

fn key_pem() -> String {
    CheckpointKey::generate_pem().unwrap()
}

/// Writes `n` records (checkpoint every 4) into a file; returns its lines.
fn write_log(path: &Path, n: u64, key: &str) -> Vec<String> {
    let sink = ChainedSink::open(SinkOptions {
        key: Some(CheckpointKey::from_pem(key.as_bytes()).unwrap()),
        checkpoint_every: 4,
        ..SinkOptions::new(Destination::file(path, 1 << 20, 3))
    })
    .unwrap();
    for i in 0..n {
        let d = if i % 3 == 0 {
            Decision::Deny
        } else {
            Decision::Allow
        };
        sink.emit(&record(i, d, if i % 2 == 0 { "node-a" } else { "node-b" }))
            .unwrap();
    }
    sink.checkpoint("shutdown").unwrap();
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn lines_of(name: &str, lines: &[String]) -> Vec<(String, String)> {
    lines
        .iter()
        .enumerate()
        .map(|(i, l)| (format!("{name}:{}", i + 1), l.clone()))
        .collect()
}

fn vkey(pem: &str) -> VerifyKey {
    VerifyKey::from_pem(pem.as_bytes()).unwrap()
}

fn is_audit(line: &str) -> bool {
    line.contains("\"type\":\"audit\"")
}

#[test]
fn intact_log_verifies_with_signed_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let key = key_pem();
    let lines = write_log(&dir.path().join("audit.log"), 10, &key);
    let r = verify::verify_lines(&lines_of("a", &lines), Some(&vkey(&key))).unwrap();
    assert_eq!(r.records, 10);
    // start + every 4 records (2) + shutdown
    assert_eq!(r.checkpoints, 4);
    assert_eq!(r.signed_checkpoints, 4);
    assert_eq!(r.unsigned_tail, 0);
    // The public key alone verifies too.
    let public = vkey(&key).to_pem();
    verify::verify_lines(&lines_of("a", &lines), Some(&vkey(&public))).unwrap();
}

#[test]
fn edited_record_is_reported_at_that_record() {
    let dir = tempfile::tempdir().unwrap();
    let key = key_pem();
    let mut lines = write_log(&dir.path().join("audit.log"), 10, &key);
    let k = lines
        .iter()
        .position(|l| is_audit(l) && l.contains("\"decision\":\"deny\""))
        .unwrap();
    lines[k] = lines[k].replace("\"decision\":\"deny\"", "\"decision\":\"allow\"");
    let f = verify::verify_lines(&lines_of("a", &lines), Some(&vkey(&key))).unwrap_err();
    assert_eq!(f.location, format!("a:{}", k + 1), "{f}");
    assert!(f.why.contains("edited"), "{f}");
}

#[test]
fn edited_prev_field_is_reported_at_that_record() {
    let dir = tempfile::tempdir().unwrap();
    let key = key_pem();
    let mut lines = write_log(&dir.path().join("audit.log"), 10, &key);
    let k = 3;
    assert!(is_audit(&lines[k]));
    let v: serde_json::Value = serde_json::from_str(&lines[k]).unwrap();
    let prev = v["prev"].as_str().unwrap().to_string();
    lines[k] = lines[k].replace(&prev, &"ab".repeat(32));
    let f = verify::verify_lines(&lines_of("a", &lines), Some(&vkey(&key))).unwrap_err();
    assert_eq!(f.location, format!("a:{}", k + 1), "{f}");
}

#[test]
fn deleted_record_is_reported_at_the_gap() {
    let dir = tempfile::tempdir().unwrap();
    let key = key_pem();
    let mut lines = write_log(&dir.path().join("audit.log"), 10, &key);
    let k = lines.iter().rposition(|l| is_audit(l)).unwrap() - 1;
    assert!(is_audit(&lines[k]));
    lines.remove(k);
    let f = verify::verify_lines(&lines_of("a", &lines), Some(&vkey(&key))).unwrap_err();
    assert_eq!(
        f.location,
        format!("a:{}", k + 1),
        "the line that now follows the gap: {f}"
    );
    assert!(f.why.contains("removed or reordered"), "{f}");
}

#[test]
fn reordered_records_are_reported_at_the_first_moved_line() {
    let dir = tempfile::tempdir().unwrap();
    let key = key_pem();
    let mut lines = write_log(&dir.path().join("audit.log"), 10, &key);
    let k = 2;
    assert!(is_audit(&lines[k]) && is_audit(&lines[k + 1]));
    lines.swap(k, k + 1);
    let f = verify::verify_lines(&lines_of("a", &lines), Some(&vkey(&key))).unwrap_err();
    assert_eq!(f.location, format!("a:{}", k + 1), "{f}");
}

#[test]
fn truncation_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let key = key_pem();
    let lines = write_log(&dir.path().join("audit.log"), 10, &key);

    // Cut inside a line (a crash or a tampered tail).
    let mut cut = lines.clone();
    let last = cut.len() - 1;
    let half = cut[last].len() / 2;
    cut[last].truncate(half);
    let f = verify::verify_lines(&lines_of("a", &cut), Some(&vkey(&key))).unwrap_err();
    assert_eq!(f.location, format!("a:{}", last + 1));
    assert!(f.why.contains("truncated"), "{f}");

    // Head removed: the log no longer starts at genesis or a checkpoint.
    let head_cut: Vec<String> = lines.iter().skip(2).cloned().collect();
    assert!(is_audit(&head_cut[0]));
    let f = verify::verify_lines(&lines_of("a", &head_cut), Some(&vkey(&key))).unwrap_err();
    assert_eq!(f.location, "a:1");

    // Whole lines removed from the tail: no longer ends in a checkpoint.
    let tail_cut: Vec<String> = lines[..lines.len() - 2].to_vec();
    let r = verify::verify_lines(&lines_of("a", &tail_cut), Some(&vkey(&key))).unwrap();
    assert!(r.unsigned_tail > 0, "reported as an unsigned tail");
}

#[test]
fn forged_checkpoint_or_wrong_key_fails() {
    let dir = tempfile::tempdir().unwrap();
    let key = key_pem();
    let mut lines = write_log(&dir.path().join("audit.log"), 10, &key);
    let f = verify::verify_lines(&lines_of("a", &lines), Some(&vkey(&key_pem()))).unwrap_err();
    assert_eq!(f.location, "a:1", "first checkpoint fails with another key");
    let k = lines
        .iter()
        .position(|l| l.contains("\"reason\":\"periodic\""))
        .unwrap();
    lines[k] = lines[k].replace("\"records\":4", "\"records\":3");
    let f = verify::verify_lines(&lines_of("a", &lines), Some(&vkey(&key))).unwrap_err();
    assert_eq!(f.location, format!("a:{}", k + 1));
    assert!(f.why.contains("signature"), "{f}");
}

#[test]
fn rotation_and_restart_keep_one_chain() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.log");
    let key = key_pem();
    let mk = || {
        ChainedSink::open(SinkOptions {
            key: Some(CheckpointKey::from_pem(key.as_bytes()).unwrap()),
            ..SinkOptions::new(Destination::file(&path, 4096, 20))
        })
        .unwrap()
    };
    let sink = mk();
    for i in 0..20 {
        sink.emit(&record(i, Decision::Allow, "node-a")).unwrap();
    }
    drop(sink);
    // A restart continues the chain from the file's last line.
    let sink = mk();
    for i in 20..30 {
        sink.emit(&record(i, Decision::Allow, "node-a")).unwrap();
    }
    sink.checkpoint("shutdown").unwrap();
    let mut files: Vec<_> = (1..20)
        .rev()
        .map(|i| dir.path().join(format!("audit.log.{i}")))
        .filter(|p| p.exists())
        .collect();
    assert!(files.len() >= 2, "small max size rotated: {files:?}");
    files.push(path.clone());
    let lines = verify::read_lines(&files).unwrap();
    let r = verify::verify_lines(&lines, Some(&vkey(&key))).unwrap();
    assert_eq!(r.records, 30);
    assert_eq!(r.chain_starts, 1, "one chain across rotation and restart");
    // After old files are rotated away, the rest still verifies from the
    // signed rotation anchor that starts each file.
    let only_current = verify::read_lines(&[&path]).unwrap();
    assert!(String::from_utf8_lossy(&only_current[0].1).contains("\"reason\":\"rotation\""));
    let r = verify::verify_lines(&only_current, Some(&vkey(&key))).unwrap();
    assert_eq!(r.chain_starts, 0);
    assert!(r.records < 30);
}

#[test]
fn query_filters_records() {
    let dir = tempfile::tempdir().unwrap();
    let lines = write_log(&dir.path().join("audit.log"), 9, &key_pem());
    let lines = lines_of("a", &lines);
    let deny = query::query(
        &lines,
        &Query {
            decision: Some(Decision::Deny),
            ..Default::default()
        },
    )
    .0;
    assert_eq!(deny.len(), 3);
    let node_b = query::query(
        &lines,
        &Query {
            node: Some("node-b".into()),
            ..Default::default()
        },
    )
    .0;
    assert_eq!(node_b.len(), 4);
    let one = query::query(
        &lines,
        &Query {
            identity: Some("spiffe://cluster.local/ns/app/sa/sa-4".into()),
            ..Default::default()
        },
    )
    .0;
    assert_eq!(one.len(), 1);
    assert_eq!(
        one[0].serial.as_deref(),
        Some(format!("{:032x}", 4).as_str())
    );
    let future = query::query(
        &lines,
        &Query {
            since: Some(OffsetDateTime::now_utc() + time::Duration::hours(1)),
            ..Default::default()
        },
    )
    .0;
    assert!(future.is_empty());
}

fn meshca(args: &[&str]) -> (i32, String) {
    meshca::testing::run_cli(env!("CARGO_BIN_EXE_meshca").as_ref(), args)
}

#[test]
fn cli_verify_and_query() {
    let dir = tempfile::tempdir().unwrap();
    let key_path = dir.path().join("cp.key");
    let (code, public) = meshca(&["audit", "keygen", "--out", key_path.to_str().unwrap()]);
    assert_eq!(code, 0, "{public}");
    let pub_path = dir.path().join("cp.pub");
    std::fs::write(
        &pub_path,
        public
            .lines()
            .take_while(|l| !l.starts_with("wrote"))
            .collect::<Vec<_>>()
            .join("\n")
            + "\n",
    )
    .unwrap();
    let log = dir.path().join("audit.log");
    let lines = write_log(&log, 8, &std::fs::read_to_string(&key_path).unwrap());

    let (code, out) = meshca(&[
        "audit",
        "verify",
        "--strict",
        "--key",
        pub_path.to_str().unwrap(),
        log.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("OK: 8 records"), "{out}");

    let tampered = dir.path().join("tampered.log");
    let mut t = lines.clone();
    let k = t
        .iter()
        .position(|l| is_audit(l) && l.contains("node-b"))
        .unwrap();
    t[k] = t[k].replace("node-b", "node-c");
    std::fs::write(&tampered, t.join("\n") + "\n").unwrap();
    let (code, out) = meshca(&[
        "audit",
        "verify",
        "--key",
        pub_path.to_str().unwrap(),
        tampered.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!("FAIL at {}:{}", tampered.display(), k + 1)),
        "{out}"
    );
    // The documented format: `(seq N)`, no Rust Debug syntax.
    let seq: serde_json::Value = serde_json::from_str(&lines[k]).unwrap();
    assert!(
        out.contains(&format!(
            "FAIL at {}:{} (seq {}): ",
            tampered.display(),
            k + 1,
            seq["seq"].as_u64().unwrap()
        )),
        "{out}"
    );
    assert!(!out.contains("Some("), "{out}");

    let (code, out) = meshca(&[
        "audit",
        "query",
        "--decision",
        "deny",
        "-o",
        "json",
        log.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(out.lines().count(), 3);
    let (code, out) = meshca(&["audit", "query", "--node", "node-a", log.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(out.starts_with("TIME"), "{out}");
    assert_eq!(out.lines().count(), 1 + 4);
}

/// `meshca serve --dev` writing its audit log to `log`: (child, gRPC addr).
async fn serve_dev(data: &Path, log: &Path) -> (tokio::process::Child, std::net::SocketAddr) {
    serve_dev_with(data, log, &[]).await
}

async fn serve_dev_with(
    data: &Path,
    log: &Path,
    env: &[(&str, &str)],
) -> (tokio::process::Child, std::net::SocketAddr) {
    let mut cmd = meshca::testing::serve_dev_command(env!("CARGO_BIN_EXE_meshca").as_ref(), data);
    cmd.envs(env.iter().copied());
    let key = data.join("checkpoint.key");
    if key.exists() {
        cmd.env("MESHCA_AUDIT_CHECKPOINT_KEY", &key);
    }
    let mut child = cmd
        .args(["--audit-sink", "file", "--audit-file"])
        .arg(log)
        .spawn()
        .unwrap();
    let (addr, _) = meshca::testing::await_listening(
        child.stderr.take().unwrap(),
        std::time::Duration::from_secs(30),
    )
    .await;
    (child, addr)
}

/// Calls the dev server with its dev client identity; Ok(chain) or the status.
async fn call(
    data: &Path,
    addr: std::net::SocketAddr,
    san: &str,
    metadata: &[(&str, prost_types::Value)],
) -> Result<Vec<String>, tonic::Status> {
    let mut c = meshca::testing::dev_client(addr, data).await;
    let key = rcgen::KeyPair::generate().unwrap();
    c.create_certificate(meshca::testing::request(
        meshca::testing::csr_for(&key, san),
        0,
        metadata,
    ))
    .await
    .map(|r| r.into_inner().cert_chain)
}

const DEV_ID: &str = "spiffe://cluster.local/ns/default/sa/default";

/// A first run of the real server, leaving an audit log behind.
async fn first_run(data: &Path, log: &Path) {
    let (mut child, addr) = serve_dev(data, log).await;
    call(data, addr, DEV_ID, &[]).await.unwrap();
    child.kill().await.unwrap();
}

fn checkpoint_key(log: &Path) -> Option<CheckpointKey> {
    let pem = std::fs::read(log.parent()?.parent()?.join("checkpoint.key")).ok()?;
    Some(CheckpointKey::from_pem(&pem).unwrap())
}

fn damage_oversize(log: &Path) {
    // An old writer's last line over the cap (and over 256 KiB).
    let sink = ChainedSink::open(SinkOptions {
        key: checkpoint_key(log),
        max_line_bytes: 1 << 20,
        ..SinkOptions::new(Destination::file(log, 1 << 30, 3))
    })
    .unwrap();
    let mut r = record(1, Decision::Deny, "node-a");
    r.detail = Some("x".repeat(400 * 1024));
    sink.emit(&r).unwrap();
}

fn damage_mid_utf8(log: &Path) {
    // Fill past 256 KiB with multi-byte text until `len - 256 KiB` falls
    // inside a character: the old tail reader failed startup there.
    let sink = ChainedSink::open(SinkOptions {
        key: checkpoint_key(log),
        ..SinkOptions::new(Destination::file(log, 1 << 30, 3))
    })
    .unwrap();
    let mut r = record(1, Decision::Deny, "node-a");
    r.detail = Some("é".repeat(3001));
    for _ in 0..400 {
        sink.emit(&r).unwrap();
        let b = std::fs::read(log).unwrap();
        if b.len() > 300 * 1024 && b[b.len() - 256 * 1024] & 0xC0 == 0x80 {
            return;
        }
    }
    panic!("never landed inside a character");
}

/// Restart on a damaged tail: the server starts, serves a certificate, and
/// `meshca audit verify` accepts the log and reports the recovery.
async fn restart_on(damage: &str) -> String {
    let data = tempfile::tempdir().unwrap();
    let log = data.path().join("audit").join("audit.log");
    // Checkpoints (recoveries included) are signed.
    let key = data.path().join("checkpoint.key");
    let (code, out) = meshca(&["audit", "keygen", "--out", key.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    first_run(data.path(), &log).await;
    match damage {
        "torn_line" => {
            // A crash in the middle of a write: half a line, no newline.
            let text = std::fs::read_to_string(&log).unwrap();
            let last = text.lines().last().unwrap();
            let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
            std::io::Write::write_all(&mut f, &last.as_bytes()[..last.len() / 2]).unwrap();
        }
        "garbage" => {
            let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
            std::io::Write::write_all(&mut f, b"\xde\xad\xbe\xef\n\x00\x01 not json {\n\xe2\x82\n")
                .unwrap();
        }
        "oversize" => damage_oversize(&log),
        "mid_utf8" => damage_mid_utf8(&log),
        other => panic!("{other}"),
    }
    let (mut child, addr) = serve_dev(data.path(), &log).await;
    let chain = call(data.path(), addr, DEV_ID, &[]).await.unwrap();
    let root = std::fs::read_to_string(data.path().join("dev-client/root-cert.pem")).unwrap();
    assert_eq!(chain.last(), Some(&root), "a chain to the dev root");
    child.kill().await.unwrap();
    let (code, out) = meshca(&[
        "audit",
        "verify",
        "--key",
        key.to_str().unwrap(),
        log.to_str().unwrap(),
    ]);
    eprintln!("{damage}: {out}");
    assert_eq!(code, 0, "{damage}: {out}");
    assert!(out.starts_with("OK: "), "{out}");
    assert!(!out.contains("(0 signature-verified)"), "{out}");
    // Every line the restarted server wrote is within the default cap.
    let bytes = std::fs::read(&log).unwrap();
    let last_start = bytes
        .windows(12)
        .rposition(|w| w == b"\"reason\":\"st")
        .unwrap_or(0);
    for line in bytes[last_start..].split(|b| *b == b'\n') {
        assert!(line.len() < 16 * 1024);
    }
    out
}

#[tokio::test]
async fn restart_on_a_torn_line_records_the_recovery() {
    let out = restart_on("torn_line").await;
    assert!(
        out.contains("recovery: the log ended in a torn (incomplete) line; 1 damaged line(s)")
            && out.contains("(present and matching); the chain continues"),
        "{out}"
    );
}

#[tokio::test]
async fn restart_on_a_garbage_tail_records_the_recovery() {
    let out = restart_on("garbage").await;
    assert!(
        out.contains("recovery: the log ended in unparsable data; 3 damaged line(s)")
            && out.contains("(present and matching); the chain continues"),
        "{out}"
    );
}

#[tokio::test]
async fn restart_on_an_oversize_last_line_records_the_recovery() {
    let out = restart_on("oversize").await;
    assert!(
        out.contains("recovery: the log's last line was over the line cap; last line"),
        "{out}"
    );
    assert!(out.contains("the chain continues"), "{out}");
    assert!(
        out.contains("1 chain start(s)"),
        "not a silent new chain: {out}"
    );
}

#[tokio::test]
async fn restart_with_the_tail_window_inside_a_utf8_character_continues_the_chain() {
    let out = restart_on("mid_utf8").await;
    assert!(out.contains("1 chain start(s)"), "{out}");
    assert!(!out.contains("recovery"), "nothing was damaged: {out}");
}

#[tokio::test]
async fn hostile_input_is_bounded_and_the_refused_san_is_queryable() {
    let data = tempfile::tempdir().unwrap();
    let log = data.path().join("audit.log");
    let (mut child, addr) = serve_dev(data.path(), &log).await;
    // A CSR for someone else's identity.
    let other = "spiffe://cluster.local/ns/x/sa/y";
    let err = call(data.path(), addr, other, &[]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    // A 1 MB impersonated identity of control bytes.
    let huge = "\u{1}".repeat(1 << 20);
    let v = prost_types::Value {
        kind: Some(prost_types::value::Kind::StringValue(huge.clone())),
    };
    let _ = call(data.path(), addr, DEV_ID, &[("ImpersonatedIdentity", v)]).await;
    child.kill().await.unwrap();

    let text = std::fs::read_to_string(&log).unwrap();
    let longest = text.lines().map(str::len).max().unwrap();
    eprintln!("longest audit line: {longest} bytes");
    assert!(longest < 16 * 1024, "longest audit line {longest} bytes");
    let digest = hex::encode(aws_lc_rs::digest::digest(
        &aws_lc_rs::digest::SHA256,
        huge.as_bytes(),
    ));
    assert!(
        !text.contains(&"\\u0001".repeat(2000)),
        "the raw value is never written"
    );
    // Where the value reached the record (today: requested_identity), it is
    // kept as length and hash. (A decode-time input limit may refuse it
    // before that; the bound above holds either way.)
    let recorded = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["requested_identity"].as_str().map(str::to_string))
        .filter(|id| id.starts_with("\\u{1}"))
        .collect::<Vec<_>>();
    eprintln!("records holding the bounded identity: {}", recorded.len());
    for id in &recorded {
        assert!(
            id.ends_with(&format!("1048576 bytes, sha256:{digest}]")),
            "{id}"
        );
    }

    let (code, out) = meshca(&[
        "audit",
        "query",
        "--identity",
        other,
        "-o",
        "json",
        log.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(out.lines().count(), 1, "{out}");
    let r: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(r["reason"], "csr_san_not_authorized");
    assert_eq!(r["csr_sans"], serde_json::json!([other]));
    let (code, out) = meshca(&["audit", "verify", log.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
}

#[test]
fn an_invalid_line_cap_is_a_startup_error_naming_the_flag() {
    let data = tempfile::tempdir().unwrap();
    for bad in ["10", "0", "99999999"] {
        let (code, out) = meshca::testing::output_text(
            meshca::testing::serve_dev_std_command(
                env!("CARGO_BIN_EXE_meshca").as_ref(),
                data.path(),
            )
            .args(["--audit-max-line-bytes", bad]),
        );
        assert_ne!(code, 0, "{out}");
        assert!(out.contains("MESHCA_AUDIT_MAX_LINE_BYTES"), "{out}");
    }
}

#[tokio::test]
async fn a_record_over_the_line_cap_is_written_reduced_and_verify_says_so() {
    let data = tempfile::tempdir().unwrap();
    let log = data.path().join("audit.log");
    let (mut child, addr) = serve_dev_with(
        data.path(),
        &log,
        &[("MESHCA_AUDIT_MAX_LINE_BYTES", "4096")],
    )
    .await;
    // A CSR with many long SANs: each is bounded, together they pass 4 KiB.
    let key = rcgen::KeyPair::generate().unwrap();
    let uri = |i: usize| {
        rcgen::SanType::URI(
            format!("spiffe://cluster.local/ns/{i}/sa/{}", "b".repeat(400))
                .try_into()
                .unwrap(),
        )
    };
    let sans: Vec<rcgen::SanType> = (0..20).map(uri).collect();
    let mut c = meshca::testing::dev_client(addr, data.path()).await;
    let err = c
        .create_certificate(meshca::testing::request(
            meshca::testing::csr_pem(&key, &sans, false),
            0,
            &[],
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    child.kill().await.unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.lines().all(|l| l.len() < 4096));
    let denial: serde_json::Value = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["reason"] == "csr_san_not_authorized")
        .expect("the denial is recorded, not dropped");
    assert_eq!(denial["reduced"]["max_line_bytes"], 4096, "{denial}");
    assert!(denial["reduced"]["line_bytes"].as_u64().unwrap() > 4096);
    let (code, out) = meshca(&["audit", "verify", log.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("1 record(s) were written in reduced form"),
        "{out}"
    );
}

/// What `kubectl logs POD` returns for a replica: the audit stream (stdout)
/// and the process's own log (stderr) interleaved line by line in one file,
/// as a container runtime writes them. Plain `verify` refuses the stream;
/// `verify --from-logs` sets the log lines aside, checks the chain (to the
/// shutdown checkpoint), and still fails when an audit line is removed.
#[tokio::test]
async fn verify_from_logs_reads_an_interleaved_container_log() {
    let data = tempfile::tempdir().unwrap();
    let log = data.path().join("container.log");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .unwrap();
    let mut cmd =
        meshca::testing::serve_dev_std_command(env!("CARGO_BIN_EXE_meshca").as_ref(), data.path());
    cmd.args(["--audit-sink", "stdout"])
        .env("RUST_LOG", "info,meshca=debug")
        .stdout(file.try_clone().unwrap())
        .stderr(file);
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.kill_on_drop(true);
    let child = cmd.spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let addr: std::net::SocketAddr = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(a) = text
            .lines()
            .find_map(|l| l.strip_prefix("listening on "))
            .and_then(|rest| rest.split(' ').next())
            .and_then(|a| a.parse().ok())
        {
            break a;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never listened:\n{text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    for _ in 0..5 {
        call(data.path(), addr, DEV_ID, &[]).await.unwrap();
    }
    assert!(
        meshca::testing::terminate(child, std::time::Duration::from_secs(20))
            .await
            .success()
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let audit = text
        .lines()
        .filter(|l| l.starts_with("{\"type\":\"audit\""))
        .count();
    let other = text
        .lines()
        .filter(|l| !l.starts_with("{\"type\":"))
        .count();
    assert!(
        audit >= 6 && other >= 2,
        "an interleaved stream: {audit} audit lines, {other} others"
    );
    let path = log.to_str().unwrap();

    let (code, out) = meshca(&["audit", "verify", path]);
    assert_ne!(
        code, 0,
        "plain verify reads every line as the audit log's: {out}"
    );
    let (code, out) = meshca(&["audit", "verify", "--from-logs", "--strict", path]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains(&format!("{other} line(s) set aside")), "{out}");
    // The documented pipeline, through stdin.
    let piped = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(
            "cat {path} | {} audit verify --from-logs --strict -",
            env!("CARGO_BIN_EXE_meshca")
        ))
        .output()
        .unwrap();
    assert!(
        piped.status.success(),
        "{}",
        String::from_utf8_lossy(&piped.stderr)
    );

    // One audit record removed from the middle: the chain breaks.
    let lines: Vec<&str> = text.lines().collect();
    let victim = lines
        .iter()
        .rposition(|l| l.starts_with("{\"type\":\"audit\""))
        .unwrap();
    let cut: String = lines
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != victim)
        .map(|(_, l)| format!("{l}\n"))
        .collect();
    let tampered = data.path().join("tampered.log");
    std::fs::write(&tampered, cut).unwrap();
    let (code, out) = meshca(&["audit", "verify", "--from-logs", tampered.to_str().unwrap()]);
    assert_ne!(code, 0, "a removed record is still found: {out}");
    assert!(out.contains("FAIL at"), "{out}");
}
