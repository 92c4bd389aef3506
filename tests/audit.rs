//! The audit log: hash chain, signed checkpoints, rotation, and
//! `meshca audit verify|query` on tampered, reordered and truncated files.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use meshca::audit::chain::{ChainedSink, CheckpointKey, VerifyKey};
use meshca::audit::verify::{self, Query};
use meshca::audit::{AuditRecord, AuditSink, Decision};
use time::OffsetDateTime;

fn record(i: u64, decision: Decision, node: &str) -> AuditRecord {
    AuditRecord {
        time: OffsetDateTime::now_utc(),
        request_id: format!("req-{i}"),
        peer: Some("127.0.0.1:5000".into()),
        authn_method: Some("token-review".into()),
        caller_identity: Some("spiffe://cluster.local/ns/istio-system/sa/ztunnel".into()),
        caller_pod: Some("istio-system/ztunnel-a".into()),
        caller_pod_uid: Some("uid-1".into()),
        node: Some(node.into()),
        requested_identity: Some(format!("spiffe://cluster.local/ns/app/sa/sa-{i}")),
        impersonated: true,
        decision,
        reason: if decision == Decision::Allow {
            "issued".into()
        } else {
            "impersonation_no_pod_on_node".into()
        },
        detail: None,
        evidence: None,
        serial: Some(format!("{i:032x}")),
        spki_sha256: None,
        csr_sha256: None,
        not_before: None,
        not_after: None,
        issuer_key_id: None,
        lifetime: None,
        latency_ms: 1.0,
    }
}

fn key_pem() -> String {
    CheckpointKey::generate_pem().unwrap()
}

/// Writes `n` records (checkpoint every 4) into a file; returns its lines.
fn write_log(path: &Path, n: u64, key: &str) -> Vec<String> {
    let sink = ChainedSink::file(
        path,
        1 << 20,
        3,
        Some(CheckpointKey::from_pem(key.as_bytes()).unwrap()),
        4,
    )
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
        ChainedSink::file(
            &path,
            4096,
            20,
            Some(CheckpointKey::from_pem(key.as_bytes()).unwrap()),
            1000,
        )
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
    assert!(only_current[0].1.contains("\"reason\":\"rotation\""));
    let r = verify::verify_lines(&only_current, Some(&vkey(&key))).unwrap();
    assert_eq!(r.chain_starts, 0);
    assert!(r.records < 30);
}

#[test]
fn query_filters_records() {
    let dir = tempfile::tempdir().unwrap();
    let lines = write_log(&dir.path().join("audit.log"), 9, &key_pem());
    let lines = lines_of("a", &lines);
    let deny = verify::query(
        &lines,
        &Query {
            decision: Some(Decision::Deny),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(deny.len(), 3);
    let node_b = verify::query(
        &lines,
        &Query {
            node: Some("node-b".into()),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(node_b.len(), 4);
    let one = verify::query(
        &lines,
        &Query {
            identity: Some("spiffe://cluster.local/ns/app/sa/sa-4".into()),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(
        one[0].serial.as_deref(),
        Some(format!("{:032x}", 4).as_str())
    );
    let future = verify::query(
        &lines,
        &Query {
            since: Some(OffsetDateTime::now_utc() + time::Duration::hours(1)),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(future.is_empty());
}

fn meshca(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_meshca"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
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
