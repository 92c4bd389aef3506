//! Runs linked into one history, and the tampering a security reviewer
//! tries against signed logs: whole runs removed, replaced, replayed or
//! reordered, cuts right after a checkpoint, cut tails, a checkpoint naming
//! another key, edited anchors, and a log that disagrees with its anchor.
//! Each must fail verification at the line where the damage shows.
#![allow(clippy::unwrap_used)]

use std::ops::Range;
use std::path::Path;

use meshca::audit::chain::{ChainedSink, Destination, RunInfo, SinkOptions};
use meshca::audit::keys::{CheckpointKey, VerifyKey};
use meshca::audit::verify::anchors;
use meshca::audit::verify::{self, VerifyFailure, VerifyOptions, VerifyReport};
use meshca::audit::{AuditRecord, AuditSink, Decision};
use time::OffsetDateTime;

fn record(i: usize) -> AuditRecord {
    AuditRecord {
        caller_identity: Some("spiffe://cluster.local/ns/istio-system/sa/ztunnel".into()),
        serial: Some(format!("{i:032x}")),
        ..AuditRecord::new(
            OffsetDateTime::now_utc(),
            format!("req-{i}"),
            Decision::Allow,
            "issued".into(),
        )
    }
}

/// A log of several runs, each a process lifetime, with the line range of
/// every run and every run's last checkpoint (what its anchor holds).
struct Log {
    lines: Vec<String>,
    runs: Vec<Range<usize>>,
    anchors: Vec<String>,
}

impl Log {
    /// Lines of the runs in `order` (indices into `self.runs`).
    fn runs_in(&self, order: &[usize]) -> Vec<String> {
        order
            .iter()
            .flat_map(|&r| self.lines[self.runs[r].clone()].to_vec())
            .collect()
    }

    /// 1-based line number, in `runs_in(order)`, of the first line of the
    /// `k`-th run listed.
    fn first_line_of(&self, order: &[usize], k: usize) -> usize {
        order[..k]
            .iter()
            .map(|&r| self.runs[r].len())
            .sum::<usize>()
            + 1
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Sink {
    File,
    /// stdout, each run continuing from the head its predecessor anchored.
    StdoutLinked,
    /// stdout with no anchor: every run starts a new chain.
    StdoutUnlinked,
}

/// Writes `records.len()` runs as `replica`; run `i` writes `records[i]`
/// records and, when `clean[i]`, a shutdown checkpoint.
fn write_runs(
    dir: &Path,
    sink: Sink,
    replica: &str,
    keys: &[&str],
    records: &[usize],
    every: u64,
) -> Log {
    let path = dir.join(format!("{replica}.log"));
    let _ = std::fs::remove_file(&path);
    let mut log = Log {
        lines: vec![],
        runs: vec![],
        anchors: vec![],
    };
    let mut head = None;
    let mut n = 0;
    for (run, &count) in records.iter().enumerate() {
        let key = CheckpointKey::from_pem(keys[run.min(keys.len() - 1)].as_bytes()).unwrap();
        let info = RunInfo::new(replica);
        let s = match sink {
            Sink::File => ChainedSink::open(SinkOptions {
                key: Some(key),
                checkpoint_every: every,
                run: info,
                ..SinkOptions::new(Destination::file(&path, 1 << 30, 3))
            })
            .unwrap(),
            Sink::StdoutLinked | Sink::StdoutUnlinked => ChainedSink::open(SinkOptions {
                key: Some(key),
                checkpoint_every: every,
                run: info,
                head: if sink == Sink::StdoutLinked {
                    head.clone()
                } else {
                    None
                },
                ..SinkOptions::new(Destination::Buffer)
            })
            .unwrap(),
        };
        for _ in 0..count {
            s.emit(&record(n)).unwrap();
            n += 1;
        }
        s.checkpoint("shutdown").unwrap();
        head = s.head();
        log.anchors.push(s.last_checkpoint().unwrap());
        let new: Vec<String> = match sink {
            Sink::File => std::fs::read_to_string(&path)
                .unwrap()
                .lines()
                .skip(log.lines.len())
                .map(str::to_string)
                .collect(),
            _ => s.buffer_contents().lines().map(str::to_string).collect(),
        };
        let start = log.lines.len();
        log.lines.extend(new);
        log.runs.push(start..log.lines.len());
    }
    log
}

fn numbered(lines: &[String]) -> Vec<(String, String)> {
    lines
        .iter()
        .enumerate()
        .map(|(i, l)| (format!("log:{}", i + 1), l.clone()))
        .collect()
}

fn keys(pems: &[&str]) -> Vec<VerifyKey> {
    pems.iter()
        .map(|p| VerifyKey::from_pem(p.as_bytes()).unwrap())
        .collect()
}

fn verify(lines: &[String], k: &[VerifyKey]) -> Result<VerifyReport, VerifyFailure> {
    verify::verify_lines_with(
        &numbered(lines),
        &VerifyOptions {
            keys: k,
            ..Default::default()
        },
    )
}

fn anchored(
    lines: &[String],
    k: &[VerifyKey],
    anchor: &str,
) -> Result<anchors::AnchorReport, VerifyFailure> {
    let report = verify(lines, k)?;
    anchors::check_anchors(
        &numbered(lines),
        &report,
        &[anchors::Anchor {
            source: "ns/meshca-audit-anchor-a".into(),
            line: anchor.to_string(),
            created: None,
            misplaced: None,
        }],
        &anchors::AnchorOptions {
            keys: k,
            ..Default::default()
        },
    )
}

fn fails_at(r: Result<impl std::fmt::Debug, VerifyFailure>, line: usize, why: &str) {
    let f = r.expect_err("tampering must fail verification");
    assert_eq!(f.location, format!("log:{line}"), "{f}");
    assert!(f.why.contains(why), "{f}");
}

struct Fixture {
    _dir: tempfile::TempDir,
    key: String,
    k: Vec<VerifyKey>,
    log: Log,
}

fn fixture(sink: Sink) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let key = CheckpointKey::generate_pem().unwrap();
    let log = write_runs(dir.path(), sink, "meshca-0", &[&key], &[5, 7, 6], 3);
    let k = keys(&[&key]);
    Fixture {
        _dir: dir,
        key,
        k,
        log,
    }
}

#[test]
fn linked_runs_verify_as_one_history_on_both_sinks() {
    for sink in [Sink::File, Sink::StdoutLinked] {
        let f = fixture(sink);
        let rep = verify(&f.log.lines, &f.k).unwrap();
        assert_eq!(rep.records, 18);
        assert_eq!(rep.chain_starts, 1, "one chain across three runs");
        assert_eq!(rep.runs.len(), 3);
        assert!(rep.runs.iter().all(|r| r.replica == "meshca-0"));
        assert_eq!(
            rep.runs.iter().map(|r| r.records).collect::<Vec<_>>(),
            [5, 7, 6],
            "each run's checkpoints account for its records"
        );
        assert_eq!(rep.last_checkpoint_reason.as_deref(), Some("shutdown"));
        assert_eq!(rep.signed_checkpoints, rep.checkpoints);
        // Every run's start names the head it continues from.
        for r in 1..3 {
            let first: serde_json::Value =
                serde_json::from_str(&f.log.lines[f.log.runs[r].start]).unwrap();
            assert_eq!(first["reason"], "start");
            assert_eq!(
                first["previous"]["seq"].as_u64().unwrap() + 1,
                first["seq"].as_u64().unwrap()
            );
        }
        anchored(&f.log.lines, &f.k, &f.log.anchors[2]).unwrap();
    }
}

#[test]
fn a_removed_first_run_fails_where_the_log_now_begins() {
    for sink in [Sink::File, Sink::StdoutLinked] {
        let f = fixture(sink);
        let lines = f.log.runs_in(&[1, 2]);
        fails_at(verify(&lines, &f.k), 1, "earlier runs are missing");
        // Said explicitly, the operator may verify a suffix.
        let rep = verify::verify_lines_with(
            &numbered(&lines),
            &VerifyOptions {
                keys: &f.k,
                partial: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(rep.partial_start.unwrap().0, "log:1");
    }
}

#[test]
fn a_removed_middle_run_fails_at_the_next_runs_start() {
    for sink in [Sink::File, Sink::StdoutLinked] {
        let f = fixture(sink);
        let order = [0, 2];
        fails_at(
            verify(&f.log.runs_in(&order), &f.k),
            f.log.first_line_of(&order, 1),
            "runs were removed, replaced or reordered",
        );
    }
}

#[test]
fn a_removed_last_run_is_found_by_the_anchor() {
    for sink in [Sink::File, Sink::StdoutLinked] {
        let f = fixture(sink);
        let lines = f.log.runs_in(&[0, 1]);
        // The log alone ends cleanly (run 2's shutdown): only the head
        // anchored outside the pod shows what is missing.
        let rep = verify(&lines, &f.k).unwrap();
        assert_eq!(rep.last_checkpoint_reason.as_deref(), Some("shutdown"));
        let e = anchored(&lines, &f.k, &f.log.anchors[2]).unwrap_err();
        assert_eq!(e.location, "anchor ns/meshca-audit-anchor-a");
        assert!(e.why.contains("the log was cut after it"), "{e}");
    }
}

#[test]
fn a_run_replaced_by_another_replicas_run_signed_with_the_same_key_fails() {
    let f = fixture(Sink::File);
    // Replica meshca-1 shares the key Secret; its second run is a valid,
    // signed run of similar size.
    let dir = tempfile::tempdir().unwrap();
    let other = write_runs(dir.path(), Sink::File, "meshca-1", &[&f.key], &[5, 7], 3);
    let mut lines = f.log.runs_in(&[0]);
    let at = lines.len() + 1;
    lines.extend(other.runs_in(&[1]));
    lines.extend(f.log.runs_in(&[2]));
    fails_at(
        verify(&lines, &f.k),
        at,
        "another replica's run was spliced in",
    );
    // The same replica's run from another log (a copy made earlier, say):
    // it does not continue from this log's head.
    let again = write_runs(dir.path(), Sink::File, "meshca-0", &[&f.key], &[5, 7], 3);
    let mut lines = f.log.runs_in(&[0]);
    lines.extend(again.runs_in(&[1]));
    fails_at(
        verify(&lines, &f.k),
        at,
        "runs were removed, replaced or reordered",
    );
}

#[test]
fn a_replayed_run_fails_at_its_second_start() {
    for sink in [Sink::File, Sink::StdoutLinked] {
        let f = fixture(sink);
        let order = [0, 1, 2, 1];
        fails_at(
            verify(&f.log.runs_in(&order), &f.k),
            f.log.first_line_of(&order, 3),
            "appears a second time",
        );
    }
}

#[test]
fn runs_in_the_wrong_order_fail_at_the_first_misplaced_run() {
    for sink in [Sink::File, Sink::StdoutLinked] {
        let f = fixture(sink);
        let order = [0, 2, 1];
        fails_at(
            verify(&f.log.runs_in(&order), &f.k),
            f.log.first_line_of(&order, 1),
            "runs were removed, replaced or reordered",
        );
    }
}

/// Index of the first periodic checkpoint in the last run.
fn periodic_in_last_run(log: &Log) -> usize {
    log.runs[2]
        .clone()
        .find(|&i| log.lines[i].contains("\"reason\":\"periodic\""))
        .unwrap()
}

#[test]
fn a_cut_right_after_a_checkpoint_is_found_on_both_sinks() {
    for sink in [Sink::File, Sink::StdoutLinked] {
        let f = fixture(sink);
        let cut = periodic_in_last_run(&f.log) + 1;
        let lines = f.log.lines[..cut].to_vec();
        // The chain is intact up to the cut; what gives it away is that the
        // log does not end with a shutdown (--strict) ...
        let rep = verify(&lines, &f.k).unwrap();
        assert_eq!(rep.unsigned_tail, 0);
        assert_eq!(rep.last_checkpoint_reason.as_deref(), Some("periodic"));
        // ... and, wherever it ends, the anchor of a later checkpoint.
        let e = anchored(&lines, &f.k, &f.log.anchors[2]).unwrap_err();
        assert!(e.why.contains("the log was cut after it"), "{e}");
    }
}

#[test]
fn a_cut_tail_on_stdout_is_found() {
    let f = fixture(Sink::StdoutLinked);
    let cut = periodic_in_last_run(&f.log) + 2;
    let lines = f.log.lines[..cut].to_vec();
    let rep = verify(&lines, &f.k).unwrap();
    assert_eq!(rep.unsigned_tail, 1, "a record no checkpoint covers yet");
    let e = anchored(&lines, &f.k, &f.log.anchors[2]).unwrap_err();
    assert!(e.why.contains("the log was cut after it"), "{e}");
}

#[test]
fn a_checkpoint_naming_another_key_than_its_signer_fails_there() {
    let f = fixture(Sink::File);
    let other = CheckpointKey::generate_pem().unwrap();
    let both = keys(&[&f.key, &other]);
    let i = periodic_in_last_run(&f.log);
    let own = f.k[0].key_id();
    let mut lines = f.log.lines.clone();
    lines[i] = lines[i].replace(&own, &both[1].key_id());
    fails_at(verify(&lines, &both), i + 1, "does not verify with key");
    // Naming a key that is not given at all.
    let mut lines = f.log.lines.clone();
    lines[i] = lines[i].replace(&own, "0123456789abcdef");
    fails_at(verify(&lines, &both), i + 1, "not among the given keys");
}

#[test]
fn a_rotated_checkpoint_key_keeps_old_runs_verifiable() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = (
        CheckpointKey::generate_pem().unwrap(),
        CheckpointKey::generate_pem().unwrap(),
    );
    let log = write_runs(
        dir.path(),
        Sink::File,
        "meshca-0",
        &[&old, &new],
        &[4, 4],
        3,
    );
    let rep = verify(&log.lines, &keys(&[&new, &old])).unwrap();
    assert_eq!(rep.signed_checkpoints, rep.checkpoints);
    // Without the old key, the old run's first checkpoint is where it fails.
    fails_at(
        verify(&log.lines, &keys(&[&new])),
        1,
        "not among the given keys",
    );
}

#[test]
fn an_edited_anchor_fails() {
    let f = fixture(Sink::File);
    let anchor = f.log.anchors[2].replace("\"reason\":\"shutdown\"", "\"reason\":\"periodic\"");
    let e = anchored(&f.log.lines, &f.k, &anchor).unwrap_err();
    assert_eq!(e.location, "anchor ns/meshca-audit-anchor-a");
    assert!(e.why.contains("signature does not verify"), "{e}");
    let e = anchored(&f.log.lines, &f.k, "{\"not\":\"a checkpoint\"}").unwrap_err();
    assert!(e.why.contains("not a checkpoint"), "{e}");
}

#[test]
fn a_log_that_disagrees_with_its_anchor_fails_at_that_line() {
    // Two logs of the same replica and key with the same shape: the anchor
    // of one names a seq the other has, with another line there.
    let f = fixture(Sink::File);
    let dir = tempfile::tempdir().unwrap();
    let twin = write_runs(dir.path(), Sink::File, "meshca-0", &[&f.key], &[5, 7, 6], 3);
    let last = f.log.lines.len();
    fails_at(
        anchored(&f.log.lines, &f.k, &twin.anchors[2]),
        last,
        "disagree",
    );
}

#[test]
fn a_new_chain_mid_log_fails_unless_the_operator_allows_it() {
    let f = fixture(Sink::StdoutUnlinked);
    fails_at(
        verify(&f.log.lines, &f.k),
        f.log.runs[1].start + 1,
        "a new chain (seq 0) starts in the middle of the log",
    );
    let rep = verify::verify_lines_with(
        &numbered(&f.log.lines),
        &VerifyOptions {
            keys: &f.k,
            allow_new_chain: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(rep.new_chains.len(), 2);
}

fn meshca(args: &[&str]) -> (i32, String) {
    meshca::testing::run_cli(env!("CARGO_BIN_EXE_meshca").as_ref(), args)
}

#[test]
fn cli_strict_and_anchor_catch_a_cut_after_a_checkpoint() {
    let f = fixture(Sink::File);
    let dir = tempfile::tempdir().unwrap();
    let (log, key, anchor) = (
        dir.path().join("audit.log"),
        dir.path().join("key.pem"),
        dir.path().join("anchor.json"),
    );
    std::fs::write(&key, &f.key).unwrap();
    std::fs::write(&anchor, format!("{}\n", f.log.anchors[2])).unwrap();
    let whole = f.log.lines.join("\n") + "\n";
    std::fs::write(&log, &whole).unwrap();
    let (k, l, a) = (
        key.to_str().unwrap(),
        log.to_str().unwrap(),
        anchor.to_str().unwrap(),
    );
    let (code, out) = meshca(&["audit", "verify", "--key", k, "--strict", "--anchor", a, l]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("run ") && out.contains("matches"), "{out}");

    let cut = periodic_in_last_run(&f.log) + 1;
    std::fs::write(&log, f.log.lines[..cut].join("\n") + "\n").unwrap();
    let (code, out) = meshca(&["audit", "verify", "--key", k, l]);
    assert_eq!(
        code, 0,
        "without --strict the intact prefix verifies: {out}"
    );
    let (code, out) = meshca(&["audit", "verify", "--key", k, "--strict", l]);
    assert_ne!(code, 0);
    assert!(
        out.contains("does not end with a shutdown checkpoint"),
        "{out}"
    );
    let (code, out) = meshca(&["audit", "verify", "--key", k, "--anchor", a, l]);
    assert_ne!(code, 0);
    assert!(
        out.contains("FAIL at anchor") && out.contains("cut"),
        "{out}"
    );
}

#[test]
fn a_stdout_run_after_a_crash_continues_from_the_anchor_and_names_the_orphaned_tail() {
    let key = CheckpointKey::generate_pem().unwrap();
    let k = keys(&[&key]);
    let sink = |head| {
        ChainedSink::open(SinkOptions {
            key: Some(CheckpointKey::from_pem(key.as_bytes()).unwrap()),
            checkpoint_every: 3,
            run: RunInfo::new("meshca-0"),
            head,
            ..SinkOptions::new(Destination::Buffer)
        })
        .unwrap()
    };
    // Run 1 crashes two records after its last (anchored) checkpoint.
    let run1 = sink(None);
    for i in 0..5 {
        run1.emit(&record(i)).unwrap();
    }
    let anchor = run1.last_checkpoint().unwrap();
    let anchored_seq: u64 = serde_json::from_str::<serde_json::Value>(&anchor).unwrap()["seq"]
        .as_u64()
        .unwrap();
    let run2 = sink(Some((
        anchored_seq,
        meshca::audit::format::line_hash(&anchor),
    )));
    run2.emit(&record(9)).unwrap();
    run2.checkpoint("shutdown").unwrap();
    let lines: Vec<String> = run1
        .buffer_contents()
        .lines()
        .chain(run2.buffer_contents().lines())
        .map(str::to_string)
        .collect();
    let rep = verify(&lines, &k).unwrap();
    let start = run1.buffer_contents().lines().count() + 1;
    assert_eq!(rep.orphaned, vec![(format!("log:{start}"), 2)]);
    assert_eq!(rep.chain_starts, 1);
    // Only a head that came from the anchor may fork: a file run may not.
    let forged: Vec<String> = lines
        .iter()
        .map(|l| l.replace("\"from\":\"anchor\"", "\"from\":\"file\""))
        .collect();
    assert!(
        verify(&forged, &k).is_err(),
        "the edit breaks the signature"
    );
    fails_at(
        verify(&forged, &[]),
        start,
        "runs were removed, replaced or reordered",
    );
}
